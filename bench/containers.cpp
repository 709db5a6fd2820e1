// C++ container and string churn: every allocation goes through operator
// new/delete (from this program's inlined templates and from libstdc++'s
// std::string). Deterministic: prints a checksum that depends only on the
// number of rounds (argv[1]).
//
//   g++ -O2 bench/containers.cpp -o containers && ./containers 200
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

static uint64_t state = 0x9e3779b97f4a7c15ull;
static uint64_t next_random()
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

static uint64_t checksum = 1469598103934665603ull;
static void mix(uint64_t v)
{
    checksum = (checksum ^ v) * 1099511628211ull;
}

// A word of 3 to 40 letters: short ones fit the string's inline buffer,
// longer ones are allocated.
static std::string word()
{
    std::string w;
    size_t n = 3 + next_random() % 38;
    for (size_t i = 0; i < n; i++)
        w.push_back(char('a' + next_random() % 26));
    return w;
}

struct Record {
    std::string name;
    std::vector<int> values;
};

static void round_once()
{
    // Strings in a vector, sorted into a map, counted in an unordered_map.
    std::vector<std::string> words;
    for (int i = 0; i < 2000; i++)
        words.push_back(word());
    std::map<std::string, int> ordered;
    std::unordered_map<std::string, int> counts;
    for (const auto &w : words) {
        ordered[w] += 1;
        counts[w.substr(0, 4)] += int(w.size());
    }
    for (const auto &[k, v] : ordered)
        mix(k.size() * 31 + uint64_t(v));
    for (const auto &w : words)
        mix(uint64_t(counts[w.substr(0, 4)]));

    // Records with growing vectors, held by unique_ptr in a hash map and
    // churned: inserted, grown, erased.
    std::unordered_map<uint64_t, std::unique_ptr<Record>> records;
    for (int i = 0; i < 3000; i++) {
        uint64_t key = next_random() % 1024;
        auto &r = records[key];
        if (!r) {
            r = std::make_unique<Record>();
            r->name = word() + "-" + std::to_string(key);
        }
        r->values.push_back(int(next_random() % 1000));
        if (next_random() % 4 == 0)
            records.erase(next_random() % 1024);
    }
    for (const auto &[k, r] : records) {
        uint64_t s = k + r->name.size();
        for (int v : r->values)
            s += uint64_t(v);
        mix(s);
    }

    // String building: concatenation and reallocation.
    std::string text;
    for (int i = 0; i < 500; i++) {
        text += words[size_t(i)];
        text += ' ';
    }
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t i = 0; i < text.size(); i++)
        if (text[i] == ' ') {
            parts.emplace_back(text, start, i - start);
            start = i + 1;
        }
    mix(parts.size() + text.size());
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 100;
    for (int i = 0; i < rounds; i++)
        round_once();
    printf("%016llx\n", (unsigned long long)checksum);
    return 0;
}
