// build: {cc} -g -O2 -fPIE -pie -Wall -Werror {src} -o {out} -L{dir} -l:libgrow.so -Wl,-rpath,{dir} -ldl
// needs: libgrow libdlgrow
/*
 * grower: allocates in a library it links (libgrow.so, through the PLT),
 * in a library it loads with dlopen by name (libdlgrow.so, found through
 * its RUNPATH, loaded twice: one handle), and itself; prints the same
 * line on every run. `alloctramp run` profiles all three
 * (cli/tests/run.rs).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int grow_keep(int n);
void grow_drop(void);

int main(void)
{
    char *own = malloc(100); /* @site malloc calls=1 bytes=100 live=0,0 */
    if (own == NULL)
        return 1;
    memset(own, 'g', 100);
    if (grow_keep(4) != 4)
        return 1;
    grow_drop();
    void *h = dlopen("libdlgrow.so", RTLD_NOW);
    if (h == NULL) {
        printf("grower: dlopen: %s\n", dlerror());
        return 1;
    }
    int (*keep)(int) = (int (*)(int))dlsym(h, "dlgrow_keep");
    void (*drop_one)(void) = (void (*)(void))dlsym(h, "dlgrow_drop_one");
    if (keep == NULL || drop_one == NULL || keep(3) != 3)
        return 1;
    drop_one();
    void *again = dlopen("libdlgrow.so", RTLD_NOW);
    printf("grower: %s, %c\n", again == h ? "one handle" : "two handles", own[99]);
    free(own); /* @site free calls=1 bytes=0 */
    return 0;
}
