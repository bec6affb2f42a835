/*
 * launch.c - the compute limit: CUDA_DEVICE_SM_LIMIT=C gives the container C%
 * of the GPU's time, enforced in the launch path.
 *
 * Measure, then pace.  Each throttled launch records a CUDA event after the
 * kernel on its stream (and one before it when the stream was idle, or had a
 * copy, host function or wait queued since its last launch: that gap is not
 * charged), so the
 * time between consecutive completed events is the GPU time the stream's
 * kernels took, or waited: a kernel queued behind another stream's counts
 * from its start event.  So the intervals of a context's streams are placed
 * on one timeline (each event's time after a reference event of that
 * context, re-based every GS_EPOCH_NS) and only their union is debited: N
 * streams whose kernels run one after another are charged their total, not
 * N(N+1)/2 kernels' worth.  Completed intervals are debited from a budget shared by all
 * processes of the container through the region: a virtual clock vt per
 * device, advanced by busy_ns * 100 / C.  A launch waits until vt <= now, and
 * vt never lags now by more than GS_BURST_NS (idle time buys at most that much
 * credit).  Over any long window GPU time / wall time therefore tends to C%,
 * for a few huge kernels (each one is debited in full when it ends, and the
 * next waits it off) as for floods of tiny ones (debited in batches).
 *
 * Work launched but not yet measured is bounded: at most GS_RING events per
 * stream (past that the newest event is recorded again, so it covers more
 * launches), and about GS_QUEUE_NS of estimated GPU time (one kernel while the
 * per-launch estimate is unknown), so the GPU cannot run far ahead of the
 * budget.  A launch waits for that queue at most GS_QUEUE_WAIT_NS: a program
 * whose queued kernel waits for the host (a stream wait on a flag the host
 * sets after its next launch) must not deadlock; what runs ahead is debited
 * when it completes all the same.  Synchronisations (cuCtxSynchronize[_v2],
 * cuStreamSynchronize, cuEventSynchronize) measure what completed, so the
 * last work before a process exits is charged too.  An interval is never
 * charged more than the host time since its first event was recorded (a
 * failed record cannot turn idle time into GPU time).
 *
 * Without a limit the launch path is one atomic load, one pointer load and a
 * tail call into the real function (the hooks at the end of this file).
 * Streams being captured into a graph are not touched (event queries would
 * invalidate the capture); the graph is paced when it is launched.  While
 * any thread captures in global mode, or this thread in any mode but
 * relaxed, the driver forbids event queries in the whole process (they would
 * invalidate that capture): launches then go unmeasured (cuStreamBeginCapture*
 * and cuStreamEndCapture* are hooked to know), but they still wait for the
 * budget and pay the last measured launch's GPU time in advance, and the
 * sampler settles that against NVML's per-process utilisation (slices.c).
 *
 * The throttle's files: this one (its state, the launch and synchronisation
 * hooks and their fast path), throttle.h (what the others share), clockcomp.c
 * (clock compensation, below), budget.c (the shared budget: the virtual clock,
 * its wait, launches a capture keeps from being measured), streams.c
 * (per-stream measurement, a context's end, fork and exit), timeline.c (a
 * context's timeline), capture.c (stream captures and their hooks), admit.c
 * (a launch's admission and its end event) and gaps.c (work between kernels:
 * copies, host functions, waits, and their hooks).
 *
 * Clock compensation (GPUSLICE_SM_LIMIT_MODE=throughput, the default, in
 * clockcomp.c) debits GPU time times how much faster the container's kernels
 * run than they would under full load (the GPU's spare power lets them clock
 * higher).
 */
#define _GNU_SOURCE
#include "throttle.h"

int thr_state;
int thr_time_mode; /* GPUSLICE_SM_LIMIT_MODE=time: no clock compensation */
int thr_gang = 1;  /* GPUSLICE_SM_LIMIT_GANG: launches wait for every limited device's clock */

void gs_launch_configure(void)
{
    int on = 0;
    struct gpuslice_region *r = gs_region;
    for (unsigned d = 0; r && d < gs_region_devices(r); d++) {
        unsigned sm = __atomic_load_n(&r->devices[d].sm_limit, __ATOMIC_RELAXED);
        if (sm > 0 && sm < 100) on = 1;
    }
    thr_time_mode = on && gs_env_sm_time_mode();
    thr_gang = !on || gs_env_sm_gang();
    __atomic_store_n(&thr_state, on ? THROTTLE_ON : THROTTLE_OFF, __ATOMIC_RELEASE);
    if (on) GS_INFO("compute limit active (%s)", thr_time_mode ? "time share" : "throughput, clock compensated");
}

