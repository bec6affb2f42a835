/*
 * memory.c - device memory allocation hooks: plain, pitch, managed, and CUDA
 * 2.x's 32-bit entry points for them; and what every allocation hook shares
 * (the reservation, the booking against a context's teardown: mem_internal.h).
 * (Virtual memory management: vmm.c.  Arrays, mipmapped arrays and sparse
 * arrays' tiles: arrays.c.  Stream-ordered and pool allocations: pool.c.)
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

#include "mem_internal.h"

/* Near the cap (gs_near_cap): reconciled first, as gs_reserve does; an allocation charged below a
 * whole page is served from pages the process's small allocations share, so it may take a whole
 * page more (the driver's figure grows 2 MiB at once): it is admitted only if the headroom covers
 * that page on top of what the process already holds uncharged (gs_reconcile_gap), reserved as
 * any reservation is (atomic across the container's processes).  A larger one takes its charge
 * on top of that gap too (admitted against its charge alone, it took the process past the cap by
 * the gap: 1025 MiB held under a 1 GiB cap, a 922 MiB allocation after a 4 KiB one beside a
 * 101 MiB context, `test_near_cap_growth.py -k beside_uncharged`).  The caller returns what it
 * reserved beyond the charge once the driver's call is over: what the page really took is then
 * what the process holds beyond its charge, which the next near-cap admission finds in the gap
 * (or the reconcile charges, past GS_SLACK).  0 reserved (*held: the bytes), -1 refused.  A
 * charge of 0 (an array without backing) takes no page and nothing of the gap. */
__attribute__((noinline)) int gs_reserve_near(int slot, uint64_t charge, uint64_t *held)
{
    gs_reconcile_slot_reserving(slot);
    uint64_t want = !charge ? 0 : gs_add_sat(charge < GS_PAGE ? GS_PAGE : charge, gs_reconcile_gap(slot));
    if (gs_reserve_raw(slot, want) != 0) return -1;
    *held = want;
    return 0;
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
 * handle cannot (a destroyed one is not documented to be told from a live one), so an array,
 * a mipmapped array or an external memory object (its memory goes with it: 250 MiB charged
 * for 50 held, `-k imported_as_its_context_goes`) is gone only if its context itself went
 * since the allocation began
 * (a reset that leaves the context active does not say: the array is recorded; before, every
 * array made before the context's end stayed charged, 250 MiB for 50 held).  Others, or an
 * answer that does not say the memory is gone (not found, or its context, the calling
 * thread's current one, gone), are recorded.  0 recorded, 1 gone (its reservation returned),
 * -1 cannot be tracked. */
static int gone_with_its_context(int kind, uint64_t key, CUcontext ctx, unsigned seq0, int locked)
{
    return kind == GS_KIND_DPTR ? gs_dptr_gone(key)
           : (kind == GS_KIND_ARRAY || kind == GS_KIND_MIPMAP || kind == GS_KIND_EXTMEM) && locked &&
                 gs_ctx_gone_since_locked(ctx, seq0);
}

__attribute__((noinline)) int gs_record_after_teardown(int kind, uint64_t key, int slot, uint64_t charge,
                                                    CUcontext ctx, unsigned seq0)
{
    int locked = gs_ctx_lock() == 0; /* not from inside a context call of this thread */
    int gone = gone_with_its_context(kind, key, ctx, seq0, locked);
    int rc = gone ? 1 : gs_record(kind, key, slot, charge, ctx);
    if (gone) gs_budget_release(slot, charge);
    if (locked) gs_ctx_unlock();
    if (gone) GS_INFO("an allocation made as its context went is gone with it: its charge is returned");
    return rc;
}

static void drop_one(int kind, uint64_t key, const struct gs_alloc *rec);

/* A teardown that began after gs_book's first look and before the record existed: its forget may
 * have run without the record (which then stays charged for memory the teardown freed), or
 * after it (which dropped the record and returned its charge, right if the memory went with
 * the context, not if the allocation came after a reset that keeps the context active).  Under
 * the context lock, after the teardown: a record of memory the driver no longer holds is
 * dropped, and memory it still holds is booked again if the forget took its record.  Return
 * as gs_record_after_teardown's. */
__attribute__((noinline)) int gs_settle_after_record(int kind, uint64_t key, int slot, uint64_t charge,
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
        rc = gs_record(kind, key, slot, charge, ctx);
        rebooked = 1;
    }
    if (locked) gs_ctx_unlock();
    GS_INFO("an allocation booked as its context went: %s",
            left ? "its record, which the teardown missed, dropped with its charge"
            : gone ? "gone with it, its record too"
            : rebooked ? "held, its record (which the teardown dropped) booked again" : "held, its record kept");
    return rc;
}

static void drop_one(int kind, uint64_t key, const struct gs_alloc *rec)
{
    if (kind == GS_KIND_VMAP) return; /* never owned by a context; charges nothing */
    if (kind == GS_KIND_AMAP) { /* owned by an array, which is never a context: not reached */
        gs_amap_lose(rec->aux);
        return;
    }
    if (kind == GS_KIND_ARRAY || kind == GS_KIND_MIPMAP) gs_array_drop_maps(key); /* the array went with it */
    if (kind == GS_KIND_POOLPTR)
        gs_pool_drop_ptr(rec->aux, rec->size);
    else
        gs_budget_release(rec->slot, rec->size);
}

void gs_forget_ctx(CUcontext ctx)
{
    gs_am_drop_ctx((uint64_t)(uintptr_t)ctx, drop_one);
    gs_pools_ctx_gone(ctx);
}

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
    GS_CHARGED_ALLOC(GS_DPTR32, dptr, !bytesize, bytesize, gs_cuda.cuMemAlloc(dptr, bytesize), 1);
}

GS_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemAllocManaged) return CUDA_ERROR_NOT_SUPPORTED;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    /* Managed memory may live on the device: charge it there, as HAMi does. */
    if (bytesize) __atomic_store_n(&gs_managed_seen, 1, __ATOMIC_RELAXED);
    GS_CHARGED_ALLOC(GS_KIND_DPTR, dptr, !bytesize, bytesize, gs_cuda.cuMemAllocManaged(dptr, bytesize, flags), 0);
}

