/*
 * throttle.h - what the compute throttle's files share (launch.c has the
 * overview): the state, the per-stream and per-context records, and each
 * file's functions that the others call.  gpuslice.h declares what the rest of
 * the library calls.  Names shared only among these files are prefixed thr_
 * (the name they had when the throttle was one file follows); everything else
 * stays static in its file.
 */
#ifndef GPUSLICE_THROTTLE_H
#define GPUSLICE_THROTTLE_H

#include <pthread.h>
#include <unistd.h>
#include <sys/syscall.h>

#include "gpuslice.h"

/* Hidden declarations: every file reads the throttle's state with one RIP-relative load, not
 * through the GOT (the fast paths of the hooks in gaps.c cost what those of launch.c do). */
#pragma GCC visibility push(hidden)

#define GS_TIMELINES 16           /* contexts with a timeline, at first */
#define GS_SEGMENTS 32            /* disjoint busy segments a timeline remembers */
#define GS_RING 64
#define GS_POLL_NS 100000ull
#define GS_SCALE_MAX_MILLI 1750u  /* clock compensation: at most 1.75 x */

enum { THROTTLE_UNKNOWN = 0, THROTTLE_OFF = 1, THROTTLE_ON = 2 };
extern int thr_state;
extern int thr_time_mode; /* GPUSLICE_SM_LIMIT_MODE=time: no clock compensation */
extern int thr_gang;      /* GPUSLICE_SM_LIMIT_GANG: launches wait for every limited device's clock */

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
    uint64_t fn[GS_RING];       /* the one launch it ends: its function or executable graph, whose
                                 * cost its interval teaches (thr_cost_locked); 0: several, or a gap */
    uint64_t size[GS_RING];     /* that launch's size (threads; 1 for a graph) */
    uint64_t est[GS_RING];      /* the estimated GPU time of the launches it ends, of known cost */
    unsigned short unknown[GS_RING]; /* those launches of unknown cost */
    unsigned gen[GS_RING];      /* thr_cost_gen when its launch was admitted */
    uint64_t queued_est;        /* est over the ring: the queue's estimated GPU time */
    int queued_unknown;         /* unknown over the ring */
    uint64_t rec_ns[GS_RING];   /* host time each was (last) recorded */
    CUevent mark;       /* the last measured event: start of the next interval */
    uint64_t mark_ns;   /* host time it was recorded: the interval cannot be longer than since */
    CUevent spare[GS_RING + 2];
    int nspare;
    uint64_t per_launch_ns; /* running estimate of one launch's GPU time (any); 0 = unknown */
    uint64_t advance_ns; /* GPU time debited before it was measured (a queue wait gave up) */
    uint64_t advance_cost; /* what that cost on the clock: settled and given back at most */
    uint64_t last_use;
};

/* One context's timeline: event times in ms after `epoch`, and the union of
 * the intervals debited so far as disjoint segments (oldest first; when full,
 * the oldest is forgotten, so a late interval reaching back over it is charged
 * that time again: line_add in timeline.c). */
struct tline {
    CUcontext ctx;        /* NULL = free */
    CUevent epoch;        /* completed reference event, or NULL */
    CUevent pending;      /* a newer reference recorded, not yet known complete */
    uint64_t epoch_ns;    /* host time the epoch was recorded */
    uint64_t pending_ns;  /* host time the pending one was recorded */
    int nseg;
    double seg[GS_SEGMENTS][2];
};

/* A context-less kernel (a CUkernel) runs in the context of its stream, which need not be the
 * current one.  Its events must be made in that context (the driver records an event only on
 * a stream of its own context) and its time belongs to that context's device: the throttle's
 * bookkeeping runs with the stream's context current, the launch itself with the caller's. */
struct ctx_switch {
    int on;
    CUcontext home, there;
};

/* A launch being measured: its stream, the slot and context it is measured in. */
struct measured {
    int slot;
    CUcontext ctx;
    CUstream es;
    uint64_t key;
    struct ctx_switch sw;
    int begun; /* counted in its stream's `launching` (thr_begin_locked) */
    uint64_t fn; /* its function or executable graph */
    uint64_t size; /* its threads, grid times block (an executable graph's: 1) */
    uint64_t fn_est; /* its cost as estimated at its size (thr_cost_locked); 0 = unknown */
    unsigned gen;    /* thr_cost_gen then */
};

