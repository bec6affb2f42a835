/*
 * lmem.c - the local memory a launch makes the driver reserve, judged near the cap.
 *
 * CUDA reserves local memory for every thread the device runs at once: the per-thread stack
 * (CU_LIMIT_STACK_SIZE) times MULTIPROCESSOR_COUNT times MAX_THREADS_PER_MULTIPROCESSOR.  A
 * kernel that needs more local memory per thread (CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES) than the
 * context's stack limit makes the driver grow that reservation at its launch, and keep it
 * (cuda.h on CU_LIMIT_STACK_SIZE).  On an H100 or H200 (132 SMs x 2048 threads) each KiB per
 * thread is 264 MiB, which no allocation hook sees: only the reconcile charged it, after the
 * fact, so one launch near the cap could take the container GBs past it.
 *
 * Near the cap only (gs_lmem_watch, set by every near-cap reconcile and kept by the sampler's
 * ticks; far from it the launch hooks stay a tail call, one more load), a launch asks for its
 * function's local size once (cuFuncGetAttribute; for a CUkernel passed as a CUfunction, which
 * cuLaunchKernel and cuLaunchKernelEx accept, cuKernelGetAttribute on the current device where
 * the first refuses it), cached per handle until code is unloaded or a context goes, and where it
 * exceeds the context's stack, grows the stack first through the cuCtxSetLimit hook
 * (gs_limits_stack_for): reserved before the driver's call, refused past the cap, and then the
 * launch answers CUDA_ERROR_OUT_OF_MEMORY without reaching the driver.
 *
 * Skipped (the launch goes as before, its growth charged by the reconcile): a driver callback
 * under a lock of ours (gs_t_held), a launch on a stream of a context that is not the current one
 * (cuCtxSetLimit acts on the current context), a stream being captured, and while a capture
 * forbids potentially unsafe calls (a global one anywhere, a strict one on this thread): no
 * cuCtxSetLimit may be made then; a function whose local size the driver does not tell.
 */
#define _GNU_SOURCE
#include "throttle.h"

#include <string.h>

__attribute__((visibility("hidden"))) int gs_lmem_watch;
__attribute__((visibility("hidden"))) uint64_t gs_lmem_watch_at;

#define GS_LMEM_FNS 4096 /* direct-mapped: a function that collides is asked again */

struct fn_local {
    uintptr_t key;  /* the CUfunction (or CUkernel); 0 = empty */
    int32_t local;  /* bytes per thread; -1: the driver does not say */
};
static struct fn_local g_fns[GS_LMEM_FNS];
static pthread_mutex_t g_fn_mu = PTHREAD_MUTEX_INITIALIZER; /* a leaf: never held across a driver call */
static unsigned g_fn_gen; /* moves at every forget, under g_fn_mu */

void gs_lmem_forget_all(void)
{
    pthread_mutex_lock(&g_fn_mu);
    memset(g_fns, 0, sizeof(g_fns));
    g_fn_gen++;
    pthread_mutex_unlock(&g_fn_mu);
}

static unsigned fn_index(uintptr_t key)
{
    uint64_t h = (uint64_t)key * 0x9e3779b97f4a7c15ull;
    return (unsigned)(h >> 52) & (GS_LMEM_FNS - 1);
}

static int32_t ask_local(CUfunction f)
{
    int v = 0;
    if (gs_cuda.cuFuncGetAttribute &&
        gs_cuda.cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f) == CUDA_SUCCESS)
        return v < 0 ? -1 : v;
    /* a context-less kernel (cuLibraryGetKernel's CUkernel, cast): asked for the current device */
    CUdevice dev;
    if (gs_cuda.cuKernelGetAttribute && gs_cuda.cuCtxGetDevice && gs_cuda.cuCtxGetDevice(&dev) == CUDA_SUCCESS &&
        gs_cuda.cuKernelGetAttribute(&v, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, (CUkernel)(void *)f, dev) ==
            CUDA_SUCCESS)
        return v < 0 ? -1 : v;
    return -1;
}

/* f's local memory per thread, asked of the driver at its first launch near the cap only */
static int32_t fn_local(CUfunction f)
{
    uintptr_t key = (uintptr_t)f;
    unsigned i = fn_index(key);
    pthread_mutex_lock(&g_fn_mu);
    int hit = g_fns[i].key == key;
    int32_t local = g_fns[i].local;
    unsigned gen = g_fn_gen;
    pthread_mutex_unlock(&g_fn_mu);
    if (hit) return local;
    local = ask_local(f);
    pthread_mutex_lock(&g_fn_mu);
    if (gen == g_fn_gen) { /* not forgotten meanwhile (the handle may be another's now) */
        g_fns[i].key = key;
        g_fns[i].local = local;
    }
    pthread_mutex_unlock(&g_fn_mu);
    return local;
}

int gs_lmem_admit(CUfunction f, CUstream stream, int per_thread)
{
    if (gs_t_held || !f) return 0;
    int32_t local = fn_local(f);
    if (local <= 0) return 0;
    CUcontext cur = NULL;
    if (!gs_cuda.cuCtxGetCurrent || gs_cuda.cuCtxGetCurrent(&cur) != CUDA_SUCCESS || !cur) return 0;
    /* the common case near the cap, a kernel whose stack the context has already: no more driver
     * calls (a launch of it near the cap made four, for every launch) */
    if (gs_limits_stack_covers(cur, (size_t)local)) return 0;
    CUstream es = gs_effective_stream(stream, per_thread);
    CUcontext there = gs_stream_ctx(es);
    if (there && there != cur) return 0; /* another context's stream: cuCtxSetLimit would set ours */
    if (thr_capture_forbids_queries() || gs_stream_capturing(es)) return 0;
    return gs_limits_stack_for((size_t)local);
}

void gs_lmem_after_fork_child(void)
{
    pthread_mutex_init(&g_fn_mu, NULL);
}
