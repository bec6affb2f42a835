/*
 * admit.c - a launch's way through the compute limit: the slot and context it
 * is measured in, its wait for the budget and for its stream's queue (or its
 * pacing unmeasured, where a capture forbids event queries), and after the
 * driver's call the event that ends it.  The interval's start is gaps.c's
 * (thr_begin_locked).
 */
#define _GNU_SOURCE
#include "throttle.h"

#define GS_QUEUE_NS 20000000ull   /* unmeasured work in flight per stream */
#define GS_VAR_QUEUE_NS 1000000ull /* the same before a launch whose cost its GPU code decides */
#define GS_QUEUE_WAIT_NS 50000000ull /* the longest a launch waits for that queue */
#define GS_SETTLE_NS 10000000ull     /* a wait for the budget measures advances this often */

/* Launches recorded, not yet measured (gaps are not work of ours) */
static int queued_launches(const struct tstream *s)
{
    return s->count - s->gaps;
}

/* est: the launch's own cost (m->fn_est), 0 if unknown */
static int over_queue(const struct tstream *s, int variable, uint64_t est)
{
    if (s->count >= GS_RING) return 1;
    if (!queued_launches(s)) return 0;
    /* a launch of unknown cost, or one queued: one measured launch first */
    if (!est || s->queued_unknown) return 1;
    /* a graph whose GPU code decides its cost (gs_graph_variable: a WHILE node's trip count)
     * may take far more than the estimate learnt from its launches so far: a shorter queue */
    return s->queued_est >= (variable ? GS_VAR_QUEUE_NS : GS_QUEUE_NS);
}

/* A launch of cost est (0: unknown) counted in the estimates of ring entry k and of the queue */
static void count_launch(struct tstream *s, int k, uint64_t est)
{
    s->est[k] += est;
    s->unknown[k] += !est;
    s->queued_est += est;
    s->queued_unknown += !est;
}

/* Queued launches of unknown cost whose function's or graph's cost a measurement has taught
 * since (its first launch, measured alone while these waited behind it) count at that cost:
 * counted at nothing, a launch that gave up waiting behind them paid only what the head had run
 * so far, and each one after it queued another 100 ms graph behind the first (a graph changed
 * from 1 ms to 100 ms a launch: 86.6 % of the GPU under 30 %, `test_throttle.py -k
 * changed_in_place`) */
static void queue_costs_learnt_locked(struct tstream *s)
{
    for (int i = 0; i < s->count && s->queued_unknown; i++) {
        int k = (s->head + i) % GS_RING;
        uint64_t c = s->unknown[k] ? thr_cost_locked(s->fn[k], s->size[k]) : 0; /* fn: one launch's entry */
        if (!c) continue;
        s->unknown[k] = 0;
        s->queued_unknown--;
        count_launch(s, k, c);
    }
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
        thr_switch_to(sw, 0);
        sw->on = 0;
    }
    return slot;
}

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
    if (!locked) thr_mu_lock();
    const struct tstream *s = thr_stream_find_locked(thr_stream_key(m->es), m->ctx);
    if (s) est = s->per_launch_ns * thr_own_share(slot) / 1000;
    thr_mu_unlock();
    if (!est) est = __atomic_load_n(&thr_launch_est_ns[slot], __ATOMIC_RELAXED);
    if (est > GS_QUEUE_NS) est = GS_QUEUE_NS;
    uint64_t cost = est ? thr_unmeasured_cost(&gs_region->devices[slot], est) : 0;
    if (cost) {
        __atomic_add_fetch(&gs_unmeasured_prepaid_ns[slot], est, __ATOMIC_RELAXED);
        __atomic_add_fetch(&gs_unmeasured_prepaid_cost[slot], cost, __ATOMIC_RELAXED);
        thr_clock_add(slot, cost);
    }
    __atomic_store_n(&gs_unmeasured_ns[slot], gs_now_ns(), __ATOMIC_RELAXED);
    if (thr_budget_owed(slot)) thr_wait_for_budget(slot);
}

/* After a launch from a driver callback under a lock of ours (a profiler's API callback inside
 * the event calls the throttle makes under thr_mu, say): it can wait for neither that lock (its
 * own thread may hold it) nor the budget (other threads would wait behind the lock), so it goes
 * unmeasured, but not uncharged: the sampler charges the process's NVML share beyond what its
 * events measured, as for a launch a capture keeps from being measured (slices.c).  No advance:
 * such a kernel often lies inside a measured interval (one queued on the stream whose event is
 * being recorded), and an advance paid for it twice is given back too late to be used (16 %
 * of the fake GPU at a 30 % limit).  Let through uncharged, a callback launching on a stream of
 * its own inside every event query ran at 44.8 % under 30 % (`test_throttle.py -k
 * from_a_driver_callback`). */
static __thread unsigned t_callback_launches; /* this thread's, from callbacks inside its own driver calls */

