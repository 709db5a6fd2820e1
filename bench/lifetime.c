/* Objects that live: each of THREADS threads keeps a ring of W / THREADS
 * objects of 16-79 bytes; after filling it, every step frees the oldest
 * object and allocates a new one in its place, so each object is freed W
 * allocations (of its thread) after it was made and W objects are live
 * throughout. Usage: lifetime W PAIRS [THREADS]: PAIRS steps per thread.
 * Prints the checksum of what it wrote and, on stderr, its peak RSS in KiB. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>

struct job {
    long ring, pairs;
    unsigned seed;
    unsigned long sum;
};

static unsigned next(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return *s >> 16;
}

/* The measured work (callgrind --toggle-collect=work). */
__attribute__((noinline)) void *work(void *arg)
{
    struct job *j = arg;
    unsigned char **ring = malloc(j->ring * sizeof *ring);
    if (ring == NULL)
        abort();
    for (long i = 0; i < j->ring; i++) {
        size_t n = 16 + next(&j->seed) % 64;
        if ((ring[i] = malloc(n)) == NULL)
            abort();
        ring[i][0] = (unsigned char)n;
    }
    for (long k = 0, i = 0; k < j->pairs; k++) {
        j->sum += ring[i][0];
        free(ring[i]);
        size_t n = 16 + next(&j->seed) % 64;
        if ((ring[i] = malloc(n)) == NULL)
            abort();
        ring[i][0] = (unsigned char)n;
        if (++i == j->ring)
            i = 0;
    }
    for (long i = 0; i < j->ring; i++) {
        j->sum += ring[i][0];
        free(ring[i]);
    }
    free(ring);
    return NULL;
}

int main(int argc, char **argv)
{
    long w = argc > 1 ? atol(argv[1]) : 1000000;
    long pairs = argc > 2 ? atol(argv[2]) : 10000000;
    int threads = argc > 3 ? atoi(argv[3]) : 1;
    if (w < threads || pairs < 0 || threads < 1 || threads > 64)
        return 2;
    struct job jobs[64];
    pthread_t th[64];
    for (int t = 0; t < threads; t++) {
        jobs[t] = (struct job){ .ring = w / threads, .pairs = pairs, .seed = 7u + t, .sum = 0 };
        if (threads == 1)
            work(&jobs[t]);
        else if (pthread_create(&th[t], NULL, work, &jobs[t]) != 0)
            return 1;
    }
    unsigned long sum = 0;
    for (int t = 0; t < threads; t++) {
        if (threads > 1)
            pthread_join(th[t], NULL);
        sum += jobs[t].sum;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("%lu\n", sum);
    fprintf(stderr, "maxrss_kib %ld\n", ru.ru_maxrss);
    return 0;
}
