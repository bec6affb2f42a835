/*
 * devices.c - device discovery and the memory views.
 *
 * Discovery (once per process, on cuInit or the first hook that needs it):
 * the container's devices are NVML's list (NVML ignores CUDA_VISIBLE_DEVICES,
 * so its order is the container's device index); each CUDA ordinal is mapped
 * to its device by UUID, so caps follow the device whatever order or subset
 * CUDA_VISIBLE_DEVICES gives.  Without NVML, the CUDA devices are used, with
 * the index taken from an integer CUDA_VISIBLE_DEVICES entry if there is one.
 *
 * (Contexts: context.c, primary.c, green.c; their footprint: footprint.c.)
 *
 * Views: cuMemGetInfo / cuDeviceTotalMem report total = the cap, used = the
 * container's usage, free = cap - used clamped at 0 (and never more than the
 * device really has free).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuslice.h"


static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_ready;
static int g_ndev;
static int g_slot_of[GS_MAX_CUDA_DEVS];
static nvmlDevice_t g_nvml_of[GS_MAX_CUDA_DEVS];

void gs_uuid_format(const CUuuid *u, char *out, size_t len)
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* Container index of CUDA ordinal i when NVML is not there: CUDA_VISIBLE_DEVICES=2,0 maps 0->2, 1->0. */
static unsigned visible_index(int ordinal)
{
    const char *v = gs_getenv("CUDA_VISIBLE_DEVICES");
    for (int i = 0; v && *v; i++) {
        char *end = NULL;
        long idx = strtol(v, &end, 10);
        if (i == ordinal) return (end != v && (*end == ',' || *end == '\0') && idx >= 0) ? (unsigned)idx
                                                                                         : (unsigned)ordinal;
        v = strchr(v, ',');
        if (v) v++;
    }
    return (unsigned)ordinal;
}

static int cuda_uuid(CUdevice dev, char *out, size_t len)
{
    CUuuid u;
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    if (gs_cuda.cuDeviceGetUuid_v2) rc = gs_cuda.cuDeviceGetUuid_v2(&u, dev);
    if (rc != CUDA_SUCCESS && gs_cuda.cuDeviceGetUuid) rc = gs_cuda.cuDeviceGetUuid(&u, dev);
    if (rc != CUDA_SUCCESS) return -1;
    gs_uuid_format(&u, out, len);
    return 0;
}

/* The container's devices as NVML lists them; limits are filled in by the caller.  *inited: the
 * library took a reference on NVML (nvmlInit_v2), which the caller keeps or gives back.
 * *unread (optional): bit i set for each NVML index whose device could not be reached (fallen
 * off the bus: NVML_ERROR_GPU_IS_LOST), which CUDA may still list. */
static unsigned nvml_enumerate(struct gs_devcfg *devs, nvmlDevice_t *handles, int *inited, uint64_t *unread)
{
    unsigned count = 0, n = 0;
    gs_nvml_init();
    *inited = 0;
    if (unread) *unread = 0;
    if (!gs_nvml.nvmlInit_v2 || !gs_nvml.nvmlDeviceGetCount_v2 || !gs_nvml.nvmlDeviceGetHandleByIndex_v2 ||
        !gs_nvml.nvmlDeviceGetUUID || gs_nvml.nvmlInit_v2() != NVML_SUCCESS)
        return 0;
    *inited = 1;
    if (gs_nvml.nvmlDeviceGetCount_v2(&count) != NVML_SUCCESS) return 0;
    if (count > GPUSLICE_MAX_DEVICES) count = GPUSLICE_MAX_DEVICES;
    for (unsigned i = 0; i < count; i++) {
        nvmlDevice_t h;
        char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
        nvmlMemory_t mem;
        if (gs_nvml.nvmlDeviceGetHandleByIndex_v2(i, &h) != NVML_SUCCESS ||
            gs_nvml.nvmlDeviceGetUUID(h, uuid, sizeof(uuid)) != NVML_SUCCESS) {
            if (unread && i < 64) *unread |= 1ull << i;
            continue;
        }
        memset(&devs[n], 0, sizeof(devs[n]));
        size_t len = strnlen(uuid, sizeof(devs[n].uuid) - 1);
        memcpy(devs[n].uuid, uuid, len);
        devs[n].uuid[len] = '\0';
        devs[n].index = i;
        if (gs_nvml.nvmlDeviceGetMemoryInfo && gs_nvml.nvmlDeviceGetMemoryInfo(h, &mem) == NVML_SUCCESS)
            devs[n].total = mem.total;
        handles[n] = h;
        n++;
    }
    return n;
}

