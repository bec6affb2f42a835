/*
 * context.c - contexts and their footprint.
 *
 * Creating a context costs device memory.  Its size is measured and charged:
 * the growth of the process's own usage in NVML's process list, or, where
 * that list cannot say (no per-process figures, host pid unknown), the
 * growth of the device's used memory, which also counts what other
 * processes allocated meanwhile (limited to the largest process that started
 * with ours, when several did).  The last measurement,
 * kept in the region, is reserved up front, so a context that would not fit
 * is refused with CUDA_ERROR_OUT_OF_MEMORY.  Destroying a context returns its
 * footprint and everything allocated in it.
 *
 * A context grows afterwards (modules loaded lazily, the driver's buffers):
 * reconcile.c charges that growth to the device's latest context.  The
 * context lock (gs_ctx_lock) serialises context records and those charges.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpuslice.h"

#define NO_READING UINT64_MAX

/* Recursive: the driver may call back into the process from inside a context call (a
 * profiler's resource callback on "context created" or "destroy starting"), and a callback
 * that creates or destroys a context of its own takes the lock again in the same thread. */
static pthread_mutex_t g_ctx_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static __thread unsigned t_ctx_depth; /* how many times this thread holds g_ctx_mu */
static CUcontext g_primary_ctx[GS_MAX_CUDA_DEVS];

/* Created contexts with usage counts beyond their creation's (deprecated cuCtxAttach): the
 * cuCtxDetach that takes the count to zero destroys the context.  Under g_ctx_mu. */
struct attached {
    CUcontext ctx;
    unsigned n;
};
static struct attached *g_attached;
static size_t g_nattached, g_attached_cap;

static void ctx_lock(void)
{
    pthread_mutex_lock(&g_ctx_mu);
    t_ctx_depth++;
}

static void ctx_unlock(void)
{
    t_ctx_depth--;
    pthread_mutex_unlock(&g_ctx_mu);
}

unsigned gs_ctx_enter(void)
{
    ctx_lock();
    return t_ctx_depth;
}

void gs_ctx_leave(void)
{
    ctx_unlock();
}

__thread unsigned gs_t_held;

int gs_ctx_lock(void)
{
    /* inside a context call of this thread (a driver callback) the call is measuring the
     * process: an allocation's or a load's reconcile would see its half-made context and is
     * skipped (the call measures when it returns).  A nested context call itself takes the
     * lock again and may reconcile near the cap; the outer call's measurement then subtracts
     * what that charged (charge_end: the process's charge moved meanwhile) */
    if (t_ctx_depth || gs_t_held) return -1;
    ctx_lock();
    return 0;
}

void gs_ctx_unlock(void)
{
    ctx_unlock();
}

static uint64_t nvml_used(CUdevice dev)
{
    nvmlMemory_t m;
    nvmlDevice_t h = gs_dev_nvml(dev);
    if (!h || !gs_nvml.nvmlDeviceGetMemoryInfo || gs_nvml.nvmlDeviceGetMemoryInfo(h, &m) != NVML_SUCCESS)
        return NO_READING;
    return m.used;
}

struct ctx_charge {
    int slot;
    uint64_t reserved;
    uint64_t before;
    uint64_t mine; /* what the process was charged on the device once the estimate was reserved */
    int busy;      /* allocations or frees were inside the driver when the measurement began */
    int first;     /* the process's first context on the device */
    int nprocs;
    nvmlProcessInfo_t procs[GS_MAX_PIDS];
};

