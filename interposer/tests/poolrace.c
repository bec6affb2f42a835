/*
 * poolrace - threads of one process allocating from the device's default pool and from a pool
 * of their own (cuMemAllocAsync, cuMemAllocFromPoolAsync: 1 KiB to 1 MiB, or 1 to 48 MiB),
 * freeing (cuMemFreeAsync), trimming and synchronising at random, near the cap; run as
 * several processes of one container, the growth of one pool races the others'.  Links the
 * fake driver and NVML.
 *
 *   poolrace ITERATIONS THREADS
 *     every thread frees what it holds; then a synchronisation, both pools trimmed, and 1.2 s
 *     for the sampler; prints "poolrace <errors> <this process's charge> <what the fake driver
 *     holds for it>" (errors: calls that failed with anything but CUDA_ERROR_OUT_OF_MEMORY)
 *   poolrace monitor FILE
 *     (run without the interposer) reads NVML's device usage, as seen from outside, until FILE
 *     exists; prints "monitor <highest usage> <longest time above CAP_BYTES in us>", counting
 *     only sums read the same twice in a row (the fake sums the processes one by one)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "devpool.h"
#include "gpuslice_region.h"
#include "selfcharge.h"

CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
CUresult cuDeviceGetMemPool(CUmemoryPool *, CUdevice);
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned, nvmlDevice_t *);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);
uint64_t fake_cuda_local_used(int pdev);

#define HELD 8

static CUcontext ctx;
static CUmemoryPool own, def;
static int iterations, errors;

static void count(CUresult rc)
{
    if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_OUT_OF_MEMORY) __atomic_add_fetch(&errors, 1, __ATOMIC_RELAXED);
}

static void *worker(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg * 7919u + (unsigned)getpid();
    CUdeviceptr held[HELD] = {0};
    cuCtxSetCurrent(ctx);
    for (int i = 0; i < iterations; i++) {
        int op = rand_r(&seed) % 12, k = rand_r(&seed) % HELD;
        size_t size = rand_r(&seed) % 4 == 0 ? (size_t)(1 + rand_r(&seed) % 1024) << 10
                                             : (size_t)(1 + rand_r(&seed) % 48) << 20;
        if (op < 9 && held[k]) { /* a free, or one before the slot's next allocation */
            count(cuMemFreeAsync(held[k], NULL));
            held[k] = 0;
        }
        if (op < 6) {
            CUresult rc = op < 4 ? cuMemAllocAsync(&held[k], size, NULL)
                                 : cuMemAllocFromPoolAsync(&held[k], size, own, NULL);
            count(rc);
            if (rc != CUDA_SUCCESS) held[k] = 0;
        } else if (op == 9) {
            count(cuMemPoolTrimTo(rand_r(&seed) % 2 ? own : def, 0));
        } else if (op > 9) {
            count(cuCtxSynchronize()); /* FAKE_CUDA_POOL_RELEASE: the pools give back */
        }
    }
    for (int k = 0; k < HELD; k++)
        if (held[k]) count(cuMemFreeAsync(held[k], NULL));
    return NULL;
}

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000;
}

static int monitor(const char *done)
{
    nvmlDevice_t d = NULL;
    const char *cap = getenv("CAP_BYTES");
    unsigned long long limit = cap ? strtoull(cap, NULL, 10) : ~0ull, peak = 0, last = ~0ull;
    uint64_t over_since = 0, longest = 0;
    struct stat st;
    if (nvmlInit_v2() != NVML_SUCCESS || nvmlDeviceGetHandleByIndex_v2(0, &d) != NVML_SUCCESS) return 2;
    for (unsigned n = 0;; n++) {
        nvmlMemory_t m;
        if ((n & 1023) == 0 && stat(done, &st) == 0) break;
        if (nvmlDeviceGetMemoryInfo(d, &m) != NVML_SUCCESS) return 2;
        if (m.used == last) { /* the same twice in a row */
            uint64_t t = now_us();
            if (m.used > peak) peak = m.used;
            if (m.used <= limit) {
                over_since = 0;
            } else if (!over_since) {
                over_since = t;
            } else if (t - over_since > longest) {
                longest = t - over_since;
            }
        }
        last = m.used;
    }
    printf("monitor %llu %llu\n", peak, (unsigned long long)longest);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 2 && strcmp(argv[1], "monitor") == 0) return monitor(argv[2]);
    iterations = argc > 1 ? atoi(argv[1]) : 200;
    int nthreads = argc > 2 ? atoi(argv[2]) : 4;
    if (nthreads < 1 || nthreads > 32) return 2;
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS) return 2;
    cuCtxSetCurrent(ctx);
    if (device_pool_create(&own) != CUDA_SUCCESS || cuDeviceGetMemPool(&def, 0) != CUDA_SUCCESS) return 2;
    pthread_t t[32];
    for (int i = 0; i < nthreads; i++) pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < nthreads; i++) pthread_join(t[i], NULL);
    count(cuCtxSynchronize());
    count(cuMemPoolTrimTo(own, 0));
    count(cuMemPoolTrimTo(def, 0));
    usleep(1200 * 1000); /* the sampler's round */
    uint64_t mine;
    if (self_charge(&mine) != 0) return 2;
    printf("poolrace %d %llu %llu\n", errors, (unsigned long long)mine, (unsigned long long)fake_cuda_local_used(0));
    return 0;
}
