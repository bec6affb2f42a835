/*
 * capture.c - stream captures, for the compute limit: while any thread
 * captures in global mode, or this thread in any mode but relaxed, the driver
 * forbids event queries in the whole process (they would invalidate that
 * capture).  The captures are counted here (cuStreamBeginCapture* and
 * cuStreamEndCapture* are hooked) so that the throttle knows
 * (thr_capture_forbids_queries, throttle.h).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "throttle.h"

/* The captures begun and not ended, on the heap (under g_cap_mu), grown as needed: a fixed table
 * of 64 left the 65th uncounted, and the throttle's event queries invalidated it
 * (`test_throttle.py -k beside_64`) */
static pthread_mutex_t g_cap_mu = PTHREAD_MUTEX_INITIALIZER;
static struct capture {
    uint64_t key; /* 0 = free */
    int mode;
    pid_t tid;     /* the thread that began it */
    CUcontext ctx; /* its stream's context (its end ends the capture) */
} *g_caps;
static size_t g_ncaps; /* entries allocated */
static int g_live;     /* entries taken (atomic): a stream's destroy looks only if some are */
int thr_global_captures;          /* captures in global mode, any thread (atomic) */
__thread int thr_strict_captures; /* this thread's captures not in relaxed mode */

int thr_settling; /* contexts being synchronised before their destroy (gs_launch_settle_ctx) */
__thread int thr_t_settling; /* of those, this thread's */

/* A global capture is counted before it begins (capture_announce), the others once begun. */
static void capture_announce(void)
{
    /* under thr_mu: no thread is querying events as the count goes up, and any that takes the
     * lock later sees it (the throttle queries under thr_mu and looks at the count first) */
    if (gs_t_held) { /* a driver callback under a lock of ours (maybe thr_mu itself): none is waited for */
        __atomic_add_fetch(&thr_global_captures, 1, __ATOMIC_ACQ_REL);
        return;
    }
    thr_mu_lock();
    __atomic_add_fetch(&thr_global_captures, 1, __ATOMIC_ACQ_REL);
    thr_mu_unlock();
    /* a context being settled before its destroy is synchronised outside thr_mu (it checked for
     * captures under it, before this one was counted): the capture begins after that sync, which
     * would invalidate it.  Not this thread's own: a capture begun from a driver callback inside
     * that very synchronisation waited for itself for ever (`test_throttle.py -k inside_the_settle`) */
    while (__atomic_load_n(&thr_settling, __ATOMIC_ACQUIRE) > thr_t_settling) gs_sleep_ns(GS_POLL_NS);
}

/* A free entry (g_cap_mu held), the table grown if every one is taken; NULL if it cannot grow */
static struct capture *capture_free_locked(void)
{
    for (size_t i = 0; i < g_ncaps; i++)
        if (!g_caps[i].key) return &g_caps[i];
    size_t n = g_ncaps ? 2 * g_ncaps : 64;
    struct capture *grown = realloc(g_caps, n * sizeof(*grown));
    if (!grown) return NULL;
    memset(grown + g_ncaps, 0, (n - g_ncaps) * sizeof(*grown));
    g_caps = grown;
    struct capture *c = &g_caps[g_ncaps];
    g_ncaps = n;
    return c;
}

static void capture_begun(CUstream stream, int per_thread, CUstreamCaptureMode mode, CUresult rc)
{
    struct capture *c = NULL;
    if (rc == CUDA_SUCCESS) {
        CUstream es = gs_effective_stream(stream, per_thread);
        uint64_t key = thr_stream_key(es);
        CUcontext ctx = gs_stream_ctx(es); /* NULL for a default stream: the current context's */
        if (!ctx && gs_cuda.cuCtxGetCurrent && gs_cuda.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS) ctx = NULL;
        pthread_mutex_lock(&g_cap_mu);
        if ((c = capture_free_locked())) {
            c->key = key;
            c->mode = mode;
            c->tid = (pid_t)syscall(SYS_gettid);
            c->ctx = ctx;
            __atomic_add_fetch(&g_live, 1, __ATOMIC_RELAXED);
        }
        pthread_mutex_unlock(&g_cap_mu);
        if (!c) GS_WARN("a stream capture could not be recorded (no memory): the throttle may invalidate it");
    }
    if (!c) { /* not begun, or not recorded: its end will not be seen */
        if (mode == CU_STREAM_CAPTURE_MODE_GLOBAL) __atomic_sub_fetch(&thr_global_captures, 1, __ATOMIC_ACQ_REL);
        return;
    }
    if (mode != CU_STREAM_CAPTURE_MODE_RELAXED) thr_strict_captures++;
}