static CUresult charge_begin(CUdevice dev, struct ctx_charge *c)
{
    c->nprocs = -1;
    c->slot = gs_dev_slot(dev);
    c->reserved = 0;
    c->before = NO_READING;
    if (c->slot < 0) return CUDA_SUCCESS;
    uint64_t estimate = __atomic_load_n(&gs_region->devices[c->slot].ctx_footprint_bytes, __ATOMIC_RELAXED);
    if (gs_near_cap(c->slot, estimate)) gs_reconcile_dev_locked(dev); /* another context of ours may have grown */
    if (gs_reserve_raw(c->slot, estimate) != 0) {
        GS_WARN("context refused: its footprint (%llu bytes) exceeds the remaining cap",
                (unsigned long long)estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->reserved = estimate;
    c->busy = __atomic_load_n(&gs_inflight, __ATOMIC_SEQ_CST) + __atomic_load_n(&gs_unsettled, __ATOMIC_SEQ_CST);
    c->first = gs_reconcile_dev_contexts(dev) == 0;
    c->mine = gs_slot_mine(c->slot);
    c->before = nvml_used(dev);
    c->nprocs = gs_list_processes(dev, c->procs, GS_MAX_PIDS);
    return CUDA_SUCCESS;
}

/* Returns the bytes the new context stays charged with. */
static uint64_t charge_end(CUdevice dev, struct ctx_charge *c, CUresult rc)
{
    if (c->slot < 0) return 0;
    if (rc != CUDA_SUCCESS) {
        gs_budget_release(c->slot, c->reserved);
        return 0;
    }
    uint64_t bound, others, measured = gs_ctx_growth(dev, c->procs, c->nprocs, c->first, &bound, &others);
    if (measured == NO_READING) {
        /* the device's growth: other tenants' allocations meanwhile count too, less what
         * processes that cannot be ours hold */
        uint64_t after = nvml_used(dev);
        if (c->before == NO_READING || after == NO_READING || after <= c->before + others) return c->reserved;
        measured = after - c->before - others;
        if (bound < measured) measured = bound;
    }
    /* what other threads allocated (or freed) meanwhile grew (or shrank) the process too, and
     * is charged by its own records; one that was inside the driver as the measurement began
     * or ended cannot be told apart: then the estimate stands (the reconcile adds what it
     * misses) */
    if (c->busy || __atomic_load_n(&gs_inflight, __ATOMIC_SEQ_CST) || __atomic_load_n(&gs_unsettled, __ATOMIC_SEQ_CST))
        return c->reserved;
    uint64_t mine = gs_slot_mine(c->slot);
    if (mine != c->mine) {
        if (mine > c->mine && measured <= mine - c->mine) return c->reserved;
        measured = mine > c->mine ? measured - (mine - c->mine) : measured + (c->mine - mine);
    }
    if (!measured) return c->reserved;
    /* a clean measurement of a process's first context on the device: the estimate for the
     * container's next contexts.  Not from a later one: code another thread's kernels load
     * lazily into a context of the device meanwhile passes no hook and would count */
    if (mine == c->mine && c->first)
        __atomic_store_n(&gs_region->devices[c->slot].ctx_footprint_bytes, measured, __ATOMIC_RELAXED);
    if (measured > c->reserved)
        gs_budget_force(c->slot, measured - c->reserved);
    else
        gs_budget_release(c->slot, c->reserved - measured);
    GS_DEBUG("context on device %d: footprint %llu bytes", (int)dev, (unsigned long long)measured);
    return measured;
}

static void record_ctx(CUcontext ctx, int slot, uint64_t bytes, CUdevice dev)
{
    struct gs_alloc rec = {.size = bytes, .slot = slot, .aux = (uint64_t)dev}, old;
    if (gs_am_put(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec, &old) == 1) gs_budget_release(old.slot, old.size);
    gs_reconcile_track_ctx(dev, ctx);
}

static struct attached *find_attached(CUcontext ctx)
{
    for (size_t i = 0; i < g_nattached; i++)
        if (g_attached[i].ctx == ctx) return &g_attached[i];
    return NULL;
}

static void forget_attached(struct attached *a)
{
    if (a) *a = g_attached[--g_nattached];
}

static void release_ctx(CUcontext ctx)
{
    struct gs_alloc rec;
    forget_attached(find_attached(ctx)); /* destroyed whatever its usage count */
    gs_forget_ctx(ctx);
    gs_graphmem_forget_ctx(ctx);
    gs_limits_forget_ctx(ctx);
    if (gs_am_take(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec) == 0) gs_budget_release(rec.slot, rec.size);
    gs_reconcile_forget_ctx(ctx); /* last: it measures what is left */
    gs_launch_forget_ctx(ctx);    /* under the context lock: a new context cannot take its handle first */
}


/* Primary contexts retained from inside the device discovery (a driver callback there): no
 * device is known yet, so they pass through, and are taken over once it is done */
#define GS_EARLY 8
static struct {
    CUcontext ctx;
    CUdevice dev;
} g_early[GS_EARLY];
static int g_nearly;

void gs_context_after_discovery(void)
{
    ctx_lock();
    for (int i = 0; i < g_nearly; i++) {
        CUdevice dev = g_early[i].dev;
        int slot = gs_dev_slot(dev);
        unsigned flags = 0;
        int active = 0;
        if (dev < 0 || dev >= GS_MAX_CUDA_DEVS || g_primary_ctx[dev] || slot < 0 || !gs_cuda.cuDevicePrimaryCtxGetState ||
            gs_cuda.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || !active)
            continue; /* released again meanwhile */
        /* the container's footprint estimate, forced (it exists already); the reconcile
         * charges what it really took beyond that */
        uint64_t bytes = __atomic_load_n(&gs_region->devices[slot].ctx_footprint_bytes, __ATOMIC_RELAXED);
        gs_budget_force(slot, bytes);
        g_primary_ctx[dev] = g_early[i].ctx;
        record_ctx(g_early[i].ctx, slot, bytes, dev);
        gs_reconcile_dev_locked(dev); /* what the process holds beyond its records, now */
        GS_INFO("a primary context retained during the device discovery is charged from now on");
    }
    g_nearly = 0;
    ctx_unlock();
}

GS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuDevicePrimaryCtxRetain) return CUDA_ERROR_NOT_SUPPORTED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (gs_t_held) return gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev); /* a driver callback: see gs_t_held */
    if (gs_devices_discovering()) {
        CUresult rc = gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
        ctx_lock();
        if (rc == CUDA_SUCCESS && g_nearly < GS_EARLY) g_early[g_nearly++] = (__typeof__(g_early[0])){*pctx, dev};
        ctx_unlock();
        return rc;
    }
    gs_devices_ready();
    unsigned flags = 0;
    int active = 1;
    if (dev < 0 || dev >= gs_dev_count() || dev >= GS_MAX_CUDA_DEVS || !gs_cuda.cuDevicePrimaryCtxGetState)
        return gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
    /* the state is read under the lock that releases and resets take too: an active context
     * cannot go between the check and the retain (which would then create one uncharged), and
     * one that another thread is creating is found active, not created twice */
    ctx_lock();
    if (gs_cuda.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || active) {
        CUresult rc = gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev); /* one more reference */
        ctx_unlock();
        return rc;
    }
    struct ctx_charge c;
    CUresult rc = charge_begin(dev, &c);
    if (rc == CUDA_SUCCESS) {
        rc = gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
        uint64_t bytes = charge_end(dev, &c, rc);
        if (rc == CUDA_SUCCESS) {
            g_primary_ctx[dev] = *pctx;
            record_ctx(*pctx, c.slot, bytes, dev);
        }
    }
    ctx_unlock();
    return rc;
}

