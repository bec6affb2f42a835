/*
 * launch.c - the compute limit: CUDA_DEVICE_SM_LIMIT=C gives the container C%
 * of the GPU's time, enforced in the launch path.
 *
 * Measure, then pace.  Each throttled launch records a CUDA event after the
 * kernel on its stream (and one before it when the stream was idle, or had a
 * copy, host function or wait queued since its last launch: that gap is not
 * charged), so the
 * time between consecutive completed events is the GPU time the stream's
 * kernels took, or waited: a kernel queued behind another stream's counts
 * from its start event.  So the intervals of a context's streams are placed
 * on one timeline (each event's time after a reference event of that
 * context, re-based every GS_EPOCH_NS) and only their union is debited: N
 * streams whose kernels run one after another are charged their total, not
 * N(N+1)/2 kernels' worth.  Completed intervals are debited from a budget shared by all
 * processes of the container through the region: a virtual clock vt per
 * device, advanced by busy_ns * 100 / C.  A launch waits until vt <= now, and
 * vt never lags now by more than GS_BURST_NS (idle time buys at most that much
 * credit).  Over any long window GPU time / wall time therefore tends to C%,
 * for a few huge kernels (each one is debited in full when it ends, and the
 * next waits it off) as for floods of tiny ones (debited in batches).
 *
 * Work launched but not yet measured is bounded: at most GS_RING events per
 * stream (past that the newest event is recorded again, so it covers more
 * launches), and about GS_QUEUE_NS of estimated GPU time (one kernel while the
 * per-launch estimate is unknown), so the GPU cannot run far ahead of the
 * budget.  A launch waits for that queue at most GS_QUEUE_WAIT_NS: a program
 * whose queued kernel waits for the host (a stream wait on a flag the host
 * sets after its next launch) must not deadlock; what runs ahead is debited
 * when it completes all the same.  Synchronisations (cuCtxSynchronize[_v2],
 * cuStreamSynchronize, cuEventSynchronize) measure what completed, so the
 * last work before a process exits is charged too.  An interval is never
 * charged more than the host time since its first event was recorded (a
 * failed record cannot turn idle time into GPU time).
 *
 * Without a limit the launch path is one atomic load, one pointer load and a
 * tail call into the real function (the hooks at the end of this file).
 * Streams being captured into a graph are not touched (event queries would
 * invalidate the capture); the graph is paced when it is launched.  While
 * any thread captures in global mode, or this thread in any mode but
 * relaxed, the driver forbids event queries in the whole process (they would
 * invalidate that capture): launches then go unmeasured (cuStreamBeginCapture*
 * and cuStreamEndCapture* are hooked to know), but they still wait for the
 * budget and pay the last measured launch's GPU time in advance, and the
 * sampler settles that against NVML's per-process utilisation (slices.c).
 *
 * Clock compensation (GPUSLICE_SM_LIMIT_MODE=throughput, the default).  A GPU
 * that the container leaves idle most of the time has power to spare, so the
 * container's kernels run at a higher clock than the same kernels would
 * under full load (H200, bf16 matmul: ~1950 MHz throttled to 30%, ~1515 MHz
 * power-capped at 100%), and C% of the time delivers more than C% of the
 * throughput.  The sampler estimates how much faster: with idle power P0,
 * power limit L, board power P and utilisation u (all from NVML), the GPU
 * fully busy with the current kernels would draw P0 + (P - P0) / u at the
 * present clock; if that exceeds L the clock would fall until it fits, and
 * dynamic power goes as about the cube of the clock (voltage follows the
 * clock), so the clock now is s = cbrt(((P - P0) / u) / (L - P0)) times the
 * full-load one.  GPU time is debited times s (per device, shared through the
 * region, from smoothed readings, 1 <= s <= 1.75).  A GPU already at its power limit gives
 * s = 1, and so does work that would not reach the limit even at full load
 * (memory-bound kernels), where time share and throughput share agree.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

#include "gpuslice.h"

#define GS_BURST_NS 50000000ull   /* idle credit: at most 50 ms of wall time */
/* A clock further ahead than this was written over (any process of the container can write the
 * region): a day is what an 864 s kernel costs at a 1 % limit */
#define GS_AHEAD_MAX_NS (86400ull * 1000000000ull)
#define GS_QUEUE_NS 20000000ull   /* unmeasured work in flight per stream */
#define GS_UNREAD_MAX_NS 2000000000ull /* work whose events cannot be read: charged up to this */
#define GS_QUEUE_WAIT_NS 50000000ull /* the longest a launch waits for that queue */
#define GS_EPOCH_NS 5000000000ull /* a context's reference event is renewed this often */
#define GS_TIMELINES 16           /* contexts with a timeline */
#define GS_SEGMENTS 32            /* disjoint busy segments a timeline remembers */
#define GS_RING 64
#define GS_STREAMS 256
#define GS_POLL_NS 100000ull
/* unmeasured time NVML found is charged from at most this long ago (a sampler tick with new samples
 * and the sample period that can lag behind it) */
#define GS_UNMEASURED_SPAN_NS 1500000000ull
#define GS_SCALE_MAX_MILLI 1750u  /* clock compensation: at most 1.75 x */
#define GS_UTIL_MIN 5u            /* below this utilisation (%) the power estimate is noise */
#define GS_WINDOW 4               /* samples the estimate averages (2 s at the sampler's 500 ms) */
#define GS_WARMUP_SAMPLES 2       /* busy samples after idle not used (power is a 1 s average) */
#define GS_IDLE_SAMPLES 2         /* consecutive samples at 0% utilisation before power counts as idle */

enum { THROTTLE_UNKNOWN = 0, THROTTLE_OFF = 1, THROTTLE_ON = 2 };
static int g_state;
static int g_time_mode; /* GPUSLICE_SM_LIMIT_MODE=time: no clock compensation */
static int g_gang = 1;  /* GPUSLICE_SM_LIMIT_GANG: launches wait for every limited device's clock */

struct tstream {
    uint64_t key;       /* stream handle (per-thread default stream: mixed with the thread id) */
    CUcontext ctx;
    int slot;
    int head, count;    /* ring[head .. head+count) recorded, not yet measured */
    int gaps;           /* of those, events that end a gap (launches 0) */
    int launching;      /* measured launches between their begin and their end's record */
    int unended;        /* a launch's end could not be recorded: no gap before the next end */
    CUevent ring[GS_RING];
    unsigned launches[GS_RING]; /* launches covered by each event; 0: it ends other work (a gap) */
    uint64_t rec_ns[GS_RING];   /* host time each was (last) recorded */
    CUevent mark;       /* the last measured event: start of the next interval */
    uint64_t mark_ns;   /* host time it was recorded: the interval cannot be longer than since */
    CUevent spare[GS_RING + 2];
    int nspare;
    uint64_t per_launch_ns; /* running estimate of one launch's GPU time; 0 = unknown */
    uint64_t advance_ns; /* GPU time debited before it was measured (a queue wait gave up) */
    uint64_t advance_cost; /* what that cost on the clock: settled and given back at most */
    uint64_t last_use;
};

/* One context's timeline: event times in ms after `epoch`, and the union of
 * the intervals debited so far as disjoint segments (oldest first; when full,
 * the two oldest merge, so a late interval inside that gap counts as covered). */
