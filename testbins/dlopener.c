// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out} -ldl
// needs: libatshared
// counts: variable
/*
 * dlopener: loads libatshared.so with dlopen from the directory given as
 * the first argument, else from its own directory,
 * calls its allocating functions, and unloads it with dlclose. Profiling
 * a patched copy shows the library's sites although it was loaded late.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    char dir[4096], path[8192];
    if (argc > 1) {
        snprintf(dir, sizeof dir, "%s", argv[1]);
    } else {
        ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
        if (n <= 0)
            return 1;
        dir[n] = 0;
        char *slash = strrchr(dir, '/');
        if (slash != NULL)
            *slash = 0;
    }
    snprintf(path, sizeof path, "%s/libatshared.so", dir);
    void *h = dlopen(path, RTLD_NOW);
    if (h == NULL) {
        printf("dlopen failed\n");
        return 1;
    }
    void *(*alloc)(size_t) = (void *(*)(size_t))dlsym(h, "atshared_alloc");
    void (*release)(void *) = (void (*)(void *))dlsym(h, "atshared_free");
    if (alloc == NULL || release == NULL)
        return 1;
    for (int i = 0; i < 3; i++) {
        char *p = alloc(40);
        memset(p, 'x', 40);
        release(p);
    }
    dlclose(h);
    printf("dlopen ok\n");
    return 0;
}
