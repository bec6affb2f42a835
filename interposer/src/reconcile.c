/*
 * reconcile.c - charging what a process holds on a device beyond its
 * allocations: modules loaded lazily (at a kernel's first launch), the
 * driver's own buffers.
 *
 * NVML reports each process's real usage by host pid; the host pid is ours
 * when pid namespaces agree, or else the one pid that appeared in the
 * device's process list while our context was created.  Whatever NVML shows
 * beyond the process's charge is charged to the device's latest context:
 *
 *  - synchronously, before any reservation that would bring the container's
 *    usage within GPUSLICE_RECONCILE_MARGIN (default 256 MiB) of the cap or
 *    past it, so the last allocations before the cap always see the real
 *    usage;
 *  - right after a module or library load: synchronously near the cap,
 *    otherwise by waking the sampler;
 *  - by a sampler thread every 500 ms (100 ms while near the cap; the first
 *    reservation near the cap wakes it to notice), which keeps the views and
 *    the agent's figures close to the truth, also for growth that no
 *    allocation follows.
 *
 * The same thread samples power and utilisation for the compute limit's
 * clock compensation (clockcomp.c).
 *
 * The process-list query costs ~20 us on an H200: it never runs on the
 * allocation path far from the cap, and never on the launch path.  A query
 * is used only if no charge of this process changed while NVML was asked (an
 * allocation completing meanwhile would be counted twice) and no operation
 * was between growing the device and settling its charge (gs_unsettled).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gpuslice.h"

#define GS_SAMPLE_NS 500000000ull     /* far from the cap */
#define GS_SAMPLE_NEAR_NS 100000000ull /* within the margin of the cap */
#define GS_SAMPLE_MIN_NS 10000000ull  /* a woken sampler still waits this long after its last query */
#define GS_SAMPLER_STACK (8u << 20)  /* bytes: what glibc gives a thread by default (ulimit -s 8192) */
#define GS_SLACK (2ull << 20)         /* differences below this are noise */
#define GS_ATTEMPTS 3

uint64_t gs_reconcile_margin = GS_DEFAULT_MARGIN;

#define GS_DEV_CTXS 8 /* live contexts remembered per device at first; the list grows */

static unsigned g_host_pid[GS_MAX_CUDA_DEVS];
/* NVML listed our getpid() for a process that was not ours (another pid namespace's): that pid
 * is never taken for ours */
static int g_getpid_foreign;
static CUcontext g_dev_ctx[GS_MAX_CUDA_DEVS]; /* where what is found gets charged: the newest live one */
static CUcontext *g_dev_ctxs[GS_MAX_CUDA_DEVS]; /* the device's live contexts, newest last; under the context lock */
/* how many: under the context lock, stored atomically (the sampler's time-slice correction reads
 * it without the lock, gs_reconcile_dev_contexts) */
static int g_dev_nctx[GS_MAX_CUDA_DEVS], g_dev_cap[GS_MAX_CUDA_DEVS];
/* What the reconcile charged on each device beyond the records, and to which slot; under the
 * context lock (stored atomically: a synchronisation reads it without it,
 * gs_reconcile_remeasure_given_back).  It is not any one context's: when a context goes it is
 * dropped and measured again (the memory may have gone with it, or may belong to a context that
 * lives on). */
static uint64_t g_untracked[GS_MAX_CUDA_DEVS];
_Static_assert(GS_MAX_CUDA_DEVS <= 64, "g_untracked_devs: one bit per device");
static uint64_t g_untracked_devs; /* bit d: g_untracked[d] is not 0 (one load for a synchronisation) */

static void set_untracked(CUdevice dev, uint64_t bytes)
{
    __atomic_store_n(&g_untracked[dev], bytes, __ATOMIC_RELAXED);
    if (bytes)
        __atomic_fetch_or(&g_untracked_devs, 1ull << dev, __ATOMIC_RELAXED);
    else
        __atomic_fetch_and(&g_untracked_devs, ~(1ull << dev), __ATOMIC_RELAXED);
}
static int g_untracked_slot[GS_MAX_CUDA_DEVS];
static int g_rebase[GS_MAX_CUDA_DEVS]; /* a context went and no clean reading came since */
/* a rebase reading found a charge waiting for a synchronisation (gs_pools_held_for_frees): the
 * synchronisation that returns it wakes the sampler for the reading (gs_reconcile_remeasure_given_back) */
static int g_rebase_held[GS_MAX_CUDA_DEVS];
/* What the device's latest reading showed the process holding beyond its charge and left
 * uncharged (at most GS_SLACK: a difference within it is taken for noise); atomic.  Near the cap
 * an allocation below a page, or a code load, must find it in the headroom too (memory.c,
 * module.c): a page taken on top of it is real. */
static uint64_t g_gap[GS_MAX_CUDA_DEVS];
static nvmlProcessInfo_t g_procs[GS_MAX_PIDS]; /* under the context lock */

static pthread_mutex_t g_wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake_cv;
static int g_woken;
static int g_sampler_started;
static int g_sampler_far; /* the sampler sleeps the long interval: nudge it once near the cap */
/* Exit: the sampler must be out of NVML and the driver before their libraries' finalisers run.
 * Those run before our destructor (they were dlopened after the library was preloaded), and a
 * pass can be inside a query for milliseconds; so an atexit handler, which runs before any
 * finaliser, stops the sampler and waits for the pass it is in (g_sampler_busy) to end. */
static int g_sampler_stop, g_sampler_busy, g_atexit_registered; /* stop: the pid of the process exiting */
#define GS_EXIT_WAIT_NS 500000000ull /* at most: a pass stuck on a lock the exiting thread holds */

/* ---- NVML's process list and our host pid --------------------------------- */

