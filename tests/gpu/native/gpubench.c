/*
 * gpubench: a small CUDA driver-API program for the real-GPU checks (tests/gpu).
 *
 * It needs no CUDA headers or toolkit: the few driver entry points it uses are declared
 * below (their ABI has been stable since CUDA 4) and it is built with gcc alone, either
 * linked against the machine's libcuda.so.1 (direct symbol calls) or, with
 * -DGPUBENCH_DLOPEN, resolving them through dlopen + dlsym.  The empty kernel is PTX
 * that the driver compiles at load time, so no nvcc is needed either.
 *
 *   gpubench info                         cuMemGetInfo / cuDeviceTotalMem as the process sees them
 *   gpubench serve                        stdin lines: alloc BYTES | free IDX | info | quit |
 *                                         ipcget IDX (prints "ipc HEX", the CUDA IPC handle of
 *                                         allocation IDX) | ipcopen HEX (maps another process's
 *                                         allocation: "ok IDX"; free IDX closes it) |
 *                                         managed BYTES (cuMemAllocManaged, attached globally:
 *                                         "ok IDX"; free IDX frees it) |
 *                                         touch IDX BYTES (cuMemsetD8Async of BYTES at held
 *                                         allocation or mapping IDX, then synchronised) |
 *                                         spin MS (empty kernels launched back to back for MS
 *                                         ms: "ok LAUNCHES"; work for NVML's samples) |
 *                                         vmmexport BYTES PATH (cuMemCreate'd, mapped, exported
 *                                         as a file descriptor and offered once on the Unix
 *                                         socket PATH: "ok IDX") | vmmimport PATH BYTES (that
 *                                         descriptor imported and mapped: "ok IDX"; free IDX
 *                                         unmaps and releases either)
 *   gpubench launch LAUNCHES REPS BATCH   empty-kernel launch cost (CPU call cost and saturated)
 *   gpubench allocfree BYTES PAIRS REPS   cuMemAlloc + cuMemFree pair cost
 *   gpubench memset MIB MS                memsets alone for MS ms (cuMemsetD8Async of MIB):
 *                                         how many, GB/s (tests/gpu/test_memset.py)
 *   gpubench legacy MIB                   CUDA 2.x's cuMemAlloc / cuMemFree / cuMemGetInfo (32-bit,
 *                                         found by dlsym): MIB allocated, then 3 GiB, then freed;
 *                                         what each returned and what cuMemGetInfo_v2 saw
 *   gpubench graph MIB                    a captured graph that allocates MIB (cuMemAllocAsync,
 *                                         memset, cuMemFreeAsync): memory seen before and after
 *                                         instantiate, launch and cuDeviceGraphMemTrim, then a
 *                                         graph of 1 GiB more than the view's free memory
 *   gpubench green MIB                    a green context (CUDA 12.4+, found by dlsym) as the
 *                                         process's first context, so the driver makes the
 *                                         primary context inside it: the view after it, after
 *                                         MIB allocated in it and after 1 GiB more than the
 *                                         view's free memory, then after it is destroyed
 *   gpubench poolgrow MIB,MIB,...         device 0's default pool (release threshold 0):
 *                                         each request cuMemAllocAsync'd on a stream and
 *                                         held, the pool's CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT
 *                                         after each call and after a synchronisation; then
 *                                         all freed (cuMemFreeAsync), after a synchronisation,
 *                                         and after cuMemPoolTrimTo(0): how the driver grows a
 *                                         pool (interposer/src/pool.c's GS_POOL_CHUNK)
 *   gpubench poolfill MIB,MIB,...         the same pool filled with cuMemAllocAsync: each size
 *                                         (largest first) until refused, all held; the total,
 *                                         the view and the pool's size at the peak, then all
 *                                         freed and the pool trimmed (stops once the total
 *                                         passes the view's total: no cap)
 *                                         (graph, green and poolfill hold their peak for
 *                                         250 ms, so that the parent's outside NVML watch sees it)
 *   gpubench arrays                       one cuArray3DCreate_v2 array each of float x 4,
 *                                         BC1_UNORM, BC7_UNORM (4096 x 4096 texels) and NV12
 *                                         (3840 x 2160), all held to the end: cuMemGetInfo's
 *                                         used bytes before and after each creation (without the
 *                                         library the driver's own figure, with it the charge),
 *                                         the refusals, then after all are destroyed
 *   gpubench stackgrow FREE_MIB|-         a PTX module (JIT-compiled by the driver) of two
 *                                         kernels: gpubench_stack, 16 KiB of local memory per
 *                                         thread (an array indexed at run time), and
 *                                         gpubench_lean, none; device memory filled with 64 MiB
 *                                         cuMemAllocs until the view's free memory is under
 *                                         FREE_MIB + 64 ("-": no fill), then gpubench_stack
 *                                         launched once (1 x 32 threads) and gpubench_lean after
 *                                         it: their results, CU_LIMIT_STACK_SIZE before and
 *                                         after, the local sizes, MULTIPROCESSOR_COUNT x
 *                                         MAX_THREADS_PER_MULTIPROCESSOR and the view's used
 *                                         memory at each step (the stack the driver grows at a
 *                                         launch: interposer/README.md "Near the cap: a
 *                                         launch's stack"); the fill held throughout
 *
 * Benchmarks print one line "RESULT {json}"; errors go to stderr with exit status 2.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct {
    char reserved[64];
} CUipcMemHandle;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUarray_st *CUarray;
typedef struct {
    size_t Width, Height, Depth;
    int Format; /* CUarray_format */
    unsigned int NumChannels, Flags;
} CUDA_ARRAY3D_DESCRIPTOR;
typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} CUmemLocation;
typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType, gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} CUmemAccessDesc;

/* name, return type, parameters: the only driver calls this program makes. */
#define DRIVER_CALLS(X)                                                                  \
    X(CUresult, cuInit, (unsigned int flags))                                            \
    X(CUresult, cuDeviceGet, (CUdevice * dev, int ordinal))                              \
    X(CUresult, cuDeviceGetName, (char *name, int len, CUdevice dev))                    \
    X(CUresult, cuDeviceTotalMem_v2, (size_t * bytes, CUdevice dev))                     \
    X(CUresult, cuDevicePrimaryCtxRetain, (CUcontext * ctx, CUdevice dev))               \
    X(CUresult, cuCtxSetCurrent, (CUcontext ctx))                                        \
    X(CUresult, cuCtxSynchronize, (void))                                                \
    X(CUresult, cuMemGetInfo_v2, (size_t * free_bytes, size_t * total_bytes))            \
    X(CUresult, cuMemAlloc_v2, (CUdeviceptr * ptr, size_t bytes))                        \
    X(CUresult, cuMemAllocManaged, (CUdeviceptr * ptr, size_t bytes, unsigned int flags)) \
    X(CUresult, cuMemFree_v2, (CUdeviceptr ptr))                                         \
    X(CUresult, cuModuleLoadData, (CUmodule * mod, const void *image))                   \
    X(CUresult, cuModuleGetFunction, (CUfunction * fn, CUmodule mod, const char *name))  \
    X(CUresult, cuLaunchKernel,                                                          \
      (CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,   \
       unsigned bz, unsigned shared, CUstream stream, void **params, void **extra))      \
    X(CUresult, cuStreamCreate, (CUstream * stream, unsigned int flags))                 \
    X(CUresult, cuStreamSynchronize, (CUstream stream))                                  \
    X(CUresult, cuStreamBeginCapture_v2, (CUstream stream, int mode))                    \
    X(CUresult, cuStreamEndCapture, (CUstream stream, CUgraph * graph))                  \
    X(CUresult, cuMemAllocAsync, (CUdeviceptr * ptr, size_t bytes, CUstream stream))     \
    X(CUresult, cuMemFreeAsync, (CUdeviceptr ptr, CUstream stream))                      \
    X(CUresult, cuMemsetD8Async, (CUdeviceptr ptr, unsigned char v, size_t n, CUstream s)) \
    X(CUresult, cuGraphInstantiateWithFlags, (CUgraphExec * exec, CUgraph g, unsigned long long f)) \
    X(CUresult, cuGraphLaunch, (CUgraphExec exec, CUstream stream))                      \
    X(CUresult, cuGraphExecDestroy, (CUgraphExec exec))                                  \
    X(CUresult, cuGraphDestroy, (CUgraph g))                                             \
    X(CUresult, cuDeviceGraphMemTrim, (CUdevice dev))                                    \
    X(CUresult, cuDeviceGetDefaultMemPool, (CUmemoryPool * pool, CUdevice dev))          \
    X(CUresult, cuMemPoolGetAttribute, (CUmemoryPool pool, int attr, void *value))       \
    X(CUresult, cuMemPoolSetAttribute, (CUmemoryPool pool, int attr, void *value))       \
    X(CUresult, cuMemPoolTrimTo, (CUmemoryPool pool, size_t keep))                       \
    X(CUresult, cuArray3DCreate_v2, (CUarray * array, const CUDA_ARRAY3D_DESCRIPTOR *desc)) \
    X(CUresult, cuArrayDestroy, (CUarray array))                                         \
    X(CUresult, cuGetErrorName, (CUresult err, const char **name))                     \
    X(CUresult, cuDeviceGetAttribute, (int *value, int attr, CUdevice dev))              \
    X(CUresult, cuFuncGetAttribute, (int *value, int attr, CUfunction fn))               \
    X(CUresult, cuCtxGetLimit, (size_t * value, int limit))