struct tline {
    CUcontext ctx;        /* NULL = free */
    CUevent epoch;        /* completed reference event, or NULL */
    CUevent pending;      /* a newer reference recorded, not yet known complete */
    uint64_t epoch_ns;    /* host time the epoch was recorded */
    uint64_t pending_ns;  /* host time the pending one was recorded */
    int nseg;
    double seg[GS_SEGMENTS][2];
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
/* g_mu counts in gs_t_held: the driver may call back into the process from inside the event
 * calls made under it (a profiler's API callback), and a launch or synchronisation from
 * there passes through unmeasured rather than wait for its own thread */
static void mu_lock(void)
{
    gs_held_lock(&g_mu);
}

static void mu_unlock(void)
{
    gs_held_unlock(&g_mu);
}
static struct tstream g_streams[GS_STREAMS];
static int g_streams_used; /* entries [0, g_streams_used) were ever taken (485 KiB in all: a fork
                            * clears only these, not faulting in the rest) */
static struct tline g_lines[GS_TIMELINES];
static uint64_t g_tick;

void gs_launch_configure(void)
{
    int on = 0;
    struct gpuslice_region *r = gs_region;
    for (unsigned d = 0; r && d < gs_region_devices(r); d++) {
        unsigned sm = __atomic_load_n(&r->devices[d].sm_limit, __ATOMIC_RELAXED);
        if (sm > 0 && sm < 100) on = 1;
    }
    g_time_mode = on && gs_env_sm_time_mode();
    g_gang = !on || gs_env_sm_gang();
    __atomic_store_n(&g_state, on ? THROTTLE_ON : THROTTLE_OFF, __ATOMIC_RELEASE);
    if (on) GS_INFO("compute limit active (%s)", g_time_mode ? "time share" : "throughput, clock compensated");
}

/* Each region slot with a compute limit once, with a CUDA ordinal of it and its NVML handle
 * (slots NVML does not know are left out); returns how many. */
int gs_limited_devices(struct gs_limited_dev *out)
{
    struct gpuslice_region *r = gs_region;
    int done[GPUSLICE_MAX_DEVICES] = {0}, k = 0;
    int n = gs_dev_count();
    for (CUdevice dev = 0; r && dev < n && dev < GS_MAX_CUDA_DEVS; dev++) {
        int slot = gs_dev_slot(dev);
        nvmlDevice_t h = gs_dev_nvml(dev);
        if (slot < 0 || slot >= GPUSLICE_MAX_DEVICES || done[slot] || !h) continue;
        done[slot] = 1;
        unsigned sm = __atomic_load_n(&r->devices[slot].sm_limit, __ATOMIC_RELAXED);
        if (sm && sm < 100) out[k++] = (struct gs_limited_dev){dev, slot, h};
    }
    return k;
}

/* ---- clock compensation --------------------------------------------------- */

static double cube_root(double r)
{
    double x = r > 1 ? 1 + (r - 1) / 3 : 1;
    for (int i = 0; i < 40; i++) x = (2 * x + r / (x * x)) / 3;
    return x;
}

/* s in 1/1000 (1000..GS_SCALE_MAX_MILLI), or 0 when the readings say nothing
 * (too little utilisation, no power limit). */
unsigned gs_power_scale_milli(double power_mw, double limit_mw, double idle_mw, double util_pct)
{
    if (!(limit_mw > idle_mw) || !(util_pct >= GS_UTIL_MIN) || util_pct > 100) return 0;
    if (power_mw <= idle_mw) return 1000;
    double busy = (power_mw - idle_mw) * 100.0 / util_pct; /* dynamic power at full duty */
    double ratio = busy / (limit_mw - idle_mw);
    if (ratio <= 1) return 1000;
    double s = cube_root(ratio) * 1000.0;
    return s >= GS_SCALE_MAX_MILLI ? GS_SCALE_MAX_MILLI : (unsigned)(s + 0.5);
}

/* A limit: the sampler corrects for time slices (slices.c) and compensates the clock, and it
 * charges launches that a capture kept from being measured (gs_launch_charge_unmeasured) */
int gs_launch_wants_sampler(void)
{
    return __atomic_load_n(&g_state, __ATOMIC_ACQUIRE) == THROTTLE_ON;
}

static void lower_idle_power(struct gpuslice_device *d, unsigned mw)
{
    unsigned old = __atomic_load_n(&d->idle_power_mw, __ATOMIC_RELAXED);
    while ((!old || mw < old) &&
           !__atomic_compare_exchange_n(&d->idle_power_mw, &old, mw, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* Sampler thread: one NVML reading per limited device.  Power and
 * utilisation are summed over the last GS_WINDOW useful samples and divided
 * once (the ratio of two noisy readings, taken sample by sample, is biased
 * upward, and power is averaged over a longer window than utilisation), then
 * give the device's sm_scale_milli (shared by the container's processes). */
void gs_launch_sample(void)
{
    /* sampler thread only */
    static int idle_run[GPUSLICE_MAX_DEVICES];
    static unsigned busy_run[GPUSLICE_MAX_DEVICES];
    static unsigned win_power[GPUSLICE_MAX_DEVICES][GS_WINDOW], win_util[GPUSLICE_MAX_DEVICES][GS_WINDOW];
    static unsigned win_next[GPUSLICE_MAX_DEVICES];
    struct gpuslice_region *r = gs_region;
    if (!r || !gs_launch_wants_sampler() || g_time_mode) return;
    gs_nvml_init();
    if (!gs_nvml.nvmlDeviceGetPowerUsage || !gs_nvml.nvmlDeviceGetEnforcedPowerLimit ||
        !gs_nvml.nvmlDeviceGetUtilizationRates)
        return;
    struct gs_limited_dev lim[GPUSLICE_MAX_DEVICES];
    int nlim = gs_limited_devices(lim);
    for (int l = 0; l < nlim; l++) {
        int slot = lim[l].slot;
        nvmlDevice_t h = lim[l].nvml;
        struct gpuslice_device *d = &r->devices[slot];
        unsigned power = 0, limit = 0;
        nvmlUtilization_t util = {0, 0};
        if (gs_nvml.nvmlDeviceGetPowerUsage(h, &power) != NVML_SUCCESS ||
            gs_nvml.nvmlDeviceGetEnforcedPowerLimit(h, &limit) != NVML_SUCCESS ||
            gs_nvml.nvmlDeviceGetUtilizationRates(h, &util) != NVML_SUCCESS || util.gpu > 100)
            continue;
        /* board power is averaged over about a second: only a second idle sample in a row is idle power */
        idle_run[slot] = util.gpu ? 0 : idle_run[slot] + 1;
        if (idle_run[slot] >= GS_IDLE_SAMPLES && power) lower_idle_power(d, power);
        /* idle or nearly: nothing to learn, keep the last scale.  Just after idle, power
         * (averaged over a second, twice the sampling interval) still reads part of the idle
         * time: the first GS_WARMUP_SAMPLES busy samples are not used */
        busy_run[slot] = util.gpu < GS_UTIL_MIN ? 0 : busy_run[slot] + 1;
        if (busy_run[slot] <= GS_WARMUP_SAMPLES) continue;
        unsigned k = win_next[slot]++ % GS_WINDOW;
        win_power[slot][k] = power;
        win_util[slot][k] = util.gpu;
        double power_sum = 0, util_sum = 0;
        for (int i = 0; i < GS_WINDOW; i++) {
            power_sum += win_power[slot][i];
            util_sum += win_util[slot][i];
        }
        unsigned used = win_next[slot] < GS_WINDOW ? win_next[slot] : GS_WINDOW;
        unsigned idle = __atomic_load_n(&d->idle_power_mw, __ATOMIC_RELAXED);
        if (!idle || idle >= limit) idle = limit / 8; /* not seen yet: typical idle draw */
        unsigned s = gs_power_scale_milli(power_sum / used, limit, idle, util_sum / used);
        if (!s) continue;
        __atomic_store_n(&d->sm_scale_milli, s, __ATOMIC_RELAXED);
        GS_DEBUG("device slot %d: power %u/%u mW (idle %u), utilisation %u%% -> clock scale %u/1000", slot, power,
                 limit, idle, util.gpu, s);
    }
}

/* ---- the shared budget ---------------------------------------------------- */

/* GPU time measured for the process on the device: the figures the slices correction and the
 * agent's metrics read (other processes' slices removed, slices.c) */
static unsigned own_share(int slot)
{
    unsigned own = __atomic_load_n(&gs_slice_milli[slot], __ATOMIC_RELAXED);
    return !own || own > 1000 ? 1000 : own;
}

static void account(int slot, uint64_t busy_ns)
{
    unsigned own = own_share(slot);
    gs_region_note_measured(slot, __atomic_add_fetch(&gs_slice_measured_ns[slot], busy_ns, __ATOMIC_RELAXED));
    __atomic_add_fetch(&gs_region->devices[slot].busy_ns, busy_ns * own / 1000, __ATOMIC_RELAXED);
}

/* What busy_ns of the process's own GPU time costs on the shared virtual clock: busy × s × 100 / C;
 * 0 without a limit */
static uint64_t unmeasured_cost(struct gpuslice_device *d, uint64_t busy_ns)
{
    unsigned sm = __atomic_load_n(&d->sm_limit, __ATOMIC_RELAXED);
    if (!sm || sm >= 100) return 0;
    unsigned scale = g_time_mode ? 0 : __atomic_load_n(&d->sm_scale_milli, __ATOMIC_RELAXED);
    if (scale < 1000 || scale > GS_SCALE_MAX_MILLI) scale = 1000;
    return busy_ns * scale / (10ull * sm); /* no overflow for 200 days */
}

/* The same for busy_ns the events measured: the process's own share of it */
static uint64_t clock_cost(int slot, uint64_t busy_ns)
{
    return unmeasured_cost(&gs_region->devices[slot], busy_ns * own_share(slot) / 1000);
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

static void clock_add(int slot, uint64_t cost)
{
    clock_add_from(slot, cost, gs_now_ns());
}

/* Gives back what was paid in advance for time the measurement did not find (a clock already
 * below the burst floor keeps only what the floor allows at the next debit) */
static void clock_refund(int slot, uint64_t cost)
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
static uint64_t g_launch_est_ns[GPUSLICE_MAX_DEVICES]; /* one launch's GPU time, as last measured */

/* Sampler thread: busy_ns of GPU time that NVML's per-process utilisation found beyond what the
 * events measured, while launches went unmeasured; it ran in [since, now].  Charged as the real
 * share it is (no time-slice factor), and the clock's floor is where that time began, so that
 * the idle credit is not taken again for time the process spent running. */
void gs_launch_charge_unmeasured(int slot, uint64_t busy_ns, uint64_t since)
{
    struct gpuslice_device *d = &gs_region->devices[slot];
    uint64_t cost = unmeasured_cost(d, busy_ns), now = gs_now_ns();
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
    clock_refund(slot, cost);
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
    if (!g_gang) return vt;
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
    if (!r || !g_gang || !gs_launch_wants_sampler()) return;
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

static int budget_owed(int slot)
{
    return __atomic_load_n(gate_clock(slot), __ATOMIC_RELAXED) > gs_now_ns();
}

static void wait_for_budget(int slot)
{
    for (;;) {
        uint64_t *vt = gate_clock(slot);
        uint64_t v = __atomic_load_n(vt, __ATOMIC_RELAXED), now = gs_now_ns();
        if (v <= now) return;
        uint64_t wait = v - now;
        if (GS_UNLIKELY(wait > GS_AHEAD_MAX_NS)) {
            if (__atomic_compare_exchange_n(vt, &v, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                GS_WARN("the compute limit's clock was %llu s ahead (the region was written over): reset",
                        (unsigned long long)(wait / 1000000000ull));
            continue;
        }
        gs_sleep_ns(wait > 50000000ull ? 50000000ull : wait);
    }
}

/* ---- per-stream measurement ----------------------------------------------- */

static CUevent take_event(struct tstream *s)
{
    CUevent e = NULL;
    if (s->nspare) return s->spare[--s->nspare];
    if (gs_cuda.cuEventCreate(&e, CU_EVENT_DEFAULT) != CUDA_SUCCESS) return NULL;
    return e;
}

static void give_event(struct tstream *s, CUevent e)
{
    if (!e) return;
    if (s->nspare < (int)(sizeof(s->spare) / sizeof(s->spare[0])))
        s->spare[s->nspare++] = e;
    else if (gs_cuda.cuEventDestroy_v2)
        gs_cuda.cuEventDestroy_v2(e);
}

/* An event the driver would not record (made in another context, a sticky error): destroyed,
 * never reused, or every later launch on the stream would fail to record it. */
static void drop_event(CUevent e)
{
    if (e && gs_cuda.cuEventDestroy_v2) gs_cuda.cuEventDestroy_v2(e);
}

static void reset_stream(struct tstream *s)
{
    /* events of a dead context are gone with it: just forget them */
    memset(s, 0, sizeof(*s));
}

/* A query failed on a live context (a sticky error, ...): destroy the
 * stream's events and start over, keeping the entry. */
static void restart_stream(struct tstream *s)
{
    if (gs_cuda.cuEventDestroy_v2) {
        for (int i = 0; i < s->count; i++) gs_cuda.cuEventDestroy_v2(s->ring[(s->head + i) % GS_RING]);
        for (int i = 0; i < s->nspare; i++) gs_cuda.cuEventDestroy_v2(s->spare[i]);
        if (s->mark) gs_cuda.cuEventDestroy_v2(s->mark);
    }
    s->head = s->count = s->nspare = s->gaps = s->unended = 0;
    s->mark = NULL;
    s->mark_ns = 0;
    s->per_launch_ns = s->advance_ns = s->advance_cost = 0;
}

static int context_gone(CUresult rc)
{
    return rc == CUDA_ERROR_CONTEXT_IS_DESTROYED || rc == CUDA_ERROR_INVALID_CONTEXT ||
           rc == CUDA_ERROR_INVALID_HANDLE || rc == CUDA_ERROR_DEINITIALIZED;
}

static cuEventElapsedTime_fn elapsed_fn(void)
{
    return gs_cuda.cuEventElapsedTime ? gs_cuda.cuEventElapsedTime : gs_cuda.cuEventElapsedTime_v2;
}

/* ---- a context's timeline ------------------------------------------------- */

static struct tline *line_get_locked(CUcontext ctx, int create)
{
    struct tline *free_line = NULL;
    for (int i = 0; i < GS_TIMELINES; i++) {
        if (g_lines[i].ctx == ctx) return &g_lines[i];
        if (!g_lines[i].ctx && !free_line) free_line = &g_lines[i];
    }
    if (!create || !free_line) return NULL;
    memset(free_line, 0, sizeof(*free_line));
    free_line->ctx = ctx;
    return free_line;
}

static void line_drop_events(struct tline *t, int destroy)
{
    if (destroy && gs_cuda.cuEventDestroy_v2) {
        if (t->epoch) gs_cuda.cuEventDestroy_v2(t->epoch);
        if (t->pending) gs_cuda.cuEventDestroy_v2(t->pending);
    }
    t->epoch = t->pending = NULL;
    t->nseg = 0;
}

/* Record a reference event on es when the context has none, or a newer one
 * when it is GS_EPOCH_NS old (float milliseconds lose precision far from it;
 * after a long idle only the old segments, in the past, shift imprecisely). */
static void line_reference_locked(CUcontext ctx, CUstream es, uint64_t now)
{
    struct tline *t = line_get_locked(ctx, 1);
    if (!t || t->pending) return;
    if (t->epoch && now - t->epoch_ns <= GS_EPOCH_NS) return;
    CUevent e = NULL;
    if (gs_cuda.cuEventCreate(&e, CU_EVENT_DEFAULT) != CUDA_SUCCESS || !e) return;
    if (gs_cuda.cuEventRecord(e, es) != CUDA_SUCCESS) {
        gs_cuda.cuEventDestroy_v2(e);
        return;
    }
    t->pending = e;
    t->pending_ns = now;
}

/* Promote a completed pending reference: segment times shift by its offset. */
static void line_settle_locked(struct tline *t, cuEventElapsedTime_fn elapsed)
{
    if (!t->pending || gs_cuda.cuEventQuery(t->pending) != CUDA_SUCCESS) return;
    if (t->epoch) {
        float off = 0;
        if (elapsed(&off, t->epoch, t->pending) != CUDA_SUCCESS) {
            line_drop_events(t, 1); /* cannot relate the two: start over */
            return;
        }
        for (int i = 0; i < t->nseg; i++) {
            t->seg[i][0] -= off;
            t->seg[i][1] -= off;
        }
        GS_DEBUG("timeline re-based by %.3f ms", off);
        gs_cuda.cuEventDestroy_v2(t->epoch);
    } else {
        t->nseg = 0;
        GS_DEBUG("timeline started");
    }
    t->epoch = t->pending;
    t->epoch_ns = t->pending_ns;
    t->pending = NULL;
}

/* Add [a, b] (ms after the epoch) to the union; returns the part not yet covered. */
static double line_add(struct tline *t, double a, double b)
{
    if (b <= a) return 0;
    double overlap = 0, lo = a, hi = b;
    int keep = 0;
    for (int i = 0; i < t->nseg; i++) {
        double s0 = t->seg[i][0], s1 = t->seg[i][1];
        double o = (s1 < b ? s1 : b) - (s0 > a ? s0 : a);
        if (o > 0) overlap += o;
        if (s1 < a || s0 > b) { /* disjoint: kept */
            t->seg[keep][0] = s0;
            t->seg[keep][1] = s1;
            keep++;
        } else { /* touching or overlapping: merged into the new segment */
            if (s0 < lo) lo = s0;
            if (s1 > hi) hi = s1;
        }
    }
    int at = 0; /* keep the segments in order */
    while (at < keep && t->seg[at][0] < lo) at++;
    memmove(&t->seg[at + 1], &t->seg[at], (size_t)(keep - at) * sizeof(t->seg[0]));
    t->seg[at][0] = lo;
    t->seg[at][1] = hi;
    t->nseg = keep + 1;
    if (t->nseg == GS_SEGMENTS) {
        /* full: the oldest is forgotten, so an interval reaching back over it is charged that
         * time again (the strict side).  Merging the two oldest instead counted the gap between
         * them as charged: one stream's long interval spanning many small kernels of another
         * was then charged almost nothing (97-101 % under a 30 % limit) */
        memmove(&t->seg[0], &t->seg[1], (size_t)(GS_SEGMENTS - 1) * sizeof(t->seg[0]));
        t->nseg--;
    }
    double fresh = (b - a) - overlap;
    return fresh > 0 ? fresh : 0;
}

/* The part of the interval [mark, e] (plain length ms) not already debited
 * for another stream of the context; ms itself without a timeline. */
static double line_credit_locked(CUcontext ctx, CUevent mark, CUevent e, double ms, cuEventElapsedTime_fn elapsed)
{
    struct tline *t = line_get_locked(ctx, 0);
    if (!t) return ms;
    line_settle_locked(t, elapsed);
    float a = 0, b = 0;
    if (!t->epoch || elapsed(&a, t->epoch, mark) != CUDA_SUCCESS || elapsed(&b, t->epoch, e) != CUDA_SUCCESS)
        return ms;
    return line_add(t, a, b);
}

/* Debit every completed interval of s. */
static void measure_locked(struct tstream *s)
{
    static int warned;
    cuEventElapsedTime_fn elapsed = elapsed_fn();
    while (s->count) {
        CUevent e = s->ring[s->head];
        CUresult q = gs_cuda.cuEventQuery(e);
        if (q == CUDA_ERROR_NOT_READY) return;
        if (q != CUDA_SUCCESS) {
            if (context_gone(q)) {
                reset_stream(s);
            } else {
                if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
                    GS_WARN("compute limit: cuEventQuery failed (%d); the stream's measurement starts over", q);
                restart_stream(s);
            }
            return;
        }
        float ms = 0;
        CUresult er = s->mark && elapsed ? elapsed(&ms, s->mark, e) : CUDA_ERROR_NOT_READY;
        unsigned n = s->launches[s->head];
        if (er == CUDA_SUCCESS && ms > 0) {
            uint64_t ns = (uint64_t)((double)ms * 1e6), now = gs_now_ns();
            uint64_t host = now > s->mark_ns ? now - s->mark_ns : 0;
            if (ns > host) ns = host; /* never more than the wall time since its start was recorded */
            uint64_t charge = 0; /* a gap (n 0: copies, host functions, waits) is charged nothing */
            if (n) {
                uint64_t each = ns / n;
                s->per_launch_ns = s->per_launch_ns ? (s->per_launch_ns * 3 + each) / 4 : each;
                __atomic_store_n(&g_launch_est_ns[s->slot], s->per_launch_ns * own_share(s->slot) / 1000,
                                 __ATOMIC_RELAXED);
                double fresh = line_credit_locked(s->ctx, s->mark, e, ms, elapsed);
                charge = (uint64_t)(fresh * 1e6);
                if (charge > ns) charge = ns;
            }
            /* an advance paid for the interval's length in host time, so it is settled against
             * the interval's length (ns); what the interval is charged is what the merged
             * timeline leaves of it, and the difference is paid, or given back (never more
             * than the settled part of the advance cost the clock) */
            uint64_t settled = ns < s->advance_ns ? ns : s->advance_ns;
            uint64_t paid = s->advance_ns ? (uint64_t)((unsigned __int128)s->advance_cost * settled / s->advance_ns) : 0;
            s->advance_ns -= settled;
            s->advance_cost -= paid;
            account(s->slot, charge);
            uint64_t cost = clock_cost(s->slot, charge);
            if (cost >= paid)
                clock_add(s->slot, cost - paid);
            else
                clock_refund(s->slot, paid - cost);
            if (n)
                GS_DEBUG("debit %llu ns of %llu (%u launches) on device slot %d", (unsigned long long)charge,
                         (unsigned long long)ns, n, s->slot);
            else
                GS_DEBUG("a gap of %llu ns on device slot %d (copies, host functions, waits): not charged",
                         (unsigned long long)ns, s->slot);
        } else if (er != CUDA_SUCCESS && er != CUDA_ERROR_NOT_READY &&
                   !__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED)) {
            GS_WARN("compute limit: cuEventElapsedTime failed (%d); GPU time goes unmeasured", er);
        }
        give_event(s, s->mark);
        s->mark = e;
        s->mark_ns = s->rec_ns[s->head];
        s->head = (s->head + 1) % GS_RING;
        if (!n) s->gaps--;
        if (!--s->count) {
            /* all measured: what was paid in advance beyond it (time the stream's work spent
             * waiting for other streams or the host, or that the merged timeline found
             * already charged) is given back */
            clock_refund(s->slot, s->advance_cost);
            s->advance_ns = s->advance_cost = 0;
        }
    }
}

static void measure_all_locked(void)
{
    for (int i = 0; i < GS_STREAMS; i++)
        if (g_streams[i].count) measure_locked(&g_streams[i]);
}

static int capture_forbids_queries(void);

/* After a synchronisation: charge what completed (the last work of a process
 * is charged before it exits, not only at its next launch). */
void gs_launch_after_sync(void)
{
    if (__atomic_load_n(&g_state, __ATOMIC_ACQUIRE) != THROTTLE_ON || capture_forbids_queries() || gs_t_held) return;
    mu_lock();
    if (!capture_forbids_queries()) measure_all_locked(); /* a global capture may have begun meanwhile */
    mu_unlock();
}

/* The stream's entry, or NULL: looked up, not made */
static struct tstream *stream_find_locked(uint64_t key, CUcontext ctx)
{
    for (int i = 0; i < g_streams_used; i++)
        if (g_streams[i].last_use && g_streams[i].key == key && g_streams[i].ctx == ctx) return &g_streams[i];
    return NULL;
}

static struct tstream *stream_get_locked(uint64_t key, CUcontext ctx, int slot)
{
    struct tstream *empty = NULL, *idle = NULL;
    for (int i = 0; i < GS_STREAMS; i++) {
        struct tstream *s = &g_streams[i];
        if (!s->last_use) {
            if (!empty) empty = s;
        } else if (s->key == key && s->ctx == ctx) {
            s->last_use = ++g_tick;
            return s;
        } else if (!s->count && !s->launching && (!idle || s->last_use < idle->last_use)) {
            idle = s;
        }
    }
    struct tstream *s = empty ? empty : idle;
    if (!s) return NULL; /* every entry has work in flight: the launch is paced unmeasured */
    if (s == idle) restart_stream(s); /* recycle the least recently used idle entry: its events go */
    if (s - g_streams >= g_streams_used) g_streams_used = (int)(s - g_streams) + 1;
    memset(s, 0, sizeof(*s));
    s->key = key;
    s->ctx = ctx;
    s->slot = slot;
    s->last_use = ++g_tick;
    return s;
}

/* Launches recorded, not yet measured (gaps are not work of ours) */
static int queued_launches(const struct tstream *s)
{
    return s->count - s->gaps;
}

static int over_queue(const struct tstream *s)
{
    if (s->count >= GS_RING) return 1;
    if (!queued_launches(s)) return 0;
    if (!s->per_launch_ns) return 1; /* unknown cost: one measured launch first */
    return (uint64_t)queued_launches(s) * s->per_launch_ns >= GS_QUEUE_NS;
}

/* ---- stream captures ------------------------------------------------------- */

#define GS_CAPTURES 64
static pthread_mutex_t g_cap_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    uint64_t key; /* 0 = free */
    int mode;
} g_caps[GS_CAPTURES];
static int g_global_captures;          /* captures in global mode, any thread (atomic) */
static __thread int t_strict_captures; /* this thread's captures not in relaxed mode */

static uint64_t stream_key(CUstream es)
{
    uint64_t key = es == CU_STREAM_LEGACY ? 0 : (uint64_t)(uintptr_t)es; /* NULL is the legacy stream too */
    if (es == CU_STREAM_PER_THREAD) key ^= (uint64_t)syscall(SYS_gettid) << 8;
    return key;
}

/* Would an event query now invalidate a capture? */
static int capture_forbids_queries(void)
{
    return __atomic_load_n(&g_global_captures, __ATOMIC_ACQUIRE) || t_strict_captures;
}

static int g_settling; /* contexts being synchronised before their destroy (gs_launch_settle_ctx) */

/* A global capture is counted before it begins (capture_announce), the others once begun. */
static void capture_announce(void)
{
    /* under g_mu: no thread is querying events as the count goes up, and any that takes the
     * lock later sees it (the throttle queries under g_mu and looks at the count first) */
    if (gs_t_held) { /* a driver callback under a lock of ours (maybe g_mu itself): none is waited for */
        __atomic_add_fetch(&g_global_captures, 1, __ATOMIC_ACQ_REL);
        return;
    }
    mu_lock();
    __atomic_add_fetch(&g_global_captures, 1, __ATOMIC_ACQ_REL);
    mu_unlock();
    /* a context being settled before its destroy is synchronised outside g_mu (it checked for
     * captures under it, before this one was counted): the capture begins after that sync, which
     * would invalidate it */
    while (__atomic_load_n(&g_settling, __ATOMIC_ACQUIRE)) gs_sleep_ns(GS_POLL_NS);
}

static void capture_begun(CUstream stream, int per_thread, CUstreamCaptureMode mode, CUresult rc)
{
    int i = GS_CAPTURES;
    if (rc == CUDA_SUCCESS) {
        uint64_t key = stream_key(gs_effective_stream(stream, per_thread));
        pthread_mutex_lock(&g_cap_mu);
        i = 0;
        while (i < GS_CAPTURES && g_caps[i].key) i++;
        if (i < GS_CAPTURES) {
            g_caps[i].key = key;
            g_caps[i].mode = mode;
        }
        pthread_mutex_unlock(&g_cap_mu);
        if (i == GS_CAPTURES)
            GS_WARN("more than %d stream captures at once: the throttle may invalidate one", GS_CAPTURES);
    }
    if (i == GS_CAPTURES) { /* not begun, or not recorded: its end will not be seen */
        if (mode == CU_STREAM_CAPTURE_MODE_GLOBAL) __atomic_sub_fetch(&g_global_captures, 1, __ATOMIC_ACQ_REL);
        return;
    }
    if (mode != CU_STREAM_CAPTURE_MODE_RELAXED) t_strict_captures++;
}

static void capture_ended(CUstream stream, int per_thread)
{
    CUstream es = gs_effective_stream(stream, per_thread);
    if (gs_stream_capturing(es)) return; /* the end was refused: the capture goes on */
    uint64_t key = stream_key(es);
    int mode = -1;
    pthread_mutex_lock(&g_cap_mu);
    for (int i = 0; i < GS_CAPTURES && mode < 0; i++)
        if (g_caps[i].key == key) {
            mode = g_caps[i].mode;
            g_caps[i].key = 0;
        }
    pthread_mutex_unlock(&g_cap_mu);
    if (mode == CU_STREAM_CAPTURE_MODE_GLOBAL) __atomic_sub_fetch(&g_global_captures, 1, __ATOMIC_ACQ_REL);
    if (mode >= 0 && mode != CU_STREAM_CAPTURE_MODE_RELAXED && t_strict_captures > 0) t_strict_captures--;
}

int gs_capture_global(void)
{
    return __atomic_load_n(&g_global_captures, __ATOMIC_ACQUIRE) != 0;
}

typedef CUresult (*launch_thunk)(const void *args);

/* A context-less kernel (a CUkernel) runs in the context of its stream, which need not be the
 * current one.  Its events must be made in that context (the driver records an event only on
 * a stream of its own context) and its time belongs to that context's device: the throttle's
 * bookkeeping runs with the stream's context current, the launch itself with the caller's. */
struct ctx_switch {
    int on;
    CUcontext home, there;
};

static int switch_to(const struct ctx_switch *sw, int there)
{
    return !sw->on || gs_cuda.cuCtxSetCurrent(there ? sw->there : sw->home) == CUDA_SUCCESS ? 0 : -1;
}

/* The slot (and context) a launch on es is measured in, -1 if none. */
static int launch_slot(CUstream es, CUcontext *ctx, struct ctx_switch *sw)
{
    int slot = gs_current_slot_raw(ctx); /* raw: green contexts measured as contexts of their own */
    CUcontext there = gs_stream_ctx(es), home = NULL;
    sw->on = 0;
    if (!there || there == *ctx || !gs_cuda.cuCtxSetCurrent || !gs_cuda.cuCtxGetCurrent) return slot;
    /* the caller's context as it is, even one the driver no longer gives a device for, or none:
     * a thread with no current context launches a context-less kernel in its stream's (it went
     * unmeasured, 100 % under 30 %), and gets none back after the bookkeeping */
    if (gs_cuda.cuCtxGetCurrent(&home) != CUDA_SUCCESS || there == home) return slot;
    if (gs_cuda.cuCtxSetCurrent(there) != CUDA_SUCCESS) return -1; /* launched unmeasured */
    sw->on = 1;
    sw->home = home;
    sw->there = there;
    slot = gs_current_slot_raw(ctx);
    if (slot < 0) {
        switch_to(sw, 0);
        sw->on = 0;
    }
    return slot;
}

/* A launch being measured: its stream, the slot and context it is measured in. */
struct measured {
    int slot;
    CUcontext ctx;
    CUstream es;
    uint64_t key;
    struct ctx_switch sw;
    int begun; /* counted in its stream's `launching` (begin_locked) */
};

/* A launch that a capture keeps from being measured (an event query would invalidate the capture)
 * still waits for the budget, a wait on the host that no capture forbids; what it runs is
 * charged by the sampler from NVML's per-process utilisation (slices.c) */
static void pace_unmeasured(const struct measured *m, int locked)
{
    /* paid in advance at the stream's last measured launch's GPU time (else the device's), at
     * most GS_QUEUE_NS, so that the queue cannot run far ahead of the budget before the sampler
     * knows (settled then against what NVML found).  A stream's entry is looked up, not made */
    int slot = m->slot;
    uint64_t est = 0;
    if (!locked) mu_lock();
    const struct tstream *s = stream_find_locked(stream_key(m->es), m->ctx);
    if (s) est = s->per_launch_ns * own_share(slot) / 1000;
    mu_unlock();
    if (!est) est = __atomic_load_n(&g_launch_est_ns[slot], __ATOMIC_RELAXED);
    if (est > GS_QUEUE_NS) est = GS_QUEUE_NS;
    uint64_t cost = est ? unmeasured_cost(&gs_region->devices[slot], est) : 0;
    if (cost) {
        __atomic_add_fetch(&gs_unmeasured_prepaid_ns[slot], est, __ATOMIC_RELAXED);
        __atomic_add_fetch(&gs_unmeasured_prepaid_cost[slot], cost, __ATOMIC_RELAXED);
        clock_add(slot, cost);
    }
    __atomic_store_n(&gs_unmeasured_ns[slot], gs_now_ns(), __ATOMIC_RELAXED);
    if (budget_owed(slot)) wait_for_budget(slot);
}

/* Waits until a launch on the stream may go: returns 1 with g_mu held and the stream's context
 * current, or 0 if the launch goes unmeasured (the caller's context current, g_mu free). */
static int admit_locked(CUstream stream, int per_thread, struct measured *m)
{
    m->sw.on = 0;
    m->begun = 0;
    m->es = gs_effective_stream(stream, per_thread);
    m->slot = launch_slot(m->es, &m->ctx, &m->sw);
    int slot = m->slot;
    if (slot < 0 || !__atomic_load_n(&gs_region->devices[slot].sm_limit, __ATOMIC_RELAXED) ||
        !gs_cuda.cuEventCreate || !gs_cuda.cuEventRecord || !gs_cuda.cuEventQuery || !elapsed_fn() ||
        gs_stream_capturing(m->es)) {
        switch_to(&m->sw, 0);
        return 0;
    }
    if (capture_forbids_queries()) {
        pace_unmeasured(m, 0);
        switch_to(&m->sw, 0);
        return 0;
    }
    m->key = stream_key(m->es);

    mu_lock();
    struct tstream *s;
    uint64_t queue_until = 0;
    int measured_all = 0, advanced = 0;
    for (;;) {
        /* a global capture begun meanwhile (counted under g_mu before it begins) forbids
         * every query from now on: launched unmeasured */
        if (capture_forbids_queries()) {
            pace_unmeasured(m, 1); /* unlocks */
            switch_to(&m->sw, 0);
            return 0;
        }
        if (!measured_all) measure_all_locked();
        measured_all = 1;
        /* launch only when the budget is paid and the queue is short, both at once; the queue
         * is waited for at most GS_QUEUE_WAIT_NS (its head may wait for the host) */
        s = stream_get_locked(m->key, m->ctx, slot);
        if (!s) {
            /* every entry has work in flight (streams held by waits on the host, say): paced as
             * a launch a capture keeps from being measured, paid in advance and settled against
             * NVML; let through unpaid, 256 such streams let another run at 100 % under 30 % */
            pace_unmeasured(m, 1); /* unlocks */
            switch_to(&m->sw, 0);
            return 0;
        }
        measure_locked(s);
        uint64_t now = gs_now_ns();
        if (over_queue(s) && (!queue_until || now < queue_until)) {
            if (!queue_until) queue_until = now + GS_QUEUE_WAIT_NS;
            mu_unlock();
            gs_sleep_ns(GS_POLL_NS);
        } else if (over_queue(s) && !advanced) {
            /* the queue's head has run longer than the wait (a kernel longer than it, or one
             * waiting for the host or another stream): what it can have taken since its
             * interval began, and no more than the queued work's estimate, is debited now,
             * once, and settled when it is measured; else kernels longer than the wait would
             * each pass it unpaid, at 100 % */
            advanced = 1;
            uint64_t ran = now > s->mark_ns ? now - s->mark_ns : 0, queued = (uint64_t)queued_launches(s) * s->per_launch_ns;
            if (s->per_launch_ns && ran > queued) ran = queued;
            if (s->mark_ns && ran > s->advance_ns) {
                uint64_t cost = clock_cost(slot, ran - s->advance_ns);
                clock_add(slot, cost); /* the budget only: the measurement accounts */
                s->advance_cost += cost;
                s->advance_ns = ran;
            }
            mu_unlock();
        } else if (budget_owed(slot)) {
            mu_unlock();
            wait_for_budget(slot);
        } else {
            return 1;
        }
        mu_lock();
    }
}

/* ---- work between kernels: copies, host functions, waits ------------------------------------
 * An interval runs from one event of the stream to the next, so whatever the stream did between
 * two launches was charged as kernel time: an async copy on a copy engine, a host function, a
 * wait for another stream's event or for a flag.  A 2 ms cuMemcpyHtoDAsync before each 2 ms
 * kernel got 16.8 % of kernel time at a 30 % limit (`test_throttle.py -k copies_host`: now
 * 30.7 %).  The hooks of those calls (with a limit)
 * mark the stream here, and its next launch records an event right before the kernel: the
 * interval up to it (a gap) is not charged.  One bit per stream key hash: a collision marks
 * another stream too (its next launch records an event it did not need: the gap it ends is idle
 * time, or nothing) or takes another's mark (that stream's gap is charged, as before). */
#define GS_GAP_BITS 1024
static uint64_t g_gap_bits[GS_GAP_BITS / 64];   /* a copy, host function or wait since the last launch */
static uint64_t g_block_bits[GS_GAP_BITS / 64]; /* a memset since the last launch: no gap may end */

static void bits_set(uint64_t *bits, CUstream stream, int per_thread)
{
    unsigned b = (unsigned)(gs_hash_step(0, stream_key(gs_effective_stream(stream, per_thread))) & (GS_GAP_BITS - 1));
    uint64_t bit = 1ull << (b & 63);
    if (!(__atomic_load_n(&bits[b >> 6], __ATOMIC_RELAXED) & bit)) __atomic_fetch_or(&bits[b >> 6], bit, __ATOMIC_RELAXED);
}

/* Whether the stream's bit was set since its last launch (and the bit cleared) */
static int bits_take(uint64_t *bits, uint64_t key)
{
    unsigned b = (unsigned)(gs_hash_step(0, key) & (GS_GAP_BITS - 1));
    uint64_t bit = 1ull << (b & 63);
    return (__atomic_load_n(&bits[b >> 6], __ATOMIC_RELAXED) & bit) &&
           (__atomic_fetch_and(&bits[b >> 6], ~bit, __ATOMIC_RELAXED) & bit);
}

static void gap_mark(CUstream stream, int per_thread)
{
    bits_set(g_gap_bits, stream, per_thread);
}

static void gap_block(CUstream stream, int per_thread)
{
    bits_set(g_block_bits, stream, per_thread);
}

/* A busy stream had other work queued since its last launch: an event right before this one
 * ends the gap, so that the kernel's interval starts after it */
static void gap_end_locked(struct tstream *s, const struct measured *m)
{
    if (s->count >= GS_RING) return; /* full: the gap is charged, as before */
    /* a kernel whose end event could not be recorded would fall into the gap (a review's find,
     * with a failing record: `test_throttle.py -k no_gap_after_a_failed_record`) */
    if (s->unended) return;
    CUevent g = take_event(s);
    if (!g || gs_cuda.cuEventRecord(g, m->es) != CUDA_SUCCESS) {
        drop_event(g);
        return;
    }
    int tail = (s->head + s->count) % GS_RING;
    s->ring[tail] = g;
    s->launches[tail] = 0;
    s->rec_ns[tail] = gs_now_ns();
    s->count++;
    s->gaps++;
}

/* Right before the launch (g_mu held, the stream's context current): an idle stream starts a
 * new interval here, so idle time is not counted; if that fails, no interval starts before the
 * next measured event.  A busy one after a copy, host function or wait ends that gap here.
 * Neither while another thread's launch on the stream is between its begin and its end's record:
 * its kernel may be queued already, and an event recorded now would come after it, so the kernel
 * would fall into the gap or before the new interval's start (charged nothing; found reviewing
 * the gaps: two threads on one stream, `test_throttle.py -k racing_on_one_stream`). */
static void begin_locked(struct measured *m)
{
    int blocked = bits_take(g_block_bits, m->key), gap = bits_take(g_gap_bits, m->key) && !blocked;
    struct tstream *s = stream_get_locked(m->key, m->ctx, m->slot);
    if (!s) return;
    int racing = s->launching++;
    m->begun = 1;
    if (racing) return; /* its interval (a start, or the last end) stands; a gap stays charged */
    if (s->count) {
        if (gap) gap_end_locked(s, m);
        return;
    }
    line_reference_locked(m->ctx, m->es, gs_now_ns());
    CUevent start = take_event(s);
    give_event(s, s->mark);
    s->mark = NULL;
    s->mark_ns = 0; /* no interval: nothing to advance against until one starts */
    if (start && gs_cuda.cuEventRecord(start, m->es) == CUDA_SUCCESS) {
        s->mark = start;
        s->mark_ns = gs_now_ns();
    } else {
        drop_event(start);
    }
}

/* The launch is no longer between its begin and its end's record (g_mu held) */
static void launch_done_locked(struct measured *m, struct tstream *s)
{
    if (!m->begun) return;
    m->begun = 0;
    if (!s) s = stream_find_locked(m->key, m->ctx);
    if (s && s->launching) s->launching--; /* 0: the entry was reset meanwhile (its context went) */
}

/* After a launch that failed */
static void launch_failed(struct measured *m)
{
    if (!m->begun) return;
    mu_lock();
    launch_done_locked(m, NULL);
    mu_unlock();
}

/* After a launch that succeeded: the event that ends it (the caller's context current). */
static void record_end(struct measured *m)
{
    if (switch_to(&m->sw, 1) != 0) { /* the stream's context is gone: this launch unmeasured */
        launch_failed(m);
        return;
    }
    mu_lock();
    struct tstream *s = stream_get_locked(m->key, m->ctx, m->slot);
    launch_done_locked(m, s);
    if (s && s->count >= GS_RING) {
        /* the ring is full (the queue wait timed out): the newest event covers this launch too */
        int tail = (s->head + s->count - 1) % GS_RING;
        if (gs_cuda.cuEventRecord(s->ring[tail], m->es) == CUDA_SUCCESS) {
            if (!s->launches[tail]) s->gaps--; /* a gap's end now ends this launch, gap included */
            s->launches[tail]++;
            s->rec_ns[tail] = gs_now_ns();
            GS_DEBUG("event ring full: the newest event now covers %u launches", s->launches[tail]);
        }
    } else if (s) {
        CUevent end = take_event(s);
        if (end && gs_cuda.cuEventRecord(end, m->es) == CUDA_SUCCESS) {
            int tail = (s->head + s->count) % GS_RING;
            s->ring[tail] = end;
            s->launches[tail] = 1;
            s->rec_ns[tail] = gs_now_ns();
            s->count++;
            s->unended = 0;
            line_reference_locked(m->ctx, m->es, s->rec_ns[tail]);
        } else {
            drop_event(end);
            s->unended = 1; /* its kernel is charged to the next interval, which no gap may cut */
        }
    }
    mu_unlock();
    if (switch_to(&m->sw, 0) != 0) GS_ERROR("cuCtxSetCurrent failed: the caller's context could not be restored");
}

static CUresult throttled(CUstream stream, int per_thread, launch_thunk launch, const void *args)
{
    if (gs_t_held) return launch(args); /* a driver callback under a lock of ours (maybe g_mu) */
    struct measured m;
    if (!admit_locked(stream, per_thread, &m)) return launch(args);
    begin_locked(&m);
    mu_unlock();
    switch_to(&m.sw, 0);
    CUresult rc = launch(args);
    if (rc == CUDA_SUCCESS)
        record_end(&m);
    else
        launch_failed(&m);
    return rc;
}

static inline int throttle_on(void)
{
    int st = __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
    if (GS_LIKELY(st == THROTTLE_OFF)) return 0;
    if (st == THROTTLE_UNKNOWN) {
        gs_devices_ready();
        st = __atomic_load_n(&g_state, __ATOMIC_ACQUIRE);
    }
    return st == THROTTLE_ON && gs_region;
}

/* Work whose events can no longer be read (its context went, or the process is exiting) is
 * charged from host time: everything after a stream's interval began (its mark) until now,
 * the union over the context's streams (the events that would have told it went, or there is
 * no time to read them).  That is never less than the work that ran since, and more when the
 * stream sat idle after it: the strict side.  What the intervals paid in advance is settled.
 * ctx NULL: every context's.  No driver call. */
static void charge_unread_locked(CUcontext ctx, uint64_t now)
{
    for (int i = 0; i < GS_STREAMS; i++) {
        struct tstream *s = &g_streams[i];
        if (!s->last_use || !s->count || (ctx && s->ctx != ctx)) continue;
        uint64_t from = 0, adv_cost = 0;
        int slot = s->slot;
        for (int j = i; j < GS_STREAMS; j++) { /* this stream and the context's others */
            struct tstream *o = &g_streams[j];
            if (!o->last_use || !o->count || o->ctx != s->ctx) continue;
            if (o->mark_ns && (!from || o->mark_ns < from)) from = o->mark_ns;
            adv_cost += o->advance_cost;
            o->count = o->gaps = 0; /* charged here, whatever its events say later */
            o->advance_ns = o->advance_cost = 0;
        }
        uint64_t ran = from && now > from ? now - from : 0;
        /* bounded: the work may have ended long before (a synchronous copy, a cuStreamQuery
         * poll, then minutes of host work before the exit), and all of that time would be
         * debt the container's next launches wait for */
        if (ran > GS_UNREAD_MAX_NS) ran = GS_UNREAD_MAX_NS;
        if (ran) account(slot, ran);
        uint64_t cost = ran ? clock_cost(slot, ran) : 0;
        if (cost >= adv_cost)
            clock_add(slot, cost - adv_cost);
        else
            clock_refund(slot, adv_cost - cost);
        GS_DEBUG("charged %llu ns of unread work on device slot %d", (unsigned long long)ran, slot);
    }
}

/* Before a context goes (cuCtxDestroy, a primary reset): the driver waits for its work
 * anyway, so it is waited for here and measured as a hooked synchronisation does; once the
 * context is gone its events cannot be read. */
void gs_launch_settle_ctx(CUcontext ctx)
{
    if (!ctx || __atomic_load_n(&g_state, __ATOMIC_ACQUIRE) != THROTTLE_ON || gs_t_held) return;
    /* waited for without the lock: another thread's launch (on another context, or one this
     * context's work waits for) must not wait behind it.  The context is synchronised, as its
     * destroy does anyway: events of our streams' rings may be recycled by other threads
     * meanwhile, and the program's streams may be gone */
    int busy = 0;
    CUcontext prev = NULL;
    if (!gs_cuda.cuCtxGetCurrent || !gs_cuda.cuCtxSetCurrent || !gs_cuda.cuCtxSynchronize ||
        gs_cuda.cuCtxGetCurrent(&prev) != CUDA_SUCCESS)
        return;
    mu_lock();
    if (!capture_forbids_queries()) /* else charged from host time once it went */
        for (int i = 0; i < GS_STREAMS && !busy; i++)
            busy = g_streams[i].last_use && g_streams[i].count && g_streams[i].ctx == ctx;
    if (busy) __atomic_add_fetch(&g_settling, 1, __ATOMIC_ACQ_REL); /* a global capture waits for it */
    mu_unlock();
    if (!busy) return;
    if (gs_cuda.cuCtxSetCurrent(ctx) == CUDA_SUCCESS) {
        gs_cuda.cuCtxSynchronize();
        gs_cuda.cuCtxSetCurrent(prev);
    }
    __atomic_sub_fetch(&g_settling, 1, __ATOMIC_ACQ_REL);
    mu_lock();
    if (!capture_forbids_queries())
        for (int i = 0; i < GS_STREAMS; i++) {
            struct tstream *s = &g_streams[i];
            if (s->last_use && s->count && s->ctx == ctx) measure_locked(s);
        }
    mu_unlock();
}

/* At exit (the region's destructor, before it returns the process's slot): work still in
 * flight is charged from host time, without driver calls (the driver may be torn down). */
void gs_launch_at_exit(void)
{
    if (__atomic_load_n(&g_state, __ATOMIC_ACQUIRE) != THROTTLE_ON || !gs_region) return;
    if (pthread_mutex_trylock(&g_mu) != 0) return; /* held by a thread stopped by the exit (or this one) */
    charge_unread_locked(NULL, gs_now_ns());
    pthread_mutex_unlock(&g_mu);
}

static void forget_ctx_locked(CUcontext ctx)
{
    charge_unread_locked(ctx, gs_now_ns()); /* what the settle before it went did not measure */
    for (int i = 0; i < GS_STREAMS; i++)
        if (g_streams[i].last_use && g_streams[i].ctx == ctx) reset_stream(&g_streams[i]);
    struct tline *t = line_get_locked(ctx, 0);
    if (t) memset(t, 0, sizeof(*t)); /* its events went with the context */
}

void gs_launch_forget_ctx(CUcontext ctx)
{
    mu_lock();
    forget_ctx_locked(ctx);
    mu_unlock();
}

void gs_launch_after_fork_child(void)
{
    pthread_mutex_init(&g_mu, NULL);
    memset(g_streams, 0, (size_t)g_streams_used * sizeof(g_streams[0]));
    g_streams_used = 0;
    memset(g_lines, 0, sizeof(g_lines));
    memset(g_gap_bits, 0, sizeof(g_gap_bits));
    memset(g_block_bits, 0, sizeof(g_block_bits));
    memset(gs_unmeasured_ns, 0, sizeof(gs_unmeasured_ns));
    memset(gs_unmeasured_prepaid_ns, 0, sizeof(gs_unmeasured_prepaid_ns));
    memset(gs_unmeasured_prepaid_cost, 0, sizeof(gs_unmeasured_prepaid_cost));
    memset(g_launch_est_ns, 0, sizeof(g_launch_est_ns));
    gs_slices_after_fork_child();
}

/* ---- the hooks ------------------------------------------------------------ */

struct kernel_args {
    const void *real;
    CUfunction f;
    unsigned gx, gy, gz, bx, by, bz, shmem;
    CUstream stream;
    void **params, **extra;
};

static CUresult call_kernel(const void *p)
{
    const struct kernel_args *a = p;
    return ((cuLaunchKernel_fn)a->real)(a->f, a->gx, a->gy, a->gz, a->bx, a->by, a->bz, a->shmem, a->stream,
                                        a->params, a->extra);
}

static CUresult call_coop(const void *p)
{
    const struct kernel_args *a = p;
    return ((cuLaunchCooperativeKernel_fn)a->real)(a->f, a->gx, a->gy, a->gz, a->bx, a->by, a->bz, a->shmem,
                                                   a->stream, a->params);
}

struct ex_args {
    const void *real;
    const CUlaunchConfig *config;
    CUfunction f;
    void **params, **extra;
};

static CUresult call_ex(const void *p)
{
    const struct ex_args *a = p;
    return ((cuLaunchKernelEx_fn)a->real)(a->config, a->f, a->params, a->extra);
}

struct graph_args {
    const void *real;
    CUgraphExec exec;
    CUstream stream;
};

static CUresult call_graph(const void *p)
{
    const struct graph_args *a = p;
    return ((cuGraphLaunch_fn)a->real)(a->exec, a->stream);
}

/* A graph with allocation nodes: its memory is reserved right before the driver call and
 * settled right after (graphmem.c), so the reconcile is kept waiting only that long, never
 * while the throttle waits for the budget. */
static CUresult call_graph_mem(const void *p)
{
    const struct graph_args *a = p;
    if (gs_graphmem_passthrough()) return call_graph(p); /* a driver callback under its lock: see graphmem.c */
    struct gs_graph_need need;
    uint64_t reserved[GS_GRAPH_DEVS];
    int mem = gs_graphmem_before(a->exec, &need, reserved);
    if (mem < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = call_graph(p);
    if (mem) gs_graphmem_after(a->exec, &need, reserved, rc == CUDA_SUCCESS);
    return rc;
}

/* Each hook is a fast path and a slow one.  With no compute limit the state is
 * THROTTLE_OFF, which is set only after the real functions are resolved, so
 * the fast path is one atomic load, one pointer load and a tail call: no
 * stack frame, no lock, no region access, no clock.  Everything else (first
 * call, a missing real function, a limit) goes to the out-of-line slow path. */
#define GS_FAST(name, args)                                                                                   \
    do {                                                                                                      \
        name##_fn real_;                                                                                      \
        if (GS_LIKELY(__atomic_load_n(&g_state, __ATOMIC_ACQUIRE) == THROTTLE_OFF) &&                         \
            GS_LIKELY((real_ = gs_cuda.name) != NULL))                                                        \
            return real_ args;                                                                                \
    } while (0)

#define GS_KERNEL_ARGS (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, \
                        kernelParams, extra)
#define GS_KERNEL_HOOK(name, pt, thunk)                                                                       \
    static __attribute__((noinline)) CUresult name##_slow GS_LAUNCH_PARAMS                                    \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        if (!throttle_on()) return gs_cuda.name GS_KERNEL_ARGS;                                               \
        struct kernel_args a = {(const void *)gs_cuda.name, f, gridDimX, gridDimY, gridDimZ, blockDimX,       \
                                blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra};          \
        return throttled(hStream, pt, thunk, &a);                                                             \
    }                                                                                                         \
    GS_EXPORT CUresult name GS_LAUNCH_PARAMS                                                                  \
    {                                                                                                         \
        GS_FAST(name, GS_KERNEL_ARGS);                                                                        \
        return name##_slow GS_KERNEL_ARGS;                                                                    \
    }

GS_KERNEL_HOOK(cuLaunchKernel, 0, call_kernel)
GS_KERNEL_HOOK(cuLaunchKernel_ptsz, 1, call_kernel)

#define GS_COOP_ARGS (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, \
                      kernelParams)
#define GS_COOP_HOOK(name, pt)                                                                                \
    static __attribute__((noinline)) CUresult name##_slow GS_COOP_PARAMS                                      \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        if (!throttle_on()) return gs_cuda.name GS_COOP_ARGS;                                                 \
        struct kernel_args a = {(const void *)gs_cuda.name, f, gridDimX, gridDimY, gridDimZ, blockDimX,       \
                                blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, NULL};           \
        return throttled(hStream, pt, call_coop, &a);                                                         \
    }                                                                                                         \
    GS_EXPORT CUresult name GS_COOP_PARAMS                                                                    \
    {                                                                                                         \
        GS_FAST(name, GS_COOP_ARGS);                                                                          \
        return name##_slow GS_COOP_ARGS;                                                                      \
    }

GS_COOP_HOOK(cuLaunchCooperativeKernel, 0)
GS_COOP_HOOK(cuLaunchCooperativeKernel_ptsz, 1)

/* cuLaunchCooperativeKernelMultiDevice (deprecated, still exported): one kernel per device,
 * each on a stream of its own, queued by one driver call.  Every stream waits for its
 * device's budget first; then the idle ones start their intervals, the call is made, and
 * each stream's end event is recorded.  (Nested throttled() calls, one per stream, let the
 * first stream's interval span the later ones' waits: 17 % per device at 30 %.) */
static __attribute__((noinline)) CUresult multi_slow(CUDA_LAUNCH_PARAMS *list, unsigned n, unsigned flags)
{
    gs_cuda_init();
    cuLaunchCooperativeKernelMultiDevice_fn real = gs_cuda.cuLaunchCooperativeKernelMultiDevice;
    if (!real) return CUDA_ERROR_NOT_SUPPORTED;
    /* one entry per device: a longer list is the driver's to refuse */
    if (gs_t_held || !throttle_on() || !list || n > GPUSLICE_MAX_DEVICES || n > (unsigned)gs_dev_count())
        return real(list, n, flags);
    struct measured m[GPUSLICE_MAX_DEVICES];
    int on[GPUSLICE_MAX_DEVICES];
    for (unsigned i = 0; i < n; i++)
        if ((on[i] = admit_locked(list[i].hStream, 0, &m[i]))) {
            mu_unlock();
            switch_to(&m[i].sw, 0);
        }
    for (unsigned i = 0; i < n; i++)
        if (on[i] && switch_to(&m[i].sw, 1) == 0) {
            mu_lock();
            /* what ran while the later streams waited: else a stream whose work ended meanwhile
             * would not start a new interval, and its next one would span the wait */
            measure_all_locked();
            begin_locked(&m[i]);
            mu_unlock();
            switch_to(&m[i].sw, 0);
        }
    CUresult rc = real(list, n, flags);
    for (unsigned i = 0; i < n; i++)
        if (on[i] && rc == CUDA_SUCCESS)
            record_end(&m[i]);
        else if (on[i])
            launch_failed(&m[i]);
    return rc;
}

GS_EXPORT CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices,
                                                        unsigned int flags)
{
    GS_FAST(cuLaunchCooperativeKernelMultiDevice, (launchParamsList, numDevices, flags));
    return multi_slow(launchParamsList, numDevices, flags);
}

#define GS_EX_HOOK(name, pt)                                                                                  \
    static __attribute__((noinline)) CUresult name##_slow(const CUlaunchConfig *config, CUfunction f,        \
                                                          void **kernelParams, void **extra)                  \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        if (!throttle_on() || !config) return gs_cuda.name(config, f, kernelParams, extra);                   \
        struct ex_args a = {(const void *)gs_cuda.name, config, f, kernelParams, extra};                      \
        return throttled(config->hStream, pt, call_ex, &a);                                                   \
    }                                                                                                         \
    GS_EXPORT CUresult name(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)    \
    {                                                                                                         \
        GS_FAST(name, (config, f, kernelParams, extra));                                                      \
        return name##_slow(config, f, kernelParams, extra);                                                   \
    }

