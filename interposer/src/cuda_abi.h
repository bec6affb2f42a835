/*
 * cuda_abi.h - the few CUDA driver and NVML types the interposer uses.
 *
 * Declared here rather than taken from cuda.h / nvml.h so that the library
 * builds with gcc alone, with or without a CUDA toolkit.  Only types whose
 * layout we read are spelled out; the rest are opaque pointers.  When cuda.h
 * is present, tests/abi_check.c compares these declarations with it
 * (offsets, sizes, enum values).
 */
#ifndef GPUSLICE_CUDA_ABI_H
#define GPUSLICE_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

/* ---- CUDA driver API ---------------------------------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef uint64_t cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUextMemory_st *CUexternalMemory;
typedef struct CUgreenCtx_st *CUgreenCtx;
typedef struct CUdevResourceDesc_st *CUdevResourceDesc;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUexecAffinityParam_st CUexecAffinityParam; /* only passed through */
typedef struct CUctxCreateParams_st CUctxCreateParams;     /* only passed through */
typedef struct CUlaunchAttribute_st CUlaunchAttribute;     /* only passed through */
typedef int CUdriverProcAddressQueryResult;
typedef int CUmemPool_attribute;
typedef int CUpointer_attribute;
typedef int CUarray_format;
typedef int CUstreamCaptureStatus;
typedef int CUgraphNodeType;
typedef int CUgraphExecUpdateResult; /* an enum: only passed through */
/* an executable graph's node parameters: only passed through (launch.c's graph-change hooks) */
typedef struct CUDA_KERNEL_NODE_PARAMS_st CUDA_KERNEL_NODE_PARAMS_v1;
typedef struct CUDA_KERNEL_NODE_PARAMS_v2_st CUDA_KERNEL_NODE_PARAMS;
typedef struct CUDA_MEMSET_NODE_PARAMS_st CUDA_MEMSET_NODE_PARAMS;
typedef struct CUDA_HOST_NODE_PARAMS_st CUDA_HOST_NODE_PARAMS;
typedef struct CUgraphNodeParams_st CUgraphNodeParams;
typedef struct CUgraphExecUpdateResultInfo_st CUgraphExecUpdateResultInfo;
typedef int CUgraphMem_attribute;
typedef int CUgraphInstantiateResult;
typedef struct CUmemAccessDesc_st CUmemAccessDesc; /* only passed through */
typedef int CUjit_option;    /* enums: only passed through, by pointer */
typedef int CUlibraryOption;
typedef int CUmoduleLoadingMode;
#define CU_MODULE_EAGER_LOADING 0x1
#define CU_MODULE_LAZY_LOADING 0x2
typedef int CUlimit;
#define CU_LIMIT_STACK_SIZE 0x00
#define CU_LIMIT_PRINTF_FIFO_SIZE 0x01
#define CU_LIMIT_MALLOC_HEAP_SIZE 0x02
typedef int CUdevice_attribute;
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR 39
typedef int CUfunction_attribute;
#define CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES 3
typedef int CUstreamCaptureMode;
typedef struct CUgraphEdgeData_st CUgraphEdgeData; /* only passed through */
/* passed through by the hooks that end a stream's measured interval (gaps.c): copies, host
 * functions, waits; never read */
typedef uint32_t cuuint32_t;
typedef struct CUDA_MEMCPY2D_st CUDA_MEMCPY2D;
typedef struct CUDA_MEMCPY3D_st CUDA_MEMCPY3D;
typedef struct CUDA_MEMCPY2D_v1_st CUDA_MEMCPY2D_v1;
typedef struct CUDA_MEMCPY3D_v1_st CUDA_MEMCPY3D_v1;
typedef struct CUDA_MEMCPY3D_PEER_st CUDA_MEMCPY3D_PEER;
typedef struct CUmemcpyAttributes_st CUmemcpyAttributes;
typedef struct CUDA_MEMCPY3D_BATCH_OP_st CUDA_MEMCPY3D_BATCH_OP;
typedef struct CUmemDecompressParams_st CUmemDecompressParams;
typedef union CUstreamBatchMemOpParams_union CUstreamBatchMemOpParams;
typedef struct CUextSemaphore_st *CUexternalSemaphore;
typedef struct CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS_st CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS;
typedef void (*CUhostFn)(void *userData);
typedef void (*CUstreamCallback)(CUstream hStream, CUresult status, void *userData);
/* CUDA 13.3's callback for a recapture's parameter mismatches: passed through, never called */
typedef void (*CUgraphRecaptureCallback)(void);
#define CU_STREAM_CAPTURE_MODE_GLOBAL 0
#define CU_STREAM_CAPTURE_MODE_RELAXED 2

typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

typedef struct CUDA_ARRAY_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    size_t Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;