/* Needed by serve's ipcget / ipcopen and vmmexport / vmmimport only: a driver without them
 * still runs the others, and those commands answer CUDA_ERROR_NOT_FOUND. */
#define OPTIONAL_CALLS(X)                                                                \
    X(CUresult, cuIpcGetMemHandle, (CUipcMemHandle * handle, CUdeviceptr ptr))           \
    X(CUresult, cuIpcOpenMemHandle_v2, (CUdeviceptr * ptr, CUipcMemHandle handle, unsigned flags)) \
    X(CUresult, cuIpcCloseMemHandle, (CUdeviceptr ptr))                                  \
    X(CUresult, cuMemGetAllocationGranularity, (size_t * g, const CUmemAllocationProp *prop, int option)) \
    X(CUresult, cuMemCreate, (CUmemGenericAllocationHandle * h, size_t size, const CUmemAllocationProp *prop, \
                              unsigned long long flags))                                 \
    X(CUresult, cuMemRelease, (CUmemGenericAllocationHandle h))                          \
    X(CUresult, cuMemAddressReserve, (CUdeviceptr * ptr, size_t size, size_t align, CUdeviceptr addr, \
                                      unsigned long long flags))                         \
    X(CUresult, cuMemAddressFree, (CUdeviceptr ptr, size_t size))                        \
    X(CUresult, cuMemMap, (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, \
                           unsigned long long flags))                                    \
    X(CUresult, cuMemUnmap, (CUdeviceptr ptr, size_t size))                              \
    X(CUresult, cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)) \
    X(CUresult, cuMemExportToShareableHandle, (void *shared, CUmemGenericAllocationHandle h, int type, \
                                               unsigned long long flags))               \
    X(CUresult, cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle * h, void *os_handle, int type))

#ifdef GPUBENCH_DLOPEN
#define DECLARE(ret, name, params) static ret(*p_##name) params;
DRIVER_CALLS(DECLARE)
OPTIONAL_CALLS(DECLARE)
#define CALL(name) p_##name
#define HAVE(name) (p_##name != NULL)
static void resolve_driver(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == NULL) {
        fprintf(stderr, "ERROR dlopen libcuda.so.1: %s\n", dlerror());
        exit(2);
    }
#define RESOLVE(ret, name, params)                                  \
    p_##name = (ret(*) params)dlsym(lib, #name);                    \
    if (p_##name == NULL) {                                         \
        fprintf(stderr, "ERROR dlsym %s: not found\n", #name);      \
        exit(2);                                                    \
    }
    DRIVER_CALLS(RESOLVE)
#define RESOLVE_OPTIONAL(ret, name, params) p_##name = (ret(*) params)dlsym(lib, #name);
    OPTIONAL_CALLS(RESOLVE_OPTIONAL)
}
#else
#define DECLARE(ret, name, params) extern ret name params;
DRIVER_CALLS(DECLARE)
OPTIONAL_CALLS(DECLARE)
#define CALL(name) name
#define HAVE(name) 1
static void resolve_driver(void) {}
#endif

/* The empty kernel, for the oldest target CUDA 13 supports, then for Hopper itself. */
#define EMPTY_PTX(version, target)                                                       \
    ".version " version "\n.target " target "\n.address_size 64\n"                       \
    ".visible .entry gpubench_empty()\n{\n\tret;\n}\n"
static const char *const EMPTY_PTXS[] = {EMPTY_PTX("7.0", "sm_75"), EMPTY_PTX("7.8", "sm_90")};

static const char *error_name(CUresult err)
{
    const char *name = NULL;
    if (CALL(cuGetErrorName)(err, &name) != 0 || name == NULL)
        return "CUDA_ERROR_UNKNOWN_CODE";
    return name;
}

static void check(CUresult err, const char *what)
{
    if (err != 0) {
        fprintf(stderr, "ERROR %s %d %s\n", what, err, error_name(err));
        exit(2);
    }
}

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int compare_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *values, int n)
{
    qsort(values, (size_t)n, sizeof(double), compare_double);
    return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2.0;
}

static void print_list(const char *key, const double *values, int n)
{
    printf("\"%s\": [", key);
    for (int i = 0; i < n; i++)
        printf("%s%.1f", i ? ", " : "", values[i]);
    printf("]");
}

static void print_ints(const char *key, const int *values, int n)
{
    printf("\"%s\": [", key);
    for (int i = 0; i < n; i++)
        printf("%s%d", i ? ", " : "", values[i]);
    printf("]");
}

