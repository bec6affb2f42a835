/*
 * memory.c - device memory allocation hooks: plain, pitch, managed, VMM,
 * arrays and mipmapped arrays, and CUDA 2.x's 32-bit entry points for them.
 * (Stream-ordered and pool allocations: pool.c.)
 *
 * Every hook follows reserve -> call -> commit/rollback: the bytes are
 * reserved on the shared budget first (atomic across the container's
 * processes), then the driver is called; on failure the reservation is
 * returned, on success the allocation is recorded so its free returns
 * exactly what it charged.  Out-parameters are read only after success.
 * Over the cap the caller gets CUDA_ERROR_OUT_OF_MEMORY and nothing changes.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "gpuslice.h"

#define MIB (1ull << 20)
#define VMM_REF (1ull << 32) /* one handle reference in a GS_KIND_VMM record's aux */

/* What an allocation of `bytes` costs: the driver hands out large
 * allocations in 2 MiB pages and small ones from shared pages. */
uint64_t gs_charge_size(uint64_t bytes)
{
    if (bytes > UINT64_MAX - 2 * MIB) return UINT64_MAX;
    if (bytes <= MIB) return (bytes + 511) & ~511ull;
    return (bytes + 2 * MIB - 1) & ~(2 * MIB - 1);
}

int gs_reserve_raw(int slot, uint64_t bytes)
{
    if (gs_budget_reserve(slot, bytes) == 0) return 0;
    /* pools may hold charges for memory they have released; not from a driver callback under
     * a lock of ours (the pools' own, or one after it: see gs_t_held) */
    if (!gs_t_held) gs_pools_reconcile_all();
    return gs_budget_reserve(slot, bytes);
}

/* Near the cap (gs_near_cap): reconciled first, as gs_reserve does; an allocation charged below a
 * whole page is served from pages the process's small allocations share, so it may take a whole
 * page more (the driver's figure grows 2 MiB at once): it is admitted only if the headroom covers
 * that page on top of what the process already holds uncharged (gs_reconcile_gap), reserved as
 * any reservation is (atomic across the container's processes).  The caller returns what it
 * reserved beyond the charge once the driver's call is over: what the page really took is then
 * what the process holds beyond its charge, which the next near-cap admission finds in the gap
 * (or the reconcile charges, past GS_SLACK).  0 reserved (*held: the bytes), -1 refused.  A
 * charge of 0 (an array without backing) takes no page. */
__attribute__((noinline)) static int reserve_near(int slot, uint64_t charge, uint64_t *held)
{
    gs_reconcile_slot(slot);
    uint64_t want = charge && charge < GS_PAGE ? gs_add_sat(GS_PAGE, gs_reconcile_gap(slot)) : charge;
    if (gs_reserve_raw(slot, want) != 0) return -1;
    *held = want;
    return 0;
}

/* gs_reserve for an allocation: far from the cap the same reservation; near it, reserve_near.
 * 0 reserved (*held: the bytes, charge or more near the cap), -1 refused */
static inline int reserve_alloc(int slot, uint64_t charge, uint64_t *held)
{
    *held = charge;
    if (GS_UNLIKELY(gs_near_cap(slot, charge))) return reserve_near(slot, charge, held);
    return gs_reserve_raw(slot, charge);
}

/* Record a successful allocation; -1 if it cannot be tracked (the caller undoes it). */
static int record(int kind, uint64_t key, int slot, uint64_t charge, CUcontext ctx)
{
    struct gs_alloc rec = {.size = charge, .slot = slot, .ctx = (uint64_t)(uintptr_t)ctx}, old;
    int rc = gs_am_put(kind, key, &rec, &old);
    if (rc == 1) gs_budget_release(old.slot, old.size);
    return rc < 0 ? -1 : 0;
}

int gs_dptr_gone(uint64_t dptr)
{
    CUdeviceptr base = 0;
    size_t size = 0;
    if (!gs_cuda.cuMemGetAddressRange_v2) return 0;
    CUresult q = gs_cuda.cuMemGetAddressRange_v2(&base, &size, (CUdeviceptr)dptr);
    return q == CUDA_ERROR_NOT_FOUND || q == CUDA_ERROR_INVALID_CONTEXT || q == CUDA_ERROR_CONTEXT_IS_DESTROYED;
}

/* The record of an allocation that was inside the driver while a context of the process went
 * (gs_teardown_since): booked under the context lock, after the teardown forgot what its context
 * held, and only if the driver still holds it.  Made before a primary reset, the reset freed
 * it (booked after the reset, its record stayed charged for nothing: 250 MiB for 50 held);
 * made while the reset was still in progress (a driver that keeps the context active), the
 * reset's forget dropped its record (200 MiB held uncharged without NVML's per-process
 * figures).  Only a plain allocation can be asked for (cuMemGetAddressRange_v2); an array's
 * handle cannot (a destroyed one is not documented to be told from a live one), so an array
 * or mipmapped array is gone only if its context itself went since the allocation began
 * (a reset that leaves the context active does not say: the array is recorded; before, every
 * array made before the context's end stayed charged, 250 MiB for 50 held).  Others, or an
 * answer that does not say the memory is gone (not found, or its context, the calling
 * thread's current one, gone), are recorded.  0 recorded, 1 gone (its reservation returned),
 * -1 cannot be tracked. */
static int gone_with_its_context(int kind, uint64_t key, CUcontext ctx, unsigned seq0, int locked)
{
    return kind == GS_KIND_DPTR ? gs_dptr_gone(key)
           : (kind == GS_KIND_ARRAY || kind == GS_KIND_MIPMAP) && locked && gs_ctx_gone_since_locked(ctx, seq0);
}

__attribute__((noinline)) static int record_after_teardown(int kind, uint64_t key, int slot, uint64_t charge,
                                                           CUcontext ctx, unsigned seq0)
{
    int locked = gs_ctx_lock() == 0; /* not from inside a context call of this thread */
    int gone = gone_with_its_context(kind, key, ctx, seq0, locked);
    int rc = gone ? 1 : record(kind, key, slot, charge, ctx);
    if (gone) gs_budget_release(slot, charge);
    if (locked) gs_ctx_unlock();
    if (gone) GS_INFO("an allocation made as its context went is gone with it: its charge is returned");
    return rc;
}

