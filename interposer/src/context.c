/*
 * context.c - contexts and the memory a process holds that no allocation shows.
 *
 * Creating a context costs device memory.  Its size is measured (NVML used
 * memory of the device before and after) and charged; the last measurement,
 * kept in the region, is reserved up front, so a context that would not fit
 * is refused with CUDA_ERROR_OUT_OF_MEMORY.  Destroying a context returns its
 * footprint and everything allocated in it.
 *
 * A context grows afterwards (modules are loaded lazily at first launch, the
 * driver's own buffers).  NVML reports each process's real usage by host pid;
 * the host pid is ours when pid namespaces agree, or else the one pid that
 * appeared in the device's process list while our context was created.  At
 * most every GS_SAMPLE_NS, an allocation compares that real usage with what
 * the process is charged and charges the difference to the current context,
 * so later allocations see the cap as it really stands.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "gpuslice.h"

#define NO_READING UINT64_MAX
#define GS_SAMPLE_NS 500000000ull /* at most two process-list queries a second */
#define GS_SLACK (2ull << 20)     /* differences below this are noise */
#define GS_MAX_PIDS 256

static pthread_mutex_t g_ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static CUcontext g_primary_ctx[GS_MAX_CUDA_DEVS];
static unsigned g_host_pid[GS_MAX_CUDA_DEVS];
static uint64_t g_next_sample;

/* The device's process list (pid, bytes); -1 if NVML cannot say. */
static int list_processes(CUdevice dev, nvmlProcessInfo_t *out, unsigned cap)
{
    nvmlDevice_t h = gs_dev_nvml(dev);
    unsigned count = cap;
    gs_nvml_init();
    if (!h || !gs_nvml.nvmlDeviceGetComputeRunningProcesses_v3 ||
        gs_nvml.nvmlDeviceGetComputeRunningProcesses_v3(h, &count, out) != NVML_SUCCESS)
        return -1;
    return (int)count;
}

static void learn_host_pid(CUdevice dev, const nvmlProcessInfo_t *before, int nbefore)
{
    static nvmlProcessInfo_t after[GS_MAX_PIDS];
    int n = list_processes(dev, after, GS_MAX_PIDS);
    unsigned fresh = 0, nfresh = 0;
    for (int i = 0; i < n; i++) {
        if (after[i].pid == (unsigned)getpid()) { /* same pid namespace as the driver */
            g_host_pid[dev] = after[i].pid;
            return;
        }
        int seen = 0;
        for (int k = 0; k < nbefore && !seen; k++) seen = before[k].pid == after[i].pid;
        if (!seen) {
            fresh = after[i].pid;
            nfresh++;
        }
    }
    if (nfresh == 1) g_host_pid[dev] = fresh;
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
    if (gs_reserve(c->slot, estimate) != 0) {
        GS_WARN("context refused: its footprint (%llu bytes) exceeds the remaining cap",
                (unsigned long long)estimate);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->reserved = estimate;
    c->before = nvml_used(dev);
    if (dev < GS_MAX_CUDA_DEVS && !g_host_pid[dev]) c->nprocs = list_processes(dev, c->procs, GS_MAX_PIDS);
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
    if (c->nprocs >= 0) learn_host_pid(dev, c->procs, c->nprocs);
    uint64_t after = nvml_used(dev);
    if (c->before == NO_READING || after == NO_READING || after <= c->before) return c->reserved;
    uint64_t measured = after - c->before;
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
}

static void release_ctx(CUcontext ctx)
{
    struct gs_alloc rec;
    gs_forget_ctx(ctx);
    if (gs_am_take(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec) == 0) gs_budget_release(rec.slot, rec.size);
}

GS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuDevicePrimaryCtxRetain) return CUDA_ERROR_NOT_SUPPORTED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    gs_devices_ready();
    unsigned flags = 0;
    int active = 1;
    if (dev < 0 || dev >= gs_dev_count() || dev >= GS_MAX_CUDA_DEVS || !gs_cuda.cuDevicePrimaryCtxGetState ||
        gs_cuda.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || active)
        return gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
    pthread_mutex_lock(&g_ctx_mu);
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
    pthread_mutex_unlock(&g_ctx_mu);
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
    gs_launch_forget_ctx(g_primary_ctx[dev]);
    g_primary_ctx[dev] = NULL;
}

