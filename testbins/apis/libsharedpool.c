// build: {cc} -O2 -g -fPIC -shared {src} -o {out}
// output: libsharedpool.so
/* A library's pool, exported (pool_alloc, pool_free: the user names them)
   and in a table of operations the library hands out (pool_ops) and uses
   itself (pool_churn): calls through the table, from the program or from
   the library, are seen only at the functions' entry hooks, and count on
   their rows here; the program's calls through the PLT count at its
   sites only (they raise the depth that the hooks check). */
#include <stddef.h>

#define BLOCK 64
#define BLOCKS 4096

struct ops {
    void *(*alloc)(size_t);
    void (*free)(void *);
};

static unsigned char arena[BLOCKS * BLOCK] __attribute__((aligned(64)));
static size_t used;
static void *free_list;

__attribute__((noinline, noipa)) void *pool_alloc(size_t n)
{
    if (n > BLOCK) /* @site pool_alloc calls=1000 bytes=24000 live=0,0 */
        return NULL;
    void *p = free_list;
    if (p != NULL)
        free_list = *(void **)p;
    else if (used + BLOCK <= sizeof arena) {
        p = arena + used;
        used += BLOCK;
    }
    return p;
}

__attribute__((noinline, noipa)) void pool_free(void *p)
{
    if (p == NULL) /* @site pool_free calls=1250 */
        return;
    *(void **)p = free_list;
    free_list = p;
}

static const struct ops table = {pool_alloc, pool_free};
static const struct ops *volatile ops = &table;

const struct ops *pool_ops(void)
{
    return ops;
}

/* n objects of 16 bytes through the table, then freed through it. */
void pool_churn(int n, void **scratch)
{
    for (int i = 0; i < n; i++)
        scratch[i] = ops->alloc(16);
    for (int i = 0; i < n; i++)
        ops->free(scratch[i]);
}
