/* malloc/free through a hook: N pairs (argv[1]) of new_obj(), a wrapper
 * whose size is a constant (xmalloc(48)), so that its call is a hook that
 * takes what the xmalloc call inside counts, and free, on one thread.
 * Prints a checksum. */
#include <stdio.h>
#include <stdlib.h>

static long n;

__attribute__((noinline)) static void touch(volatile char *p) { p[0] = 1; }

__attribute__((noinline, noreturn)) static void die(void)
{
    fputs("hook_loop: out of memory\n", stderr);
    exit(2);
}

__attribute__((noinline)) static void *xmalloc(size_t size)
{
    void *p = malloc(size);
    if (p == NULL)
        die();
    return p;
}

struct obj {
    long id;
    char data[40];
};

__attribute__((noinline)) static struct obj *new_obj(long id)
{
    struct obj *o = xmalloc(sizeof *o);
    o->id = id;
    return o;
}

__attribute__((noinline)) static void work(void)
{
    for (long i = 0; i < n; i++) {
        struct obj *o = new_obj(i);
        touch(o->data);
        free(o);
    }
}

int main(int argc, char **argv)
{
    n = argc > 1 ? atol(argv[1]) : 1000000;
    work();
    printf("%ld\n", n);
    return 0;
}
