/*
 * fakenvml.c - a fake libnvidia-ml.so.1: the machine's devices from
 * FAKE_CUDA_DEVICES (all of them, in order, ignoring CUDA_VISIBLE_DEVICES as
 * NVML does), with used memory = FAKE_NVML_BASE_USED + what the live
 * processes hold according to FAKE_CUDA_STATE, a total FAKE_NVML_TOTAL_EXTRA
 * above the driver's (default 0) and FAKE_NVML_RESERVED of it reserved by the
 * driver (default 0; the H200 reserves what its NVML total has above CUDA's).
 */
#include "fakestate.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cuda_abi.h"

#define API __attribute__((visibility("default")))

static struct fake_dev devs[FAKE_MAX_DEVS];
static int ndevs = -1;
static int refs;
static void utilisation_start(void);

/* FAKE_NVML_INIT_ERROR=<code>: nvmlInit fails with it (9 DRIVER_NOT_LOADED; 18
 * LIB_RM_VERSION_MISMATCH, the host's driver upgraded under running containers). */
API nvmlReturn_t nvmlInit_v2(void)
{
    const char *fail = getenv("FAKE_NVML_INIT_ERROR");
    if (fail && *fail) return (nvmlReturn_t)atoi(fail);
    if (ndevs < 0) ndevs = fake_devices(devs);
    if (!refs) utilisation_start();
    refs++;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return nvmlInit_v2(); }

API nvmlReturn_t nvmlShutdown(void)
{
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    refs--;
    return NVML_SUCCESS;
}

API const char *nvmlErrorString(nvmlReturn_t rc)
{
    return rc == NVML_SUCCESS ? "Success" : "Fake NVML error";
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int len)
{
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (!version || !len) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(version, len, "%s", "580.00.00-fake");
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n)
{
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (!n) return NVML_ERROR_INVALID_ARGUMENT;
    *n = (unsigned)ndevs;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *n) { return nvmlDeviceGetCount_v2(n); }

/* FAKE_NVML_LOST="UUID[,UUID]": these devices fell off the bus (NVML_ERROR_GPU_IS_LOST) while
 * CUDA still lists them. */
static int fake_lost(const char *uuid)
{
    const char *lost = getenv("FAKE_NVML_LOST");
    size_t len = strlen(uuid);
    for (const char *p = lost; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
        if (!strncmp(p, uuid, len) && (p[len] == ',' || p[len] == '\0')) return 1;
    return 0;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (!d || i >= (unsigned)ndevs) return NVML_ERROR_INVALID_ARGUMENT;
    if (fake_lost(devs[i].uuid)) return 15; /* NVML_ERROR_GPU_IS_LOST */
    *d = (nvmlDevice_t)&devs[i];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d)
{
    return nvmlDeviceGetHandleByIndex_v2(i, d);
}

static int index_of(nvmlDevice_t d)
{
    for (int i = 0; i < ndevs; i++)
        if ((nvmlDevice_t)&devs[i] == d) return i;
    return -1;
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *d)
{
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !d) return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < ndevs; i++)
        if (!strcmp(devs[i].uuid, uuid)) {
            if (fake_lost(uuid)) return 15;
            *d = (nvmlDevice_t)&devs[i];
            return NVML_SUCCESS;
        }
    return 6; /* NVML_ERROR_NOT_FOUND */
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int len)
{
    int i = index_of(d);
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !uuid) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(devs[i].uuid) >= len) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    strcpy(uuid, devs[i].uuid);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index)
{
    int i = index_of(d);
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned)i;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int len)
{
    int i = index_of(d);
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !name || !len) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(name, len, "Fake GPU %d", i);
    return NVML_SUCCESS;
}

/* The device's memory as the driver's NVML gives it: FAKE_NVML_RESERVED (default 0) is the
 * driver's and firmware's reservation, which v2 reports apart (total = reserved + used + free, as
 * nvidia-smi -q prints it) and v1 counts in used (used + free = total: "Sum of Reserved and
 * Allocated device memory") */
