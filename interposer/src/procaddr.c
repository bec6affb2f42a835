/*
 * procaddr.c - cuGetProcAddress and cuGetProcAddress_v2.
 *
 * The CUDA runtime (and PyTorch, CuPy, JAX through it) finds every driver
 * function with cuGetProcAddress(symbol, &pfn, cudaVersion, flags).  We ask
 * the real driver first, so it alone decides which variant (_v2, _ptsz, ...)
 * the caller gets and whether the symbol exists at that version.  Then:
 *  1. if the pointer it returned is one of the real functions we hook, the
 *     caller gets our hook for exactly that function (same ABI by identity);
 *  2. if it is an export we do not hook (a later _vN of a hooked function, from
 *     a CUDA newer than the table), it is returned untouched: a hook chosen by
 *     name would have another signature;
 *  3. otherwise, if the driver handed out an address that is not an export
 *     (possible in principle), the hook is chosen by name: the entry whose
 *     base name is `symbol`, per-thread flag matches `flags`, and whose
 *     min_version is the highest one <= cudaVersion (cuGraphInstantiate from
 *     12.0 on being cuGraphInstantiateWithFlags); if the driver does not export
 *     that one, its counterpart of the same version that it does (the plain one
 *     for a missing _ptsz), else the driver's function unhooked.  Past the table's version
 *     (GS_HOOKS_CUDA_VERSION) a later CUDA may have added a variant the table
 *     does not know, of another signature: the name decides there only if the
 *     driver hands out the same address at the table's version.
 * Anything else is returned untouched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "gpuslice.h"

void *gs_cuda_hook_for_real(const char *symbol, void *real, int cuda_version, cuuint64_t flags)
{
    if (!real) return real;
    for (size_t i = 0; i < gs_cuda_hook_count; i++) {
        const struct gs_hook *h = &gs_cuda_hooks[i];
        if (*h->real && *h->real == real) return h->hook;
    }
    if (!symbol) return real;
    Dl_info info;
    if (dladdr(real, &info) && info.dli_sname && info.dli_saddr == real) return real;
    if (cuda_version > GS_HOOKS_CUDA_VERSION) {
        /* cuFoo_v3 of a later CUDA, named cuFoo, would get the cuFoo_v2 hook (another signature,
         * review): the same function at the table's version proves nothing changed since */
        void *then = NULL;
        CUresult rc = gs_cuda.cuGetProcAddress_v2
                          ? gs_cuda.cuGetProcAddress_v2(symbol, &then, GS_HOOKS_CUDA_VERSION, flags, NULL)
                      : gs_cuda.cuGetProcAddress ? gs_cuda.cuGetProcAddress(symbol, &then, GS_HOOKS_CUDA_VERSION, flags)
                                                 : CUDA_ERROR_NOT_SUPPORTED;
        if (rc != CUDA_SUCCESS || then != real) {
            GS_WARN("cuGetProcAddress(%s, %d): the driver's function is not an export and may be newer than the "
                    "library's hooks (CUDA %d): handed out unhooked",
                    symbol, cuda_version, GS_HOOKS_CUDA_VERSION);
            return real;
        }
        cuda_version = GS_HOOKS_CUDA_VERSION;
    }
    /* From CUDA 12.0 the name cuGraphInstantiate means cuGraphInstantiateWithFlags (cuda.h
     * renames it): another signature than the cuGraphInstantiate_v2 its base name suggests. */
    if (strcmp(symbol, "cuGraphInstantiate") == 0 && cuda_version >= 12000) symbol = "cuGraphInstantiateWithFlags";
    int per_thread = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct gs_hook *best = NULL;
    for (size_t i = 0; i < gs_cuda_hook_count; i++) {
        const struct gs_hook *h = &gs_cuda_hooks[i];
        if (strcmp(h->base, symbol) != 0 || h->min_version > cuda_version) continue;
        if (h->per_thread != per_thread) {
            /* A per-thread request for a function without a _ptsz variant
             * gets the plain one, as the driver does. */
            int has_variant = 0;
            for (size_t j = 0; j < gs_cuda_hook_count; j++)
                if (strcmp(gs_cuda_hooks[j].base, symbol) == 0 && gs_cuda_hooks[j].per_thread)
                    has_variant = 1;
            if (has_variant || h->per_thread) continue;
        }
        if (!best || h->min_version > best->min_version) best = h;
    }
    if (best && !*best->real) {
        /* this driver does not export it, so it cannot be what it handed out: its counterpart
         * of the same version (the same signature) that it does export is, where the per-thread
         * one is missing (a driver without cuStreamBeginCapture_v2_ptsz got that hook, with
         * nothing to call: 801 for every capture, `test_paths.py -k without_its_per_thread`);
         * else unhooked.  Never an older variant: another signature */
        const struct gs_hook *same = NULL;
        for (size_t i = 0; i < gs_cuda_hook_count && !same; i++) {
            const struct gs_hook *h = &gs_cuda_hooks[i];
            if (strcmp(h->base, best->base) == 0 && h->min_version == best->min_version && *h->real) same = h;
        }
        best = same;
    }
    if (best) {
        GS_DEBUG("cuGetProcAddress(%s, %d): driver address not an export, hooked by name as %s", symbol,
                 cuda_version, best->name);
        return best->hook;
    }
    return real;
}

GS_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuGetProcAddress) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = gs_cuda.cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn && *pfn) *pfn = gs_cuda_hook_for_real(symbol, *pfn, cudaVersion, flags);
    return rc;
}

GS_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *symbolStatus)
{
    gs_cuda_init();
    if (!gs_cuda.cuGetProcAddress_v2) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = gs_cuda.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn && *pfn) *pfn = gs_cuda_hook_for_real(symbol, *pfn, cudaVersion, flags);
    return rc;
}
