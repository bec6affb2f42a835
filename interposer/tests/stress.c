/*
 * stress - threads allocating and freeing near the cap (plain and stream-ordered) while others
 * load modules and launch new kernels (memory the hooks do not see), so the synchronous
 * reconcile, the sampler and the allocation hooks all run at once.  Links the fake driver.
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

int main(int argc, char **argv)
{
    iterations = argc > 1 ? atoi(argv[1]) : 200;
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS) return 2;
    cuCtxSetCurrent(ctx);
    CUdeviceptr base = 0;
    count(cuMemAlloc_v2(&base, 700u << 20)); /* start near the cap */
    pthread_t t[5];
    for (int i = 0; i < 4; i++) pthread_create(&t[i], NULL, allocator, (void *)(uintptr_t)(i + 1));
    pthread_create(&t[4], NULL, loader, NULL);
    for (int i = 0; i < 5; i++) pthread_join(t[i], NULL);
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