/* ---- launch.c: the hooks' fast path -------------------------------------- */

static inline int throttle_on(void)
{
    int st = __atomic_load_n(&thr_state, __ATOMIC_ACQUIRE);
    if (GS_LIKELY(st == THROTTLE_OFF)) return 0;
    if (st == THROTTLE_UNKNOWN) {
        gs_devices_ready();
        st = __atomic_load_n(&thr_state, __ATOMIC_ACQUIRE);
    }
    return st == THROTTLE_ON && gs_region;
}

/* Each hook is a fast path and a slow one.  With no compute limit the state is
 * THROTTLE_OFF, which is set only after the real functions are resolved, so
 * the fast path is one atomic load, one pointer load and a tail call: no
 * stack frame, no lock, no region access, no clock.  Everything else (first
 * call, a missing real function, a limit) goes to the out-of-line slow path. */
#define GS_FAST(name, args)                                                                                   \
    do {                                                                                                      \
        name##_fn real_;                                                                                      \
        if (GS_LIKELY(__atomic_load_n(&thr_state, __ATOMIC_ACQUIRE) == THROTTLE_OFF) &&                       \
            GS_LIKELY((real_ = gs_cuda.name) != NULL))                                                        \
            return real_ args;                                                                                \
    } while (0)

/* A kernel launch's fast path: GS_FAST's, while no device of the process is near its cap
 * (gs_lmem_watch: one more load; near it the slow path judges the stack growth, lmem.c) */
#define GS_FAST_LAUNCH(name, args)                                                                            \
    do {                                                                                                      \
        name##_fn real_;                                                                                      \
        if (GS_LIKELY(__atomic_load_n(&thr_state, __ATOMIC_ACQUIRE) == THROTTLE_OFF) &&                       \
            GS_LIKELY(!gs_lmem_watching()) && GS_LIKELY((real_ = gs_cuda.name) != NULL))                      \
            return real_ args;                                                                                \
    } while (0)

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

/* ---- budget.c ------------------------------------------------------------- */

/* The share (1/1000) of the GPU time its events measure that is the process's own, other
 * processes' time slices removed (slices.c); account() in streams.c keeps with it the figures the
 * slices correction and the agent's metrics read */
static inline unsigned thr_own_share(int slot)
{
    unsigned own = __atomic_load_n(&gs_slice_milli[slot], __ATOMIC_RELAXED);
    return !own || own > 1000 ? 1000 : own;
}

uint64_t thr_unmeasured_cost(struct gpuslice_device *d, uint64_t busy_ns);
uint64_t thr_clock_cost(int slot, uint64_t busy_ns);
void thr_clock_add(int slot, uint64_t cost);
void thr_clock_add_since(int slot, uint64_t cost, uint64_t began);
void thr_clock_refund(int slot, uint64_t cost);
extern uint64_t thr_launch_est_ns[GPUSLICE_MAX_DEVICES]; /* one launch's GPU time, as last measured */
int thr_budget_owed(int slot);
void thr_wait_for_budget(int slot);
void thr_wait_for_budget_until(int slot, uint64_t until); /* or until `until` (gs_now_ns) */

/* ---- streams.c ------------------------------------------------------------ */

extern pthread_mutex_t thr_mu;
/* thr_mu counts in gs_t_held: the driver may call back into the process from inside the event
 * calls made under it (a profiler's API callback), and a launch or synchronisation from
 * there passes through unmeasured rather than wait for its own thread */
static inline void thr_mu_lock(void)
{
    gs_held_lock(&thr_mu);
}

static inline void thr_mu_unlock(void)
{
    gs_held_unlock(&thr_mu);
}

CUevent thr_take_event(struct tstream *s);
void thr_give_event(struct tstream *s, CUevent e);
void thr_drop_event(CUevent e);

static inline cuEventElapsedTime_fn thr_elapsed_fn(void)
{
    return gs_cuda.cuEventElapsedTime ? gs_cuda.cuEventElapsedTime : gs_cuda.cuEventElapsedTime_v2;
}