/* Each region slot with a compute limit once, with a CUDA ordinal of it and its NVML handle
 * (slots NVML does not know are left out); returns how many. */
int gs_limited_devices(struct gs_limited_dev *out)
{
    struct gpuslice_region *r = gs_region;
    int done[GPUSLICE_MAX_DEVICES] = {0}, k = 0;
    int n = gs_dev_count();
    for (CUdevice dev = 0; r && dev < n && dev < GS_MAX_CUDA_DEVS; dev++) {
        int slot = gs_dev_slot(dev);
        nvmlDevice_t h = gs_dev_nvml(dev);
        if (slot < 0 || slot >= GPUSLICE_MAX_DEVICES || done[slot] || !h) continue;
        done[slot] = 1;
        unsigned sm = __atomic_load_n(&r->devices[slot].sm_limit, __ATOMIC_RELAXED);
        if (sm && sm < 100) out[k++] = (struct gs_limited_dev){dev, slot, h};
    }
    return k;
}

typedef CUresult (*launch_thunk)(const void *args);

/* A kernel launch's size for its cost's estimate (thr_cost_locked): its threads, grid times
 * block (saturated; 0 for a shape the driver refuses) */
static uint64_t launch_size(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz)
{
    unsigned __int128 grid = (unsigned __int128)gx * gy * gz, block = (unsigned __int128)bx * by * bz; /* < 2^96 */
    if (grid >> 64 || block >> 64) return UINT64_MAX;
    unsigned __int128 threads = grid * block;
    return threads >> 64 ? UINT64_MAX : (uint64_t)threads;
}

/* variable: a graph launch's gs_graph_variable, else 0; fn: the function or executable graph
 * launched, whose cost the launch's measurement teaches (thr_cost_locked), at `size` */
static CUresult throttled(CUstream stream, int per_thread, int variable, const void *fn, uint64_t size,
                          launch_thunk launch, const void *args)
{
    if (gs_t_held) { /* a driver callback under a lock of ours (maybe thr_mu): charged from NVML, not measured */
        CUresult rc = launch(args);
        if (rc == CUDA_SUCCESS) thr_callback_launched(stream, per_thread);
        return rc;
    }
    struct measured m;
    if (!thr_admit_locked(stream, per_thread, variable, (uint64_t)(uintptr_t)fn, size, &m)) return launch(args);
    thr_begin_locked(&m);
    thr_mu_unlock();
    thr_switch_to(&m.sw, 0);
    CUresult rc = launch(args);
    if (rc == CUDA_SUCCESS)
        thr_record_end(&m);
    else
        thr_launch_failed(&m);
    return rc;
}

/* ---- the hooks ------------------------------------------------------------ */

/* the size of a launch whose shape is in x's gridDimX .. blockDimZ */
#define SIZE_OF(x) launch_size((x).gridDimX, (x).gridDimY, (x).gridDimZ, (x).blockDimX, (x).blockDimY, (x).blockDimZ)

struct kernel_args {
    const void *real;
    CUfunction f;
    unsigned gx, gy, gz, bx, by, bz, shmem;
    CUstream stream;
    void **params, **extra;
};

static uint64_t kernel_size(const struct kernel_args *a)
{
    return launch_size(a->gx, a->gy, a->gz, a->bx, a->by, a->bz);
}

static CUresult call_kernel(const void *p)
{
    const struct kernel_args *a = p;
    return ((cuLaunchKernel_fn)a->real)(a->f, a->gx, a->gy, a->gz, a->bx, a->by, a->bz, a->shmem, a->stream,
                                        a->params, a->extra);
}

static CUresult call_coop(const void *p)
{
    const struct kernel_args *a = p;
    return ((cuLaunchCooperativeKernel_fn)a->real)(a->f, a->gx, a->gy, a->gz, a->bx, a->by, a->bz, a->shmem,
                                                   a->stream, a->params);
}

struct ex_args {
    const void *real;
    const CUlaunchConfig *config;
    CUfunction f;
    void **params, **extra;
};

static CUresult call_ex(const void *p)
{
    const struct ex_args *a = p;
    return ((cuLaunchKernelEx_fn)a->real)(a->config, a->f, a->params, a->extra);
}

