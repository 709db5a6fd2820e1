// A thread cancelled inside a hooked call (a wrapper that allocates a
// computed size, then waits at a cancellation point): the cleanup handler
// its caller pushed runs, as in the original.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int fds[2];
__attribute__((noinline)) char *make_and_wait(const char *s) {
    char *p = malloc(strlen(s) + 16);
    strcpy(p, s);
    char c;
    read(fds[0], &c, 1); /* a cancellation point */
    return p;
}
static void cleanup(void *arg) { printf("cleanup %s\n", (const char *)arg); fflush(stdout); }
static void *worker(void *arg) {
    pthread_cleanup_push(cleanup, arg);
    char *p = make_and_wait("hello");
    free(p);
    pthread_cleanup_pop(0);
    return NULL;
}
int main(void) {
    pipe(fds);
    pthread_t t;
    pthread_create(&t, NULL, worker, "worker");
    usleep(100000);
    pthread_cancel(t);
    void *r;
    pthread_join(t, &r);
    printf("cancelled %d\n", r == PTHREAD_CANCELED);

    return 0;
}
