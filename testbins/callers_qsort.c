// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
/*
 * A call chain through the C library: the comparison function that qsort
 * calls allocates, so the chains of its malloc site pass through qsort's
 * frames (unpatched) back to sort_them and main (cli/tests/callers.rs).
 * Two elements: one comparison per sort, three sorts.
 */
#include <stdio.h>
#include <stdlib.h>

static void *kept[8];
static int nkept;

__attribute__((noinline, noclone, noipa)) static int cmp(const void *a, const void *b)
{
    kept[nkept++ % 8] = malloc(24); /* @site malloc calls=3 bytes=72 live=0 live_bytes=0 */
    return *(const int *)a - *(const int *)b;
}

__attribute__((noinline, noclone, noipa)) static void sort_them(int *v)
{
    qsort(v, 2, sizeof *v, cmp); /* @frame qsort */
    __asm__ volatile("" ::: "memory");
}

int main(void)
{
    int v[2] = {2, 1};
    for (int i = 0; i < 3; i++)
        sort_them(v);
    printf("%d %d %d\n", v[0], v[1], nkept);
    for (int i = 0; i < nkept; i++)
        free(kept[i]); /* @site free calls=3 bytes=0 */
    return 0;
}
