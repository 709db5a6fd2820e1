/* malloc/free loop: N pairs (argv[1]) on one thread, or on T threads
 * (argv[2]) each doing N pairs. Prints a checksum. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static long n;

__attribute__((noinline)) static void touch(volatile char *p) { p[0] = 1; }

static void *work(void *arg)
{
    (void)arg;
    for (long i = 0; i < n; i++) {
        char *p = malloc(32 + (i & 31));
        touch(p);
        free(p);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    n = argc > 1 ? atol(argv[1]) : 1000000;
    int threads = argc > 2 ? atoi(argv[2]) : 1;
    pthread_t t[64];
    for (int i = 0; i < threads && i < 64; i++)
        pthread_create(&t[i], NULL, work, NULL);
    for (int i = 0; i < threads && i < 64; i++)
        pthread_join(t[i], NULL);
    printf("%ld\n", n * threads);
    return 0;
}
