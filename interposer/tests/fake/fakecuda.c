/*
 * fakecuda.c - a fake libcuda.so.1 for testing libgpuslice without a GPU.
 *
 * It models what the interposer depends on: devices (FAKE_CUDA_DEVICES,
 * honouring CUDA_VISIBLE_DEVICES like the real driver), contexts with a
 * footprint, physical memory that runs out, allocations of every kind, memory
 * pools that keep freed memory until trimmed, cuGetProcAddress with versioned
 * and per-thread variants, and a GPU timeline: each kernel takes
 * FAKE_CUDA_KERNEL_US microseconds of (real, monotonic) time after the
 * previous work on its stream, and events complete when the stream reaches them.
 *
 * Knobs (besides fakestate.h):
 *   FAKE_CUDA_KERNEL_US      kernel duration, default 10
 *   FAKE_CUDA_POOL_CHUNK     pool growth granularity, default 32m
 *   FAKE_CUDA_POOL_RELEASE=1 pools have the driver's default release threshold (0): every
 *                            stream, event or context synchronisation gives back what they
 *                            do not use (otherwise they keep it until trimmed, unless a
 *                            program sets CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: such a pool gives
 *                            back what is past it at every synchronisation)
 *   FAKE_CUDA_POOL_PENDING=1 a pool allocation freed with cuMemFreeAsync stays outstanding until a
 *                            synchronisation of its stream, of a context or of an event, or a
 *                            context's end, as the driver documents for cuMemPoolTrimTo
 *                            ("allocations that have been asynchronously freed but whose completion
 *                            has not been observed on the host ... can count as outstanding"): no
 *                            trim gives it back, and only an allocation on the stream that freed
 *                            it reuses it; one on another stream grows the pool instead (the
 *                            driver inserts a dependency on another stream's free only once it
 *                            fails to grow the pool: CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES).
 *                            A pool destroyed meanwhile keeps its memory (and its handle) until
 *                            they complete, as cuMemPoolDestroy's documentation says.  A cuMemAlloc
 *                            pointer freed with cuMemFreeAsync keeps its memory until the same
 *                            completes ("the underlying memory is not freed until the next
 *                            synchronization of the stream passed to cudaFreeAsync").
 *                            With =ctx a context's synchronisation completes only the frees made
 *                            on streams that context created (and on the default streams, which
 *                            the fake shares between contexts), not other contexts' streams'.
 *                            Off by default: frees are then complete at once
 *   FAKE_CUDA_FAIL           "name[:nth[:code]],..." make a call fail (nth 0 = every
 *                            call, default 1; code default 2 = out of memory)
 *   FAKE_CUDA_SLEEP          "name:ms[:nth][,...]" sleep inside those calls (with nth, in the nth
 *                            such call only); "exit:ms" sleeps in the
 *                            library's destructor, as a real driver tearing down its
 *                            contexts at process exit does
 *                            ("cuMemAlloc_v2After", "cuMemAllocPitch_v2After": once the memory is
 *                            taken; "cuDevicePrimaryCtxResetAfter": once the context is emptied;
 *                            "cuMemFree_v2After": freed or refused; "cuLaunchKernelAfter": the
 *                            kernel queued; "cuMemMapArrayAsyncAfter": the tiles (un)mapped;
 *                            "cuMemMapAfter": the range mapped;
 *                            "cuStreamGetCtx": every such query, a sleep point only)
 *   FAKE_CUDA_SLEEP_MARK     file created when such a sleep starts ("{}" in it: the call's name,
 *                            "name:nth" for an nth call's sleep)
 *   FAKE_CUDA_SLEEP_UNTIL    such a sleep ends as soon as this file exists ("{}" as in the mark;
 *                            its ms then the most it lasts): with the mark, a test orders
 *                            another thread's or process's step inside the call (wait for the
 *                            mark, act, create this file) instead of betting on fixed sleeps
 *   FAKE_CUDA_PROCADDR_TRAMPOLINE=1  cuGetProcAddress hands out trampolines, not exports
 *   FAKE_CUDA_PROCADDR_LOG=path  every cuGetProcAddress[_v2] request appended to that file,
 *                            "<entry> <symbol> <cudaVersion> <flags> <rc> <export or ->"
 *                            (tests/cudart_requests.py records the CUDA runtime's with it)
 *   FAKE_CUDA_PROCADDR_FUTURE=1  a later CUDA's variant: cuGetProcAddress("cuMemGetInfo") from
 *                            13010 on is a cuMemGetInfo_v3(free, total, device) the
 *                            interposer's table does not know (a trampoline, not an export)
 *   FAKE_CUDA_DRIVER_VERSION  what cuDriverGetVersion says (default 13000); calls newer than
 *                            that (cuCtxGetDevice_v2 13.0, cuStreamGetDevice 12.8) answer
 *                            CUDA_ERROR_NOT_SUPPORTED
 *   FAKE_CUDA_MODULE_BYTES   device memory each module or library load takes (default 0)
 *   FAKE_CUDA_SMALL_PAGES=1  plain, pitched and managed allocations of at most 1 MiB (FAKE_SMALL_MAX) are
 *                            carved, at 512-byte granularity, from 2 MiB pages the device's
 *                            small allocations share: the process's figure (NVML) grows by a
 *                            whole page when one needs a new page and shrinks by one when the
 *                            bytes in use fit in a page fewer (pages packed without gaps), as
 *                            the driver serves them (its 2 MiB page is the GPU's page size;
 *                            the 1 MiB limit is the library's own assumption, gs_charge_size,
 *                            not a documented figure).  Off by default: without it every
 *                            allocation takes exactly its size, which the figures of the
 *                            older tests are written against
 *   FAKE_CUDA_LAUNCH_BYTES   device memory the first launch of each distinct function
 *                            takes, as when code is loaded lazily (default 0)
 *   FAKE_CUDA_RESET_ACTIVE=1 cuDevicePrimaryCtxReset empties the primary context but leaves
 *                            it active (retained), instead of releasing it
 *   FAKE_CUDA_STACK_THREADS  threads the device runs at once: cuCtxSetLimit's stack size
 *                            reserves that many stacks (default 1024); its printf FIFO and
 *                            malloc heap limits reserve their size; with
 *                            FAKE_CUDA_LIMIT_SHRINK=1 a lowered limit frees the difference
 *   FAKE_CUDA_FUNC_LOCAL     local memory per thread (CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, from
 *                            cuFuncGetAttribute and cuKernelGetAttribute) of every function but
 *                            gsprobe's default kernel 0x1234 (default 0).  A kernel launch whose
 *                            function needs more than its context's stack limit grows the limit
 *                            to that, taking (new - old) x FAKE_CUDA_STACK_THREADS bytes, kept, as
 *                            the driver does ("increases the per-thread stack size for each
 *                            kernel launch as needed"); refused with CUDA_ERROR_OUT_OF_MEMORY
 *                            when the device cannot hold it.  fake_cuda_lmem_calls() counts the
 *                            calls a launch's judgement may make (cuFuncGetAttribute,
 *                            cuKernelGetAttribute, cuCtxGetLimit, cuCtxSetLimit);
 *                            fake_cuda_attr_queries() the first two only
 *   FAKE_CUDA_FUNC_LOCAL_NAME with FAKE_CUDA_FUNC_LOCAL: only functions cuModuleGetFunction
 *                            found by a name containing this (the first 64) have that local
 *                            size, every other none (the GPU check's launch_stack row: a big
 *                            kernel and a small one in one module)
 *   FAKE_CUDA_ADDR_REUSE=1   the last plain allocation freed (or gone with its context) gives its
 *                            address to the next one that fits in it
 *   FAKE_CUDA_HANDLE_REUSE=1 a destroyed memory pool's (once its memory is gone), executable
 *                            graph's, stream's or unloaded module's or library's handle is the next one
 *                            cuMemPoolCreate, a graph instantiation, cuStreamCreate or a load hands out,
 *                            as a real driver's handles (addresses of
 *                            its objects) may be once freed (otherwise a pool's object is never
 *                            freed, and an executable's comes back only if malloc reuses it)
 * Memory taken by modules and launches belongs to the current context and is
 * visible to the fake NVML (per process), never to an allocation call.
 * Built with -Bsymbolic, so its internal calls never reach the interposer.
 */
#include "fakestate.h"

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/stat.h>
#include <time.h>

#include "cuda_abi.h"

/* the driver's API as a profiler's callback (the program's code) finds it: fakecb.c */
void *fake_api(const char *name);

#define API __attribute__((visibility("default")))

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct fake_dev devs[FAKE_MAX_DEVS];
static int ndevs;
static int visible[FAKE_MAX_DEVS]; /* ordinal -> physical index */
static int nvisible;
static int initialized;
static uint64_t kernel_ns = 10000, pool_chunk = 32ull << 20, ctx_bytes, module_bytes, launch_bytes;
static uint64_t local_used[FAKE_MAX_DEVS]; /* this process's physical usage */
/* FAKE_CUDA_SMALL_PAGES: small allocations share 2 MiB pages (under mu) */
#define FAKE_SMALL_MAX (1ull << 20)
#define FAKE_SMALL_PAGE (2ull << 20)
static int small_pages;
static uint64_t small_used[FAKE_MAX_DEVS], small_held[FAKE_MAX_DEVS]; /* bytes in use, in pages held */
static uint64_t graph_reserved[FAKE_MAX_DEVS]; /* each device's graph memory pool (fakegraph.h) */

/* A clock that follows the power limit, when FAKE_GPU_EXPONENT is set: the GPU
 * runs at FAKE_GPU_MAX_MHZ (1980) unless its kernels, at the utilisation of the
 * last 50 ms, would draw more than the limit, FAKE_NVML_IDLE_MW +
 * u x FAKE_NVML_DYNAMIC_MW x (f / max)^exponent <= FAKE_NVML_POWER_LIMIT_MW;
 * then it runs at the clock where they fit.  Kernels take FAKE_CUDA_KERNEL_US
 * at the maximum clock and proportionally longer below it, unless
 * FAKE_GPU_MEMBOUND=1 (their time does not depend on the clock).  The fake
 * NVML reads the clock to report the power. */
static double clk_exp, clk_max = 1980, clk_limit, clk_idle, clk_dyn;
static int clk_membound;
static double clk_mhz = 1980;
static uint64_t clk_t0, clk_busy0;
static double clk_energy; /* dynamic energy of the kernels queued so far, mW x ns */
static uint64_t kernel_total_ns;

/* FAKE_GPU_COTENANT_SLICE_US=T: another process (no library) keeps this GPU busy,
 * and the GPU time-slices between it and this process as without MPS: this
 * process's work runs only in its slices, [2kT, 2kT + T) from the first launch,
 * the other's fill the rest, so a kernel longer than what is left of a slice
 * is switched out and finishes a slice later, and an event is reached only
 * while this process runs.  The process's kernels run one at a time (all its
 * streams share its slices).  The fake NVML reports both processes' shares
 * (nvmlDeviceGetProcessUtilization).  With FAKE_GPU_COTENANT_MS the other
 * process leaves that long after the first launch.  FAKE_GPU_COTENANTS=n: n
 * busy processes take their slices in turn after each of ours. */
static uint64_t cot_slice_ns, cot_base, cot_for_ns; /* FAKE_GPU_COTENANT_MS: it leaves after that long */
static uint64_t cot_n = 1;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t)
{
    uint64_t n = now_ns();
    if (t > n) {
        struct timespec ts = {(time_t)((t - n) / 1000000000ull), (long)((t - n) % 1000000000ull)};
        nanosleep(&ts, NULL);
    }
}

/* ---- failure injection ---------------------------------------------------- */

/* FAKE_CUDA_FAIL set by the program itself (fake_cuda_set_fail) rather than with setenv: the
 * library's sampler thread calls the fake, whose getenv beside the program's setenv may read a
 * freed environment (the hook sweep crashed so under ASan) */
static pthread_mutex_t g_fail_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_fail_spec[512];
static int g_fail_set;

API void fake_cuda_set_fail(const char *spec)
{
    pthread_mutex_lock(&g_fail_mu);
    snprintf(g_fail_spec, sizeof(g_fail_spec), "%s", spec ? spec : "");
    __atomic_store_n(&g_fail_set, spec != NULL, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&g_fail_mu);
}

/* FAKE_CUDA_SLEEP_MARK's or _UNTIL's file for a sleep at `point`: "{}" in it stands for it */
static int sleep_path(const char *var, const char *point, char *out, size_t size)
{
    const char *v = getenv(var), *at = v ? strstr(v, "{}") : NULL;
    if (!v || !*v) return 0;
    if (at)
        snprintf(out, size, "%.*s%s%s", (int)(at - v), v, point, at + 2);
    else
        snprintf(out, size, "%s", v);
    return 1;
}

static int fail_check(const char *name)
{
    char set_spec[sizeof(g_fail_spec)];
    int set;
    static struct {
        char name[64];
        unsigned calls;
    } counters[64];
    const char *spec = getenv("FAKE_CUDA_SLEEP"); /* "name:ms[:nth][,name:ms[:nth]...]" */
    size_t nl = strlen(name);
    unsigned sleep_calls = 0; /* this call's number among the name's, counted once */
    for (const char *p = spec; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) {
        if (strncmp(p, name, nl) != 0 || p[nl] != ':') continue;
        char *end, point[96];
        (void)strtol(p + nl + 1, &end, 10);
        snprintf(point, sizeof(point), "%s", name);
        if (*end == ':') { /* the nth such call only; "name:nth" in the mark's and go's paths */
            static struct {
                char name[64];
                unsigned calls;
            } sleeps[64];
            static pthread_mutex_t sleeps_mu = PTHREAD_MUTEX_INITIALIZER;
            if (!sleep_calls) {
                pthread_mutex_lock(&sleeps_mu);
                for (int i = 0; i < 64; i++) {
                    if (!sleeps[i].name[0]) snprintf(sleeps[i].name, sizeof(sleeps[i].name), "%s", name);
                    if (strcmp(sleeps[i].name, name) == 0) {
                        sleep_calls = ++sleeps[i].calls;
                        break;
                    }
                }
                pthread_mutex_unlock(&sleeps_mu);
            }
            if (sleep_calls != (unsigned)strtoul(end + 1, NULL, 10)) continue;
            snprintf(point, sizeof(point), "%s:%u", name, sleep_calls);
        }
        char path[4096];
        if (sleep_path("FAKE_CUDA_SLEEP_MARK", point, path, sizeof(path)))
            close(open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0644));
        struct timespec ts = {0, 0};
        long ms = atol(p + nl + 1);
        if (sleep_path("FAKE_CUDA_SLEEP_UNTIL", point, path, sizeof(path))) {
            struct timespec tick = {0, 1000000L}; /* 1 ms */
            struct stat st;
            for (long waited = 0; waited < ms && stat(path, &st) != 0; waited++) nanosleep(&tick, NULL);
            break;
        }
        ts.tv_sec = ms / 1000;
        ts.tv_nsec = (ms % 1000) * 1000000L;
        nanosleep(&ts, NULL);
        break;
    }
    /* the lock only once a program has set it: a program's exit from a signal handler (tests/
     * exitsignal.c) may come inside this very function, and its exit's calls would wait for it */
    set = __atomic_load_n(&g_fail_set, __ATOMIC_ACQUIRE);
    if (set) {
        pthread_mutex_lock(&g_fail_mu);
        set = g_fail_set;
        memcpy(set_spec, g_fail_spec, sizeof(set_spec));
        pthread_mutex_unlock(&g_fail_mu);
    }
    spec = set ? set_spec : getenv("FAKE_CUDA_FAIL");
    for (const char *p = spec; p && *p;) {
        if (strncmp(p, name, nl) == 0 && (p[nl] == ':' || p[nl] == ',' || p[nl] == '\0')) {
            unsigned nth = 1;
            int code = CUDA_ERROR_OUT_OF_MEMORY;
            if (p[nl] == ':') {
                char *end;
                nth = (unsigned)strtoul(p + nl + 1, &end, 10);
                if (*end == ':') code = (int)strtol(end + 1, NULL, 10);
            }
            unsigned calls = 0;
            for (int i = 0; i < 64; i++) {
                if (!counters[i].name[0]) snprintf(counters[i].name, sizeof(counters[i].name), "%s", name);
                if (strcmp(counters[i].name, name) == 0) {
                    calls = ++counters[i].calls;
                    break;
                }
            }
            if (nth == 0 || calls == nth) return code;
            return 0;
        }
        p = strchr(p, ',');
        if (p) p++;
    }
    return 0;
}

