// build: {cc} -g -O2 -fPIC -shared -Wall -Werror {src} -o {out} -Wl,-soname,libgrow.so
// output: libgrow.so
/*
 * libgrow: a library grower.c links, and calls through its PLT.
 * grow_keep(n) keeps n more blocks, of 16, 17, ... bytes; grow_drop()
 * frees every block kept. Neither is a wrapper (nothing allocated is
 * returned), so the library's own lines count. Marker counts are for one
 * run of grower: grow_keep(4), then grow_drop().
 */
#include <stdlib.h>

static void *kept[64];
static int nkept;

__attribute__((noinline)) int grow_keep(int n)
{
    for (int i = 0; i < n && nkept < 64; i++) {
        char *p = malloc(16 + (size_t)i); /* @site malloc calls=4 bytes=70 live=0,0 */
        if (p == NULL)
            return -1;
        p[0] = (char)i;
        kept[nkept++] = p;
    }
    return nkept;
}

__attribute__((noinline)) void grow_drop(void)
{
    while (nkept > 0)
        free(kept[--nkept]); /* @site free calls=4 bytes=0 */
}
