/*
 * cudashim.c - build/shim/libcuda.so.1: a driver library that finds its own functions through
 * dlsym, as WSL2's libcuda does with the driver it loads: cuInit and cuMemAlloc_v2 are looked
 * up in libcuda.so.1.1 (a copy of the fake driver) by dlsym on its handle and called through
 * the pointer; every other function is libcuda.so.1.1's, reached as a dependency.  The lookup
 * must give the driver's function: given the interposer's hook, the hook calls this library,
 * which calls the hook, until the stack runs out.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

typedef int (*init_fn)(unsigned);
typedef int (*alloc_fn)(unsigned long long *, size_t);

static void *inner(const char *name)
{
    void *h = dlopen("libcuda.so.1.1", RTLD_NOW | RTLD_NOLOAD);
    return h ? dlsym(h, name) : NULL;
}

__attribute__((visibility("default"))) int cuInit(unsigned flags)
{
    init_fn f = (init_fn)inner("cuInit");
    return f ? f(flags) : 999;
}

__attribute__((visibility("default"))) int cuMemAlloc_v2(unsigned long long *dptr, size_t size)
{
    alloc_fn f = (alloc_fn)inner("cuMemAlloc_v2");
    return f ? f(dptr, size) : 999;
}
