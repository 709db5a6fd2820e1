// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
// counts: variable
/*
 * forker: the parent allocates 3 blocks, forks; the child allocates 2
 * blocks and exits; the parent waits, then allocates 4 more. Each process
 * has its own counters: the parent's file shows 7 calls at the malloc
 * site, the child's 2 (a child starts from zero).
 * `forker exec`: the child runs /bin/sh at once instead, allocating
 * nothing in this program; `forker exec-killed`: the same, then the parent
 * kills itself with SIGKILL once the child has ended (no exit handlers).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

__attribute__((noinline, noclone, noipa)) static void touch(char *p, size_t n)
{
    memset(p, 'f', n);
}

__attribute__((noinline, noclone, noipa)) static void allocate(int n)
{
    for (int i = 0; i < n; i++) {
        char *p = malloc(24); /* @site malloc calls=0 bytes=0 */
        touch(p, 24);
        free(p); /* @site free calls=0 bytes=0 */
    }
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "";
    int exec_child = strcmp(mode, "exec") == 0 || strcmp(mode, "exec-killed") == 0;
    allocate(3);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        if (exec_child) {
            execl("/bin/sh", "sh", "-c", "exit 0", (char *)0);
            _exit(127);
        }
        allocate(2);
        printf("child %d\n", 2);
        fflush(stdout);
        _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    if (strcmp(mode, "exec-killed") == 0)
        raise(SIGKILL);
    allocate(4);
    printf("parent %d\n", 7);
    return WEXITSTATUS(status);
}
