// build: {cc} -g {opt} -fPIC -shared {extra} -Wall -Werror {src} -o {out} -Wl,-soname,libwraps.so
// output: libwraps.so
/*
 * libwraps: a shared library exporting an allocation wrapper and a free
 * wrapper, as GLib exports g_malloc and g_free. Marker counts are for one
 * run of wrappers (the program that needs this library):
 *   lw_alloc(12) x5   -> malloc, 5 calls, 60 bytes
 *   lw_free(p) x5     -> free, 5 calls
 */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noreturn, noinline)) static void lw_die(const char *what)
{
    fprintf(stderr, "libwraps: out of memory in %s\n", what);
    abort();
}

/* @wrapper lw_alloc alloc */
void *lw_alloc(size_t n)
{
    void *p = malloc(n); /* @site malloc calls=5 bytes=60 */
    if (p == NULL)
        lw_die("lw_alloc");
    return p;
}

/* @wrapper lw_free free */
void lw_free(void *p)
{
    free(p); /* @site free tail calls=5 bytes=0 */
}
