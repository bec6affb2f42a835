/*
 * slices.c - the compute limit beside other processes: their time slices are
 * not ours.
 *
 * Without MPS a GPU runs one process's kernels at a time and switches between
 * processes that have work every time slice.  The throttle (launch.c) times
 * the process's kernels with events, and an interval between two events is
 * wall time on the GPU: while the process's kernel is switched out for
 * another process's slice, the interval still runs.  So beside a busy
 * process (another container, or another process of this one) the union of
 * intervals counts both processes' time, and the container would get about
 * half its share.
 *
 * NVML's per-process utilisation (nvmlDeviceGetProcessUtilization: for each
 * process that ran in the last sample period, 1/6 to 1 s depending on the
 * GPU, the share of it its kernels ran) tells the process's real share.  At
 * every sampler tick (500 ms) that brings new samples, each process compares
 * its own share with the share its events measured since the previous new
 * samples and, while another process also ran, charges its measured time
 * times real / measured (over the last GS_SLICE_WINDOW such ticks), each
 * process for itself.  Guards, since the figure is a driver's estimate:
 *
 *  - only while another process had a sample of at least GS_SLICE_OTHERS %, or
 *    the process has several contexts on the device (they take turns too, and
 *    one context's intervals hold the others' kernels): alone on the GPU, in
 *    one context, nothing is corrected (the factor returns to 1 at the
 *    first samples without another process, or after GS_SLICE_SILENCE_NS
 *    without new samples, or of failing queries); a tick without new
 *    samples changes nothing;
 *  - only if the processes' shares add up to no more than the device's
 *    utilisation (+ GS_SLICE_SLACK): time slices are disjoint, so figures
 *    that overlap (MPS, or a driver reporting something else) say nothing
 *    about slices;
 *  - no sample for this process (under MPS every kernel is the server's), or
 *    one above what its events measured (not its pid): nothing is learnt;
 *  - taking turns with n busy processes (and our own other contexts), an
 *    interval holds at most n of their slices per slice of ours, and no more
 *    than their time: the real share is at least measured / (1 + n) and
 *    measured / k - theirs with k contexts of ours on the device (NVML's
 *    truncation to whole percents is rounded back), and the factor is at
 *    least GS_SLICE_MIN_MILLI (a bound for garbage, not for crowds);
 *  - a factor applies only once two ticks with GS_SLICE_LEARN % measured
 *    between them are in the window (one short burst is too coarse).
 *
 * GPUSLICE_SM_TIMESLICE_CORRECTION=off charges event time as measured.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpuslice.h"

#define GS_SLICE_WINDOW 4        /* ticks averaged (2 s at the sampler's 500 ms) */
#define GS_SLICE_OTHERS 5u       /* % another process must have run to count as a co-tenant */
#define GS_SLICE_SLACK 10u       /* % the processes' shares may exceed the device's utilisation */
#define GS_SLICE_MEASURED 5u     /* % of the tick our events must have measured to learn anything */
#define GS_SLICE_MIN_MILLI 62u   /* the factor never goes below 1/16 (the 1/(1+n) bound does the work) */
#define GS_SLICE_SAMPLES 1024    /* some drivers always report room for 100 */
#define GS_SLICE_SILENCE_NS 2000000000ull /* no new sample this long: nobody ran */
#define GS_SLICE_LEARN 20.0      /* measured % summed over the window before a factor applies */

unsigned gs_slice_milli[GPUSLICE_MAX_DEVICES];     /* 0 or 1000 = no correction */
uint64_t gs_slice_measured_ns[GPUSLICE_MAX_DEVICES]; /* this process's debits, uncorrected */

static int g_off = -1;

static struct slice_state {
    uint64_t t_ns, measured_ns; /* at the tick that last brought new samples */
    uint64_t seen_ns;           /* when new samples last came */
    unsigned long long last_seen; /* NVML timestamp of the newest sample used */
    double ours[GS_SLICE_WINDOW], meas[GS_SLICE_WINDOW], others[GS_SLICE_WINDOW]; /* % per tick */
    unsigned busy[GS_SLICE_WINDOW];                 /* other processes that ran */
    unsigned next, filled;
    int announced;
} g_st[GPUSLICE_MAX_DEVICES]; /* sampler thread only */

