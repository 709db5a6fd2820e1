// build: {cxx} -g -O2 -fPIE -pie -Wall -Werror {src} -o {out}
/*
 * layers: C++ allocations that pass through libstdc++'s operator new
 * (which calls malloc), through libstdc++'s own code (std::string's
 * constructor calls basic_string::_M_construct, compiled in libstdc++),
 * and through out-of-line copies of the headers' templates (a vector's
 * growth, _M_realloc_insert). Under `alloctramp run`, which patches
 * libstdc++ too, each allocation counts once, on the line here that asked
 * for it: never at libstdc++'s call of operator new, never again at the
 * malloc inside operator new (cli/tests/run.rs).
 * Strings: 100 of 40 characters (41 bytes each). Growth: a vector of ints
 * doubles from 1 to 128 elements (8 allocations, 4 * 255 bytes).
 */
#include <cstdio>
#include <string>
#include <vector>

struct Node {
    long a, b, c;
};

int main()
{
    std::vector<std::string> v;
    v.reserve(100); /* @site operator new calls=1 bytes=3200 live=0,0 */
    for (int i = 0; i < 100; i++)
        v.emplace_back(40, static_cast<char>('a' + i % 26)); /* @site hook calls=100 bytes=4100 live=0,0 */
    std::vector<Node *> nodes;
    nodes.reserve(10); /* @site operator new calls=1 bytes=80 live=0,0 */
    for (int i = 0; i < 10; i++)
        nodes.push_back(new Node{i, i, i}); /* @site operator new calls=10 bytes=240 live=0,0 */
    std::vector<int> grown;
    for (int i = 0; i < 100; i++)
        grown.push_back(i); /* @site hook calls=8 bytes=1020 live=0,0 */
    long sum = grown.back();
    for (Node *n : nodes) {
        sum += n->a + n->b + n->c;
        delete n;
    }
    std::printf("layers: %zu strings, sum %ld\n", v.size(), sum);
    return 0;
}