GS_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuDevicePrimaryCtxRelease_v2) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_ctx_mu);
    CUresult rc = gs_cuda.cuDevicePrimaryCtxRelease_v2(dev);
    if (rc == CUDA_SUCCESS) primary_maybe_gone(dev);
    pthread_mutex_unlock(&g_ctx_mu);
    return rc;
}

GS_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuDevicePrimaryCtxReset_v2) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_ctx_mu);
    CUresult rc = gs_cuda.cuDevicePrimaryCtxReset_v2(dev);
    if (rc == CUDA_SUCCESS) primary_maybe_gone(dev);
    pthread_mutex_unlock(&g_ctx_mu);
    return rc;
}

#define GS_CTX_CREATE(call)                                                 \
    do {                                                                    \
        if (!pctx) return CUDA_ERROR_INVALID_VALUE;                         \
        gs_devices_ready();                                                 \
        pthread_mutex_lock(&g_ctx_mu);                                      \
        struct ctx_charge c;                                                \
        CUresult rc = charge_begin(dev, &c);                                \
        if (rc == CUDA_SUCCESS) {                                           \
            rc = (call);                                                    \
            uint64_t bytes = charge_end(dev, &c, rc);                       \
            if (rc == CUDA_SUCCESS) record_ctx(*pctx, c.slot, bytes, dev);       \
        }                                                                   \
        pthread_mutex_unlock(&g_ctx_mu);                                    \
        return rc;                                                          \
    } while (0)

GS_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxCreate_v2) return CUDA_ERROR_NOT_SUPPORTED;
    GS_CTX_CREATE(gs_cuda.cuCtxCreate_v2(pctx, flags, dev));
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

GS_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxDestroy_v2) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = gs_cuda.cuCtxDestroy_v2(ctx);
    if (rc == CUDA_SUCCESS && ctx) {
        release_ctx(ctx);
        gs_launch_forget_ctx(ctx);
    }
    return rc;
}


void gs_footprint_refresh(CUcontext ctx)
{
    static nvmlProcessInfo_t procs[GS_MAX_PIDS];
    uint64_t now = gs_now_ns();
    if (!ctx || now < __atomic_load_n(&g_next_sample, __ATOMIC_RELAXED)) return;
    pthread_mutex_lock(&g_ctx_mu);
    if (now < g_next_sample) {
        pthread_mutex_unlock(&g_ctx_mu);
        return;
    }
    __atomic_store_n(&g_next_sample, now + GS_SAMPLE_NS, __ATOMIC_RELAXED);
    struct gs_alloc rec, old;
    if (gs_am_take(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec) == 0) {
        CUdevice dev = (CUdevice)rec.aux;
        int n = dev >= 0 && dev < GS_MAX_CUDA_DEVS && g_host_pid[dev] ? list_processes(dev, procs, GS_MAX_PIDS)
                                                                       : -1;
        for (int i = 0; i < n; i++) {
            if (procs[i].pid != g_host_pid[dev]) continue;
            uint64_t real = procs[i].usedGpuMemory, mine = gs_slot_mine(rec.slot);
            if (real > mine + GS_SLACK) {
                GS_INFO("charging %llu bytes the process holds beyond its allocations (modules, driver)",
                        (unsigned long long)(real - mine));
                gs_budget_force(rec.slot, real - mine);
                rec.size += real - mine;
            }
        }
        gs_am_put(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec, &old);
    }
    pthread_mutex_unlock(&g_ctx_mu);
}