static CUdevice open_device(void)
{
    CUdevice dev;
    CUcontext ctx;
    resolve_driver();
    check(CALL(cuInit)(0), "cuInit");
    check(CALL(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    check(CALL(cuDevicePrimaryCtxRetain)(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(CALL(cuCtxSetCurrent)(ctx), "cuCtxSetCurrent");
    return dev;
}

static int cmd_info(void)
{
    CUdevice dev = open_device();
    size_t free_bytes = 0, total_bytes = 0, device_total = 0;
    char name[128] = {0};
    check(CALL(cuMemGetInfo_v2)(&free_bytes, &total_bytes), "cuMemGetInfo_v2");
    check(CALL(cuDeviceTotalMem_v2)(&device_total, dev), "cuDeviceTotalMem_v2");
    check(CALL(cuDeviceGetName)(name, (int)sizeof(name) - 1, dev), "cuDeviceGetName");
    printf("RESULT {\"free\": %zu, \"total\": %zu, \"device_total\": %zu, \"name\": \"%s\"}\n",
           free_bytes, total_bytes, device_total, name);
    return 0;
}

enum { MAX_HELD = 4096 };

/* "ipc HEX" for allocation ptr: the handle as 128 hex digits */
static void print_ipc(CUdeviceptr ptr)
{
    CUipcMemHandle handle;
    CUresult err = HAVE(cuIpcGetMemHandle) ? CALL(cuIpcGetMemHandle)(&handle, ptr) : 500;
    if (err != 0) {
        printf("err %d %s\n", err, error_name(err));
        return;
    }
    printf("ipc ");
    for (size_t i = 0; i < sizeof(handle.reserved); i++)
        printf("%02x", (unsigned char)handle.reserved[i]);
    printf("\n");
}

/* 128 hex digits back into a handle; 0 on malformed text */
static int parse_ipc(const char *hex, CUipcMemHandle *handle)
{
    for (size_t i = 0; i < sizeof(handle->reserved); i++) {
        unsigned byte;
        if (sscanf(hex + 2 * i, "%2x", &byte) != 1)
            return 0;
        handle->reserved[i] = (char)byte;
    }
    return 1;
}

/* Empty kernels in batches of 1,000, each batch waited for, until `ns` have passed. */
static CUresult spin(double ns, unsigned long long *launches)
{
    static CUfunction fn;
    CUresult err = 0;
    if (!fn) {
        CUmodule mod;
        err = 1;
        for (size_t i = 0; err != 0 && i < sizeof(EMPTY_PTXS) / sizeof(EMPTY_PTXS[0]); i++)
            err = CALL(cuModuleLoadData)(&mod, EMPTY_PTXS[i]);
        if (err == 0)
            err = CALL(cuModuleGetFunction)(&fn, mod, "gpubench_empty");
        if (err != 0)
            return err;
    }
    for (double t0 = now_ns(); now_ns() - t0 < ns;) {
        for (int i = 0; i < 1000 && err == 0; i++)
            err = CALL(cuLaunchKernel)(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        if (err == 0)
            err = CALL(cuCtxSynchronize)();
        if (err != 0)
            return err;
        *launches += 1000;
    }
    return 0;
}

/* ---- serve's VMM sharing: a cuMemCreate'd allocation passed to another process as a file
 * descriptor over a Unix socket (SCM_RIGHTS), as NCCL's and PyTorch's sharing do ---------- */

struct vmm_held {
    CUmemGenericAllocationHandle handle;
    size_t size;
};

/* BYTES rounded up to the granularity, reserved, mapped from `handle` and made accessible */
static CUresult vmm_map(CUmemGenericAllocationHandle handle, size_t bytes, CUdeviceptr *ptr)
{
    CUmemAccessDesc access = {{1, 0}, 3};
    CUresult err = CALL(cuMemAddressReserve)(ptr, bytes, 0, 0, 0);
    if (err == 0 && (err = CALL(cuMemMap)(*ptr, bytes, 0, handle, 0)) != 0)
        CALL(cuMemAddressFree)(*ptr, bytes);
    else if (err == 0 && (err = CALL(cuMemSetAccess)(*ptr, bytes, &access, 1)) != 0) {
        CALL(cuMemUnmap)(*ptr, bytes);
        CALL(cuMemAddressFree)(*ptr, bytes);
    }
    return err;
}

static CUresult vmm_free(CUdeviceptr ptr, const struct vmm_held *held)
{
    CUresult err = CALL(cuMemUnmap)(ptr, held->size);
    CUresult freed = CALL(cuMemAddressFree)(ptr, held->size);
    CUresult released = CALL(cuMemRelease)(held->handle);
    return err ? err : freed ? freed : released;
}

static int vmm_socket(const char *path, struct sockaddr_un *addr)
{
    memset(addr, 0, sizeof(*addr));
    addr->sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(addr->sun_path))
        return -1;
    strcpy(addr->sun_path, path);
    return socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
}

struct vmm_offer {
    int listener, fd;
};

/* the exporter's side: one connection, one descriptor, then both closed */
static void *vmm_offer_once(void *arg)
{
    struct vmm_offer *offer = arg;
    int conn = accept(offer->listener, NULL, NULL);
    if (conn >= 0) {
        char byte = 'v', control[CMSG_SPACE(sizeof(int))];
        struct iovec iov = {&byte, 1};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof(control)};
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cmsg), &offer->fd, sizeof(int));
        if (sendmsg(conn, &msg, 0) < 0)
            perror("gpubench: sendmsg");
        close(conn);
    }
    close(offer->listener);
    close(offer->fd);
    free(offer);
    return NULL;
}

static CUresult vmm_export(size_t bytes, const char *path, struct vmm_held *held, CUdeviceptr *ptr)
{
    CUmemAllocationProp prop = {.type = 1, .requestedHandleTypes = 1, .location = {1, 0}};
    size_t gran = 0;
    int fd = -1;
    struct sockaddr_un addr;
    if (!HAVE(cuMemCreate) || !HAVE(cuMemExportToShareableHandle))
        return 500; /* CUDA_ERROR_NOT_FOUND */
    CUresult err = CALL(cuMemGetAllocationGranularity)(&gran, &prop, 0);
    if (err != 0)
        return err;
    bytes = (bytes + gran - 1) / gran * gran;
    if ((err = CALL(cuMemCreate)(&held->handle, bytes, &prop, 0)) != 0)
        return err;
    held->size = bytes;
    if ((err = vmm_map(held->handle, bytes, ptr)) != 0 ||
        (err = CALL(cuMemExportToShareableHandle)(&fd, held->handle, 1, 0)) != 0) {
        CALL(cuMemRelease)(held->handle);
        return err;
    }
    struct vmm_offer *offer = malloc(sizeof(*offer));
    int listener = vmm_socket(path, &addr);
    pthread_t thread;
    if (offer != NULL && listener >= 0 && bind(listener, (struct sockaddr *)&addr, sizeof(addr)) == 0 &&
        listen(listener, 1) == 0) {
        offer->listener = listener;
        offer->fd = fd;
        if (pthread_create(&thread, NULL, vmm_offer_once, offer) == 0) {
            pthread_detach(thread);
            return 0;
        }
    }
    perror("gpubench: vmmexport socket");
    free(offer);
    if (listener >= 0)
        close(listener);
    close(fd);
    vmm_free(*ptr, held);
    return 304; /* CUDA_ERROR_OPERATING_SYSTEM */
}

static CUresult vmm_import(const char *path, size_t bytes, struct vmm_held *held, CUdeviceptr *ptr)
{
    struct sockaddr_un addr;
    char byte, control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof(control)};
    int fd = -1, sock = vmm_socket(path, &addr);
    if (!HAVE(cuMemImportFromShareableHandle))
        return 500;
    if (sock < 0 || connect(sock, (struct sockaddr *)&addr, sizeof(addr)) != 0 || recvmsg(sock, &msg, 0) != 1) {
        perror("gpubench: vmmimport socket");
        if (sock >= 0)
            close(sock);
        return 304;
    }
    close(sock);
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    if (cmsg == NULL || cmsg->cmsg_type != SCM_RIGHTS)
        return 304;
    memcpy(&fd, CMSG_DATA(cmsg), sizeof(int));
    CUresult err = CALL(cuMemImportFromShareableHandle)(&held->handle, (void *)(intptr_t)fd, 1);
    close(fd); /* the imported handle keeps the allocation */
    if (err != 0)
        return err;
    held->size = bytes;
    if ((err = vmm_map(held->handle, bytes, ptr)) != 0)
        CALL(cuMemRelease)(held->handle);
    return err;
}


