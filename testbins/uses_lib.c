// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out} -L{dir} -l:libatshared.so -Wl,-rpath,{dir}
// needs: libatshared
/*
 * uses_lib: allocates through libatshared.so and frees here, and the other
 * way round. 5 iterations (i = 0..4):
 *   p = atshared_alloc(40 + i)   (malloc in the library)  -> free(p) here
 *   q = malloc(24 + i) here      -> atshared_free(q)      (free in the library)
 *   s = atshared_dup("shared-5") (strdup in the library)  -> free(s) here
 * Here: malloc 5 calls / 130 bytes, free 10 calls.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

void *atshared_alloc(size_t n);
void atshared_free(void *p);
char *atshared_dup(const char *s);

static volatile int iterations = 5;
static char name[16];

int main(void)
{
    int n = iterations;

    snprintf(name, sizeof name, "shared-%d", n);
    for (int i = 0; i < n; i++) {
        unsigned char *p = atshared_alloc(40 + (size_t)i);
        if (p == NULL)
            return 1;
        sum(p, 40 + (size_t)i);
        free(p); /* @site free calls=5 bytes=0 */

        unsigned char *q = malloc(24 + (size_t)i); /* @site malloc calls=5 bytes=130 */
        if (q == NULL)
            return 1;
        for (size_t k = 0; k < 24 + (size_t)i; k++)
            q[k] = (unsigned char)(k + 3u * (unsigned)i + 1u);
        sum(q, 24 + (size_t)i);
        atshared_free(q);

        char *s = atshared_dup(name);
        if (s == NULL)
            return 1;
        sum(s, strlen(s) + 1);
        free(s); /* @site free calls=5 bytes=0 */
    }
    printf("uses_lib: iterations=%d checksum=%lu\n", n, checksum);
    return 0;
}
