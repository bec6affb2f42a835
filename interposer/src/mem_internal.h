/*
 * mem_internal.h - what the allocation hooks of memory.c (linear allocations), vmm.c (virtual
 * memory management) and arrays.c (arrays, mipmapped arrays, sparse arrays' tiles) share:
 * the reservation, the booking of an allocation against a context's teardown, the undoing of
 * one that cannot be tracked, and GS_CHARGED_ALLOC, the tail of reserve -> call ->
 * commit/rollback.  Internal to those three files (the library's other declarations:
 * gpuslice.h).
 */
#ifndef GPUSLICE_MEM_INTERNAL_H
#define GPUSLICE_MEM_INTERNAL_H

#include "gpuslice.h"

/* ---- memory.c ------------------------------------------------------------- */

int gs_reserve_near(int slot, uint64_t charge, uint64_t *held);
int gs_record_after_teardown(int kind, uint64_t key, int slot, uint64_t charge, CUcontext ctx, unsigned seq0);
int gs_settle_after_record(int kind, uint64_t key, int slot, uint64_t charge, CUcontext ctx, unsigned seq0);

/* gs_reserve for an allocation: far from the cap the same reservation; near it, gs_reserve_near.
 * 0 reserved (*held: the bytes, charge or more near the cap), -1 refused */
static inline int gs_reserve_alloc(int slot, uint64_t charge, uint64_t *held)
{
    *held = charge;
    if (GS_UNLIKELY(gs_near_cap(slot, charge))) return gs_reserve_near(slot, charge, held);
    return gs_reserve_raw(slot, charge);
}

/* Record a successful allocation; -1 if it cannot be tracked (the caller undoes it). */
static inline int gs_record(int kind, uint64_t key, int slot, uint64_t charge, CUcontext ctx)
{
    struct gs_alloc rec = {.size = charge, .slot = slot, .ctx = (uint64_t)(uintptr_t)ctx}, old;
    int rc = gs_am_put(kind, key, &rec, &old);
    if (rc == 1) gs_budget_release(old.slot, old.size);
    return rc < 0 ? -1 : 0;
}

/* Book a successful allocation: after a teardown that ran while it was inside the driver,
 * under the context lock (gs_record_after_teardown); else recorded, and looked at again, for a
 * teardown that began between that look and the record (gs_settle_after_record: it forgot its
 * context without the record, which stayed charged for memory the teardown freed). */
static inline int gs_book(int kind, uint64_t key, int slot, uint64_t charge, CUcontext ctx, unsigned seq0)
{
    if (gs_teardown_since(seq0)) return gs_record_after_teardown(kind, key, slot, charge, ctx, seq0);
    if (gs_record(kind, key, slot, charge, ctx) < 0) return -1;
    return gs_teardown_since(seq0) ? gs_settle_after_record(kind, key, slot, charge, ctx, seq0) : 0;
}

