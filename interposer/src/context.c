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

/* References to each device's primary context taken through these hooks (the program's
 * retains, ours, a green context's), under g_ctx_mu.  The driver's count cannot be read: a
 * release that finds ours at one or less is taken for the last, and the context's work is
 * waited for and measured before the driver destroys it with its events (as before a
 * destroy); the others do not wait.  References taken unseen leave ours low: a release
 * settles though the context stays (a synchronisation more).  Releases unseen leave it high:
 * found when the context goes at a release that did not settle, after which every release on
 * the device settles (g_primary_unsure).  Ours is zeroed whenever the context is found gone. */
static unsigned g_primary_refs[GS_MAX_CUDA_DEVS];
static unsigned char g_primary_unsure[GS_MAX_CUDA_DEVS];

unsigned gs_ctx_teardown_seq;
static unsigned g_teardowns; /* nested (a driver callback's inside another): under g_ctx_mu */

static void teardown_begin(void)
{
    if (!g_teardowns++) __atomic_add_fetch(&gs_ctx_teardown_seq, 1, __ATOMIC_SEQ_CST);
}

static void teardown_end(void)
{
    if (!--g_teardowns) __atomic_add_fetch(&gs_ctx_teardown_seq, 1, __ATOMIC_SEQ_CST);
}

/* Array creations against primary resets.  An array's handle cannot be asked for, so an array
 * another thread's creation had inside the driver while a reset that keeps the context active
 * ran could have been made before the reset (which freed it) or after it (held): booked after
 * the reset, it stayed charged until the process exited (250 MiB for 50 held, `test_memory.py
 * -k made_before_a_reset`).  So a reset's driver call and its forget, and an array creation's
 * driver call and its booking, exclude each other: a creation before the reset is booked in
 * time for the reset's forget to drop it, one after it is made in the emptied context and
 * kept.  Creations share the lock (shared among themselves); a reset waits for those inside
 * the driver, and creations wait for a reset in progress (writers first: a stream of creations
 * cannot hold a reset off).  Taken before the context lock.  Not from a driver callback (this
 * thread inside a context call or holding another lock of ours; a nested creation or reset is
 * booked as before, by the teardown sequence), so a thread never takes it twice. */
static pthread_rwlock_t g_array_rw = PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
static __thread unsigned t_array_rw; /* this thread holds g_array_rw (shared or not) */

int gs_array_fence_enter(void)
{
    if (t_ctx_depth || gs_t_held || t_array_rw) return 0;
    pthread_rwlock_rdlock(&g_array_rw);
    t_array_rw++;
    return 1;
}

void gs_array_fence_call(void)
{
    gs_t_held++; /* a driver callback inside the creation waits for no lock of ours (a reset) */
}

void gs_array_fence_called(void)
{
    if (!--gs_t_held && GS_UNLIKELY(__atomic_load_n(&gs_ctx_pending, __ATOMIC_ACQUIRE))) gs_context_drain();
}

void gs_array_fence_leave(void)
{
    t_array_rw--;
    pthread_rwlock_unlock(&g_array_rw);
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
    if (!t_ctx_depth++ && !gs_t_held && __atomic_load_n(&gs_ctx_pending, __ATOMIC_ACQUIRE)) drain_locked();
}

static void ctx_unlock(void)
{
    if (t_ctx_depth == 1 && !gs_t_held && __atomic_load_n(&gs_ctx_pending, __ATOMIC_ACQUIRE)) drain_locked();
    t_ctx_depth--;
    pthread_mutex_unlock(&g_ctx_mu);
}

unsigned gs_ctx_enter(void)
{
    ctx_lock();
    return t_ctx_depth;
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
    int over;      /* made, but its measured footprint does not fit the cap: to be undone */
    int first;     /* the process's first context on the device */
    int nprocs;
    nvmlProcessInfo_t procs[GS_MAX_PIDS];
};

/* Why a context is refused, in the units a pod's limits are written in.  A footprint larger
 * than the whole cap can never fit: CUDA cannot start in this container, so that is an error
 * that says what to raise. */
static void refused(int slot, uint64_t footprint)
{
    uint64_t limit = gs_slot_limit(slot);
    unsigned long long cap = limit >> 20, used = gs_slot_used(slot) >> 20, need = footprint >> 20;
    if (footprint > limit)
        GS_ERROR("a CUDA context needs %llu MiB on this device, more than the container's whole cap of %llu MiB: "
                 "CUDA cannot start here; raise the memory limit (nvidia.com/gpumem) above the context's size",
                 need, cap);
    else
        GS_WARN("context refused: its footprint (%llu MiB) does not fit in what is left of the cap "
                "(%llu of %llu MiB in use by the container)",
                need, used, cap);
}