/* NVML_VALUE_NOT_AVAILABLE: no per-process figure (e.g. under WDDM) */
#define GS_NO_VALUE 0xffffffffffffffffull

/* A process in the compute list holds a context, and so memory: a figure of 0 is none.  Drivers
 * whose list gives pids in the caller's namespace (os_find_ns_pid) while the memory is looked up
 * by the host pid listed a container's processes with 0 bytes (R560): taken as a figure, a
 * context measured as nothing was charged nothing. */
/* The size of an entry of _v3's list.  Drivers of the R535 and R545 branches (CUDA 12.2, 12.3)
 * fill it with nvmlProcessInfo_v3_t, whose first 24 bytes are nvmlProcessInfo_t and which adds
 * usedGpuCcProtectedMemory; R550 moved that struct to nvmlDeviceGetRunningProcessDetailList and
 * _v3 lists the 24-byte entries again.  Told apart by their exports, as nvitop does: R535
 * brought nvmlDeviceGetConfComputeMemSizeInfo, R550 nvmlDeviceGetRunningProcessDetailList.  Read
 * as 24-byte entries, every one past the first was garbage (a process listed after another
 * tenant never found itself: its growth went uncharged). */
#define GS_PROC_V3_535 32

static size_t proc_entry_size(void)
{
    return gs_nvml.nvmlDeviceGetConfComputeMemSizeInfo && !gs_nvml.nvmlDeviceGetRunningProcessDetailList
               ? GS_PROC_V3_535
               : sizeof(nvmlProcessInfo_t);
}

int gs_list_processes(CUdevice dev, nvmlProcessInfo_t *out, unsigned cap)
{
    nvmlDevice_t h = gs_dev_nvml(dev);
    gs_nvml_init();
    size_t size = proc_entry_size();
    unsigned count = (unsigned)(cap * sizeof(*out) / size); /* what fits in out's bytes */
    if (!h || !gs_nvml.nvmlDeviceGetComputeRunningProcesses_v3 ||
        gs_nvml.nvmlDeviceGetComputeRunningProcesses_v3(h, &count, out) != NVML_SUCCESS)
        return -1;
    if (count > cap * sizeof(*out) / size) count = (unsigned)(cap * sizeof(*out) / size);
    for (unsigned i = 0; size != sizeof(*out) && i < count; i++) {
        nvmlProcessInfo_t e; /* in place, front to back: entry i moves down onto bytes already read */
        memcpy(&e, (const unsigned char *)out + i * size, sizeof(e));
        out[i] = e;
    }
    for (unsigned i = 0; i < count; i++)
        if (!out[i].usedGpuMemory) out[i].usedGpuMemory = GS_NO_VALUE;
    return (int)count;
}

/* Whether NVML lists this process's namespace's pids: every pid it lists is a process this
 * process can see.  One it cannot is another namespace's (the host's: a container's processes
 * are listed by their host pids), and then a listed getpid() may be anyone's: NVML's getpid()
 * taken for ours on that word alone (a context adopted from a driver callback, never measured),
 * a co-tenant's 700 MiB were charged to the container for good (`test_reconcile.py -k
 * adopted_context`).  A process that ended between the listing and the look reads as another
 * namespace's: the pid is then learnt from allocations instead, the safe side. */
static int lists_our_pids(const nvmlProcessInfo_t *procs, int n)
{
    char path[32];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof(path), "/proc/%u", procs[i].pid);
        if (access(path, F_OK) != 0) return 0;
    }
    return 1;
}

static uint64_t used_by(const nvmlProcessInfo_t *procs, int n, unsigned pid)
{
    for (int i = 0; i < n; i++)
        if (procs[i].pid == pid) return procs[i].usedGpuMemory;
    return 0;
}

/* The host pid is the process's, the same on every device: once learnt it holds for all. */
static void learn_pid(unsigned pid)
{
    for (int d = 0; d < GS_MAX_CUDA_DEVS; d++) __atomic_store_n(&g_host_pid[d], pid, __ATOMIC_RELAXED);
    __atomic_store_n(&gs_pid_unknown, 0, __ATOMIC_RELAXED);
}

static void start_sampler(void);

/* ---- learning the host pid from an allocation ------------------------------
 * NVML's pid is getpid() where the driver gives callers the pids of their own namespace (the
 * open kernel modules, os_find_ns_pid; they leave out processes the caller cannot see) or the
 * process runs in the host's.  Else, inside a container's pid namespace, it is the host pid,
 * learnt at the first context when exactly one process appears in NVML's list with it; when
 * several appear at once (processes of the container, or another tenant, starting together)
 * it is learnt from the process's own allocations instead (cuMemAlloc, cuMemCreate, and
 * stream-ordered ones that grow their pool): while gs_pid_unknown, an allocation that takes at
 * least GS_PROBE_MIN bytes reads NVML's list before and after the driver call, and a pid that
 * alone grew by about that much is a candidate; the same candidate from two allocations is
 * ours.  At most GS_PROBE_TRIES allocations pay for the two readings. */
#define GS_PROBE_MIN (2ull << 20)
#define GS_PROBE_PAD (4ull << 20) /* page rounding and the driver's bookkeeping */
#define GS_PROBE_TRIES 32
int gs_pid_unknown;
static pthread_mutex_t g_probe_mu = PTHREAD_MUTEX_INITIALIZER;
static nvmlProcessInfo_t g_probe_before[GS_MAX_PIDS], g_probe_after[GS_MAX_PIDS]; /* under g_probe_mu */
static int g_probe_n, g_probe_tries;
static CUdevice g_probe_dev;
static unsigned g_probe_candidate;
static uint64_t g_probe_seq;

