// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
/*
 * basic: malloc, calloc, realloc and free in a loop of 10 iterations, then
 * one malloc that fails (SIZE_MAX bytes, taken from a volatile so the
 * compiler neither warns nor folds it).
 *
 * Iteration i (0..9): malloc(16 + 8*i), calloc(i + 1, 4),
 * realloc(that malloc block, 2 * (16 + 8*i)), then both blocks are freed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.h"

static volatile int iterations = 10;
static volatile size_t huge_size = SIZE_MAX;

int main(void)
{
    int n = iterations;
    int failed = 0;

    for (int i = 0; i < n; i++) {
        size_t sz = 16 + 8 * (size_t)i;
        unsigned char *a = malloc(sz); /* @site malloc calls=10 bytes=520 */
        int *b = calloc((size_t)i + 1, sizeof(int)); /* @site calloc calls=10 bytes=220 */
        if (a == NULL || b == NULL)
            return 1;
        fill(a, sz, (unsigned)i);
        sum(b, ((size_t)i + 1) * sizeof(int));
        unsigned char *c = realloc(a, 2 * sz); /* @site realloc calls=10 bytes=1040 */
        if (c == NULL)
            return 1;
        fill(c + sz, sz, (unsigned)i + 7u);
        sum(c, 2 * sz);
        free(c); /* @site free calls=10 bytes=0 */
        free(b); /* @site free calls=10 bytes=0 */
    }

    void *big = malloc(huge_size); /* @site malloc calls=1 bytes=18446744073709551615 failed=1 */
    if (big == NULL)
        failed++;
    else
        sum(big, 1);

    printf("basic: iterations=%d failed=%d checksum=%lu\n", n, failed, checksum);
    return 0;
}