static int cmd_serve(void)
{
    static CUdeviceptr held[MAX_HELD];
    static char imported[MAX_HELD]; /* 1: a CUDA IPC mapping; 2: a VMM mapping (vmm[]) */
    static struct vmm_held vmm[MAX_HELD];
    char line[512], hex[160], path[200];
    int count = 0;
    open_device();
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    while (fgets(line, sizeof(line), stdin) != NULL) {
        unsigned long long arg = 0, bytes = 0;
        size_t free_bytes = 0, total_bytes = 0;
        if (sscanf(line, "alloc %llu", &arg) == 1 || sscanf(line, "managed %llu", &arg) == 1) {
            CUdeviceptr ptr = 0;
            CUresult err = count >= MAX_HELD ? 2
                           : line[0] == 'a' ? CALL(cuMemAlloc_v2)(&ptr, (size_t)arg)
                                            : CALL(cuMemAllocManaged)(&ptr, (size_t)arg, 1 /* CU_MEM_ATTACH_GLOBAL */);
            if (err == 0) {
                held[count] = ptr;
                printf("ok %d\n", count++);
            } else {
                printf("err %d %s\n", err, error_name(err));
            }
        } else if (sscanf(line, "free %llu", &arg) == 1) {
            CUresult err = 1;
            if (arg < (unsigned long long)count && held[arg] != 0) {
                if (!imported[arg])
                    err = CALL(cuMemFree_v2)(held[arg]);
                else if (imported[arg] == 2)
                    err = vmm_free(held[arg], &vmm[arg]);
                else
                    err = HAVE(cuIpcCloseMemHandle) ? CALL(cuIpcCloseMemHandle)(held[arg]) : 500;
                held[arg] = 0;
            }
            if (err == 0)
                printf("ok\n");
            else
                printf("err %d %s\n", err, error_name(err));
        } else if (sscanf(line, "ipcget %llu", &arg) == 1) {
            if (arg < (unsigned long long)count && held[arg] != 0 && !imported[arg])
                print_ipc(held[arg]);
            else
                printf("err 1 CUDA_ERROR_INVALID_VALUE\n");
        } else if (sscanf(line, "ipcopen %159s", hex) == 1) {
            CUipcMemHandle handle;
            CUdeviceptr ptr = 0;
            CUresult err = 1; /* CUDA_ERROR_INVALID_VALUE */
            if (!HAVE(cuIpcOpenMemHandle_v2))
                err = 500; /* CUDA_ERROR_NOT_FOUND */
            else if (strlen(hex) == 2 * sizeof(handle.reserved) && parse_ipc(hex, &handle) && count < MAX_HELD)
                err = CALL(cuIpcOpenMemHandle_v2)(&ptr, handle, 1 /* lazy peer access */);
            if (err == 0) {
                held[count] = ptr;
                imported[count] = 1;
                printf("ok %d\n", count++);
            } else {
                printf("err %d %s\n", err, error_name(err));
            }
        } else if (sscanf(line, "touch %llu %llu", &arg, &bytes) == 2) {
            CUresult err = 1; /* CUDA_ERROR_INVALID_VALUE */
            if (arg < (unsigned long long)count && held[arg] != 0) {
                err = CALL(cuMemsetD8Async)(held[arg], 1, (size_t)bytes, NULL);
                if (err == 0) err = CALL(cuCtxSynchronize)();
            }
            if (err == 0)
                printf("ok\n");
            else
                printf("err %d %s\n", err, error_name(err));
        } else if (sscanf(line, "vmmexport %llu %199s", &arg, path) == 2 ||
                   sscanf(line, "vmmimport %199s %llu", path, &arg) == 2) {
            CUdeviceptr ptr = 0;
            CUresult err = 2; /* CUDA_ERROR_OUT_OF_MEMORY: no slot left */
            if (count < MAX_HELD)
                err = line[3] == 'e' ? vmm_export((size_t)arg, path, &vmm[count], &ptr)
                                     : vmm_import(path, (size_t)arg, &vmm[count], &ptr);
            if (err == 0) {
                held[count] = ptr;
                imported[count] = 2;
                printf("ok %d\n", count++);
            } else {
                printf("err %d %s\n", err, error_name(err));
            }
        } else if (sscanf(line, "spin %llu", &arg) == 1) {
            unsigned long long launches = 0;
            CUresult err = spin((double)arg * 1e6, &launches);
            if (err == 0)
                printf("ok %llu\n", launches);
            else
                printf("err %d %s\n", err, error_name(err));
        } else if (strncmp(line, "info", 4) == 0) {
            CUresult err = CALL(cuMemGetInfo_v2)(&free_bytes, &total_bytes);
            if (err == 0)
                printf("info %zu %zu\n", free_bytes, total_bytes);
            else
                printf("err %d %s\n", err, error_name(err));
        } else if (strncmp(line, "quit", 4) == 0) {
            printf("bye\n");
            fflush(stdout);
            return 0; /* allocations are left for the exit path to return */
        } else {
            printf("err -1 bad-command\n");
        }
        fflush(stdout);
    }
    return 0;
}

static int cmd_launch(int launches, int reps, int batch)
{
    CUmodule mod;
    CUfunction fn;
    double cpu[64], sat[64];
    open_device();
    CUresult loaded = 1;
    for (size_t i = 0; loaded != 0 && i < sizeof(EMPTY_PTXS) / sizeof(EMPTY_PTXS[0]); i++)
        loaded = CALL(cuModuleLoadData)(&mod, EMPTY_PTXS[i]);
    check(loaded, "cuModuleLoadData");
    check(CALL(cuModuleGetFunction)(&fn, mod, "gpubench_empty"), "cuModuleGetFunction");
    if (reps > 64)
        reps = 64;
    for (int i = 0; i < 2000; i++)
        check(CALL(cuLaunchKernel)(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), "cuLaunchKernel");
    check(CALL(cuCtxSynchronize)(), "cuCtxSynchronize");
    for (int r = 0; r < reps; r++) {
        /* CPU call cost: batches small enough never to fill the launch queue. */
        double spent = 0;
        for (int done = 0; done < launches; done += batch) {
            double t0 = now_ns();
            for (int i = 0; i < batch; i++)
                check(CALL(cuLaunchKernel)(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL),
                      "cuLaunchKernel");
            spent += now_ns() - t0;
            check(CALL(cuCtxSynchronize)(), "cuCtxSynchronize");
        }
        cpu[r] = spent / launches;
        /* Saturated: a flood of launches, queue full, until the GPU has run them all. */
        double t0 = now_ns();
        for (int i = 0; i < launches; i++)
            check(CALL(cuLaunchKernel)(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL),
                  "cuLaunchKernel");
        check(CALL(cuCtxSynchronize)(), "cuCtxSynchronize");
        sat[r] = (now_ns() - t0) / launches;
    }
    printf("RESULT {");
    print_list("cpu_ns_reps", cpu, reps);
    printf(", ");
    print_list("sat_ns_reps", sat, reps);
    double cpu_med = median(cpu, reps), sat_med = median(sat, reps);
    printf(", \"cpu_ns\": %.1f, \"sat_ns\": %.1f}\n", cpu_med, sat_med);
    return 0;
}

static int cmd_allocfree(size_t bytes, int pairs, int reps)
{
    double per_pair[64];
    CUdeviceptr ptr;
    open_device();
    if (reps > 64)
        reps = 64;
    for (int i = 0; i < 200; i++) {
        check(CALL(cuMemAlloc_v2)(&ptr, bytes), "cuMemAlloc_v2");
        check(CALL(cuMemFree_v2)(ptr), "cuMemFree_v2");
    }
    for (int r = 0; r < reps; r++) {
        double t0 = now_ns();
        for (int i = 0; i < pairs; i++) {
            check(CALL(cuMemAlloc_v2)(&ptr, bytes), "cuMemAlloc_v2");
            check(CALL(cuMemFree_v2)(ptr), "cuMemFree_v2");
        }
        per_pair[r] = (now_ns() - t0) / pairs;
    }
    printf("RESULT {");
    print_list("pair_ns_reps", per_pair, reps);
    printf(", \"pair_ns\": %.1f}\n", median(per_pair, reps));
    return 0;
}

/* Memsets alone (cuMemsetD8Async of MIB on the legacy stream, waited for every 16) for MS
 * ms: how many, and the bytes per second, while the parent watches NVML's utilisation. */
static int cmd_memset(size_t mib, double ms)
{
    CUdeviceptr ptr;
    size_t bytes = mib << 20;
    unsigned long long n = 0;
    open_device();
    check(CALL(cuMemAlloc_v2)(&ptr, bytes), "cuMemAlloc_v2");
    double t0 = now_ns();
    while (now_ns() - t0 < ms * 1e6) {
        for (int i = 0; i < 16; i++, n++)
            check(CALL(cuMemsetD8Async)(ptr, (unsigned char)n, bytes, NULL), "cuMemsetD8Async");
        check(CALL(cuCtxSynchronize)(), "cuCtxSynchronize");
    }
    double s = (now_ns() - t0) / 1e9;
    check(CALL(cuMemFree_v2)(ptr), "cuMemFree_v2");
    printf("RESULT {\"memsets\": %llu, \"mib\": %zu, \"seconds\": %.3f, \"gb_per_s\": %.1f}\n", n, mib, s,
           (double)n * (double)bytes / s / 1e9);
    return 0;
}

/* Keep the moment's usage for a while: the parent's outside watch polls NVML every few ms,
 * and a peak that lasts microseconds would pass between two of its samples. */
