/*
 * slices.c - the compute limit beside other processes: their time slices are
 * not ours.
 *
 * Without MPS a GPU runs one process's kernels at a time and switches between
 * processes that have work every time slice.  The throttle (launch.c, streams.c) times
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
 * the real share with the share the events measured since the previous new
 * samples and, while another process also ran, charges its measured time
 * times real / measured (over the last GS_SLICE_WINDOW such ticks).  Both
 * are summed over the container's processes that measured meanwhile (the
 * team): each one publishes its host pid and its measured time in its region
 * slot, so all of them learn one factor, from figures large enough to mean
 * something (six processes sharing 30 % have about 5 % each, in whole
 * percents, and alone mostly fell under the thresholds below).  A team
 * member whose host pid never matched a sample counts as uncorrected (real =
 * measured: its pid may be another namespace's).  Guards, since the figure
 * is a driver's estimate:
 *
 *  - only while another process had a sample of at least GS_SLICE_OTHERS %, or
 *    the team or the process's own contexts on the device are several (they
 *    take turns too, and one's intervals hold the others' kernels): alone on
 *    the GPU, in one context, nothing is corrected (the factor returns to 1 at the
 *    first samples without another process, or after GS_SLICE_SILENCE_NS
 *    without new samples, or of failing queries); a tick without new
 *    samples changes nothing;
 *  - only if the processes' shares add up to no more than the device's
 *    utilisation (+ GS_SLICE_SLACK): time slices are disjoint, so figures
 *    that overlap (MPS, or a driver reporting something else) say nothing
 *    about slices;
 *  - no sample for this process (under MPS every kernel is the server's), or
 *    one above what its events measured (not its pid): nothing is learnt;
 *  - taking turns with n busy processes (the team's and our own other contexts
 *    included), an
 *    interval holds at most n of their slices per slice of ours, and no more
 *    than their time: the real share is at least measured / (1 + n) and
 *    measured / k - theirs with k contexts and team members of ours (NVML's
 *    truncation to whole percents is rounded back), and the factor is at
 *    least GS_SLICE_MIN_MILLI (a bound for garbage, not for crowds);
 *  - a factor applies only once two ticks with GS_SLICE_LEARN % measured
 *    between them are in the window (one short burst is too coarse).
 *
 * GPUSLICE_SM_TIMESLICE_CORRECTION=off charges event time as measured.
 *
 * The same samples pay for launches that a capture kept from being measured
 * (admit.c, budget.c): while there are such launches, and until their queued work has
 * drained, the process's share beyond what its events measured (and what the
 * launches paid in advance) is charged to the clock, correction off or not
 * (charge_unmeasured).
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
/* NVML's samples can lag an unmeasured launch this long, and half a sampler round more: the
 * launch that first waits for the charge stamps the last such launch a few ms after a round, and
 * at 1 s the round whose span begins a second later was inside it by ~7 ms.  Rounds a few ms late
 * (a loaded machine) left it out, and the device's figure for the queue's last 500 ms went
 * uncharged: 42.8 % of the GPU under 30 % (`test_throttle.py -k while_the_sampler_runs_late`,
 * 43.1 % seen at load ~9); at 1.25 s, 35.0 / 34.8 / 34.3 % with the rounds 0 / 5 / 20 ms late */
#define GS_UNMEASURED_TAIL_NS 1250000000ull
#define GS_UNMEASURED_NOISE 2.0  /* points of NVML's share beyond the measured time that are noise */
#define GS_UNMEASURED_MAX_NS 30000000000ull /* a queue drains within this after the last such launch */

unsigned gs_slice_milli[GPUSLICE_MAX_DEVICES];     /* 0 or 1000 = no correction */
uint64_t gs_slice_measured_ns[GPUSLICE_MAX_DEVICES]; /* this process's debits, uncorrected */

static int g_off = -1;

