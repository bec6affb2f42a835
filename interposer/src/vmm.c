/*
 * vmm.c - the virtual memory management hooks: physical allocations (cuMemCreate), their
 * handles' references (cuMemRelease, cuMemRetainAllocationHandle, handles imported from another
 * process) and their mappings (cuMemMap, cuMemUnmap), counted in the handle's record
 * (gs_vmm_count, mem_internal.h, says how).  (Mappings into sparse arrays' tiles: arrays.c;
 * the reservation and the undoing shared with the other allocation hooks: mem_internal.h,
 * memory.c.)
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "mem_internal.h"

/* The region slot of a VMM allocation's location, -1 if not a device of ours: a device's memory,
 * or a locality domain's of one (CUDA 13.4: taken for host memory, two 600 MiB allocations held
 * 1.2 GiB under a 1 GiB cap, `test_memory.py -k locality_domain`); a location newer than the
 * library, the current device's.  *dev: its device, -1 where that is the current one */
static int vmm_slot(const CUmemLocation *loc, CUdevice *dev)
{
    *dev = gs_location_device(loc);
    if (*dev != GS_LOCATION_UNKNOWN) return gs_dev_slot(*dev);
    *dev = -1;
    return gs_current_slot(NULL);
}

GS_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                               unsigned long long flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemCreate) return CUDA_ERROR_NOT_SUPPORTED;
    if (!handle || !prop) return CUDA_ERROR_INVALID_VALUE;
    gs_devices_ready();
    CUdevice dev;
    int slot = vmm_slot(&prop->location, &dev);
    if (slot < 0 || !size) return gs_cuda.cuMemCreate(handle, size, prop, flags);
    uint64_t charge = gs_charge_size(size), held;
    gs_inflight_begin();
    if (gs_reserve_alloc(slot, charge, &held) != 0) { /* near the cap: with what the process holds uncharged */
        gs_inflight_end();
        return gs_over_cap(slot, charge);
    }
    int probe = GS_UNLIKELY(__atomic_load_n(&gs_pid_unknown, __ATOMIC_RELAXED)) &&
                gs_pid_probe_begin(dev, charge, 0);
    CUresult rc = gs_cuda.cuMemCreate(handle, size, prop, flags);
    if (probe) gs_pid_probe_end(rc == CUDA_SUCCESS, charge, 0);
    if (GS_UNLIKELY(held != charge)) gs_budget_release(slot, held - charge); /* the gap's headroom */
    if (rc != CUDA_SUCCESS) {
        rc = gs_rollback(rc, slot, charge);
    } else {
        /* Physical memory belongs to the process, not to a context: one reference, no mapping. */
        struct gs_alloc rec = {.size = charge, .slot = slot, .aux = GS_VMM_REF}, old;
        int put = gs_am_put(GS_KIND_VMM, *handle, &rec, &old);
        if (put < 0)
            rc = gs_discard(GS_KIND_VMM, *handle, slot, charge);
        else if (put == 1)
            gs_budget_release(old.slot, old.size);
    }
    gs_inflight_end();
    return rc;
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
        gs_vmm_count(handle, -delta, &again);
    }
}

GS_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemRelease) return CUDA_ERROR_NOT_SUPPORTED;
    struct gs_alloc rec;
    gs_inflight_begin(); /* the memory may go before its charge */
    int how = gs_vmm_count(handle, -(int64_t)GS_VMM_REF, &rec);
    CUresult rc = gs_cuda.cuMemRelease(handle);
    if (rc != CUDA_SUCCESS)
        vmm_uncount(handle, -(int64_t)GS_VMM_REF, how, &rec);
    else if (how == 1)
        gs_vmm_gone(&rec);
    gs_inflight_end();
    return rc;
}

