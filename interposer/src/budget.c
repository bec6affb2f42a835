/*
 * budget.c - the compute limit's shared budget: a virtual clock vt per device
 * in the region, advanced by what measured GPU time costs (busy_ns * s * 100 /
 * C); a launch waits until vt <= now (the clocks of all of the container's
 * limited devices: the gang), and vt never lags now by more than GS_BURST_NS.
 * And the GPU time of launches a capture keeps from being measured, which the
 * sampler charges from NVML (slices.c).
 */
#define _GNU_SOURCE
#include "throttle.h"

#define GS_BURST_NS 50000000ull   /* idle credit: at most 50 ms of wall time */
/* A clock further ahead than this was written over (any process of the container can write the
 * region): a day is what an 864 s kernel costs at a 1 % limit */
#define GS_AHEAD_MAX_NS (86400ull * 1000000000ull)
/* unmeasured time NVML found is charged from at most this long ago (a sampler tick with new samples
 * and the sample period that can lag behind it) */
#define GS_UNMEASURED_SPAN_NS 1500000000ull

/* What busy_ns of the process's own GPU time costs on the shared virtual clock: busy × s × 100 / C;
 * 0 without a limit */
uint64_t thr_unmeasured_cost(struct gpuslice_device *d, uint64_t busy_ns)
{
    unsigned sm = __atomic_load_n(&d->sm_limit, __ATOMIC_RELAXED);
    if (!sm || sm >= 100) return 0;
    unsigned scale = thr_time_mode ? 0 : __atomic_load_n(&d->sm_scale_milli, __ATOMIC_RELAXED);
    if (scale < 1000 || scale > GS_SCALE_MAX_MILLI) scale = 1000;
    return busy_ns * scale / (10ull * sm); /* no overflow for 200 days */
}

/* The same for busy_ns the events measured: the process's own share of it */
uint64_t thr_clock_cost(int slot, uint64_t busy_ns)
{
    return thr_unmeasured_cost(&gs_region->devices[slot], busy_ns * thr_own_share(slot) / 1000);
}

