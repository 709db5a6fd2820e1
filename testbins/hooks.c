// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
/*
 * hooks: allocation wrappers whose callers cannot be charged by size, because
 * the size is not one of their arguments (a constant, or computed), so that
 * a call to one is a hook (as the kernel's alloc_hooks()): the outermost
 * such call on a thread takes what the sites inside allocate during it,
 * each with its own size.
 *   xmalloc: a die-on-NULL wrapper whose callers are charged by size;
 *   new_node: xmalloc(sizeof (struct node)), a constant: a hook;
 *   dup_n: malloc(strnlen(s, max) + 1), computed: a hook;
 *   new_list: new_node k times, returns the first: a hook around hooks;
 *   checked_node: new_node, or frees it and longjmp()s out when asked: a
 *     hook that can be left without returning.
 * Two threads (main and one more) each run work(), 5 iterations (i = 0..4):
 *   a = new_node(i)             5 calls,  120 bytes
 *   kept[i] = new_node(100 + i) 5 calls,  120 bytes, live at exit
 *   s = dup_n(TEXT, 5 + i)      5 calls,  6+7+8+9+10 = 40 bytes
 *   l = new_list(i + 1)         15 calls, 360 bytes
 *   f = node_fn(7)              new_node through a function pointer: its
 *                               call of xmalloc counts (5 calls, 120 bytes)
 *   t = xmalloc(10 + i)         5 calls,  60 bytes
 * Main first: checked_node(3), then checked_node(-1), which longjmps out.
 *
 * `@site` markers give what each allocator call counts where it is made
 * (`--no-charge-callers`); `@charged` a call of a wrapper charged by size;
 * `@hook` a hook's figures; `under=CALLS,BYTES` what a site inside a hook
 * counts itself (reached without one). Sites inside xmalloc are `inside`.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define WRAPPER __attribute__((noinline, noclone, noipa))
#define ITERATIONS 5

static volatile int iterations = ITERATIONS;

struct node {
    struct node *next;
    long v[2];
};

__attribute__((noreturn, noinline, noclone, noipa)) static void die(const char *what)
{
    fprintf(stderr, "hooks: out of memory in %s\n", what);
    exit(2);
}

/* @wrapper xmalloc alloc */
WRAPPER void *xmalloc(size_t n)
{
    void *p = malloc(n); /* @site malloc calls=72 bytes=1608 live=10 live_bytes=240 inside */
    if (p == NULL)
        die("xmalloc");
    return p;
}

/* @wrapper new_node alloc */
WRAPPER struct node *new_node(long v)
{
    struct node *n = xmalloc(sizeof *n); /* @charged xmalloc calls=10 bytes=240 under=10,240 */
    n->next = NULL;
    n->v[0] = v;
    n->v[1] = -v;
    return n;
}

/* @wrapper dup_n alloc */
WRAPPER char *dup_n(const char *s, size_t max)
{
    size_t len = strnlen(s, max);
    char *p = malloc(len + 1); /* @site malloc calls=10 bytes=80 under=0,0 */
    if (p == NULL)
        die("dup_n");
    memcpy(p, s, len);
    p[len] = 0;
    return p;
}

/* @wrapper new_list alloc */
WRAPPER struct node *new_list(int k)
{
    struct node *head = new_node(0); /* @hook new_node */
    for (int i = 1; i < k; i++) {
        struct node *n = new_node(i); /* @hook new_node */
        n->next = head->next;
        head->next = n;
    }
    return head;
}

static jmp_buf out;

/* @wrapper checked_node alloc */
WRAPPER struct node *checked_node(long v)
{
    struct node *n = new_node(v); /* @hook new_node */
    if (v < 0) {
        free(n); /* @site free calls=1 bytes=0 */
        longjmp(out, 1);
    }
    return n;
}

/* new_node's address is taken: it can be reached without a hook. */
static struct node *(*volatile node_fn)(long) = new_node;

/* The second thread runs alongside main and reads what it allocates
 * without adding it to the checksum (whose order would then vary). */
static __thread int quiet;

__attribute__((noinline, noclone, noipa)) static void look(const void *p, size_t n)
{
    if (!quiet)
        sum(p, n);
}

__attribute__((noinline, noclone, noipa)) static void free_list(struct node *l)
{
    for (struct node *e = l; e != NULL; e = e->next)
        look(e->v, sizeof e->v);
    while (l != NULL) {
        struct node *next = l->next;
        free(l); /* @site free calls=30 bytes=0 */
        l = next;
    }
}

static const char TEXT[] = "hooks and wrappers";

static void *work(void *arg)
{
    quiet = arg != NULL;
    struct node *kept[ITERATIONS];
    int n = iterations;
    for (int i = 0; i < n; i++) {
        struct node *a = new_node(i); /* @hook new_node calls=10 bytes=240 */
        kept[i] = new_node(100 + i); /* @hook new_node calls=10 bytes=240 live=10 live_bytes=240 */
        char *s = dup_n(TEXT, 5 + (size_t)i); /* @hook dup_n calls=10 bytes=80 */
        struct node *l = new_list(i + 1); /* @hook new_list calls=30 bytes=720 */
        struct node *f = node_fn(7);
        char *t = xmalloc(10 + (size_t)i); /* @charged xmalloc calls=10 bytes=120 */
        memset(t, i, 10 + (size_t)i);
        look(a, sizeof *a);
        look(s, strlen(s) + 1);
        look(f, sizeof *f);
        look(t, 10 + (size_t)i);
        free(a); /* @site free calls=10 bytes=0 */
        free(s); /* @site free calls=10 bytes=0 */
        free(f); /* @site free calls=10 bytes=0 */
        free(t); /* @site free calls=10 bytes=0 */
        free_list(l);
    }
    for (int i = 0; i < n; i++)
        look(kept[i], sizeof *kept[i]);
    return arg;
}

int main(void)
{
    struct node *c = checked_node(3); /* @hook checked_node calls=1 bytes=24 */
    sum(c, sizeof *c);
    free(c); /* @site free calls=1 bytes=0 */
    if (setjmp(out) == 0)
        checked_node(-1); /* @hook checked_node calls=1 bytes=24 */

    pthread_t t;
    if (pthread_create(&t, NULL, work, (void *)1) != 0)
        die("pthread_create");
    work(NULL);
    pthread_join(t, NULL);
    printf("hooks: checksum %lu\n", checksum);
    return 0;
}
