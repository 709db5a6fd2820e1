// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
// run: round free
/*
 * server: a long-running program for live tests.
 *
 * Commands, one per line on stdin (or, if arguments are given, one per
 * argument instead of reading stdin; then the program exits after the
 * last one):
 *   round  does a fixed set of allocations and replies "done":
 *            malloc(100) x5, kept alive in a global list      (site 1)
 *            calloc(10, 8) x2, each freed immediately          (sites 2, 3)
 *            strdup("hello") x1 (6 bytes), freed immediately   (sites 4, 5)
 *   free   frees every block kept alive by earlier rounds      (site 6)
 *          and replies "freed"
 *   quit   exits with status 0 (so does end of input)
 *   other non-empty lines reply "unknown"
 *
 * per-round: the markers give calls/bytes for ONE "round" command; for the
 * site in the "free" handler they give the frees of the 5 blocks one round
 * kept alive. The "// run:" arguments (round free) are exactly one round
 * followed by one free, so the markers are also exact for that run.
 *
 * Robust against signals: read(2) and write(2) are retried on EINTR, and
 * replies are written with write(2) directly (no stdio buffering, i.e.
 * every reply is flushed as soon as it is made).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct node {
    struct node *next;
};

static struct node *kept;
static unsigned long kept_count;
static volatile int keep_n = 5;
static volatile int calloc_n = 2;
static unsigned long checksum;

static char inbuf[4096];
static size_t inlen;

__attribute__((noinline, noclone, noipa)) static const char *opaque(const char *s)
{
    return s;
}

__attribute__((noinline, noclone, noipa)) static void fill(void *p, size_t n, unsigned seed)
{
    unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        c[i] = (unsigned char)(seed + i * 31u + 1u);
}

__attribute__((noinline, noclone, noipa)) static void sum(const void *p, size_t n)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        checksum = checksum * 131u + c[i];
}

__attribute__((noinline, noclone, noipa)) static void write_all(const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = write(1, s, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            _exit(3);
        }
        s += w;
        n -= (size_t)w;
    }
}

__attribute__((noinline, noclone, noipa)) static void reply(const char *s)
{
    char line[64];
    size_t n = strlen(s);
    if (n > sizeof line - 2)
        n = sizeof line - 2;
    memcpy(line, s, n);
    line[n] = '\n';
    write_all(line, n + 1);
}

__attribute__((noinline, noclone, noipa, noreturn)) static void die(const char *why)
{
    write_all(why, strlen(why));
    write_all("\n", 1);
    _exit(1);
}

__attribute__((noinline, noclone, noipa)) static void do_round(void)
{
    int k = keep_n;
    for (int i = 0; i < k; i++) {
        struct node *nd = malloc(100); /* @site malloc calls=5 bytes=500 */
        if (nd == NULL)
            die("malloc failed");
        fill(nd, 100, (unsigned)i);
        nd->next = kept;
        kept = nd;
        kept_count++;
    }
    int c = calloc_n;
    for (int i = 0; i < c; i++) {
        unsigned char *z = calloc(10, 8); /* @site calloc calls=2 bytes=160 */
        if (z == NULL)
            die("calloc failed");
        sum(z, 80);
        free(z); /* @site free calls=2 bytes=0 */
    }
    char *s = strdup(opaque("hello")); /* @site strdup calls=1 bytes=6 */
    if (s == NULL)
        die("strdup failed");
    sum(s, 6);
    free(s); /* @site free calls=1 bytes=0 */
    reply("done");
}

__attribute__((noinline, noclone, noipa)) static void do_free(void)
{
    while (kept != NULL) {
        struct node *next = kept->next;
        free(kept); /* @site free calls=5 bytes=0 */
        kept = next;
        kept_count--;
    }
    reply("freed");
}

/* Returns 1 and the next line (without newline) in line, or 0 at end of
 * input. Retries on EINTR. */
