/*
 * pool.c - stream-ordered allocations and memory pools.
 *
 * A pool keeps memory after cuMemFreeAsync and releases it later (at a
 * synchronisation past its release threshold, or on cuMemPoolTrimTo), so what
 * it costs the device is its reserved memory, not what is in use.  Each pool
 * this process allocates from is therefore charged max(reserved, in use):
 *  - before cuMemAllocAsync / cuMemAllocFromPoolAsync the part of the request
 *    the pool's charge does not already cover is reserved;
 *  - after it, the pool's CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT is read and
 *    the charge follows it; if the pool grew past the cap, the allocation is
 *    undone and the caller gets CUDA_ERROR_OUT_OF_MEMORY;
 *  - frees, trims, a refused reservation anywhere, pool destruction (once its
 *    frees are complete: below), and the sampler thread every 500 ms bring the
 *    charge back down to what the pool still reserves (a pool at the driver's default release threshold, 0,
 *    gives its memory back at the next synchronisation, which no hook sees);
 *    never while an allocation from that pool is between its reservation and
 *    its settling (the reservation would go, and another process take it).
 * Allocations on a stream being captured into a graph are graph nodes, not
 * memory: they pass through uncharged (graphmem.c charges graphs).
 * A pool is charged to the device it keeps its memory on, whichever context
 * allocates from it: its own location for a pool this process created
 * (cuMemPoolCreate) or was handed for a location (CUDA 13's cuMemGetDefaultMemPool
 * and cuMemGetMemPool), the device whose default pool it is otherwise; a pool of
 * pinned host memory is not charged.  A managed pool (CUDA 13) with no device for
 * its location is charged to the device of the stream that first allocates from
 * it, as cuMemAllocManaged is to the current one.  cuMemAllocAsync takes its
 * memory from the current pool of the stream's device, which need not be the
 * current context's.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpuslice.h"
#include "throttle.h" /* thr_state: a destroyed stream's entry in the compute limit's table */

#define GS_MAX_POOLS 64

/* A stream a free from the pool was made on (cuMemFreeAsync) that no synchronisation of the stream
 * or of its context has covered since: the free may still be outstanding in the driver.  `ctx` is
 * the stream's context (the current one for the default streams); stream GS_WAIT_CTX: any stream
 * of that context; ctx 0 with it: any context (only where the list could not grow).  `seq`: when it
 * was noted, for a synchronisation under way meanwhile not to cover it */
#define GS_POOL_WAITS 8
#define GS_WAIT_CTX UINT64_MAX
struct pool_wait {
    uint64_t stream, ctx, seq;
};

/* The key of a destroyed pool's record once the pool has no allocation left but frees that may be
 * outstanding (draining): not its handle, which the driver may hand a new pool */
#define GS_DRAINING (1ull << 63)

struct pool_rec {
    uint64_t pool;    /* CUmemoryPool handle, or GS_DRAINING | n; 0 = free entry */
    int slot;
    int destroyed;
    uint64_t live;    /* bytes allocated from it and not freed */
    uint64_t charged; /* bytes charged to the budget for it */
    uint64_t kept;    /* destroyed: its charge at the destroy, which it keeps until its last free completes */
    uint64_t pending; /* bytes requested by allocations inside the driver */
    int busy;         /* allocations from it between their reservation and reconcile */
    int nwait, nroom;
    struct pool_wait *wait; /* nroom entries, allocated; freed with the record */
};

GS_OWNED_LOCK()

/* cuDeviceSetMemPool against the allocations from a device's current pool (cuMemAllocAsync, below) */
static pthread_rwlock_t g_current_rw = PTHREAD_RWLOCK_INITIALIZER;
static __thread unsigned t_current_rw; /* this thread holds g_current_rw (shared or not) */

/* wait entries in all records (the synchronisation hooks look at the pools only while there are
 * any), the sequence they are noted with, and the stream-ordered frees since the last context
 * synchronisation (gs_pools_at_sync); atomic */
int gs_pool_waits;
unsigned gs_pool_frees;
static uint64_t g_wait_seq, g_drain_seq;
/* This thread's per-thread default stream, as a key: a number no other thread's is (not the
 * address of a thread-local, which a new thread's may take from one that ended: its
 * synchronisation then took the frees on the dead thread's stream for complete, 600 MiB
 * returned while outstanding; `test_memory.py -k thread_that_ended`).  A stream handle is a
 * pointer, below this bit */
static __thread uint64_t t_ptds;
static uint64_t g_ptds_seq;
#define GS_PTDS_KEY (1ull << 62)

int gs_pool_lock_mine(void)
{
    return t_mine;
}

static struct pool_rec g_pools[GS_MAX_POOLS];

/* Where pools keep their memory: those this process created, devices' default pools, and
 * the pools cuMemGetDefaultMemPool / cuMemGetMemPool returned (a location's, host ones too). */
struct pool_where {
    uint64_t pool; /* 0 = free entry */
    CUmemLocation location;
    int managed; /* CU_MEM_ALLOCATION_TYPE_MANAGED: its location is only a preference */
};
/* On the heap, grown as needed: a fixed table of 64 left the 65th pool's location unknown, and
 * a pinned host pool's 600 MiB were charged to the GPU (`test_memory.py -k host_pool_past`) */
static struct pool_where *g_where;
static int g_nwhere;

static void wait_put_locked(struct pool_rec *p, struct pool_wait w);

/* A record that holds only a charge until frees complete (draining: a destroyed pool's, or
 * cuMemAlloc pointers freed on a stream) */
static int draining(const struct pool_rec *p)
{
    return (p->pool & GS_DRAINING) && !p->live && !p->busy;
}

/* The table is full: two draining records of one device become one, its charge held until the
 * frees of both are complete (longer for one of them: on the safe side).  Draining records
 * filled it, one per stream a cuMemAlloc pointer was freed on, and a 1 MiB cuMemAllocAsync far
 * under the cap was refused as a 65th pool (`test_memory.py -k freed_on_64_streams`).  The entry
 * freed, or NULL where no two draining records share a device. */
static struct pool_rec *merge_draining_locked(void)
{
    for (int i = 0; i < GS_MAX_POOLS; i++) {
        struct pool_rec *into = &g_pools[i];
        if (!draining(into)) continue;
        for (int j = i + 1; j < GS_MAX_POOLS; j++) {
            struct pool_rec *from = &g_pools[j];
            if (!draining(from) || from->slot != into->slot) continue;
            into->charged += from->charged;
            into->kept += from->kept;
            for (int k = 0; k < from->nwait; k++) wait_put_locked(into, from->wait[k]);
            __atomic_sub_fetch(&gs_pool_waits, from->nwait, __ATOMIC_RELAXED); /* after: never fewer */
            free(from->wait);
            memset(from, 0, sizeof(*from));
            return from;
        }
    }
    return NULL;
}

static struct pool_rec *find_locked(uint64_t pool, int slot, int create)
{
    struct pool_rec *empty = NULL;
    for (int i = 0; i < GS_MAX_POOLS; i++) {
        if (g_pools[i].pool == pool) return &g_pools[i];
        if (!g_pools[i].pool && !empty) empty = &g_pools[i];
    }
    if (create && !empty) empty = merge_draining_locked();
    if (!create || !empty) return NULL;
    memset(empty, 0, sizeof(*empty));
    empty->pool = pool;
    empty->slot = slot;
    return empty;
}