/* Adds cost to the clock, which first catches up with `from` less the idle credit */
static void clock_add_from(int slot, uint64_t cost, uint64_t from)
{
    if (!cost) return;
    uint64_t *vt = &gs_region->devices[slot].throttle_vt_ns;
    uint64_t floor = from > GS_BURST_NS ? from - GS_BURST_NS : 0;
    uint64_t old = __atomic_load_n(vt, __ATOMIC_RELAXED), next;
    do {
        next = gs_add_sat(old > floor ? old : floor, cost); /* saturates: the file is the container's */
    } while (!__atomic_compare_exchange_n(vt, &old, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}

void thr_clock_add(int slot, uint64_t cost)
{
    clock_add_from(slot, cost, gs_now_ns());
}

/* The same for GPU time that ran from `began` on: the idle credit ends where that work began,
 * not where it was measured.  Caught up with the moment of the measurement, the clock took a
 * kernel's own time beyond GS_BURST_NS for idle time: 200 ms kernels each waited for got 36 %
 * of the GPU under a 50 % limit, 300 ms ones 24 % under 30 % (`test_throttle.py -k longer_than_the_idle`) */
void thr_clock_add_since(int slot, uint64_t cost, uint64_t began)
{
    clock_add_from(slot, cost, began);
}

/* Gives back what was paid in advance for time the measurement did not find (a clock already
 * below the burst floor keeps only what the floor allows at the next debit) */
void thr_clock_refund(int slot, uint64_t cost)
{
    if (!cost) return;
    uint64_t *vt = &gs_region->devices[slot].throttle_vt_ns;
    uint64_t old = __atomic_load_n(vt, __ATOMIC_RELAXED), next;
    do {
        next = old > cost ? old - cost : 0;
    } while (!__atomic_compare_exchange_n(vt, &old, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}

/* ---- launches a capture keeps from being measured -------------------------- */

uint64_t gs_unmeasured_ns[GPUSLICE_MAX_DEVICES];
uint64_t gs_unmeasured_prepaid_ns[GPUSLICE_MAX_DEVICES];
uint64_t gs_unmeasured_prepaid_cost[GPUSLICE_MAX_DEVICES]; /* what those advances cost the clock */
uint64_t thr_launch_est_ns[GPUSLICE_MAX_DEVICES]; /* one launch's GPU time, as last measured */

/* Sampler thread: busy_ns of GPU time that NVML's per-process utilisation found beyond what the
 * events measured, while launches went unmeasured; it ran in [since, now].  Charged as the real
 * share it is (no time-slice factor), and the clock's floor is where that time began, so that
 * the idle credit is not taken again for time the process spent running. */
void gs_launch_charge_unmeasured(int slot, uint64_t busy_ns, uint64_t since)
{
    struct gpuslice_device *d = &gs_region->devices[slot];
    uint64_t cost = thr_unmeasured_cost(d, busy_ns), now = gs_now_ns();
    if (!cost) return;
    if (since + GS_UNMEASURED_SPAN_NS < now) since = now - GS_UNMEASURED_SPAN_NS;
    clock_add_from(slot, cost, since);
    __atomic_add_fetch(&d->busy_ns, busy_ns, __ATOMIC_RELAXED);
    GS_DEBUG("device slot %d: %llu ns of unmeasured GPU time charged (NVML)", slot, (unsigned long long)busy_ns);
}

/* Sampler thread: launches paid in advance for GPU time NVML did not find them running; cost is
 * what that advance cost the clock (as paid: the clock scale may have changed since) */
void gs_launch_refund_unmeasured(int slot, uint64_t cost)
{
    thr_clock_refund(slot, cost);
    GS_DEBUG("device slot %d: %llu ns of clock paid in advance for unmeasured launches given back (NVML)", slot,
             (unsigned long long)cost);
}

/* The clock a launch on the slot waits for: the furthest ahead of those of the container's
 * devices under a compute limit (its own alone with GPUSLICE_SM_LIMIT_GANG=off).  Each device's
 * clock is charged its own GPU time only, so each device stays within the limit; waiting for
 * all of them makes the container's processes wait together.  Paced one device at a time,
 * ranks that synchronise across devices (tensor or data parallel, NCCL) stall: one rank's
 * collective kernel spins while another waits for its device's budget, the spin is charged as
 * the GPU time it is, so that rank then waits (100/C - 1) times as long while the other's next
 * collective spins, and so on: under a limit below 50 % each wait is longer than the last by
 * that factor (two ranks of 1.0 and 1.2 ms kernels at 40 %: 25 steps in 38 s, then a
 * collective never met; test_throttle.py -k tensor_parallel) */
/* the slots live processes of the container have measured work on (all until the sampler's
 * first look: ranks not measured yet must not be left out) */
static uint32_t g_gang_mask = ~0u;

static uint64_t *gate_clock(int slot)
{
    struct gpuslice_device *own = &gs_region->devices[slot];
    uint64_t *vt = &own->throttle_vt_ns;
    if (!thr_gang) return vt;
    unsigned n = gs_region_devices(gs_region);
    uint32_t gang = __atomic_load_n(&g_gang_mask, __ATOMIC_RELAXED);
    uint64_t ahead = __atomic_load_n(vt, __ATOMIC_RELAXED);
    for (unsigned i = 0; i < n; i++) {
        struct gpuslice_device *d = &gs_region->devices[i];
        uint64_t v = __atomic_load_n(&d->throttle_vt_ns, __ATOMIC_RELAXED);
        unsigned sm = v > ahead && (gang >> i & 1) ? __atomic_load_n(&d->sm_limit, __ATOMIC_RELAXED) : 0;
        if (sm > 0 && sm < 100) ahead = v, vt = &d->throttle_vt_ns; /* each charged at its own limit */
    }
    return vt;
}

/* Sampler thread: the gang is the devices that live processes of the container have measured
 * work on.  A device whose last process went keeps the clock its work left ahead (its next
 * process pays it), but that debt no longer holds the other devices' launches: one process
 * ending with a 1 s kernel at 20 % held an unrelated one on another device for 4 s. */
void gs_launch_gang_refresh(void)
{
    struct gpuslice_region *r = gs_region;
    if (!r || !thr_gang || !gs_launch_wants_sampler()) return;
    unsigned n = gs_region_devices(r);
    uint32_t gang = 0;
    for (unsigned p = 0; p < GPUSLICE_MAX_PROCS; p++) {
        struct gpuslice_proc *pr = &r->procs[p];
        if (__atomic_load_n(&pr->state, __ATOMIC_ACQUIRE) != GPUSLICE_PROC_LIVE) continue;
        for (unsigned i = 0; i < n; i++)
            if (__atomic_load_n(&pr->measured_ns[i], __ATOMIC_RELAXED)) gang |= 1u << i;
    }
    __atomic_store_n(&g_gang_mask, gang, __ATOMIC_RELAXED);
}

int thr_budget_owed(int slot)
{
    return __atomic_load_n(gate_clock(slot), __ATOMIC_RELAXED) > gs_now_ns();
}

void thr_wait_for_budget(int slot)
{
    thr_wait_for_budget_until(slot, UINT64_MAX);
}

void thr_wait_for_budget_until(int slot, uint64_t until)
{
    for (;;) {
        uint64_t *vt = gate_clock(slot);
        uint64_t v = __atomic_load_n(vt, __ATOMIC_RELAXED), now = gs_now_ns();
        if (v <= now || now >= until) return;
        uint64_t wait = v - now;
        if (GS_UNLIKELY(wait > GS_AHEAD_MAX_NS)) {
            if (__atomic_compare_exchange_n(vt, &v, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                GS_WARN("the compute limit's clock was %llu s ahead (the region was written over): reset",
                        (unsigned long long)(wait / 1000000000ull));
            continue;
        }
        if (wait > until - now) wait = until - now;
        gs_sleep_ns(wait > 50000000ull ? 50000000ull : wait);
    }
}
