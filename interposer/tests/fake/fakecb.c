/*
 * fakecb.c - build/fake/libgsfakecb.so: where the fake driver's callbacks
 * (FAKE_CUDA_API_CALLBACK, FAKE_CUDA_CTX_CALLBACK) find the driver's API.  A
 * profiler's callback is the program's code, not the driver's: its dlsym must
 * come from outside libcuda (the interposer gives the driver's own lookups the
 * driver's functions, and the program's its hooks).
 */
#define _GNU_SOURCE
#include <dlfcn.h>

__attribute__((visibility("default"))) void *fake_api(const char *name)
{
    void *fn = dlsym(RTLD_DEFAULT, name);
    __asm__ volatile("" : : "r"(fn) : "memory"); /* no tail call: dlsym must see this library calling */
    return fn;
}