#define FAIL_POINT(name)                     \
    do {                                     \
        int fc_ = fail_check(name);          \
        if (fc_) return fc_;                 \
    } while (0)

__attribute__((destructor)) static void fake_teardown(void)
{
    fail_check("exit");
}

/* ---- physical memory ------------------------------------------------------ */

static int phys_slot(void)
{
    static int slot = -1;
    static pid_t owner;
    struct fake_phys *m = fake_phys_map();
    if (!m) return -1;
    if (slot >= 0 && owner == getpid()) return slot;
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        int32_t pid = m->procs[i].pid;
        if (pid <= 0 || (kill(pid, 0) != 0 && pid != getpid())) {
            if (__atomic_compare_exchange_n(&m->procs[i].pid, &pid, getpid(), 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_RELAXED)) {
                memset(m->procs[i].used, 0, sizeof(m->procs[i].used));
                __atomic_store_n(&m->coll[i].seq, 0, __ATOMIC_RELEASE);
                __atomic_store_n(&m->procs[i].kernel_ns, 0, __ATOMIC_RELAXED);
                slot = i;
                owner = getpid();
                return slot;
            }
        }
    }
    return -1;
}

static int phys_add(int pdev, uint64_t bytes)
{
    if (pdev < 0) return CUDA_SUCCESS; /* host memory (a host pool) */
    struct fake_phys *m = fake_phys_map();
    uint64_t used = m ? fake_phys_used(pdev) : local_used[pdev];
    if (used + bytes > devs[pdev].total) return CUDA_ERROR_OUT_OF_MEMORY;
    local_used[pdev] += bytes;
    int s = phys_slot();
    if (s >= 0) __atomic_add_fetch(&m->procs[s].used[pdev], bytes, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

static void phys_sub(int pdev, uint64_t bytes)
{
    if (pdev < 0) return;
    struct fake_phys *m = fake_phys_map();
    local_used[pdev] -= bytes < local_used[pdev] ? bytes : local_used[pdev];
    int s = phys_slot();
    if (s >= 0) __atomic_sub_fetch(&m->procs[s].used[pdev], bytes, __ATOMIC_RELAXED);
}

/* ---- devices and contexts ------------------------------------------------- */

struct fake_ctx {
    int pdev;
    int primary;
    int refs;
    int attached;     /* a created context's uses beyond its creation (cuCtxAttach) */
    int api1;         /* made by CUDA 2.x's cuCtxCreate: a "3010 context" */
    uint64_t base;    /* the context's own memory, less its default heap */
    uint64_t modules; /* memory taken by (lazily loaded) modules and by limits */
    uint64_t limits[5]; /* what cuCtxSetLimit reserved: stacks, printf FIFO, malloc heap, and the
                         * device runtime's sync depth and pending launches (FAKE_CUDA_CDP_UNIT
                         * bytes per unit, 1 KiB by default; the real sizes are not documented) */
    struct fake_ctx *owner; /* a green context's: its device's primary, which owns its allocations */
    struct fake_ctx *next_dead; /* a destroyed created context's place in `dead` */
    unsigned gen;               /* moves when the context goes: a primary retained again is new */
};
static struct fake_ctx primaries[FAKE_MAX_DEVS];
static __thread struct fake_ctx *current;

static void setup(void)
{
    ndevs = fake_devices(devs);
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    if (!cvd) {
        for (int i = 0; i < ndevs; i++) visible[nvisible++] = i;
    } else {
        for (const char *p = cvd; *p && nvisible < ndevs;) {
            int found = -1;
            if (isdigit((unsigned char)*p)) {
                int idx = atoi(p);
                if (idx < ndevs) found = idx;
            } else {
                size_t len = strcspn(p, ",");
                for (int i = 0; i < ndevs; i++)
                    if (strncmp(devs[i].uuid, p, len) == 0) found = i;
            }
            if (found < 0) break; /* like the driver: stop at the first invalid entry */
            visible[nvisible++] = found;
            p = strchr(p, ',');
            if (!p) break;
            p++;
        }
    }
    const char *v = getenv("FAKE_CUDA_KERNEL_US");
    if (v) kernel_ns = (uint64_t)(atof(v) * 1000.0);
    v = getenv("FAKE_CUDA_POOL_CHUNK");
    if (v) pool_chunk = fake_size(v);
    v = getenv("FAKE_CUDA_CTX_BYTES");
    if (v) ctx_bytes = fake_size(v);
    v = getenv("FAKE_CUDA_MODULE_BYTES");
    if (v) module_bytes = fake_size(v);
    v = getenv("FAKE_CUDA_LAUNCH_BYTES");
    if (v) launch_bytes = fake_size(v);
    v = getenv("FAKE_CUDA_SMALL_PAGES");
    small_pages = v && *v == '1';
    v = getenv("FAKE_GPU_COTENANT_SLICE_US");
    if (v && *v) cot_slice_ns = (uint64_t)(atof(v) * 1000.0);
    v = getenv("FAKE_GPU_COTENANTS");
    if (v && *v && strtoull(v, NULL, 10) > 0) cot_n = strtoull(v, NULL, 10);
    v = getenv("FAKE_GPU_COTENANT_MS");
    if (v && *v) cot_for_ns = (uint64_t)(atof(v) * 1e6);
    v = getenv("FAKE_GPU_EXPONENT");
    if (v && *v) {
        clk_exp = atof(v);
        if ((v = getenv("FAKE_GPU_MAX_MHZ"))) clk_max = atof(v);
        clk_mhz = clk_max;
        clk_limit = (v = getenv("FAKE_NVML_POWER_LIMIT_MW")) ? atof(v) : 700000;
        clk_idle = (v = getenv("FAKE_NVML_IDLE_MW")) ? atof(v) : clk_limit / 7;
        clk_dyn = (v = getenv("FAKE_NVML_DYNAMIC_MW")) ? atof(v) : 0;
        clk_membound = (v = getenv("FAKE_GPU_MEMBOUND")) && atoi(v);
    }
}

/* The clock for work queued now (clock model on), from the last 50 ms. */
static double clock_now(uint64_t now)
{
    if (!clk_exp) return clk_max;
    pthread_mutex_lock(&mu);
    uint64_t busy = __atomic_load_n(&kernel_total_ns, __ATOMIC_RELAXED);
    if (!clk_t0) {
        clk_t0 = now;
        clk_busy0 = busy;
    } else if (now - clk_t0 >= 50000000ull || busy - clk_busy0 >= 50000000ull) {
        /* work queued faster than time passes keeps the GPU fully busy */
        double span = (double)(now - clk_t0), queued = (double)(busy - clk_busy0);
        double u = queued >= span ? 1 : queued / span;
        double f = clk_max;
        if (u > 0 && clk_dyn > 0 && clk_idle + u * clk_dyn > clk_limit)
            f = clk_max * pow((clk_limit - clk_idle) / (u * clk_dyn), 1.0 / clk_exp);
        clk_mhz = f;
        clk_t0 = now;
        clk_busy0 = busy;
    }
    double f = clk_mhz;
    pthread_mutex_unlock(&mu);
    return f;
}

/* Test-only: the fake GPU's clock (MHz), and the dynamic energy of the kernels
 * queued so far (mW x ns), from which the fake NVML averages board power. */
API double fake_cuda_clock_mhz(void)
{
    return clk_mhz;
}

API double fake_cuda_energy(void)
{
    pthread_mutex_lock(&mu);
    double e = clk_energy;
    pthread_mutex_unlock(&mu);
    return e;
}

static void add_energy(uint64_t busy_ns, double mhz)
{
    pthread_mutex_lock(&mu);
    clk_energy += (double)busy_ns * clk_dyn * pow(mhz / clk_max, clk_exp);
    pthread_mutex_unlock(&mu);
}

API CUresult cuInit(unsigned int flags)
{
    FAIL_POINT("cuInit");
    if (flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (!initialized) setup();
    initialized = 1;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

#define NEED_INIT()                                          \
    do {                                                     \
        if (!initialized) return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)

/* FAKE_CUDA_DRIVER_VERSION (default 13000): what cuDriverGetVersion says; the calls a driver
 * of that version lacks answer CUDA_ERROR_NOT_SUPPORTED */
static int driver_version(void)
{
    const char *v = getenv("FAKE_CUDA_DRIVER_VERSION");
    return v ? atoi(v) : 13000;
}

API CUresult cuDriverGetVersion(int *v)
{
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = driver_version();
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *n)
{
    NEED_INIT();
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = nvisible;
    return CUDA_SUCCESS;
}

/* FAKE_CUDA_API_CALLBACK="fn:action[,fn:action]": a profiler's API callback on entry to fn
 * that calls the driver's exported API itself (so through the interposer): totalmem
 * (cuDeviceTotalMem_v2 of device 0), setlimit (cuCtxSetLimit of the printf FIFO to
 * FAKE_CUDA_API_CALLBACK_BYTES, default 1m), alloc (that much, freed again), ctx (a context of
 * its own, created and destroyed), ctxkeep (a context of its own, created once per process and
 * kept), retain (device 0's primary context, once per process), sync (cuCtxSynchronize), launch
 * (an empty kernel on the legacy stream; launchown: on a stream of its own), capture (a
 * global-mode capture of a stream of its own, begun and ended), async (a stream-ordered
 * allocation of that size, freed again) or graph (the newest executable graph launched on the
 * legacy stream).  Never from inside
 * another callback.  The first result per action goes to stderr, and how many ran at exit. */
static __thread int in_callback;
static unsigned api_callbacks;
API CUresult cuStreamCreate(CUstream *s, unsigned int flags); /* fakelaunch.h */

__attribute__((destructor)) static void api_callbacks_report(void)
{
    if (api_callbacks) fprintf(stderr, "fake: api callbacks %u\n", api_callbacks);
}

static void *last_gexec; /* fakegraph.h: the newest executable graph (the "graph" action launches it) */

static void api_callback(const char *fn)
{
    const char *spec = getenv("FAKE_CUDA_API_CALLBACK");
    size_t nl = strlen(fn);
    if (!spec || in_callback) return;
    for (const char *p = spec; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) {
        if (strncmp(p, fn, nl) != 0 || p[nl] != ':') continue;
        const char *what = p + nl + 1, *v = getenv("FAKE_CUDA_API_CALLBACK_BYTES");
        size_t bytes = v ? (size_t)fake_size(v) : 1 << 20;
        int rc = -1;
        in_callback = 1;
        if (!strncmp(what, "totalmem", 8)) {
            CUresult (*total)(size_t *, CUdevice) = (CUresult(*)(size_t *, CUdevice))fake_api("cuDeviceTotalMem_v2");
            size_t total_bytes = 0;
            rc = total(&total_bytes, 0);
        } else if (!strncmp(what, "setlimit", 8)) {
            CUresult (*set)(int, size_t) = (CUresult(*)(int, size_t))fake_api("cuCtxSetLimit");
            rc = set(1, bytes);
        } else if (!strncmp(what, "alloc", 5)) {
            CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))fake_api("cuMemAlloc_v2");
            CUresult (*release)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))fake_api("cuMemFree_v2");
            CUdeviceptr d = 0;
            rc = alloc(&d, bytes);
            if (rc == CUDA_SUCCESS) release(d);
            if (rc == CUDA_ERROR_OUT_OF_MEMORY) rc = 0; /* refused near the cap: an answer */
        } else if (!strncmp(what, "ctxkeep", 7)) { /* before "ctx", its prefix */
            CUresult (*create)(CUcontext *, unsigned, CUdevice) = (CUresult(*)(CUcontext *, unsigned, CUdevice))fake_api("cuCtxCreate_v2");
            struct fake_ctx *was = current;
            static int made;
            CUcontext c = NULL;
            rc = __atomic_exchange_n(&made, 1, __ATOMIC_RELAXED) ? 0 : create(&c, 0, 0);
            current = was;
        } else if (!strncmp(what, "ctx", 3)) {
            CUresult (*create)(CUcontext *, unsigned, CUdevice) = (CUresult(*)(CUcontext *, unsigned, CUdevice))fake_api("cuCtxCreate_v2");
            CUresult (*destroy)(CUcontext) = (CUresult(*)(CUcontext))fake_api("cuCtxDestroy_v2");
            struct fake_ctx *was = current;
            CUcontext c = NULL;
            rc = create(&c, 0, 0);
            if (rc == CUDA_SUCCESS) rc = destroy(c);
            current = was;
        } else if (!strncmp(what, "retain", 6)) {
            CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))fake_api("cuDevicePrimaryCtxRetain");
            static int retained;
            CUcontext c = NULL;
            rc = __atomic_exchange_n(&retained, 1, __ATOMIC_RELAXED) ? 0 : retain(&c, 0);
        } else if (!strncmp(what, "sync", 4)) {
            CUresult (*sync)(void) = (CUresult(*)(void))fake_api("cuCtxSynchronize");
            rc = sync();
        } else if (!strncmp(what, "async", 5)) {
            CUresult (*alloc)(CUdeviceptr *, size_t, CUstream) = (CUresult(*)(CUdeviceptr *, size_t, CUstream))fake_api("cuMemAllocAsync");
            CUresult (*release)(CUdeviceptr, CUstream) = (CUresult(*)(CUdeviceptr, CUstream))fake_api("cuMemFreeAsync");
            CUdeviceptr d = 0;
            rc = alloc(&d, bytes, NULL);
            if (rc == CUDA_SUCCESS) release(d, NULL);
            if (rc == CUDA_ERROR_OUT_OF_MEMORY) rc = 0;
        } else if (!strncmp(what, "graph", 5)) {
            CUresult (*launch)(void *, CUstream) = (CUresult(*)(void *, CUstream))fake_api("cuGraphLaunch");
            rc = last_gexec ? launch(last_gexec, NULL) : CUDA_ERROR_NOT_FOUND;
            if (rc == CUDA_ERROR_OUT_OF_MEMORY) rc = 0;
        } else if (!strncmp(what, "capture", 7)) {
            CUresult (*begin)(CUstream, int) = (CUresult(*)(CUstream, int))fake_api("cuStreamBeginCapture_v2");
            CUresult (*end)(CUstream, void **) = (CUresult(*)(CUstream, void **))fake_api("cuStreamEndCapture");
            CUstream s = NULL;
            void *g = NULL;
            rc = cuStreamCreate(&s, 1);
            if (rc == CUDA_SUCCESS) rc = begin(s, 0 /* global */);
            if (rc == CUDA_SUCCESS) rc = end(s, &g);
        } else if (!strncmp(what, "launch", 6)) {
            typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                         unsigned, CUstream, void **, void **);
            launch_t launch = (launch_t)fake_api("cuLaunchKernel");
            /* "launchown": on a stream of the callback's own, one per context (none of the
             * program's streams, so no interval of theirs covers it) */
            static struct fake_ctx *own_ctx;
            static CUstream own;
            CUstream s = NULL;
            if (!strncmp(what, "launchown", 9)) {
                if (own_ctx != current) {
                    own = NULL;
                    own_ctx = current;
                    cuStreamCreate(&own, 1);
                }
                s = own;
            }
            rc = launch((CUfunction)0x99, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        }
        in_callback = 0;
        static int reported;
        if (!__atomic_exchange_n(&reported, 1, __ATOMIC_RELAXED))
            fprintf(stderr, "fake: api callback %s %.8s %d\n", fn, what, rc);
        __atomic_add_fetch(&api_callbacks, 1, __ATOMIC_RELAXED);
        return;
    }
}

API CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    NEED_INIT();
    api_callback("cuDeviceGet");
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= nvisible) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

#define CHECK_DEV(d)                                                           \
    do {                                                                       \
        NEED_INIT();                                                           \
        if ((d) < 0 || (d) >= nvisible) return CUDA_ERROR_INVALID_DEVICE;      \
    } while (0)

API CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d)
{
    CHECK_DEV(d);
    if (!u) return CUDA_ERROR_INVALID_VALUE;
    const char *s = devs[visible[d]].uuid;
    if (strncmp(s, "GPU-", 4) == 0) s += 4;
    int k = 0;
    for (; *s && k < 16; s++) {
        unsigned v;
        if (*s == '-') continue;
        if (sscanf(s, "%2x", &v) != 1) break;
        u->bytes[k++] = (char)v;
        s++;
    }
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d)
{
    return cuDeviceGetUuid(u, d);
}

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    CHECK_DEV(d);
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = devs[visible[d]].total;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice d)
{
    CHECK_DEV(d);
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "Fake GPU %d", visible[d]);
    return CUDA_SUCCESS;
}

/* FAKE_CUDA_HEAP_DEFAULT: a new context's malloc heap limit, part of FAKE_CUDA_CTX_BYTES
 * (a real context starts with an 8 MiB heap); default 0. */
static void ctx_fill(struct fake_ctx *c)
{
    const char *v = getenv("FAKE_CUDA_HEAP_DEFAULT");
    uint64_t heap = v ? fake_size(v) : 0;
    if (heap > ctx_bytes) heap = ctx_bytes;
    c->base = ctx_bytes - heap;
    c->modules = heap;
    c->limits[2] = heap;
}

/* FAKE_CUDA_CTX_CALLBACK=alloc|keep|load|setlimit|ctx: a profiler's resource callback (CUPTI's
 * "context created" and "context destroy starting") that calls the driver's exported API from
 * inside the call, with the context concerned current: it allocates
 * FAKE_CUDA_CTX_CALLBACK_BYTES (default 1m) and frees it (keep: keeps it), loads and unloads a
 * module, sets the malloc heap to that size, or creates and destroys a context of its own
 * (whose own calls do not call back).
 * Each result goes to stderr. */
static void ctx_callback(struct fake_ctx *c, const char *event)
{
    const char *what = getenv("FAKE_CUDA_CTX_CALLBACK");
    if (!what || in_callback) return;
    in_callback = 1;
    struct fake_ctx *was = current;
    current = c;
    int rc = -1, rc2 = -1;
    if (!strcmp(what, "alloc") || !strcmp(what, "keep")) {
        CUresult (*alloc)(CUdeviceptr *, size_t) = (CUresult(*)(CUdeviceptr *, size_t))fake_api("cuMemAlloc_v2");
        CUresult (*release)(CUdeviceptr) = (CUresult(*)(CUdeviceptr))fake_api("cuMemFree_v2");
        const char *v = getenv("FAKE_CUDA_CTX_CALLBACK_BYTES");
        CUdeviceptr p = 0;
        rc = alloc(&p, v ? fake_size(v) : 1 << 20);
        if (rc == CUDA_SUCCESS) rc2 = what[0] == 'k' ? 0 : release(p);
    } else if (!strcmp(what, "load")) {
        CUresult (*load)(CUmodule *, const void *) = (CUresult(*)(CUmodule *, const void *))fake_api("cuModuleLoadData");
        CUresult (*unload)(CUmodule) = (CUresult(*)(CUmodule))fake_api("cuModuleUnload");
        CUmodule m = NULL;
        rc = load(&m, "image");
        if (rc == CUDA_SUCCESS) rc2 = unload(m);
    } else if (!strcmp(what, "setlimit")) { /* the malloc heap */
        CUresult (*set)(int, size_t) = (CUresult(*)(int, size_t))fake_api("cuCtxSetLimit");
        const char *v = getenv("FAKE_CUDA_CTX_CALLBACK_BYTES");
        rc = set(2, v ? fake_size(v) : 1 << 20);
        rc2 = 0;
    } else if (!strcmp(what, "ctx")) {
        CUresult (*create)(CUcontext *, unsigned, CUdevice) = (CUresult(*)(CUcontext *, unsigned, CUdevice))fake_api("cuCtxCreate_v2");
        CUresult (*destroy)(CUcontext) = (CUresult(*)(CUcontext))fake_api("cuCtxDestroy_v2");
        CUcontext n = NULL;
        int ordinal = 0;
        while (ordinal < nvisible - 1 && visible[ordinal] != c->pdev) ordinal++;
        rc = create(&n, 0, ordinal);
        if (rc == CUDA_SUCCESS) rc2 = destroy(n);
    }
    current = was;
    fprintf(stderr, "fake: %s callback %s %d %d\n", event, what, rc, rc2);
    in_callback = 0;
}

static CUresult ctx_new(struct fake_ctx *c, int ordinal)
{
    int rc = phys_add(visible[ordinal], ctx_bytes);
    if (rc) return rc;
    c->pdev = visible[ordinal];
    c->refs = 1;
    ctx_fill(c);
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d)
{
    FAIL_POINT("cuDevicePrimaryCtxRetain");
    CHECK_DEV(d);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct fake_ctx *c = &primaries[d];
    CUresult rc = CUDA_SUCCESS;
    if (c->refs)
        c->refs++;
    else
        rc = ctx_new(c, d);
    int created = rc == CUDA_SUCCESS && c->refs == 1;
    c->primary = 1;
    pthread_mutex_unlock(&mu);
    if (created) ctx_callback(c, "created");
    if (rc == CUDA_SUCCESS) *pctx = (CUcontext)c;
    return rc;
}

API CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned int *flags, int *active)
{
    CHECK_DEV(d);
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    *flags = 0;
    *active = primaries[d].refs > 0;
    return CUDA_SUCCESS;
}

/* Green contexts: each retains its device's primary context and holds FAKE_CUDA_GREEN_BYTES
 * (default 8m) of its own; the CUcontext standing for it (cuCtxFromGreenCtx) is its fake_ctx,
 * owned by the primary context (what is allocated in it is the primary's). */
#define FAKE_GREENS 160
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d);
static struct fake_green {
    struct fake_ctx ctx;
    int dev; /* ordinal */
} greens[FAKE_GREENS];

API CUresult cuGreenCtxCreate(void **ph, void *desc, CUdevice d, unsigned int flags)
{
    (void)flags;
    NEED_INIT();
    FAIL_POINT("cuGreenCtxCreate");
    CHECK_DEV(d);
    if (!ph || !desc) return CUDA_ERROR_INVALID_VALUE;
    const char *v = getenv("FAKE_CUDA_GREEN_BYTES");
    uint64_t bytes = v ? fake_size(v) : 8ull << 20;
    CUcontext primary;
    CUresult rc = cuDevicePrimaryCtxRetain(&primary, d);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&mu);
    struct fake_green *g = NULL;
    for (int i = 0; i < FAKE_GREENS && !g; i++)
        if (!greens[i].ctx.refs) g = &greens[i];
    rc = !g ? CUDA_ERROR_OUT_OF_MEMORY : phys_add(visible[d], bytes);
    if (rc == CUDA_SUCCESS) {
        memset(g, 0, sizeof(*g));
        g->ctx.pdev = visible[d];
        g->ctx.refs = 1;
        g->ctx.base = bytes;
        g->ctx.owner = (struct fake_ctx *)primary;
        g->dev = d;
        *ph = g;
    }
    pthread_mutex_unlock(&mu);
    if (rc != CUDA_SUCCESS) cuDevicePrimaryCtxRelease_v2(d);
    return rc;
}

/* The SM resource of a device (an opaque 144-byte CUdevResource here: its type first) and a
 * descriptor of it; the fake partitions nothing. */
API CUresult cuDeviceGetDevResource(CUdevice d, void *res, int type)
{
    NEED_INIT();
    CHECK_DEV(d);
    if (!res || type != 1) return CUDA_ERROR_INVALID_VALUE;
    memset(res, 0, 144);
    *(int *)res = type;
    return CUDA_SUCCESS;
}

API CUresult cuDevResourceGenerateDesc(void **desc, void *res, unsigned int n)
{
    if (!desc || !res || !n) return CUDA_ERROR_INVALID_VALUE;
    *desc = res;
    return CUDA_SUCCESS;
}

API CUresult cuCtxFromGreenCtx(CUcontext *pctx, void *h)
{
    struct fake_green *g = h;
    if (!pctx || !g) return CUDA_ERROR_INVALID_VALUE;
    if (!g->ctx.refs) return CUDA_ERROR_INVALID_CONTEXT;
    *pctx = (CUcontext)&g->ctx;
    return CUDA_SUCCESS;
}

API CUresult cuGreenCtxDestroy(void *h)
{
    FAIL_POINT("cuGreenCtxDestroy");
    struct fake_green *g = h;
    if (!g) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    int live = g->ctx.refs > 0;
    if (live) {
        phys_sub(g->ctx.pdev, g->ctx.base);
        g->ctx.refs = 0;
        g->ctx.base = 0;
    }
    pthread_mutex_unlock(&mu);
    if (!live) return CUDA_ERROR_INVALID_CONTEXT;
    if (current == &g->ctx) current = NULL;
    return cuDevicePrimaryCtxRelease_v2(g->dev);
}

static void ctx_drop(struct fake_ctx *c);
static void captures_ctx_gone(const struct fake_ctx *c); /* fakelaunch.h */
static void pools_complete_all(void); /* FAKE_CUDA_POOL_PENDING: every pool's frees complete */

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    FAIL_POINT("cuDevicePrimaryCtxRelease");
    CHECK_DEV(d);
    if (primaries[d].refs == 1) ctx_callback(&primaries[d], "destroy-starting");
    pthread_mutex_lock(&mu);
    struct fake_ctx *c = &primaries[d];
    CUresult rc = CUDA_SUCCESS;
    if (!c->refs)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else if (--c->refs == 0)
        ctx_drop(c);
    pthread_mutex_unlock(&mu);
    return rc;
}

API CUresult cuDevicePrimaryCtxReset_v2(CUdevice d)
{
    CHECK_DEV(d);
    if (primaries[d].refs) ctx_callback(&primaries[d], "destroy-starting");
    pthread_mutex_lock(&mu);
    if (primaries[d].refs) {
        ctx_drop(&primaries[d]);
        if (getenv("FAKE_CUDA_RESET_ACTIVE")) { /* a driver that keeps the (emptied) context active */
            phys_add(primaries[d].pdev, ctx_bytes);
            ctx_fill(&primaries[d]);
        } else
            primaries[d].refs = 0;
    }
    pthread_mutex_unlock(&mu);
    (void)fail_check("cuDevicePrimaryCtxResetAfter"); /* FAKE_CUDA_SLEEP: still inside, the context emptied */
    return CUDA_SUCCESS;
}

/* Destroyed created contexts (refs 0), kept rather than freed: another thread may still have
 * one current (its calls then fail with CUDA_ERROR_CONTEXT_IS_DESTROYED, as the driver's do),
 * and the next creation takes the newest again, so handles are reused as they were when
 * destroyed contexts went back to malloc.  Under mu. */
static struct fake_ctx *dead;

static CUresult ctx_create(CUcontext *pctx, CUdevice d)
{
    FAIL_POINT("cuCtxCreate");
    CHECK_DEV(d);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct fake_ctx *c = dead;
    if (c) {
        unsigned gen = c->gen; /* a new context at the old one's handle: code loaded there went */
        dead = c->next_dead;
        memset(c, 0, sizeof(*c));
        c->gen = gen + 1;
    } else {
        c = calloc(1, sizeof(*c));
    }
    CUresult rc = c ? ctx_new(c, d) : CUDA_ERROR_OUT_OF_MEMORY;
    if (rc && c) {
        c->next_dead = dead;
        dead = c;
    }
    pthread_mutex_unlock(&mu);
    if (rc) return rc;
    current = c;
    ctx_callback(c, "created");
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d)
{
    (void)flags;
    return ctx_create(pctx, d);
}

API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *p, int n, unsigned int flags, CUdevice d)
{
    (void)p, (void)n, (void)flags;
    return ctx_create(pctx, d);
}

API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p, unsigned int flags, CUdevice d)
{
    (void)p, (void)flags;
    return ctx_create(pctx, d);
}

API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    FAIL_POINT("cuCtxDestroy_v2");
    struct fake_ctx *c = (struct fake_ctx *)ctx;
    if (!c || c->primary || !c->refs) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_callback(c, "destroy-starting");
    pthread_mutex_lock(&mu);
    ctx_drop(c);
    c->refs = 0;
    c->next_dead = dead;
    dead = c;
    pthread_mutex_unlock(&mu);
    if (current == c) current = NULL;
    return CUDA_SUCCESS;
}

/* the entry points before CUDA 4.0 (cuCtxDestroy, cuCtxCreate) and 11.0 (primary release/reset) */
API CUresult cuCtxDestroy(CUcontext ctx)
{
    FAIL_POINT("cuCtxDestroy");
    return cuCtxDestroy_v2(ctx);
}

API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice d)
{
    FAIL_POINT("cuCtxCreate");
    CUresult rc = cuCtxCreate_v2(pctx, flags, d);
    if (rc == CUDA_SUCCESS) ((struct fake_ctx *)*pctx)->api1 = 1;
    return rc;
}

/* The API version a context was made with: 3010 by CUDA 2.x's cuCtxCreate, 3020 otherwise */
API CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    struct fake_ctx *c = ctx ? (struct fake_ctx *)ctx : current;
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *version = c->api1 ? 3010 : 3020;
    return CUDA_SUCCESS;
}

/* CUDA 2.x's usage counts: the current context gets one more use; the last cuCtxDetach of a
 * created context destroys it, a primary context's is a release */
API CUresult cuCtxAttach(CUcontext *pctx, unsigned int flags)
{
    FAIL_POINT("cuCtxAttach");
    if (!pctx || flags) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&mu);
    if (current->primary)
        current->refs++;
    else
        current->attached++;
    pthread_mutex_unlock(&mu);
    *pctx = (CUcontext)current;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d);

