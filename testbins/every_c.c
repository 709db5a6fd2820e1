// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
/*
 * every_c: one call of every C allocator entry point, each block written,
 * read back and freed:
 *   malloc(100) -> realloc(.., 200); calloc(5, 12) -> reallocarray(.., 10, 30);
 *   posix_memalign(64, 128); aligned_alloc(64, 256); memalign(32, 96);
 *   valloc(1000); pvalloc(5000); strdup("alloctramp"); strndup("hello, world", 5)
 * and nine frees.
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"


/* Hides string literals from the optimiser (so strdup is not folded). */
__attribute__((noinline, noclone, noipa)) static const char *opaque(const char *s)
{
    return s;
}

int main(void)
{
    int bad = 0;

    char *m = malloc(100); /* @site malloc calls=1 bytes=100 */
    if (m == NULL)
        return 1;
    fill(m, 100, 1);
    char *r = realloc(m, 200); /* @site realloc calls=1 bytes=200 */
    if (r == NULL)
        return 1;
    fill(r + 100, 100, 2);
    sum(r, 200);

    char *c = calloc(5, 12); /* @site calloc calls=1 bytes=60 */
    if (c == NULL)
        return 1;
    sum(c, 60);
    char *ra = reallocarray(c, 10, 30); /* @site reallocarray calls=1 bytes=300 */
    if (ra == NULL)
        return 1;
    fill(ra, 300, 3);
    sum(ra, 300);

    void *pm = NULL;
    int err = posix_memalign(&pm, 64, 128); /* @site posix_memalign calls=1 bytes=128 */
    if (err != 0 || pm == NULL)
        return 1;
    bad += ((unsigned long)pm % 64) != 0;
    fill(pm, 128, 4);
    sum(pm, 128);

    void *aa = aligned_alloc(64, 256); /* @site aligned_alloc calls=1 bytes=256 */
    if (aa == NULL)
        return 1;
    bad += ((unsigned long)aa % 64) != 0;
    fill(aa, 256, 5);
    sum(aa, 256);

    void *ma = memalign(32, 96); /* @site memalign calls=1 bytes=96 */
    if (ma == NULL)
        return 1;
    bad += ((unsigned long)ma % 32) != 0;
    fill(ma, 96, 6);
    sum(ma, 96);

    void *va = valloc(1000); /* @site valloc calls=1 bytes=1000 */
    if (va == NULL)
        return 1;
    bad += ((unsigned long)va % 4096) != 0;
    fill(va, 1000, 7);
    sum(va, 1000);

    void *pv = pvalloc(5000); /* @site pvalloc calls=1 bytes=5000 */
    if (pv == NULL)
        return 1;
    bad += ((unsigned long)pv % 4096) != 0;
    fill(pv, 5000, 8);
    sum(pv, 5000);

    char *sd = strdup(opaque("alloctramp")); /* @site strdup calls=1 bytes=11 */
    if (sd == NULL)
        return 1;
    sum(sd, strlen(sd) + 1);

    char *sn = strndup(opaque("hello, world"), 5); /* @site strndup calls=1 bytes=6 */
    if (sn == NULL)
        return 1;
    sum(sn, strlen(sn) + 1);

    printf("every_c: %s %s misaligned=%d checksum=%lu\n", sd, sn, bad, checksum);

    free(r); /* @site free calls=1 bytes=0 */
    free(ra); /* @site free calls=1 bytes=0 */
    free(pm); /* @site free calls=1 bytes=0 */
    free(aa); /* @site free calls=1 bytes=0 */
    free(ma); /* @site free calls=1 bytes=0 */
    free(va); /* @site free calls=1 bytes=0 */
    free(pv); /* @site free calls=1 bytes=0 */
    free(sd); /* @site free calls=1 bytes=0 */
    free(sn); /* @site free calls=1 bytes=0 */
    return 0;
}