static void primary_maybe_gone(CUdevice dev)
{
    unsigned flags = 0;
    int active = 1;
    if (dev < 0 || dev >= GS_MAX_CUDA_DEVS || !g_primary_ctx[dev] || !gs_cuda.cuDevicePrimaryCtxGetState ||
        gs_cuda.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || active)
        return;
    release_ctx(g_primary_ctx[dev]);
    g_primary_ctx[dev] = NULL;
}

typedef CUresult (*dev_fn)(CUdevice);

static CUresult primary_release(dev_fn release, CUdevice dev)
{
    if (gs_t_held) return release(dev); /* a driver callback under a lock of ours: see gs_t_held */
    ctx_lock();
    CUresult rc = release(dev);
    if (rc == CUDA_SUCCESS) primary_maybe_gone(dev);
    ctx_unlock();
    return rc;
}

/* A reset destroys every allocation and event of the primary context, whether
 * or not the driver then reports the context active. */
static CUresult primary_reset(dev_fn reset, CUdevice dev)
{
    if (gs_t_held) return reset(dev); /* a driver callback under a lock of ours: see gs_t_held */
    ctx_lock();
    CUresult rc = reset(dev);
    if (rc == CUDA_SUCCESS && dev >= 0 && dev < GS_MAX_CUDA_DEVS && g_primary_ctx[dev]) {
        gs_forget_ctx(g_primary_ctx[dev]);
        gs_launch_forget_ctx(g_primary_ctx[dev]);
        gs_graphmem_forget_ctx(g_primary_ctx[dev]);
        gs_limits_forget_ctx(g_primary_ctx[dev]); /* the reset context starts with the defaults */
    }
    if (rc == CUDA_SUCCESS) primary_maybe_gone(dev);
    if (rc == CUDA_SUCCESS) gs_reconcile_ctx_reset(dev); /* its code and buffers went */
    ctx_unlock();
    return rc;
}