API CUresult cuCtxDetach(CUcontext ctx)
{
    FAIL_POINT("cuCtxDetach");
    struct fake_ctx *c = (struct fake_ctx *)ctx;
    if (!c || c != current) return CUDA_ERROR_INVALID_CONTEXT;
    if (c->primary) return cuDevicePrimaryCtxRelease_v2(c->pdev);
    pthread_mutex_lock(&mu);
    int last = c->attached-- == 0;
    pthread_mutex_unlock(&mu);
    return last ? cuCtxDestroy_v2(ctx) : CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease(CUdevice d)
{
    return cuDevicePrimaryCtxRelease_v2(d);
}

API CUresult cuDevicePrimaryCtxReset(CUdevice d)
{
    return cuDevicePrimaryCtxReset_v2(d);
}

API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    FAIL_POINT("cuCtxSetCurrent");
    current = (struct fake_ctx *)ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)current;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetDevice(CUdevice *d)
{
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (!current || (current->primary && !current->refs)) return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = 0; i < nvisible; i++)
        if (visible[i] == current->pdev) *d = i;
    return CUDA_SUCCESS;
}

/* CUDA 13: the device of any context, NULL meaning the current one */
API CUresult cuCtxGetDevice_v2(CUdevice *d, CUcontext ctx)
{
    if (driver_version() < 13000) return CUDA_ERROR_NOT_SUPPORTED;
    FAIL_POINT("cuCtxGetDevice_v2");
    struct fake_ctx *c = ctx ? (struct fake_ctx *)ctx : current;
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (!c || (c->primary && !c->refs)) return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = 0; i < nvisible; i++)
        if (visible[i] == c->pdev) *d = i;
    return CUDA_SUCCESS;
}

/* a primary context released or reset is not initialised (CUDA_ERROR_INVALID_CONTEXT here); a
 * created or green context destroyed while current to another thread: cuda.h's
 * CUDA_ERROR_CONTEXT_IS_DESTROYED */
#define NEED_CTX()                                                                         \
    do {                                                                                   \
        if (!current || (current->primary && !current->refs)) return CUDA_ERROR_INVALID_CONTEXT; \
        if (!current->refs) return CUDA_ERROR_CONTEXT_IS_DESTROYED;                        \
    } while (0)

/* FAKE_CUDA_API_VERSIONS: cuda.h's CUDA_ERROR_INVALID_CONTEXT for "a user mixes different API
 * versions (i.e. 3010 context with 3020 API calls)": in a context made by CUDA 2.x's
 * cuCtxCreate the memory calls of 3.2 and later fail, and CUDA 2.x's fail in any other */
#define NEED_API(v1)                                                                       \
    do {                                                                                   \
        NEED_CTX();                                                                        \
        if (getenv("FAKE_CUDA_API_VERSIONS") && current->api1 != (v1)) return CUDA_ERROR_INVALID_CONTEXT; \
    } while (0)

/* The pitch of a row of w bytes: FAKE_CUDA_PITCH_ALIGN (default 512) */
static uint64_t pitch_of(uint64_t w)
{
    const char *v = getenv("FAKE_CUDA_PITCH_ALIGN");
    uint64_t align = v && atoll(v) > 0 ? (uint64_t)atoll(v) : 512;
    return (w + align - 1) / align * align;
}

/* ---- allocations ---------------------------------------------------------- */

/* K_PEND: a K_DPTR freed by cuMemFreeAsync whose free is not complete (FAKE_CUDA_POOL_PENDING) */
enum { K_DPTR = 1, K_POOL, K_ARRAY, K_MIPMAP, K_VMM, K_IPC, K_PEND };
struct fake_alloc {
    uint64_t handle;
    uint64_t size;
    int pdev;
    int kind;
    struct fake_ctx *ctx;
    struct fake_pool *pool;
    unsigned refs, maps; /* K_VMM: unreleased handle references, mappings */
    uint64_t small; /* FAKE_CUDA_SMALL_PAGES: bytes taken from the shared pages (0: none) */
    CUstream pend_stream; /* K_PEND: the stream its free was made on */
    int32_t src_pid; /* K_IPC: the exporter and its allocation's base (refs: the opens) */
    uint64_t src_base;
    int domain; /* K_VMM: 1 + the locality domain it was made in (CUDA 13.4), 0: the device's */
};
struct fake_pool {
    int pdev; /* -1: host memory; FAKE_POOL_FOLLOWS: managed, on the first allocating context's device */
    int destroyed;
    uint64_t reserved, used;
    int release_set; /* cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) was called */
    uint64_t release_threshold;
    /* FAKE_CUDA_POOL_PENDING: bytes freed by cuMemFreeAsync not yet complete (outside `used`),
     * per freeing stream (a free beyond the table's streams is complete at once) */
    uint64_t pending;
    CUstream pend_stream[8];
    uint64_t pend_bytes[8];
};
#define MAX_ALLOCS 8192
static struct fake_alloc allocs[MAX_ALLOCS];
static uint64_t next_handle = 0x7f0000000000ull;
#define FAKE_POOL_FOLLOWS (-2)
static struct fake_pool default_pools[FAKE_MAX_DEVS];
static struct fake_pool host_pool = {.pdev = -1}, managed_pool = {.pdev = FAKE_POOL_FOLLOWS};
static struct fake_pool domain_pools[FAKE_MAX_DEVS][4]; /* each locality domain's default pool */
static struct fake_pool *user_pools[64];
static struct fake_pool *freed_pool; /* FAKE_CUDA_HANDLE_REUSE: the next cuMemPoolCreate's */

/* A destroyed object kept for FAKE_CUDA_HANDLE_REUSE (*freed), cleared, so the new one gets its
 * handle; else a new zeroed one.  NULL if out of memory. */
static void *reuse_or_alloc(void **freed, size_t size)
{
    pthread_mutex_lock(&mu);
    void *p = *freed;
    *freed = NULL;
    pthread_mutex_unlock(&mu);
    if (p) return memset(p, 0, size);
    return calloc(1, size);
}

/* An allocation of `bytes` from the pool is freed (called with mu held).  A destroyed pool
 * keeps all it reserved while allocations from it are outstanding and gives it all back with
 * the last one, as the driver documents for cuMemPoolDestroy. */
static void pool_give(struct fake_pool *p, uint64_t bytes)
{
    p->used -= bytes;
    if (p->destroyed && !p->used && !p->pending) {
        phys_sub(p->pdev, p->reserved);
        p->reserved = 0;
    }
}
static int nuser_pools;

/* FAKE_CUDA_SMALL_PAGES (mu held): `bytes` more of the device's shared pages, taking a whole
 * page more when they do not fit in those held; or `bytes` given back, and the pages no
 * longer needed with them. */
static CUresult small_take(int pdev, uint64_t bytes)
{
    uint64_t need = (small_used[pdev] + bytes + FAKE_SMALL_PAGE - 1) / FAKE_SMALL_PAGE * FAKE_SMALL_PAGE;
    if (need > small_held[pdev]) {
        if (phys_add(pdev, need - small_held[pdev]) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
        small_held[pdev] = need;
    }
    small_used[pdev] += bytes;
    return CUDA_SUCCESS;
}

static void small_give(int pdev, uint64_t bytes)
{
    small_used[pdev] -= bytes < small_used[pdev] ? bytes : small_used[pdev];
    uint64_t keep = (small_used[pdev] + FAKE_SMALL_PAGE - 1) / FAKE_SMALL_PAGE * FAKE_SMALL_PAGE;
    if (keep < small_held[pdev]) {
        phys_sub(pdev, small_held[pdev] - keep);
        small_held[pdev] = keep;
    }
}

/* What a freed allocation gives back (mu held) */
/* FAKE_CUDA_ADDR_REUSE=1: the address of the last plain allocation freed (by a free or with its
 * context) goes to the next plain allocation that fits in it, as the driver reuses addresses */
static uint64_t reuse_at, reuse_size;

static void alloc_give(const struct fake_alloc *a)
{
    static int reuse = -1;
    if (reuse < 0) reuse = getenv("FAKE_CUDA_ADDR_REUSE") != NULL;
    if (reuse && a->kind == K_DPTR && !a->small) reuse_at = a->handle, reuse_size = a->size;
    if (a->small)
        small_give(a->pdev, a->small);
    else
        phys_sub(a->pdev, a->size);
}

static uint64_t next_low = 0x10000000ull; /* CUDA 2.x's 32-bit pointers come from below 4 GiB */

static CUresult alloc_at(int kind, uint64_t size, int pdev, struct fake_pool *pool, void *handle, int charge,
                         int low)
{
    pthread_mutex_lock(&mu);
    uint64_t *next = low ? &next_low : &next_handle;
    int slot = -1;
    for (int i = 0; i < MAX_ALLOCS && slot < 0; i++)
        if (!allocs[i].kind) slot = i;
    uint64_t small = small_pages && kind == K_DPTR && charge && pdev >= 0 && size <= FAKE_SMALL_MAX
                     ? (size + 511) & ~511ull : 0;
    CUresult rc = slot < 0 || (low && size > 0xffffffffull - *next) ? CUDA_ERROR_OUT_OF_MEMORY
                  : small ? small_take(pdev, small)
                  : charge ? phys_add(pdev, size) : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS) {
        struct fake_ctx *own = current && current->owner ? current->owner : current;
        int again = reuse_at && kind == K_DPTR && !low && !small && size <= reuse_size;
        if (again) next = &reuse_at;
        allocs[slot] = (struct fake_alloc){*next, size, pdev, kind, own, pool, kind == K_VMM, 0, small, NULL, 0, 0, 0};
        if (low) {
            unsigned int h = (unsigned int)*next;
            memcpy(handle, &h, sizeof(h));
        } else {
            memcpy(handle, next, sizeof(*next)); /* CUdeviceptr, CUarray, ... are 8 bytes */
        }
        if (again) {
            reuse_at = reuse_size = 0;
        } else {
            *next += (size + 0xfffff) & ~0xfffffull;
            *next += 0x100000;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUresult alloc_new(int kind, uint64_t size, int pdev, struct fake_pool *pool, void *handle, int charge)
{
    return alloc_at(kind, size, pdev, pool, handle, charge, 0);
}

/* Handles imported by the process that exported them (cuMemImportFromShareableHandle): other
 * names of the same VMM allocation, each holding a reference to it. */
#define MAX_ALIASES 256
static struct {
    uint64_t alias, handle;
} aliases[MAX_ALIASES];

static struct fake_alloc *alloc_find(int kind, uint64_t handle)
{
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].kind == kind && allocs[i].handle == handle) return &allocs[i];
    for (int j = 0; kind == K_VMM && handle && j < MAX_ALIASES; j++)
        if (aliases[j].alias == handle) return alloc_find(K_VMM, aliases[j].handle);
    return NULL;
}

static void amap_drop_array(uint64_t array);

static CUresult alloc_free(int kind, uint64_t handle)
{
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(kind, handle);
    if (a && (kind == K_ARRAY || kind == K_MIPMAP)) amap_drop_array(handle); /* its tiles' mappings go */
    if (!a && kind == K_DPTR) a = alloc_find(K_POOL, handle);
    if (!a) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (a->kind == K_POOL)
        pool_give(a->pool, a->size);
    else
        alloc_give(a);
    memset(a, 0, sizeof(*a));
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

static void extmems_drop_ctx(struct fake_ctx *c);

/* Everything a dying context owned goes with it (called with mu held). */
static void ctx_drop(struct fake_ctx *c)
{
    captures_ctx_gone(c); /* its streams went, and their captures with them */
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (!allocs[i].kind || allocs[i].ctx != c || allocs[i].kind == K_VMM) continue;
        if (allocs[i].kind == K_ARRAY || allocs[i].kind == K_MIPMAP) amap_drop_array(allocs[i].handle);
        if (allocs[i].kind == K_POOL)
            pool_give(allocs[i].pool, allocs[i].size);
        else if (allocs[i].kind != K_IPC) /* a mapping of another process's memory took none */
            alloc_give(&allocs[i]);
        memset(&allocs[i], 0, sizeof(allocs[i]));
    }
    extmems_drop_ctx(c); /* its external memory objects go with it */
    pools_complete_all(); /* its streams' frees complete with it (FAKE_CUDA_POOL_PENDING) */
    if (c->primary) { /* the device's default pool goes with its primary context */
        struct fake_pool *p = &default_pools[c->pdev];
        p->pending = 0; /* its frees complete with it */
        memset(p->pend_bytes, 0, sizeof(p->pend_bytes));
        phys_sub(c->pdev, p->reserved - p->used);
        p->reserved = p->used;
        phys_sub(c->pdev, graph_reserved[c->pdev]); /* and so does its graph memory */
        graph_reserved[c->pdev] = 0;
    }
    phys_sub(c->pdev, c->base + c->modules);
    c->base = c->modules = 0;
    c->gen++;
    memset(c->limits, 0, sizeof(c->limits));
}

/* Test-only: the context grows by `bytes` without any API call the interposer sees,
 * as when the driver loads a module at a kernel's first launch. */
API CUresult fake_cuda_module_load(uint64_t bytes)
{
    NEED_CTX();
    pthread_mutex_lock(&mu);
    CUresult rc = phys_add(current->pdev, bytes);
    if (rc == CUDA_SUCCESS) current->modules += bytes;
    pthread_mutex_unlock(&mu);
    return rc;
}

/* ---- modules and libraries ------------------------------------------------ */

struct fake_module {
    struct fake_ctx *ctx;
    uint64_t bytes;
    unsigned gen; /* ctx's when loaded */
    struct {      /* a library: the other contexts it was loaded in when needed there */
        struct fake_ctx *ctx;
        unsigned gen;
    } also[8];
    int nalso;
};
static void *freed_module; /* FAKE_CUDA_HANDLE_REUSE: the next module or library load's */

/* The current context takes `bytes` more for code (under mu). */
static CUresult code_grow_locked(uint64_t bytes)
{
    CUresult rc = phys_add(current->pdev, bytes);
    if (rc == CUDA_SUCCESS) current->modules += bytes;
    return rc;
}

static uint64_t stack_threads(void)
{
    const char *v = getenv("FAKE_CUDA_STACK_THREADS");
    uint64_t n = v ? strtoull(v, NULL, 10) : 1024;
    return n ? n : 1;
}

/* The threads the device runs at once, as SMs x threads per SM (8 SMs when they divide). */
API CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
    if (!pi || dev < 0 || dev >= nvisible) return CUDA_ERROR_INVALID_VALUE;
    uint64_t threads = stack_threads(), sms = threads % 8 ? 1 : 8;
    switch (attrib) {
    case 16: *pi = (int)sms; return CUDA_SUCCESS;           /* MULTIPROCESSOR_COUNT */
    case 39: *pi = (int)(threads / sms); return CUDA_SUCCESS; /* MAX_THREADS_PER_MULTIPROCESSOR */
    default: *pi = 0; return CUDA_SUCCESS;
    }
}

/* Bytes the device runtime's limits (sync depth, pending launch count) take per unit. */
static uint64_t cdp_unit(void)
{
    const char *v = getenv("FAKE_CUDA_CDP_UNIT");
    uint64_t n = v ? fake_size(v) : 1024;
    return n ? n : 1;
}

static unsigned long lmem_calls, attr_queries; /* FAKE_CUDA_FUNC_LOCAL's counters */

API unsigned long fake_cuda_lmem_calls(void)
{
    return __atomic_load_n(&lmem_calls, __ATOMIC_RELAXED);
}

API unsigned long fake_cuda_attr_queries(void)
{
    return __atomic_load_n(&attr_queries, __ATOMIC_RELAXED);
}

static const void *local_named[64]; /* FAKE_CUDA_FUNC_LOCAL_NAME's functions */

static int is_local_named(const void *f)
{
    for (unsigned i = 0; i < 64; i++)
        if (__atomic_load_n(&local_named[i], __ATOMIC_ACQUIRE) == f) return 1;
    return 0;
}

