/*
 * slicesim - src/slices.c (the time-slice correction) driven tick by tick with scripted figures:
 * what each process of the container measured, what NVML says each one's share was, and a
 * fake clock.  No driver, no NVML, no threads: the sampler's arithmetic alone, compiled in.
 *
 *   slicesim SCENARIO   prints "tick N factor F" (F in 1/1000) for each 500 ms tick
 *
 * We are pid 5000 on the host; the container's other processes (the team) sit in region slots
 * 1.. with host pids 6000.. (0 = not published); other tenants are pids 9000...
 */
#define _GNU_SOURCE
#include "slices.c"

#include <stdarg.h>
#include <stdio.h>

struct gpuslice_region *gs_region;
struct gs_nvml_real gs_nvml;
int gs_nvml_resolved = 1;
int gs_log_level = 0;

void gs_nvml_resolve(void)
{
}

const char *gs_getenv(const char *name)
{
    return getenv(name);
}

void gs_log_write(int level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (getenv("SLICESIM_LOG")) {
        fprintf(stderr, "[%d] ", level);
        vfprintf(stderr, fmt, ap);
        fputc('\n', stderr);
    }
    va_end(ap);
}

static uint64_t g_clock = 1000000000ull;

uint64_t gs_now_ns(void)
{
    return g_clock;
}

unsigned gs_host_pid(CUdevice dev)
{
    (void)dev;
    return 5000;
}

int gs_getpid_trusted(void)
{
    return 1;
}

void gs_region_note_host_pid(unsigned pid)
{
    (void)pid;
}

int gs_reconcile_dev_contexts(CUdevice dev)
{
    (void)dev;
    return 1;
}

/* budget.c's side of unmeasured launches: what the sampler charges, summed */
uint64_t gs_unmeasured_ns[GPUSLICE_MAX_DEVICES];
uint64_t gs_unmeasured_prepaid_ns[GPUSLICE_MAX_DEVICES];
uint64_t gs_unmeasured_prepaid_cost[GPUSLICE_MAX_DEVICES]; /* slicesim: cost = GPU time (no limit) */
static uint64_t g_charged_ns, g_charged_since, g_refunded_ns;

void gs_launch_refund_unmeasured(int slot, uint64_t cost)
{
    (void)slot;
    g_refunded_ns += cost;
}

void gs_launch_charge_unmeasured(int slot, uint64_t busy_ns, uint64_t since)
{
    (void)slot;
    g_charged_ns += busy_ns;
    g_charged_since = since;
}

int gs_limited_devices(struct gs_limited_dev *out)
{
    (void)out;
    return 0;
}

/* ---- NVML as scripted ------------------------------------------------------ */

#define MAX_SAMPLES 64
static nvmlProcessUtilizationSample_t g_samples[MAX_SAMPLES];
static unsigned g_nsamples, g_util;
static unsigned long long g_stamp = 1;

static nvmlReturn_t proc_util(nvmlDevice_t d, nvmlProcessUtilizationSample_t *out, unsigned *n,
                              unsigned long long last_seen)
{
    (void)d;
    unsigned k = 0;
    for (unsigned i = 0; i < g_nsamples && k < *n; i++)
        if (g_samples[i].timeStamp > last_seen) out[k++] = g_samples[i];
    *n = k;
    return k ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

static nvmlReturn_t util_rates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    (void)d;
    u->gpu = g_util > 100 ? 100 : g_util;
    u->memory = 0;
    return NVML_SUCCESS;
}

/* ---- the container ---------------------------------------------------------- */

#define TEAM 8
static uint64_t g_team_ns[TEAM];  /* what each member measured in its life */
static unsigned g_team_pid[TEAM]; /* the host pid NVML lists it under */

/* Member i registers in region slot 1 + i with what it measured so far (as the library does),
 * publishing host_pid (0: not known; NVML then lists it under 7000 + i) */
