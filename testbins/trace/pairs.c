// build: {cc} -O2 -g {pie} {src} -o {out}
/* Traced by cli/tests/trace.rs: each line "go N" allocates N objects of 48
   bytes at one site, then frees them at another, and says "done"; "keep N"
   allocates N objects of 64 bytes kept until exit; "realloc" grows one
   object twice and frees it; end of input exits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *volatile sink;

int main(void) {
    char line[64];
    static void *objs[100000];
    setvbuf(stdout, NULL, _IOLBF, 0);
    puts("ready");
    while (fgets(line, sizeof line, stdin)) {
        int n = 0;
        if (sscanf(line, "go %d", &n) == 1 && n > 0 && n <= 100000) {
            for (int i = 0; i < n; i++) {
                objs[i] = malloc(48); /* @site malloc A */
                memset(objs[i], i, 48);
            }
            for (int i = 0; i < n; i++)
                free(objs[i]); /* @site free F */
        } else if (sscanf(line, "keep %d", &n) == 1 && n > 0) {
            for (int i = 0; i < n; i++)
                sink = malloc(64); /* @site malloc K */
        } else if (strncmp(line, "realloc", 7) == 0) {
            char *p = malloc(10); /* @site malloc R0 */
            p = realloc(p, 100); /* @site realloc R1 */
            p = realloc(p, 5000); /* @site realloc R2 */
            p[4999] = 1;
            free(p); /* @site free R3 */
        }
        puts("done");
    }
    return 0;
}
