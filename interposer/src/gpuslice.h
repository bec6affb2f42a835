/*
 * gpuslice.h - declarations shared by the interposer's source files.
 *
 * Families: log.c (logging), real.c (real functions, dlsym), procaddr.c
 * (cuGetProcAddress), config.c (environment), devices.c (device discovery,
 * the memory views), context.c / primary.c / green.c / footprint.c (contexts:
 * created, primary and green ones, and a new context's footprint; shared among
 * them: ctx_internal.h), reconcile.c (memory held beyond allocations), module.c
 * (module loads), region.c / regionopen.c / liveness.c (the shared region and
 * the budget, opening it, reclaiming dead processes; region_internal.h),
 * allocmap.c (what this process holds), memory.c / vmm.c / arrays.c / pool.c
 * (allocation hooks; the first three share mem_internal.h), graphmem.c (graphs'
 * allocation nodes), launch.c (the compute throttle, with clockcomp.c,
 * budget.c, streams.c, timeline.c, capture.c, admit.c and gaps.c; throttle.h
 * is theirs), nvml.c (NVML views), crash.c (a fatal signal's report, on request).
 */
#ifndef GPUSLICE_INTERNAL_H
#define GPUSLICE_INTERNAL_H

#include <stdint.h>
#include <stddef.h>

#include "cuda_abi.h"
#include "hooks.h"
#include "gpuslice_region.h"

#define GS_EXPORT __attribute__((visibility("default")))
#define GS_LIKELY(x) __builtin_expect(!!(x), 1)
#define GS_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define GS_VERSION "0.1.0"

/* ---- clock (misc) --------------------------------------------------------- */

uint64_t gs_now_ns(void);             /* CLOCK_MONOTONIC */
void gs_sleep_ns(uint64_t ns);

/* ---- log.c ---------------------------------------------------------------- */