GS_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemRetainAllocationHandle) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = gs_cuda.cuMemRetainAllocationHandle(handle, addr);
    struct gs_alloc rec;
    if (rc == CUDA_SUCCESS && handle) gs_vmm_count(*handle, (int64_t)GS_VMM_REF, &rec);
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
        gs_cuda.cuMemGetAllocationPropertiesFromHandle(&p.prop, *handle) == CUDA_SUCCESS) {
        CUdevice dev;
        slot = vmm_slot(&p.prop.location, &dev);
    }
    /* not on a device of ours, or the driver does not say: not charged.  A handle the query
     * fails for is kept, not undone: multicast objects (cuMulticastCreate) are shared through
     * this call too (NCCL's NVLS with POSIX descriptors, PyTorch's symmetric memory), hold no
     * memory of their own, and what the query answers for one is not documented; refusing
     * such an import would stop NVLS, charging it would count the memory bound to it twice */
    if (slot < 0) return rc;
    struct gs_alloc rec, old;
    if (gs_vmm_count(*handle, (int64_t)GS_VMM_REF, &rec) >= 0) return rc; /* imported again: one more reference */
    rec = (struct gs_alloc){.size = 0, .slot = slot, .aux = GS_VMM_REF, .ctx = GS_VMM_IMPORTED};
    if (gs_am_put(GS_KIND_VMM, *handle, &rec, &old) == 1) gs_budget_release(old.slot, old.size);
    return rc;
}

struct import_grow {
    uint64_t need, surplus;
};

/* A mapping of an imported handle reaching `need` bytes into it (counted already): the charge
 * grows to that (g->surplus: what the caller reserved beyond it, another thread having grown it
 * since). */
static int import_adjust(struct gs_alloc *rec, void *arg)
{
    struct import_grow *g = arg;
    uint64_t reserved = g->surplus, grow = rec->size < g->need ? g->need - rec->size : 0;
    if (grow > reserved) grow = reserved; /* re-imported meanwhile: no more than this call reserved */
    rec->size += grow;
    g->surplus = reserved - grow;
    return 0;
}

/* A mapping is counted in its handle's record before the driver maps it: another thread's
 * release of the handle's last reference meanwhile then finds the mapping and leaves the record
 * (and its charge) to it, as the driver leaves the memory to the mapping.  Counted after the
 * driver's call, such a release took the record and returned the charge, and the mapping went
 * uncounted: 600 MiB held with nothing charged, a 500 MiB allocation passed beside it under a
 * 1 GiB cap (`test_memory.py -k released_while_it_is_mapped`; tiles of sparse arrays too,
 * arrays.c).  Returns what gs_vmm_count does (0: counted). */
int gs_vmm_map_begin(CUmemGenericAllocationHandle handle, struct gs_alloc *rec)
{
    return gs_vmm_count(handle, 1, rec);
}

/* The driver refused a mapping counted by gs_vmm_map_begin: uncounted, and the charge returned
 * if that was the last of the handle's references and mappings (released meanwhile) */
void gs_vmm_map_failed(CUmemGenericAllocationHandle handle)
{
    struct gs_alloc rec;
    if (gs_vmm_count(handle, -1, &rec) == 1) gs_vmm_gone(&rec);
}

int gs_vmm_peek(struct gs_alloc *rec, void *arg)
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
        if (gs_vmm_count(old.aux, -1, &rec) == 1) gs_vmm_gone(&rec);
    } else if (put < 0) {
        /* cannot remember the mapping: count it as gone, which at worst
         * returns the charge early, as releasing the handle used to */
        if (gs_vmm_count(handle, -1, &rec) == 1) gs_vmm_gone(&rec);
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
    uint64_t cap = gs_slot_limit(slot);
    /* more than the whole cap (or than the total can add) never fits: forced, a size near
     * 2^64 saturated the container's total and its release took the total to 0, every
     * process's charge with it (a 600 MiB allocation then passed beside another process's
     * 600 MiB under a 1 GiB cap; `test_memory.py -k larger_than_the_cap`) */
    if ((cap && extra > cap) || extra > UINT64_MAX - gs_slot_used(slot)) return 0;
    gs_budget_force(slot, extra);
    gs_inflight_end(); /* the reading must be clean of this thread too */
    gs_reconcile_remeasure_slot(slot);
    gs_reconcile_slot(slot);
    int fits = !cap || gs_slot_used(slot) <= cap;
    if (!fits) {
        gs_budget_release(slot, extra);
        gs_reconcile_slot(slot);
    }
    gs_inflight_begin();
    return fits;
}

