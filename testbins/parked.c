// build: {cc} -g {opt} {pie} {extra} -Wall -Werror -pthread {src} -o {out}
/*
 * parked: two threads are inside an allocator function while the test
 * switches profiling: one called slow_alloc directly, one reached it
 * through a tail call. slow_alloc blocks until main releases it (after a
 * line on stdin, or at end of input). With slow_alloc named as an entry
 * point (--entry slow_alloc:alloc), both calls go through trampolines that
 * may be switched on or off while the threads are parked inside.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fds[2];
static atomic_int inside;

__attribute__((noinline, noclone, noipa)) void *slow_alloc(size_t n) /* @wrapper slow_alloc alloc */
{
    char c;
    atomic_fetch_add(&inside, 1);
    while (read(fds[0], &c, 1) < 0)
        ;
    return malloc(n); /* @site malloc tail calls=2 bytes=96 */
}

__attribute__((noinline, noclone, noipa)) void *via_tail(size_t n) /* @wrapper via_tail alloc */
{
    return slow_alloc(n); /* @usersite slow_alloc tail calls=1 bytes=32 */
}

static void *direct(void *arg) /* @wrapper direct alloc */
{
    (void)arg;
    char *p = slow_alloc(64); /* @usersite slow_alloc calls=1 bytes=64 */
    memset(p, 'd', 64);
    return p;
}

static void *tail(void *arg) /* @wrapper tail alloc */
{
    (void)arg;
    char *p = via_tail(32);
    memset(p, 't', 32);
    return p;
}

int main(void)
{
    if (pipe(fds) != 0)
        return 1;
    pthread_t a, b;
    pthread_create(&a, NULL, direct, NULL);
    pthread_create(&b, NULL, tail, NULL);
    while (atomic_load(&inside) < 2)
        usleep(1000);
    printf("parked\n");
    fflush(stdout);
    char line[64];
    if (fgets(line, sizeof line, stdin) == NULL)
        line[0] = 0;
    if (write(fds[1], "xx", 2) != 2)
        return 1;
    void *ra, *rb;
    pthread_join(a, &ra);
    pthread_join(b, &rb);
    printf("%c%c %zu\n", ((char *)ra)[63], ((char *)rb)[31], strlen("done"));
    free(ra); /* @site free calls=1 bytes=0 */
    free(rb); /* @site free calls=1 bytes=0 */
    return 0;
}
