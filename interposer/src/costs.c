/*
 * costs.c - what a launch of each function or executable graph costs the GPU, as its launches
 * alone on their stream measured it: the estimate by which a stream's queue counts the work it
 * holds (admit.c), per process, under thr_mu.
 */
#define _GNU_SOURCE
#include "throttle.h"

/* Set-associative by handle, GS_COST_WAYS to a set, the least recently used way giving room: a
 * handle whose entry another took is of unknown cost again, and its next launch waits for its
 * stream's queue.  A program cycling through more kernels than the table holds waits so at
 * every launch: 9000 kernels of 20 us in turn got 12.4 % of the GPU under 30 % with 8192
 * entries (`test_throttle.py -k many_kernels_in_turn`; an XLA step may run thousands of fused
 * kernels).  65536 entries, 3 MiB of static pages that a process never launching under a limit
 * never touches.  Under thr_mu.
 *
 * A function's cost depends on its launch's size (threads: grid times block; an executable
 * graph's is 1): an elementwise kernel's grid follows its tensor's.  Kept as two measured
 * points, the smallest and the largest size measured, and estimated as GPU time is shaped: not
 * less at a larger size, flat while the GPU is not filled, then in proportion (or faster: in the
 * square, attention's).  So a size between them is estimated on the chord, above the largest in
 * proportion to it (in the square if the two points grew faster than in proportion), below the
 * smallest at its figure: at or above the time for a kernel whose time grows so (the errors that
 * count let the queue run ahead; one estimate too high only shortens it).
 * One figure per function, a second of grid-1 launches taught 1 ms, and the queue took twenty
 * of the same kernel at a grid of 100 by it: 2 s of work at once, 86.6 % of the GPU over 1.5 s
 * under a 30 % limit (`test_throttle.py -k 'longer_kernel and bigrid'`).  A size never measured is not unknown:
 * a kernel over tensors of changing shapes would wait for its stream's queue at each launch.
 * Except a leap: more than GS_COST_LEAP times the largest size measured is unknown, and waits
 * to be measured alone.  Nothing measured shows how fast the time grows beyond (one size
 * measured shows nothing of it), and in proportion the error is the leap's size: attention
 * measured at a short sequence's grid alone, then launched at a 50 times longer one, 2500
 * times the time, was counted at 50 times, and the queue took four: 50.0 % of the GPU over
 * 1.5 s windows under 30 % (`test_throttle.py -k 'faster_than_its_grid and bigrid1'`).  Within the
 * leap the error is at most its factor (a queue of 80 ms for one of 20, kernels in the square
 * of their size); a function pays the wait once a leap: a few times over sizes from one
 * thread to millions. */
#define GS_COST_SETS 16384
#define GS_COST_WAYS 4
struct cost_point {
    uint64_t size, ns;
};
static struct cost {
    uint64_t fn, used;
    struct cost_point lo, hi; /* lo.size <= hi.size; equal while one size was measured */
} g_costs[GS_COST_SETS][GS_COST_WAYS];
static uint64_t g_cost_clock;
/* Entries last used at or before this clock are gone (gs_launch_costs_forget_all): no table to
 * clear, and the least recently used way giving room takes them first */
static uint64_t g_cost_floor;
unsigned thr_cost_gen;

/* An estimate in proportion beyond the largest size measured: at most this, or that size's figure
 * if more.  Any estimate past a stream's queue (admit.c's GS_QUEUE_NS, 20 ms) lets nothing queue
 * behind it, so more would change nothing there; but a launch that gives up waiting behind it pays
 * the queue's estimate in advance (settled when measured), and a 30 ms kernel at 4 times its
 * grid, estimated in the square, would be paid for by half a second however fast it ran */
#define GS_COST_SCALED_MAX_NS 100000000ull
/* Beyond this many times the largest size measured, unknown (above) */
#define GS_COST_LEAP 4

static struct cost *cost_set(uint64_t fn)
{
    return g_costs[(fn * 0x9e3779b97f4a7c15ull) >> 50 & (GS_COST_SETS - 1)];
}

static struct cost *cost_find(uint64_t fn)
{
    struct cost *set = cost_set(fn);
    for (int w = 0; fn && w < GS_COST_WAYS; w++)
        if (set[w].fn == fn && set[w].used > g_cost_floor) return &set[w];
    return NULL;
}

