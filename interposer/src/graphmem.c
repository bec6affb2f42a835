/*
 * graphmem.c - memory of CUDA graphs' allocation nodes.
 *
 * A graph's memory allocation nodes (cuGraphAddMemAllocNode, or
 * cuMemAllocAsync captured on a stream) take no memory when they are made:
 * the driver maps physical memory into the device's graph memory pool when
 * an executable graph is uploaded or launched, and keeps it there (reserved,
 * reused by later launches) until cuDeviceGraphMemTrim or the context goes.
 * So, per device:
 *  - captured cuMemAllocAsync / cuMemAllocFromPoolAsync are passed through
 *    uncharged (pool.c): they are nodes, not memory;
 *  - cuGraphInstantiate* sums the graph's allocation nodes per device (child
 *    graphs included), and remembers executable graphs that have any;
 *  - before such a graph is uploaded or launched, the part of its
 *    allocations the graph pool cannot already hold, used + need - reserved
 *    (CU_GRAPH_MEM_ATTR_*), is reserved on the budget; over the cap the call
 *    returns CUDA_ERROR_OUT_OF_MEMORY and nothing runs.  `need` is the sum of
 *    the nodes, an upper bound (the driver lets nodes with disjoint lifetimes
 *    share memory); once the graph has run, a pool at least as large as it
 *    was after that run needs nothing more, so replays near the cap go on;
 *  - after it, and after cuDeviceGraphMemTrim, the device's graph charge
 *    follows CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT (the reservation is
 *    settled to what the pool really holds; nodes with disjoint lifetimes
 *    share memory, so it is usually less).
 * The charge is kept in the allocation map under the device (the pool
 * outlives the contexts that used it); a context's end or reset reads the
 * pool again (gs_graphmem_resettle).
 *
 * Graph launches of graphs without allocation nodes keep the launch fast
 * path (launch.c): it checks gs_graph_mem_execs, which stays 0 until a graph
 * with allocation nodes is instantiated.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpuslice.h"

int gs_graph_mem_execs;

struct gexec {
    CUgraphExec exec;
    CUcontext ctx;             /* it was instantiated in: goes with it */
    struct gs_graph_need need; /* need.ran[i]: what its last launch needed at most (0 = never) */
};

GS_OWNED_LOCK() /* the table and every settle */

int gs_graphmem_passthrough(void)
{
    return t_mine || gs_pool_lock_mine();
}
/* On the heap, grown as needed: a fixed table of 1024 left the 1025th executable untracked, and
 * its 2 GiB of allocation nodes launched with nothing charged under a 1 GiB cap
 * (`test_graphs.py -k more_than`) */
static struct gexec *g_execs;
static int g_n, g_cap;

/* ---- what a graph allocates ------------------------------------------------ */

static void need_add(struct gs_graph_need *need, CUdevice dev, uint64_t bytes)
{
    for (int i = 0; i < need->n; i++) {
        if (need->dev[i] == dev) {
            need->bytes[i] += bytes;
            return;
        }
    }
    if (need->n < GS_GRAPH_DEVS) {
        need->dev[need->n] = dev;
        need->bytes[need->n++] = bytes;
    } else {
        need->bytes[GS_GRAPH_DEVS - 1] += bytes; /* more devices than tracked: charge the last one */
    }
}

/* Every graph below `root` (child graph nodes, however deeply nested: a depth limit would leave
 * the allocations past it uncharged), from a stack of its own rather than by recursion.
 * CUDA_SUCCESS, or the error of the first query that failed (CUDA_ERROR_OUT_OF_MEMORY: host
 * memory for the walk): then the graph's allocations are not known. */