static void drop_one(int kind, uint64_t key, const struct gs_alloc *rec);

/* A teardown that began after book's first look and before the record existed: its forget may
 * have run without the record (which then stays charged for memory the teardown freed), or
 * after it (which dropped the record and returned its charge, right if the memory went with
 * the context, not if the allocation came after a reset that keeps the context active).  Under
 * the context lock, after the teardown: a record of memory the driver no longer holds is
 * dropped, and memory it still holds is booked again if the forget took its record.  Return
 * as record_after_teardown's. */
__attribute__((noinline)) static int settle_after_record(int kind, uint64_t key, int slot, uint64_t charge,
                                                         CUcontext ctx, unsigned seq0)
{
    int locked = gs_ctx_lock() == 0;
    int gone = gone_with_its_context(kind, key, ctx, seq0, locked);
    struct gs_alloc rec;
    int rc = 0, left = 0, rebooked = 0;
    if (gone) {
        left = gs_am_take(kind, key, &rec) == 0; /* else the forget took it, returning its charge */
        if (left) drop_one(kind, key, &rec);
        rc = 1;
    } else if (!gs_am_has(kind, key)) {
        gs_budget_force(slot, charge); /* held by the driver: what the forget returned */
        rc = record(kind, key, slot, charge, ctx);
        rebooked = 1;
    }
    if (locked) gs_ctx_unlock();
    GS_INFO("an allocation booked as its context went: %s",
            left ? "its record, which the teardown missed, dropped with its charge"
            : gone ? "gone with it, its record too"
            : rebooked ? "held, its record (which the teardown dropped) booked again" : "held, its record kept");
    return rc;
}

/* Book a successful allocation: after a teardown that ran while it was inside the driver,
 * under the context lock (record_after_teardown); else recorded, and looked at again, for a
 * teardown that began between that look and the record (settle_after_record: it forgot its
 * context without the record, which stayed charged for memory the teardown freed). */
static inline int book(int kind, uint64_t key, int slot, uint64_t charge, CUcontext ctx, unsigned seq0)
{
    if (gs_teardown_since(seq0)) return record_after_teardown(kind, key, slot, charge, ctx, seq0);
    if (record(kind, key, slot, charge, ctx) < 0) return -1;
    return gs_teardown_since(seq0) ? settle_after_record(kind, key, slot, charge, ctx, seq0) : 0;
}

static void drop_array_maps(uint64_t array);
static void amap_lose(uint64_t handle);

static void drop_one(int kind, uint64_t key, const struct gs_alloc *rec)
{
    if (kind == GS_KIND_VMAP) return; /* never owned by a context; charges nothing */
    if (kind == GS_KIND_AMAP) { /* owned by an array, which is never a context: not reached */
        amap_lose(rec->aux);
        return;
    }
    if (kind == GS_KIND_ARRAY || kind == GS_KIND_MIPMAP) drop_array_maps(key); /* the array went with it */
    if (kind == GS_KIND_POOLPTR)
        gs_pool_drop_ptr(rec->aux, rec->size);
    else
        gs_budget_release(rec->slot, rec->size);
}

void gs_forget_ctx(CUcontext ctx)
{
    gs_am_drop_ctx((uint64_t)(uintptr_t)ctx, drop_one);
}

static CUresult over_cap(int slot, uint64_t bytes)
{
    GS_INFO("allocation of %llu bytes refused: device slot %d has %llu of %llu bytes in use",
            (unsigned long long)bytes, slot, (unsigned long long)gs_slot_used(slot),
            (unsigned long long)gs_slot_limit(slot));
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The tail of reserve -> call -> commit/rollback.  rollback: the driver
 * failed; the reservation goes back and the caller gets the driver's error.
 * After success the handle from the out-parameter is recorded; if it cannot
 * be tracked, discard frees the allocation with the driver's free for `kind`,
 * returns the reservation and answers CUDA_ERROR_OUT_OF_MEMORY. */
static inline CUresult rollback(CUresult rc, int slot, uint64_t charge)
{
    gs_budget_release(slot, charge);
    return rc;
}

/* For discard only: an allocation of CUDA 2.x's entry points, freed by its own cuMemFree (the
 * driver may refuse to mix generations); recorded as GS_KIND_DPTR */
#define DPTR32 (-1)

static CUresult discard(int kind, uint64_t key, int slot, uint64_t charge)
{
    switch (kind) {
    case GS_KIND_DPTR:
        if (gs_cuda.cuMemFree_v2) gs_cuda.cuMemFree_v2(key);
        break;
    case DPTR32:
        if (gs_cuda.cuMemFree) gs_cuda.cuMemFree((unsigned int)key);
        break;
    case GS_KIND_VMM:
        if (gs_cuda.cuMemRelease) gs_cuda.cuMemRelease(key);
        break;
    case GS_KIND_ARRAY:
        if (gs_cuda.cuArrayDestroy) gs_cuda.cuArrayDestroy((CUarray)(uintptr_t)key);
        break;
    case GS_KIND_MIPMAP:
        if (gs_cuda.cuMipmappedArrayDestroy) gs_cuda.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)key);
        break;
    }
    gs_budget_release(slot, charge);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The rest of an allocation hook after its own checks: `call` goes straight
 * to the driver when the current context has no slot or `pass` holds;
 * otherwise the charge for `bytes` is reserved, `call` made, and the
 * reservation rolled back or the handle in `*out` recorded as `kind` (DPTR32:
 * as GS_KIND_DPTR).  `*out`
 * is read again for discard rather than kept across record(): one instruction
 * fewer on the success path. */