/* FAKE_CUDA_FUNC_LOCAL: a function's local memory per thread */
static uint64_t func_local(const void *f)
{
    const char *v = getenv("FAKE_CUDA_FUNC_LOCAL");
    if (getenv("FAKE_CUDA_FUNC_LOCAL_NAME") && !is_local_named(f)) return 0;
    return v && f && f != (const void *)0x1234 ? fake_size(v) : 0;
}

API CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction f)
{
    __atomic_add_fetch(&lmem_calls, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&attr_queries, 1, __ATOMIC_RELAXED);
    FAIL_POINT("cuFuncGetAttribute");
    if (!pi || !f) return CUDA_ERROR_INVALID_VALUE;
    *pi = attrib == 3 ? (int)func_local(f) : 0; /* CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES */
    return CUDA_SUCCESS;
}

API CUresult cuKernelGetAttribute(int *pi, int attrib, CUkernel k, CUdevice dev)
{
    __atomic_add_fetch(&lmem_calls, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&attr_queries, 1, __ATOMIC_RELAXED);
    FAIL_POINT("cuKernelGetAttribute");
    if (!pi || !k || dev < 0 || dev >= nvisible) return CUDA_ERROR_INVALID_VALUE;
    *pi = attrib == 3 ? (int)func_local(k) : 0;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetLimit(size_t *value, int limit)
{
    __atomic_add_fetch(&lmem_calls, 1, __ATOMIC_RELAXED);
    NEED_CTX();
    if (!value || limit < 0 || limit > 4) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    uint64_t held = current->limits[limit];
    pthread_mutex_unlock(&mu);
    *value = (size_t)(limit == 0 ? held / stack_threads() : limit >= 3 ? held / cdp_unit() : held);
    return CUDA_SUCCESS;
}

/* cuCtxSetLimit: the context reserves the stacks, the printf FIFO and the malloc heap. */
API CUresult cuCtxSetLimit(int limit, size_t value)
{
    __atomic_add_fetch(&lmem_calls, 1, __ATOMIC_RELAXED);
    FAIL_POINT("cuCtxSetLimit");
    NEED_CTX();
    api_callback("cuCtxSetLimit");
    if (limit < 0 || limit > 4) return CUDA_ERROR_INVALID_VALUE;
    uint64_t want = limit == 0 ? (uint64_t)value * stack_threads() : limit >= 3 ? (uint64_t)value * cdp_unit() : value;
    pthread_mutex_lock(&mu);
    CUresult rc = CUDA_SUCCESS;
    uint64_t *held = &current->limits[limit];
    if (want > *held) {
        rc = code_grow_locked(want - *held);
        if (rc == CUDA_SUCCESS) *held = want;
    } else if (want < *held && getenv("FAKE_CUDA_LIMIT_SHRINK")) { /* a lowered limit is freed */
        phys_sub(current->pdev, *held - want);
        current->modules -= *held - want;
        *held = want;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUresult module_new(void *out)
{
    NEED_CTX();
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult rc = code_grow_locked(module_bytes);
    pthread_mutex_unlock(&mu);
    if (rc != CUDA_SUCCESS) return rc;
    struct fake_module *m = reuse_or_alloc(&freed_module, sizeof(*m));
    m->ctx = current;
    m->gen = current->gen;
    m->bytes = module_bytes;
    memcpy(out, &m, sizeof(m));
    return CUDA_SUCCESS;
}

static CUresult module_drop(void *handle)
{
    struct fake_module *m = handle;
    if (!m) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    uint64_t b = m->bytes < m->ctx->modules ? m->bytes : m->ctx->modules;
    m->ctx->modules -= b;
    phys_sub(m->ctx->pdev, b);
    for (int i = 0; i < m->nalso; i++) {
        struct fake_ctx *c = m->also[i].ctx;
        if (c->gen != m->also[i].gen) continue; /* that context went, and the code with it */
        uint64_t a = m->bytes < c->modules ? m->bytes : c->modules;
        c->modules -= a;
        phys_sub(c->pdev, a);
    }
    if (getenv("FAKE_CUDA_HANDLE_REUSE")) { /* the next load gets its handle */
        free(freed_module);
        freed_module = m;
        m = NULL;
    }
    pthread_mutex_unlock(&mu);
    free(m);
    return CUDA_SUCCESS;
}

/* Distinct function / kernel handles (never dereferenced). */
static void *code_handle(void)
{
    static uint64_t next = 0x200000;
    return (void *)(uintptr_t)__atomic_add_fetch(&next, 16, __ATOMIC_RELAXED);
}

API CUresult cuModuleLoad(CUmodule *m, const char *fname)
{
    FAIL_POINT("cuModuleLoad");
    return fname ? module_new(m) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    FAIL_POINT("cuModuleLoadData");
    return image ? module_new(m) : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned int n, CUjit_option *o, void **v)
{
    (void)n, (void)o, (void)v;
    return cuModuleLoadData(m, image);
}

API CUresult cuModuleLoadFatBinary(CUmodule *m, const void *fatbin)
{
    return cuModuleLoadData(m, fatbin);
}

API CUresult cuModuleUnload(CUmodule m)
{
    FAIL_POINT("cuModuleUnload");
    return module_drop(m);
}

/* The same handle for the same name in the same module or library, as the driver gives (a
 * launcher may look a kernel up before every launch) */
static void *named_handle(const void *in, const char *name)
{
    static struct {
        const void *in;
        uint64_t name;
        void *handle;
    } known[256];
    static pthread_mutex_t named_mu = PTHREAD_MUTEX_INITIALIZER;
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *c = name; *c; c++) h = (h ^ (unsigned char)*c) * 0x100000001b3ull;
    void *got = NULL;
    pthread_mutex_lock(&named_mu);
    for (unsigned i = 0; i < 256 && !got; i++) {
        if (known[i].handle && known[i].in == in && known[i].name == h) got = known[i].handle;
        if (!known[i].handle) {
            known[i].in = in, known[i].name = h, known[i].handle = got = code_handle();
        }
    }
    pthread_mutex_unlock(&named_mu);
    return got ? got : code_handle();
}

API CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    FAIL_POINT("cuModuleGetFunction");
    if (!f || !m || !name) return CUDA_ERROR_INVALID_VALUE;
    *f = (CUfunction)named_handle(m, name);
    const char *local = getenv("FAKE_CUDA_FUNC_LOCAL_NAME");
    if (local && *local && strstr(name, local) && !is_local_named(*f))
        for (unsigned i = 0; i < 64; i++) {
            const void *none = NULL;
            if (__atomic_compare_exchange_n(&local_named[i], &none, (const void *)*f, 0, __ATOMIC_RELEASE,
                                            __ATOMIC_RELAXED))
                break;
        }
    return CUDA_SUCCESS;
}

/* CUDA_MODULE_LOADING=EAGER, as the driver reads it: 1 eager, 2 lazy (the default) */
static int eager_loading(void)
{
    const char *v = getenv("CUDA_MODULE_LOADING");
    return v && !strcmp(v, "EAGER");
}

API CUresult cuModuleGetLoadingMode(CUmoduleLoadingMode *mode)
{
    FAIL_POINT("cuModuleGetLoadingMode");
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    *mode = eager_loading() ? CU_MODULE_EAGER_LOADING : CU_MODULE_LAZY_LOADING;
    return CUDA_SUCCESS;
}

API CUresult cuLibraryLoadData(CUlibrary *l, const void *code, CUjit_option *jo, void **jv, unsigned int nj,
                               CUlibraryOption *lo, void **lv, unsigned int nl)
{
    (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    FAIL_POINT("cuLibraryLoadData");
    CUresult rc = code ? module_new(l) : CUDA_ERROR_INVALID_VALUE;
    if (rc != CUDA_SUCCESS || !eager_loading()) return rc;
    /* loaded eagerly, the library goes into every context at once: the other devices' primary
     * contexts too */
    struct fake_module *m = *(struct fake_module **)l;
    pthread_mutex_lock(&mu);
    for (int d = 0; d < nvisible; d++) {
        struct fake_ctx *c = &primaries[d];
        if (c == current || !c->refs || m->nalso >= 8 || phys_add(c->pdev, m->bytes) != CUDA_SUCCESS) continue;
        c->modules += m->bytes;
        m->also[m->nalso].ctx = c;
        m->also[m->nalso++].gen = c->gen;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

API CUresult cuLibraryLoadFromFile(CUlibrary *l, const char *file, CUjit_option *jo, void **jv, unsigned int nj,
                                   CUlibraryOption *lo, void **lv, unsigned int nl)
{
    return cuLibraryLoadData(l, file, jo, jv, nj, lo, lv, nl);
}

API CUresult cuLibraryUnload(CUlibrary l)
{
    FAIL_POINT("cuLibraryUnload");
    return module_drop(l);
}

/* A library is loaded in a context when it is needed there (lazy loading): the first
 * cuLibraryGetModule or cuLibraryGetGlobal in a context it is not loaded in (one made after
 * its load, or a primary context retained again) loads its code there */
static CUresult library_here(struct fake_module *l)
{
    NEED_CTX();
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&mu);
    int here = l->ctx == current && l->gen == current->gen;
    for (int i = 0; i < l->nalso && !here; i++) here = l->also[i].ctx == current && l->also[i].gen == current->gen;
    if (!here) {
        rc = code_grow_locked(l->bytes);
        if (rc == CUDA_SUCCESS && l->nalso < 8) {
            l->also[l->nalso].ctx = current;
            l->also[l->nalso++].gen = current->gen;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

API CUresult cuLibraryGetModule(CUmodule *m, CUlibrary l)
{
    FAIL_POINT("cuLibraryGetModule");
    if (!m || !l) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = library_here((struct fake_module *)l);
    if (rc == CUDA_SUCCESS) *m = (CUmodule)named_handle(l, "(module)");
    return rc;
}

API CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary l, const char *name)
{
    FAIL_POINT("cuLibraryGetGlobal");
    if ((!dptr && !bytes) || !l || !name) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = library_here((struct fake_module *)l);
    if (rc != CUDA_SUCCESS) return rc;
    if (dptr) *dptr = (CUdeviceptr)(uintptr_t)named_handle(l, name);
    if (bytes) *bytes = 8;
    return CUDA_SUCCESS;
}

API CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary l, const char *name)
{
    if (!k || !l || !name) return CUDA_ERROR_INVALID_VALUE;
    *k = (CUkernel)named_handle(l, name);
    return CUDA_SUCCESS;
}

API CUresult cuKernelGetFunction(CUfunction *f, CUkernel k)
{
    if (!f || !k) return CUDA_ERROR_INVALID_VALUE;
    *f = (CUfunction)k;
    return CUDA_SUCCESS;
}

/* The first launch of a function loads its code (lazy loading). */
static CUresult lazy_code(CUfunction f)
{
    static CUfunction seen[1024];
    static int nseen;
    if (!launch_bytes || !f) return CUDA_SUCCESS;
    NEED_CTX();
    pthread_mutex_lock(&mu);
    CUresult rc = CUDA_SUCCESS;
    int known = 0;
    for (int i = 0; i < nseen && !known; i++) known = seen[i] == f;
    if (!known) {
        rc = code_grow_locked(launch_bytes);
        if (rc == CUDA_SUCCESS && nseen < 1024) seen[nseen++] = f;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* cuFuncLoad (CUDA 12.4): finalizes a lazily loaded function's loading, as its first launch
 * would (FAKE_CUDA_LAUNCH_BYTES); a loaded one is left as it is */
API CUresult cuFuncLoad(CUfunction f)
{
    FAIL_POINT("cuFuncLoad");
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    return lazy_code(f);
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
{
    FAIL_POINT("cuMemAlloc_v2");
    NEED_API(0);
    if (!dptr || !bytes) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_new(K_DPTR, bytes, current->pdev, NULL, dptr, 1);
    (void)fail_check("cuMemAlloc_v2After"); /* FAKE_CUDA_SLEEP: still inside, the memory taken */
    return rc;
}

/* CUDA 2.x's entry points: 32-bit pointers, sizes and views (saturated) */
API CUresult cuMemAlloc(unsigned int *dptr, unsigned int bytes)
{
    FAIL_POINT("cuMemAlloc");
    NEED_API(1);
    if (!dptr || !bytes) return CUDA_ERROR_INVALID_VALUE;
    return alloc_at(K_DPTR, bytes, current->pdev, NULL, dptr, 1, 1);
}

API CUresult cuMemAllocPitch(unsigned int *dptr, unsigned int *pitch, unsigned int w, unsigned int h,
                             unsigned int elem)
{
    FAIL_POINT("cuMemAllocPitch");
    NEED_API(1);
    if (!dptr || !pitch || !w || !h || (elem != 4 && elem != 8 && elem != 16)) return CUDA_ERROR_INVALID_VALUE;
    uint64_t p = pitch_of(w);
    if (p > 0xffffffffu) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_at(K_DPTR, p * h, current->pdev, NULL, dptr, 1, 1);
    if (rc == CUDA_SUCCESS) *pitch = (unsigned int)p;
    return rc;
}

API CUresult cuMemFree(unsigned int dptr)
{
    FAIL_POINT("cuMemFree");
    if (current && !current->api1 && getenv("FAKE_CUDA_API_VERSIONS")) return CUDA_ERROR_INVALID_CONTEXT;
    return alloc_free(K_DPTR, dptr);
}

static unsigned int sat32(size_t v)
{
    return v > 0xffffffffu ? 0xffffffffu : (unsigned int)v;
}

static void mem_info(size_t *free_bytes, size_t *total)
{
    uint64_t used = fake_phys_map() ? fake_phys_used(current->pdev) : local_used[current->pdev];
    *total = devs[current->pdev].total;
    *free_bytes = used < *total ? *total - used : 0;
}

API CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total)
{
    FAIL_POINT("cuMemGetInfo");
    NEED_API(1);
    if (!free_bytes && !total) return CUDA_ERROR_INVALID_VALUE; /* as cuMemGetInfo_v2 */
    size_t f = 0, t = 0;
    mem_info(&f, &t);
    if (free_bytes) *free_bytes = sat32(f);
    if (total) *total = sat32(t);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice d)
{
    FAIL_POINT("cuDeviceTotalMem");
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    size_t t = 0;
    CUresult rc = cuDeviceTotalMem_v2(&t, d);
    if (rc == CUDA_SUCCESS) *bytes = sat32(t);
    return rc;
}

API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytes, unsigned int flags)
{
    (void)flags;
    FAIL_POINT("cuMemAllocManaged");
    NEED_CTX();
    if (!dptr || !bytes) return CUDA_ERROR_INVALID_VALUE;
    return alloc_new(K_DPTR, bytes, current->pdev, NULL, dptr, 1);
}

API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned int elem)
{
    FAIL_POINT("cuMemAllocPitch_v2");
    NEED_API(0);
    if (!dptr || !pitch || !w || !h || (elem != 4 && elem != 8 && elem != 16)) return CUDA_ERROR_INVALID_VALUE;
    size_t p = pitch_of(w);
    CUresult rc = alloc_new(K_DPTR, p * h, current->pdev, NULL, dptr, 1);
    if (rc == CUDA_SUCCESS) *pitch = p;
    (void)fail_check("cuMemAllocPitch_v2After"); /* FAKE_CUDA_SLEEP: still inside, the memory taken */
    return rc;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    FAIL_POINT("cuMemFree_v2");
    if (current && current->api1 && getenv("FAKE_CUDA_API_VERSIONS")) return CUDA_ERROR_INVALID_CONTEXT;
    CUresult rc = alloc_free(K_DPTR, dptr);
    (void)fail_check("cuMemFree_v2After"); /* FAKE_CUDA_SLEEP: still inside, freed or refused */
    return rc;
}

API CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr dptr)
{
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_DPTR, dptr);
    if (!a) a = alloc_find(K_POOL, dptr); /* a stream-ordered allocation is an address range too */
    if (a) {
        if (base) *base = a->handle;
        if (size) *size = a->size;
    }
    pthread_mutex_unlock(&mu);
    return a ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

/* CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL only (other attributes: CUDA_ERROR_NOT_SUPPORTED, not
 * modelled): "the device ordinal of the device against which the memory was allocated or
 * registered", for any address inside a plain or stream-ordered allocation (a pool's: the device
 * the pool keeps its memory on, whichever context allocated; a host pool's: the allocating
 * context's); CUDA_ERROR_INVALID_VALUE for an address the driver did not allocate */
#define FAKE_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
API CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr)
{
    FAIL_POINT("cuPointerGetAttribute");
    NEED_INIT();
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    if (attribute != FAKE_POINTER_ATTRIBUTE_DEVICE_ORDINAL) return CUDA_ERROR_NOT_SUPPORTED;
    int pdev = -1;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_ALLOCS && pdev < 0; i++) {
        const struct fake_alloc *a = &allocs[i];
        if ((a->kind == K_DPTR || a->kind == K_POOL) && ptr >= a->handle && ptr - a->handle < a->size)
            pdev = a->pdev >= 0 ? a->pdev : a->ctx ? a->ctx->pdev : -1;
    }
    pthread_mutex_unlock(&mu);
    for (int d = 0; d < nvisible; d++)
        if (pdev >= 0 && visible[d] == pdev) {
            *(int *)data = d;
            return CUDA_SUCCESS;
        }
    return CUDA_ERROR_INVALID_VALUE;
}

/* CUDA IPC: a handle names the exporter's allocation (its pid, device, base, size); the
 * importer maps that memory, so its mapping (K_IPC) takes no memory of its own: the fake's
 * NVML lists nothing more for the importer, as the H200 showed (driver 580.159.04, the GPU
 * check's ipc_import row: +0 MiB for the importer).  As documented: a handle already opened by
 * the context is not mapped again ("the reference count on the handle is incremented by 1 and
 * the existing device pointer is returned"), and cuIpcCloseMemHandle unmaps it when the count
 * reaches 0.  The exporter's cuMemFree before the importer's close is undefined behaviour by
 * the documentation: here the memory goes at the free (the mapping stays, as a name only). */
typedef struct {
    char reserved[64]; /* CU_IPC_HANDLE_SIZE */
} fake_ipc_handle;
struct fake_ipc_body {
    char magic[8];
    int32_t pid, pdev;
    uint64_t base, size;
};

API CUresult cuIpcGetMemHandle(fake_ipc_handle *handle, CUdeviceptr dptr)
{
    FAIL_POINT("cuIpcGetMemHandle");
    NEED_CTX();
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_DPTR, dptr);
    struct fake_ipc_body body = {"FAKEIPC", (int32_t)getpid(), a ? a->pdev : 0, dptr, a ? a->size : 0};
    pthread_mutex_unlock(&mu);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    memset(handle, 0, sizeof(*handle));
    memcpy(handle->reserved, &body, sizeof(body));
    return CUDA_SUCCESS;
}