static struct slice_state {
    uint64_t t_ns, measured_ns; /* at the tick that last brought new samples */
    uint64_t seen_ns;           /* when new samples last came */
    unsigned long long last_seen; /* NVML timestamp of the newest sample used */
    double ours[GS_SLICE_WINDOW], meas[GS_SLICE_WINDOW], others[GS_SLICE_WINDOW]; /* % per tick */
    unsigned busy[GS_SLICE_WINDOW];                 /* processes (and contexts) that took turns with ours */
    unsigned mates[GS_SLICE_WINDOW];                /* of them, the container's (and this process's) */
    unsigned next, filled;
    int announced;
    int unmeasured; /* launches went unmeasured: NVML's share beyond the measured time is charged */
    int seen_ours;  /* a sample of this process came: a span without one is a span it did not run */
    uint64_t prepaid_ns, prepaid_cost; /* gs_unmeasured_prepaid_ns, _cost at the last span's end */
} g_st[GPUSLICE_MAX_DEVICES]; /* sampler thread only */

int gs_slices_enabled(void)
{
    int off = __atomic_load_n(&g_off, __ATOMIC_RELAXED);
    if (off < 0) {
        const char *v = gs_getenv("GPUSLICE_SM_TIMESLICE_CORRECTION");
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
 * reading starts afresh (NVML's timestamps are CPU time in microseconds, compared here only with
 * each other: the wall clock's in every published output of this call, so one from before the
 * clock was set back would otherwise hide every newer sample). */
static void silence(int slot, struct slice_state *st)
{
    forget(slot, st);
    st->last_seen = 0;
    st->t_ns = 0;
}

/* The container's other live processes (through the region: each one's host pid and the GPU
 * time it measured on the device).  Sampler thread only. */
struct peer_seen {
    int32_t pid;
    uint64_t start, meas;
    unsigned confirmed; /* the host pid it published had a sample of ours to match */
};
static struct peer_seen *g_seen[GPUSLICE_MAX_DEVICES]; /* per region process slot, calloc'd */
static struct team {
    unsigned n;
    unsigned pid[GPUSLICE_MAX_PROCS]; /* host pid, 0 = not known */
    uint64_t dm[GPUSLICE_MAX_PROCS];  /* measured since the tick that last brought new samples (may be 0) */
    int share[GPUSLICE_MAX_PROCS];    /* its NVML share, -1 = no sample */
    int confirmed[GPUSLICE_MAX_PROCS]; /* its host pid matched a sample before */
    unsigned idx[GPUSLICE_MAX_PROCS]; /* its region slot */
    uint64_t cur[GPUSLICE_MAX_PROCS]; /* its figure now */
} g_team;

/* The figures the next differences start from: the ones just read */
static void commit_team(int slot, const struct team *t)
{
    for (unsigned j = 0; j < t->n; j++) {
        struct peer_seen *seen = &g_seen[slot][t->idx[j]];
        seen->meas = t->cur[j];
        if (t->share[j] >= 0) seen->confirmed = t->pid[j];
    }
}

static void scan_team(int slot, struct team *t)
{
    struct gpuslice_region *r = gs_region;
    t->n = 0;
    if (!g_seen[slot] && !(g_seen[slot] = calloc(GPUSLICE_MAX_PROCS, sizeof(struct peer_seen)))) return;
    int32_t me = (int32_t)getpid();
    for (unsigned i = 0; i < GPUSLICE_MAX_PROCS; i++) {
        struct gpuslice_proc *p = &r->procs[i];
        struct peer_seen *seen = &g_seen[slot][i];
        int32_t pid = __atomic_load_n(&p->pid, __ATOMIC_RELAXED);
        if (__atomic_load_n(&p->state, __ATOMIC_ACQUIRE) != GPUSLICE_PROC_LIVE || pid <= 0 || pid == me) {
            seen->pid = 0;
            continue;
        }
        uint64_t start = __atomic_load_n(&p->start_time, __ATOMIC_RELAXED);
        uint64_t meas = __atomic_load_n(&p->measured_ns[slot], __ATOMIC_RELAXED);
        /* first seen: its figure covers its whole life; lower than before: our figure, written
         * as the slot changed hands (see gs_region_note_measured) */
        if (seen->pid != pid || seen->start != start || meas < seen->meas)
            *seen = (struct peer_seen){pid, start, meas, seen->pid == pid && seen->start == start ? seen->confirmed : 0};
        /* its samples are matched even when its measurement has not moved: a sample may come
         * a tick before or after the time it measures */
        t->pid[t->n] = __atomic_load_n(&p->host_pid, __ATOMIC_RELAXED);
        t->dm[t->n] = meas - seen->meas;
        t->share[t->n] = -1;
        t->confirmed[t->n] = seen->confirmed == t->pid[t->n] && t->pid[t->n];
        t->idx[t->n] = i;
        t->cur[t->n++] = meas;
    }
}

/* What the new samples say: this process's share (%, -1 without a sample), each team member's
 * (t->share), the sum of everyone else's (a process with several samples counts with their
 * average) and how many of them ran; samples not newer than *newest are old news (some drivers
 * return them again).  Returns how many samples were new. */
static unsigned shares(const nvmlProcessUtilizationSample_t *s, unsigned n, unsigned pid, struct team *t,
                       int *ours, unsigned *others, unsigned *busy, unsigned long long *newest)
{
    unsigned fresh = 0;
    unsigned long long seen = *newest;
    *others = *busy = 0;
    *ours = -1;
    for (unsigned i = 0; i < n; i++) {
        if (s[i].timeStamp <= seen || s[i].smUtil > 100) continue;
        fresh++;
        if (s[i].timeStamp > *newest) *newest = s[i].timeStamp;
        int first = 1;
        for (unsigned k = 0; k < i && first; k++) first = !(s[k].pid == s[i].pid && s[k].timeStamp > seen && s[k].smUtil <= 100);
        if (!first) continue;
        unsigned sum = 0, cnt = 0;
        for (unsigned k = i; k < n; k++)
            if (s[k].pid == s[i].pid && s[k].timeStamp > seen && s[k].smUtil <= 100) sum += s[k].smUtil, cnt++;
        if (pid && s[i].pid == pid) {
            *ours = (int)(sum / cnt);
            continue;
        }
        unsigned j = 0;
        while (j < t->n && (!t->pid[j] || t->pid[j] != s[i].pid)) j++;
        if (j < t->n) {
            t->share[j] = (int)(sum / cnt);
            continue;
        }
        *others += sum / cnt;
        if (sum) ++*busy; /* any process that ran can hold slices inside our intervals */
    }
    return fresh;
}

/* The device's utilisation over NVML's last sample period, in % (whole percents rounded back) */
static int device_pct(nvmlDevice_t h, double *pct)
{
    nvmlUtilization_t u = {0, 0};
    if (!h || !gs_nvml.nvmlDeviceGetUtilizationRates || gs_nvml.nvmlDeviceGetUtilizationRates(h, &u) != NVML_SUCCESS ||
        u.gpu > 100)
        return -1;
    *pct = u.gpu >= 100 ? 100.0 : u.gpu + 0.5;
    return 0;
}

/* Launches that a capture kept from being measured (admit.c, budget.c): the process's NVML share of the
 * span, beyond what its events measured (as charged: time-slice factor applied), is charged to
 * the clock.  Their kernels run, and NVML reports them, for as long as they were queued: from
 * such a launch on, until a span after the last one (and its tail: a sample period) shows no
 * more than GS_UNMEASURED_NOISE points beyond the measured time, or no sample of ours at all.
 * Returns whether the span was such a one (it teaches the time-slice correction nothing: its
 * share is not the measured time's).  No figure for this process (NVML without per-process
 * samples, its host pid unknown and not the driver's, MPS): the device's utilisation stands in
 * for its share (device_pct), every process's kernels counted, the strict side beside other
 * tenants; without it only the advance paid for them applied, and a tenant sets that (learn a
 * one-kernel estimate, capture, launch graphs of many kernels: 99.9 % of the GPU under 30 %).
 * `silent`: a span in which NVML gave nothing new at all (silent()): the device's figure stands
 * in whatever samples of ours came before. */
static int charge_unmeasured(int slot, struct slice_state *st, nvmlDevice_t h, uint64_t since, uint64_t dt,
                             uint64_t dm, int ours, int silent)
{
    uint64_t last = __atomic_load_n(&gs_unmeasured_ns[slot], __ATOMIC_RELAXED);
    uint64_t prepaid = __atomic_load_n(&gs_unmeasured_prepaid_ns[slot], __ATOMIC_RELAXED);
    uint64_t prepaid_cost = __atomic_load_n(&gs_unmeasured_prepaid_cost[slot], __ATOMIC_RELAXED);
    uint64_t paid = prepaid - st->prepaid_ns, paid_cost = prepaid_cost - st->prepaid_cost; /* the span's */
    st->prepaid_ns = prepaid;
    st->prepaid_cost = prepaid_cost;
    int fresh = last && last + GS_UNMEASURED_TAIL_NS >= since;
    if (fresh) st->unmeasured = 1;
    if (!st->unmeasured) return 0;
    double excess = 0, pct = ours >= 100 ? 100.0 : ours + 0.5; /* NVML truncates to whole percents */
    /* no figure of ours (ours < 0): the device's figure only where NVML never had one of ours: where it had, a span without one
     * is a span the process did not run (charged other tenants' time, a process beside a busy
     * one paid it until GS_UNMEASURED_MAX_NS after its last such launch: over 60 s for 2 s of
     * launches after a capture, `test_throttle.py -k after_a_capture_beside`) */
    int device = ours < 0 && (silent || !st->seen_ours) && device_pct(h, &pct) == 0;
    if (ours >= 0 || device) {
        unsigned own = __atomic_load_n(&gs_slice_milli[slot], __ATOMIC_RELAXED);
        if (!own || own > 1000) own = 1000;
        excess = pct * (double)dt / 100.0 - (double)dm * own / 1000.0;
        /* paid in advance: charged already; paid for what did not run, given back */
        if (excess > (double)paid)
            gs_launch_charge_unmeasured(slot, (uint64_t)(excess - (double)paid), since);
        else if (paid) /* at what the advance cost: the clock scale may have moved since */
            gs_launch_refund_unmeasured(
                slot, (uint64_t)((double)paid_cost * ((double)paid - (excess > 0 ? excess : 0)) / (double)paid));
        excess -= (double)paid;
    }
    /* drained; or so long after the last such launch that what NVML finds beyond the events is
     * other work they miss (launches from driver callbacks), not a queue */
    /* the device's figure applies only while such launches are recent (and their tail) */
    if (!fresh && (device || excess <= GS_UNMEASURED_NOISE * (double)dt / 100.0 ||
                   last + GS_UNMEASURED_MAX_NS < since))
        st->unmeasured = 0;
    return 1;
}

/* A span ends at this tick: it ran from the last one (returned), dt long, dm measured in it */
static uint64_t span_end(struct slice_state *st, uint64_t now, uint64_t measured, uint64_t *dt, uint64_t *dm)
{
    uint64_t since = st->t_ns;
    *dt = now - since;
    *dm = measured - st->measured_ns;
    st->t_ns = st->seen_ns = now;
    st->measured_ns = measured;
    return since;
}

/* Nothing new for GS_SLICE_SILENCE_NS while unmeasured launches are recent: NVML's per-process
 * query failing, or answering NOT_FOUND for good, gave no figure, and the device's utilisation
 * did not stand in as it does without the call: launches under a capture held open ran at
 * 99.9-100 % of the GPU under 30 % (`test_throttle.py -k one_kernel_advance`, NVML silent or
 * failing).  The silent span is charged the device's figure, whatever samples of ours came before
 * (on a driver that answers, a silence means no process ran, and the device's figure is ~0) */
static void silent(int slot, struct slice_state *st, nvmlDevice_t h, uint64_t now, uint64_t measured)
{
    uint64_t last = __atomic_load_n(&gs_unmeasured_ns[slot], __ATOMIC_RELAXED);
    if (st->t_ns && (st->unmeasured || (last && last + GS_UNMEASURED_TAIL_NS >= st->t_ns))) {
        uint64_t dt, dm, since = span_end(st, now, measured, &dt, &dm);
        if (dt) charge_unmeasured(slot, st, h, since, dt, dm, -1, 1);
    }
    silence(slot, st);
}

static void sample_slot(CUdevice dev, int slot, nvmlDevice_t h)
{
    static nvmlProcessUtilizationSample_t buf[GS_SLICE_SAMPLES]; /* sampler thread only */
    struct slice_state *st = &g_st[slot];
    uint64_t now = gs_now_ns(), measured = __atomic_load_n(&gs_slice_measured_ns[slot], __ATOMIC_RELAXED);
    struct team *team = &g_team;
    scan_team(slot, team);
    if (!st->t_ns) { /* the first tick: where measuring starts */
        st->t_ns = st->seen_ns = now;
        st->measured_ns = measured;
        /* advances paid before are not this span's (their work ran before it) */
        st->prepaid_ns = __atomic_load_n(&gs_unmeasured_prepaid_ns[slot], __ATOMIC_RELAXED);
        st->prepaid_cost = __atomic_load_n(&gs_unmeasured_prepaid_cost[slot], __ATOMIC_RELAXED);
        commit_team(slot, team);
        team->n = 0;
    }
    unsigned pid = gs_host_pid(dev);
    /* not learnt (yet): getpid(), right where NVML gives our namespace's pids; not where the
     * reconcile found NVML listing it for another namespace's process (a co-tenant's sample
     * was taken for ours and the factor learnt from its share: from a 2 % one, 45.7 % of the
     * GPU at a 30 % limit; test_throttle.py -k pid_equal_to_ours) */
    if (!pid && gs_getpid_trusted()) pid = (unsigned)getpid();
    gs_region_note_host_pid(pid); /* 0: not known (a getpid() noted before is no longer trusted) */
    unsigned n = GS_SLICE_SAMPLES;
    nvmlReturn_t rc = gs_nvml.nvmlDeviceGetProcessUtilization
                          ? gs_nvml.nvmlDeviceGetProcessUtilization(h, buf, &n, st->last_seen)
                          : NVML_ERROR_FUNCTION_NOT_FOUND;
    if (rc == NVML_ERROR_NOT_SUPPORTED || rc == NVML_ERROR_FUNCTION_NOT_FOUND) {
        /* no per-process samples ever: each tick is a span, for launches a capture kept from
         * being measured (charged the device's utilisation); nothing to learn a factor from */
        uint64_t dt, dm, since = span_end(st, now, measured, &dt, &dm);
        if (dt) charge_unmeasured(slot, st, h, since, dt, dm, -1, 0);
        return;
    }
    if (rc != NVML_SUCCESS && rc != NVML_ERROR_NOT_FOUND) {
        /* another error: no news, which stands for a while only */
        if (now - st->seen_ns >= GS_SLICE_SILENCE_NS) silent(slot, st, h, now, measured);
        return;
    }
    if (n > GS_SLICE_SAMPLES) n = GS_SLICE_SAMPLES;
    int ours = -1;
    unsigned others = 0, busy = 0;
    unsigned long long newest = st->last_seen;
    if (rc != NVML_SUCCESS || !shares(buf, n, pid, team, &ours, &others, &busy, &newest)) {
        /* nothing new: drivers sample every 1/6 to 1 s.  Only a long silence means nobody ran */
        if (now - st->seen_ns >= GS_SLICE_SILENCE_NS) silent(slot, st, h, now, measured);
        return;
    }
    if (ours >= 0) st->seen_ours = 1;
    /* the new samples cover the time since the last ones: measure over the same span */
    uint64_t dt, dm, since = span_end(st, now, measured, &dt, &dm);
    st->last_seen = newest;
    commit_team(slot, team);
    if (!dt) return;
    if (charge_unmeasured(slot, st, h, since, dt, dm, ours, 0) || !gs_slices_enabled()) return;
    /* the process's own contexts on the device take turns as processes do: with several, an
     * interval of one holds the others' kernels too; so do the container's other processes
     * that measured meanwhile (the team): the correction is learnt for all of them together,
     * from their summed shares and measurements (one process's share of a crowded GPU is a few
     * whole percents, too coarse alone) */
    int ctxs = gs_reconcile_dev_contexts(dev);
    unsigned measuring = 0;
    for (unsigned j = 0; j < team->n; j++) measuring += team->dm[j] > 0;
    unsigned mates = measuring + (ctxs > 1 ? (unsigned)ctxs - 1 : 0);
    unsigned turns = busy + mates;
    if (others < GS_SLICE_OTHERS && !mates) {
        forget(slot, st); /* alone (again), in one context: event time is our time */
        return;
    }
    double measured_pct = (double)dm * 100.0 / (double)dt;
    if (measured_pct > 100) measured_pct = 100;
    /* nothing to learn from; or a share our events cannot have produced (not our pid) */
    if (ours < 0 || ours > measured_pct + GS_SLICE_SLACK) return;
    /* each team member's sample counts as it is, measured or not this tick (a sample and the
     * time it measures may fall in neighbouring ticks: the window's sums pair them), rounded
     * back from whole percents.  A member that measured without a sample: under 1 % if its
     * pid matched samples before (NVML lists a process that ran); else counted uncorrected,
     * real = measured (its pid unknown, or not the host's).  A pid matched by someone else's
     * sample only errs high, which is the strict side (the real share is capped by the
     * measured one over the window) */
    double real = ours + 0.5, team_meas = 0; /* NVML truncates to whole percents */
    unsigned listed = (unsigned)ours;
    for (unsigned j = 0; j < team->n; j++) {
        double mj = (double)team->dm[j] * 100.0 / (double)dt;
        if (mj > 100) mj = 100;
        team_meas += mj;
        int sj = team->share[j];
        if (sj >= 0)
            real += sj + 0.5, listed += (unsigned)sj;
        else if (mj > 0)
            real += team->confirmed[j] ? (mj < 0.5 ? mj : 0.5) : mj;
    }
    if (measured_pct + team_meas < GS_SLICE_MEASURED) return;
    nvmlUtilization_t util = {0, 0};
    if (!gs_nvml.nvmlDeviceGetUtilizationRates || gs_nvml.nvmlDeviceGetUtilizationRates(h, &util) != NVML_SUCCESS ||
        util.gpu > 100 || listed + others > util.gpu + GS_SLICE_SLACK) {
        forget(slot, st); /* the shares are not a split of the device's time */
        return;
    }
    unsigned k = st->next++ % GS_SLICE_WINDOW;
    st->ours[k] = real;
    st->meas[k] = measured_pct + team_meas;
    st->others[k] = others;
    st->busy[k] = turns;
    st->mates[k] = mates;
    if (st->filled < GS_SLICE_WINDOW) st->filled++;
    GS_DEBUG("device slot %d: ours %d%%, others %u%% (%u ran), device %u%%, measured %.1f%%; with %u other "
             "processes of the container: %.1f%% of %.1f%% measured", slot, ours, others, busy, util.gpu,
             measured_pct, measuring, real, measured_pct + team_meas);
    double rs = 0, ms = 0, os = 0;
    unsigned most = 0, most_mates = 0;
    for (unsigned i = 0; i < st->filled; i++) {
        rs += st->ours[i], ms += st->meas[i], os += st->others[i];
        if (st->busy[i] > most) most = st->busy[i];
        if (st->mates[i] > most_mates) most_mates = st->mates[i];
    }
    if (st->filled < 2 || ms < GS_SLICE_LEARN) return; /* one short burst is too coarse to act on */
    /* taking turns with `most` other processes, an interval holds at most that many of their
     * slices per slice of ours, and no more than their time (bounds on the window's sums, so
     * that one tick's noise is not clipped one way only) */
    if (rs < ms / (1 + most)) rs = ms / (1 + most);
    /* their time is all an interval can hold beyond ours; with k contexts (or processes) of
     * our own, each one's intervals can also hold the others' kernels, counted in our share */
    double own = 1 + most_mates;
    if (rs < ms / own - os) rs = ms / own - os;
    if (rs > ms) rs = ms;
    double f = rs * 1000.0 / ms;
    set_factor(slot, st, f < GS_SLICE_MIN_MILLI ? GS_SLICE_MIN_MILLI : f > 1000 ? 1000 : (unsigned)(f + 0.5));
}

/* Sampler thread, every tick while a compute limit applies. */
void gs_slices_sample(void)
{
    if (!gs_region) return;
    if (!gs_slices_enabled()) { /* unmeasured launches are charged all the same */
        uint64_t recent = 0, now = gs_now_ns();
        int draining = 0;
        for (int i = 0; i < GPUSLICE_MAX_DEVICES; i++) {
            uint64_t t = __atomic_load_n(&gs_unmeasured_ns[i], __ATOMIC_RELAXED);
            if (t > recent) recent = t;
            draining |= g_st[i].unmeasured;
        }
        if (!draining && (!recent || recent + GS_UNMEASURED_TAIL_NS + GS_SLICE_SILENCE_NS < now)) {
            memset(g_st, 0, sizeof(g_st)); /* the next ones start afresh */
            return;
        }
    }
    gs_nvml_init();
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
