/*
 * streams.c - the compute limit's per-stream measurement: each stream's ring
 * of events recorded after its launches, and each completed interval debited
 * (thr_measure_locked); the table of streams, under thr_mu; and what becomes
 * of a context's streams when it goes (settled, or charged from host time), at
 * exit and in a forked child.
 */
#define _GNU_SOURCE
#include <string.h>

#include "throttle.h"

#define GS_STREAMS 256
#define GS_KEY_GONE (~0ull) /* a destroyed stream's entry: no stream's key is all ones */
#define GS_UNREAD_MAX_NS 2000000000ull /* work whose events cannot be read: charged up to this */

pthread_mutex_t thr_mu = PTHREAD_MUTEX_INITIALIZER;
static struct tstream g_streams[GS_STREAMS];
static int g_streams_used; /* entries [0, g_streams_used) were ever taken (485 KiB in all: a fork
                            * clears only these, not faulting in the rest) */
static uint64_t g_tick;

static void account(int slot, uint64_t busy_ns)
{
    unsigned own = thr_own_share(slot);
    gs_region_note_measured(slot, __atomic_add_fetch(&gs_slice_measured_ns[slot], busy_ns, __ATOMIC_RELAXED));
    __atomic_add_fetch(&gs_region->devices[slot].busy_ns, busy_ns * own / 1000, __ATOMIC_RELAXED);
}

CUevent thr_take_event(struct tstream *s)
{
    CUevent e = NULL;
    if (s->nspare) return s->spare[--s->nspare];
    if (gs_cuda.cuEventCreate(&e, CU_EVENT_DEFAULT) != CUDA_SUCCESS) return NULL;
    return e;
}

void thr_give_event(struct tstream *s, CUevent e)
{
    if (!e) return;
    if (s->nspare < (int)(sizeof(s->spare) / sizeof(s->spare[0])))
        s->spare[s->nspare++] = e;
    else if (gs_cuda.cuEventDestroy_v2)
        gs_cuda.cuEventDestroy_v2(e);
}

/* An event the driver would not record (made in another context, a sticky error): destroyed,
 * never reused, or every later launch on the stream would fail to record it. */
void thr_drop_event(CUevent e)
{
    if (e && gs_cuda.cuEventDestroy_v2) gs_cuda.cuEventDestroy_v2(e);
}

void thr_queue_clear(struct tstream *s)
{
    s->queued_est = 0;
    s->queued_unknown = 0;
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
    thr_queue_clear(s);
    s->mark = NULL;
    s->mark_ns = 0;
    s->per_launch_ns = s->advance_ns = s->advance_cost = 0;
}

static int context_gone(CUresult rc)
{
    return rc == CUDA_ERROR_CONTEXT_IS_DESTROYED || rc == CUDA_ERROR_INVALID_CONTEXT ||
           rc == CUDA_ERROR_INVALID_HANDLE || rc == CUDA_ERROR_DEINITIALIZED;
}

/* Debit every completed interval of s. */
void thr_measure_locked(struct tstream *s)
{
    static int warned;
    cuEventElapsedTime_fn elapsed = thr_elapsed_fn();
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
                /* not a launch admitted before a change forgot its cost: it ran what was launched
                 * then (a queued 1 ms launch of a graph changed to 100 ms taught 1 ms again) */
                if (n == 1 && s->fn[s->head] && s->gen[s->head] == thr_cost_gen)
                    thr_cost_learn_locked(s->fn[s->head], s->size[s->head], each);
                __atomic_store_n(&thr_launch_est_ns[s->slot], s->per_launch_ns * thr_own_share(s->slot) / 1000,
                                 __ATOMIC_RELAXED);
                double fresh = thr_line_credit_locked(s->ctx, s->mark, e, ms, elapsed);
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
            uint64_t cost = thr_clock_cost(s->slot, charge);
            if (cost >= paid)
                thr_clock_add_since(s->slot, cost - paid, now - ns); /* the interval began no later */
            else
                thr_clock_refund(s->slot, paid - cost);
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
        thr_give_event(s, s->mark);
        s->mark = e;
        s->mark_ns = s->rec_ns[s->head];
        s->queued_est -= s->est[s->head];
        s->queued_unknown -= s->unknown[s->head];
        s->head = (s->head + 1) % GS_RING;
        if (!n) s->gaps--;
        if (!--s->count) {
            /* all measured: what was paid in advance beyond it (time the stream's work spent
             * waiting for other streams or the host, or that the merged timeline found
             * already charged) is given back */
            thr_clock_refund(s->slot, s->advance_cost);
            s->advance_ns = s->advance_cost = 0;
        }
    }
}

