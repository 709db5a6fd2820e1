// build: {cc} -g {opt} -fPIC -shared {extra} -Wall -Werror {src} -o {out} -Wl,-soname,libatshared.so
// output: libatshared.so
/*
 * libatshared: a shared library that allocates and frees on behalf of its
 * callers. Marker counts are for one run of uses_lib (the program that
 * needs this library):
 *   atshared_alloc(40 + i) for i = 0..4  -> malloc, 5 calls, 210 bytes
 *   atshared_free(p) of 5 blocks malloc'ed by uses_lib
 *   atshared_dup("shared-5") x5        -> strdup, 5 calls, 45 bytes
 */
#include <stdlib.h>
#include <string.h>

__attribute__((noinline, noclone, noipa)) static void fill(void *p, size_t n)
{
    unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        c[i] = (unsigned char)(i * 13u + 5u);
}

void *atshared_alloc(size_t n) /* @wrapper atshared_alloc alloc */
{
    void *p = malloc(n); /* @site malloc calls=5 bytes=210 */
    if (p != NULL)
        fill(p, n);
    return p;
}

void atshared_free(void *p) /* @wrapper atshared_free free */
{
    free(p); /* @site free tail calls=5 bytes=0 */
}

char *atshared_dup(const char *s) /* @wrapper atshared_dup alloc */
{
    return strdup(s); /* @site strdup tail calls=5 bytes=45 */
}
