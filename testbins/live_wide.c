// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
// counts: variable
/*
 * live_wide: objects of 1 KiB or more, which the shadow map describes
 * with two entries (the record, and the size in the next granule's
 * entry), freed at patched sites and freed unseen (through a function
 * pointer) with their memory handed out again by glibc's malloc: at the
 * same address, at the next 32-byte granule, and over small objects that
 * were freed unseen; objects of 0 bytes where wide ones were and next to
 * live ones; wide objects grown and shrunk by realloc.
 *
 * Prints "reuse NAME yes|no" for each address it expects malloc to hand
 * back (the scenario took place), then, as live_stress, what it still
 * holds ("held OBJECTS BYTES", "site LINE OBJECTS BYTES") and exits
 * without freeing it. Nothing is printed before the end: stdio's buffer
 * would change the heap's layout.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void (*volatile release)(void *) = free;
static void *(*volatile unseen_malloc)(size_t) = malloc;

enum { LINES = 256 };
static unsigned long per_objects[LINES], per_bytes[LINES];
static unsigned long objects, bytes;
static const char *reuse_name[16];
static int reuse_ok[16];
static int reuses;

static void hold(void *p, size_t n, int line)
{
    if (p == NULL)
        abort();
    objects++;
    bytes += n;
    per_objects[line % LINES]++;
    per_bytes[line % LINES] += n;
}

static void expect(const char *name, int ok)
{
    reuse_name[reuses] = name;
    reuse_ok[reuses++] = ok;
}

/* Small chunks made untracked until one is at `at` (small chunks
 * something freed before main come first). */
__attribute__((noinline)) static char *unseen_small_at(char *at)
{
    char *x;
    int tries = 0;
    do
        x = unseen_malloc(8);
    while (x != at && ++tries < 64);
    return x;
}

int main(void)
{
    /* Each scenario starts with the heap's free memory all at its top
     * (or in chunks it leaves behind for the next to take), so that the
     * addresses it expects are the ones malloc hands out. */

    /* A wide object freed unseen, then an object 32 bytes in (the next
     * granule, where its size is kept) made by a tracked call, after an
     * untracked one took its first 32 bytes. */
    char *e = malloc(3000); /* @site malloc */
    release(e);
    char *x = unseen_small_at(e);
    char *y = malloc(8); /* @site malloc */
    hold(y, 8, __LINE__ - 1);
    expect("next-granule", x == e && y == e + 32);

    /* A wide object freed unseen, its address handed out again to a
     * wide one: the new record replaces the old, charged as freed. */
    char *a = malloc(4000); /* @site malloc */
    memset(a, 1, 16);
    release(a);
    char *b = malloc(4000); /* @site malloc */
    hold(b, 4000, __LINE__ - 1);
    expect("same-address", a == b);

    /* The same, with a small object at the address. */
    char *c = malloc(3000); /* @site malloc */
    release(c);
    char *d = malloc(100); /* @site malloc */
    hold(d, 100, __LINE__ - 1);
    expect("small-at-wide", c == d);

    /* A wide object freed at a patched site, then objects of 0 bytes
     * where it was (its extension was cleared) and next to a live one. */
    char *w = malloc(4000); /* @site malloc */
    free(w); /* @site free */
    char *z0 = malloc(0); /* @site malloc */
    hold(z0, 0, __LINE__ - 1);
    expect("empty-at-wide", z0 == w);
    char *q0 = malloc(0); /* @site malloc */
    char *q1 = malloc(8); /* @site malloc */
    hold(q1, 8, __LINE__ - 1);
    expect("empty-before-live", q1 == q0 + 32);
    free(q0); /* @site free */

    /* Two small objects freed unseen into the fast bins (the cache of
     * their size full), which a wide request consolidates: the wide
     * object starts at the first and covers the second, whose record is
     * in the granule where the wide record keeps its size. */
    char *small[8];
    for (int i = 0; i < 8; i++)
        small[i] = malloc(8); /* @site malloc */
    char *fence = malloc(8); /* @site malloc */
    hold(fence, 8, __LINE__ - 1);
    char *big = malloc(4000); /* @site malloc */
    char *guard = malloc(8); /* @site malloc */
    hold(guard, 8, __LINE__ - 1);
    free(big); /* @site free */
    char *n0 = malloc(8); /* @site malloc */
    char *n1 = malloc(8); /* @site malloc */
    for (int i = 0; i < 8; i++)
        free(small[i]); /* @site free */
    release(n0);
    release(n1);
    char *v = malloc(2000); /* @site malloc */
    hold(v, 2000, __LINE__ - 1);
    expect("wide-over-small", n0 == big && n1 == n0 + 32 && v == n0);

    /* Wide objects through realloc: grown, moved, shrunk to small, and
     * small grown to wide. */
    char *r = malloc(2000); /* @site malloc */
    r = realloc(r, 6000); /* @site realloc */
    char *s = malloc(1500); /* @site malloc */
    s = realloc(s, 40); /* @site realloc */
    hold(s, 40, __LINE__ - 1);
    char *t = malloc(40); /* @site malloc */
    t = realloc(t, 5000); /* @site realloc */
    hold(t, 5000, __LINE__ - 1);
    free(r); /* @site free */

    /* Many at once, freed in another order than made. */
    enum { MANY = 1000 };
    static char *many[MANY];
    int many_line = 0;
    for (int i = 0; i < MANY; i++) {
        many[i] = malloc(1024 + (size_t)i * 7); /* @site malloc */
        many_line = __LINE__ - 1;
    }
    for (int i = 0; i < MANY; i += 2)
        free(many[i]); /* @site free */
    for (int i = 1; i < MANY; i += 4) {
        free(many[i]); /* @site free */
        many[i] = NULL;
    }
    for (int i = 3; i < MANY; i += 4)
        hold(many[i], 1024 + (size_t)i * 7, many_line);

    for (int i = 0; i < reuses; i++)
        printf("reuse %s %s\n", reuse_name[i], reuse_ok[i] ? "yes" : "no");
    printf("held %lu %lu\n", objects, bytes);
    for (int l = 0; l < LINES; l++)
        if (per_objects[l] != 0)
            printf("site %d %lu %lu\n", l, per_objects[l], per_bytes[l]);
    return 0;
}
