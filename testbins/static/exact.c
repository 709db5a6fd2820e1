// build: {cc} -g -O1 {extra} -Wall -Werror -pthread {src} -o {out}
/*
 * static/exact: what a statically linked service does, with exact
 * figures at every marked site. Built -static (glibc, musl), and
 * -static-pie.
 *
 * With an argument, prints "ready" and waits for a line on stdin before
 * it allocates anything counted (the test switches profiling on there).
 * Then, on the main thread: malloc, calloc, realloc and free in a loop;
 * four threads each keep 1,000 objects, of which the main thread frees
 * every other one (frees from another thread); a forked child allocates
 * five objects and exits (counted in its own file, never in its
 * parent's); then one object stays live at exit. Thread-local variables
 * (one aligned to 128 bytes, one initialized with an address) must keep
 * their places and values in every thread: the runtime's block goes in
 * front of the program's.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define THREADS 4
#define PER 1000

static void *kept[THREADS][PER];
static volatile unsigned long checksum;
static _Thread_local _Alignas(128) unsigned char tls_block[200];
static _Thread_local const char *tls_name = "thread";
static int tls_ok[THREADS + 1];

/* Whether this thread's thread-local variables are where and what they
 * should be. */
static int tls_check(int t)
{
    int ok = (uintptr_t)tls_block % 128 == 0 && tls_block[t] == 0 && strcmp(tls_name, "thread") == 0;
    tls_block[t] = (unsigned char)(t + 1);
    tls_name = "used";
    return ok && tls_block[t] == t + 1 && tls_name[0] == 'u';
}

static void *worker(void *arg)
{
    long t = (long)arg;
    tls_ok[t] = tls_check((int)t);
    for (int i = 0; i < PER; i++) {
        char *p = malloc(24 + (size_t)t); /* @site malloc calls=4000 bytes=102000 live=2000,51000 */
        if (p == NULL)
            abort();
        memset(p, (int)t, 24 + (size_t)t);
        kept[t][i] = p;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1) {
        char line[16];
        puts("ready");
        fflush(stdout);
        if (fgets(line, sizeof line, stdin) == NULL)
            return 3;
    }
    for (int i = 0; i < 10; i++) {
        size_t n = 16 + 8 * (size_t)i;
        char *a = malloc(n); /* @site malloc calls=10 bytes=520 live=0,0 */
        int *b = calloc((size_t)i + 1, sizeof(int)); /* @site calloc calls=10 bytes=220 live=0,0 */
        if (a == NULL || b == NULL)
            return 1;
        memset(a, i, n);
        char *c = realloc(a, 2 * n); /* @site realloc calls=10 bytes=1040 live=0,0 */
        if (c == NULL)
            return 1;
        checksum += (unsigned char)c[n - 1] + (unsigned)b[i];
        free(c); /* @site free calls=10 */
        free(b); /* @site free calls=10 */
    }
    pthread_t threads[THREADS];
    for (long t = 0; t < THREADS; t++)
        if (pthread_create(&threads[t], NULL, worker, (void *)t) != 0)
            return 1;
    for (int t = 0; t < THREADS; t++)
        pthread_join(threads[t], NULL);
    tls_ok[THREADS] = tls_check(THREADS);
    for (int t = 0; t <= THREADS; t++)
        if (!tls_ok[t])
            return 4;
    for (int t = 0; t < THREADS; t++)
        for (int i = 0; i < PER; i += 2)
            free(kept[t][i]); /* @site free calls=2000 */
    pid_t child = fork();
    if (child == 0) {
        for (int i = 0; i < 5; i++) {
            void *p = malloc(40); /* @site malloc calls=0 bytes=0 live=0,0 */
            checksum += (unsigned long)p & 1;
        }
        _exit(0);
    }
    int status = 0;
    if (child < 0 || waitpid(child, &status, 0) != child || status != 0)
        return 2;
    char *last = malloc(100); /* @site malloc calls=1 bytes=100 live=1,100 */
    memset(last, 1, 100);
    printf("static exact: checksum %lu\n", checksum + (unsigned char)last[99]);
    return 0;
}