API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, fake_ipc_handle handle, unsigned int flags)
{
    (void)flags;
    FAIL_POINT("cuIpcOpenMemHandle_v2");
    NEED_CTX();
    struct fake_ipc_body body;
    memcpy(&body, handle.reserved, sizeof(body));
    if (!dptr || memcmp(body.magic, "FAKEIPC", 8) || !body.size) return CUDA_ERROR_INVALID_VALUE;
    if (body.pid == (int32_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT; /* as the driver: not in its own process */
    if (kill(body.pid, 0) != 0) return CUDA_ERROR_INVALID_HANDLE;
    struct fake_ctx *own = current && current->owner ? current->owner : current;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].kind == K_IPC && allocs[i].ctx == own && allocs[i].src_pid == body.pid &&
            allocs[i].src_base == body.base) {
            allocs[i].refs++;
            *dptr = allocs[i].handle;
            pthread_mutex_unlock(&mu);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&mu);
    CUdeviceptr p = 0;
    CUresult rc = alloc_new(K_IPC, body.size, body.pdev, NULL, &p, 0);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_IPC, p);
    if (a) a->refs = 1, a->src_pid = body.pid, a->src_base = body.base;
    pthread_mutex_unlock(&mu);
    *dptr = p;
    return CUDA_SUCCESS;
}

API CUresult cuIpcOpenMemHandle(CUdeviceptr *dptr, fake_ipc_handle handle, unsigned int flags)
{
    return cuIpcOpenMemHandle_v2(dptr, handle, flags);
}

API CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    FAIL_POINT("cuIpcCloseMemHandle");
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_IPC, dptr);
    if (a && --a->refs == 0) memset(a, 0, sizeof(*a));
    pthread_mutex_unlock(&mu);
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    FAIL_POINT("cuMemGetInfo_v2");
    NEED_API(0);
    /* one output may be omitted: the driver answers the other (libnvoptix, shipped with the
     * driver, asks cuMemGetInfo_v2(NULL, &total) at OptiX's initialisation, HAMi-core #321/#333;
     * llama.cpp asked cudaMemGetInfo(&free, NULL)); neither is taken for a bad call */
    if (!free_bytes && !total) return CUDA_ERROR_INVALID_VALUE;
    size_t f = 0, t = 0;
    mem_info(&f, &t);
    if (free_bytes) *free_bytes = f;
    if (total) *total = t;
    return CUDA_SUCCESS;
}

/* VMM */
/* A VMM allocation made in a locality domain remembers it (its properties say so) */
static void set_domain(uint64_t handle, int domain)
{
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_VMM, handle);
    if (a) a->domain = domain;
    pthread_mutex_unlock(&mu);
}

/* A location's visible ordinal (*domain: 1 + its locality domain, 0 for a device's), -1 for host
 * memory, -2 if invalid.  As a CUDA 13.4 driver, each device has FAKE_CUDA_LOCALITY_DOMAINS (2)
 * locality domains: CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN, its id's first byte the device,
 * its second the domain */
static int location_ordinal(const CUmemLocation *loc, int *domain)
{
    *domain = 0;
    if (loc->type == CU_MEM_LOCATION_TYPE_HOST || loc->type == CU_MEM_LOCATION_TYPE_HOST_NUMA ||
        loc->type == CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT)
        return -1;
    int ordinal = loc->id;
    if (loc->type == CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN) {
        unsigned char b[2];
        memcpy(b, &loc->id, 2);
        const char *v = getenv("FAKE_CUDA_LOCALITY_DOMAINS");
        if (b[1] >= (v ? atoi(v) : 2)) return -2;
        ordinal = b[0];
        *domain = 1 + b[1];
    } else if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE) {
        return -2;
    }
    return ordinal >= 0 && ordinal < nvisible ? ordinal : -2;
}

API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                         unsigned long long flags)
{
    (void)flags;
    FAIL_POINT("cuMemCreate");
    NEED_INIT();
    int domain = 0, ordinal = prop ? location_ordinal(&prop->location, &domain) : -2;
    if (!handle || !prop || !size || ordinal < 0 || size % (2u << 20))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_new(K_VMM, size, visible[ordinal], NULL, handle, 1); /* one reference */
    if (rc == CUDA_SUCCESS) set_domain(*handle, domain);
    return rc;
}

/* A VMM allocation is freed once its handle references (cuMemCreate,
 * cuMemRetainAllocationHandle) are all released and its mappings all unmapped,
 * in either order, as the real driver documents. */
#define MAX_VMAPS 1024
static struct {
    uint64_t va, size, handle;
} vmaps[MAX_VMAPS];
static uint64_t next_va = 0x600000000000ull;

static void vmm_maybe_free(struct fake_alloc *a) /* mu held */
{
    if (a->refs || a->maps) return;
    phys_sub(a->pdev, a->size);
    memset(a, 0, sizeof(*a));
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    FAIL_POINT("cuMemRelease");
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_VMM, handle);
    CUresult rc = a && a->refs ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        a->refs--;
        vmm_maybe_free(a);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                 unsigned long long flags)
{
    (void)alignment, (void)addr, (void)flags;
    if (!ptr || !size || size % (2u << 20)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    *ptr = next_va;
    next_va += size + (2u << 20);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    return ptr && size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                      unsigned long long flags)
{
    (void)flags;
    FAIL_POINT("cuMemMap");
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_VMM, handle);
    CUresult rc = a && a->refs && size && offset + size <= a->size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    int slot = -1;
    for (int i = 0; i < MAX_VMAPS && rc == CUDA_SUCCESS; i++) {
        if (!vmaps[i].size) {
            if (slot < 0) slot = i;
        } else if (ptr < vmaps[i].va + vmaps[i].size && vmaps[i].va < ptr + size) {
            rc = CUDA_ERROR_INVALID_VALUE; /* overlaps a mapping */
        }
    }
    if (rc == CUDA_SUCCESS && slot < 0) rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (rc == CUDA_SUCCESS) {
        vmaps[slot].va = ptr;
        vmaps[slot].size = size;
        vmaps[slot].handle = handle;
        a->maps++;
    }
    pthread_mutex_unlock(&mu);
    if (rc == CUDA_SUCCESS) (void)fail_check("cuMemMapAfter"); /* FAKE_CUDA_SLEEP: still inside, mapped */
    return rc;
}

/* cuMemMapArrayAsync: tiles of sparse arrays backed by VMM allocations.  A mapping holds its
 * allocation's memory like cuMemMap's; an unmap names the array and the tiles (the same
 * subresource as a mapping undoes it; any other leaves the mappings, as a partial unmap of
 * them would keep their memory); destroying the array drops its mappings. */
#define MAX_AMAPS 1024
static struct {
    uint64_t array, handle;
    int type;
    unsigned v[8];
    unsigned long long tail[2];
} amaps[MAX_AMAPS];

static void amap_fill(const CUarrayMapInfo *m, unsigned v[8], unsigned long long tail[2], int *type)
{
    memset(v, 0, 8 * sizeof(unsigned));
    tail[0] = tail[1] = 0;
    *type = m->subresourceType;
    if (m->subresourceType == CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL) {
        v[0] = m->subresource.miptail.layer;
        tail[0] = m->subresource.miptail.offset;
        tail[1] = m->subresource.miptail.size;
    } else {
        memcpy(v, &m->subresource.sparseLevel, 8 * sizeof(unsigned));
    }
}

static void amap_drop(int i) /* mu held */
{
    struct fake_alloc *a = alloc_find(K_VMM, amaps[i].handle);
    memset(&amaps[i], 0, sizeof(amaps[i]));
    if (a && a->maps) {
        a->maps--;
        vmm_maybe_free(a);
    }
}

static void amap_drop_array(uint64_t array) /* mu held */
{
    for (int i = 0; i < MAX_AMAPS; i++)
        if (amaps[i].array == array) amap_drop(i);
}