/* The hooks of both generations (7.0's and 11.0's, same semantics) */
#define GS_PRIMARY_HOOK(name, impl)                                 \
    GS_EXPORT CUresult name(CUdevice dev)                           \
    {                                                               \
        gs_cuda_init();                                             \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;         \
        return impl(gs_cuda.name, dev);                             \
    }
GS_PRIMARY_HOOK(cuDevicePrimaryCtxRelease_v2, primary_release)
GS_PRIMARY_HOOK(cuDevicePrimaryCtxRelease, primary_release)
GS_PRIMARY_HOOK(cuDevicePrimaryCtxReset_v2, primary_reset)
GS_PRIMARY_HOOK(cuDevicePrimaryCtxReset, primary_reset)

#define GS_CTX_CREATE(call)                                                 \
    do {                                                                    \
        if (!pctx) return CUDA_ERROR_INVALID_VALUE;                         \
        if (gs_t_held) return (call); /* a driver callback: see gs_t_held */ \
        gs_devices_ready();                                                 \
        ctx_lock();                                      \
        struct ctx_charge c;                                                \
        CUresult rc = charge_begin(dev, &c);                                \
        if (rc == CUDA_SUCCESS) {                                           \
            rc = (call);                                                    \
            uint64_t bytes = charge_end(dev, &c, rc);                       \
            if (rc == CUDA_SUCCESS) record_ctx(*pctx, c.slot, bytes, dev);       \
        }                                                                   \
        ctx_unlock();                                    \
        return rc;                                                          \
    } while (0)

GS_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxCreate_v2) return CUDA_ERROR_NOT_SUPPORTED;
    GS_CTX_CREATE(gs_cuda.cuCtxCreate_v2(pctx, flags, dev));
}

GS_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) /* CUDA 2.x's */
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxCreate) return CUDA_ERROR_NOT_SUPPORTED;
    GS_CTX_CREATE(gs_cuda.cuCtxCreate(pctx, flags, dev));
}

GS_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                                  unsigned int flags, CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxCreate_v3) return CUDA_ERROR_NOT_SUPPORTED;
    GS_CTX_CREATE(gs_cuda.cuCtxCreate_v3(pctx, paramsArray, numParams, flags, dev));
}

GS_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                  CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxCreate_v4) return CUDA_ERROR_NOT_SUPPORTED;
    GS_CTX_CREATE(gs_cuda.cuCtxCreate_v4(pctx, ctxCreateParams, flags, dev));
}

