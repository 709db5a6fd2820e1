// build: {cc} -O2 -g -Wall -Werror {pie} {src} -o {out}
/*
 * A program with a section that is writable and executable: the linker
 * puts it, the GOT and the program's data in one RWX segment. Switching
 * profiling on must leave that segment writable, or the dynamic linker's
 * first lazy binding after the switch faults.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__asm__(".section .rwxdata,\"awx\",@progbits\n.byte 0xc3\n.previous");

__attribute__((noinline, noipa)) static size_t use(char *p, size_t n)
{
    memset(p, (int)n, n);
    return (unsigned char)p[n - 1];
}

int main(void)
{
    size_t total = 0;
    for (size_t i = 0; i < 100; i++) {
        char *p = malloc(32 + i); /* @site malloc calls=100 bytes=8150 */
        total += use(p, 32 + i);
        free(p); /* @site free calls=100 bytes=0 */
    }
    /* First calls of these functions: lazy binding writes the GOT. */
    char *s = strdup("rwx"); /* @site strdup calls=1 bytes=4 */
    puts(s);
    free(s); /* @site free calls=1 bytes=0 */
    printf("%zu\n", total);
    return 0;
}