enum { GS_LOG_ERROR = 0, GS_LOG_WARN = 1, GS_LOG_INFO = 2, GS_LOG_DEBUG = 3 };
extern int gs_log_level;
void gs_log_init(void);
void gs_log_report_level(void); /* at the first CUDA call: a LIBCUDA_LOG_LEVEL the constructor ignored */
void gs_log_write(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* gs_log_defer(1): lines wait (the region lock is held); 0: they are written (gs_log_flush, if
 * any waited).  Inline: every reservation and release takes and gives the region lock, and the
 * call cost an alloc+free pair 77 instructions (costs.py) */
extern __thread int gs_t_log_defer;
extern __thread char *gs_t_log_pending;
void gs_log_flush(void);
static inline void gs_log_defer(int on)
{
    gs_t_log_defer = on;
    if (!on && GS_UNLIKELY(gs_t_log_pending != NULL)) gs_log_flush();
}
#define GS_LOG(lvl, ...)                                        \
    do {                                                        \
        if ((lvl) <= gs_log_level) gs_log_write((lvl), __VA_ARGS__); \
    } while (0)
#define GS_ERROR(...) GS_LOG(GS_LOG_ERROR, __VA_ARGS__)
#define GS_WARN(...) GS_LOG(GS_LOG_WARN, __VA_ARGS__)
#define GS_INFO(...) GS_LOG(GS_LOG_INFO, __VA_ARGS__)
#define GS_DEBUG(...) GS_LOG(GS_LOG_DEBUG, __VA_ARGS__)

/* ---- crash.c: GPUSLICE_CRASH_REPORT=1, a fatal signal's report ------------- */

void gs_crash_install(void);      /* once libcuda or NVML is resolved; nothing unless asked */
void gs_crash_thread_start(void); /* a thread of the library's: an alternate signal stack */

/* ---- real.c: typed real functions ---------------------------------------- */

#define GS_TYPEDEF_CUDA(name, ret, params, base, ver, pt) typedef ret(*name##_fn) params;
#define GS_TYPEDEF_REAL(name, ret, params) typedef ret(*name##_fn) params;
GS_CUDA_HOOKS(GS_TYPEDEF_CUDA)
GS_CUDA_REALS(GS_TYPEDEF_REAL)
GS_NVML_HOOKS(GS_TYPEDEF_REAL)
GS_NVML_REALS(GS_TYPEDEF_REAL)

#define GS_MEMBER_CUDA(name, ret, params, base, ver, pt) name##_fn name;
#define GS_MEMBER_REAL(name, ret, params) name##_fn name;
struct gs_cuda_real {
    GS_CUDA_HOOKS(GS_MEMBER_CUDA)
    GS_CUDA_REALS(GS_MEMBER_REAL)
};
struct gs_nvml_real {
    GS_NVML_HOOKS(GS_MEMBER_REAL)
    GS_NVML_REALS(GS_MEMBER_REAL)
};

extern struct gs_cuda_real gs_cuda;
extern struct gs_nvml_real gs_nvml;
extern int gs_cuda_resolved; /* atomic: 1 once resolution ran */
extern int gs_nvml_resolved;
void gs_cuda_resolve(void);
void gs_nvml_resolve(void);

/* Resolve the real libcuda once; cheap after the first call. */
static inline void gs_cuda_init(void)
{
    if (GS_UNLIKELY(!__atomic_load_n(&gs_cuda_resolved, __ATOMIC_ACQUIRE))) gs_cuda_resolve();
}
static inline void gs_nvml_init(void)
{
    if (GS_UNLIKELY(!__atomic_load_n(&gs_nvml_resolved, __ATOMIC_ACQUIRE))) gs_nvml_resolve();
}

/* The real dlsym (never ours). */
void *gs_real_dlsym(void *handle, const char *name);

/* Hook table lookups (real.c). */
struct gs_hook {
    const char *name;
    const char *base;
    int min_version;
    int per_thread;
    void *hook;
    void **real;
};
extern const struct gs_hook gs_cuda_hooks[];
extern const size_t gs_cuda_hook_count;
void *gs_hook_by_name(const char *name);
void *gs_cuda_hook_for_real(const char *symbol, void *real, int cuda_version, cuuint64_t flags);

/* ---- config.c ------------------------------------------------------------- */

int gs_parse_size(const char *text, uint64_t *out);
const char *gs_getenv(const char *name); /* the environment; nothing in a set-user-ID program (AT_SECURE) */
int gs_env_managed(void);            /* the limits file or GPUSLICE_POD_UID: the webhook set the limits */
int gs_limits_from_file(void);       /* the read-only limits file decides (config.c) */
uint64_t gs_env_reconcile_margin(void);
uint64_t gs_env_memory_limit(unsigned container_index, uint64_t total);
unsigned gs_env_sm_limit(unsigned container_index);
int gs_env_sm_time_mode(void);       /* GPUSLICE_SM_LIMIT_MODE=time: no clock compensation */
int gs_env_sm_gang(void);            /* GPUSLICE_SM_LIMIT_GANG: 0 = each device paced alone */
const char *gs_env_region_path(char *buf, size_t len);
void gs_copy_env(char *dst, size_t len, const char *name);

/* ---- devices.c ------------------------------------------------------------ */

/* One device of the container, as configured by this process's environment. */
struct gs_devcfg {
    char uuid[GPUSLICE_UUID_LEN];
    unsigned index;      /* container index (NVML order) */
    uint64_t total;      /* real total bytes */
    uint64_t limit;      /* 0 = none */
    unsigned sm_limit;   /* 0 = none */
};

void gs_devices_ready(void);         /* discovery + region, once (CUDA processes) */
int gs_devices_discovering(void);    /* this thread is inside the discovery (a driver callback there) */
int gs_devices_known(void);          /* the discovery is done */
void gs_context_after_discovery(void); /* takes over primary contexts retained during it */
void gs_devices_view_ready(void);    /* region devices for NVML-only processes (no registration) */
int gs_dev_slot(CUdevice dev);       /* region slot of a CUDA ordinal, -1 if unknown */
/* The device whose memory a CUmemLocation names (a device's, CUDA 13.4's locality domain of
 * one); -1 for host memory, none, or a device this process does not see; GS_LOCATION_UNKNOWN for
 * a type newer than the library, which callers count as device memory (the strict side) */
#define GS_LOCATION_UNKNOWN (-2)
CUdevice gs_location_device(const CUmemLocation *loc);
int gs_current_slot(CUcontext *ctx); /* slot of the current context's device, -1 if none */
/* The same with the current context as the driver has it (a green context's own CUcontext): for
 * the throttle, whose events belong to the context they are made in. */
int gs_current_slot_raw(CUcontext *ctx);
/* The context a stream of the program's belongs to; NULL for the special handles (NULL, legacy,
 * per-thread: the current context's) or if the driver cannot say. */
CUcontext gs_stream_ctx(CUstream es);
/* The context and device whose work a stream carries (the current ones for the special
 * handles); 0, or -1 if unknown. */
int gs_stream_device(CUstream es, CUcontext *ctx, CUdevice *dev);
void gs_uuid_format(const CUuuid *uuid, char *out, size_t len);
int gs_nvml_slot(nvmlDevice_t device); /* region slot of an NVML handle, -1 if unknown */
nvmlDevice_t gs_dev_nvml(CUdevice dev);  /* NVML handle of a CUDA ordinal, NULL if unknown */
int gs_dev_count(void);
#define GS_MAX_CUDA_DEVS 64

/* ---- context.c / primary.c / green.c ------------------------------------- */

/* green.c: a green context's CUcontext (cuCtxFromGreenCtx) stands for its device's primary
 * context, whose memory it shares: records and measurements key it by the primary; other
 * contexts unchanged. */
CUcontext gs_ctx_canonical(CUcontext ctx);

/* Context records and what reconcile.c charges to them: 0 = taken; -1 = not taken, this thread
 * is inside a context call already (the driver called back: that call measures the process) */
int gs_ctx_lock(void);
/* Always taken (recursively): returns how many times this thread holds it now; released with
 * gs_ctx_unlock */
unsigned gs_ctx_enter(void);
int gs_ctx_mine(void); /* 1 while this thread holds the context lock */
/* Locks of the library other than the context lock that this thread holds, some across driver
 * calls (the throttle's, the pools', the graph memory's; a limit change's is taken after the
 * context lock, so a callback there re-enters the context lock it holds).  A hook reached from
 * a driver callback meanwhile never waits for the context lock (the context hooks pass straight
 * through, the near-cap reconcile is skipped: gs_ctx_lock returns -1) nor for the throttle's
 * (launches and synchronisations pass through unmeasured): the order is the context lock first */
extern __thread unsigned gs_t_held;
static inline void gs_held_lock(pthread_mutex_t *m)
{
    pthread_mutex_lock(m);
    gs_t_held++;
}
extern int gs_ctx_pending;  /* context calls from driver callbacks wait to be booked */
void gs_context_drain(void); /* books them (takes the context lock) */
static inline void gs_held_unlock(pthread_mutex_t *m)
{
    pthread_mutex_unlock(m);
    if (!--gs_t_held && GS_UNLIKELY(__atomic_load_n(&gs_ctx_pending, __ATOMIC_ACQUIRE))) gs_context_drain();
}

/* A file's lock held across driver calls (pools, graph memory): static g_mu, mu_lock() and
 * mu_unlock(), and t_mine, nonzero while this thread holds it, for a driver callback reached
 * inside (which must not wait for it). */
#define GS_OWNED_LOCK()                                                                       \
    static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;                                  \
    static __thread int t_mine;                                                               \
    static void mu_lock(void)                                                                 \
    {                                                                                         \
        gs_held_lock(&g_mu);                                                                  \
        t_mine++;                                                                             \
    }                                                                                         \
    static void mu_unlock(void)                                                               \
    {                                                                                         \
        t_mine--;                                                                             \
        gs_held_unlock(&g_mu);                                                                \
    }
void gs_ctx_unlock(void);
/* Around an array creation's reservation, driver call and booking (primary.c's g_array_rw):
 * enter (1 if entered, 0 from a driver callback), call and called around the driver's call,
 * leave (booked) */
int gs_array_fence_enter(void);
void gs_array_fence_call(void);
void gs_array_fence_called(void);
void gs_array_fence_leave(void);
void gs_context_after_fork_child(void);

/* ---- reconcile.c ---------------------------------------------------------- */

#define GS_MAX_PIDS 256
#define GS_DEFAULT_MARGIN (256ull << 20)
/* The cap where the limits file gives none: one byte, so no context or allocation fits. */
#define GS_CAP_NOTHING 1ull
extern uint64_t gs_reconcile_margin;  /* GPUSLICE_RECONCILE_MARGIN; 0 = reconcile in the background only */
int gs_list_processes(CUdevice dev, nvmlProcessInfo_t *out, unsigned cap); /* -1 if NVML cannot say */
/* After a context was created: learns the process's host pid (ours, or, for the process's
 * first context on dev, the one pid new in NVML's list since `before`) and returns how much
 * the process's own usage grew, or UINT64_MAX when NVML cannot say; then *bound is, when
 * known, what the process holds at most (the largest of the processes new in the list), else
 * UINT64_MAX, and *others what processes new in the list hold that cannot be ours (a later
 * context's: the process was in the list before).  Caller holds gs_ctx_lock. */
uint64_t gs_ctx_growth(CUdevice dev, const nvmlProcessInfo_t *before, int nbefore, int first, uint64_t *bound,
                       uint64_t *others);
int gs_host_pid_known(CUdevice dev);
extern int gs_pid_unknown; /* atomic: allocations may teach the host pid (reconcile.c) */
/* Around an allocation of `bytes` on dev (-1: the current context's) while gs_pid_unknown:
 * begin returns 1 if it read NVML's list (then end must follow, with whether the allocation
 * succeeded and the bytes it took).  bytes 0 at begin: not known until the call returns (a
 * pool's growth); end with ok 0 then counts nothing.  `unsettled` is how many gs_unsettled
 * marks are the caller's own. */
int gs_pid_probe_begin(CUdevice dev, uint64_t bytes, int unsettled);
void gs_pid_probe_end(int ok, uint64_t bytes, int unsettled);
unsigned gs_host_pid(CUdevice dev); /* the process's pid in NVML's lists, 0 if not known yet */
int gs_getpid_trusted(void); /* getpid() may stand for NVML's pid of this process (not found to be another's) */
void gs_sampler_start(void); /* the background thread (reconcile.c), if not running yet */
uint64_t gs_reconcile_dev_locked(CUdevice dev); /* caller holds gs_ctx_lock; returns bytes charged */
void gs_reconcile_slot_held(int slot);          /* gs_reconcile_slot, the caller holding the context lock */
void gs_reconcile_slot(int slot);               /* synchronous, every ordinal of that slot */
/* gs_reconcile_slot from an allocation about to reserve (memory.c's gs_reserve_near,
 * gs_reserve, pool.c's unknown pool): the one operation this thread may have in flight has
 * neither reserved nor called the driver yet */
void gs_reconcile_slot_reserving(int slot);
/* What the slot's devices' latest readings showed this process holding beyond its charge, left
 * uncharged as noise (under GS_SLACK, 2 MiB, each): 0 where NVML cannot say */
uint64_t gs_reconcile_gap(int slot);
/* The driver's page (the GPU's, and cuMemCreate's granularity): allocations of at most 1 MiB
 * share pages, so one may take a whole page more; a code load takes code chunks of it */
#define GS_PAGE (2ull << 20)
void gs_reconcile_after_load(void);             /* a module or library was loaded */
int gs_reconcile_near_any(void); /* a device with a context of ours is near its cap: loads measure at once */
/* The same as gs_reconcile_after_load near the cap, for a load that can be undone (module.c):
 * returns those of `slots` (a bit each) with a context of ours whose container charge is past the
 * cap after the reading; a reading an operation in flight may have undercounted is taken again
 * (for up to 100 ms).  0 when skipped (this thread inside a context call; the sampler woken) or
 * where NVML gives no figure of the process */
uint32_t gs_reconcile_load_over(uint32_t slots);
/* Code loaded was unloaded again: the devices of `slots` (a bit each) with a context of ours are
 * measured again at once (down as well as up, from a clean reading only; else left marked for the
 * sampler, woken) */
void gs_reconcile_after_undo(uint32_t slots);
void gs_reconcile_wake(void);                   /* the sampler looks now */
void gs_reconcile_track_ctx(CUdevice dev, CUcontext ctx);
int gs_reconcile_dev_contexts(CUdevice dev); /* contexts of the process on dev; under the context lock */
void gs_reconcile_remeasure(CUdevice dev);   /* the next clean reading may lower what was charged beyond the records */
void gs_reconcile_remeasure_slot(int slot); /* gs_reconcile_remeasure, every ordinal of that slot */
/* a synchronisation after stream-ordered frees: pools may have given memory back, which the
 * reconcile may have charged as growth no hook saw; devices with such a charge are measured again */
void gs_reconcile_remeasure_given_back(void);
void gs_reconcile_forget_ctx(CUcontext ctx);  /* caller holds gs_ctx_lock (both) */
void gs_reconcile_ctx_reset(CUdevice dev);
void gs_reconcile_after_fork_child(void);

/* ---- region.c / regionopen.c / liveness.c --------------------------------- */

extern struct gpuslice_region *gs_region; /* NULL until opened */
/* The region's device count, within its table: every process of the container can write the
 * file, and a count past the table would index beyond it */
/* a + b, UINT64_MAX where the sum would wrap */
static inline uint64_t gs_add_sat(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

static inline unsigned gs_region_devices(const struct gpuslice_region *r)
{
    unsigned n = __atomic_load_n(&r->device_count, __ATOMIC_RELAXED);
    return n < GPUSLICE_MAX_DEVICES ? n : GPUSLICE_MAX_DEVICES;
}
int gs_region_open(void); /* regionopen.c */
void gs_region_sync(const struct gs_devcfg *devs, unsigned n, int do_register);
int gs_region_slot_by_uuid(const char *uuid);
int gs_budget_reserve(int slot, uint64_t bytes);  /* 0 = reserved, -1 = over the cap */
void gs_budget_release(int slot, uint64_t bytes);
void gs_budget_force(int slot, uint64_t bytes);   /* charge without checking the cap */
uint64_t gs_slot_used(int slot);
uint64_t gs_slot_limit(int slot);                 /* 0 = none */
/* Lock-free notes in this process's slot, for the container's other processes (slices.c) */
void gs_region_note_measured(int slot, uint64_t total_ns); /* GPU time measured on the slot so far */
void gs_region_note_host_pid(unsigned pid);                /* the pid NVML lists this process under */
uint64_t gs_slot_mine(int slot);                  /* this process's charge on the slot */
uint64_t gs_charge_seq(void);                     /* changes whenever this process's charge does */
/* Whether this process exits (the library's destructor returned its usage):
 * from then on nothing is charged, and the sampler stops asking NVML, whose
 * library may already be torn down. */
int gs_exiting(void);
/* Operations during which the device may hold more for this process than it
 * is charged (a pool growing by whole chunks, a pitch wider than reserved)
 * bracket that window, so a reconcile never counts it as untracked memory. */
extern int gs_unsettled;
static inline void gs_unsettled_begin(void)
{
    __atomic_add_fetch(&gs_unsettled, 1, __ATOMIC_SEQ_CST);
}
static inline void gs_unsettled_end(void)
{
    __atomic_sub_fetch(&gs_unsettled, 1, __ATOMIC_SEQ_CST);
}
/* Allocations and frees inside the driver, charged (or uncharged) before NVML can show them:
 * a measurement across one is not clean (a context's footprint, re-measuring what the process
 * holds beyond its records when a context goes).  The main paths only (cuMemAlloc, managed,
 * pitch, arrays, cuMemCreate, cuMemFree); the reconcile that adds growth does not wait for it. */
extern int gs_inflight;
extern __thread unsigned gs_t_inflight; /* the part of gs_inflight this thread began */
/* The process has allocated managed memory (cuMemAllocManaged, a managed pool): charged in full
 * but resident only as touched, so NVML may show less than the records charge; atomic, set for
 * good */
extern int gs_managed_seen;
/* Odd while a context's teardown (its destroy, a primary release or reset) is in progress
 * under the context lock, from before the driver's call until what the context held is
 * forgotten; moves on with each (context.c).  An allocation that was inside the driver while
 * it moved books its record after that teardown, if the driver still holds it (memory.c). */
extern unsigned gs_ctx_teardown_seq;
/* The teardown sequence now: read before an allocation's driver call */
static inline unsigned gs_teardown_seq(void)
{
    return __atomic_load_n(&gs_ctx_teardown_seq, __ATOMIC_SEQ_CST);
}
/* Did a teardown run (or is one running) since `seq0` was read? */
static inline int gs_teardown_since(unsigned seq0)
{
    return GS_UNLIKELY((seq0 & 1) || gs_teardown_seq() != seq0);
}
/* After a teardown, under the context lock: does the driver say the device pointer is gone (no
 * allocation holds it, or its context went)?  0 where it cannot be asked (memory.c) */
int gs_dptr_gone(uint64_t dptr);
/* Under gs_ctx_lock: did `ctx` go (destroyed, its last reference released, a primary context
 * reset and left inactive) at or after teardown sequence `seq0`? (context.c) */
int gs_ctx_gone_since_locked(CUcontext ctx, unsigned seq0);
static inline void gs_inflight_begin(void)
{
    gs_t_inflight++;
    __atomic_add_fetch(&gs_inflight, 1, __ATOMIC_SEQ_CST);
}
static inline void gs_inflight_end(void)
{
    __atomic_sub_fetch(&gs_inflight, 1, __ATOMIC_SEQ_CST);
    gs_t_inflight--;
}
void gs_region_reclaim_soon(void);                /* rate-limited dead-process reclaim (liveness.c) */
void gs_region_sweep(void);                       /* the sampler's: one per container every 2 s */
void gs_region_after_fork_child(void);

/* This process's own cap per region slot where the limits file decides (0 = none): the region
 * file is writable by every process of the container, so the cap written there is only taken
 * up to this one.  Set at attach, read on the allocation path. */
extern uint64_t gs_own_cap[GPUSLICE_MAX_DEVICES];

/* The cap that holds on a region slot: the region's, within this process's own. */
static inline uint64_t gs_cap_of(int slot, uint64_t region_limit)
{
    uint64_t own = __atomic_load_n(&gs_own_cap[slot], __ATOMIC_RELAXED);
    if (!own) return region_limit;
    return region_limit && region_limit < own ? region_limit : own;
}

/* Would `bytes` more bring the slot's usage within gs_reconcile_margin of its
 * cap, or past it?  Inline on the allocation path: a few loads, no lock.
 * Slots past device_count are zeroed, so their limit reads as none. */
static inline int gs_near_cap(int slot, uint64_t bytes)
{
    struct gpuslice_region *r = __atomic_load_n(&gs_region, __ATOMIC_ACQUIRE);
    uint64_t margin = gs_reconcile_margin;
    if (!r || slot < 0 || slot >= GPUSLICE_MAX_DEVICES || !margin) return 0;
    uint64_t limit = gs_cap_of(slot, __atomic_load_n(&r->devices[slot].limit_bytes, __ATOMIC_RELAXED));
    if (!limit) return 0;
    uint64_t used = __atomic_load_n(&r->devices[slot].used_bytes, __ATOMIC_RELAXED);
    return used >= limit || bytes >= limit - used || limit - used - bytes < margin;
}

/* ---- allocmap.c ----------------------------------------------------------- */

enum gs_kind {
    GS_KIND_DPTR = 1, GS_KIND_POOLPTR, GS_KIND_ARRAY, GS_KIND_MIPMAP, GS_KIND_VMM, GS_KIND_CTX, GS_KIND_GRAPHMEM,
    GS_KIND_VMAP, /* a mapping of a GS_KIND_VMM handle, keyed by its address; charges nothing itself */
    GS_KIND_AMAP, /* a mapping of a GS_KIND_VMM handle into a sparse array's tiles, keyed by the array and
                     tiles; its ctx is the array; charges nothing itself */
    GS_KIND_EXTMEM /* an imported external memory object (cuImportExternalMemory), keyed by its handle */
};
struct gs_alloc {
    uint64_t size;   /* bytes charged (for GS_KIND_POOLPTR: bytes in use; the pool holds the charge;
                        for GS_KIND_VMAP: bytes mapped) */
    uint64_t aux;    /* pool handle for GS_KIND_POOLPTR; references << 32 | mappings for GS_KIND_VMM;
                        the handle for GS_KIND_VMAP and GS_KIND_AMAP */
    uint64_t ctx;    /* the context that owns it: destroying the context frees it */
    int slot;
};
/* 0 = recorded, 1 = replaced a stale record (returned in *replaced), -1 = out of memory */
int gs_am_put(int kind, uint64_t key, const struct gs_alloc *rec, struct gs_alloc *replaced);
int gs_am_take(int kind, uint64_t key, struct gs_alloc *out);      /* 0 found (and removed) */
int gs_am_has(int kind, uint64_t key);                             /* 1 if there is such a record */
/* One step of the keys made of several values (a sparse mapping's, a code lookup's) */
static inline uint64_t gs_hash_step(uint64_t h, uint64_t v)
{
    h = (h ^ v) * 0xff51afd7ed558ccdull;
    return h ^ (h >> 32);
}
/* Change a record in place under the table's lock: fn edits *rec (size, aux) and returns 0 to
 * keep it, 1 to remove it, or another value to leave it as it was; -1 if there is none.
 * *out is the record as fn left it. */
int gs_am_update(int kind, uint64_t key, int (*fn)(struct gs_alloc *rec, void *arg), void *arg,
                 struct gs_alloc *out);
/* Remove up to max records of `kind` whose keys lie in [lo, hi); returns how many. */
size_t gs_am_take_range(int kind, uint64_t lo, uint64_t hi, uint64_t *keys, struct gs_alloc *out, size_t max);
/* Remove every record owned by ctx; fn is called for each, without locks held. */
void gs_am_drop_ctx(uint64_t ctx, void (*fn)(int kind, uint64_t key, const struct gs_alloc *rec));
void gs_am_lock(void);
void gs_am_unlock(void);
void gs_am_after_fork_child(void);

/* ---- memory.c / vmm.c / arrays.c / pool.c -------------------------------- */

#define GS_MIB (1ull << 20)

/* What an allocation of `bytes` costs: the driver hands out large
 * allocations in 2 MiB pages and small ones from shared pages.  (Inline: the
 * allocation hooks of several files call it.) */
static inline uint64_t gs_charge_size(uint64_t bytes)
{
    if (bytes > UINT64_MAX - 2 * GS_MIB) return UINT64_MAX;
    if (bytes <= GS_MIB) return (bytes + 511) & ~511ull;
    return (bytes + 2 * GS_MIB - 1) & ~(2 * GS_MIB - 1);
}

void gs_pools_reconcile_all(void);
int gs_pools_held_for_frees(int slot); /* a charge waits for a synchronisation to return it */
/* Budget reserve; on refusal trims pool charges and retries.  gs_reserve
 * first reconciles near the cap (gs_near_cap); gs_reserve_raw does not (for
 * callers holding the context lock). */
static inline int gs_reserve_raw(int slot, uint64_t bytes)
{
    if (gs_budget_reserve(slot, bytes) == 0) return 0;
    /* pools may hold charges for memory they have released; not from a driver callback under
     * a lock of ours (the pools' own, or one after it: see gs_t_held) */
    if (!gs_t_held) gs_pools_reconcile_all();
    return gs_budget_reserve(slot, bytes);
}

static inline int gs_reserve(int slot, uint64_t bytes)
{
    /* the last allocations before the cap see what the process really holds (callers: nothing
     * of theirs reserved or called yet, gs_reconcile_slot_reserving) */
    if (GS_UNLIKELY(gs_near_cap(slot, bytes))) gs_reconcile_slot_reserving(slot);
    return gs_reserve_raw(slot, bytes);
}

void gs_forget_ctx(CUcontext ctx);         /* a context was destroyed: release what it held */
/* A free of a plain or stream-ordered allocation (`kind`, its record `rec` taken) the driver
 * refused after a teardown began since the record was taken: settled under the context lock
 * (memory.c; from cuMemFree's and cuMemFreeAsync's hooks alike) */
void gs_free_refused_after_teardown(int kind, CUdeviceptr dptr, const struct gs_alloc *rec);
int gs_pool_lock_mine(void);     /* this thread holds the pools' lock (a driver callback inside) */
/* A graph hook must pass through: this thread holds the graph memory's lock or the pools'.
 * The locks held across driver calls are taken in one order: context, throttle, graph
 * memory, pools (a driver callback under the graph memory's lock may allocate from a pool;
 * under the pools' lock no graph hook takes the graph memory's). */
int gs_graphmem_passthrough(void);
void gs_pool_drop_ptr(uint64_t pool, uint64_t bytes);
/* Synchronisations (launch.c's hooks) tell the pools which stream-ordered frees are complete
 * (pool.c): a destroyed pool keeps its charge until its frees are.  The hooks pass straight
 * through while gs_pools_at_sync() is 0. */
extern int gs_pool_waits;
extern unsigned gs_pool_frees;
static inline int gs_pools_at_sync(void)
{
    return __atomic_load_n(&gs_pool_waits, __ATOMIC_RELAXED) | __atomic_load_n(&gs_pool_frees, __ATOMIC_RELAXED);
}
struct gs_pool_sync {
    uint64_t seq;
    unsigned frees;
};
enum { GS_SYNC_CTX, GS_SYNC_STREAM, GS_SYNC_EVENT };
void gs_pools_before_sync(struct gs_pool_sync *ps); /* before the driver's call */
/* after a successful one: of context ctx (NULL: the current one), of stream `stream`, or of an event */
void gs_pools_after_sync(const struct gs_pool_sync *ps, int what, CUcontext ctx, CUstream stream, int per_thread);
void gs_pools_ctx_gone(CUcontext ctx); /* the context went, and its streams' frees with it */
void gs_pools_after_fork_child(void);

/* ---- streams ------------------------------------------------------------- */

/* The stream a call on `stream` really uses: the per-thread default stream for
 * a _ptsz call on stream 0. */
static inline CUstream gs_effective_stream(CUstream stream, int per_thread)
{
    return per_thread && !stream ? CU_STREAM_PER_THREAD : stream;
}

/* Is the stream being captured into a graph?  (0 when the driver cannot say.) */
static inline int gs_stream_capturing(CUstream stream)
{
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return gs_cuda.cuStreamIsCapturing && gs_cuda.cuStreamIsCapturing(stream, &st) == CUDA_SUCCESS &&
           st != CU_STREAM_CAPTURE_STATUS_NONE;
}

/* ---- graphmem.c ----------------------------------------------------------- */

#define GS_GRAPH_DEVS 4
struct gs_graph_need {            /* a graph's allocation nodes, per device */
    int n;
    CUdevice dev[GS_GRAPH_DEVS];
    uint64_t bytes[GS_GRAPH_DEVS];
    uint64_t ran[GS_GRAPH_DEVS];  /* at most what its last launch needed beyond the pool's live
                                   * allocations (the pool's size after it, less those before it);
                                   * 0 = never launched */
    uint64_t left[GS_GRAPH_DEVS];  /* what its last launch left allocated in the pool (its own
                                   * allocations no free node of it freed) */
    int auto_free;                /* CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH: a launch
                                   * frees those `left` first */
    uint64_t epoch;               /* gs_graphmem_epoch after its last launch: `left` is known
                                   * alive only while no graph launch or foreign free came since */
    uint64_t live[GS_GRAPH_DEVS]; /* scratch: the pool's live allocations before this launch,
                                   * beside which it maps (an auto-free one's `left` not among them) */
    unsigned read;                /* scratch: bit i, the pool's counters were read before it */
    uint64_t claim[GS_GRAPH_DEVS]; /* scratch: the pool's free room this launch counts on, claimed
                                   * from launches in flight beside it until it is settled */
    int conditional;              /* a conditional node somewhere in it (gs_graph_variable) */
};
extern int gs_graph_mem_execs;    /* executable graphs with allocation nodes (atomic) */
/* Is the GPU time of the executable's launches its GPU code's to decide (a conditional node, or
 * made for device launch)?  The compute limit queues less of them (admit.c) */
int gs_graph_variable(CUgraphExec exec);
void gs_graphmem_note_free(void); /* a free of a pointer not ours, or a graph launch: maybe graph memory freed */
/* 0 = not such a graph; 1 = reserved[] taken, the charge unsettled until gs_graphmem_after;
 * -1 = over the cap (nothing taken) */
int gs_graphmem_before(CUgraphExec exec, struct gs_graph_need *need, uint64_t *reserved);
/* Would the launch's memory fit now? -1 = no (nothing kept); for refusing before the throttle waits. */
int gs_graphmem_check(CUgraphExec exec);
void gs_graphmem_after(CUgraphExec exec, struct gs_graph_need *need, const uint64_t *reserved, int ran);
void gs_graphmem_after_fork_child(void);
void gs_graphmem_forget_ctx(CUcontext ctx); /* its executable graphs went with it */
void gs_limits_forget_ctx(CUcontext ctx);   /* module.c: the limits set in it are returned */
/* Lower the charges of limits set above their current value on `slot` by up to `bytes`
 * (returned to the budget); returns the bytes taken. */
uint64_t gs_limits_take_slack(int slot, uint64_t bytes);
int gs_limits_slack(int slot); /* 1 if a limit on `slot` is charged above its current value */
void gs_limits_after_fork_child(void);
/* A launch needs `need` bytes of stack per thread in the current context: grown first through
 * the cuCtxSetLimit hook (reserved, refused past the cap) if the context's stack is smaller;
 * -1 = refused (CUDA_ERROR_OUT_OF_MEMORY), 0 = go on (module.c) */
int gs_limits_stack_for(size_t need);
/* 1 if ctx's stack is known to hold `need` bytes per thread already (no driver call) */
int gs_limits_stack_covers(CUcontext ctx, size_t need);

/* ---- lmem.c: a launch's local memory near the cap ------------------------ */

/* 1 while a device of this process may be near its cap (set by every near-cap reconcile,
 * set or cleared by the sampler's ticks): launches then leave the fast path to judge the stack
 * growth they would make the driver reserve.  Read with one relaxed load on the launch path. */
extern int gs_lmem_watch __attribute__((visibility("hidden")));
static inline int gs_lmem_watching(void)
{
    return __atomic_load_n(&gs_lmem_watch, __ATOMIC_RELAXED);
}
extern uint64_t gs_lmem_watch_at __attribute__((visibility("hidden"))); /* when last turned on */
static inline void gs_lmem_watch_set(int on)
{
    if (on) __atomic_store_n(&gs_lmem_watch_at, gs_now_ns(), __ATOMIC_RELAXED);
    if (__atomic_load_n(&gs_lmem_watch, __ATOMIC_RELAXED) != on) __atomic_store_n(&gs_lmem_watch, on, __ATOMIC_RELAXED);
}
/* The sampler's tick: on while near; off only a second after it was last turned on.  A near-cap
 * reconcile turns it on before its reservation lands: a sampler tick that read the usage before
 * that, then stored "off", left the next launch unjudged (a CI run: 1,056 MiB under 1,024) */
static inline void gs_lmem_watch_tick(int near, uint64_t now)
{
    if (near) gs_lmem_watch_set(1);
    else if (now - __atomic_load_n(&gs_lmem_watch_at, __ATOMIC_RELAXED) > 1000000000ull) gs_lmem_watch_set(0);
}
/* Before a launch of f on stream (per_thread: a _ptsz entry point) while watching: -1 if the
 * stack growth it needs does not fit the cap (the launch answers CUDA_ERROR_OUT_OF_MEMORY) */
int gs_lmem_admit(CUfunction f, CUstream stream, int per_thread);
void gs_lmem_forget_all(void); /* code unloaded or a context gone: function handles may come back */
void gs_lmem_after_fork_child(void);
void gs_graphmem_resettle(CUdevice dev, int contexts_left); /* a context of dev went or was reset */

/* ---- the compute throttle: launch.c --------------------------------------- */

void gs_launch_configure(void);       /* after device discovery: is any SM limit set? */
struct gs_limited_dev {
    CUdevice dev;
    int slot;
    nvmlDevice_t nvml;
};
int gs_limited_devices(struct gs_limited_dev *out); /* slots with a compute limit, each once */

/* ---- clockcomp.c ---------------------------------------------------------- */

int gs_launch_wants_sampler(void);    /* a compute limit: the sampler must run */
void gs_launch_sample(void);          /* sampler thread: power and utilisation -> clock compensation */
unsigned gs_power_scale_milli(double power_mw, double limit_mw, double idle_mw, double util_pct);

/* ---- budget.c ------------------------------------------------------------- */

void gs_launch_gang_refresh(void);   /* sampler thread: the devices live processes measured work on */
/* Per region slot: when a launch last went unmeasured because a capture forbade event queries
 * (gs_now_ns, 0 = never); the sampler charges what NVML finds such launches ran */
extern uint64_t gs_unmeasured_ns[GPUSLICE_MAX_DEVICES];
extern uint64_t gs_unmeasured_prepaid_ns[GPUSLICE_MAX_DEVICES];   /* GPU time such launches paid in advance */
extern uint64_t gs_unmeasured_prepaid_cost[GPUSLICE_MAX_DEVICES]; /* what it cost the clock */
void gs_launch_charge_unmeasured(int slot, uint64_t busy_ns, uint64_t since);
void gs_launch_refund_unmeasured(int slot, uint64_t cost);

/* ---- streams.c ------------------------------------------------------------ */

void gs_launch_forget_ctx(CUcontext ctx);
void gs_launch_settle_ctx(CUcontext ctx);
void gs_launch_stream_gone(CUstream s); /* before its destroy, with a compute limit */
void gs_launch_at_exit(void);
void gs_launch_after_sync(void);      /* a synchronisation returned: measure what completed */
void gs_launch_cost_forget(uint64_t fn); /* a function or executable graph changed or went: its cost unknown */
void gs_launch_costs_forget_all(void);   /* code unloaded: every function's cost unknown */
void gs_launch_after_fork_child(void);

/* ---- capture.c ------------------------------------------------------------ */

int gs_capture_global(void);          /* a thread captures in global mode: driver queries would invalidate it */

/* ---- slices.c ------------------------------------------------------------- */

/* Per region slot, this process only: the share of measured GPU time that is its own beside
 * other processes' time slices (1/1000; 0 or 1000 = all), and what it measured so far. */
extern unsigned gs_slice_milli[GPUSLICE_MAX_DEVICES];
extern uint64_t gs_slice_measured_ns[GPUSLICE_MAX_DEVICES];
int gs_slices_enabled(void);           /* GPUSLICE_SM_TIMESLICE_CORRECTION is not off */
void gs_slices_sample(void);           /* sampler thread: per-process utilisation -> gs_slice_milli */
void gs_slices_after_fork_child(void);

#endif /* GPUSLICE_INTERNAL_H */
