// build: {cc} -g {opt} {pie} {extra} -Wall -Werror -pthread {src} -o {out}
/*
 * Call chains from threads at once: 4 threads reach one malloc site (in
 * leaf) through four different chains, 20000 times each, all at the same
 * time, so that the chains of one site are recorded by several threads
 * concurrently (cli/tests/callers.rs). Thread t (0..3) calls leaf through
 * path<t>, which asks for 16 * (t + 1) bytes, and frees them in use:
 *   leaf <- path0 <- worker   20000 calls, 320000 bytes
 *   leaf <- path1 <- worker   20000 calls, 640000 bytes
 *   leaf <- path2 <- worker   20000 calls, 960000 bytes
 *   leaf <- path3 <- worker   20000 calls, 1280000 bytes
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define NTHREADS 4
#define ITER 20000

static pthread_barrier_t start;
static unsigned long results[NTHREADS];

static unsigned char *held[NTHREADS];

/* Not an allocation wrapper (it returns nothing): its malloc is the site. */
__attribute__((noinline, noclone, noipa)) static void leaf(size_t n, int t)
{
    held[t] = malloc(n); /* @site malloc calls=80000 bytes=3200000 live=0 live_bytes=0 */
    __asm__ volatile("" ::: "memory");
}

__attribute__((noinline, noclone, noipa)) static unsigned long use(int k)
{
    unsigned char *p = held[k];
    p[0] = (unsigned char)k;
    unsigned long r = p[0];
    free(p); /* @site free calls=80000 bytes=0 */
    return r;
}

__attribute__((noinline, noclone, noipa)) static unsigned long path0(void)
{
    leaf(16, 0);
    return use(0);
}

__attribute__((noinline, noclone, noipa)) static unsigned long path1(void)
{
    leaf(32, 1);
    return use(1);
}

__attribute__((noinline, noclone, noipa)) static unsigned long path2(void)
{
    leaf(48, 2);
    return use(2);
}

__attribute__((noinline, noclone, noipa)) static unsigned long path3(void)
{
    leaf(64, 3);
    return use(3);
}

static void *worker(void *arg)
{
    long t = (long)arg;
    unsigned long (*path)(void) = t == 0 ? path0 : t == 1 ? path1 : t == 2 ? path2 : path3;
    unsigned long s = 0;
    pthread_barrier_wait(&start);
    for (int i = 0; i < ITER; i++)
        s += path();
    results[t] = s;
    return NULL;
}

int main(void)
{
    pthread_t th[NTHREADS];
    pthread_barrier_init(&start, NULL, NTHREADS);
    for (long t = 0; t < NTHREADS; t++)
        pthread_create(&th[t], NULL, worker, (void *)t);
    unsigned long total = 0;
    for (int t = 0; t < NTHREADS; t++) {
        pthread_join(th[t], NULL);
        total += results[t];
    }
    printf("%lu\n", total);
    return 0;
}
