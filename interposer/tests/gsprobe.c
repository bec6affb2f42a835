/*
 * gsprobe - drives the CUDA driver API the way a program would, through one
 * of the paths a program takes, and prints one line per command for pytest.
 *
 *   gsprobe [--api direct|dlsym|procaddr|procaddr1|ptsz] COMMAND [ARGS]...
 *
 * direct     calls the exported symbols (the program links libcuda)
 * dlsym      dlopen("libcuda.so.1") + dlsym for every function
 * procaddr   cuGetProcAddress_v2(base name, 13000, default flags)
 * procaddr1  cuGetProcAddress (v1) with cudaVersion 12000
 * ptsz       cuGetProcAddress_v2 with the per-thread default stream flag
 *
 * Every command prints "<command> <CUresult> [values...]".  Allocations get
 * ids 0, 1, 2... in order; `free ID` frees one with the matching call.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "peek.h" /* the library's in-flight counts */

typedef struct {
    char reserved[64]; /* CUipcMemHandle, CUipcEventHandle: CU_IPC_HANDLE_SIZE bytes */
} ipc_handle_t;
/* cuda.h's CUDA_KERNEL_NODE_PARAMS (v2: v1's fields lead it) and CUgraphExecUpdateResultInfo */
typedef struct {
    CUfunction func;
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    void **kernelParams, **extra;
    CUkernel kern;
    CUcontext ctx;
} kernel_node_t;
typedef struct {
    int result;
    CUgraphNode errorNode, errorFromNode;
} update_info_t;
/* cuda.h's generic node parameters (CUDA 12.3), of which cpeak makes a conditional
 * node and gpeak a kernel's */
typedef struct {
    uint64_t handle;
    int type; /* 0 IF, 1 WHILE */
    unsigned int size;
    CUgraph *phGraph_out;
    CUcontext ctx;
} cond_params;
typedef struct {
    CUgraphNodeType type;
    int reserved0[3];
    union {
        long long reserved1[29];
        cond_params conditional;
        kernel_node_t kernel;
    };
    long long reserved2;
} node_params;

#define FN(name, ret, params) typedef ret(*name##_t) params;
#define API_FUNCS(X)                                                                                         \
    X(cuInit, CUresult, (unsigned))                                                                          \
    X(cuDevicePrimaryCtxRetain, CUresult, (CUcontext *, CUdevice))                                           \
    X(cuDevicePrimaryCtxRelease_v2, CUresult, (CUdevice))                                                    \
    X(cuDevicePrimaryCtxReset_v2, CUresult, (CUdevice))                                                      \
    X(cuCtxCreate_v2, CUresult, (CUcontext *, unsigned, CUdevice))                                           \
    X(cuCtxDestroy_v2, CUresult, (CUcontext))                                                                \
    X(cuCtxSetCurrent, CUresult, (CUcontext))                                                                \
    X(cuCtxGetCurrent, CUresult, (CUcontext *))                                                              \
    X(cuMemAlloc_v2, CUresult, (CUdeviceptr *, size_t))                                                      \
    X(cuMemAllocManaged, CUresult, (CUdeviceptr *, size_t, unsigned))                                        \
    X(cuMemAllocPitch_v2, CUresult, (CUdeviceptr *, size_t *, size_t, size_t, unsigned))                     \
    X(cuMemFree_v2, CUresult, (CUdeviceptr))                                                                 \
    X(cuMemAllocAsync, CUresult, (CUdeviceptr *, size_t, CUstream))                                          \
    X(cuMemAllocFromPoolAsync, CUresult, (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                    \
    X(cuMemFreeAsync, CUresult, (CUdeviceptr, CUstream))                                                     \
    X(cuMemPoolCreate, CUresult, (CUmemoryPool *, const void *))                                             \
    X(cuMemPoolTrimTo, CUresult, (CUmemoryPool, size_t))                                                     \
    X(cuMemPoolDestroy, CUresult, (CUmemoryPool))                                                            \
    X(cuDeviceGetMemPool, CUresult, (CUmemoryPool *, CUdevice))                                              \
    X(cuDeviceSetMemPool, CUresult, (CUdevice, CUmemoryPool))                                                \
    X(cuMemGetDefaultMemPool, CUresult, (CUmemoryPool *, CUmemLocation *, CUmemAllocationType))               \
    X(cuMemGetMemPool, CUresult, (CUmemoryPool *, CUmemLocation *, CUmemAllocationType))                      \
    X(cuMemSetMemPool, CUresult, (CUmemLocation *, CUmemAllocationType, CUmemoryPool))                        \
    X(cuMemCreate, CUresult, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)) \
    X(cuMemRelease, CUresult, (CUmemGenericAllocationHandle))                                                \
    X(cuMemAddressReserve, CUresult, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))       \
    X(cuMemMap, CUresult, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))   \
    X(cuMemUnmap, CUresult, (CUdeviceptr, size_t))                                                           \
    X(cuMemRetainAllocationHandle, CUresult, (CUmemGenericAllocationHandle *, void *))                       \
    X(cuMemExportToShareableHandle, CUresult, (void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, \
                                               unsigned long long))                                         \
    X(cuMemImportFromShareableHandle, CUresult, (CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType)) \
    X(cuImportExternalMemory, CUresult, (CUexternalMemory *, const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *))     \
    X(cuDestroyExternalMemory, CUresult, (CUexternalMemory))                                                 \
    X(cuMemMapArrayAsync, CUresult, (CUarrayMapInfo *, unsigned int, CUstream))                              \
    X(cuArrayCreate_v2, CUresult, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *))                                \
    X(cuArray3DCreate_v2, CUresult, (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *))                            \
    X(cuArrayDestroy, CUresult, (CUarray))                                                                   \
    X(cuMipmappedArrayCreate, CUresult, (CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned))     \
    X(cuMipmappedArrayDestroy, CUresult, (CUmipmappedArray))                                                 \
    X(cuMemGetInfo_v2, CUresult, (size_t *, size_t *))                                                       \
    X(cuDeviceTotalMem_v2, CUresult, (size_t *, CUdevice))                                                   \
    X(cuLaunchKernel, CUresult, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,     \
                                 unsigned, CUstream, void **, void **))                                      \
    X(cuLaunchKernelEx, CUresult, (const CUlaunchConfig *, CUfunction, void **, void **))                    \
    X(cuLaunchCooperativeKernel, CUresult, (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,    \
                                            unsigned, unsigned, CUstream, void **))                          \
    X(cuGraphLaunch, CUresult, (CUgraphExec, CUstream))                                                      \
    X(cuStreamBeginCapture_v2, CUresult, (CUstream, int))                                                    \
    X(cuStreamEndCapture, CUresult, (CUstream, void **))                                                     \
    X(cuStreamBeginCaptureToGraph, CUresult, (CUstream, CUgraph, const CUgraphNode *, const void *, size_t, int)) \
    X(cuStreamCreate, CUresult, (CUstream *, unsigned))                                                      \
    X(cuStreamDestroy_v2, CUresult, (CUstream))                                                              \
    X(cuMemcpyHtoDAsync_v2, CUresult, (CUdeviceptr, const void *, size_t, CUstream))                         \
    X(cuMemsetD8Async, CUresult, (CUdeviceptr, unsigned char, size_t, CUstream))                             \
    X(cuMemsetD8_v2, CUresult, (CUdeviceptr, unsigned char, size_t))                                        \
    X(cuMemPrefetchAsync_v2, CUresult, (CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream))             \
    X(cuMemPrefetchBatchAsync, CUresult, (CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t,  \
                                          unsigned long long, CUstream))                                     \
    X(cuMemBatchDecompressAsync, CUresult, (CUmemDecompressParams *, size_t, unsigned, size_t *, CUstream))   \
    X(cuLaunchHostFunc, CUresult, (CUstream, CUhostFn, void *))                                              \
    X(cuStreamWaitEvent, CUresult, (CUstream, CUevent, unsigned))                                            \
    X(cuEventCreate, CUresult, (CUevent *, unsigned))                                                        \
    X(cuEventRecord, CUresult, (CUevent, CUstream))                                                          \
    X(cuLaunchCooperativeKernelMultiDevice, CUresult, (CUDA_LAUNCH_PARAMS *, unsigned, unsigned))            \
    X(cuGreenCtxCreate, CUresult, (CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned))                     \
    X(cuGreenCtxDestroy, CUresult, (CUgreenCtx))                                                             \
    X(cuCtxFromGreenCtx, CUresult, (CUcontext *, CUgreenCtx))                                                \
    X(cuCtxSynchronize, CUresult, (void))                                                                    \
    X(cuStreamSynchronize, CUresult, (CUstream))                                                             \
    X(cuEventSynchronize, CUresult, (CUevent))                                                               \
    X(cuModuleLoadData, CUresult, (CUmodule *, const void *))                                                \
    X(cuModuleUnload, CUresult, (CUmodule))                                                                  \
    X(cuLibraryUnload, CUresult, (CUlibrary))                                                                \
    X(cuCtxSetLimit, CUresult, (int, size_t))                                                                \
    X(cuCtxGetLimit, CUresult, (size_t *, int))                                                              \
    X(cuModuleGetFunction, CUresult, (CUfunction *, CUmodule, const char *))                                 \
    X(cuLibraryLoadData, CUresult, (CUlibrary *, const void *, CUjit_option *, void **, unsigned,             \
                                    CUlibraryOption *, void **, unsigned))                                   \
    X(cuLibraryGetKernel, CUresult, (CUkernel *, CUlibrary, const char *))                                   \
    X(cuKernelGetFunction, CUresult, (CUfunction *, CUkernel))                                              \
    X(cuFuncLoad, CUresult, (CUfunction))                                                                    \
    X(cuLibraryGetModule, CUresult, (CUmodule *, CUlibrary))                                                 \
    X(cuLibraryGetGlobal, CUresult, (CUdeviceptr *, size_t *, CUlibrary, const char *))                      \
    X(cuGraphCreate, CUresult, (CUgraph *, unsigned))                                                        \
    X(cuGraphAddMemAllocNode, CUresult, (CUgraphNode *, CUgraph, const CUgraphNode *, size_t,                \
                                         CUDA_MEM_ALLOC_NODE_PARAMS *))                                      \
    X(cuGraphAddChildGraphNode, CUresult, (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraph))    \
    X(cuGraphInstantiateWithFlags, CUresult, (CUgraphExec *, CUgraph, unsigned long long))                   \
    X(cuGraphInstantiateWithParams, CUresult, (CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *))      \
    X(cuGraphUpload, CUresult, (CUgraphExec, CUstream))                                                      \
    X(cuGraphExecDestroy, CUresult, (CUgraphExec))                                                           \
    X(cuGraphAddKernelNode_v2, CUresult, (CUgraphNode *, CUgraph, const CUgraphNode *, size_t,               \
                                          const kernel_node_t *))                                            \
    X(cuGraphExecUpdate_v2, CUresult, (CUgraphExec, CUgraph, update_info_t *))                               \
    X(cuGraphExecKernelNodeSetParams_v2, CUresult, (CUgraphExec, CUgraphNode, const kernel_node_t *))        \
    X(cuGraphExecNodeSetParams, CUresult, (CUgraphExec, CUgraphNode, node_params *))                         \
    X(cuGraphExecChildGraphNodeSetParams, CUresult, (CUgraphExec, CUgraphNode, CUgraph))                     \
    X(cuGraphNodeSetEnabled, CUresult, (CUgraphExec, CUgraphNode, unsigned))                                 \
    X(cuGraphExecMemcpyNodeSetParams, CUresult, (CUgraphExec, CUgraphNode, const CUDA_MEMCPY3D *, CUcontext)) \
    X(cuGraphExecMemsetNodeSetParams, CUresult, (CUgraphExec, CUgraphNode, const void *, CUcontext))         \
    X(cuGraphExecHostNodeSetParams, CUresult, (CUgraphExec, CUgraphNode, const void *))                      \
    X(cuDeviceGraphMemTrim, CUresult, (CUdevice))                                                            \
    X(cuIpcGetMemHandle, CUresult, (ipc_handle_t *, CUdeviceptr))                                            \
    X(cuIpcOpenMemHandle_v2, CUresult, (CUdeviceptr *, ipc_handle_t, unsigned))                              \
    X(cuIpcCloseMemHandle, CUresult, (CUdeviceptr))                                                          \
    X(cuIpcGetEventHandle, CUresult, (ipc_handle_t *, CUevent))                                              \
    X(cuIpcOpenEventHandle, CUresult, (CUevent *, ipc_handle_t))                                             \
    X(cuEventDestroy_v2, CUresult, (CUevent))
API_FUNCS(FN)
/* CUDA 2.x's entry points (and 7.0's primary-context release and reset), with the
 * cudaVersion cuGetProcAddress hands them out for; used after the "legacy" command.  Also
 * CUDA 13.2's and 13.3's, asked for at their own version */
#define API1_FUNCS(X)                                                                                        \
    X(cuMemAlloc, CUresult, (unsigned *, unsigned), 2000)                                                    \
    X(cuMemAllocPitch, CUresult, (unsigned *, unsigned *, unsigned, unsigned, unsigned), 2000)               \
    X(cuMemFree, CUresult, (unsigned), 2000)                                                                 \
    X(cuMemGetInfo, CUresult, (unsigned *, unsigned *), 2000)                                                \
    X(cuDeviceTotalMem, CUresult, (unsigned *, CUdevice), 2000)                                              \
    X(cuArrayCreate, CUresult, (CUarray *, const CUDA_ARRAY_DESCRIPTOR_v1 *), 2000)                          \
    X(cuArray3DCreate, CUresult, (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR_v1 *), 2000)                      \
    X(cuCtxCreate, CUresult, (CUcontext *, unsigned, CUdevice), 2000)                                        \
    X(cuCtxDestroy, CUresult, (CUcontext), 2000)                                                             \
    X(cuStreamDestroy, CUresult, (CUstream), 2000)                                                           \
    X(cuDevicePrimaryCtxRelease, CUresult, (CUdevice), 7000)                                                 \
    X(cuDevicePrimaryCtxReset, CUresult, (CUdevice), 7000)                                                   \
    X(cuCtxAttach, CUresult, (CUcontext *, unsigned), 2000)                                                  \
    X(cuCtxDetach, CUresult, (CUcontext), 2000)                                                              \
    X(cuLaunch, CUresult, (CUfunction), 2000)                                                                \
    X(cuLaunchGrid, CUresult, (CUfunction, int, int), 2000)                                                  \
    X(cuLaunchGridAsync, CUresult, (CUfunction, int, int, CUstream), 2000)                                  \
    X(cuGraphInstantiate, CUresult, (CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t), 10000)          \
    X(cuGraphExecUpdate, CUresult, (CUgraphExec, CUgraph, CUgraphNode *, int *), 10020)                      \
    X(cuGraphExecKernelNodeSetParams, CUresult, (CUgraphExec, CUgraphNode, const kernel_node_t *), 10010)   \
    X(cuMemcpyWithAttributesAsync, CUresult, (CUdeviceptr, CUdeviceptr, size_t, CUmemcpyAttributes *, CUstream), \
      13020)                                                                                                 \
    X(cuMemcpy3DWithAttributesAsync, CUresult, (CUDA_MEMCPY3D_BATCH_OP *, unsigned long long, CUstream), 13020) \
    X(cuLaunchHostFunc_v2, CUresult, (CUstream, CUhostFn, void *, unsigned), 13020)                          \
    X(cuStreamBeginRecaptureToGraph, CUresult, (CUstream, int, CUgraph, void (*)(void), void *), 13030)
#define FN1(name, ret, params, version) typedef ret(*name##_t) params;
API1_FUNCS(FN1)
typedef CUresult (*getproc2_t)(const char *, void **, int, cuuint64_t, int *);
typedef CUresult (*getproc1_t)(const char *, void **, int, cuuint64_t);
typedef nvmlReturn_t (*nvml_init_t)(void);
typedef nvmlReturn_t (*nvml_handle_t)(unsigned, nvmlDevice_t *);
typedef nvmlReturn_t (*nvml_mem_t)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*nvml_mem2_t)(nvmlDevice_t, nvmlMemory_v2_t *);

#define MEMBER(name, ret, params) name##_t name;
static struct {
    API_FUNCS(MEMBER)
} api;
#define MEMBER1(name, ret, params, version) name##_t name;
static struct {
    API1_FUNCS(MEMBER1)
} api1;
static int legacy; /* the "legacy" command: allocations, views and contexts through api1 */

/* The symbols, for --api direct (the program links libcuda.so.1). */
#define DECLARE(name, ret, params) ret name params;
API_FUNCS(DECLARE)
#define DECLARE1(name, ret, params, version) ret name params;
API1_FUNCS(DECLARE1)
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned, nvmlDevice_t *);
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t, nvmlMemory_t *);
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t, nvmlMemory_v2_t *);

static const char *mode = "direct";
static CUgraph graph;      /* the graph commands' current graph and executable */
static CUgraphExec gexec;
static int is_child;
static void *libcuda;

/* The base name and cudaVersion a runtime would ask cuGetProcAddress for (`version`
 * if not 0). */
static void *by_procaddr(const char *name, int version)
{
    static getproc2_t gp2;
    static getproc1_t gp1;
    if (!gp2) gp2 = (getproc2_t)dlsym(libcuda, "cuGetProcAddress_v2");
    if (!gp1) gp1 = (getproc1_t)dlsym(libcuda, "cuGetProcAddress");
    char base[128];
    snprintf(base, sizeof(base), "%s", name);
    char *suffix = strstr(base, "_v2");
    if (suffix && suffix[3] == '\0') *suffix = '\0';
    if (!version) version = strcmp(base, "cuCtxCreate") == 0 ? 3020 : 13000; /* we call the _v2 ABI */
    cuuint64_t flags = strcmp(mode, "ptsz") == 0 ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : 0;
    void *fn = NULL;
    int status = -1;
    if (strcmp(mode, "procaddr1") == 0)
        gp1(base, &fn, version > 12000 ? 12000 : version, flags);
    else
        gp2(base, &fn, version, flags, &status);
    return fn;
}

/* cuCtxSynchronize of the current context.  Through cuGetProcAddress at 13000 the pointer is
 * CUDA 13's cuCtxSynchronize_v2(CUcontext), NULL for the current context: passed NULL in either
 * case (called without it, the hook read a register's leftover as the context) */
static CUresult ctx_sync(void)
{
    return ((CUresult(*)(CUcontext))(void (*)(void))api.cuCtxSynchronize)(NULL);
}

static void load_api(void)
{
    libcuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (strcmp(mode, "direct") == 0) {
#define DIRECT(name, ret, params) api.name = name;
        API_FUNCS(DIRECT)
#define DIRECT1(name, ret, params, version) api1.name = name;
        API1_FUNCS(DIRECT1)
    } else if (strcmp(mode, "dlsym") == 0) {
#define VIA_DLSYM(name, ret, params) api.name = (name##_t)dlsym(libcuda, #name);
        API_FUNCS(VIA_DLSYM)
#define VIA_DLSYM1(name, ret, params, version) api1.name = (name##_t)dlsym(libcuda, #name);
        API1_FUNCS(VIA_DLSYM1)
    } else {
#define VIA_PROC(name, ret, params) api.name = (name##_t)by_procaddr(#name, 0);
        API_FUNCS(VIA_PROC)
#define VIA_PROC1(name, ret, params, version) api1.name = (name##_t)by_procaddr(#name, version);
        API1_FUNCS(VIA_PROC1)
    }
}