static CUresult walk(CUgraph root, CUdevice here, struct gs_graph_need *need)
{
    size_t cap = 16, top = 0;
    CUgraph *stack = malloc(cap * sizeof(*stack));
    if (!root) {
        free(stack);
        return CUDA_SUCCESS; /* the driver's to refuse */
    }
    if (!stack) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = CUDA_SUCCESS;
    stack[top++] = root;
    while (top && rc == CUDA_SUCCESS) {
        CUgraph graph = stack[--top];
        size_t n = 0;
        if ((rc = gs_cuda.cuGraphGetNodes(graph, NULL, &n)) != CUDA_SUCCESS || !n) continue;
        CUgraphNode *nodes = calloc(n, sizeof(*nodes));
        if (!nodes) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            continue;
        }
        rc = gs_cuda.cuGraphGetNodes(graph, nodes, &n);
        for (size_t i = 0; i < n && rc == CUDA_SUCCESS; i++) {
            CUgraphNodeType type = 0;
            if ((rc = gs_cuda.cuGraphNodeGetType(nodes[i], &type)) != CUDA_SUCCESS) break;
            if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
                CUDA_MEM_ALLOC_NODE_PARAMS p;
                memset(&p, 0, sizeof(p));
                if ((rc = gs_cuda.cuGraphMemAllocNodeGetParams(nodes[i], &p)) != CUDA_SUCCESS || !p.bytesize) continue;
                CUdevice dev = gs_location_device(&p.poolProps.location); /* a locality domain's too */
                if (dev < 0) dev = here;
                need_add(need, dev, gs_charge_size(p.bytesize));
            } else if (type == CU_GRAPH_NODE_TYPE_CONDITIONAL) {
                need->conditional = 1; /* its bodies hold no allocation nodes (cuda.h) */
            } else if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
                CUgraph child = NULL;
                rc = gs_cuda.cuGraphChildGraphNodeGetGraph ? gs_cuda.cuGraphChildGraphNodeGetGraph(nodes[i], &child)
                                                           : CUDA_ERROR_NOT_SUPPORTED;
                if (rc != CUDA_SUCCESS || !child) continue;
                if (top == cap) {
                    CUgraph *more = realloc(stack, 2 * cap * sizeof(*stack));
                    if (!more) {
                        rc = CUDA_ERROR_OUT_OF_MEMORY;
                        continue;
                    }
                    stack = more;
                    cap *= 2;
                }
                stack[top++] = child;
            }
        }
        free(nodes);
    }
    free(stack);
    return rc;
}

/* The graph's allocations per device (n = 0 when it has none, or when the driver has no
 * allocation nodes); CUDA_SUCCESS or the error that kept them from being read. */
static CUresult graph_need(CUgraph graph, struct gs_graph_need *need)
{
    memset(need, 0, sizeof(*need));
    CUdevice here = 0;
    if (!gs_cuda.cuGraphGetNodes || !gs_cuda.cuGraphNodeGetType || !gs_cuda.cuGraphMemAllocNodeGetParams ||
        !gs_cuda.cuDeviceGetGraphMemAttribute)
        return CUDA_SUCCESS;
    if (!gs_cuda.cuCtxGetDevice || gs_cuda.cuCtxGetDevice(&here) != CUDA_SUCCESS) here = 0;
    return walk(graph, here, need);
}

/* ---- executables whose launches take what the GPU decides --------------------- */

/* A conditional node's WHILE body runs as many times as the graph's kernels say, and a graph
 * made for device launch may relaunch itself from the GPU: the same executable's launch may take
 * a millisecond or a second.  The compute limit queues at most about GS_QUEUE_NS of a stream's
 * work by its per-launch estimate, and a loop whose trip count grew after that estimate was
 * learnt was queued twenty deep: 4 s of work admitted at once, the GPU 100 % busy for seconds
 * under a 30 % limit (`test_throttle.py -k trip_count`).  Their launches queue a twentieth of
 * that (admit.c).  Kept apart from the allocation table below (whose entries the memory hooks
 * act on); g_var_any stays 0 while there are none. */
static struct var_exec {
    CUgraphExec exec;
    CUcontext ctx; /* it was instantiated in: goes with it */
    int device;    /* made for device launch */
} *g_var;
static int g_nvar, g_capvar, g_var_any; /* g_var_any: g_nvar, read without the lock */
static int g_ndev;                      /* entries made for device launch */