static void fill_limits(struct gs_devcfg *devs, unsigned n)
{
    for (unsigned k = 0; k < n; k++) {
        devs[k].limit = gs_env_memory_limit(devs[k].index, devs[k].total);
        devs[k].sm_limit = gs_env_sm_limit(devs[k].index);
        GS_INFO("device %u %s: total %llu, cap %llu, sm limit %u", devs[k].index, devs[k].uuid,
                (unsigned long long)devs[k].total, (unsigned long long)devs[k].limit, devs[k].sm_limit);
    }
}

/* CUDA devices left out of the region because its GPUSLICE_MAX_DEVICES slots were taken (a
 * container that sees more GPUs than gpuslice grants one: the webhook grants at most 16, so
 * only a container given GPUs some other way).  Such a device has no slot, and a device without
 * a slot runs with no cap: said once, at discovery, naming it. */
static void report_unslotted(int ncuda, int left, int first, const char *uuid)
{
    GS_ERROR("this container sees %d GPUs, more than the %u gpuslice can cap in one container: %d of them "
             "(CUDA device %d, %s, the first) run with NO memory or compute cap; give the container at most "
             "%u GPUs",
             ncuda, GPUSLICE_MAX_DEVICES, left, first, uuid, GPUSLICE_MAX_DEVICES);
}

/* This thread is discovering the devices: a driver callback inside one of discover()'s calls
 * (a profiler's) that reaches a hook finds no device yet and passes through (pthread_once
 * would wait for its own thread) */
static __thread int t_discovering;

static void discover(void)
{
    t_discovering = 1;
    static struct gs_devcfg cuda_devs[GS_MAX_CUDA_DEVS], devs[GPUSLICE_MAX_DEVICES];
    static nvmlDevice_t nvml_handles[GPUSLICE_MAX_DEVICES];
    int ncuda = 0;
    unsigned n = 0;

    gs_cuda_init();
    if (gs_cuda.cuInit && gs_cuda.cuDeviceGetCount && gs_cuda.cuDeviceGet && gs_cuda.cuInit(0) == CUDA_SUCCESS &&
        gs_cuda.cuDeviceGetCount(&ncuda) == CUDA_SUCCESS) {
        if (ncuda > GS_MAX_CUDA_DEVS) ncuda = GS_MAX_CUDA_DEVS;
        for (int i = 0; i < ncuda; i++) {
            CUdevice dev;
            size_t total = 0;
            memset(&cuda_devs[i], 0, sizeof(cuda_devs[i]));
            if (gs_cuda.cuDeviceGet(&dev, i) != CUDA_SUCCESS ||
                cuda_uuid(dev, cuda_devs[i].uuid, sizeof(cuda_devs[i].uuid)) != 0)
                continue;
            if (gs_cuda.cuDeviceTotalMem_v2 && gs_cuda.cuDeviceTotalMem_v2(&total, dev) == CUDA_SUCCESS)
                cuda_devs[i].total = total;
            cuda_devs[i].index = visible_index(i);
        }
    } else {
        ncuda = 0;
    }

    int inited; /* the reference is kept: the sampler (reconcile.c, slices.c) asks NVML for the process's life */
    uint64_t unread;
    unsigned nnvml = nvml_enumerate(devs, nvml_handles, &inited, &unread);
    unsigned next = 0; /* past every container index taken: for a device no index is left for */
    for (unsigned k = 0; k < nnvml; k++)
        if (devs[k].index >= next) next = devs[k].index + 1;
    for (unsigned b = 0; b < 64; b++)
        if (unread & (1ull << b) && b >= next) next = b + 1;
    n = nnvml;
    /* CUDA devices NVML does not list (or no NVML at all).  One NVML lists but cannot reach (a
     * GPU fallen off the bus) takes the index NVML could not read: its own CUDA_DEVICE_MEMORY_LIMIT_<i>
     * (an index past NVML's gave it none, uncapped, or another device's); the one an integer
     * CUDA_VISIBLE_DEVICES entry (or its ordinal) names if that is one of them, else the lowest. */
    int left = 0, first = -1; /* CUDA devices past the region's slots (report_unslotted) */
    for (int i = 0; i < ncuda; i++) {
        int known = !cuda_devs[i].uuid[0];
        for (unsigned k = 0; k < n && !known; k++) known = strcmp(devs[k].uuid, cuda_devs[i].uuid) == 0;
        if (known) continue;
        if (n >= GPUSLICE_MAX_DEVICES) {
            if (first < 0) first = i;
            left++;
            continue;
        }
        devs[n] = cuda_devs[i];
        if (nnvml || unread) {
            unsigned want = devs[n].index;
            if (!(want < 64 && unread & (1ull << want)))
                want = unread ? (unsigned)__builtin_ctzll(unread) : next++;
            if (want < 64) unread &= ~(1ull << want);
            devs[n].index = want;
        }
        nvml_handles[n] = NULL;
        n++;
    }
    for (unsigned k = 0; k < n; k++) {
        for (int i = 0; i < ncuda && !devs[k].total; i++)
            if (strcmp(devs[k].uuid, cuda_devs[i].uuid) == 0) devs[k].total = cuda_devs[i].total;
    }
    if (left) report_unslotted(ncuda, left, first, cuda_devs[first].uuid);
    fill_limits(devs, n);
    gs_reconcile_margin = gs_env_reconcile_margin();
    gs_log_report_level();

    gs_region_sync(devs, n, 1);

    for (int i = 0; i < GS_MAX_CUDA_DEVS; i++) g_slot_of[i] = -1;
    for (int i = 0; i < ncuda; i++) {
        g_slot_of[i] = gs_region_slot_by_uuid(cuda_devs[i].uuid);
        for (unsigned k = 0; k < n; k++)
            if (strcmp(devs[k].uuid, cuda_devs[i].uuid) == 0) g_nvml_of[i] = nvml_handles[k];
    }
    g_ndev = ncuda;
    gs_launch_configure();
    __atomic_store_n(&g_ready, 1, __ATOMIC_RELEASE);
    t_discovering = 0;
    gs_context_after_discovery();
}