#define GS_CHARGED_ALLOC(kind, out, pass, bytes, call, probe)                         \
    do {                                                                              \
        gs_devices_ready();                                                           \
        CUcontext ctx;                                                                \
        int slot = gs_current_slot(&ctx);                                             \
        if (slot < 0 || (pass)) return (call);                                        \
        uint64_t charge = gs_charge_size(bytes);                                      \
        /* an array's creation and booking against a primary reset (context.c) */     \
        int fence_ = ((kind) == GS_KIND_ARRAY || (kind) == GS_KIND_MIPMAP) && gs_array_fence_enter(); \
        gs_inflight_begin(); /* before the charge changes: no clean reading between */ \
        uint64_t held_;                                                               \
        if (reserve_alloc(slot, charge, &held_) != 0) {                               \
            gs_inflight_end();                                                        \
            if (fence_) gs_array_fence_leave();                                       \
            return over_cap(slot, charge);                                            \
        }                                                                             \
        int probe_ = (probe) && GS_UNLIKELY(__atomic_load_n(&gs_pid_unknown, __ATOMIC_RELAXED)) && \
                     gs_pid_probe_begin(-1, charge, 0);                                  \
        unsigned seq0_ = gs_teardown_seq();                                           \
        if (fence_) gs_array_fence_call();                                            \
        CUresult rc = (call);                                                         \
        if (fence_) gs_array_fence_called();                                          \
        if (probe_) gs_pid_probe_end(rc == CUDA_SUCCESS, charge, 0);                     \
        if (GS_UNLIKELY(held_ != charge)) gs_budget_release(slot, held_ - charge); /* the page's headroom */ \
        int kind_ = (kind) == DPTR32 ? GS_KIND_DPTR : (kind);                         \
        if (rc != CUDA_SUCCESS)                                                       \
            rc = rollback(rc, slot, charge);                                          \
        else if (book(kind_, (uint64_t)(uintptr_t)*(out), slot, charge, ctx, seq0_) < 0) \
            rc = discard(kind, (uint64_t)(uintptr_t)*(out), slot, charge);            \
        if (fence_) gs_array_fence_leave();                                           \
        gs_inflight_end();                                                            \
        return rc;                                                                    \
    } while (0)

/* ---- linear allocations --------------------------------------------------- */

GS_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemAlloc_v2) return CUDA_ERROR_NOT_SUPPORTED;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    GS_CHARGED_ALLOC(GS_KIND_DPTR, dptr, !bytesize, bytesize, gs_cuda.cuMemAlloc_v2(dptr, bytesize), 1);
}

/* CUDA 2.x: a 32-bit pointer and size.  Its record is the plain allocations' (either
 * generation's cuMemFree hook finds it; whether the driver frees it through the other
 * generation's entry point is the driver's to say) */
GS_EXPORT CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytesize)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemAlloc) return CUDA_ERROR_NOT_SUPPORTED;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    GS_CHARGED_ALLOC(DPTR32, dptr, !bytesize, bytesize, gs_cuda.cuMemAlloc(dptr, bytesize), 1);
}

GS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemAllocManaged) return CUDA_ERROR_NOT_SUPPORTED;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    /* Managed memory may live on the device: charge it there, as HAMi does. */
    GS_CHARGED_ALLOC(GS_KIND_DPTR, dptr, !bytesize, bytesize, gs_cuda.cuMemAllocManaged(dptr, bytesize, flags), 0);
}

/* The driver's pitch allocation, through the CUDA 2.x entry point (32-bit
 * pointer, pitch and sizes) when `v1`. */
static CUresult real_pitch(int v1, CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned int elem)
{
    if (!v1) return gs_cuda.cuMemAllocPitch_v2(dptr, pitch, w, h, elem);
    unsigned int d = 0, p = 0;
    CUresult rc = gs_cuda.cuMemAllocPitch(&d, &p, (unsigned int)w, (unsigned int)h, elem);
    if (rc == CUDA_SUCCESS) {
        *dptr = d;
        *pitch = p;
    }
    return rc;
}

static CUresult alloc_pitch(int v1, CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes)
{
    gs_devices_ready();
    CUcontext ctx;
    int slot = gs_current_slot(&ctx);
    uint64_t row = ((uint64_t)WidthInBytes + 511) & ~511ull;
    if (slot < 0 || !WidthInBytes || !Height || WidthInBytes > UINT64_MAX / 2 || row > UINT64_MAX / Height)
        return real_pitch(v1, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    uint64_t charge = gs_charge_size(row * Height); /* the pitch is not known before the call */
    gs_inflight_begin();
    uint64_t held;
    if (reserve_alloc(slot, charge, &held) != 0) {
        gs_inflight_end();
        return over_cap(slot, charge);
    }
    gs_unsettled_begin(); /* the pitch may be wider than reserved until the charge is adjusted */
    unsigned seq0 = gs_teardown_seq();
    CUresult rc = real_pitch(v1, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (GS_UNLIKELY(held != charge)) gs_budget_release(slot, held - charge); /* the page's headroom */
    if (rc != CUDA_SUCCESS) {
        rc = rollback(rc, slot, charge); /* before the ends, as GS_CHARGED_ALLOC: no clean reading between */
        gs_inflight_end();
        gs_unsettled_end();
        return rc;
    }
    uint64_t actual = *pPitch <= UINT64_MAX / Height ? gs_charge_size((uint64_t)*pPitch * Height) : UINT64_MAX;
    int ok = 1;
    if (actual > charge) {
        ok = gs_reserve_raw(slot, actual - charge) == 0; /* reconciled above */
        if (ok) charge = actual;
    } else if (actual < charge) {
        gs_budget_release(slot, charge - actual);
        charge = actual;
    }
    if (!ok || book(GS_KIND_DPTR, *dptr, slot, charge, ctx, seq0) < 0)
        rc = discard(v1 ? DPTR32 : GS_KIND_DPTR, *dptr, slot, charge);
    gs_inflight_end();
    gs_unsettled_end();
    return rc;
}

GS_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                      unsigned int ElementSizeBytes)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemAllocPitch_v2) return CUDA_ERROR_NOT_SUPPORTED;
    if (!dptr || !pPitch) return CUDA_ERROR_INVALID_VALUE;
    return alloc_pitch(0, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
}

GS_EXPORT CUresult cuMemAllocPitch(unsigned int *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                   unsigned int Height, unsigned int ElementSizeBytes)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemAllocPitch) return CUDA_ERROR_NOT_SUPPORTED;
    if (!dptr || !pPitch) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr d = 0;
    size_t p = 0;
    CUresult rc = alloc_pitch(1, &d, &p, WidthInBytes, Height, ElementSizeBytes);
    if (rc == CUDA_SUCCESS) {
        *dptr = (unsigned int)d;
        *pPitch = (unsigned int)p;
    }
    return rc;
}