static struct pool_where *where_entry_locked(uint64_t pool)
{
    struct pool_where *w = NULL;
    for (int i = 0; i < g_nwhere && !w; i++)
        if (g_where[i].pool == pool) w = &g_where[i];
    for (int i = 0; i < g_nwhere && !w; i++)
        if (!g_where[i].pool) w = &g_where[i];
    if (!w) {
        int n = g_nwhere ? 2 * g_nwhere : GS_MAX_POOLS;
        struct pool_where *grown = realloc(g_where, (size_t)n * sizeof(*grown));
        if (!grown) return NULL;
        memset(grown + g_nwhere, 0, (size_t)(n - g_nwhere) * sizeof(*grown));
        w = &grown[g_nwhere];
        g_where = grown;
        g_nwhere = n;
    }
    return w;
}

/* 0 if the table is full */
static int remember_where(uint64_t pool, const CUmemLocation *loc, int managed)
{
    mu_lock();
    struct pool_where *w = where_entry_locked(pool);
    if (w) {
        w->pool = pool;
        w->location = *loc;
        w->managed = managed;
    }
    if (managed) __atomic_store_n(&gs_managed_seen, 1, __ATOMIC_RELAXED);
    mu_unlock();
    return w != NULL;
}

/* A pool no hook saw made or handed out: a device's default pool (cuDeviceGetDefaultMemPool is
 * not hooked; cuDeviceGetMemPool returns a device's pool), asked for here. */
static int default_pool_location(uint64_t pool, CUmemLocation *loc, int *managed)
{
    int n = gs_dev_count();
    for (int d = 0; d < n && gs_cuda.cuDeviceGetDefaultMemPool; d++) {
        CUmemoryPool p = NULL;
        if (gs_cuda.cuDeviceGetDefaultMemPool(&p, d) == CUDA_SUCCESS && (uint64_t)(uintptr_t)p == pool) {
            loc->type = CU_MEM_LOCATION_TYPE_DEVICE;
            loc->id = d;
            *managed = 0;
            return 1;
        }
    }
    return 0;
}

/* 1 and *loc if the pool's location is known: created here, handed out by cuMemGetDefaultMemPool
 * or cuMemGetMemPool, or a default pool (a device's is the one cuMemAllocAsync uses unless
 * cuDeviceSetMemPool / cuMemSetMemPool made another current). */
static int pool_location(uint64_t pool, CUmemLocation *loc, int *managed)
{
    mu_lock();
    for (int i = 0; i < g_nwhere; i++)
        if (g_where[i].pool == pool) {
            *loc = g_where[i].location;
            *managed = g_where[i].managed;
            mu_unlock();
            return 1;
        }
    mu_unlock();
    if (!default_pool_location(pool, loc, managed)) return 0;
    remember_where(pool, loc, *managed);
    return 1;
}

/* cuMemGetDefaultMemPool and cuMemGetMemPool (CUDA 13): a pool for a location and allocation
 * type; remembered, so that a host pool's allocations are not charged to a device */
static CUresult remember_location_pool(CUresult rc, CUmemoryPool *pool, const CUmemLocation *location,
                                       CUmemAllocationType type)
{
    if (rc != CUDA_SUCCESS || !pool || !*pool || !location || t_mine) return rc; /* t_mine: see pool_alloc */
    remember_where((uint64_t)(uintptr_t)*pool, location, type == CU_MEM_ALLOCATION_TYPE_MANAGED);
    return rc;
}

GS_EXPORT CUresult cuMemGetDefaultMemPool(CUmemoryPool *pool_out, CUmemLocation *location, CUmemAllocationType type)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemGetDefaultMemPool) return CUDA_ERROR_NOT_SUPPORTED;
    return remember_location_pool(gs_cuda.cuMemGetDefaultMemPool(pool_out, location, type), pool_out, location, type);
}

GS_EXPORT CUresult cuMemGetMemPool(CUmemoryPool *pool, CUmemLocation *location, CUmemAllocationType type)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemGetMemPool) return CUDA_ERROR_NOT_SUPPORTED;
    return remember_location_pool(gs_cuda.cuMemGetMemPool(pool, location, type), pool, location, type);
}

GS_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemPoolCreate) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = gs_cuda.cuMemPoolCreate(pool, poolProps);
    if (rc != CUDA_SUCCESS || !pool || !poolProps || t_mine) return rc; /* t_mine: see pool_alloc */
    uint64_t key = (uint64_t)(uintptr_t)*pool;
    if (!remember_where(key, &poolProps->location, poolProps->allocType == CU_MEM_ALLOCATION_TYPE_MANAGED))
        GS_WARN("no host memory to note a memory pool's location: it is charged to the allocating stream's device");
    /* a destroyed pool's handle handed out again: the new pool's reserved memory counts
     * (what the old one still has allocated stays in the record: charged, on the safe side) */
    mu_lock();
    struct pool_rec *old = find_locked(key, -1, 0);
    if (old) old->destroyed = 0;
    mu_unlock();
    return rc;
}

/* Bring the charge to max(reserved, live).  May reserve more only if `grow`;
 * returns -1 if that reservation was refused.  grow 2: charged whatever the cap (memory the
 * pool holds and cannot give back: see pool_alloc's undo). */
static int reconcile_locked(struct pool_rec *p, int grow)
{
    cuuint64_t reserved = 0;
    uint64_t target = p->live;
    if (p->destroyed && (p->live || p->nwait)) {
        /* the driver keeps a destroyed pool until its last allocation goes and the frees from it
         * are complete; not p->charged, which may hold the reservation of a (failing) allocation
         * from it since */
        target = p->kept;
    } else if (!p->destroyed) {
        if (gs_cuda.cuMemPoolGetAttribute &&
            gs_cuda.cuMemPoolGetAttribute((CUmemoryPool)(uintptr_t)p->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                                          &reserved) == CUDA_SUCCESS) {
            if (reserved > target) target = reserved;
        } else if (p->charged > target) {
            target = p->charged; /* the pool's size is unknown: it may still hold what was charged */
        }
    }
    if (target > p->charged) {
        if (!grow) return 0;
        if (grow == 2)
            gs_budget_force(p->slot, target - p->charged);
        else if (gs_budget_reserve(p->slot, target - p->charged) != 0)
            return -1;
        p->charged = target;
    } else if (target < p->charged && !p->busy) {
        gs_budget_release(p->slot, p->charged - target);
        p->charged = target;
    }
    if (p->destroyed && !p->live && !p->busy && p->nwait) {
        if (!(p->pool & GS_DRAINING)) p->pool = GS_DRAINING | ++g_drain_seq; /* its handle may go to a new pool */
    } else if (p->destroyed && !p->live && !p->busy) {
        gs_budget_release(p->slot, p->charged);
        free(p->wait);
        memset(p, 0, sizeof(*p));
    }
    return 0;
}

/* ---- frees that may be outstanding ---------------------------------------------------------
 * A free is stream-ordered: the driver frees the memory when the stream reaches it, and a pool
 * destroyed before that keeps all its memory until then (cuMemPoolDestroy's documentation: "the
 * resources associated with the pool will be released automatically once there are no more
 * outstanding allocations").  So each pool remembers the streams its frees were made on until a
 * synchronisation covers them: of that stream (cuStreamSynchronize) or of its context
 * (cuCtxSynchronize, or the context's end).  An event's synchronisation covers whatever stream
 * the event was recorded on, which no hook tells: it covers none.  A destroyed pool keeps its
 * charge until its last allocation is freed and no stream of its frees is left (released at
 * the destroy, 608 MiB were held uncharged until the program synchronised: a 900 MiB allocation
 * passed a 1 GiB cap; or the near-cap reconcile charged them as growth no hook saw, then 608 MiB
 * charged for nothing once the driver had freed them; test_memory.py -k frees_are_outstanding). */

/* The key of stream es (a call's effective stream): the legacy default stream whatever its
 * handle, each thread's own per-thread default stream */