struct graph_args {
    const void *real;
    CUgraphExec exec;
    CUstream stream;
};

static CUresult call_graph(const void *p)
{
    const struct graph_args *a = p;
    return ((cuGraphLaunch_fn)a->real)(a->exec, a->stream);
}

/* A graph with allocation nodes: its memory is reserved right before the driver call and
 * settled right after (graphmem.c), so the reconcile is kept waiting only that long, never
 * while the throttle waits for the budget. */
static CUresult call_graph_mem(const void *p)
{
    const struct graph_args *a = p;
    if (gs_graphmem_passthrough()) return call_graph(p); /* a driver callback under its lock: see graphmem.c */
    struct gs_graph_need need;
    uint64_t reserved[GS_GRAPH_DEVS];
    int mem = gs_graphmem_before(a->exec, &need, reserved);
    if (mem < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = call_graph(p);
    if (mem) gs_graphmem_after(a->exec, &need, reserved, rc == CUDA_SUCCESS);
    return rc;
}


#define GS_KERNEL_ARGS (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, \
                        kernelParams, extra)
#define GS_KERNEL_HOOK(name, pt, thunk)                                                                       \
    static __attribute__((noinline)) CUresult name##_slow GS_LAUNCH_PARAMS                                    \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        if (gs_lmem_watching() && gs_lmem_admit(f, hStream, pt) != 0) return CUDA_ERROR_OUT_OF_MEMORY;         \
        if (!throttle_on()) return gs_cuda.name GS_KERNEL_ARGS;                                               \
        struct kernel_args a = {(const void *)gs_cuda.name, f, gridDimX, gridDimY, gridDimZ, blockDimX,       \
                                blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra};          \
        return throttled(hStream, pt, 0, f, kernel_size(&a), thunk, &a);                                       \
    }                                                                                                         \
    GS_EXPORT CUresult name GS_LAUNCH_PARAMS                                                                  \
    {                                                                                                         \
        GS_FAST_LAUNCH(name, GS_KERNEL_ARGS);                                                                 \
        return name##_slow GS_KERNEL_ARGS;                                                                    \
    }

GS_KERNEL_HOOK(cuLaunchKernel, 0, call_kernel)
GS_KERNEL_HOOK(cuLaunchKernel_ptsz, 1, call_kernel)

#define GS_COOP_ARGS (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, \
                      kernelParams)
#define GS_COOP_HOOK(name, pt)                                                                                \
    static __attribute__((noinline)) CUresult name##_slow GS_COOP_PARAMS                                      \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        if (gs_lmem_watching() && gs_lmem_admit(f, hStream, pt) != 0) return CUDA_ERROR_OUT_OF_MEMORY;         \
        if (!throttle_on()) return gs_cuda.name GS_COOP_ARGS;                                                 \
        struct kernel_args a = {(const void *)gs_cuda.name, f, gridDimX, gridDimY, gridDimZ, blockDimX,       \
                                blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, NULL};           \
        return throttled(hStream, pt, 0, f, kernel_size(&a), call_coop, &a);                                   \
    }                                                                                                         \
    GS_EXPORT CUresult name GS_COOP_PARAMS                                                                    \
    {                                                                                                         \
        GS_FAST_LAUNCH(name, GS_COOP_ARGS);                                                                   \
        return name##_slow GS_COOP_ARGS;                                                                      \
    }

GS_COOP_HOOK(cuLaunchCooperativeKernel, 0)
GS_COOP_HOOK(cuLaunchCooperativeKernel_ptsz, 1)

/* cuLaunchCooperativeKernelMultiDevice (deprecated, still exported): one kernel per device,
 * each on a stream of its own, queued by one driver call.  Every stream waits for its
 * device's budget first; then the idle ones start their intervals, the call is made, and
 * each stream's end event is recorded.  (Nested throttled() calls, one per stream, let the
 * first stream's interval span the later ones' waits: 17 % per device at 30 %.) */