/* `estimate`: the container's footprint estimate is reserved first (a context that does not fit
 * is refused); else what the measurement finds is charged afterwards. */
static CUresult charge_begin(CUdevice dev, struct ctx_charge *c, int estimate_first)
{
    c->nprocs = -1;
    c->over = 0;
    c->slot = gs_dev_slot(dev);
    c->reserved = 0;
    c->before = NO_READING;
    if (c->slot < 0) return CUDA_SUCCESS;
    uint64_t estimate =
        estimate_first ? __atomic_load_n(&gs_region->devices[c->slot].ctx_footprint_bytes, __ATOMIC_RELAXED) : 0;
    if (gs_near_cap(c->slot, estimate)) gs_reconcile_dev_locked(dev); /* another context of ours may have grown */
    if (gs_reserve_raw(c->slot, estimate) != 0) {
        refused(c->slot, estimate);
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
    int from_device = measured == NO_READING;
    if (from_device) {
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
    /* the device's growth also holds what another tenant took meanwhile, and a driver that
     * leaves other namespaces' processes out of the list (or gives them no figure) leaves
     * nothing to take off: it is charged at most the container's estimate, and only a smaller
     * one becomes the estimate.  Charged whole, a co-tenant's 500 MiB taken while a context
     * was made went to the container, and into the estimate every later process reserved */
    uint64_t estimate = __atomic_load_n(&gs_region->devices[c->slot].ctx_footprint_bytes, __ATOMIC_RELAXED);
    if (from_device && estimate && measured > estimate) measured = estimate;
    /* a clean measurement of a process's first context on the device: the estimate for the
     * container's next contexts.  Not from a later one: code another thread's kernels load
     * lazily into a context of the device meanwhile passes no hook and would count */
    if (mine == c->mine && c->first && (!from_device || !estimate || measured < estimate))
        __atomic_store_n(&gs_region->devices[c->slot].ctx_footprint_bytes, measured, __ATOMIC_RELAXED);
    /* more than was reserved (nothing is, before the container's first clean measurement; a
     * few processes making their first contexts at once all reserve nothing): the rest must
     * fit, or the context is undone by the caller.  Forced, it took a container 128 MiB past
     * its cap while others filled it */
    if (measured > c->reserved && gs_reserve_raw(c->slot, measured - c->reserved) != 0) {
        gs_budget_release(c->slot, c->reserved);
        refused(c->slot, measured);
        c->over = 1;
        return 0;
    }
    if (measured < c->reserved) gs_budget_release(c->slot, c->reserved - measured);
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

/* Contexts found gone (release_ctx) and the teardown sequence they went at, the newest
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

static void release_ctx(CUcontext ctx)
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
 * The queue's own lock is never held across anything else. */
enum pending_op { OP_RETAIN, OP_CREATE, OP_RELEASE, OP_RESET, OP_DESTROY, OP_ATTACH, OP_DETACH };
#define GS_PENDING 32
static pthread_mutex_t g_pend_mu = PTHREAD_MUTEX_INITIALIZER;
static struct pending {
    enum pending_op op;
    CUcontext ctx;
    CUdevice dev;
} g_pend[GS_PENDING];
static int g_npend;
int gs_ctx_pending;

static void defer(enum pending_op op, CUcontext ctx, CUdevice dev)
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

/* A context that exists already: the container's footprint estimate, forced, and what the
 * process holds beyond its records, reconciled now */
static void adopt_locked(CUcontext ctx, CUdevice dev, int primary)
{
    int slot = gs_dev_slot(dev);
    unsigned flags = 0;
    int active = 0;
    struct gs_alloc rec;
    if (dev < 0 || dev >= GS_MAX_CUDA_DEVS || slot < 0) return;
    if (primary && (g_primary_ctx[dev] == ctx || !gs_cuda.cuDevicePrimaryCtxGetState ||
                    gs_cuda.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || !active))
        return; /* known, or released again meanwhile */
    if (!primary && gs_am_take(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec) == 0) {
        gs_am_put(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec, &rec); /* known already */
        return;
    }
    uint64_t bytes = __atomic_load_n(&gs_region->devices[slot].ctx_footprint_bytes, __ATOMIC_RELAXED);
    if (primary && g_primary_ctx[dev]) release_ctx(g_primary_ctx[dev]); /* released and made again meanwhile */
    gs_budget_force(slot, bytes);
    if (primary) g_primary_ctx[dev] = ctx;
    record_ctx(ctx, slot, bytes, dev);
    gs_reconcile_dev_locked(dev);
    GS_INFO("a context made from a driver callback is charged from now on");
}

static void primary_maybe_gone(CUdevice dev);
static void primary_ref(CUdevice dev);
static void primary_released(CUdevice dev, int settled);
static void reset_done_locked(CUdevice dev);
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
        case OP_RETAIN:
            primary_ref(ops[i].dev);
            adopt_locked(ops[i].ctx, ops[i].dev, 1);
            break;
        case OP_CREATE: adopt_locked(ops[i].ctx, ops[i].dev, 0); break;
        case OP_RELEASE: primary_released(ops[i].dev, 1); break; /* could not settle: not the count's fault */
        case OP_RESET: reset_done_locked(ops[i].dev); break;
        case OP_DESTROY: release_ctx(ops[i].ctx); break;
        case OP_ATTACH:
            if (attach_locked(ops[i].ctx) != 0) GS_WARN("a context's usage count could not be kept");
            break;
        case OP_DETACH: detach_locked(ops[i].ctx, 1); break;
        }
    }
}

