// build: {cc} -O2 -g {pie} {src} -o {out} -L{dir} -l:libsharedpool.so -Wl,-rpath,{dir}
/* The program of testbins/apis/libsharedpool.c (built first): it calls the
   library's pool through the PLT (its sites) and through the library's
   table. Patched with the library, with the same entries, every call
   counts once: through the PLT at the program's sites, through the table
   at the library's entry hooks (the markers there). */
#include <stdio.h>
#include <stdlib.h>

struct ops {
    void *(*alloc)(size_t);
    void (*free)(void *);
};

void *pool_alloc(size_t);
void pool_free(void *);
const struct ops *pool_ops(void);
void pool_churn(int n, void **scratch);

#define N 1000

int main(void)
{
    static void *keep[N], *scratch[500];
    unsigned long sum = 0, kept = 0;
    const struct ops *ops = pool_ops();
    for (int i = 0; i < N; i++) {
        unsigned char *a = pool_alloc(24); /* @site pool_alloc calls=1000 bytes=24000 live=250,6000 */
        unsigned char *b = i % 2 ? ops->alloc(32) : NULL;
        if (a == NULL)
            return 1;
        a[0] = (unsigned char)i;
        sum += a[0];
        if (b != NULL) {
            b[0] = 1;
            pool_free(b); /* @site pool_free calls=500 */
        } else {
            pool_free(NULL); /* @site pool_free calls=500 */
        }
        if (i % 4 != 0)
            ops->free(a);
        else
            keep[kept++] = a;
    }
    pool_churn(500, scratch);
    for (unsigned long k = 0; k < kept; k++)
        sum += ((unsigned char *)keep[k])[0];
    printf("sum %lu kept %lu\n", sum, kept);
    return 0;
}
