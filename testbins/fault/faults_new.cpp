// build: {cxx} -g -O2 {pie} -Wall -Werror {src} -o {out}
/*
 * faults_new: C++ allocations for fault injection. N: a throwing
 * operator new[] in a loop of three rounds, whose std::bad_alloc the
 * program catches; T: a nothrow operator new, whose NULL it checks; V:
 * the aligned operator new of an over-aligned type, whose std::bad_alloc
 * it catches.
 */
#include <cstdio>
#include <new>

static char *volatile sink;

struct alignas(64) Block {
    char bytes[4096];
};

int main()
{
    int caught = 0;
    for (int i = 0; i < 3; i++) {
        try {
            char *p = new char[100]; /* @site operator new[] calls=3 bytes=300 */ /* N */
            sink = p;
            delete[] p;
        } catch (const std::bad_alloc &) {
            std::printf("N: bad_alloc caught in round %d\n", i);
            caught++;
        }
    }
    char *q = new (std::nothrow) char[50]; /* @site operator new[] calls=1 bytes=50 */ /* T */
    if (q == nullptr) {
        std::puts("T: nothrow new returned NULL");
    } else {
        sink = q;
        delete[] q;
        std::puts("T: ok");
    }
    try {
        Block *v = new Block; /* @site operator new calls=1 bytes=4096 */ /* V */
        v->bytes[0] = 1;
        sink = v->bytes;
        delete v;
        std::puts("V: ok");
    } catch (const std::bad_alloc &) {
        std::puts("V: bad_alloc caught");
        caught++;
    }
    std::printf("caught %d\n", caught);
    return 0;
}
