// build: {cc} -g -O2 {pie} -Wall -Werror {src} -o {out} -Wl,-rpath,{dir} -ldl
// needs: libdlgrow
/*
 * reaper: counts the SIGCHLD signals it gets and reaps any child with
 * waitpid(-1), as servers that manage workers do, then loads libdlgrow.so
 * with dlopen by name. Under `alloctramp run` with an empty cache the
 * library is patched while the program waits in dlopen: the program must
 * see no signal and no child of that (cli/tests/run.rs).
 */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>

static volatile sig_atomic_t signals, reaped;

static void on_child(int sig)
{
    (void)sig;
    signals++;
    while (waitpid(-1, NULL, WNOHANG) > 0)
        reaped++;
}

int main(void)
{
    struct sigaction sa = {.sa_handler = on_child};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGCHLD, &sa, NULL);
    void *h = dlopen("libdlgrow.so", RTLD_NOW);
    if (h == NULL) {
        printf("reaper: dlopen: %s\n", dlerror());
        return 1;
    }
    int (*keep)(int) = (int (*)(int))dlsym(h, "dlgrow_keep");
    if (keep == NULL || keep(2) != 2)
        return 1;
    printf("reaper: %d signals, %d children reaped\n", (int)signals, (int)reaped);
    return 0;
}