static CUresult map_array(CUarrayMapInfo *list, unsigned count)
{
    FAIL_POINT("cuMemMapArrayAsync");
    if (!list || !count) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult rc = CUDA_SUCCESS;
    for (unsigned k = 0; k < count && rc == CUDA_SUCCESS; k++) {
        const CUarrayMapInfo *m = &list[k];
        uint64_t array = (uint64_t)(uintptr_t)m->resource.array;
        int kind = m->resourceType == CU_RESOURCE_TYPE_MIPMAPPED_ARRAY ? K_MIPMAP : K_ARRAY, type;
        unsigned v[8];
        unsigned long long tail[2];
        amap_fill(m, v, tail, &type);
        if (!alloc_find(kind, array)) {
            rc = CUDA_ERROR_INVALID_VALUE;
            break;
        }
        int at = -1, free_at = -1;
        for (int i = 0; i < MAX_AMAPS; i++) {
            if (!amaps[i].array) {
                if (free_at < 0) free_at = i;
            } else if (amaps[i].array == array && amaps[i].type == type && !memcmp(amaps[i].v, v, sizeof(v)) &&
                       !memcmp(amaps[i].tail, tail, sizeof(tail))) {
                at = i;
            }
        }
        if (m->memOperationType == CU_MEM_OPERATION_TYPE_UNMAP) {
            if (at >= 0) amap_drop(at);
        } else if (m->memOperationType == CU_MEM_OPERATION_TYPE_MAP) {
            struct fake_alloc *a = alloc_find(K_VMM, m->memHandle.memHandle);
            if (!a || !a->refs || m->memHandleType != CU_MEM_HANDLE_TYPE_GENERIC) {
                rc = CUDA_ERROR_INVALID_VALUE;
                break;
            }
            if (at >= 0) amap_drop(at), free_at = at; /* the tiles mapped again: the old mapping goes */
            if (free_at < 0) {
                rc = CUDA_ERROR_OUT_OF_MEMORY;
                break;
            }
            amaps[free_at].array = array;
            amaps[free_at].handle = m->memHandle.memHandle;
            amaps[free_at].type = type;
            memcpy(amaps[free_at].v, v, sizeof(v));
            memcpy(amaps[free_at].tail, tail, sizeof(tail));
            a->maps++;
        } else {
            rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

API CUresult cuMemMapArrayAsync(CUarrayMapInfo *list, unsigned int count, CUstream s)
{
    (void)s;
    CUresult rc = map_array(list, count);
    (void)fail_check("cuMemMapArrayAsyncAfter"); /* FAKE_CUDA_SLEEP: still inside, the tiles (un)mapped */
    return rc;
}

API CUresult cuMemMapArrayAsync_ptsz(CUarrayMapInfo *list, unsigned int count, CUstream s)
{
    (void)s;
    return map_array(list, count);
}

/* Unmaps every mapping that starts inside [ptr, ptr + size). */
API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    FAIL_POINT("cuMemUnmap");
    pthread_mutex_lock(&mu);
    int found = 0;
    for (int i = 0; i < MAX_VMAPS; i++) {
        if (!vmaps[i].size || vmaps[i].va < ptr || vmaps[i].va >= ptr + size) continue;
        struct fake_alloc *a = alloc_find(K_VMM, vmaps[i].handle);
        memset(&vmaps[i], 0, sizeof(vmaps[i]));
        found++;
        if (a) {
            a->maps--;
            vmm_maybe_free(a);
        }
    }
    pthread_mutex_unlock(&mu);
    (void)fail_check("cuMemUnmapAfter"); /* FAKE_CUDA_SLEEP: still inside, the range unmapped */
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count)
{
    return ptr && size && desc && count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    FAIL_POINT("cuMemRetainAllocationHandle");
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    uint64_t va = (uint64_t)(uintptr_t)addr;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_VMAPS && rc != CUDA_SUCCESS; i++) {
        if (!vmaps[i].size || va < vmaps[i].va || va >= vmaps[i].va + vmaps[i].size) continue;
        struct fake_alloc *a = alloc_find(K_VMM, vmaps[i].handle);
        if (a) {
            a->refs++;
            *handle = vmaps[i].handle; /* the handle that mapped it (an import's own), as documented */
            rc = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* VMM export and import, POSIX file descriptors only.  The descriptor is a memfd holding what an
 * importer needs.  Imported by the exporting process, the handle is another name of the same
 * allocation, holding a reference to it as the real driver's does.  Imported by another process,
 * it is a new allocation of the importer's, its memory counted there (in its NVML figure too),
 * and the exporter's memory goes with its own handle and mappings, where the real driver keeps
 * one allocation while any of them remains.  Neither keeps the memory for the descriptor alone,
 * which the real driver also does. */
struct fake_export {
    char magic[8];
    int32_t pid, pdev;
    uint64_t size, handle;
    int32_t domain;
};
static uint64_t next_alias = 0x7a0000000000ull;

API CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                          CUmemAllocationHandleType handleType, unsigned long long flags)
{
    FAIL_POINT("cuMemExportToShareableHandle");
    if (!shareableHandle || flags) return CUDA_ERROR_INVALID_VALUE;
    if (handleType != 1) return CUDA_ERROR_NOT_SUPPORTED; /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_VMM, handle);
    struct fake_export body = {"FAKEEXP", (int32_t)getpid(), a ? a->pdev : 0, a ? a->size : 0, a ? a->handle : 0,
                               a ? a->domain : 0};
    pthread_mutex_unlock(&mu);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    int fd = memfd_create("fakecuda-export", 0);
    if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
    if (write(fd, &body, sizeof(body)) != (ssize_t)sizeof(body)) {
        close(fd);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    memcpy(shareableHandle, &fd, sizeof(fd));
    return CUDA_SUCCESS;
}

API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                            CUmemAllocationHandleType shHandleType)
{
    FAIL_POINT("cuMemImportFromShareableHandle");
    NEED_INIT();
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    if (shHandleType != 1) return CUDA_ERROR_NOT_SUPPORTED;
    struct fake_export body;
    int fd = (int)(intptr_t)osHandle; /* a descriptor is passed as the pointer's value */
    if (pread(fd, &body, sizeof(body), 0) != (ssize_t)sizeof(body) || memcmp(body.magic, "FAKEEXP", 8) ||
        !body.size || body.pdev < 0 || body.pdev >= ndevs)
        return CUDA_ERROR_INVALID_VALUE;
    if (body.pid != (int32_t)getpid()) {
        CUresult rc = alloc_new(K_VMM, body.size, body.pdev, NULL, handle, 1);
        if (rc == CUDA_SUCCESS) set_domain(*handle, body.domain);
        return rc;
    }
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_VMM, body.handle);
    for (int j = 0; a && j < MAX_ALIASES && rc != CUDA_SUCCESS; j++) {
        if (aliases[j].alias && alloc_find(K_VMM, aliases[j].alias)) continue; /* in use */
        aliases[j].alias = next_alias;
        aliases[j].handle = a->handle;
        next_alias += 2u << 20;
        a->refs++;
        *handle = aliases[j].alias;
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* External memory (cuImportExternalMemory), of this fake's VMM exports only
 * (CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD): the object holds a reference to the allocation,
 * as an imported handle does (another process's export: a new allocation of the importer's,
 * as cuMemImportFromShareableHandle's), until cuDestroyExternalMemory or its context's end.
 * The descriptor is the driver's once the import succeeds: it is closed. */
#define MAX_EXTMEMS 64
static struct fake_extmem {
    uint64_t alloc; /* the K_VMM allocation it references (0: a free entry) */
    struct fake_ctx *ctx;
} extmems[MAX_EXTMEMS];

static void extmem_drop(struct fake_extmem *e) /* mu held */
{
    struct fake_alloc *a = alloc_find(K_VMM, e->alloc);
    memset(e, 0, sizeof(*e));
    if (a && a->refs) {
        a->refs--;
        vmm_maybe_free(a);
    }
}

/* Test-only: memory another API of this process (Vulkan, say) allocates on the current
 * context's device, which no CUDA call allocates but NVML counts, exported to a descriptor
 * (*fd) that cuImportExternalMemory takes; *handle is the other API's own reference, which
 * fake_cuda_other_api_free lets go of (the memory goes with the last holder). */
API CUresult fake_cuda_other_api_alloc(uint64_t bytes, uint64_t *handle, int *fd)
{
    NEED_CTX();
    if (!handle || !fd || !bytes) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = alloc_new(K_VMM, bytes, current->pdev, NULL, handle, 1);
    if (rc != CUDA_SUCCESS) return rc;
    struct fake_export body = {"FAKEEXP", (int32_t)getpid(), current->pdev, bytes, *handle, 0};
    *fd = memfd_create("fakecuda-other-api", 0);
    if (*fd >= 0 && write(*fd, &body, sizeof(body)) == (ssize_t)sizeof(body)) return CUDA_SUCCESS;
    if (*fd >= 0) close(*fd);
    cuMemRelease(*handle);
    return CUDA_ERROR_OPERATING_SYSTEM;
}

API CUresult fake_cuda_other_api_free(uint64_t handle)
{
    return cuMemRelease(handle);
}

static void extmems_drop_ctx(struct fake_ctx *c) /* mu held */
{
    for (int j = 0; j < MAX_EXTMEMS; j++)
        if (extmems[j].alloc && extmems[j].ctx == c) extmem_drop(&extmems[j]);
}

API CUresult cuImportExternalMemory(CUexternalMemory *out, const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *desc)
{
    FAIL_POINT("cuImportExternalMemory");
    NEED_INIT();
    NEED_CTX();
    if (!out || !desc || !desc->size) return CUDA_ERROR_INVALID_VALUE;
    if (desc->type != CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD) return CUDA_ERROR_NOT_SUPPORTED;
    struct fake_export body;
    int fd = desc->handle.fd;
    if (pread(fd, &body, sizeof(body), 0) != (ssize_t)sizeof(body) || memcmp(body.magic, "FAKEEXP", 8) ||
        body.size < desc->size || body.pdev < 0 || body.pdev >= ndevs)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t h = 0;
    if (body.pid != (int32_t)getpid()) {
        CUresult rc = alloc_new(K_VMM, body.size, body.pdev, NULL, &h, 1); /* its one reference: ours */
        if (rc != CUDA_SUCCESS) return rc;
    }
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_VMM, h ? h : body.handle);
    if (!a) rc = CUDA_ERROR_INVALID_VALUE;
    for (int j = 0; a && j < MAX_EXTMEMS && rc != CUDA_SUCCESS; j++) {
        if (extmems[j].alloc) continue;
        extmems[j].alloc = a->handle;
        extmems[j].ctx = current->owner ? current->owner : current;
        if (!h) a->refs++;
        *out = (CUexternalMemory)(void *)&extmems[j];
        rc = CUDA_SUCCESS;
    }
    if (rc != CUDA_SUCCESS && a && h) extmem_drop(&(struct fake_extmem){.alloc = h});
    pthread_mutex_unlock(&mu);
    if (rc == CUDA_SUCCESS) close(fd);
    (void)fail_check("cuImportExternalMemoryAfter"); /* FAKE_CUDA_SLEEP: still inside, imported */
    return rc;
}

API CUresult cuDestroyExternalMemory(CUexternalMemory ext)
{
    FAIL_POINT("cuDestroyExternalMemory");
    struct fake_extmem *e = (struct fake_extmem *)(void *)ext;
    if (e < extmems || e >= extmems + MAX_EXTMEMS) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    CUresult rc = e->alloc ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) extmem_drop(e);
    pthread_mutex_unlock(&mu);
    return rc;
}

API CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle)
{
    FAIL_POINT("cuMemGetAllocationPropertiesFromHandle");
    if (!prop) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    struct fake_alloc *a = alloc_find(K_VMM, handle);
    int pdev = a ? a->pdev : -1, domain = a ? a->domain : 0;
    pthread_mutex_unlock(&mu);
    if (pdev < 0) return CUDA_ERROR_INVALID_VALUE;
    int ordinal = -1;
    for (int i = 0; i < nvisible; i++)
        if (visible[i] == pdev) ordinal = i;
    memset(prop, 0, sizeof(*prop));
    prop->type = 1; /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prop->requestedHandleTypes = 1;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = ordinal;
    if (domain) { /* CUDA 13.4: localized {deviceId, localityDomainId} */
        unsigned char b[4] = {(unsigned char)ordinal, (unsigned char)(domain - 1), 0, 0};
        prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN;
        memcpy(&prop->location.id, b, sizeof(b));
    }
    return CUDA_SUCCESS;
}

API CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option)
{
    (void)prop, (void)option;
    if (!g) return CUDA_ERROR_INVALID_VALUE;
    *g = 2u << 20;
    return CUDA_SUCCESS;
}

/* Arrays */
static uint64_t elem_bytes(int format, unsigned ch)
{
    if (format == 0x50) return 4; /* UNORM_INT_101010_2 */
    if (format >= 0xc0 && format <= 0xcb) { /* [US]NORM_INT8X1/2/4, INT16X1/2/4: as named */
        int k = (format - 0xc0) % 6;
        return (k < 3 ? 1u : 2u) << (k % 3);
    }
    uint64_t per = (format == 1 || format == 8) ? 1 : (format == 2 || format == 9 || format == 0x10) ? 2 : 4;
    return per * (ch ? ch : 1);
}

/* The memory an array level takes, unpadded: block-compressed formats in 4 x 4 texel blocks
 * (8 bytes for BC1/BC4, else 16), YUV formats by their planes (in eighths of a byte a pixel:
 * NV12 is 12/8, 4:2:0 16-bit P0xx 24/8, ...), any other by elem_bytes. */
static uint64_t level_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, uint64_t w, uint64_t h, uint64_t dd)
{
    static const struct { int format; unsigned eighths; } yuv[] = {
        {0xb0, 12}, {0x9f, 24}, {0xa1, 24}, {0xa2, 16}, {0xa3, 32}, {0xa4, 32}, {0xa5, 16}, {0xa6, 32},
        {0xa7, 32}, {0xa8, 32}, {0xa9, 32}, {0xb1, 64}, {0xb2, 24}, {0xb3, 48}, {0xb4, 24}, {0xb5, 48},
    };
    int f = (int)d->Format;
    w = w ? w : 1, h = h ? h : 1, dd = dd ? dd : 1;
    if (f >= 0x91 && f <= 0x9e) {
        uint64_t block = (f <= 0x92 || f == 0x97 || f == 0x98) ? 8 : 16;
        return ((w + 3) / 4) * ((h + 3) / 4) * dd * block;
    }
    for (size_t i = 0; i < sizeof(yuv) / sizeof(yuv[0]); i++)
        if (yuv[i].format == f) return w * h * dd * yuv[i].eighths / 8; /* even sizes only */
    return w * h * dd * elem_bytes(f, d->NumChannels);
}

API CUresult cuArrayCreate_v2(CUarray *h, const CUDA_ARRAY_DESCRIPTOR *d)
{
    FAIL_POINT("cuArrayCreate_v2");
    NEED_CTX();
    if (!h || !d || !d->Width) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d3 = {d->Width, d->Height, 1, d->Format, d->NumChannels, 0};
    uint64_t bytes = level_bytes(&d3, d->Width, d->Height, 1);
    CUresult rc = alloc_new(K_ARRAY, bytes, current->pdev, NULL, h, 1);
    (void)fail_check("cuArrayCreate_v2After"); /* FAKE_CUDA_SLEEP: still inside, the memory taken */
    return rc;
}

API CUresult cuArray3DCreate_v2(CUarray *h, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    FAIL_POINT("cuArray3DCreate_v2");
    NEED_CTX();
    if (!h || !d || !d->Width) return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = level_bytes(d, d->Width, d->Height, d->Depth);
    if (d->Flags & 0xc0) bytes = 0; /* sparse or deferred mapping: memory comes from cuMemMapArrayAsync */
    return alloc_new(K_ARRAY, bytes, current->pdev, NULL, h, 1);
}

API CUresult cuArrayCreate(CUarray *h, const CUDA_ARRAY_DESCRIPTOR_v1 *d)
{
    FAIL_POINT("cuArrayCreate");
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY_DESCRIPTOR d2 = {d->Width, d->Height, d->Format, d->NumChannels};
    return cuArrayCreate_v2(h, &d2);
}

API CUresult cuArray3DCreate(CUarray *h, const CUDA_ARRAY3D_DESCRIPTOR_v1 *d)
{
    FAIL_POINT("cuArray3DCreate");
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d2 = {d->Width, d->Height, d->Depth, d->Format, d->NumChannels, d->Flags};
    return cuArray3DCreate_v2(h, &d2);
}

API CUresult cuArrayDestroy(CUarray h)
{
    FAIL_POINT("cuArrayDestroy");
    CUresult rc = alloc_free(K_ARRAY, (uint64_t)(uintptr_t)h);
    (void)fail_check("cuArrayDestroyAfter"); /* FAKE_CUDA_SLEEP: still inside, the memory gone */
    return rc;
}

API CUresult cuMipmappedArrayCreate(CUmipmappedArray *h, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels)
{
    FAIL_POINT("cuMipmappedArrayCreate");
    NEED_CTX();
    if (!h || !d || !d->Width || !levels) return CUDA_ERROR_INVALID_VALUE;
    uint64_t bytes = 0;
    for (unsigned l = 0; l < levels; l++) {
        /* layers and cube faces do not shrink with the level, a 3D array's depth does */
        uint64_t w = d->Width >> l, hh = d->Height >> l, dd = d->Flags & 0x05 ? d->Depth : d->Depth >> l;
        bytes += level_bytes(d, w, hh, dd);
    }
    if (d->Flags & 0xc0) bytes = 0;
    return alloc_new(K_MIPMAP, bytes, current->pdev, NULL, h, 1);
}

API CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    FAIL_POINT("cuMipmappedArrayDestroy");
    return alloc_free(K_MIPMAP, (uint64_t)(uintptr_t)h);
}

/* Pools */
static struct fake_pool *current_pools[FAKE_MAX_DEVS]; /* cuDeviceSetMemPool's (NULL: the default one) */

API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice d)
{
    FAIL_POINT("cuDeviceGetMemPool");
    CHECK_DEV(d);
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    default_pools[visible[d]].pdev = visible[d];
    *pool = (CUmemoryPool)&default_pools[visible[d]];
    return CUDA_SUCCESS;
}

/* The device's current pool, the one cuMemAllocAsync takes its memory from ("cuDeviceGetMemPoolAfter":
 * FAKE_CUDA_SLEEP once it is read) */
API CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice d)
{
    CUresult rc = cuDeviceGetDefaultMemPool(pool, d);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&mu);
    if (current_pools[visible[d]]) *pool = (CUmemoryPool)current_pools[visible[d]];
    pthread_mutex_unlock(&mu);
    (void)fail_check("cuDeviceGetMemPoolAfter");
    return CUDA_SUCCESS;
}

/* A pool of the device's memory becomes its current pool (the default one: back to it) */
API CUresult cuDeviceSetMemPool(CUdevice d, CUmemoryPool pool)
{
    FAIL_POINT("cuDeviceSetMemPool");
    CHECK_DEV(d);
    struct fake_pool *p = (struct fake_pool *)pool;
    if (!p || p->destroyed || p->pdev != visible[d]) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    current_pools[visible[d]] = p == &default_pools[visible[d]] ? NULL : p;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* CUDA 13: a location's default pool for an allocation type (PINNED: a device's or the host's;
 * MANAGED: one pool whatever the location, its memory on the device that allocates first) */