static int read_line(char *line, size_t cap)
{
    for (;;) {
        char *nl = memchr(inbuf, '\n', inlen);
        if (nl != NULL || inlen == sizeof inbuf) {
            size_t n = nl != NULL ? (size_t)(nl - inbuf) : inlen;
            size_t used = nl != NULL ? n + 1 : n;
            size_t copy = n < cap - 1 ? n : cap - 1;
            memcpy(line, inbuf, copy);
            line[copy] = '\0';
            memmove(inbuf, inbuf + used, inlen - used);
            inlen -= used;
            return 1;
        }
        ssize_t r = read(0, inbuf + inlen, sizeof inbuf - inlen);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            die("read failed");
        }
        if (r == 0) {
            if (inlen == 0)
                return 0;
            size_t copy = inlen < cap - 1 ? inlen : cap - 1;
            memcpy(line, inbuf, copy);
            line[copy] = '\0';
            inlen = 0;
            return 1;
        }
        inlen += (size_t)r;
    }
}

/*
 * fork: the child replies "child PID" and carries on the conversation; the
 * parent waits for it, then exits with its status. No allocation. (Its
 * headers are here, below the marked lines the live tests name by number.)
 */
#include <stdio.h>
#include <sys/wait.h>

__attribute__((noinline, noclone, noipa)) static void do_fork(void)
{
    pid_t p = fork();
    if (p < 0)
        die("fork failed");
    if (p == 0) {
        char b[32];
        snprintf(b, sizeof b, "child %d", (int)getpid());
        reply(b);
        return;
    }
    int st = 0;
    while (waitpid(p, &st, 0) < 0)
        if (errno != EINTR)
            die("waitpid failed");
    exit(WIFEXITED(st) ? WEXITSTATUS(st) : 1);
}

/*
 * spread: three threads, each allocating and freeing 600 times (more
 * counted calls than a thread makes in shard 0 before it is given a shard
 * of its own), all alive until every one has (a barrier), then joined: for
 * a moment they hold three counter shards besides the main thread's.
 */
#include <pthread.h>

static pthread_barrier_t spread_barrier;
static void *volatile spread_block[3];

__attribute__((noinline, noclone, noipa)) static void *spread_one(void *arg)
{
    int i = (int)(long)arg;
    for (int k = 0; k < 600; k++) {
        spread_block[i] = malloc(24); /* @site malloc calls=0 bytes=0 */
        free(spread_block[i]); /* @site free calls=0 bytes=0 */
    }
    pthread_barrier_wait(&spread_barrier);
    return NULL;
}

static void do_spread(void)
{
    pthread_t t[3];
    pthread_barrier_init(&spread_barrier, NULL, 3);
    for (int i = 0; i < 3; i++)
        if (pthread_create(&t[i], NULL, spread_one, (void *)(long)i) != 0)
            die("pthread_create failed");
    for (int i = 0; i < 3; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&spread_barrier);
    reply("spread");
}

/* Returns 0 to go on, 1 to quit. */
static int command(char *cmd)
{
    size_t n = strlen(cmd);
    while (n > 0 && (cmd[n - 1] == '\r' || cmd[n - 1] == ' ' || cmd[n - 1] == '\t'))
        cmd[--n] = '\0';
    while (*cmd == ' ' || *cmd == '\t')
        cmd++;
    if (*cmd == '\0')
        return 0;
    if (strcmp(cmd, "round") == 0)
        do_round();
    else if (strcmp(cmd, "free") == 0)
        do_free();
    else if (strcmp(cmd, "fork") == 0)
        do_fork();
    else if (strcmp(cmd, "spread") == 0)
        do_spread();
    else if (strcmp(cmd, "quit") == 0)
        return 1;
    else
        reply("unknown");
    return 0;
}

int main(int argc, char **argv)
{
    char line[256];

    if (argc > 1) {
        for (int i = 1; i < argc; i++) {
            size_t n = strlen(argv[i]);
            if (n > sizeof line - 1)
                n = sizeof line - 1;
            memcpy(line, argv[i], n);
            line[n] = '\0';
            if (command(line))
                break;
        }
        return 0;
    }
    while (read_line(line, sizeof line))
        if (command(line))
            break;
    return 0;
}
