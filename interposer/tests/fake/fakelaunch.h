/*
 * fakelaunch.h - the fake driver's GPU timeline (streams, events, kernels,
 * graphs, capture) and cuGetProcAddress.  Included by fakecuda.c only.
 */

struct fake_graph;
static struct fake_graph *fake_graph_new(void);
static int fake_gexec_launch(CUgraphExec g, CUstream s, int ptsz, CUresult *rc);

struct fake_stream {
    uint64_t tail; /* when the last queued work finishes */
    struct fake_ctx *ctx; /* current when it was created */
    int capturing;
    int capture_mode;
    const char *capturer; /* the capturing thread's t_me (a context's end ends only its own) */
    struct fake_graph *graph; /* being captured */
    int to_graph;             /* into the program's graph (cuStreamBeginCaptureToGraph): not freed here */
};
struct fake_event {
    struct fake_ctx *ctx; /* current when it was created */
    int recorded;
    uint64_t t;
    unsigned flags; /* cuEventCreate's */
};
static struct fake_stream legacy_stream;
static __thread struct fake_stream ptds_stream;

static struct fake_stream *stream_of(CUstream s, int ptsz)
{
    if (s == NULL) return ptsz ? &ptds_stream : &legacy_stream;
    if (s == (CUstream)0x1) return &legacy_stream;
    if (s == CU_STREAM_PER_THREAD) return &ptds_stream;
    return (struct fake_stream *)s;
}

/* The streams capturing now (a context's end ends their captures), under cap_mu.  The fake
 * keeps a stream's capture state unsynchronised, for its own thread: a context's end or a
 * stream's destroy ends only the captures the calling thread began (another thread's stays,
 * a limit of the model; mixrace resets contexts while other threads capture) */
static __thread char t_me;
#define FAKE_CAPTURING 64
static pthread_mutex_t cap_mu = PTHREAD_MUTEX_INITIALIZER;
static struct fake_stream *capturing[FAKE_CAPTURING];

static void capturing_set(struct fake_stream *st, int on)
{
    if (st == &legacy_stream || st == &ptds_stream) return; /* no context of their own here */
    pthread_mutex_lock(&cap_mu);
    for (int i = 0; i < FAKE_CAPTURING; i++)
        if (on ? !capturing[i] : capturing[i] == st) {
            capturing[i] = on ? st : NULL;
            break;
        }
    pthread_mutex_unlock(&cap_mu);
}

/* Every pool (under mu): each device's default, the host's, the managed one, the program's */
#define FAKE_ALL_POOLS (FAKE_MAX_DEVS + 2 + 64)
static int all_pools(struct fake_pool *all[FAKE_ALL_POOLS])
{
    int n = 0;
    for (int d = 0; d < FAKE_MAX_DEVS; d++) all[n++] = &default_pools[d];
    all[n++] = &host_pool;
    all[n++] = &managed_pool;
    for (int i = 0; i < nuser_pools && n < FAKE_ALL_POOLS; i++) all[n++] = user_pools[i];
    return n;
}

/* FAKE_CUDA_POOL_PENDING=ctx: a context's synchronisation completes the pools' frees made on
 * streams that context created (and on the default streams, which the fake shares), not those
 * of other contexts' streams */
static void pools_complete_ctx(const struct fake_ctx *c)
{
    pthread_mutex_lock(&mu);
    struct fake_pool *all[FAKE_ALL_POOLS];
    int n = all_pools(all);
    for (int k = 0; k < n; k++)
        for (int i = 0; i < 8; i++) {
            const struct fake_stream *st = (const struct fake_stream *)all[k]->pend_stream[i];
            if (all[k]->pend_bytes[i] && (st == &legacy_stream || st == &ptds_stream || st->ctx == c))
                pool_complete(all[k], st);
        }
    for (int j = 0; j < MAX_ALLOCS; j++) { /* cuMemAlloc pointers freed with cuMemFreeAsync */
        const struct fake_stream *ps = (const struct fake_stream *)allocs[j].pend_stream;
        if (allocs[j].kind == K_PEND && (ps == &legacy_stream || ps == &ptds_stream || ps->ctx == c))
            plain_complete(ps);
    }
    pthread_mutex_unlock(&mu);
}

/* FAKE_CUDA_HANDLE_REUSE: a destroyed stream, the next cuStreamCreate's (under mu) */
static void *freed_stream;
/* FAKE_CUDA_POOL_PENDING: what destroyed streams freed, outstanding until a context's synchronisation
 * or end (the driver releases a destroyed stream once its work completes, which no stream's
 * synchronisation observes) */
static struct fake_stream gone_stream;

API CUresult cuStreamCreate(CUstream *s, unsigned int flags)
{
    (void)flags;
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    struct fake_stream *st = reuse_or_alloc(&freed_stream, sizeof(*st));
    st->ctx = current;
    *s = (CUstream)st;
    return CUDA_SUCCESS;
}

static int special_stream(CUstream s)
{
    return s == NULL || s == (CUstream)0x1 || s == CU_STREAM_PER_THREAD;
}

/* The context a stream belongs to: the current one for the special handles. */
static struct fake_ctx *stream_ctx(CUstream s)
{
    return special_stream(s) || !stream_of(s, 0)->ctx ? current : stream_of(s, 0)->ctx;
}

API CUresult cuStreamGetCtx(CUstream s, CUcontext *pctx)
{
    (void)fail_check("cuStreamGetCtx"); /* FAKE_CUDA_SLEEP only: never fails */
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    struct fake_ctx *c = stream_ctx(s);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

/* CUDA 12.8: the device of a stream's context */
API CUresult cuStreamGetDevice(CUstream s, CUdevice *d)
{
    if (driver_version() < 12080) return CUDA_ERROR_NOT_SUPPORTED;
    FAIL_POINT("cuStreamGetDevice");
    struct fake_ctx *c = stream_ctx(s);
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = 0; i < nvisible; i++)
        if (visible[i] == c->pdev) *d = i;
    return CUDA_SUCCESS;
}

static void capture_gone(struct fake_stream *st);

API CUresult cuStreamDestroy_v2(CUstream s)
{
    FAIL_POINT("cuStreamDestroy_v2");
    if (!s || s == (CUstream)0x1 || s == CU_STREAM_PER_THREAD) return CUDA_ERROR_INVALID_VALUE;
    capture_gone(stream_of(s, 0)); /* a capture in progress goes with its stream */
    pthread_mutex_lock(&mu);
    struct fake_pool *all[FAKE_ALL_POOLS];
    int n = all_pools(all);
    for (int k = 0; k < n; k++) /* its frees stay outstanding, no longer under its handle */
        for (int i = 0; i < 8; i++)
            if (all[k]->pend_bytes[i] && all[k]->pend_stream[i] == s) all[k]->pend_stream[i] = (CUstream)&gone_stream;
    for (int j = 0; j < MAX_ALLOCS; j++)
        if (allocs[j].kind == K_PEND && allocs[j].pend_stream == s) allocs[j].pend_stream = (CUstream)&gone_stream;
    if (getenv("FAKE_CUDA_HANDLE_REUSE") && !freed_stream) { /* the next cuStreamCreate gets its handle */
        freed_stream = s;
        s = NULL;
    }
    pthread_mutex_unlock(&mu);
    free(s);
    return CUDA_SUCCESS;
}

/* CUDA 2.x's entry point (cuGetProcAddress below 4000): the same destroy */
API CUresult cuStreamDestroy(CUstream s)
{
    FAIL_POINT("cuStreamDestroy");
    return cuStreamDestroy_v2(s);
}

API CUresult cuStreamSynchronize(CUstream s)
{
    sleep_until(__atomic_load_n(&stream_of(s, 0)->tail, __ATOMIC_ACQUIRE));
    pools_release_at_sync(stream_of(s, 0));
    return CUDA_SUCCESS;
}

API CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    sleep_until(__atomic_load_n(&stream_of(s, 1)->tail, __ATOMIC_ACQUIRE));
    pools_release_at_sync(stream_of(s, 1));
    return CUDA_SUCCESS;
}

/* FAKE_CUDA_CAPTURE_STRICT=1: as the real driver, a capture in global mode
 * (0) forbids potentially unsafe calls in every thread: cuEventQuery (and, with
 * FAKE_CUDA_CAPTURE_SYNC=1, cuCtxSynchronize: below) then fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
 * (900) and invalidates the capture, whose cuStreamEndCapture returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901). */
static int global_captures, capture_invalidated;
/* a thread-local capture (1) forbids them in its own thread only, and invalidates that thread's */
static __thread int local_captures, local_invalidated;

static int capture_forbids(void)
{
    static int strict = -1;
    if (strict < 0) strict = getenv("FAKE_CUDA_CAPTURE_STRICT") != NULL;
    if (!strict) return 0;
    if (local_captures) local_invalidated = 1;
    if (!__atomic_load_n(&global_captures, __ATOMIC_ACQUIRE)) return local_captures != 0;
    __atomic_store_n(&capture_invalidated, 1, __ATOMIC_RELEASE);
    return 1;
}

API CUresult cuStreamBeginCapture_v2(CUstream s, int mode)
{
    FAIL_POINT("cuStreamBeginCapture_v2");
    if (getenv("FAKE_CUDA_CAPTURE_REENTER")) {
        /* a profiler's API callback inside the call launching through the exported symbol */
        typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                     unsigned, CUstream, void **, void **);
        launch_t launch = (launch_t)dlsym(RTLD_DEFAULT, "cuLaunchKernel");
        if (launch) launch((CUfunction)0x99, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    }
    struct fake_stream *st = stream_of(s, 0);
    st->capturing = 1;
    st->capturer = &t_me;
    capturing_set(st, 1);
    st->capture_mode = mode;
    st->to_graph = 0;
    st->graph = fake_graph_new();
    if (mode == 0) __atomic_add_fetch(&global_captures, 1, __ATOMIC_ACQ_REL);
    if (mode == 1) local_captures++;
    return CUDA_SUCCESS;
}

/* CUDA 10.0's capture: always global */
API CUresult cuStreamBeginCapture(CUstream s)
{
    return cuStreamBeginCapture_v2(s, 0);
}

/* A capturing stream destroyed: its capture forbids nothing from then on (whether the real
 * driver allows the destroy is not documented; where it does, the capture cannot outlive it) */
static void capture_gone(struct fake_stream *st)
{
    if (st == &legacy_stream || st == &ptds_stream || st->capturer != &t_me || !st->capturing) return;
    capturing_set(st, 0);
    if (st->capture_mode == 0 && !__atomic_sub_fetch(&global_captures, 1, __ATOMIC_ACQ_REL))
        __atomic_store_n(&capture_invalidated, 0, __ATOMIC_RELEASE);
    if (st->capture_mode == 1 && local_captures > 0 && !--local_captures) local_invalidated = 0;
    st->capturing = 0;
    if (!st->to_graph) free(st->graph);
    st->graph = NULL;
}

/* A context went (under mu): its streams' captures with it */
static void captures_ctx_gone(const struct fake_ctx *c)
{
    struct fake_stream *gone[FAKE_CAPTURING];
    int n = 0;
    pthread_mutex_lock(&cap_mu);
    for (int i = 0; i < FAKE_CAPTURING; i++)
        if (capturing[i] && capturing[i]->ctx == c && capturing[i]->capturer == &t_me) gone[n++] = capturing[i];
    pthread_mutex_unlock(&cap_mu);
    for (int i = 0; i < n; i++) capture_gone(gone[i]);
}

API CUresult cuStreamEndCapture(CUstream s, void **graph)
{
    struct fake_stream *st = stream_of(s, 0);
    int invalidated = 0;
    if (st->capturing) capturing_set(st, 0);
    if (st->capturing && st->capture_mode == 0 && !__atomic_sub_fetch(&global_captures, 1, __ATOMIC_ACQ_REL))
        invalidated = __atomic_exchange_n(&capture_invalidated, 0, __ATOMIC_ACQ_REL);
    if (st->capturing && st->capture_mode == 1 && local_captures > 0 && !--local_captures) {
        invalidated = local_invalidated;
        local_invalidated = 0;
    }
    if (invalidated) {
        st->capturing = 0;
        if (!st->to_graph) free(st->graph);
        st->graph = NULL;
        if (graph) *graph = NULL;
        return 901; /* CUDA_ERROR_STREAM_CAPTURE_INVALIDATED */
    }
    st->capturing = 0;
    if (graph)
        *graph = st->graph;
    else if (!st->to_graph)
        free(st->graph);
    st->graph = NULL;
    return CUDA_SUCCESS;
}

API CUresult cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st)
{
    if (!st) return CUDA_ERROR_INVALID_VALUE;
    *st = stream_of(s, 0)->capturing ? 1 : 0;
    return CUDA_SUCCESS;
}

API CUresult cuStreamIsCapturing_ptsz(CUstream s, CUstreamCaptureStatus *st)
{
    if (!st) return CUDA_ERROR_INVALID_VALUE;
    *st = stream_of(s, 1)->capturing ? 1 : 0;
    return CUDA_SUCCESS;
}

static long live_events;