static void capture_ended(CUstream stream, int per_thread)
{
    CUstream es = gs_effective_stream(stream, per_thread);
    if (gs_stream_capturing(es)) return; /* the end was refused: the capture goes on */
    uint64_t key = thr_stream_key(es);
    int mode = -1;
    pthread_mutex_lock(&g_cap_mu);
    for (size_t i = 0; i < g_ncaps && mode < 0; i++)
        if (g_caps[i].key == key) {
            mode = g_caps[i].mode;
            g_caps[i].key = 0;
            __atomic_sub_fetch(&g_live, 1, __ATOMIC_RELAXED);
        }
    pthread_mutex_unlock(&g_cap_mu);
    if (mode == CU_STREAM_CAPTURE_MODE_GLOBAL) __atomic_sub_fetch(&thr_global_captures, 1, __ATOMIC_ACQ_REL);
    if (mode >= 0 && mode != CU_STREAM_CAPTURE_MODE_RELAXED && thr_strict_captures > 0) thr_strict_captures--;
}

/* The captures of a stream that went, or of every stream of a context that went (ctx set):
 * no cuStreamEndCapture will come.  They stayed counted for good: every launch of the process
 * (of the thread, thread-local) went unmeasured, unpaced without NVML's figure, 151 % of the
 * fake GPU under 30 % (`test_throttle.py -k stream_is_destroyed`, `-k context_is_destroyed`).
 * Whether a driver lets a capturing stream be destroyed is not documented; if it refuses,
 * nothing is seen here.  A thread-local capture of another thread stays in that thread's count
 * (its counter is its own): that thread's launches stay unmeasured, charged from NVML, as while
 * it captured */
static void captures_gone(uint64_t key, CUcontext ctx)
{
    if (!__atomic_load_n(&g_live, __ATOMIC_RELAXED)) return;
    pid_t me = (pid_t)syscall(SYS_gettid);
    int global = 0, mine = 0;
    pthread_mutex_lock(&g_cap_mu);
    for (size_t i = 0; i < g_ncaps; i++) {
        if (!g_caps[i].key || (ctx ? g_caps[i].ctx != ctx : g_caps[i].key != key)) continue;
        global += g_caps[i].mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
        mine += g_caps[i].mode != CU_STREAM_CAPTURE_MODE_RELAXED && g_caps[i].tid == me;
        g_caps[i].key = 0;
        __atomic_sub_fetch(&g_live, 1, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&g_cap_mu);
    if (global) __atomic_sub_fetch(&thr_global_captures, global, __ATOMIC_ACQ_REL);
    thr_strict_captures = thr_strict_captures > mine ? thr_strict_captures - mine : 0;
}

void thr_capture_stream_destroyed(CUstream s)
{
    captures_gone(thr_stream_key(s), NULL);
}

void thr_capture_ctx_gone(CUcontext ctx)
{
    if (ctx) captures_gone(0, ctx);
}

/* In a child of fork(): the parent's other threads are gone, and with them their captures, the
 * settles they were in (a global capture begun in the child waited for those for ever) and any
 * hold of the table's lock.  The forking thread's own captures were of the parent's streams,
 * which the child cannot end either: its count starts over too. */
void thr_capture_after_fork_child(void)
{
    pthread_mutex_init(&g_cap_mu, NULL);
    if (g_caps) memset(g_caps, 0, g_ncaps * sizeof(*g_caps));
    g_live = 0;
    thr_global_captures = 0;
    thr_strict_captures = 0;
    thr_settling = 0;
    thr_t_settling = 0;
}

int gs_capture_global(void)
{
    return __atomic_load_n(&thr_global_captures, __ATOMIC_ACQUIRE) != 0;
}

/* Stream captures: counted, so that the throttle knows when event queries are forbidden. */
#define GS_CAPTURE_BEGIN_HOOK(name, pt, mode_of, params, args)                                                \
    GS_EXPORT CUresult name params                                                                            \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        /* a global capture forbids event queries in every thread: none may be running as it   \
         * begins, so it is counted before the call (no lock is held across the call: a        \
         * profiler's callback inside it may reach the throttle) */                             \
        CUstreamCaptureMode mode_ = (mode_of);                                                                \
        if (mode_ == CU_STREAM_CAPTURE_MODE_GLOBAL) capture_announce();                                       \
        CUresult rc = gs_cuda.name args;                                                                      \
        capture_begun(hStream, pt, mode_, rc);                                                                \
        return rc;                                                                                            \
    }
