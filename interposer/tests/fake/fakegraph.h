/*
 * fakegraph.h - the fake driver's graphs with memory allocation nodes.
 * Included by fakecuda.c after fakelaunch.h.
 *
 * A graph is a list of nodes: kernels, memory allocations (captured
 * cuMemAllocAsync or cuGraphAddMemAllocNode), frees, child graphs.  An
 * executable graph that allocates needs, per device, the sum of its
 * allocation nodes times FAKE_CUDA_GRAPH_SHARE % (default 100: a real driver
 * lets nodes with disjoint lifetimes share memory, so the footprint is often
 * less than the sum); uploading or launching it maps what the device's graph
 * pool does not hold yet (physical memory, as NVML sees it).  The pool keeps
 * it until cuDeviceGraphMemTrim or the primary context goes.  Allocation
 * nodes are taken to be freed inside their graph, so USED_MEM_CURRENT reads 0,
 * unless a test says another graph kept some (fake_cuda_graph_keep), or with
 * FAKE_CUDA_GRAPH_UNFREED=1, where a graph without free nodes leaves its
 * allocations alive after its launch, as the driver does with allocations a
 * graph does not free: they count in USED_MEM_CURRENT, and a relaunch is
 * refused with CUDA_ERROR_INVALID_VALUE while they live, unless the executable
 * was instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, which
 * has the launch free them first.
 * The executables of fakelaunch.h (small integers = kernel counts) still work.
 *
 * Kernel nodes (cuGraphAddKernelNode[_v2]): a kernel's time grows with its grid, so here a node
 * runs gridDimX kernels of FAKE_CUDA_KERNEL_US at each launch.  A launch of an executable with
 * kernel nodes anywhere runs its enabled top-level kernel nodes' and child graphs' kernels; one
 * without runs one kernel, as before.  An executable changes in place as the driver's does:
 * cuGraphExecUpdate[_v2] from a graph of the same node count and types (else
 * CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE), cuGraphExecKernelNodeSetParams[_v2] and
 * cuGraphExecNodeSetParams (a kernel's grid), cuGraphExecChildGraphNodeSetParams (a child's
 * kernels), cuGraphNodeSetEnabled; the memcpy, memset and host node setters are accepted for
 * nodes of their executable and change nothing here.  Nodes are named by the handles of the
 * graph the executable was instantiated from, as the driver's.
 *
 * Conditional nodes (CUDA 12.3's cuGraphConditionalHandleCreate and cuGraphAddNode of
 * CU_GRAPH_NODE_TYPE_CONDITIONAL, an IF or WHILE node with body graphs): the kernels of a real
 * graph set the condition in device memory, so how many times a WHILE body runs is the GPU's
 * business, never the host's.  Here a launch of an executable with a conditional node anywhere
 * runs as many kernels as fake_cuda_graph_trips last said (default 1), which a test calls where
 * a real program's kernels would change their loop's trip count.  So does one instantiated with
 * CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH: its kernel may relaunch it from the GPU
 * (cudaGraphLaunch into cudaStreamGraphTailLaunch) as many times as it likes, and a host launch
 * completes on its stream only once all of that has (the stream environment of the programming
 * guide's "Device Graph Launch").  fake_cuda_graph_spawn(host, device) has the kernels of one
 * executable launch such a graph from the GPU (fire and forget) at each of its launches.
 */

#define FAKE_GRAPH_MAGIC 0x4752415048ull /* "GRAPH" */
#define FAKE_MAX_NODES 64
#define FAKE_COND_BODIES 2

/* cuda.h's layout (CUDA 12.3), of which only the conditional member is made here */
typedef struct {
    uint64_t handle;
    int type; /* 0 IF, 1 WHILE, 2 SWITCH */
    unsigned int size;
    CUgraph *phGraph_out;
    CUcontext ctx;
} fake_cond_params;
typedef struct {
    CUgraphNodeType type;
    int reserved0[3];
    union {
        long long reserved1[29];
        fake_cond_params conditional;
    };
    long long reserved2;
} fake_node_params;