static void hold_peak(void)
{
    struct timespec ts = {0, 250 * 1000 * 1000};
    nanosleep(&ts, NULL);
}

static double used_mib(void)
{
    size_t free_bytes = 0, total = 0;
    check(CALL(cuMemGetInfo_v2)(&free_bytes, &total), "cuMemGetInfo_v2");
    return (double)(total - free_bytes) / (1 << 20);
}

/* Capture alloc + memset + free of `bytes`, instantiate, launch: the launch's result. */
static CUresult graph_run(CUstream s, size_t bytes, double *after_inst, double *after_launch)
{
    CUgraph g = NULL;
    CUgraphExec e = NULL;
    CUdeviceptr p = 0;
    check(CALL(cuStreamBeginCapture_v2)(s, 2 /* relaxed */), "cuStreamBeginCapture_v2");
    CUresult rc = CALL(cuMemAllocAsync)(&p, bytes, s);
    if (rc == 0) rc = CALL(cuMemsetD8Async)(p, 1, bytes, s);
    if (rc == 0) rc = CALL(cuMemFreeAsync)(p, s);
    CUresult end = CALL(cuStreamEndCapture)(s, &g);
    check(rc ? rc : end, "capture");
    check(CALL(cuGraphInstantiateWithFlags)(&e, g, 0), "cuGraphInstantiateWithFlags");
    if (after_inst) *after_inst = used_mib();
    rc = CALL(cuGraphLaunch)(e, s);
    if (rc == 0) check(CALL(cuStreamSynchronize)(s), "cuStreamSynchronize");
    if (after_launch) *after_launch = used_mib();
    CALL(cuGraphExecDestroy)(e);
    CALL(cuGraphDestroy)(g);
    return rc;
}

static int cmd_graph(size_t mib)
{
    CUdevice dev = open_device();
    CUstream s = NULL;
    check(CALL(cuStreamCreate)(&s, 1 /* non-blocking */), "cuStreamCreate");
    double before = used_mib(), inst = 0, launched = 0;
    CUresult rc = graph_run(s, mib << 20, &inst, &launched);
    CUresult again = graph_run(s, mib << 20, NULL, NULL);
    double replayed = used_mib();
    hold_peak(); /* the graphs' memory, kept until the trim */
    check(CALL(cuDeviceGraphMemTrim)(dev), "cuDeviceGraphMemTrim");
    double trimmed = used_mib();
    size_t free_bytes = 0, total = 0;
    check(CALL(cuMemGetInfo_v2)(&free_bytes, &total), "cuMemGetInfo_v2");
    size_t big = free_bytes + ((size_t)1 << 30);
    double big_after = 0;
    CUresult big_rc = graph_run(s, big, NULL, &big_after);
    CALL(cuDeviceGraphMemTrim)(dev);
    printf("RESULT {\"launch_rc\": %d, \"again_rc\": %d, \"big_rc\": %d, \"big_mib\": %.1f, "
           "\"used_before\": %.1f, \"used_after_instantiate\": %.1f, \"used_after_launch\": %.1f, "
           "\"used_after_replay\": %.1f, \"used_after_trim\": %.1f, \"used_after_big\": %.1f, "
           "\"total_mib\": %.1f}\n",
           rc, again, big_rc, (double)big / (1 << 20), before, inst, launched, replayed, trimmed, big_after,
           (double)total / (1 << 20));
    return 0;
}

/* CUDA 2.x's memory entry points, which cuda.h no longer declares for 64-bit programs but the
 * driver still exports: looked up by name, so the build never depends on them */
typedef CUresult (*alloc32_fn)(unsigned int *ptr, unsigned int bytes);
typedef CUresult (*free32_fn)(unsigned int ptr);
typedef CUresult (*info32_fn)(unsigned int *free_bytes, unsigned int *total_bytes);
typedef CUresult (*ctx_create32_fn)(CUcontext *ctx, unsigned int flags, CUdevice dev);
typedef CUresult (*ctx_destroy32_fn)(CUcontext ctx);
typedef CUresult (*api_version_fn)(CUcontext ctx, unsigned int *version);
typedef CUresult (*get_current_fn)(CUcontext *ctx);

static size_t view_used(void)
{
    size_t free_bytes = 0, total_bytes = 0;
    check(CALL(cuMemGetInfo_v2)(&free_bytes, &total_bytes), "cuMemGetInfo_v2");
    return total_bytes - free_bytes;
}

static int cmd_legacy(size_t mib)
{
    open_device();
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    alloc32_fn alloc32 = lib ? (alloc32_fn)dlsym(lib, "cuMemAlloc") : NULL;
    free32_fn free32 = lib ? (free32_fn)dlsym(lib, "cuMemFree") : NULL;
    info32_fn info32 = lib ? (info32_fn)dlsym(lib, "cuMemGetInfo") : NULL;
    if (!alloc32 || !free32 || !info32) {
        printf("RESULT {\"exported\": false}\n");
        return 0;
    }
    unsigned int ptr = 0, big_ptr = 0, free32_bytes = 0, total32 = 0;
    size_t before = view_used();
    CUresult rc = alloc32(&ptr, (unsigned int)(mib << 20));
    size_t held = view_used();
    CUresult big_rc = alloc32(&big_ptr, 3u << 30);
    size_t with_big = view_used();
    CUresult info_rc = info32(&free32_bytes, &total32);
    CUresult free_rc = rc == 0 ? free32(ptr) : -1;
    CUresult big_free_rc = big_rc == 0 ? free32(big_ptr) : -1;
    size_t after = view_used();
    /* facts for the record: the primary context's API version, and in a context made by
     * CUDA 2.x's cuCtxCreate its version, a 64 MiB 32-bit allocation, the 32-bit view, and
     * whether 3.2's cuMemGetInfo_v2 and cuMemFree_v2 are accepted there */
    ctx_create32_fn create32 = (ctx_create32_fn)dlsym(lib, "cuCtxCreate");
    ctx_destroy32_fn destroy32 = (ctx_destroy32_fn)dlsym(lib, "cuCtxDestroy");
    api_version_fn api_version = (api_version_fn)dlsym(lib, "cuCtxGetApiVersion");
    get_current_fn get_current = (get_current_fn)dlsym(lib, "cuCtxGetCurrent");
    CUcontext primary = NULL, old_ctx = NULL;
    unsigned int primary_api = 0, old_api = 0, old_ptr = 0, old_free = 0, old_total = 0;
    CUresult create_rc = -1, old_alloc_rc = -1, old_info_rc = -1, v2_info_rc = -1, v2_free_rc = -1,
             v1_free_rc = -1, destroy_rc = -1;
    size_t v2_free = 0, v2_total = 0;
    if (get_current && api_version && get_current(&primary) == 0) api_version(primary, &primary_api);
    if (create32 && destroy32 && api_version) {
        create_rc = create32(&old_ctx, 0, 0);
        if (create_rc == 0) {
            api_version(old_ctx, &old_api);
            old_alloc_rc = alloc32(&old_ptr, 64u << 20);
            old_info_rc = info32(&old_free, &old_total);
            v2_info_rc = CALL(cuMemGetInfo_v2)(&v2_free, &v2_total);
            if (old_alloc_rc == 0) {
                v2_free_rc = CALL(cuMemFree_v2)(old_ptr);
                if (v2_free_rc != 0) v1_free_rc = free32(old_ptr);
            }
            destroy_rc = destroy32(old_ctx);
            CALL(cuCtxSetCurrent)(primary);
        }
    }
    printf("RESULT {\"exported\": true, \"alloc_rc\": %d, \"ptr\": %u, \"before\": %zu, \"held\": %zu, "
           "\"big_rc\": %d, \"with_big\": %zu, \"info_rc\": %d, \"free32\": %u, \"total32\": %u, "
           "\"free_rc\": %d, \"big_free_rc\": %d, \"after\": %zu, \"primary_api\": %u, "
           "\"create_rc\": %d, \"old_api\": %u, \"old_alloc_rc\": %d, \"old_ptr\": %u, "
           "\"old_info_rc\": %d, \"old_free32\": %u, \"old_total32\": %u, \"v2_info_rc\": %d, "
           "\"v2_free_rc\": %d, \"v1_free_rc\": %d, \"destroy_rc\": %d}\n",
           rc, ptr, before, held, big_rc, with_big, info_rc, free32_bytes, total32, free_rc, big_free_rc, after,
           primary_api, create_rc, old_api, old_alloc_rc, old_ptr, old_info_rc, old_free, old_total, v2_info_rc,
           v2_free_rc, v1_free_rc, destroy_rc);
    return 0;
}