static uint64_t wait_stream(CUstream es)
{
    if (!es || es == CU_STREAM_LEGACY) return (uint64_t)(uintptr_t)CU_STREAM_LEGACY;
    if (es == CU_STREAM_PER_THREAD) {
        if (!t_ptds) t_ptds = GS_PTDS_KEY | __atomic_add_fetch(&g_ptds_seq, 1, __ATOMIC_RELAXED);
        return t_ptds; /* the dead thread's frees: its context's synchronisation covers them */
    }
    return (uint64_t)(uintptr_t)es;
}

/* Its context: its own, the current one for the default streams */
static uint64_t wait_ctx(CUstream es)
{
    CUcontext c = gs_stream_ctx(es);
    if (!c && (!gs_cuda.cuCtxGetCurrent || gs_cuda.cuCtxGetCurrent(&c) != CUDA_SUCCESS)) c = NULL;
    return (uint64_t)(uintptr_t)c;
}

/* 1 if w is merged into an entry that stands for it */
static int wait_merge_locked(struct pool_rec *p, struct pool_wait w)
{
    for (int i = 0; i < p->nwait; i++)
        if ((p->wait[i].stream == w.stream || p->wait[i].stream == GS_WAIT_CTX) &&
            (p->wait[i].ctx == w.ctx || (!p->wait[i].ctx && p->wait[i].stream == GS_WAIT_CTX))) {
            if (w.seq > p->wait[i].seq) p->wait[i].seq = w.seq;
            return 1;
        }
    return 0;
}

static void wait_put_locked(struct pool_rec *p, struct pool_wait w)
{
    if (wait_merge_locked(p, w)) return;
    if (p->nwait == p->nroom && p->nroom) {
        /* full: each stream stands for its context (noted as late as the latest) */
        int n = p->nwait, k = 0;
        for (int i = 0; i < n; i++) w.seq = p->wait[i].seq > w.seq ? p->wait[i].seq : w.seq;
        for (int i = 0; i < n; i++) {
            uint64_t ctx = p->wait[i].ctx;
            int j = 0;
            while (j < k && p->wait[j].ctx != ctx) j++;
            if (j == k) p->wait[k++] = (struct pool_wait){GS_WAIT_CTX, ctx, w.seq};
        }
        __atomic_sub_fetch(&gs_pool_waits, n - k, __ATOMIC_RELAXED);
        p->nwait = k;
        w.stream = GS_WAIT_CTX;
        if (wait_merge_locked(p, w)) return;
    }
    if (p->nwait == p->nroom) {
        /* as many contexts as entries: room for more.  Not "any context" for all, which the
         * synchronisation of one context cleared while the others' frees were outstanding (nine
         * contexts' frees, one synchronised: 0 charged for a destroyed pool's 544 MiB, and a
         * 900 MiB allocation passed beside them, 1444 MiB held under a 1 GiB cap;
         * test_memory.py -k more_contexts_than_it_remembers) */
        int room = p->nroom ? 2 * p->nroom : GS_POOL_WAITS;
        struct pool_wait *more = realloc(p->wait, (size_t)room * sizeof(*more));
        if (more) {
            p->wait = more;
            p->nroom = room;
        } else if (!p->nroom) {
            return; /* no memory: the free is not waited for */
        } else { /* no memory: any context for all */
            for (int i = 0; i < p->nwait; i++) w.seq = p->wait[i].seq > w.seq ? p->wait[i].seq : w.seq;
            __atomic_sub_fetch(&gs_pool_waits, p->nwait, __ATOMIC_RELAXED);
            p->nwait = 0;
            w = (struct pool_wait){GS_WAIT_CTX, 0, w.seq};
        }
    }
    p->wait[p->nwait++] = w;
    __atomic_add_fetch(&gs_pool_waits, 1, __ATOMIC_RELAXED);
}

/* `bytes` allocated from the pool are no longer: its charge follows (reconcile_locked's `grow`;
 * 2, the undo's, only while no other allocation from it is in flight: pool_alloc).  Freed on a
 * stream (`freed`, es its effective stream): the free is noted until a synchronisation covers it. */
static void pool_drop(uint64_t pool, uint64_t bytes, int grow, int freed, CUstream es)
{
    struct pool_wait w = {0};
    if (freed) w = (struct pool_wait){wait_stream(es), wait_ctx(es), 0};
    mu_lock();
    struct pool_rec *p = find_locked(pool, -1, 0);
    if (p) {
        if (freed) {
            w.seq = __atomic_add_fetch(&g_wait_seq, 1, __ATOMIC_ACQ_REL);
            wait_put_locked(p, w);
        }
        p->live = p->live > bytes ? p->live - bytes : 0;
        reconcile_locked(p, grow == 2 && p->busy ? 0 : grow);
    }
    mu_unlock();
}

/* A destroyed pool's record taken out with frees that may be outstanding: charged, under a key of
 * its own, until they are complete */
static void drain_locked(const struct pool_rec *gone)
{
    struct pool_rec *d = find_locked(GS_DRAINING | ++g_drain_seq, gone->slot, 1);
    if (!d) { /* the table is full: the reconcile's to charge, near the cap */
        gs_budget_release(gone->slot, gone->charged);
        return;
    }
    d->destroyed = 1;
    d->charged = d->kept = gone->charged;
    for (int i = 0; i < gone->nwait; i++) wait_put_locked(d, gone->wait[i]);
}

/* A cuMemAlloc pointer of `bytes` charged to slot, freed on stream es (cuMemFreeAsync takes one):
 * "the underlying memory is not freed until the next synchronization of the stream passed to
 * cudaFreeAsync" (the runtime's notes on the stream-ordered allocator), so its charge is held as a
 * destroyed pool's is, until a synchronisation covers the free: in a draining record of its device's,
 * one for all such frees (returned at the free, the 600 MiB it still held beside a 900 MiB
 * allocation made 1500 MiB under a 1 GiB cap; test_memory.py -k cumemalloc_pointer_freed_on_a_stream) */
static void plain_free_held(int slot, uint64_t bytes, CUstream es, uint64_t alloc_ctx)
{
    struct pool_wait w = {wait_stream(es), wait_ctx(es), 0};
    if (!w.ctx) w.ctx = alloc_ctx; /* no context current: the pointer's own */
    mu_lock();
    /* joined to a record only if its frees are all on that stream, so that they complete together:
     * one record for every such free kept each stream's frees charged until every stream's were
     * complete (two streams taking turns, each synchronised after the other's free: 400, 600, 800,
     * 1000 MiB charged for 200 held, and a 200 MiB allocation refused under a 1 GiB cap;
     * test_memory.py -k taking_turns) */
    struct pool_rec *d = NULL;
    for (int i = 0; i < GS_MAX_POOLS && !d; i++) {
        struct pool_rec *p = &g_pools[i];
        if (!(p->pool & GS_DRAINING) || p->slot != slot || !p->nwait) continue;
        int same = 1;
        for (int j = 0; j < p->nwait && same; j++) same = p->wait[j].stream == w.stream && p->wait[j].ctx == w.ctx;
        if (same) d = p;
    }
    if (!d) d = find_locked(GS_DRAINING | ++g_drain_seq, slot, 1);
    if (!d) { /* the table is full: returned now, the reconcile's to charge near the cap */
        mu_unlock();
        gs_budget_release(slot, bytes);
        return;
    }
    d->destroyed = 1;
    d->charged += bytes;
    d->kept += bytes;
    w.seq = __atomic_add_fetch(&g_wait_seq, 1, __ATOMIC_ACQ_REL);
    wait_put_locked(d, w);
    if (!d->nwait) reconcile_locked(d, 0); /* no memory to note the free: returned now */
    mu_unlock();
}