/* The driver's free, through the CUDA 2.x entry point when `v1` */
static CUresult real_free(int v1, CUdeviceptr dptr)
{
    return v1 ? gs_cuda.cuMemFree((unsigned int)dptr) : gs_cuda.cuMemFree_v2(dptr);
}

/* A free the driver refused after a context's teardown began since its record was taken: the
 * teardown's forget could not drop the record (taken), and the refusal may only say that the
 * teardown freed the memory.  Under the context lock, after the teardown: dropped with its
 * charge if the driver no longer holds the pointer (a stream-ordered allocation's bytes off its
 * pool's live bytes, where they stayed after the forget), else put back.  For either kind
 * from either free: cuMemFree of a stream-ordered allocation and cuMemFreeAsync of a cuMemAlloc
 * pointer are legal, and put back at every refusal they kept 200 MiB charged for nothing until
 * the process exited, 250 MiB for 50 held (`test_memory.py -k other_kind`). */
__attribute__((noinline)) void gs_free_refused_after_teardown(int kind, CUdeviceptr dptr, const struct gs_alloc *rec)
{
    int locked = gs_ctx_lock() == 0; /* not from inside a context call of this thread */
    if (gs_dptr_gone(dptr)) {
        drop_one(kind, dptr, rec);
        GS_INFO("a free refused after its context went: the memory went with it, its charge is returned");
    } else {
        /* held: by this allocation, or by one booked since at the same address (the driver
         * reuses addresses), which this one's record put back replaced: that newer charge then
         * stayed until exit (`test_memory.py -k address_the_driver_gave_again`) */
        struct gs_alloc newer, mine;
        int taken = gs_am_has(kind == GS_KIND_DPTR ? GS_KIND_POOLPTR : GS_KIND_DPTR, dptr);
        if (!taken && gs_am_put(kind, dptr, rec, &newer) == 1) {
            gs_am_put(kind, dptr, &newer, &mine); /* the newer record back */
            taken = 1;
        }
        if (taken) {
            drop_one(kind, dptr, rec);
            GS_INFO("a free refused after its context went: its address holds a newer allocation, its charge is "
                    "returned");
        }
    }
    if (locked) gs_ctx_unlock();
}

static CUresult free_dptr(int v1, CUdeviceptr dptr)
{
    struct gs_alloc rec;
    int kind = GS_KIND_DPTR;
    /* before the record is taken: a teardown that starts later finds no record to forget (the
     * free took it), and the driver's refusal may then mean the teardown freed the memory (a
     * free racing a primary reset left its 4 MiB charged for nothing, tests/teardownrace.c) */
    unsigned seq0 = gs_teardown_seq();
    if (gs_am_take(kind, dptr, &rec) != 0) {
        kind = GS_KIND_POOLPTR; /* cuMemFree also frees stream-ordered allocations */
        if (gs_pool_lock_mine()) return real_free(v1, dptr); /* its pool's lock is ours: see pool.c's pool_alloc */
        if (gs_am_take(kind, dptr, &rec) != 0) {
            gs_graphmem_note_free();
            return real_free(v1, dptr);
        }
    }
    gs_inflight_begin();
    CUresult rc = real_free(v1, dptr);
    if (rc == CUDA_SUCCESS) {
        drop_one(kind, dptr, &rec);
    } else if (gs_teardown_since(seq0)) {
        gs_free_refused_after_teardown(kind, dptr, &rec);
    } else {
        struct gs_alloc old;
        gs_am_put(kind, dptr, &rec, &old);
    }
    gs_inflight_end();
    return rc;
}

GS_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemFree_v2) return CUDA_ERROR_NOT_SUPPORTED;
    return free_dptr(0, dptr);
}

GS_EXPORT CUresult cuMemFree(unsigned int dptr)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemFree) return CUDA_ERROR_NOT_SUPPORTED;
    return free_dptr(1, dptr);
}

/* ---- virtual memory management -------------------------------------------- */

GS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemCreate) return CUDA_ERROR_NOT_SUPPORTED;
    if (!handle || !prop) return CUDA_ERROR_INVALID_VALUE;
    gs_devices_ready();
    int slot = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? gs_dev_slot(prop->location.id) : -1;
    if (slot < 0 || !size) return gs_cuda.cuMemCreate(handle, size, prop, flags);
    uint64_t charge = gs_charge_size(size);
    gs_inflight_begin();
    if (gs_reserve(slot, charge) != 0) {
        gs_inflight_end();
        return over_cap(slot, charge);
    }
    int probe = GS_UNLIKELY(__atomic_load_n(&gs_pid_unknown, __ATOMIC_RELAXED)) &&
                gs_pid_probe_begin(prop->location.id, charge, 0);
    CUresult rc = gs_cuda.cuMemCreate(handle, size, prop, flags);
    if (probe) gs_pid_probe_end(rc == CUDA_SUCCESS, charge, 0);
    if (rc != CUDA_SUCCESS) {
        rc = rollback(rc, slot, charge);
    } else {
        /* Physical memory belongs to the process, not to a context: one reference, no mapping. */
        struct gs_alloc rec = {.size = charge, .slot = slot, .aux = VMM_REF}, old;
        int put = gs_am_put(GS_KIND_VMM, *handle, &rec, &old);
        if (put < 0)
            rc = discard(GS_KIND_VMM, *handle, slot, charge);
        else if (put == 1)
            gs_budget_release(old.slot, old.size);
    }
    gs_inflight_end();
    return rc;
}

/* A VMM allocation lives while a handle to it is unreleased or a mapping of
 * it remains: the driver frees it when both are gone, whatever the order.
 * Releasing the handle right after cuMemMap is the documented idiom (the
 * mapping keeps the memory), so the charge stays until the last of the
 * references (cuMemCreate, cuMemRetainAllocationHandle) is released and the
 * last mapping (cuMemMap) is unmapped.  Each is counted in the handle's
 * record; each mapping is recorded by address, so cuMemUnmap finds the
 * handles of the range it unmaps. */
