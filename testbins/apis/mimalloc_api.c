// build: {cc} -O2 -g {pie} {src} -o {out} -lmimalloc
/* mimalloc's own API called directly (Debian libmimalloc-dev): each call is
   a site with no option, and its calls, bytes and what is live at exit
   (live=OBJECTS,BYTES) are exact. mimalloc puts 8- and 16-byte objects
   side by side. */
#include <mimalloc.h>
#include <stdio.h>
#include <string.h>

#define N 1000

static void *keep[N];
static void *volatile sink;

int main(void) {
    unsigned long sum = 0;
    for (int i = 0; i < N; i++) {
        keep[i] = mi_malloc(16); /* @site mi_malloc calls=1000 bytes=16000 live=250,4000 */
        memset(keep[i], i & 0x7f, 16);
    }
    for (int i = 0; i < N; i++) {
        if (i % 4 == 0)
            continue;
        sum += ((unsigned char *)keep[i])[5];
        if (i % 4 == 1)
            mi_free(keep[i]); /* @site mi_free calls=250 */
        else
            mi_free_size(keep[i], 16); /* @site mi_free_size calls=500 */
    }
    for (int i = 0; i < 50; i++) {
        int *a = mi_calloc(10, 12); /* @site mi_calloc calls=50 bytes=6000 live=0,0 */
        char *z = mi_zalloc(40); /* @site mi_zalloc calls=50 bytes=2000 live=10,400 */
        a = mi_realloc(a, 2000); /* @site mi_realloc calls=50 bytes=100000 live=0,0 */
        sum += (unsigned long)a[3] + (unsigned char)z[39];
        mi_free(a); /* @site mi_free calls=50 */
        if (i < 40)
            mi_free(z); /* @site mi_free calls=40 */
        else
            sink = z;
    }
    char *s = mi_strdup("a string of 26 characters."); /* @site mi_strdup calls=1 bytes=27 live=1,27 */
    sum += (unsigned char)s[3];
    void *al = mi_malloc_aligned(100, 256); /* @site mi_malloc_aligned calls=1 bytes=100 live=0,0 */
    sum += (unsigned long)al & 255;
    mi_free_aligned(al, 256); /* @site mi_free_aligned calls=1 */
    void *n = mi_new_n(6, 11); /* @site mi_new_n calls=1 bytes=66 live=1,66 */
    sink = n;
    mi_heap_t *h = mi_heap_get_default();
    for (int i = 0; i < 3; i++) {
        void *p = mi_heap_malloc(h, 200); /* @site mi_heap_malloc calls=3 bytes=600 live=0,0 */
        p = mi_heap_realloc(h, p, 300); /* @site mi_heap_realloc calls=3 bytes=900 live=2,600 */
        if (i == 0)
            mi_free(p); /* @site mi_free calls=1 */
        else
            sink = p;
    }
    /* Objects 4 past a 32-byte boundary (p + 4 aligned), alone in their
       granule of the shadow map: their frees find no record there. */
    for (int i = 0; i < 100; i++) {
        unsigned char *p = mi_malloc_aligned_at(24, 32, 4); /* @site mi_malloc_aligned_at calls=100 bytes=2400 live=50,1200 */
        sum += (unsigned long)p & 31;
        p[0] = (unsigned char)i;
        if (i % 2 == 0)
            mi_free(p); /* @site mi_free calls=50 */
        else
            sink = p;
    }
    printf("mimalloc api: sum %lu\n", sum);
    return 0;
}