/* The frees made on stream `stream` of context ctx (stream GS_WAIT_CTX: on any stream of it)
 * and noted before `seq` are complete: destroyed pools left with none give their charge back */
static void waits_done(uint64_t stream, uint64_t ctx, uint64_t seq)
{
    mu_lock();
    for (int i = 0; i < GS_MAX_POOLS; i++) {
        struct pool_rec *p = &g_pools[i];
        if (!p->pool || !p->nwait) continue;
        int k = 0;
        for (int j = 0; j < p->nwait; j++) {
            struct pool_wait w = p->wait[j];
            int done = w.seq < seq && (stream == GS_WAIT_CTX ? w.ctx == ctx || (!w.ctx && w.stream == GS_WAIT_CTX)
                                                             : w.stream == stream && w.ctx == ctx);
            if (!done) p->wait[k++] = w;
        }
        __atomic_sub_fetch(&gs_pool_waits, p->nwait - k, __ATOMIC_RELAXED);
        p->nwait = k;
        if (!k && p->destroyed) reconcile_locked(p, 0);
    }
    mu_unlock();
}

void gs_pools_before_sync(struct gs_pool_sync *ps)
{
    ps->seq = __atomic_load_n(&g_wait_seq, __ATOMIC_ACQUIRE) + 1; /* what was noted so far */
    ps->frees = __atomic_load_n(&gs_pool_frees, __ATOMIC_ACQUIRE);
}

void gs_pools_after_sync(const struct gs_pool_sync *ps, int what, CUcontext ctx, CUstream stream, int per_thread)
{
    if (gs_t_held) return; /* a driver callback under a lock of ours: the frees stay noted */
    if (__atomic_load_n(&gs_pool_waits, __ATOMIC_RELAXED) && what != GS_SYNC_EVENT) {
        if (what != GS_SYNC_CTX) {
            CUstream es = gs_effective_stream(stream, per_thread);
            waits_done(wait_stream(es), wait_ctx(es), ps->seq);
        } else if (ctx || (gs_cuda.cuCtxGetCurrent && gs_cuda.cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx)) {
            waits_done(GS_WAIT_CTX, (uint64_t)(uintptr_t)ctx, ps->seq);
        }
    }
    if (ps->frees) {
        /* pools give memory back at synchronisations: what the reconcile charged as growth no hook
         * saw may have been some (a pool the library could not ask for), measured again.  Once the
         * frees are complete: the sampler woken before, a reading while a free's charge was still
         * held could not lower the charge and left it to the next round, 500 ms on (212 MiB
         * charged with nothing held, 1000 MiB refused under 1 GiB; test_memory.py -k
         * measured_once_its_frees_are_complete) */
        gs_reconcile_remeasure_given_back();
        unsigned seen = ps->frees;
        if (what == GS_SYNC_CTX)
            __atomic_compare_exchange_n(&gs_pool_frees, &seen, 0, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
}

/* A stream is destroyed: its frees complete once its work does, which no synchronisation of a stream
 * observes, and the driver may hand its handle to a new stream, whose synchronisation does not wait for
 * the old one's work.  So what was noted on it waits for its context's synchronisation from now on
 * (left under its handle, a new stream's synchronisation took a destroyed pool's 608 MiB for freed:
 * a 900 MiB allocation passed, 1508 MiB held under a 1 GiB cap; test_memory.py -k destroyed_stream).
 * Before the driver's call: once it returns the handle may be another stream's. */
static void stream_gone(CUstream s)
{
    if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD || t_mine ||
        !__atomic_load_n(&gs_pool_waits, __ATOMIC_RELAXED))
        return;
    uint64_t key = (uint64_t)(uintptr_t)s;
    mu_lock();
    for (int i = 0; i < GS_MAX_POOLS; i++) {
        struct pool_rec *p = &g_pools[i];
        if (!p->pool || !p->nwait) continue;
        struct pool_wait moved[GS_POOL_WAITS];
        int k = 0, n = 0;
        for (int j = 0; j < p->nwait; j++) {
            struct pool_wait w = p->wait[j];
            if (w.stream == key && n < GS_POOL_WAITS)
                moved[n++] = (struct pool_wait){GS_WAIT_CTX, w.ctx, w.seq};
            else
                p->wait[k++] = w;
        }
        __atomic_sub_fetch(&gs_pool_waits, p->nwait - k, __ATOMIC_RELAXED);
        p->nwait = k;
        for (int j = 0; j < n; j++) wait_put_locked(p, moved[j]); /* room: as many went */
    }
    mu_unlock();
}

/* Before the driver's destroy (it may hand the handle to a new stream at once): the stream's
 * pending frees wait on its context from now on, and its throttle entry goes */
static void stream_destroying(CUstream s)
{
    stream_gone(s);
    if (__atomic_load_n(&thr_state, __ATOMIC_RELAXED) == THROTTLE_ON) gs_launch_stream_gone(s);
}

GS_EXPORT CUresult cuStreamDestroy(CUstream hStream)
{
    gs_cuda_init();
    if (!gs_cuda.cuStreamDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    stream_destroying(hStream);
    CUresult rc = gs_cuda.cuStreamDestroy(hStream);
    if (rc == CUDA_SUCCESS) thr_capture_stream_destroyed(hStream);
    return rc;
}

GS_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream)
{
    gs_cuda_init();
    if (!gs_cuda.cuStreamDestroy_v2) return CUDA_ERROR_NOT_SUPPORTED;
    stream_destroying(hStream);
    CUresult rc = gs_cuda.cuStreamDestroy_v2(hStream);
    if (rc == CUDA_SUCCESS) thr_capture_stream_destroyed(hStream);
    return rc;
}

/* A context went: its streams' frees went with it (under the context lock) */
void gs_pools_ctx_gone(CUcontext ctx)
{
    if (ctx && __atomic_load_n(&gs_pool_waits, __ATOMIC_RELAXED) && !t_mine)
        waits_done(GS_WAIT_CTX, (uint64_t)(uintptr_t)ctx, UINT64_MAX);
}

static int pool_reserved(CUmemoryPool pool, cuuint64_t *bytes)
{
    return gs_cuda.cuMemPoolGetAttribute &&
           gs_cuda.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, bytes) == CUDA_SUCCESS;
}

/* 1 if an allocation of `bytes` cannot come from what the pool holds free, so the driver must
 * grow it (a probe for the host pid can see that growth); *reserved is the pool's size. */
static int pool_must_grow(CUmemoryPool pool, size_t bytes, cuuint64_t *reserved)
{
    cuuint64_t used = 0;
    return pool_reserved(pool, reserved) &&
           gs_cuda.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) == CUDA_SUCCESS &&
           used <= *reserved && *reserved - used < bytes;
}

static void reconcile_all_locked(void)
{
    for (int i = 0; i < GS_MAX_POOLS; i++)
        if (g_pools[i].pool) reconcile_locked(&g_pools[i], 0);
}

/* 1 if a charge of slot's is held for frees no synchronisation has covered yet (a destroyed pool's,
 * cuMemAlloc pointers freed on a stream): the driver may give their memory back before the
 * synchronisation that returns the charge (a stream's work passing the free, the synchronisation's
 * own call), and a re-measurement then would take the memory still charged as untracked memory
 * gone: 144 MiB charged for 400 held once the sync returned the 256 (test_reconcile.py -k
 * memory_gone_inside_the_sync).  A mutex and 64 entries, only while such waits are noted. */
int gs_pools_held_for_frees(int slot)
{
    if (!__atomic_load_n(&gs_pool_waits, __ATOMIC_RELAXED)) return 0;
    if (t_mine) return 1; /* a driver callback inside a pool call of this thread's: cannot look */
    int held = 0;
    mu_lock();
    for (int i = 0; i < GS_MAX_POOLS && !held; i++)
        held = g_pools[i].pool && g_pools[i].destroyed && g_pools[i].nwait && g_pools[i].charged &&
               g_pools[i].slot == slot;
    mu_unlock();
    return held;
}

