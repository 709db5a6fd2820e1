// build: {cc} -g {opt} -fPIC -shared {extra} -Wall -Werror {src} -o {out} -Wl,-soname,liblive.so
// output: liblive.so
/*
 * liblive: a library whose objects live on in the program that loads it,
 * and which frees the program's objects. Markers give the figures at the
 * exit of one run of `live` (the program that needs it); live=N
 * live_bytes=B are the objects of a site still allocated at exit.
 *   live_make(100 + i), i = 0..9: 10 objects; live frees 6 of them, keeps
 *     i = 6..9 (106 + 107 + 108 + 109 = 430 bytes)
 *   live_drop(p): frees 8 objects live malloc'ed (and one NULL: not a free)
 *   live_label(i) for i = 0..2: strdup("label-i"), 8 bytes each; live keeps
 *     the one of i = 2
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__attribute__((noinline, noclone, noipa)) static void fill(void *p, size_t n)
{
    unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        c[i] = (unsigned char)(i * 13u + 5u);
}

void *live_make(size_t n) /* @wrapper live_make alloc */
{
    void *p = malloc(n); /* @site malloc calls=10 bytes=1045 live=4 live_bytes=430 */
    if (p != NULL)
        fill(p, n);
    return p;
}

void live_drop(void *p) /* @wrapper live_drop free */
{
    free(p); /* @site free tail calls=9 bytes=0 untracked=0 */
}

char *live_label(int i) /* @wrapper live_label alloc */
{
    char buf[16];
    snprintf(buf, sizeof buf, "label-%d", i);
    return strdup(buf); /* @site strdup calls=3 bytes=24 live=1 live_bytes=8 */
}
