/*
 * timeline.c - a context's timeline, for the compute limit: the intervals of
 * the context's streams are placed on one timeline (each event's time after a
 * reference event of the context, re-based every GS_EPOCH_NS) and only their
 * union is debited, so that N streams whose kernels run one after another are
 * charged their total.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "throttle.h"

#define GS_EPOCH_NS 5000000000ull /* a context's reference event is renewed this often */

/* On the heap (under thr_mu), grown as needed: a fixed table of 16 left the 17th context alive
 * with work (green contexts are measured as contexts of their own) without a timeline, its
 * streams charged the sum of their intervals: 2 streams of serial kernels got 17.7-22.4 % under
 * a 30 % limit (`test_throttle.py -k timeline_of_its_own`) */
struct tline *thr_lines;
int thr_nlines;

struct tline *thr_line_get_locked(CUcontext ctx, int create)
{
    struct tline *free_line = NULL;
    for (int i = 0; i < thr_nlines; i++) {
        if (thr_lines[i].ctx == ctx) return &thr_lines[i];
        if (!thr_lines[i].ctx && !free_line) free_line = &thr_lines[i];
    }
    if (!create) return NULL;
    if (!free_line) {
        int n = thr_nlines ? 2 * thr_nlines : GS_TIMELINES;
        struct tline *grown = realloc(thr_lines, (size_t)n * sizeof(*grown));
        if (!grown) return NULL; /* charged per stream, the strict side */
        memset(grown + thr_nlines, 0, (size_t)(n - thr_nlines) * sizeof(*grown));
        thr_lines = grown;
        free_line = &thr_lines[thr_nlines];
        thr_nlines = n;
    }
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
void thr_line_reference_locked(CUcontext ctx, CUstream es, uint64_t now)
{
    struct tline *t = thr_line_get_locked(ctx, 1);
    if (!t) return;
    if (t->pending) {
        /* one not complete this long after its record waits behind work that may not end for
         * hours (a stream wait on the host, a persistent kernel), and meanwhile the epoch aged:
         * an hour after it, float milliseconds are a quarter of a millisecond apart, and 20 us
         * kernels on other streams were charged nothing (100 % of the fake GPU under a 30 %
         * limit, `test_throttle.py -k blur`).  It goes (the driver frees it once it completes),
         * and a new one is recorded on this stream */
        if (now - t->pending_ns <= GS_EPOCH_NS) return;
        if (gs_cuda.cuEventDestroy_v2) gs_cuda.cuEventDestroy_v2(t->pending);
        t->pending = NULL;
    }
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
double thr_line_credit_locked(CUcontext ctx, CUevent mark, CUevent e, double ms, cuEventElapsedTime_fn elapsed)
{
    struct tline *t = thr_line_get_locked(ctx, 0);
    if (!t) return ms;
    line_settle_locked(t, elapsed);
    float a = 0, b = 0;
    if (!t->epoch || elapsed(&a, t->epoch, mark) != CUDA_SUCCESS || elapsed(&b, t->epoch, e) != CUDA_SUCCESS)
        return ms;
    return line_add(t, a, b);
}