struct fake_node {
    CUgraphNodeType type;
    unsigned grid;   /* KERNEL: its gridDimX, the kernels it runs */
    uint64_t bytes;  /* MEM_ALLOC */
    int ordinal;     /* MEM_ALLOC: the CUDA device */
    CUmemLocation where; /* MEM_ALLOC: its location as given (a locality domain's, CUDA 13.4) */
    CUdeviceptr dptr;
    struct fake_graph *child; /* GRAPH */
    CUgraph bodies[FAKE_COND_BODIES]; /* CONDITIONAL */
};
struct fake_graph {
    uint64_t magic;
    int n;
    struct fake_node nodes[FAKE_MAX_NODES];
};
struct fake_gexec {
    uint64_t magic;
    uint64_t kernels;
    uint64_t need[FAKE_MAX_DEVS]; /* per physical device */
    int frees;                    /* its free nodes */
    int auto_free;                /* CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH */
    int loops;                    /* a conditional node, or made for device launch: fake_cuda_graph_trips
                                   * kernels a launch */
    struct fake_gexec *spawns;    /* a device graph its kernels launch (fake_cuda_graph_spawn) */
    const struct fake_node *base; /* the nodes of the graph it was instantiated from (their handles) */
    int nnodes;
    uint64_t weight[FAKE_MAX_NODES]; /* each top-level node's kernels a launch (kernel, child graph) */
    unsigned char off[FAKE_MAX_NODES]; /* cuGraphNodeSetEnabled(0) */
    int weighted;                 /* kernel nodes somewhere: `kernels` is their sum */
    uint64_t live[FAKE_MAX_DEVS]; /* FAKE_CUDA_GRAPH_UNFREED: its last launch's allocations, alive */
};

/* Allocations of other graphs that their graphs did not free: alive in the pool, which a
 * launch must hold beside its own nodes (cuDeviceGetGraphMemAttribute's USED_MEM_CURRENT). */
static uint64_t graph_used_kept[FAKE_MAX_DEVS];

/* FAKE_CUDA_GRAPH_UNFREED: the executable whose launch last left allocations alive; the program
 * frees them with cuMemFreeAsync / cuMemFree of FAKE_GRAPH_LIVE_PTR (fake_cuda_graph_live_ptr
 * hands it out), as a real program frees a graph's allocation by its address. */
#define FAKE_GRAPH_LIVE_PTR 0x7e0000000000ull
static struct fake_gexec *graph_live_exec;

API CUdeviceptr fake_cuda_graph_live_ptr(void)
{
    return graph_live_exec ? FAKE_GRAPH_LIVE_PTR : 0;
}

/* 1 if dptr named those allocations (now freed) */
static int fake_graph_free_live(CUdeviceptr dptr)
{
    if (dptr != FAKE_GRAPH_LIVE_PTR) return 0;
    pthread_mutex_lock(&mu);
    struct fake_gexec *e = graph_live_exec;
    for (int d = 0; e && d < FAKE_MAX_DEVS; d++) {
        graph_used_kept[d] -= e->live[d];
        e->live[d] = 0;
    }
    graph_live_exec = NULL;
    pthread_mutex_unlock(&mu);
    return e != NULL;
}

/* Test-only: such an allocation of `bytes` in device 0's graph pool (mapped if the pool is
 * smaller). */