int gs_devices_known(void)
{
    return __atomic_load_n(&g_ready, __ATOMIC_ACQUIRE);
}

int gs_devices_discovering(void)
{
    return t_discovering;
}

void gs_devices_ready(void)
{
    if (GS_LIKELY(__atomic_load_n(&g_ready, __ATOMIC_ACQUIRE)) || t_discovering) return;
    pthread_once(&g_once, discover);
}

/* NVML-only processes (nvidia-smi): the region's devices, without registering. */
static pthread_once_t g_view_once = PTHREAD_ONCE_INIT;

static void view_setup(void)
{
    static struct gs_devcfg devs[GPUSLICE_MAX_DEVICES];
    static nvmlDevice_t handles[GPUSLICE_MAX_DEVICES];
    if (__atomic_load_n(&g_ready, __ATOMIC_ACQUIRE)) return;
    int inited;
    unsigned n = nvml_enumerate(devs, handles, &inited, NULL);
    /* given back: the program's own nvmlShutdown must still shut NVML down (nvidia-smi-like
     * programs would notice a library that kept NVML initialised; found by review) */
    if (inited && gs_nvml.nvmlShutdown) gs_nvml.nvmlShutdown();
    fill_limits(devs, n);
    gs_region_sync(devs, n, 0);
}

void gs_devices_view_ready(void)
{
    if (__atomic_load_n(&g_ready, __ATOMIC_ACQUIRE)) return;
    pthread_once(&g_view_once, view_setup);
}

int gs_nvml_slot(nvmlDevice_t device)
{
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    if (!gs_nvml.nvmlDeviceGetUUID || gs_nvml.nvmlDeviceGetUUID(device, uuid, sizeof(uuid)) != NVML_SUCCESS)
        return -1;
    return gs_region_slot_by_uuid(uuid);
}

int gs_dev_slot(CUdevice dev)
{
    gs_devices_ready();
    return dev >= 0 && dev < g_ndev ? g_slot_of[dev] : -1;
}

