// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
/*
 * fnptr: allocator functions reached through pointers, which cannot be
 * patched at their call sites and are reported as references instead:
 * - alloc_fn holds &malloc in data (a relocation in position-independent
 *   builds; a plain address written by the linker otherwise);
 * - release() takes &free in code (a GOT read, or the address of the PLT
 *   entry as an immediate in a position-dependent build).
 * One direct call is marked as usual.
 */
#include <stdio.h>
#include <stdlib.h>

void *(*volatile alloc_fn)(size_t) = malloc;

__attribute__((noinline, noclone, noipa)) static void release(void *p)
{
    void (*volatile f)(void *) = free;
    f(p);
}

int main(void)
{
    char *a = alloc_fn(32);
    char *b = malloc(64); /* @site malloc calls=1 bytes=64 */
    a[0] = 'a';
    b[0] = 'b';
    printf("%c%c\n", a[0], b[0]);
    release(a);
    release(b);
    return 0;
}