/* After another lock of ours was released: booked now if the context lock is free (a launch
 * must not wait for a context creation in progress), else by whoever takes it next */
void gs_context_drain(void)
{
    if (pthread_mutex_trylock(&g_ctx_mu) != 0) return;
    if (!t_ctx_depth++ && !gs_t_held) drain_locked();
    ctx_unlock();
}

void gs_context_after_discovery(void)
{
    if (!__atomic_load_n(&gs_ctx_pending, __ATOMIC_ACQUIRE)) return;
    ctx_lock(); /* drains */
    ctx_unlock();
}

/* The primary context retained under the context lock; charged if it is made here. */
static CUresult primary_retain_locked(CUcontext *pctx, CUdevice dev)
{
    unsigned flags = 0;
    int active = 1;
    /* the state is read under the lock that releases and resets take too: an active context
     * cannot go between the check and the retain (which would then create one uncharged), and
     * one that another thread is creating is found active, not created twice */
    if (gs_cuda.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || active) {
        CUresult rc = gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev); /* one more reference */
        if (rc == CUDA_SUCCESS) primary_ref(dev);
        return rc;
    }
    struct ctx_charge c;
    CUresult rc = charge_begin(dev, &c, 1);
    if (rc == CUDA_SUCCESS) {
        rc = gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
        uint64_t bytes = charge_end(dev, &c, rc);
        if (rc == CUDA_SUCCESS && c.over) {
            /* ours is its only reference (it was inactive under this lock): it goes */
            CUresult (*release)(CUdevice) = gs_cuda.cuDevicePrimaryCtxRelease_v2 ? gs_cuda.cuDevicePrimaryCtxRelease_v2
                                                                                  : gs_cuda.cuDevicePrimaryCtxRelease;
            if (release) release(dev);
            *pctx = NULL;
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (rc == CUDA_SUCCESS) {
            g_primary_ctx[dev] = *pctx;
            primary_ref(dev);
            record_ctx(*pctx, c.slot, bytes, dev);
        }
    }
    return rc;
}

GS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuDevicePrimaryCtxRetain) return CUDA_ERROR_NOT_SUPPORTED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (gs_t_held || gs_devices_discovering()) { /* a driver callback: booked later (see defer) */
        CUresult rc = gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
        if (rc == CUDA_SUCCESS) defer(OP_RETAIN, *pctx, dev);
        return rc;
    }
    gs_devices_ready();
    if (dev < 0 || dev >= gs_dev_count() || dev >= GS_MAX_CUDA_DEVS || !gs_cuda.cuDevicePrimaryCtxGetState)
        return gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
    ctx_lock();
    CUresult rc = primary_retain_locked(pctx, dev);
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
    g_primary_refs[dev] = 0; /* whatever was counted, none is left */
    release_ctx(g_primary_ctx[dev]);
    g_primary_ctx[dev] = NULL;
}

static void primary_ref(CUdevice dev)
{
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS) g_primary_refs[dev]++;
}

/* Would a release now drop the last reference, as far as we can tell?  Then the context's
 * work is waited for and measured first (see g_primary_refs). */