static void join(int i, int32_t pid, unsigned host_pid)
{
    struct gpuslice_proc *p = &gs_region->procs[1 + i];
    p->pid = pid;
    p->start_time = 7;
    p->host_pid = host_pid;
    p->measured_ns[0] = g_team_ns[i];
    p->state = GPUSLICE_PROC_LIVE;
    g_team_pid[i] = host_pid ? host_pid : 7000 + (unsigned)i;
}

static void leave(int i)
{
    memset(&gs_region->procs[1 + i], 0, sizeof(gs_region->procs[1 + i]));
}

static void sample(unsigned pid, int pct)
{
    if (pct < 0 || g_nsamples >= MAX_SAMPLES) return;
    g_samples[g_nsamples++] = (nvmlProcessUtilizationSample_t){pid, g_stamp, (unsigned)pct, 0, 0, 0};
    g_util += (unsigned)pct;
}

/* One 500 ms tick: our measured % and NVML share (-1: no sample); n team members' measured %
 * and shares (a member that left measures nothing); other tenants' shares. */
static unsigned tick(int t, double our_meas, int our_share, int n, const double *meas, const int *share,
                     int nother, const int *other)
{
    g_clock += 500000000ull;
    g_stamp++;
    g_nsamples = g_util = 0;
    gs_slice_measured_ns[0] += (uint64_t)(our_meas * 5e6);
    sample(5000, our_share);
    for (int i = 0; i < n; i++) {
        g_team_ns[i] += (uint64_t)(meas[i] * 5e6);
        struct gpuslice_proc *p = &gs_region->procs[1 + i];
        if (p->state == GPUSLICE_PROC_LIVE) p->measured_ns[0] = g_team_ns[i];
        sample(g_team_pid[i], share[i]);
    }
    for (int i = 0; i < nother; i++) sample(9000 + (unsigned)i, other[i]);
    uint64_t before = g_charged_ns, refunded = g_refunded_ns;
    sample_slot(0, 0, (nvmlDevice_t)1);
    unsigned f = gs_slice_milli[0] ? gs_slice_milli[0] : 1000;
    printf("tick %d factor %u charged_us %llu since_ms_ago %llu refunded_us %llu\n", t, f,
           (unsigned long long)((g_charged_ns - before) / 1000),
           (unsigned long long)(g_charged_ns > before ? (g_clock - g_charged_since) / 1000000 : 0),
           (unsigned long long)((g_refunded_ns - refunded) / 1000));
    return f;
}

