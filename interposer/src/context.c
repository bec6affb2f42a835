/*
 * context.c - contexts: the context lock and what it serialises, the queue of context calls
 * made from driver callbacks, created contexts (cuCtxCreate*, cuCtxDestroy*) and CUDA 2.x's
 * usage counts (cuCtxAttach, cuCtxDetach).  (A new context's footprint, measured and charged:
 * footprint.c.  Primary contexts: primary.c.  Green contexts: green.c.)
 *
 * Destroying a context returns its footprint and everything allocated in it.
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

#include "ctx_internal.h"

/* Recursive: the driver may call back into the process from inside a context call (a
 * profiler's resource callback on "context created" or "destroy starting"), and a callback
 * that creates or destroys a context of its own takes the lock again in the same thread. */
static pthread_mutex_t g_ctx_mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
__thread unsigned gs_t_ctx_depth; /* how many times this thread holds g_ctx_mu */

unsigned gs_ctx_teardown_seq;
static unsigned g_teardowns; /* nested (a driver callback's inside another): under g_ctx_mu */

void gs_ctx_teardown_begin(void)
{
    if (!g_teardowns++) __atomic_add_fetch(&gs_ctx_teardown_seq, 1, __ATOMIC_SEQ_CST);
}

void gs_ctx_teardown_end(void)
{
    if (!--g_teardowns) __atomic_add_fetch(&gs_ctx_teardown_seq, 1, __ATOMIC_SEQ_CST);
}

/* Created contexts with usage counts beyond their creation's (deprecated cuCtxAttach): the
 * cuCtxDetach that takes the count to zero destroys the context.  Under g_ctx_mu. */
struct attached {
    CUcontext ctx;
    unsigned n;
};
static struct attached *g_attached;
static size_t g_nattached, g_attached_cap;

static void drain_locked(void);

static void ctx_lock(void)
{
    pthread_mutex_lock(&g_ctx_mu);
    /* context calls that passed through earlier (from driver callbacks) are booked first, in
     * their order: before any later call on a context that may have the same handle */
    if (!gs_t_ctx_depth++ && !gs_t_held && __atomic_load_n(&gs_ctx_pending, __ATOMIC_ACQUIRE)) drain_locked();
}

static void ctx_unlock(void)
{
    if (gs_t_ctx_depth == 1 && !gs_t_held && __atomic_load_n(&gs_ctx_pending, __ATOMIC_ACQUIRE)) drain_locked();
    gs_t_ctx_depth--;
    pthread_mutex_unlock(&g_ctx_mu);
}

unsigned gs_ctx_enter(void)
{
    ctx_lock();
    return gs_t_ctx_depth;
}

__thread unsigned gs_t_held;

int gs_ctx_lock(void)
{
    /* inside a context call of this thread (a driver callback) the call is measuring the
     * process: an allocation's or a load's reconcile would see its half-made context and is
     * skipped (the call measures when it returns).  A nested context call itself takes the
     * lock again and may reconcile near the cap; the outer call's measurement then subtracts
     * what that charged (gs_ctx_charge_end: the process's charge moved meanwhile) */
    if (gs_t_ctx_depth || gs_t_held) return -1;
    ctx_lock();
    return 0;
}

void gs_ctx_unlock(void)
{
    ctx_unlock();
}