/* ---- allocations ---------------------------------------------------------- */

enum { A_DPTR, A_POOL, A_VMM, A_ARRAY, A_MIPMAP, A_EXTMEM, A_OTHER, A_IPC };
static struct {
    int kind;
    uint64_t handle;
    uint64_t size;   /* A_VMM */
    CUdeviceptr va;  /* A_VMM: where vmap mapped it */
    uint64_t mapped; /* A_VMM: how much of it vmap (all) or vmappart mapped there */
    int fd;          /* A_VMM: the descriptor vexport exported it to */
} allocs[4096];
static CUdeviceptr vrange;  /* vmapall: one reservation, every VMM allocation mapped in turn */
static uint64_t vrange_size;
static int nallocs;
static CUmemoryPool user_pool;
static CUgreenCtx greenctx; /* the "green" command's (the newest of "greens") */
static CUgreenCtx greenctxs[160]; /* "greens N D": the N made, greenctx the last */
static int ngreens;
static CUmodule user_module;
static CUlibrary user_library;
static CUfunction user_function;
static CUcontext ctxs[128];
static int nctx;

static void remember(const char *what, CUresult rc, int kind, uint64_t handle)
{
    if (rc == CUDA_SUCCESS) {
        allocs[nallocs].kind = kind;
        allocs[nallocs].handle = handle;
        printf("%s %d %d\n", what, rc, nallocs++);
    } else {
        printf("%s %d -1\n", what, rc);
    }
}

static uint64_t size_arg(const char *s)
{
    char *end;
    uint64_t v = strtoull(s, &end, 10);
    if (*end == 'k') v <<= 10;
    if (*end == 'm') v <<= 20;
    if (*end == 'g') v <<= 30;
    return v;
}

/* The pool "pool" allocates from; "mkpool TYPE ID" makes it at a location of its own
 * (TYPE 1 device ID, 2 host), "mkmanaged TYPE ID" a managed pool (TYPE 0: no preferred
 * location), "defpool"/"curpool TYPE ALLOC" takes a location's default or current pool
 * (ALLOC 1 pinned, 2 managed); otherwise it is made on device 0. */
static CUresult make_user_pool_of(int alloc_type, int type, int id)
{
    struct {
        int allocType, handleTypes;
        CUmemLocation location;
        char rest[64];
    } props = {alloc_type, 0, {type, id}, {0}};
    return api.cuMemPoolCreate(&user_pool, &props);
}

static CUresult make_user_pool(int type, int id)
{
    return make_user_pool_of(CU_MEM_ALLOCATION_TYPE_PINNED, type, id);
}

static CUmemoryPool get_user_pool(void)
{
    if (!user_pool) make_user_pool(CU_MEM_LOCATION_TYPE_DEVICE, 0);
    return user_pool;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The "multi" benches' launch list: a stream of the current context, and for "multi2" one
 * of device 1's primary context too (the current context stays). */
static CUresult multi_list(const char *kind, CUfunction f, CUDA_LAUNCH_PARAMS *list, unsigned *n)
{
    CUDA_LAUNCH_PARAMS one = {f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL};
    CUcontext home = NULL, there = NULL;
    list[0] = list[1] = one;
    *n = !strcmp(kind, "multi2") ? 2 : 1;
    CUresult rc = api.cuStreamCreate(&list[0].hStream, 0);
    if (rc != CUDA_SUCCESS || *n == 1) return rc;
    if ((rc = api.cuCtxGetCurrent(&home)) != CUDA_SUCCESS || (rc = api.cuDevicePrimaryCtxRetain(&there, 1)) != CUDA_SUCCESS ||
        (rc = api.cuCtxSetCurrent(there)) != CUDA_SUCCESS)
        return rc;
    rc = api.cuStreamCreate(&list[1].hStream, 0);
    CUresult back = api.cuCtxSetCurrent(home);
    return rc != CUDA_SUCCESS ? rc : back;
}

/* Launch for `seconds` of wall time; report the GPU time the fake ran. */
static void no_op(void *data)
{
    (void)data;
}

/* Work before each kernel on its stream that is not a kernel (bench's "copy", "hostfn" and
 * "waitcopy" kinds): an async copy; a host function; a copy on a second stream that the
 * kernel's stream waits for (as JAX's copy streams are waited for); "prefetch": managed memory's
 * ("prefetchbatch": CUDA 13.0's batch of them; "decompress": the decompression engine's copy);
 * "memsetcopy": a memset, then a copy; "smemsetcopy": the same with cuMemsetD8 (no stream);
 * CUDA 13.2's "copyattr" and "copy3dattr" (copies with attributes) and "hostfn2"
 * (cuLaunchHostFunc_v2) */
static CUresult before_kernel(const char *kind, CUstream s, CUstream side, CUevent ev)
{
    static char host[64];
    if (!strcmp(kind, "copy")) return api.cuMemcpyHtoDAsync_v2((CUdeviceptr)0x1000, host, sizeof(host), s);
    if (!strcmp(kind, "hostfn")) return api.cuLaunchHostFunc(s, no_op, NULL);
    if (!strcmp(kind, "hostfn2")) return api1.cuLaunchHostFunc_v2(s, no_op, NULL, 1 /* spin-wait */);
    if (!strcmp(kind, "copyattr")) /* attributes the fake does not read */
        return api1.cuMemcpyWithAttributesAsync((CUdeviceptr)0x1000, (CUdeviceptr)0x2000, sizeof(host),
                                                (CUmemcpyAttributes *)host, s);
    if (!strcmp(kind, "copy3dattr"))
        return api1.cuMemcpy3DWithAttributesAsync((CUDA_MEMCPY3D_BATCH_OP *)host, 0, s);
    if (!strcmp(kind, "prefetch")) { /* managed memory to device 0 */
        CUmemLocation dev0 = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
        return api.cuMemPrefetchAsync_v2((CUdeviceptr)0x1000, sizeof(host), dev0, 0, s);
    }
    if (!strcmp(kind, "prefetchbatch")) { /* CUDA 13.0: one range of managed memory to device 0 */
        CUmemLocation dev0 = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
        CUdeviceptr p = 0x1000;
        size_t n = sizeof(host), first = 0;
        return api.cuMemPrefetchBatchAsync(&p, &n, 1, &dev0, &first, 1, 0, s);
    }
    if (!strcmp(kind, "decompress")) /* the decompression engine: parameters the fake does not read */
        return api.cuMemBatchDecompressAsync((CUmemDecompressParams *)host, 1, 0, NULL, s);
    if (!strcmp(kind, "memsetcopy")) { /* a memset (kernel time), then a copy that marks a gap */
        CUresult rc = api.cuMemsetD8Async((CUdeviceptr)0x1000, 0, sizeof(host), s);
        return rc == CUDA_SUCCESS ? api.cuMemcpyHtoDAsync_v2((CUdeviceptr)0x1000, host, sizeof(host), s) : rc;
    }
    if (!strcmp(kind, "smemsetcopy")) { /* the same with a memset without a stream (the default one) */
        CUresult rc = api.cuMemsetD8_v2((CUdeviceptr)0x1000, 0, sizeof(host));
        return rc == CUDA_SUCCESS ? api.cuMemcpyHtoDAsync_v2((CUdeviceptr)0x1000, host, sizeof(host), s) : rc;
    }
    if (strcmp(kind, "waitcopy") != 0) return CUDA_SUCCESS;
    CUresult rc = api.cuMemcpyHtoDAsync_v2((CUdeviceptr)0x1000, host, sizeof(host), side);
    if (rc == CUDA_SUCCESS) rc = api.cuEventRecord(ev, side);
    return rc == CUDA_SUCCESS ? api.cuStreamWaitEvent(s, ev, 0) : rc;
}

static void bench(double seconds, const char *kind)
{
    typedef uint64_t (*kns_t)(void);
    kns_t kernel_ns = (kns_t)dlsym(libcuda, "fake_cuda_kernel_ns");
    CUfunction f = (CUfunction)0x1234;
    CUstream s = NULL, side = NULL;
    CUevent ev = NULL;
    CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
    CUDA_LAUNCH_PARAMS list[2];
    unsigned nlist = 0;
    CUresult rc = !strncmp(kind, "multi", 5) ? multi_list(kind, f, list, &nlist) : CUDA_SUCCESS;
    if (!strcmp(kind, "own")) rc = api.cuStreamCreate(&s, 1 /* CU_STREAM_NON_BLOCKING */);
    if (!strcmp(kind, "waitcopy")) {
        rc = api.cuStreamCreate(&side, 1);
        if (rc == CUDA_SUCCESS) rc = api.cuEventCreate(&ev, 0);
    }
    /* "fns:N": N functions launched in turn (a model's many kernels); "alt:G": one function
     * whose time is the same at any grid, its grid 1 and G in turn (a grid the GPU never fills);
     * "sizes:N": FAKE_GRID_FN, whose time grows with its grid, at grids 1..N in turn (a kernel
     * over tensors of changing shapes) */
    unsigned nfns = !strncmp(kind, "fns:", 4) ? (unsigned)atoi(kind + 4) : 0;
    unsigned alt = !strncmp(kind, "alt:", 4) ? (unsigned)atoi(kind + 4) : 0;
    unsigned sizes = !strncmp(kind, "sizes:", 6) ? (unsigned)atoi(kind + 6) : 0;
    unsigned grid = 1;
    if (sizes) f = (CUfunction)0x6d1d;
    uint64_t k0 = kernel_ns(), t0 = now_ns(), end = t0 + (uint64_t)(seconds * 1e9), n = 0;
    while (rc == CUDA_SUCCESS && now_ns() < end) {
        if ((rc = before_kernel(kind, s, side, ev)) != CUDA_SUCCESS) break;
        if (nfns) f = (CUfunction)(uintptr_t)(0x100000 + 64 * (n % nfns));
        if (alt) grid = n % 2 ? alt : 1;
        if (sizes) grid = 1 + (unsigned)(n % sizes);
        if (!strcmp(kind, "ex"))
            rc = api.cuLaunchKernelEx(&cfg, f, NULL, NULL);
        else if (!strcmp(kind, "coop"))
            rc = api.cuLaunchCooperativeKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL);
        else if (!strcmp(kind, "graph"))
            rc = api.cuGraphLaunch((CUgraphExec)(uintptr_t)4, s);
        else if (nlist)
            rc = api.cuLaunchCooperativeKernelMultiDevice(list, nlist, 0);
        else if (!strcmp(kind, "launch1")) /* CUDA 2.x's launches */
            rc = api1.cuLaunch(f);
        else if (!strcmp(kind, "grid"))
            rc = api1.cuLaunchGrid(f, 1, 1);
        else if (!strcmp(kind, "gridasync"))
            rc = api1.cuLaunchGridAsync(f, 1, 1, s);
        else
            rc = api.cuLaunchKernel(f, grid, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        if (rc == CUDA_SUCCESS && !strcmp(kind, "sync")) rc = ctx_sync(); /* each kernel waited for */
        n++;
    }
    ctx_sync();
    uint64_t wall = now_ns() - t0;
    printf("bench %d %llu %llu %llu\n", rc, (unsigned long long)n, (unsigned long long)(kernel_ns() - k0),
           (unsigned long long)wall);
}

/* "peak SECONDS WINDOW_MS SKIP_MS": bench's launch loop (the legacy stream) while a thread samples
 * the fake GPU's kernel time run so far every millisecond; prints the launches and the most of
 * any WINDOW_MS the GPU was busy (per mille), among windows that begin SKIP_MS or more after the
 * first launch: how far the GPU ran ahead of the budget at its worst.  "cpeak SECONDS WINDOW_MS
 * SKIP_MS LEARN_MS TRIPS": the same with a graph's WHILE loop, "dpeak ...": with a device graph's
 * relaunches, "fpeak ...": with a plain graph that launches such a device graph from the GPU
 * (peak's comment below) */
#define PEAK_SAMPLES 65536
static struct {
    uint64_t t[PEAK_SAMPLES], ran[PEAK_SAMPLES];
    int n, stop;
} peak_log;

static void *peak_sampler(void *arg)
{
    uint64_t (*run_ns)(void) = (uint64_t (*)(void))arg;
    while (!__atomic_load_n(&peak_log.stop, __ATOMIC_ACQUIRE) && peak_log.n < PEAK_SAMPLES) {
        peak_log.t[peak_log.n] = now_ns();
        peak_log.ran[peak_log.n] = run_ns();
        peak_log.n++;
        usleep(1000);
    }
    return NULL;
}

/* An executable graph of one WHILE node, or (device 1) an empty one made for device launch (its
 * kernels may relaunch it from the GPU), or (device 2) a plain one whose kernel launches such a
 * graph from the GPU; NULL if the driver has none */
static CUgraphExec loop_graph(int device)
{
    typedef CUresult (*handle_t)(uint64_t *, CUgraph, CUcontext, unsigned, unsigned);
    typedef CUresult (*add_t)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, node_params *);
    handle_t make_handle = (handle_t)dlsym(libcuda, "cuGraphConditionalHandleCreate");
    add_t add = (add_t)dlsym(libcuda, "cuGraphAddNode");
    CUgraph g = NULL;
    CUgraphNode node;
    CUgraphExec exec = NULL;
    node_params p = {.type = CU_GRAPH_NODE_TYPE_CONDITIONAL};
    p.conditional.type = 1;
    p.conditional.size = 1;
    if (!make_handle || !add || api.cuGraphCreate(&g, 0) != CUDA_SUCCESS)
        return NULL;
    if (!device && (make_handle(&p.conditional.handle, g, NULL, 1, 1) != CUDA_SUCCESS ||
                    add(&node, g, NULL, 0, &p) != CUDA_SUCCESS))
        return NULL;
    if (api.cuGraphInstantiateWithFlags(&exec, g, device ? CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH : 0))
        return NULL;
    if (device == 2) { /* a plain graph whose kernel launches that one from the GPU */
        typedef void (*spawn_t)(CUgraphExec, CUgraphExec);
        spawn_t spawn = (spawn_t)dlsym(libcuda, "fake_cuda_graph_spawn");
        CUgraph h = NULL;
        CUgraphExec host = NULL;
        if (!spawn || api.cuGraphCreate(&h, 0) || api.cuGraphInstantiateWithFlags(&host, h, 0)) return NULL;
        spawn(host, exec);
        return host;
    }
    return exec;
}

/* peak: kernels on the legacy stream; trips > 0: launches of a graph with a WHILE node instead
 * (device: loop_graph's other kinds), whose kernels run its body once a launch for the
 * first learn_ms, then `trips` times (a loop whose trip count the GPU sets: the host launches
 * the same graph and never knows; the fake driver's fake_cuda_graph_trips plays those kernels) */
/* ---- graphs changed in place (gpeak, gset) ---- */

/* gpeak's graph: one kernel node of grid 1 (a launch runs one FAKE_CUDA_KERNEL_US kernel), and
 * the same shape with `grid` (HOW "update*" updates from it; "new" instantiates it instead).
 * "child": the kernel inside a child graph node; "enable": a second kernel node of grid-1,
 * disabled until the change. */
static struct {
    const char *how;
    unsigned grid;
    CUgraph big;
    CUgraphNode node, second;
    CUgraphExec exec;
} chg;

static CUgraph kernel_graph(unsigned grid, unsigned second, CUgraphNode *node, CUgraphNode *other)
{
    CUgraph g = NULL, inner = NULL;
    kernel_node_t p = {.func = (CUfunction)0x1234, .gridDimX = grid, .gridDimY = 1, .gridDimZ = 1,
                       .blockDimX = 1, .blockDimY = 1, .blockDimZ = 1};
    CUgraphNode n = NULL, m = NULL;
    if (api.cuGraphCreate(&g, 0) != CUDA_SUCCESS) return NULL;
    if (!strcmp(chg.how, "child")) {
        if (api.cuGraphCreate(&inner, 0) || api.cuGraphAddKernelNode_v2(&m, inner, NULL, 0, &p) ||
            api.cuGraphAddChildGraphNode(&n, g, NULL, 0, inner))
            return NULL;
    } else if (api.cuGraphAddKernelNode_v2(&n, g, NULL, 0, &p) != CUDA_SUCCESS) {
        return NULL;
    }
    p.gridDimX = second;
    if (second && api.cuGraphAddKernelNode_v2(&m, g, NULL, 0, &p) != CUDA_SUCCESS) return NULL;
    if (node) *node = n;
    if (other) *other = m;
    return g;
}

/* The executable gpeak and gset launch; NULL if the driver has none of it */
static CUgraphExec change_setup(const char *how, unsigned grid)
{
    chg.how = how;
    chg.grid = grid;
    int enable = !strcmp(how, "enable");
    CUgraph g = kernel_graph(1, enable ? grid - 1 : 0, &chg.node, &chg.second);
    chg.big = kernel_graph(grid, 0, NULL, NULL);
    if (!g || !chg.big || api.cuGraphInstantiateWithFlags(&chg.exec, g, 0) != CUDA_SUCCESS) return NULL;
    if (enable && api.cuGraphNodeSetEnabled(chg.exec, chg.second, 0) != CUDA_SUCCESS) return NULL;
    return chg.exec;
}

/* The change; the executable to launch from now on in *exec */
static CUresult change_apply(CUgraphExec *exec)
{
    const char *how = chg.how;
    kernel_node_t p = {.func = (CUfunction)0x1234, .gridDimX = chg.grid, .gridDimY = 1, .gridDimZ = 1,
                       .blockDimX = 1, .blockDimY = 1, .blockDimZ = 1};
    if (!strcmp(how, "update")) {
        update_info_t info;
        return api.cuGraphExecUpdate_v2(chg.exec, chg.big, &info);
    }
    if (!strcmp(how, "update1")) {
        CUgraphNode err;
        int result;
        return api1.cuGraphExecUpdate(chg.exec, chg.big, &err, &result);
    }
    if (!strcmp(how, "kernel")) return api.cuGraphExecKernelNodeSetParams_v2(chg.exec, chg.node, &p);
    if (!strcmp(how, "kernel1")) return api1.cuGraphExecKernelNodeSetParams(chg.exec, chg.node, &p);
    if (!strcmp(how, "node")) {
        node_params np = {.type = CU_GRAPH_NODE_TYPE_KERNEL};
        np.kernel = p;
        return api.cuGraphExecNodeSetParams(chg.exec, chg.node, &np);
    }
    if (!strcmp(how, "child")) { /* a child graph of one kernel of the grid */
        CUgraph child = NULL;
        CUgraphNode n;
        if (api.cuGraphCreate(&child, 0) || api.cuGraphAddKernelNode_v2(&n, child, NULL, 0, &p))
            return CUDA_ERROR_INVALID_VALUE;
        return api.cuGraphExecChildGraphNodeSetParams(chg.exec, chg.node, child);
    }
    if (!strcmp(how, "enable")) return api.cuGraphNodeSetEnabled(chg.exec, chg.second, 1);
    if (!strcmp(how, "new")) return api.cuGraphInstantiateWithFlags(exec, chg.big, 0);
    if (!strcmp(how, "memcpy")) {
        static unsigned char copy[256];
        return api.cuGraphExecMemcpyNodeSetParams(chg.exec, chg.node, (const CUDA_MEMCPY3D *)copy, NULL);
    }
    if (!strcmp(how, "memset")) {
        static unsigned char set[64];
        return api.cuGraphExecMemsetNodeSetParams(chg.exec, chg.node, set, NULL);
    }
    if (!strcmp(how, "host")) {
        static unsigned char host[16];
        return api.cuGraphExecHostNodeSetParams(chg.exec, chg.node, host);
    }
    return CUDA_SUCCESS; /* "none" */
}