int main(int argc, char **argv)
{
    const char *sc = argc > 1 ? argv[1] : "";
    gs_region = calloc(1, sizeof(*gs_region));
    if (!gs_region) return 2;
    gs_region->device_count = 1;
    gs_nvml.nvmlDeviceGetProcessUtilization = proc_util;
    gs_nvml.nvmlDeviceGetUtilizationRates = util_rates;
    double m[TEAM];
    int s[TEAM];
    if (!strcmp(sc, "apart")) {
        /* one teammate, kernels never overlapping: each measures what it runs, 15 % */
        join(0, 100, 6000);
        for (int t = 0; t < 16; t++) {
            m[0] = 15, s[0] = 15;
            tick(t, 15, 15, 1, m, s, 0, NULL);
        }
    } else if (!strcmp(sc, "lag")) {
        /* the same, but the teammate's samples come a tick after the time they cover */
        join(0, 100, 6000);
        for (int t = 0; t < 20; t++) {
            m[0] = t < 4 || (t & 1) == 0 ? 20 : 0;
            s[0] = t < 4 ? 20 : (t & 1) ? 20 : -1;
            tick(t, 15, 15, 1, m, s, 0, NULL);
        }
    } else if (!strcmp(sc, "jitter")) {
        /* NVML's figures for the two move opposite ways, ±5 points, around what ran */
        join(0, 100, 6000);
        for (int t = 0; t < 20; t++) {
            m[0] = 15, s[0] = (t & 1) ? 10 : 20;
            tick(t, 15, (t & 1) ? 20 : 10, 1, m, s, 0, NULL);
        }
    } else if (!strcmp(sc, "crowd")) {
        /* six processes taking turns: each one's intervals hold the others' kernels, so each
         * measures 15 % of the GPU where it ran 5 % (whole percents, 4 to 6) */
        for (int i = 0; i < 5; i++) join(i, 100 + i, 6000 + (unsigned)i);
        for (int t = 0; t < 16; t++) {
            for (int i = 0; i < 5; i++) m[i] = 15, s[i] = 4 + (t + i) % 3;
            tick(t, 15, 4 + t % 3, 5, m, s, 0, NULL);
        }
    } else if (!strcmp(sc, "unknown")) {
        /* as "crowd" with one teammate, whose host pid is not known: NVML lists it under a pid
         * we cannot tell from another tenant's, so it counts uncorrected (real = measured) */
        join(0, 100, 0);
        for (int t = 0; t < 16; t++) {
            m[0] = 15, s[0] = 5;
            tick(t, 15, 5, 1, m, s, 0, NULL);
        }
    } else if (!strcmp(sc, "rejoin")) {
        /* "apart", and at tick 8 the teammate's slot is reclaimed (another process took it for
         * dead) and it registers again in another slot, with the time it measured so far */
        join(0, 100, 6000);
        for (int t = 0; t < 16; t++) {
            if (t == 8) {
                leave(0);
                g_team_ns[1] = g_team_ns[0];
                join(1, 100, 6000);
            }
            double mm[2] = {t < 8 ? 15 : 0, t < 8 ? 0 : 15};
            int ss[2] = {t < 8 ? 15 : -1, t < 8 ? -1 : 15};
            tick(t, 15, 15, 2, mm, ss, 0, NULL);
        }
    } else if (!strncmp(sc, "unmeasured", 10)) {
        /* a capture keeps launches from being measured in ticks 4-9: NVML's share beyond what
         * the events measured is charged (ticks 4-6 nothing measured, 7-9 part of it), and the
         * second after (the samples can lag) too; ticks 0-3 and 10-15 are measured as usual.
         * -cotenant: the events measure twice what runs (another process's slices).
         * -prepaid: the launches paid 300 ms in advance each tick (one tick NVML found 20 %).
         * -queued: the queued work runs on (NVML 40 % beyond the measured) to tick 13 */
        int co = !strcmp(sc, "unmeasured-cotenant"), other[1] = {50};
        int prepaid = !strcmp(sc, "unmeasured-prepaid"), queued = !strcmp(sc, "unmeasured-queued");
        for (int t = 0; t < 16; t++) {
            int blind = t >= 4 && t <= 9;
            if (blind) gs_unmeasured_ns[0] = g_clock + 250000000ull; /* mid-tick */
            if (blind && prepaid) gs_unmeasured_prepaid_ns[0] += 300000000ull, gs_unmeasured_prepaid_cost[0] += 300000000ull;
            if (t == 0 && prepaid) /* paid before the first tick: not the spans' to settle */
                gs_unmeasured_prepaid_ns[0] = gs_unmeasured_prepaid_cost[0] = 5000000000ull;
            double meas = blind ? (t < 7 ? 0 : 20) : 30;
            int share = blind ? (t < 7 ? 100 : 50) : 30;
            if (prepaid && t == 5) share = 20;
            if (queued && t > 9 && t <= 13) share = 70;
            if (co) meas *= 2, share = share > 50 ? 50 : share;
            tick(t, meas, share, 0, NULL, NULL, co, other);
        }
    } else {
        fprintf(stderr, "usage: slicesim apart|lag|jitter|crowd|unknown|rejoin|unmeasured[-cotenant]\n");
        return 2;
    }
    return 0;
}