GS_EX_HOOK(cuLaunchKernelEx, 0)
GS_EX_HOOK(cuLaunchKernelEx_ptsz, 1)

/* CUDA 2.x's launches (parameters from cuParamSet*, block shape from cuFuncSetBlockShape),
 * which the driver still exports though cuda.h no longer declares them: on the legacy
 * stream, or on a stream for cuLaunchGridAsync */
enum { GRID_ONE, GRID_SYNC, GRID_ASYNC };

struct grid_args {
    const void *real;
    CUfunction f;
    int w, h, how;
    CUstream stream;
};

static CUresult call_grid(const void *p)
{
    const struct grid_args *a = p;
    switch (a->how) {
    case GRID_ONE: return ((cuLaunch_fn)a->real)(a->f);
    case GRID_SYNC: return ((cuLaunchGrid_fn)a->real)(a->f, a->w, a->h);
    default: return ((cuLaunchGridAsync_fn)a->real)(a->f, a->w, a->h, a->stream);
    }
}

static __attribute__((noinline)) CUresult grid_slow(int how, CUfunction f, int w, int h, CUstream hStream)
{
    gs_cuda_init();
    const void *real = how == GRID_ONE    ? (const void *)gs_cuda.cuLaunch
                       : how == GRID_SYNC ? (const void *)gs_cuda.cuLaunchGrid
                                          : (const void *)gs_cuda.cuLaunchGridAsync;
    if (!real) return CUDA_ERROR_NOT_SUPPORTED;
    struct grid_args a = {real, f, w, h, how, hStream};
    if (!throttle_on()) return call_grid(&a);
    return throttled(hStream, 0, call_grid, &a);
}

