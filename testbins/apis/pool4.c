// build: {cc} -O2 -g {pie} {src} -o {out}
/* A pool allocator the user names (--entry pool_alloc:alloc --entry
   pool_free:free) whose objects may start 4 past an 8-aligned address, as
   a pool of packed 4-byte-aligned records does. For each of N 64-byte
   blocks (two 32-byte granules of the shadow map):
     b at +28, 4 bytes: alone in the first granule, whose entry stays
       empty; half of them are freed, half kept;
     a at +32, 16 bytes: 8-aligned, recorded in the second granule, then
       freed, which leaves its freed record there;
     c at +60, 4 bytes: in the granule of a's freed record, then freed.
   Decoded with b or c, the entry of their granule must not pass for their
   record: the live figures are exact (live=OBJECTS,BYTES at exit). */
#include <stdio.h>
#include <string.h>

#define N 1000

static unsigned char arena[N * 64] __attribute__((aligned(32)));
static size_t cursor;
static unsigned long frees;
static void *keep[N];

/* The pool hands out the object at `cursor`, which the program sets. */
__attribute__((noinline, noipa)) void *pool_alloc(size_t n)
{
    if (cursor + n > sizeof arena)
        return NULL;
    return arena + cursor;
}

__attribute__((noinline, noipa)) void pool_free(void *p)
{
    if (p != NULL)
        frees++;
}

int main(void)
{
    unsigned long sum = 0;
    for (int i = 0; i < N; i++) {
        size_t block = (size_t)i * 64;
        cursor = block + 28;
        unsigned char *b = pool_alloc(4); /* @site pool_alloc calls=1000 bytes=4000 live=500,2000 */
        cursor = block + 32;
        unsigned char *a = pool_alloc(16); /* @site pool_alloc calls=1000 bytes=16000 live=0,0 */
        if (a == NULL || b == NULL)
            return 1;
        memset(a, i & 0x7f, 16);
        memset(b, i & 0x3f, 4);
        sum += a[5] + b[3];
        pool_free(a); /* @site pool_free calls=1000 */
        cursor = block + 60;
        unsigned char *c = pool_alloc(4); /* @site pool_alloc calls=1000 bytes=4000 live=0,0 */
        if (c == NULL)
            return 1;
        memset(c, i & 0x1f, 4);
        sum += c[1];
        pool_free(c); /* @site pool_free calls=1000 */
        if (i % 2 == 0)
            pool_free(b); /* @site pool_free calls=500 */
        else
            keep[i] = b;
    }
    for (int i = 1; i < N; i += 2)
        sum += ((unsigned char *)keep[i])[2];
    printf("sum %lu frees %lu\n", sum, frees);
    return 0;
}
