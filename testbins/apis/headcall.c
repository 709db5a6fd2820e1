// build: {cc} -O2 -g -fcf-protection=none {pie} {src} -o {out}
/* An allocator the user names (--entry xalloc:alloc --entry xfree:free)
   whose first instructions call malloc and free, called directly and
   through a table of operations. Moving those instructions to an entry
   hook's stub would move sites (the runtime rewrites sites), so neither
   function is hooked: the calls through the table count at the calls of
   malloc and free inside, which check the wrapper depth, and the calls at
   sites count there only. Half of the direct allocations are freed
   through the table, every allocation through the table directly. */
#include <stdio.h>
#include <stdlib.h>

#define N 1000

struct ops {
    void *(*alloc)(size_t);
    void (*free)(void *);
};

__attribute__((noinline, noipa)) void *xalloc(size_t n)
{
    void *p = malloc(n); /* @site malloc calls=1000 bytes=48000 live=0,0 */
    if (p == NULL)
        abort();
    return p;
}

__attribute__((noinline, noipa)) void xfree(void *p)
{
    free(p); /* @site free calls=500 */
}

static const struct ops x_ops = {xalloc, xfree};
static const struct ops *volatile ops = &x_ops;

int main(void)
{
    static void *keep[N];
    unsigned long sum = 0, kept = 0;
    for (int i = 0; i < N; i++) {
        unsigned char *a = xalloc(32); /* @site xalloc calls=1000 bytes=32000 live=500,16000 */
        unsigned char *b = ops->alloc(48);
        a[0] = (unsigned char)i;
        b[0] = (unsigned char)(i >> 1);
        sum += a[0] + b[0];
        xfree(b); /* @site xfree calls=1000 */
        if (i % 2 == 0)
            ops->free(a);
        else
            keep[kept++] = a;
    }
    for (unsigned long k = 0; k < kept; k++)
        sum += ((unsigned char *)keep[k])[0];
    printf("sum %lu kept %lu\n", sum, kept);
    return 0;
}
