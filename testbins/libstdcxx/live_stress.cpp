// build: {cxx} -g -O2 {pie} -Wall -Werror -pthread -static-libstdc++ {src} -o {out}
/*
 * libstdcxx/live_stress: live_stress.c in C++, with libstdc++ linked in
 * (-static-libstdc++), so that the program defines operator new and
 * delete itself, as wrappers of the C library's malloc and free. 8 threads
 * allocate 25,000 objects each with new[] and ::operator new, wait for
 * each other, then each deletes every other object of its neighbour's
 * array while the others do the same, and deletes its own with
 * index % 3 == 0 that its neighbour left. The program then prints how
 * many objects and bytes it still holds, in all and per allocating line
 * ("site LINE OBJECTS BYTES"), and exits without deleting them. Sizes are
 * a deterministic function of thread and index (1..512 bytes, and one
 * object in 64 of 1..4 KiB).
 */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <pthread.h>

enum { THREADS = 8, PER = 25000, LINES = 256 };

struct Held {
    void *p;
    size_t size;
    int line;
    bool array;
};

static Held *held[THREADS];
static pthread_barrier_t barrier;

static size_t size_of(unsigned t, unsigned i)
{
    unsigned h = (t * 2654435761u + i * 40503u) >> 7;
    return i % 64 == 63 ? 1024 + h % 3072 : 1 + h % 512;
}

__attribute__((noinline)) static void drop(Held &h)
{
    if (h.array)
        delete[] static_cast<unsigned char *>(h.p);
    else
        ::operator delete(h.p);
    h.p = nullptr;
}

static void *work(void *arg)
{
    unsigned t = static_cast<unsigned>(reinterpret_cast<unsigned long>(arg));
    Held *b = held[t];
    for (unsigned i = 0; i < PER; i++) {
        size_t n = size_of(t, i);
        if (i % 3 == 0) {
            b[i] = Held{ ::operator new(n), n, __LINE__, false };
        } else {
            b[i] = Held{ new unsigned char[n], n, __LINE__, true };
        }
        std::memset(b[i].p, static_cast<int>(t), n < 8 ? n : 8);
    }
    pthread_barrier_wait(&barrier);
    Held *o = held[(t + 1) % THREADS];
    for (unsigned i = 1; i < PER; i += 2)
        drop(o[i]);
    pthread_barrier_wait(&barrier);
    for (unsigned i = 0; i < PER; i += 3)
        if (b[i].p != nullptr)
            drop(b[i]);
    return nullptr;
}

int main()
{
    pthread_t th[THREADS];
    pthread_barrier_init(&barrier, nullptr, THREADS);
    for (unsigned t = 0; t < THREADS; t++)
        held[t] = static_cast<Held *>(std::calloc(PER, sizeof(Held)));
    for (unsigned t = 0; t < THREADS; t++)
        pthread_create(&th[t], nullptr, work, reinterpret_cast<void *>(static_cast<unsigned long>(t)));
    for (unsigned t = 0; t < THREADS; t++)
        pthread_join(th[t], nullptr);
    unsigned long objects = 0, bytes = 0;
    unsigned long per_objects[LINES] = { 0 }, per_bytes[LINES] = { 0 };
    for (unsigned t = 0; t < THREADS; t++)
        for (unsigned i = 0; i < PER; i++)
            if (held[t][i].p != nullptr) {
                objects++;
                bytes += held[t][i].size;
                per_objects[held[t][i].line % LINES]++;
                per_bytes[held[t][i].line % LINES] += held[t][i].size;
            }
    /* The bookkeeping arrays are live too. */
    objects += THREADS;
    bytes += THREADS * static_cast<unsigned long>(PER) * sizeof(Held);
    std::printf("held %lu %lu\n", objects, bytes);
    for (unsigned l = 0; l < LINES; l++)
        if (per_objects[l] != 0)
            std::printf("site %u %lu %lu\n", l, per_objects[l], per_bytes[l]);
    return 0;
}
