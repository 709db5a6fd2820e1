/* Holds N live allocations of 32 bytes (argv[1]) until a line arrives on
 * stdin, then frees them: the live objects whose tracking memory is
 * measured. Prints "ready" once they are all allocated. */
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    void **objects = malloc(n * sizeof *objects);
    if (objects == NULL)
        return 1;
    for (long i = 0; i < n; i++)
        if ((objects[i] = malloc(32)) == NULL)
            return 1;
    printf("ready\n");
    fflush(stdout);
    char line[16];
    int status = fgets(line, sizeof line, stdin) == NULL;
    for (long i = 0; i < n; i++)
        free(objects[i]);
    free(objects);
    return status;
}
