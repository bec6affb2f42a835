/*
 * stress - threads allocating and freeing near the cap (plain and stream-ordered) while others
 * load modules and launch new kernels (memory the hooks do not see), launch kernels on their
 * own streams and on the per-thread default stream (throttled when CUDA_DEVICE_SM_LIMIT is
 * set), capture, instantiate, launch and trim graphs that allocate, and map and unmap VMM
 * allocations in every order of release and unmap, so the synchronous reconcile, the
 * sampler, the throttle, the graph-memory charge and the allocation hooks all run at once.  Links the fake driver.
 *
 *   stress ITERATIONS
 *
 * Prints "stress <errors> <region used> <physical>" after every thread has freed what it
 * allocated and one last allocation near the cap has reconciled: the container's charge in
 * the region (CUDA_DEVICE_MEMORY_SHARED_CACHE) must then equal what the fake driver holds for
 * the process (nothing counted twice, nothing lost); errors counts calls that failed with
 * anything but CUDA_ERROR_OUT_OF_MEMORY.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "gpuslice_region.h"

CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuGraphDestroy(CUgraph);
CUresult cuDeviceGraphMemTrim(CUdevice);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *, void *);
uint64_t fake_cuda_local_used(int pdev);

static CUcontext ctx;
static int iterations;
static int errors;

static void count(CUresult rc)
{
    if (rc != CUDA_SUCCESS && rc != CUDA_ERROR_OUT_OF_MEMORY) __atomic_add_fetch(&errors, 1, __ATOMIC_RELAXED);
}

static void *allocator(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    static const size_t sizes[] = {1u << 20, 16u << 20, 64u << 20};
    cuCtxSetCurrent(ctx);
    for (int i = 0; i < iterations; i++) {
        CUdeviceptr p = 0;
        size_t size = sizes[rand_r(&seed) % 3];
        int async = rand_r(&seed) % 2 == 0;
        CUresult rc = async ? cuMemAllocAsync(&p, size, NULL) : cuMemAlloc_v2(&p, size);
        count(rc);
        if (rc == CUDA_SUCCESS) count(async ? cuMemFreeAsync(p, NULL) : cuMemFree_v2(p));
    }
    return NULL;
}

static void *loader(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(ctx);
    for (int i = 0; i < iterations / 4; i++) {
        CUmodule m = NULL;
        CUfunction f = NULL;
        count(cuModuleLoadData(&m, "image"));
        if (m) count(cuModuleGetFunction(&f, m, "k"));
        if (f) count(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    }
    return NULL;
}

/* Kernels on a stream of its own (arg 0) or on the per-thread default stream (arg 1). */
static void *launcher(void *arg)
{
    int per_thread = arg != NULL;
    cuCtxSetCurrent(ctx);
    CUstream s = NULL;
    if (!per_thread) count(cuStreamCreate(&s, 0));
    CUfunction f = (CUfunction)(uintptr_t)(per_thread ? 0x5151 : 0x5150);
    for (int i = 0; i < iterations; i++)
        count(per_thread ? cuLaunchKernel_ptsz(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL)
                         : cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL));
    count(cuStreamSynchronize(s));
    return NULL;
}

/* Graphs that allocate 4 MiB (captured cuMemAllocAsync), launched twice each; the graph pool
 * is trimmed now and then and at the end. */
static void *grapher(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(ctx);
    CUstream s = NULL;
    count(cuStreamCreate(&s, 0));
    for (int i = 0; i < iterations / 8; i++) {
        CUgraph g = NULL;
        CUgraphExec e = NULL;
        CUdeviceptr p = 0;
        count(cuStreamBeginCapture_v2(s, 2 /* relaxed */));
        CUresult rc = cuMemAllocAsync(&p, 4u << 20, s);
        count(rc);
        if (rc == CUDA_SUCCESS) count(cuMemFreeAsync(p, s));
        count(cuStreamEndCapture(s, &g));
        if (g && cuGraphInstantiateWithFlags(&e, g, 0) == CUDA_SUCCESS) {
            for (int k = 0; k < 2; k++) count(cuGraphLaunch(e, s));
            count(cuStreamSynchronize(s));
            count(cuGraphExecDestroy(e));
        }
        if (g) count(cuGraphDestroy(g));
        if (i % 8 == 7) count(cuDeviceGraphMemTrim(0));
    }
    count(cuDeviceGraphMemTrim(0));
    return NULL;
}

/* VMM allocations released while mapped (freed by the unmap), or unmapped first, or with a
 * retained second reference (NCCL's order). */
static void *mapper(void *arg)
{
    (void)arg;
    unsigned seed = 99;
    CUmemAllocationProp prop = {1, 0, {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
    for (int i = 0; i < iterations / 2; i++) {
        size_t size = (size_t)(1 + rand_r(&seed) % 8) << 21;
        CUmemGenericAllocationHandle h = 0, again = 0;
        CUdeviceptr va = 0;
        CUresult rc = cuMemCreate(&h, size, &prop, 0);
        count(rc);
        if (rc != CUDA_SUCCESS) continue;
        count(cuMemAddressReserve(&va, size, 0, 0, 0));
        count(cuMemMap(va, size, 0, h, 0));
        switch (i % 3) {
        case 0:
            count(cuMemRelease(h));
            count(cuMemUnmap(va, size));
            break;
        case 1:
            count(cuMemUnmap(va, size));
            count(cuMemRelease(h));
            break;
        default:
            count(cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)va));
            count(cuMemRelease(again));
            count(cuMemUnmap(va, size));
            count(cuMemRelease(h));
            break;
        }
        count(cuMemAddressFree(va, size));
    }
    return NULL;
}

int main(int argc, char **argv)
{
    iterations = argc > 1 ? atoi(argv[1]) : 200;
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS) return 2;
    cuCtxSetCurrent(ctx);
    CUdeviceptr base = 0;
    count(cuMemAlloc_v2(&base, 700u << 20)); /* start near the cap */
    pthread_t t[9];
    for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, allocator, (void *)(uintptr_t)(i + 1));
    pthread_create(&t[4], NULL, loader, NULL);
    pthread_create(&t[5], NULL, launcher, NULL);
    pthread_create(&t[6], NULL, launcher, (void *)1);
    pthread_create(&t[7], NULL, grapher, NULL);
    pthread_create(&t[8], NULL, mapper, NULL);
    for (int i = 0; i < 9; i++) pthread_join(t[i], NULL);
    CUdeviceptr last = 0;
    CUresult rc = cuMemAlloc_v2(&last, 1u << 20); /* near the cap: reconciles, alone */
    count(rc);
    const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    int fd = path ? open(path, O_RDONLY) : -1;
    const struct gpuslice_region *r =
        fd < 0 ? MAP_FAILED : mmap(NULL, sizeof(*r), PROT_READ, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) return 2;
    printf("stress %d %llu %llu\n", errors, (unsigned long long)r->devices[0].used_bytes,
           (unsigned long long)fake_cuda_local_used(0));
    return 0;
}
