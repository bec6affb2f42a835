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
GS_LOAD_HOOK(cuCtxSetLimit, (CUlimit limit, size_t value), (limit, value))