int gs_slices_enabled(void)
{
    int off = __atomic_load_n(&g_off, __ATOMIC_RELAXED);
    if (off < 0) {
        const char *v = getenv("GPUSLICE_SM_TIMESLICE_CORRECTION");
        int bad = v && *v && strcmp(v, "nvml") != 0 && strcmp(v, "off") != 0, unset = -1;
        off = v && !strcmp(v, "off");
        if (__atomic_compare_exchange_n(&g_off, &unset, off, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED) && bad)
            GS_ERROR("ignoring GPUSLICE_SM_TIMESLICE_CORRECTION value '%s' (expected nvml or off)", v);
    }
    return !off;
}

static void set_factor(int slot, struct slice_state *st, unsigned milli)
{
    unsigned old = __atomic_exchange_n(&gs_slice_milli[slot], milli, __ATOMIC_RELAXED);
    if (milli < 1000 && !st->announced) {
        st->announced = 1;
        GS_INFO("compute limit: other processes (or other contexts of this one) run on device slot %d; their "
                "time slices are not charged (charging %u/1000 of the measured GPU time)", slot, milli);
    }
    if ((old ? old : 1000) != milli) GS_DEBUG("device slot %d: time-slice factor %u/1000", slot, milli);
}

static void forget(int slot, struct slice_state *st)
{
    st->next = st->filled = 0;
    set_factor(slot, st, 1000);
}

/* Nothing came for GS_SLICE_SILENCE_NS: nobody ran, or NVML stopped answering.  The next
 * reading starts afresh (NVML's timestamps are wall-clock time: one from before the clock
 * was set back would otherwise hide every newer sample). */
static void silence(int slot, struct slice_state *st)
{
    forget(slot, st);
    st->last_seen = 0;
    st->t_ns = 0;
}

/* What the new samples say: this process's share (%, -1 without a sample), the sum of the
 * others' (a process with several samples counts with their average) and how many of them
 * ran; samples not newer than *newest are old news (some drivers return them again).
 * Returns how many samples were new. */
static unsigned shares(const nvmlProcessUtilizationSample_t *s, unsigned n, unsigned pid, int *ours,
                       unsigned *others, unsigned *busy, unsigned long long *newest)
{
    unsigned our_sum = 0, our_n = 0, fresh = 0;
    unsigned long long seen = *newest;
    *others = *busy = 0;
    for (unsigned i = 0; i < n; i++) {
        if (s[i].timeStamp <= seen || s[i].smUtil > 100) continue;
        fresh++;
        if (s[i].timeStamp > *newest) *newest = s[i].timeStamp;
        if (s[i].pid == pid) {
            our_sum += s[i].smUtil;
            our_n++;
            continue;
        }
        int first = 1;
        for (unsigned k = 0; k < i && first; k++) first = !(s[k].pid == s[i].pid && s[k].timeStamp > seen && s[k].smUtil <= 100);
        if (!first) continue;
        unsigned sum = 0, cnt = 0;
        for (unsigned k = i; k < n; k++)
            if (s[k].pid == s[i].pid && s[k].timeStamp > seen && s[k].smUtil <= 100) sum += s[k].smUtil, cnt++;
        *others += sum / cnt;
        if (sum) ++*busy; /* any process that ran can hold slices inside our intervals */
    }
    *ours = our_n ? (int)(our_sum / our_n) : -1;
    return fresh;
}

