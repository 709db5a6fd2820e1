// build: {cc} -O2 -g {pie} {src} -o {out}
/* CPython's allocator shape, with no option: PyObject_Malloc and
   PyObject_Free call a small-object pool through the slots of a table in
   data (`_PyObject.free(_PyObject.ctx, p)`), the pool takes large objects
   from PyMem_RawMalloc (which calls malloc through a table of its own),
   and objects are freed through their type's tp_free pointer as often as
   directly. Every free is seen: the calls through tp_free count at the
   call in PyObject_Free (PF), those made at a site count there only, and
   the layers under a counted call (the pool's PyMem_RawMalloc, its malloc)
   count nothing more. The live figures are exact (live=OBJECTS,BYTES). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    void *ctx;
    void *(*malloc)(void *ctx, size_t size);
    void (*free)(void *ctx, void *ptr);
} Allocator;

void *PyMem_RawMalloc(size_t size);
void PyMem_RawFree(void *ptr);

/* The pool: 32-byte blocks from an arena, a free list, large objects from
   PyMem_RawMalloc. */
#define BLOCK 32
#define BLOCKS 4096
static unsigned char arena[BLOCK * BLOCKS] __attribute__((aligned(32)));
static void *free_list;
static size_t used, large_objects;

static void *pool_malloc(void *ctx, size_t size)
{
    (void)ctx;
    if (size > BLOCK) {
        void *p = PyMem_RawMalloc(size); /* @site PyMem_RawMalloc live=0,0 (inside) */
        large_objects += p != NULL;
        return p;
    }
    void *p = free_list;
    if (p != NULL) {
        free_list = *(void **)p;
        return p;
    }
    if (used == BLOCKS)
        return NULL;
    return arena + BLOCK * used++;
}

static void pool_free(void *ctx, void *p)
{
    (void)ctx;
    if (p == NULL)
        return;
    if ((unsigned char *)p < arena || (unsigned char *)p >= arena + sizeof arena) {
        PyMem_RawFree(p); /* @site PyMem_RawFree (inside) */
        large_objects--;
        return;
    }
    *(void **)p = free_list;
    free_list = p;
}

static void *raw_malloc(void *ctx, size_t size)
{
    (void)ctx;
    return malloc(size ? size : 1); /* @site malloc live=0,0 (inside) */
}

static void raw_free(void *ctx, void *p)
{
    (void)ctx;
    free(p); /* @site free (inside) */
}

/* Not const: a program may install another allocator (PyMem_SetAllocator). */
Allocator _PyObject = {NULL, pool_malloc, pool_free};
Allocator _PyMem_Raw = {NULL, raw_malloc, raw_free};

__attribute__((noinline)) void *PyMem_RawMalloc(size_t size)
{
    return _PyMem_Raw.malloc(_PyMem_Raw.ctx, size); /* @site PyMem_RawMalloc live=0,0 (inside) */
}

__attribute__((noinline)) void PyMem_RawFree(void *ptr)
{
    _PyMem_Raw.free(_PyMem_Raw.ctx, ptr); /* @site PyMem_RawFree (inside) */
}

__attribute__((noinline)) void *PyObject_Malloc(size_t size)
{
    return _PyObject.malloc(_PyObject.ctx, size); /* @site PyObject_Malloc live=0,0 (inside) */
}

__attribute__((noinline)) void PyObject_Free(void *ptr)
{
    _PyObject.free(_PyObject.ctx, ptr); /* @site PyObject_Free calls=1010 (through tp_free) */
}

typedef struct object {
    const struct type *type;
    long value;
} object;

struct type {
    const char *name;
    void (*tp_free)(void *);
};

/* Not const: what tp_free holds is read when it is called. */
struct type small_type = {"small", PyObject_Free};

/* Frees through the type, as CPython's deallocators do. */
__attribute__((noinline)) static void dealloc(object *o)
{
    o->type->tp_free(o);
}

#define N 2000

static object *objects[N];
static unsigned char *large[20];

int main(void)
{
    long sum = 0;
    for (int i = 0; i < N; i++) {
        object *o = PyObject_Malloc(sizeof(object)); /* @site PyObject_Malloc calls=2000 bytes=32000 live=500,8000 */
        if (o == NULL)
            return 1;
        o->type = &small_type;
        o->value = i;
        objects[i] = o;
    }
    for (int i = 0; i < 20; i++) {
        large[i] = PyObject_Malloc(1000 + (size_t)i); /* @site PyObject_Malloc calls=20 bytes=20190 live=10,10100 */
        if (large[i] == NULL)
            return 1;
        memset(large[i], i, 1000);
    }
    /* Half of the small objects freed through tp_free, a quarter directly. */
    for (int i = 0; i < N; i++) {
        sum += objects[i]->value;
        if (i % 2 == 0)
            dealloc(objects[i]);
        else if (i % 4 == 1)
            PyObject_Free(objects[i]); /* @site PyObject_Free calls=500 */
    }
    /* Half of the large ones through tp_free. */
    for (int i = 0; i < 20; i += 2) {
        sum += large[i][7];
        small_type.tp_free(large[i]);
    }
    printf("sum %ld, %zu large objects\n", sum, large_objects);
    return 0;
}