GS_EXPORT CUresult cuLaunch(CUfunction f)
{
    GS_FAST(cuLaunch, (f));
    return grid_slow(GRID_ONE, f, 1, 1, NULL);
}

GS_EXPORT CUresult cuLaunchGrid(CUfunction f, int grid_width, int grid_height)
{
    GS_FAST(cuLaunchGrid, (f, grid_width, grid_height));
    return grid_slow(GRID_SYNC, f, grid_width, grid_height, NULL);
}

GS_EXPORT CUresult cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream)
{
    GS_FAST(cuLaunchGridAsync, (f, grid_width, grid_height, hStream));
    return grid_slow(GRID_ASYNC, f, grid_width, grid_height, hStream);
}

/* Graph launches also pay for the graph's allocation nodes (graphmem.c): the
 * fast path holds only while no executable graph has any. */
#define GS_GRAPH_HOOK(name, pt)                                                                               \
    static __attribute__((noinline)) CUresult name##_slow(CUgraphExec hGraphExec, CUstream hStream)           \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        struct graph_args a = {(const void *)gs_cuda.name, hGraphExec, hStream};                              \
        int mem = __atomic_load_n(&gs_graph_mem_execs, __ATOMIC_ACQUIRE) != 0;                                 \
        if (!throttle_on()) return mem ? call_graph_mem(&a) : call_graph(&a);                                 \
        /* refused at once, not after waiting for the compute budget */                                      \
        if (mem && gs_graphmem_check(hGraphExec) != 0) return CUDA_ERROR_OUT_OF_MEMORY;                       \
        return throttled(hStream, pt, mem ? call_graph_mem : call_graph, &a);                                 \
    }                                                                                                         \
    GS_EXPORT CUresult name(CUgraphExec hGraphExec, CUstream hStream)                                         \
    {                                                                                                         \
        if (GS_LIKELY(!__atomic_load_n(&gs_graph_mem_execs, __ATOMIC_RELAXED)))                               \
            GS_FAST(name, (hGraphExec, hStream));                                                             \
        return name##_slow(hGraphExec, hStream);                                                              \
    }

