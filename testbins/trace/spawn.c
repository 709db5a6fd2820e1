// build: {cc} -O2 -g {pie} {src} -o {out}
/* spawn PROGRAM: 10 allocations of 32 bytes at P, each freed at F, then
   PROGRAM (a patched copy of this program) run with `child` in a child
   process, waited for. spawn child: 20 allocations at C, freed at D, and
   whether the runtime gave the process a counters file and a trace file
   ($ALLOCTRAMP_DIR/PID.counters, PID.trace): `alloctramp run --trace`
   records the program it starts, not the programs that one starts, which
   are profiled all the same. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void *volatile sink;

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    if (strcmp(argv[1], "child") == 0) {
        for (int i = 0; i < 20; i++) {
            sink = malloc(48); /* @site malloc C */
            free(sink); /* @site free D */
        }
        const char *dir = getenv("ALLOCTRAMP_DIR");
        char path[4096];
        snprintf(path, sizeof path, "%s/%d.counters", dir ? dir : ".", (int)getpid());
        printf("child counters file: %s\n", access(path, F_OK) == 0 ? "yes" : "no");
        snprintf(path, sizeof path, "%s/%d.trace", dir ? dir : ".", (int)getpid());
        printf("child trace file: %s\n", access(path, F_OK) == 0 ? "yes" : "no");
        return 0;
    }
    for (int i = 0; i < 10; i++) {
        sink = malloc(32); /* @site malloc P */
        free(sink); /* @site free F */
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        return 1;
    if (pid == 0) {
        execl(argv[1], argv[1], "child", (char *)NULL);
        _exit(127);
    }
    int status;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return 1;
    printf("parent done\n");
    return 0;
}