/* nothing else of ours between reservation and record: only this allocation in flight */
static int probe_alone(int unsettled)
{
    return __atomic_load_n(&gs_inflight, __ATOMIC_SEQ_CST) == 1 &&
           __atomic_load_n(&gs_unsettled, __ATOMIC_SEQ_CST) == unsettled;
}

int gs_pid_probe_begin(CUdevice dev, uint64_t bytes, int unsettled)
{
    if ((bytes && bytes < GS_PROBE_MIN) || pthread_mutex_trylock(&g_probe_mu) != 0) return 0;
    if (!__atomic_load_n(&gs_pid_unknown, __ATOMIC_RELAXED) || !probe_alone(unsettled) ||
        (dev < 0 && (!gs_cuda.cuCtxGetDevice || gs_cuda.cuCtxGetDevice(&dev) != CUDA_SUCCESS)) || dev < 0 ||
        dev >= GS_MAX_CUDA_DEVS ||
        (g_probe_n = gs_list_processes(dev, g_probe_before, GS_MAX_PIDS)) < 0) {
        pthread_mutex_unlock(&g_probe_mu);
        return 0;
    }
    g_probe_dev = dev;
    g_probe_seq = gs_charge_seq();
    return 1;
}

void gs_pid_probe_end(int ok, uint64_t bytes, int unsettled)
{
    int alone = probe_alone(unsettled);
    int n = ok && bytes >= GS_PROBE_MIN ? gs_list_processes(g_probe_dev, g_probe_after, GS_MAX_PIDS) : -1;
    unsigned found = 0, matches = 0;
    int learnt = 0;
    if (!alone || !probe_alone(unsettled) || gs_charge_seq() != g_probe_seq)
        matches = 2; /* another op of ours crossed the window */
    for (int i = 0; i < n; i++) {
        uint64_t now = g_probe_after[i].usedGpuMemory, was = 0;
        if (now == GS_NO_VALUE) continue;
        for (int k = 0; k < g_probe_n; k++)
            if (g_probe_before[k].pid == g_probe_after[i].pid) was = g_probe_before[k].usedGpuMemory;
        if (was == GS_NO_VALUE || now < was) continue;
        if (now - was >= bytes && now - was <= bytes + GS_PROBE_PAD && matches < 2) {
            found = g_probe_after[i].pid;
            matches++;
        }
    }
    if (n >= 0) {
        if (matches != 1) {
            found = 0;
        } else if (found == g_probe_candidate) {
            GS_INFO("host pid %u learnt from the process's allocations", found);
            learn_pid(found);
            learnt = 1;
        }
        g_probe_candidate = found;
        if (++g_probe_tries >= GS_PROBE_TRIES && __atomic_load_n(&gs_pid_unknown, __ATOMIC_RELAXED)) {
            __atomic_store_n(&gs_pid_unknown, 0, __ATOMIC_RELAXED);
            GS_INFO("host pid not learnt: growth no hook sees is not charged, time slices not corrected");
        }
    }
    pthread_mutex_unlock(&g_probe_mu);
    if (learnt) start_sampler(); /* what no hook sees is charged from now on */
}

uint64_t gs_ctx_growth(CUdevice dev, const nvmlProcessInfo_t *before, int nbefore, int first, uint64_t *bound,
                       uint64_t *others)
{
    static nvmlProcessInfo_t after[GS_MAX_PIDS]; /* under the context lock */
    *bound = GS_NO_VALUE;
    *others = 0;
    if (dev < 0 || dev >= GS_MAX_CUDA_DEVS || nbefore < 0) return GS_NO_VALUE;
    int n = gs_list_processes(dev, after, GS_MAX_PIDS);
    unsigned pid = __atomic_load_n(&g_host_pid[dev], __ATOMIC_RELAXED), fresh = 0, nfresh = 0;
    uint64_t most = 0;
    int listed = 0; /* getpid() is in the list */
    for (int i = 0; i < n && !pid; i++) {
        int seen = 0;
        for (int k = 0; k < nbefore && !seen; k++) seen = before[k].pid == after[i].pid;
        if (after[i].pid == (unsigned)getpid()) listed = 1;
        if (after[i].pid == (unsigned)getpid() && !__atomic_load_n(&g_getpid_foreign, __ATOMIC_RELAXED)) {
            /* same pid namespace as the driver, if it appeared with our first context (or was
             * listed already, with a later one); else it is another namespace's process whose
             * pid equals ours: taken for ours, a co-tenant's 700 MiB were charged to the
             * container (test_memory.py -k another_namespaces_pid) */
            if (first != seen) {
                pid = after[i].pid;
                break;
            }
            __atomic_store_n(&g_getpid_foreign, 1, __ATOMIC_RELAXED);
        }
        if (!seen) {
            fresh = after[i].pid;
            nfresh++;
            if (after[i].usedGpuMemory > most) most = after[i].usedGpuMemory;
            if (after[i].usedGpuMemory != GS_NO_VALUE) *others += after[i].usedGpuMemory;
        }
    }
    /* the one process that appeared with our first context on the device is ours; with a
     * later one we were in the list already, and those that appeared are others' */
    if (first) *others = 0;
    else nfresh = 0;
    /* processes appeared with our first context and getpid() is not among them: ours is
     * listed under another pid, NVML's are another namespace's, and a getpid() it lists later
     * is another process's (a co-tenant starting later with that host pid was taken for ours
     * by the reconcile while the pid was unknown: its 700 MiB charged to the container;
     * test_memory.py -k pid_equal_to_ours_appearing).  Not where none appeared: the list
     * then says nothing of ours */
    if (first && !pid && !listed && nfresh) __atomic_store_n(&g_getpid_foreign, 1, __ATOMIC_RELAXED);
    if (!pid && nfresh == 1) pid = fresh;
    if (!pid && n >= 0 && __atomic_load_n(&g_probe_tries, __ATOMIC_RELAXED) < GS_PROBE_TRIES)
        __atomic_store_n(&gs_pid_unknown, 1, __ATOMIC_RELAXED); /* learnt from allocations instead */
    if (!pid) {
        /* several processes started with ours: it is one of them, so it holds no more than
         * the largest (unless NVML gives no figures) */
        if (nfresh) *bound = most;
        return GS_NO_VALUE;
    }
    if (!__atomic_load_n(&g_host_pid[dev], __ATOMIC_RELAXED)) learn_pid(pid);
    uint64_t was = used_by(before, nbefore, pid), now = used_by(after, n, pid);
    if (was == GS_NO_VALUE || now == GS_NO_VALUE || now < was) return GS_NO_VALUE;
    return now - was;
}

