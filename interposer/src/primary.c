/*
 * primary.c - primary contexts: cuDevicePrimaryCtxRetain, Release and Reset (both
 * generations), the references to each device's primary context taken through them, a primary
 * context made from a driver callback (adopted when the queue is booked, context.c), and the
 * array fence that keeps array creations and primary resets apart.  Its footprint is measured
 * and charged as any context's (footprint.c).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>

#include "ctx_internal.h"

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
    if (gs_t_ctx_depth || gs_t_held || t_array_rw) return 0;
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

/* A context that exists already: the container's footprint estimate, forced, and what the
 * process holds beyond its records, reconciled now */
void gs_ctx_adopt_locked(CUcontext ctx, CUdevice dev, int primary)
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
    if (primary && g_primary_ctx[dev]) gs_ctx_release(g_primary_ctx[dev]); /* released and made again meanwhile */
    gs_budget_force(slot, bytes);
    if (primary) g_primary_ctx[dev] = ctx;
    gs_ctx_record(ctx, slot, bytes, dev);
    gs_reconcile_dev_locked(dev);
    GS_INFO("a context made from a driver callback is charged from now on");
}

/* The primary context retained under the context lock; charged if it is made here. */
CUresult gs_primary_retain_locked(CUcontext *pctx, CUdevice dev)
{
    unsigned flags = 0;
    int active = 1;
    /* the state is read under the lock that releases and resets take too: an active context
     * cannot go between the check and the retain (which would then create one uncharged), and
     * one that another thread is creating is found active, not created twice */
    if (gs_cuda.cuDevicePrimaryCtxGetState(dev, &flags, &active) != CUDA_SUCCESS || active) {
        CUresult rc = gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev); /* one more reference */
        if (rc == CUDA_SUCCESS) gs_primary_ref(dev);
        return rc;
    }
    struct gs_ctx_charge c;
    CUresult rc = gs_ctx_charge_begin(dev, &c, 1);
    if (rc == CUDA_SUCCESS) {
        rc = gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
        uint64_t bytes = gs_ctx_charge_end(dev, &c, rc);
        if (rc == CUDA_SUCCESS && c.over) {
            /* ours is its only reference (it was inactive under this lock): it goes */
            CUresult (*release)(CUdevice) = gs_cuda.cuDevicePrimaryCtxRelease_v2 ? gs_cuda.cuDevicePrimaryCtxRelease_v2
                                                                                  : gs_cuda.cuDevicePrimaryCtxRelease;
            if (release) release(dev);
            *pctx = NULL;
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (rc == CUDA_SUCCESS) {
            g_primary_ctx[dev] = *pctx;
            gs_primary_ref(dev);
            gs_ctx_record(*pctx, c.slot, bytes, dev);
        }
    }
    return rc;
}

GS_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuDevicePrimaryCtxRetain) return CUDA_ERROR_NOT_SUPPORTED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (gs_ctx_passes_through()) { /* a driver callback: booked later (see gs_ctx_passes_through) */
        CUresult rc = gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
        if (rc == CUDA_SUCCESS) gs_ctx_defer(GS_OP_RETAIN, *pctx, dev);
        return rc;
    }
    gs_devices_ready();
    if (dev < 0 || dev >= gs_dev_count() || dev >= GS_MAX_CUDA_DEVS || !gs_cuda.cuDevicePrimaryCtxGetState)
        return gs_cuda.cuDevicePrimaryCtxRetain(pctx, dev);
    gs_ctx_enter();
    CUresult rc = gs_primary_retain_locked(pctx, dev);
    gs_ctx_unlock();
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
    gs_ctx_release(g_primary_ctx[dev]);
    g_primary_ctx[dev] = NULL;
}

void gs_primary_ref(CUdevice dev)
{
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS) g_primary_refs[dev]++;
}

/* Would a release now drop the last reference, as far as we can tell?  Then the context's
 * work is waited for and measured first (see g_primary_refs). */
static int primary_last_ref(CUdevice dev)
{
    return dev >= 0 && dev < GS_MAX_CUDA_DEVS && (g_primary_unsure[dev] || g_primary_refs[dev] <= 1);
}

void gs_primary_settle_if_last(CUdevice dev, int *last)
{
    *last = primary_last_ref(dev);
    if (*last) gs_launch_settle_ctx(g_primary_ctx[dev]); /* as before a destroy */
}

/* A reference went (the driver said so); `settled`: the context's work was measured first */
void gs_primary_released(CUdevice dev, int settled)
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
    if (gs_ctx_passes_through()) { /* a driver callback: booked later (see gs_ctx_passes_through) */
        CUresult rc = release(dev);
        if (rc == CUDA_SUCCESS) gs_ctx_defer(GS_OP_RELEASE, NULL, dev);
        return rc;
    }
    gs_ctx_enter();
    int last;
    gs_primary_settle_if_last(dev, &last);
    gs_ctx_teardown_begin();
    CUresult rc = release(dev);
    if (rc == CUDA_SUCCESS) gs_primary_released(dev, last);
    gs_ctx_teardown_end();
    gs_ctx_unlock();
    return rc;
}

/* A reset destroys every allocation and event of the primary context, whether
 * or not the driver then reports the context active. */
static CUresult primary_reset(dev_fn reset, CUdevice dev)
{
    if (gs_ctx_passes_through()) { /* a driver callback: booked later (see gs_ctx_passes_through) */
        CUresult rc = reset(dev);
        if (rc == CUDA_SUCCESS) gs_ctx_defer(GS_OP_RESET, NULL, dev);
        return rc;
    }
    int fence = !gs_t_ctx_depth && !t_array_rw; /* see g_array_rw; not from a driver callback */
    if (fence) {
        pthread_rwlock_wrlock(&g_array_rw);
        t_array_rw++;
    }
    gs_ctx_enter();
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS) gs_launch_settle_ctx(g_primary_ctx[dev]); /* as before a destroy */
    gs_ctx_teardown_begin();
    CUresult rc = reset(dev);
    if (rc == CUDA_SUCCESS) gs_primary_reset_done_locked(dev);
    gs_ctx_teardown_end();
    gs_ctx_unlock();
    if (fence) {
        t_array_rw--;
        pthread_rwlock_unlock(&g_array_rw);
    }
    return rc;
}

void gs_primary_reset_done_locked(CUdevice dev)
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

int gs_primary_dev_of(CUcontext ctx)
{
    for (int d = 0; d < GS_MAX_CUDA_DEVS; d++)
        if (ctx && g_primary_ctx[d] == ctx) return d;
    return -1;
}

void gs_primary_after_fork_child(void)
{
    /* forked by a creation's or a reset's thread (a driver callback): the child returns through it */
    g_array_rw = (pthread_rwlock_t)PTHREAD_RWLOCK_WRITER_NONRECURSIVE_INITIALIZER_NP;
    if (t_array_rw) pthread_rwlock_wrlock(&g_array_rw);
    memset(g_primary_ctx, 0, sizeof(g_primary_ctx));
    memset(g_primary_refs, 0, sizeof(g_primary_refs));
    memset(g_primary_unsure, 0, sizeof(g_primary_unsure));
}
