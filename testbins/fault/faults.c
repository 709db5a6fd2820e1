// build: {cc} -g -O2 {pie} -Wall -Werror {src} -o {out}
/*
 * faults: four allocation sites, for fault injection. Two handle a failed
 * allocation: A (malloc, in a loop of three rounds) skips its round and
 * says so; B (posix_memalign) says so. Two use what they got without a
 * check: C (malloc) copies a string into it, D (calloc) writes and reads
 * an element. Each prints one line; the program ends with "pass done".
 *
 * With the argument "serve" it prints "ready", then makes one pass per
 * line it reads on stdin, until end of input.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Stores here keep the objects (the compiler may not drop them). */
static void *volatile sink;
static volatile int seven = 7;

static void pass(void)
{
    for (int i = 0; i < 3; i++) {
        char *a = malloc(64); /* @site malloc calls=3 bytes=192 */ /* A */
        if (a == NULL) {
            printf("A: no memory in round %d (%s)\n", i, errno == ENOMEM ? "ENOMEM" : "errno not ENOMEM");
            continue;
        }
        snprintf(a, 64, "round %d", i);
        sink = a;
        free(a);
    }
    void *b = NULL;
    int e = posix_memalign(&b, 64, 256); /* @site posix_memalign calls=1 bytes=256 */ /* B */
    if (e != 0) {
        printf("B: posix_memalign failed (%s)%s\n", e == ENOMEM ? "ENOMEM" : "not ENOMEM",
               b == NULL ? "" : ", but set its pointer");
    } else {
        memset(b, 1, 256);
        sink = b;
        free(b);
        puts("B: ok");
    }
    char *c = malloc(32); /* @site malloc calls=1 bytes=32 */ /* C */
    strcpy(c, "C: ok");
    puts(c);
    free(c);
    int *d = calloc(8, sizeof *d); /* @site calloc calls=1 bytes=32 */ /* D */
    d[seven] = 7;
    printf("D: %d\n", d[seven] + d[0]);
    free(d);
    puts("pass done");
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "serve") == 0) {
        char line[64];
        puts("ready");
        fflush(stdout);
        while (fgets(line, sizeof line, stdin)) {
            pass();
            fflush(stdout);
        }
        return 0;
    }
    pass();
    return 0;
}