static void variable_note(CUgraphExec exec, int device)
{
    CUcontext ctx = NULL;
    if (gs_cuda.cuCtxGetCurrent) gs_cuda.cuCtxGetCurrent(&ctx);
    ctx = gs_ctx_canonical(ctx);
    mu_lock();
    int i = 0;
    while (i < g_nvar && g_var[i].exec != exec) i++;
    if (i == g_nvar && g_nvar == g_capvar) {
        int cap = g_capvar ? 2 * g_capvar : 16;
        struct var_exec *t = realloc(g_var, (size_t)cap * sizeof(*t));
        if (t) {
            g_var = t;
            g_capvar = cap;
        }
    }
    if (i < g_capvar) {
        if (i < g_nvar) g_ndev -= g_var[i].device;
        g_var[i] = (struct var_exec){exec, ctx, device};
        g_ndev += device;
        if (i == g_nvar) g_nvar++;
    }
    __atomic_store_n(&g_var_any, g_nvar, __ATOMIC_RELEASE);
    mu_unlock();
    if (i >= g_capvar) GS_WARN("no host memory to note a graph whose GPU code decides its cost: its launches queue as others");
}

/* Take exec (ctx NULL), or every executable of ctx, out; 0 if there was none, 2 if (the last) one
 * was made for device launch, else 1 */
static int variable_forget(CUgraphExec exec, CUcontext ctx)
{
    int had = 0;
    if (!__atomic_load_n(&g_var_any, __ATOMIC_ACQUIRE)) return 0;
    mu_lock();
    for (int i = 0; i < g_nvar; i++)
        if (ctx ? g_var[i].ctx == ctx : g_var[i].exec == exec) {
            had = g_var[i].device ? 2 : 1;
            g_ndev -= g_var[i].device;
            g_var[i--] = g_var[--g_nvar];
        }
    __atomic_store_n(&g_var_any, g_nvar, __ATOMIC_RELEASE);
    mu_unlock();
    return had;
}

int gs_graph_variable(CUgraphExec exec)
{
    /* none, or a driver callback under g_mu (passed through, as its other hooks) */
    if (!__atomic_load_n(&g_var_any, __ATOMIC_ACQUIRE) || gs_graphmem_passthrough()) return 0;
    /* a graph made for device launch may also be launched by the kernels of any other graph
     * (fire-and-forget, tail or sibling: the host launch completes with all of it), so while one
     * lives every graph launch may take what its GPU code decides */
    mu_lock();
    int i = 0;
    while (!g_ndev && i < g_nvar && g_var[i].exec != exec) i++;
    int found = g_ndev || i < g_nvar;
    mu_unlock();
    return found;
}

/* ---- the executable graphs that allocate ----------------------------------- */

/* Room for one more entry; -1 when there is no host memory for it.  Caller holds g_mu. */
static int room_locked(void)
{
    if (g_n < g_cap) return 0;
    int cap = g_cap ? 2 * g_cap : 64;
    struct gexec *t = cap > g_cap ? realloc(g_execs, (size_t)cap * sizeof(*t)) : NULL;
    if (!t) return -1;
    g_execs = t;
    g_cap = cap;
    return 0;
}

/* Index of exec in the table, or -1; caller holds g_mu. */
static int find_locked(CUgraphExec exec)
{
    for (int i = 0; i < g_n; i++)
        if (g_execs[i].exec == exec) return i;
    return -1;
}

static int remember(CUgraphExec exec, const struct gs_graph_need *need)
{
    CUcontext ctx = NULL;
    if (gs_cuda.cuCtxGetCurrent) gs_cuda.cuCtxGetCurrent(&ctx);
    ctx = gs_ctx_canonical(ctx); /* a green context's graphs go with the primary context */
    mu_lock();
    int i = find_locked(exec);
    if (i < 0 && room_locked() == 0) i = g_n++;
    if (i >= 0) {
        g_execs[i].exec = exec;
        g_execs[i].ctx = ctx;
        g_execs[i].need = *need;
        __atomic_store_n(&gs_graph_mem_execs, g_n, __ATOMIC_RELEASE);
    }
    mu_unlock();
    return i >= 0 ? 0 : -1;
}

/* Take exec's entry out of the table; 1 and *out if it had one. */
static int forget(CUgraphExec exec, struct gexec *out)
{
    mu_lock();
    int i = find_locked(exec);
    if (i >= 0) {
        *out = g_execs[i];
        g_execs[i] = g_execs[--g_n];
        __atomic_store_n(&gs_graph_mem_execs, g_n, __ATOMIC_RELEASE);
    }
    mu_unlock();
    return i >= 0;
}