void gs_pools_reconcile_all(void)
{
    mu_lock();
    reconcile_all_locked();
    mu_unlock();
}

/* The driver grows a pool by whole chunks: an allocation that must grow its pool reserves up to
 * the next multiple of this beyond what the pool's allocations need (once settled, the charge
 * follows the pool's real size).  32 MiB on the H200 (driver 580.159.04): 32/32/32/64/160 MiB
 * reserved for 1/2/10/50/150 MiB held (the GPU check's pool_chunk row) */
#define GS_POOL_CHUNK (32ull << 20)

/* Reserve the part of an allocation of `want` bytes from p that p's charge does not cover yet
 * (beside the other allocations from it still inside the driver) with the rest of the chunk the
 * pool may grow by, or nothing: noticed only after the driver's call, the chunk was free for
 * others to take meanwhile (an 8 MiB allocation grows the pool by 32: a 1016 MiB allocation
 * beside it passed, 1048 MiB held under a 1 GiB cap, 24 MiB more for every pool growing at
 * once; taking only what the cap left of the chunk, pools growing at the cap at once still
 * added up, 32 MiB over in a stress).  A request the pool's charge already covers reserves its
 * chunk only where it fits (the pool has room, or its charge a driver's finer size).  A refusal
 * first brings the pools' charges down to what they still hold, p's too, so the part is worked
 * out again after it (worked out before, the part stayed as it was while p's charge dropped:
 * 92 MiB reserved for a pool that grew by 704, and 1604 MiB held under a 1 GiB cap
 * meanwhile).  Near the cap a growth is reserved with `gap` on top (what the process holds
 * uncharged, as memory.c's gs_reserve_near), which the caller returns once the pool's charge
 * has followed the driver's call (where *took is not 0).  -1 if refused; *took: what was added
 * to p's charge. */
static uint64_t chunks(uint64_t need)
{
    return need > UINT64_MAX - GS_POOL_CHUNK ? need : (need + GS_POOL_CHUNK - 1) & ~(GS_POOL_CHUNK - 1);
}

static int reserve_for_locked(struct pool_rec *p, uint64_t want, uint64_t gap, uint64_t *took)
{
    *took = 0;
    for (int tries = 0;; tries++) {
        uint64_t need = gs_add_sat(gs_add_sat(p->live, p->pending), want);
        uint64_t whole = chunks(need);
        uint64_t more = whole > p->charged ? whole - p->charged : 0;
        if (gs_budget_reserve(p->slot, more ? gs_add_sat(more, gap) : 0) == 0) { /* no growth, nothing held */
            p->charged += more;
            *took = more;
            return 0;
        }
        if (need <= p->charged) return 0;
        if (tries) return -1;
        reconcile_all_locked();
    }
}

void gs_pool_drop_ptr(uint64_t pool, uint64_t bytes)
{
    pool_drop(pool, bytes, 0, 0, NULL);
}

void gs_pools_after_fork_child(void)
{
    pthread_mutex_init(&g_mu, NULL);
    pthread_rwlock_init(&g_current_rw, NULL);
    memset(g_pools, 0, sizeof(g_pools));
    if (g_where) memset(g_where, 0, (size_t)g_nwhere * sizeof(*g_where));
    gs_pool_waits = gs_pool_frees = 0;
}

typedef CUresult (*alloc_call)(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream,
                               const void *real);

static CUresult call_alloc_async(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream,
                                 const void *real)
{
    (void)pool;
    return ((cuMemAllocAsync_fn)real)(dptr, bytesize, stream);
}

static CUresult call_alloc_from_pool(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream,
                                     const void *real)
{
    return ((cuMemAllocFromPoolAsync_fn)real)(dptr, bytesize, pool, stream);
}

/* cuMemAllocAsync on a stream whose device could not be read (a driver before CUDA 12.8 tells
 * the current context's device only, and the switch to the stream's context was refused:
 * gs_stream_device) is reserved on the current device, a guess.  Once the pointer exists the
 * driver tells its device (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, older than stream-ordered
 * allocation), and the charge moves there.  The guess stood: the stream's device's reconcile
 * charged the same memory again as growth no hook saw (3 GiB on a stream of device 1 under
 * device 0's context: 3 GiB charged to each, 6 GiB for 3 held under a 4 GiB cap;
 * test_memory.py -k charged_once_when_the_sampler_measures), and a device with no room for it
 * took it anyway (5 GiB held under its 4 GiB cap; -k past_its_devices_cap).  Returns the slot of
 * the pointer's device where it is another charged one than guess_slot, with *pool (if asked
 * for) that device's current pool, the one the allocation came from (cuDeviceSetMemPool waits
 * for it: alloc_from_current); -1 to keep the guess (no answer: charged as before, to the
 * current device, rather than not at all). */
static int actual_slot(CUdeviceptr dptr, int guess_slot, CUmemoryPool *pool)
{
    int ord = -1, slot;
    if (!gs_cuda.cuPointerGetAttribute ||
        gs_cuda.cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dptr) != CUDA_SUCCESS ||
        (slot = gs_dev_slot(ord)) < 0 || slot == guess_slot)
        return -1;
    if (pool && (!gs_cuda.cuDeviceGetMemPool || gs_cuda.cuDeviceGetMemPool(pool, ord) != CUDA_SUCCESS || !*pool))
        return -1;
    return slot;
}

/* cuMemAllocAsync when the stream's device's current pool cannot be asked for
 * (cuDeviceGetMemPool failed): charged as a plain allocation, its size reserved before the call
 * and returned at its free (reserving nothing let it pass uncharged: two 600 MiB allocations
 * held 1.2 GiB under a 1 GiB cap).  What the pool keeps beyond it (its rounding, and the memory
 * after the free until the pool releases it) no hook sees: the near-cap reconcile charges it as
 * growth, as it does code loaded lazily. */
