/*
 * hooksweep - calls every function the interposer hooks (hooks.h's tables, CUDA and NVML) with hostile
 * arguments, in one process, and checks the region's charge around each call.
 *
 *   hooksweep [--fail] [--fill BYTES] [--no-ones] [--bare 1|2] [--only NAME[,NAME...]]
 *   hooksweep --pairs [--fill BYTES]
 *
 * Each parameter's type (the table's own text) gives it a class, and each class a list of
 * hostile values: pointers NULL, a zeroed buffer or one filled with 0xff (structures of huge
 * sizes, counts and garbage handles), sizes and counts 0, 1, SIZE_MAX and values
 * whose rounding to a page overflows, ints 0, -1, INT_MAX, device addresses and memory handles
 * 0 or bogus, object handles NULL.  A function is called with every argument at its class's
 * first value, then once for each other value of each argument, the rest at their first.
 * With --fail the fake driver fails every call of the function's name (FAKE_CUDA_FAIL), so
 * that none succeeds even where the arguments happen to be valid.  With --fill, BYTES are
 * allocated first (cuMemAlloc_v2), so that the calls run near the cap, where the hooks measure
 * and reserve before the driver's call.  With --bare no context is current (1: after cuInit;
 * 2: cuInit only as the sweep calls it).
 *
 * Before each call it prints "call NAME SET" (flushed: a crash names the call), after it
 * "ret NAME SET RC BEFORE AFTER" (the region's charges around the call: the process's on every
 * device slot plus every slot's total) and, where a
 * call that failed moved the charge, "LEAK NAME SET RC BEFORE AFTER"; where the library's in-flight
 * counts stay raised after the call (peek.h), "UNBALANCED NAME SET RC INFLIGHT UNSETTLED".  The
 * last line is "done CALLS LEAKS UNBALANCED" (UNBALANCED -1: the counts could not be read).  The primary context of
 * device 0 is made current again after each call (a call may release or reset it).
 * The fake driver is linked directly; the interposer, preloaded, is what dlsym finds.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_abi.h"
#include "hooks.h"
#include "peek.h"       /* the library's in-flight counts */
#include "selfcharge.h" /* the region's layout, mmap */

void fake_cuda_set_fail(const char *spec); /* the fake driver's FAKE_CUDA_FAIL, set without setenv */
CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);

#define GS_STR_(x) #x
#define GS_STR(x) GS_STR_(x)
#define SWEEP_ENTRY(name, ret, params, base, ver, pt) {#name, GS_STR(params)},
#define SWEEP_NVML(name, ret, params) {#name, GS_STR(params)},
static const struct {
    const char *name, *params;
} hooks[] = {GS_CUDA_HOOKS(SWEEP_ENTRY) GS_NVML_HOOKS(SWEEP_NVML)};

/* --no-ones: no structure filled with 0xff (its stream handles are garbage, which a compute
 * limit's hooks hand to the driver, whose fake would crash on them as a driver may) */
static int no_ones;

/* called with ten integer registers' worth of arguments: the System V ABI passes a
 * function's integer, pointer and small-struct arguments in them whatever its type */
typedef CUresult (*any_fn)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                           uint64_t, uint64_t, uint64_t, uint64_t);
#define MAX_ARGS 12

enum cls { C_PTR, C_SIZE, C_INT, C_SMALL, C_ADDR, C_HANDLE, C_LOC, C_NVMLDEV };
#define ZBUF_SIZE (1u << 20)
static unsigned char *zbuf; /* zeroed before each call */
#define ZBUF_TOKEN 0x5a5a5a5a5a5a5a5aull /* replaced by zbuf's address */

#define ONES_TOKEN 0x5a5a5a5a5a5a5a5bull /* zbuf's address, the buffer filled with 0xff */
static const uint64_t vals_ptr[] = {0, ZBUF_TOKEN, ONES_TOKEN};
static const uint64_t vals_size[] = {0, 1, UINT64_MAX, UINT64_MAX - (1ull << 20) + 2, 1ull << 63,
                                     (1ull << 32) + 1};