/* Put back an entry forget took (its executable lives on); never over a newer one. */
static void put_back(const struct gexec *e)
{
    mu_lock();
    int lost = 0;
    if (find_locked(e->exec) < 0 && !(lost = room_locked() != 0)) {
        g_execs[g_n++] = *e;
        __atomic_store_n(&gs_graph_mem_execs, g_n, __ATOMIC_RELEASE);
    }
    mu_unlock();
    if (lost) GS_WARN("no host memory to keep an executable graph's allocations: it is charged by the NVML reconcile only");
}

/* A context went: its executable graphs went with it (the driver may hand their handles
 * out again, for graphs that allocate nothing). */
void gs_graphmem_forget_ctx(CUcontext ctx)
{
    if (ctx) variable_forget(NULL, ctx);
    mu_lock();
    for (int i = 0; i < g_n;)
        if (g_execs[i].ctx == ctx)
            g_execs[i] = g_execs[--g_n];
        else
            i++;
    __atomic_store_n(&gs_graph_mem_execs, g_n, __ATOMIC_RELEASE);
    mu_unlock();
}

static int lookup(CUgraphExec exec, struct gs_graph_need *need)
{
    mu_lock();
    int i = find_locked(exec);
    if (i >= 0) *need = g_execs[i].need;
    mu_unlock();
    return i >= 0;
}

/* ---- the charge ------------------------------------------------------------ */

static int graph_attr(CUdevice dev, int attr, uint64_t *value)
{
    cuuint64_t v = 0;
    if (!gs_cuda.cuDeviceGetGraphMemAttribute || gs_cuda.cuDeviceGetGraphMemAttribute(dev, attr, &v) != CUDA_SUCCESS)
        return -1;
    *value = v;
    return 0;
}

/* Per device, the pool's free room that launches in flight count on (reserve() to
 * gs_graphmem_after); under g_mu.  Indexed only by devices with a region slot (gs_dev_slot >= 0:
 * an ordinal below GS_MAX_CUDA_DEVS) */
static uint64_t g_claimed[GS_MAX_CUDA_DEVS];

/* Bring the device's graph charge to the pool's reserved memory; `reserved`
 * bytes were already taken from the budget for it (by gs_graphmem_before).  A pool that cannot
 * be read keeps the charge, unless `gone_unread` (no context of the process left on the device,
 * where the driver may not answer): then it goes. */
static uint64_t settle_as(CUdevice dev, uint64_t reserved, int gone_unread)
{
    int slot = gs_dev_slot(dev);
    if (slot < 0) return 0;
    /* the charge is the device's, not a context's (the pool outlives the contexts that used
     * it): it follows the pool's size here, and gs_graphmem_resettle when a context goes */
    mu_lock();
    struct gs_alloc rec = {0}, old;
    if (gs_am_take(GS_KIND_GRAPHMEM, (uint64_t)dev, &rec) != 0) rec.slot = slot;
    uint64_t charged = rec.size + reserved, target = charged;
    uint64_t used = 0;
    if (graph_attr(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &target) != 0)
        target = gone_unread ? 0 : charged;
    else if (g_claimed[dev] && graph_attr(dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used) == 0 &&
             target < gs_add_sat(used, g_claimed[dev]))
        /* never below the room launches in flight count on: a trim meanwhile gave it back, an
         * allocation took it, and the launch mapped its 600 MiB again, 1200 MiB held under a
         * 1 GiB cap (`test_graphs.py -k trim_during`) */
        target = gs_add_sat(used, g_claimed[dev]);
    if (target > charged) {
        gs_budget_force(rec.slot, target - charged); /* grew past the reservation: charged all the same */
        /* the reconcile may have charged that pool memory already, as growth no hook saw: the
         * next clean reading takes the overlap out of it */
        gs_reconcile_remeasure(dev);
    }
    else if (target < charged)
        gs_budget_release(rec.slot, charged - target);
    rec.size = target;
    if (target) gs_am_put(GS_KIND_GRAPHMEM, (uint64_t)dev, &rec, &old);
    mu_unlock();
    return target;
}

static uint64_t settle(CUdevice dev, uint64_t reserved)
{
    return settle_as(dev, reserved, 0);
}

