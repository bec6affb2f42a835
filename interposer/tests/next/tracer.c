/*
 * tracer.c - libgstracer.so: a tool preloaded before the interposer that wraps
 * cuMemAlloc_v2 and forwards with dlsym(RTLD_NEXT, ...), as API tracers do.  It
 * must reach the interposer's hook (and through it the driver), never itself.
 * Prints "tracer <calls>" at exit.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef int (*alloc_fn)(uint64_t *, size_t);
static int calls, depth;

__attribute__((visibility("default"))) int cuMemAlloc_v2(uint64_t *dptr, size_t size)
{
    static alloc_fn next;
    if (!next) next = (alloc_fn)dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    if (!next || depth > 0) return 999; /* no next, or we were handed ourselves */
    calls++;
    depth++;
    int rc = next(dptr, size);
    depth--;
    return rc;
}

__attribute__((destructor)) static void report(void)
{
    fprintf(stderr, "tracer %d\n", calls);
}