static nvmlReturn_t usage(nvmlDevice_t d, unsigned long long *total, unsigned long long *reserved,
                          unsigned long long *used)
{
    int i = index_of(d);
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (i < 0) return NVML_ERROR_INVALID_ARGUMENT;
    const char *base = getenv("FAKE_NVML_BASE_USED"), *extra = getenv("FAKE_NVML_TOTAL_EXTRA");
    const char *rsv = getenv("FAKE_NVML_RESERVED");
    *total = devs[i].total + (extra ? fake_size(extra) : 0); /* the H200: NVML 615 MiB more than CUDA */
    *reserved = rsv ? fake_size(rsv) : 0;
    if (*reserved > *total) *reserved = *total;
    *used = fake_phys_used(i) + (base ? fake_size(base) : 0);
    if (*used > *total - *reserved) *used = *total - *reserved;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    unsigned long long reserved = 0;
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = usage(d, &m->total, &reserved, &m->used);
    if (rc == NVML_SUCCESS) {
        m->used += reserved;
        m->free = m->total - m->used;
    }
    return rc;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != ((2u << 24) | (unsigned)sizeof(nvmlMemory_v2_t))) return 25; /* VERSION_MISMATCH */
    nvmlReturn_t rc = usage(d, &m->total, &m->reserved, &m->used);
    if (rc == NVML_SUCCESS) m->free = m->total - m->reserved - m->used;
    return rc;
}

/* Processes holding memory on a device, as the driver sees them (pids shifted by
 * FAKE_NVML_PID_OFFSET to play a container's pid namespace).  FAKE_NVML_PROC_MEM=0 lists each
 * with 0 bytes: a driver that gives the list's pids in the caller's namespace but looks their
 * memory up by the host's (R560 in a container listed `mem: 0`).  FAKE_NVML_PID_AS_MINE=<pid>
 * lists that process under the caller's own getpid(): another namespace's pid that happens to
 * equal ours (a host pid is not a container's). */
static unsigned long process_queries, device_queries[FAKE_MAX_DEVS];

/* Test-only: how many process-list queries this process made. */
API unsigned long fake_nvml_process_queries(void)
{
    return __atomic_load_n(&process_queries, __ATOMIC_RELAXED);
}

/* Test-only: how many of them were of device `index` (NVML's order) */
API unsigned long fake_nvml_device_queries(unsigned index)
{
    return index < FAKE_MAX_DEVS ? __atomic_load_n(&device_queries[index], __ATOMIC_RELAXED) : 0;
}

/* FAKE_NVML_R535 (build/fake/r535/): a driver of the R535 or R545 branch (CUDA 12.2, 12.3).  Its
 * _v3 fills the list with nvmlProcessInfo_v3_t, 8 bytes longer than the v2 entries (nvml.h 12.2:
 * usedGpuCcProtectedMemory; pynvml PR #48 on 535.54.03, go-nvml issue #75), and it exports
 * nvmlDeviceGetConfComputeMemSizeInfo (new in R535) but not yet
 * nvmlDeviceGetRunningProcessDetailList (R550, which took that struct over and gave _v3 the v2
 * entries again).  The default fake is a later driver: both symbols, v2 entries. */
#ifdef FAKE_NVML_R535
typedef struct {
    nvmlProcessInfo_t v2;
    unsigned long long usedGpuCcProtectedMemory;
} fake_proc_info_t;
#else
typedef nvmlProcessInfo_t fake_proc_info_t;

API nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t d, void *plist)
{
    (void)d, (void)plist;
    return NVML_ERROR_NOT_SUPPORTED;
}
#endif

API nvmlReturn_t nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t d, void *info)
{
    (void)d, (void)info;
    return NVML_ERROR_NOT_SUPPORTED;
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                         fake_proc_info_t *list)
{
    int i = index_of(d);
    __atomic_add_fetch(&process_queries, 1, __ATOMIC_RELAXED);
    if (i >= 0) __atomic_add_fetch(&device_queries[i], 1, __ATOMIC_RELAXED);
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (i < 0 || !count) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_phys *m = fake_phys_map();
    const char *off = getenv("FAKE_NVML_PID_OFFSET"), *mem = getenv("FAKE_NVML_PROC_MEM");
    const char *as_mine = getenv("FAKE_NVML_PID_AS_MINE");
    int zero_mem = mem && !strcmp(mem, "0");
    unsigned n = 0;
    for (int p = 0; m && p < FAKE_MAX_PROCS; p++) {
        int32_t pid = m->procs[p].pid;
        uint64_t used = m->procs[p].used[i];
        if (pid <= 0 || !used || kill(pid, 0) != 0) continue;
        if (list && n < *count) {
            nvmlProcessInfo_t *info = (nvmlProcessInfo_t *)&list[n];
            memset(&list[n], 0, sizeof(list[n]));
            info->pid = (unsigned)pid + (unsigned)(off ? atoi(off) : 0);
            if (as_mine && atoi(as_mine) == pid) info->pid = (unsigned)getpid();
            info->usedGpuMemory = zero_mem ? 0 : used;
            info->gpuInstanceId = info->computeInstanceId = 0xffffffffu;
        }
        n++;
    }
    nvmlReturn_t rc = n > *count ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    *count = n;
    return rc;
}

