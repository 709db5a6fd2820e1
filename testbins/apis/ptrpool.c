// build: {cc} -O2 -g {pie} -pthread {src} -o {out}
/* A pool allocator the user names (--entry pool_alloc:alloc --entry
   pool_free:free), called directly and through a table of operations in
   data, as an interpreter's objects are freed through their type's
   pointer. No call site sees a call through the table: the pool's
   functions are hooked at their entry, and count those calls on their
   own rows (named after their first line of code); the direct calls
   count at their sites.

   First the main thread, N times:
     a (direct, 24 bytes): freed through the table 3 times in 4, else kept;
     b (through the table, 40 bytes): freed directly every other time;
     c (direct, 8 bytes): freed directly;
   then THREADS threads each allocate PER objects of 40 bytes through the
   table, which the main thread frees through the table once they are
   joined. The live figures are exact only if the calls through the
   table are seen.

   With the argument `wait`, the program prints "ready" and waits for a
   line on stdin before it starts (profiling is switched on meanwhile);
   with `pause`, between the main thread's part and the threads', it
   prints "paused" and waits for a line (profiling is switched off: the
   hooks' jumps go back to the stubs), allocates and frees through the
   table uncounted, then prints "resumed" and waits for a line (profiling
   is switched on again). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 1000
#define THREADS 4
#define PER 250
#define BLOCK 64

struct ops {
    void *(*alloc)(size_t);
    void (*free)(void *);
};

static unsigned char arena[3 * N * BLOCK] __attribute__((aligned(64)));
static size_t used;
static void *free_list;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((noinline, noipa)) void *pool_alloc(size_t n)
{
    if (n > BLOCK) /* @site pool_alloc calls=2000 bytes=80000 live=500,20000 */
        return NULL;
    pthread_mutex_lock(&lock);
    void *p = free_list;
    if (p != NULL) {
        free_list = *(void **)p;
    } else if (used + BLOCK <= sizeof arena) {
        p = arena + used;
        used += BLOCK;
    }
    pthread_mutex_unlock(&lock);
    return p;
}

__attribute__((noinline, noipa)) void pool_free(void *p)
{
    if (p == NULL) /* @site pool_free calls=1750 */
        return;
    pthread_mutex_lock(&lock);
    *(void **)p = free_list;
    free_list = p;
    pthread_mutex_unlock(&lock);
}

static const struct ops pool_ops = {pool_alloc, pool_free};
/* Read at every call: the compiler cannot call the functions directly. */
static const struct ops *volatile ops = &pool_ops;

static void *made[THREADS][PER];

static void *worker(void *arg)
{
    void **mine = arg;
    for (int i = 0; i < PER; i++) {
        mine[i] = ops->alloc(40);
        if (mine[i] == NULL)
            abort();
        memset(mine[i], i, 40);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "wait") == 0) {
        char line[16];
        puts("ready");
        fflush(stdout);
        if (fgets(line, sizeof line, stdin) == NULL)
            return 1;
    }
    int pause = argc > 1 && strcmp(argv[1], "pause") == 0;
    unsigned long sum = 0, kept = 0;
    static void *keep[2 * N];
    for (int i = 0; i < N; i++) {
        unsigned char *a = pool_alloc(24); /* @site pool_alloc calls=1000 bytes=24000 live=250,6000 */
        unsigned char *b = ops->alloc(40);
        unsigned char *c = pool_alloc(8); /* @site pool_alloc calls=1000 bytes=8000 live=0,0 */
        if (a == NULL || b == NULL || c == NULL)
            return 1;
        a[0] = (unsigned char)i;
        b[1] = (unsigned char)(i >> 1);
        c[2] = (unsigned char)(i >> 2);
        sum += a[0] + b[1] + c[2];
        pool_free(c); /* @site pool_free calls=1000 */
        if (i % 4 != 0)
            ops->free(a);
        else
            keep[kept++] = a;
        if (i % 2 == 0)
            pool_free(b); /* @site pool_free calls=500 */
        else
            keep[kept++] = b;
    }
    if (pause) {
        char line[16];
        puts("paused");
        fflush(stdout);
        if (fgets(line, sizeof line, stdin) == NULL)
            return 1;
        for (int i = 0; i < 100; i++) {
            void *p = ops->alloc(40);
            if (p == NULL)
                return 1;
            ops->free(p);
        }
        puts("resumed");
        fflush(stdout);
        if (fgets(line, sizeof line, stdin) == NULL)
            return 1;
    }
    pthread_t t[THREADS];
    for (int k = 0; k < THREADS; k++)
        if (pthread_create(&t[k], NULL, worker, made[k]) != 0)
            return 1;
    for (int k = 0; k < THREADS; k++)
        pthread_join(t[k], NULL);
    for (int k = 0; k < THREADS; k++)
        for (int i = 0; i < PER; i++) {
            sum += ((unsigned char *)made[k][i])[i % 40];
            ops->free(made[k][i]);
        }
    for (unsigned long k = 0; k < kept; k++)
        sum += ((unsigned char *)keep[k])[0];
    printf("sum %lu kept %lu used %zu\n", sum, kept, used);
    return 0;
}
