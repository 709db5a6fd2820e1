// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out} -L{dir} -l:libcbouter.so -Wl,-rpath,{dir}
// needs: libcbouter
/*
 * A call chain through two unpatched libraries, one of them needed only by
 * the other: main -> outer_apply (libcbouter.so) -> inner_apply
 * (libcbinner.so) -> grow, which allocates. Its chains pass through both
 * libraries' frames back to main's call (cli/tests/callers.rs).
 */
#include <stdio.h>
#include <stdlib.h>

#include "common.h"

int outer_apply(int (*f)(int), int x);

static void *kept[3];
static int next;
static volatile int rounds = 3;

__attribute__((noinline, noclone, noipa)) static int grow(int x)
{
    char *p = malloc(16 + (size_t)x); /* @site malloc calls=3 bytes=57 */
    fill(p, 16 + (size_t)x, (unsigned)x);
    sum(p, 16 + (size_t)x);
    kept[next++] = p;
    return x;
}

int main(void)
{
    int r = 0, n = rounds;
    for (int i = 0; i < n; i++)
        r += outer_apply(grow, i); /* @frame outer_apply */
    for (int i = 0; i < n; i++)
        free(kept[i]); /* @site free calls=3 bytes=0 */
    printf("callers_deep: %d checksum %lu\n", r, checksum);
    return 0;
}