static CUresult alloc_unknown_pool(alloc_call call, const void *real, cuMemFreeAsync_fn free_real, CUdeviceptr *dptr,
                                   size_t bytesize, CUmemoryPool pool, CUstream stream, int slot, CUcontext ctx,
                                   int guessed)
{
    uint64_t want = gs_charge_size(bytesize), held = want;
    gs_inflight_begin(); /* before the charge changes: no clean reading between */
    if (GS_UNLIKELY(gs_near_cap(slot, want))) { /* on top of what the process holds uncharged, as pool_alloc */
        gs_reconcile_slot_reserving(slot);
        held = gs_add_sat(want, gs_reconcile_gap(slot));
    }
    if (gs_reserve_raw(slot, held) != 0) {
        gs_inflight_end();
        GS_INFO("pool allocation of %llu bytes refused: over the cap", (unsigned long long)bytesize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult rc = call(dptr, bytesize, pool, stream, real);
    if (GS_UNLIKELY(held != want)) gs_budget_release(slot, held - want); /* the gap's headroom */
    int to = rc == CUDA_SUCCESS && guessed ? actual_slot(*dptr, slot, NULL) : -1;
    if (to >= 0 && gs_reserve_raw(to, want) != 0) { /* another device's (actual_slot), with no room */
        if (free_real) free_real(*dptr, stream);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (to >= 0) {
        gs_budget_release(slot, want);
        slot = to;
        CUcontext owner = gs_stream_ctx(stream);
        if (owner) ctx = gs_ctx_canonical(owner);
    }
    if (rc == CUDA_SUCCESS) {
        struct gs_alloc rec = {.size = want, .slot = slot, .ctx = (uint64_t)(uintptr_t)ctx}, old;
        int put = gs_am_put(GS_KIND_DPTR, *dptr, &rec, &old); /* pool_free and cuMemFree take it */
        if (put == 1) gs_budget_release(old.slot, old.size); /* a record the driver's reuse made stale */
        if (put < 0) {
            if (free_real) free_real(*dptr, stream);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (rc != CUDA_SUCCESS) gs_budget_release(slot, want);
    gs_inflight_end();
    return rc;
}

/* A pool allocation whose teardown began after pool_alloc's look at the counter and before its
 * record existed (as memory.c's gs_settle_after_record): the teardown's forget missed the record,
 * whose bytes stayed in the pool's live bytes, charged for memory the teardown freed; or it took
 * the record (its bytes off) while the driver still holds the memory.  Under the context lock,
 * after the teardown, by whether the driver still holds the pointer.  Not from a driver
 * callback (t_mine: see pool_alloc). */
__attribute__((noinline)) static void settle_after_record(const struct gs_alloc *rec, CUdeviceptr dptr)
{
    int locked = gs_ctx_lock() == 0; /* not from inside a context call of this thread */
    struct gs_alloc now, old;
    if (gs_dptr_gone(dptr)) {
        if (gs_am_take(GS_KIND_POOLPTR, dptr, &now) == 0) { /* else the forget took it */
            gs_pool_drop_ptr(now.aux, now.size);
            GS_INFO("a pool allocation booked as its context went: gone with it, its charge returned");
        }
    } else if (!gs_am_has(GS_KIND_POOLPTR, dptr)) {
        mu_lock();
        struct pool_rec *p = find_locked(rec->aux, rec->slot, 0);
        if (p) {
            p->live += rec->size;
            reconcile_locked(p, 0);
        }
        mu_unlock();
        if (p && gs_am_put(GS_KIND_POOLPTR, dptr, rec, &old) == 1) gs_pool_drop_ptr(old.aux, old.size);
        GS_INFO("a pool allocation booked as its context went: held, its record booked again");
    }
    if (locked) gs_ctx_unlock();
}

static CUresult pool_alloc(alloc_call call, const void *real, cuMemFreeAsync_fn free_real, CUdeviceptr *dptr,
                           size_t bytesize, CUmemoryPool pool, CUstream stream, int per_thread)
{
    if (!real) return CUDA_ERROR_NOT_SUPPORTED;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    /* a driver callback while this thread holds g_mu across a driver call (a pool's attribute
     * query): nothing here waits for g_mu.  Passed through uncharged: the pool's growth is
     * charged at its next reconcile; frees, trims and destruction from there pass through too
     * (a freed pointer's record stays until its address is reused, on the safe side) */
    if (t_mine) return call(dptr, bytesize, pool, stream, real);
    gs_devices_ready();
    CUcontext ctx;
    CUdevice dev;
    CUstream es = gs_effective_stream(stream, per_thread);
    int slot = gs_stream_device(es, &ctx, &dev) == 0 ? gs_dev_slot(dev) : -1, guessed = 0;
    if (slot < 0 && gs_cuda.cuCtxGetDevice && gs_cuda.cuCtxGetDevice(&dev) == CUDA_SUCCESS) {
        slot = gs_current_slot(&ctx); /* the stream's device unknown: charged to the current one */
        guessed = !pool;              /* cuMemAllocAsync: its pool too (corrected after the call) */
    }
    int unknown = 0; /* cuMemAllocAsync, the stream's device's current pool not known */
    if (!pool && slot >= 0) { /* cuMemAllocAsync: the stream's device's current pool */
        unknown = !gs_cuda.cuDeviceGetMemPool || gs_cuda.cuDeviceGetMemPool(&pool, dev) != CUDA_SUCCESS || !pool;
        if (unknown) pool = NULL;
    }
    CUmemLocation loc;
    int managed = 0;
    CUdevice mem_dev = slot >= 0 ? dev : -1; /* the device whose memory it takes */
    if (pool && pool_location((uint64_t)(uintptr_t)pool, &loc, &managed)) {
        /* the pool's device, a locality domain's pool (CUDA 13.4) its device's too (taken for a
         * host pool, 1.2 GiB held under a 1 GiB cap, `test_memory.py -k locality_domain`); or
         * host memory, not charged.  Else (managed memory without a device of its own, or a
         * location newer than the library) the stream's device's, as cuMemAllocManaged is
         * charged to the current one (it may all migrate there) */
        CUdevice at = gs_location_device(&loc);
        if (at >= 0 || (at == -1 && !managed)) {
            slot = at >= 0 ? gs_dev_slot(at) : -1;
            mem_dev = at;
        }
    }
    /* on a stream being captured into a graph the allocation is a graph node: it takes
     * memory only when the graph runs, and graphmem.c charges it then */
    if (slot < 0 || !bytesize || gs_stream_capturing(es) || (!pool && !unknown))
        return call(dptr, bytesize, pool, stream, real);
    if (unknown) return alloc_unknown_pool(call, real, free_real, dptr, bytesize, NULL, stream, slot, ctx, guessed);

    uint64_t key = (uint64_t)(uintptr_t)pool, want = gs_charge_size(bytesize), gap = 0;
    if (GS_UNLIKELY(gs_near_cap(slot, want))) {
        gs_reconcile_slot(slot); /* before g_mu: lock order */
        /* its growth on top of what the process holds uncharged (under the reconcile's noise
         * threshold), as memory.c's gs_reserve_near: reserved against the cap alone, an 896 MiB
         * pool growth beside a 4 KiB array's 2 MiB page and a 127 MiB context held 1025 MiB
         * under a 1 GiB cap (`test_near_cap_growth.py -k pool_growing`) */
        gap = gs_reconcile_gap(slot);
    }
    mu_lock();
    struct pool_rec *p = find_locked(key, slot, 1);
    if (!p) {
        /* more pools in use than the table holds: charged by its size as a plain allocation, what
         * the pool keeps beyond it left to the near-cap reconcile (refused, the 65th pool's 1 MiB
         * failed with 2 GiB of a 10 GiB cap in use; `test_memory.py -k 65th_pool`) */
        static int warned;
        mu_unlock();
        if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
            GS_WARN("more than %d memory pools in use in one process: allocations from the others are charged "
                    "by their size, what those pools keep beyond it only near the cap", GS_MAX_POOLS);
        return alloc_unknown_pool(call, real, free_real, dptr, bytesize, pool, stream, slot, ctx, guessed);
    }
    uint64_t took;
    if (reserve_for_locked(p, want, gap, &took) != 0) {
        mu_unlock();
        GS_INFO("pool allocation of %llu bytes refused: over the cap", (unsigned long long)bytesize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    p->pending += want;
    p->busy++;
    mu_unlock();
    gs_sampler_start(); /* it returns what pools give back at synchronisations (one load once running) */

    gs_unsettled_begin(); /* the pool may grow by more than was reserved until reconcile_locked */
    cuuint64_t was = 0;
    int probe = GS_UNLIKELY(__atomic_load_n(&gs_pid_unknown, __ATOMIC_RELAXED)) && pool_must_grow(pool, bytesize, &was);
    if (probe) {
        gs_inflight_begin();
        if (!(probe = gs_pid_probe_begin(mem_dev, 0, 1))) gs_inflight_end();
    }
    unsigned seq0 = gs_teardown_seq();
    CUresult rc = call(dptr, bytesize, pool, stream, real);
    if (probe) {
        cuuint64_t now = 0;
        int grew = rc == CUDA_SUCCESS && pool_reserved(pool, &now) && now > was;
        gs_pid_probe_end(grew, grew ? now - was : 0, 1);
        gs_inflight_end();
    }
    /* a context of the process went while it was inside the driver (as memory.c's
     * gs_record_after_teardown): booked under the context lock, after the teardown forgot what its
     * context held, and not at all if the driver says the pointer went with it (taken before a
     * primary reset or last release, booked after it: its 200 MiB stayed in the pool's live
     * bytes, 250 MiB charged for 50 held).  A driver that cannot tell a live pool allocation
     * from a gone one costs nothing: the pool's charge follows its reserved memory */
    int locked = 0, gone = 0, after = rc == CUDA_SUCCESS && gs_teardown_since(seq0);
    if (after) {
        locked = gs_ctx_lock() == 0; /* not from inside a context call of this thread */
        gone = gs_dptr_gone(*dptr);
    }
    /* the current device guessed wrong: the allocation is the stream's device's, from its current
     * pool, and booked there instead (see actual_slot) */
    CUmemoryPool actual = NULL;
    int to = rc == CUDA_SUCCESS && guessed ? actual_slot(*dptr, slot, &actual) : -1;
    if (to >= 0 && (uint64_t)(uintptr_t)actual == key) to = -1;
    struct gs_alloc rec = {.size = bytesize, .aux = key, .slot = slot, .ctx = (uint64_t)(uintptr_t)ctx}, old;
    mu_lock();
    p = find_locked(key, slot, 0); /* kept while busy */
    int grown = -1;
    if (p) {
        p->busy--;
        p->pending -= want;
        if (rc == CUDA_SUCCESS && !gone && to < 0) p->live += bytesize;
        cuuint64_t size;
        if (rc != CUDA_SUCCESS && took && !p->destroyed && !pool_reserved(pool, &size)) {
            /* refused, and the pool's size unknown (a destroyed pool's handle, a context in a
             * sticky error): the reconcile keeps the charge, which the pool may hold, but not
             * what this request reserved for growth the driver did not make (kept, a destroyed
             * pool's handle allocated from again left 320 MiB charged for nothing for good;
             * test_memory.py -k refused_with_the_pool_size_unknown); down to the chunks of what
             * the pool's other allocations hold and ask for */
            uint64_t floor = chunks(gs_add_sat(p->live, p->pending));
            uint64_t back = p->charged > floor ? p->charged - floor : 0;
            if (back > took) back = took;
            gs_budget_release(p->slot, back);
            p->charged -= back;
        }
        int pslot = p->slot;
        grown = reconcile_locked(p, rc == CUDA_SUCCESS && !gone && to < 0); /* moved: its reservation goes */
        if (GS_UNLIKELY(gap) && took) gs_budget_release(pslot, gap); /* the gap's headroom: the charge has followed */
    }
    if (to >= 0) { /* reserved against that device's cap in one step: refused, undone below */
        struct pool_rec *q = find_locked((uint64_t)(uintptr_t)actual, to, 1);
        if (q && !gone) q->live += bytesize;
        grown = q ? reconcile_locked(q, !gone) : -1;
        if (grown < 0 && q) { /* as reserve_for_locked: the pools' charges down to what they hold first */
            reconcile_all_locked();
            grown = reconcile_locked(q, !gone);
        }
    }
    mu_unlock();
    if (to >= 0) {
        pool = actual;
        key = rec.aux = (uint64_t)(uintptr_t)actual;
        rec.slot = to;
        CUcontext owner = gs_stream_ctx(es); /* its context, not the current one */
        if (owner) rec.ctx = (uint64_t)(uintptr_t)gs_ctx_canonical(owner);
    }
    int put = rc == CUDA_SUCCESS && grown == 0 && !gone ? gs_am_put(GS_KIND_POOLPTR, *dptr, &rec, &old) : -1;
    if (locked) gs_ctx_unlock();
    if (gone) {
        GS_INFO("a pool allocation made as its context went is gone with it: its charge is returned");
        gs_unsettled_end();
        return CUDA_SUCCESS;
    }
    if (put >= 0) {
        if (put == 1) gs_pool_drop_ptr(old.aux, old.size); /* a record the driver's reuse made stale */
        if (!after && gs_teardown_since(seq0)) settle_after_record(&rec, *dptr); /* began as it booked */
        gs_unsettled_end();
        return CUDA_SUCCESS;
    }
    if (rc == CUDA_SUCCESS) {
        /* the pool grew past the cap (or the pointer cannot be tracked): undo.  The free is
         * stream-ordered, and the trim cannot give back what backs a free whose completion the
         * host has not observed (cuMemPoolTrimTo's documentation): what the pool still holds
         * after it stays charged, past the cap if it must, until the pool gives it back (left
         * uncharged, a 400 MiB cuMemAlloc passed beside it, 1520 MiB held under a 1 GiB cap;
         * or the near-cap reconcile charged it as growth no hook saw, for good: 512 MiB charged
         * for nothing once the pool gave it back; test_memory.py -k undone_while).  Not while
         * another allocation from it is in flight: that one's settling charges the pool's size
         * (reserved, or undone and charged here), and a growth of its own past its reservation
         * charged by force would let it pass the cap */
        int freed = free_real && free_real(*dptr, stream) == CUDA_SUCCESS;
        if (gs_cuda.cuMemPoolTrimTo) gs_cuda.cuMemPoolTrimTo(pool, 0);
        pool_drop(key, bytesize, 2, freed, gs_effective_stream(stream, per_thread));
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    gs_unsettled_end();
    return rc;
}

/* cuMemAllocAsync takes its memory from the current pool of the stream's device, asked for before the
 * driver's call: a cuDeviceSetMemPool of another thread between the two made the allocation another
 * pool's, booked under the old one (the new pool's growth uncharged, and after the free its 608 MiB held
 * uncharged: a 900 MiB allocation passed, 1508 MiB under a 1 GiB cap; test_memory.py -k
 * current_pool_changed).  So cuDeviceSetMemPool waits for the allocations from a current pool in
 * progress, and they for it.  Not from a driver callback (this thread inside one of them, or holding
 * another lock of ours or the context lock, which they may wait for): passed straight through
 * (g_current_rw, t_current_rw: above). */

static CUresult alloc_from_current(const void *real, cuMemFreeAsync_fn free_real, CUdeviceptr *dptr, size_t bytesize,
                                   CUstream stream, int per_thread)
{
    int fence = !t_current_rw && !gs_t_held && !gs_ctx_mine() && pthread_rwlock_rdlock(&g_current_rw) == 0;
    if (fence) t_current_rw++;
    CUresult rc = pool_alloc(call_alloc_async, real, free_real, dptr, bytesize, NULL, stream, per_thread);
    if (fence) {
        t_current_rw--;
        pthread_rwlock_unlock(&g_current_rw);
    }
    return rc;
}

static int set_current_begin(void)
{
    int fence = !t_current_rw && !gs_t_held && !gs_ctx_mine() && pthread_rwlock_wrlock(&g_current_rw) == 0;
    if (fence) t_current_rw++;
    return fence;
}

static CUresult set_current_end(int fence, CUresult rc)
{
    if (fence) {
        t_current_rw--;
        pthread_rwlock_unlock(&g_current_rw);
    }
    return rc;
}

GS_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    gs_cuda_init();
    if (!gs_cuda.cuDeviceSetMemPool) return CUDA_ERROR_NOT_SUPPORTED;
    int fence = set_current_begin();
    return set_current_end(fence, gs_cuda.cuDeviceSetMemPool(dev, pool));
}

/* CUDA 13: a location's current pool, a device's the one cuMemAllocAsync takes from */
GS_EXPORT CUresult cuMemSetMemPool(CUmemLocation *location, CUmemAllocationType type, CUmemoryPool pool)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemSetMemPool) return CUDA_ERROR_NOT_SUPPORTED;
    int fence = set_current_begin();
    return set_current_end(fence, gs_cuda.cuMemSetMemPool(location, type, pool));
}

GS_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    gs_cuda_init();
    return alloc_from_current((const void *)gs_cuda.cuMemAllocAsync, gs_cuda.cuMemFreeAsync, dptr, bytesize, hStream,
                              0);
}

GS_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    gs_cuda_init();
    return alloc_from_current((const void *)gs_cuda.cuMemAllocAsync_ptsz, gs_cuda.cuMemFreeAsync_ptsz, dptr, bytesize,
                              hStream, 1);
}

GS_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    gs_cuda_init();
    if (!pool) return gs_cuda.cuMemAllocFromPoolAsync ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_SUPPORTED;
    return pool_alloc(call_alloc_from_pool, (const void *)gs_cuda.cuMemAllocFromPoolAsync, gs_cuda.cuMemFreeAsync,
                      dptr, bytesize, pool, hStream, 0);
}

GS_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                CUstream hStream)
{
    gs_cuda_init();
    if (!pool) return gs_cuda.cuMemAllocFromPoolAsync_ptsz ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_SUPPORTED;
    return pool_alloc(call_alloc_from_pool, (const void *)gs_cuda.cuMemAllocFromPoolAsync_ptsz,
                      gs_cuda.cuMemFreeAsync_ptsz, dptr, bytesize, pool, hStream, 1);
}

static CUresult pool_free(cuMemFreeAsync_fn real, CUdeviceptr dptr, CUstream stream, int per_thread)
{
    if (!real) return CUDA_ERROR_NOT_SUPPORTED;
    if (t_mine) return real(dptr, stream); /* see pool_alloc */
    struct gs_alloc rec, old;
    int kind = GS_KIND_POOLPTR;
    /* before the record is taken: a teardown that starts later finds no record to forget, and
     * the driver's refusal may then mean the teardown freed the memory (its bytes stayed in the
     * pool's live bytes, 1-4 MiB charged for nothing, tests/teardownrace.c async; a cuMemAlloc
     * pointer's record was put back, 200 MiB charged for nothing, test_memory.py -k other_kind) */
    unsigned seq0 = gs_teardown_seq();
    if (gs_am_take(kind, dptr, &rec) != 0) {
        kind = GS_KIND_DPTR;
        if (gs_am_take(kind, dptr, &rec) != 0) {
            gs_graphmem_note_free(); /* graph memory, maybe */
            CUresult rc = real(dptr, stream);
            if (rc == CUDA_SUCCESS) __atomic_add_fetch(&gs_pool_frees, 1, __ATOMIC_RELEASE);
            return rc;
        }
    }
    gs_inflight_begin(); /* a cuMemAlloc pointer's memory goes before its charge */
    CUresult rc = real(dptr, stream);
    if (rc == CUDA_SUCCESS) __atomic_add_fetch(&gs_pool_frees, 1, __ATOMIC_RELEASE); /* see gs_pools_after_sync */
    if (rc != CUDA_SUCCESS && gs_teardown_since(seq0))
        gs_free_refused_after_teardown(kind, dptr, &rec); /* after the teardown: did the memory go with it? */
    else if (rc != CUDA_SUCCESS)
        gs_am_put(kind, dptr, &rec, &old);
    else if (kind == GS_KIND_POOLPTR)
        pool_drop(rec.aux, rec.size, 0, 1, gs_effective_stream(stream, per_thread));
    else
        plain_free_held(rec.slot, rec.size, gs_effective_stream(stream, per_thread), rec.ctx);
    gs_inflight_end();
    return rc;
}

GS_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    gs_cuda_init();
    return pool_free(gs_cuda.cuMemFreeAsync, dptr, hStream, 0);
}