GS_GRAPH_HOOK(cuGraphLaunch, 0)
GS_GRAPH_HOOK(cuGraphLaunch_ptsz, 1)

/* A hook that does `after` (rc: the driver's answer) once the driver's call returns: with no
 * compute limit a tail call. */
#define GS_AFTER_HOOK(name, params, args, after)                                                              \
    static __attribute__((noinline)) CUresult name##_slow params                                            \
    {                                                                                                         \
        gs_cuda_init();                                                                                       \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                                   \
        CUresult rc = gs_cuda.name args;                                                                      \
        after;                                                                                                \
        return rc;                                                                                            \
    }                                                                                                         \
    GS_EXPORT CUresult name params                                                                            \
    {                                                                                                         \
        GS_FAST(name, args);                                                                                  \
        return name##_slow args;                                                                              \
    }

/* Synchronisations: with a compute limit, what completed is measured afterwards
 * (gs_launch_after_sync). */
#define GS_SYNC_HOOK(name, params, args) GS_AFTER_HOOK(name, params, args, if (throttle_on()) gs_launch_after_sync())

GS_SYNC_HOOK(cuCtxSynchronize, (void), ())
/* CUDA 13.0's (what cuGetProcAddress("cuCtxSynchronize", 13000) hands out): the context given,
 * the current one where it is NULL; what completed is measured in every context, as above */