/* A location of CUDA 13.4's locality domains (the partitions of a GPU's SMs and memory, which
 * cuMemCreate and memory pools take) is its device's memory; an imported pool's location of a
 * device this process does not see (CUDA 13.2's INVISIBLE) is the exporter's */
CUdevice gs_location_device(const CUmemLocation *loc)
{
    unsigned char device_id;
    switch ((int)loc->type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        return loc->id;
    case CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN:
        memcpy(&device_id, &loc->id, 1); /* localized.deviceId, the union's first byte */
        return device_id;
    case CU_MEM_LOCATION_TYPE_NONE: /* = INVALID */
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
    case CU_MEM_LOCATION_TYPE_INVISIBLE:
        return -1;
    default: {
        static int told;
        if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
            GS_WARN("a memory location of type %d, newer than this library: its memory is counted as device "
                    "memory (update gpuslice)",
                    (int)loc->type);
        return GS_LOCATION_UNKNOWN;
    }
    }
}

int gs_current_slot_raw(CUcontext *ctx)
{
    CUcontext c = NULL;
    CUdevice dev;
    if (ctx) *ctx = NULL;
    if (!gs_cuda.cuCtxGetCurrent || !gs_cuda.cuCtxGetDevice || gs_cuda.cuCtxGetCurrent(&c) != CUDA_SUCCESS ||
        !c || gs_cuda.cuCtxGetDevice(&dev) != CUDA_SUCCESS)
        return -1;
    if (ctx) *ctx = c;
    return gs_dev_slot(dev);
}

int gs_current_slot(CUcontext *ctx)
{
    int slot = gs_current_slot_raw(ctx);
    if (ctx) *ctx = gs_ctx_canonical(*ctx);
    return slot;
}

CUcontext gs_stream_ctx(CUstream es)
{
    CUcontext c = NULL;
    if (!es || es == CU_STREAM_LEGACY || es == CU_STREAM_PER_THREAD || !gs_cuda.cuStreamGetCtx ||
        gs_cuda.cuStreamGetCtx(es, &c) != CUDA_SUCCESS)
        return NULL;
    return c;
}

int gs_stream_device(CUstream es, CUcontext *ctx, CUdevice *dev)
{
    CUcontext cur = NULL, there;
    *ctx = NULL;
    if (!gs_cuda.cuCtxGetCurrent || !gs_cuda.cuCtxGetDevice || gs_cuda.cuCtxGetCurrent(&cur) != CUDA_SUCCESS)
        cur = NULL;
    there = gs_stream_ctx(es);
    if (!there) there = cur;
    if (!there) return -1;
    CUresult rc = CUDA_ERROR_NOT_SUPPORTED;
    if (there == cur) {
        rc = gs_cuda.cuCtxGetDevice(dev);
    } else {
        /* a context's device without making it current: CUDA 13 asks the context, 12.8 the
         * stream; older drivers tell the device of the current context only */
        if (gs_cuda.cuCtxGetDevice_v2) rc = gs_cuda.cuCtxGetDevice_v2(dev, there);
        if (rc != CUDA_SUCCESS && gs_cuda.cuStreamGetDevice) rc = gs_cuda.cuStreamGetDevice(es, dev);
        if (rc != CUDA_SUCCESS) {
            if (!gs_cuda.cuCtxSetCurrent || gs_cuda.cuCtxSetCurrent(there) != CUDA_SUCCESS) return -1;
            rc = gs_cuda.cuCtxGetDevice(dev);
            gs_cuda.cuCtxSetCurrent(cur);
        }
    }
    if (rc != CUDA_SUCCESS) return -1;
    *ctx = gs_ctx_canonical(there);
    return 0;
}

nvmlDevice_t gs_dev_nvml(CUdevice dev)
{
    return dev >= 0 && dev < g_ndev ? g_nvml_of[dev] : NULL;
}

int gs_dev_count(void)
{
    gs_devices_ready();
    return g_ndev;
}

GS_EXPORT CUresult cuInit(unsigned int flags)
{
    gs_cuda_init();
    if (!gs_cuda.cuInit) return CUDA_ERROR_NOT_SUPPORTED;
    CUresult rc = gs_cuda.cuInit(flags);
    if (rc == CUDA_SUCCESS) gs_devices_ready();
    return rc;
}

