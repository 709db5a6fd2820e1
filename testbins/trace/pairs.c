// build: {cc} -O2 -g {pie} {src} -o {out}
/* Traced by cli/tests/trace.rs: each line "go N" allocates N objects of 48
   bytes at one site, then frees them at another, and says "done"; "keep N"
   allocates N objects of 64 bytes kept until exit; "realloc" grows one
   object twice and frees it; "grow" grows a line buffer the C library
   allocated before "ready" (no site made it); end of input exits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *volatile sink;

int main(void) {
    char line[64];
    static void *objs[100000];
    setvbuf(stdout, NULL, _IOLBF, 0);
    char early_text[] = "early\n", *early = NULL;
    size_t early_size = 0;
    FILE *m = fmemopen(early_text, sizeof early_text - 1, "r");
    if (!m || getline(&early, &early_size, m) < 0)
        return 1;
    fclose(m);
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
        } else if (strncmp(line, "grow", 4) == 0) {
            early = realloc(early, 4096); /* @site realloc G */
            early[4095] = 1;
        }
        puts("done");
    }
    return 0;
}
