// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
/*
 * wrapper: program-defined allocation wrappers. xmalloc, xfree, xcalloc,
 * xrealloc and xstrdup are thin wrappers whose allocator call is the last
 * thing they do (a tail jump at -O2); xmalloc_checked tests the result and
 * so always calls. All wrappers are noinline/noclone/noipa, so each has
 * exactly one call site of its allocator.
 *
 * xmalloc and xfree are also used as user-named entry points
 * (--entry xmalloc:alloc, --entry xfree:free): the calls OF them carry
 * usersite markers.
 *
 * main runs 7 iterations (i = 0..6):
 *   a = xmalloc(32 + i)                 sum 7*32 + 21 = 245 bytes
 *   b = xcalloc(i + 1, 8)               sum 8 * 28     = 224 bytes
 *   a = xrealloc(a, 64 + 2*i)           sum 7*64 + 42  = 490 bytes
 *   s = xstrdup("wrapper")              7 * 8          = 56 bytes
 *   d = xmalloc_checked(10)             7 * 10         = 70 bytes
 *   xfree(a); xfree(b); xfree(s); xfree(d)
 *   e = xmalloc(5)                      7 * 5          = 35 bytes
 *   xfree(e)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static volatile int iterations = 7;

__attribute__((noinline, noclone, noipa)) static const char *opaque(const char *s)
{
    return s;
}

__attribute__((noinline, noclone, noipa)) void *xmalloc(size_t n) /* @wrapper xmalloc alloc */
{
    return malloc(n); /* @site malloc tail calls=14 bytes=280 */
}

__attribute__((noinline, noclone, noipa)) void xfree(void *p) /* @wrapper xfree free */
{
    free(p); /* @site free tail calls=35 bytes=0 */
}

__attribute__((noinline, noclone, noipa)) void *xcalloc(size_t n, size_t size) /* @wrapper xcalloc alloc */
{
    return calloc(n, size); /* @site calloc tail calls=7 bytes=224 */
}

__attribute__((noinline, noclone, noipa)) void *xrealloc(void *p, size_t n) /* @wrapper xrealloc realloc */
{
    return realloc(p, n); /* @site realloc tail calls=7 bytes=490 */
}

__attribute__((noinline, noclone, noipa)) char *xstrdup(const char *s) /* @wrapper xstrdup alloc */
{
    return strdup(s); /* @site strdup tail calls=7 bytes=56 */
}

__attribute__((noinline, noclone, noipa)) void *xmalloc_checked(size_t n) /* @wrapper xmalloc_checked alloc */
{
    void *p = malloc(n); /* @site malloc calls=7 bytes=70 */
    if (p == NULL) {
        fputs("out of memory\n", stderr);
        exit(2);
    }
    return p;
}

int main(void)
{
    int n = iterations;

    for (int i = 0; i < n; i++) {
        char *a = xmalloc(32 + (size_t)i); /* @usersite xmalloc calls=7 bytes=245 */
        char *b = xcalloc((size_t)i + 1, 8);
        if (a == NULL || b == NULL)
            return 1;
        fill(a, 32 + (size_t)i, (unsigned)i);
        sum(b, ((size_t)i + 1) * 8);
        a = xrealloc(a, 64 + 2 * (size_t)i);
        if (a == NULL)
            return 1;
        fill(a, 64 + 2 * (size_t)i, (unsigned)i + 3u);
        sum(a, 64 + 2 * (size_t)i);
        char *s = xstrdup(opaque("wrapper"));
        if (s == NULL)
            return 1;
        sum(s, 8);
        char *d = xmalloc_checked(10);
        fill(d, 10, 9);
        sum(d, 10);
        xfree(a); /* @usersite xfree calls=7 bytes=0 */
        xfree(b); /* @usersite xfree calls=7 bytes=0 */
        xfree(s); /* @usersite xfree calls=7 bytes=0 */
        xfree(d); /* @usersite xfree calls=7 bytes=0 */
        char *e = xmalloc(5); /* @usersite xmalloc calls=7 bytes=35 */
        if (e == NULL)
            return 1;
        fill(e, 5, 11);
        sum(e, 5);
        xfree(e); /* @usersite xfree calls=7 bytes=0 */
    }

    printf("wrapper: iterations=%d checksum=%lu\n", n, checksum);
    return 0;
}