static void sample_slot(CUdevice dev, int slot, nvmlDevice_t h)
{
    static nvmlProcessUtilizationSample_t buf[GS_SLICE_SAMPLES]; /* sampler thread only */
    struct slice_state *st = &g_st[slot];
    uint64_t now = gs_now_ns(), measured = __atomic_load_n(&gs_slice_measured_ns[slot], __ATOMIC_RELAXED);
    if (!st->t_ns) { /* the first tick: where measuring starts */
        st->t_ns = st->seen_ns = now;
        st->measured_ns = measured;
    }
    unsigned pid = gs_host_pid(dev);
    if (!pid) pid = (unsigned)getpid(); /* not learnt (yet): right in the driver's pid namespace */
    unsigned n = GS_SLICE_SAMPLES;
    nvmlReturn_t rc = gs_nvml.nvmlDeviceGetProcessUtilization(h, buf, &n, st->last_seen);
    if (rc != NVML_SUCCESS && rc != NVML_ERROR_NOT_FOUND) {
        /* NOT_SUPPORTED and the like: no news, which stands for a while only */
        if (now - st->seen_ns >= GS_SLICE_SILENCE_NS) silence(slot, st);
        return;
    }
    if (n > GS_SLICE_SAMPLES) n = GS_SLICE_SAMPLES;
    int ours = -1;
    unsigned others = 0, busy = 0;
    unsigned long long newest = st->last_seen;
    if (rc != NVML_SUCCESS || !shares(buf, n, pid, &ours, &others, &busy, &newest)) {
        /* nothing new: drivers sample every 1/6 to 1 s.  Only a long silence means nobody ran */
        if (now - st->seen_ns >= GS_SLICE_SILENCE_NS) silence(slot, st);
        return;
    }
    /* the new samples cover the time since the last ones: measure over the same span */
    uint64_t dt = now - st->t_ns, dm = measured - st->measured_ns;
    st->last_seen = newest;
    st->t_ns = st->seen_ns = now;
    st->measured_ns = measured;
    if (!dt) return;
    /* the process's own contexts on the device take turns as processes do: with several, an
     * interval of one holds the others' kernels too */
    int ctxs = gs_reconcile_dev_contexts(dev);
    unsigned turns = busy + (ctxs > 1 ? (unsigned)ctxs - 1 : 0);
    if (others < GS_SLICE_OTHERS && ctxs < 2) {
        forget(slot, st); /* alone (again), in one context: event time is our time */
        return;
    }
    double measured_pct = (double)dm * 100.0 / (double)dt;
    if (measured_pct > 100) measured_pct = 100;
    /* nothing to learn from; or a share our events cannot have produced (not our pid) */
    if (ours < 0 || measured_pct < GS_SLICE_MEASURED || ours > measured_pct + GS_SLICE_SLACK) return;
    nvmlUtilization_t util = {0, 0};
    if (!gs_nvml.nvmlDeviceGetUtilizationRates || gs_nvml.nvmlDeviceGetUtilizationRates(h, &util) != NVML_SUCCESS ||
        util.gpu > 100 || (unsigned)ours + others > util.gpu + GS_SLICE_SLACK) {
        forget(slot, st); /* the shares are not a split of the device's time */
        return;
    }
    unsigned k = st->next++ % GS_SLICE_WINDOW;
    st->ours[k] = ours + 0.5; /* NVML truncates to whole percents */
    st->meas[k] = measured_pct;
    st->others[k] = others;
    st->busy[k] = turns;
    if (st->filled < GS_SLICE_WINDOW) st->filled++;
    GS_DEBUG("device slot %d: ours %d%%, others %u%% (%u ran), device %u%%, measured %.1f%%", slot, ours, others,
             busy, util.gpu, measured_pct);
    double rs = 0, ms = 0, os = 0;
    unsigned most = 0;
    for (unsigned i = 0; i < st->filled; i++) {
        rs += st->ours[i], ms += st->meas[i], os += st->others[i];
        if (st->busy[i] > most) most = st->busy[i];
    }
    if (st->filled < 2 || ms < GS_SLICE_LEARN) return; /* one short burst is too coarse to act on */
    /* taking turns with `most` other processes, an interval holds at most that many of their
     * slices per slice of ours, and no more than their time (bounds on the window's sums, so
     * that one tick's noise is not clipped one way only) */
    if (rs < ms / (1 + most)) rs = ms / (1 + most);
    /* their time is all an interval can hold beyond ours; with k contexts of our own, each
     * context's intervals can also hold the others' kernels, counted in our share */
    double own = ctxs > 1 ? ctxs : 1;
    if (rs < ms / own - os) rs = ms / own - os;
    if (rs > ms) rs = ms;
    double f = rs * 1000.0 / ms;
    set_factor(slot, st, f < GS_SLICE_MIN_MILLI ? GS_SLICE_MIN_MILLI : f > 1000 ? 1000 : (unsigned)(f + 0.5));
}

/* Sampler thread, every tick while a compute limit applies. */
void gs_slices_sample(void)
{
    if (!gs_region || !gs_slices_enabled()) return;
    gs_nvml_init();
    if (!gs_nvml.nvmlDeviceGetProcessUtilization) return;
    struct gs_limited_dev lim[GPUSLICE_MAX_DEVICES];
    int n = gs_limited_devices(lim);
    for (int i = 0; i < n; i++) sample_slot(lim[i].dev, lim[i].slot, lim[i].nvml);
}

void gs_slices_after_fork_child(void)
{
    memset(gs_slice_milli, 0, sizeof(gs_slice_milli));
    memset(gs_slice_measured_ns, 0, sizeof(gs_slice_measured_ns));
    memset(g_st, 0, sizeof(g_st));
}