/* A context of dev went or was reset: the pool may have shrunk or gone with it.  The charge
 * follows what the pool reports; with no context of the process left on the device, a pool
 * that cannot be read is taken for gone.  (It was taken for gone unread: a pool the driver
 * keeps past a created context, the process's only one, went uncharged, and a 600 MiB
 * allocation passed beside its 600 MiB, 1200 MiB held under a 1 GiB cap on the fake, whose
 * pool goes with the primary context; `test_graphs.py -k past_the_last_context`.) */
void gs_graphmem_resettle(CUdevice dev, int contexts_left)
{
    struct gs_alloc rec, old;
    if (dev < 0) return;
    mu_lock();
    int have = gs_am_take(GS_KIND_GRAPHMEM, (uint64_t)dev, &rec) == 0;
    if (have) gs_am_put(GS_KIND_GRAPHMEM, (uint64_t)dev, &rec, &old);
    mu_unlock();
    if (have) settle_as(dev, 0, !contexts_left);
}

/* Bumped by every graph launch and every free of a pointer the library did not record (graph
 * memory among them): an auto-free executable's relaunch credits what its last launch left
 * only while this is what that launch left it at.  Credited after the program freed that
 * memory itself, the credit came off another graph's live allocations: 1.2 GiB held under a
 * 1 GiB cap (review). */
static uint64_t g_graph_epoch;

void gs_graphmem_note_free(void)
{
    if (__atomic_load_n(&gs_graph_mem_execs, __ATOMIC_RELAXED)) __atomic_add_fetch(&g_graph_epoch, 1, __ATOMIC_RELAXED);
}

/* Give back the pool room that devices [0, n) of a launch claimed (reserve) */
static void unclaim(struct gs_graph_need *need, int n)
{
    mu_lock();
    for (int i = 0; i < n; i++) {
        if (need->claim[i]) g_claimed[need->dev[i]] -= need->claim[i]; /* claimed: a device of a slot */
        need->claim[i] = 0;
    }
    mu_unlock();
}

/* Reserve what the pool cannot hold of `need`; 0 = done, -1 = over the cap (nothing kept). */
static int reserve(struct gs_graph_need *need, uint64_t *reserved)
{
    for (int i = 0; i < need->n; i++) {
        uint64_t used = 0, held = 0, extra = 0;
        CUdevice dev = need->dev[i];
        int slot = gs_dev_slot(dev);
        reserved[i] = 0;
        need->claim[i] = 0;
        need->live[i] = 0;
        need->read &= ~(1u << i);
        if (slot < 0) continue;
        /* the counters read and the room claimed at once: two launches in flight read the same
         * free room otherwise */
        mu_lock();
        if (graph_attr(dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used) != 0 ||
            graph_attr(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &held) != 0) {
            /* the pool cannot be read: the whole sum of its nodes, as if the pool held nothing
             * (reserving nothing let it map past the cap) */
            used = 0;
            extra = need->bytes[i];
        } else {
            /* an auto-free executable's launch first frees what its last one left: counting
             * those as alive beside it refused its relaunch near the cap */
            if (need->auto_free && need->epoch == __atomic_load_n(&g_graph_epoch, __ATOMIC_RELAXED))
                used -= need->left[i] < used ? need->left[i] : used;
            need->live[i] = used;
            need->read |= 1u << i;
            /* the sum of its nodes, or less if it ran before: then it needed no more than the
             * pool held after that run beyond the allocations alive before it (nodes with
             * disjoint lifetimes share memory); both beside the allocations alive now */
            uint64_t want = need->bytes[i];
            if (need->ran[i] && need->ran[i] < want) want = need->ran[i];
            /* of the pool's free room, what no launch in flight beside it counts on already:
             * two threads launching 600 MiB graphs beside a pool's 600 free MiB each took it
             * for theirs, and the pool grew to 1200 MiB under a 1 GiB cap (`test_graphs.py -k
             * at_once`) */
            uint64_t room = held > used ? held - used : 0;
            room = room > g_claimed[dev] ? room - g_claimed[dev] : 0;
            need->claim[i] = want < room ? want : room;
            extra = want - need->claim[i];
            g_claimed[dev] += need->claim[i];
        }
        mu_unlock();
        /* near the cap, on top of what the process holds uncharged (under the reconcile's noise
         * threshold), as memory.c's gs_reserve_near: admitted against its part alone, a 922 MiB
         * graph beside a 4 KiB array's page and a 101 MiB context held 1025 MiB under a 1 GiB
         * cap (`test_graphs.py -k beside_uncharged`).  settle() returns what the pool does not
         * take of it */
        uint64_t take = extra;
        if (extra && GS_UNLIKELY(gs_near_cap(slot, extra))) {
            gs_reconcile_slot(slot);
            take = gs_add_sat(extra, gs_reconcile_gap(slot));
        }
        if (take && gs_reserve_raw(slot, take) != 0) {
            for (int k = 0; k < i; k++)
                if (reserved[k]) gs_budget_release(gs_dev_slot(need->dev[k]), reserved[k]);
            unclaim(need, i + 1);
            GS_INFO("graph launch refused: its %llu bytes of allocations would exceed the cap",
                    (unsigned long long)need->bytes[i]);
            return -1;
        }
        reserved[i] = take;
    }
    return 0;
}