static int primary_last_ref(CUdevice dev)
{
    return dev >= 0 && dev < GS_MAX_CUDA_DEVS && (g_primary_unsure[dev] || g_primary_refs[dev] <= 1);
}

static void primary_settle_if_last(CUdevice dev, int *last)
{
    *last = primary_last_ref(dev);
    if (*last) gs_launch_settle_ctx(g_primary_ctx[dev]); /* as before a destroy */
}

/* A reference went (the driver said so); `settled`: the context's work was measured first */
static void primary_released(CUdevice dev, int settled)
{
    if (dev < 0 || dev >= GS_MAX_CUDA_DEVS) return;
    if (g_primary_refs[dev]) g_primary_refs[dev]--;
    CUcontext was = g_primary_ctx[dev];
    primary_maybe_gone(dev);
    if (was && !g_primary_ctx[dev] && !settled && !g_primary_unsure[dev]) {
        g_primary_unsure[dev] = 1; /* its work in flight is charged from host time (gs_launch_forget_ctx) */
        GS_INFO("device %d's primary context went at a release not counted as its last (references released "
                "unseen): every release on it waits for its work from now on",
                (int)dev);
    }
}

typedef CUresult (*dev_fn)(CUdevice);

static CUresult primary_release(dev_fn release, CUdevice dev)
{
    if (gs_t_held) { /* a driver callback under a lock of ours: booked later (see defer) */
        CUresult rc = release(dev);
        if (rc == CUDA_SUCCESS) defer(OP_RELEASE, NULL, dev);
        return rc;
    }
    ctx_lock();
    int last;
    primary_settle_if_last(dev, &last);
    teardown_begin();
    CUresult rc = release(dev);
    if (rc == CUDA_SUCCESS) primary_released(dev, last);
    teardown_end();
    ctx_unlock();
    return rc;
}

/* A reset destroys every allocation and event of the primary context, whether
 * or not the driver then reports the context active. */
static CUresult primary_reset(dev_fn reset, CUdevice dev)
{
    if (gs_t_held) { /* a driver callback under a lock of ours: booked later (see defer) */
        CUresult rc = reset(dev);
        if (rc == CUDA_SUCCESS) defer(OP_RESET, NULL, dev);
        return rc;
    }
    int fence = !t_ctx_depth && !t_array_rw; /* see g_array_rw; not from a driver callback */
    if (fence) {
        pthread_rwlock_wrlock(&g_array_rw);
        t_array_rw++;
    }
    ctx_lock();
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS) gs_launch_settle_ctx(g_primary_ctx[dev]); /* as before a destroy */
    teardown_begin();
    CUresult rc = reset(dev);
    if (rc == CUDA_SUCCESS) reset_done_locked(dev);
    teardown_end();
    ctx_unlock();
    if (fence) {
        t_array_rw--;
        pthread_rwlock_unlock(&g_array_rw);
    }
    return rc;
}