GS_SYNC_HOOK(cuCtxSynchronize_v2, (CUcontext ctx), (ctx))
GS_SYNC_HOOK(cuStreamSynchronize, (CUstream hStream), (hStream))
GS_SYNC_HOOK(cuStreamSynchronize_ptsz, (CUstream hStream), (hStream))
GS_SYNC_HOOK(cuEventSynchronize, (CUevent hEvent), (hEvent))

/* Copies, host functions and waits: with a compute limit the stream is marked, so that its next
 * launch ends the gap they leave between its kernels (gap_mark). */
#define GS_GAP_HOOK(name, params, args, pt)                                                                   \
    GS_AFTER_HOOK(name, params, args, if (rc == CUDA_SUCCESS && throttle_on()) gap_mark(hStream, pt))
/* the shapes: n arguments, then the stream; the stream, then n arguments */
#define GS_GAP_1(name, pt, A) GS_GAP_HOOK(name, (A a, CUstream hStream), (a, hStream), pt)
#define GS_GAP_3(name, pt, A, B, C) GS_GAP_HOOK(name, (A a, B b, C c, CUstream hStream), (a, b, c, hStream), pt)
#define GS_GAP_4(name, pt, A, B, C, D)                                                                        \
    GS_GAP_HOOK(name, (A a, B b, C c, D d, CUstream hStream), (a, b, c, d, hStream), pt)
