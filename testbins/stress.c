// build: {cc} -g {opt} {pie} {extra} -Wall -Werror -pthread {src} -o {out}
// counts: variable
/*
 * stress: 8 threads allocate and free in a loop until a line (or end of
 * input) arrives on stdin, then print "ok". The number of iterations
 * depends on timing (at least 1000 per thread), so the markers' counts are not checked ("counts:
 * variable"); the output is always the same.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define THREADS 8

static atomic_int stop;
static atomic_ulong total;

__attribute__((noinline, noclone, noipa)) static void touch(unsigned char *p, size_t n)
{
    memset(p, 0x5a, n);
}

static void *worker(void *arg)
{
    unsigned long n = 0;
    size_t sz = 16 + (size_t)(long)arg * 8;
    while (n < 1000 || !atomic_load_explicit(&stop, memory_order_relaxed)) {
        unsigned char *p = malloc(sz); /* @site malloc calls=0 bytes=0 */
        if (p == NULL)
            abort();
        touch(p, sz);
        free(p); /* @site free calls=0 bytes=0 */
        n++;
    }
    atomic_fetch_add(&total, n);
    return NULL;
}

int main(void)
{
    pthread_t t[THREADS];
    for (long i = 0; i < THREADS; i++)
        if (pthread_create(&t[i], NULL, worker, (void *)i) != 0)
            return 1;
    printf("started\n");
    fflush(stdout);
    char line[64];
    if (fgets(line, sizeof line, stdin) == NULL)
        line[0] = 0;
    atomic_store(&stop, 1);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    printf("ok %s\n", atomic_load(&total) > 0 ? "work done" : "no work");
    return 0;
}
