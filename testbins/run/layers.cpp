// build: {cxx} -g -O2 -fPIE -pie -Wall -Werror {src} -o {out}
/*
 * layers: C++ allocations that pass through libstdc++'s operator new
 * (which calls malloc) and, for std::string, through libstdc++'s own
 * code (std::string's constructor is compiled in libstdc++). Under
 * `alloctramp run`, which patches libstdc++ too, each allocation counts
 * once, where it is made: here, or at libstdc++'s call of operator new,
 * never again at the malloc inside operator new (cli/tests/run.rs).
 * Strings: 100 of 40 characters (41 bytes each, in libstdc++).
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
        v.emplace_back(40, static_cast<char>('a' + i % 26));
    std::vector<Node *> nodes;
    nodes.reserve(10); /* @site operator new calls=1 bytes=80 live=0,0 */
    for (int i = 0; i < 10; i++)
        nodes.push_back(new Node{i, i, i}); /* @site operator new calls=10 bytes=240 live=0,0 */
    long sum = 0;
    for (Node *n : nodes) {
        sum += n->a + n->b + n->c;
        delete n;
    }
    std::printf("layers: %zu strings, sum %ld\n", v.size(), sum);
    return 0;
}
