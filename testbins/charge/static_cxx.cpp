// build: {cxx} -g -O2 -fPIE -pie -static-libstdc++ -Wall -Werror {src} -o {out}
/*
 * static_cxx: a program that links libstdc++ statically, so that its own
 * operator new[] calls its own operator new, which calls malloc, and its
 * operator delete[] and sized delete call its operator delete, which
 * calls free. Each allocation counts once, at the line here that asked
 * for it: the calls inside those operators are layers of it
 * (cli/tests/charge.rs). Operator new reached through a pointer (no site)
 * counts at the malloc inside it.
 *
 * new[]: 20 arrays of i + 1 ints (i = 0..19), the first 10 deleted.
 * new: 8 objects of 24 bytes, deleted (sized delete).
 * Through a pointer: 5 blocks of 48 bytes, deleted at a site.
 */
#include <cstdio>
#include <new>

struct Node {
    long a, b, c;
};

static void *(*volatile allocate)(std::size_t) = ::operator new;

int main()
{
    int *arrays[20];
    for (int i = 0; i < 20; i++)
        arrays[i] = new int[i + 1]; /* @site operator new[] calls=20 bytes=840 live=10,620 */
    for (int i = 0; i < 10; i++)
        delete[] arrays[i];
    Node *nodes[8];
    for (int i = 0; i < 8; i++)
        nodes[i] = new Node{i, i, i}; /* @site operator new calls=8 bytes=192 live=0,0 */
    long sum = 0;
    for (Node *n : nodes) {
        sum += n->a + n->b + n->c;
        delete n;
    }
    for (int i = 0; i < 5; i++) {
        void *p = allocate(48);
        sum += reinterpret_cast<long>(p) & 1;
        ::operator delete(p);
    }
    for (int i = 10; i < 20; i++)
        sum += arrays[i][0] = i;
    std::printf("static_cxx: sum %ld\n", sum);
    return 0;
}