static const uint64_t vals_int[] = {0, 0xffffffffull, 0x7fffffffull, 1};
static const uint64_t vals_small[] = {0, 0xff};
static const uint64_t vals_addr[] = {0, 0xdead000ull, UINT64_MAX};
static const uint64_t vals_handle[] = {0};
#define NVMLDEV_TOKEN 0x5a5a5a5a5a5a5a5cull /* device 0's NVML handle */
static uint64_t nvml_dev0;
static const uint64_t vals_nvmldev[] = {NVMLDEV_TOKEN, 0};
static const uint64_t vals_loc[] = {0, 0xffffffffffffffffull, 0x0000000100000001ull};
static const struct {
    const uint64_t *v;
    int n;
} classes[] = {
    [C_PTR] = {vals_ptr, 3},       [C_SIZE] = {vals_size, 6},     [C_INT] = {vals_int, 4},
    [C_SMALL] = {vals_small, 2},   [C_ADDR] = {vals_addr, 3},     [C_HANDLE] = {vals_handle, 1},
    [C_LOC] = {vals_loc, 3},       [C_NVMLDEV] = {vals_nvmldev, 2},
};

/* the class of one parameter's text, "const CUDA_MEMCPY2D *pCopy", "size_t N" */
static enum cls classify(const char *p, size_t len)
{
    char t[160];
    if (len >= sizeof(t)) len = sizeof(t) - 1;
    memcpy(t, p, len);
    t[len] = 0;
    if (strchr(t, '*')) return C_PTR;
    /* drop the parameter's name: the type is what comes before the last word */
    char *end = t + strlen(t);
    while (end > t && end[-1] == ' ') *--end = 0;
    while (end > t && end[-1] != ' ') end--;
    if (end > t) *end = 0;
#define IS(s) (strstr(t, s) != NULL)
    if (IS("nvmlDevice_t")) return C_NVMLDEV;
    if (IS("size_t") || IS("unsigned long long") || IS("cuuint64_t")) return C_SIZE;
    if (IS("CUdeviceptr") || IS("CUmemGenericAllocationHandle")) return C_ADDR;
    if (IS("CUmemLocation")) return C_LOC;
    if (IS("unsigned char") || IS("unsigned short")) return C_SMALL;
    if (IS("CUcontext") || IS("CUstream") || IS("CUevent") || IS("CUfunction") || IS("CUgraph") ||
        IS("CUmemoryPool") || IS("CUgreenCtx") || IS("CUdevResourceDesc") || IS("CUarray") ||
        IS("CUmipmappedArray") || IS("CUmodule") || IS("CUlibrary") || IS("CUkernel") || IS("CUhostFn") ||
        IS("CUstreamCallback"))
        return C_HANDLE;
#undef IS
    return C_INT; /* int, unsigned int, CUdevice, cuuint32_t, the enums */
}

/* the classes of a parameter list's text; the count, 0 for "(void)" */
static int parse_params(const char *params, enum cls *out)
{
    const char *p = strchr(params, '(');
    if (!p) return 0;
    p++;
    int n = 0;
    while (*p && *p != ')') {
        while (*p == ' ') p++;
        const char *q = p;
        while (*q && *q != ',' && *q != ')') q++;
        if (strncmp(p, "void", 4) == 0 && q - p == 4) return 0;
        if (n < MAX_ARGS) out[n++] = classify(p, (size_t)(q - p));
        p = *q == ',' ? q + 1 : q;
    }
    return n;
}

static CUcontext primary;
static int bare; /* --bare 1: cuInit only, no context; --bare 2: not even cuInit */
static unsigned long long fill; /* --fill: bytes kept allocated (again after a reset took them) */

/* The region's charges: this process's on every device slot and every slot's total, summed
 * (a hook may charge another device than the one the sweep's context is on) */
static uint64_t charge_now(void)
{
    static const struct gpuslice_region *r; /* mapped once: the region's size is fixed */
    static int me = -1;                     /* this process's entry */
    if (!r) {
        const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
        int fd = path ? open(path, O_RDONLY) : -1;
        const struct gpuslice_region *m =
            fd < 0 ? MAP_FAILED : mmap(NULL, sizeof(*m), PROT_READ, MAP_SHARED, fd, 0);
        if (fd >= 0) close(fd);
        if (m == MAP_FAILED) return UINT64_MAX;
        r = m;
    }
    if (me < 0 || r->procs[me].pid != getpid())
        for (me = 0; me < GPUSLICE_MAX_PROCS && r->procs[me].pid != getpid(); me++) continue;
    uint64_t sum = 0;
    for (int d = 0; d < GPUSLICE_MAX_DEVICES; d++)
        sum += __atomic_load_n(&r->devices[d].used_bytes, __ATOMIC_RELAXED) +
               (me < GPUSLICE_MAX_PROCS ? __atomic_load_n(&r->procs[me].used_bytes[d], __ATOMIC_RELAXED) : 0);
    if (me >= GPUSLICE_MAX_PROCS) me = -1;
    return sum;
}

