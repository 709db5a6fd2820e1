// Call chains through a hook's call: `build` is a hook (its malloc's size
// is a constant), and calls back into `visit` while its call is under
// way; visit's malloc site is not inside a hooked function, so it counts
// its own calls, and its chains pass through build's frame and the hook's
// trampoline back to the hook's caller. `@frame NAME` marks the calls they
// pass through (cli/tests/callers.rs):
//   cb <- hook <- main <- libc    3 calls, 16 + 17 + 18 = 51 bytes
// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
#include <stdlib.h>
#include <stdio.h>

#include "common.h"

#define WRAPPER __attribute__((noinline, noclone, noipa))

struct node {
    struct node *next;
    long v[2];
};

static void *kept[6];

__attribute__((noinline, noclone, noipa)) static void visit(long v)
{
    char *p = malloc(16 + (size_t)v); /* @site malloc calls=3 bytes=51 live=0 live_bytes=0 */
    fill(p, 16 + (size_t)v, (unsigned)v);
    kept[v] = p;
}

/* @wrapper build alloc */
WRAPPER struct node *build(long v, void (*cb)(long))
{
    struct node *n = malloc(sizeof *n); /* @site malloc calls=3 bytes=72 live=0 live_bytes=0 under=0,0 */
    if (n == NULL)
        abort();
    n->next = NULL;
    n->v[0] = v;
    n->v[1] = -v;
    cb(v); /* @frame cb */
    return n;
}

__attribute__((noinline, noclone, noipa)) static void run(void)
{
    for (long v = 0; v < 3; v++) {
        struct node *n = build(v, visit); /* @hook build calls=3 bytes=72 */ /* @frame hook */
        sum(n, sizeof *n);
        kept[3 + v] = n;
    }
}

int main(void)
{
    run(); /* @frame main */
    for (int i = 0; i < 3; i++)
        sum(kept[i], 16 + (size_t)i);
    for (int i = 0; i < 6; i++)
        free(kept[i]); /* @site free calls=6 bytes=0 */
    printf("callers_hook: checksum %lu\n", checksum);
    return 0;
}
