/*
 * teardownrace - threads of one process allocating (cuMemAlloc_v2, 1 to 4 MiB) and freeing at
 * random while the main thread resets the primary context again and again
 * (cuDevicePrimaryCtxReset_v2): every allocation races a teardown somewhere, before, during or
 * just after its driver call, and the library must book it by whether the driver still holds
 * it.  Links the fake driver.
 *
 *   teardownrace ITERATIONS THREADS RESETS [async]
 *     each thread does ITERATIONS allocations or frees (async: cuMemAllocAsync and
 *     cuMemFreeAsync from the device's default pool); the main thread RESETS resets, 200 us
 *     apart, while they run.  Then every thread frees what it holds (a pointer a reset freed
 *     answers an error, not counted), the context is made again, and the program prints
 *     "teardownrace <errors> <this process's charge> <what the fake driver holds for it>
 *     <retains>" (errors: allocations that failed with anything but CUDA_ERROR_OUT_OF_MEMORY;
 *     retains: a thread whose context a reset left inactive made it again, as programs do)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "gpuslice_region.h"
#include "selfcharge.h"

CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuCtxSynchronize(void);
CUresult cuDeviceGetMemPool(CUmemoryPool *, CUdevice);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
uint64_t fake_cuda_local_used(int pdev);

#define HELD 6

static CUcontext ctx;
static int iterations, errors, running, retained, async;

static void *worker(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg * 7919u + (unsigned)getpid();
    CUdeviceptr held[HELD] = {0};
    cuCtxSetCurrent(ctx);
    for (int i = 0; i < iterations; i++) {
        int k = rand_r(&seed) % HELD;
        if (held[k]) { /* freed by a reset meanwhile, the driver answers an error: not counted */
            if (async)
                cuMemFreeAsync(held[k], NULL);
            else
                cuMemFree_v2(held[k]);
            held[k] = 0;
        }
        if (rand_r(&seed) % 3) {
            size_t size = (size_t)(1 + rand_r(&seed) % 4) << 20;
            CUresult rc = async ? cuMemAllocAsync(&held[k], size, NULL) : cuMemAlloc_v2(&held[k], size);
            if (rc != CUDA_SUCCESS) {
                held[k] = 0;
                if (rc == CUDA_ERROR_INVALID_CONTEXT || rc == CUDA_ERROR_CONTEXT_IS_DESTROYED) {
                    /* a reset that leaves the context inactive: made again, as programs do */
                    CUcontext again;
                    if (cuDevicePrimaryCtxRetain(&again, 0) == CUDA_SUCCESS) {
                        cuCtxSetCurrent(again);
                        __atomic_add_fetch(&retained, 1, __ATOMIC_RELAXED);
                        continue;
                    }
                }
                if (rc != CUDA_ERROR_OUT_OF_MEMORY) __atomic_add_fetch(&errors, 1, __ATOMIC_RELAXED);
            }
        }
    }
    __atomic_sub_fetch(&running, 1, __ATOMIC_SEQ_CST);
    for (int k = 0; k < HELD; k++)
        if (held[k]) async ? cuMemFreeAsync(held[k], NULL) : cuMemFree_v2(held[k]);
    if (async) cuCtxSynchronize(); /* the pool gives its memory back (release threshold 0) */
    return NULL;
}

int main(int argc, char **argv)
{
    iterations = argc > 1 ? atoi(argv[1]) : 2000;
    int nthreads = argc > 2 ? atoi(argv[2]) : 3;
    int resets = argc > 3 ? atoi(argv[3]) : 200;
    async = argc > 4 && !strcmp(argv[4], "async");
    if (nthreads < 1 || nthreads > 32) return 2;
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS) return 2;
    cuCtxSetCurrent(ctx);
    running = nthreads;
    pthread_t t[32];
    for (int i = 0; i < nthreads; i++) pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < resets && __atomic_load_n(&running, __ATOMIC_SEQ_CST); i++) {
        if (cuDevicePrimaryCtxReset_v2(0) != CUDA_SUCCESS) __atomic_add_fetch(&errors, 1, __ATOMIC_RELAXED);
        usleep(200);
    }
    for (int i = 0; i < nthreads; i++) pthread_join(t[i], NULL);
    /* the context reset last is inactive or active (FAKE_CUDA_RESET_ACTIVE): made current again */
    if (cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS) return 2;
    cuCtxSetCurrent(ctx);
    CUmemoryPool pool;
    if (async && (cuCtxSynchronize() != CUDA_SUCCESS || cuDeviceGetMemPool(&pool, 0) != CUDA_SUCCESS ||
                  cuMemPoolTrimTo(pool, 0) != CUDA_SUCCESS))
        return 2; /* what the pool kept is given back: the charge follows at the trim */
    uint64_t mine;
    if (self_charge(&mine) != 0) return 2;
    printf("teardownrace %d %llu %llu %d\n", errors, (unsigned long long)mine,
           (unsigned long long)fake_cuda_local_used(0), retained);
    return 0;
}
