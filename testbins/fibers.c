// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
/*
 * fibers: a hook's call left on a stack the program then unmaps. A fiber
 * (ucontext) calls the hook `make_node`, whose callback switches back to
 * main while the call is under way; main unmaps that fiber's stack without
 * unwinding it, as coroutine libraries destroy a suspended coroutine, then
 * runs a second fiber on a stack below the first one's. There, a hook call
 * (round 0) or a site inside `make_node` reached through a function
 * pointer (round 1) checks whether the first fiber's hook call is still
 * under way by reading the word below its stack pointer, which is no
 * longer mapped: the check finds the charge stale, as after a longjmp, and
 * the program runs as the original. Stacks, from the top of one mapping:
 * round 0 leaves its hook on the fourth and runs on the third, round 1 on
 * the second and the first.
 *
 * Arguments: `crash`: the program then faults (writing through NULL) and
 * ends by SIGSEGV, as the original does. `handler crash` and `handler
 * kill`: it first installs a SIGSEGV handler of its own (SA_SIGINFO |
 * SA_RESETHAND), says "ready" and waits for a line on stdin (the test
 * switches profiling on meanwhile, so the runtime's handler comes after
 * the program's), then runs the rounds, and faults (the handler reports
 * the fault once; the fault comes again and ends the program) or sends
 * itself SIGSEGV (the handler reports its code, and the program exits 0).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include "common.h"

#define WRAPPER __attribute__((noinline, noclone, noipa))
#define STACK (64 * 1024)

struct node {
    struct node *next;
    long v[2];
};

__attribute__((noreturn, noinline, noclone, noipa)) static void die(const char *what)
{
    fprintf(stderr, "fibers: %s failed\n", what);
    exit(2);
}

/* @wrapper make_node alloc */
WRAPPER struct node *make_node(long v, void (*then)(void))
{
    struct node *n = malloc(sizeof *n); /* @site malloc calls=4 bytes=96 live=2 live_bytes=48 under=1,24 */
    if (n == NULL)
        die("malloc");
    n->next = NULL;
    n->v[0] = v;
    n->v[1] = -v;
    if (then != NULL)
        then();
    return n;
}

static struct node *(*volatile node_fn)(long, void (*)(void)) = make_node;

static ucontext_t main_ctx, first_ctx, second_ctx;

__attribute__((noinline, noclone, noipa)) static void back_to_main(void)
{
    if (swapcontext(&first_ctx, &main_ctx) != 0)
        die("swapcontext");
    die("resuming a destroyed fiber");
}

static int round;

static void caught(int sig, siginfo_t *info, void *ctx)
{
    (void)ctx;
    char line[64];
    int n = snprintf(line, sizeof line, "caught %d code %d\n", sig, info->si_code);
    if (write(1, line, (size_t)n) != n)
        _exit(3);
}

static void first(void)
{
    struct node *n = make_node(1, back_to_main); /* @hook make_node calls=2 bytes=48 live=2 live_bytes=48 */
    sum(n, sizeof *n);
}

static void second(void)
{
    struct node *a;
    if (round == 0)
        a = make_node(3, NULL); /* @hook make_node calls=1 bytes=24 */
    else
        a = node_fn(2, NULL);
    sum(a->v, sizeof a->v);
    free(a); /* @site free calls=2 bytes=0 */
    sum(&round, sizeof round);
}

static void start(ucontext_t *ctx, char *stack, void (*f)(void))
{
    if (getcontext(ctx) != 0)
        die("getcontext");
    ctx->uc_stack.ss_sp = stack;
    ctx->uc_stack.ss_size = STACK;
    ctx->uc_link = &main_ctx;
    makecontext(ctx, f, 0);
    if (swapcontext(&main_ctx, ctx) != 0)
        die("swapcontext");
}

int main(int argc, char **argv)
{
    int handler = argc > 1 && strcmp(argv[1], "handler") == 0;
    if (handler) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = caught;
        sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGSEGV, &sa, NULL) != 0)
            die("sigaction");
        printf("ready\n");
        fflush(stdout);
        char line[16];
        if (fgets(line, sizeof line, stdin) == NULL)
            die("reading stdin");
    }
    char *stacks = mmap(NULL, 4 * STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stacks == MAP_FAILED)
        die("mmap");
    for (round = 0; round < 2; round++) {
        char *upper = stacks + (3 - 2 * round) * STACK;
        start(&first_ctx, upper, first);
        if (munmap(upper, STACK) != 0)
            die("munmap");
        start(&second_ctx, upper - STACK, second);
    }
    printf("fibers: checksum %lu\n", checksum);
    fflush(stdout);
    const char *what = argc > 1 ? argv[argc - 1] : "";
    if (strcmp(what, "kill") == 0)
        kill(getpid(), SIGSEGV);
    else if (strcmp(what, "crash") == 0)
        *(volatile char *)argv[argc] = 0; /* argv[argc] is NULL */
    return 0;
}