/* The estimate at `size` from the two points (size at least 1); 0, unknown, past a leap */
static uint64_t cost_at(const struct cost *c, uint64_t size)
{
    uint64_t lo = c->lo.ns, hi = c->hi.ns > lo ? c->hi.ns : lo; /* not less at a larger size */
    if (size <= c->lo.size) return lo;
    if (size >= c->hi.size) {
        if (size > (unsigned __int128)c->hi.size * GS_COST_LEAP) return 0;
        unsigned __int128 e = (unsigned __int128)hi * size / c->hi.size; /* < 2^66 */
        /* the points grew faster than in proportion, a thread at the larger costing half as much
         * again or more (attention over a sequence its grid follows): in the square of the size.
         * In proportion, such a kernel at grids 1 and 2 (0.1, 0.4 ms) then at 50 (250 ms) was
         * counted at 10 ms, two queued at a time: 50.0 % of the GPU over 1.5 s windows under 30 %,
         * then 33.3 % (`test_throttle.py -k 'faster_than_its_grid and bigrid2'`; grid 50 is a
         * leap now, measured alone first).  Within a leap the square keeps the queue's estimate
         * closer (a scratch probe, grids 8 and 16 then 64: 34.1 % over 300 ms windows either way) */
        if (e <= GS_COST_SCALED_MAX_NS &&
            2 * (unsigned __int128)c->hi.ns * c->lo.size >= 3 * (unsigned __int128)c->lo.ns * c->hi.size)
            e = e * size / c->hi.size; /* < 2^27 * 4 */
        return e <= GS_COST_SCALED_MAX_NS ? (uint64_t)e : hi > GS_COST_SCALED_MAX_NS ? hi : GS_COST_SCALED_MAX_NS;
    }
    return lo + (uint64_t)((unsigned __int128)(hi - lo) * (size - c->lo.size) / (c->hi.size - c->lo.size));
}

uint64_t thr_cost_locked(uint64_t fn, uint64_t size)
{
    struct cost *c = cost_find(fn);
    if (!c) return 0;
    c->used = ++g_cost_clock;
    return cost_at(c, size ? size : 1);
}

/* A launch of fn at `size` took `each` alone.  At a measured point's size: a quarter of its
 * running average.  Beyond them: the new smallest or largest point.  Between them: the nearer
 * point moves there if the chord had it too low (a kernel grown costlier since, or one that grows
 * faster than in proportion); else nothing, the chord stays above. */
void thr_cost_learn_locked(uint64_t fn, uint64_t size, uint64_t each)
{
    struct cost *c = cost_find(fn);
    if (!each) each = 1; /* known: even a launch too short to read costs something */
    if (!size) size = 1;
    if (c) {
        int at_lo = size == c->lo.size, at_hi = size == c->hi.size; /* both while one size was measured */
        if (at_lo) c->lo.ns = (c->lo.ns * 3 + each) / 4;
        if (at_hi) c->hi.ns = (c->hi.ns * 3 + each) / 4;
        if (at_lo || at_hi) return;
        if (size < c->lo.size)
            c->lo = (struct cost_point){size, each};
        else if (size > c->hi.size)
            c->hi = (struct cost_point){size, each};
        else if (each > cost_at(c, size))
            *(size - c->lo.size < c->hi.size - size ? &c->lo : &c->hi) = (struct cost_point){size, each};
        return;
    }
    struct cost *set = cost_set(fn);
    c = &set[0];
    for (int w = 1; w < GS_COST_WAYS; w++)
        if (set[w].used < c->used) c = &set[w]; /* an empty way's is 0 */
    *c = (struct cost){fn, ++g_cost_clock, {size, each}, {size, each}};
}

/* fn changed (an executable graph updated, its nodes' parameters set) or went (its handle may
 * come back for another): of unknown cost until a launch of it is measured.  Not from a driver
 * callback under a lock of ours (thr_mu may be this thread's): the old figure stays, learnt
 * over at the next measurement. */
void gs_launch_cost_forget(uint64_t fn)
{
    if (!fn || gs_t_held || __atomic_load_n(&thr_state, __ATOMIC_ACQUIRE) != THROTTLE_ON) return;
    thr_mu_lock();
    struct cost *c = cost_find(fn);
    if (c) *c = (struct cost){0};
    thr_cost_gen++;
    thr_mu_unlock();
}

/* Code unloaded (a module or library): any function's handle may come back as another's, a
 * kernel of the code loaded again (a JIT's new version of it, the allocator handing back the
 * old one's memory), and would inherit the old one's cost.  Every cost is forgotten: which
 * handles were the unloaded code's is not known (a CUkernel's library, a CUfunction's module
 * are separate lookups, not made on the launch path).  Each function's next launch then waits
 * for its stream's queue once.  Kernel "k" at 1 ms, its module unloaded and loaded again to run
 * 100 ms at the same handle: the queue took twenty by the old figure, 100 % of the GPU over
 * 1.5 s windows under 30 % (`test_throttle.py -k loaded_again`).  Not from a driver callback
 * under a lock of ours, as gs_launch_cost_forget. */
void gs_launch_costs_forget_all(void)
{
    if (gs_t_held || __atomic_load_n(&thr_state, __ATOMIC_ACQUIRE) != THROTTLE_ON) return;
    thr_mu_lock();
    g_cost_floor = g_cost_clock;
    thr_cost_gen++;
    thr_mu_unlock();
}
