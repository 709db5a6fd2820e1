/* malloc/free at the bottom of a call chain five functions deep: N pairs
 * (argv[1]). Prints a checksum. */
#include <stdio.h>
#include <stdlib.h>

static long n;
static long sum;

__attribute__((noinline)) static void touch(volatile char *p) { p[0] = 1; }

__attribute__((noinline)) static void level3(long i)
{
    char *p = malloc(32 + (i & 31));
    touch(p);
    free(p);
    sum += i & 1;
}
__attribute__((noinline)) static void level2(long i) { level3(i); sum++; }
__attribute__((noinline)) static void level1(long i) { level2(i); sum++; }

__attribute__((noinline)) static void work(void)
{
    for (long i = 0; i < n; i++)
        level1(i);
}

int main(int argc, char **argv)
{
    n = argc > 1 ? atol(argv[1]) : 1000000;
    work();
    printf("%ld %ld\n", n, sum);
    return 0;
}
