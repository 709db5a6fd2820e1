// build: {cc} -O2 -g -Wall -Werror {pie} {src} -o {out} -ldl
/*
 * fds FILE LIBRARY: a daemon's habits. Closes every descriptor above 2,
 * opens FILE (and gets descriptor 3 back), forks a child that writes to
 * it, dlopens LIBRARY, then waits for a line on stdin (meanwhile the test
 * resets the counters from outside), writes again, and prints the
 * descriptors it has open. A patched run must leave FILE byte-identical
 * to an unpatched run and show the same descriptors.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void put(int fd, const char *s)
{
    if (write(fd, s, strlen(s)) != (ssize_t)strlen(s))
        printf("write failed\n");
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    closefrom(3);
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC, 0644);
    printf("file descriptor %d\n", fd);
    char *block = malloc(100);
    memset(block, 'a', 99);
    block[98] = '\n';
    block[99] = 0;
    put(fd, block);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        char *c = malloc(10);
        free(c);
        put(fd, "child\n");
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    printf("child exit %d\n", WEXITSTATUS(status));
    void *h = dlopen(argv[2], RTLD_NOW);
    printf("dlopen %s\n", h ? "ok" : dlerror());
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        return 3;
    put(fd, "after\n");
    DIR *d = opendir("/proc/self/fd");
    int own = dirfd(d);
    printf("descriptors:");
    int fds[64], n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64) {
        if (e->d_name[0] == '.' || atoi(e->d_name) == own)
            continue;
        fds[n++] = atoi(e->d_name);
    }
    closedir(d);
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (fds[j] < fds[i]) {
                int t = fds[i];
                fds[i] = fds[j];
                fds[j] = t;
            }
    for (int i = 0; i < n; i++)
        printf(" %d", fds[i]);
    printf("\n");
    free(block);
    close(fd);
    return 0;
}