/* Green contexts: the entry points and the one struct this program passes whole (opaque:
 * cuda.h's CUdevResource is 144 bytes on CUDA 13.0; the buffer leaves room for more). */
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUdevResourceDesc_st *CUdevResourceDesc;
typedef CUresult (*get_resource_fn)(CUdevice dev, void *resource, int type);
typedef CUresult (*generate_desc_fn)(CUdevResourceDesc *desc, void *resources, unsigned int n);
typedef CUresult (*green_create_fn)(CUgreenCtx *green, CUdevResourceDesc desc, CUdevice dev, unsigned int flags);
typedef CUresult (*green_ctx_fn)(CUcontext *ctx, CUgreenCtx green);
typedef CUresult (*green_destroy_fn)(CUgreenCtx green);

static int cmd_green(size_t mib)
{
    resolve_driver();
    check(CALL(cuInit)(0), "cuInit");
    CUdevice dev;
    check(CALL(cuDeviceGet)(&dev, 0), "cuDeviceGet");
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    get_resource_fn get_resource = lib ? (get_resource_fn)dlsym(lib, "cuDeviceGetDevResource") : NULL;
    generate_desc_fn generate_desc = lib ? (generate_desc_fn)dlsym(lib, "cuDevResourceGenerateDesc") : NULL;
    green_create_fn create = lib ? (green_create_fn)dlsym(lib, "cuGreenCtxCreate") : NULL;
    green_ctx_fn as_ctx = lib ? (green_ctx_fn)dlsym(lib, "cuCtxFromGreenCtx") : NULL;
    green_destroy_fn destroy = lib ? (green_destroy_fn)dlsym(lib, "cuGreenCtxDestroy") : NULL;
    if (!get_resource || !generate_desc || !create || !as_ctx || !destroy) {
        printf("RESULT {\"exported\": false}\n");
        return 0;
    }
    static unsigned long long resource[512]; /* CU_DEV_RESOURCE_TYPE_SM: every SM of the device */
    CUdevResourceDesc desc = NULL;
    CUgreenCtx green = NULL;
    CUcontext ctx = NULL;
    CUresult rc = get_resource(dev, resource, 1);
    if (rc == 0) rc = generate_desc(&desc, resource, 1);
    if (rc == 0) rc = create(&green, desc, dev, 1 /* CU_GREEN_CTX_DEFAULT_STREAM */);
    if (rc == 0) rc = as_ctx(&ctx, green);
    if (rc == 0) rc = CALL(cuCtxSetCurrent)(ctx);
    if (rc != 0) {
        printf("RESULT {\"exported\": true, \"create_rc\": %d}\n", rc);
        return 0;
    }
    size_t free_bytes = 0, total = 0;
    double made = used_mib();
    CUdeviceptr p = 0, big = 0;
    CUresult alloc_rc = CALL(cuMemAlloc_v2)(&p, mib << 20);
    double held = used_mib();
    hold_peak();
    check(CALL(cuMemGetInfo_v2)(&free_bytes, &total), "cuMemGetInfo_v2");
    CUresult big_rc = CALL(cuMemAlloc_v2)(&big, free_bytes + ((size_t)1 << 30));
    double with_big = used_mib();
    if (big_rc == 0) CALL(cuMemFree_v2)(big);
    if (alloc_rc == 0) CALL(cuMemFree_v2)(p);
    double freed = used_mib();
    CALL(cuCtxSetCurrent)(NULL);
    CUresult destroy_rc = destroy(green);
    open_device(); /* the primary context made again: what the view holds then */
    double after = used_mib();
    printf("RESULT {\"exported\": true, \"create_rc\": 0, \"used_made\": %.1f, \"alloc_rc\": %d, "
           "\"used_held\": %.1f, \"big_rc\": %d, \"used_with_big\": %.1f, \"used_freed\": %.1f, "
           "\"destroy_rc\": %d, \"used_after\": %.1f, \"total_mib\": %.1f}\n",
           made, alloc_rc, held, big_rc, with_big, freed, destroy_rc, after, (double)total / (1 << 20));
    return 0;
}

/* Stream-ordered allocations from device 0's default pool (cuda.h's CUmemPool_attribute). */
enum { POOL_RELEASE_THRESHOLD = 4, POOL_RESERVED_MEM_CURRENT = 5, MAX_SIZES = 16 };

static double pool_reserved_mib(CUmemoryPool pool)
{
    unsigned long long bytes = 0;
    check(CALL(cuMemPoolGetAttribute)(pool, POOL_RESERVED_MEM_CURRENT, &bytes), "cuMemPoolGetAttribute");
    return (double)bytes / (1 << 20);
}

/* The device's default pool with release threshold 0 (the driver's default: a synchronisation
 * gives back what the pool's allocations do not use), on a stream of its own. */
static CUmemoryPool default_pool(CUdevice dev, CUstream *s)
{
    CUmemoryPool pool = NULL;
    unsigned long long zero = 0;
    check(CALL(cuDeviceGetDefaultMemPool)(&pool, dev), "cuDeviceGetDefaultMemPool");
    check(CALL(cuMemPoolSetAttribute)(pool, POOL_RELEASE_THRESHOLD, &zero), "cuMemPoolSetAttribute");
    check(CALL(cuStreamCreate)(s, 1 /* non-blocking */), "cuStreamCreate");
    return pool;
}

static int cmd_poolgrow(const double *mib, int n)
{
    CUstream s = NULL;
    CUdeviceptr held[MAX_SIZES];
    double at_call[MAX_SIZES], synced[MAX_SIZES];
    CUmemoryPool pool = default_pool(open_device(), &s);
    double start = pool_reserved_mib(pool);
    for (int i = 0; i < n; i++) {
        check(CALL(cuMemAllocAsync)(&held[i], (size_t)mib[i] << 20, s), "cuMemAllocAsync");
        at_call[i] = pool_reserved_mib(pool);
        check(CALL(cuStreamSynchronize)(s), "cuStreamSynchronize");
        synced[i] = pool_reserved_mib(pool);
    }
    for (int i = 0; i < n; i++)
        check(CALL(cuMemFreeAsync)(held[i], s), "cuMemFreeAsync");
    double freed = pool_reserved_mib(pool);
    check(CALL(cuStreamSynchronize)(s), "cuStreamSynchronize");
    double after_sync = pool_reserved_mib(pool);
    check(CALL(cuMemPoolTrimTo)(pool, 0), "cuMemPoolTrimTo");
    double after_trim = pool_reserved_mib(pool);
    printf("RESULT {");
    print_list("requests_mib", mib, n);
    printf(", \"start_mib\": %.1f, ", start);
    print_list("reserved_mib", at_call, n);
    printf(", ");
    print_list("synced_mib", synced, n);
    printf(", \"freed_mib\": %.1f, \"after_sync_mib\": %.1f, \"after_trim_mib\": %.1f}\n", freed, after_sync,
           after_trim);
    return 0;
}

