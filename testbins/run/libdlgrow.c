// build: {cc} -g -O2 -fPIC -shared -Wall -Werror {src} -o {out} -Wl,-soname,libdlgrow.so
// output: libdlgrow.so
/*
 * libdlgrow: a library grower.c loads with dlopen by name (found through
 * the program's RUNPATH). dlgrow_keep(n) keeps n more blocks, of 32, 33,
 * ... bytes, still live when the program exits; dlgrow_drop_one() frees
 * the last one. Marker counts are for one run of grower: dlgrow_keep(3),
 * then dlgrow_drop_one().
 */
#include <stdlib.h>

static void *kept[64];
static int nkept;

__attribute__((noinline)) int dlgrow_keep(int n)
{
    for (int i = 0; i < n && nkept < 64; i++) {
        char *p = malloc(32 + (size_t)i); /* @site malloc calls=3 bytes=99 live=2,65 */
        if (p == NULL)
            return -1;
        p[0] = (char)i;
        kept[nkept++] = p;
    }
    return nkept;
}

__attribute__((noinline)) void dlgrow_drop_one(void)
{
    if (nkept > 0)
        free(kept[--nkept]); /* @site free calls=1 bytes=0 */
}