int gs_ctx_mine(void)
{
    return gs_t_ctx_depth != 0;
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

/* Contexts found gone (gs_ctx_release) and the teardown sequence they went at, the newest
 * GS_GONE: an allocation that cannot be asked for (an array) booked after a teardown is gone
 * with its context if that went since the allocation began (memory.c).  Under g_ctx_mu. */
#define GS_GONE 16
static struct gone_ctx {
    CUcontext ctx;
    unsigned seq;
} g_gone[GS_GONE];
static unsigned g_ngone;

int gs_ctx_gone_since_locked(CUcontext ctx, unsigned seq0)
{
    for (unsigned i = 0; ctx && i < GS_GONE && i < g_ngone; i++)
        if (g_gone[i].ctx == ctx && (int)(g_gone[i].seq - seq0) >= 0) return 1;
    return 0;
}

void gs_ctx_release(CUcontext ctx)
{
    struct gs_alloc rec;
    g_gone[g_ngone++ % GS_GONE] = (struct gone_ctx){ctx, gs_teardown_seq()};
    forget_attached(find_attached(ctx)); /* destroyed whatever its usage count */
    gs_forget_ctx(ctx);
    gs_graphmem_forget_ctx(ctx);
    gs_limits_forget_ctx(ctx);
    if (gs_am_take(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec) == 0) gs_budget_release(rec.slot, rec.size);
    gs_reconcile_forget_ctx(ctx); /* last: it measures what is left */
    gs_launch_forget_ctx(ctx);    /* under the context lock: a new context cannot take its handle first */
}

/* Context calls that passed straight through, from a driver callback inside the device
 * discovery (no device known yet) or under another lock of ours (see gs_t_held): the driver
 * did them, and their bookkeeping waits here until the context lock can be taken, in order.
 * The queue's own lock is never held across anything else.  (The calls: enum gs_ctx_op,
 * ctx_internal.h.) */
#define GS_PENDING 32
static pthread_mutex_t g_pend_mu = PTHREAD_MUTEX_INITIALIZER;
static struct pending {
    enum gs_ctx_op op;
    CUcontext ctx;
    CUdevice dev;
} g_pend[GS_PENDING];
static int g_npend;
int gs_ctx_pending;

void gs_ctx_defer(enum gs_ctx_op op, CUcontext ctx, CUdevice dev)
{
    pthread_mutex_lock(&g_pend_mu);
    if (g_npend < GS_PENDING) {
        g_pend[g_npend++] = (struct pending){op, ctx, dev};
        __atomic_store_n(&gs_ctx_pending, 1, __ATOMIC_RELEASE);
    } else {
        GS_WARN("too many context calls from driver callbacks at once: one is not booked");
    }
    pthread_mutex_unlock(&g_pend_mu);
}

static int attach_locked(CUcontext ctx);
static void detach_locked(CUcontext ctx, int settled);

static void drain_locked(void)
{
    /* not before the devices are known (the discovery books what came during it at its end:
     * a thread holding the context lock would wait for it in gs_dev_slot) */
    if (!gs_devices_known()) return;
    struct pending ops[GS_PENDING];
    pthread_mutex_lock(&g_pend_mu);
    int n = g_npend;
    memcpy(ops, g_pend, (size_t)n * sizeof(ops[0]));
    g_npend = 0;
    __atomic_store_n(&gs_ctx_pending, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_pend_mu);
    for (int i = 0; i < n; i++) {
        switch (ops[i].op) {
        case GS_OP_RETAIN:
            gs_primary_ref(ops[i].dev);
            gs_ctx_adopt_locked(ops[i].ctx, ops[i].dev, 1);
            break;
        case GS_OP_CREATE: gs_ctx_adopt_locked(ops[i].ctx, ops[i].dev, 0); break;
        case GS_OP_RELEASE: gs_primary_released(ops[i].dev, 1); break; /* could not settle: not the count's fault */
        case GS_OP_RESET: gs_primary_reset_done_locked(ops[i].dev); break;
        case GS_OP_DESTROY: gs_ctx_release(ops[i].ctx); break;
        case GS_OP_ATTACH:
            if (attach_locked(ops[i].ctx) != 0) GS_WARN("a context's usage count could not be kept");
            break;
        case GS_OP_DETACH: detach_locked(ops[i].ctx, 1); break;
        }
    }
}

/* After another lock of ours was released: booked now if the context lock is free (a launch
 * must not wait for a context creation in progress), else by whoever takes it next */
void gs_context_drain(void)
{
    if (pthread_mutex_trylock(&g_ctx_mu) != 0) return;
    if (!gs_t_ctx_depth++ && !gs_t_held) drain_locked();
    ctx_unlock();
}

void gs_context_after_discovery(void)
{
    if (!__atomic_load_n(&gs_ctx_pending, __ATOMIC_ACQUIRE)) return;
    ctx_lock(); /* drains */
    ctx_unlock();
}

/* A context just made whose footprint does not fit: destroyed (which also pops it from the
 * calling thread's stack, where creation pushed it). */
static void undo_create(CUcontext ctx)
{
    CUresult (*destroy)(CUcontext) = gs_cuda.cuCtxDestroy_v2 ? gs_cuda.cuCtxDestroy_v2 : gs_cuda.cuCtxDestroy;
    if (destroy && destroy(ctx) != CUDA_SUCCESS) GS_WARN("a context refused for the cap could not be destroyed");
}

#define GS_CTX_CREATE(call)                                                 \
    do {                                                                    \
        if (!pctx) return CUDA_ERROR_INVALID_VALUE;                         \
        if (gs_ctx_passes_through()) { /* a driver callback: booked later */ \
            CUresult prc = (call);                                          \
            if (prc == CUDA_SUCCESS) gs_ctx_defer(GS_OP_CREATE, *pctx, dev); \
            return prc;                                                     \
        }                                                                   \
        gs_devices_ready();                                                 \
        ctx_lock();                                      \
        struct gs_ctx_charge c;                                             \
        CUresult rc = gs_ctx_charge_begin(dev, &c, 1);                      \
        if (rc == CUDA_SUCCESS) {                                           \
            rc = (call);                                                    \
            uint64_t bytes = gs_ctx_charge_end(dev, &c, rc);                \
            if (rc == CUDA_SUCCESS && c.over) {                             \
                undo_create(*pctx);                                         \
                *pctx = NULL;                                               \
                rc = CUDA_ERROR_OUT_OF_MEMORY;                              \
            } else if (rc == CUDA_SUCCESS) {                                \
                gs_ctx_record(*pctx, c.slot, bytes, dev);                   \
            }                                                               \
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
    if (gs_ctx_passes_through()) { /* a driver callback: booked later (see gs_ctx_passes_through) */
        CUresult rc = destroy(ctx);
        if (rc == CUDA_SUCCESS && ctx) gs_ctx_defer(GS_OP_DESTROY, ctx, -1);
        return rc;
    }
    ctx_lock(); /* a reconcile may be charging this context */
    gs_launch_settle_ctx(ctx); /* its work is measured while its events can be read */
    gs_ctx_teardown_begin();
    CUresult rc = destroy(ctx);
    if (rc == CUDA_SUCCESS && ctx) gs_ctx_release(ctx);
    gs_ctx_teardown_end();
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

/* CUDA 2.x's usage counts (deprecated, still exported): one more use of the current context.
 * A count that cannot be kept undoes the attach: a later detach would be taken for the
 * context's end, and its charge returned while it lives. */
/* One more use of a created context counted: 0, or -1 if the count cannot be kept */
static int attach_locked(CUcontext ctx)
{
    if (!ctx || gs_primary_dev_of(ctx) >= 0) return 0;
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
    if (!a) return -1;
    a->n++;
    return 0;
}

GS_EXPORT CUresult cuCtxAttach(CUcontext *pctx, unsigned int flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxAttach) return CUDA_ERROR_NOT_SUPPORTED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (gs_ctx_passes_through()) { /* a driver callback: booked later (see gs_ctx_passes_through) */
        CUresult rc = gs_cuda.cuCtxAttach(pctx, flags);
        if (rc == CUDA_SUCCESS) gs_ctx_defer(GS_OP_ATTACH, *pctx, -1);
        return rc;
    }
    ctx_lock();
    CUresult rc = gs_cuda.cuCtxAttach(pctx, flags);
    if (rc == CUDA_SUCCESS && attach_locked(*pctx) != 0) {
        if (gs_cuda.cuCtxDetach) gs_cuda.cuCtxDetach(*pctx);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    ctx_unlock();
    return rc;
}

/* One use less, done by the driver: the last destroys a created context (as cuCtxDestroy),
 * and a primary context's may leave it inactive (as a release; an attach to it is not
 * counted as a reference, so its detach is taken for the last sooner rather than later) */
static void detach_locked(CUcontext ctx, int settled)
{
    if (!ctx) return;
    int dev = gs_primary_dev_of(ctx);
    struct attached *a = find_attached(ctx);
    if (dev >= 0)
        gs_primary_released(dev, settled);
    else if (a) {
        if (!--a->n) forget_attached(a);
    } else
        gs_ctx_release(ctx);
}

GS_EXPORT CUresult cuCtxDetach(CUcontext ctx)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxDetach) return CUDA_ERROR_NOT_SUPPORTED;
    if (gs_ctx_passes_through()) { /* a driver callback: booked later (see gs_ctx_passes_through) */
        CUresult rc = gs_cuda.cuCtxDetach(ctx);
        if (rc == CUDA_SUCCESS) gs_ctx_defer(GS_OP_DETACH, ctx, -1);
        return rc;
    }
    ctx_lock();
    int dev = gs_primary_dev_of(ctx), last = 0;
    if (dev >= 0)
        gs_primary_settle_if_last(dev, &last);
    else if (ctx && !find_attached(ctx))
        last = 1, gs_launch_settle_ctx(ctx); /* its last use: destroyed */
    gs_ctx_teardown_begin();
    CUresult rc = gs_cuda.cuCtxDetach(ctx);
    if (rc == CUDA_SUCCESS) detach_locked(ctx, last);
    gs_ctx_teardown_end();
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
    gs_primary_after_fork_child(); /* the array fence, the primary contexts' counts */
    /* forked inside a context call (a driver callback's): the child returns through it */
    for (unsigned i = 0; i < gs_t_ctx_depth; i++) pthread_mutex_lock(&g_ctx_mu);
    if (!gs_t_ctx_depth && g_teardowns) { /* another thread's teardown: it does not go on in the child */
        g_teardowns = 0;
        gs_ctx_teardown_seq++;
    }
    g_npend = 0;
    gs_ctx_pending = 0;
    pthread_mutex_init(&g_pend_mu, NULL);
    g_nattached = 0; /* the parent's contexts are not the child's */
    g_ngone = 0;
}