static int cmd_poolfill(const double *mib, int n)
{
    static CUdeviceptr held[MAX_HELD];
    CUstream s = NULL;
    int counts[MAX_SIZES], refused[MAX_SIZES];
    size_t free_bytes = 0, total = 0, filled = 0;
    int count = 0, guard_hit = 0;
    CUmemoryPool pool = default_pool(open_device(), &s);
    check(CALL(cuMemGetInfo_v2)(&free_bytes, &total), "cuMemGetInfo_v2");
    double before = used_mib();
    for (int i = 0; i < n; i++) {
        size_t bytes = (size_t)mib[i] << 20;
        counts[i] = 0;
        refused[i] = -1; /* not refused: stopped by the guard (or MAX_HELD) */
        while (!guard_hit && count < MAX_HELD) {
            CUresult rc = CALL(cuMemAllocAsync)(&held[count], bytes, s);
            if (rc != 0) {
                refused[i] = rc;
                break;
            }
            count++;
            counts[i]++;
            filled += bytes;
            guard_hit = filled > total;
        }
    }
    check(CALL(cuStreamSynchronize)(s), "cuStreamSynchronize");
    double peak = used_mib(), reserved_peak = pool_reserved_mib(pool);
    hold_peak();
    for (int i = 0; i < count; i++)
        check(CALL(cuMemFreeAsync)(held[i], s), "cuMemFreeAsync");
    check(CALL(cuStreamSynchronize)(s), "cuStreamSynchronize");
    check(CALL(cuMemPoolTrimTo)(pool, 0), "cuMemPoolTrimTo");
    double after = used_mib(), reserved_after = pool_reserved_mib(pool);
    printf("RESULT {");
    print_list("steps_mib", mib, n);
    printf(", ");
    print_ints("counts", counts, n);
    printf(", ");
    print_ints("refused_rc", refused, n);
    printf(", \"total_mib\": %.1f, \"guard_hit\": %s, \"used_before\": %.1f, \"used_peak\": %.1f, "
           "\"reserved_peak_mib\": %.1f, \"used_after\": %.1f, \"reserved_after_mib\": %.1f, \"view_total_mib\": %.1f}\n",
           (double)filled / (1 << 20), guard_hit ? "true" : "false", before, peak, reserved_peak, after,
           reserved_after, (double)total / (1 << 20));
    return 0;
}

/* The arrays `arrays` makes (cuda.h's CUarray_format codes): a 4-channel float array, whose
 * size no one doubts, beside the formats whose size the library computes from its own reading
 * of their layout (interposer/src/arrays.c): block-compressed ones in 4 x 4 blocks of 8 bytes
 * (BC1) or 16 (BC7) with Width and Height counting texels, and NV12's two planes (1.5 bytes a
 * pixel); the channel counts are those the runtime's channel descriptors give them. */
static const struct {
    const char *name;
    int format;
    unsigned channels;
    size_t width, height;
} ARRAYS[] = {
    {"FLOAT_X4", 0x20, 4, 4096, 4096},  /* 256 MiB */
    {"BC1_UNORM", 0x91, 4, 4096, 4096}, /* 8 MiB, texels; 128 MiB were they blocks */
    {"BC7_UNORM", 0x9d, 4, 4096, 4096}, /* 16 MiB, texels; 256 MiB were they blocks */
    {"NV12", 0xb0, 3, 3840, 2160},      /* 11.9 MiB */
};
enum { N_ARRAYS = sizeof(ARRAYS) / sizeof(ARRAYS[0]) };

/* Each array is held until all are made, so that none is placed in memory another one gave
 * back; a small float array made and destroyed first takes whatever the driver sets up at a
 * process's first array. */
static int cmd_arrays(void)
{
    CUarray held[N_ARRAYS] = {0}, warm = NULL;
    CUresult rc[N_ARRAYS];
    long long grew[N_ARRAYS];
    open_device();
    CUDA_ARRAY3D_DESCRIPTOR d = {256, 256, 0, 0x20, 1, 0};
    CUresult warm_rc = CALL(cuArray3DCreate_v2)(&warm, &d);
    if (warm_rc == 0) check(CALL(cuArrayDestroy)(warm), "cuArrayDestroy");
    size_t start = view_used();
    for (int i = 0; i < N_ARRAYS; i++) {
        CUDA_ARRAY3D_DESCRIPTOR a = {ARRAYS[i].width, ARRAYS[i].height, 0, ARRAYS[i].format,
                                     ARRAYS[i].channels, 0};
        size_t before = view_used();
        rc[i] = CALL(cuArray3DCreate_v2)(&held[i], &a);
        grew[i] = (long long)view_used() - (long long)before;
    }
    size_t peak = view_used();
    for (int i = 0; i < N_ARRAYS; i++)
        if (rc[i] == 0) check(CALL(cuArrayDestroy)(held[i]), "cuArrayDestroy");
    check(CALL(cuCtxSynchronize)(), "cuCtxSynchronize");
    size_t end = view_used();
    printf("RESULT {\"warmup_rc\": %d, \"arrays\": [", warm_rc);
    for (int i = 0; i < N_ARRAYS; i++)
        printf("%s{\"name\": \"%s\", \"format\": %d, \"channels\": %u, \"width\": %zu, "
               "\"height\": %zu, \"rc\": %d, \"error\": \"%s\", \"grew\": %lld}",
               i ? ", " : "", ARRAYS[i].name, ARRAYS[i].format, ARRAYS[i].channels, ARRAYS[i].width,
               ARRAYS[i].height, rc[i], rc[i] ? error_name(rc[i]) : "CUDA_SUCCESS", grew[i]);
    printf("], \"used_start\": %zu, \"used_peak\": %zu, \"used_end\": %zu}\n", start, peak, end);
    return 0;
}

/* stackgrow's kernels: gpubench_stack writes all 4,096 words of a 16 KiB local array (values
 * that depend on a parameter) and reads one back at an index known only at run time, so the
 * array stays in local memory; gpubench_lean does nothing.  For the oldest target CUDA 13
 * supports, then for Hopper itself, as EMPTY_PTXS. */
#define STACK_PTX(version, target)                                                       \
    ".version " version "\n.target " target "\n.address_size 64\n"                       \
    ".visible .entry gpubench_stack(.param .u64 out, .param .u32 seed)\n{\n"             \
    "\t.local .align 4 .b8 buf[16384];\n"                                                 \
    "\t.reg .pred %p<2>;\n\t.reg .b32 %r<10>;\n\t.reg .b64 %rd<8>;\n"                    \
    "\tld.param.u64 %rd1, [out];\n\tld.param.u32 %r1, [seed];\n"                          \
    "\tmov.u64 %rd2, buf;\n\tmov.u32 %r2, %tid.x;\n\tmov.u32 %r3, 0;\n"                   \
    "LOOP:\n\tmul.wide.u32 %rd3, %r3, 4;\n\tadd.u64 %rd4, %rd2, %rd3;\n"                  \
    "\txor.b32 %r4, %r3, %r1;\n\tadd.u32 %r4, %r4, %r2;\n\tst.local.u32 [%rd4], %r4;\n"   \
    "\tadd.u32 %r3, %r3, 1;\n\tsetp.lt.u32 %p1, %r3, 4096;\n\t@%p1 bra LOOP;\n"           \
    "\tmad.lo.u32 %r5, %r1, 7, %r2;\n\tand.b32 %r5, %r5, 4095;\n"                         \
    "\tmul.wide.u32 %rd5, %r5, 4;\n\tadd.u64 %rd6, %rd2, %rd5;\n\tld.local.u32 %r6, [%rd6];\n" \
    "\tcvta.to.global.u64 %rd7, %rd1;\n\tmul.wide.u32 %rd5, %r2, 4;\n\tadd.u64 %rd7, %rd7, %rd5;\n" \
    "\tst.global.u32 [%rd7], %r6;\n\tret;\n}\n"                                           \
    ".visible .entry gpubench_lean()\n{\n\tret;\n}\n"
static const char *const STACK_PTXS[] = {STACK_PTX("7.0", "sm_75"), STACK_PTX("7.8", "sm_90")};

enum { LIMIT_STACK_SIZE = 0, FUNC_LOCAL_SIZE_BYTES = 3, ATTR_SM_COUNT = 16, ATTR_THREADS_PER_SM = 39,
       STACK_THREADS = 32 };

static size_t stack_limit(void)
{
    size_t v = 0;
    check(CALL(cuCtxGetLimit)(&v, LIMIT_STACK_SIZE), "cuCtxGetLimit");
    return v;
}

