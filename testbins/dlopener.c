// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out} -ldl
// needs: libatshared
// counts: variable
/*
 * dlopener: loads libatshared.so with dlopen from the directory given as
 * the first argument, else from its own directory,
 * calls its allocating functions, and unloads it with dlclose. Profiling
 * a patched copy shows the library's sites although it was loaded late.
 * With a second argument `handover` it also loads libatshared_b.so (another
 * copy of the library), allocates one block in the first copy, unloads the
 * first copy, then frees the block through the second: the free must still
 * count on the unloaded copy's site.
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
    if (argc > 2 && strcmp(argv[2], "handover") == 0) {
        snprintf(path, sizeof path, "%s/libatshared_b.so", dir);
        void *hb = dlopen(path, RTLD_NOW);
        if (hb == NULL || hb == h) {
            printf("dlopen of the second copy failed\n");
            return 1;
        }
        void (*release_b)(void *) = (void (*)(void *))dlsym(hb, "atshared_free");
        if (release_b == NULL)
            return 1;
        char *kept = alloc(24);
        memset(kept, 'y', 24);
        dlclose(h);
        release_b(kept);
        dlclose(hb);
        printf("handover ok\n");
        return 0;
    }
    dlclose(h);
    printf("dlopen ok\n");
    return 0;
}
