// build: {cxx} -g {opt} {pie} {extra} -Wall -Werror {src} -o {out}
/*
 * cxx_new_delete: every global operator new / new[] / delete / delete[]
 * variant (plain, nothrow, sized, std::align_val_t and combinations), reached
 * through new/delete expressions where the language emits that variant and
 * through explicit ::operator calls otherwise.
 *
 * Only trivial types are used (no constructors that can throw, so no
 * exception cleanup path calls operator delete), and no standard library
 * header that allocates (only <new>, <cstddef>, <cstdio>).
 * Two nothrow calls request 2^62 bytes and return nullptr (failed=1).
 * make_raw, drop_raw and drop_int end in an operator call, which is a tail
 * jump at -O2.
 */
#include <cstddef>
#include <cstdio>
#include <new>

struct alignas(64) Big {
    unsigned char d[128];
};

static volatile unsigned count_n = 4;
static volatile std::size_t huge_size = std::size_t(1) << 62;
static unsigned long checksum;

__attribute__((noinline, noclone, noipa)) static void use(void *p, std::size_t n, unsigned seed)
{
    unsigned char *c = static_cast<unsigned char *>(p);
    for (std::size_t i = 0; i < n; i++)
        c[i] = static_cast<unsigned char>(seed + i * 31u + 1u);
    for (std::size_t i = 0; i < n; i++)
        checksum = checksum * 131u + c[i];
}

__attribute__((noinline, noclone, noipa)) static void *make_raw(std::size_t n) /* @wrapper make_raw alloc */
{
    return ::operator new(n); /* @site _Znwm tail calls=1 bytes=72 live=0 live_bytes=0 */
}

__attribute__((noinline, noclone, noipa)) static void drop_raw(void *p) /* @wrapper drop_raw free */
{
    ::operator delete(p); /* @site _ZdlPv tail calls=1 bytes=0 untracked=0 */
}

__attribute__((noinline, noclone, noipa)) static void drop_int(int *p) /* @wrapper drop_int free */
{
    delete p; /* @site _ZdlPvm tail calls=1 bytes=0 untracked=0 */
}

