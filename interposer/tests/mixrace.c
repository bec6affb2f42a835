/*
 * mixrace - threads of one process each doing, at random, one of the calls the other race
 * programs keep apart: allocations (plain, stream-ordered, from a pool of the process's own, as
 * arrays, managed), contexts made and destroyed with work in them, green contexts, limits set,
 * modules loaded and unloaded, kernels launched and synchronised, global and relaxed captures,
 * the device's current pool swapped, VMM mappings, memory queries through the driver and NVML.
 * For ThreadSanitizer (the ThreadSanitizer library preloaded): the calls' results are not
 * judged, only counted.  Links the fake driver and NVML.
 *
 *   mixrace ITERATIONS THREADS [SEED [OPS]]
 *     prints "mixrace <calls> <calls that failed>" once every thread is done; OPS (say "3,9")
 *     limits the threads to those calls (the numbers of the cases in one(), below)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "devpool.h"

CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, CUdevice);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuCtxSetLimit(CUlimit, size_t);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemPoolDestroy(CUmemoryPool);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
CUresult cuDeviceGetMemPool(CUmemoryPool *, CUdevice);
CUresult cuDeviceSetMemPool(CUdevice, CUmemoryPool);
CUresult cuArrayCreate_v2(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
CUresult cuArrayDestroy(CUarray);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuModuleUnload(CUmodule);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuGraphDestroy(CUgraph);
CUresult cuDeviceGraphMemTrim(CUdevice);
CUresult cuGreenCtxCreate(CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned);
CUresult cuGreenCtxDestroy(CUgreenCtx);
CUresult cuCtxFromGreenCtx(CUcontext *, CUgreenCtx);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned, nvmlDevice_t *);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);

#define KERNEL ((CUfunction)0x1234)
#define OPS 18

static CUcontext primary;
static CUmemoryPool own, def;
static int iterations, calls, failures;

static void count(CUresult rc)
{
    __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
    if (rc != CUDA_SUCCESS) __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
}

static size_t some_size(unsigned *seed)
{
    static const size_t sizes[] = {4096, 1u << 20, 8u << 20, 48u << 20};
    return sizes[rand_r(seed) % 4];
}

static void launches(CUstream s, int n)
{
    for (int i = 0; i < n; i++) count(cuLaunchKernel(KERNEL, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL));
}

static void one(int op, unsigned *seed, CUstream s)
{
    CUdeviceptr p = 0;
    CUresult rc;
    switch (op) {
    case 0: /* plain */
        count(rc = cuMemAlloc_v2(&p, some_size(seed)));
        if (rc == CUDA_SUCCESS) count(cuMemFree_v2(p));
        break;
    case 1: /* stream-ordered, from the device's current pool, freed on the stream */
        count(rc = cuMemAllocAsync(&p, some_size(seed), s));
        if (rc == CUDA_SUCCESS) count(cuMemFreeAsync(p, s));
        if (rand_r(seed) % 4 == 0) count(cuStreamSynchronize(s));
        break;
    case 2: /* from the process's own pool, trimmed now and then */
        count(rc = cuMemAllocFromPoolAsync(&p, some_size(seed), own, s));
        if (rc == CUDA_SUCCESS) count(cuMemFreeAsync(p, s));
        if (rand_r(seed) % 3 == 0) {
            count(cuStreamSynchronize(s));
            count(cuMemPoolTrimTo(own, 0));
        }
        break;
    case 3: { /* a context of its own, with work in it, destroyed */
        CUcontext c = NULL;
        count(rc = cuCtxCreate_v2(&c, 0, 0));
        if (rc == CUDA_SUCCESS) {
            CUstream cs = NULL;
            count(cuMemAlloc_v2(&p, 1u << 20));
            count(cuStreamCreate(&cs, 1));
            launches(cs, 3);
            if (cs) count(cuStreamDestroy_v2(cs));
            count(cuCtxDestroy_v2(c));
        }
        count(cuCtxSetCurrent(primary));
        break;
    }
    case 4: { /* a green context, work in it, destroyed */
        CUgreenCtx g = NULL;
        CUcontext as = NULL;
        count(rc = cuGreenCtxCreate(&g, (CUdevResourceDesc)(uintptr_t)1, 0, 1));
        if (rc != CUDA_SUCCESS) break;
        if (cuCtxFromGreenCtx(&as, g) == CUDA_SUCCESS && cuCtxSetCurrent(as) == CUDA_SUCCESS) {
            count(rc = cuMemAlloc_v2(&p, 1u << 20));
            launches(NULL, 2);
            if (rc == CUDA_SUCCESS) count(cuMemFree_v2(p));
            count(cuCtxSynchronize());
            count(cuCtxSetCurrent(primary));
        }
        count(cuGreenCtxDestroy(g));
        break;
    }
    case 5: /* the device heap's limit */
        count(cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, (size_t)(1 + rand_r(seed) % 64) << 20));
        break;
    case 6: { /* arrays */
        CUDA_ARRAY_DESCRIPTOR d = {1024, 1 + (size_t)(rand_r(seed) % 512), 0x20, 4};
        CUarray a = NULL;
        count(rc = cuArrayCreate_v2(&a, &d));
        if (rc == CUDA_SUCCESS) count(cuArrayDestroy(a));
        break;
    }
    case 7: { /* what the device has, through the driver and NVML */
        size_t fr = 0, tot = 0;
        nvmlDevice_t h = NULL;
        nvmlMemory_t m;
        count(cuMemGetInfo_v2(&fr, &tot));
        if (nvmlDeviceGetHandleByIndex_v2(0, &h) == NVML_SUCCESS) count(nvmlDeviceGetMemoryInfo(h, &m) ? 1 : 0);
        break;
    }
    case 8: { /* a module, its kernel, unloaded */
        CUmodule mod = NULL;
        CUfunction f = NULL;
        count(rc = cuModuleLoadData(&mod, "image"));
        if (rc != CUDA_SUCCESS) break;
        if (cuModuleGetFunction(&f, mod, "k") == CUDA_SUCCESS)
            count(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL));
        count(cuStreamSynchronize(s));
        count(cuModuleUnload(mod));
        break;
    }
    case 9: /* kernels */
        launches(s, 1 + rand_r(seed) % 8);
        if (rand_r(seed) % 2) count(cuStreamSynchronize(s));
        break;
    case 10: /* the device's current pool swapped */
        count(cuDeviceSetMemPool(0, rand_r(seed) % 2 ? own : def));
        break;
    case 11: { /* a capture (global or relaxed) that allocates, instantiated and launched */
        CUgraph g = NULL;
        CUgraphExec e = NULL;
        count(cuStreamBeginCapture_v2(s, rand_r(seed) % 2 ? 0 /* global */ : 2 /* relaxed */));
        count(rc = cuMemAllocAsync(&p, 2u << 20, s));
        launches(s, 1);
        if (rc == CUDA_SUCCESS) count(cuMemFreeAsync(p, s));
        count(cuStreamEndCapture(s, &g));
        if (g && cuGraphInstantiateWithFlags(&e, g, 0) == CUDA_SUCCESS) {
            count(cuGraphLaunch(e, s));
            count(cuStreamSynchronize(s));
            count(cuGraphExecDestroy(e));
        }
        if (g) count(cuGraphDestroy(g));
        if (rand_r(seed) % 4 == 0) count(cuDeviceGraphMemTrim(0));
        break;
    }
    case 12: { /* VMM */
        CUmemAllocationProp prop = {1, 0, {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
        CUmemGenericAllocationHandle h = 0;
        size_t size = (size_t)(1 + rand_r(seed) % 4) << 21;
        count(rc = cuMemCreate(&h, size, &prop, 0));
        if (rc != CUDA_SUCCESS) break;
        if (cuMemAddressReserve(&p, size, 0, 0, 0) == CUDA_SUCCESS) {
            count(cuMemMap(p, size, 0, h, 0));
            count(cuMemUnmap(p, size));
            count(cuMemAddressFree(p, size));
        }
        count(cuMemRelease(h));
        break;
    }
    case 13: /* managed */
        count(rc = cuMemAllocManaged(&p, some_size(seed), 1));
        if (rc == CUDA_SUCCESS) count(cuMemFree_v2(p));
        break;
    case 14:
        count(cuCtxSynchronize());
        break;
    case 16: /* the primary context reset (the others' work in it goes: their calls may fail) */
        count(cuDevicePrimaryCtxReset_v2(0));
        break;
    case 17: { /* a pool of its own, allocated from, destroyed with its allocation outstanding */
        CUmemoryPool mine = NULL;
        count(rc = device_pool_create(&mine));
        if (rc != CUDA_SUCCESS) break;
        count(rc = cuMemAllocFromPoolAsync(&p, some_size(seed), mine, s));
        if (rc == CUDA_SUCCESS && rand_r(seed) % 2) count(cuMemFreeAsync(p, s));
        count(cuMemPoolDestroy(mine));
        if (rc == CUDA_SUCCESS) count(cuMemFreeAsync(p, s));
        break;
    }
    default: /* a burst of small allocations held across others' calls */
    {
        CUdeviceptr held[8] = {0};
        for (int i = 0; i < 8; i++) count(cuMemAlloc_v2(&held[i], 512u << 10));
        for (int i = 0; i < 8; i++)
            if (held[i]) count(cuMemFree_v2(held[i]));
        break;
    }
    }
}