static void restore_context(void)
{
    if (bare) {
        CUcontext cur = NULL;
        if (cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur) cuCtxSetCurrent(NULL);
        return;
    }
    unsigned flags = 0;
    int active = 0;
    CUcontext cur = NULL;
    if (cuDevicePrimaryCtxGetState(0, &flags, &active) != CUDA_SUCCESS || !active)
        cuDevicePrimaryCtxRetain(&primary, 0);
    if (cuCtxGetCurrent(&cur) != CUDA_SUCCESS || cur != primary) cuCtxSetCurrent(primary);
    CUdeviceptr p = 0;
    if (fill && charge_now() < 2 * fill) cuMemAlloc_v2(&p, fill); /* counted twice: the process's, the slot's */
}

static int leaks, calls, unbalanced;

static void call_one(const char *name, any_fn fn, int nargs, const uint64_t *args, const char *set, int fail)
{
    uint64_t a[MAX_ARGS] = {0};
    int ones = 0;
    for (int i = 0; i < nargs; i++) {
        a[i] = args[i] == ZBUF_TOKEN || args[i] == ONES_TOKEN ? (uint64_t)(uintptr_t)zbuf
               : args[i] == NVMLDEV_TOKEN                  ? nvml_dev0
                                                           : args[i];
        ones |= args[i] == ONES_TOKEN;
    }
    memset(zbuf, ones ? 0xff : 0, ZBUF_SIZE);
    printf("call %s %s\n", name, set);
    fflush(stdout);
    char spec[200];
    if (fail) { /* the hook's name, and its base name without a _v2/_ptsz/_ptds suffix */
        char base[96];
        snprintf(base, sizeof(base), "%s", name);
        char *s;
        while ((s = strrchr(base, '_')) != NULL && (!strcmp(s, "_ptsz") || !strcmp(s, "_ptds") ||
                                                   (s[1] == 'v' && s[2] >= '0' && s[2] <= '9')))
            *s = 0;
        snprintf(spec, sizeof(spec), "%s:0,%s:0", name, base);
        fake_cuda_set_fail(spec); /* not setenv: the sampler thread reads the environment */
    }
    uint64_t before = charge_now();
    CUresult rc = fn(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]);
    uint64_t after = charge_now();
    if (fail) fake_cuda_set_fail(NULL);
    calls++;
    printf("ret %s %s %d %llu %llu\n", name, set, rc, (unsigned long long)before, (unsigned long long)after);
    if (rc != CUDA_SUCCESS && after != before) {
        printf("LEAK %s %s %d %llu %llu\n", name, set, rc, (unsigned long long)before, (unsigned long long)after);
        leaks++;
    }
    int inflight, unsettled; /* every return path of the hook ended what it began (five reported) */
    if (unbalanced < 5 && peek_balanced(200, &inflight, &unsettled) == 0) {
        printf("UNBALANCED %s %s %d %d %d\n", name, set, rc, inflight, unsettled);
        unbalanced++;
    }
    fflush(stdout);
    restore_context();
}

/* ---- --pairs: every free of every kind on every kind of allocation ---------------------------- */

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t w, size_t h, unsigned int elem);
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int levels);
CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);

#define PAIR_BYTES (64ull << 20)
enum { F_FREE, F_FREE32, F_FREEASYNC, F_RELEASE, F_ARRAY, F_MIPMAP, F_UNMAP, F_NFREES };
static const char *const free_names[F_NFREES] = {"cuMemFree_v2", "cuMemFree", "cuMemFreeAsync", "cuMemRelease",
                                                 "cuArrayDestroy", "cuMipmappedArrayDestroy", "cuMemUnmap"};
enum { K_ALLOC, K_MANAGED, K_PITCH, K_ASYNC, K_VMM, K_MAPPED, K_ARRAY, K_MIPMAP, K_NKINDS };
static const char *const kind_names[K_NKINDS] = {"alloc", "managed", "pitch", "async", "vmm", "mapped", "array",
                                                 "mipmap"};
static const int right_free[K_NKINDS] = {F_FREE, F_FREE, F_FREE, F_FREEASYNC, F_RELEASE, F_UNMAP, F_ARRAY, F_MIPMAP};

