/* Loads the shared libraries named on the command line with dlopen and
 * waits for a line on stdin: a process with large patched modules whose
 * switching time can be measured. */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (dlopen(argv[i], RTLD_NOW | RTLD_LOCAL) == NULL) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
    printf("ready\n");
    fflush(stdout);
    char line[16];
    return fgets(line, sizeof line, stdin) == NULL;
}