int gs_getpid_trusted(void)
{
    return !__atomic_load_n(&g_getpid_foreign, __ATOMIC_RELAXED);
}

int gs_host_pid_known(CUdevice dev)
{
    return gs_host_pid(dev) != 0;
}

unsigned gs_host_pid(CUdevice dev)
{
    return dev >= 0 && dev < GS_MAX_CUDA_DEVS ? __atomic_load_n(&g_host_pid[dev], __ATOMIC_RELAXED) : 0;
}

/* ---- the reconcile -------------------------------------------------------- */

/* What the last reading (reconcile_locked) of a device was worth, for a load's judgement
 * (gs_reconcile_load_over); under the context lock.  Dirty: an operation of ours was in
 * flight across it, or allocations kept changing; such a reading can only undercount (an
 * allocation reserved before the driver has taken its memory, a free's memory gone before its
 * charge) */
enum { GS_READ_NONE, GS_READ_DIRTY, GS_READ_CLEAN };
static int g_read;

static void charge_untracked(CUdevice dev, int slot, uint64_t extra)
{
    GS_INFO("charging %llu bytes the process holds beyond its allocations (modules, driver)",
            (unsigned long long)extra);
    if (g_untracked[dev] && g_untracked_slot[dev] != slot) { /* cannot happen: a device keeps its slot */
        gs_budget_release(g_untracked_slot[dev], g_untracked[dev]);
        set_untracked(dev, 0);
    }
    gs_budget_force(slot, extra);
    set_untracked(dev, g_untracked[dev] + extra);
    g_untracked_slot[dev] = slot;
}

static __thread int t_reserving; /* inside gs_reconcile_slot_reserving */

/* One reading of what the process holds on dev beyond its charge.  Adding (rebase 0): the
 * growth is charged.  Rebasing (rebase 1, after a context went or was reset): what
 * was charged beyond the records is set to what NVML shows beyond them now, down as well as
 * up, but down only from a reading no allocation or free crossed; until one comes the device
 * stays marked (growth is still added meanwhile), for the sampler to try again.  Returns the
 * bytes added. */