GS_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    gs_cuda_init();
    return pool_free(gs_cuda.cuMemFreeAsync_ptsz, dptr, hStream, 1);
}

GS_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemPoolTrimTo) return CUDA_ERROR_NOT_SUPPORTED;
    gs_inflight_begin(); /* memory goes back before the pool's charge follows */
    CUresult rc = gs_cuda.cuMemPoolTrimTo(pool, minBytesToKeep);
    if (rc == CUDA_SUCCESS && !t_mine) gs_pool_drop_ptr((uint64_t)(uintptr_t)pool, 0); /* else the sampler's */
    gs_inflight_end();
    return rc;
}

/* The driver may hand a destroyed pool's handle to another thread's cuMemPoolCreate as soon as
 * the pool is gone, before cuMemPoolDestroy returns: so the pool's record and location are taken
 * out before the driver's call, and the new pool's bookkeeping starts afresh after them (taken out
 * after it, they took the new pool's: its charge was returned while it held its memory).  A pool
 * with allocations outstanding keeps its handle in the driver until the last is freed: its record
 * stays, marked destroyed, to take their frees.  One with none left but frees that may still be
 * outstanding keeps its charge under a key of its own until they are complete (above).  A failed
 * destroy puts everything back. */
GS_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemPoolDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    if (t_mine) return gs_cuda.cuMemPoolDestroy(pool); /* see pool_alloc: its charge stays */
    uint64_t key = (uint64_t)(uintptr_t)pool;
    struct pool_rec gone = {0}; /* the record taken out; its charge held until the driver is done */
    struct pool_where where = {0};
    int stays = 0, was_destroyed = 0;
    uint64_t was_kept = 0;
    gs_inflight_begin();
    mu_lock();
    struct pool_rec *p = find_locked(key, -1, 0);
    if (p && (p->live || p->busy)) {
        stays = 1;
        was_destroyed = p->destroyed; /* destroyed before (a second destroy): so it stays if refused */
        was_kept = p->kept;
        p->destroyed = 1; /* charged as it is until its last allocation is freed */
        if (!was_destroyed) p->kept = p->charged;
    } else if (p) {
        gone = *p;
        __atomic_sub_fetch(&gs_pool_waits, p->nwait, __ATOMIC_RELAXED);
        memset(p, 0, sizeof(*p));
    }
    for (int i = 0; i < g_nwhere; i++)
        if (g_where[i].pool == key) {
            where = g_where[i];
            memset(&g_where[i], 0, sizeof(g_where[i]));
        }
    mu_unlock();
    CUresult rc = gs_cuda.cuMemPoolDestroy(pool);
    mu_lock();
    if (rc == CUDA_SUCCESS) {
        if (gone.pool && gone.nwait)
            drain_locked(&gone); /* the driver keeps its memory until they are complete */
        else if (gone.pool)
            gs_budget_release(gone.slot, gone.charged);
    } else {
        /* the pool lives on, and so does its handle: nobody else can have it */
        p = stays ? find_locked(key, -1, 0) : gone.pool ? find_locked(key, gone.slot, 1) : NULL;
        if (p && stays) {
            /* as it was: alive, or destroyed already, its allocations outstanding (undone as a live
             * pool's, a second destroy's refusal kept its charge for good once they were freed:
             * `test_memory.py -k destroyed_again`) */
            p->destroyed = was_destroyed;
            p->kept = was_kept;
        } else if (p) { /* beside what an allocation racing the destroy may have begun */
            p->charged += gone.charged;
            p->live += gone.live;
            for (int i = 0; i < gone.nwait; i++) wait_put_locked(p, gone.wait[i]);
        } else if (gone.pool) {
            gs_budget_release(gone.slot, gone.charged); /* the table is full: the reconcile's to charge */
        }
        struct pool_where *w = where.pool ? where_entry_locked(key) : NULL;
        if (w && !w->pool) *w = where;
    }
    mu_unlock();
    free(gone.wait); /* its entries were copied where they still count */
    gs_inflight_end();
    return rc;
}