static __attribute__((noinline)) CUresult multi_slow(CUDA_LAUNCH_PARAMS *list, unsigned n, unsigned flags)
{
    gs_cuda_init();
    cuLaunchCooperativeKernelMultiDevice_fn real = gs_cuda.cuLaunchCooperativeKernelMultiDevice;
    if (!real) return CUDA_ERROR_NOT_SUPPORTED;
    /* one entry per device: a longer list is the driver's to refuse */
    if (gs_t_held) { /* a driver callback under a lock of ours: charged from NVML, not measured (throttled()) */
        CUresult rc = real(list, n, flags);
        int on = __atomic_load_n(&thr_state, __ATOMIC_ACQUIRE) == THROTTLE_ON && list && n <= GPUSLICE_MAX_DEVICES;
        for (unsigned i = 0; on && i < n && rc == CUDA_SUCCESS; i++) thr_callback_launched(list[i].hStream, 0);
        return rc;
    }
    if (!throttle_on() || !list || n > GPUSLICE_MAX_DEVICES || n > (unsigned)gs_dev_count())
        return real(list, n, flags);
    struct measured m[GPUSLICE_MAX_DEVICES];
    int on[GPUSLICE_MAX_DEVICES];
    for (unsigned i = 0; i < n; i++)
        if ((on[i] = thr_admit_locked(list[i].hStream, 0, 0, (uint64_t)(uintptr_t)list[i].function,
                                      SIZE_OF(list[i]), &m[i]))) {
            thr_mu_unlock();
            thr_switch_to(&m[i].sw, 0);
        }
    for (unsigned i = 0; i < n; i++)
        if (on[i] && thr_switch_to(&m[i].sw, 1) == 0) {
            thr_mu_lock();
            /* what ran while the later streams waited: else a stream whose work ended meanwhile
             * would not start a new interval, and its next one would span the wait */
            thr_measure_all_locked();
            thr_begin_locked(&m[i]);
            thr_mu_unlock();
            thr_switch_to(&m[i].sw, 0);
        }
    CUresult rc = real(list, n, flags);
    for (unsigned i = 0; i < n; i++)
        if (on[i] && rc == CUDA_SUCCESS)
            thr_record_end(&m[i]);
        else if (on[i])
            thr_launch_failed(&m[i]);
    return rc;
}

GS_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices,
                                                        unsigned int flags)
{
    GS_FAST(cuLaunchCooperativeKernelMultiDevice, (launchParamsList, numDevices, flags));
    return multi_slow(launchParamsList, numDevices, flags);
}

#define GS_EX_HOOK(name, pt)                                                                                  \
    static __attribute__((noinline)) CUresult name##_slow(const CUlaunchConfig *config, CUfunction f,        \
                                                          void **kernelParams, void **extra)                  \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        if (gs_lmem_watching() && config && gs_lmem_admit(f, config->hStream, pt) != 0)                       \
            return CUDA_ERROR_OUT_OF_MEMORY;                                                                  \
        if (!throttle_on() || !config) return gs_cuda.name(config, f, kernelParams, extra);                   \
        struct ex_args a = {(const void *)gs_cuda.name, config, f, kernelParams, extra};                      \
        return throttled(config->hStream, pt, 0, f, SIZE_OF(*config), call_ex, &a);                            \
    }                                                                                                         \
    GS_EXPORT CUresult name(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)    \
    {                                                                                                         \
        GS_FAST_LAUNCH(name, (config, f, kernelParams, extra));                                               \
        return name##_slow(config, f, kernelParams, extra);                                                   \
    }

GS_EX_HOOK(cuLaunchKernelEx, 0)
GS_EX_HOOK(cuLaunchKernelEx_ptsz, 1)

/* CUDA 2.x's launches (parameters from cuParamSet*, block shape from cuFuncSetBlockShape),
 * which the driver still exports though cuda.h no longer declares them: on the legacy
 * stream, or on a stream for cuLaunchGridAsync */
enum { GRID_ONE, GRID_SYNC, GRID_ASYNC };

struct grid_args {
    const void *real;
    CUfunction f;
    int w, h, how;
    CUstream stream;
};

static CUresult call_grid(const void *p)
{
    const struct grid_args *a = p;
    switch (a->how) {
    case GRID_ONE: return ((cuLaunch_fn)a->real)(a->f);
    case GRID_SYNC: return ((cuLaunchGrid_fn)a->real)(a->f, a->w, a->h);
    default: return ((cuLaunchGridAsync_fn)a->real)(a->f, a->w, a->h, a->stream);
    }
}