int gs_graphmem_before(CUgraphExec exec, struct gs_graph_need *need, uint64_t *reserved)
{
    /* any launch may free graph memory (free nodes; a graph without allocation nodes too),
     * after this one's own credit is judged */
    if (!lookup(exec, need)) {
        gs_graphmem_note_free();
        return 0;
    }
    int over = reserve(need, reserved);
    gs_graphmem_note_free();
    if (over != 0) return -1;
    gs_unsettled_begin(); /* the driver maps before settle() charges it: no reconcile in between */
    return 1;
}

int gs_graphmem_check(CUgraphExec exec)
{
    struct gs_graph_need need;
    uint64_t reserved[GS_GRAPH_DEVS];
    if (!lookup(exec, &need)) return 0;
    if (reserve(&need, reserved) != 0) return -1;
    for (int i = 0; i < need.n; i++)
        if (reserved[i]) gs_budget_release(gs_dev_slot(need.dev[i]), reserved[i]);
    unclaim(&need, need.n);
    return 0;
}

void gs_graphmem_after(CUgraphExec exec, struct gs_graph_need *need, const uint64_t *reserved, int ran)
{
    uint64_t held[GS_GRAPH_DEVS] = {0};
    unclaim(need, need->n); /* its room is the pool's, in use or free again */
    for (int i = 0; i < need->n; i++) held[i] = settle(need->dev[i], reserved[i]);
    gs_unsettled_end();
    if (!ran || !exec) return;
    uint64_t ran_need[GS_GRAPH_DEVS] = {0}, left[GS_GRAPH_DEVS] = {0};
    for (int i = 0; i < need->n; i++) {
        /* the pool held its need beside what lived before it; if some of that was freed
         * meanwhile, the run may have used the space: then only the pool's size bounds it */
        uint64_t after = 0, base = need->live[i];
        int known = graph_attr(need->dev[i], CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &after) == 0 && after >= base;
        if (!known) base = 0;
        ran_need[i] = held[i] > base + 1 ? held[i] - base : 1; /* never 0 once it ran: 0 means never */
        /* what it left allocated: the pool's growth in use across it (0 where unknown: its
         * relaunch then counts it as alive, on the safe side), at most its nodes' sum */
        if (known && (need->read & (1u << i))) left[i] = after - base < need->bytes[i] ? after - base : need->bytes[i];
    }
    uint64_t epoch = __atomic_add_fetch(&g_graph_epoch, 1, __ATOMIC_RELAXED);
    mu_lock();
    int k = find_locked(exec);
    for (int i = 0; k >= 0 && i < need->n; i++) {
        g_execs[k].need.ran[i] = ran_need[i];
        g_execs[k].need.left[i] = left[i];
    }
    if (k >= 0) g_execs[k].need.epoch = epoch;
    mu_unlock();
}

/* ---- the hooks ------------------------------------------------------------- */

typedef CUresult (*instantiate_thunk)(const void *args);

struct inst_args {
    const void *real;
    CUgraphExec *exec;
    CUgraph graph;
    unsigned long long flags;
    CUDA_GRAPH_INSTANTIATE_PARAMS *params;
    CUgraphNode *err;
    char *log;
    size_t logsize;
};

static CUresult call_with_flags(const void *p)
{
    const struct inst_args *a = p;
    return ((cuGraphInstantiateWithFlags_fn)a->real)(a->exec, a->graph, a->flags);
}