static CUresult call_free(int f, uint64_t v)
{
    typedef CUresult (*one_fn)(uint64_t);
    typedef CUresult (*two_fn)(uint64_t, uint64_t);
    void *fn = dlsym(RTLD_DEFAULT, free_names[f]);
    if (!fn) return CUDA_ERROR_NOT_FOUND;
    if (f == F_FREE32) return ((one_fn)fn)(v & 0xffffffffull);
    if (f == F_FREEASYNC) return ((two_fn)fn)(v, 0);
    if (f == F_UNMAP) return ((two_fn)fn)(v, PAIR_BYTES);
    return ((one_fn)fn)(v);
}

/* One allocation of kind k: its value (pointer or handle), 0 if it cannot be made */
static uint64_t make_kind(int k)
{
    CUdeviceptr p = 0;
    size_t pitch = 0;
    CUmemGenericAllocationHandle h = 0;
    CUmemAllocationProp prop = {1, 0, {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
    CUDA_ARRAY_DESCRIPTOR ad = {1024, 1024, 0x20, 4};
    CUDA_ARRAY3D_DESCRIPTOR md = {1024, 1024, 0, 0x20, 4, 0};
    CUarray a = NULL;
    CUmipmappedArray m = NULL;
    CUresult rc;
    switch (k) {
    case K_ALLOC: rc = cuMemAlloc_v2(&p, PAIR_BYTES); break;
    case K_MANAGED: rc = cuMemAllocManaged(&p, PAIR_BYTES, 1); break;
    case K_PITCH: rc = cuMemAllocPitch_v2(&p, &pitch, 8192, 8192, 4); break;
    case K_ASYNC: rc = cuMemAllocAsync(&p, PAIR_BYTES, NULL); break;
    case K_VMM: rc = cuMemCreate(&h, PAIR_BYTES, &prop, 0); p = h; break;
    case K_MAPPED: /* a mapping whose handle is released: the mapping holds the memory */
        rc = cuMemCreate(&h, PAIR_BYTES, &prop, 0);
        if (rc == CUDA_SUCCESS) rc = cuMemAddressReserve(&p, PAIR_BYTES, 0, 0, 0);
        if (rc == CUDA_SUCCESS) rc = cuMemMap(p, PAIR_BYTES, 0, h, 0);
        if (rc == CUDA_SUCCESS) rc = cuMemRelease(h);
        break;
    case K_ARRAY: rc = cuArrayCreate_v2(&a, &ad); p = (uint64_t)(uintptr_t)a; break;
    default: rc = cuMipmappedArrayCreate(&m, &md, 4); p = (uint64_t)(uintptr_t)m; break;
    }
    return rc == CUDA_SUCCESS ? p : 0;
}

/* What a pool keeps after a free: given back, so that the charge can come back to where it was */
static void settle_pools(void)
{
    CUmemoryPool pool = NULL;
    cuCtxSynchronize();
    if (cuDeviceGetMemPool(&pool, 0) == CUDA_SUCCESS) cuMemPoolTrimTo(pool, 0);
}

/* Prints "pair KIND FREE RC BEFORE AFTER" for each wrong free (it must fail and change nothing),
 * then the right free, then the right free again (refused, nothing given back twice) */
static int pairs(void)
{
    int bad = 0;
    for (int k = 0; k < K_NKINDS; k++) {
        settle_pools();
        uint64_t empty = charge_now(), v = make_kind(k), made = charge_now();
        printf("made %s %d %llu %llu\n", kind_names[k], v ? 0 : 1, (unsigned long long)empty,
               (unsigned long long)made);
        if (!v || made <= empty) {
            bad++;
            continue;
        }
        for (int f = 0; f < F_NFREES; f++) {
            if (f == right_free[k] || (right_free[k] == F_FREE && f == F_FREEASYNC) ||
                (right_free[k] == F_FREEASYNC && f == F_FREE))
                continue; /* cuMemFree and cuMemFreeAsync free either kind */
            uint64_t before = charge_now();
            CUresult rc = call_free(f, v);
            uint64_t after = charge_now();
            int wrong = rc == CUDA_SUCCESS || after != before;
            printf("%s %s %s %d %llu %llu\n", wrong ? "BADPAIR" : "pair", kind_names[k], free_names[f], rc,
                   (unsigned long long)before, (unsigned long long)after);
            bad += wrong;
        }
        CUresult rc = call_free(right_free[k], v);
        settle_pools();
        uint64_t freed = charge_now();
        rc = rc == CUDA_SUCCESS ? call_free(right_free[k], v) : rc;
        settle_pools();
        uint64_t again = charge_now();
        int wrong = freed != empty || again != empty;
        printf("%s %s %s %d %llu %llu %llu\n", wrong ? "BADFREE" : "freed", kind_names[k], free_names[right_free[k]],
               rc, (unsigned long long)empty, (unsigned long long)freed, (unsigned long long)again);
        bad += wrong;
    }
    printf("pairs %d\n", bad);
    return bad ? 1 : 0;
}

static int wanted(const char *name, const char *only)
{
    if (!only) return 1;
    size_t n = strlen(name);
    for (const char *p = only; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
        if (strncmp(p, name, n) == 0 && (p[n] == ',' || p[n] == 0)) return 1;
    return 0;
}

int main(int argc, char **argv)
{
    const char *only = NULL;
    int fail = 0, pairs_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--fail")) fail = 1;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--no-ones")) no_ones = 1;
        else if (!strcmp(argv[i], "--pairs")) pairs_only = 1;
        else if (!strcmp(argv[i], "--bare") && i + 1 < argc) bare = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--fill") && i + 1 < argc) fill = strtoull(argv[++i], NULL, 0);
    }
    zbuf = calloc(1, ZBUF_SIZE);
    void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    typedef int (*nvml_init_fn)(void);
    nvml_init_fn nvml_init = nvml ? (nvml_init_fn)dlsym(nvml, "nvmlInit_v2") : NULL;
    typedef int (*nvml_handle_fn)(unsigned, void **);
    nvml_handle_fn nvml_handle = nvml ? (nvml_handle_fn)dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2") : NULL;
    void *dev0 = NULL;
    if (!nvml_init || nvml_init() != 0 || !nvml_handle || nvml_handle(0, &dev0) != 0) return 4;
    nvml_dev0 = (uint64_t)(uintptr_t)dev0;
    if (!zbuf || (bare < 2 && cuInit(0) != CUDA_SUCCESS) ||
        (!bare && cuDevicePrimaryCtxRetain(&primary, 0) != CUDA_SUCCESS))
        return 2;
    if (!bare) cuCtxSetCurrent(primary);
    CUdeviceptr filler = 0;
    if (fill && cuMemAlloc_v2(&filler, fill) != CUDA_SUCCESS) return 3;
    (void)filler;
    if (pairs_only) return pairs();
    for (size_t h = 0; h < sizeof(hooks) / sizeof(hooks[0]); h++) {
        const char *name = hooks[h].name;
        if (!wanted(name, only)) continue;
        /* NVML's through its library (which the program does not link), as a program dlopens it:
         * the interposer's dlsym hands out its hooks */
        any_fn fn = (any_fn)dlsym(strncmp(name, "nvml", 4) == 0 ? nvml : RTLD_DEFAULT, name);
        if (!fn) {
            printf("missing %s\n", name);
            continue;
        }
        enum cls c[MAX_ARGS];
        int n = parse_params(hooks[h].params, c);
        uint64_t base[MAX_ARGS] = {0};
        for (int i = 0; i < n; i++) base[i] = classes[c[i]].v[0];
        call_one(name, fn, n, base, "zero", fail);
        for (int i = 0; i < n; i++) {
            for (int k = 1; k < classes[c[i]].n; k++) {
                if (no_ones && classes[c[i]].v[k] == ONES_TOKEN) continue;
                uint64_t a[MAX_ARGS];
                memcpy(a, base, sizeof(a));
                a[i] = classes[c[i]].v[k];
                char set[32];
                snprintf(set, sizeof(set), "a%d=%d", i, k);
                call_one(name, fn, n, a, set, fail);
            }
        }
        /* every pointer a zeroed buffer (zeroed structures, writable outputs), then each other
         * argument hostile in turn */
        uint64_t zb[MAX_ARGS];
        for (int i = 0; i < n; i++) zb[i] = c[i] == C_PTR ? ZBUF_TOKEN : classes[c[i]].v[0];
        call_one(name, fn, n, zb, "buf", fail);
        for (int i = 0; i < n; i++) {
            if (c[i] == C_PTR) continue;
            for (int k = 1; k < classes[c[i]].n; k++) {
                uint64_t a[MAX_ARGS];
                memcpy(a, zb, sizeof(a));
                a[i] = classes[c[i]].v[k];
                char set[32];
                snprintf(set, sizeof(set), "buf,a%d=%d", i, k);
                call_one(name, fn, n, a, set, fail);
            }
        }
        cuCtxSynchronize();
    }
    int inflight, unsettled;
    if (peek_balanced(0, &inflight, &unsettled) < 0) unbalanced = -1; /* the counts could not be read */
    printf("done %d %d %d\n", calls, leaks, unbalanced);
    return 0;
}