static __attribute__((noinline)) CUresult grid_slow(int how, CUfunction f, int w, int h, CUstream hStream)
{
    gs_cuda_init();
    const void *real = how == GRID_ONE    ? (const void *)gs_cuda.cuLaunch
                       : how == GRID_SYNC ? (const void *)gs_cuda.cuLaunchGrid
                                          : (const void *)gs_cuda.cuLaunchGridAsync;
    if (!real) return CUDA_ERROR_NOT_SUPPORTED;
    struct grid_args a = {real, f, w, h, how, hStream};
    if (gs_lmem_watching() && gs_lmem_admit(f, hStream, 0) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!throttle_on()) return call_grid(&a);
    return throttled(hStream, 0, 0, f, (uint64_t)(unsigned)w * (unsigned)h, call_grid, &a); /* block: cuFuncSetBlockShape's */
}

GS_EXPORT CUresult cuLaunch(CUfunction f)
{
    GS_FAST_LAUNCH(cuLaunch, (f));
    return grid_slow(GRID_ONE, f, 1, 1, NULL);
}

GS_EXPORT CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    GS_FAST_LAUNCH(cuLaunchGrid, (f, grid_width, grid_height));
    return grid_slow(GRID_SYNC, f, grid_width, grid_height, NULL);
}

GS_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
{
    GS_FAST_LAUNCH(cuLaunchGridAsync, (f, grid_width, grid_height, hStream));
    return grid_slow(GRID_ASYNC, f, grid_width, grid_height, hStream);
}

/* Graph launches also pay for the graph's allocation nodes (graphmem.c): the
 * fast path holds only while no executable graph has any. */
#define GS_GRAPH_HOOK(name, pt)                                                                               \
    static __attribute__((noinline)) CUresult name##_slow(CUgraphExec hGraphExec, CUstream hStream)           \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        struct graph_args a = {(const void *)gs_cuda.name, hGraphExec, hStream};                              \
        int mem = __atomic_load_n(&gs_graph_mem_execs, __ATOMIC_ACQUIRE) != 0;                                 \
        if (!throttle_on()) return mem ? call_graph_mem(&a) : call_graph(&a);                                 \
        /* refused at once, not after waiting for the compute budget */                                      \
        if (mem && gs_graphmem_check(hGraphExec) != 0) return CUDA_ERROR_OUT_OF_MEMORY;                       \
        return throttled(hStream, pt, gs_graph_variable(hGraphExec), hGraphExec, 1,                           \
                         mem ? call_graph_mem : call_graph, &a);                                              \
    }                                                                                                         \
    GS_EXPORT CUresult name(CUgraphExec hGraphExec, CUstream hStream)                                         \
    {                                                                                                         \
        if (GS_LIKELY(!__atomic_load_n(&gs_graph_mem_execs, __ATOMIC_RELAXED)))                               \
            GS_FAST(name, (hGraphExec, hStream));                                                             \
        return name##_slow(hGraphExec, hStream);                                                              \
    }

GS_GRAPH_HOOK(cuGraphLaunch, 0)
GS_GRAPH_HOOK(cuGraphLaunch_ptsz, 1)

/* An executable graph changed in place (updated from another graph, its nodes' parameters set, a
 * node enabled): what its launches cost is unknown until one is measured, so its next launch
 * waits for its stream's queue (thr_cost_locked).  Learnt over from the old figure instead, a
 * stream of 1 ms launches whose graph was changed to 100 ms queued twenty by it: 2 s of work
 * at once, 86.7 % of the GPU over 1.5 s under a 30 % limit (`test_throttle.py -k
 * changed_in_place`).  With no compute limit a tail call. */
static void graph_changed(CUgraphExec exec)
{
    gs_launch_cost_forget((uint64_t)(uintptr_t)exec);
    GS_DEBUG("executable graph %p changed: its next launches wait for their stream's queue", (void *)exec);
}

#define GS_GRAPH_CHANGE_HOOK(name, params, args)                                                              \
    GS_AFTER_HOOK(name, params, args, if (rc == CUDA_SUCCESS && throttle_on()) graph_changed(hGraphExec))

GS_GRAPH_CHANGE_HOOK(cuGraphExecUpdate, (CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out,
                                         CUgraphExecUpdateResult *updateResult_out),
                     (hGraphExec, hGraph, hErrorNode_out, updateResult_out))
GS_GRAPH_CHANGE_HOOK(cuGraphExecUpdate_v2,
                     (CUgraphExec hGraphExec, CUgraph hGraph, CUgraphExecUpdateResultInfo *resultInfo),
                     (hGraphExec, hGraph, resultInfo))
