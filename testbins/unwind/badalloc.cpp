// operator new throwing std::bad_alloc through its site's trampoline, caught
// by the caller: a patched program behaves as the original with profiling on,
// and every call is counted (cli/tests/charge.rs): take() is charged to its
// caller, and an exception through the caller's trampoline counts the call
// as failed and lowers the wrapper depth again.
#include <cstdio>
#include <cstdlib>
#include <new>
__attribute__((noinline)) char* take(size_t n) { return new char[n]; }
int main(int argc, char**) {
    int failed = 0;
    size_t got = 0;
    for (int i = 0; i < 8; i++) {
        size_t n = (i % 4 == 3) ? (size_t(1) << 62) / size_t(argc) : size_t(64 * (i + 1));
        try {
            char* p = take(n);
            got += n;
            delete[] p;
        } catch (const std::bad_alloc&) {
            failed++;
        }
    }
    // A call that no site makes: the sites inside take() count it (the
    // wrapper depth that the throws raised went down again).
    char* (*volatile indirect)(size_t) = take;
    char* q = indirect(100);
    delete[] q;
    printf("failed %d got %zu\n", failed, got);
}
