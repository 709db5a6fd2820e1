// build: {cc} -g {opt} {pie} {extra} -Wall -Werror -pthread {src} -o {out} -L{dir} -l:liblive.so -Wl,-rpath,{dir}
// needs: liblive
/*
 * live: objects allocated here and freed in liblive.so, and the other way
 * round; objects handed from thread to thread; reallocs that move objects
 * between sites; a known set still allocated at exit (live=N live_bytes=B
 * in the markers are the objects of a site still allocated then).
 *
 * Threads: 4 producers each malloc 100 blocks of 32 + t bytes (t = 0..3)
 * and hand them to the consumer thread, which frees all but the last 5 of
 * each producer (those stay live). A block freed through a call the
 * patcher cannot see (a function pointer) is an untracked free only when
 * the free site sees memory it never saw allocated: here, one block from
 * malloc called through a pointer, freed at a patched site.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

void *live_make(size_t n);
void live_drop(void *p);
char *live_label(int i);

#define PRODUCERS 4
#define PER 100

static void *queue[PRODUCERS][PER];
static void *keep[64];
static int nkeep;
static void *(*volatile indirect_malloc)(size_t) = malloc;

static void *producer(void *arg)
{
    unsigned t = (unsigned)(unsigned long)arg;
    for (int i = 0; i < PER; i++) {
        size_t n = 32 + t;
        void *p = malloc(n); /* @site malloc calls=400 bytes=13400 live=20 live_bytes=670 */
        fill(p, n, t + (unsigned)i);
        queue[t][i] = p;
    }
    return NULL;
}

static void *consumer(void *arg)
{
    (void)arg;
    for (int t = 0; t < PRODUCERS; t++)
        for (int i = 0; i < PER - 5; i++) {
            sum(queue[t][i], 32);
            free(queue[t][i]); /* @site free calls=380 bytes=0 untracked=0 */
        }
    return NULL;
}

int main(void)
{
    pthread_t th[PRODUCERS], c;
    for (int t = 0; t < PRODUCERS; t++)
        pthread_create(&th[t], NULL, producer, (void *)(unsigned long)t);
    for (int t = 0; t < PRODUCERS; t++)
        pthread_join(th[t], NULL);
    pthread_create(&c, NULL, consumer, NULL);
    pthread_join(c, NULL);

    /* Library objects, freed here (6) or kept (4). */
    void *made[10];
    for (int i = 0; i < 10; i++)
        made[i] = live_make(100 + (size_t)i);
    for (int i = 0; i < 6; i++) {
        sum(made[i], 100);
        free(made[i]); /* @site free calls=6 bytes=0 untracked=0 */
    }
    for (int i = 6; i < 10; i++)
        keep[nkeep++] = made[i];

    /* Objects allocated here, freed in the library (8, and a NULL). */
    for (int i = 0; i < 8; i++) {
        void *p = calloc(2, 20 + (size_t)i); /* @site calloc calls=8 bytes=376 live=0 live_bytes=0 */
        sum(p, 40);
        live_drop(p);
    }
    live_drop(NULL);

    /* Strings made in the library: two freed here, one kept. */
    for (int i = 0; i < 3; i++) {
        char *s = live_label(i);
        sum(s, strlen(s));
        if (i < 2)
            free(s); /* @site free calls=2 bytes=0 untracked=0 */
        else
            keep[nkeep++] = s;
    }

    /* A realloc moves an object from its malloc site to the realloc site;
     * a second realloc keeps it there with its new size. */
    char *r = malloc(50); /* @site malloc calls=1 bytes=50 live=0 live_bytes=0 */
    fill(r, 50, 7);
    r = realloc(r, 5000); /* @site realloc calls=1 bytes=5000 live=0 live_bytes=0 */
    sum(r, 50);
    r = realloc(r, 70); /* @site realloc calls=1 bytes=70 live=1 live_bytes=70 */
    keep[nkeep++] = r;

    /* realloc(p, 0) frees p (glibc) and returns NULL: a failed call. */
    char *z = malloc(30); /* @site malloc calls=1 bytes=30 live=0 live_bytes=0 */
    fill(z, 30, 9);
    z = realloc(z, 0); /* @site realloc calls=1 bytes=0 failed=1 live=0 live_bytes=0 */

    /* An allocation the patcher cannot see, freed at a patched site. */
    void *u = indirect_malloc(77);
    fill(u, 77, 3);
    sum(u, 77);
    free(u); /* @site free calls=1 bytes=0 untracked=1 */

    /* An aligned block kept, a failing malloc (no object). */
    void *a = NULL;
    if (posix_memalign(&a, 64, 256) == 0) /* @site posix_memalign calls=1 bytes=256 live=1 live_bytes=256 */
        keep[nkeep++] = a;
    volatile size_t huge = (size_t)1 << 62;
    void *h = malloc(huge); /* @site malloc calls=1 bytes=4611686018427387904 failed=1 live=0 live_bytes=0 */
    printf("kept %d checksum %lu %s\n", nkeep, checksum, h == NULL ? "huge failed" : "huge?");
    return 0;
}
