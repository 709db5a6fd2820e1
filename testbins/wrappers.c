// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out} -L{dir} -l:libwraps.so -Wl,-rpath,{dir}
// needs: libwraps
/*
 * wrappers: allocation wrappers of every shape alloctramp finds without
 * being told. Each wrapper carries a marker `@wrapper NAME KIND` (alloc,
 * free or realloc); `@notwrapper NAME` marks a function that allocates but
 * is not one.
 *   xmalloc, xcalloc, xrealloc, xstrdup: call, test for NULL, die()
 *     (a function of the program that never returns), return the result;
 *   xfree: frees its argument;
 *   zmalloc_usable: a size header in front (malloc(n + 16), returns p + 16,
 *     or NULL); zmalloc: a wrapper of it that dies on NULL (two levels);
 *     zfree: frees p - 16;
 *   xmalloc0: a size of 0 becomes 1, then xmalloc (a wrapper of a wrapper);
 *   tmalloc: returns malloc's result directly (a tail call at -O2);
 *   lw_alloc, lw_free: exported by libwraps.so;
 *   grow: reallocates a buffer it is given and returns nothing: not a
 *     wrapper.
 * main runs 5 iterations (i = 0..4):
 *   a = xmalloc(16 + i)         malloc in xmalloc        5 calls, 90 bytes
 *   f = alloc_fn(40)            malloc in xmalloc        5 calls, 200 bytes
 *                               (xmalloc through a function pointer)
 *   kept[i] = xmalloc(8 + i)    malloc in xmalloc        5 calls, 50 bytes,
 *                               still allocated at exit
 *   b = xcalloc(i + 1, 4)       calloc in xcalloc        5 calls, 60 bytes
 *   a = xrealloc(a, 32 + i)     realloc in xrealloc      5 calls, 170 bytes
 *   s = xstrdup("wrappers")     strdup in xstrdup        5 calls, 45 bytes
 *   z = zmalloc(24)             malloc in zmalloc_usable 5 calls, 200 bytes
 *   y = zmalloc(8)              malloc in zmalloc_usable 5 calls, 120 bytes
 *   e = xmalloc0(i)             malloc in xmalloc        5 calls, 1+1+2+3+4 = 11 bytes
 *   t = tmalloc(8)              malloc in tmalloc        5 calls, 40 bytes
 *   g = lw_alloc(12)            (in libwraps.so)
 *   d = lw_dup(g, 12)           (in libwraps.so)
 *   grow(&buf, 64 * (i + 1))    realloc in grow          5 calls, 960 bytes
 *   xfree(a, b, s, e, t, f)     free in xfree            30 calls
 *   zfree(z), free_fn(y)        free in zfree            10 calls
 *                               (zfree through a function pointer: its
 *                               inner free finds y by the allocator's
 *                               pointer, where live tracking keys it)
 *   o = lw_node()               (in libwraps.so: a hook)
 *   lw_free(g), lw_free(d), lw_free(o)  (in libwraps.so)
 * then free(buf.p) once.
 *
 * `@site` markers count calls where they are made (`--no-charge-callers`).
 * Charging callers (the default), the calls to wrappers count what the wrappers
 * allocate (`@charged` markers on the calls, `tail` where the call is a
 * jump at -O2), and a site inside a wrapper (word `inside`) counts only the
 * calls that reach its wrapper other than through such a call: here the
 * function-pointer calls of xmalloc, whose address is taken (its inner
 * site checks the thread's wrapper depth; `charged=` gives those counts).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

void *lw_alloc(size_t n);
void *lw_dup(const void *p, size_t n);
void *lw_node(void);
void lw_free(void *p);

static volatile int iterations = 5;

void *xmalloc(size_t n);
/* xmalloc's and zfree's addresses are taken: they can be reached without
 * a call site. */
static void *(*volatile alloc_fn)(size_t) = xmalloc;
void zfree(void *p);
static void (*volatile free_fn)(void *) = zfree;

#define WRAPPER __attribute__((noinline, noclone, noipa))

__attribute__((noreturn, noinline, noclone, noipa)) static void die(const char *what)
{
    fprintf(stderr, "wrappers: out of memory in %s\n", what);
    exit(2);
}

__attribute__((noinline, noclone, noipa)) static const char *opaque(const char *s)
{
    return s;
}

/* @wrapper xmalloc alloc */
WRAPPER void *xmalloc(size_t n)
{
    void *p = malloc(n); /* @site malloc calls=20 bytes=351 live=5 live_bytes=50 inside charged=5,200 */
    if (p == NULL)
        die("xmalloc");
    return p;
}

/* @wrapper xcalloc alloc */
WRAPPER void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n, size); /* @site calloc calls=5 bytes=60 inside */
    if (p == NULL)
        die("xcalloc");
    return p;
}

/* @wrapper xrealloc realloc */
WRAPPER void *xrealloc(void *old, size_t n)
{
    void *p = realloc(old, n); /* @site realloc calls=5 bytes=170 inside */
    if (p == NULL)
        die("xrealloc");
    return p;
}

