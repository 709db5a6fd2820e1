// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
/*
 * own_malloc: a program with its own bump allocator (my_alloc / my_free over
 * a 64 KiB static arena; my_free only counts) that also calls glibc
 * malloc/free. Site markers are on the glibc calls only; my_alloc and
 * my_free are not entry points by default. The calls OF my_alloc/my_free
 * carry usersite markers for tests that name them as entry points
 * (--entry my_alloc:alloc, --entry my_free:free).
 *
 * 6 iterations (i = 0..5):
 *   a = my_alloc(24 + 8*i)   6 calls, 264 bytes
 *   b = malloc(24 + 8*i)     6 calls, 264 bytes
 *   my_free(a); free(b)
 * then one my_alloc(1 MiB) that fails (returns NULL, arena too small).
 */
#include <stdio.h>
#include <stdlib.h>

static unsigned char arena[65536] __attribute__((aligned(16)));
static size_t arena_used;
static unsigned long my_frees;
static volatile int iterations = 6;
static unsigned long checksum;

__attribute__((noinline, noclone, noipa)) void *my_alloc(size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n > sizeof arena - arena_used)
        return NULL;
    void *p = arena + arena_used;
    arena_used += n;
    return p;
}

__attribute__((noinline, noclone, noipa)) void my_free(void *p)
{
    if (p != NULL)
        my_frees++;
}

__attribute__((noinline, noclone, noipa)) static void touch(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(seed + i * 31u + 1u);
    for (size_t i = 0; i < n; i++)
        checksum = checksum * 131u + p[i];
}

int main(void)
{
    int n = iterations;
    int failed = 0;

    for (int i = 0; i < n; i++) {
        size_t sz = 24 + 8 * (size_t)i;
        unsigned char *a = my_alloc(sz); /* @usersite my_alloc calls=6 bytes=264 */
        unsigned char *b = malloc(sz); /* @site malloc calls=6 bytes=264 */
        if (a == NULL || b == NULL)
            return 1;
        touch(a, sz, (unsigned)i);
        touch(b, sz, (unsigned)i + 100u);
        my_free(a); /* @usersite my_free calls=6 bytes=0 */
        free(b); /* @site free calls=6 bytes=0 */
    }
    void *big = my_alloc(1u << 20); /* @usersite my_alloc calls=1 bytes=1048576 failed=1 */
    if (big == NULL)
        failed++;

    printf("own_malloc: iterations=%d my_frees=%lu arena_used=%zu failed=%d checksum=%lu\n",
           n, my_frees, arena_used, failed, checksum);
    return 0;
}
