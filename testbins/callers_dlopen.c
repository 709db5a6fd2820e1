// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out} -ldl
// needs: libcbouter
/*
 * A call chain through libraries loaded with dlopen, which the program
 * does not name in DT_NEEDED: main loads libcbouter.so (which needs
 * libcbinner.so) from the directory given as its argument, else from its
 * own, then takes commands on stdin (at its end, without any, one round).
 * `round` calls outer_apply(grow, i) three times
 * (outer_apply -> inner_apply -> grow, which allocates) and frees what
 * grow allocated; `swap` unloads both libraries and loads libcbinner.so
 * before libcbouter.so, so that each may land where the other was;
 * `maps` prints the libraries' load addresses. The patched program carries
 * no rows for either library: its chains go on through them once
 * `alloctramp callers PID on` wrote the process's unwind file
 * (cli/tests/callers.rs).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

static void *kept[3];
static int next;
static char dir[4096];
static void *outer, *inner;
static volatile int three = 3;
static int (*outer_apply)(int (*)(int), int);

__attribute__((noinline, noclone, noipa)) static int grow(int x)
{
    char *p = malloc(16 + (size_t)x); /* @site malloc calls=3 bytes=57 */
    fill(p, 16 + (size_t)x, (unsigned)x);
    sum(p, 16 + (size_t)x);
    kept[next++] = p;
    return x;
}

static void *load(const char *name)
{
    char path[8192];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        fprintf(stderr, "callers_dlopen: %s\n", dlerror());
        exit(1);
    }
    return h;
}

static void load_outer(void)
{
    outer = load("libcbouter.so");
    outer_apply = (int (*)(int (*)(int), int))dlsym(outer, "outer_apply");
    if (outer_apply == NULL)
        exit(1);
}

__attribute__((noinline, noclone, noipa)) static int round_of_three(void)
{
    int r = 0, n = three;
    next = 0;
    for (int i = 0; i < n; i++)
        r += outer_apply(grow, i); /* @frame outer_apply */
    for (int i = 0; i < n; i++)
        free(kept[i]); /* @site free calls=3 bytes=0 */
    return r;
}

int main(int argc, char **argv)
{
    char line[256];
    int commands = 0;
    if (argc > 1) {
        snprintf(dir, sizeof dir, "%s", argv[1]);
    } else {
        ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
        if (n <= 0)
            return 1;
        dir[n] = 0;
        char *slash = strrchr(dir, '/');
        if (slash != NULL)
            *slash = 0;
    }
    load_outer();
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\r\n")] = '\0';
        commands++;
        if (strcmp(line, "round") == 0) {
            printf("done %d\n", round_of_three());
        } else if (strcmp(line, "swap") == 0) {
            dlclose(outer);
            if (inner != NULL)
                dlclose(inner);
            inner = load("libcbinner.so");
            load_outer();
            printf("done\n");
        } else if (strcmp(line, "maps") == 0) {
            Dl_info a, b;
            void *in = dlsym(inner != NULL ? inner : outer, "inner_apply");
            if (in == NULL || !dladdr((void *)outer_apply, &a) || !dladdr(in, &b))
                return 1;
            printf("outer %p inner %p\n", a.dli_fbase, b.dli_fbase);
        } else if (strcmp(line, "quit") == 0) {
            break;
        } else {
            printf("unknown\n");
        }
        fflush(stdout);
    }
    if (commands == 0)
        printf("round %d\n", round_of_three());
    printf("callers_dlopen: checksum %lu\n", checksum);
    return 0;
}
