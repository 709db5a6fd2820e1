// build: {cc} -g {opt} {pie} {extra} -Wall -Werror -pthread {src} -o {out}
/*
 * threads: 4 threads (pthread); thread t (0..3) does 50 malloc/free pairs of
 * 64 + 16*t bytes (and one calloc(t + 1, 32) block it frees at the end).
 * main joins them. Marker counts are totals over all threads:
 *   malloc: 4*50 = 200 calls, 50 * (64 + 80 + 96 + 112) = 17600 bytes
 *   calloc: 4 calls, 32 * (1 + 2 + 3 + 4) = 320 bytes
 * An argument N makes each thread do N pairs instead of 50 (the markers
 * then do not hold): with N over 511 every thread makes more counted calls
 * than a thread makes in shard 0 before it gets a shard of its own.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define NTHREADS 4

static volatile int pairs = 50;
static unsigned long results[NTHREADS];

__attribute__((noinline, noclone, noipa)) static unsigned long touch(unsigned char *p, size_t n, unsigned seed)
{
    unsigned long s = 0;
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(seed + i * 31u + 1u);
    for (size_t i = 0; i < n; i++)
        s = s * 131u + p[i];
    return s;
}

static void *worker(void *arg)
{
    unsigned t = (unsigned)(unsigned long)arg;
    int n = pairs;
    size_t sz = 64 + 16 * (size_t)t;
    unsigned long s = 0;

    unsigned char *acc = calloc(t + 1, 32); /* @site calloc calls=4 bytes=320 */
    if (acc == NULL)
        return (void *)1;
    for (int i = 0; i < n; i++) {
        unsigned char *p = malloc(sz); /* @site malloc calls=200 bytes=17600 */
        if (p == NULL)
            return (void *)1;
        s += touch(p, sz, t * 1000u + (unsigned)i);
        acc[i % (32 * (t + 1))] ^= p[i % sz];
        free(p); /* @site free calls=200 bytes=0 */
    }
    s += touch(acc, 0, 0);
    for (size_t i = 0; i < 32 * ((size_t)t + 1); i++)
        s = s * 7u + acc[i];
    free(acc); /* @site free calls=4 bytes=0 */
    results[t] = s;
    return NULL;
}

int main(int argc, char **argv)
{
    pthread_t th[NTHREADS];
    int bad = 0;

    if (argc > 1)
        pairs = atoi(argv[1]);

    for (unsigned long t = 0; t < NTHREADS; t++)
        if (pthread_create(&th[t], NULL, worker, (void *)t) != 0)
            return 1;
    for (int t = 0; t < NTHREADS; t++) {
        void *ret;
        if (pthread_join(th[t], &ret) != 0)
            return 1;
        bad += ret != NULL;
    }
    unsigned long total = 0;
    for (int t = 0; t < NTHREADS; t++)
        total = total * 31u + results[t];
    printf("threads: %d threads, failures=%d, checksum=%lu\n", NTHREADS, bad, total);
    return bad != 0;
}
