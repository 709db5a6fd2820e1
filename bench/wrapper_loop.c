/* malloc/free through one level of allocation wrappers: N pairs (argv[1])
 * of xmalloc (dies on NULL) and xfree on one thread. Prints a checksum. */
#include <stdio.h>
#include <stdlib.h>

static long n;

__attribute__((noinline)) static void touch(volatile char *p) { p[0] = 1; }

__attribute__((noinline, noreturn)) static void die(void)
{
    fputs("wrapper_loop: out of memory\n", stderr);
    exit(2);
}

__attribute__((noinline)) static void *xmalloc(size_t size)
{
    void *p = malloc(size);
    if (p == NULL)
        die();
    return p;
}

__attribute__((noinline)) static void xfree(void *p) { free(p); }

__attribute__((noinline)) static void work(void)
{
    for (long i = 0; i < n; i++) {
        char *p = xmalloc(32 + (i & 31));
        touch(p);
        xfree(p);
    }
}

int main(int argc, char **argv)
{
    n = argc > 1 ? atol(argv[1]) : 1000000;
    work();
    printf("%ld\n", n);
    return 0;
}