static uint64_t reconcile_locked(CUdevice dev, int rebase)
{
    g_read = GS_READ_NONE; /* until a reading says more */
    if (dev < 0 || dev >= GS_MAX_CUDA_DEVS) return 0;
    if (!g_dev_ctx[dev]) {
        if (rebase && g_untracked[dev]) /* no context left: what it held went with it */
            gs_budget_release(g_untracked_slot[dev], g_untracked[dev]);
        if (rebase) {
            set_untracked(dev, 0);
            __atomic_store_n(&g_rebase[dev], 0, __ATOMIC_RELAXED);
        }
        return 0;
    }
    int slot = gs_dev_slot(dev);
    if (slot < 0) return 0;
    if (rebase) __atomic_store_n(&g_rebase[dev], 1, __ATOMIC_RELAXED); /* until a clean reading */
    int settle = 0; /* a lowered limit's slack is to be taken (below): the pools settled first */
    for (int attempt = 0; attempt < GS_ATTEMPTS; attempt++) {
        /* pools' charges for memory they gave back at a synchronisation (no hook sees it) go
         * first: else that memory, gone from NVML's figure but still charged to its pool,
         * would be taken off the untracked charge too, and then off the pool's */
        if ((rebase || settle) && !gs_capture_global()) gs_pools_reconcile_all();
        uint64_t seq = gs_charge_seq();
        int unsettled = __atomic_load_n(&gs_unsettled, __ATOMIC_SEQ_CST);
        int inflight = __atomic_load_n(&gs_inflight, __ATOMIC_SEQ_CST);
        uint64_t mine = gs_slot_mine(slot);
        int n = gs_list_processes(dev, g_procs, GS_MAX_PIDS);
        if (n < 0) {
            g_read = GS_READ_NONE;
            return 0;
        }
        unsettled += __atomic_load_n(&gs_unsettled, __ATOMIC_SEQ_CST);
        inflight += __atomic_load_n(&gs_inflight, __ATOMIC_SEQ_CST);
        if (unsettled || gs_charge_seq() != seq) {
            g_read = GS_READ_DIRTY;
            continue;
        }
        g_read = GS_READ_NONE; /* dirty or clean once a figure of ours is found below */
        /* an allocation or free inside the driver is charged before NVML shows it, and a charge
         * held until a synchronisation may stand for memory already gone: such a reading can
         * still show growth (added below) but cannot lower the charge; the device stays marked
         * for a reading after the synchronisation */
        int down = rebase && !inflight;
        if (down && gs_pools_held_for_frees(slot)) {
            down = 0;
            __atomic_store_n(&g_rebase_held[dev], 1, __ATOMIC_RELAXED);
        }
        unsigned pid = g_host_pid[dev];
        for (int i = 0; i < n && !pid && !__atomic_load_n(&g_getpid_foreign, __ATOMIC_RELAXED); i++)
            if (g_procs[i].pid == (unsigned)getpid()) pid = g_procs[i].pid;
        if (pid && !g_host_pid[dev] && !lists_our_pids(g_procs, n)) {
            __atomic_store_n(&g_getpid_foreign, 1, __ATOMIC_RELAXED);
            if (__atomic_load_n(&g_probe_tries, __ATOMIC_RELAXED) < GS_PROBE_TRIES)
                __atomic_store_n(&gs_pid_unknown, 1, __ATOMIC_RELAXED); /* learnt from allocations */
            pid = 0;
        }
        if (!pid) return 0;
        if (!g_host_pid[dev]) {
            learn_pid(pid);
            /* what no hook sees is charged from now on, far from the cap too (a context adopted
             * unmeasured learnt it here: code loaded later went uncharged until the cap was
             * near, 100 MiB charged for 400 held; test_memory.py -k learnt_by_the_reconcile) */
            start_sampler();
        }
        uint64_t held = used_by(g_procs, n, pid);
        if (held == GS_NO_VALUE) {
            /* no figure to measure again with (nor will one come from such a driver): the
             * charges stand, and the device is not marked for ever */
            if (rebase) __atomic_store_n(&g_rebase[dev], 0, __ATOMIC_RELAXED);
            __atomic_store_n(&g_gap[dev], 0, __ATOMIC_RELAXED);
            return 0;
        }
        g_read = inflight ? GS_READ_DIRTY : GS_READ_CLEAN;
        if (down) {
            __atomic_store_n(&g_rebase[dev], 0, __ATOMIC_RELAXED);
            uint64_t was = g_untracked[dev], others = mine > was ? mine - was : 0; /* the records' charges */
            uint64_t want = held > others + GS_SLACK ? held - others : 0;
            __atomic_store_n(&g_gap[dev], held > others + want ? held - others - want : 0, __ATOMIC_RELAXED);
            if (want < was) {
                /* the records may charge more than the driver holds: limits lowered on a driver
                 * that freed the difference are charged for their highest value.  That part
                 * goes first (a raise then reserves again); only the rest was untracked */
                uint64_t drop = was - want;
                drop -= gs_limits_take_slack(slot, drop);
                if (drop) gs_budget_release(g_untracked_slot[dev], drop);
                set_untracked(dev, was - drop);
                return 0;
            }
            if (want > was) charge_untracked(dev, slot, want - was);
            return want - was;
        }
        /* this thread's allocation about to reserve stands for nothing NVML could show yet */
        int others = inflight - (t_reserving && gs_t_inflight == 1 ? 2 : 0);
        if (!rebase && !others && held + GS_SLACK < mine && !gs_capture_global() &&
            !__atomic_load_n(&gs_managed_seen, __ATOMIC_RELAXED) && gs_limits_slack(slot)) {
            /* the records charge more than the process holds, and a limit is charged above its
             * value: lowered on a driver that freed the difference, it stood charged for its
             * highest until the context went (600 MiB for 116 held: test_reconcile.py -k
             * give_the_room_back).  The pools' charges for memory given back at a
             * synchronisation settle first and the device is read again: only what is still
             * over comes off the limits (a raise reserves again), never while a free's charge
             * waits for a synchronisation (-k charge_waits_for_a_sync).  The difference is net
             * of growth no reading has charged yet, so slack beyond it stays charged (the
             * strict side; the next reading sorts it out).  Not once the process has managed
             * memory: its pages not yet touched would be taken for the limits' */
            if (!settle && attempt + 1 < GS_ATTEMPTS) {
                settle = 1;
                continue;
            }
            if (settle && !gs_pools_held_for_frees(slot)) gs_limits_take_slack(slot, mine - held); /* then below: 0 */
        }
        __atomic_store_n(&g_gap[dev], held > mine && held <= mine + GS_SLACK ? held - mine : 0, __ATOMIC_RELAXED);
        if (held <= mine + GS_SLACK) return 0;
        charge_untracked(dev, slot, held - mine);
        return held - mine;
    }
    GS_DEBUG("reconcile of device %d skipped: allocations kept changing", (int)dev);
    return 0;
}

uint64_t gs_reconcile_dev_locked(CUdevice dev)
{
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS && __atomic_load_n(&g_rebase[dev], __ATOMIC_RELAXED))
        return reconcile_locked(dev, 1);
    return reconcile_locked(dev, 0);
}

/* A context of the device went (or was reset): what was charged beyond the records is
 * measured again. */
static void rebase_untracked(CUdevice dev)
{
    gs_graphmem_resettle(dev, g_dev_nctx[dev] > 0); /* the records first: the graph pool's */
    reconcile_locked(dev, 1);
}

/* Near the cap the sampler runs more often; one that sleeps the long interval
 * is woken to notice (it reconciles only when its shorter interval is due). */
static void nudge_sampler(void)
{
    if (!__atomic_load_n(&g_sampler_far, __ATOMIC_RELAXED)) return;
    pthread_mutex_lock(&g_wake_mu);
    if (g_sampler_started) pthread_cond_signal(&g_wake_cv);
    pthread_mutex_unlock(&g_wake_mu);
}

void gs_reconcile_slot_held(int slot)
{
    gs_lmem_watch_set(1); /* near the cap: launches judge their stack growth (lmem.c) */
    int n = gs_dev_count();
    for (CUdevice dev = 0; dev < n && dev < GS_MAX_CUDA_DEVS; dev++)
        if (gs_dev_slot(dev) == slot && __atomic_load_n(&g_dev_ctx[dev], __ATOMIC_ACQUIRE))
            gs_reconcile_dev_locked(dev);
    nudge_sampler();
}