static CUresult ctx_destroy(CUresult (*destroy)(CUcontext), CUcontext ctx)
{
    if (gs_t_held) return destroy(ctx); /* a driver callback under a lock of ours: see gs_t_held */
    ctx_lock(); /* a reconcile may be charging this context */
    CUresult rc = destroy(ctx);
    if (rc == CUDA_SUCCESS && ctx) release_ctx(ctx);
    ctx_unlock();
    return rc;
}

GS_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxDestroy_v2) return CUDA_ERROR_NOT_SUPPORTED;
    return ctx_destroy(gs_cuda.cuCtxDestroy_v2, ctx);
}

GS_EXPORT CUresult cuCtxDestroy(CUcontext ctx) /* CUDA 2.x's, same semantics */
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    return ctx_destroy(gs_cuda.cuCtxDestroy, ctx);
}

static int primary_dev_of(CUcontext ctx)
{
    for (int d = 0; d < GS_MAX_CUDA_DEVS; d++)
        if (ctx && g_primary_ctx[d] == ctx) return d;
    return -1;
}

/* CUDA 2.x's usage counts (deprecated, still exported): one more use of the current context.
 * A count that cannot be kept undoes the attach: a later detach would be taken for the
 * context's end, and its charge returned while it lives. */
GS_EXPORT CUresult cuCtxAttach(CUcontext *pctx, unsigned int flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxAttach) return CUDA_ERROR_NOT_SUPPORTED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (gs_t_held) return gs_cuda.cuCtxAttach(pctx, flags); /* a driver callback: see gs_t_held */
    ctx_lock();
    CUresult rc = gs_cuda.cuCtxAttach(pctx, flags);
    CUcontext ctx = rc == CUDA_SUCCESS ? *pctx : NULL;
    if (ctx && primary_dev_of(ctx) < 0) {
        struct attached *a = find_attached(ctx);
        if (!a && g_nattached == g_attached_cap) {
            size_t cap = g_attached_cap ? 2 * g_attached_cap : 8;
            struct attached *grown = realloc(g_attached, cap * sizeof(*grown));
            if (grown) {
                g_attached = grown;
                g_attached_cap = cap;
            }
        }
        if (!a && g_nattached < g_attached_cap) {
            a = &g_attached[g_nattached++];
            *a = (struct attached){ctx, 0};
        }
        if (a) {
            a->n++;
        } else {
            if (gs_cuda.cuCtxDetach) gs_cuda.cuCtxDetach(ctx);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    ctx_unlock();
    return rc;
}

/* One use less; the last destroys a created context (as cuCtxDestroy), and a primary
 * context's may leave it inactive (as a release) */
GS_EXPORT CUresult cuCtxDetach(CUcontext ctx)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxDetach) return CUDA_ERROR_NOT_SUPPORTED;
    if (gs_t_held) return gs_cuda.cuCtxDetach(ctx); /* a driver callback: see gs_t_held */
    ctx_lock();
    CUresult rc = gs_cuda.cuCtxDetach(ctx);
    if (rc == CUDA_SUCCESS && ctx) {
        int dev = primary_dev_of(ctx);
        struct attached *a = find_attached(ctx);
        if (dev >= 0)
            primary_maybe_gone(dev);
        else if (a) {
            if (!--a->n) forget_attached(a);
        } else
            release_ctx(ctx);
    }
    ctx_unlock();
    return rc;
}

void gs_context_after_fork_child(void)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&g_ctx_mu, &a);
    pthread_mutexattr_destroy(&a);
    /* forked inside a context call (a driver callback's): the child returns through it */
    for (unsigned i = 0; i < t_ctx_depth; i++) pthread_mutex_lock(&g_ctx_mu);
    memset(g_primary_ctx, 0, sizeof(g_primary_ctx));
    g_nearly = 0;
    g_nattached = 0; /* the parent's contexts are not the child's */
}