static int vmm_adjust(struct gs_alloc *rec, void *arg)
{
    int64_t delta = *(const int64_t *)arg;
    uint64_t refs = rec->aux >> 32, maps = rec->aux & 0xffffffffull;
    if (delta == -(int64_t)VMM_REF && !refs) return 2; /* nothing to release: the driver says so */
    if (delta == -1 && !maps) return 2;
    rec->aux += (uint64_t)delta;
    return rec->aux == 0 ? 1 : 0;
}

/* Apply delta (±VMM_REF, ±1) to the handle's counts.  Returns 1 when that was
 * the last of both (the record, in *rec, is gone: its charge is to return),
 * 0 when counted, 2 when there was nothing to take away, -1 if not ours. */
static int vmm_count(CUmemGenericAllocationHandle handle, int64_t delta, struct gs_alloc *rec)
{
    return gs_am_update(GS_KIND_VMM, handle, vmm_adjust, &delta, rec);
}

#define GS_VMM_IMPORTED 1ull /* in a GS_KIND_VMM record's ctx (below): never a context's address */

/* The handle's last reference and mapping went (*rec, from vmm_count): the driver freed its
 * memory, and its charge returns.  An imported handle's memory may also have been charged as
 * growth no hook saw (NVML counts it for the importer while it is held unmapped, or beyond
 * what is mapped of it): the next clean reading takes that out too */
static void vmm_gone(const struct gs_alloc *rec)
{
    gs_budget_release(rec->slot, rec->size);
    if (rec->ctx == GS_VMM_IMPORTED) gs_reconcile_remeasure_slot(rec->slot);
}

/* Undo a count taken before a driver call that failed. */
static void vmm_uncount(CUmemGenericAllocationHandle handle, int64_t delta, int how, const struct gs_alloc *rec)
{
    struct gs_alloc again, old;
    if (how == 1) {
        struct gs_alloc back = *rec;
        back.aux = (uint64_t)(-delta);
        gs_am_put(GS_KIND_VMM, handle, &back, &old);
    } else if (how == 0) {
        vmm_count(handle, -delta, &again);
    }
}

GS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemRelease) return CUDA_ERROR_NOT_SUPPORTED;
    struct gs_alloc rec;
    gs_inflight_begin(); /* the memory may go before its charge */
    int how = vmm_count(handle, -(int64_t)VMM_REF, &rec);
    CUresult rc = gs_cuda.cuMemRelease(handle);
    if (rc != CUDA_SUCCESS)
        vmm_uncount(handle, -(int64_t)VMM_REF, how, &rec);
    else if (how == 1)
        vmm_gone(&rec);
    gs_inflight_end();
    return rc;
}

GS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemRetainAllocationHandle) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = gs_cuda.cuMemRetainAllocationHandle(handle, addr);
    struct gs_alloc rec;
    if (rc == CUDA_SUCCESS && handle) vmm_count(*handle, (int64_t)VMM_REF, &rec);
    return rc;
}

/* A handle imported from another process (cuMemImportFromShareableHandle) names memory the
 * exporter allocated, and the exporter's charge goes when the exporter lets go of it, while
 * the memory lives on in this process.  So what this process maps of it is charged here:
 * the driver tells no size, so the record is charged from its first mapping, up to the
 * farthest byte mapped (offset + size), and returned with its last reference and mapping as
 * any other.  While the exporter holds it too, it is charged twice: the strict side. */

GS_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                  CUmemAllocationHandleType shHandleType)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemImportFromShareableHandle) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = gs_cuda.cuMemImportFromShareableHandle(handle, osHandle, shHandleType);
    if (rc != CUDA_SUCCESS || !handle) return rc;
    gs_devices_ready();
    union {
        CUmemAllocationProp prop;
        unsigned char room[256]; /* the driver writes its whole, larger struct */
    } p;
    memset(&p, 0, sizeof(p));
    int slot = -1;
    if (gs_cuda.cuMemGetAllocationPropertiesFromHandle &&
        gs_cuda.cuMemGetAllocationPropertiesFromHandle(&p.prop, *handle) == CUDA_SUCCESS &&
        p.prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        slot = gs_dev_slot(p.prop.location.id);
    if (slot < 0) return rc; /* not on a device of ours (or the driver does not say): not charged */
    struct gs_alloc rec, old;
    if (vmm_count(*handle, (int64_t)VMM_REF, &rec) >= 0) return rc; /* imported again: one more reference */
    rec = (struct gs_alloc){.size = 0, .slot = slot, .aux = VMM_REF, .ctx = GS_VMM_IMPORTED};
    if (gs_am_put(GS_KIND_VMM, *handle, &rec, &old) == 1) gs_budget_release(old.slot, old.size);
    return rc;
}

struct import_grow {
    uint64_t need, surplus;
};

/* A mapping of an imported handle reaching `need` bytes into it: the charge grows to that
 * (g->surplus: what the caller reserved beyond it, another thread having grown it since). */
static int import_adjust(struct gs_alloc *rec, void *arg)
{
    struct import_grow *g = arg;
    uint64_t reserved = g->surplus, grow = rec->size < g->need ? g->need - rec->size : 0;
    if (grow > reserved) grow = reserved; /* re-imported meanwhile: no more than this call reserved */
    rec->size += grow;
    g->surplus = reserved - grow;
    rec->aux += 1; /* one mapping more */
    return 0;
}

static int peek(struct gs_alloc *rec, void *arg)
{
    (void)rec, (void)arg;
    return 2; /* leave it: the caller reads the copy */
}

/* A mapping counted in its handle's record (*counted) is recorded by its address. */
static void record_mapping(CUdeviceptr ptr, size_t size, CUmemGenericAllocationHandle handle,
                           const struct gs_alloc *counted)
{
    struct gs_alloc rec, old;
    struct gs_alloc map = {.size = size ? size : 1, .aux = handle, .slot = counted->slot};
    int put = gs_am_put(GS_KIND_VMAP, ptr, &map, &old);
    if (put == 1) { /* a mapping we missed the unmap of: its handle loses it now */
        if (vmm_count(old.aux, -1, &rec) == 1) vmm_gone(&rec);
    } else if (put < 0) {
        /* cannot remember the mapping: count it as gone, which at worst
         * returns the charge early, as releasing the handle used to */
        if (vmm_count(handle, -1, &rec) == 1) vmm_gone(&rec);
        GS_WARN("cannot track a mapping of %llu bytes: its memory is charged only while its handle lives",
                (unsigned long long)size);
    }
}