uint64_t gs_reconcile_gap(int slot)
{
    uint64_t gap = 0;
    int n = gs_dev_count();
    for (CUdevice dev = 0; dev < n && dev < GS_MAX_CUDA_DEVS; dev++)
        if (gs_dev_slot(dev) == slot && __atomic_load_n(&g_dev_ctx[dev], __ATOMIC_ACQUIRE))
            gap = gs_add_sat(gap, __atomic_load_n(&g_gap[dev], __ATOMIC_RELAXED));
    return gap;
}

void gs_reconcile_slot_reserving(int slot)
{
    t_reserving = 1;
    gs_reconcile_slot(slot);
    t_reserving = 0;
}

void gs_reconcile_slot(int slot)
{
    gs_lmem_watch_set(1);
    if (gs_ctx_lock() != 0) { /* inside a context call or a callback: the sampler looks soon */
        nudge_sampler();
        return;
    }
    gs_reconcile_slot_held(slot);
    gs_ctx_unlock();
}

/* Devices this process has a context on; 1 if any of them is near its cap. */
static int any_near_cap(void)
{
    for (CUdevice dev = 0; dev < GS_MAX_CUDA_DEVS; dev++)
        if (__atomic_load_n(&g_dev_ctx[dev], __ATOMIC_ACQUIRE) && gs_near_cap(gs_dev_slot(dev), 0)) return 1;
    return 0;
}

/* 0 if skipped: this thread is inside a context call (a driver callback) */
static int reconcile_all(void)
{
    for (CUdevice dev = 0; dev < GS_MAX_CUDA_DEVS && !gs_exiting(); dev++) {
        if (!__atomic_load_n(&g_dev_ctx[dev], __ATOMIC_ACQUIRE)) continue;
        if (gs_ctx_lock() != 0) return 0;
        gs_reconcile_dev_locked(dev);
        gs_ctx_unlock();
    }
    return 1;
}

void gs_reconcile_wake(void)
{
    pthread_mutex_lock(&g_wake_mu);
    g_woken = 1;
    if (g_sampler_started) pthread_cond_signal(&g_wake_cv);
    pthread_mutex_unlock(&g_wake_mu);
}

void gs_reconcile_after_load(void)
{
    if (any_near_cap() && reconcile_all()) return; /* else the sampler looks soon */
    gs_reconcile_wake();
}

/* The most a load's judgement waits for a clean reading: an allocation in the driver is over in
 * microseconds to milliseconds; a free may wait for the device (cuMemFree synchronises), and
 * hides nothing (its memory goes) */
#define GS_JUDGE_NS 100000000ull
#define GS_JUDGE_STEP_NS 1000000ull

int gs_reconcile_near_any(void)
{
    return any_near_cap();
}

uint32_t gs_reconcile_load_over(uint32_t slots)
{
    uint64_t until = 0;
    for (int pass = 0;; pass++) {
        uint32_t over = 0;
        int dirty = 0;
        for (CUdevice dev = 0; dev < GS_MAX_CUDA_DEVS && !gs_exiting(); dev++) {
            if (!__atomic_load_n(&g_dev_ctx[dev], __ATOMIC_ACQUIRE)) continue;
            int slot = gs_dev_slot(dev);
            int judged = slot >= 0 && slot < GPUSLICE_MAX_DEVICES && (slots >> slot & 1);
            if (pass && !judged) continue; /* the first pass is gs_reconcile_after_load's, every device */
            if (gs_ctx_lock() != 0) { /* inside a context call: skipped, the sampler looks soon */
                gs_reconcile_wake();
                return 0;
            }
            gs_reconcile_dev_locked(dev);
            int read = g_read;
            gs_ctx_unlock();
            if (!judged) continue;
            uint64_t cap = gs_slot_limit(slot);
            if (cap && gs_slot_used(slot) > cap)
                over |= 1u << slot; /* past it even as undercounted: the load did not fit */
            else if (read == GS_READ_DIRTY)
                dirty = 1; /* an allocation in flight may hide what the load took */
        }
        if (over || !dirty) return over;
        uint64_t now = gs_now_ns();
        if (!until) {
            until = now + GS_JUDGE_NS;
        } else if (now >= until) {
            GS_INFO("a load near the cap was judged without a clean reading: operations stayed in flight");
            return 0;
        }
        gs_sleep_ns(GS_JUDGE_STEP_NS);
    }
}

void gs_reconcile_after_undo(uint32_t slots)
{
    int again = 0;
    for (CUdevice dev = 0; dev < GS_MAX_CUDA_DEVS && !gs_exiting(); dev++) {
        if (!__atomic_load_n(&g_dev_ctx[dev], __ATOMIC_ACQUIRE)) continue;
        int slot = gs_dev_slot(dev);
        if (slot < 0 || slot >= GPUSLICE_MAX_DEVICES || !(slots >> slot & 1)) continue;
        gs_reconcile_remeasure(dev); /* before the lock: a reading that cannot lower leaves it marked */
        if (gs_ctx_lock() != 0) {
            again = 1;
            break;
        }
        gs_reconcile_dev_locked(dev);
        gs_ctx_unlock();
        if (__atomic_load_n(&g_rebase[dev], __ATOMIC_RELAXED)) again = 1; /* no clean reading yet */
    }
    if (again) gs_reconcile_wake();
}

/* ---- contexts to charge --------------------------------------------------- */

static void start_sampler(void);

