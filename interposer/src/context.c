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
 * appeared in the device's process list while our context was created.  A
 * sampler thread compares that real usage with what the process is charged
 * every GS_SAMPLE_NS and charges the difference to the device's latest
 * context, so later allocations see the cap as it really stands.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "gpuslice.h"

#define NO_READING UINT64_MAX
#define GS_SAMPLE_NS 500000000ull /* two process-list queries a second, off the hot path */
#define GS_SLACK (2ull << 20)     /* differences below this are noise */
#define GS_MAX_PIDS 256

static pthread_mutex_t g_ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static CUcontext g_primary_ctx[GS_MAX_CUDA_DEVS];
static unsigned g_host_pid[GS_MAX_CUDA_DEVS];
static CUcontext g_dev_ctx[GS_MAX_CUDA_DEVS]; /* where the sampler charges what it finds */
static int g_sampler_started;

static void start_sampler(void);

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
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS && g_host_pid[dev]) start_sampler();
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
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS) __atomic_store_n(&g_dev_ctx[dev], ctx, __ATOMIC_RELEASE);
}

static void release_ctx(CUcontext ctx)
{
    struct gs_alloc rec;
    for (int d = 0; d < GS_MAX_CUDA_DEVS; d++)
        if (g_dev_ctx[d] == ctx) __atomic_store_n(&g_dev_ctx[d], NULL, __ATOMIC_RELEASE);
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


/* ---- the sampler ---------------------------------------------------------- */

/* Compare NVML's view of this process with its charge on each device; charge
 * the difference to the device's latest context.  A sample is used only if no
 * charge changed while NVML was asked (allocations in flight would skew it). */
static void sample_once(void)
{
    static nvmlProcessInfo_t procs[GS_MAX_PIDS];
    for (CUdevice dev = 0; dev < GS_MAX_CUDA_DEVS; dev++) {
        CUcontext ctx = __atomic_load_n(&g_dev_ctx[dev], __ATOMIC_ACQUIRE);
        unsigned host_pid = __atomic_load_n(&g_host_pid[dev], __ATOMIC_RELAXED);
        int slot = gs_dev_slot(dev);
        if (!ctx || !host_pid || slot < 0) continue;
        uint64_t seq = gs_charge_seq(), mine = gs_slot_mine(slot);
        int n = list_processes(dev, procs, GS_MAX_PIDS);
        if (gs_charge_seq() != seq) continue;
        for (int i = 0; i < n; i++) {
            if (procs[i].pid != host_pid || procs[i].usedGpuMemory <= mine + GS_SLACK) continue;
            uint64_t extra = procs[i].usedGpuMemory - mine;
            struct gs_alloc rec, old;
            pthread_mutex_lock(&g_ctx_mu);
            if (g_dev_ctx[dev] == ctx && gs_am_take(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec) == 0) {
                GS_INFO("charging %llu bytes the process holds beyond its allocations (modules, driver)",
                        (unsigned long long)extra);
                gs_budget_force(rec.slot, extra);
                rec.size += extra;
                gs_am_put(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec, &old);
            }
            pthread_mutex_unlock(&g_ctx_mu);
        }
    }
}

static void *sampler(void *arg)
{
    (void)arg;
    for (;;) {
        gs_sleep_ns(GS_SAMPLE_NS);
        sample_once();
    }
    return NULL;
}

/* Started once a host pid is known; the NVML query (milliseconds) stays off
 * the program's own threads. */
static void start_sampler(void)
{
    if (__atomic_exchange_n(&g_sampler_started, 1, __ATOMIC_ACQ_REL)) return;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    if (pthread_create(&t, &attr, sampler, NULL) != 0) {
        GS_WARN("cannot start the memory sampler: memory beyond allocations is not charged");
        __atomic_store_n(&g_sampler_started, 0, __ATOMIC_RELEASE);
    }
    pthread_attr_destroy(&attr);
}

void gs_context_after_fork_child(void)
{
    pthread_mutex_init(&g_ctx_mu, NULL);
    memset(g_primary_ctx, 0, sizeof(g_primary_ctx));
    memset(g_dev_ctx, 0, sizeof(g_dev_ctx));
    memset(g_host_pid, 0, sizeof(g_host_pid));
    g_sampler_started = 0; /* threads do not survive fork */
}
