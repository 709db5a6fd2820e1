// build: {cc} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
// counts: variable
/*
 * forker: the parent allocates 3 blocks, forks; the child allocates 2
 * blocks and exits; the parent waits, then allocates 4 more. Each process
 * has its own counters: the parent's file shows 7 calls at the malloc
 * site, the child's 2 (a child starts from zero).
 */
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

int main(void)
{
    allocate(3);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        allocate(2);
        printf("child %d\n", 2);
        fflush(stdout);
        _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    allocate(4);
    printf("parent %d\n", 7);
    return WEXITSTATUS(status);
}