static void reset_done_locked(CUdevice dev)
{
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS && g_primary_ctx[dev]) {
        gs_forget_ctx(g_primary_ctx[dev]);
        gs_launch_forget_ctx(g_primary_ctx[dev]);
        gs_graphmem_forget_ctx(g_primary_ctx[dev]);
        gs_limits_forget_ctx(g_primary_ctx[dev]); /* the reset context starts with the defaults */
    }
    primary_maybe_gone(dev);
    gs_reconcile_ctx_reset(dev); /* its code and buffers went */
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
        if (gs_t_held) { /* a driver callback: booked later (see defer) */  \
            CUresult prc = (call);                                          \
            if (prc == CUDA_SUCCESS) defer(OP_CREATE, *pctx, dev);          \
            return prc;                                                     \
        }                                                                   \
        gs_devices_ready();                                                 \
        ctx_lock();                                      \
        struct ctx_charge c;                                                \
        CUresult rc = charge_begin(dev, &c, 1);                             \
        if (rc == CUDA_SUCCESS) {                                           \
            rc = (call);                                                    \
            uint64_t bytes = charge_end(dev, &c, rc);                       \
            if (rc == CUDA_SUCCESS && c.over) {                             \
                undo_create(*pctx);                                         \
                *pctx = NULL;                                               \
                rc = CUDA_ERROR_OUT_OF_MEMORY;                              \
            } else if (rc == CUDA_SUCCESS) {                                \
                record_ctx(*pctx, c.slot, bytes, dev);                      \
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
    if (gs_t_held) { /* a driver callback under a lock of ours: booked later (see defer) */
        CUresult rc = destroy(ctx);
        if (rc == CUDA_SUCCESS && ctx) defer(OP_DESTROY, ctx, -1);
        return rc;
    }
    ctx_lock(); /* a reconcile may be charging this context */
    gs_launch_settle_ctx(ctx); /* its work is measured while its events can be read */
    teardown_begin();
    CUresult rc = destroy(ctx);
    if (rc == CUDA_SUCCESS && ctx) release_ctx(ctx);
    teardown_end();
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

/* ---- green contexts (CUDA 12.4+) -------------------------------------------------
 * cuGreenCtxCreate retains the device's primary context (making it if it is not active) and
 * gives part of the GPU's SMs a context of its own; its CUcontext (cuCtxFromGreenCtx) shares
 * the primary context's memory and lifetime.  Here the primary context is retained first
 * through the primary hook's own path (charged if made), the green context's footprint is
 * measured like a context's and charged (not refused: no estimate is reserved first), and
 * allocations and graphs made in it are keyed by the primary context (gs_ctx_canonical), which
 * frees them; the throttle measures it as a context of its own (its events are its own).
 * cuGreenCtxDestroy returns the footprint and the primary context's reference. */
#define GS_GREENS 64
static struct green {
    CUgreenCtx g;     /* NULL: free entry (under the context lock) */
    CUcontext as_ctx; /* read without the lock by gs_ctx_canonical: written last, cleared first */
    CUcontext primary;
    CUdevice dev;
    int slot;
    uint64_t bytes;
} g_greens[GS_GREENS];
static int g_ngreens; /* entries in use; read without the lock */

CUcontext gs_ctx_canonical(CUcontext ctx)
{
    if (GS_LIKELY(!__atomic_load_n(&g_ngreens, __ATOMIC_ACQUIRE)) || !ctx) return ctx;
    for (int i = 0; i < GS_GREENS; i++)
        if (__atomic_load_n(&g_greens[i].as_ctx, __ATOMIC_ACQUIRE) == ctx) {
            CUcontext p = __atomic_load_n(&g_greens[i].primary, __ATOMIC_RELAXED);
            return p ? p : ctx;
        }
    return ctx;
}

static void green_put_locked(CUgreenCtx g, CUcontext as_ctx, CUcontext primary, CUdevice dev, int slot, uint64_t bytes)
{
    for (int i = 0; i < GS_GREENS; i++)
        if (!g_greens[i].g) {
            struct green *e = &g_greens[i];
            e->g = g;
            e->dev = dev;
            e->slot = slot;
            e->bytes = bytes;
            __atomic_store_n(&e->primary, primary, __ATOMIC_RELAXED);
            __atomic_store_n(&e->as_ctx, as_ctx, __ATOMIC_RELEASE);
            __atomic_add_fetch(&g_ngreens, 1, __ATOMIC_RELEASE);
            return;
        }
    GS_WARN("more than %d green contexts: a new one's footprint stays charged after it goes", GS_GREENS);
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
    ctx_lock();
    CUcontext primary = NULL;
    CUresult rc = primary_retain_locked(&primary, dev);
    if (rc == CUDA_SUCCESS) {
        struct ctx_charge c;
        (void)charge_begin(dev, &c, 0); /* reserves nothing: cannot refuse (charge_end can) */
        rc = real(phCtx, desc, dev, flags);
        uint64_t bytes = charge_end(dev, &c, rc);
        CUcontext as_ctx = NULL;
        if (rc == CUDA_SUCCESS && c.over) { /* its footprint does not fit */
            if (gs_cuda.cuGreenCtxDestroy) gs_cuda.cuGreenCtxDestroy(*phCtx);
            *phCtx = NULL;
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (rc == CUDA_SUCCESS) {
            if (gs_cuda.cuCtxFromGreenCtx(&as_ctx, *phCtx) != CUDA_SUCCESS) as_ctx = NULL;
            green_put_locked(*phCtx, as_ctx, primary, dev, c.slot, bytes);
            primary_ref(dev); /* the green context's own, returned by its destroy */
        }
        /* this hook's reference goes (the green context holds its own): a primary context
         * made here for a creation that failed goes with it */
        int last;
        primary_settle_if_last(dev, &last);
        if (gs_cuda.cuDevicePrimaryCtxRelease_v2(dev) == CUDA_SUCCESS) primary_released(dev, last);
    }
    ctx_unlock();
    return rc;
}

GS_EXPORT CUresult cuGreenCtxDestroy(CUgreenCtx hCtx)
{
    gs_cuda_init();
    if (!gs_cuda.cuGreenCtxDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    if (gs_t_held) return gs_cuda.cuGreenCtxDestroy(hCtx); /* a driver callback: its footprint stays charged */
    ctx_lock();
    struct green *e = NULL;
    for (int i = 0; i < GS_GREENS && hCtx && !e; i++)
        if (g_greens[i].g == hCtx) e = &g_greens[i];
    /* its work is measured while its events can be read (as before a context's destroy), and
     * the primary context's if the reference to it that goes with it is the last */
    int last = 0;
    if (e && e->as_ctx) gs_launch_settle_ctx(e->as_ctx);
    if (e) primary_settle_if_last(e->dev, &last);
    teardown_begin();
    CUresult rc = gs_cuda.cuGreenCtxDestroy(hCtx);
    if (e && rc == CUDA_SUCCESS) {
        if (e->as_ctx) gs_launch_forget_ctx(e->as_ctx); /* the throttle measures it as a context of its own */
        __atomic_store_n(&e->as_ctx, NULL, __ATOMIC_RELEASE);
        __atomic_sub_fetch(&g_ngreens, 1, __ATOMIC_RELEASE);
        if (e->slot >= 0) gs_budget_release(e->slot, e->bytes);
        CUdevice dev = e->dev;
        __atomic_store_n(&e->primary, NULL, __ATOMIC_RELAXED); /* a reader may still hold the entry */
        e->g = NULL;
        primary_released(dev, last);
    }
    teardown_end();
    ctx_unlock();
    return rc;
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
/* One more use of a created context counted: 0, or -1 if the count cannot be kept */
static int attach_locked(CUcontext ctx)
{
    if (!ctx || primary_dev_of(ctx) >= 0) return 0;
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
    if (gs_t_held) { /* a driver callback: booked later (see defer) */
        CUresult rc = gs_cuda.cuCtxAttach(pctx, flags);
        if (rc == CUDA_SUCCESS) defer(OP_ATTACH, *pctx, -1);
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
    int dev = primary_dev_of(ctx);
    struct attached *a = find_attached(ctx);
    if (dev >= 0)
        primary_released(dev, settled);
    else if (a) {
        if (!--a->n) forget_attached(a);
    } else
        release_ctx(ctx);
}

GS_EXPORT CUresult cuCtxDetach(CUcontext ctx)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxDetach) return CUDA_ERROR_NOT_SUPPORTED;
    if (gs_t_held) { /* a driver callback: booked later (see defer) */
        CUresult rc = gs_cuda.cuCtxDetach(ctx);
        if (rc == CUDA_SUCCESS) defer(OP_DETACH, ctx, -1);
        return rc;
    }
    ctx_lock();
    int dev = primary_dev_of(ctx), last = 0;
    if (dev >= 0)
        primary_settle_if_last(dev, &last);
    else if (ctx && !find_attached(ctx))
        last = 1, gs_launch_settle_ctx(ctx); /* its last use: destroyed */
    teardown_begin();
    CUresult rc = gs_cuda.cuCtxDetach(ctx);
    if (rc == CUDA_SUCCESS) detach_locked(ctx, last);
    teardown_end();
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
    /* forked by a creation's or a reset's thread (a driver callback): the child returns through it */
    g_array_rw = (pthread_rwlock_t)PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
    if (t_array_rw) pthread_rwlock_wrlock(&g_array_rw);
    /* forked inside a context call (a driver callback's): the child returns through it */
    for (unsigned i = 0; i < t_ctx_depth; i++) pthread_mutex_lock(&g_ctx_mu);
    memset(g_primary_ctx, 0, sizeof(g_primary_ctx));
    memset(g_primary_refs, 0, sizeof(g_primary_refs));
    memset(g_primary_unsure, 0, sizeof(g_primary_unsure));
    if (!t_ctx_depth && g_teardowns) { /* another thread's teardown: it does not go on in the child */
        g_teardowns = 0;
        gs_ctx_teardown_seq++;
    }
    g_npend = 0;
    gs_ctx_pending = 0;
    pthread_mutex_init(&g_pend_mu, NULL);
    g_nattached = 0; /* the parent's contexts are not the child's */
    g_ngone = 0;
}