/* "gset HOW GRID": gpeak's graph launched once and synchronised, then changed by HOW (gpeak's,
 * or memcpy, memset, host: those nodes' setters, which the fake takes for any node), launched
 * again and synchronised: "gset RC" (the first failure) */
static void gset(const char *how, unsigned grid)
{
    CUgraphExec exec = change_setup(how, grid);
    CUresult rc = exec ? api.cuGraphLaunch(exec, NULL) : CUDA_ERROR_NOT_SUPPORTED;
    if (rc == CUDA_SUCCESS) rc = ctx_sync();
    if (rc == CUDA_SUCCESS) rc = change_apply(&exec);
    if (rc == CUDA_SUCCESS) rc = api.cuGraphLaunch(exec, NULL);
    if (rc == CUDA_SUCCESS) rc = ctx_sync();
    printf("gset %d\n", rc);
}

static void peak_graph(double seconds, uint64_t window_ms, uint64_t skip_ms, uint64_t learn_ms, uint64_t trips,
                       int device, const char *how);

static void peak(double seconds, uint64_t window_ms, uint64_t skip_ms, uint64_t learn_ms, uint64_t trips, int device)
{
    peak_graph(seconds, window_ms, skip_ms, learn_ms, trips, device, NULL);
}

/* gpeak's reload: kernel "k" of a module loaded (how "reload"), or of a library, as a CUkernel */
static CUresult load_k(const char *how, CUmodule *mod, CUlibrary *lib, CUfunction *fn)
{
    if (!strcmp(how, "reload")) {
        CUresult rc = api.cuModuleLoadData(mod, "fake image");
        return rc == CUDA_SUCCESS ? api.cuModuleGetFunction(fn, *mod, "k") : rc;
    }
    CUresult rc = api.cuLibraryLoadData(lib, "fake image", NULL, NULL, 0, NULL, NULL, 0);
    return rc == CUDA_SUCCESS ? api.cuLibraryGetKernel((CUkernel *)fn, *lib, "k") : rc;
}

/* "gpeak SECONDS WINDOW_MS SKIP_MS LEARN_MS GRID HOW": peak with gpeak's graph, which after
 * LEARN_MS runs GRID kernels a launch, changed by HOW (update, update1, kernel, kernel1, node,
 * child, enable, new: its launches are then another executable's; none: no change, the graph
 * stays at one kernel; bigfn: no graph, a kernel of another function whose grid of GRID runs
 * that many; bigrid: no graph, that function from the start, its grid 1, then GRID; bigrid2:
 * the same with a function whose time is in its grid's square, its grid 1 and 2 in turn; bigrid1:
 * that function at grid 1 alone (one size measured), then GRID; reload,
 * relib: no graph, a module's or library's kernel, GRID times longer in the code loaded again);
 * then "after RC BUSY": the GPU's busy share (1/1000) from SKIP_MS on */
