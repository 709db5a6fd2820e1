// build: {cc} -O2 -g {pie} {src} -o {out}
/* Traced by cli/tests/trace.rs: the main thread allocates and frees in a
   loop while a 50-microsecond timer's handler allocates and frees from a pool
   of its own (pool_alloc and pool_free: async-signal-safe, named as entry
   points), so that the handler's events interrupt the runtime while it
   records the main thread's. Says how many passes and handler runs. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

static char pool[64][64] __attribute__((aligned(64)));
static volatile int used[64];
static volatile unsigned long handled;

__attribute__((noinline)) void *pool_alloc(size_t n) {
    for (int i = 0; i < 64 && n <= 64; i++)
        if (!used[i]) {
            used[i] = 1;
            return pool[i];
        }
    return NULL;
}

__attribute__((noinline)) void pool_free(void *p) {
    if (p)
        used[((char *)p - pool[0]) / 64] = 0;
}

static void on_alarm(int sig) {
    (void)sig;
    void *p = pool_alloc(32); /* @site pool_alloc S */
    pool_free(p); /* @site pool_free SF */
    handled++;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 2000000, passes = 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval every = {{0, 50}, {0, 50}}, off = {{0, 0}, {0, 0}};
    /* The first pass before the timer (the thread's ring is claimed then),
       then at least N passes and 2,000 handler runs. */
    for (;;) {
        char *p = malloc(48); /* @site malloc M */
        memset(p, (int)passes, 48);
        free(p); /* @site free MF */
        if (++passes == 1)
            setitimer(ITIMER_REAL, &every, NULL);
        else if (passes >= n && handled >= 2000)
            break;
    }
    setitimer(ITIMER_REAL, &off, NULL);
    printf("passes %ld handled %lu\n", passes, handled);
    return 0;
}