void thr_callback_launched(CUstream stream, int per_thread)
{
    t_callback_launches++;
    CUcontext ctx = NULL;
    CUdevice dev = -1;
    if (!gs_region || gs_stream_device(gs_effective_stream(stream, per_thread), &ctx, &dev) != 0) return;
    int slot = gs_dev_slot(dev);
    if (slot >= 0 && slot < GPUSLICE_MAX_DEVICES) __atomic_store_n(&gs_unmeasured_ns[slot], gs_now_ns(), __ATOMIC_RELAXED);
}

/* Waits until a launch on the stream may go: returns 1 with thr_mu held and the stream's context
 * current, or 0 if the launch goes unmeasured (the caller's context current, thr_mu free). */
int thr_admit_locked(CUstream stream, int per_thread, int variable, uint64_t fn, uint64_t size, struct measured *m)
{
    m->sw.on = 0;
    m->begun = 0;
    m->fn = fn;
    m->size = size;
    m->fn_est = 0;
    m->es = gs_effective_stream(stream, per_thread);
    m->slot = launch_slot(m->es, &m->ctx, &m->sw);
    int slot = m->slot;
    if (slot < 0 || !__atomic_load_n(&gs_region->devices[slot].sm_limit, __ATOMIC_RELAXED) ||
        !gs_cuda.cuEventCreate || !gs_cuda.cuEventRecord || !gs_cuda.cuEventQuery || !thr_elapsed_fn() ||
        gs_stream_capturing(m->es)) {
        thr_switch_to(&m->sw, 0);
        return 0;
    }
    if (thr_capture_forbids_queries()) {
        pace_unmeasured(m, 0);
        thr_switch_to(&m->sw, 0);
        return 0;
    }
    m->key = thr_stream_key(m->es);

    thr_mu_lock();
    struct tstream *s;
    uint64_t queue_until = 0;
    unsigned callbacks = t_callback_launches;
    int measured_all = 0, advanced = 0, settle = 0;
    for (;;) {
        /* a global capture begun meanwhile (counted under thr_mu before it begins) forbids
         * every query from now on: launched unmeasured */
        if (thr_capture_forbids_queries()) {
            pace_unmeasured(m, 1); /* unlocks */
            thr_switch_to(&m->sw, 0);
            return 0;
        }
        if (!measured_all) thr_measure_all_locked();
        else if (settle) thr_measure_advanced_locked();
        measured_all = 1;
        /* launch only when the budget is paid and the queue is short, both at once; the queue
         * is waited for at most GS_QUEUE_WAIT_NS (its head may wait for the host) */
        s = thr_stream_get_locked(m->key, m->ctx, slot);
        if (!s) {
            /* every entry has work in flight (streams held by waits on the host, say): paced as
             * a launch a capture keeps from being measured, paid in advance and settled against
             * NVML; let through unpaid, 256 such streams let another run at 100 % under 30 % */
            pace_unmeasured(m, 1); /* unlocks */
            thr_switch_to(&m->sw, 0);
            return 0;
        }
        thr_measure_locked(s);
        if (s->queued_unknown) queue_costs_learnt_locked(s);
        m->fn_est = thr_cost_locked(fn, size);
        m->gen = thr_cost_gen;
        uint64_t now = gs_now_ns();
        if (over_queue(s, variable, m->fn_est) && (!queue_until || now < queue_until)) {
            if (!queue_until) queue_until = now + GS_QUEUE_WAIT_NS;
            thr_mu_unlock();
            /* each poll queries the head's event; where a profiler's callback inside those
             * queries launches (thr_callback_launched), each poll queued a kernel of its own:
             * polled every GS_POLL_NS, one launch's wait queued up to 500 of them, paid only
             * at the sampler's next look (a tenant ending its run with such a flood got up to
             * 47.6 % of the fake GPU under 30 %, `test_throttle.py -k from_a_driver_callback`) */
            gs_sleep_ns(t_callback_launches != callbacks ? GS_SETTLE_NS : GS_POLL_NS);
        } else if (over_queue(s, variable, m->fn_est) && !advanced) {
            /* the queue's head has run longer than the wait (a kernel longer than it, or one
             * waiting for the host or another stream): the queued work's estimate (while it is
             * unknown, what the head can have taken since its interval began) is debited now,
             * once, and settled when it is measured; else kernels longer than the wait would
             * each pass it unpaid, at 100 %.  Not merely what the head took so far: this launch
             * queues behind all of it, so each launch past the wait paid a little and the
             * queue grew by doubling, 1 s kernels under a 50 % limit ran four at a time, 4 s
             * at 100 % then 4 s idle (`test_throttle.py -k run_ahead`) */
            advanced = 1;
            uint64_t ran = now > s->mark_ns ? now - s->mark_ns : 0, queued = s->queued_est;
            /* nothing has run while the interval's start, or the gap at the queue's head, has not
             * been reached (the stream waits for the host, or another stream): host time is not
             * the head's then.  Paid all the same, a kernel behind a wait on a flag the host set
             * only after its next launch held that launch for 3 s of host work times 100/30:
             * 10.2 s, the container's budget on the device with it (`test_throttle.py -k
             * host_held`) */
            if ((s->mark && gs_cuda.cuEventQuery(s->mark) == CUDA_ERROR_NOT_READY) ||
                (s->count && !s->launches[s->head] && gs_cuda.cuEventQuery(s->ring[s->head]) == CUDA_ERROR_NOT_READY))
                ran = 0;
            /* a graph whose GPU code decides its cost: what the head ran, if the estimate is less */
            if (!s->queued_unknown && (!variable || queued > ran)) ran = queued;
            if (s->mark_ns && ran > s->advance_ns) {
                uint64_t cost = thr_clock_cost(slot, ran - s->advance_ns);
                thr_clock_add(slot, cost); /* the budget only: the measurement accounts */
                s->advance_cost += cost;
                s->advance_ns = ran;
            }
            thr_mu_unlock();
        } else if (thr_budget_owed(slot)) {
            /* while a stream holds an advance (paid above), its work is measured every
             * GS_SETTLE_NS of the wait, so that what the advance paid beyond it comes back
             * when the work ends.  Measured only once the clock had passed, the advance was
             * waited off first and then given back below the idle credit, lost: 16 streams
             * whose kernels wait for each other (each one's intervals, and so the estimate,
             * 20-50 ms for a 2 ms kernel) got 8.9-11.4 % under 30 % (`test_throttle.py -k
             * given_back_late`).  Those streams only: each measurement is event queries, and a
             * profiler's callback inside them may launch (thr_callback_launched) */
            settle = thr_advance_pending_locked();
            thr_mu_unlock();
            if (settle)
                thr_wait_for_budget_until(slot, gs_now_ns() + GS_SETTLE_NS);
            else
                thr_wait_for_budget(slot);
        } else {
            return 1;
        }
        thr_mu_lock();
    }
}