/* A mapping of an imported handle refused: the handle may be charged already, as growth no hook
 * saw (NVML counts it for the importer while it is held unmapped).  Its charge is taken by
 * force, a clean reading takes that overlap out, and the cap judges after it; refused, the
 * charge goes back and what the reading took out is charged again.  1 if it fits (the charge
 * then held), the caller no longer in flight and back in flight after it. */
static int fits_remeasured(int slot, uint64_t extra)
{
    gs_budget_force(slot, extra);
    gs_inflight_end(); /* the reading must be clean of this thread too */
    gs_reconcile_remeasure_slot(slot);
    gs_reconcile_slot(slot);
    uint64_t cap = gs_slot_limit(slot);
    int fits = !cap || gs_slot_used(slot) <= cap;
    if (!fits) {
        gs_budget_release(slot, extra);
        gs_reconcile_slot(slot);
    }
    gs_inflight_begin();
    return fits;
}

/* A mapping of an imported handle: what it reaches beyond the record's charge is reserved
 * before the driver maps it, and refused past the cap like an allocation. */
static CUresult map_imported(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags, const struct gs_alloc *seen)
{
    uint64_t need = gs_charge_size(gs_add_sat(offset, size));
    uint64_t extra = need > seen->size ? need - seen->size : 0;
    gs_inflight_begin(); /* before the charge changes: no clean reading between */
    if (extra && gs_reserve(seen->slot, extra) != 0 && !fits_remeasured(seen->slot, extra)) {
        gs_inflight_end();
        return over_cap(seen->slot, extra);
    }
    CUresult rc = gs_cuda.cuMemMap(ptr, size, offset, handle, flags);
    struct import_grow g = {.need = need, .surplus = extra};
    struct gs_alloc rec, old;
    if (rc != CUDA_SUCCESS) {
        gs_budget_release(seen->slot, extra);
    } else if (gs_am_update(GS_KIND_VMM, handle, import_adjust, &g, &rec) >= 0) {
        gs_budget_release(seen->slot, g.surplus);
        record_mapping(ptr, size, handle, &rec);
        /* what the charge grew by may have been charged already as growth no hook saw (the
         * handle held unmapped): the next clean reading takes the overlap out */
        if (g.surplus < extra) gs_reconcile_remeasure_slot(seen->slot);
    } else {
        /* its last reference went meanwhile (the program released the handle while mapping
         * it): the mapping keeps the memory, charged with what this call reserved */
        rec = (struct gs_alloc){.size = extra, .slot = seen->slot, .aux = 1, .ctx = GS_VMM_IMPORTED};
        if (gs_am_put(GS_KIND_VMM, handle, &rec, &old) < 0)
            gs_budget_release(seen->slot, extra);
        else
            record_mapping(ptr, size, handle, &rec);
    }
    gs_inflight_end();
    return rc;
}

GS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemMap) return CUDA_ERROR_NOT_SUPPORTED;
    struct gs_alloc rec, seen;
    if (gs_am_update(GS_KIND_VMM, handle, peek, NULL, &seen) >= 0 && seen.ctx == GS_VMM_IMPORTED)
        return map_imported(ptr, size, offset, handle, flags, &seen);
    CUresult rc = gs_cuda.cuMemMap(ptr, size, offset, handle, flags);
    if (rc != CUDA_SUCCESS || vmm_count(handle, 1, &rec) != 0) return rc;
    record_mapping(ptr, size, handle, &rec);
    return rc;
}

#define GS_UNMAP_BATCH 256

/* The records of every mapping in [ptr, end), taken before the unmap (after it, another thread
 * may already have mapped new memory there): in *keys and *maps, the stack's batch or, for more
 * mappings than one batch holds, arrays from the heap.  Returns how many; *more is set when
 * the heap could not hold them all and the rest are still to take. */
static size_t take_mappings(uint64_t ptr, uint64_t end, uint64_t **keys, struct gs_alloc **maps, int *more)
{
    size_t n = gs_am_take_range(GS_KIND_VMAP, ptr, end, *keys, *maps, GS_UNMAP_BATCH), cap = GS_UNMAP_BATCH;
    *more = 0;
    while (n == cap) {
        uint64_t *k = malloc(2 * cap * sizeof(*k));
        struct gs_alloc *m = malloc(2 * cap * sizeof(*m));
        if (!k || !m) {
            free(k);
            free(m);
            *more = 1;
            break;
        }
        memcpy(k, *keys, n * sizeof(*k));
        memcpy(m, *maps, n * sizeof(*m));
        if (cap > GS_UNMAP_BATCH) {
            free(*keys);
            free(*maps);
        }
        *keys = k;
        *maps = m;
        cap *= 2;
        n += gs_am_take_range(GS_KIND_VMAP, ptr, end, k + n, m + n, cap - n);
    }
    return n;
}

GS_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemUnmap) return CUDA_ERROR_NOT_SUPPORTED;
    uint64_t batch_keys[GS_UNMAP_BATCH], *keys = batch_keys;
    struct gs_alloc batch_maps[GS_UNMAP_BATCH], *maps = batch_maps;
    uint64_t end = gs_add_sat(ptr, size);
    int more;
    gs_inflight_begin(); /* the last mapping of a released handle frees its memory */
    size_t n = take_mappings(ptr, end, &keys, &maps, &more);
    CUresult rc = gs_cuda.cuMemUnmap(ptr, size);
    struct gs_alloc rec, old;
    for (;;) {
        for (size_t i = 0; i < n; i++) {
            if (rc != CUDA_SUCCESS)
                gs_am_put(GS_KIND_VMAP, keys[i], &maps[i], &old);
            else if (vmm_count(maps[i].aux, -1, &rec) == 1)
                vmm_gone(&rec);
        }
        /* out of memory for the records: the rest after the call */
        if (rc != CUDA_SUCCESS || !more) break;
        n = gs_am_take_range(GS_KIND_VMAP, ptr, end, batch_keys, batch_maps, GS_UNMAP_BATCH);
        if (keys != batch_keys) {
            free(keys);
            free(maps);
            keys = batch_keys;
            maps = batch_maps;
        }
        more = n == GS_UNMAP_BATCH;
    }
    if (keys != batch_keys) {
        free(keys);
        free(maps);
    }
    gs_inflight_end();
    return rc;
}

