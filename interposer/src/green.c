/*
 * green.c - green contexts (CUDA 12.4+): cuGreenCtxCreate, cuGreenCtxDestroy, gs_ctx_canonical.
 *
 * cuGreenCtxCreate retains the device's primary context (making it if it is not active) and
 * gives part of the GPU's SMs a context of its own; its CUcontext (cuCtxFromGreenCtx) shares
 * the primary context's memory and lifetime.  Here the primary context is retained first
 * through the primary hook's own path (charged if made), the green context's footprint is
 * measured like a context's and charged (not refused: no estimate is reserved first), and
 * allocations and graphs made in it are keyed by the primary context (gs_ctx_canonical), which
 * frees them; the throttle measures it as a context of its own (its events are its own).
 * cuGreenCtxDestroy returns the footprint and the primary context's reference.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "ctx_internal.h"

/* The green contexts alive, in chunks of GS_GREEN_CHUNK entries made as needed and never freed
 * (gs_ctx_canonical reads them without the lock): a fixed table of 64 left the 65th unbooked,
 * its footprint and what was allocated in it charged for ever (`test_memory.py -k past_the_64th`) */
#define GS_GREEN_CHUNK 64
#define GS_GREEN_CHUNKS 256
struct green {
    CUgreenCtx g;     /* NULL: free entry (under the context lock) */
    CUcontext as_ctx; /* read without the lock by gs_ctx_canonical: written last, cleared first */
    CUcontext primary;
    CUdevice dev;
    int slot;
    uint64_t bytes;
};
static struct green *g_chunks[GS_GREEN_CHUNKS]; /* published before g_nchunks counts them */
static int g_nchunks;
static int g_ngreens; /* entries in use; read without the lock */

CUcontext gs_ctx_canonical(CUcontext ctx)
{
    if (GS_LIKELY(!__atomic_load_n(&g_ngreens, __ATOMIC_ACQUIRE)) || !ctx) return ctx;
    int n = __atomic_load_n(&g_nchunks, __ATOMIC_ACQUIRE);
    for (int c = 0; c < n; c++) {
        struct green *chunk = __atomic_load_n(&g_chunks[c], __ATOMIC_ACQUIRE);
        for (int i = 0; i < GS_GREEN_CHUNK; i++)
            if (__atomic_load_n(&chunk[i].as_ctx, __ATOMIC_ACQUIRE) == ctx) {
                CUcontext p = __atomic_load_n(&chunk[i].primary, __ATOMIC_RELAXED);
                return p ? p : ctx;
            }
    }
    return ctx;
}

/* A free entry (under the context lock), a new chunk's if every one is taken; NULL if none can be made */
static struct green *green_free_locked(void)
{
    for (int c = 0; c < g_nchunks; c++)
        for (int i = 0; i < GS_GREEN_CHUNK; i++)
            if (!g_chunks[c][i].g) return &g_chunks[c][i];
    struct green *chunk = g_nchunks < GS_GREEN_CHUNKS ? calloc(GS_GREEN_CHUNK, sizeof(*chunk)) : NULL;
    if (!chunk) return NULL;
    __atomic_store_n(&g_chunks[g_nchunks], chunk, __ATOMIC_RELEASE);
    __atomic_add_fetch(&g_nchunks, 1, __ATOMIC_RELEASE);
    return chunk;
}

static struct green *green_find_locked(CUgreenCtx g)
{
    for (int c = 0; g && c < g_nchunks; c++)
        for (int i = 0; i < GS_GREEN_CHUNK; i++)
            if (g_chunks[c][i].g == g) return &g_chunks[c][i];
    return NULL;
}

static void green_put(struct green *e, CUgreenCtx g, CUcontext as_ctx, CUcontext primary, CUdevice dev, int slot,
                      uint64_t bytes)
{
    e->g = g;
    e->dev = dev;
    e->slot = slot;
    e->bytes = bytes;
    __atomic_store_n(&e->primary, primary, __ATOMIC_RELAXED);
    __atomic_store_n(&e->as_ctx, as_ctx, __ATOMIC_RELEASE);
    __atomic_add_fetch(&g_ngreens, 1, __ATOMIC_RELEASE);
}