int main()
{
    unsigned n = count_n;
    int failed = 0;

    // new-expressions: plain and sized delete (complete type => sized).
    for (unsigned i = 0; i < n; i++) {
        int *a = new int(static_cast<int>(i)); /* @site _Znwm calls=4 bytes=16 live=0 live_bytes=0 */
        use(a, sizeof *a, i);
        delete a; /* @site _ZdlPvm calls=4 bytes=0 untracked=0 */
    }

    // new[] with a run-time length; delete[] of a trivially destructible
    // type has no cookie and is unsized.
    int *b = new int[n]; /* @site _Znam calls=1 bytes=16 live=0 live_bytes=0 */
    use(b, n * sizeof(int), 1);
    delete[] b; /* @site _ZdaPv calls=1 bytes=0 untracked=0 */

    // nothrow new-expressions.
    int *c = new (std::nothrow) int(3); /* @site _ZnwmRKSt9nothrow_t calls=1 bytes=4 live=0 live_bytes=0 */
    if (c == nullptr)
        return 1;
    use(c, sizeof *c, 2);
    delete c; /* @site _ZdlPvm calls=1 bytes=0 untracked=0 */

    long *d = new (std::nothrow) long[8]; /* @site _ZnamRKSt9nothrow_t calls=1 bytes=64 live=0 live_bytes=0 */
    if (d == nullptr)
        return 1;
    use(d, 8 * sizeof(long), 3);
    delete[] d; /* @site _ZdaPv calls=1 bytes=0 untracked=0 */

    // over-aligned types: align_val_t variants.
    Big *e = new Big; /* @site _ZnwmSt11align_val_t calls=1 bytes=128 live=0 live_bytes=0 */
    use(e, sizeof *e, 4);
    delete e; /* @site _ZdlPvmSt11align_val_t calls=1 bytes=0 untracked=0 */

    Big *f = new Big[n]; /* @site _ZnamSt11align_val_t calls=1 bytes=512 live=0 live_bytes=0 */
    use(f, n * sizeof(Big), 5);
    delete[] f; /* @site _ZdaPvSt11align_val_t calls=1 bytes=0 untracked=0 */

    Big *g = new (std::nothrow) Big; /* @site _ZnwmSt11align_val_tRKSt9nothrow_t calls=1 bytes=128 live=0 live_bytes=0 */
    if (g == nullptr)
        return 1;
    use(g, sizeof *g, 6);
    ::operator delete(g, std::align_val_t(alignof(Big)), std::nothrow); /* @site _ZdlPvSt11align_val_tRKSt9nothrow_t calls=1 bytes=0 untracked=0 */

    Big *h = new (std::nothrow) Big[3]; /* @site _ZnamSt11align_val_tRKSt9nothrow_t calls=1 bytes=384 live=0 live_bytes=0 */
    if (h == nullptr)
        return 1;
    use(h, 3 * sizeof(Big), 7);
    ::operator delete[](h, std::align_val_t(alignof(Big)), std::nothrow); /* @site _ZdaPvSt11align_val_tRKSt9nothrow_t calls=1 bytes=0 untracked=0 */

    // explicit operator calls for the remaining variants.
    void *i = ::operator new(24); /* @site _Znwm calls=1 bytes=24 live=0 live_bytes=0 */
    use(i, 24, 8);
    ::operator delete(i); /* @site _ZdlPv calls=1 bytes=0 untracked=0 */

    void *j = ::operator new[](40); /* @site _Znam calls=1 bytes=40 live=0 live_bytes=0 */
    use(j, 40, 9);
    ::operator delete[](j, 40); /* @site _ZdaPvm calls=1 bytes=0 untracked=0 */

    void *k = ::operator new(256, std::align_val_t(128)); /* @site _ZnwmSt11align_val_t calls=1 bytes=256 live=0 live_bytes=0 */
    use(k, 256, 10);
    ::operator delete(k, std::align_val_t(128)); /* @site _ZdlPvSt11align_val_t calls=1 bytes=0 untracked=0 */

    void *l = ::operator new[](192, std::align_val_t(64)); /* @site _ZnamSt11align_val_t calls=1 bytes=192 live=0 live_bytes=0 */
    use(l, 192, 11);
    ::operator delete[](l, 192, std::align_val_t(64)); /* @site _ZdaPvmSt11align_val_t calls=1 bytes=0 untracked=0 */

    void *m = ::operator new(16, std::nothrow); /* @site _ZnwmRKSt9nothrow_t calls=1 bytes=16 live=0 live_bytes=0 */
    if (m == nullptr)
        return 1;
    use(m, 16, 12);
    ::operator delete(m, std::nothrow); /* @site _ZdlPvRKSt9nothrow_t calls=1 bytes=0 untracked=0 */

    void *o = ::operator new[](48, std::nothrow); /* @site _ZnamRKSt9nothrow_t calls=1 bytes=48 live=0 live_bytes=0 */
    if (o == nullptr)
        return 1;
    use(o, 48, 13);
    ::operator delete[](o, std::nothrow); /* @site _ZdaPvRKSt9nothrow_t calls=1 bytes=0 untracked=0 */

    void *u = ::operator new(256, std::align_val_t(32)); /* @site _ZnwmSt11align_val_t calls=1 bytes=256 live=0 live_bytes=0 */
    use(u, 256, 14);
    ::operator delete(u, 256, std::align_val_t(32)); /* @site _ZdlPvmSt11align_val_t calls=1 bytes=0 untracked=0 */

    void *v = ::operator new(32); /* @site _Znwm calls=1 bytes=32 live=0 live_bytes=0 */
    use(v, 32, 15);
    ::operator delete(v, 32); /* @site _ZdlPvm calls=1 bytes=0 untracked=0 */

    // tail calls in helpers.
    void *w = make_raw(72);
    use(w, 72, 18);
    drop_raw(w);
    int *z = new int(9); /* @site _Znwm calls=1 bytes=4 live=0 live_bytes=0 */
    use(z, sizeof *z, 19);
    drop_int(z);

    // failing nothrow allocations (2^62 bytes).
    void *x = ::operator new(huge_size, std::nothrow); /* @site _ZnwmRKSt9nothrow_t calls=1 bytes=4611686018427387904 failed=1 live=0 live_bytes=0 */
    if (x == nullptr)
        failed++;
    else
        use(x, 1, 16);
    void *y = ::operator new[](huge_size, std::align_val_t(64), std::nothrow); /* @site _ZnamSt11align_val_tRKSt9nothrow_t calls=1 bytes=4611686018427387904 failed=1 live=0 live_bytes=0 */
    if (y == nullptr)
        failed++;
    else
        use(y, 1, 17);

    std::printf("cxx_new_delete: n=%u failed=%d checksum=%lu\n", n, failed, checksum);
    return 0;
}