API CUresult fake_cuda_graph_keep(uint64_t bytes)
{
    pthread_mutex_lock(&mu);
    int d = visible[0];
    graph_used_kept[d] += bytes;
    CUresult rc = CUDA_SUCCESS;
    if (graph_used_kept[d] > graph_reserved[d]) {
        rc = phys_add(d, graph_used_kept[d] - graph_reserved[d]);
        if (rc == CUDA_SUCCESS) graph_reserved[d] = graph_used_kept[d];
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* FAKE_CUDA_HANDLE_REUSE: a destroyed executable graph, the next instantiation's (under mu) */
static struct fake_gexec *freed_gexec;

static struct fake_graph *fake_graph_new(void)
{
    struct fake_graph *g = calloc(1, sizeof(*g));
    if (g) g->magic = FAKE_GRAPH_MAGIC;
    return g;
}

static struct fake_node *node_add(struct fake_graph *g, CUgraphNodeType type)
{
    if (!g || g->magic != FAKE_GRAPH_MAGIC || g->n >= FAKE_MAX_NODES) return NULL;
    struct fake_node *n = &g->nodes[g->n++];
    memset(n, 0, sizeof(*n));
    n->type = type;
    return n;
}

static int ordinal_of(int pdev)
{
    for (int i = 0; i < nvisible; i++)
        if (visible[i] == pdev) return i;
    return 0;
}

static CUdeviceptr graph_address(uint64_t bytes)
{
    pthread_mutex_lock(&mu);
    CUdeviceptr p = next_handle;
    next_handle += ((bytes + 0xfffff) & ~0xfffffull) + 0x100000;
    pthread_mutex_unlock(&mu);
    return p;
}

/* cuMemAllocAsync / cuMemFreeAsync on a capturing stream: a node, no memory. */
static int fake_capture_alloc(CUstream s, int ptsz, CUdeviceptr *dptr, size_t bytes, CUresult *rc)
{
    struct fake_stream *st = stream_of(s, ptsz);
    if (!st->capturing) return 0;
    struct fake_node *n = node_add(st->graph, CU_GRAPH_NODE_TYPE_MEM_ALLOC);
    if (!n || !dptr || !bytes) {
        *rc = CUDA_ERROR_INVALID_VALUE;
        return 1;
    }
    n->bytes = bytes;
    n->ordinal = ordinal_of(current->pdev);
    n->where = (CUmemLocation){CU_MEM_LOCATION_TYPE_DEVICE, n->ordinal};
    n->dptr = *dptr = graph_address(bytes);
    *rc = CUDA_SUCCESS;
    return 1;
}

static int fake_capture_free(CUstream s, int ptsz, CUresult *rc)
{
    struct fake_stream *st = stream_of(s, ptsz);
    if (!st->capturing) return 0;
    *rc = node_add(st->graph, 11 /* CU_GRAPH_NODE_TYPE_MEM_FREE */) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    return 1;
}

static struct fake_graph *graph_of(CUgraph g)
{
    struct fake_graph *fg = (struct fake_graph *)g;
    return fg && fg->magic == FAKE_GRAPH_MAGIC ? fg : NULL;
}

static struct fake_node *node_of(CUgraphNode n)
{
    return (struct fake_node *)n;
}

/* CUDA 12.3's capture into the program's graph: as cuStreamBeginCapture_v2, the nodes added to it */
API CUresult cuStreamBeginCaptureToGraph(CUstream s, CUgraph g, const CUgraphNode *deps, const void *data, size_t ndeps,
                                         int mode)
{
    (void)deps, (void)data, (void)ndeps;
    struct fake_graph *fg = graph_of(g);
    if (!fg) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = cuStreamBeginCapture_v2(s, mode);
    if (rc != CUDA_SUCCESS) return rc;
    struct fake_stream *st = stream_of(s, 0);
    free(st->graph);
    st->graph = fg;
    st->to_graph = 1;
    return CUDA_SUCCESS;
}

/* CUDA 13.3's recapture into an existing graph: captured as into the program's graph (that the
 * nodes come in the original's order is not checked; a stream is captured, not the default one,
 * so the _ptsz variant is the same) */
API CUresult cuStreamBeginRecaptureToGraph(CUstream s, int mode, CUgraph g, void (*callback)(void), void *data)
{
    (void)callback, (void)data;
    return cuStreamBeginCaptureToGraph(s, g, NULL, NULL, 0, mode);
}

API CUresult cuStreamBeginRecaptureToGraph_ptsz(CUstream s, int mode, CUgraph g, void (*callback)(void), void *data)
{
    return cuStreamBeginRecaptureToGraph(s, mode, g, callback, data);
}

API CUresult cuGraphCreate(CUgraph *g, unsigned int flags)
{
    (void)flags;
    if (!g) return CUDA_ERROR_INVALID_VALUE;
    *g = (CUgraph)fake_graph_new();
    return *g ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

API CUresult cuGraphDestroy(CUgraph g)
{
    struct fake_graph *fg = graph_of(g);
    if (!fg) return CUDA_ERROR_INVALID_VALUE;
    fg->magic = 0;
    free(fg);
    return CUDA_SUCCESS;
}

API CUresult cuGraphAddMemAllocNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                    CUDA_MEM_ALLOC_NODE_PARAMS *params)
{
    (void)deps, (void)ndeps;
    if (!node || !params || !params->bytesize) return CUDA_ERROR_INVALID_VALUE;
    struct fake_node *n = node_add(graph_of(g), CU_GRAPH_NODE_TYPE_MEM_ALLOC);
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    n->bytes = params->bytesize;
    int domain;
    n->ordinal = location_ordinal(&params->poolProps.location, &domain);
    n->where = params->poolProps.location;
    n->dptr = params->dptr = graph_address(params->bytesize);
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

API CUresult cuGraphAddChildGraphNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                      CUgraph child)
{
    (void)deps, (void)ndeps;
    if (!node || !graph_of(child)) return CUDA_ERROR_INVALID_VALUE;
    struct fake_node *n = node_add(graph_of(g), CU_GRAPH_NODE_TYPE_GRAPH);
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    n->child = graph_of(child);
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

/* cuda.h's CUDA_KERNEL_NODE_PARAMS: its v1 fields lead v2 and v3, of which gridDimX is read */
typedef struct {
    CUfunction func;
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void **kernelParams, **extra;
} fake_kernel_params;

static CUresult add_kernel(CUgraphNode *node, CUgraph g, const fake_kernel_params *p)
{
    if (!node || !p || !p->gridDimX) return CUDA_ERROR_INVALID_VALUE;
    struct fake_node *n = node_add(graph_of(g), CU_GRAPH_NODE_TYPE_KERNEL);
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    n->grid = p->gridDimX;
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

API CUresult cuGraphAddKernelNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                  const fake_kernel_params *p)
{
    (void)deps, (void)ndeps;
    return add_kernel(node, g, p);
}

API CUresult cuGraphAddKernelNode_v2(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                                     const fake_kernel_params *p)
{
    (void)deps, (void)ndeps;
    return add_kernel(node, g, p);
}

API CUresult cuGraphConditionalHandleCreate(uint64_t *handle, CUgraph g, CUcontext ctx, unsigned int dflt,
                                            unsigned int flags)
{
    (void)ctx, (void)dflt, (void)flags;
    static uint64_t next = 1;
    if (!handle || !graph_of(g)) return CUDA_ERROR_INVALID_VALUE;
    *handle = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

/* cuGraphAddNode: conditional nodes only (their body graphs made here, as the driver's) */
API CUresult cuGraphAddNode(CUgraphNode *node, CUgraph g, const CUgraphNode *deps, size_t ndeps, fake_node_params *p)
{
    (void)deps, (void)ndeps;
    if (!node || !p || p->type != CU_GRAPH_NODE_TYPE_CONDITIONAL || !p->conditional.handle ||
        !p->conditional.size || p->conditional.size > FAKE_COND_BODIES)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_node *n = node_add(graph_of(g), CU_GRAPH_NODE_TYPE_CONDITIONAL);
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < p->conditional.size; i++) n->bodies[i] = (CUgraph)fake_graph_new();
    p->conditional.phGraph_out = n->bodies;
    *node = (CUgraphNode)n;
    return CUDA_SUCCESS;
}

static uint64_t graph_trips = 1;

/* Test-only: the kernels of `host` launch `device` from the GPU at each of its launches */
API void fake_cuda_graph_spawn(CUgraphExec host, CUgraphExec device)
{
    ((struct fake_gexec *)host)->spawns = (struct fake_gexec *)device;
}

/* Test-only: the trip count the kernels of every graph's conditional node set from now on */
API void fake_cuda_graph_trips(uint64_t trips)
{
    __atomic_store_n(&graph_trips, trips, __ATOMIC_RELAXED);
}

API CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *count)
{
    FAIL_POINT("cuGraphGetNodes");
    struct fake_graph *fg = graph_of(g);
    if (!fg || !count) return CUDA_ERROR_INVALID_VALUE;
    if (nodes)
        for (size_t i = 0; i < *count && i < (size_t)fg->n; i++) nodes[i] = (CUgraphNode)&fg->nodes[i];
    *count = (size_t)fg->n;
    return CUDA_SUCCESS;
}

API CUresult cuGraphNodeGetType(CUgraphNode n, CUgraphNodeType *type)
{
    FAIL_POINT("cuGraphNodeGetType");
    if (!n || !type) return CUDA_ERROR_INVALID_VALUE;
    *type = node_of(n)->type;
    return CUDA_SUCCESS;
}

API CUresult cuGraphMemAllocNodeGetParams(CUgraphNode n, CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    FAIL_POINT("cuGraphMemAllocNodeGetParams");
    if (!n || !p || node_of(n)->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) return CUDA_ERROR_INVALID_VALUE;
    memset(p, 0, sizeof(*p));
    p->poolProps.allocType = 1;
    p->poolProps.location = node_of(n)->where;
    p->bytesize = node_of(n)->bytes;
    p->dptr = node_of(n)->dptr;
    return CUDA_SUCCESS;
}

API CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode n, CUgraph *g)
{
    FAIL_POINT("cuGraphChildGraphNodeGetGraph");
    if (!n || !g || node_of(n)->type != CU_GRAPH_NODE_TYPE_GRAPH) return CUDA_ERROR_INVALID_VALUE;
    *g = (CUgraph)node_of(n)->child;
    return CUDA_SUCCESS;
}

/* The kernels a launch of g's kernel nodes runs, children's included; -1 if it has none */
static int64_t graph_kernels(const struct fake_graph *g, int depth)
{
    int64_t sum = -1;
    for (int i = 0; g && depth < 64 && i < g->n; i++) {
        const struct fake_node *n = &g->nodes[i];
        int64_t k = n->type == CU_GRAPH_NODE_TYPE_KERNEL ? n->grid
                    : n->type == CU_GRAPH_NODE_TYPE_GRAPH ? graph_kernels(n->child, depth + 1) : -1;
        if (k >= 0) sum = (sum < 0 ? 0 : sum) + k;
    }
    return sum;
}

/* e's kernels a launch, from its nodes' weights */
static void exec_weigh(struct fake_gexec *e)
{
    if (!e->weighted) return;
    uint64_t k = 0;
    for (int i = 0; i < e->nnodes; i++) k += e->off[i] ? 0 : e->weight[i];
    e->kernels = k;
}

/* e's top-level weights from g (instantiation, or an update from a graph of the same shape) */
static void exec_weights(struct fake_gexec *e, const struct fake_graph *g)
{
    for (int i = 0; i < g->n && i < FAKE_MAX_NODES; i++) {
        int64_t k = g->nodes[i].type == CU_GRAPH_NODE_TYPE_KERNEL ? g->nodes[i].grid
                    : g->nodes[i].type == CU_GRAPH_NODE_TYPE_GRAPH ? graph_kernels(g->nodes[i].child, 1) : 0;
        e->weight[i] = k > 0 ? (uint64_t)k : 0;
    }
    exec_weigh(e);
}

static void exec_sum(struct fake_gexec *e, const struct fake_graph *g, int depth)
{
    for (int i = 0; g && depth < 64 && i < g->n; i++) {
        const struct fake_node *n = &g->nodes[i];
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC && n->ordinal >= 0 && n->ordinal < nvisible)
            e->need[visible[n->ordinal]] += n->bytes;
        else if (n->type == CU_GRAPH_NODE_TYPE_GRAPH)
            exec_sum(e, n->child, depth + 1);
        else if (n->type == 11 /* CU_GRAPH_NODE_TYPE_MEM_FREE */)
            e->frees++;
        else if (n->type == CU_GRAPH_NODE_TYPE_CONDITIONAL)
            e->loops = 1;
    }
}