static unsigned base_seed;
static int ops[OPS], nops;

static void *worker(void *arg)
{
    unsigned seed = base_seed * 7919u + (unsigned)(uintptr_t)arg;
    CUstream s = NULL;
    count(cuCtxSetCurrent(primary));
    count(cuStreamCreate(&s, 1));
    for (int i = 0; i < iterations; i++) one(ops[rand_r(&seed) % nops], &seed, s);
    count(cuStreamSynchronize(s));
    return NULL;
}

int main(int argc, char **argv)
{
    iterations = argc > 1 ? atoi(argv[1]) : 200;
    int nthreads = argc > 2 ? atoi(argv[2]) : 6;
    base_seed = argc > 3 ? (unsigned)atoi(argv[3]) : (unsigned)getpid();
    if (nthreads < 1 || nthreads > 32) return 2;
    for (const char *p = argc > 4 ? argv[4] : NULL; p && *p && nops < OPS; p = strchr(p, ',') ? strchr(p, ',') + 1 : "")
        ops[nops++] = atoi(p) % OPS;
    if (!nops)
        for (; nops < OPS; nops++) ops[nops] = nops;
    if (cuInit(0) != CUDA_SUCCESS || nvmlInit_v2() != NVML_SUCCESS || cuDevicePrimaryCtxRetain(&primary, 0) != CUDA_SUCCESS)
        return 2;
    cuCtxSetCurrent(primary);
    if (device_pool_create(&own) != CUDA_SUCCESS || cuDeviceGetMemPool(&def, 0) != CUDA_SUCCESS) return 2;
    pthread_t t[32];
    for (int i = 0; i < nthreads; i++) pthread_create(&t[i], NULL, worker, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < nthreads; i++) pthread_join(t[i], NULL);
    printf("mixrace %d %d\n", calls, failures);
    return 0;
}