/* An external memory object (cuImportExternalMemory): another API's or process's memory, a VMM
 * allocation's exported descriptor among them (CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD), which
 * the object keeps alive until cuDestroyExternalMemory, whoever else lets go of it.  Unhooked,
 * create -> export -> import as external memory -> release took memory past the cap with
 * nothing charged (`test_memory.py -k external_memory`).  The description tells its size: it is
 * charged to the current context's device, refused past the cap with CUDA_ERROR_OUT_OF_MEMORY,
 * and returned when destroyed or with the context.  Like an imported VMM handle, it counts
 * twice while its exporter in the container holds it too: the strict side.  Memory another API
 * of the process made (Vulkan's) may be charged already as growth no hook saw (NVML counts it):
 * an import the cap refuses is judged again after a clean reading, as a mapping of an imported
 * handle is (judged as taking its memory a second time, 600 MiB of Vulkan's were refused under
 * a 1 GiB cap with 700 MiB held; `-k another_apis_memory`), and its charge and its end mark the
 * device for one.  Its buffers and mipmapped arrays (cuExternalMemoryGetMapped*) are views of
 * it and charge nothing. */
static CUresult import_external(CUexternalMemory *out, const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *desc)
{
    gs_devices_ready();
    CUcontext ctx;
    int slot = gs_current_slot(&ctx);
    if (slot < 0 || !desc->size) return gs_cuda.cuImportExternalMemory(out, desc);
    uint64_t charge = gs_charge_size(desc->size);
    int remeasured = 0;
    /* its handle cannot be asked for either: kept apart from primary resets as an array's
     * creation is (else one made as a reset that keeps the context active freed it stayed
     * charged, 250 MiB for 50 held; `-k imported_as_its_context_goes`) */
    int fence = gs_array_fence_enter();
    gs_inflight_begin(); /* before the charge changes: no clean reading between */
    if (gs_reserve(slot, charge) != 0) {
        if (!fits_remeasured(slot, charge)) {
            gs_inflight_end();
            if (fence) gs_array_fence_leave();
            return gs_over_cap(slot, charge);
        }
        remeasured = 1;
    }
    unsigned seq0 = gs_teardown_seq();
    if (fence) gs_array_fence_call();
    CUresult rc = gs_cuda.cuImportExternalMemory(out, desc);
    if (fence) gs_array_fence_called();
    if (rc != CUDA_SUCCESS)
        rc = gs_rollback(rc, slot, charge);
    else if (gs_book(GS_KIND_EXTMEM, (uint64_t)(uintptr_t)*out, slot, charge, ctx, seq0) < 0)
        rc = gs_discard(GS_KIND_EXTMEM, (uint64_t)(uintptr_t)*out, slot, charge);
    else
        gs_reconcile_remeasure_slot(slot); /* what it overlaps of the growth no hook saw goes */
    if (fence) gs_array_fence_leave();
    gs_inflight_end();
    if (rc != CUDA_SUCCESS && remeasured) gs_reconcile_slot(slot); /* the reading's overlap charged again */
    return rc;
}

GS_EXPORT CUresult cuImportExternalMemory(CUexternalMemory *extMem_out,
                                          const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *memHandleDesc)
{
    gs_cuda_init();
    if (!gs_cuda.cuImportExternalMemory) return CUDA_ERROR_NOT_SUPPORTED;
    if (!extMem_out || !memHandleDesc) return gs_cuda.cuImportExternalMemory(extMem_out, memHandleDesc);
    return import_external(extMem_out, memHandleDesc);
}

GS_EXPORT CUresult cuDestroyExternalMemory(CUexternalMemory extMem)
{
    gs_cuda_init();
    if (!gs_cuda.cuDestroyExternalMemory) return CUDA_ERROR_NOT_SUPPORTED;
    uint64_t key = (uint64_t)(uintptr_t)extMem;
    struct gs_alloc rec, old;
    int fence = gs_array_fence_enter(); /* as an array's destroy: a reset waits for it, or it for the reset */
    unsigned seq0 = gs_teardown_seq(); /* as cuMemFree's: before the record is taken */
    if (gs_am_take(GS_KIND_EXTMEM, key, &rec) != 0) {
        if (fence) gs_array_fence_leave();
        return gs_cuda.cuDestroyExternalMemory(extMem);
    }
    gs_inflight_begin();
    if (fence) gs_array_fence_call();
    CUresult rc = gs_cuda.cuDestroyExternalMemory(extMem);
    if (fence) gs_array_fence_called();
    if (rc == CUDA_SUCCESS) {
        gs_budget_release(rec.slot, rec.size);
        gs_reconcile_remeasure_slot(rec.slot); /* as an imported handle's end (gs_vmm_gone) */
    } else if (gs_teardown_since(seq0)) {
        gs_array_refused_after_teardown(GS_KIND_EXTMEM, key, &rec, seq0); /* gone with its context? */
    } else {
        gs_am_put(GS_KIND_EXTMEM, key, &rec, &old);
    }
    if (fence) gs_array_fence_leave();
    gs_inflight_end();
    return rc;
}