static void drop_dev_ctx(int d, CUcontext ctx)
{
    int k = 0;
    for (int i = 0; i < g_dev_nctx[d]; i++)
        if (g_dev_ctxs[d][i] != ctx) g_dev_ctxs[d][k++] = g_dev_ctxs[d][i];
    __atomic_store_n(&g_dev_nctx[d], k, __ATOMIC_RELAXED);
}

int gs_reconcile_dev_contexts(CUdevice dev)
{
    return dev >= 0 && dev < GS_MAX_CUDA_DEVS ? __atomic_load_n(&g_dev_nctx[dev], __ATOMIC_RELAXED) : 0;
}

void gs_reconcile_remeasure(CUdevice dev)
{
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS) __atomic_store_n(&g_rebase[dev], 1, __ATOMIC_RELAXED);
}

/* Pools give memory back at synchronisations, where no hook sees it go; what the reconcile
 * charged as growth no hook saw may have been such memory (a pool the library could not ask for,
 * pool.c's alloc_unknown_pool; memory a destroyed pool held past its charge).  Lowered only by a
 * re-measurement, it stayed charged until a context of the device went (608 MiB charged for
 * nothing, a 900 MiB allocation refused with nothing held under a 1 GiB cap; test_memory.py
 * -k given_back_at_a_synchronisation).  As after an unload: the devices with such a charge are
 * marked, and the sampler (started if need be, woken once) measures them again; no reading here,
 * in the synchronisation's path. */
void gs_reconcile_remeasure_given_back(void)
{
    int wake = 0;
    uint64_t devs = __atomic_load_n(&g_untracked_devs, __ATOMIC_RELAXED);
    for (CUdevice dev = 0; devs; dev++, devs >>= 1) {
        if (!(devs & 1)) continue;
        if (!__atomic_exchange_n(&g_rebase[dev], 1, __ATOMIC_RELAXED)) wake = 1;
        /* marked already, its last reading held off by a charge this synchronisation may have
         * returned: waited for the sampler's next round, 500 ms on (300 MiB of a context's code
         * still charged after the synchronisation, 800 MiB refused with 100 held under 1 GiB;
         * test_reconcile.py -k held_off_by_a_free) */
        if (__atomic_exchange_n(&g_rebase_held[dev], 0, __ATOMIC_RELAXED)) wake = 1;
    }
    if (!wake) return;
    start_sampler(); /* a process that allocates from no pool it can ask for may have none yet */
    gs_reconcile_wake();
}

void gs_reconcile_remeasure_slot(int slot)
{
    int n = gs_dev_count();
    for (CUdevice dev = 0; dev < n && dev < GS_MAX_CUDA_DEVS; dev++)
        if (gs_dev_slot(dev) == slot) gs_reconcile_remeasure(dev);
}

/* Caller holds the context lock (both below). */
void gs_reconcile_track_ctx(CUdevice dev, CUcontext ctx)
{
    if (dev < 0 || dev >= GS_MAX_CUDA_DEVS) return;
    drop_dev_ctx(dev, ctx);
    if (g_dev_nctx[dev] == g_dev_cap[dev]) {
        int cap = g_dev_cap[dev] ? 2 * g_dev_cap[dev] : GS_DEV_CTXS;
        CUcontext *t = realloc(g_dev_ctxs[dev], (size_t)cap * sizeof(*t));
        if (t) {
            g_dev_ctxs[dev] = t;
            g_dev_cap[dev] = cap;
        } else if (g_dev_nctx[dev]) {
            drop_dev_ctx(dev, g_dev_ctxs[dev][0]); /* no memory: the oldest is forgotten */
        } else {
            return;
        }
    }
    g_dev_ctxs[dev][g_dev_nctx[dev]] = ctx;
    __atomic_store_n(&g_dev_nctx[dev], g_dev_nctx[dev] + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&g_dev_ctx[dev], ctx, __ATOMIC_RELEASE);
    if (gs_host_pid_known(dev) || gs_launch_wants_sampler()) start_sampler();
}

/* A context went: reconcile goes on with the newest one left on its device, after measuring
 * again what was charged beyond the records. */
void gs_reconcile_forget_ctx(CUcontext ctx)
{
    for (int d = 0; d < GS_MAX_CUDA_DEVS; d++) {
        int had = g_dev_nctx[d];
        drop_dev_ctx(d, ctx);
        if (g_dev_ctx[d] == ctx)
            __atomic_store_n(&g_dev_ctx[d], g_dev_nctx[d] ? g_dev_ctxs[d][g_dev_nctx[d] - 1] : NULL,
                             __ATOMIC_RELEASE);
        if (g_dev_nctx[d] != had) rebase_untracked(d);
    }
}

void gs_reconcile_ctx_reset(CUdevice dev)
{
    if (dev >= 0 && dev < GS_MAX_CUDA_DEVS) rebase_untracked(dev);
}

/* ---- the sampler ---------------------------------------------------------- */

static int sampler_stopped(void)
{
    int pid = __atomic_load_n(&g_sampler_stop, __ATOMIC_SEQ_CST);
    return pid && pid == (int)getpid();
}