GS_EXPORT CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags)
{
    gs_cuda_init();
    cuGreenCtxCreate_fn real = gs_cuda.cuGreenCtxCreate;
    if (!real) return CUDA_ERROR_NOT_SUPPORTED;
    /* from a driver callback: passed through (the reconcile charges what it misses) */
    if (!phCtx || gs_t_held || gs_devices_discovering()) return real(phCtx, desc, dev, flags);
    gs_devices_ready();
    if (dev < 0 || dev >= gs_dev_count() || dev >= GS_MAX_CUDA_DEVS || gs_dev_slot(dev) < 0 ||
        !gs_cuda.cuDevicePrimaryCtxGetState || !gs_cuda.cuDevicePrimaryCtxRetain ||
        !gs_cuda.cuDevicePrimaryCtxRelease_v2 || !gs_cuda.cuCtxFromGreenCtx)
        return real(phCtx, desc, dev, flags);
    gs_ctx_enter();
    CUcontext primary = NULL;
    struct green *e = green_free_locked(); /* stays free until green_put, under the lock */
    CUresult rc = e ? gs_primary_retain_locked(&primary, dev) : CUDA_ERROR_OUT_OF_MEMORY;
    if (!e)
        GS_WARN("a green context cannot be booked (%s): refused",
                g_nchunks < GS_GREEN_CHUNKS ? "no memory for its entry" : "too many alive at once");
    if (rc == CUDA_SUCCESS) {
        struct gs_ctx_charge c;
        (void)gs_ctx_charge_begin(dev, &c, 0); /* reserves nothing: cannot refuse (gs_ctx_charge_end can) */
        rc = real(phCtx, desc, dev, flags);
        uint64_t bytes = gs_ctx_charge_end(dev, &c, rc);
        CUcontext as_ctx = NULL;
        if (rc == CUDA_SUCCESS && c.over) { /* its footprint does not fit */
            if (gs_cuda.cuGreenCtxDestroy) gs_cuda.cuGreenCtxDestroy(*phCtx);
            *phCtx = NULL;
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (rc == CUDA_SUCCESS) {
            if (gs_cuda.cuCtxFromGreenCtx(&as_ctx, *phCtx) != CUDA_SUCCESS) as_ctx = NULL;
            green_put(e, *phCtx, as_ctx, primary, dev, c.slot, bytes);
            gs_primary_ref(dev); /* the green context's own, returned by its destroy */
        }
        /* this hook's reference goes (the green context holds its own): a primary context
         * made here for a creation that failed goes with it */
        int last;
        gs_primary_settle_if_last(dev, &last);
        if (gs_cuda.cuDevicePrimaryCtxRelease_v2(dev) == CUDA_SUCCESS) gs_primary_released(dev, last);
    }
    gs_ctx_unlock();
    return rc;
}

GS_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx hCtx)
{
    gs_cuda_init();
    if (!gs_cuda.cuGreenCtxDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    if (gs_t_held) return gs_cuda.cuGreenCtxDestroy(hCtx); /* a driver callback: its footprint stays charged */
    gs_ctx_enter();
    struct green *e = green_find_locked(hCtx);
    /* its work is measured while its events can be read (as before a context's destroy), and
     * the primary context's if the reference to it that goes with it is the last */
    int last = 0;
    if (e && e->as_ctx) gs_launch_settle_ctx(e->as_ctx);
    if (e) gs_primary_settle_if_last(e->dev, &last);
    gs_ctx_teardown_begin();
    CUresult rc = gs_cuda.cuGreenCtxDestroy(hCtx);
    if (e && rc == CUDA_SUCCESS) {
        if (e->as_ctx) gs_launch_forget_ctx(e->as_ctx); /* the throttle measures it as a context of its own */
        __atomic_store_n(&e->as_ctx, NULL, __ATOMIC_RELEASE);
        __atomic_sub_fetch(&g_ngreens, 1, __ATOMIC_RELEASE);
        if (e->slot >= 0) gs_budget_release(e->slot, e->bytes);
        CUdevice dev = e->dev;
        __atomic_store_n(&e->primary, NULL, __ATOMIC_RELAXED); /* a reader may still hold the entry */
        e->g = NULL;
        gs_primary_released(dev, last);
    }
    gs_ctx_teardown_end();
    gs_ctx_unlock();
    return rc;
}
