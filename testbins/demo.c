// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
// run: serve 100
/*
 * demo: the example program of `alloctramp demo` (the command embeds this
 * file, compiles it, patches it and profiles it while it runs): a small
 * request handler with a cache, and a leak.
 *
 * Commands, one per line on stdin (or one per argument; then the program
 * exits after the last one):
 *   serve N   handles N requests, replies "served N"
 *   quit      exits with status 0 (so does end of input)
 *   other non-empty lines reply "unknown"
 *
 * Request number r (counted from 0 over the program's life):
 *   read_request   malloc(4096) request buffer, freed when the request ends
 *   parse_key      strdup of the key "user-NNNN" (10 bytes), freed at the end
 *   cache_store    calloc(1, 64 * (1 + r % 4)) stored in slot r % 16 of the
 *                  cache; the slot's previous value is freed (free(NULL) for
 *                  the first 16 requests)
 *   open_session   every 10th request (r % 10 == 0): malloc(1024), never
 *                  freed: the leak
 *   render         malloc(32), grown with realloc to 256, freed at the end
 *
 * The markers count one run with the "// run:" arguments (requests 0..99).
 * @demo-live markers give what stays allocated at each site after requests
 * 100..199 when profiling (with live tracking) is switched on after request
 * 99, as `alloctramp demo` does: the 10 sessions of those requests and the
 * 16 cache values of requests 184..199 (4 x (64 + 128 + 192 + 256) bytes).
 *
 * Replies are written with write(2) directly and read(2)/write(2) are
 * retried on EINTR, so the control signal does not disturb the program.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CACHE_SLOTS 16

struct session {
    struct session *next;
    unsigned long id;
    char data[1008];
};

static void *cache[CACHE_SLOTS];
static struct session *sessions;
static unsigned long requests;
static unsigned long checksum;
static volatile size_t request_size = 4096;

static char inbuf[4096];
static size_t inlen;

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

__attribute__((noinline, noclone, noipa, noreturn)) static void die(const char *why)
{
    write_all(why, strlen(why));
    write_all("\n", 1);
    _exit(1);
}

__attribute__((noinline, noclone, noipa)) static char *read_request(unsigned long r) /* @wrapper read_request alloc */
{
    char *buf = malloc(request_size); /* @site malloc calls=100 bytes=409600 under=0,0 */
    if (buf == NULL)
        die("out of memory");
    fill(buf, request_size, (unsigned)r);
    return buf;
}

__attribute__((noinline, noclone, noipa)) static char *parse_key(unsigned long r) /* @wrapper parse_key alloc */
{
    char key[32];
    snprintf(key, sizeof key, "user-%04lu", r % 10000);
    char *k = strdup(key); /* @site strdup calls=100 bytes=1000 inside */
    if (k == NULL)
        die("out of memory");
    sum(k, strlen(k));
    return k;
}

__attribute__((noinline, noclone, noipa)) static void cache_store(unsigned long r)
{
    size_t size = 64 * (1 + r % 4);
    void *v = calloc(1, size); /* @site calloc calls=100 bytes=16000 */ /* @demo-live objects=16 bytes=2560 */
    if (v == NULL)
        die("out of memory");
    fill(v, size, (unsigned)r);
    void *old = cache[r % CACHE_SLOTS];
    cache[r % CACHE_SLOTS] = v;
    free(old); /* @site free calls=100 bytes=0 */
    sum(v, size);
}

__attribute__((noinline, noclone, noipa)) static void open_session(unsigned long r) /* @notwrapper open_session */
{
    struct session *s = malloc(sizeof *s); /* @site malloc calls=10 bytes=10240 */ /* @demo-live objects=10 bytes=10240 */
    if (s == NULL)
        die("out of memory");
    s->id = r;
    fill(s->data, sizeof s->data, (unsigned)r);
    s->next = sessions;
    sessions = s;
}

__attribute__((noinline, noclone, noipa)) static char *render(const char *key) /* @notwrapper render */
{
    char *out = malloc(32); /* @site malloc calls=100 bytes=3200 */
    if (out == NULL)
        die("out of memory");
    fill(out, 32, 7u);
    char *grown = realloc(out, 256); /* @site realloc calls=100 bytes=25600 */
    if (grown == NULL)
        die("out of memory");
    snprintf(grown, 256, "hello %s", key);
    sum(grown, strlen(grown));
    return grown;
}

__attribute__((noinline, noclone, noipa)) static void handle(void)
{
    unsigned long r = requests++;
    char *buf = read_request(r); /* @hook read_request calls=100 bytes=409600 */
    char *key = parse_key(r); /* @charged parse_key calls=100 bytes=1000 */
    cache_store(r);
    if (r % 10 == 0)
        open_session(r);
    char *page = render(key);
    sum(buf, 16);
    free(page); /* @site free calls=100 bytes=0 */
    sum(key, 4);
    free(key); /* @site free calls=100 bytes=0 */
    checksum += 1;
    free(buf); /* @site free calls=100 bytes=0 */
    sum(&checksum, sizeof checksum);
}

static void reply(const char *s)
{
    write_all(s, strlen(s));
    write_all("\n", 1);
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

/* Returns 0 to go on, 1 to quit. */
static int command(const char *cmd)
{
    char word[16];
    unsigned long n = 0;
    int fields = sscanf(cmd, "%15s %lu", word, &n);
    if (fields <= 0)
        return 0;
    if (strcmp(word, "quit") == 0)
        return 1;
    if (strcmp(word, "serve") == 0 && fields == 2) {
        for (unsigned long i = 0; i < n; i++)
            handle();
        char msg[48];
        snprintf(msg, sizeof msg, "served %lu", n);
        reply(msg);
    } else {
        reply("unknown");
    }
    return 0;
}

int main(int argc, char **argv)
{
    char line[256];

    if (argc > 1) {
        /* One command per argument: "serve" and its count are two. */
        for (int i = 1; i < argc; i++) {
            if (strcmp(argv[i], "serve") == 0 && i + 1 < argc) {
                snprintf(line, sizeof line, "serve %s", argv[i + 1]);
                i++;
            } else {
                snprintf(line, sizeof line, "%s", argv[i]);
            }
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