void thr_measure_all_locked(void)
{
    for (int i = 0; i < GS_STREAMS; i++)
        if (g_streams[i].count) thr_measure_locked(&g_streams[i]);
}

/* Whether a stream holds an advance (its queue wait gave up) that its measurement has not
 * settled yet */
int thr_advance_pending_locked(void)
{
    for (int i = 0; i < g_streams_used; i++)
        if (g_streams[i].count && g_streams[i].advance_cost) return 1;
    return 0;
}

/* Debit the completed intervals of the streams that hold an advance: what it paid beyond their
 * work is given back */
void thr_measure_advanced_locked(void)
{
    for (int i = 0; i < g_streams_used; i++)
        if (g_streams[i].count && g_streams[i].advance_cost) thr_measure_locked(&g_streams[i]);
}

/* After a synchronisation: charge what completed (the last work of a process
 * is charged before it exits, not only at its next launch). */
void gs_launch_after_sync(void)
{
    if (__atomic_load_n(&thr_state, __ATOMIC_ACQUIRE) != THROTTLE_ON || thr_capture_forbids_queries() || gs_t_held)
        return;
    thr_mu_lock();
    if (!thr_capture_forbids_queries()) thr_measure_all_locked(); /* a global capture may have begun meanwhile */
    thr_mu_unlock();
}

/* The stream's entry, or NULL: looked up, not made */
struct tstream *thr_stream_find_locked(uint64_t key, CUcontext ctx)
{
    for (int i = 0; i < g_streams_used; i++)
        if (g_streams[i].last_use && g_streams[i].key == key && g_streams[i].ctx == ctx) return &g_streams[i];
    return NULL;
}

struct tstream *thr_stream_get_locked(uint64_t key, CUcontext ctx, int slot)
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
            thr_queue_clear(o);
            o->advance_ns = o->advance_cost = 0;
        }
        uint64_t ran = from && now > from ? now - from : 0;
        /* bounded: the work may have ended long before (a synchronous copy, a cuStreamQuery
         * poll, then minutes of host work before the exit), and all of that time would be
         * debt the container's next launches wait for */
        if (ran > GS_UNREAD_MAX_NS) ran = GS_UNREAD_MAX_NS;
        if (ran) account(slot, ran);
        uint64_t cost = ran ? thr_clock_cost(slot, ran) : 0;
        if (cost >= adv_cost)
            thr_clock_add(slot, cost - adv_cost);
        else
            thr_clock_refund(slot, adv_cost - cost);
        GS_DEBUG("charged %llu ns of unread work on device slot %d", (unsigned long long)ran, slot);
    }
}

/* Before a context goes (cuCtxDestroy, a primary reset): the driver waits for its work
 * anyway, so it is waited for here and measured as a hooked synchronisation does; once the
 * context is gone its events cannot be read. */
void gs_launch_settle_ctx(CUcontext ctx)
{
    if (!ctx || __atomic_load_n(&thr_state, __ATOMIC_ACQUIRE) != THROTTLE_ON || gs_t_held) return;
    /* waited for without the lock: another thread's launch (on another context, or one this
     * context's work waits for) must not wait behind it.  The context is synchronised, as its
     * destroy does anyway: events of our streams' rings may be recycled by other threads
     * meanwhile, and the program's streams may be gone */
    int busy = 0;
    CUcontext prev = NULL;
    if (!gs_cuda.cuCtxGetCurrent || !gs_cuda.cuCtxSetCurrent || !gs_cuda.cuCtxSynchronize ||
        gs_cuda.cuCtxGetCurrent(&prev) != CUDA_SUCCESS)
        return;
    thr_mu_lock();
    if (!thr_capture_forbids_queries()) /* else charged from host time once it went */
        for (int i = 0; i < GS_STREAMS && !busy; i++)
            busy = g_streams[i].last_use && g_streams[i].count && g_streams[i].ctx == ctx;
    if (busy) __atomic_add_fetch(&thr_settling, 1, __ATOMIC_ACQ_REL); /* a global capture waits for it */
    thr_mu_unlock();
    if (!busy) return;
    thr_t_settling++; /* except one begun from a driver callback inside the sync (capture.c) */
    if (gs_cuda.cuCtxSetCurrent(ctx) == CUDA_SUCCESS) {
        gs_cuda.cuCtxSynchronize();
        gs_cuda.cuCtxSetCurrent(prev);
    }
    thr_t_settling--;
    __atomic_sub_fetch(&thr_settling, 1, __ATOMIC_ACQ_REL);
    thr_mu_lock();
    if (!thr_capture_forbids_queries())
        for (int i = 0; i < GS_STREAMS; i++) {
            struct tstream *s = &g_streams[i];
            if (s->last_use && s->count && s->ctx == ctx) thr_measure_locked(s);
        }
    thr_mu_unlock();
}