#define GS_TO_GRAPH_PARAMS                                                                                    \
    (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies, const CUgraphEdgeData *dependencyData, \
     size_t numDependencies, CUstreamCaptureMode mode)
#define GS_TO_GRAPH_ARGS (hStream, hGraph, dependencies, dependencyData, numDependencies, mode)

/* the first cuStreamBeginCapture (CUDA 10.0, still exported for old binaries) always captures in
 * global mode */
GS_CAPTURE_BEGIN_HOOK(cuStreamBeginCapture, 0, CU_STREAM_CAPTURE_MODE_GLOBAL, (CUstream hStream), (hStream))
GS_CAPTURE_BEGIN_HOOK(cuStreamBeginCapture_ptsz, 1, CU_STREAM_CAPTURE_MODE_GLOBAL, (CUstream hStream), (hStream))
GS_CAPTURE_BEGIN_HOOK(cuStreamBeginCapture_v2, 0, mode, (CUstream hStream, CUstreamCaptureMode mode), (hStream, mode))
GS_CAPTURE_BEGIN_HOOK(cuStreamBeginCapture_v2_ptsz, 1, mode, (CUstream hStream, CUstreamCaptureMode mode),
                      (hStream, mode))
GS_CAPTURE_BEGIN_HOOK(cuStreamBeginCaptureToGraph, 0, mode, GS_TO_GRAPH_PARAMS, GS_TO_GRAPH_ARGS)
GS_CAPTURE_BEGIN_HOOK(cuStreamBeginCaptureToGraph_ptsz, 1, mode, GS_TO_GRAPH_PARAMS, GS_TO_GRAPH_ARGS)
/* CUDA 13.3: a capture into an existing graph, its nodes in the original's order.  Unhooked, a
 * global one went uncounted, and the throttle's event queries from other threads invalidated it
 * (`test_throttle.py -k recapture`) */
#define GS_RECAPTURE_PARAMS                                                                                   \
    (CUstream hStream, CUstreamCaptureMode mode, CUgraph hGraph, CUgraphRecaptureCallback callbackFunc,       \
     void *userData)
#define GS_RECAPTURE_ARGS (hStream, mode, hGraph, callbackFunc, userData)
GS_CAPTURE_BEGIN_HOOK(cuStreamBeginRecaptureToGraph, 0, mode, GS_RECAPTURE_PARAMS, GS_RECAPTURE_ARGS)
GS_CAPTURE_BEGIN_HOOK(cuStreamBeginRecaptureToGraph_ptsz, 1, mode, GS_RECAPTURE_PARAMS, GS_RECAPTURE_ARGS)

#define GS_CAPTURE_END_HOOK(name, pt)                                                                         \
    GS_EXPORT CUresult name(CUstream hStream, CUgraph *phGraph)                                               \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        CUresult rc = gs_cuda.name(hStream, phGraph);                                                         \
        capture_ended(hStream, pt);                                                                           \
        return rc;                                                                                            \
    }

GS_CAPTURE_END_HOOK(cuStreamEndCapture, 0)
GS_CAPTURE_END_HOOK(cuStreamEndCapture_ptsz, 1)