static void peak_graph(double seconds, uint64_t window_ms, uint64_t skip_ms, uint64_t learn_ms, uint64_t trips,
                       int device, const char *how)
{
    void (*set_trips)(uint64_t) = (void (*)(uint64_t))dlsym(libcuda, "fake_cuda_graph_trips");
    /* "bigfn": kernels, not a graph; after LEARN_MS another function's, of grid GRID (the fake's
     * FAKE_GRID_FN runs one kernel per block of its grid) */
    int bigfn = how && !strcmp(how, "bigfn");
    /* "bigrid": the same, but FAKE_GRID_FN from the start, its grid 1 until LEARN_MS (a kernel
     * whose grid follows its tensor's size, one function for small and large) */
    int bigrid = how && !strcmp(how, "bigrid");
    /* "bigrid2": FAKE_GRID2_FN (time in the square of its grid), its grid 1 and 2 in turn until
     * LEARN_MS, then GRID (attention over a sequence its grid follows, a longer one) */
    int bigrid2 = how && !strcmp(how, "bigrid2");
    /* "bigrid1": FAKE_GRID2_FN at grid 1 alone until LEARN_MS (short prompts), then GRID (a long
     * one: nothing measured showed how its time grows) */
    int square = bigrid2 || (how && !strcmp(how, "bigrid1"));
    bigrid |= square;
    /* "reload": kernel "k" of a module ("relib": of a library, its CUkernel launched); at
     * LEARN_MS it is unloaded, kernels are made GRID times longer (fake_cuda_kernel_us_set), and
     * "k" of the code loaded again is launched (recompiled to do more; under
     * FAKE_CUDA_HANDLE_REUSE the same handle: prints "reused RC 1") */
    int reload = how && (!strcmp(how, "reload") || !strcmp(how, "relib"));
    bigfn |= bigrid | reload;
    CUfunction fn = square ? (CUfunction)0x6d2d : bigrid ? (CUfunction)0x6d1d : (CUfunction)0x1234;
    CUmodule mod = NULL;
    CUlibrary lib = NULL;
    void (*set_us)(uint64_t) = (void (*)(uint64_t))dlsym(libcuda, "fake_cuda_kernel_us_set");
    if (reload && (!set_us || load_k(how, &mod, &lib, &fn) != CUDA_SUCCESS)) {
        printf("peak %d 0 0\n", CUDA_ERROR_NOT_SUPPORTED);
        return;
    }
    unsigned grid = 1;
    CUgraphExec loop = bigfn ? NULL : how ? change_setup(how, (unsigned)trips) : trips ? loop_graph(device) : NULL;
    if ((trips && !loop && !bigfn) || (trips && !how && !set_trips)) {
        printf("peak %d 0 0\n", CUDA_ERROR_NOT_SUPPORTED);
        return;
    }
    if (trips && !how) set_trips(1);
    int learning = trips != 0;
    typedef uint64_t (*kns_t)(void);
    kns_t run_ns = (kns_t)dlsym(libcuda, "fake_cuda_kernel_run_ns");
    pthread_t th;
    CUresult rc = CUDA_SUCCESS;
    uint64_t t0 = now_ns(), end = t0 + (uint64_t)(seconds * 1e9), n = 0, worst = 0;
    if (!run_ns || pthread_create(&th, NULL, peak_sampler, (void *)run_ns) != 0) {
        printf("peak %d 0 0\n", CUDA_ERROR_NOT_SUPPORTED);
        return;
    }
    while (rc == CUDA_SUCCESS && now_ns() < end) {
        if (learning && now_ns() >= t0 + learn_ms * 1000000ull) {
            learning = 0;
            if (reload) {
                CUfunction was = fn;
                const char *v = getenv("FAKE_CUDA_KERNEL_US");
                rc = mod ? api.cuModuleUnload(mod) : api.cuLibraryUnload(lib);
                mod = NULL, lib = NULL;
                set_us((uint64_t)(v ? atof(v) : 10) * trips);
                if (rc == CUDA_SUCCESS) rc = load_k(how, &mod, &lib, &fn);
                printf("reused %d %d\n", rc, fn == was);
            } else if (bigfn) {
                if (!bigrid) fn = (CUfunction)0x6d1d; /* bigrid, bigrid1, bigrid2: the same function */
                grid = (unsigned)trips;
            } else if (how) {
                rc = change_apply(&loop);
            } else {
                set_trips(trips);
            }
            if (rc != CUDA_SUCCESS) break;
        }
        if (learning && bigrid2) grid = 1 + (unsigned)(n % 2);
        if (!loop)
            rc = api.cuLaunchKernel(fn, grid, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        else
            rc = api.cuGraphLaunch(loop, NULL);
        n++;
    }
    __atomic_store_n(&peak_log.stop, 1, __ATOMIC_RELEASE);
    pthread_join(th, NULL);
    ctx_sync();
    uint64_t w = window_ms * 1000000ull;
    for (int a = 0, b = 0; a < peak_log.n; a++) {
        if (peak_log.t[a] < t0 + skip_ms * 1000000ull) continue;
        while (b < peak_log.n && peak_log.t[b] < peak_log.t[a] + w) b++;
        if (b == peak_log.n) break; /* the window runs past the samples */
        uint64_t busy = (peak_log.ran[b] - peak_log.ran[a]) * 1000 / (peak_log.t[b] - peak_log.t[a]);
        if (busy > worst) worst = busy;
    }
    if (loop && api.cuGraphExecDestroy(loop) != CUDA_SUCCESS && rc == CUDA_SUCCESS) rc = CUDA_ERROR_INVALID_VALUE;
    if (mod && api.cuModuleUnload(mod) != CUDA_SUCCESS && rc == CUDA_SUCCESS) rc = CUDA_ERROR_INVALID_VALUE;
    if (lib && api.cuLibraryUnload(lib) != CUDA_SUCCESS && rc == CUDA_SUCCESS) rc = CUDA_ERROR_INVALID_VALUE;
    printf("peak %d %llu %llu\n", rc, (unsigned long long)n, (unsigned long long)worst);
    if (how) { /* gpeak: also how busy the GPU was (1/1000) from SKIP_MS to the end */
        int a = 0, b = peak_log.n - 1;
        while (a < peak_log.n && peak_log.t[a] < t0 + skip_ms * 1000000ull) a++;
        uint64_t after = a < b ? (peak_log.ran[b] - peak_log.ran[a]) * 1000 / (peak_log.t[b] - peak_log.t[a]) : 0;
        printf("after %d %llu\n", rc, (unsigned long long)after);
    }
}

/* A tensor-parallel rank (the fake driver's collectives, fakelaunch.h): STEPS steps of K kernels
 * and one collective across the ranks on a stream of its own, each step synchronised, as an
 * inference server's decode loop is.  Prints the steps done, the GPU time (spins in collectives
 * included) and the wall time. */
static void tp(long steps, int k)
{
    typedef uint64_t (*kns_t)(void);
    kns_t kernel_ns = (kns_t)dlsym(libcuda, "fake_cuda_kernel_ns");
    CUstream s = NULL;
    CUresult rc = api.cuStreamCreate(&s, 1 /* CU_STREAM_NON_BLOCKING */);
    uint64_t k0 = kernel_ns(), t0 = now_ns();
    long done = 0;
    for (; done < steps && rc == CUDA_SUCCESS; done += rc == CUDA_SUCCESS) {
        for (int j = 0; j < k && rc == CUDA_SUCCESS; j++)
            rc = api.cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        if (rc == CUDA_SUCCESS) rc = api.cuLaunchKernel((CUfunction)0xC011EC7, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        if (rc == CUDA_SUCCESS) rc = api.cuStreamSynchronize(s);
    }
    printf("tp %d %ld %llu %llu\n", rc, done, (unsigned long long)(kernel_ns() - k0),
           (unsigned long long)(now_ns() - t0));
}

static CUcontext capture_ctx; /* the context "ctx" made current: other threads use it too */

/* Like bench, with a context-less kernel (CUkernel) launched on a stream of device DEV's
 * primary context while the current context stays the one "ctx" made (the kernel runs in its
 * stream's context). */
static void xbench(double seconds, int dev)
{
    typedef uint64_t (*kns_t)(void);
    kns_t kernel_ns = (kns_t)dlsym(libcuda, "fake_cuda_kernel_ns");
    CUcontext home = capture_ctx, there = NULL;
    CUstream s = NULL;
    CUlibrary lib = NULL;
    CUkernel k = NULL;
    CUresult rc = api.cuDevicePrimaryCtxRetain(&there, dev);
    if (rc == CUDA_SUCCESS) rc = api.cuCtxSetCurrent(there);
    if (rc == CUDA_SUCCESS) rc = api.cuStreamCreate(&s, 0);
    if (rc == CUDA_SUCCESS) rc = api.cuLibraryLoadData(&lib, "fake image", NULL, NULL, 0, NULL, NULL, 0);
    if (rc == CUDA_SUCCESS) rc = api.cuLibraryGetKernel(&k, lib, "k");
    api.cuCtxSetCurrent(home);
    uint64_t k0 = kernel_ns(), t0 = now_ns(), end = t0 + (uint64_t)(seconds * 1e9), n = 0;
    while (rc == CUDA_SUCCESS && now_ns() < end) {
        rc = api.cuLaunchKernel((CUfunction)k, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        n++;
    }
    if (s) api.cuStreamSynchronize(s);
    uint64_t wall = now_ns() - t0;
    CUcontext after = NULL;
    api.cuCtxGetCurrent(&after);
    /* the last field: whether the caller's context is still the current one */
    printf("xbench %d %llu %llu %llu %d\n", rc, (unsigned long long)n, (unsigned long long)(kernel_ns() - k0),
           (unsigned long long)wall, after == home);
}

/* Real GPUs only: `count` cuMemAlloc+cuMemFree pairs of `size` bytes; ns per pair. */
static void allocbench(long count, uint64_t size)
{
    CUresult rc = CUDA_SUCCESS;
    CUdeviceptr p;
    for (int warm = 0; warm < 100 && rc == CUDA_SUCCESS; warm++)
        if ((rc = api.cuMemAlloc_v2(&p, size)) == CUDA_SUCCESS) rc = api.cuMemFree_v2(p);
    uint64_t t0 = now_ns();
    for (long n = 0; n < count && rc == CUDA_SUCCESS; n++)
        if ((rc = api.cuMemAlloc_v2(&p, size)) == CUDA_SUCCESS) rc = api.cuMemFree_v2(p);
    printf("allocbench %d %llu\n", rc, (unsigned long long)((now_ns() - t0) / (uint64_t)count));
}

/* mbench SECONDS N: N threads, each launching on a stream of its own as fast as it can; like
 * bench, prints launches, the fake GPU's kernel time and the wall time (mbench() below). */

struct mbench_arg {
    uint64_t end, launches;
    CUresult rc;
    int own_ctx; /* the thread makes a context of its own (cuCtxCreate) */
    CUstream shared; /* mbenchone: the stream every thread launches on */
    int copy;        /* mbenchone: an async copy on it before each launch (odd threads) */
};

static void *mbench_thread(void *p)
{
    struct mbench_arg *a = p;
    CUstream s = a->shared;
    CUcontext c = NULL;
    static char host[64];
    a->rc = a->own_ctx ? api.cuCtxCreate_v2(&c, 0, 0) : api.cuCtxSetCurrent(capture_ctx);
    if (a->rc == CUDA_SUCCESS && !s) a->rc = api.cuStreamCreate(&s, 0);
    while (a->rc == CUDA_SUCCESS && now_ns() < a->end) {
        if (a->copy) a->rc = api.cuMemcpyHtoDAsync_v2((CUdeviceptr)0x1000, host, sizeof(host), s);
        if (a->rc == CUDA_SUCCESS) a->rc = api.cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
        a->launches++;
    }
    api.cuStreamSynchronize(s);
    return NULL;
}

/* mbenchctx: each thread in a context of its own; mbenchone: all on one stream, the odd threads
 * with an async copy before each launch */
static void mbench(double seconds, int n, int own_ctx, int one)
{
    typedef uint64_t (*kns_t)(void);
    kns_t kernel_ns = (kns_t)dlsym(libcuda, "fake_cuda_kernel_ns");
    struct mbench_arg args[16];
    pthread_t t[16];
    if (n > 16) n = 16;
    uint64_t k0 = kernel_ns(), t0 = now_ns(), launches = 0;
    CUresult rc = CUDA_SUCCESS;
    CUstream shared = NULL;
    if (one && (rc = api.cuStreamCreate(&shared, 0)) != CUDA_SUCCESS) n = 0;
    for (int i = 0; i < n; i++) {
        args[i] = (struct mbench_arg){t0 + (uint64_t)(seconds * 1e9), 0, CUDA_SUCCESS, own_ctx, shared, one && i % 2};
        pthread_create(&t[i], NULL, mbench_thread, &args[i]);
    }
    for (int i = 0; i < n; i++) {
        pthread_join(t[i], NULL);
        launches += args[i].launches;
        if (args[i].rc != CUDA_SUCCESS) rc = args[i].rc;
    }
    printf("%s %d %llu %llu %llu\n", one ? "mbenchone" : own_ctx ? "mbenchctx" : "mbench", rc, (unsigned long long)launches, (unsigned long long)(kernel_ns() - k0),
           (unsigned long long)(now_ns() - t0));
}

/* captureother N: this thread captures a stream in global mode while another thread launches N
 * kernels on a stream of its own; prints the capture's end and the other thread's launches. */
static CUresult other_rc;
static int other_n;

static void *other_launcher(void *arg)
{
    (void)arg;
    CUstream y = NULL;
    api.cuCtxSetCurrent(capture_ctx);
    api.cuStreamCreate(&y, 0);
    other_rc = CUDA_SUCCESS;
    for (int n = 0; n < other_n && other_rc == CUDA_SUCCESS; n++)
        other_rc = api.cuLaunchKernel((CUfunction)0x4321, 1, 1, 1, 1, 1, 1, 0, y, NULL, NULL);
    return NULL;
}

static void capture_other(int n, int recapture)
{
    CUstream x = NULL;
    void *g = NULL;
    api.cuStreamCreate(&x, 0);
    CUresult rc = CUDA_SUCCESS;
    if (!recapture)
        rc = api.cuStreamBeginCapture_v2(x, 0 /* global */);
    else if ((rc = api.cuGraphCreate((CUgraph *)&g, 0)) == CUDA_SUCCESS) /* CUDA 13.3: into an existing graph */
        rc = api1.cuStreamBeginRecaptureToGraph(x, 0 /* global */, (CUgraph)g, NULL, NULL);
    if (rc == CUDA_SUCCESS) rc = api.cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, x, NULL, NULL);
    other_n = n;
    pthread_t t;
    pthread_create(&t, NULL, other_launcher, NULL);
    pthread_join(t, NULL);
    CUresult end = api.cuStreamEndCapture(x, &g);
    printf("%s %d %d %d\n", recapture ? "recaptureother" : "captureother", rc, end, other_rc);
}

/* One background thread at a time ("bgalloc", "bgretain"), its result printed at "join".  Its
 * start and end can be ordered against the main thread's steps by files rather than by its
 * delay: "bgafter PATH" makes the next one wait for PATH (as "waitfile") before anything else,
 * "bgdone PATH" makes it create PATH once its call has returned. */
static char bg_after[4096], bg_done[4096];

static void wait_file(const char *path, int *timed_out)
{
    struct stat st;
    int n = 0;
    while (stat(path, &st) != 0 && n++ < 2000) usleep(5000);
    *timed_out = n > 2000;
}

static struct {
    pthread_t thread;
    int running;
    char what[16];
    long ms;
    uint64_t size;
    CUresult rc;
    const char *path;  /* bgcapture: the file it waits for */
    CUresult end_rc;   /* bgcapture: the capture's end */
    uint64_t waited;   /* bgcapture: ns its begin took */
    uint64_t handle;   /* bgarray: the array made, an allocation ID from "join" on */
    char after[4096], done[4096]; /* "bgafter", "bgdone" given before it started */
} bg;

static void bg_work(void);

static void *bg_main(void *p)
{
    (void)p;
    if (bg.after[0]) {
        int timed_out;
        wait_file(bg.after, &timed_out);
        if (timed_out) fprintf(stderr, "gsprobe: bgafter: %s never appeared\n", bg.after);
    }
    bg_work();
    if (bg.done[0]) fclose(fopen(bg.done, "w"));
    return NULL;
}

static void bg_work(void)
{
    if (!strcmp(bg.what, "bgalloc") || !strcmp(bg.what, "bgpitch")) {
        CUdeviceptr d = 0;
        size_t pitch = 0;
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = !strcmp(bg.what, "bgalloc") ? api.cuMemAlloc_v2(&d, bg.size)
                                            : api.cuMemAllocPitch_v2(&d, &pitch, bg.size, 1, 4);
    } else if (!strcmp(bg.what, "bgasync")) {
        CUdeviceptr d = 0;
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuMemAllocAsync(&d, bg.size, NULL);
    } else if (!strcmp(bg.what, "bgarray")) {
        CUDA_ARRAY_DESCRIPTOR d = {bg.size >> 32, bg.size & 0xffffffffu, 0x20, 4}; /* float4 */
        CUarray a = NULL;
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuArrayCreate_v2(&a, &d);
        bg.handle = (uint64_t)(uintptr_t)a;
    } else if (!strcmp(bg.what, "bgeimport")) {
        CUDA_EXTERNAL_MEMORY_HANDLE_DESC d;
        CUexternalMemory e = NULL;
        memset(&d, 0, sizeof(d));
        d.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
        d.handle.fd = dup(allocs[bg.size].fd);
        d.size = allocs[bg.size].size;
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuImportExternalMemory(&e, &d);
        if (bg.rc != CUDA_SUCCESS && d.handle.fd >= 0) close(d.handle.fd);
        bg.handle = (uint64_t)(uintptr_t)e;
    } else if (!strcmp(bg.what, "bgarrayfree")) {
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = allocs[bg.size].kind == A_EXTMEM
                    ? api.cuDestroyExternalMemory((CUexternalMemory)(uintptr_t)allocs[bg.size].handle)
                    : api.cuArrayDestroy((CUarray)(uintptr_t)allocs[bg.size].handle);
    } else if (!strcmp(bg.what, "bgaunmap") || !strcmp(bg.what, "bgamap")) {
        CUarrayMapInfo m; /* as "aunmap" / "amap": the 64x64 tile at x = X (size: ARRAY << 40 | VMM << 20 | X) */
        int map = !strcmp(bg.what, "bgamap");
        memset(&m, 0, sizeof(m));
        m.resourceType = CU_RESOURCE_TYPE_ARRAY;
        m.resource.array = (CUarray)(uintptr_t)allocs[bg.size >> 40].handle;
        m.subresourceType = CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_SPARSE_LEVEL;
        m.subresource.sparseLevel.offsetX = (unsigned)(bg.size & 0xfffffu);
        m.subresource.sparseLevel.extentWidth = 64;
        m.subresource.sparseLevel.extentHeight = 64;
        m.subresource.sparseLevel.extentDepth = 1;
        m.memOperationType = map ? CU_MEM_OPERATION_TYPE_MAP : CU_MEM_OPERATION_TYPE_UNMAP;
        m.memHandleType = CU_MEM_HANDLE_TYPE_GENERIC;
        if (map) m.memHandle.memHandle = allocs[(bg.size >> 20) & 0xfffffu].handle;
        m.deviceBitMask = 1;
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuMemMapArrayAsync(&m, 1, NULL);
    } else if (!strcmp(bg.what, "bgfreeasync")) {
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuMemFreeAsync(allocs[bg.size].handle, NULL);
    } else if (!strcmp(bg.what, "bgssync")) {
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuStreamSynchronize(NULL);
    } else if (!strcmp(bg.what, "bgsetpool")) {
        CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = !bg.size                ? api.cuDeviceSetMemPool(0, user_pool)
                : api.cuMemSetMemPool ? api.cuMemSetMemPool(&loc, CU_MEM_ALLOCATION_TYPE_PINNED, user_pool)
                                        : CUDA_ERROR_NOT_FOUND;
    } else if (!strcmp(bg.what, "bgfreesync")) {
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuMemFree_v2(allocs[bg.size].handle);
    } else if (!strcmp(bg.what, "bgmodule")) {
        typedef CUresult (*module_t)(uint64_t);
        module_t load = (module_t)dlsym(libcuda, "fake_cuda_module_load");
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = load ? load(bg.size) : CUDA_ERROR_NOT_SUPPORTED;
    } else if (!strcmp(bg.what, "bgsetlimit")) {
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuCtxSetLimit(2, bg.size);
    } else if (!strcmp(bg.what, "bgvremap")) {
        /* new memory mapped at the start of the "vmapall" range, its handle released */
        CUmemAllocationProp prop = {1, 0, {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
        CUmemGenericAllocationHandle h = 0;
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuMemCreate(&h, bg.size, &prop, 0);
        if (bg.rc == CUDA_SUCCESS) bg.rc = api.cuMemMap(vrange, bg.size, 0, h, 0);
        if (h) api.cuMemRelease(h);
    } else if (!strcmp(bg.what, "bgvmap")) {
        /* as "vmap": VMM allocation ID mapped at an address of its own */
        api.cuCtxSetCurrent(capture_ctx);
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuMemAddressReserve(&allocs[bg.size].va, allocs[bg.size].size, 0, 0, 0);
        if (bg.rc == CUDA_SUCCESS)
            bg.rc = api.cuMemMap(allocs[bg.size].va, allocs[bg.size].size, 0, allocs[bg.size].handle, 0);
        allocs[bg.size].mapped = allocs[bg.size].size;
    } else if (!strcmp(bg.what, "bgctxdestroy")) {
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuCtxDestroy_v2(ctxs[bg.size]);
    } else if (!strcmp(bg.what, "bgpooldestroy")) {
        api.cuCtxSetCurrent(capture_ctx);
        bg.rc = api.cuMemPoolDestroy((CUmemoryPool)(uintptr_t)bg.size);
    } else if (!strcmp(bg.what, "bggdestroy")) {
        CUgraphExec e = (CUgraphExec)(uintptr_t)bg.size;
        api.cuCtxSetCurrent(capture_ctx);
        bg.rc = api.cuGraphExecDestroy(e);
    } else if (!strcmp(bg.what, "bgcapture")) {
        /* a global capture begun once bg.path exists, held open for bg.ms */
        CUstream cs = NULL;
        void *g = NULL;
        api.cuCtxSetCurrent(capture_ctx);
        api.cuStreamCreate(&cs, 1);
        struct stat st;
        for (int n = 0; stat(bg.path, &st) != 0 && n < 20000; n++) usleep(1000);
        uint64_t t0 = now_ns();
        bg.rc = api.cuStreamBeginCapture_v2(cs, 0 /* global */);
        bg.waited = now_ns() - t0;
        if (bg.rc == CUDA_SUCCESS)
            bg.rc = api.cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, cs, NULL, NULL);
        usleep((useconds_t)bg.ms * 1000);
        bg.end_rc = api.cuStreamEndCapture(cs, &g);
    } else if (!strcmp(bg.what, "bgglaunch")) {
        api.cuCtxSetCurrent(capture_ctx);
        bg.rc = CUDA_SUCCESS;
        for (long n = 0; n < bg.ms && bg.rc == CUDA_SUCCESS; n++) bg.rc = api.cuGraphLaunch(gexec, NULL);
    } else {
        CUcontext c = NULL;
        usleep((useconds_t)bg.ms * 1000);
        bg.rc = api.cuDevicePrimaryCtxRetain(&c, 0);
    }
}

static struct timespec mark_ts;

static void bg_start(const char *what, long ms, uint64_t size)
{
    snprintf(bg.what, sizeof(bg.what), "%s", what);
    bg.ms = ms;
    bg.size = size;
    memcpy(bg.after, bg_after, sizeof(bg.after));
    memcpy(bg.done, bg_done, sizeof(bg.done));
    bg_after[0] = bg_done[0] = '\0'; /* the next one's own */
    bg.running = pthread_create(&bg.thread, NULL, bg_main, NULL) == 0;
}

static void bg_join(void)
{
    if (!bg.running) return;
    pthread_join(bg.thread, NULL);
    bg.running = 0;
    if (!strcmp(bg.what, "bgcapture"))
        printf("bgcapture %d %d %llu\n", bg.rc, bg.end_rc, (unsigned long long)(bg.waited / 1000000));
    else if (!strcmp(bg.what, "bgarray"))
        remember("bgarray", bg.rc, A_ARRAY, bg.handle); /* "free ID" destroys it */
    else if (!strcmp(bg.what, "bgeimport"))
        remember("bgeimport", bg.rc, A_EXTMEM, bg.handle);
    else
        printf("%s %d\n", bg.what, bg.rc);
}

/* `count` cuArrayCreate_v2+cuArrayDestroy pairs of a 2D float4 array, w x h texels; ns per pair. */
static void arraybench(long count, uint64_t w, uint64_t h)
{
    CUDA_ARRAY_DESCRIPTOR d = {w, h, 0x20, 4};
    CUresult rc = CUDA_SUCCESS;
    uint64_t t0 = 0;
    for (long n = -100; n < count && rc == CUDA_SUCCESS; n++) { /* 100 warm-up rounds */
        if (n == 0) t0 = now_ns();
        CUarray a = NULL;
        if ((rc = api.cuArrayCreate_v2(&a, &d)) == CUDA_SUCCESS) rc = api.cuArrayDestroy(a);
    }
    printf("arraybench %d %llu\n", rc, (unsigned long long)(count > 0 ? (now_ns() - t0) / (uint64_t)count : 0));
}

/* PyTorch's expandable segments, page by page: create, map, release the handle (the mapping
 * keeps the memory), then unmap; ns per page. */
static void vmmbench(long count, uint64_t size)
{
    CUmemAllocationProp prop = {1, 0, {CU_MEM_LOCATION_TYPE_DEVICE, 0}};
    CUdeviceptr va = 0;
    CUresult rc = api.cuMemAddressReserve(&va, size, 0, 0, 0);
    uint64_t t0 = 0;
    for (long n = -100; n < count && rc == CUDA_SUCCESS; n++) { /* 100 warm-up rounds */
        if (n == 0) t0 = now_ns();
        CUmemGenericAllocationHandle h = 0;
        if ((rc = api.cuMemCreate(&h, size, &prop, 0)) != CUDA_SUCCESS) break;
        if ((rc = api.cuMemMap(va, size, 0, h, 0)) == CUDA_SUCCESS) rc = api.cuMemRelease(h);
        if (rc == CUDA_SUCCESS) rc = api.cuMemUnmap(va, size);
    }
    printf("vmmbench %d %llu\n", rc, (unsigned long long)(count > 0 ? (now_ns() - t0) / (uint64_t)count : 0));
}

/* Real GPUs only: launch an empty kernel (PTX, JIT-compiled by the driver) `count`
 * times; ns per launch, the GPU drained at the end. */
static void launchbench(long count)
{
    static const char ptx[] = ".version 7.0\n.target sm_50\n.address_size 64\n"
                              ".visible .entry gs_noop()\n{\n ret;\n}\n";
    typedef CUresult (*load_t)(void **, const void *);
    typedef CUresult (*getfn_t)(CUfunction *, void *, const char *);
    load_t load = (load_t)dlsym(libcuda, "cuModuleLoadData");
    getfn_t getfn = (getfn_t)dlsym(libcuda, "cuModuleGetFunction");
    void *mod = NULL;
    CUfunction f = NULL;
    CUresult rc = load && getfn ? load(&mod, ptx) : CUDA_ERROR_NOT_SUPPORTED;
    if (rc == CUDA_SUCCESS) rc = getfn(&f, mod, "gs_noop");
    for (int warm = 0; warm < 1000 && rc == CUDA_SUCCESS; warm++)
        rc = api.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
    ctx_sync();
    uint64_t t0 = now_ns();
    for (long n = 0; n < count && rc == CUDA_SUCCESS; n++)
        rc = api.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
    uint64_t launched = now_ns() - t0;
    ctx_sync();
    printf("launchbench %d %llu %llu\n", rc, (unsigned long long)(launched / (uint64_t)count),
           (unsigned long long)((now_ns() - t0) / (uint64_t)count));
}

static nvmlDevice_t nvml_device(unsigned index)
{
    static nvml_handle_t by_index;
    nvmlDevice_t d = NULL;
    if (!by_index) {
        void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        ((nvml_init_t)dlsym(h, "nvmlInit_v2"))();
        by_index = (nvml_handle_t)dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    }
    by_index(index, &d);
    return d;
}

static nvml_mem_t nvml_mem(void)
{
    if (strcmp(mode, "direct") == 0) return nvmlDeviceGetMemoryInfo;
    return (nvml_mem_t)dlsym(dlopen("libnvidia-ml.so.1", RTLD_NOW), "nvmlDeviceGetMemoryInfo");
}

static nvml_mem2_t nvml_mem2(void)
{
    if (strcmp(mode, "direct") == 0) return nvmlDeviceGetMemoryInfo_v2;
    return (nvml_mem2_t)dlsym(dlopen("libnvidia-ml.so.1", RTLD_NOW), "nvmlDeviceGetMemoryInfo_v2");
}

/* "sigcatch" / "segv": a handler of the program's own, and a fault for it */
static void *volatile probe_null;
static void probe_fatal(int sig)
{
    static const char msg[] = "probe handler\n";
    (void)sig;
    ssize_t w = write(STDOUT_FILENO, msg, sizeof(msg) - 1);
    (void)w;
    _exit(42);
}

/* "badframe": a fault in a function whose frame pointer was overwritten, as in a smashed stack,
 * its caller's frame found through it (x86_64; elsewhere "badframe -1"): whoever unwinds the
 * stack from there reads a wild address too */
#if defined(__x86_64__)
void probe_bad_frame(void);
__asm__(".text\n"
        ".globl probe_bad_frame\n"
        ".type probe_bad_frame, @function\n"
        "probe_bad_frame:\n"
        ".cfi_startproc\n"
        "pushq %rbp\n"
        ".cfi_def_cfa_offset 16\n"
        ".cfi_offset %rbp, -16\n"
        "movq %rsp, %rbp\n"
        ".cfi_def_cfa_register %rbp\n"
        "movq $16, %rbp\n"
        "movl $1, 0\n"
        "popq %rbp\n"
        ".cfi_def_cfa %rsp, 8\n"
        "ret\n"
        ".cfi_endproc\n"
        ".size probe_bad_frame, .-probe_bad_frame\n");
#endif

/* "sigguard" / "guard": a handler of the program's own that makes a guard page readable when
 * a load faults on it (as a runtime's guard pages or a GC's write barrier do: the fault's
 * address and code tell it that the fault is its own) and lets the load run again; and the
 * load.  Any other SIGSEGV it is given: says so, with the code it got, and exits with 43. */
static volatile int *probe_guard;
static void probe_guard_fault(int sig, siginfo_t *info, void *uc)
{
    (void)sig;
    (void)uc;
    if (info->si_code == SEGV_ACCERR && info->si_addr == (void *)probe_guard &&
        mprotect((void *)probe_guard, 4096, PROT_READ | PROT_WRITE) == 0)
        return;
    char msg[64];
    int n = snprintf(msg, sizeof(msg), "probe guard handler: code %d\n", info->si_code);
    ssize_t w = write(STDOUT_FILENO, msg, (size_t)n);
    (void)w;
    _exit(43);
}

/* vforkexit: in a function of its own, so that main()'s variables are not vfork()'s to clobber */
__attribute__((noinline)) static int vfork_exit(void)
{
    fflush(stdout);
    pid_t pid = vfork();
    if (pid == 0) exit(0);
    int status = 0;
    waitpid(pid, &status, 0);
    return status;
}

int main(int argc, char **argv)
{
    int i = 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (i + 1 < argc && strcmp(argv[i], "--api") == 0) {
        mode = argv[i + 1];
        i += 2;
    }
    load_api();
    while (i < argc) {
        const char *c = argv[i++];
#define ARG(k) (i + (k) < argc ? argv[i + (k)] : "0")
        if (!strcmp(c, "legacy")) {
            /* legacy 1|0: the commands below that have a CUDA 2.x entry point use it */
            legacy = atoi(ARG(0));
            printf("legacy 0 %d\n", legacy);
            i += 1;
        } else if (!strcmp(c, "init")) {
            printf("init %d\n", api.cuInit(0));
        } else if (!strcmp(c, "ctx")) {
            CUcontext ctx = NULL;
            CUresult rc = api.cuDevicePrimaryCtxRetain(&ctx, atoi(ARG(0)));
            if (rc == CUDA_SUCCESS) api.cuCtxSetCurrent(ctx);
            if (rc == CUDA_SUCCESS) capture_ctx = ctx;
            printf("ctx %d\n", rc);
            i += 1;
        } else if (!strcmp(c, "release")) {
            int d = atoi(ARG(0));
            printf("release %d\n", legacy ? api1.cuDevicePrimaryCtxRelease(d) : api.cuDevicePrimaryCtxRelease_v2(d));
            i += 1;
        } else if (!strcmp(c, "reset")) {
            int d = atoi(ARG(0));
            printf("reset %d\n", legacy ? api1.cuDevicePrimaryCtxReset(d) : api.cuDevicePrimaryCtxReset_v2(d));
            i += 1;
        } else if (!strcmp(c, "ctxcreate")) {
            CUcontext ctx = NULL;
            CUresult rc = legacy ? api1.cuCtxCreate(&ctx, 0, atoi(ARG(0))) : api.cuCtxCreate_v2(&ctx, 0, atoi(ARG(0)));
            if (rc == CUDA_SUCCESS && nctx < 128) ctxs[nctx] = ctx;
            printf("ctxcreate %d %d\n", rc, rc == CUDA_SUCCESS && nctx < 128 ? nctx++ : -1);
            i += 1;
        } else if (!strcmp(c, "ctxset")) {
            /* ctxset N: make the Nth context "ctxcreate" made current */
            printf("ctxset %d\n", api.cuCtxSetCurrent(ctxs[atoi(ARG(0))]));
            i += 1;
        } else if (!strcmp(c, "attach")) {
            /* attach: one more use of the current context (CUDA 2.x) */
            CUcontext ctx = NULL;
            printf("attach %d\n", api1.cuCtxAttach(&ctx, 0));
        } else if (!strcmp(c, "detach")) {
            /* detach N: one use less of the Nth context "ctxcreate" made (-1: the current one) */
            int n = atoi(ARG(0));
            CUcontext ctx = NULL;
            if (n < 0) api.cuCtxGetCurrent(&ctx);
            printf("detach %d\n", api1.cuCtxDetach(n < 0 ? ctx : ctxs[n]));
            i += 1;
        } else if (!strcmp(c, "ctxdestroy")) {
            CUcontext ctx = ctxs[atoi(ARG(0))];
            printf("ctxdestroy %d\n", legacy ? api1.cuCtxDestroy(ctx) : api.cuCtxDestroy_v2(ctx));
            i += 1;
        } else if (!strcmp(c, "alloc") || !strcmp(c, "managed")) {
            CUdeviceptr p = 0;
            unsigned p32 = 0;
            CUresult rc;
            if (legacy && !strcmp(c, "alloc")) {
                rc = api1.cuMemAlloc(&p32, (unsigned)size_arg(ARG(0)));
                p = p32;
            } else {
                rc = !strcmp(c, "alloc") ? api.cuMemAlloc_v2(&p, size_arg(ARG(0)))
                                         : api.cuMemAllocManaged(&p, size_arg(ARG(0)), 1);
            }
            remember(c, rc, A_DPTR, p);
            i += 1;
        } else if (!strcmp(c, "pitch")) {
            CUdeviceptr p = 0;
            size_t pitch = 0;
            CUresult rc;
            if (legacy) {
                unsigned p32 = 0, pitch32 = 0;
                rc = api1.cuMemAllocPitch(&p32, &pitch32, (unsigned)size_arg(ARG(0)), (unsigned)size_arg(ARG(1)), 4);
                p = p32;
            } else {
                rc = api.cuMemAllocPitch_v2(&p, &pitch, size_arg(ARG(0)), size_arg(ARG(1)), 4);
            }
            remember("pitch", rc, A_DPTR, p);
            i += 2;
        } else if (!strcmp(c, "async") || !strcmp(c, "pool")) {
            CUdeviceptr p = 0;
            CUresult rc = !strcmp(c, "async")
                              ? api.cuMemAllocAsync(&p, size_arg(ARG(0)), NULL)
                              : api.cuMemAllocFromPoolAsync(&p, size_arg(ARG(0)), get_user_pool(), NULL);
            remember(c, rc, A_POOL, p);
            i += 1;
        } else if (!strcmp(c, "devpool")) {
            /* devpool D SIZE: cuMemAllocFromPoolAsync from device D's current pool */
            CUmemoryPool dp = NULL;
            CUdeviceptr p = 0;
            CUresult rc = api.cuDeviceGetMemPool(&dp, atoi(ARG(0)));
            if (rc == CUDA_SUCCESS) rc = api.cuMemAllocFromPoolAsync(&p, size_arg(ARG(1)), dp, NULL);
            remember(c, rc, A_POOL, p);
            i += 2;
        } else if (!strcmp(c, "xasync")) {
            /* xasync D SIZE: cuMemAllocAsync on a stream of device D's primary context, the
             * current context staying what it is */
            CUcontext home = NULL, there = NULL;
            CUstream st = NULL;
            CUdeviceptr p = 0;
            api.cuCtxGetCurrent(&home);
            CUresult rc = api.cuDevicePrimaryCtxRetain(&there, atoi(ARG(0)));
            if (rc == CUDA_SUCCESS) rc = api.cuCtxSetCurrent(there);
            if (rc == CUDA_SUCCESS) rc = api.cuStreamCreate(&st, 0);
            api.cuCtxSetCurrent(home);
            if (rc == CUDA_SUCCESS) rc = api.cuMemAllocAsync(&p, size_arg(ARG(1)), st);
            remember(c, rc, A_POOL, p);
            i += 2;
        } else if (!strcmp(c, "vmm")) {
            CUmemAllocationProp prop = {1, 0, {CU_MEM_LOCATION_TYPE_DEVICE, atoi(ARG(1))}};
            CUmemGenericAllocationHandle h = 0;
            CUresult rc = api.cuMemCreate(&h, size_arg(ARG(0)), &prop, 0);
            if (rc == CUDA_SUCCESS) allocs[nallocs].size = size_arg(ARG(0));
            remember("vmm", rc, A_VMM, h);
            i += 2;
        } else if (!strcmp(c, "vmmld")) {
            /* vmmld SIZE DEV DOMAIN: cuMemCreate in locality domain DOMAIN of device DEV (CUDA
             * 13.4's CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN: the id's bytes {device, domain}) */
            CUmemAllocationProp prop = {1, 0, {CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN, 0}};
            unsigned char where[4] = {(unsigned char)atoi(ARG(1)), (unsigned char)atoi(ARG(2)), 0, 0};
            memcpy(&prop.location.id, where, sizeof(where));
            CUmemGenericAllocationHandle h = 0;
            CUresult rc = api.cuMemCreate(&h, size_arg(ARG(0)), &prop, 0);
            if (rc == CUDA_SUCCESS) allocs[nallocs].size = size_arg(ARG(0));
            remember("vmmld", rc, A_VMM, h);
            i += 3;
        } else if (!strcmp(c, "vmap")) {
            /* map VMM allocation ID at an address of its own */
            int id = atoi(ARG(0));
            CUresult rc = api.cuMemAddressReserve(&allocs[id].va, allocs[id].size, 0, 0, 0);
            if (rc == CUDA_SUCCESS) rc = api.cuMemMap(allocs[id].va, allocs[id].size, 0, allocs[id].handle, 0);
            allocs[id].mapped = allocs[id].size;
            printf("vmap %d\n", rc);
            i += 1;
        } else if (!strcmp(c, "vmappart")) {
            /* vmappart ID OFFSET SIZE: map SIZE bytes of VMM allocation ID from OFFSET, at an address of
             * its own (vunmap ID unmaps it) */
            int id = atoi(ARG(0));
            uint64_t off = size_arg(ARG(1)), len = size_arg(ARG(2));
            CUresult rc = api.cuMemAddressReserve(&allocs[id].va, len, 0, 0, 0);
            if (rc == CUDA_SUCCESS) rc = api.cuMemMap(allocs[id].va, len, off, allocs[id].handle, 0);
            allocs[id].mapped = len;
            printf("vmappart %d\n", rc);
            i += 3;
        } else if (!strcmp(c, "vunmap")) {
            int id = atoi(ARG(0));
            printf("vunmap %d\n", api.cuMemUnmap(allocs[id].va, allocs[id].mapped ? allocs[id].mapped : allocs[id].size));
            i += 1;
        } else if (!strcmp(c, "closefds")) {
            /* close every descriptor past stderr, as a daemon's closefrom(3) does */
            for (int fd = 3; fd < 4096; fd++) close(fd);
            printf("closefds 0\n");
        } else if (!strcmp(c, "vexport")) {
            /* vexport ID: VMM allocation ID to a file descriptor (vimport takes it) */
            int id = atoi(ARG(0));
            allocs[id].fd = -1;
            printf("vexport %d\n", api.cuMemExportToShareableHandle(&allocs[id].fd, allocs[id].handle, 1, 0));
            i += 1;
        } else if (!strcmp(c, "vimport")) {
            /* vimport ID: a new handle from ID's exported descriptor, remembered as a VMM allocation of ID's size */
            int id = atoi(ARG(0));
            CUmemGenericAllocationHandle h = 0;
            CUresult rc = api.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)allocs[id].fd, 1);
            if (rc == CUDA_SUCCESS) allocs[nallocs].size = allocs[id].size;
            remember("vimport", rc, A_VMM, h);
            i += 1;
        } else if (!strcmp(c, "otheralloc")) {
            /* otheralloc SIZE: memory another API of the process allocates on the current
             * context's device (the fake's stand-in for Vulkan), exported to a descriptor that
             * "eimport" takes; "free" lets go of it */
            typedef CUresult (*other_alloc_t)(uint64_t, uint64_t *, int *);
            other_alloc_t f = (other_alloc_t)dlsym(libcuda, "fake_cuda_other_api_alloc");
            uint64_t h = 0;
            int fd = -1;
            CUresult rc = f ? f(size_arg(ARG(0)), &h, &fd) : CUDA_ERROR_NOT_SUPPORTED;
            allocs[nallocs].size = size_arg(ARG(0));
            allocs[nallocs].fd = fd;
            remember(c, rc, A_OTHER, h);
            i += 1;
        } else if (!strcmp(c, "eimport") || !strcmp(c, "eimportas")) {
            /* eimport ID: ID's exported descriptor (a copy: the driver takes it) imported as
             * external memory of ID's size (cuImportExternalMemory); "free" destroys it.
             * eimportas ID SIZE: described as SIZE bytes */
            int id = atoi(ARG(0)), as = !strcmp(c, "eimportas");
            CUDA_EXTERNAL_MEMORY_HANDLE_DESC d;
            memset(&d, 0, sizeof(d));
            d.type = CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD;
            d.handle.fd = dup(allocs[id].fd);
            d.size = as ? size_arg(ARG(1)) : allocs[id].size;
            CUexternalMemory e = NULL;
            CUresult rc = api.cuImportExternalMemory(&e, &d);
            if (rc != CUDA_SUCCESS && d.handle.fd >= 0) close(d.handle.fd);
            remember(c, rc, A_EXTMEM, (uint64_t)(uintptr_t)e);
            i += 1 + as;
        } else if (!strcmp(c, "vimportfrom")) {
            /* vimportfrom PATH SIZE: a new handle from the descriptor another process's "vfd"
             * named in PATH (as NCCL passes one over a socket), remembered as a VMM allocation
             * of SIZE */
            char path[64];
            int pid = 0, pfd = -1, fd = -1;
            FILE *f = fopen(ARG(0), "r");
            if (f && fscanf(f, "%d %d", &pid, &pfd) == 2) {
                snprintf(path, sizeof(path), "/proc/%d/fd/%d", pid, pfd);
                fd = open(path, O_RDONLY);
            }
            if (f) fclose(f);
            CUmemGenericAllocationHandle h = 0;
            CUresult rc = fd < 0 ? CUDA_ERROR_INVALID_VALUE
                                 : api.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd, 1);
            if (fd >= 0) close(fd);
            if (rc == CUDA_SUCCESS) allocs[nallocs].size = size_arg(ARG(1));
            remember("vimportfrom", rc, A_VMM, h);
            i += 2;
        } else if (!strcmp(c, "ipcget") || !strcmp(c, "ipcopen") || !strcmp(c, "ipcevent") ||
                   !strcmp(c, "ipcwait")) {
            /* CUDA IPC through a file (a 64-byte handle, written whole by a rename):
             * ipcget ID PATH: allocation ID's handle (cuIpcGetMemHandle) to PATH;
             * ipcopen PATH: the handle in PATH mapped (cuIpcOpenMemHandle, lazy peer access),
             *   remembered as an allocation ("free" closes it);
             * ipcevent PATH: an interprocess event recorded on the legacy stream, its handle
             *   (cuIpcGetEventHandle) to PATH (the event is kept);
             * ipcwait PATH: the event in PATH opened (cuIpcOpenEventHandle), waited for on the
             *   legacy stream and synchronised, then destroyed; prints the four results */
            int get = !strcmp(c, "ipcget"), event = !strcmp(c, "ipcevent");
            const char *path = ARG(get);
            ipc_handle_t h;
            memset(&h, 0, sizeof(h));
            if (get || event) {
                CUresult rc;
                if (get) {
                    rc = api.cuIpcGetMemHandle(&h, allocs[atoi(ARG(0))].handle);
                } else {
                    CUevent ev = NULL;
                    rc = api.cuEventCreate(&ev, 0x2 | 0x4); /* CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS */
                    if (rc == CUDA_SUCCESS) rc = api.cuEventRecord(ev, NULL);
                    if (rc == CUDA_SUCCESS) rc = api.cuIpcGetEventHandle(&h, ev);
                }
                char tmp[4096];
                snprintf(tmp, sizeof(tmp), "%s.tmp", path);
                FILE *f = rc == CUDA_SUCCESS ? fopen(tmp, "w") : NULL;
                if (f) {
                    fwrite(&h, sizeof(h), 1, f);
                    fclose(f);
                    rename(tmp, path);
                }
                printf("%s %d\n", c, rc);
            } else {
                FILE *f = fopen(path, "r");
                int whole = f && fread(&h, sizeof(h), 1, f) == 1;
                if (f) fclose(f);
                if (!strcmp(c, "ipcopen")) {
                    CUdeviceptr p = 0;
                    CUresult rc = whole ? api.cuIpcOpenMemHandle_v2(&p, h, 1) : CUDA_ERROR_INVALID_VALUE;
                    remember(c, rc, A_IPC, p);
                } else {
                    CUevent ev = NULL;
                    CUresult open = whole ? api.cuIpcOpenEventHandle(&ev, h) : CUDA_ERROR_INVALID_VALUE;
                    CUresult wait = open == CUDA_SUCCESS ? api.cuStreamWaitEvent(NULL, ev, 0) : open;
                    CUresult sync = open == CUDA_SUCCESS ? api.cuEventSynchronize(ev) : open;
                    CUresult destroy = open == CUDA_SUCCESS ? api.cuEventDestroy_v2(ev) : open;
                    printf("%s %d %d %d %d\n", c, open, wait, sync, destroy);
                }
            }
            i += 1 + get;
        } else if (!strcmp(c, "ipcnull")) {
            /* the IPC calls with NULL outputs or nothing to name: the driver's answers, in order
             * get(NULL handle), open(NULL pointer), close(0), get event(NULL handle),
             * open event(NULL event), get event of a NULL event */
            ipc_handle_t h;
            memset(&h, 0, sizeof(h));
            printf("ipcnull %d %d %d %d %d %d\n", api.cuIpcGetMemHandle(NULL, allocs[0].handle),
                   api.cuIpcOpenMemHandle_v2(NULL, h, 1), api.cuIpcCloseMemHandle(0),
                   api.cuIpcGetEventHandle(NULL, NULL), api.cuIpcOpenEventHandle(NULL, h),
                   api.cuIpcGetEventHandle(&h, NULL));
        } else if (!strcmp(c, "vfd")) {
            /* vfd ID PATH: this process's pid and ID's exported descriptor, written to PATH */
            int id = atoi(ARG(0));
            char tmp[4096];
            snprintf(tmp, sizeof(tmp), "%s.tmp", ARG(1));
            FILE *f = fopen(tmp, "w");
            fprintf(f, "%d %d\n", (int)getpid(), allocs[id].fd);
            fclose(f);
            printf("vfd %d\n", rename(tmp, ARG(1)) == 0 ? 0 : 1);
            i += 2;
        } else if (!strcmp(c, "vretain")) {
            /* a second reference to the allocation mapped at ID's address (released by "free ID") */
            int id = atoi(ARG(0));
            CUmemGenericAllocationHandle h = 0;
            CUresult rc = api.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)(allocs[id].va + 4096));
            printf("vretain %d %d\n", rc, rc == CUDA_SUCCESS && h == allocs[id].handle);
            i += 1;
        } else if (!strcmp(c, "vmapall")) {
            /* every VMM allocation so far, back to back in one reservation */
            vrange_size = 0;
            for (int k = 0; k < nallocs; k++)
                if (allocs[k].kind == A_VMM) vrange_size += allocs[k].size;
            CUresult rc = api.cuMemAddressReserve(&vrange, vrange_size, 0, 0, 0);
            CUdeviceptr at = vrange;
            for (int k = 0; k < nallocs && rc == CUDA_SUCCESS; k++) {
                if (allocs[k].kind != A_VMM) continue;
                rc = api.cuMemMap(at, allocs[k].size, 0, allocs[k].handle, 0);
                allocs[k].va = at;
                at += allocs[k].size;
            }
            printf("vmapall %d\n", rc);
        } else if (!strcmp(c, "vunmapall")) {
            printf("vunmapall %d\n", api.cuMemUnmap(vrange, vrange_size));
        } else if (!strcmp(c, "amap") || !strcmp(c, "aunmap") || !strcmp(c, "aunmapwide")) {
            /* amap ARRAY VMM X: map VMM allocation VMM into sparse array ARRAY's 64x64 tile at x = X
             * (ids as "free" takes them); aunmap ARRAY X: unmap that tile; aunmapwide ARRAY X: unmap
             * a region twice as wide from there (no mapping has exactly that extent) */
            int map = !strcmp(c, "amap");
            CUarrayMapInfo m;
            memset(&m, 0, sizeof(m));
            m.resourceType = CU_RESOURCE_TYPE_ARRAY;
            m.resource.array = (CUarray)(uintptr_t)allocs[atoi(ARG(0))].handle;
            m.subresourceType = CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_SPARSE_LEVEL;
            m.subresource.sparseLevel.offsetX = (unsigned)atoi(ARG(map ? 2 : 1));
            m.subresource.sparseLevel.extentWidth = !strcmp(c, "aunmapwide") ? 128 : 64;
            m.subresource.sparseLevel.extentHeight = 64;
            m.subresource.sparseLevel.extentDepth = 1;
            m.memOperationType = map ? CU_MEM_OPERATION_TYPE_MAP : CU_MEM_OPERATION_TYPE_UNMAP;
            m.memHandleType = CU_MEM_HANDLE_TYPE_GENERIC;
            if (map) m.memHandle.memHandle = allocs[atoi(ARG(1))].handle;
            m.deviceBitMask = 1;
            printf("%s %d\n", c, api.cuMemMapArrayAsync(&m, 1, NULL));
            i += map ? 3 : 2;
        } else if (!strcmp(c, "amaplist")) {
            /* amaplist ARRAY N OP VMM X ...: one cuMemMapArrayAsync call of N operations (at most 8):
             * OP m maps allocation VMM (-1: a handle that is no allocation) into the 64x64 tile at
             * x = X, OP u unmaps that tile (VMM ignored) */
            int n = atoi(ARG(1));
            CUarrayMapInfo ms[8];
            memset(ms, 0, sizeof(ms));
            for (int k = 0; k < n && k < 8; k++) {
                CUarrayMapInfo *m = &ms[k];
                int map = ARG(2 + 3 * k)[0] == 'm', id = atoi(ARG(3 + 3 * k));
                m->resourceType = CU_RESOURCE_TYPE_ARRAY;
                m->resource.array = (CUarray)(uintptr_t)allocs[atoi(ARG(0))].handle;
                m->subresourceType = CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_SPARSE_LEVEL;
                m->subresource.sparseLevel.offsetX = (unsigned)atoi(ARG(4 + 3 * k));
                m->subresource.sparseLevel.extentWidth = 64;
                m->subresource.sparseLevel.extentHeight = 64;
                m->subresource.sparseLevel.extentDepth = 1;
                m->memOperationType = map ? CU_MEM_OPERATION_TYPE_MAP : CU_MEM_OPERATION_TYPE_UNMAP;
                m->memHandleType = CU_MEM_HANDLE_TYPE_GENERIC;
                if (map) m->memHandle.memHandle = id < 0 ? 0xdead : allocs[id].handle;
                m->deviceBitMask = 1;
            }
            printf("amaplist %d\n", api.cuMemMapArrayAsync(ms, (unsigned)(n < 8 ? n : 8), NULL));
            i += 2 + 3 * n;
        } else if (!strcmp(c, "array")) {
            CUDA_ARRAY_DESCRIPTOR d = {size_arg(ARG(0)), size_arg(ARG(1)), 0x20, 4};
            CUDA_ARRAY_DESCRIPTOR_v1 d1 = {(unsigned)d.Width, (unsigned)d.Height, d.Format, d.NumChannels};
            CUarray a = NULL;
            CUresult rc = legacy ? api1.cuArrayCreate(&a, &d1) : api.cuArrayCreate_v2(&a, &d);
            remember("array", rc, A_ARRAY, (uint64_t)(uintptr_t)a);
            i += 2;
        } else if (!strcmp(c, "array3d") || !strcmp(c, "sparse3d")) {
            /* sparse3d: CUDA_ARRAY3D_SPARSE, no memory until pages are mapped into it */
            CUDA_ARRAY3D_DESCRIPTOR d = {size_arg(ARG(0)), size_arg(ARG(1)), size_arg(ARG(2)), 0x01, 1,
                                         !strcmp(c, "sparse3d") ? 0x40 : 0};
            CUDA_ARRAY3D_DESCRIPTOR_v1 d1 = {(unsigned)d.Width, (unsigned)d.Height, (unsigned)d.Depth, d.Format,
                                             d.NumChannels, d.Flags};
            CUarray a = NULL;
            CUresult rc = legacy ? api1.cuArray3DCreate(&a, &d1) : api.cuArray3DCreate_v2(&a, &d);
            remember(c, rc, A_ARRAY, (uint64_t)(uintptr_t)a);
            i += 3;
        } else if (!strcmp(c, "mipmap")) {
            CUDA_ARRAY3D_DESCRIPTOR d = {size_arg(ARG(0)), size_arg(ARG(1)), 0, 0x10, 2, 0};
            CUmipmappedArray m = NULL;
            CUresult rc = api.cuMipmappedArrayCreate(&m, &d, (unsigned)atoi(ARG(2)));
            remember("mipmap", rc, A_MIPMAP, (uint64_t)(uintptr_t)m);
            i += 3;
        } else if (!strcmp(c, "mipmap3d")) {
            /* mipmap3d W H D FLAGS LEVELS FORMAT CHANNELS: any descriptor (layered, cubemap) */
            CUDA_ARRAY3D_DESCRIPTOR d = {size_arg(ARG(0)), size_arg(ARG(1)), size_arg(ARG(2)),
                                         (CUarray_format)strtol(ARG(5), NULL, 0), (unsigned)atoi(ARG(6)),
                                         (unsigned)strtol(ARG(3), NULL, 0)};
            CUmipmappedArray m = NULL;
            CUresult rc = api.cuMipmappedArrayCreate(&m, &d, (unsigned)atoi(ARG(4)));
            remember("mipmap3d", rc, A_MIPMAP, (uint64_t)(uintptr_t)m);
            i += 7;
        } else if (!strcmp(c, "free") || !strcmp(c, "freesync")) {
            int id = atoi(ARG(0));
            uint64_t h = allocs[id].handle;
            CUresult rc;
            switch (allocs[id].kind) {
            case A_POOL: rc = !strcmp(c, "free") ? api.cuMemFreeAsync(h, NULL) : api.cuMemFree_v2(h); break;
            case A_VMM: rc = api.cuMemRelease(h); break;
            case A_ARRAY: rc = api.cuArrayDestroy((CUarray)(uintptr_t)h); break;
            case A_MIPMAP: rc = api.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)h); break;
            case A_EXTMEM: rc = api.cuDestroyExternalMemory((CUexternalMemory)(uintptr_t)h); break;
            case A_IPC: rc = api.cuIpcCloseMemHandle(h); break;
            case A_OTHER: {
                typedef CUresult (*other_free_t)(uint64_t);
                other_free_t f = (other_free_t)dlsym(libcuda, "fake_cuda_other_api_free");
                rc = f ? f(h) : CUDA_ERROR_NOT_SUPPORTED;
                break;
            }
            default: rc = legacy ? api1.cuMemFree((unsigned)h) : api.cuMemFree_v2(h); break;
            }
            printf("%s %d\n", c, rc);
            i += 1;
        } else if (!strcmp(c, "trim") || !strcmp(c, "trimdefault")) {
            CUmemoryPool p = user_pool;
            if (!strcmp(c, "trimdefault")) api.cuDeviceGetMemPool(&p, 0);
            printf("%s %d\n", c, api.cuMemPoolTrimTo(p, size_arg(ARG(0))));
            i += 1;
        } else if (!strcmp(c, "pooldestroy")) {
            printf("pooldestroy %d\n", api.cuMemPoolDestroy(user_pool));
        } else if (!strcmp(c, "meminfo")) {
            size_t fr = 0, tot = 0;
            unsigned fr32 = 0, tot32 = 0;
            CUresult rc = legacy ? api1.cuMemGetInfo(&fr32, &tot32) : api.cuMemGetInfo_v2(&fr, &tot);
            if (legacy) fr = fr32, tot = tot32;
            printf("meminfo %d %zu %zu\n", rc, fr, tot);
        } else if (!strcmp(c, "meminfo1")) {
            /* one out-parameter at a time, as libnvoptix asks (cuMemGetInfo_v2(NULL, &total)):
             * "meminfo1 <rc total only> <total> <rc free only> <free>" */
            size_t fr = 0, tot = 0;
            unsigned fr32 = 0, tot32 = 0;
            CUresult rt = legacy ? api1.cuMemGetInfo(NULL, &tot32) : api.cuMemGetInfo_v2(NULL, &tot);
            CUresult rf = legacy ? api1.cuMemGetInfo(&fr32, NULL) : api.cuMemGetInfo_v2(&fr, NULL);
            if (legacy) fr = fr32, tot = tot32;
            printf("meminfo1 %d %zu %d %zu\n", rt, tot, rf, fr);
        } else if (!strcmp(c, "totalmem")) {
            size_t tot = 0;
            unsigned tot32 = 0;
            CUresult rc = legacy ? api1.cuDeviceTotalMem(&tot32, atoi(ARG(0))) : api.cuDeviceTotalMem_v2(&tot, atoi(ARG(0)));
            if (legacy) tot = tot32;
            printf("totalmem %d %zu\n", rc, tot);
            i += 1;
        } else if (!strcmp(c, "nvml")) {
            nvmlMemory_t m = {0, 0, 0};
            nvmlReturn_t rc = nvml_mem()(nvml_device((unsigned)atoi(ARG(0))), &m);
            printf("nvml %d %llu %llu %llu\n", rc, m.total, m.used, m.free);
            i += 1;
        } else if (!strcmp(c, "nvml2")) {
            nvmlMemory_v2_t m = {(2u << 24) | (unsigned)sizeof(nvmlMemory_v2_t), 0, 0, 0, 0};
            nvmlReturn_t rc = nvml_mem2()(nvml_device((unsigned)atoi(ARG(0))), &m);
            printf("nvml2 %d %llu %llu %llu %llu\n", rc, m.total, m.reserved, m.used, m.free);
            i += 1;
        } else if (!strcmp(c, "nvmlloop")) {
            /* nvmlloop N DEV: N answers of each NVML view; how many did not add up (v1: used + free
             * != total, v2: reserved + used + free != total, or used > total), and the first such
             * v1 and v2 answer (total used free; total reserved used free) */
            nvmlDevice_t d = nvml_device((unsigned)atoi(ARG(1)));
            long n = atol(ARG(0)), bad1 = 0, bad2 = 0;
            nvmlMemory_t first1 = {0, 0, 0};
            nvmlMemory_v2_t first2 = {0, 0, 0, 0, 0};
            nvmlReturn_t rc = NVML_SUCCESS;
            for (long k = 0; k < n && rc == NVML_SUCCESS; k++) {
                nvmlMemory_t m = {0, 0, 0};
                nvmlMemory_v2_t m2 = {(2u << 24) | (unsigned)sizeof(nvmlMemory_v2_t), 0, 0, 0, 0};
                rc = nvml_mem()(d, &m);
                if (rc == NVML_SUCCESS) rc = nvml_mem2()(d, &m2);
                if (rc != NVML_SUCCESS) break;
                if (m.used + m.free != m.total || m.used > m.total) {
                    if (!bad1++) first1 = m;
                }
                if (m2.reserved + m2.used + m2.free != m2.total || m2.used > m2.total) {
                    if (!bad2++) first2 = m2;
                }
            }
            printf("nvmlloop %d %ld %ld %llu %llu %llu %llu %llu %llu %llu\n", rc, bad1, bad2, first1.total,
                   first1.used, first1.free, first2.total, first2.reserved, first2.used, first2.free);
            i += 2;
        } else if (!strcmp(c, "churn")) {
            /* churn SIZE FILE: allocate SIZE and free it, again and again until FILE exists; how
             * many rounds */
            struct stat st;
            long rounds = 0;
            CUresult rc = CUDA_SUCCESS;
            while (rc == CUDA_SUCCESS && stat(ARG(1), &st) != 0) {
                CUdeviceptr p = 0;
                rc = api.cuMemAlloc_v2(&p, size_arg(ARG(0)));
                if (rc == CUDA_SUCCESS) rc = api.cuMemFree_v2(p);
                rounds++;
            }
            printf("churn %d %ld\n", rc, rounds);
            i += 2;
        } else if (!strcmp(c, "nullargs")) {
            printf("nullargs %d %d %d %d %d %d %d %d %d %d\n", api.cuMemAlloc_v2(NULL, 1 << 20),
                   api.cuMemGetInfo_v2(NULL, NULL), api.cuDeviceTotalMem_v2(NULL, 0),
                   api.cuMemAllocPitch_v2(NULL, NULL, 16, 16, 4), api.cuDevicePrimaryCtxRetain(NULL, 0),
                   api.cuMemAllocAsync(NULL, 16, NULL), api.cuMemCreate(NULL, 2 << 20, NULL, 0),
                   api.cuArrayCreate_v2(NULL, NULL), api.cuMemRetainAllocationHandle(NULL, (void *)4096),
                   api.cuMemPoolCreate(NULL, NULL));
        } else if (!strcmp(c, "vmmbad")) {
            /* the VMM calls with what no driver accepts: a bogus handle, an address never mapped,
             * NULL out-parameters, a descriptor that is none, a device that is none */
            CUmemGenericAllocationHandle h = 0;
            CUmemAllocationProp none = {1, 0, {CU_MEM_LOCATION_TYPE_DEVICE, 99}};
            printf("vmmbad %d %d %d %d %d %d %d %d %d %d\n", api.cuMemRelease(0xdead),
                   api.cuMemUnmap(0x7f0000000000ull, 2 << 20), api.cuMemMap(0x7f0000000000ull, 2 << 20, 0, 0xdead, 0),
                   api.cuMemRetainAllocationHandle(NULL, (void *)4096), api.cuMemRetainAllocationHandle(&h, NULL),
                   api.cuMemImportFromShareableHandle(NULL, (void *)(intptr_t)0, 1),
                   api.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)-1, 1), api.cuMemMapArrayAsync(NULL, 1, NULL),
                   api.cuMemCreate(&h, 2 << 20, &none, 0), api.cuMemUnmap(0, 0));
        } else if (!strcmp(c, "nullargs1")) {
            printf("nullargs1 %d %d %d %d %d %d %d\n", api1.cuMemAlloc(NULL, 1 << 20), api1.cuMemGetInfo(NULL, NULL),
                   api1.cuDeviceTotalMem(NULL, 0), api1.cuMemAllocPitch(NULL, NULL, 16, 16, 4),
                   api1.cuArrayCreate(NULL, NULL), api1.cuArray3DCreate(NULL, NULL), api1.cuCtxCreate(NULL, 0, 0));
        } else if (!strcmp(c, "nvmlshutdown")) {
            /* the program's nvmlShutdown (balancing nvml_device's init), then a query: an NVML no
             * one holds answers NVML_ERROR_UNINITIALIZED */
            void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
            nvmlReturn_t rc = ((nvml_init_t)dlsym(h, "nvmlShutdown"))();
            unsigned n = 0;
            nvmlReturn_t after = ((nvmlReturn_t (*)(unsigned *))dlsym(h, "nvmlDeviceGetCount_v2"))(&n);
            printf("nvmlshutdown %d %d\n", rc, after);
        } else if (!strcmp(c, "nvmlnull")) {
            printf("nvmlnull %d %d\n", nvml_mem()(nvml_device(0), NULL), nvml_mem2()(nvml_device(0), NULL));
        } else if (!strcmp(c, "launch")) {
            CUresult rc = CUDA_SUCCESS;
            for (int n = atoi(ARG(0)); n > 0 && rc == CUDA_SUCCESS; n--)
                rc = api.cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            printf("launch %d\n", rc);
            i += 1;
        } else if (!strcmp(c, "launchex") || !strcmp(c, "ctxsyncs") || !strcmp(c, "streamsyncs") ||
                   !strcmp(c, "copies")) {
            /* N cuLaunchKernelEx calls (one block of one thread, the current context's default
             * stream), or N cuCtxSynchronize / cuStreamSynchronize(NULL) / 64-byte
             * cuMemcpyHtoDAsync_v2 (default stream) calls: costs.py's loops */
            CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
            static char host[64];
            CUresult rc = CUDA_SUCCESS;
            for (int n = atoi(ARG(0)); n > 0 && rc == CUDA_SUCCESS; n--)
                rc = !strcmp(c, "launchex")   ? api.cuLaunchKernelEx(&cfg, (CUfunction)0x1234, NULL, NULL)
                     : !strcmp(c, "ctxsyncs") ? ctx_sync()
                     : !strcmp(c, "copies")   ? api.cuMemcpyHtoDAsync_v2((CUdeviceptr)0x1000, host, sizeof(host), NULL)
                                              : api.cuStreamSynchronize(NULL);
            printf("%s %d\n", c, rc);
            i += 1;
        } else if (!strcmp(c, "meminfos") || !strcmp(c, "nvmlmeminfos")) {
            /* N cuMemGetInfo_v2 calls, or N nvmlDeviceGetMemoryInfo calls on device 0: costs.py's
             * loops */
            CUresult rc = CUDA_SUCCESS;
            size_t fr = 0, tot = 0;
            nvmlMemory_t m;
            nvml_mem_t mem = NULL;
            nvmlDevice_t dev = NULL;
            if (!strcmp(c, "nvmlmeminfos")) {
                mem = nvml_mem();
                dev = nvml_device(0);
            }
            for (int n = atoi(ARG(0)); n > 0 && rc == CUDA_SUCCESS; n--)
                rc = mem ? (CUresult)mem(dev, &m) : api.cuMemGetInfo_v2(&fr, &tot);
            printf("%s %d\n", c, rc);
            i += 1;
        } else if (!strcmp(c, "asyncpairs")) {
            /* asyncpairs N SIZE: N cuMemAllocAsync + cuMemFreeAsync pairs of SIZE bytes on the
             * default stream, from the device's default pool: costs.py's loop */
            CUresult rc = CUDA_SUCCESS;
            uint64_t size = size_arg(ARG(1));
            for (int n = atoi(ARG(0)); n > 0 && rc == CUDA_SUCCESS; n--) {
                CUdeviceptr p = 0;
                if ((rc = api.cuMemAllocAsync(&p, size, NULL)) == CUDA_SUCCESS) rc = api.cuMemFreeAsync(p, NULL);
            }
            printf("asyncpairs %d\n", rc);
            i += 2;
        } else if (!strcmp(c, "lmlaunch")) {
            /* lmlaunch HOW K: one launch of kernel number K (as launchk) by HOW: plain
             * (cuLaunchKernel), ex (cuLaunchKernelEx), coop (cuLaunchCooperativeKernel), grid
             * (CUDA 2.x's cuLaunchGrid); the _ptsz variants with --api ptsz */
            const char *how = ARG(0);
            CUfunction f = (CUfunction)(uintptr_t)(0x100000 + 16 * (uint64_t)atoi(ARG(1)));
            CUlaunchConfig cfg = {1, 1, 1, 1, 1, 1, 0, NULL, NULL, 0};
            CUresult rc = !strcmp(how, "ex")     ? api.cuLaunchKernelEx(&cfg, f, NULL, NULL)
                          : !strcmp(how, "coop") ? api.cuLaunchCooperativeKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL)
                          : !strcmp(how, "grid") ? api1.cuLaunchGrid(f, 1, 1)
                                                 : api.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            printf("lmlaunch %d\n", rc);
            i += 2;
        } else if (!strcmp(c, "lmcalls")) {
            /* the fake driver's count of the calls a launch's stack judgement may make, and of its
             * local-size queries (FAKE_CUDA_FUNC_LOCAL) */
            typedef unsigned long (*count_t)(void);
            count_t calls = (count_t)dlsym(libcuda, "fake_cuda_lmem_calls");
            count_t queries = (count_t)dlsym(libcuda, "fake_cuda_attr_queries");
            printf("lmcalls 0 %lu %lu\n", calls ? calls() : 0ul, queries ? queries() : 0ul);
        } else if (!strcmp(c, "getlimit")) {
            size_t v = 0;
            CUresult rc = api.cuCtxGetLimit ? api.cuCtxGetLimit(&v, atoi(ARG(0))) : CUDA_ERROR_NOT_FOUND;
            printf("getlimit %d %zu\n", rc, v);
            i += 1;
        } else if (!strcmp(c, "launchk")) {
            /* one launch of kernel number K (distinct functions load their code separately) */
            CUfunction f = (CUfunction)(uintptr_t)(0x100000 + 16 * (uint64_t)atoi(ARG(0)));
            printf("launchk %d\n", api.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
            i += 1;
        } else if (!strcmp(c, "mkpool")) {
            printf("mkpool %d\n", make_user_pool(atoi(ARG(0)), atoi(ARG(1))));
            i += 2;
        } else if (!strcmp(c, "green")) {
            /* green D: a green context on device D (the descriptor is the fake's to ignore) */
            printf("green %d\n", api.cuGreenCtxCreate(&greenctx, (CUdevResourceDesc)(uintptr_t)1, atoi(ARG(0)), 1));
            i += 1;
        } else if (!strcmp(c, "greens")) {
            /* greens N D: N more green contexts on device D; prints how many were made */
            int n = atoi(ARG(0)), made = 0;
            CUresult rc = CUDA_SUCCESS;
            for (; made < n && ngreens < 160; made++) {
                rc = api.cuGreenCtxCreate(&greenctxs[ngreens], (CUdevResourceDesc)(uintptr_t)1, atoi(ARG(1)), 1);
                if (rc != CUDA_SUCCESS) break;
                greenctx = greenctxs[ngreens++];
            }
            printf("greens %d %d\n", rc, made);
            i += 2;
        } else if (!strcmp(c, "greenswork")) {
            /* one kernel in each green context "greens" made, each current in turn; then the
             * current context as before */
            CUcontext home = NULL, gc = NULL;
            CUresult rc = api.cuCtxGetCurrent(&home);
            for (int k = 0; k < ngreens && rc == CUDA_SUCCESS; k++)
                if ((rc = api.cuCtxFromGreenCtx(&gc, greenctxs[k])) == CUDA_SUCCESS &&
                    (rc = api.cuCtxSetCurrent(gc)) == CUDA_SUCCESS)
                    rc = api.cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            if (rc == CUDA_SUCCESS) rc = api.cuCtxSetCurrent(home);
            printf("greenswork %d\n", rc);
        } else if (!strcmp(c, "greensdestroy")) {
            /* every green context "greens" made, newest first; prints the first failure's code */
            CUresult rc = CUDA_SUCCESS, r;
            while (ngreens > 0)
                if ((r = api.cuGreenCtxDestroy(greenctxs[--ngreens])) != CUDA_SUCCESS && rc == CUDA_SUCCESS) rc = r;
            greenctx = NULL;
            printf("greensdestroy %d\n", rc);
        } else if (!strcmp(c, "greencur")) {
            /* the green context's CUcontext made current */
            CUcontext gc = NULL;
            CUresult rc = api.cuCtxFromGreenCtx(&gc, greenctx);
            printf("greencur %d\n", rc == CUDA_SUCCESS ? api.cuCtxSetCurrent(gc) : rc);
        } else if (!strcmp(c, "capcur")) {
            /* the current context becomes the one other threads and xbench come back to */
            printf("capcur %d\n", api.cuCtxGetCurrent(&capture_ctx));
        } else if (!strcmp(c, "greendestroy")) {
            printf("greendestroy %d\n", api.cuGreenCtxDestroy(greenctx));
        } else if (!strcmp(c, "multibad")) {
            /* cuLaunchCooperativeKernelMultiDevice refused by the driver: no list, a NULL stream,
             * more entries than devices */
            CUDA_LAUNCH_PARAMS list[64] = {{(CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, NULL, NULL}};
            printf("multibad %d %d %d\n", api.cuLaunchCooperativeKernelMultiDevice(NULL, 1, 0),
                   api.cuLaunchCooperativeKernelMultiDevice(list, 1, 0),
                   api.cuLaunchCooperativeKernelMultiDevice(list, 64, 0));
        } else if (!strcmp(c, "mkmanaged")) {
            printf("mkmanaged %d\n", make_user_pool_of(CU_MEM_ALLOCATION_TYPE_MANAGED, atoi(ARG(0)), atoi(ARG(1))));
            i += 2;
        } else if (!strcmp(c, "defpool") || !strcmp(c, "curpool")) {
            CUmemLocation loc = {atoi(ARG(0)), 0};
            CUmemAllocationType type = atoi(ARG(1));
            CUresult (*get)(CUmemoryPool *, CUmemLocation *, CUmemAllocationType) =
                !strcmp(c, "defpool") ? api.cuMemGetDefaultMemPool : api.cuMemGetMemPool;
            printf("%s %d\n", c, get ? get(&user_pool, &loc, type) : CUDA_ERROR_NOT_FOUND);
            i += 2;
        } else if (!strcmp(c, "events")) {
            typedef long (*live_t)(void);
            live_t live = (live_t)dlsym(libcuda, "fake_cuda_live_events");
            printf("events 0 %ld\n", live ? live() : -1L);
        } else if (!strcmp(c, "sync")) {
            printf("sync %d\n", ctx_sync());
        } else if (!strcmp(c, "nsfree")) {
            /* nsfree ID: cuMemFreeAsync of allocation ID on a new stream of the current context */
            CUstream ns = NULL;
            CUresult rc = api.cuStreamCreate(&ns, 0);
            if (rc == CUDA_SUCCESS) rc = api.cuMemFreeAsync(allocs[atoi(ARG(0))].handle, ns);
            printf("nsfree %d\n", rc);
            i += 1;
        } else if (!strcmp(c, "sfree") || !strcmp(c, "ssync") || !strcmp(c, "esync") || !strcmp(c, "sdestroy") ||
                   !strcmp(c, "slaunch") || !strcmp(c, "shostfn")) {
            /* sfree ID S: cuMemFreeAsync of pool allocation ID on stream S (0-3, made in the
             * current context at its first use); ssync S: cuStreamSynchronize of stream S;
             * esync S: an event recorded on stream S, and cuEventSynchronize of it; sdestroy S:
             * cuStreamDestroy_v2 (after "legacy 1": cuStreamDestroy) of stream S (its next use
             * makes a new one); slaunch S N: N kernel launches on stream S; shostfn S: a host
             * function on stream S */
            static CUstream ss[4];
            int sfree = !strcmp(c, "sfree"), n = atoi(ARG(sfree)) & 3;
            CUresult rc = ss[n] ? CUDA_SUCCESS : api.cuStreamCreate(&ss[n], 0);
            CUevent ev = NULL;
            if (!strcmp(c, "slaunch")) {
                for (int k = atoi(ARG(1)); k > 0 && rc == CUDA_SUCCESS; k--)
                    rc = api.cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, ss[n], NULL, NULL);
                i += 1;
            } else if (rc == CUDA_SUCCESS && !strcmp(c, "shostfn")) {
                rc = api.cuLaunchHostFunc(ss[n], no_op, NULL);
            } else if (rc == CUDA_SUCCESS && !strcmp(c, "sdestroy")) {
                rc = legacy ? api1.cuStreamDestroy(ss[n]) : api.cuStreamDestroy_v2(ss[n]);
                ss[n] = NULL;
            } else if (rc == CUDA_SUCCESS && sfree) rc = api.cuMemFreeAsync(allocs[atoi(ARG(0))].handle, ss[n]);
            else if (rc == CUDA_SUCCESS && !strcmp(c, "ssync")) rc = api.cuStreamSynchronize(ss[n]);
            else if (rc == CUDA_SUCCESS && (rc = api.cuEventCreate(&ev, 0)) == CUDA_SUCCESS &&
                     (rc = api.cuEventRecord(ev, ss[n])) == CUDA_SUCCESS)
                rc = api.cuEventSynchronize(ev);
            printf("%s %d\n", c, rc);
            i += 1 + sfree;
        } else if (!strcmp(c, "setlimit")) {
            /* setlimit LIMIT VALUE: 0 stack size per thread, 1 printf FIFO, 2 malloc heap */
            printf("setlimit %d\n", api.cuCtxSetLimit(atoi(ARG(0)), (size_t)size_arg(ARG(1))));
            i += 2;
        } else if (!strcmp(c, "modload")) {
            /* a failed load leaves no handle: a later modunload must not pass the one an earlier
             * load had, unloaded since (the fake has no check of a second unload: the hook sweep's
             * random sequence 8524 crashed in it) */
            CUresult rc = api.cuModuleLoadData(&user_module, "fake image");
            if (rc != CUDA_SUCCESS) user_module = NULL;
            printf("modload %d\n", rc);
        } else if (!strcmp(c, "modunload")) {
            printf("modunload %d\n", api.cuModuleUnload(user_module));
        } else if (!strcmp(c, "libunload")) {
            printf("libunload %d\n", api.cuLibraryUnload(user_library));
        } else if (!strcmp(c, "getfunc")) {
            printf("getfunc %d\n", api.cuModuleGetFunction(&user_function, user_module, "k"));
        } else if (!strcmp(c, "libload")) {
            CUresult rc = api.cuLibraryLoadData(&user_library, "fake image", NULL, NULL, 0, NULL, NULL, 0);
            if (rc != CUDA_SUCCESS) user_library = NULL; /* as modload */
            printf("libload %d\n", rc);
        } else if (!strcmp(c, "libkernel")) {
            CUkernel k = NULL;
            CUresult rc = api.cuLibraryGetKernel(&k, user_library, "k");
            if (rc == CUDA_SUCCESS) rc = api.cuKernelGetFunction(&user_function, k);
            printf("libkernel %d\n", rc);
        } else if (!strcmp(c, "libmodule")) {
            /* the library's module in the current context (getfunc looks in it next) */
            printf("libmodule %d\n", api.cuLibraryGetModule(&user_module, user_library));
        } else if (!strcmp(c, "libglobal")) {
            CUdeviceptr g = 0;
            size_t gbytes = 0;
            printf("libglobal %d\n", api.cuLibraryGetGlobal(&g, &gbytes, user_library, "g"));
        } else if (!strcmp(c, "funcload")) {
            /* cuFuncLoad of the function getfunc or libkernel looked up last */
            printf("funcload %d\n", api.cuFuncLoad(user_function));
        } else if (!strcmp(c, "launchfn")) {
            printf("launchfn %d\n", api.cuLaunchKernel(user_function, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
        } else if (!strcmp(c, "nvmlqueries")) {
            typedef unsigned long (*count_t)(void);
            count_t count = (count_t)dlsym(dlopen("libnvidia-ml.so.1", RTLD_NOW), "fake_nvml_process_queries");
            printf("nvmlqueries %d %lu\n", count ? 0 : 1, count ? count() : 0);
        } else if (!strcmp(c, "nvmlrounds")) {
            /* nvmlrounds D N: wait until the fake NVML has listed device D's processes N more times
             * ("nvmlrounds 0" then, 1 if it never did).  The library's reconcile of a device lists
             * them at most 3 times (GS_ATTEMPTS), all in one thread: with nothing else reconciling,
             * N = 4 means a reconcile of D that began after this command has completed */
            typedef unsigned long (*count_t)(unsigned);
            count_t count = (count_t)dlsym(dlopen("libnvidia-ml.so.1", RTLD_NOW), "fake_nvml_device_queries");
            unsigned dev = (unsigned)atoi(ARG(0));
            unsigned long want = count ? count(dev) + strtoul(ARG(1), NULL, 10) : 0;
            int n = 0;
            while (count && count(dev) < want && n++ < 20000) usleep(1000);
            printf("nvmlrounds %d\n", count && count(dev) >= want ? 0 : 1);
            i += 2;
        } else if (!strcmp(c, "fill")) {
            /* allocate SIZE chunks until one is refused: "fill <last rc> <chunks granted>" */
            uint64_t size = size_arg(ARG(0));
            CUresult rc = CUDA_SUCCESS;
            int granted = 0;
            while (rc == CUDA_SUCCESS && nallocs < (int)(sizeof(allocs) / sizeof(allocs[0]))) {
                CUdeviceptr p = 0;
                rc = api.cuMemAlloc_v2(&p, size);
                if (rc == CUDA_SUCCESS) {
                    allocs[nallocs].kind = A_DPTR;
                    allocs[nallocs++].handle = p;
                    granted++;
                }
            }
            printf("fill %d %d\n", rc, granted);
            i += 1;
        } else if (!strcmp(c, "bench")) {
            bench(atof(ARG(0)), ARG(1));
            i += 2;
        } else if (!strcmp(c, "peak")) {
            peak(atof(ARG(0)), (uint64_t)atoll(ARG(1)), (uint64_t)atoll(ARG(2)), 0, 0, 0);
            i += 3;
        } else if (!strcmp(c, "gpeak")) {
            peak_graph(atof(ARG(0)), (uint64_t)atoll(ARG(1)), (uint64_t)atoll(ARG(2)), (uint64_t)atoll(ARG(3)),
                       (uint64_t)atoll(ARG(4)), 0, ARG(5));
            i += 6;
        } else if (!strcmp(c, "gset")) {
            gset(ARG(0), (unsigned)atoi(ARG(1)));
            i += 2;
        } else if (!strcmp(c, "cpeak") || !strcmp(c, "dpeak") || !strcmp(c, "fpeak")) {
            peak(atof(ARG(0)), (uint64_t)atoll(ARG(1)), (uint64_t)atoll(ARG(2)), (uint64_t)atoll(ARG(3)),
                 (uint64_t)atoll(ARG(4)), c[0] == 'd' ? 1 : c[0] == 'f' ? 2 : 0);
            i += 5;
        } else if (!strcmp(c, "tp")) {
            tp(atol(ARG(0)), atoi(ARG(1)));
            i += 2;
        } else if (!strcmp(c, "xbench")) {
            xbench(atof(ARG(0)), atoi(ARG(1)));
            i += 2;
        } else if (!strcmp(c, "module")) {
            typedef CUresult (*module_t)(uint64_t);
            module_t load = (module_t)dlsym(libcuda, "fake_cuda_module_load");
            printf("module %d\n", load ? load(size_arg(ARG(0))) : CUDA_ERROR_NOT_SUPPORTED);
            i += 1;
        } else if (!strcmp(c, "allocbench")) {
            allocbench(atol(ARG(0)), size_arg(ARG(1)));
            i += 2;
        } else if (!strcmp(c, "mbench") || !strcmp(c, "mbenchctx") || !strcmp(c, "mbenchone")) {
            /* mbenchctx: each thread in a context of its own on device 0; mbenchone: one stream */
            mbench(atof(ARG(0)), atoi(ARG(1)), !strcmp(c, "mbenchctx"), !strcmp(c, "mbenchone"));
            i += 2;
        } else if (!strcmp(c, "procaddr")) {
            /* procaddr SYMBOL VERSION EXPORT: is what cuGetProcAddress_v2 hands out the export
             * EXPORT as the process sees it (the interposer's hook)? */
            typedef CUresult (*gp_t)(const char *, void **, int, cuuint64_t, int *);
            gp_t gp = (gp_t)dlsym(RTLD_DEFAULT, "cuGetProcAddress_v2");
            void *fn = NULL;
            CUresult rc = gp ? gp(ARG(0), &fn, atoi(ARG(1)), 0, NULL) : CUDA_ERROR_NOT_SUPPORTED;
            printf("procaddr %d %d\n", rc, fn && fn == dlsym(RTLD_DEFAULT, ARG(2)));
            i += 3;
        } else if (!strcmp(c, "ran")) {
            /* the fake GPU's kernel time run so far (not merely queued), and the time */
            typedef uint64_t (*kns_t)(void);
            kns_t run_ns = (kns_t)dlsym(libcuda, "fake_cuda_kernel_run_ns");
            printf("ran 0 %llu %llu\n", (unsigned long long)(run_ns ? run_ns() : 0), (unsigned long long)now_ns());
        } else if (!strcmp(c, "hold") || !strcmp(c, "holdg") || !strcmp(c, "unhold") || !strcmp(c, "holdgone")) {
            /* hold MODE: a capture begun on a stream of its own and left open (MODE 0 global,
             * 1 thread-local, 2 relaxed); holdg MODE: the same into a graph of the program's
             * (cuStreamBeginCaptureToGraph); unhold: its end; holdgone: its stream destroyed
             * instead (cuStreamDestroy_v2), the capture never ended */
            static CUstream hs;
            if (!strcmp(c, "holdgone")) {
                printf("holdgone %d\n", hs ? api.cuStreamDestroy_v2(hs) : CUDA_ERROR_INVALID_VALUE);
                hs = NULL;
            } else if (strcmp(c, "unhold") != 0) {
                CUgraph into = NULL;
                CUresult rc = hs ? CUDA_SUCCESS : api.cuStreamCreate(&hs, 1);
                if (rc == CUDA_SUCCESS && c[4] == 'g') rc = api.cuGraphCreate(&into, 0);
                if (rc == CUDA_SUCCESS)
                    rc = c[4] == 'g' ? api.cuStreamBeginCaptureToGraph(hs, into, NULL, NULL, 0, atoi(ARG(0)))
                                     : api.cuStreamBeginCapture_v2(hs, atoi(ARG(0)));
                printf("%s %d\n", c, rc);
                i += 1;
            } else {
                void *g = NULL;
                printf("unhold %d\n", hs ? api.cuStreamEndCapture(hs, &g) : CUDA_ERROR_INVALID_VALUE);
            }
        } else if (!strcmp(c, "holds") || !strcmp(c, "unholds")) {
            /* holds N MODE: N more captures held open, each on a stream of its own (as "hold");
             * unholds: their ends, newest first (the first failure's code) */
            static CUstream hss[256];
            static int nhs;
            CUresult rc = CUDA_SUCCESS, r;
            if (!strcmp(c, "holds")) {
                for (int n = atoi(ARG(0)); n > 0 && nhs < 256 && rc == CUDA_SUCCESS; n--)
                    if ((rc = api.cuStreamCreate(&hss[nhs], 1)) == CUDA_SUCCESS &&
                        (rc = api.cuStreamBeginCapture_v2(hss[nhs], atoi(ARG(1)))) == CUDA_SUCCESS)
                        nhs++;
                printf("holds %d %d\n", rc, nhs);
                i += 2;
            } else {
                void *g = NULL;
                while (nhs > 0)
                    if ((r = api.cuStreamEndCapture(hss[--nhs], &g)) != CUDA_SUCCESS && rc == CUDA_SUCCESS) rc = r;
                printf("unholds %d\n", rc);
            }
        } else if (!strcmp(c, "captureother") || !strcmp(c, "recaptureother")) {
            /* a global capture (recaptureother: CUDA 13.3's recapture into a graph) in this
             * thread while another launches N kernels */
            capture_other(atoi(ARG(0)), c[0] == 'r');
            i += 1;
        } else if (!strcmp(c, "arraybench")) {
            arraybench(atol(ARG(0)), size_arg(ARG(1)), size_arg(ARG(2)));
            i += 3;
        } else if (!strcmp(c, "vmmbench")) {
            vmmbench(atol(ARG(0)), size_arg(ARG(1)));
            i += 2;
        } else if (!strcmp(c, "launchbench")) {
            launchbench(atol(ARG(0)));
            i += 1;
        } else if (!strcmp(c, "capture")) {
            /* launches on a capturing stream must pass straight through */
            CUstream s = NULL;
            api.cuStreamCreate(&s, 0);
            api.cuStreamBeginCapture_v2(s, 0);
            CUresult rc = CUDA_SUCCESS;
            uint64_t t0 = now_ns();
            for (int n = atoi(ARG(0)); n > 0 && rc == CUDA_SUCCESS; n--)
                rc = api.cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
            api.cuStreamEndCapture(s, NULL);
            printf("capture %d %llu\n", rc, (unsigned long long)(now_ns() - t0));
            i += 1;
        } else if (!strcmp(c, "gcapture")) {
            /* capture SIZE allocated and freed on a stream, as a runtime's cudaMallocAsync would */
            static CUstream cs;
            if (!cs) api.cuStreamCreate(&cs, 0);
            CUdeviceptr p = 0;
            api.cuStreamBeginCapture_v2(cs, 0);
            CUresult rc = api.cuMemAllocAsync(&p, size_arg(ARG(0)), cs);
            if (rc == CUDA_SUCCESS) rc = api.cuLaunchKernel((CUfunction)0x1234, 1, 1, 1, 1, 1, 1, 0, cs, NULL, NULL);
            if (rc == CUDA_SUCCESS) rc = api.cuMemFreeAsync(p, cs);
            CUresult end = api.cuStreamEndCapture(cs, (void **)&graph);
            printf("gcapture %d\n", rc != CUDA_SUCCESS ? rc : end);
            i += 1;
        } else if (!strcmp(c, "gnode")) {
            /* an allocation node of SIZE on device DEV (D.L: in its locality domain L, CUDA
             * 13.4), added to the current graph */
            CUDA_MEM_ALLOC_NODE_PARAMS prm;
            memset(&prm, 0, sizeof(prm));
            prm.poolProps.allocType = 1;
            prm.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prm.poolProps.location.id = atoi(ARG(1));
            const char *dot = strchr(ARG(1), '.');
            if (dot) {
                unsigned char where[4] = {(unsigned char)atoi(ARG(1)), (unsigned char)atoi(dot + 1), 0, 0};
                prm.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN;
                memcpy(&prm.poolProps.location.id, where, sizeof(where));
            }
            prm.bytesize = size_arg(ARG(0));
            CUgraphNode node = NULL;
            CUresult rc = graph ? CUDA_SUCCESS : api.cuGraphCreate(&graph, 0);
            if (rc == CUDA_SUCCESS) rc = api.cuGraphAddMemAllocNode(&node, graph, NULL, 0, &prm);
            printf("gnode %d\n", rc);
            i += 2;
        } else if (!strcmp(c, "gchild")) {
            /* the current graph becomes a child node of a new one */
            CUgraph parent = NULL;
            CUgraphNode node = NULL;
            CUresult rc = api.cuGraphCreate(&parent, 0);
            if (rc == CUDA_SUCCESS) rc = api.cuGraphAddChildGraphNode(&node, parent, NULL, 0, graph);
            if (rc == CUDA_SUCCESS) graph = parent;
            printf("gchild %d\n", rc);
        } else if (!strcmp(c, "ginst")) {
            /* instantiate the current graph: flags | upload (WithParams + upload flag) */
            CUresult rc;
            CUDA_GRAPH_INSTANTIATE_PARAMS prm = {.flags = CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD};
            if (!strcmp(ARG(0), "upload"))
                rc = api.cuGraphInstantiateWithParams(&gexec, graph, &prm);
            else
                rc = api.cuGraphInstantiateWithFlags(&gexec, graph, 0);
            printf("ginst %d %d\n", rc, (int)prm.result_out); /* result_out: WithParams only */
            i += 1;
        } else if (!strcmp(c, "ginstf") || !strcmp(c, "ginstpf")) {
            /* ginstf FLAGS / ginstpf FLAGS: cuGraphInstantiateWithFlags / WithParams with FLAGS */
            unsigned long long flags = strtoull(ARG(0), NULL, 0);
            CUDA_GRAPH_INSTANTIATE_PARAMS prm = {.flags = flags};
            printf("%s %d\n", c, c[5] == 'f' ? api.cuGraphInstantiateWithFlags(&gexec, graph, flags)
                                             : api.cuGraphInstantiateWithParams(&gexec, graph, &prm));
            i += 1;
        } else if (!strcmp(c, "ginst10")) {
            /* CUDA 10.0's cuGraphInstantiate, still exported */
            CUresult rc = api1.cuGraphInstantiate ? api1.cuGraphInstantiate(&gexec, graph, NULL, NULL, 0)
                                                  : CUDA_ERROR_NOT_FOUND;
            printf("ginst10 %d\n", rc);
        } else if (!strcmp(c, "ctxsync13") || !strcmp(c, "ctxsyncnull")) {
            /* cuGetProcAddress("cuCtxSynchronize", 13000): cuCtxSynchronize_v2(ctx), called with the
             * current context (ctxsyncnull: NULL, which means it); prints rc and whether the caller
             * got the interposer's function (1) or the driver's (0) */
            typedef CUresult (*sync_v2_t)(CUcontext);
            sync_v2_t fn = (sync_v2_t)by_procaddr("cuCtxSynchronize", 13000);
            CUcontext cur = NULL;
            if (!strcmp(c, "ctxsync13")) api.cuCtxGetCurrent(&cur);
            CUresult rc = fn ? fn(cur) : CUDA_ERROR_NOT_FOUND;
            Dl_info info;
            const char *file = fn && dladdr((void *)fn, &info) && info.dli_fname ? info.dli_fname : "";
            const char *slash = strrchr(file, '/'); /* the file's name, not the checkout's path */
            int ours = !strncmp(slash ? slash + 1 : file, "libgpuslice", 11);
            printf("%s %d %d\n", c, rc, ours);
        } else if (!strcmp(c, "glaunch")) {
            CUresult rc = api.cuGraphLaunch(gexec, NULL);
            if (rc == CUDA_SUCCESS) ctx_sync();
            printf("glaunch %d\n", rc);
        } else if (!strcmp(c, "gupload")) {
            printf("gupload %d\n", api.cuGraphUpload(gexec, NULL));
        } else if (!strcmp(c, "gkeep")) {
            /* gkeep SIZE: another graph's allocation, not freed in its graph, lives in the pool */
            typedef CUresult (*keep_t)(uint64_t);
            keep_t keep = (keep_t)dlsym(libcuda, "fake_cuda_graph_keep");
            printf("gkeep %d\n", keep ? keep(size_arg(ARG(0))) : CUDA_ERROR_NOT_SUPPORTED);
            i += 1;
        } else if (!strcmp(c, "gfreelast")) {
            /* the program frees, by its address, what the last graph launch left allocated
             * (FAKE_CUDA_GRAPH_UNFREED) */
            typedef CUdeviceptr (*live_t)(void);
            live_t live = (live_t)dlsym(libcuda, "fake_cuda_graph_live_ptr");
            CUdeviceptr ptr = live ? live() : 0;
            printf("gfreelast %d\n", ptr ? api.cuMemFreeAsync(ptr, NULL) : CUDA_ERROR_NOT_SUPPORTED);
        } else if (!strcmp(c, "gtrim")) {
            printf("gtrim %d\n", api.cuDeviceGraphMemTrim(0));
        } else if (!strcmp(c, "gdestroy")) {
            CUresult rc = api.cuGraphExecDestroy(gexec);
            if (rc == CUDA_SUCCESS) gexec = NULL; /* a failed destroy leaves it to launch */
            printf("gdestroy %d\n", rc);
        } else if (!strcmp(c, "physd")) {
            /* physd D: what the fake driver holds for this process on physical device D */
            typedef uint64_t (*local_t)(int);
            local_t local = (local_t)dlsym(libcuda, "fake_cuda_local_used");
            printf("physd 0 %llu\n", local ? (unsigned long long)local(atoi(ARG(0))) : 0ull);
            i += 1;
        } else if (!strcmp(c, "balanced")) {
            /* the library's in-flight and unsettled counts (peek.h), once back at zero or after 1 s;
             * rc -1 where they cannot be read */
            int inflight = 0, unsettled = 0, ok = peek_balanced(1000, &inflight, &unsettled);
            printf("balanced %d %d %d\n", ok < 0 ? -1 : 0, inflight, unsettled);
        } else if (!strcmp(c, "phys")) {
            /* what the fake driver holds for this process on physical device 0 */
            typedef uint64_t (*local_t)(int);
            local_t local = (local_t)dlsym(libcuda, "fake_cuda_local_used");
            printf("phys 0 %llu\n", local ? (unsigned long long)local(0) : 0ull);
        } else if (!strcmp(c, "bgalloc")) {
            /* bgalloc SIZE MS: a thread, in the context "ctx" made current, allocates SIZE after MS */
            bg_start("bgalloc", atol(ARG(1)), size_arg(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgpitch")) {
            /* bgpitch WIDTH MS: the same with a pitched allocation of one row */
            bg_start("bgpitch", atol(ARG(1)), size_arg(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgasync")) {
            /* bgasync SIZE MS: a thread, in the context "ctx" made current, allocates from the pool */
            bg_start("bgasync", atol(ARG(1)), size_arg(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgarray")) {
            /* bgarray W H MS: a thread, in the context "ctx" made current, makes a W x H float4
             * array after MS ("join" gives it an allocation ID) */
            bg_start("bgarray", atol(ARG(2)), size_arg(ARG(0)) << 32 | (size_arg(ARG(1)) & 0xffffffffu));
            i += 3;
        } else if (!strcmp(c, "bgeimport")) {
            /* bgeimport ID MS: a thread, in the context "ctx" made current, imports ID's exported
             * descriptor as external memory (as "eimport") after MS ("join" gives it an ID) */
            bg_start("bgeimport", atol(ARG(1)), (uint64_t)atoi(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgarrayfree")) {
            /* bgarrayfree ID MS: a thread destroys the array (or external memory) of allocation ID
             * after MS */
            bg_start("bgarrayfree", atol(ARG(1)), (uint64_t)atoi(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgaunmap")) {
            /* bgaunmap ARRAY X MS: a thread unmaps sparse array ARRAY's tile at x = X (as "aunmap") after MS */
            bg_start("bgaunmap", atol(ARG(2)), (uint64_t)atoi(ARG(0)) << 40 | ((unsigned)atoi(ARG(1)) & 0xfffffu));
            i += 3;
        } else if (!strcmp(c, "bgamap")) {
            /* bgamap ARRAY VMM X MS: a thread maps VMM allocation VMM into that tile (as "amap") after MS */
            bg_start("bgamap", atol(ARG(3)),
                     (uint64_t)atoi(ARG(0)) << 40 | (uint64_t)(atoi(ARG(1)) & 0xfffff) << 20 |
                         ((unsigned)atoi(ARG(2)) & 0xfffffu));
            i += 4;
        } else if (!strcmp(c, "bgfreeasync")) {
            /* bgfreeasync ID MS: a thread frees allocation ID with cuMemFreeAsync after MS */
            bg_start("bgfreeasync", atol(ARG(1)), (uint64_t)atoi(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgssync")) {
            /* bgssync MS: a thread synchronises the default stream after MS (its per-thread one
             * with --api ptsz) */
            bg_start("bgssync", atol(ARG(0)), 0);
            i += 1;
        } else if (!strcmp(c, "bgsetpool")) {
            /* bgsetpool MS HOW: a thread makes the pool of "mkpool" device 0's current pool after MS
             * (HOW 0: cuDeviceSetMemPool, 1: CUDA 13's cuMemSetMemPool) */
            bg_start("bgsetpool", atol(ARG(0)), (uint64_t)atoi(ARG(1)));
            i += 2;
        } else if (!strcmp(c, "bgfreesync")) {
            /* bgfreesync ID MS: a thread frees allocation ID with cuMemFree after MS (a
             * stream-ordered one too, which CUDA allows) */
            bg_start("bgfreesync", atol(ARG(1)), (uint64_t)atoi(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgmodule")) {
            /* bgmodule SIZE MS: a thread, in the context "ctx" made current, loads code lazily */
            bg_start("bgmodule", atol(ARG(1)), size_arg(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgsetlimit")) {
            /* bgsetlimit SIZE MS: a thread, in the context "ctx" made current, sets the malloc heap */
            bg_start("bgsetlimit", atol(ARG(1)), size_arg(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgretain")) {
            /* bgretain MS: a thread retains device 0's primary context after MS */
            bg_start("bgretain", atol(ARG(0)), 0);
            i += 1;
        } else if (!strcmp(c, "bgvremap")) {
            /* bgvremap SIZE MS: a thread maps new memory at the start of the vmapall range after MS */
            bg_start("bgvremap", atol(ARG(1)), size_arg(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgvmap")) {
            /* bgvmap ID MS: a thread, in the context "ctx" made current, maps VMM allocation ID
             * (as "vmap") after MS ("vunmap ID" unmaps it once joined) */
            bg_start("bgvmap", atol(ARG(1)), (uint64_t)atoi(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bggdestroy")) {
            /* bggdestroy: a thread destroys the executable graph (printed as gexec), forgotten here */
            printf("gexec 0 %llu\n", (unsigned long long)(uintptr_t)gexec);
            bg_start("bggdestroy", 0, (uint64_t)(uintptr_t)gexec);
            gexec = NULL;
        } else if (!strcmp(c, "bgctxdestroy")) {
            /* bgctxdestroy N MS: a thread destroys the Nth context "ctxcreate" made, MS from now */
            bg_start("bgctxdestroy", atol(ARG(1)), (uint64_t)atoi(ARG(0)));
            i += 2;
        } else if (!strcmp(c, "bgpooldestroy")) {
            /* bgpooldestroy: a thread destroys the user pool (printed as upool), forgotten here */
            printf("upool 0 %llu\n", (unsigned long long)(uintptr_t)user_pool);
            bg_start("bgpooldestroy", 0, (uint64_t)(uintptr_t)user_pool);
            user_pool = NULL;
        } else if (!strcmp(c, "upool")) {
            /* upool / gexec: the user pool's or the executable graph's handle */
            printf("upool 0 %llu\n", (unsigned long long)(uintptr_t)user_pool);
        } else if (!strcmp(c, "gexec")) {
            printf("gexec 0 %llu\n", (unsigned long long)(uintptr_t)gexec);
        } else if (!strcmp(c, "gnew")) {
            /* gnew: the next graph command starts a new graph */
            graph = NULL;
            printf("gnew 0\n");
        } else if (!strcmp(c, "bgglaunch")) {
            /* bgglaunch N: a thread launches the instantiated graph N times */
            bg_start("bgglaunch", atol(ARG(0)), 0);
            i += 1;
        } else if (!strcmp(c, "bgcapture")) {
            /* bgcapture FILE MS: a thread, in the context "ctx" made current, begins a global
             * capture once FILE exists and ends it MS later; "join" prints the begin's (and its
             * launch's) result, the end's, and the milliseconds the begin took */
            bg.path = ARG(0);
            bg_start("bgcapture", atol(ARG(1)), 0);
            i += 2;
        } else if (!strcmp(c, "gnew")) {
            /* the next gnode starts a new graph */
            graph = NULL;
            printf("gnew 0\n");
        } else if (!strcmp(c, "gsave") || !strcmp(c, "guse")) {
            /* gsave N keeps the current executable as N (0..3); guse N makes N's current */
            static CUgraphExec saved[4];
            if (c[1] == 's') saved[atoi(ARG(0)) & 3] = gexec; else gexec = saved[atoi(ARG(0)) & 3];
            printf("%s 0\n", c);
            i += 1;
        } else if (!strcmp(c, "join")) {
            bg_join();
        } else if (!strcmp(c, "mark")) {
            /* mark ... since: the milliseconds between the two */
            clock_gettime(CLOCK_MONOTONIC, &mark_ts);
            printf("mark 0\n");
        } else if (!strcmp(c, "since")) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            printf("since 0 %ld\n", (long)((ts.tv_sec - mark_ts.tv_sec) * 1000 + (ts.tv_nsec - mark_ts.tv_nsec) / 1000000));
        } else if (!strcmp(c, "sleep")) {
            usleep((useconds_t)atoi(ARG(0)) * 1000);
            printf("sleep 0\n");
            i += 1;
        } else if (!strcmp(c, "touch")) {
            fclose(fopen(ARG(0), "w"));
            printf("touch 0\n");
            i += 1;
        } else if (!strcmp(c, "waitfile")) {
            int timed_out;
            wait_file(ARG(0), &timed_out);
            printf("waitfile %d\n", timed_out);
            i += 1;
        } else if (!strcmp(c, "bgafter") || !strcmp(c, "bgdone")) {
            /* bgafter PATH, bgdone PATH: for the next background thread only */
            snprintf(c[2] == 'a' ? bg_after : bg_done, sizeof(bg_after), "%s", ARG(0));
            printf("%s 0\n", c);
            i += 1;
        } else if (!strcmp(c, "reexec")) {
            /* the rest of the commands run in a new image of this program, same process */
            char **args = calloc((size_t)(argc - i + 4), sizeof(char *));
            int k = 0;
            args[k++] = argv[0];
            args[k++] = "--api";
            args[k++] = (char *)mode;
            for (int j = i; j < argc; j++) args[k++] = argv[j];
            fflush(stdout);
            execv("/proc/self/exe", args);
            printf("reexec 1\n");
            break;
        } else if (!strcmp(c, "fork")) {
            pid_t pid = fork();
            if (pid == 0) { /* the child runs the rest */
                is_child = 1;
                continue;
            }
            int status = 0;
            waitpid(pid, &status, 0);
            printf("fork %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
        } else if (!strcmp(c, "rssanon")) {
            /* the process's anonymous resident memory, kB (after "fork": the child's, the first
             * thing it does; /proc read with read(2), no stdio buffer) */
            static char sbuf[8192];
            int sfd = open("/proc/self/status", O_RDONLY);
            ssize_t sn = sfd >= 0 ? read(sfd, sbuf, sizeof(sbuf) - 1) : -1;
            if (sfd >= 0) close(sfd);
            sbuf[sn > 0 ? sn : 0] = '\0';
            const char *ra = strstr(sbuf, "RssAnon:");
            printf("rssanon 0 %ld %d\n", ra ? strtol(ra + 8, NULL, 10) : -1L, is_child);
        } else if (!strcmp(c, "vforkexit")) {
            /* a vfork() child that calls exit(), not _exit(): its atexit handlers and destructors
             * run in its parent's memory (undefined by POSIX, done by real programs) */
            int status = vfork_exit();
            printf("vforkexit %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
        } else if (!strcmp(c, "childexit")) {
            if (is_child) exit(0); /* a normal exit: atexit handlers and destructors run */
        } else if (!strcmp(c, "exit")) {
            fflush(stdout);
            _exit(atoi(ARG(0)));
        } else if (!strcmp(c, "sigcatch")) {
            /* the program's own fatal-signal handler: says so and exits with status 42 */
            struct sigaction sa;
            memset(&sa, 0, sizeof(sa));
            sa.sa_handler = probe_fatal;
            sigaction(SIGSEGV, &sa, NULL);
            printf("sigcatch 0\n");
        } else if (!strcmp(c, "badframe")) {
            fflush(stdout);
#if defined(__x86_64__)
            probe_bad_frame();
#endif
            printf("badframe -1\n");
        } else if (!strcmp(c, "sigguard")) {
            void *page = mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            struct sigaction sa;
            memset(&sa, 0, sizeof(sa));
            sa.sa_sigaction = probe_guard_fault;
            sa.sa_flags = SA_SIGINFO;
            int rc = page == MAP_FAILED || sigaction(SIGSEGV, &sa, NULL) != 0;
            probe_guard = page == MAP_FAILED ? NULL : page;
            printf("sigguard %d\n", rc);
        } else if (!strcmp(c, "guard")) {
            fflush(stdout);
            int v = probe_guard ? *probe_guard : -1; /* faults once: the handler opens the page */
            printf("guard 0 %d\n", v);
        } else if (!strcmp(c, "segv")) {
            fflush(stdout);
            *(volatile int *)probe_null = 1; /* a fault in the program's own code */
            printf("segv 1\n");
        } else {
            fprintf(stderr, "gsprobe: unknown command %s\n", c);
            return 2;
        }
    }
    return 0;
}
