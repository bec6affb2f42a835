/*
 * envsampler - count the library's reads of the environment from its sampler thread (named
 * "gpuslice"): the program's own threads may change the environment at any time (setenv,
 * putenv; Python's os.environ), and glibc's getenv beside a setenv may read a freed array, so
 * that thread must read none.  The program interposes secure_getenv (the library's reader;
 * linked -rdynamic so the library finds this one), makes a context (which starts the sampler),
 * launches a little, lets the sampler run for a while, and prints "envsampler N" with N the
 * reads made on the sampler thread.
 *
 *   envsampler [MILLISECONDS]
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "cuda_abi.h"

CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);

static int g_sampler_reads;

char *secure_getenv(const char *name)
{
    static char *(*real)(const char *);
    char me[32] = "";
    prctl(PR_GET_NAME, me, 0, 0, 0);
    if (!strcmp(me, "gpuslice")) __atomic_add_fetch(&g_sampler_reads, 1, __ATOMIC_RELAXED);
    if (!real) real = (char *(*)(const char *))dlsym(RTLD_NEXT, "secure_getenv");
    return real ? real(name) : NULL;
}

int main(int argc, char **argv)
{
    long ms = argc > 1 ? atol(argv[1]) : 1500;
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS ||
        cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
        return 1;
    struct timespec end, now;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_sec += ms / 1000;
    end.tv_nsec += (ms % 1000) * 1000000L;
    if (end.tv_nsec >= 1000000000L) end.tv_sec++, end.tv_nsec -= 1000000000L;
    do {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, 1 << 20) == CUDA_SUCCESS) cuMemFree_v2(p);
        struct timespec nap = {0, 20000000L};
        nanosleep(&nap, NULL);
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while (now.tv_sec < end.tv_sec || (now.tv_sec == end.tv_sec && now.tv_nsec < end.tv_nsec));
    printf("envsampler %d\n", __atomic_load_n(&g_sampler_reads, __ATOMIC_RELAXED));
    return 0;
}