/* Map what the graph pool does not hold yet of e's footprint. */
static CUresult gexec_map(struct fake_gexec *e)
{
    const char *share = getenv("FAKE_CUDA_GRAPH_SHARE");
    uint64_t pct = share && *share ? strtoull(share, NULL, 10) : 100;
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&mu);
    for (int d = 0; d < FAKE_MAX_DEVS && rc == CUDA_SUCCESS; d++) {
        uint64_t footprint = e->need[d] * pct / 100;
        if (footprint) footprint += graph_used_kept[d]; /* beside what other graphs keep */
        if (footprint <= graph_reserved[d]) continue;
        rc = phys_add(d, footprint - graph_reserved[d]);
        if (rc == CUDA_SUCCESS) graph_reserved[d] = footprint;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUresult instantiate(CUgraphExec *exec, CUgraph g, int upload, unsigned long long flags)
{
    FAIL_POINT("cuGraphInstantiate");
    struct fake_graph *fg = graph_of(g);
    if (!exec || !fg) return CUDA_ERROR_INVALID_VALUE;
    struct fake_gexec *e = reuse_or_alloc((void **)&freed_gexec, sizeof(*e)); /* a destroyed executable's handle, reused */
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = FAKE_GRAPH_MAGIC;
    e->kernels = 1;
    exec_sum(e, fg, 0);
    e->base = fg->nodes;
    e->nnodes = fg->n;
    memset(e->off, 0, sizeof(e->off));
    e->weighted = graph_kernels(fg, 0) >= 0;
    exec_weights(e, fg);
    e->auto_free = (flags & 1 /* CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH */) != 0;
    if (flags & CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH) e->loops = 1;
    CUresult rc = upload ? gexec_map(e) : CUDA_SUCCESS;
    if (rc != CUDA_SUCCESS) {
        free(e);
        return rc;
    }
    *exec = (CUgraphExec)e;
    last_gexec = e;
    return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph g, unsigned long long flags)
{
    return instantiate(exec, g, 0, flags);
}

/* CUDA 10.0's, which drivers still export */
API CUresult cuGraphInstantiate(CUgraphExec *exec, CUgraph g, CUgraphNode *err, char *log, size_t size)
{
    (void)err, (void)log, (void)size;
    return instantiate(exec, g, 0, 0);
}

API CUresult cuGraphInstantiate_v2(CUgraphExec *exec, CUgraph g, CUgraphNode *err, char *log, size_t size)
{
    (void)err, (void)log, (void)size;
    return instantiate(exec, g, 0, 0);
}

API CUresult cuGraphInstantiateWithParams(CUgraphExec *exec, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = instantiate(exec, g, (p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) != 0, p->flags);
    p->result_out = rc == CUDA_SUCCESS ? 0 : 1;
    return rc;
}

API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *exec, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    return cuGraphInstantiateWithParams(exec, g, p);
}

