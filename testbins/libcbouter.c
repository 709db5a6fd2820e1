// build: {cc} -g {opt} -fPIC -shared {extra} -Wall -Werror {src} -o {out} -Wl,-soname,libcbouter.so -L{dir} -l:libcbinner.so -Wl,-rpath,{dir}
// output: libcbouter.so
// needs: libcbinner
/*
 * libcbouter: passes a callback on to libcbinner.so, which the program
 * does not name in DT_NEEDED (see callers_deep.c).
 */
int inner_apply(int (*f)(int), int x);

__attribute__((noinline, noclone, noipa)) int outer_apply(int (*f)(int), int x)
{
    int r = inner_apply(f, x * 2);
    return r + 7;
}