#define GS_GAP_5(name, pt, A, B, C, D, E)                                                                     \
    GS_GAP_HOOK(name, (A a, B b, C c, D d, E e, CUstream hStream), (a, b, c, d, e, hStream), pt)
#define GS_GAP_7(name, pt, A, B, C, D, E, F, G)                                                               \
    GS_GAP_HOOK(name, (A a, B b, C c, D d, E e, F f, G g, CUstream hStream), (a, b, c, d, e, f, g, hStream), pt)
#define GS_GAP_8(name, pt, A, B, C, D, E, F, G, H)                                                            \
    GS_GAP_HOOK(name, (A a, B b, C c, D d, E e, F f, G g, H h, CUstream hStream), (a, b, c, d, e, f, g, h, hStream), \
                pt)
#define GS_STREAM_GAP_2(name, pt, A, B) GS_GAP_HOOK(name, (CUstream hStream, A a, B b), (hStream, a, b), pt)
#define GS_STREAM_GAP_3(name, pt, A, B, C)                                                                    \
    GS_GAP_HOOK(name, (CUstream hStream, A a, B b, C c), (hStream, a, b, c), pt)

GS_GAP_3(cuMemcpyAsync, 0, CUdeviceptr, CUdeviceptr, size_t)
GS_GAP_3(cuMemcpyAsync_ptsz, 1, CUdeviceptr, CUdeviceptr, size_t)
GS_GAP_5(cuMemcpyPeerAsync, 0, CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t)
GS_GAP_5(cuMemcpyPeerAsync_ptsz, 1, CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t)
GS_GAP_3(cuMemcpyHtoDAsync, 0, unsigned int, const void *, unsigned int) /* CUDA 2.x: 32-bit */
GS_GAP_3(cuMemcpyHtoDAsync_v2, 0, CUdeviceptr, const void *, size_t)
GS_GAP_3(cuMemcpyHtoDAsync_v2_ptsz, 1, CUdeviceptr, const void *, size_t)
GS_GAP_3(cuMemcpyDtoHAsync, 0, void *, unsigned int, unsigned int)
GS_GAP_3(cuMemcpyDtoHAsync_v2, 0, void *, CUdeviceptr, size_t)
GS_GAP_3(cuMemcpyDtoHAsync_v2_ptsz, 1, void *, CUdeviceptr, size_t)
GS_GAP_3(cuMemcpyDtoDAsync, 0, unsigned int, unsigned int, unsigned int)
GS_GAP_3(cuMemcpyDtoDAsync_v2, 0, CUdeviceptr, CUdeviceptr, size_t)
GS_GAP_3(cuMemcpyDtoDAsync_v2_ptsz, 1, CUdeviceptr, CUdeviceptr, size_t)
GS_GAP_4(cuMemcpyHtoAAsync, 0, CUarray, unsigned int, const void *, unsigned int)
GS_GAP_4(cuMemcpyHtoAAsync_v2, 0, CUarray, size_t, const void *, size_t)
GS_GAP_4(cuMemcpyHtoAAsync_v2_ptsz, 1, CUarray, size_t, const void *, size_t)
GS_GAP_4(cuMemcpyAtoHAsync, 0, void *, CUarray, unsigned int, unsigned int)
GS_GAP_4(cuMemcpyAtoHAsync_v2, 0, void *, CUarray, size_t, size_t)
GS_GAP_4(cuMemcpyAtoHAsync_v2_ptsz, 1, void *, CUarray, size_t, size_t)
GS_GAP_1(cuMemcpy2DAsync, 0, const CUDA_MEMCPY2D_v1 *)
GS_GAP_1(cuMemcpy2DAsync_v2, 0, const CUDA_MEMCPY2D *)
GS_GAP_1(cuMemcpy2DAsync_v2_ptsz, 1, const CUDA_MEMCPY2D *)
GS_GAP_1(cuMemcpy3DAsync, 0, const CUDA_MEMCPY3D_v1 *)
GS_GAP_1(cuMemcpy3DAsync_v2, 0, const CUDA_MEMCPY3D *)
GS_GAP_1(cuMemcpy3DAsync_v2_ptsz, 1, const CUDA_MEMCPY3D *)
GS_GAP_1(cuMemcpy3DPeerAsync, 0, const CUDA_MEMCPY3D_PEER *)
GS_GAP_1(cuMemcpy3DPeerAsync_ptsz, 1, const CUDA_MEMCPY3D_PEER *)
GS_GAP_8(cuMemcpyBatchAsync, 0, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *, size_t,
         size_t *)