void thr_measure_locked(struct tstream *s);
void thr_queue_clear(struct tstream *s); /* its events forgotten (count 0): their estimates too */
void thr_measure_all_locked(void);
int thr_advance_pending_locked(void);
void thr_measure_advanced_locked(void);
struct tstream *thr_stream_find_locked(uint64_t key, CUcontext ctx);
struct tstream *thr_stream_get_locked(uint64_t key, CUcontext ctx, int slot);

/* ---- costs.c -------------------------------------------------------------- */

/* A function's or executable graph's GPU time a launch of `size` threads, estimated from those
 * measured; 0 if none was.  Kept per process, for every stream: a stream's own running estimate
 * is what its last launches cost, whatever they were, and a stream of 1 ms kernels that went on
 * to launch 100 ms ones queued twenty of them by it.  Under thr_mu. */
uint64_t thr_cost_locked(uint64_t fn, uint64_t size);
/* A launch of fn at `size`, alone on its stream, took `each` ns.  Under thr_mu. */
void thr_cost_learn_locked(uint64_t fn, uint64_t size, uint64_t each);
/* Bumped when a cost is forgotten (gs_launch_cost_forget): launches admitted before teach none,
 * since they ran what was launched before the change.  Under thr_mu. */
extern unsigned thr_cost_gen;

/* ---- timeline.c ----------------------------------------------------------- */

extern struct tline *thr_lines; /* thr_nlines of them, grown as needed (timeline.c) */
extern int thr_nlines;
struct tline *thr_line_get_locked(CUcontext ctx, int create);
void thr_line_reference_locked(CUcontext ctx, CUstream es, uint64_t now);
double thr_line_credit_locked(CUcontext ctx, CUevent mark, CUevent e, double ms, cuEventElapsedTime_fn elapsed);

/* ---- capture.c ------------------------------------------------------------ */

extern int thr_global_captures;          /* captures in global mode, any thread (atomic) */
extern __thread int thr_strict_captures; /* this thread's captures not in relaxed mode */
extern int thr_settling; /* contexts being synchronised before their destroy (gs_launch_settle_ctx) */
extern __thread int thr_t_settling; /* of those, this thread's */
void thr_capture_after_fork_child(void); /* the parent's captures and settles are not the child's */
void thr_capture_stream_destroyed(CUstream s); /* its capture, if any, went with it */
void thr_capture_ctx_gone(CUcontext ctx);      /* its streams' captures went with it */

static inline uint64_t thr_stream_key(CUstream es)
{
    uint64_t key = es == CU_STREAM_LEGACY ? 0 : (uint64_t)(uintptr_t)es; /* NULL is the legacy stream too */
    if (es == CU_STREAM_PER_THREAD) key ^= (uint64_t)syscall(SYS_gettid) << 8;
    return key;
}

/* Would an event query now invalidate a capture? */
static inline int thr_capture_forbids_queries(void)
{
    return __atomic_load_n(&thr_global_captures, __ATOMIC_ACQUIRE) || thr_strict_captures;
}

/* ---- admit.c -------------------------------------------------------------- */

static inline int thr_switch_to(const struct ctx_switch *sw, int there)
{
    return !sw->on || gs_cuda.cuCtxSetCurrent(there ? sw->there : sw->home) == CUDA_SUCCESS ? 0 : -1;
}

int thr_admit_locked(CUstream stream, int per_thread, int variable, uint64_t fn, uint64_t size, struct measured *m);
void thr_launch_failed(struct measured *m);
void thr_callback_launched(CUstream stream, int per_thread);
void thr_record_end(struct measured *m);

/* ---- gaps.c --------------------------------------------------------------- */

#define GS_GAP_BITS 1024
extern uint64_t thr_gap_bits[GS_GAP_BITS / 64];   /* a copy, host function or wait since the last launch */
extern uint64_t thr_block_bits[GS_GAP_BITS / 64]; /* a memset since the last launch: no gap may end */
void thr_begin_locked(struct measured *m);

#pragma GCC visibility pop

#endif /* GPUSLICE_THROTTLE_H */