/* One launch of fn and the synchronisation after it: the launch's result, *synced the other's
 * (-1: not reached) */
static CUresult launch_once(CUfunction fn, void **params, unsigned threads, CUresult *synced)
{
    CUresult rc = CALL(cuLaunchKernel)(fn, 1, 1, 1, threads, 1, 1, 0, NULL, params, NULL);
    *synced = rc == 0 ? CALL(cuCtxSynchronize)() : -1;
    return rc;
}

static int cmd_stackgrow(long long free_mib)
{
    static CUdeviceptr held[MAX_HELD];
    CUdevice dev = open_device();
    CUmodule mod = NULL;
    CUfunction big = NULL, lean = NULL;
    CUresult load = 1;
    for (size_t i = 0; load != 0 && i < sizeof(STACK_PTXS) / sizeof(STACK_PTXS[0]); i++)
        load = CALL(cuModuleLoadData)(&mod, STACK_PTXS[i]);
    check(load, "cuModuleLoadData");
    check(CALL(cuModuleGetFunction)(&big, mod, "gpubench_stack"), "cuModuleGetFunction");
    check(CALL(cuModuleGetFunction)(&lean, mod, "gpubench_lean"), "cuModuleGetFunction");
    int big_local = 0, lean_local = 0, sms = 0, per_sm = 0;
    check(CALL(cuFuncGetAttribute)(&big_local, FUNC_LOCAL_SIZE_BYTES, big), "cuFuncGetAttribute");
    check(CALL(cuFuncGetAttribute)(&lean_local, FUNC_LOCAL_SIZE_BYTES, lean), "cuFuncGetAttribute");
    check(CALL(cuDeviceGetAttribute)(&sms, ATTR_SM_COUNT, dev), "cuDeviceGetAttribute");
    check(CALL(cuDeviceGetAttribute)(&per_sm, ATTR_THREADS_PER_SM, dev), "cuDeviceGetAttribute");
    CUdeviceptr out = 0;
    check(CALL(cuMemAlloc_v2)(&out, STACK_THREADS * sizeof(unsigned)), "cuMemAlloc_v2");
    double start = used_mib();
    /* the fill: 64 MiB at a time while the view has more than free_mib + 64 free */
    size_t chunk = (size_t)64 << 20, free_bytes = 0, total = 0;
    int count = 0;
    CUresult fill_rc = 0;
    while (free_mib >= 0 && count < MAX_HELD) {
        check(CALL(cuMemGetInfo_v2)(&free_bytes, &total), "cuMemGetInfo_v2");
        if (free_bytes < ((size_t)free_mib << 20) + chunk) break;
        fill_rc = CALL(cuMemAlloc_v2)(&held[count], chunk);
        if (fill_rc != 0) break;
        count++;
    }
    double filled = used_mib();
    hold_peak();
    size_t stack_before = stack_limit();
    unsigned seed = 3;
    void *params[] = {&out, &seed};
    CUresult big_sync = -1, lean_sync = -1;
    CUresult big_rc = launch_once(big, params, STACK_THREADS, &big_sync);
    double launched = used_mib();
    size_t stack_after = stack_limit();
    hold_peak(); /* what the launch grew, for the parent's outside watch */
    CUresult lean_rc = launch_once(lean, NULL, STACK_THREADS, &lean_sync);
    double after = used_mib();
    check(CALL(cuMemGetInfo_v2)(&free_bytes, &total), "cuMemGetInfo_v2");
    for (int i = 0; i < count; i++)
        check(CALL(cuMemFree_v2)(held[i]), "cuMemFree_v2");
    printf("RESULT {\"big_local\": %d, \"lean_local\": %d, \"sms\": %d, \"threads_per_sm\": %d, "
           "\"used_start\": %.1f, \"fill_mib\": %d, \"fill_rc\": %d, \"used_filled\": %.1f, "
           "\"stack_before\": %zu, \"big_rc\": %d, \"big_error\": \"%s\", \"big_sync_rc\": %d, "
           "\"used_launched\": %.1f, \"stack_after\": %zu, \"lean_rc\": %d, \"lean_sync_rc\": %d, "
           "\"used_after\": %.1f, \"free_after\": %zu, \"total\": %zu}\n",
           big_local, lean_local, sms, per_sm, start, count * 64, fill_rc, filled, stack_before, big_rc,
           big_rc ? error_name(big_rc) : "CUDA_SUCCESS", big_sync, launched, stack_after, lean_rc, lean_sync,
           after, free_bytes, total);
    return 0;
}

/* "64,16,4,1": whole MiB, each > 0, at most MAX_SIZES of them; the count, or 0 if malformed. */
static int parse_sizes(const char *text, double *mib)
{
    int n = 0;
    for (const char *at = text; n < MAX_SIZES;) {
        char *end = NULL;
        long long v = strtoll(at, &end, 10);
        if (end == at || v <= 0 || v >= (1ll << 30))
            return 0;
        mib[n++] = (double)v;
        if (*end == '\0')
            return n;
        if (*end != ',')
            return 0;
        at = end + 1;
    }
    return 0;
}

static int usage(void)
{
    fprintf(stderr, "usage: gpubench info | serve | launch LAUNCHES REPS BATCH | "
                    "allocfree BYTES PAIRS REPS | memset MIB MS | legacy MIB | graph MIB | green MIB | "
                    "poolgrow MIB,MIB,... | poolfill MIB,MIB,... | arrays | stackgrow FREE_MIB|-\n");
    return 64;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "info") == 0)
        return cmd_info();
    if (argc == 2 && strcmp(argv[1], "serve") == 0)
        return cmd_serve();
    if (argc == 5 && strcmp(argv[1], "launch") == 0) {
        int launches = atoi(argv[2]), reps = atoi(argv[3]), batch = atoi(argv[4]);
        if (launches <= 0 || reps <= 0 || batch <= 0 || launches % batch != 0)
            return usage();
        return cmd_launch(launches, reps, batch);
    }
    if (argc == 5 && strcmp(argv[1], "allocfree") == 0) {
        long long bytes = atoll(argv[2]);
        int pairs = atoi(argv[3]), reps = atoi(argv[4]);
        if (bytes <= 0 || pairs <= 0 || reps <= 0)
            return usage();
        return cmd_allocfree((size_t)bytes, pairs, reps);
    }
    if (argc == 4 && strcmp(argv[1], "memset") == 0) {
        long long mib = atoll(argv[2]), ms = atoll(argv[3]);
        if (mib <= 0 || ms <= 0)
            return usage();
        return cmd_memset((size_t)mib, (double)ms);
    }
    if (argc == 3 && strcmp(argv[1], "legacy") == 0) {
        long long mib = atoll(argv[2]);
        if (mib <= 0 || mib >= 4096)
            return usage();
        return cmd_legacy((size_t)mib);
    }
    if (argc == 3 && strcmp(argv[1], "graph") == 0) {
        long long mib = atoll(argv[2]);
        if (mib <= 0)
            return usage();
        return cmd_graph((size_t)mib);
    }
    if (argc == 3 && strcmp(argv[1], "green") == 0) {
        long long mib = atoll(argv[2]);
        if (mib <= 0)
            return usage();
        return cmd_green((size_t)mib);
    }
    if (argc == 2 && strcmp(argv[1], "arrays") == 0)
        return cmd_arrays();
    if (argc == 3 && strcmp(argv[1], "stackgrow") == 0) {
        char *end = NULL;
        long long mib = strcmp(argv[2], "-") == 0 ? -1 : strtoll(argv[2], &end, 10);
        if (mib != -1 && (end == argv[2] || *end != '\0' || mib < 0))
            return usage();
        return cmd_stackgrow(mib);
    }
    if (argc == 3 && (strcmp(argv[1], "poolgrow") == 0 || strcmp(argv[1], "poolfill") == 0)) {
        double mib[MAX_SIZES];
        int n = parse_sizes(argv[2], mib);
        if (n == 0)
            return usage();
        return argv[1][4] == 'g' ? cmd_poolgrow(mib, n) : cmd_poolfill(mib, n);
    }
    return usage();
}