static CUresult call_with_params(const void *p)
{
    const struct inst_args *a = p;
    return ((cuGraphInstantiateWithParams_fn)a->real)(a->exec, a->graph, a->params);
}

static CUresult call_v2(const void *p)
{
    const struct inst_args *a = p;
    return ((cuGraphInstantiate_v2_fn)a->real)(a->exec, a->graph, a->err, a->log, a->logsize);
}

/* An instantiation refused before the driver's: what the driver says of a failed one. */
static CUresult refuse(const struct inst_args *a, CUresult rc)
{
    if (a->params) a->params->result_out = CUDA_GRAPH_INSTANTIATE_ERROR;
    if (a->err) *a->err = NULL;
    if (a->log && a->logsize) a->log[0] = '\0';
    return rc;
}

static CUresult instantiate(instantiate_thunk call, const struct inst_args *a, int uploads)
{
    if (!a->real) return CUDA_ERROR_NOT_SUPPORTED;
    /* a driver callback while this thread holds g_mu across a driver call (a graph-memory
     * attribute query), or the pools' lock (a pool's: the lock order puts g_mu first): nothing
     * here waits for g_mu.  Passed through: such a graph's memory is charged by the NVML
     * reconcile only, and its executable's destruction, uploads, launches and trims from there
     * pass through too */
    if (gs_graphmem_passthrough()) return call(a);
    gs_devices_ready();
    struct gs_graph_need need;
    uint64_t reserved[GS_GRAPH_DEVS] = {0};
    /* A graph whose nodes the driver cannot read (a failed cuGraphGetNodes, cuGraphNodeGetType,
     * cuGraphMemAllocNodeGetParams or cuGraphChildGraphNodeGetGraph on the graph the program
     * just built, or no host memory for the walk) is refused with that error, before the driver
     * instantiates anything: its allocations are unknown, so no launch of it could be reserved
     * (instantiated untracked, it launched past the cap: 2.3 GiB held under 1 GiB).  Tracking it
     * as of unknown size and settling after each launch would keep the program going but let
     * its first launch map past the cap, which is what the cap is for. */
    CUresult q = graph_need(a->graph, &need);
    if (q != CUDA_SUCCESS) {
        GS_WARN("graph instantiation refused: its allocation nodes cannot be read (CUDA error %d)", (int)q);
        return refuse(a, q);
    }
    unsigned long long flags = a->params ? a->params->flags : a->flags;
    int device = (flags & CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH) != 0, variable = need.conditional || device;
    if (!need.n) {
        CUresult rc = call(a);
        if (rc == CUDA_SUCCESS && a->exec && variable) variable_note(*a->exec, device);
        return rc;
    }
    if (uploads) { /* mapped while instantiating */
        if (reserve(&need, reserved) != 0) return refuse(a, CUDA_ERROR_OUT_OF_MEMORY);
        gs_unsettled_begin();
    }
    need.auto_free = (flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0;
    CUresult rc = call(a);
    int made = rc == CUDA_SUCCESS && a->exec;
    if (made && variable) variable_note(*a->exec, device);
    if (made && remember(*a->exec, &need) != 0) {
        /* no host memory to remember it: untracked, its launches would map past the cap, so it
         * is undone and refused, as a graph whose nodes cannot be read is */
        GS_WARN("graph instantiation refused: no host memory to track its allocation nodes");
        if (gs_cuda.cuGraphExecDestroy) gs_cuda.cuGraphExecDestroy(*a->exec);
        made = 0;
        rc = refuse(a, CUDA_ERROR_OUT_OF_MEMORY);
    }
    if (uploads) gs_graphmem_after(made ? *a->exec : NULL, &need, reserved, made);
    return rc;
}

GS_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    gs_cuda_init();
    struct inst_args a = {.real = (const void *)gs_cuda.cuGraphInstantiateWithFlags, .exec = phGraphExec,
                          .graph = hGraph, .flags = flags};
    return instantiate(call_with_flags, &a, 0);
}

/* The 5-argument instantiations: CUDA 10.0's cuGraphInstantiate, which the driver still exports
 * (dlsym, or cuGetProcAddress at 10.x), and its _v2 */
static CUresult instantiate_5(const void *real, CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                              char *logBuffer, size_t bufferSize)
{
    struct inst_args a = {.real = real, .exec = phGraphExec, .graph = hGraph, .err = phErrorNode, .log = logBuffer,
                          .logsize = bufferSize};
    return instantiate(call_v2, &a, 0);
}