/* A mapping of an imported handle: what it reaches beyond the record's charge is reserved
 * before the driver maps it, and refused past the cap like an allocation. */
static CUresult map_imported(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                             unsigned long long flags, const struct gs_alloc *seen)
{
    uint64_t need = gs_charge_size(gs_add_sat(offset, size));
    uint64_t extra = need > seen->size ? need - seen->size : 0;
    int remeasured = 0;
    gs_inflight_begin(); /* before the charge changes: no clean reading between */
    if (extra && gs_reserve(seen->slot, extra) != 0) {
        if (!fits_remeasured(seen->slot, extra)) {
            gs_inflight_end();
            return gs_over_cap(seen->slot, extra);
        }
        remeasured = 1;
    }
    struct import_grow g = {.need = need, .surplus = extra};
    struct gs_alloc rec, old;
    int counted = gs_vmm_map_begin(handle, &rec) == 0;
    CUresult rc = gs_cuda.cuMemMap(ptr, size, offset, handle, flags);
    if (rc != CUDA_SUCCESS) {
        gs_budget_release(seen->slot, extra);
        if (counted) gs_vmm_map_failed(handle);
    } else if (counted && gs_am_update(GS_KIND_VMM, handle, import_adjust, &g, &rec) >= 0) {
        gs_budget_release(seen->slot, g.surplus);
        record_mapping(ptr, size, handle, &rec);
        /* what the charge grew by may have been charged already as growth no hook saw (the
         * handle held unmapped): the next clean reading takes the overlap out */
        if (g.surplus < extra) gs_reconcile_remeasure_slot(seen->slot);
    } else {
        /* its last reference went before the mapping was counted (the program released the
         * handle while mapping it), its charge with it: the mapping keeps the memory, charged
         * all of what it reaches (what this call reserved, and the rest the record held) */
        rec = (struct gs_alloc){.size = need, .slot = seen->slot, .aux = 1, .ctx = GS_VMM_IMPORTED};
        if (gs_am_put(GS_KIND_VMM, handle, &rec, &old) < 0) {
            gs_budget_release(seen->slot, extra);
        } else {
            gs_budget_force(seen->slot, need - extra);
            record_mapping(ptr, size, handle, &rec);
        }
    }
    gs_inflight_end();
    /* refused by the driver after the reading took the handle's memory (still held, unmapped)
     * out of the growth no hook saw: charged again now, as a mapping the cap refuses is (it was
     * left uncharged until the sampler's next reading, and a 300 MiB allocation passed beside
     * it meanwhile, 1100 MiB held under a 1 GiB cap; `test_memory.py -k driver_refuses`) */
    if (rc != CUDA_SUCCESS && remeasured) gs_reconcile_slot(seen->slot);
    return rc;
}

GS_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                            unsigned long long flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemMap) return CUDA_ERROR_NOT_SUPPORTED;
    struct gs_alloc rec, seen;
    if (gs_am_update(GS_KIND_VMM, handle, gs_vmm_peek, NULL, &seen) >= 0 && seen.ctx == GS_VMM_IMPORTED)
        return map_imported(ptr, size, offset, handle, flags, &seen);
    int counted = gs_vmm_map_begin(handle, &rec) == 0; /* before the call: see gs_vmm_map_begin */
    CUresult rc = gs_cuda.cuMemMap(ptr, size, offset, handle, flags);
    if (!counted) return rc;
    if (rc != CUDA_SUCCESS)
        gs_vmm_map_failed(handle);
    else
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
            else if (gs_vmm_count(maps[i].aux, -1, &rec) == 1)
                gs_vmm_gone(&rec);
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
