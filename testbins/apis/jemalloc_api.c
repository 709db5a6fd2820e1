// build: {cc} -O2 -g {pie} {src} -o {out} -ljemalloc
/* jemalloc's own API called directly (Debian libjemalloc-dev): each call is
   a site with no option, and its calls, bytes and what is live at exit
   (live=OBJECTS,BYTES) are exact. The 8-byte objects share 32-byte
   granules (jemalloc's smallest class), half of them freed. */
#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <string.h>

#define N 1000

static void *keep[N];
static void *volatile sink;

int main(void) {
    unsigned long sum = 0;
    for (int i = 0; i < N; i++) {
        keep[i] = mallocx(8, 0); /* @site mallocx calls=1000 bytes=8000 live=500,4000 */
        memset(keep[i], i & 0x7f, 8);
    }
    for (int i = 0; i < N; i += 2) {
        sum += ((unsigned char *)keep[i])[3];
        dallocx(keep[i], 0); /* @site dallocx calls=500 */
    }
    for (int i = 0; i < 100; i++) {
        char *p = mallocx(100, MALLOCX_ZERO); /* @site mallocx calls=100 bytes=10000 live=0,0 */
        p[7] = (char)i;
        p = rallocx(p, 3000, 0); /* @site rallocx calls=100 bytes=300000 live=0,0 */
        sum += (unsigned char)p[7];
        sdallocx(p, 3000, 0); /* @site sdallocx calls=100 */
    }
    for (int i = 0; i < 10; i++) {
        void *q = mallocx(64, MALLOCX_ALIGN(64)); /* @site mallocx calls=10 bytes=640 live=3,192 */
        sum += (unsigned long)q & 63;
        if (i < 7)
            sdallocx(q, 64, MALLOCX_ALIGN(64)); /* @site sdallocx calls=7 */
        else
            sink = q;
    }
    printf("jemalloc api: sum %lu\n", sum);
    return 0;
}