/* ---- views ---------------------------------------------------------------- */

/* The driver's figures for the current context, *free and *total, replaced by the cap and
 * the container's usage where a cap applies */
static void cap_view(size_t *free, size_t *total)
{
    gs_devices_ready();
    CUcontext ctx;
    int slot = gs_current_slot(&ctx);
    uint64_t limit = gs_slot_limit(slot);
    if (slot < 0 || !limit) return;
    gs_region_reclaim_soon();
    if (limit > *total) limit = *total;
    uint64_t used = gs_slot_used(slot);
    uint64_t avail = used >= limit ? 0 : limit - used;
    *total = (size_t)limit;
    if (avail < *free) *free = (size_t)avail;
}

GS_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemGetInfo_v2) return CUDA_ERROR_NOT_SUPPORTED;
    size_t real_free = 0, real_total = 0;
    /* an omitted output is the driver's to judge: it answers the other one (libnvoptix asks
     * cuMemGetInfo_v2(NULL, &total)); refused here, OptiX failed in the container only. The
     * view needs both figures, so they are asked for again once the driver has accepted */
    CUresult rc = gs_cuda.cuMemGetInfo_v2(free ? &real_free : NULL, total ? &real_total : NULL);
    if (rc == CUDA_SUCCESS && (!free || !total)) rc = gs_cuda.cuMemGetInfo_v2(&real_free, &real_total);
    if (rc != CUDA_SUCCESS) return rc;
    cap_view(&real_free, &real_total);
    if (free) *free = real_free;
    if (total) *total = real_total;
    return CUDA_SUCCESS;
}

GS_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuDeviceTotalMem_v2) return CUDA_ERROR_NOT_SUPPORTED;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = gs_cuda.cuDeviceTotalMem_v2(bytes, dev);
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t limit = gs_slot_limit(gs_dev_slot(dev));
    if (limit && limit < *bytes) *bytes = (size_t)limit;
    return CUDA_SUCCESS;
}

/* CUDA 2.x's 32-bit views: the driver answers first (its errors are the caller's), then the
 * capped figures replace its own, saturated at 4 GiB - 1 rather than wrapped.  The full-width
 * figures come from the 3.2 entry points where the driver answers them; in a context made by
 * CUDA 2.x's cuCtxCreate it may refuse them ("a 3010 context with 3020 API calls"), and the
 * cap is applied to its 32-bit figures instead. */
static unsigned int sat32(size_t v)
{
    return v > 0xffffffffu ? 0xffffffffu : (unsigned int)v;
}

GS_EXPORT CUresult cuMemGetInfo(unsigned int *free, unsigned int *total)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemGetInfo) return CUDA_ERROR_NOT_SUPPORTED;
    unsigned int f32 = 0, t32 = 0; /* an omitted output: as cuMemGetInfo_v2 */
    CUresult rc = gs_cuda.cuMemGetInfo(free ? &f32 : NULL, total ? &t32 : NULL);
    if (rc == CUDA_SUCCESS && (!free || !total)) rc = gs_cuda.cuMemGetInfo(&f32, &t32);
    if (rc != CUDA_SUCCESS) return rc;
    size_t f = f32, t = t32;
    if (gs_cuda.cuMemGetInfo_v2 && gs_cuda.cuMemGetInfo_v2(&f, &t) != CUDA_SUCCESS) f = f32, t = t32;
    cap_view(&f, &t);
    if (free) *free = sat32(f);
    if (total) *total = sat32(t);
    return CUDA_SUCCESS;
}

GS_EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev)
{
    gs_cuda_init();
    if (!gs_cuda.cuDeviceTotalMem) return CUDA_ERROR_NOT_SUPPORTED;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = gs_cuda.cuDeviceTotalMem(bytes, dev);
    if (rc != CUDA_SUCCESS) return rc;
    size_t t = *bytes;
    if (gs_cuda.cuDeviceTotalMem_v2 && gs_cuda.cuDeviceTotalMem_v2(&t, dev) != CUDA_SUCCESS) t = *bytes;
    uint64_t limit = gs_slot_limit(gs_dev_slot(dev));
    if (limit && limit < t) t = (size_t)limit;
    *bytes = sat32(t);
    return CUDA_SUCCESS;
}