static inline CUresult gs_over_cap(int slot, uint64_t bytes)
{
    GS_INFO("allocation of %llu bytes refused: device slot %d has %llu of %llu bytes in use",
            (unsigned long long)bytes, slot, (unsigned long long)gs_slot_used(slot),
            (unsigned long long)gs_slot_limit(slot));
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The tail of reserve -> call -> commit/rollback.  gs_rollback: the driver
 * failed; the reservation goes back and the caller gets the driver's error.
 * After success the handle from the out-parameter is recorded; if it cannot
 * be tracked, gs_discard frees the allocation with the driver's free for `kind`,
 * returns the reservation and answers CUDA_ERROR_OUT_OF_MEMORY. */
static inline CUresult gs_rollback(CUresult rc, int slot, uint64_t charge)
{
    gs_budget_release(slot, charge);
    return rc;
}

/* For gs_discard only: an allocation of CUDA 2.x's entry points, freed by its own cuMemFree (the
 * driver may refuse to mix generations); recorded as GS_KIND_DPTR */
#define GS_DPTR32 (-1)

static inline CUresult gs_discard(int kind, uint64_t key, int slot, uint64_t charge)
{
    switch (kind) {
    case GS_KIND_DPTR:
        if (gs_cuda.cuMemFree_v2) gs_cuda.cuMemFree_v2(key);
        break;
    case GS_DPTR32:
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
    case GS_KIND_EXTMEM:
        if (gs_cuda.cuDestroyExternalMemory) gs_cuda.cuDestroyExternalMemory((CUexternalMemory)(uintptr_t)key);
        break;
    }
    gs_budget_release(slot, charge);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The rest of an allocation hook after its own checks: `call` goes straight
 * to the driver when the current context has no slot or `pass` holds;
 * otherwise the charge for `bytes` is reserved, `call` made, and the
 * reservation rolled back or the handle in `*out` recorded as `kind` (GS_DPTR32:
 * as GS_KIND_DPTR).  `*out`
 * is read again for gs_discard rather than kept across gs_record(): one instruction
 * fewer on the success path. */
#define GS_CHARGED_ALLOC(kind, out, pass, bytes, call, probe)                         \
    do {                                                                              \
        gs_devices_ready();                                                           \
        CUcontext ctx;                                                                \
        int slot = gs_current_slot(&ctx);                                             \
        if (slot < 0 || (pass)) return (call);                                        \
        uint64_t charge = gs_charge_size(bytes);                                      \
        /* an array's creation and booking against a primary reset (primary.c) */     \
        int fence_ = ((kind) == GS_KIND_ARRAY || (kind) == GS_KIND_MIPMAP) && gs_array_fence_enter(); \
        gs_inflight_begin(); /* before the charge changes: no clean reading between */ \
        uint64_t held_;                                                               \
        if (gs_reserve_alloc(slot, charge, &held_) != 0) {                            \
            gs_inflight_end();                                                        \
            if (fence_) gs_array_fence_leave();                                       \
            return gs_over_cap(slot, charge);                                         \
        }                                                                             \
        int probe_ = (probe) && GS_UNLIKELY(__atomic_load_n(&gs_pid_unknown, __ATOMIC_RELAXED)) && \
                     gs_pid_probe_begin(-1, charge, 0);                                  \
        unsigned seq0_ = gs_teardown_seq();                                           \
        if (fence_) gs_array_fence_call();                                            \
        CUresult rc = (call);                                                         \
        if (fence_) gs_array_fence_called();                                          \
        if (probe_) gs_pid_probe_end(rc == CUDA_SUCCESS, charge, 0);                     \
        if (GS_UNLIKELY(held_ != charge)) gs_budget_release(slot, held_ - charge); /* the page's headroom */ \
        int kind_ = (kind) == GS_DPTR32 ? GS_KIND_DPTR : (kind);                      \
        if (rc != CUDA_SUCCESS)                                                       \
            rc = gs_rollback(rc, slot, charge);                                       \
        else if (gs_book(kind_, (uint64_t)(uintptr_t)*(out), slot, charge, ctx, seq0_) < 0) \
            rc = gs_discard(kind, (uint64_t)(uintptr_t)*(out), slot, charge);         \
        if (fence_) gs_array_fence_leave();                                           \
        gs_inflight_end();                                                            \
        return rc;                                                                    \
    } while (0)

/* ---- vmm.c ---------------------------------------------------------------- */

#define GS_VMM_REF (1ull << 32) /* one handle reference in a GS_KIND_VMM record's aux */
#define GS_VMM_IMPORTED 1ull /* in a GS_KIND_VMM record's ctx (vmm.c): never a context's address */

/* A VMM allocation lives while a handle to it is unreleased or a mapping of
 * it remains: the driver frees it when both are gone, whatever the order.
 * Releasing the handle right after cuMemMap is the documented idiom (the
 * mapping keeps the memory), so the charge stays until the last of the
 * references (cuMemCreate, cuMemRetainAllocationHandle) is released and the
 * last mapping (cuMemMap) is unmapped.  Each is counted in the handle's
 * record; each mapping is recorded by address, so cuMemUnmap finds the
 * handles of the range it unmaps. */
static inline int gs_vmm_adjust(struct gs_alloc *rec, void *arg)
{
    int64_t delta = *(const int64_t *)arg;
    uint64_t refs = rec->aux >> 32, maps = rec->aux & 0xffffffffull;
    if (delta == -(int64_t)GS_VMM_REF && !refs) return 2; /* nothing to release: the driver says so */
    if (delta == -1 && !maps) return 2;
    rec->aux += (uint64_t)delta;
    return rec->aux == 0 ? 1 : 0;
}

/* Apply delta (±GS_VMM_REF, ±1) to the handle's counts.  Returns 1 when that was
 * the last of both (the record, in *rec, is gone: its charge is to return),
 * 0 when counted, 2 when there was nothing to take away, -1 if not ours. */
static inline int gs_vmm_count(CUmemGenericAllocationHandle handle, int64_t delta, struct gs_alloc *rec)
{
    return gs_am_update(GS_KIND_VMM, handle, gs_vmm_adjust, &delta, rec);
}

/* The handle's last reference and mapping went (*rec, from gs_vmm_count): the driver freed its
 * memory, and its charge returns.  An imported handle's memory may also have been charged as
 * growth no hook saw (NVML counts it for the importer while it is held unmapped, or beyond
 * what is mapped of it): the next clean reading takes that out too */
static inline void gs_vmm_gone(const struct gs_alloc *rec)
{
    gs_budget_release(rec->slot, rec->size);
    if (rec->ctx == GS_VMM_IMPORTED) gs_reconcile_remeasure_slot(rec->slot);
}

int gs_vmm_peek(struct gs_alloc *rec, void *arg); /* leaves the record: the caller reads the copy */
/* a mapping of a handle counted before the driver's call, and uncounted if it fails (vmm.c) */
int gs_vmm_map_begin(CUmemGenericAllocationHandle handle, struct gs_alloc *rec);
void gs_vmm_map_failed(CUmemGenericAllocationHandle handle);

/* An array's (or mipmapped array's) destroy refused after a context's teardown began since its
 * record (*rec) was taken: settled under the context lock, after the teardown (memory.c) */
void gs_array_refused_after_teardown(int kind, uint64_t key, const struct gs_alloc *rec, unsigned seq0);

/* ---- arrays.c ------------------------------------------------------------- */

void gs_array_drop_maps(uint64_t array); /* an array went: the mappings of its tiles with it */
void gs_amap_lose(uint64_t handle);      /* a mapping of the handle into an array's tiles went */

#endif /* GPUSLICE_MEM_INTERNAL_H */