/* ---- power and utilisation ------------------------------------------------
 * Off (NVML_ERROR_NOT_SUPPORTED) unless FAKE_NVML_POWER_LIMIT_MW is set (utilisation also
 * with a co-tenant, a shared GPU, or FAKE_NVML_UTIL_RATES=1).  Then:
 * utilisation = FAKE_NVML_UTIL (%) if set, else the share of wall time the
 * fake driver ran this process's kernels since the previous query (windows of
 * at least 100 ms, as a real GPU's sample period); board power =
 * FAKE_NVML_IDLE_MW + utilisation x FAKE_NVML_DYNAMIC_MW (the kernels' draw at
 * full duty, at whatever clock the test plays), at most the limit;
 * FAKE_NVML_POWER_MW overrides it.  FAKE_NVML_UTIL_SLEEP_MS: each utilisation query takes that
 * long (a sampler whose rounds come that much later, as on a loaded machine). */
typedef uint64_t (*fake_kernel_ns_fn)(void);
static uint64_t win_t0, win_k0;
static unsigned win_util;
static unsigned proc_device; /* the device's utilisation in the last per-process sample period */

static unsigned env_uint(const char *name, unsigned dflt)
{
    const char *v = getenv(name);
    return v && *v ? (unsigned)strtoul(v, NULL, 10) : dflt;
}

static int power_on(nvmlDevice_t d)
{
    return refs && index_of(d) >= 0 && env_uint("FAKE_NVML_POWER_LIMIT_MW", 0) > 0;
}