GS_GRAPH_CHANGE_HOOK(cuGraphExecKernelNodeSetParams,
                     (CUgraphExec hGraphExec, CUgraphNode hNode, const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams),
                     (hGraphExec, hNode, nodeParams))
GS_GRAPH_CHANGE_HOOK(cuGraphExecKernelNodeSetParams_v2,
                     (CUgraphExec hGraphExec, CUgraphNode hNode, const CUDA_KERNEL_NODE_PARAMS *nodeParams),
                     (hGraphExec, hNode, nodeParams))
GS_GRAPH_CHANGE_HOOK(cuGraphExecNodeSetParams, (CUgraphExec hGraphExec, CUgraphNode hNode, CUgraphNodeParams *nodeParams),
                     (hGraphExec, hNode, nodeParams))
GS_GRAPH_CHANGE_HOOK(cuGraphExecChildGraphNodeSetParams, (CUgraphExec hGraphExec, CUgraphNode hNode, CUgraph childGraph),
                     (hGraphExec, hNode, childGraph))
GS_GRAPH_CHANGE_HOOK(cuGraphNodeSetEnabled, (CUgraphExec hGraphExec, CUgraphNode hNode, unsigned int isEnabled),
                     (hGraphExec, hNode, isEnabled))
GS_GRAPH_CHANGE_HOOK(cuGraphExecMemcpyNodeSetParams,
                     (CUgraphExec hGraphExec, CUgraphNode hNode, const CUDA_MEMCPY3D *copyParams, CUcontext ctx),
                     (hGraphExec, hNode, copyParams, ctx))
GS_GRAPH_CHANGE_HOOK(cuGraphExecMemsetNodeSetParams,
                     (CUgraphExec hGraphExec, CUgraphNode hNode, const CUDA_MEMSET_NODE_PARAMS *memsetParams,
                      CUcontext ctx),
                     (hGraphExec, hNode, memsetParams, ctx))
GS_GRAPH_CHANGE_HOOK(cuGraphExecHostNodeSetParams,
                     (CUgraphExec hGraphExec, CUgraphNode hNode, const CUDA_HOST_NODE_PARAMS *nodeParams),
                     (hGraphExec, hNode, nodeParams))

/* Synchronisations: with a compute limit, what completed is measured afterwards
 * (gs_launch_after_sync); after stream-ordered frees, the pools learn which are complete
 * (gs_pools_after_sync: what, ctx, stream, per-thread).  Otherwise a tail call. */
#define GS_SYNC_HOOK(name, params, args, what, ctx, stream, pt)                                             \
    static __attribute__((noinline)) CUresult name##_slow params                                          \
    {                                                                                                     \
        gs_cuda_init();                                                                                   \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                               \
        struct gs_pool_sync ps;                                                                           \
        gs_pools_before_sync(&ps);                                                                        \
        CUresult rc = gs_cuda.name args;                                                                  \
        if (throttle_on()) gs_launch_after_sync();                                                        \
        if (rc == CUDA_SUCCESS && gs_pools_at_sync()) gs_pools_after_sync(&ps, what, ctx, stream, pt);    \
        return rc;                                                                                        \
    }                                                                                                     \
    GS_EXPORT CUresult name params                                                                        \
    {                                                                                                     \
        if (GS_LIKELY(!gs_pools_at_sync())) GS_FAST(name, args);                                         \
        return name##_slow args;                                                                          \
    }

GS_SYNC_HOOK(cuCtxSynchronize, (void), (), GS_SYNC_CTX, NULL, NULL, 0)
/* CUDA 13.0's (what cuGetProcAddress("cuCtxSynchronize", 13000) hands out): the context given,
 * the current one where it is NULL; what completed is measured in every context, as above */
GS_SYNC_HOOK(cuCtxSynchronize_v2, (CUcontext ctx), (ctx), GS_SYNC_CTX, ctx, NULL, 0)
GS_SYNC_HOOK(cuStreamSynchronize, (CUstream hStream), (hStream), GS_SYNC_STREAM, NULL, hStream, 0)
GS_SYNC_HOOK(cuStreamSynchronize_ptsz, (CUstream hStream), (hStream), GS_SYNC_STREAM, NULL, hStream, 1)
GS_SYNC_HOOK(cuEventSynchronize, (CUevent hEvent), (hEvent), GS_SYNC_EVENT, NULL, NULL, 0)