/* @wrapper xstrdup alloc */
WRAPPER char *xstrdup(const char *s)
{
    char *p = strdup(s); /* @site strdup calls=5 bytes=45 inside */
    if (p == NULL)
        die("xstrdup");
    return p;
}

/* @wrapper xfree free */
WRAPPER void xfree(void *p)
{
    free(p); /* @site free tail calls=30 bytes=0 inside */
}

/* @wrapper zmalloc_usable alloc */
WRAPPER void *zmalloc_usable(size_t n)
{
    size_t *p = malloc(n + 16); /* @site malloc calls=10 bytes=320 inside */
    if (p == NULL)
        return NULL;
    p[0] = n;
    return (char *)p + 16;
}

/* @wrapper zmalloc alloc */
WRAPPER void *zmalloc(size_t n)
{
    void *p = zmalloc_usable(n); /* @charged zmalloc_usable inside */
    if (p == NULL)
        die("zmalloc");
    return p;
}

/* @wrapper zfree free */
WRAPPER void zfree(void *p)
{
    if (p != NULL)
        free((char *)p - 16); /* @site free tail calls=10 bytes=0 inside charged=5,0 */
}

/* @wrapper xmalloc0 alloc */
WRAPPER void *xmalloc0(size_t n)
{
    if (n == 0)
        n = 1;
    return xmalloc(n); /* @charged xmalloc tail inside */
}

/* @wrapper tmalloc alloc */
WRAPPER void *tmalloc(size_t n)
{
    return malloc(n); /* @site malloc tail calls=5 bytes=40 inside */
}

struct buf {
    char *p;
    size_t cap;
};

/* @notwrapper grow */
WRAPPER void grow(struct buf *b, size_t n)
{
    char *p = realloc(b->p, n); /* @site realloc calls=5 bytes=960 */
    if (p == NULL)
        die("grow");
    b->p = p;
    b->cap = n;
}

int main(void)
{
    int n = iterations;
    struct buf buf = {NULL, 0};
    char *kept[5];

    for (int i = 0; i < n; i++) {
        char *a = xmalloc(16 + (size_t)i); /* @charged xmalloc calls=5 bytes=90 */
        fill(a, 16 + (size_t)i, (unsigned)i);
        char *f = alloc_fn(40);
        fill(f, 40, 1);
        kept[i % 5] = xmalloc(8 + (size_t)i); /* @charged xmalloc calls=5 bytes=50 live=5 live_bytes=50 */
        fill(kept[i % 5], 8 + (size_t)i, 2);
        char *b = xcalloc((size_t)i + 1, 4); /* @charged xcalloc calls=5 bytes=60 */
        sum(b, ((size_t)i + 1) * 4);
        a = xrealloc(a, 32 + (size_t)i); /* @charged xrealloc calls=5 bytes=170 */
        fill(a, 32 + (size_t)i, (unsigned)i + 1u);
        char *s = xstrdup(opaque("wrappers")); /* @charged xstrdup calls=5 bytes=45 */
        sum(s, 9);
        char *z = zmalloc(24); /* @charged zmalloc calls=5 bytes=120 */
        char *y = zmalloc(8); /* @charged zmalloc calls=5 bytes=40 */
        fill(y, 8, 4);
        fill(z, 24, 7);
        char *e = xmalloc0((size_t)i); /* @charged xmalloc0 calls=5 bytes=10 */
        fill(e, i == 0 ? 1 : (size_t)i, 3);
        char *t = tmalloc(8); /* @charged tmalloc calls=5 bytes=40 */
        fill(t, 8, 5);
        char *g = lw_alloc(12); /* @charged lw_alloc calls=5 bytes=60 */
        fill(g, 12, 9);
        char *d = lw_dup(g, 12); /* @charged lw_dup calls=5 bytes=60 */
        sum(d, 12);
        char *o = lw_node(); /* @hook lw_node calls=5 bytes=120 */
        sum(o, 24);
        grow(&buf, 64 * ((size_t)i + 1));
        fill(buf.p, buf.cap, (unsigned)i);
        sum(a, 32 + (size_t)i);
        xfree(a); /* @charged xfree calls=5 bytes=0 */
        xfree(b); /* @charged xfree calls=5 bytes=0 */
        xfree(s); /* @charged xfree calls=5 bytes=0 */
        xfree(e); /* @charged xfree calls=5 bytes=0 */
        xfree(t); /* @charged xfree calls=5 bytes=0 */
        xfree(f); /* @charged xfree calls=5 bytes=0 */
        zfree(z); /* @charged zfree calls=5 bytes=0 */
        free_fn(y);
        lw_free(g); /* @charged lw_free calls=5 bytes=0 */
        lw_free(d); /* @charged lw_free calls=5 bytes=0 */
        lw_free(o); /* @charged lw_free calls=5 bytes=0 */
    }
    for (int i = 0; i < n; i++)
        sum(kept[i % 5], 8 + (size_t)i);
    sum(buf.p, buf.cap);
    free(buf.p); /* @site free calls=1 bytes=0 */

    printf("wrappers: iterations=%d checksum=%lu\n", n, checksum);
    return 0;
}