/* The launch is no longer between its begin and its end's record (thr_mu held) */
static void launch_done_locked(struct measured *m, struct tstream *s)
{
    if (!m->begun) return;
    m->begun = 0;
    if (!s) s = thr_stream_find_locked(m->key, m->ctx);
    if (s && s->launching) s->launching--; /* 0: the entry was reset meanwhile (its context went) */
}

/* After a launch that failed */
void thr_launch_failed(struct measured *m)
{
    if (!m->begun) return;
    thr_mu_lock();
    launch_done_locked(m, NULL);
    thr_mu_unlock();
}

/* After a launch that succeeded: the event that ends it (the caller's context current). */
void thr_record_end(struct measured *m)
{
    if (thr_switch_to(&m->sw, 1) != 0) { /* the stream's context is gone: this launch unmeasured */
        thr_launch_failed(m);
        return;
    }
    thr_mu_lock();
    struct tstream *s = thr_stream_get_locked(m->key, m->ctx, m->slot);
    launch_done_locked(m, s);
    if (s && s->count >= GS_RING) {
        /* the ring is full (the queue wait timed out): the newest event covers this launch too */
        int tail = (s->head + s->count - 1) % GS_RING;
        if (gs_cuda.cuEventRecord(s->ring[tail], m->es) == CUDA_SUCCESS) {
            if (!s->launches[tail]) s->gaps--; /* a gap's end now ends this launch, gap included */
            s->launches[tail]++;
            s->fn[tail] = 0; /* no one launch's interval: teaches no cost */
            count_launch(s, tail, m->fn_est);
            s->rec_ns[tail] = gs_now_ns();
            s->unended = 0; /* recorded after every kernel queued so far, an unended one's too */
            GS_DEBUG("event ring full: the newest event now covers %u launches", s->launches[tail]);
        } else {
            s->unended = 1;
        }
    } else if (s) {
        CUevent end = thr_take_event(s);
        if (end && gs_cuda.cuEventRecord(end, m->es) == CUDA_SUCCESS) {
            int tail = (s->head + s->count) % GS_RING;
            s->ring[tail] = end;
            s->launches[tail] = 1;
            s->fn[tail] = m->fn;
            s->size[tail] = m->size;
            s->gen[tail] = m->gen;
            s->est[tail] = s->unknown[tail] = 0;
            count_launch(s, tail, m->fn_est);
            s->rec_ns[tail] = gs_now_ns();
            s->count++;
            s->unended = 0;
            thr_line_reference_locked(m->ctx, m->es, s->rec_ns[tail]);
        } else {
            thr_drop_event(end);
            s->unended = 1; /* its kernel is charged to the next interval, which no gap may cut */
        }
    }
    thr_mu_unlock();
    if (thr_switch_to(&m->sw, 0) != 0) GS_ERROR("cuCtxSetCurrent failed: the caller's context could not be restored");
}
