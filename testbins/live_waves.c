// build: {cc} -g {opt} {pie} {extra} -Wall -Werror -pthread {src} -o {out}
/*
 * live_waves: more threads alive at once than the runtime has nurseries
 * (80 > 64), and threads that exit while objects they allocated are live.
 * Wave A: 80 threads, all alive together, each keeps 300 blocks of
 * 24 + (i % 8) * 8 bytes and allocates and frees 200 short-lived blocks,
 * then exits. Wave B: 80 new threads (taking over the nurseries of wave
 * A's); thread t frees the even-indexed blocks of wave-A thread t, keeps
 * 20 blocks of 100 bytes and frees 20 more right away. Then main frees
 * wave A's blocks with index % 6 == 1, prints how many blocks and bytes
 * the program still holds and exits without freeing them.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define THREADS 80
#define KEPT 300
#define SHORT 200
#define LATER 40

static void *a_blocks[THREADS][KEPT];
static void *b_blocks[THREADS][LATER];
static pthread_barrier_t barrier;

static size_t size_of(unsigned i)
{
    return 24 + (i % 8) * 8;
}

static void *wave_a(void *arg)
{
    unsigned t = (unsigned)(unsigned long)arg;
    pthread_barrier_wait(&barrier);
    for (unsigned i = 0; i < KEPT; i++) {
        a_blocks[t][i] = malloc(size_of(i)); /* @site malloc calls=24000 bytes=1242880 */
        if (a_blocks[t][i] == NULL)
            abort();
        memset(a_blocks[t][i], (int)t, 8);
        if (i < SHORT) {
            volatile char *s = malloc(64); /* @site malloc calls=16000 bytes=1024000 */
            if (s == NULL)
                abort();
            s[0] = (char)i;
            free((void *)s); /* @site free calls=16000 bytes=0 */
        }
    }
    pthread_barrier_wait(&barrier);
    return NULL;
}

static void *wave_b(void *arg)
{
    unsigned t = (unsigned)(unsigned long)arg;
    for (unsigned i = 0; i < KEPT; i += 2) {
        free(a_blocks[t][i]); /* @site free calls=12000 bytes=0 */
        a_blocks[t][i] = NULL;
    }
    for (unsigned i = 0; i < LATER; i++) {
        b_blocks[t][i] = malloc(100); /* @site malloc calls=3200 bytes=320000 */
        if (b_blocks[t][i] == NULL)
            abort();
        memset(b_blocks[t][i], (int)i, 8);
    }
    for (unsigned i = 1; i < LATER; i += 2) {
        free(b_blocks[t][i]); /* @site free calls=1600 bytes=0 */
        b_blocks[t][i] = NULL;
    }
    return NULL;
}

int main(void)
{
    pthread_t th[THREADS];
    pthread_barrier_init(&barrier, NULL, THREADS);
    for (unsigned t = 0; t < THREADS; t++)
        if (pthread_create(&th[t], NULL, wave_a, (void *)(unsigned long)t) != 0)
            abort();
    for (unsigned t = 0; t < THREADS; t++)
        pthread_join(th[t], NULL);
    for (unsigned t = 0; t < THREADS; t++)
        if (pthread_create(&th[t], NULL, wave_b, (void *)(unsigned long)t) != 0)
            abort();
    for (unsigned t = 0; t < THREADS; t++)
        pthread_join(th[t], NULL);
    for (unsigned t = 0; t < THREADS; t++)
        for (unsigned i = 1; i < KEPT; i += 6) {
            free(a_blocks[t][i]); /* @site free calls=4000 bytes=0 */
            a_blocks[t][i] = NULL;
        }
    unsigned long objects = 0, bytes = 0;
    for (unsigned t = 0; t < THREADS; t++) {
        for (unsigned i = 0; i < KEPT; i++)
            if (a_blocks[t][i] != NULL) {
                objects++;
                bytes += size_of(i);
            }
        for (unsigned i = 0; i < LATER; i++)
            if (b_blocks[t][i] != NULL) {
                objects++;
                bytes += 100;
            }
    }
    printf("held %lu %lu\n", objects, bytes);
    return 0;
}
