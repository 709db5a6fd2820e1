// build: {cxx} -O2 -g -std=c++17 {pie} {src} -o {out} -ltcmalloc
/* gperftools' tcmalloc API called directly (Debian libgoogle-perftools-dev):
   each call is a site with no option, and its calls, bytes and what is live
   at exit (live=OBJECTS,BYTES) are exact. tcmalloc puts 8-byte objects side
   by side. */
#include <gperftools/tcmalloc.h>
#include <cstdio>
#include <cstring>
#include <new>

#define N 1000

static void *keep[N];
static void *volatile sink;

int main() {
    unsigned long sum = 0;
    for (int i = 0; i < N; i++) {
        keep[i] = tc_malloc(8); /* @site tc_malloc calls=1000 bytes=8000 live=100,800 */
        std::memset(keep[i], i & 0x7f, 8);
    }
    for (int i = 100; i < N; i++) {
        sum += static_cast<unsigned char *>(keep[i])[2];
        if (i & 1)
            tc_free(keep[i]); /* @site tc_free calls=450 */
        else
            tc_free_sized(keep[i], 8); /* @site tc_free_sized calls=450 */
    }
    for (int i = 0; i < 20; i++) {
        int *a = static_cast<int *>(tc_calloc(5, 12)); /* @site tc_calloc calls=20 bytes=1200 live=0,0 */
        a = static_cast<int *>(tc_realloc(a, 1500)); /* @site tc_realloc calls=20 bytes=30000 live=0,0 */
        sum += static_cast<unsigned>(a[4]);
        tc_free(a); /* @site tc_free calls=20 */
        void *m = nullptr;
        if (tc_posix_memalign(&m, 128, 200) == 0) /* @site tc_posix_memalign calls=20 bytes=4000 live=5,1000 */
            sum += reinterpret_cast<unsigned long>(m) & 127;
        if (i < 15)
            tc_free(m); /* @site tc_free calls=15 */
        else
            sink = m;
        char *n = static_cast<char *>(tc_new(48)); /* @site tc_new calls=20 bytes=960 live=0,0 */
        n[47] = static_cast<char>(i);
        sum += static_cast<unsigned char>(n[47]);
        tc_delete_sized(n, 48); /* @site tc_delete_sized calls=20 */
        void *arr = tc_newarray(300); /* @site tc_newarray calls=20 bytes=6000 live=20,6000 */
        sink = arr;
        void *al = tc_new_aligned(64, std::align_val_t(64)); /* @site tc_new_aligned calls=20 bytes=1280 live=0,0 */
        sum += reinterpret_cast<unsigned long>(al) & 63;
        tc_delete_aligned(al, std::align_val_t(64)); /* @site tc_delete_aligned calls=20 */
    }
    std::printf("tcmalloc api: sum %lu\n", sum);
    return 0;
}