static int cotenant(void)
{
    const char *v = getenv("FAKE_GPU_COTENANT_SLICE_US");
    if (!v || !*v) return 0;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    int (*active)(void) = cuda ? (int (*)(void))dlsym(cuda, "fake_cuda_cotenant") : NULL;
    if (cuda) dlclose(cuda);
    return active ? active() : 1;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Kernel time the fake driver ran for this process so far (0 without it): work counts as it
 * runs, not as it is queued, as the real NVML's figures do. */
static uint64_t kernel_time(void)
{
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    fake_kernel_ns_fn kernel_ns = cuda ? (fake_kernel_ns_fn)dlsym(cuda, "fake_cuda_kernel_run_ns") : NULL;
    if (cuda) dlclose(cuda);
    return kernel_ns ? kernel_ns() : 0;
}

/* A real GPU's figure is there at the first query (the last sample period's): the first
 * window here starts when NVML is initialised, not at that query (which read 0 %) */
static void utilisation_start(void)
{
    if (win_t0) return;
    win_t0 = mono_ns();
    win_k0 = kernel_time();
}

static unsigned utilisation(void)
{
    const char *fixed = getenv("FAKE_NVML_UTIL");
    if (fixed && *fixed) return env_uint("FAKE_NVML_UTIL", 0);
    if (cotenant()) return 100; /* the other process keeps the GPU busy */
    if (fake_gpu_shared() && fake_phys_map()) return proc_device; /* every process's share, summed */
    uint64_t t = mono_ns(), k = kernel_time();
    if (win_t0 && t - win_t0 < 100000000ull) return win_util;
    if (win_t0) {
        uint64_t busy = k - win_k0, pct = busy * 100 / (t - win_t0);
        win_util = pct > 100 ? 100 : (unsigned)pct;
    }
    win_t0 = t;
    win_k0 = k;
    return win_util;
}

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    if (!power_on(d) && !(refs && index_of(d) >= 0 && (cotenant() || fake_gpu_shared() || env_uint("FAKE_NVML_UTIL_RATES", 0))))
        return NVML_ERROR_NOT_SUPPORTED;
    if (!u) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned late = env_uint("FAKE_NVML_UTIL_SLEEP_MS", 0);
    if (late) {
        struct timespec ts = {(time_t)(late / 1000), (long)(late % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    u->gpu = utilisation();
    u->memory = u->gpu / 2;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned int *limit)
{
    if (!power_on(d)) return NVML_ERROR_NOT_SUPPORTED;
    if (!limit) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = env_uint("FAKE_NVML_POWER_LIMIT_MW", 0);
    return NVML_SUCCESS;
}

/* With the clock model (FAKE_GPU_EXPONENT): idle + the kernels' dynamic energy over the last
 * FAKE_NVML_POWER_AVG_MS (default 1000) up to the reading, as nvmlDeviceGetPowerUsage gives on
 * Ampere (but GA100) and newer GPUs, the H200 included: "power averaged over 1 sec interval"
 * (NVML API reference; instantaneous power is NVML_FI_DEV_POWER_INSTANT).  The window starts at
 * the newest earlier reading at least that old (readings 100 ms apart at least; before the
 * first ones, the oldest).  FAKE_NVML_POWER_AVG_MS=0: the fake's first model, the average since
 * the previous reading.  Otherwise idle + utilisation x FAKE_NVML_DYNAMIC_MW. */
#define ENERGY_SNAPS 64
static double energy_t[ENERGY_SNAPS], energy_e[ENERGY_SNAPS];
static unsigned energy_n; /* readings taken; the last ENERGY_SNAPS kept */
static unsigned energy_last;

static unsigned clock_model_power(unsigned idle, unsigned limit)
{
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    double (*energy)(void) = cuda ? (double (*)(void))dlsym(cuda, "fake_cuda_energy") : NULL;
    if (cuda) dlclose(cuda);
    if (!energy) return idle;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double t = (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec, e = energy();
    unsigned prev = (energy_n + ENERGY_SNAPS - 1) % ENERGY_SNAPS;
    if (energy_n && t - energy_t[prev] < 1e8) return energy_last;
    double window = env_uint("FAKE_NVML_POWER_AVG_MS", 1000) * 1e6;
    double p = idle;
    if (energy_n) {
        unsigned kept = energy_n < ENERGY_SNAPS ? energy_n : ENERGY_SNAPS, from = prev;
        /* the newest earlier reading at least `window` old (the previous one with no window) */
        for (unsigned k = 0; window > 0 && k < kept; k++) {
            from = (energy_n + ENERGY_SNAPS - 1 - k) % ENERGY_SNAPS;
            if (t - energy_t[from] >= window) break;
        }
        p = idle + (e - energy_e[from]) / (t - energy_t[from]);
    }
    energy_t[energy_n % ENERGY_SNAPS] = t;
    energy_e[energy_n % ENERGY_SNAPS] = e;
    energy_n++;
    energy_last = p < limit ? (unsigned)p : limit;
    return energy_last;
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *power)
{
    if (!power_on(d)) return NVML_ERROR_NOT_SUPPORTED;
    if (!power) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned limit = env_uint("FAKE_NVML_POWER_LIMIT_MW", 0), idle = env_uint("FAKE_NVML_IDLE_MW", limit / 7);
    const char *exponent = getenv("FAKE_GPU_EXPONENT");
    uint64_t p = exponent && *exponent ? clock_model_power(idle, limit)
                                       : idle + (uint64_t)win_util * env_uint("FAKE_NVML_DYNAMIC_MW", 0) / 100;
    *power = env_uint("FAKE_NVML_POWER_MW", p < limit ? (unsigned)p : limit);
    return NVML_SUCCESS;
}

/* ---- per-process utilisation ----------------------------------------------
 * One sample per process that ran in the last sample period (at least 100 ms,
 * taken when asked), with the share of the period its kernels ran:
 *  - with FAKE_GPU_SHARED, every process of the state file (from the kernel
 *    time each queued; the device's utilisation is their sum);
 *  - else this process (from the fake driver's kernel time) and, with a
 *    co-tenant (FAKE_GPU_COTENANT_SLICE_US), the rest for pid
 *    FAKE_GPU_COTENANT_PID (default 999999), split evenly among the next
 *    pids when there are FAKE_GPU_COTENANTS of them; FAKE_GPU_COTENANT_SELF_PCT
 *    adds a sample with that share under the caller's own getpid(), unshifted:
 *    another namespace's process whose host pid equals ours, running little.
 * Pids are shifted by FAKE_NVML_PID_OFFSET.  FAKE_NVML_PROC_UTIL plays other
 * drivers: "off" (not supported), "mps" (everything attributed to the
 * co-tenant's pid, as an MPS server would be), "device" (every process
 * reported at the device's utilisation: not a split of time).  And:
 * FAKE_NVML_PROC_PERIOD_MS, the sample period (default 100; a query within
 * it after the last sample finds nothing new: NVML_ERROR_NOT_FOUND);
 * FAKE_NVML_PROC_BIAS, this process's share as reported, in % of the true one
 * (default 100); FAKE_NVML_PROC_ROOM, the buffer entries the call insists on
 * (some drivers always ask for 100); FAKE_NVML_PROC_FAIL_AFTER_MS, the query
 * fails (NVML_ERROR_UNKNOWN) from that long after the first one on;
 * FAKE_NVML_PROC_GARBAGE=1, every reply also lists rows of garbage, whatever the
 * lastSeenTimeStamp (see proc_garbage). */
#define PROC_SAMPLES 16
static uint64_t proc_t0, proc_k0, proc_stamp;
static uint64_t proc_prev[FAKE_MAX_PROCS];
static int32_t proc_prev_pid[FAKE_MAX_PROCS];
static nvmlProcessUtilizationSample_t proc_s[PROC_SAMPLES];
static unsigned proc_n;

static void proc_sample(unsigned pid, unsigned pct)
{
    if (pct && proc_n < PROC_SAMPLES) proc_s[proc_n++] = (nvmlProcessUtilizationSample_t){pid, proc_stamp, pct, pct / 2, 0, 0};
}

static unsigned pct_of(uint64_t busy, uint64_t span)
{
    uint64_t pct = busy * 100 / span;
    return pct > 100 ? 100 : (unsigned)pct;
}

/* A new sample period: every process's share of it. */
static void proc_window(uint64_t t, uint64_t k)
{
    const char *mode = getenv("FAKE_NVML_PROC_UTIL"), *off = getenv("FAKE_NVML_PID_OFFSET");
    unsigned shift = (unsigned)(off ? atoi(off) : 0), other = env_uint("FAKE_GPU_COTENANT_PID", 999999);
    struct fake_phys *m = fake_gpu_shared() ? fake_phys_map() : NULL;
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    uint64_t span = t - proc_t0;
    proc_stamp = (uint64_t)rt.tv_sec * 1000000ull + (uint64_t)rt.tv_nsec / 1000;
    proc_n = 0;
    unsigned mine = pct_of(k - proc_k0, span), theirs = 0, total = 0;
    mine = mine * env_uint("FAKE_NVML_PROC_BIAS", 100) / 100;
    if (m) {
        for (int i = 0; i < FAKE_MAX_PROCS; i++) {
            int32_t pid = __atomic_load_n(&m->procs[i].pid, __ATOMIC_ACQUIRE);
            uint64_t kn = __atomic_load_n(&m->procs[i].kernel_ns, __ATOMIC_RELAXED);
            unsigned pct = pid > 0 && pid == proc_prev_pid[i] && kn >= proc_prev[i] ? pct_of(kn - proc_prev[i], span) : 0;
            proc_prev[i] = kn;
            proc_prev_pid[i] = pid;
            if (pid <= 0 || !pct) continue;
            total += pct;
            proc_sample((unsigned)pid + shift, pct);
        }
        proc_device = total > 100 ? 100 : total;
        return;
    }
    if (cotenant()) theirs = 100 - mine;
    if (mode && !strcmp(mode, "mps")) {
        theirs += mine;
        mine = 0;
    } else if (mode && !strcmp(mode, "device")) {
        mine = mine ? 100 : 0;
        theirs = cotenant() ? mine : 0;
    }
    proc_sample((unsigned)getpid() + shift, mine);
    unsigned n = env_uint("FAKE_GPU_COTENANTS", 1);
    if (!n) n = 1;
    for (unsigned i = 0; i < n; i++) proc_sample(other + i, theirs / n);
    proc_sample((unsigned)getpid(), env_uint("FAKE_GPU_COTENANT_SELF_PCT", 0));
    proc_device = cotenant() ? 100 : mine;
}

/* A sample period ends when asked at least FAKE_NVML_PROC_PERIOD_MS after the last one ended;
 * 0 when the queries fail (FAKE_NVML_PROC_FAIL_AFTER_MS). */
static int proc_advance(void)
{
    uint64_t t = mono_ns(), k = kernel_time();
    static uint64_t first;
    if (!first) first = t;
    unsigned fail_after = env_uint("FAKE_NVML_PROC_FAIL_AFTER_MS", 0);
    if (fail_after && t - first >= fail_after * 1000000ull) return 0;
    if (!proc_t0 || t - proc_t0 >= env_uint("FAKE_NVML_PROC_PERIOD_MS", 100) * 1000000ull) {
        if (proc_t0) proc_window(t, k);
        proc_t0 = t;
        proc_k0 = k;
    }
    return 1;
}

/* nvmlDeviceGetSamples for NVML_GPU_UTILIZATION_SAMPLES (1): the device's utilisation in the
 * last sample period (the one the per-process samples cover), as an unsigned int; other kinds
 * are not supported.  FAKE_NVML_DEVICE_SAMPLES=off plays a driver without the buffer. */
typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
} fake_nvml_value_t;
typedef struct {
    unsigned long long timeStamp;
    fake_nvml_value_t sampleValue;
} fake_nvml_sample_t;

API nvmlReturn_t nvmlDeviceGetSamples(nvmlDevice_t d, int type, unsigned long long last_seen, int *value_type,
                                      unsigned int *count, fake_nvml_sample_t *out)
{
    const char *mode = getenv("FAKE_NVML_DEVICE_SAMPLES");
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (index_of(d) < 0 || !count || !value_type) return NVML_ERROR_INVALID_ARGUMENT;
    if (type != 1 || (mode && !strcmp(mode, "off"))) return NVML_ERROR_NOT_SUPPORTED;
    if (!proc_advance()) return (nvmlReturn_t)999; /* NVML_ERROR_UNKNOWN */
    unsigned n = proc_stamp > last_seen ? 1 : 0;
    *value_type = 1; /* NVML_VALUE_TYPE_UNSIGNED_INT */
    if (!out) { /* the size to allocate */
        *count = n;
        return NVML_SUCCESS;
    }
    if (!n) return NVML_ERROR_NOT_FOUND;
    if (*count < n) return NVML_ERROR_INSUFFICIENT_SIZE;
    out[0].timeStamp = proc_stamp;
    out[0].sampleValue.ullVal = 0;
    out[0].sampleValue.uiVal = proc_device;
    *count = n;
    return NVML_SUCCESS;
}

/* The real NVML asks the kernel driver for per-process samples with one control call whose
 * parameters (NV2080_CTRL_PERF_GET_GPUMON_PERFMON_UTIL_SAMPLES_V2: 72 samples of 6 engines,
 * 55,888 bytes) it keeps on the caller's stack: a thread with a 64 KiB stack died of it on an
 * H200 (driver 580.159.04).  The fake takes as much stack (FAKE_NVML_STACK_BYTES, default
 * that size; 0 for none), touching every page, so a caller's thread too small for the real
 * one faults here too. */
static __attribute__((noinline)) void rm_control_on_stack(void)
{
    static const size_t real = 55888;
    size_t bytes = env_uint("FAKE_NVML_STACK_BYTES", (unsigned)real);
    if (!bytes) return;
    volatile unsigned char *params = __builtin_alloca(bytes);
    for (size_t at = 0; at < bytes; at += 1024) params[at] = (unsigned char)at;
    params[bytes - 1] = 1;
}

/* A query in flight when the library is finalised at exit.  FAKE_NVML_HOLD_MS keeps each
 * per-process utilisation query inside the library that long (creating FAKE_NVML_HELD_FILE, if
 * set, as it enters); FAKE_NVML_FINI_MS makes the library's finaliser take that long, as a
 * real teardown (closing the device, freeing its tables) can.  A query that finds the library
 * finalised when its hold ends aborts: the real library's state is gone by then. */
static int finalised;

static void held_past_finaliser(void)
{
    unsigned ms = env_uint("FAKE_NVML_HOLD_MS", 0);
    if (!ms) return;
    const char *file = getenv("FAKE_NVML_HELD_FILE");
    if (file) {
        FILE *f = fopen(file, "w");
        if (f) fclose(f);
    }
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    if (__atomic_load_n(&finalised, __ATOMIC_ACQUIRE)) {
        static const char msg[] = "fake NVML: a query ran on past the library's finaliser\n";
        fputs(msg, stderr);
        abort();
    }
}

__attribute__((destructor)) static void fake_nvml_fini(void)
{
    unsigned ms = env_uint("FAKE_NVML_FINI_MS", 0);
    if (!ms) return;
    __atomic_store_n(&finalised, 1, __ATOMIC_RELEASE);
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Rows of garbage a driver listed among its samples (nvtop issue #110, 2021, two zombie
 * processes on the GPU: count 100, three rows as below and 97 of zeros).  Their utilisations are
 * far above 100 % and their timestamps (1975, 1976 and 50 ms after the epoch) older than any real
 * sample. */
static const nvmlProcessUtilizationSample_t proc_garbage[] = {
    {50554, 217144956601725ull, 37100, 0, 50583, 50624},
    {50021, 158819300671603ull, 38305, 0, 49270, 50571},
    {50017, 49936ull, 0, 0, 3313, 0},
    {0, 0, 0, 0, 0, 0},
    {0, 0, 0, 0, 0, 0},
};

API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *out,
                                                 unsigned int *count, unsigned long long last_seen)
{
    const char *mode = getenv("FAKE_NVML_PROC_UTIL");
    rm_control_on_stack();
    held_past_finaliser();
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (index_of(d) < 0 || !count) return NVML_ERROR_INVALID_ARGUMENT;
    if (mode && !strcmp(mode, "off")) return NVML_ERROR_NOT_SUPPORTED;
    if (!proc_advance()) return (nvmlReturn_t)999; /* NVML_ERROR_UNKNOWN */
    unsigned n = proc_stamp > last_seen ? proc_n : 0, room = env_uint("FAKE_NVML_PROC_ROOM", 0);
    unsigned junk = env_uint("FAKE_NVML_PROC_GARBAGE", 0) ? sizeof(proc_garbage) / sizeof(proc_garbage[0]) : 0;
    if (!out || *count < n + junk || *count < room) {
        *count = n + junk > room ? n + junk : room;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (!n && !junk) return NVML_ERROR_NOT_FOUND;
    memcpy(out, proc_s, n * sizeof(proc_s[0]));
    memcpy(out + n, proc_garbage, junk * sizeof(proc_garbage[0]));
    *count = n + junk;
    return NVML_SUCCESS;
}

/* Event sets, for the node agent's registration of critical XID errors (gpu-check's agent_xid
 * row, rehearsed on this fake): each device supports single- and double-bit ECC and XID events,
 * none ever arrives (a wait answers NVML_ERROR_TIMEOUT at once). FAKE_NVML_EVENTS=0: the driver
 * makes no event set (NVML_ERROR_NOT_SUPPORTED), as one without them. */
#define FAKE_EVENT_TYPES 0xbull /* SingleBitEcc 1 | DoubleBitEcc 2 | XidCriticalError 8 */
#define FAKE_NVML_ERROR_TIMEOUT 10

struct fake_event_set {
    unsigned long long registered[FAKE_MAX_DEVS];
};

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} fake_event_data_t;

API nvmlReturn_t nvmlEventSetCreate(struct fake_event_set **set)
{
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    if (!env_uint("FAKE_NVML_EVENTS", 1)) return NVML_ERROR_NOT_SUPPORTED;
    *set = calloc(1, sizeof(**set));
    return *set ? NVML_SUCCESS : (nvmlReturn_t)999; /* NVML_ERROR_UNKNOWN */
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types)
{
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (index_of(d) < 0 || !types) return NVML_ERROR_INVALID_ARGUMENT;
    *types = FAKE_EVENT_TYPES;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types,
                                          struct fake_event_set *set)
{
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    int i = index_of(d);
    if (i < 0 || !set) return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~FAKE_EVENT_TYPES) return NVML_ERROR_NOT_SUPPORTED;
    set->registered[i] |= types;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlEventSetWait_v2(struct fake_event_set *set, fake_event_data_t *data,
                                     unsigned int timeout_ms)
{
    (void)timeout_ms; /* none ever arrives: not waited for */
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    return (nvmlReturn_t)FAKE_NVML_ERROR_TIMEOUT;
}

API nvmlReturn_t nvmlEventSetFree(struct fake_event_set *set)
{
    if (!refs) return NVML_ERROR_UNINITIALIZED;
    free(set);
    return NVML_SUCCESS;
}