/* The driver's free, through the CUDA 2.x entry point when `v1` */
static CUresult real_free(int v1, CUdeviceptr dptr)
{
    return v1 ? gs_cuda.cuMemFree((unsigned int)dptr) : gs_cuda.cuMemFree_v2(dptr);
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

/* The pitch is the driver's, known only after the call: the rows are reserved at 512 bytes'
 * alignment (`known` 0) and the charge follows the pitch.  One wider than reserved whose
 * difference takes the container near its cap is freed and made again, admitted at its real
 * size (`known`) as any allocation near the cap is, on top of what the process holds uncharged
 * (gs_reserve_near): the difference was reserved against the cap alone, and a pitch 2 MiB
 * wider than its estimate beside a 4 KiB array's page held 1,025 MiB under a 1 GiB cap,
 * whether the estimate was near the cap or far from it (`test_near_cap_growth.py -k
 * pitch_wider`).  Made again wider still (a driver that does not answer the same width with
 * the same pitch), the difference is reserved as before. */
static CUresult alloc_pitch(int v1, CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes, uint64_t known)
{
    gs_devices_ready();
    CUcontext ctx;
    int slot = gs_current_slot(&ctx);
    uint64_t row = ((uint64_t)WidthInBytes + 511) & ~511ull;
    if (slot < 0 || !WidthInBytes || !Height || WidthInBytes > UINT64_MAX / 2 || row > UINT64_MAX / Height)
        return real_pitch(v1, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    uint64_t charge = known ? known : gs_charge_size(row * Height); /* the pitch is not known before the call */
    gs_inflight_begin();
    uint64_t held;
    if (gs_reserve_alloc(slot, charge, &held) != 0) {
        gs_inflight_end();
        return gs_over_cap(slot, charge);
    }
    gs_unsettled_begin(); /* the pitch may be wider than reserved until the charge is adjusted */
    unsigned seq0 = gs_teardown_seq();
    CUresult rc = real_pitch(v1, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (GS_UNLIKELY(held != charge)) gs_budget_release(slot, held - charge); /* the page's headroom */
    if (rc != CUDA_SUCCESS) {
        rc = gs_rollback(rc, slot, charge); /* before the ends, as GS_CHARGED_ALLOC: no clean reading between */
        gs_inflight_end();
        gs_unsettled_end();
        return rc;
    }
    uint64_t actual = *pPitch <= UINT64_MAX / Height ? gs_charge_size((uint64_t)*pPitch * Height) : UINT64_MAX;
    if (actual > charge && !known && (held != charge || gs_near_cap(slot, actual - charge)) &&
        (v1 ? !!gs_cuda.cuMemFree : !!gs_cuda.cuMemFree_v2) && real_free(v1, *dptr) == CUDA_SUCCESS) {
        gs_budget_release(slot, charge); /* once freed */
        gs_inflight_end();
        gs_unsettled_end();
        return alloc_pitch(v1, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, actual);
    }
    int ok = 1;
    if (actual > charge) {
        ok = gs_reserve_raw(slot, actual - charge) == 0; /* reconciled above */
        if (ok) charge = actual;
    } else if (actual < charge) {
        gs_budget_release(slot, charge - actual);
        charge = actual;
    }
    if (!ok || gs_book(GS_KIND_DPTR, *dptr, slot, charge, ctx, seq0) < 0)
        rc = gs_discard(v1 ? GS_DPTR32 : GS_KIND_DPTR, *dptr, slot, charge);
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
    return alloc_pitch(0, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, 0);
}

GS_EXPORT CUresult cuMemAllocPitch(unsigned int *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                   unsigned int Height, unsigned int ElementSizeBytes)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemAllocPitch) return CUDA_ERROR_NOT_SUPPORTED;
    if (!dptr || !pPitch) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr d = 0;
    size_t p = 0;
    CUresult rc = alloc_pitch(1, &d, &p, WidthInBytes, Height, ElementSizeBytes, 0);
    if (rc == CUDA_SUCCESS) {
        *dptr = (unsigned int)d;
        *pPitch = (unsigned int)p;
    }
    return rc;
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

/* An array's destroy the driver refused after a teardown began since its record was taken (the
 * teardown's forget could not drop it): an array cannot be asked for, so it went with its context
 * if that went since (a destroy, a last release or detach, a reset leaving the primary context
 * inactive; a reset that keeps it active is kept apart by the array fence, arrays.c); then its
 * charge returns and its tiles' mappings go, else its record is put back, under a newer record
 * at the same handle if one was booked meanwhile (the driver reuses handles) */
__attribute__((noinline)) void gs_array_refused_after_teardown(int kind, uint64_t key, const struct gs_alloc *rec,
                                                             unsigned seq0)
{
    int locked = gs_ctx_lock() == 0; /* not from inside a context call of this thread */
    struct gs_alloc newer, mine;
    if (locked && gs_ctx_gone_since_locked((CUcontext)(uintptr_t)rec->ctx, seq0)) {
        drop_one(kind, key, rec);
        GS_INFO("an array destroy refused after its context went: the array went with it, its charge is returned");
    } else if (gs_am_put(kind, key, rec, &newer) == 1) {
        gs_am_put(kind, key, &newer, &mine); /* the newer record back, this one's charge returned */
        drop_one(kind, key, rec);
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