GS_GAP_8(cuMemcpyBatchAsync_ptsz, 1, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
         size_t, size_t *)
GS_GAP_7(cuMemcpyBatchAsync_v2, 0, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
         size_t)
GS_GAP_7(cuMemcpyBatchAsync_v2_ptsz, 1, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *,
         size_t *, size_t)
GS_GAP_4(cuMemcpy3DBatchAsync, 0, size_t, CUDA_MEMCPY3D_BATCH_OP *, size_t *, unsigned long long)
GS_GAP_4(cuMemcpy3DBatchAsync_ptsz, 1, size_t, CUDA_MEMCPY3D_BATCH_OP *, size_t *, unsigned long long)
GS_GAP_3(cuMemcpy3DBatchAsync_v2, 0, size_t, CUDA_MEMCPY3D_BATCH_OP *, unsigned long long)
GS_GAP_3(cuMemcpy3DBatchAsync_v2_ptsz, 1, size_t, CUDA_MEMCPY3D_BATCH_OP *, unsigned long long)
GS_STREAM_GAP_2(cuLaunchHostFunc, 0, CUhostFn, void *)
GS_STREAM_GAP_2(cuLaunchHostFunc_ptsz, 1, CUhostFn, void *)
GS_STREAM_GAP_3(cuStreamAddCallback, 0, CUstreamCallback, void *, unsigned int)
GS_STREAM_GAP_3(cuStreamAddCallback_ptsz, 1, CUstreamCallback, void *, unsigned int)
GS_STREAM_GAP_2(cuStreamWaitEvent, 0, CUevent, unsigned int)
GS_STREAM_GAP_2(cuStreamWaitEvent_ptsz, 1, CUevent, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue32, 0, CUdeviceptr, cuuint32_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue32_ptsz, 1, CUdeviceptr, cuuint32_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue32_v2, 0, CUdeviceptr, cuuint32_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue32_v2_ptsz, 1, CUdeviceptr, cuuint32_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue64, 0, CUdeviceptr, cuuint64_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue64_ptsz, 1, CUdeviceptr, cuuint64_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue64_v2, 0, CUdeviceptr, cuuint64_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue64_v2_ptsz, 1, CUdeviceptr, cuuint64_t, unsigned int)
GS_STREAM_GAP_3(cuStreamBatchMemOp, 0, unsigned int, CUstreamBatchMemOpParams *, unsigned int)
GS_STREAM_GAP_3(cuStreamBatchMemOp_ptsz, 1, unsigned int, CUstreamBatchMemOpParams *, unsigned int)
GS_STREAM_GAP_3(cuStreamBatchMemOp_v2, 0, unsigned int, CUstreamBatchMemOpParams *, unsigned int)
GS_STREAM_GAP_3(cuStreamBatchMemOp_v2_ptsz, 1, unsigned int, CUstreamBatchMemOpParams *, unsigned int)
/* a prefetch of managed memory is a copy; an external semaphore's wait, a wait */
GS_GAP_3(cuMemPrefetchAsync, 0, CUdeviceptr, size_t, CUdevice)
GS_GAP_3(cuMemPrefetchAsync_ptsz, 1, CUdeviceptr, size_t, CUdevice)
GS_GAP_4(cuMemPrefetchAsync_v2, 0, CUdeviceptr, size_t, CUmemLocation, unsigned int)
GS_GAP_4(cuMemPrefetchAsync_v2_ptsz, 1, CUdeviceptr, size_t, CUmemLocation, unsigned int)
GS_GAP_3(cuWaitExternalSemaphoresAsync, 0, const CUexternalSemaphore *, const CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS *,
         unsigned int)
GS_GAP_3(cuWaitExternalSemaphoresAsync_ptsz, 1, const CUexternalSemaphore *,
         const CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS *, unsigned int)

/* Memsets: with a compute limit the stream is marked so that no gap is ended before its next
 * launch (gap_block): a memset may run as a kernel, and one queued before a marked copy fell
 * into that copy's gap, charged nothing (a review's find; before the gaps it was charged with
 * the next kernel, as again now) */
#define GS_NOGAP_HOOK(name, params, args, pt)                                                                 \
    GS_AFTER_HOOK(name, params, args, if (rc == CUDA_SUCCESS && throttle_on()) gap_block(hStream, pt))
#define GS_MEMSET(name, pt, T) GS_NOGAP_HOOK(name, (CUdeviceptr d, T v, size_t n, CUstream hStream), (d, v, n, hStream), pt)
#define GS_MEMSET_2D(name, pt, T)                                                                             \
    GS_NOGAP_HOOK(name, (CUdeviceptr d, size_t pitch, T v, size_t w, size_t h, CUstream hStream),             \
                  (d, pitch, v, w, h, hStream), pt)
GS_MEMSET(cuMemsetD8Async, 0, unsigned char)
GS_MEMSET(cuMemsetD8Async_ptsz, 1, unsigned char)
GS_MEMSET(cuMemsetD16Async, 0, unsigned short)
GS_MEMSET(cuMemsetD16Async_ptsz, 1, unsigned short)
GS_MEMSET(cuMemsetD32Async, 0, unsigned int)
GS_MEMSET(cuMemsetD32Async_ptsz, 1, unsigned int)
GS_MEMSET_2D(cuMemsetD2D8Async, 0, unsigned char)
GS_MEMSET_2D(cuMemsetD2D8Async_ptsz, 1, unsigned char)
GS_MEMSET_2D(cuMemsetD2D16Async, 0, unsigned short)
GS_MEMSET_2D(cuMemsetD2D16Async_ptsz, 1, unsigned short)
GS_MEMSET_2D(cuMemsetD2D32Async, 0, unsigned int)
GS_MEMSET_2D(cuMemsetD2D32Async_ptsz, 1, unsigned int)

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
