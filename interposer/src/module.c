/*
 * module.c - module and library loads: cuModuleLoad*, cuLibraryLoad*, and the
 * calls that load a function's code when loading is lazy
 * (cuModuleGetFunction, cuLibraryGetKernel, cuKernelGetFunction); and
 * cuCtxSetLimit, whose stack size, printf FIFO and malloc heap limits
 * reserve device memory (the stack for every thread the device can run).
 *
 * Code and those reserves take device memory no allocation hook sees.  After each of these
 * calls succeeds, what the process really holds is reconciled with its
 * charge (reconcile.c): at once when a device is near its cap, otherwise by
 * waking the background sampler, so the caller pays for an NVML query only
 * near the cap.  Loads are not refused: their size is unknown beforehand.
 * A limit's growth is known beforehand (the new value less the current one;
 * for the stack, per thread, times the threads the device runs at once): it is
 * reserved before the call and refused with CUDA_ERROR_OUT_OF_MEMORY past the
 * cap, as the driver documents, and then stays charged to the context.
 */
#define _GNU_SOURCE
#include "gpuslice.h"

#define GS_LOAD_HOOK(name, params, args)                          \
    GS_EXPORT CUresult name params                                \
    {                                                             \
        gs_cuda_init();                                           \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;       \
        CUresult rc = gs_cuda.name args;                          \
        if (rc == CUDA_SUCCESS) gs_reconcile_after_load();        \
        return rc;                                                \
    }

GS_LOAD_HOOK(cuModuleLoad, (CUmodule *module, const char *fname), (module, fname))
GS_LOAD_HOOK(cuModuleLoadData, (CUmodule *module, const void *image), (module, image))
GS_LOAD_HOOK(cuModuleLoadDataEx,
             (CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
              void **optionValues),
             (module, image, numOptions, options, optionValues))
GS_LOAD_HOOK(cuModuleLoadFatBinary, (CUmodule *module, const void *fatCubin), (module, fatCubin))
GS_LOAD_HOOK(cuModuleGetFunction, (CUfunction *hfunc, CUmodule hmod, const char *name), (hfunc, hmod, name))
GS_LOAD_HOOK(cuLibraryLoadData,
             (CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
              unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
              unsigned int numLibraryOptions),
             (library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions, libraryOptionValues,
              numLibraryOptions))
GS_LOAD_HOOK(cuLibraryLoadFromFile,
             (CUlibrary *library, const char *fileName, CUjit_option *jitOptions, void **jitOptionsValues,
              unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
              unsigned int numLibraryOptions),
             (library, fileName, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
              libraryOptionValues, numLibraryOptions))
GS_LOAD_HOOK(cuLibraryGetKernel, (CUkernel *pKernel, CUlibrary library, const char *name), (pKernel, library, name))
GS_LOAD_HOOK(cuKernelGetFunction, (CUfunction *pFunc, CUkernel kernel), (pFunc, kernel))
/* Device memory that setting `limit` to `value` adds in the current context (0: none, or
 * the driver cannot say; UINT64_MAX: more than can be counted). */
static uint64_t limit_growth(CUlimit limit, size_t value)
{
    size_t old = 0;
    if (limit < CU_LIMIT_STACK_SIZE || limit > CU_LIMIT_MALLOC_HEAP_SIZE || !gs_cuda.cuCtxGetLimit ||
        gs_cuda.cuCtxGetLimit(&old, limit) != CUDA_SUCCESS || value <= old)
        return 0;
    uint64_t grow = (uint64_t)(value - old);
    if (limit != CU_LIMIT_STACK_SIZE) return grow;
    CUdevice dev;
    int sms = 0, per_sm = 0;
    if (!gs_cuda.cuCtxGetDevice || !gs_cuda.cuDeviceGetAttribute || gs_cuda.cuCtxGetDevice(&dev) != CUDA_SUCCESS ||
        gs_cuda.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
        gs_cuda.cuDeviceGetAttribute(&per_sm, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) !=
            CUDA_SUCCESS ||
        sms <= 0 || per_sm <= 0)
        return 0;
    uint64_t threads = (uint64_t)sms * (uint64_t)per_sm;
    return grow > UINT64_MAX / threads ? UINT64_MAX : grow * threads;
}

GS_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxSetLimit) return CUDA_ERROR_NOT_SUPPORTED;
    gs_devices_ready();
    CUcontext ctx;
    int slot = gs_current_slot(&ctx);
    uint64_t grow = slot >= 0 ? limit_growth(limit, value) : 0;
    if (grow && gs_reserve(slot, grow) != 0) {
        GS_INFO("cuCtxSetLimit(%d, %zu) refused: it would take %llu more bytes than the cap leaves", (int)limit,
                value, (unsigned long long)grow);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = gs_cuda.cuCtxSetLimit(limit, value);
    if (grow) {
        if (rc == CUDA_SUCCESS)
            gs_ctx_keep_reserved(ctx, slot, grow);
        else
            gs_budget_release(slot, grow);
    }
    if (rc == CUDA_SUCCESS) gs_reconcile_after_load();
    return rc;
}
