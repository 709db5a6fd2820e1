// build: {cc} -g {opt} -fPIC -shared {extra} -Wall -Werror {src} -o {out} -Wl,-soname,libcbinner.so
// output: libcbinner.so
/*
 * libcbinner: calls back into its caller's function (see callers_deep.c).
 * It allocates nothing; only libcbouter.so needs it, not the program.
 */
__attribute__((noinline, noclone, noipa)) int inner_apply(int (*f)(int), int x)
{
    int r = f(x + 1);
    return r * 3 + 1;
}