static void *sampler(void *arg)
{
    (void)arg;
    prctl(PR_SET_NAME, "gpuslice", 0, 0, 0); /* top -H, a crash report: whose thread this is */
    gs_crash_thread_start();
    uint64_t last = gs_now_ns();
    for (;;) {
        pthread_mutex_lock(&g_wake_mu);
        for (;;) {
            int near = any_near_cap();
            uint64_t now = gs_now_ns(), due = last + (near ? GS_SAMPLE_NEAR_NS : GS_SAMPLE_NS);
            gs_lmem_watch_tick(near, now); /* launches judge their stack growth while near (lmem.c) */
            if (g_woken && last + GS_SAMPLE_MIN_NS < due) due = last + GS_SAMPLE_MIN_NS;
            __atomic_store_n(&g_sampler_far, !near && !g_woken, __ATOMIC_RELAXED);
            if (now >= due) break;
            struct timespec ts = {.tv_sec = (time_t)(due / 1000000000ull), .tv_nsec = (long)(due % 1000000000ull)};
            pthread_cond_timedwait(&g_wake_cv, &g_wake_mu, &ts);
        }
        g_woken = 0;
        pthread_mutex_unlock(&g_wake_mu);
        /* busy before the stop is read, the exit handler's stop before it reads busy (both
         * sequentially consistent): either this pass sees the stop or the handler sees the pass */
        __atomic_store_n(&g_sampler_busy, 1, __ATOMIC_SEQ_CST);
        if (sampler_stopped() || gs_exiting())
            break; /* NVML may be gone: stop */
        reconcile_all();
        if (sampler_stopped() || gs_exiting())
            break;
        if (!gs_capture_global()) /* a global-mode capture forbids driver queries in every thread */
            gs_pools_reconcile_all(); /* what pools gave back at synchronisations (pool.c) */
        gs_launch_sample();       /* clock compensation of the compute limit (clockcomp.c), if one applies */
        gs_slices_sample();       /* other processes' time slices (slices.c), if a limit applies */
        gs_launch_gang_refresh(); /* the devices whose clocks launches wait for (budget.c) */
        gs_region_sweep();        /* the container's dead processes, one process sweeping (liveness.c) */
        __atomic_store_n(&g_sampler_busy, 0, __ATOMIC_SEQ_CST);
        last = gs_now_ns();
    }
    __atomic_store_n(&g_sampler_busy, 0, __ATOMIC_SEQ_CST);
    return NULL;
}

/* atexit: no new pass, and the one under way finished (bounded), before any library's
 * finaliser.  A child of fork() inherits the handler and, until it starts its own, no sampler.
 * The stop names the exiting process: a vfork() child that calls exit() runs the handler in its
 * parent's memory, and a flag stopped the parent's sampler for good (gs_exiting, region.c). */
static void sampler_stop_at_exit(void)
{
    __atomic_store_n(&g_sampler_stop, (int)getpid(), __ATOMIC_SEQ_CST);
    uint64_t until = gs_now_ns() + GS_EXIT_WAIT_NS;
    while (__atomic_load_n(&g_sampler_busy, __ATOMIC_SEQ_CST) && gs_now_ns() < until) {
        struct timespec ts = {0, 1000000}; /* 1 ms */
        nanosleep(&ts, NULL);
    }
}

void gs_sampler_start(void)
{
    start_sampler();
}

/* Started once a host pid is known, a compute limit needs clock
 * compensation, or a memory pool is charged: the NVML and pool queries stay
 * off the program's threads. */
static void start_sampler(void)
{
    if (__atomic_load_n(&g_sampler_started, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&g_wake_mu);
    if (!g_sampler_started) {
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&g_wake_cv, &ca);
        pthread_condattr_destroy(&ca);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* the thread runs NVML's and the driver's code, which is written for an application
         * thread's stack: NVML's per-process utilisation query alone keeps 55,888 bytes on it,
         * and the static TLS of the process's libraries comes out of the same area.  A 64 KiB
         * stack killed every process under a compute limit on an H200 (580.159.04).  Only the
         * pages touched are ever backed */
        pthread_attr_setstacksize(&attr, GS_SAMPLER_STACK);
        /* what the thread's code reads of the environment, read here: the program's own
         * threads may setenv at any time, and glibc's getenv beside a setenv may read a freed
         * array (the hook sweep, setting FAKE_CUDA_FAIL, crashed in the sampler's first
         * time-slice sample under ASan; `test_threads.py -k sampler_thread_reads`) */
        (void)gs_slices_enabled();
        if (pthread_create(&t, &attr, sampler, NULL) == 0) {
            __atomic_store_n(&g_sampler_started, 1, __ATOMIC_RELEASE);
            if (!g_atexit_registered && atexit(sampler_stop_at_exit) == 0) g_atexit_registered = 1;
        } else
            GS_WARN("cannot start the sampler thread: memory beyond allocations is charged near the cap only, "
                    "and the compute limit is not clock compensated");
        pthread_attr_destroy(&attr);
    }
    pthread_mutex_unlock(&g_wake_mu);
}

void gs_reconcile_after_fork_child(void)
{
    pthread_mutex_init(&g_wake_mu, NULL);
    memset(g_dev_ctx, 0, sizeof(g_dev_ctx));
    memset(g_dev_nctx, 0, sizeof(g_dev_nctx));
    memset(g_untracked, 0, sizeof(g_untracked)); /* the parent's, returned with its slot */
    g_untracked_devs = 0;
    memset(g_gap, 0, sizeof(g_gap));
    memset(g_rebase, 0, sizeof(g_rebase));
    memset(g_rebase_held, 0, sizeof(g_rebase_held));
    memset(g_host_pid, 0, sizeof(g_host_pid));
    g_getpid_foreign = 0; /* the child's pid is another */
    pthread_mutex_init(&g_probe_mu, NULL);
    g_probe_tries = 0;
    g_probe_candidate = 0;
    gs_pid_unknown = 0; /* the child's first context learns it again */
    g_woken = 0;
    g_sampler_far = 0;
    gs_unsettled = 0; /* operations of other threads died with them */
    gs_inflight = (int)gs_t_inflight; /* the forking thread's own go on in the child */
    g_sampler_started = 0; /* threads do not survive fork */
    g_sampler_busy = 0;    /* (g_atexit_registered stays: the handler is inherited) */
    g_sampler_stop = 0;
}