/* ---- arrays --------------------------------------------------------------- */

/* Bytes per element: the listed formats exactly, any other (block-compressed,
 * YUV, ...) at 4 bytes per channel, which is never less than it needs. */
static uint64_t element_bytes(CUarray_format format, unsigned channels)
{
    uint64_t per;
    switch (format) {
    case 0x01: case 0x08: per = 1; break;            /* (un)signed int8 */
    case 0x02: case 0x09: case 0x10: per = 2; break; /* (un)signed int16, half */
    case 0x03: case 0x0a: case 0x20: per = 4; break; /* (un)signed int32, float */
    default: per = 4; break;
    }
    return per * (channels ? channels : 1);
}

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    return b && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

static uint64_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned ch)
{
    return mul_sat(mul_sat(mul_sat(w ? w : 1, h ? h : 1), d ? d : 1), element_bytes(f, ch));
}

/* Sparse arrays and arrays with deferred mapping get no memory at creation:
 * it comes later from cuMemCreate allocations mapped into them (charged there). */
#define GS_ARRAY_NO_BACKING (0x40 /* CUDA_ARRAY3D_SPARSE */ | 0x80 /* CUDA_ARRAY3D_DEFERRED_MAPPING */)

/* The 2D and 3D creations of both generations (CUDA 2.x's descriptors have 32-bit sizes).  An
 * array without backing is recorded at no charge: its context's end finds it, and with it the
 * mappings of its tiles */
#define GS_ARRAY_HOOK(name, desc_t, depth, empty)                                                         \
    GS_EXPORT CUresult name(CUarray *pHandle, const desc_t *pAllocateArray)                               \
    {                                                                                                     \
        gs_cuda_init();                                                                                   \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                               \
        if (!pHandle || !pAllocateArray) return CUDA_ERROR_INVALID_VALUE;                                 \
        const desc_t *a = pAllocateArray;                                                                 \
        GS_CHARGED_ALLOC(GS_KIND_ARRAY, pHandle, 0,                                                       \
                         (empty) ? 0 : array_bytes(a->Width, a->Height, (depth), a->Format, a->NumChannels), \
                         gs_cuda.name(pHandle, pAllocateArray), 0);                                       \
    }
GS_ARRAY_HOOK(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, 1, 0)
GS_ARRAY_HOOK(cuArrayCreate, CUDA_ARRAY_DESCRIPTOR_v1, 1, 0)
GS_ARRAY_HOOK(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR, a->Depth, (a->Flags & GS_ARRAY_NO_BACKING) != 0)
GS_ARRAY_HOOK(cuArray3DCreate, CUDA_ARRAY3D_DESCRIPTOR_v1, a->Depth, (a->Flags & GS_ARRAY_NO_BACKING) != 0)

GS_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                          unsigned int numMipmapLevels)
{
    gs_cuda_init();
    if (!gs_cuda.cuMipmappedArrayCreate) return CUDA_ERROR_NOT_SUPPORTED;
    if (!pHandle || !pMipmappedArrayDesc) return CUDA_ERROR_INVALID_VALUE;
    const CUDA_ARRAY3D_DESCRIPTOR *a = pMipmappedArrayDesc;
    uint64_t bytes = 0;
    /* a layered array's depth counts its layers, a cubemap's its faces (six per cube): every
     * level has them all; only a 3D array's depth halves with the level */
    int layers = (a->Flags & (0x01 /* CUDA_ARRAY3D_LAYERED */ | 0x04 /* CUDA_ARRAY3D_CUBEMAP */)) != 0;
    for (unsigned l = 0; l < numMipmapLevels && l < 64; l++) {
        size_t w = a->Width >> l, h = a->Height >> l, d = layers ? a->Depth : a->Depth >> l;
        uint64_t level = array_bytes(w ? w : 1, h ? h : 1, d ? d : 1, a->Format, a->NumChannels);
        bytes = gs_add_sat(bytes, level);
    }
    if (a->Flags & GS_ARRAY_NO_BACKING) bytes = 0; /* recorded all the same (above) */
    GS_CHARGED_ALLOC(GS_KIND_MIPMAP, pHandle, 0, bytes,
                     gs_cuda.cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels), 0);
}

/* An array destroyed takes the mappings of its tiles with it (sparse arrays) */
#define GS_ARRAY_DESTROY(kind, handle, call)                                          \
    do {                                                                              \
        struct gs_alloc rec, old;                                                     \
        uint64_t key_ = (uint64_t)(uintptr_t)(handle);                                \
        int had_ = gs_am_take(kind, key_, &rec) == 0;                                 \
        gs_inflight_begin(); /* freed before its charge goes: no reading may lower */ \
        CUresult rc = (call);                                                         \
        if (rc == CUDA_SUCCESS) {                                                     \
            if (had_) gs_budget_release(rec.slot, rec.size);                          \
            drop_array_maps(key_);                                                    \
        } else if (had_) {                                                            \
            gs_am_put(kind, key_, &rec, &old);                                        \
        }                                                                             \
        gs_inflight_end();                                                            \
        return rc;                                                                    \
    } while (0)

GS_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    gs_cuda_init();
    if (!gs_cuda.cuArrayDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    GS_ARRAY_DESTROY(GS_KIND_ARRAY, hArray, gs_cuda.cuArrayDestroy(hArray));
}

GS_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    gs_cuda_init();
    if (!gs_cuda.cuMipmappedArrayDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    GS_ARRAY_DESTROY(GS_KIND_MIPMAP, hMipmappedArray, gs_cuda.cuMipmappedArrayDestroy(hMipmappedArray));
}

/* ---- sparse arrays' tiles -------------------------------------------------- */