GS_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                      char *logBuffer, size_t bufferSize)
{
    gs_cuda_init();
    return instantiate_5((const void *)gs_cuda.cuGraphInstantiate, phGraphExec, hGraph, phErrorNode, logBuffer,
                         bufferSize);
}

GS_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                         char *logBuffer, size_t bufferSize)
{
    gs_cuda_init();
    return instantiate_5((const void *)gs_cuda.cuGraphInstantiate_v2, phGraphExec, hGraph, phErrorNode, logBuffer,
                         bufferSize);
}

static CUresult with_params(const void *real, CUgraphExec *phGraphExec, CUgraph hGraph,
                            CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    struct inst_args a = {.real = real, .exec = phGraphExec, .graph = hGraph, .params = params};
    return instantiate(call_with_params, &a, params && (params->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD));
}

GS_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    gs_cuda_init();
    return with_params((const void *)gs_cuda.cuGraphInstantiateWithParams, phGraphExec, hGraph, instantiateParams);
}

GS_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                     CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    gs_cuda_init();
    return with_params((const void *)gs_cuda.cuGraphInstantiateWithParams_ptsz, phGraphExec, hGraph,
                       instantiateParams);
}

static CUresult upload(cuGraphUpload_fn real, CUgraphExec exec, CUstream stream)
{
    if (!real) return CUDA_ERROR_NOT_SUPPORTED;
    if (gs_graphmem_passthrough()) return real(exec, stream); /* see instantiate */
    struct gs_graph_need need;
    uint64_t reserved[GS_GRAPH_DEVS];
    int tracked = gs_graphmem_before(exec, &need, reserved);
    if (tracked < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(exec, stream);
    if (tracked) gs_graphmem_after(exec, &need, reserved, rc == CUDA_SUCCESS);
    return rc;
}

GS_EXPORT CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
{
    gs_cuda_init();
    return upload(gs_cuda.cuGraphUpload, hGraphExec, hStream);
}

GS_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    gs_cuda_init();
    return upload(gs_cuda.cuGraphUpload_ptsz, hGraphExec, hStream);
}

/* The driver may hand the destroyed executable's handle to another thread's instantiation before
 * cuGraphExecDestroy returns: its entry is taken out before the driver's call, so the new
 * executable's is made after it (taken out after, it was the new one's, whose launches then went
 * unreserved), and put back if the destroy fails. */
GS_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    gs_cuda_init();
    if (!gs_cuda.cuGraphExecDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    struct gexec was;
    /* under a lock of ours (see instantiate) its entry stays, replaced if the handle comes back */
    int had = __atomic_load_n(&gs_graph_mem_execs, __ATOMIC_ACQUIRE) && !gs_graphmem_passthrough() &&
              forget(hGraphExec, &was);
    int var = !gs_graphmem_passthrough() && variable_forget(hGraphExec, NULL);
    CUresult rc = gs_cuda.cuGraphExecDestroy(hGraphExec);
    if (rc == CUDA_SUCCESS) gs_launch_cost_forget((uint64_t)(uintptr_t)hGraphExec); /* its handle may come back */
    if (rc != CUDA_SUCCESS && had) put_back(&was);
    if (rc != CUDA_SUCCESS && var) variable_note(hGraphExec, var == 2); /* in the caller's context: near enough */
    return rc;
}

GS_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    gs_cuda_init();
    if (!gs_cuda.cuDeviceGraphMemTrim) return CUDA_ERROR_NOT_SUPPORTED;
    gs_inflight_begin(); /* the pool shrinks before its charge follows */
    CUresult rc = gs_cuda.cuDeviceGraphMemTrim(device);
    if (rc == CUDA_SUCCESS && gs_cuda.cuDeviceGetGraphMemAttribute && !gs_graphmem_passthrough()) { /* see instantiate */
        gs_devices_ready();
        settle(device, 0);
    }
    gs_inflight_end();
    return rc;
}

void gs_graphmem_after_fork_child(void)
{
    pthread_mutex_init(&g_mu, NULL);
    memset(g_claimed, 0, sizeof(g_claimed)); /* the launches in flight were other threads' */
}