/* A stream is being destroyed (before the driver's call: once it returns, the driver may give its
 * handle to a new stream).  Its entry no longer stands for the handle: its events, recorded before,
 * are still measured and its advance settled, but a new stream with its handle gets an entry of its
 * own.  Left under the handle, the new stream's events queued behind the old stream's unfinished
 * ones, so the new stream never looked idle and each of its kernels' intervals ran from the one
 * before's end: a 1 s host function on the old stream, and the new one's five 1 ms kernels 100 ms
 * apart were charged 403 ms (`test_throttle.py -k destroyed_streams_handle`).  No driver call. */
void gs_launch_stream_gone(CUstream es)
{
    if (!es || es == CU_STREAM_LEGACY || es == CU_STREAM_PER_THREAD || gs_t_held) return;
    uint64_t key = thr_stream_key(es);
    thr_mu_lock();
    for (int i = 0; i < g_streams_used; i++) {
        struct tstream *s = &g_streams[i];
        if (!s->last_use || s->key != key) continue; /* any context's: a handle is one stream's */
        s->key = GS_KEY_GONE;
        s->last_use = 1; /* recycled first once measured */
    }
    thr_mu_unlock();
}

/* At exit (the region's destructor, before it returns the process's slot): work still in
 * flight is charged from host time, without driver calls (the driver may be torn down). */
void gs_launch_at_exit(void)
{
    if (__atomic_load_n(&thr_state, __ATOMIC_ACQUIRE) != THROTTLE_ON || !gs_region) return;
    if (pthread_mutex_trylock(&thr_mu) != 0) return; /* held by a thread stopped by the exit (or this one) */
    charge_unread_locked(NULL, gs_now_ns());
    pthread_mutex_unlock(&thr_mu);
}

static void forget_ctx_locked(CUcontext ctx)
{
    charge_unread_locked(ctx, gs_now_ns()); /* what the settle before it went did not measure */
    for (int i = 0; i < GS_STREAMS; i++)
        if (g_streams[i].last_use && g_streams[i].ctx == ctx) reset_stream(&g_streams[i]);
    struct tline *t = thr_line_get_locked(ctx, 0);
    if (t) memset(t, 0, sizeof(*t)); /* its events went with the context */
}

void gs_launch_forget_ctx(CUcontext ctx)
{
    thr_mu_lock();
    forget_ctx_locked(ctx);
    thr_mu_unlock();
    thr_capture_ctx_gone(ctx);
}

void gs_launch_after_fork_child(void)
{
    pthread_mutex_init(&thr_mu, NULL);
    memset(g_streams, 0, (size_t)g_streams_used * sizeof(g_streams[0]));
    g_streams_used = 0;
    if (thr_lines) memset(thr_lines, 0, (size_t)thr_nlines * sizeof(*thr_lines));
    memset(thr_gap_bits, 0, sizeof(thr_gap_bits));
    memset(thr_block_bits, 0, sizeof(thr_block_bits));
    memset(gs_unmeasured_ns, 0, sizeof(gs_unmeasured_ns));
    memset(gs_unmeasured_prepaid_ns, 0, sizeof(gs_unmeasured_prepaid_ns));
    memset(gs_unmeasured_prepaid_cost, 0, sizeof(gs_unmeasured_prepaid_cost));
    memset(thr_launch_est_ns, 0, sizeof(thr_launch_est_ns));
    thr_capture_after_fork_child();
    gs_slices_after_fork_child();
}
