// An exception thrown by a function that allocates (a wrapper's shape), caught
// by its caller: a patched C++ program behaves as the original with profiling
// on (cli/tests/charge.rs).
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <stdexcept>
extern "C" __attribute__((noinline)) char* make_name(int i) {
    char* p = (char*)malloc(32);
    if (!p) return nullptr;
    if (i == 3) { free(p); throw std::runtime_error("bad"); }
    snprintf(p, 32, "n%d", i);
    return p;
}
int main(int argc, char**) {
    int caught = 0; size_t len = 0;
    for (int i = 0; i < 6; i++) {
        try { char* s = make_name(i + argc - 1); len += strlen(s); free(s); }
        catch (const std::exception&) { caught++; }
    }
    printf("caught %d len %zu\n", caught, len);
}
