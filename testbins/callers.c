// Call chains (callers capture): one malloc site reached through three
// chains, one free site. `@frame NAME` marks the calls the chains pass
// through (cli/tests/callers.rs): the malloc site's chains are
//   a     <- main1 <- libc   3 calls, 48 bytes
//   b     <- main2 <- libc   5 calls, 160 bytes
//   a     <- main3 <- libc   3 calls, 48 bytes
// Every call to leaf and sink is followed by more code, so none is a tail
// call at -O2.
// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
#include <stdlib.h>

static void *keep[64];
static int nkeep;

__attribute__((noinline, noclone, noipa)) static void sink(void)
{
    __asm__ volatile("" ::: "memory");
}

__attribute__((noinline, noclone, noipa)) static void leaf(size_t n)
{
    keep[nkeep++ % 64] = malloc(n); /* @site malloc calls=11 bytes=256 live=0 live_bytes=0 */
}

__attribute__((noinline, noclone, noipa)) static void from_a(void)
{
    for (int i = 0; i < 3; i++)
        leaf(16); /* @frame a */
    sink();
}

__attribute__((noinline, noclone, noipa)) static void from_b(void)
{
    for (int i = 0; i < 5; i++)
        leaf(32); /* @frame b */
    sink();
}

int main(void)
{
    from_a(); /* @frame main1 */
    from_b(); /* @frame main2 */
    from_a(); /* @frame main3 */
    for (int i = 0; i < nkeep; i++)
        free(keep[i]); /* @site free calls=11 bytes=0 untracked=0 */
    sink();
    return 0;
}
