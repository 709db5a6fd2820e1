// build: {cc} -g -O2 {pie} -Wall -Werror {src} -o {out}
/*
 * edge: R, a realloc whose failure the program handles by keeping the old
 * block (it prints what the block still holds); S, a malloc whose failure
 * makes the program wait for ever (a sweep's timeout ends that run).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *volatile sink;

int main(void)
{
    char *p = malloc(16);
    if (p == NULL)
        return 1;
    strcpy(p, "kept");
    char *q = realloc(p, 4096); /* R */
    if (q == NULL) {
        printf("R: realloc failed, the old block still holds \"%s\"\n", p);
    } else {
        p = q;
        puts("R: ok");
    }
    sink = p;
    free(p);
    char *s = malloc(64); /* S */
    if (s == NULL) {
        for (;;)
            pause();
    }
    sink = s;
    free(s);
    puts("S: ok");
    return 0;
}
