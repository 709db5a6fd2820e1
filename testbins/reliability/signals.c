// build: {cc} -O2 -g -Wall -Werror {pie} {src} -o {out} -lpthread
/*
 * signals pause|pipe|sigwait: a program waiting in a system call while
 * profiling is switched on and off around it. Prints "ready", then:
 * pause:   pause() with an alarm pending (SIGALRM handler without
 *          SA_RESTART); prints what pause returned and whether the alarm
 *          was handled.
 * pipe:    one blocking 1 MiB write into a pipe that a thread drains only
 *          after a line on stdin; prints what write returned.
 * sigwait: SIGTERM blocked, then sigwait() for it (the test sends it to the
 *          process); prints the signal.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t alarms;
static int pipefd[2];

static void on_alarm(int sig)
{
    (void)sig;
    alarms++;
}

static void *drain(void *arg)
{
    (void)arg;
    char line[16];
    if (!fgets(line, sizeof line, stdin))
        exit(3);
    char *buf = malloc(65536);
    size_t total = 0;
    ssize_t n;
    while (total < (1 << 20) && (n = read(pipefd[0], buf, 65536)) > 0)
        total += (size_t)n;
    free(buf);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    if (!strcmp(argv[1], "pause")) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_alarm;
        sigaction(SIGALRM, &sa, NULL);
        alarm(argc > 2 ? (unsigned)atoi(argv[2]) : 5);
        printf("ready\n");
        fflush(stdout);
        int r = pause();
        int e = errno;
        printf("pause returned %d (%s), alarms handled %d\n", r, strerror(e), (int)alarms);
    } else if (!strcmp(argv[1], "pipe")) {
        if (pipe(pipefd))
            return 4;
        char *buf = malloc(1 << 20);
        memset(buf, 'p', 1 << 20);
        pthread_t t;
        pthread_create(&t, NULL, drain, NULL);
        printf("ready\n");
        fflush(stdout);
        ssize_t n = write(pipefd[1], buf, 1 << 20);
        printf("write returned %zd\n", n);
        pthread_join(t, NULL);
        free(buf);
    } else if (!strcmp(argv[1], "sigwait")) {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGTERM);
        sigprocmask(SIG_BLOCK, &set, NULL);
        printf("ready\n");
        fflush(stdout);
        int sig = 0;
        int r = sigwait(&set, &sig);
        printf("sigwait returned %d, signal %d\n", r, sig);
    } else {
        return 2;
    }
    return 0;
}