API CUresult cuMemGetDefaultMemPool(CUmemoryPool *pool, CUmemLocation *loc, int type)
{
    NEED_INIT();
    FAIL_POINT("cuMemGetDefaultMemPool");
    if (!pool || !loc) return CUDA_ERROR_INVALID_VALUE;
    if (type == CU_MEM_ALLOCATION_TYPE_MANAGED) {
        *pool = (CUmemoryPool)&managed_pool;
        return CUDA_SUCCESS;
    }
    if (type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    if (loc->type == CU_MEM_LOCATION_TYPE_DEVICE) return cuDeviceGetDefaultMemPool(pool, loc->id);
    int domain, ordinal = location_ordinal(loc, &domain);
    if (ordinal == -2 || domain > 4) return CUDA_ERROR_INVALID_VALUE;
    if (domain) { /* a locality domain's (CUDA 13.4) */
        domain_pools[visible[ordinal]][domain - 1].pdev = visible[ordinal];
        *pool = (CUmemoryPool)&domain_pools[visible[ordinal]][domain - 1];
        return CUDA_SUCCESS;
    }
    *pool = (CUmemoryPool)&host_pool; /* HOST, HOST_NUMA, HOST_NUMA_CURRENT */
    return CUDA_SUCCESS;
}

/* A location's current pool: a device's (pinned) that cuDeviceSetMemPool or cuMemSetMemPool made
 * current, otherwise its default one */
API CUresult cuMemGetMemPool(CUmemoryPool *pool, CUmemLocation *loc, int type)
{
    if (loc && loc->type == CU_MEM_LOCATION_TYPE_DEVICE && type == CU_MEM_ALLOCATION_TYPE_PINNED) {
        NEED_INIT();
        return cuDeviceGetMemPool(pool, loc->id);
    }
    return cuMemGetDefaultMemPool(pool, loc, type);
}

/* CUDA 13: a device's current pool for pinned memory, as cuDeviceSetMemPool (no other location here) */
API CUresult cuMemSetMemPool(CUmemLocation *loc, int type, CUmemoryPool pool)
{
    FAIL_POINT("cuMemSetMemPool");
    NEED_INIT();
    if (!loc) return CUDA_ERROR_INVALID_VALUE;
    if (loc->type != CU_MEM_LOCATION_TYPE_DEVICE || type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_NOT_SUPPORTED;
    return cuDeviceSetMemPool(loc->id, pool);
}

API CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *props)
{
    NEED_INIT();
    if (!pool || !props) return CUDA_ERROR_INVALID_VALUE;
    int managed = *(const int *)props == CU_MEM_ALLOCATION_TYPE_MANAGED;
    const CUmemLocation *loc = (const CUmemLocation *)((const char *)props + 8);
    int domain, ordinal = location_ordinal(loc, &domain); /* a device's or a locality domain's */
    int host = ordinal == -1 || loc->type == CU_MEM_LOCATION_TYPE_NONE; /* CU_MEM_LOCATION_TYPE_HOST*: pinned host memory */
    if (!host && ordinal < 0) return CUDA_ERROR_INVALID_DEVICE;
    struct fake_pool *p = reuse_or_alloc((void **)&freed_pool, sizeof(*p)); /* a destroyed pool's handle, reused */
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    p->pdev = !host ? visible[ordinal] : managed ? FAKE_POOL_FOLLOWS : -1;
    *pool = (CUmemoryPool)p;
    pthread_mutex_lock(&mu);
    if (nuser_pools < 64) user_pools[nuser_pools++] = p;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    FAIL_POINT("cuMemPoolDestroy");
    struct fake_pool *p = (struct fake_pool *)pool;
    for (int d = 0; p && d < FAKE_MAX_DEVS; d++) /* a device's current pool destroyed: its default one is */
        if (current_pools[d] == p) current_pools[d] = NULL;
    if (!p || p->destroyed) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    p->destroyed = 1;
    pool_give(p, 0); /* all of it at once, now or when its last allocation is freed */
    if (!p->used && !p->pending && getenv("FAKE_CUDA_HANDLE_REUSE")) { /* else the driver keeps it */
        for (int i = 0; i < nuser_pools; i++)
            if (user_pools[i] == p) user_pools[i] = user_pools[--nuser_pools];
        free(freed_pool);
        freed_pool = p; /* gone: the next cuMemPoolCreate gets its handle */
    }
    pthread_mutex_unlock(&mu);
    (void)fail_check("cuMemPoolDestroyAfter"); /* FAKE_CUDA_SLEEP: still inside, the handle free */
    return CUDA_SUCCESS;
}

API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    struct fake_pool *p = (struct fake_pool *)pool;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    uint64_t floor = (p->used + p->pending + pool_chunk - 1) / pool_chunk * pool_chunk; /* outstanding */
    uint64_t k = (keep + pool_chunk - 1) / pool_chunk * pool_chunk;
    uint64_t target = floor > k ? floor : k;
    if (target < p->reserved) {
        phys_sub(p->pdev, p->reserved - target);
        p->reserved = target;
    }
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    FAIL_POINT("cuMemPoolGetAttribute");
    api_callback("cuMemPoolGetAttribute");
    struct fake_pool *p = (struct fake_pool *)pool;
    if (!p || !value || p->destroyed) return CUDA_ERROR_INVALID_VALUE;
    if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
        *(cuuint64_t *)value = p->reserved;
    else if (attr == CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        *(cuuint64_t *)value = p->used + p->pending;
    else
        return CUDA_ERROR_NOT_SUPPORTED;
    return CUDA_SUCCESS;
}

#define FAKE_MEMPOOL_ATTR_RELEASE_THRESHOLD 4
static int any_release_set; /* some pool has a release threshold of the program's */

/* Only the release threshold is modelled (given back at synchronisations); the reuse
 * policies answer CUDA_ERROR_NOT_SUPPORTED. */
API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    FAIL_POINT("cuMemPoolSetAttribute");
    struct fake_pool *p = (struct fake_pool *)pool;
    if (!p || !value || p->destroyed) return CUDA_ERROR_INVALID_VALUE;
    if (attr != FAKE_MEMPOOL_ATTR_RELEASE_THRESHOLD) return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&mu);
    p->release_threshold = *(cuuint64_t *)value;
    p->release_set = 1;
    any_release_set = 1;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* The stream a call on s uses (fakelaunch.h): the key of a pending free, the per-thread default
 * stream being each thread's own */
struct fake_stream;
static struct fake_stream *stream_of(CUstream s, int ptsz);

/* FAKE_CUDA_POOL_PENDING (mu held): what stream s freed is reusable on s */
static void pool_reuse_pending(struct fake_pool *p, CUstream s)
{
    s = (CUstream)stream_of(s, 0);
    for (int i = 0; i < 8; i++)
        if (p->pend_bytes[i] && p->pend_stream[i] == s) {
            p->pending -= p->pend_bytes[i];
            p->pend_bytes[i] = 0;
        }
}

/* FAKE_CUDA_POOL_PENDING (mu held): a pool allocation of `bytes` freed on stream s (before
 * the free gives it back, so that a destroyed pool keeps its memory for it); -1 if its
 * free is complete at once (no room in the table) */
static int pool_pend(struct fake_pool *p, CUstream s, uint64_t bytes)
{
    int at = -1;
    s = (CUstream)stream_of(s, 0);
    for (int i = 0; i < 8 && at < 0; i++)
        if (p->pend_bytes[i] && p->pend_stream[i] == s) at = i;
    for (int i = 0; i < 8 && at < 0; i++)
        if (!p->pend_bytes[i]) at = i;
    if (at < 0) return -1;
    p->pend_stream[at] = s;
    p->pend_bytes[at] += bytes;
    p->pending += bytes;
    return at;
}

static CUresult pool_alloc(CUdeviceptr *dptr, size_t bytes, struct fake_pool *p, CUstream s)
{
    if (!dptr || !bytes || !p || p->destroyed) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    if (p->pdev == FAKE_POOL_FOLLOWS) p->pdev = current->pdev;
    pool_reuse_pending(p, s);
    CUresult rc = CUDA_SUCCESS;
    if (p->used + p->pending + bytes > p->reserved) {
        uint64_t target = (p->used + p->pending + bytes + pool_chunk - 1) / pool_chunk * pool_chunk;
        rc = phys_add(p->pdev, target - p->reserved);
        if (rc == CUDA_SUCCESS) p->reserved = target;
    }
    if (rc == CUDA_SUCCESS) p->used += bytes;
    pthread_mutex_unlock(&mu);
    if (rc != CUDA_SUCCESS) return rc;
    rc = alloc_new(K_POOL, bytes, p->pdev, p, dptr, 0);
    if (rc != CUDA_SUCCESS) {
        pthread_mutex_lock(&mu);
        p->used -= bytes;
        pthread_mutex_unlock(&mu);
    }
    return rc;
}

API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s)
{
    FAIL_POINT("cuMemAllocFromPoolAsync");
    NEED_CTX();
    CUresult rc = pool_alloc(dptr, bytes, (struct fake_pool *)pool, s);
    (void)fail_check("cuMemAllocFromPoolAsyncAfter"); /* FAKE_CUDA_SLEEP: still inside, the pool grown */
    return rc;
}

API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s)
{
    return cuMemAllocFromPoolAsync(dptr, bytes, pool, s ? s : CU_STREAM_PER_THREAD);
}

/* fakegraph.h: on a capturing stream these make graph nodes instead */
static int fake_capture_alloc(CUstream s, int ptsz, CUdeviceptr *dptr, size_t bytes, CUresult *rc);
static int fake_capture_free(CUstream s, int ptsz, CUresult *rc);
static int fake_graph_free_live(CUdeviceptr dptr);

static struct fake_ctx *stream_ctx(CUstream s); /* fakelaunch.h */

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytes, CUstream s, int ptsz)
{
    FAIL_POINT("cuMemAllocAsync");
    NEED_CTX();
    CUresult rc;
    if (fake_capture_alloc(s, ptsz, dptr, bytes, &rc)) return rc;
    int pdev = stream_ctx(s)->pdev; /* as the driver: the current pool of the stream's device */
    default_pools[pdev].pdev = pdev;
    pthread_mutex_lock(&mu);
    struct fake_pool *cur = current_pools[pdev] ? current_pools[pdev] : &default_pools[pdev];
    pthread_mutex_unlock(&mu);
    rc = pool_alloc(dptr, bytes, cur, ptsz && !s ? CU_STREAM_PER_THREAD : s);
    (void)fail_check("cuMemAllocAsyncAfter"); /* FAKE_CUDA_SLEEP: still inside, the pool grown */
    return rc;
}

API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s)
{
    return alloc_async(dptr, bytes, s, 0);
}

API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytes, CUstream s)
{
    return alloc_async(dptr, bytes, s, 1);
}

static CUresult free_async(CUdeviceptr dptr, CUstream s, int ptsz)
{
    FAIL_POINT("cuMemFreeAsync");
    CUresult rc;
    if (fake_capture_free(s, ptsz, &rc)) return rc;
    if (fake_graph_free_live(dptr)) return CUDA_SUCCESS;
    static int pend = -1;
    if (pend < 0) pend = getenv("FAKE_CUDA_POOL_PENDING") != NULL;
    struct fake_pool *from = NULL;
    uint64_t bytes = 0;
    int at = -1;
    if (pend) {
        pthread_mutex_lock(&mu);
        struct fake_alloc *a = alloc_find(K_POOL, dptr);
        if (a) from = a->pool, bytes = a->size;
        if (from) at = pool_pend(from, ptsz && !s ? CU_STREAM_PER_THREAD : s, bytes);
        struct fake_alloc *plain = from ? NULL : alloc_find(K_DPTR, dptr);
        if (plain) { /* its memory stays until the free completes */
            plain->kind = K_PEND;
            plain->pend_stream = (CUstream)stream_of(ptsz && !s ? CU_STREAM_PER_THREAD : s, 0);
        }
        pthread_mutex_unlock(&mu);
        if (plain) {
            (void)fail_check("cuMemFreeAsyncAfter");
            return CUDA_SUCCESS;
        }
    }
    rc = alloc_free(K_DPTR, dptr);
    if (rc != CUDA_SUCCESS && at >= 0) { /* not freed after all */
        pthread_mutex_lock(&mu);
        from->pend_bytes[at] -= bytes;
        from->pending -= bytes;
        pthread_mutex_unlock(&mu);
    }
    (void)fail_check("cuMemFreeAsyncAfter"); /* FAKE_CUDA_SLEEP: still inside, the memory gone */
    return rc;
}

API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s)
{
    return free_async(dptr, s, 0);
}

API CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream s)
{
    return free_async(dptr, s, 1);
}

/* A pool at a synchronisation: with FAKE_CUDA_POOL_RELEASE=1 it trims to what it uses, with
 * a release threshold the program set to that threshold (or what it uses, if more). */
static void pool_release(struct fake_pool *p, int on)
{
    pthread_mutex_lock(&mu);
    int set = p->release_set && !p->destroyed;
    uint64_t keep = p->release_threshold;
    pthread_mutex_unlock(&mu);
    if (on || set) cuMemPoolTrimTo((CUmemoryPool)p, on ? 0 : keep);
}

/* FAKE_CUDA_POOL_PENDING (mu held): the pool's frees on stream `only` (NULL: on every stream) are
 * complete; a destroyed pool whose last allocation went gives back its memory */
static void pool_complete(struct fake_pool *p, const struct fake_stream *only)
{
    for (int i = 0; i < 8; i++)
        if (p->pend_bytes[i] && (!only || p->pend_stream[i] == (CUstream)only)) {
            p->pending -= p->pend_bytes[i];
            p->pend_bytes[i] = 0;
        }
    if (p->destroyed && !p->used && !p->pending && p->reserved) {
        phys_sub(p->pdev, p->reserved);
        p->reserved = 0;
    }
}

/* FAKE_CUDA_POOL_PENDING (mu held): the cuMemAlloc pointers freed with cuMemFreeAsync on stream
 * `only` (NULL: on any stream) give back their memory */
static void plain_complete(const struct fake_stream *only)
{
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].kind == K_PEND && (!only || allocs[i].pend_stream == (CUstream)only)) {
            allocs[i].kind = K_DPTR;
            alloc_give(&allocs[i]);
            memset(&allocs[i], 0, sizeof(allocs[i]));
        }
}

/* FAKE_CUDA_POOL_PENDING (mu held): every pool's frees complete (a context synchronised or gone;
 * the fake does not tell the streams of one context from another's) */
static void pools_complete_all(void)
{
    plain_complete(NULL);
    for (int d = 0; d < FAKE_MAX_DEVS; d++) pool_complete(&default_pools[d], NULL);
    pool_complete(&host_pool, NULL);
    pool_complete(&managed_pool, NULL);
    for (int i = 0; i < nuser_pools; i++) pool_complete(user_pools[i], NULL);
}

/* A synchronisation: of stream `only` (its frees are observed complete on the host), or of a
 * context or an event (NULL: every pool's frees, whatever stream they were made on) */
static void pools_release_at_sync(const struct fake_stream *only)
{
    static int on = -1;
    if (on < 0) on = getenv("FAKE_CUDA_POOL_RELEASE") != NULL;
    pthread_mutex_lock(&mu);
    if (only) {
        for (int d = 0; d < FAKE_MAX_DEVS; d++) pool_complete(&default_pools[d], only); /* observed on the host */
        pool_complete(&host_pool, only);
        pool_complete(&managed_pool, only);
        for (int i = 0; i < nuser_pools; i++) pool_complete(user_pools[i], only);
        plain_complete(only);
    } else {
        pools_complete_all();
    }
    int any = any_release_set, n = nuser_pools;
    pthread_mutex_unlock(&mu);
    if (!on && !any) return;
    for (int d = 0; d < FAKE_MAX_DEVS; d++) pool_release(&default_pools[d], on);
    pool_release(&host_pool, on);
    pool_release(&managed_pool, on);
    for (int i = 0; i < n; i++)
        if (!user_pools[i]->destroyed) pool_release(user_pools[i], on);
}

#include "fakelaunch.h"