static struct fake_gexec *gexec_of(CUgraphExec g)
{
    struct fake_gexec *e = (struct fake_gexec *)g;
    return (uintptr_t)g > 0x10000 && e->magic == FAKE_GRAPH_MAGIC ? e : NULL;
}

/* ---- executables changed in place ---- */

/* the index of node n in e's graph, -1 if it is none of its nodes */
static int exec_node(const struct fake_gexec *e, CUgraphNode n)
{
    const struct fake_node *p = (const struct fake_node *)n;
    if (!e || !p || p < e->base || p >= e->base + e->nnodes) return -1;
    return (int)(p - e->base);
}

/* cuda.h's CUgraphExecUpdateResultInfo */
typedef struct {
    int result;
    CUgraphNode errorNode, errorFromNode;
} fake_update_info;

static CUresult exec_update(CUgraphExec exec, CUgraph g, int *result, CUgraphNode *err)
{
    struct fake_gexec *e = gexec_of(exec);
    struct fake_graph *fg = graph_of(g);
    if (!e || !fg) return CUDA_ERROR_INVALID_VALUE;
    int bad = fg->n != e->nnodes ? 2 /* CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED */ : 0;
    for (int i = 0; !bad && i < fg->n; i++)
        if (fg->nodes[i].type != e->base[i].type) {
            bad = 3; /* CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED */
            if (err) *err = (CUgraphNode)&fg->nodes[i];
        }
    if (result) *result = bad;
    if (bad) return 910; /* CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE */
    pthread_mutex_lock(&mu);
    exec_weights(e, fg);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

API CUresult cuGraphExecUpdate(CUgraphExec exec, CUgraph g, CUgraphNode *err, int *result)
{
    FAIL_POINT("cuGraphExecUpdate");
    if (!err || !result) return CUDA_ERROR_INVALID_VALUE;
    *err = NULL;
    return exec_update(exec, g, result, err);
}

API CUresult cuGraphExecUpdate_v2(CUgraphExec exec, CUgraph g, fake_update_info *info)
{
    FAIL_POINT("cuGraphExecUpdate");
    if (!info) return CUDA_ERROR_INVALID_VALUE;
    info->errorNode = info->errorFromNode = NULL;
    return exec_update(exec, g, &info->result, &info->errorNode);
}

/* node i of e (of `type`, -1 any) takes `kernels` (-1: its own unchanged) and `on` (-1 unchanged) */
static CUresult exec_node_set(CUgraphExec exec, CUgraphNode node, int type, int64_t kernels, int on)
{
    struct fake_gexec *e = gexec_of(exec);
    int i = exec_node(e, node);
    if (i < 0 || (type >= 0 && (int)e->base[i].type != type)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (kernels >= 0) e->weight[i] = (uint64_t)kernels;
    if (on >= 0) e->off[i] = !on;
    exec_weigh(e);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

static CUresult exec_kernel_set(CUgraphExec exec, CUgraphNode node, const fake_kernel_params *p)
{
    if (!p || !p->gridDimX) return CUDA_ERROR_INVALID_VALUE;
    return exec_node_set(exec, node, CU_GRAPH_NODE_TYPE_KERNEL, p->gridDimX, -1);
}

API CUresult cuGraphExecKernelNodeSetParams(CUgraphExec exec, CUgraphNode node, const fake_kernel_params *p)
{
    FAIL_POINT("cuGraphExecKernelNodeSetParams");
    return exec_kernel_set(exec, node, p);
}

API CUresult cuGraphExecKernelNodeSetParams_v2(CUgraphExec exec, CUgraphNode node, const fake_kernel_params *p)
{
    FAIL_POINT("cuGraphExecKernelNodeSetParams");
    return exec_kernel_set(exec, node, p);
}

/* CUDA 12.2's generic setter: a kernel node's parameters at the union (CUgraphNodeParams) */
API CUresult cuGraphExecNodeSetParams(CUgraphExec exec, CUgraphNode node, fake_node_params *p)
{
    FAIL_POINT("cuGraphExecNodeSetParams");
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (p->type == CU_GRAPH_NODE_TYPE_KERNEL) return exec_kernel_set(exec, node, (const fake_kernel_params *)p->reserved1);
    if (p->type == CU_GRAPH_NODE_TYPE_CONDITIONAL) return CUDA_ERROR_INVALID_VALUE; /* not supported */
    return exec_node_set(exec, node, (int)p->type, -1, -1);
}

API CUresult cuGraphExecChildGraphNodeSetParams(CUgraphExec exec, CUgraphNode node, CUgraph child)
{
    FAIL_POINT("cuGraphExecChildGraphNodeSetParams");
    struct fake_graph *fg = graph_of(child);
    if (!fg) return CUDA_ERROR_INVALID_VALUE;
    int64_t k = graph_kernels(fg, 1);
    return exec_node_set(exec, node, CU_GRAPH_NODE_TYPE_GRAPH, k > 0 ? k : 0, -1);
}

API CUresult cuGraphNodeSetEnabled(CUgraphExec exec, CUgraphNode node, unsigned int on)
{
    FAIL_POINT("cuGraphNodeSetEnabled");
    return exec_node_set(exec, node, -1, -1, on != 0);
}

API CUresult cuGraphExecMemcpyNodeSetParams(CUgraphExec exec, CUgraphNode node, const void *p, CUcontext ctx)
{
    FAIL_POINT("cuGraphExecMemcpyNodeSetParams");
    (void)ctx;
    return p ? exec_node_set(exec, node, -1, -1, -1) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGraphExecMemsetNodeSetParams(CUgraphExec exec, CUgraphNode node, const void *p, CUcontext ctx)
{
    FAIL_POINT("cuGraphExecMemsetNodeSetParams");
    (void)ctx;
    return p ? exec_node_set(exec, node, -1, -1, -1) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGraphExecHostNodeSetParams(CUgraphExec exec, CUgraphNode node, const void *p)
{
    FAIL_POINT("cuGraphExecHostNodeSetParams");
    return p ? exec_node_set(exec, node, -1, -1, -1) : CUDA_ERROR_INVALID_VALUE;
}

/* cuGraphLaunch of an executable made here; 0 if g is fakelaunch.h's kind. */
static int fake_gexec_launch(CUgraphExec g, CUstream s, int ptsz, CUresult *rc)
{
    struct fake_gexec *e = gexec_of(g);
    if (!e) return 0;
    int failed = fail_check("cuGraphLaunch"); /* held (FAKE_CUDA_SLEEP) before it maps, or failed */
    if (failed) {
        *rc = (CUresult)failed;
        return 1;
    }
    int unfreed = getenv("FAKE_CUDA_GRAPH_UNFREED") && !e->frees;
    if (unfreed) {
        pthread_mutex_lock(&mu);
        int live = 0;
        for (int d = 0; d < FAKE_MAX_DEVS; d++) live |= e->live[d] != 0;
        if (live && !e->auto_free) {
            pthread_mutex_unlock(&mu);
            *rc = CUDA_ERROR_INVALID_VALUE; /* its allocations from the last launch still live */
            return 1;
        }
        for (int d = 0; d < FAKE_MAX_DEVS; d++) { /* auto-free: they go first */
            graph_used_kept[d] -= e->live[d];
            e->live[d] = 0;
        }
        pthread_mutex_unlock(&mu);
    }
    *rc = gexec_map(e);
    if (*rc == CUDA_SUCCESS && unfreed) {
        const char *share = getenv("FAKE_CUDA_GRAPH_SHARE");
        uint64_t pct = share && *share ? strtoull(share, NULL, 10) : 100;
        pthread_mutex_lock(&mu);
        for (int d = 0; d < FAKE_MAX_DEVS; d++) {
            e->live[d] = e->need[d] * pct / 100; /* what it mapped stays allocated */
            graph_used_kept[d] += e->live[d];
        }
        graph_live_exec = e;
        pthread_mutex_unlock(&mu);
    }
    uint64_t trips = __atomic_load_n(&graph_trips, __ATOMIC_RELAXED);
    uint64_t kernels = e->loops ? trips : e->kernels;
    if (e->spawns) kernels += e->spawns->loops ? trips : e->spawns->kernels; /* within the launch */
    if (*rc == CUDA_SUCCESS) *rc = kernels ? enqueue(s, ptsz, kernels) : CUDA_SUCCESS;
    return 1;
}

API CUresult cuGraphUpload(CUgraphExec g, CUstream s)
{
    (void)s;
    struct fake_gexec *e = gexec_of(g);
    return e ? gexec_map(e) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGraphUpload_ptsz(CUgraphExec g, CUstream s)
{
    return cuGraphUpload(g, s);
}

API CUresult cuGraphExecDestroy(CUgraphExec g)
{
    FAIL_POINT("cuGraphExecDestroy");
    struct fake_gexec *e = gexec_of(g);
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    if (last_gexec == e) last_gexec = NULL;
    e->magic = 0;
    if (getenv("FAKE_CUDA_HANDLE_REUSE")) {
        pthread_mutex_lock(&mu);
        free(freed_gexec);
        freed_gexec = e; /* the next instantiation gets its handle */
        pthread_mutex_unlock(&mu);
    } else {
        free(e);
    }
    (void)fail_check("cuGraphExecDestroyAfter"); /* FAKE_CUDA_SLEEP: still inside, the handle free */
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGraphMemTrim(CUdevice d)
{
    if (d < 0 || d >= nvisible) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    int p = visible[d];
    phys_sub(p, graph_reserved[p] - graph_used_kept[p]); /* what lives stays */
    graph_reserved[p] = graph_used_kept[p];
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetGraphMemAttribute(CUdevice d, CUgraphMem_attribute attr, void *value)
{
    FAIL_POINT("cuDeviceGetGraphMemAttribute");
    api_callback("cuDeviceGetGraphMemAttribute");
    if (d < 0 || d >= nvisible) return CUDA_ERROR_INVALID_DEVICE;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT:
    case 1: /* USED_MEM_HIGH */
        *(cuuint64_t *)value = graph_used_kept[visible[d]];
        return CUDA_SUCCESS;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT:
    case 3: /* RESERVED_MEM_HIGH */
        *(cuuint64_t *)value = graph_reserved[visible[d]];
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

/* For tests/gpu/native/gpubench.c and gsprobe, run against the fake driver.  FAKE_CUDA_MEMSET_US: the memset
 * holds its stream that long after what it had queued, as kernel time (a memset may run as a
 * kernel: NVML's utilisation counts it) */
static CUresult memset_on(CUdeviceptr p, size_t n, CUstream s, int ptsz)
{
    if (!p || !n) return CUDA_ERROR_INVALID_VALUE;
    const char *us = getenv("FAKE_CUDA_MEMSET_US");
    if (!us) return CUDA_SUCCESS;
    NEED_CTX();
    struct fake_stream *st = stream_of(s, ptsz);
    uint64_t now = now_ns(), tail = __atomic_load_n(&st->tail, __ATOMIC_ACQUIRE), start = tail > now ? tail : now;
    uint64_t ns = (uint64_t)atoll(us) * 1000ull;
    __atomic_store_n(&st->tail, start + ns, __ATOMIC_RELEASE);
    note_run(start, start + ns, ns);
    __atomic_add_fetch(&kernel_total_ns, ns, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

API CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s)
{
    (void)v;
    return memset_on(p, n, s, 0);
}

/* The memset without a stream: on the legacy stream (the per-thread one for _ptds), and as the
 * driver's, asynchronous with respect to the host for device memory */
API CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n)
{
    (void)v;
    return memset_on(p, n, NULL, 0);
}

API CUresult cuMemsetD8_v2_ptds(CUdeviceptr p, unsigned char v, size_t n)
{
    (void)v;
    return memset_on(p, n, NULL, 1);
}

API CUresult cuGetErrorName(CUresult err, const char **name)
{
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    *name = err == CUDA_SUCCESS ? "CUDA_SUCCESS" : err == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
                                                                                 : "CUDA_ERROR_FAKE";
    return CUDA_SUCCESS;
}
