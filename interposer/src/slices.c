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
 * process that ran in the last sample period, the share of the period its
 * kernels ran) tells the process's real share.  Every sampler tick (500 ms)
 * each process compares it with the share its events measured over the tick
 * and, while another process also ran, charges its measured time times
 * real / measured (averaged over the last GS_SLICE_WINDOW ticks), each
 * process for itself.  Guards, since the figure is a driver's estimate:
 *
 *  - only while another process had a sample of at least GS_SLICE_OTHERS %:
 *    alone on the GPU, nothing is corrected (the factor returns to 1 at the
 *    first tick without another process);
 *  - only if the processes' shares add up to no more than the device's
 *    utilisation (+ GS_SLICE_SLACK): time slices are disjoint, so figures
 *    that overlap (MPS, or a driver reporting something else) say nothing
 *    about slices;
 *  - no sample for this process (under MPS every kernel is the server's):
 *    nothing is learnt;
 *  - the time removed is at most the others' share (only their slices can be
 *    inside our intervals), and the factor is at least GS_SLICE_MIN_MILLI.
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
#define GS_SLICE_MIN_MILLI 250u  /* the factor never goes below 1/4 (four busy processes) */
#define GS_SLICE_SAMPLES 64

unsigned gs_slice_milli[GPUSLICE_MAX_DEVICES];     /* 0 or 1000 = no correction */
uint64_t gs_slice_measured_ns[GPUSLICE_MAX_DEVICES]; /* this process's debits, uncorrected */

static int g_off = -1;

static struct slice_state {
    uint64_t t_ns, measured_ns; /* at the previous tick */
    unsigned long long last_seen; /* NVML timestamp of the newest sample used */
    double real[GS_SLICE_WINDOW], meas[GS_SLICE_WINDOW];
    unsigned next, filled;
    int announced;
} g_st[GPUSLICE_MAX_DEVICES]; /* sampler thread only */

int gs_slices_enabled(void)
{
    if (g_off < 0) {
        const char *v = getenv("GPUSLICE_SM_TIMESLICE_CORRECTION");
        int off = 0;
        if (v && *v && strcmp(v, "nvml") != 0) {
            off = !strcmp(v, "off");
            if (!off) GS_ERROR("ignoring GPUSLICE_SM_TIMESLICE_CORRECTION value '%s' (expected nvml or off)", v);
        }
        __atomic_store_n(&g_off, off, __ATOMIC_RELAXED);
    }
    return !g_off;
}

static void set_factor(int slot, struct slice_state *st, unsigned milli)
{
    unsigned old = __atomic_exchange_n(&gs_slice_milli[slot], milli, __ATOMIC_RELAXED);
    if (milli < 1000 && !st->announced) {
        st->announced = 1;
        GS_INFO("compute limit: other processes run on device slot %d; their time slices are not charged "
                "(charging %u/1000 of the measured GPU time)", slot, milli);
    }
    if ((old ? old : 1000) != milli) GS_DEBUG("device slot %d: time-slice factor %u/1000", slot, milli);
}

static void forget(int slot, struct slice_state *st)
{
    st->next = st->filled = 0;
    set_factor(slot, st, 1000);
}

/* Shares (%) in the samples: this process's (-1 without a sample) and the sum of the
 * others' (a process with several samples counts with their average). */
static void shares(const nvmlProcessUtilizationSample_t *s, unsigned n, unsigned pid, int *ours,
                   unsigned *others, unsigned long long *newest)
{
    unsigned our_sum = 0, our_n = 0;
    *others = 0;
    for (unsigned i = 0; i < n; i++) {
        if (s[i].timeStamp > *newest) *newest = s[i].timeStamp;
        if (s[i].smUtil > 100) continue;
        if (s[i].pid == pid) {
            our_sum += s[i].smUtil;
            our_n++;
            continue;
        }
        int first = 1;
        for (unsigned k = 0; k < i && first; k++) first = s[k].pid != s[i].pid;
        if (!first) continue;
        unsigned sum = 0, cnt = 0;
        for (unsigned k = i; k < n; k++)
            if (s[k].pid == s[i].pid && s[k].smUtil <= 100) sum += s[k].smUtil, cnt++;
        *others += sum / cnt;
    }
    *ours = our_n ? (int)(our_sum / our_n) : -1;
}

static void sample_slot(CUdevice dev, int slot, nvmlDevice_t h)
{
    struct slice_state *st = &g_st[slot];
    uint64_t now = gs_now_ns(), measured = __atomic_load_n(&gs_slice_measured_ns[slot], __ATOMIC_RELAXED);
    uint64_t dt = now - st->t_ns, dm = measured - st->measured_ns;
    int first = !st->t_ns;
    st->t_ns = now;
    st->measured_ns = measured;
    unsigned pid = gs_host_pid(dev);
    if (!pid) pid = (unsigned)getpid(); /* not learnt (yet): right in the driver's pid namespace */
    nvmlProcessUtilizationSample_t s[GS_SLICE_SAMPLES];
    unsigned n = GS_SLICE_SAMPLES;
    unsigned long long newest = st->last_seen;
    nvmlReturn_t rc = gs_nvml.nvmlDeviceGetProcessUtilization(h, s, &n, st->last_seen);
    if (rc == NVML_ERROR_NOT_FOUND) {
        n = 0; /* no process ran since the last samples */
    } else if (rc != NVML_SUCCESS) {
        return; /* keep what was learnt; NOT_SUPPORTED and the like never change it */
    }
    if (n > GS_SLICE_SAMPLES) n = GS_SLICE_SAMPLES;
    int ours;
    unsigned others;
    shares(s, n, pid, &ours, &others, &newest);
    st->last_seen = newest;
    if (first || !dt) return;
    if (others < GS_SLICE_OTHERS) {
        forget(slot, st); /* alone (again): event time is our time */
        return;
    }
    double measured_pct = (double)dm * 100.0 / (double)dt;
    if (ours < 0 || measured_pct < GS_SLICE_MEASURED) return; /* nothing to learn from */
    nvmlUtilization_t util = {0, 0};
    if (!gs_nvml.nvmlDeviceGetUtilizationRates || gs_nvml.nvmlDeviceGetUtilizationRates(h, &util) != NVML_SUCCESS ||
        util.gpu > 100 || (unsigned)ours + others > util.gpu + GS_SLICE_SLACK) {
        forget(slot, st); /* the shares are not a split of the device's time */
        return;
    }
    if (measured_pct > 100) measured_pct = 100;
    double real = ours, floor = measured_pct - others;
    if (real < floor) real = floor; /* only the others' slices can be inside our intervals */
    if (real > measured_pct) real = measured_pct;
    unsigned k = st->next++ % GS_SLICE_WINDOW;
    st->real[k] = real;
    st->meas[k] = measured_pct;
    if (st->filled < GS_SLICE_WINDOW) st->filled++;
    double rs = 0, ms = 0;
    for (unsigned i = 0; i < st->filled; i++) rs += st->real[i], ms += st->meas[i];
    double f = rs * 1000.0 / ms;
    set_factor(slot, st, f < GS_SLICE_MIN_MILLI ? GS_SLICE_MIN_MILLI : f > 1000 ? 1000 : (unsigned)(f + 0.5));
    GS_DEBUG("device slot %d: ours %d%%, others %u%%, device %u%%, measured %.1f%%", slot, ours, others,
             util.gpu, measured_pct);
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
