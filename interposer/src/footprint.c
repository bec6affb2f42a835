/*
 * footprint.c - a new context's footprint, measured and charged (for context.c's created
 * contexts, primary.c's primary contexts and green.c's green contexts, each made under the
 * context lock).
 *
 * Creating a context costs device memory.  Its size is measured and charged:
 * the growth of the process's own usage in NVML's process list, or, where
 * that list cannot say (no per-process figures, host pid unknown), the
 * growth of the device's used memory, which also counts what other
 * processes allocated meanwhile (limited to the largest process that started
 * with ours, when several did).  The last measurement,
 * kept in the region, is reserved up front, so a context that would not fit
 * is refused with CUDA_ERROR_OUT_OF_MEMORY.
 */
#define _GNU_SOURCE
#include "ctx_internal.h"

#define NO_READING UINT64_MAX

static uint64_t nvml_used(CUdevice dev)
{
    nvmlMemory_t m;
    nvmlDevice_t h = gs_dev_nvml(dev);
    if (!h || !gs_nvml.nvmlDeviceGetMemoryInfo || gs_nvml.nvmlDeviceGetMemoryInfo(h, &m) != NVML_SUCCESS)
        return NO_READING;
    return m.used;
}

/* What the container's other processes are charged on the slot (the region's total less ours). */
static uint64_t container_rest(int slot)
{
    uint64_t used = gs_slot_used(slot), mine = gs_slot_mine(slot);
    return used > mine ? used - mine : 0;
}

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
CUresult gs_ctx_charge_begin(CUdevice dev, struct gs_ctx_charge *c, int estimate_first)
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
    c->rest = container_rest(c->slot);
    c->before = nvml_used(dev);
    c->nprocs = gs_list_processes(dev, c->procs, GS_MAX_PIDS);
    return CUDA_SUCCESS;
}

/* Returns the bytes the new context stays charged with. */
uint64_t gs_ctx_charge_end(CUdevice dev, struct gs_ctx_charge *c, CUresult rc)
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
        if (c->before == NO_READING || after == NO_READING) return c->reserved;
        /* and the container's other processes' allocations and frees meanwhile, which their
         * charges show: such a reading only lowers the estimate, and another process's 60 MiB
         * freed during a 100 MiB creation made it 40 MiB, each later context charged 40 MiB
         * for 100 held (test_memory.py -k free_by_another_process_of_the_container).  Not
         * where processes that appeared meanwhile were taken off by their figures already:
         * a process of the container starting its context would be taken off twice */
        uint64_t rest = container_rest(c->slot);
        if (others) rest = c->rest;
        if (rest < c->rest) after += c->rest - rest;
        else others += rest - c->rest;
        if (after <= c->before + others) return c->reserved;
        measured = after - c->before - others;
        if (bound < measured) measured = bound;
    }
    /* what other threads allocated (or freed) meanwhile grew (or shrank) the process too, and
     * is charged by its own records; one that was inside the driver as the measurement began
     * or ended cannot be told apart: then the estimate stands (the reconcile adds what it
     * misses).  Not where nothing was reserved (the container has no estimate yet) and the
     * device's growth measured it: no reconcile would add what it misses (no per-process
     * figure), and a first context made while another thread allocated (on another device,
     * even) stayed charged nothing, 100 MiB held uncharged for good (test_memory.py -k
     * made_while_another_thread_allocates); such a measurement is charged, less what this
     * process's charge on the device grew meanwhile, but never becomes the estimate */
    int busy = c->busy || __atomic_load_n(&gs_inflight, __ATOMIC_SEQ_CST) ||
               __atomic_load_n(&gs_unsettled, __ATOMIC_SEQ_CST);
    if (busy && (c->reserved || !from_device)) return c->reserved;
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
    if (!busy && mine == c->mine && c->first && (!from_device || !estimate || measured < estimate))
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

void gs_ctx_record(CUcontext ctx, int slot, uint64_t bytes, CUdevice dev)
{
    struct gs_alloc rec = {.size = bytes, .slot = slot, .aux = (uint64_t)dev}, old;
    if (gs_am_put(GS_KIND_CTX, (uint64_t)(uintptr_t)ctx, &rec, &old) == 1) gs_budget_release(old.slot, old.size);
    gs_reconcile_track_ctx(dev, ctx);
}