/* cuMemMapArrayAsync: map (or unmap) a cuMemCreate allocation into a sparse array's tiles */
#define CU_RESOURCE_TYPE_ARRAY 0x00
#define CU_RESOURCE_TYPE_MIPMAPPED_ARRAY 0x01
#define CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_SPARSE_LEVEL 0
#define CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL 1
#define CU_MEM_OPERATION_TYPE_MAP 1
#define CU_MEM_OPERATION_TYPE_UNMAP 2
#define CU_MEM_HANDLE_TYPE_GENERIC 0
typedef int CUresourcetype;
typedef int CUmemOperationType;
typedef struct CUarrayMapInfo_st {
    CUresourcetype resourceType;
    union {
        CUmipmappedArray mipmap;
        CUarray array;
    } resource;
    int subresourceType;
    union {
        struct {
            unsigned int level, layer, offsetX, offsetY, offsetZ, extentWidth, extentHeight, extentDepth;
        } sparseLevel;
        struct {
            unsigned int layer;
            unsigned long long offset, size;
        } miptail;
    } subresource;
    CUmemOperationType memOperationType;
    int memHandleType;
    union {
        CUmemGenericAllocationHandle memHandle;
    } memHandle;
    unsigned long long offset;
    unsigned int deviceBitMask, flags, reserved[2];
} CUarrayMapInfo;

/* CUDA 2.x's descriptors, for the 32-bit entry points (cuArrayCreate, ...) */
typedef struct CUDA_ARRAY_DESCRIPTOR_v1_st {
    unsigned int Width;
    unsigned int Height;
    CUarray_format Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR_v1;

typedef struct CUDA_ARRAY3D_DESCRIPTOR_v1_st {
    unsigned int Width;
    unsigned int Height;
    unsigned int Depth;
    CUarray_format Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR_v1;

typedef struct CUmemLocation_st {
    int type;
    int id;
} CUmemLocation;
typedef int CUmemAllocationType;
typedef int CUmemAllocationHandleType;

/* Leading fields of CUmemAllocationProp (we only read these; cuMemGetAllocationPropertiesFromHandle
 * writes the whole struct, so its caller passes room for more: GS_MEM_PROP_ROOM). */
typedef struct CUmemAllocationProp_st {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
} CUmemAllocationProp;

/* cuImportExternalMemory's description (we read type, the descriptor and size) */
typedef struct CUDA_EXTERNAL_MEMORY_HANDLE_DESC_st {
    int type;
    union {
        int fd;
        struct {
            void *handle;
            const void *name;
        } win32;
        const void *nvSciBufObject;
    } handle;
    unsigned long long size;
    unsigned int flags;
    unsigned int reserved[16];
} CUDA_EXTERNAL_MEMORY_HANDLE_DESC;
#define CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD 1

/* Written whole by cuGraphMemAllocNodeGetParams: the full layout. */
typedef struct CUmemPoolProps_st {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

typedef struct CUDA_MEM_ALLOC_NODE_PARAMS_v1_st {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;

typedef struct CUDA_GRAPH_INSTANTIATE_PARAMS_st {
    cuuint64_t flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    CUgraphInstantiateResult result_out;
} CUDA_GRAPH_INSTANTIATE_PARAMS;

typedef struct CUDA_LAUNCH_PARAMS_st {
    CUfunction function;
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void **kernelParams;
} CUDA_LAUNCH_PARAMS;

typedef struct CUlaunchConfig_st {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_DEINITIALIZED 4
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_OPERATING_SYSTEM 304
#define CUDA_ERROR_CONTEXT_IS_DESTROYED 709
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_NOT_SUPPORTED 801

#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (1ULL << 1)
#define CU_GET_PROC_ADDRESS_SUCCESS 0

#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT 5
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT 7
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT 0
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2
#define CU_GRAPH_NODE_TYPE_KERNEL 0
#define CU_GRAPH_NODE_TYPE_GRAPH 4
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define CU_GRAPH_NODE_TYPE_CONDITIONAL 13 /* CUDA 12.3 */
#define CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH 1
#define CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD 2
#define CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH 4
#define CUDA_GRAPH_INSTANTIATE_SUCCESS 0
#define CUDA_GRAPH_INSTANTIATE_ERROR 1

#define CU_MEM_LOCATION_TYPE_NONE 0
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_LOCATION_TYPE_HOST 2
#define CU_MEM_LOCATION_TYPE_HOST_NUMA 3
#define CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT 4
#define CU_MEM_LOCATION_TYPE_INVISIBLE 5 /* CUDA 13.2: an imported pool's device this process does not see */
/* CUDA 13.4: a device's memory in one of its locality domains; `id` is then a union member
 * `localized`, bytes {deviceId, localityDomainId, reserved[2]} (gs_location_device) */
#define CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN 6
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_ALLOCATION_TYPE_MANAGED 2
#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_EVENT_DEFAULT 0u

/* ---- NVML ----------------------------------------------------------------- */

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlMemory_v2_st {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct nvmlProcessInfo_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct nvmlUtilization_st {
    unsigned int gpu;    /* % of the sample period during which one or more kernels ran */
    unsigned int memory; /* % of it during which device memory was read or written */
} nvmlUtilization_t;

typedef struct nvmlProcessUtilizationSample_st {
    unsigned int pid;
    unsigned long long timeStamp; /* CPU time, us */
    unsigned int smUtil;          /* % of the sample period during which the process's kernels ran */
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96

#endif /* GPUSLICE_CUDA_ABI_H */
