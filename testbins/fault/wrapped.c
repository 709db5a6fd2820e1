// build: {cc} -g -O2 {pie} -Wall -Werror {src} -o {out}
/*
 * wrapped: allocation through wrappers, for fault injection. xmalloc dies
 * with a message when malloc fails (git's shape: its callers W1 and W2
 * are counted with xmalloc's size); new_node allocates a constant size
 * and returns NULL on failure (a hook: its callers H1 and H2 take what it
 * allocates). xmalloc is also called through a pointer (P), so that its
 * malloc is a site that counts only when no caller's site does; xcalloc
 * (called at X) is not, so its calloc is no site. Failing a call of a
 * wrapper fails the allocation inside it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct node {
    struct node *next;
    long value[6];
};

static void *volatile sink;
static void *xmalloc(size_t n);
static void *(*volatile through_pointer)(size_t) = xmalloc;

__attribute__((noinline)) static void *xmalloc(size_t n)
{
    void *p = malloc(n);
    if (p == NULL) {
        fprintf(stderr, "fatal: out of memory allocating %zu bytes\n", n);
        exit(128);
    }
    return p;
}

__attribute__((noipa)) static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n, size);
    if (p == NULL) {
        fprintf(stderr, "fatal: out of memory allocating %zu x %zu bytes\n", n, size);
        exit(128);
    }
    return p;
}

__attribute__((noinline)) static struct node *new_node(long v)
{
    struct node *n = malloc(sizeof *n);
    if (n == NULL) {
        fputs("new_node: no memory\n", stderr);
        return NULL;
    }
    memset(n, 0, sizeof *n);
    n->value[0] = v;
    return n;
}

int main(void)
{
    char *a = xmalloc(100); /* W1 */
    strcpy(a, "W1: ok");
    puts(a);
    fflush(stdout);
    char *b = xmalloc(200); /* W2 */
    strcpy(b, "W2: ok");
    puts(b);
    char *c = through_pointer(50); /* P */
    strcpy(c, "P: ok");
    puts(c);
    long *x = xcalloc(4, sizeof *x); /* X */
    x[3] = 3;
    printf("X: %ld\n", x[3] + x[0]);
    struct node *n1 = new_node(1); /* H1 */
    struct node *n2 = new_node(2); /* H2 */
    printf("H1: %s\n", n1 ? "ok" : "NULL, handled");
    printf("H2: %s\n", n2 ? "ok" : "NULL, handled");
    sink = n1;
    sink = n2;
    free(n1);
    free(n2);
    free(a);
    free(b);
    free(c);
    free(x);
    return 0;
}
