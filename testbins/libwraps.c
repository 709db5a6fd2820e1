// build: {cc} -g {opt} -fPIC -shared {extra} -Wall -Werror {src} -o {out} -Wl,-soname,libwraps.so
// output: libwraps.so
/*
 * libwraps: a shared library exporting an allocation wrapper and a free
 * wrapper, as GLib exports g_malloc and g_free. Marker counts are for one
 * run of wrappers (the program that needs this library):
 *   lw_alloc(12) x5   -> malloc, 5 calls, 60 bytes
 *   lw_dup(g, 12) x5  -> lw_alloc (through the PLT), malloc, 5 calls, 60 bytes
 *   lw_node() x5      -> lw_alloc(24) (through the PLT), malloc, 5 calls,
 *                        120 bytes: a constant size, so calls to lw_node
 *                        are hooks, the program's too
 *   lw_free(p) x15    -> free, 15 calls
 * Charging callers (the default), the program's calls count these; `alone=` gives
 * what the library's sites count when only the library is patched (the
 * program's calls are then plain calls): lw_dup's call of lw_alloc counts
 * the copies, and raises the depth that lw_alloc's own site checks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__attribute__((noreturn, noinline)) static void lw_die(const char *what)
{
    fprintf(stderr, "libwraps: out of memory in %s\n", what);
    abort();
}

/* @wrapper lw_alloc alloc */
void *lw_alloc(size_t n)
{
    void *p = malloc(n); /* @site malloc calls=15 bytes=240 inside alone=5,60 */
    if (p == NULL)
        lw_die("lw_alloc");
    return p;
}

/* @wrapper lw_free free */
void lw_free(void *p)
{
    free(p); /* @site free tail calls=15 bytes=0 inside alone=15,0 */
}

/* @wrapper lw_dup alloc */
void *lw_dup(const void *p, size_t n)
{
    void *q = lw_alloc(n); /* @charged lw_alloc inside alone=5,60 */
    memcpy(q, p, n);
    return q;
}

/* @wrapper lw_node alloc */
void *lw_node(void)
{
    void *p = lw_alloc(24); /* @charged lw_alloc under=0,0 alone=5,120 */
    memset(p, 0, 24);
    return p;
}