API CUresult cuEventCreate(CUevent *e, unsigned int flags)
{
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    struct fake_event *ev = calloc(1, sizeof(*ev));
    ev->ctx = current;
    ev->flags = flags;
    *e = (CUevent)ev;
    __atomic_add_fetch(&live_events, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

API CUresult cuEventDestroy_v2(CUevent e)
{
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    free(e);
    __atomic_sub_fetch(&live_events, 1, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

/* CUDA IPC events: only an event made with CU_EVENT_INTERPROCESS and CU_EVENT_DISABLE_TIMING
 * may be exported (the driver's documentation); the handle names the exporter and carries what
 * the event recorded when it was exported (a snapshot: the fake shares no event state between
 * processes), and the importer gets an event of its own current context, which waits and
 * synchronisations take as any other.  Nothing here takes device memory. */
#define FAKE_EVENT_DISABLE_TIMING 0x2
#define FAKE_EVENT_INTERPROCESS 0x4
struct fake_ipc_event_body {
    char magic[8];
    int32_t pid, recorded;
    uint64_t t;
};

API CUresult cuIpcGetEventHandle(fake_ipc_handle *handle, CUevent e)
{
    FAIL_POINT("cuIpcGetEventHandle");
    struct fake_event *ev = (struct fake_event *)e;
    if (!handle || !ev) return CUDA_ERROR_INVALID_VALUE;
    if ((ev->flags & (FAKE_EVENT_DISABLE_TIMING | FAKE_EVENT_INTERPROCESS)) !=
        (FAKE_EVENT_DISABLE_TIMING | FAKE_EVENT_INTERPROCESS))
        return CUDA_ERROR_INVALID_HANDLE;
    struct fake_ipc_event_body body = {"FAKEEVT", (int32_t)getpid(), ev->recorded, ev->t};
    memset(handle, 0, sizeof(*handle));
    memcpy(handle->reserved, &body, sizeof(body));
    return CUDA_SUCCESS;
}

API CUresult cuIpcOpenEventHandle(CUevent *e, fake_ipc_handle handle)
{
    FAIL_POINT("cuIpcOpenEventHandle");
    NEED_CTX();
    struct fake_ipc_event_body body;
    memcpy(&body, handle.reserved, sizeof(body));
    if (!e || memcmp(body.magic, "FAKEEVT", 8)) return CUDA_ERROR_INVALID_VALUE;
    if (body.pid == (int32_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT; /* not in its own process */
    if (kill(body.pid, 0) != 0) return CUDA_ERROR_INVALID_HANDLE;
    CUresult rc = cuEventCreate(e, FAKE_EVENT_DISABLE_TIMING | FAKE_EVENT_INTERPROCESS);
    if (rc != CUDA_SUCCESS) return rc;
    struct fake_event *ev = (struct fake_event *)*e;
    ev->recorded = body.recorded;
    ev->t = body.t;
    return CUDA_SUCCESS;
}

/* Events created and not destroyed (tests: nothing leaks). */
API long fake_cuda_live_events(void)
{
    return __atomic_load_n(&live_events, __ATOMIC_RELAXED);
}

/* Whether the co-tenant still runs at time t (before the first launch: it will). */
static int cotenant_at(uint64_t t)
{
    uint64_t base = __atomic_load_n(&cot_base, __ATOMIC_ACQUIRE);
    return cot_slice_ns && (!base || !cot_for_ns || t < base + cot_for_ns);
}

/* Test-only: whether the co-tenant runs now (the fake NVML reports its share). */
API int fake_cuda_cotenant(void)
{
    return cotenant_at(now_ns());
}

/* With a co-tenant: the earliest time from t on at which this process runs. */
static uint64_t own_slice(uint64_t t)
{
    uint64_t base = __atomic_load_n(&cot_base, __ATOMIC_ACQUIRE);
    if (!cot_slice_ns || !base || t < base || !cotenant_at(t)) return t;
    uint64_t round = (1 + cot_n) * cot_slice_ns, p = (t - base) % round;
    return p < cot_slice_ns ? t : t + round - p;
}

/* With a co-tenant: when `work` ns of this process's kernels started at t finish. */
static uint64_t run_sliced(uint64_t t, uint64_t work)
{
    for (t = own_slice(t); work;) {
        if (!cotenant_at(t)) return t + work; /* it left: the GPU is ours */
        uint64_t room = cot_slice_ns - (t - cot_base) % ((1 + cot_n) * cot_slice_ns);
        if (work <= room) return t + work;
        work -= room;
        t += room + cot_n * cot_slice_ns; /* switched out for the others' slices */
    }
    return t;
}

/* FAKE_CUDA_EVENT_SKEW="AFTER_MS:SKEW_MS": events that complete more than AFTER_MS after the
 * first one recorded are SKEW_MS later for cuEventElapsedTime (only): as if hours had passed
 * between them and the early ones, whose float milliseconds then lose their precision */
static uint64_t first_event_t;

static uint64_t skewed(uint64_t t)
{
    static long long after_ms = -1, skew_ms;
    if (after_ms < 0) {
        const char *v = getenv("FAKE_CUDA_EVENT_SKEW");
        if (!v || sscanf(v, "%lld:%lld", &after_ms, &skew_ms) != 2) after_ms = skew_ms = 0;
    }
    uint64_t t0 = __atomic_load_n(&first_event_t, __ATOMIC_RELAXED);
    return skew_ms && t0 && t > t0 + (uint64_t)after_ms * 1000000ull ? t + (uint64_t)skew_ms * 1000000ull : t;
}

static CUresult event_record(CUevent e, CUstream s, int ptsz)
{
    FAIL_POINT("cuEventRecord");
    struct fake_event *ev = (struct fake_event *)e;
    if (!ev) return CUDA_ERROR_INVALID_VALUE;
    struct fake_stream *st = stream_of(s, ptsz);
    /* as the real driver: an event is recorded only on a stream of its own context */
    if (!special_stream(s) && st->ctx && ev->ctx && st->ctx != ev->ctx) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t n = now_ns(), tail = __atomic_load_n(&st->tail, __ATOMIC_ACQUIRE);
    ev->t = tail > n ? tail : own_slice(n);
    ev->recorded = 1;
    uint64_t none = 0;
    __atomic_compare_exchange_n(&first_event_t, &none, ev->t, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

API CUresult cuEventRecord(CUevent e, CUstream s)
{
    api_callback("cuEventRecord");
    return event_record(e, s, 0);
}

API CUresult cuEventRecord_ptsz(CUevent e, CUstream s)
{
    return event_record(e, s, 1);
}

API CUresult cuEventQuery(CUevent e)
{
    FAIL_POINT("cuEventQuery");
    api_callback("cuEventQuery");
    if (capture_forbids()) return 900; /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
    struct fake_event *ev = (struct fake_event *)e;
    if (!ev) return CUDA_ERROR_INVALID_VALUE;
    return !ev->recorded || now_ns() >= ev->t ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuEventSynchronize(CUevent e)
{
    struct fake_event *ev = (struct fake_event *)e;
    if (!ev) return CUDA_ERROR_INVALID_VALUE;
    if (ev->recorded) sleep_until(ev->t);
    pools_release_at_sync(NULL);
    return CUDA_SUCCESS;
}

API CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b)
{
    FAIL_POINT("cuEventElapsedTime");
    struct fake_event *x = (struct fake_event *)a, *y = (struct fake_event *)b;
    if (!ms || !x || !y || !x->recorded || !y->recorded) return CUDA_ERROR_INVALID_VALUE;
    if ((x->flags | y->flags) & 0x2) return CUDA_ERROR_INVALID_HANDLE; /* CU_EVENT_DISABLE_TIMING */
    uint64_t n = now_ns();
    if (n < x->t || n < y->t) return CUDA_ERROR_NOT_READY;
    *ms = (float)(((double)skewed(y->t) - (double)skewed(x->t)) / 1e6);
    return CUDA_SUCCESS;
}

API CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b)
{
    return cuEventElapsedTime(ms, a, b);
}

/* FAKE_CUDA_CAPTURE_SYNC=1 (with FAKE_CUDA_CAPTURE_STRICT=1): a synchronisation of the context
 * is one of the calls a global capture forbids too, as on the driver: made while one is on, or
 * still waiting when one begins (in any thread), it fails and invalidates the capture.  Not by
 * default: gsprobe's bench synchronises its context while other tests hold a capture open.
 * FAKE_CUDA_SLEEP "cuCtxSynchronize:MS" makes it take that long, "cuCtxSynchronizeAfter:MS" holds it
 * that long once the frees it covers are complete (their memory gone, the call not yet returned). */
API CUresult cuCtxSynchronize(void)
{
    static int sync_forbidden = -1;
    if (sync_forbidden < 0) sync_forbidden = getenv("FAKE_CUDA_CAPTURE_SYNC") != NULL;
    api_callback("cuCtxSynchronize");
    int forbidden = sync_forbidden && capture_forbids();
    FAIL_POINT("cuCtxSynchronize");
    sleep_until(__atomic_load_n(&legacy_stream.tail, __ATOMIC_ACQUIRE));
    sleep_until(__atomic_load_n(&ptds_stream.tail, __ATOMIC_ACQUIRE));
    static int per_ctx = -1;
    if (per_ctx < 0) per_ctx = (getenv("FAKE_CUDA_POOL_PENDING") && !strcmp(getenv("FAKE_CUDA_POOL_PENDING"), "ctx"));
    if (per_ctx) pools_complete_ctx(current); /* the frees of this context's own streams only */
    else pools_release_at_sync(NULL);
    (void)fail_check("cuCtxSynchronizeAfter"); /* FAKE_CUDA_SLEEP: still inside, the frees complete */
    if (sync_forbidden && capture_forbids()) forbidden = 1;
    return forbidden ? 900 : CUDA_SUCCESS; /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
}

/* CUDA 13's: the context is an argument, NULL for the current one (this fake has one context's
 * work per process) */
API CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    if (!ctx && (cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    return cuCtxSynchronize();
}

/* What the kernels queued so far have run by now, as NVML reports it (work as it runs, not as it
 * is queued): the spans [start, end) of queued work not over yet, each with its kernel time
 * (spread evenly over it), and the kernel time of those that are. */
#define RUN_SPANS 4096
static struct {
    uint64_t start, end, ns;
} run_span[RUN_SPANS];
static unsigned run_n;
static uint64_t run_done;
static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;

static void run_fold_locked(uint64_t now)
{
    unsigned k = 0;
    for (unsigned i = 0; i < run_n; i++) {
        if (run_span[i].end <= now)
            run_done += run_span[i].ns;
        else
            run_span[k++] = run_span[i];
    }
    run_n = k;
}

static void note_run(uint64_t start, uint64_t end, uint64_t ns)
{
    pthread_mutex_lock(&run_mu);
    if (run_n && run_span[run_n - 1].end == start) { /* right after the last span: one span */
        run_span[run_n - 1].end = end;
        run_span[run_n - 1].ns += ns;
    } else {
        if (run_n == RUN_SPANS) run_fold_locked(now_ns());
        if (run_n < RUN_SPANS)
            run_span[run_n++] = (typeof(run_span[0])){start, end, ns};
        else
            run_done += ns; /* too many spans in flight: counted as run */
    }
    pthread_mutex_unlock(&run_mu);
}

/* Test-only (the fake NVML's utilisation): kernel time run by now. */
API uint64_t fake_cuda_kernel_run_ns(void)
{
    pthread_mutex_lock(&run_mu);
    uint64_t now = now_ns();
    run_fold_locked(now);
    uint64_t ran = run_done;
    for (unsigned i = 0; i < run_n; i++)
        if (run_span[i].start < now)
            ran += (uint64_t)((double)run_span[i].ns * (double)(now - run_span[i].start) /
                              (double)(run_span[i].end - run_span[i].start));
    pthread_mutex_unlock(&run_mu);
    return ran;
}

/* Run `count` kernels on the stream's timeline. */
/* FAKE_CUDA_SERIAL=1: the process's kernels run one at a time across all its streams (as
 * kernels that fill the GPU do), so a kernel may wait for another stream's before it starts;
 * otherwise every stream has the GPU to itself. */
static uint64_t serial_tail;
static pthread_mutex_t serial_mu = PTHREAD_MUTEX_INITIALIZER;

/* FAKE_STREAM_CTX_LAUNCH=1: a launch with no current context runs in its (non-special) stream's
 * context, as cuda.h says of a context-less kernel (a CUkernel); otherwise one is needed. */
static CUresult enqueue(CUstream s, int ptsz, uint64_t count)
{
    static int stream_ctx_launch = -1;
    if (stream_ctx_launch < 0) stream_ctx_launch = getenv("FAKE_STREAM_CTX_LAUNCH") != NULL;
    if (!(stream_ctx_launch && !current && !special_stream(s) && stream_of(s, ptsz)->ctx)) NEED_CTX();
    static int serial = -1;
    if (serial < 0) serial = getenv("FAKE_CUDA_SERIAL") != NULL;
    struct fake_stream *st = stream_of(s, ptsz);
    uint64_t tail = __atomic_load_n(&st->tail, __ATOMIC_ACQUIRE);
    if (tail > 1024 * kernel_ns) sleep_until(tail - 1024 * kernel_ns); /* the launch queue is full */
    uint64_t n = now_ns(), each = kernel_ns;
    if (clk_exp) {
        double mhz = clock_now(n);
        if (!clk_membound) each = (uint64_t)((double)kernel_ns * clk_max / mhz);
        add_energy(count * each, mhz);
    }
    static int shared = -1;
    if (shared < 0) shared = fake_gpu_shared() && fake_phys_map();
    if (shared) {
        /* one GPU for every process of the state file: after whatever any of them queued */
        struct fake_phys *m = fake_phys_map();
        int me = phys_slot();
        pthread_mutex_lock(&serial_mu);
        uint64_t start = tail > n ? tail : n, g = __atomic_load_n(&m->gpu_tail, __ATOMIC_ACQUIRE), end;
        if (serial_tail > start) start = serial_tail;
        do {
            end = (start > g ? start : g) + count * each;
        } while (!__atomic_compare_exchange_n(&m->gpu_tail, &g, end, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
        serial_tail = end;
        __atomic_store_n(&st->tail, end, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&serial_mu);
        note_run(end - count * each, end, count * each);
        if (me >= 0) __atomic_add_fetch(&m->procs[me].kernel_ns, count * each, __ATOMIC_RELAXED);
        __atomic_add_fetch(&kernel_total_ns, count * each, __ATOMIC_RELAXED);
        return CUDA_SUCCESS;
    }
    if (serial || cot_slice_ns) {
        pthread_mutex_lock(&serial_mu);
        uint64_t start = tail > n ? tail : n;
        if (serial_tail > start) start = serial_tail;
        if (cot_slice_ns && !cot_base) __atomic_store_n(&cot_base, n, __ATOMIC_RELEASE);
        serial_tail = cot_slice_ns ? run_sliced(start, count * each) : start + count * each;
        __atomic_store_n(&st->tail, serial_tail, __ATOMIC_RELEASE);
        uint64_t end = serial_tail;
        pthread_mutex_unlock(&serial_mu);
        note_run(start, end, count * each);
        __atomic_add_fetch(&kernel_total_ns, count * each, __ATOMIC_RELAXED);
        return CUDA_SUCCESS;
    }
    uint64_t start = tail > n ? tail : n;
    __atomic_store_n(&st->tail, start + count * each, __ATOMIC_RELEASE);
    __atomic_add_fetch(&kernel_total_ns, count * each, __ATOMIC_RELAXED);
    note_run(start, start + count * each, count * each);
    return CUDA_SUCCESS;
}

/* FAKE_COLLECTIVE_FN launches a collective across the FAKE_CUDA_RANKS (default 2) live processes
 * of the state file, each on a GPU of its own (tensor-parallel ranks, NCCL's all-reduce): its
 * kernel starts after the stream's queued work and spins until the last rank's has started,
 * then runs FAKE_CUDA_COLLECTIVE_US (default 100); the spin is GPU time like any other.  The
 * launch returns once every rank has launched its own, so the host does not run ahead of it
 * (the ranks of a step synchronise anyway); CUDA_ERROR_LAUNCH_TIMEOUT after
 * FAKE_CUDA_COLLECTIVE_WAIT_MS (default 5000) without them. */
#define FAKE_COLLECTIVE_FN ((CUfunction)0xC011EC7)
/* A kernel whose time grows with its grid: a launch of FAKE_GRID_FN runs gridDimX kernels of
 * FAKE_CUDA_KERNEL_US (cuLaunchKernel[_ptsz]), one of FAKE_GRID2_FN gridDimX squared (attention
 * over a sequence its grid follows); any other function runs one, whatever its grid */
#define FAKE_GRID_FN ((CUfunction)0x6d1d)
#define FAKE_GRID2_FN ((CUfunction)0x6d2d)

static unsigned grid_kernels(CUfunction f, unsigned gx)
{
    if (!gx) return 1;
    return f == FAKE_GRID_FN ? gx : f == FAKE_GRID2_FN ? gx * gx : 1;
}

static unsigned env_u(const char *name, unsigned dflt)
{
    const char *v = getenv(name);
    return v && *v ? (unsigned)strtoul(v, NULL, 10) : dflt;
}

static CUresult collective(CUstream s, int ptsz)
{
    NEED_CTX();
    struct fake_phys *m = fake_phys_map();
    int me = phys_slot();
    if (!m || me < 0) return CUDA_ERROR_NOT_SUPPORTED;
    static uint32_t seq;
    unsigned ranks = env_u("FAKE_CUDA_RANKS", 2);
    uint64_t x = env_u("FAKE_CUDA_COLLECTIVE_US", 100) * 1000ull;
    struct fake_stream *st = stream_of(s, ptsz);
    uint64_t n = now_ns(), tail = __atomic_load_n(&st->tail, __ATOMIC_ACQUIRE), start = tail > n ? tail : n;
    uint64_t give_up = n + env_u("FAKE_CUDA_COLLECTIVE_WAIT_MS", 5000) * 1000000ull, last;
    seq++;
    __atomic_store_n(&m->coll[me].start[seq % 8], start, __ATOMIC_RELAXED);
    __atomic_store_n(&m->coll[me].seq, seq, __ATOMIC_RELEASE);
    for (;;) {
        unsigned arrived = 0;
        last = start;
        for (int i = 0; i < FAKE_MAX_PROCS; i++) {
            int32_t pid = __atomic_load_n(&m->procs[i].pid, __ATOMIC_ACQUIRE);
            if (pid <= 0 || __atomic_load_n(&m->coll[i].seq, __ATOMIC_ACQUIRE) < seq) continue;
            if (i != me && kill(pid, 0) != 0) continue;
            arrived++;
            uint64_t t = __atomic_load_n(&m->coll[i].start[seq % 8], __ATOMIC_RELAXED);
            if (t > last) last = t;
        }
        if (arrived >= ranks) break;
        if (now_ns() >= give_up) return (CUresult)702; /* CUDA_ERROR_LAUNCH_TIMEOUT */
        sleep_until(now_ns() + 20000);
    }
    __atomic_store_n(&st->tail, last + x, __ATOMIC_RELEASE);
    note_run(start, last + x, last + x - start);
    __atomic_add_fetch(&kernel_total_ns, last + x - start, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

/* A kernel needing more local memory per thread than its context's stack limit
 * (FAKE_CUDA_FUNC_LOCAL) grows the limit at its launch, for every thread the device runs at
 * once, and keeps it (cuda.h, CU_LIMIT_STACK_SIZE) */
static CUresult launch_stack(CUfunction f, CUstream s)
{
    uint64_t lm = func_local(f);
    if (!lm) return CUDA_SUCCESS;
    NEED_CTX();
    struct fake_ctx *c = stream_ctx(s);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    CUresult rc = CUDA_SUCCESS;
    uint64_t want = lm * stack_threads();
    if (want > c->limits[0]) {
        rc = phys_add(c->pdev, want - c->limits[0]);
        if (rc == CUDA_SUCCESS) {
            c->modules += want - c->limits[0];
            c->limits[0] = want;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

#define FAKE_LAUNCH_PARAMS                                                                                     \
    CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,          \
        unsigned int bz, unsigned int shmem, CUstream s

API CUresult cuLaunchKernel(FAKE_LAUNCH_PARAMS, void **params, void **extra)
{
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)params, (void)extra;
    FAIL_POINT("cuLaunchKernel");
    if (f == FAKE_COLLECTIVE_FN) return collective(s, 0);
    CUresult rc = lazy_code(f);
    if (rc == CUDA_SUCCESS) rc = launch_stack(f, s);
    if (rc != CUDA_SUCCESS) return rc;
    rc = f ? enqueue(s, 0, grid_kernels(f, gx)) : CUDA_ERROR_INVALID_VALUE;
    (void)fail_check("cuLaunchKernelAfter"); /* FAKE_CUDA_SLEEP: still inside, the kernel queued */
    return rc;
}

API CUresult cuLaunchKernel_ptsz(FAKE_LAUNCH_PARAMS, void **params, void **extra)
{
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)params, (void)extra;
    CUresult rc = lazy_code(f);
    if (rc == CUDA_SUCCESS) rc = launch_stack(f, s);
    if (rc != CUDA_SUCCESS) return rc;
    return f ? enqueue(s, 1, grid_kernels(f, gx)) : CUDA_ERROR_INVALID_VALUE;
}

/* CUDA 2.x's launches: the legacy stream, or a stream for cuLaunchGridAsync */
API CUresult cuLaunch(CUfunction f)
{
    FAIL_POINT("cuLaunch");
    CUresult rc = lazy_code(f);
    if (rc == CUDA_SUCCESS) rc = launch_stack(f, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    return f ? enqueue(NULL, 0, 1) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuLaunchGrid(CUfunction f, int w, int h)
{
    FAIL_POINT("cuLaunchGrid");
    CUresult rc = lazy_code(f);
    if (rc == CUDA_SUCCESS) rc = launch_stack(f, NULL);
    if (rc != CUDA_SUCCESS) return rc;
    return f && w > 0 && h > 0 ? enqueue(NULL, 0, 1) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuLaunchGridAsync(CUfunction f, int w, int h, CUstream s)
{
    FAIL_POINT("cuLaunchGridAsync");
    CUresult rc = lazy_code(f);
    if (rc == CUDA_SUCCESS) rc = launch_stack(f, s);
    if (rc != CUDA_SUCCESS) return rc;
    return f && w > 0 && h > 0 ? enqueue(s, 0, 1) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuLaunchCooperativeKernel(FAKE_LAUNCH_PARAMS, void **params)
{
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)params;
    CUresult rc = f ? launch_stack(f, s) : CUDA_SUCCESS;
    if (rc != CUDA_SUCCESS) return rc;
    return f ? enqueue(s, 0, 1) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuLaunchCooperativeKernel_ptsz(FAKE_LAUNCH_PARAMS, void **params)
{
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)params;
    CUresult rc = f ? launch_stack(f, s) : CUDA_SUCCESS;
    if (rc != CUDA_SUCCESS) return rc;
    return f ? enqueue(s, 1, 1) : CUDA_ERROR_INVALID_VALUE;
}

/* One kernel per device, each on a stream of its own (never a special handle), all queued
 * by one call; the devices must differ. */
API CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list, unsigned int n, unsigned int flags)
{
    (void)flags;
    NEED_CTX();
    if (!list || !n || n > (unsigned)nvisible) return CUDA_ERROR_INVALID_VALUE;
    for (unsigned i = 0; i < n; i++) {
        if (!list[i].function || special_stream(list[i].hStream)) return CUDA_ERROR_INVALID_VALUE;
        for (unsigned j = 0; j < i; j++)
            if (stream_ctx(list[j].hStream)->pdev == stream_ctx(list[i].hStream)->pdev) return CUDA_ERROR_INVALID_DEVICE;
    }
    for (unsigned i = 0; i < n; i++) {
        CUresult rc = enqueue(list[i].hStream, 0, 1);
        if (rc != CUDA_SUCCESS) return rc;
    }
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    (void)params, (void)extra;
    CUresult rc = lazy_code(f);
    if (rc == CUDA_SUCCESS && c) rc = launch_stack(f, c->hStream);
    if (rc != CUDA_SUCCESS) return rc;
    return c && f ? enqueue(c->hStream, 0, 1) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    (void)params, (void)extra;
    CUresult rc = c && f ? launch_stack(f, c->hStream) : CUDA_SUCCESS;
    if (rc != CUDA_SUCCESS) return rc;
    return c && f ? enqueue(c->hStream, 1, 1) : CUDA_ERROR_INVALID_VALUE;
}

/* A fake graph "executable" is the number of kernels it runs, or one made
 * by cuGraphInstantiate* (fakegraph.h). */
API CUresult cuGraphLaunch(CUgraphExec g, CUstream s)
{
    CUresult rc;
    if (fake_gexec_launch(g, s, 0, &rc)) return rc;
    return g ? enqueue(s, 0, (uint64_t)(uintptr_t)g) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGraphLaunch_ptsz(CUgraphExec g, CUstream s)
{
    CUresult rc;
    if (fake_gexec_launch(g, s, 1, &rc)) return rc;
    return g ? enqueue(s, 1, (uint64_t)(uintptr_t)g) : CUDA_ERROR_INVALID_VALUE;
}

/* A stream wait on a host flag nobody sets: the stream is held for FAKE_WAIT_MS (default
 * 100 s) after whatever it had queued, as a cuStreamWaitValue32 on a flag set later would. */
API CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags)
{
    (void)addr, (void)value, (void)flags;
    NEED_CTX();
    struct fake_stream *st = stream_of(s, 0);
    const char *w = getenv("FAKE_WAIT_MS");
    uint64_t n = now_ns(), tail = __atomic_load_n(&st->tail, __ATOMIC_ACQUIRE);
    __atomic_store_n(&st->tail, (tail > n ? tail : n) + (uint64_t)(w ? atoll(w) : 100000) * 1000000ull,
                     __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

/* Work on a stream that is not a kernel: an async copy (on a copy engine), a host function, a
 * wait for an event.  It holds the stream after what it had queued (a copy FAKE_CUDA_COPY_US,
 * default 0; a host function FAKE_CUDA_HOSTFN_US, default 0; a wait until the event's time), and
 * is neither kernel time nor in NVML's utilisation.  No bytes move: device pointers are
 * numbers here. */
static CUresult hold_stream(CUstream s, int ptsz, const char *env, uint64_t until)
{
    NEED_CTX();
    struct fake_stream *st = stream_of(s, ptsz);
    const char *v = env ? getenv(env) : NULL;
    uint64_t n = now_ns(), tail = __atomic_load_n(&st->tail, __ATOMIC_ACQUIRE), start = tail > n ? tail : n;
    uint64_t end = env ? start + (uint64_t)(v ? atoll(v) : 0) * 1000ull : until > start ? until : start;
    __atomic_store_n(&st->tail, end, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    FAIL_POINT("cuMemcpyHtoDAsync_v2");
    return dst && src && n ? hold_stream(s, 0, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    return dst && src && n ? hold_stream(s, 1, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    return dst && src && n ? hold_stream(s, 0, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    return dst && src && n ? hold_stream(s, 0, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

static CUresult prefetch(CUdeviceptr p, size_t n, CUstream s, int ptsz)
{
    return p && n ? hold_stream(s, ptsz, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation where, unsigned flags, CUstream s)
{
    (void)where, (void)flags;
    return prefetch(p, n, s, 0);
}

API CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr p, size_t n, CUmemLocation where, unsigned flags, CUstream s)
{
    (void)where, (void)flags;
    return prefetch(p, n, s, 1);
}

/* CUDA 13.0's batched prefetches and the decompression engine (CUDA 12.6): copies here */
static CUresult batch_copy(CUstream s, size_t count, int ptsz)
{
    return count ? hold_stream(s, ptsz, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

#define FAKE_PREFETCH_BATCH(name, ptsz)                                                                       \
    API CUresult name(CUdeviceptr *dptrs, size_t *sizes, size_t count, CUmemLocation *locs, size_t *loc_idxs, \
                      size_t nlocs, unsigned long long flags, CUstream s)                                     \
    {                                                                                                         \
        (void)dptrs, (void)sizes, (void)locs, (void)loc_idxs, (void)nlocs, (void)flags;                       \
        return batch_copy(s, count, ptsz);                                                                    \
    }
FAKE_PREFETCH_BATCH(cuMemPrefetchBatchAsync, 0)
FAKE_PREFETCH_BATCH(cuMemPrefetchBatchAsync_ptsz, 1)
FAKE_PREFETCH_BATCH(cuMemDiscardAndPrefetchBatchAsync, 0)
FAKE_PREFETCH_BATCH(cuMemDiscardAndPrefetchBatchAsync_ptsz, 1)

API CUresult cuMemBatchDecompressAsync(CUmemDecompressParams *params, size_t count, unsigned flags, size_t *err_idx,
                                       CUstream s)
{
    (void)params, (void)flags, (void)err_idx;
    return batch_copy(s, count, 0);
}

API CUresult cuMemBatchDecompressAsync_ptsz(CUmemDecompressParams *params, size_t count, unsigned flags,
                                            size_t *err_idx, CUstream s)
{
    (void)params, (void)flags, (void)err_idx;
    return batch_copy(s, count, 1);
}

/* the function is called at once (the tests' do nothing); the stream is held as if it ran in order */
static CUresult host_func(CUstream s, CUhostFn fn, void *data, int ptsz)
{
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    fn(data);
    return hold_stream(s, ptsz, "FAKE_CUDA_HOSTFN_US", 0);
}

API CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void *data)
{
    return host_func(s, fn, data, 0);
}

API CUresult cuLaunchHostFunc_ptsz(CUstream s, CUhostFn fn, void *data)
{
    return host_func(s, fn, data, 1);
}

/* CUDA 13.2: with a dispatch mode (0 blocking, 1 a spinning driver thread), the same here */
API CUresult cuLaunchHostFunc_v2(CUstream s, CUhostFn fn, void *data, unsigned mode)
{
    return mode > 1 ? CUDA_ERROR_INVALID_VALUE : host_func(s, fn, data, 0);
}

API CUresult cuLaunchHostFunc_v2_ptsz(CUstream s, CUhostFn fn, void *data, unsigned mode)
{
    return mode > 1 ? CUDA_ERROR_INVALID_VALUE : host_func(s, fn, data, 1);
}

/* CUDA 13.2's single copies with attributes (which the fake does not read) */
API CUresult cuMemcpyWithAttributesAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUmemcpyAttributes *attr,
                                         CUstream s)
{
    return dst && src && n && attr ? hold_stream(s, 0, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemcpyWithAttributesAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUmemcpyAttributes *attr,
                                              CUstream s)
{
    return dst && src && n && attr ? hold_stream(s, 1, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemcpy3DWithAttributesAsync(CUDA_MEMCPY3D_BATCH_OP *op, unsigned long long flags, CUstream s)
{
    return op && !flags ? hold_stream(s, 0, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemcpy3DWithAttributesAsync_ptsz(CUDA_MEMCPY3D_BATCH_OP *op, unsigned long long flags, CUstream s)
{
    return op && !flags ? hold_stream(s, 1, "FAKE_CUDA_COPY_US", 0) : CUDA_ERROR_INVALID_VALUE;
}

static CUresult wait_event(CUstream s, CUevent e, int ptsz)
{
    struct fake_event *ev = (struct fake_event *)e;
    if (!ev) return CUDA_ERROR_INVALID_VALUE;
    return hold_stream(s, ptsz, NULL, ev->recorded ? ev->t : 0);
}

API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags)
{
    (void)flags;
    return wait_event(s, e, 0);
}

API CUresult cuStreamWaitEvent_ptsz(CUstream s, CUevent e, unsigned flags)
{
    (void)flags;
    return wait_event(s, e, 1);
}

/* Test-only: each kernel launched from now on runs `us` (FAKE_CUDA_KERNEL_US's value), as the
 * kernels of code loaded again, recompiled to do more, do */
API void fake_cuda_kernel_us_set(uint64_t us)
{
    __atomic_store_n(&kernel_ns, us * 1000, __ATOMIC_RELAXED);
}

/* Test-only introspection. */
API uint64_t fake_cuda_kernel_ns(void)
{
    return __atomic_load_n(&kernel_total_ns, __ATOMIC_RELAXED);
}

API uint64_t fake_cuda_local_used(int pdev)
{
    return pdev >= 0 && pdev < FAKE_MAX_DEVS ? local_used[pdev] : 0;
}

#include "fakegraph.h"

/* ---- cuGetProcAddress ----------------------------------------------------- */

#define FAKE_FUNCS(X)                                                                                          \
    X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetUuid) X(cuDeviceGetUuid_v2) \
    X(cuDeviceTotalMem_v2) X(cuDeviceGetName) X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxGetState)          \
    X(cuDevicePrimaryCtxRelease_v2) X(cuDevicePrimaryCtxReset_v2) X(cuCtxCreate_v2) X(cuCtxCreate_v3)           \
    X(cuCtxCreate_v4) X(cuCtxDestroy_v2) X(cuCtxSetCurrent) X(cuCtxGetCurrent) X(cuCtxGetDevice)                \
    X(cuCtxSynchronize) X(cuCtxSetLimit) X(cuCtxGetLimit) X(cuFuncGetAttribute) X(cuKernelGetAttribute) X(cuDeviceGetAttribute) X(cuMemAlloc_v2) X(cuMemAllocManaged) X(cuMemAllocPitch_v2) X(cuMemFree_v2)             \
    X(cuMemGetAddressRange_v2) X(cuMemGetInfo_v2) X(cuMemCreate) X(cuMemRelease)                                \
    X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap)      \
    X(cuMemSetAccess) X(cuMemRetainAllocationHandle) X(cuMemMapArrayAsync) X(cuMemMapArrayAsync_ptsz) X(cuArrayCreate_v2) X(cuArray3DCreate_v2) X(cuArrayDestroy)                \
    X(cuMipmappedArrayCreate) X(cuMipmappedArrayDestroy) X(cuDeviceGetMemPool) X(cuDeviceGetDefaultMemPool) X(cuDeviceSetMemPool)    \
    X(cuMemGetDefaultMemPool) X(cuMemGetMemPool) X(cuMemSetMemPool)                                                               \
    X(cuMemPoolCreate) X(cuMemPoolDestroy) X(cuMemPoolTrimTo) X(cuMemPoolGetAttribute) X(cuMemPoolSetAttribute)                          \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz)       \
    X(cuMemFreeAsync) X(cuMemFreeAsync_ptsz) X(cuStreamCreate) X(cuStreamGetCtx) X(cuStreamDestroy) X(cuStreamDestroy_v2) X(cuStreamSynchronize)     \
    X(cuStreamSynchronize_ptsz) X(cuStreamBeginCapture) X(cuStreamBeginCapture_v2) X(cuStreamBeginCaptureToGraph) X(cuStreamEndCapture) X(cuStreamIsCapturing)         \
    X(cuStreamIsCapturing_ptsz) X(cuEventCreate) X(cuEventDestroy_v2) X(cuEventRecord) X(cuEventRecord_ptsz)    \
    X(cuEventQuery) X(cuEventSynchronize) X(cuEventElapsedTime) X(cuEventElapsedTime_v2) X(cuLaunchKernel)      \
    X(cuLaunchKernel_ptsz) X(cuLaunchCooperativeKernel) X(cuLaunchCooperativeKernel_ptsz) X(cuLaunchKernelEx)   \
    X(cuLaunchCooperativeKernelMultiDevice) X(cuGreenCtxCreate) X(cuGreenCtxDestroy) X(cuCtxFromGreenCtx)         \
    X(cuDeviceGetDevResource) X(cuDevResourceGenerateDesc)                                                     \
    X(cuLaunchKernelEx_ptsz) X(cuGraphLaunch) X(cuGraphLaunch_ptsz) X(cuGetProcAddress) X(cuGetProcAddress_v2)  \
    X(cuModuleLoad) X(cuModuleLoadData) X(cuModuleLoadDataEx) X(cuModuleLoadFatBinary) X(cuModuleUnload)       \
    X(cuModuleGetFunction) X(cuLibraryLoadData) X(cuLibraryLoadFromFile) X(cuLibraryUnload)                    \
    X(cuLibraryGetKernel) X(cuKernelGetFunction) X(cuFuncLoad) X(cuLibraryGetModule) X(cuLibraryGetGlobal) X(cuModuleGetLoadingMode) X(cuGraphCreate) X(cuGraphDestroy) X(cuGraphAddMemAllocNode)   \
    X(cuGraphAddChildGraphNode) X(cuGraphGetNodes) X(cuGraphNodeGetType) X(cuGraphMemAllocNodeGetParams)        \
    X(cuGraphChildGraphNodeGetGraph) X(cuGraphInstantiateWithFlags) X(cuGraphInstantiate_v2)                   \
    X(cuGraphInstantiate) X(cuCtxSynchronize_v2)                                                               \
    X(cuGraphInstantiateWithParams) X(cuGraphInstantiateWithParams_ptsz) X(cuGraphUpload) X(cuGraphUpload_ptsz) \
    X(cuGraphExecDestroy) X(cuGraphAddKernelNode) X(cuGraphAddKernelNode_v2) X(cuGraphExecUpdate)               \
    X(cuGraphExecUpdate_v2) X(cuGraphExecKernelNodeSetParams) X(cuGraphExecKernelNodeSetParams_v2)             \
    X(cuGraphExecNodeSetParams) X(cuGraphExecChildGraphNodeSetParams) X(cuGraphNodeSetEnabled)                \
    X(cuGraphExecMemcpyNodeSetParams) X(cuGraphExecMemsetNodeSetParams) X(cuGraphExecHostNodeSetParams)        \
    X(cuDeviceGraphMemTrim) X(cuDeviceGetGraphMemAttribute) X(cuMemsetD8Async) X(cuMemsetD8_v2) X(cuMemsetD8_v2_ptds) X(cuGetErrorName)       \
    X(cuMemAlloc) X(cuMemAllocPitch) X(cuMemFree) X(cuMemGetInfo) X(cuDeviceTotalMem) X(cuArrayCreate)          \
    X(cuArray3DCreate) X(cuCtxCreate) X(cuCtxDestroy) X(cuDevicePrimaryCtxRelease) X(cuDevicePrimaryCtxReset) \
    X(cuLaunch) X(cuLaunchGrid) X(cuLaunchGridAsync) X(cuCtxAttach) X(cuCtxDetach) X(cuCtxGetApiVersion)    \
    X(cuMemcpyHtoDAsync_v2) X(cuMemcpyHtoDAsync_v2_ptsz) X(cuMemcpyDtoHAsync_v2) X(cuMemcpyAsync)               \
    X(cuLaunchHostFunc) X(cuStreamWaitEvent) X(cuStreamWaitValue32_v2) X(cuMemPrefetchAsync_v2)   \
    X(cuMemPrefetchAsync_v2_ptsz) X(cuLaunchHostFunc_ptsz) X(cuStreamWaitEvent_ptsz)                         \
    X(cuLaunchHostFunc_v2) X(cuLaunchHostFunc_v2_ptsz) X(cuMemcpyWithAttributesAsync)                         \
    X(cuMemcpyWithAttributesAsync_ptsz) X(cuMemcpy3DWithAttributesAsync) X(cuMemcpy3DWithAttributesAsync_ptsz) \
    X(cuStreamBeginRecaptureToGraph) X(cuStreamBeginRecaptureToGraph_ptsz)                                     \
    X(cuMemPrefetchBatchAsync) X(cuMemPrefetchBatchAsync_ptsz) X(cuMemDiscardAndPrefetchBatchAsync)           \
    X(cuMemDiscardAndPrefetchBatchAsync_ptsz) X(cuMemBatchDecompressAsync) X(cuMemBatchDecompressAsync_ptsz)  \
    X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) X(cuMemGetAllocationPropertiesFromHandle) \
    X(cuImportExternalMemory) X(cuDestroyExternalMemory) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle)              \
    X(cuIpcOpenMemHandle_v2) X(cuIpcCloseMemHandle) X(cuIpcGetEventHandle) X(cuIpcOpenEventHandle)

API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);
API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status);

#define FAKE_ENTRY(name) {#name, (void *)name},
static const struct {
    const char *name;
    void *fn;
} funcs[] = {FAKE_FUNCS(FAKE_ENTRY)};

/* Trampolines: addresses that are not the exports (FAKE_CUDA_PROCADDR_TRAMPOLINE=1). */
static CUresult tramp_cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return cuMemAlloc_v2(p, n); }
static CUresult tramp_cuMemFree_v2(CUdeviceptr p) { return cuMemFree_v2(p); }
static CUresult tramp_cuMemGetInfo_v2(size_t *f, size_t *t) { return cuMemGetInfo_v2(f, t); }
static CUresult tramp_cuCtxSynchronize_v2(CUcontext ctx) { return cuCtxSynchronize_v2(ctx); }
/* the fake has no cuStreamBeginCapture_v2_ptsz: a per-thread request gets this one */
static CUresult tramp_cuStreamBeginCapture_v2(CUstream s, int mode) { return cuStreamBeginCapture_v2(s, mode); }
/* FAKE_CUDA_PROCADDR_FUTURE: a variant from a CUDA newer than any hook table, another signature */
static CUresult tramp_cuMemGetInfo_v3(size_t *f, size_t *t, CUdevice dev)
{
    (void)dev;
    return cuMemGetInfo_v2(f, t);
}
static CUresult tramp_cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags)
{
    return cuGraphInstantiateWithFlags(e, g, flags);
}

/* base name, first cudaVersion of the variant, the variant's export */
static const struct {
    const char *base;
    int version;
    const char *name;
} versions[] = {
    {"cuMemAlloc", 3020, "cuMemAlloc_v2"},           {"cuMemAllocPitch", 3020, "cuMemAllocPitch_v2"},
    {"cuMemFree", 3020, "cuMemFree_v2"},             {"cuMemGetInfo", 3020, "cuMemGetInfo_v2"},
    {"cuDeviceTotalMem", 3020, "cuDeviceTotalMem_v2"}, {"cuMemGetAddressRange", 3020, "cuMemGetAddressRange_v2"},
    {"cuCtxCreate", 3020, "cuCtxCreate_v2"},         {"cuCtxCreate", 11040, "cuCtxCreate_v3"},
    {"cuCtxCreate", 12050, "cuCtxCreate_v4"},        {"cuCtxDestroy", 4000, "cuCtxDestroy_v2"},
    {"cuDevicePrimaryCtxRelease", 11000, "cuDevicePrimaryCtxRelease_v2"},
    {"cuDevicePrimaryCtxReset", 11000, "cuDevicePrimaryCtxReset_v2"},
    {"cuArrayCreate", 3020, "cuArrayCreate_v2"},     {"cuArray3DCreate", 3020, "cuArray3DCreate_v2"},
    {"cuGetProcAddress", 12000, "cuGetProcAddress_v2"}, {"cuDeviceGetUuid", 11040, "cuDeviceGetUuid_v2"},
    {"cuEventDestroy", 4000, "cuEventDestroy_v2"},   {"cuStreamDestroy", 4000, "cuStreamDestroy_v2"},
    {"cuStreamBeginCapture", 10010, "cuStreamBeginCapture_v2"},
    {"cuGraphInstantiate", 11000, "cuGraphInstantiate_v2"}, {"cuGraphInstantiate", 12000, "cuGraphInstantiateWithFlags"},
    {"cuMemGetDefaultMemPool", 13000, "cuMemGetDefaultMemPool"}, {"cuMemGetMemPool", 13000, "cuMemGetMemPool"},
    {"cuMemSetMemPool", 13000, "cuMemSetMemPool"},
    {"cuCtxSynchronize", 13000, "cuCtxSynchronize_v2"}, {"cuMemGetInfo", 13010, "cuMemGetInfo_v3"},
    {"cuMemcpyHtoDAsync", 3020, "cuMemcpyHtoDAsync_v2"}, {"cuMemcpyDtoHAsync", 3020, "cuMemcpyDtoHAsync_v2"},
    {"cuStreamWaitValue32", 11070, "cuStreamWaitValue32_v2"}, {"cuMemPrefetchAsync", 12020, "cuMemPrefetchAsync_v2"},
    {"cuMemsetD8", 3020, "cuMemsetD8_v2"},           {"cuIpcOpenMemHandle", 11000, "cuIpcOpenMemHandle_v2"},
    {"cuGraphExecUpdate", 12000, "cuGraphExecUpdate_v2"}, {"cuGraphAddKernelNode", 12000, "cuGraphAddKernelNode_v2"},
    {"cuGraphExecKernelNodeSetParams", 12000, "cuGraphExecKernelNodeSetParams_v2"},
    {"cuLaunchHostFunc", 13020, "cuLaunchHostFunc_v2"},
};

static void *func_by_name(const char *name)
{
    if (getenv("FAKE_CUDA_PROCADDR_TRAMPOLINE")) {
        if (!strcmp(name, "cuMemAlloc_v2")) return (void *)tramp_cuMemAlloc_v2;
        if (!strcmp(name, "cuMemFree_v2")) return (void *)tramp_cuMemFree_v2;
        if (!strcmp(name, "cuMemGetInfo_v2")) return (void *)tramp_cuMemGetInfo_v2;
        if (!strcmp(name, "cuGraphInstantiateWithFlags")) return (void *)tramp_cuGraphInstantiateWithFlags;
        if (!strcmp(name, "cuCtxSynchronize_v2")) return (void *)tramp_cuCtxSynchronize_v2;
        if (!strcmp(name, "cuStreamBeginCapture_v2")) return (void *)tramp_cuStreamBeginCapture_v2;
    }
    if (!strcmp(name, "cuMemGetInfo_v3") && getenv("FAKE_CUDA_PROCADDR_FUTURE")) return (void *)tramp_cuMemGetInfo_v3;
    for (size_t i = 0; i < sizeof(funcs) / sizeof(funcs[0]); i++)
        if (!strcmp(funcs[i].name, name)) return funcs[i].fn;
    return NULL;
}

/* FAKE_CUDA_PROCADDR_LOG=path: every request appended as one line,
 * "<entry> <symbol> <cudaVersion> <flags> <rc> <the export handed out or ->" (the CUDA runtime's
 * requests, recorded for tests/interposer/data/cudart13_procaddr.txt) */
static void log_request(const char *entry, const char *symbol, int version, cuuint64_t flags, CUresult rc,
                        const char *name)
{
    const char *path = getenv("FAKE_CUDA_PROCADDR_LOG");
    if (!path || !*path) return;
    char line[400];
    const char *shown = !symbol ? "(null)" : symbol[0] ? symbol : "\"\"";
    int n = snprintf(line, sizeof(line), "%s %s %d %llu %d %s\n", entry, shown, version, (unsigned long long)flags,
                     (int)rc, name ? name : "-");
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return;
    if (n > 0) (void)!write(fd, line, (size_t)n < sizeof(line) ? (size_t)n : sizeof(line) - 1);
    close(fd);
}

static CUresult proc_address(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status)
{
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    char name[160];
    int best = -1, too_new = 0;
    *pfn = NULL;
    for (size_t i = 0; i < sizeof(versions) / sizeof(versions[0]); i++) {
        if (strcmp(versions[i].base, symbol) != 0) continue;
        if (!strcmp(versions[i].name, "cuMemGetInfo_v3") && !getenv("FAKE_CUDA_PROCADDR_FUTURE")) continue;
        if (versions[i].version > version) {
            too_new = 1;
            continue;
        }
        if (best < 0 || versions[i].version > versions[best].version) best = (int)i;
    }
    snprintf(name, sizeof(name), "%s", best >= 0 ? versions[best].name : symbol);
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
        char pt[200];
        snprintf(pt, sizeof(pt), "%s_ptsz", name);
        if (!func_by_name(pt)) snprintf(pt, sizeof(pt), "%s_ptds", name); /* the legacy stream's calls */
        if (func_by_name(pt) && strlen(pt) < sizeof(name)) memcpy(name, pt, strlen(pt) + 1);
    }
    void *fn = func_by_name(name);
    if (!fn) {
        if (status) *status = too_new ? 2 : 1;
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = fn;
    if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

static void log_answer(const char *entry, const char *symbol, int version, cuuint64_t flags, CUresult rc, void **pfn)
{
    Dl_info info;
    const char *name = rc == CUDA_SUCCESS && pfn && *pfn && dladdr(*pfn, &info) && info.dli_sname &&
                               info.dli_saddr == *pfn
                           ? info.dli_sname
                           : NULL;
    log_request(entry, symbol, version, flags, rc, name);
}

API CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    CUresult rc = proc_address(symbol, pfn, version, flags, NULL);
    log_answer("cuGetProcAddress", symbol, version, flags, rc, pfn);
    return rc;
}

API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status)
{
    CUresult rc = proc_address(symbol, pfn, version, flags, status);
    log_answer("cuGetProcAddress_v2", symbol, version, flags, rc, pfn);
    return rc;
}