/* cuMemMapArrayAsync maps cuMemCreate allocations into the tiles of sparse (or deferred-mapping)
 * arrays.  Such a mapping keeps the allocation's memory as cuMemMap's does (a handle released
 * while it lasts keeps its charge): it is counted in the handle's record like one, and recorded
 * as GS_KIND_AMAP, keyed by the array and the subresource it covers, with the array as its
 * owner (destroying the array, or the context that holds it, drops its mappings).  An unmap is
 * matched to the mapping of exactly the same subresource; one that covers other tiles (part of
 * a mapping, or several) matches none, and what it undoes stays charged until the array goes:
 * the strict side.  The call is stream-ordered: mappings count from the call, and an unmap
 * returns its charge at the call, as stream-ordered frees do. */
static uint64_t amap_key(const CUarrayMapInfo *m)
{
    uint64_t h = 0x9e3779b97f4a7c15ull;
    h = gs_hash_step(h, (uint64_t)m->resourceType);
    h = gs_hash_step(h, (uintptr_t)m->resource.array);
    h = gs_hash_step(h, (uint64_t)m->subresourceType);
    if (m->subresourceType == CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL) {
        h = gs_hash_step(h, (uint64_t)m->subresource.miptail.layer);
        h = gs_hash_step(h, (uint64_t)m->subresource.miptail.offset);
        h = gs_hash_step(h, (uint64_t)m->subresource.miptail.size);
    } else {
        const unsigned *f = &m->subresource.sparseLevel.level;
        for (int i = 0; i < 8; i++) h = gs_hash_step(h, f[i]);
    }
    return h;
}

/* A mapping of the handle is gone: its charge returns if it was the handle's last reference */
static void amap_lose(uint64_t handle)
{
    struct gs_alloc rec;
    if (vmm_count(handle, -1, &rec) == 1) vmm_gone(&rec);
}

static void amap_dropped(int kind, uint64_t key, const struct gs_alloc *rec)
{
    (void)key;
    if (kind == GS_KIND_AMAP) amap_lose(rec->aux);
}

static void drop_array_maps(uint64_t array)
{
    gs_am_drop_ctx(array, amap_dropped);
}

/* One operation: an unmap's record is taken before the call (after it, another thread may
 * already have mapped new memory there) and put back if the call fails; a map of a handle of
 * ours is counted after it succeeds */
static CUresult map_one(cuMemMapArrayAsync_fn real, CUarrayMapInfo *m, CUstream stream)
{
    struct gs_alloc rec, old;
    if (m->memOperationType == CU_MEM_OPERATION_TYPE_UNMAP) {
        int had = gs_am_take(GS_KIND_AMAP, amap_key(m), &rec) == 0;
        CUresult rc = real(m, 1, stream);
        if (had && rc == CUDA_SUCCESS)
            amap_lose(rec.aux);
        else if (had)
            gs_am_put(GS_KIND_AMAP, amap_key(m), &rec, &old);
        return rc;
    }
    struct gs_alloc seen;
    if (m->memOperationType == CU_MEM_OPERATION_TYPE_MAP && m->memHandleType == CU_MEM_HANDLE_TYPE_GENERIC &&
        gs_am_update(GS_KIND_VMM, m->memHandle.memHandle, peek, NULL, &seen) >= 0 && seen.ctx == GS_VMM_IMPORTED) {
        /* an imported handle into a sparse array's tiles: how much of the other process's
         * allocation that takes is not told here (cuMemMap's offset + size is), and counted
         * as a mapping of a handle charged nothing it went uncharged (review: 1.8 GiB held
         * under a 1 GiB cap); refused */
        GS_WARN("a handle imported from another process cannot be mapped into a sparse array under a memory cap");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    CUresult rc = real(m, 1, stream);
    if (rc != CUDA_SUCCESS || m->memOperationType != CU_MEM_OPERATION_TYPE_MAP ||
        m->memHandleType != CU_MEM_HANDLE_TYPE_GENERIC || vmm_count(m->memHandle.memHandle, 1, &rec) != 0)
        return rc; /* failed, or not a handle of ours */
    struct gs_alloc map = {.size = 1, .aux = m->memHandle.memHandle,
                           .ctx = (uint64_t)(uintptr_t)m->resource.array, .slot = rec.slot};
    int put = gs_am_put(GS_KIND_AMAP, amap_key(m), &map, &old);
    if (put == 1) { /* the same tiles mapped again: the mapping they had is gone */
        amap_lose(old.aux);
    } else if (put < 0) {
        amap_lose(m->memHandle.memHandle); /* untracked: charged only while its handle lives */
        GS_WARN("cannot track a mapping into a sparse array: its memory is charged only while its handle lives");
    }
    return rc;
}

/* The list is passed on one operation at a time, in order, on the same stream (so in the same
 * order on the device), up to the first that fails: what a list that fails part way did is then
 * known (the driver does not document a list as all or nothing; applied in order up to the
 * failing operation, the maps before it were left uncharged: 1200 MiB held under a 1 GiB cap,
 * found by review), and a list that maps tiles and unmaps them again is counted in its order
 * (the unmap found nothing to take and the mapping stayed charged) */
static CUresult map_array(cuMemMapArrayAsync_fn real, CUarrayMapInfo *list, unsigned count, CUstream stream)
{
    if (!list || !count) return real(list, count, stream);
    gs_inflight_begin(); /* an unmap of a released handle's last mapping frees its memory */
    CUresult rc = CUDA_SUCCESS;
    for (unsigned i = 0; i < count && rc == CUDA_SUCCESS; i++) rc = map_one(real, &list[i], stream);
    gs_inflight_end();
    return rc;
}

GS_EXPORT CUresult cuMemMapArrayAsync(CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemMapArrayAsync) return CUDA_ERROR_NOT_SUPPORTED;
    return map_array(gs_cuda.cuMemMapArrayAsync, mapInfoList, count, hStream);
}

GS_EXPORT CUresult cuMemMapArrayAsync_ptsz(CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemMapArrayAsync_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
    return map_array(gs_cuda.cuMemMapArrayAsync_ptsz, mapInfoList, count, hStream);
}
