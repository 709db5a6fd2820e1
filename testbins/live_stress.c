// build: {cc} -g {opt} {pie} {extra} -Wall -Werror -pthread {src} -o {out}
// counts: variable
/*
 * live_stress: 8 threads allocate 125,000 blocks each (1,000,000 in
 * flight), wait for each other, then each frees every other block of its
 * neighbour's array while the others do the same, and frees its own with
 * index % 3 == 0 that its neighbour left (so objects die on threads other
 * than their allocating one, concurrently). The program then prints how
 * many blocks and bytes it still holds, in all and per allocating line
 * ("site LINE OBJECTS BYTES"), and exits without freeing them. Sizes are
 * a deterministic function of thread and index (1..512 bytes, and one
 * block in 64 of 1..4 KiB); blocks come from malloc, calloc and realloc
 * sites.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define THREADS 8
#define PER 125000

static void **blocks[THREADS];
static size_t *sizes[THREADS];
static int *lines[THREADS];
static pthread_barrier_t barrier;

static size_t size_of(unsigned t, unsigned i)
{
    unsigned h = (t * 2654435761u + i * 40503u) >> 7;
    return i % 64 == 63 ? 1024 + h % 3072 : 1 + h % 512;
}

static void *work(void *arg)
{
    unsigned t = (unsigned)(unsigned long)arg;
    void **b = blocks[t];
    for (unsigned i = 0; i < PER; i++) {
        size_t n = size_of(t, i);
        void *p;
        int line;
        if (i % 5 == 0) {
            p = calloc(1, n); /* @site calloc */
            line = __LINE__ - 1;
        } else if (i % 5 == 1) {
            p = malloc(n / 2 + 1); /* @site malloc */
            p = realloc(p, n); /* @site realloc */
            line = __LINE__ - 1;
        } else {
            p = malloc(n); /* @site malloc */
            line = __LINE__ - 1;
        }
        if (p == NULL)
            abort();
        memset(p, (int)t, n < 8 ? n : 8);
        b[i] = p;
        sizes[t][i] = n;
        lines[t][i] = line;
    }
    pthread_barrier_wait(&barrier);
    unsigned o = (t + 1) % THREADS;
    for (unsigned i = 1; i < PER; i += 2) {
        free(blocks[o][i]); /* @site free */
        blocks[o][i] = NULL;
    }
    pthread_barrier_wait(&barrier);
    for (unsigned i = 0; i < PER; i += 3) {
        if (b[i] != NULL) {
            free(b[i]); /* @site free */
            b[i] = NULL;
        }
    }
    return NULL;
}

int main(void)
{
    pthread_t th[THREADS];
    pthread_barrier_init(&barrier, NULL, THREADS);
    for (unsigned t = 0; t < THREADS; t++) {
        blocks[t] = calloc(PER, sizeof(void *)); /* @site calloc */
        sizes[t] = calloc(PER, sizeof(size_t)); /* @site calloc */
        lines[t] = calloc(PER, sizeof(int)); /* @site calloc */
    }
    for (unsigned t = 0; t < THREADS; t++)
        pthread_create(&th[t], NULL, work, (void *)(unsigned long)t);
    for (unsigned t = 0; t < THREADS; t++)
        pthread_join(th[t], NULL);
    unsigned long objects = 0, bytes = 0;
    enum { LINES = 256 };
    unsigned long per_objects[LINES] = { 0 }, per_bytes[LINES] = { 0 };
    for (unsigned t = 0; t < THREADS; t++)
        for (unsigned i = 0; i < PER; i++)
            if (blocks[t][i] != NULL) {
                objects++;
                bytes += sizes[t][i];
                per_objects[lines[t][i] % LINES]++;
                per_bytes[lines[t][i] % LINES] += sizes[t][i];
            }
    /* The three bookkeeping arrays per thread are live too. */
    objects += 3 * THREADS;
    bytes += THREADS * (unsigned long)PER * (sizeof(void *) + sizeof(size_t) + sizeof(int));
    printf("held %lu %lu\n", objects, bytes);
    for (unsigned l = 0; l < LINES; l++)
        if (per_objects[l] != 0)
            printf("site %u %lu %lu\n", l, per_objects[l], per_bytes[l]);
    return 0;
}
