/*
 * hooks.h - the one table of intercepted functions.
 *
 * GS_CUDA_HOOKS(X): X(name, ret, params, base, min_version, per_thread)
 *   name         the libcuda export we replace (and the hook's own name)
 *   base         the name cuGetProcAddress is asked for (cuMemAlloc for cuMemAlloc_v2)
 *   min_version  the cudaVersion from which cuGetProcAddress(base) means this variant
 *   per_thread   1 for the _ptsz variant (CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
 * GS_NVML_HOOKS(N): N(name, ret, params)
 * GS_CUDA_REALS(R) / GS_NVML_REALS(R): R(name, ret, params) - real functions we call
 *   but do not replace.
 *
 * From these lists come the typed real-function pointers (real.c), the dlsym and
 * cuGetProcAddress lookup tables (real.c, procaddr.c) and the linker's export
 * list (exports.map.in).  Adding a hook is one line here plus its body.
 * The CUDA 2.x entry points (cuMemAlloc with 32-bit pointers and sizes, ...)
 * are hooked beside their successors: the driver still exports them, and a
 * program reaches them by dlsym("cuMemAlloc") or an old cudaVersion.
 * This file must stay free of declarations: exports.map.in preprocesses it.
 */
#ifndef GPUSLICE_HOOKS_H
#define GPUSLICE_HOOKS_H

#define GS_LAUNCH_PARAMS                                                                  \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,   \
     unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,              \
     unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
#define GS_COOP_PARAMS                                                                    \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,   \
     unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,              \
     unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)

/* The newest cudaVersion whose variants the table holds: every PFN_<name>_v<version> the
 * toolkit's cudaTypedefs.h of CUDA 13.0 lists for a hooked name (test_paths.py -k every_variant).
 * Entry points of CUDA 13.2 and 13.3 that copy, call the host or begin a capture are hooked too
 * (cuMemcpy[3D]WithAttributesAsync, cuLaunchHostFunc_v2, cuStreamBeginRecaptureToGraph, with
 * their signatures from NVIDIA's documentation; no 13.2 header here): found by identity
 * (procaddr.c), they are not taken as proof that the table holds every variant to 13.3. */
#define GS_HOOKS_CUDA_VERSION 13000

#define GS_CUDA_HOOKS(X)                                                                                   \
    X(cuInit, CUresult, (unsigned int flags), cuInit, 2000, 0)                                             \
    X(cuGetProcAddress, CUresult,                                                                          \
      (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags), cuGetProcAddress, 11030, 0)     \
    X(cuGetProcAddress_v2, CUresult,                                                                       \
      (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,                                  \
       CUdriverProcAddressQueryResult *symbolStatus), cuGetProcAddress, 12000, 0)                          \
    X(cuDevicePrimaryCtxRetain, CUresult, (CUcontext *pctx, CUdevice dev), cuDevicePrimaryCtxRetain, 7000, 0) \
    X(cuDevicePrimaryCtxRelease_v2, CUresult, (CUdevice dev), cuDevicePrimaryCtxRelease, 11000, 0)         \
    X(cuDevicePrimaryCtxReset_v2, CUresult, (CUdevice dev), cuDevicePrimaryCtxReset, 11000, 0)             \
    X(cuDevicePrimaryCtxRelease, CUresult, (CUdevice dev), cuDevicePrimaryCtxRelease, 7000, 0)             \
    X(cuDevicePrimaryCtxReset, CUresult, (CUdevice dev), cuDevicePrimaryCtxReset, 7000, 0)                 \
    X(cuCtxCreate, CUresult, (CUcontext *pctx, unsigned int flags, CUdevice dev), cuCtxCreate, 2000, 0)    \
    X(cuCtxDestroy, CUresult, (CUcontext ctx), cuCtxDestroy, 2000, 0)                                      \
    X(cuCtxAttach, CUresult, (CUcontext *pctx, unsigned int flags), cuCtxAttach, 2000, 0)                  \
    X(cuCtxDetach, CUresult, (CUcontext ctx), cuCtxDetach, 2000, 0)                                        \
    X(cuCtxCreate_v2, CUresult, (CUcontext *pctx, unsigned int flags, CUdevice dev), cuCtxCreate, 3020, 0) \
    X(cuCtxCreate_v3, CUresult,                                                                            \
      (CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams, unsigned int flags, CUdevice dev), \
      cuCtxCreate, 11040, 0)                                                                               \
    X(cuCtxCreate_v4, CUresult,                                                                            \
      (CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev),             \
      cuCtxCreate, 12050, 0)                                                                               \
    X(cuCtxDestroy_v2, CUresult, (CUcontext ctx), cuCtxDestroy, 4000, 0)                                   \
    X(cuGreenCtxCreate, CUresult,                                                                          \
      (CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags), cuGreenCtxCreate, 12040,  \
      0)                                                                                                   \
    X(cuGreenCtxDestroy, CUresult, (CUgreenCtx hCtx), cuGreenCtxDestroy, 12040, 0)                         \
    X(cuMemGetInfo_v2, CUresult, (size_t *free, size_t *total), cuMemGetInfo, 3020, 0)                     \
    X(cuDeviceTotalMem_v2, CUresult, (size_t *bytes, CUdevice dev), cuDeviceTotalMem, 3020, 0)             \
    X(cuMemGetInfo, CUresult, (unsigned int *free, unsigned int *total), cuMemGetInfo, 2000, 0)            \
    X(cuDeviceTotalMem, CUresult, (unsigned int *bytes, CUdevice dev), cuDeviceTotalMem, 2000, 0)          \
    X(cuMemAlloc, CUresult, (unsigned int *dptr, unsigned int bytesize), cuMemAlloc, 2000, 0)              \
    X(cuMemAllocPitch, CUresult,                                                                           \
      (unsigned int *dptr, unsigned int *pPitch, unsigned int WidthInBytes, unsigned int Height,           \
       unsigned int ElementSizeBytes), cuMemAllocPitch, 2000, 0)                                           \
    X(cuMemFree, CUresult, (unsigned int dptr), cuMemFree, 2000, 0)                                        \
    X(cuMemAlloc_v2, CUresult, (CUdeviceptr *dptr, size_t bytesize), cuMemAlloc, 3020, 0)                  \
    X(cuMemAllocPitch_v2, CUresult,                                                                        \
      (CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height, unsigned int ElementSizeBytes), \
      cuMemAllocPitch, 3020, 0)                                                                            \
    X(cuMemAllocManaged, CUresult, (CUdeviceptr *dptr, size_t bytesize, unsigned int flags),               \
      cuMemAllocManaged, 6000, 0)                                                                          \
    X(cuMemFree_v2, CUresult, (CUdeviceptr dptr), cuMemFree, 3020, 0)                                      \
    X(cuMemAllocAsync, CUresult, (CUdeviceptr *dptr, size_t bytesize, CUstream hStream),                   \
      cuMemAllocAsync, 11020, 0)                                                                           \
    X(cuMemAllocAsync_ptsz, CUresult, (CUdeviceptr *dptr, size_t bytesize, CUstream hStream),              \
      cuMemAllocAsync, 11020, 1)                                                                           \
    X(cuMemAllocFromPoolAsync, CUresult,                                                                   \
      (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream), cuMemAllocFromPoolAsync, 11020, 0) \
    X(cuMemAllocFromPoolAsync_ptsz, CUresult,                                                              \
      (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream), cuMemAllocFromPoolAsync, 11020, 1) \
    X(cuMemFreeAsync, CUresult, (CUdeviceptr dptr, CUstream hStream), cuMemFreeAsync, 11020, 0)            \
    X(cuMemFreeAsync_ptsz, CUresult, (CUdeviceptr dptr, CUstream hStream), cuMemFreeAsync, 11020, 1)       \
    X(cuMemPoolTrimTo, CUresult, (CUmemoryPool pool, size_t minBytesToKeep), cuMemPoolTrimTo, 11020, 0)    \
    X(cuMemPoolDestroy, CUresult, (CUmemoryPool pool), cuMemPoolDestroy, 11020, 0)                         \
    X(cuMemPoolCreate, CUresult, (CUmemoryPool *pool, const CUmemPoolProps *poolProps), cuMemPoolCreate,   \
      11020, 0)                                                                                            \
    X(cuMemGetDefaultMemPool, CUresult,                                                                    \
      (CUmemoryPool *pool_out, CUmemLocation *location, CUmemAllocationType type), cuMemGetDefaultMemPool, \
      13000, 0)                                                                                            \
    X(cuMemGetMemPool, CUresult, (CUmemoryPool *pool, CUmemLocation *location, CUmemAllocationType type),  \
      cuMemGetMemPool, 13000, 0)                                                                           \
    X(cuDeviceSetMemPool, CUresult, (CUdevice dev, CUmemoryPool pool), cuDeviceSetMemPool, 11020, 0)       \
    X(cuMemSetMemPool, CUresult, (CUmemLocation *location, CUmemAllocationType type, CUmemoryPool pool),    \
      cuMemSetMemPool, 13000, 0)                                                                           \
    X(cuMemCreate, CUresult,                                                                               \
      (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,                 \
       unsigned long long flags), cuMemCreate, 10020, 0)                                                   \
    X(cuMemRelease, CUresult, (CUmemGenericAllocationHandle handle), cuMemRelease, 10020, 0)               \
    X(cuMemMap, CUresult,                                                                                  \
      (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,                   \
       unsigned long long flags), cuMemMap, 10020, 0)                                                      \
    X(cuMemUnmap, CUresult, (CUdeviceptr ptr, size_t size), cuMemUnmap, 10020, 0)                          \
    X(cuMemRetainAllocationHandle, CUresult, (CUmemGenericAllocationHandle *handle, void *addr),           \
      cuMemRetainAllocationHandle, 11000, 0)                                                               \
    X(cuMemImportFromShareableHandle, CUresult,                                                            \
      (CUmemGenericAllocationHandle *handle, void *osHandle, CUmemAllocationHandleType shHandleType),      \
      cuMemImportFromShareableHandle, 10020, 0)                                                            \
    X(cuImportExternalMemory, CUresult,                                                                    \
      (CUexternalMemory *extMem_out, const CUDA_EXTERNAL_MEMORY_HANDLE_DESC *memHandleDesc),               \
      cuImportExternalMemory, 10000, 0)                                                                    \
    X(cuDestroyExternalMemory, CUresult, (CUexternalMemory extMem), cuDestroyExternalMemory, 10000, 0)     \
    X(cuMemMapArrayAsync, CUresult, (CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream),   \
      cuMemMapArrayAsync, 11010, 0)                                                                        \
    X(cuMemMapArrayAsync_ptsz, CUresult, (CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream), \
      cuMemMapArrayAsync, 11010, 1)                                                                        \
    X(cuArrayCreate_v2, CUresult, (CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray),         \
      cuArrayCreate, 3020, 0)                                                                              \
    X(cuArray3DCreate_v2, CUresult, (CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray),     \
      cuArray3DCreate, 3020, 0)                                                                            \
    X(cuArrayCreate, CUresult, (CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *pAllocateArray),         \
      cuArrayCreate, 2000, 0)                                                                              \
    X(cuArray3DCreate, CUresult, (CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *pAllocateArray),     \
      cuArray3DCreate, 2000, 0)                                                                            \
    X(cuArrayDestroy, CUresult, (CUarray hArray), cuArrayDestroy, 2000, 0)                                 \
    X(cuMipmappedArrayCreate, CUresult,                                                                    \
      (CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,                      \
       unsigned int numMipmapLevels), cuMipmappedArrayCreate, 5000, 0)                                     \
    X(cuMipmappedArrayDestroy, CUresult, (CUmipmappedArray hMipmappedArray), cuMipmappedArrayDestroy, 5000, 0) \
    X(cuLaunchKernel, CUresult, GS_LAUNCH_PARAMS, cuLaunchKernel, 4000, 0)                                 \
    X(cuLaunchKernel_ptsz, CUresult, GS_LAUNCH_PARAMS, cuLaunchKernel, 7000, 1)                            \
    X(cuLaunchKernelEx, CUresult,                                                                          \
      (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra), cuLaunchKernelEx, 11060, 0) \
    X(cuLaunchKernelEx_ptsz, CUresult,                                                                     \
      (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra), cuLaunchKernelEx, 11060, 1) \
    X(cuLaunchCooperativeKernel, CUresult, GS_COOP_PARAMS, cuLaunchCooperativeKernel, 9000, 0)             \
    X(cuLaunchCooperativeKernel_ptsz, CUresult, GS_COOP_PARAMS, cuLaunchCooperativeKernel, 9000, 1)        \
    X(cuLaunchCooperativeKernelMultiDevice, CUresult,                                                      \
      (CUDA_LAUNCH_PARAMS *launchParamsList, unsigned int numDevices, unsigned int flags),                 \
      cuLaunchCooperativeKernelMultiDevice, 9000, 0)                                                       \
    X(cuLaunch, CUresult, (CUfunction f), cuLaunch, 2000, 0)                                               \
    X(cuLaunchGrid, CUresult, (CUfunction f, int grid_width, int grid_height), cuLaunchGrid, 2000, 0)      \
    X(cuLaunchGridAsync, CUresult, (CUfunction f, int grid_width, int grid_height, CUstream hStream),      \
      cuLaunchGridAsync, 2000, 0)                                                                          \
    X(cuGraphLaunch, CUresult, (CUgraphExec hGraphExec, CUstream hStream), cuGraphLaunch, 10000, 0)        \
    X(cuGraphLaunch_ptsz, CUresult, (CUgraphExec hGraphExec, CUstream hStream), cuGraphLaunch, 10000, 1) \
    X(cuCtxSynchronize, CUresult, (void), cuCtxSynchronize, 2000, 0)                                       \
    X(cuCtxSynchronize_v2, CUresult, (CUcontext ctx), cuCtxSynchronize, 13000, 0)                          \
    X(cuStreamBeginCapture, CUresult, (CUstream hStream), cuStreamBeginCapture, 10000, 0)                  \
    X(cuStreamBeginCapture_ptsz, CUresult, (CUstream hStream), cuStreamBeginCapture, 10000, 1)             \
    X(cuStreamBeginCapture_v2, CUresult, (CUstream hStream, CUstreamCaptureMode mode), cuStreamBeginCapture, \
      10010, 0)                                                                                            \
    X(cuStreamBeginCapture_v2_ptsz, CUresult, (CUstream hStream, CUstreamCaptureMode mode),                \
      cuStreamBeginCapture, 10010, 1)                                                                      \
    X(cuStreamBeginCaptureToGraph, CUresult,                                                               \
      (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,                                   \
       const CUgraphEdgeData *dependencyData, size_t numDependencies, CUstreamCaptureMode mode),           \
      cuStreamBeginCaptureToGraph, 12030, 0)                                                               \
    X(cuStreamBeginCaptureToGraph_ptsz, CUresult,                                                          \
      (CUstream hStream, CUgraph hGraph, const CUgraphNode *dependencies,                                  \
       const CUgraphEdgeData *dependencyData, size_t numDependencies, CUstreamCaptureMode mode),           \
      cuStreamBeginCaptureToGraph, 12030, 1)                                                               \
    X(cuStreamBeginRecaptureToGraph, CUresult,                                                             \
      (CUstream hStream, CUstreamCaptureMode mode, CUgraph hGraph, CUgraphRecaptureCallback callbackFunc,   \
       void *userData), cuStreamBeginRecaptureToGraph, 13030, 0)                                           \
    X(cuStreamBeginRecaptureToGraph_ptsz, CUresult,                                                        \
      (CUstream hStream, CUstreamCaptureMode mode, CUgraph hGraph, CUgraphRecaptureCallback callbackFunc,   \
       void *userData), cuStreamBeginRecaptureToGraph, 13030, 1)                                           \
    X(cuStreamEndCapture, CUresult, (CUstream hStream, CUgraph *phGraph), cuStreamEndCapture, 10000, 0)    \
    X(cuStreamEndCapture_ptsz, CUresult, (CUstream hStream, CUgraph *phGraph), cuStreamEndCapture, 10000, 1) \
    X(cuStreamDestroy, CUresult, (CUstream hStream), cuStreamDestroy, 2000, 0)                             \
    X(cuStreamDestroy_v2, CUresult, (CUstream hStream), cuStreamDestroy, 4000, 0)                          \
    X(cuStreamSynchronize, CUresult, (CUstream hStream), cuStreamSynchronize, 2000, 0)                     \
    X(cuStreamSynchronize_ptsz, CUresult, (CUstream hStream), cuStreamSynchronize, 7000, 1)                \
    X(cuEventSynchronize, CUresult, (CUevent hEvent), cuEventSynchronize, 2000, 0)                         \
    X(cuMemcpyAsync, CUresult, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream),      \
      cuMemcpyAsync, 4000, 0)                                                                               \
    X(cuMemcpyAsync_ptsz, CUresult, (CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream), \
      cuMemcpyAsync, 7000, 1)                                                                               \
    X(cuMemcpyPeerAsync, CUresult, (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,     \
      CUcontext srcContext, size_t ByteCount, CUstream hStream), cuMemcpyPeerAsync, 4000, 0)                \
    X(cuMemcpyPeerAsync_ptsz, CUresult, (CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, \
      CUcontext srcContext, size_t ByteCount, CUstream hStream), cuMemcpyPeerAsync, 7000, 1)                \
    X(cuMemcpyHtoDAsync, CUresult, (unsigned int dstDevice, const void *srcHost, unsigned int ByteCount,    \
      CUstream hStream), cuMemcpyHtoDAsync, 2000, 0)                                                        \
    X(cuMemcpyHtoDAsync_v2, CUresult, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,        \
      CUstream hStream), cuMemcpyHtoDAsync, 3020, 0)                                                        \
    X(cuMemcpyHtoDAsync_v2_ptsz, CUresult, (CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,   \
      CUstream hStream), cuMemcpyHtoDAsync, 7000, 1)                                                        \
    X(cuMemcpyDtoHAsync, CUresult, (void *dstHost, unsigned int srcDevice, unsigned int ByteCount,          \
      CUstream hStream), cuMemcpyDtoHAsync, 2000, 0)                                                        \
    X(cuMemcpyDtoHAsync_v2, CUresult, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,              \
      CUstream hStream), cuMemcpyDtoHAsync, 3020, 0)                                                        \
    X(cuMemcpyDtoHAsync_v2_ptsz, CUresult, (void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,         \
      CUstream hStream), cuMemcpyDtoHAsync, 7000, 1)                                                        \
    X(cuMemcpyDtoDAsync, CUresult, (unsigned int dstDevice, unsigned int srcDevice, unsigned int ByteCount, \
      CUstream hStream), cuMemcpyDtoDAsync, 3000, 0)                                                        \
    X(cuMemcpyDtoDAsync_v2, CUresult, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,      \
      CUstream hStream), cuMemcpyDtoDAsync, 3020, 0)                                                        \
    X(cuMemcpyDtoDAsync_v2_ptsz, CUresult, (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, \
      CUstream hStream), cuMemcpyDtoDAsync, 7000, 1)                                                        \
    X(cuMemcpyHtoAAsync, CUresult, (CUarray dstArray, unsigned int dstOffset, const void *srcHost,          \
      unsigned int ByteCount, CUstream hStream), cuMemcpyHtoAAsync, 2000, 0)                                \
    X(cuMemcpyHtoAAsync_v2, CUresult, (CUarray dstArray, size_t dstOffset, const void *srcHost,             \
      size_t ByteCount, CUstream hStream), cuMemcpyHtoAAsync, 3020, 0)                                      \
    X(cuMemcpyHtoAAsync_v2_ptsz, CUresult, (CUarray dstArray, size_t dstOffset, const void *srcHost,        \
      size_t ByteCount, CUstream hStream), cuMemcpyHtoAAsync, 7000, 1)                                      \
    X(cuMemcpyAtoHAsync, CUresult, (void *dstHost, CUarray srcArray, unsigned int srcOffset,                \
      unsigned int ByteCount, CUstream hStream), cuMemcpyAtoHAsync, 2000, 0)                                \
    X(cuMemcpyAtoHAsync_v2, CUresult, (void *dstHost, CUarray srcArray, size_t srcOffset, size_t ByteCount, \
      CUstream hStream), cuMemcpyAtoHAsync, 3020, 0)                                                        \
    X(cuMemcpyAtoHAsync_v2_ptsz, CUresult, (void *dstHost, CUarray srcArray, size_t srcOffset,              \
      size_t ByteCount, CUstream hStream), cuMemcpyAtoHAsync, 7000, 1)                                      \
    X(cuMemcpy2DAsync, CUresult, (const CUDA_MEMCPY2D_v1 *pCopy, CUstream hStream), cuMemcpy2DAsync, 2000, 0) \
    X(cuMemcpy2DAsync_v2, CUresult, (const CUDA_MEMCPY2D *pCopy, CUstream hStream), cuMemcpy2DAsync, 3020, 0) \
    X(cuMemcpy2DAsync_v2_ptsz, CUresult, (const CUDA_MEMCPY2D *pCopy, CUstream hStream), cuMemcpy2DAsync, 7000, \
      1)                                                                                                    \
    X(cuMemcpy3DAsync, CUresult, (const CUDA_MEMCPY3D_v1 *pCopy, CUstream hStream), cuMemcpy3DAsync, 2000, 0) \
    X(cuMemcpy3DAsync_v2, CUresult, (const CUDA_MEMCPY3D *pCopy, CUstream hStream), cuMemcpy3DAsync, 3020, 0) \
    X(cuMemcpy3DAsync_v2_ptsz, CUresult, (const CUDA_MEMCPY3D *pCopy, CUstream hStream), cuMemcpy3DAsync, 7000, \
      1)                                                                                                    \
    X(cuMemcpy3DPeerAsync, CUresult, (const CUDA_MEMCPY3D_PEER *pCopy, CUstream hStream), cuMemcpy3DPeerAsync, \
      4000, 0)                                                                                              \
    X(cuMemcpy3DPeerAsync_ptsz, CUresult, (const CUDA_MEMCPY3D_PEER *pCopy, CUstream hStream),              \
      cuMemcpy3DPeerAsync, 7000, 1)                                                                         \
    X(cuMemcpyBatchAsync, CUresult, (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,     \
      CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream hStream),    \
      cuMemcpyBatchAsync, 12080, 0)                                                                         \
    X(cuMemcpyBatchAsync_ptsz, CUresult, (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, \
      CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream hStream),    \
      cuMemcpyBatchAsync, 12080, 1)                                                                         \
    X(cuMemcpyBatchAsync_v2, CUresult, (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,  \
      CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream hStream), cuMemcpyBatchAsync, \
      13000, 0)                                                                                             \
    X(cuMemcpyBatchAsync_v2_ptsz, CUresult, (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, \
      CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, CUstream hStream), cuMemcpyBatchAsync, \
      13000, 1)                                                                                             \
    X(cuMemcpy3DBatchAsync, CUresult, (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList, size_t *failIdx,      \
      unsigned long long flags, CUstream hStream), cuMemcpy3DBatchAsync, 12080, 0)                          \
    X(cuMemcpy3DBatchAsync_ptsz, CUresult, (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList, size_t *failIdx, \
      unsigned long long flags, CUstream hStream), cuMemcpy3DBatchAsync, 12080, 1)                          \
    X(cuMemcpy3DBatchAsync_v2, CUresult, (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList,                    \
      unsigned long long flags, CUstream hStream), cuMemcpy3DBatchAsync, 13000, 0)                          \
    X(cuMemcpy3DBatchAsync_v2_ptsz, CUresult, (size_t numOps, CUDA_MEMCPY3D_BATCH_OP *opList,               \
      unsigned long long flags, CUstream hStream), cuMemcpy3DBatchAsync, 13000, 1)                          \
    X(cuMemcpyWithAttributesAsync, CUresult, (CUdeviceptr dst, CUdeviceptr src, size_t size,                \
      CUmemcpyAttributes *attr, CUstream hStream), cuMemcpyWithAttributesAsync, 13020, 0)                   \
    X(cuMemcpyWithAttributesAsync_ptsz, CUresult, (CUdeviceptr dst, CUdeviceptr src, size_t size,           \
      CUmemcpyAttributes *attr, CUstream hStream), cuMemcpyWithAttributesAsync, 13020, 1)                   \
    X(cuMemcpy3DWithAttributesAsync, CUresult, (CUDA_MEMCPY3D_BATCH_OP *op, unsigned long long flags,       \
      CUstream hStream), cuMemcpy3DWithAttributesAsync, 13020, 0)                                           \
    X(cuMemcpy3DWithAttributesAsync_ptsz, CUresult, (CUDA_MEMCPY3D_BATCH_OP *op, unsigned long long flags,  \
      CUstream hStream), cuMemcpy3DWithAttributesAsync, 13020, 1)                                           \
    X(cuLaunchHostFunc, CUresult, (CUstream hStream, CUhostFn fn, void *userData), cuLaunchHostFunc, 10000, 0) \
    X(cuLaunchHostFunc_ptsz, CUresult, (CUstream hStream, CUhostFn fn, void *userData), cuLaunchHostFunc,   \
      10000, 1)                                                                                             \
    X(cuLaunchHostFunc_v2, CUresult, (CUstream hStream, CUhostFn fn, void *userData, unsigned int syncMode), \
      cuLaunchHostFunc, 13020, 0)                                                                           \
    X(cuLaunchHostFunc_v2_ptsz, CUresult,                                                                  \
      (CUstream hStream, CUhostFn fn, void *userData, unsigned int syncMode), cuLaunchHostFunc, 13020, 1)   \
    X(cuStreamAddCallback, CUresult, (CUstream hStream, CUstreamCallback callback, void *userData,          \
      unsigned int flags), cuStreamAddCallback, 5000, 0)                                                    \
    X(cuStreamAddCallback_ptsz, CUresult, (CUstream hStream, CUstreamCallback callback, void *userData,     \
      unsigned int flags), cuStreamAddCallback, 7000, 1)                                                    \
    X(cuStreamWaitEvent, CUresult, (CUstream hStream, CUevent hEvent, unsigned int Flags), cuStreamWaitEvent, \
      3020, 0)                                                                                              \
    X(cuStreamWaitEvent_ptsz, CUresult, (CUstream hStream, CUevent hEvent, unsigned int Flags),             \
      cuStreamWaitEvent, 7000, 1)                                                                           \
    X(cuStreamWaitValue32, CUresult, (CUstream hStream, CUdeviceptr addr, cuuint32_t value,                 \
      unsigned int flags), cuStreamWaitValue32, 8000, 0)                                                    \
    X(cuStreamWaitValue32_ptsz, CUresult, (CUstream hStream, CUdeviceptr addr, cuuint32_t value,            \
      unsigned int flags), cuStreamWaitValue32, 8000, 1)                                                    \
    X(cuStreamWaitValue32_v2, CUresult, (CUstream hStream, CUdeviceptr addr, cuuint32_t value,              \
      unsigned int flags), cuStreamWaitValue32, 11070, 0)                                                   \
    X(cuStreamWaitValue32_v2_ptsz, CUresult, (CUstream hStream, CUdeviceptr addr, cuuint32_t value,         \
      unsigned int flags), cuStreamWaitValue32, 11070, 1)                                                   \
    X(cuStreamWaitValue64, CUresult, (CUstream hStream, CUdeviceptr addr, cuuint64_t value,                 \
      unsigned int flags), cuStreamWaitValue64, 9000, 0)                                                    \
    X(cuStreamWaitValue64_ptsz, CUresult, (CUstream hStream, CUdeviceptr addr, cuuint64_t value,            \
      unsigned int flags), cuStreamWaitValue64, 9000, 1)                                                    \
    X(cuStreamWaitValue64_v2, CUresult, (CUstream hStream, CUdeviceptr addr, cuuint64_t value,              \
      unsigned int flags), cuStreamWaitValue64, 11070, 0)                                                   \
    X(cuStreamWaitValue64_v2_ptsz, CUresult, (CUstream hStream, CUdeviceptr addr, cuuint64_t value,         \
      unsigned int flags), cuStreamWaitValue64, 11070, 1)                                                   \
    X(cuStreamBatchMemOp, CUresult, (CUstream hStream, unsigned int count,                                  \
      CUstreamBatchMemOpParams *paramArray, unsigned int flags), cuStreamBatchMemOp, 8000, 0)               \
    X(cuStreamBatchMemOp_ptsz, CUresult, (CUstream hStream, unsigned int count,                             \
      CUstreamBatchMemOpParams *paramArray, unsigned int flags), cuStreamBatchMemOp, 8000, 1)               \
    X(cuStreamBatchMemOp_v2, CUresult, (CUstream hStream, unsigned int count,                               \
      CUstreamBatchMemOpParams *paramArray, unsigned int flags), cuStreamBatchMemOp, 11070, 0)              \
    X(cuStreamBatchMemOp_v2_ptsz, CUresult, (CUstream hStream, unsigned int count,                          \
      CUstreamBatchMemOpParams *paramArray, unsigned int flags), cuStreamBatchMemOp, 11070, 1)              \
    X(cuMemsetD8Async, CUresult, (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream),     \
      cuMemsetD8Async, 3020, 0)                                                                             \
    X(cuMemsetD8Async_ptsz, CUresult, (CUdeviceptr dstDevice, unsigned char uc, size_t N,                   \
      CUstream hStream), cuMemsetD8Async, 7000, 1)                                                          \
    X(cuMemsetD16Async, CUresult, (CUdeviceptr dstDevice, unsigned short us, size_t N, CUstream hStream),   \
      cuMemsetD16Async, 3020, 0)                                                                            \
    X(cuMemsetD16Async_ptsz, CUresult, (CUdeviceptr dstDevice, unsigned short us, size_t N,                 \
      CUstream hStream), cuMemsetD16Async, 7000, 1)                                                         \
    X(cuMemsetD32Async, CUresult, (CUdeviceptr dstDevice, unsigned int ui, size_t N, CUstream hStream),     \
      cuMemsetD32Async, 3020, 0)                                                                            \
    X(cuMemsetD32Async_ptsz, CUresult, (CUdeviceptr dstDevice, unsigned int ui, size_t N,                   \
      CUstream hStream), cuMemsetD32Async, 7000, 1)                                                         \
    X(cuMemsetD2D8Async, CUresult, (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc,               \
      size_t Width, size_t Height, CUstream hStream), cuMemsetD2D8Async, 3020, 0)                           \
    X(cuMemsetD2D8Async_ptsz, CUresult, (CUdeviceptr dstDevice, size_t dstPitch, unsigned char uc,          \
      size_t Width, size_t Height, CUstream hStream), cuMemsetD2D8Async, 7000, 1)                           \
    X(cuMemsetD2D16Async, CUresult, (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us,             \
      size_t Width, size_t Height, CUstream hStream), cuMemsetD2D16Async, 3020, 0)                          \
    X(cuMemsetD2D16Async_ptsz, CUresult, (CUdeviceptr dstDevice, size_t dstPitch, unsigned short us,        \
      size_t Width, size_t Height, CUstream hStream), cuMemsetD2D16Async, 7000, 1)                          \
    X(cuMemsetD2D32Async, CUresult, (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui,               \
      size_t Width, size_t Height, CUstream hStream), cuMemsetD2D32Async, 3020, 0)                          \
    X(cuMemsetD2D32Async_ptsz, CUresult, (CUdeviceptr dstDevice, size_t dstPitch, unsigned int ui,          \
      size_t Width, size_t Height, CUstream hStream), cuMemsetD2D32Async, 7000, 1)                          \
    X(cuMemsetD8, CUresult, (unsigned int dstDevice, unsigned char uc, unsigned int N),                     \
      cuMemsetD8, 2000, 0)                                                                                  \
    X(cuMemsetD8_v2, CUresult, (CUdeviceptr dstDevice, unsigned char uc, size_t N),                         \
      cuMemsetD8, 3020, 0)                                                                                  \
    X(cuMemsetD8_v2_ptds, CUresult, (CUdeviceptr dstDevice, unsigned char uc, size_t N),                    \
      cuMemsetD8, 7000, 1)                                                                                  \
    X(cuMemsetD2D8, CUresult, (unsigned int dstDevice, unsigned int dstPitch,                               \
      unsigned char uc, unsigned int Width, unsigned int Height),                                           \
      cuMemsetD2D8, 2000, 0)                                                                                \
    X(cuMemsetD2D8_v2, CUresult, (CUdeviceptr dstDevice, size_t dstPitch,                                   \
      unsigned char uc, size_t Width, size_t Height),                                                       \
      cuMemsetD2D8, 3020, 0)                                                                                \
    X(cuMemsetD2D8_v2_ptds, CUresult, (CUdeviceptr dstDevice, size_t dstPitch,                              \
      unsigned char uc, size_t Width, size_t Height),                                                       \
      cuMemsetD2D8, 7000, 1)                                                                                \
    X(cuMemsetD16, CUresult, (unsigned int dstDevice, unsigned short us, unsigned int N),                   \
      cuMemsetD16, 2000, 0)                                                                                 \
    X(cuMemsetD16_v2, CUresult, (CUdeviceptr dstDevice, unsigned short us, size_t N),                       \
      cuMemsetD16, 3020, 0)                                                                                 \
    X(cuMemsetD16_v2_ptds, CUresult, (CUdeviceptr dstDevice, unsigned short us, size_t N),                  \
      cuMemsetD16, 7000, 1)                                                                                 \
    X(cuMemsetD2D16, CUresult, (unsigned int dstDevice, unsigned int dstPitch,                              \
      unsigned short us, unsigned int Width, unsigned int Height),                                          \
      cuMemsetD2D16, 2000, 0)                                                                               \
    X(cuMemsetD2D16_v2, CUresult, (CUdeviceptr dstDevice, size_t dstPitch,                                  \
      unsigned short us, size_t Width, size_t Height),                                                      \
      cuMemsetD2D16, 3020, 0)                                                                               \
    X(cuMemsetD2D16_v2_ptds, CUresult, (CUdeviceptr dstDevice, size_t dstPitch,                             \
      unsigned short us, size_t Width, size_t Height),                                                      \
      cuMemsetD2D16, 7000, 1)                                                                               \
    X(cuMemsetD32, CUresult, (unsigned int dstDevice, unsigned int ui, unsigned int N),                     \
      cuMemsetD32, 2000, 0)                                                                                 \
    X(cuMemsetD32_v2, CUresult, (CUdeviceptr dstDevice, unsigned int ui, size_t N),                         \
      cuMemsetD32, 3020, 0)                                                                                 \
    X(cuMemsetD32_v2_ptds, CUresult, (CUdeviceptr dstDevice, unsigned int ui, size_t N),                    \
      cuMemsetD32, 7000, 1)                                                                                 \
    X(cuMemsetD2D32, CUresult, (unsigned int dstDevice, unsigned int dstPitch,                              \
      unsigned int ui, unsigned int Width, unsigned int Height),                                            \
      cuMemsetD2D32, 2000, 0)                                                                               \
    X(cuMemsetD2D32_v2, CUresult, (CUdeviceptr dstDevice, size_t dstPitch,                                  \
      unsigned int ui, size_t Width, size_t Height),                                                        \
      cuMemsetD2D32, 3020, 0)                                                                               \
    X(cuMemsetD2D32_v2_ptds, CUresult, (CUdeviceptr dstDevice, size_t dstPitch,                             \
      unsigned int ui, size_t Width, size_t Height),                                                        \
      cuMemsetD2D32, 7000, 1)                                                                               \
    X(cuMemPrefetchAsync, CUresult, (CUdeviceptr devPtr, size_t count, CUdevice dstDevice,                  \
      CUstream hStream), cuMemPrefetchAsync, 8000, 0)                                                       \
    X(cuMemPrefetchAsync_ptsz, CUresult, (CUdeviceptr devPtr, size_t count, CUdevice dstDevice,             \
      CUstream hStream), cuMemPrefetchAsync, 8000, 1)                                                       \
    X(cuMemPrefetchAsync_v2, CUresult, (CUdeviceptr devPtr, size_t count, CUmemLocation location,           \
      unsigned int flags, CUstream hStream), cuMemPrefetchAsync, 12020, 0)                                  \
    X(cuMemPrefetchAsync_v2_ptsz, CUresult, (CUdeviceptr devPtr, size_t count, CUmemLocation location,      \
      unsigned int flags, CUstream hStream), cuMemPrefetchAsync, 12020, 1)                                  \
    X(cuMemPrefetchBatchAsync, CUresult, (CUdeviceptr *dptrs, size_t *sizes, size_t count,                  \
      CUmemLocation *prefetchLocs, size_t *prefetchLocIdxs, size_t numPrefetchLocs,                         \
      unsigned long long flags, CUstream hStream), cuMemPrefetchBatchAsync, 13000, 0)                       \
    X(cuMemPrefetchBatchAsync_ptsz, CUresult, (CUdeviceptr *dptrs, size_t *sizes, size_t count,             \
      CUmemLocation *prefetchLocs, size_t *prefetchLocIdxs, size_t numPrefetchLocs,                         \
      unsigned long long flags, CUstream hStream), cuMemPrefetchBatchAsync, 13000, 1)                       \
    X(cuMemDiscardAndPrefetchBatchAsync, CUresult, (CUdeviceptr *dptrs, size_t *sizes, size_t count,        \
      CUmemLocation *prefetchLocs, size_t *prefetchLocIdxs, size_t numPrefetchLocs,                         \
      unsigned long long flags, CUstream hStream), cuMemDiscardAndPrefetchBatchAsync, 13000, 0)             \
    X(cuMemDiscardAndPrefetchBatchAsync_ptsz, CUresult, (CUdeviceptr *dptrs, size_t *sizes, size_t count,   \
      CUmemLocation *prefetchLocs, size_t *prefetchLocIdxs, size_t numPrefetchLocs,                         \
      unsigned long long flags, CUstream hStream), cuMemDiscardAndPrefetchBatchAsync, 13000, 1)             \
    X(cuMemBatchDecompressAsync, CUresult, (CUmemDecompressParams *paramsArray, size_t count, unsigned int flags,\
      size_t *errorIndex, CUstream hStream), cuMemBatchDecompressAsync, 12060, 0)                           \
    X(cuMemBatchDecompressAsync_ptsz, CUresult, (CUmemDecompressParams *paramsArray, size_t count, unsigned int flags,\
      size_t *errorIndex, CUstream hStream), cuMemBatchDecompressAsync, 12060, 1)                           \
    X(cuWaitExternalSemaphoresAsync, CUresult, (const CUexternalSemaphore *extSemArray,                     \
      const CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS *paramsArray, unsigned int numExtSems,                      \
      CUstream hStream), cuWaitExternalSemaphoresAsync, 10000, 0)                                           \
    X(cuWaitExternalSemaphoresAsync_ptsz, CUresult, (const CUexternalSemaphore *extSemArray,                \
      const CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS *paramsArray, unsigned int numExtSems,                      \
      CUstream hStream), cuWaitExternalSemaphoresAsync, 10000, 1)                                           \
    X(cuGraphInstantiate, CUresult,                                                                        \
      (CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize), \
      cuGraphInstantiate, 10000, 0)                                                                        \
    X(cuGraphInstantiate_v2, CUresult,                                                                     \
      (CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize), \
      cuGraphInstantiate, 11000, 0)                                                                        \
    X(cuGraphInstantiateWithFlags, CUresult,                                                               \
      (CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags), cuGraphInstantiateWithFlags, 11040, 0) \
    X(cuGraphInstantiateWithParams, CUresult,                                                              \
      (CUgraphExec *phGraphExec, CUgraph hGraph, CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams),        \
      cuGraphInstantiateWithParams, 12000, 0)                                                              \
    X(cuGraphInstantiateWithParams_ptsz, CUresult,                                                         \
      (CUgraphExec *phGraphExec, CUgraph hGraph, CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams),        \
      cuGraphInstantiateWithParams, 12000, 1)                                                              \
    X(cuGraphUpload, CUresult, (CUgraphExec hGraphExec, CUstream hStream), cuGraphUpload, 11010, 0)        \
    X(cuGraphUpload_ptsz, CUresult, (CUgraphExec hGraphExec, CUstream hStream), cuGraphUpload, 11010, 1)   \
    X(cuGraphExecDestroy, CUresult, (CUgraphExec hGraphExec), cuGraphExecDestroy, 10000, 0)                \
    X(cuGraphExecUpdate, CUresult, (CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out,   \
      CUgraphExecUpdateResult *updateResult_out), cuGraphExecUpdate, 10020, 0)                             \
    X(cuGraphExecUpdate_v2, CUresult, (CUgraphExec hGraphExec, CUgraph hGraph,                             \
      CUgraphExecUpdateResultInfo *resultInfo), cuGraphExecUpdate, 12000, 0)                                \
    X(cuGraphExecKernelNodeSetParams, CUresult, (CUgraphExec hGraphExec, CUgraphNode hNode,                \
      const CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams), cuGraphExecKernelNodeSetParams, 10010, 0)             \
    X(cuGraphExecKernelNodeSetParams_v2, CUresult, (CUgraphExec hGraphExec, CUgraphNode hNode,             \
      const CUDA_KERNEL_NODE_PARAMS *nodeParams), cuGraphExecKernelNodeSetParams, 12000, 0)                \
    X(cuGraphExecNodeSetParams, CUresult, (CUgraphExec hGraphExec, CUgraphNode hNode,                      \
      CUgraphNodeParams *nodeParams), cuGraphExecNodeSetParams, 12020, 0)                                  \
    X(cuGraphExecChildGraphNodeSetParams, CUresult, (CUgraphExec hGraphExec, CUgraphNode hNode,            \
      CUgraph childGraph), cuGraphExecChildGraphNodeSetParams, 11010, 0)                                   \
    X(cuGraphNodeSetEnabled, CUresult, (CUgraphExec hGraphExec, CUgraphNode hNode, unsigned int isEnabled), \
      cuGraphNodeSetEnabled, 11060, 0)                                                                     \
    X(cuGraphExecMemcpyNodeSetParams, CUresult, (CUgraphExec hGraphExec, CUgraphNode hNode,                \
      const CUDA_MEMCPY3D *copyParams, CUcontext ctx), cuGraphExecMemcpyNodeSetParams, 10020, 0)           \
    X(cuGraphExecMemsetNodeSetParams, CUresult, (CUgraphExec hGraphExec, CUgraphNode hNode,                \
      const CUDA_MEMSET_NODE_PARAMS *memsetParams, CUcontext ctx), cuGraphExecMemsetNodeSetParams, 10020, 0) \
    X(cuGraphExecHostNodeSetParams, CUresult, (CUgraphExec hGraphExec, CUgraphNode hNode,                  \
      const CUDA_HOST_NODE_PARAMS *nodeParams), cuGraphExecHostNodeSetParams, 10020, 0)                    \
    X(cuDeviceGraphMemTrim, CUresult, (CUdevice device), cuDeviceGraphMemTrim, 11040, 0)                   \
    X(cuModuleLoad, CUresult, (CUmodule *module, const char *fname), cuModuleLoad, 2000, 0)                \
    X(cuCtxSetLimit, CUresult, (CUlimit limit, size_t value), cuCtxSetLimit, 3010, 0)                      \
    X(cuModuleLoadData, CUresult, (CUmodule *module, const void *image), cuModuleLoadData, 2000, 0)        \
    X(cuModuleLoadDataEx, CUresult,                                                                        \
      (CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,                \
       void **optionValues), cuModuleLoadDataEx, 2010, 0)                                                  \
    X(cuModuleLoadFatBinary, CUresult, (CUmodule *module, const void *fatCubin), cuModuleLoadFatBinary, 2000, 0) \
    X(cuModuleGetFunction, CUresult, (CUfunction *hfunc, CUmodule hmod, const char *name),                 \
      cuModuleGetFunction, 2000, 0)                                                                        \
    X(cuLibraryLoadData, CUresult,                                                                         \
      (CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,            \
       unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,            \
       unsigned int numLibraryOptions), cuLibraryLoadData, 12000, 0)                                       \
    X(cuLibraryLoadFromFile, CUresult,                                                                     \
      (CUlibrary *library, const char *fileName, CUjit_option *jitOptions, void **jitOptionsValues,        \
       unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,            \
       unsigned int numLibraryOptions), cuLibraryLoadFromFile, 12000, 0)                                   \
    X(cuLibraryGetKernel, CUresult, (CUkernel *pKernel, CUlibrary library, const char *name),              \
      cuLibraryGetKernel, 12000, 0)                                                                        \
    X(cuKernelGetFunction, CUresult, (CUfunction *pFunc, CUkernel kernel), cuKernelGetFunction, 12000, 0) \
    X(cuFuncLoad, CUresult, (CUfunction function), cuFuncLoad, 12040, 0)                                  \
    X(cuLibraryGetModule, CUresult, (CUmodule *pMod, CUlibrary library), cuLibraryGetModule, 12000, 0)   \
    X(cuLibraryGetGlobal, CUresult, (CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name), \
      cuLibraryGetGlobal, 12000, 0)                                                                        \
    X(cuModuleUnload, CUresult, (CUmodule hmod), cuModuleUnload, 2000, 0)                                  \
    X(cuLibraryUnload, CUresult, (CUlibrary library), cuLibraryUnload, 12000, 0)

#define GS_CUDA_REALS(R)                                                                      \
    R(cuDriverGetVersion, CUresult, (int *version))                                           \
    R(cuDeviceGetCount, CUresult, (int *count))                                               \
    R(cuDeviceGet, CUresult, (CUdevice *device, int ordinal))                                 \
    R(cuDeviceGetUuid, CUresult, (CUuuid *uuid, CUdevice dev))                                \
    R(cuDeviceGetUuid_v2, CUresult, (CUuuid *uuid, CUdevice dev))                             \
    R(cuCtxGetDevice, CUresult, (CUdevice *device))                                           \
    R(cuCtxGetLimit, CUresult, (size_t *pvalue, CUlimit limit))                               \
    R(cuFuncGetAttribute, CUresult, (int *pi, CUfunction_attribute attrib, CUfunction hfunc)) \
    R(cuKernelGetAttribute, CUresult, (int *pi, CUfunction_attribute attrib, CUkernel kernel, CUdevice dev)) \
    R(cuMemGetAllocationPropertiesFromHandle, CUresult, (CUmemAllocationProp *prop, CUmemGenericAllocationHandle handle)) \
    R(cuDeviceGetAttribute, CUresult, (int *pi, CUdevice_attribute attrib, CUdevice dev))     \
    R(cuCtxGetCurrent, CUresult, (CUcontext *pctx))                                           \
    R(cuCtxSetCurrent, CUresult, (CUcontext ctx))                                             \
    R(cuStreamGetCtx, CUresult, (CUstream hStream, CUcontext *pctx))                          \
    R(cuStreamGetDevice, CUresult, (CUstream hStream, CUdevice *device))                      \
    R(cuCtxGetDevice_v2, CUresult, (CUdevice *device, CUcontext ctx))                         \
    R(cuDevicePrimaryCtxGetState, CUresult, (CUdevice dev, unsigned int *flags, int *active)) \
    R(cuCtxFromGreenCtx, CUresult, (CUcontext *pContext, CUgreenCtx hCtx))                   \
    R(cuMemGetAddressRange_v2, CUresult, (CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)) \
    R(cuDeviceGetMemPool, CUresult, (CUmemoryPool *pool, CUdevice dev))                       \
    R(cuDeviceGetDefaultMemPool, CUresult, (CUmemoryPool *pool_out, CUdevice dev))            \
    R(cuMemPoolGetAttribute, CUresult, (CUmemoryPool pool, CUmemPool_attribute attr, void *value)) \
    R(cuPointerGetAttribute, CUresult, (void *data, CUpointer_attribute attribute, CUdeviceptr ptr)) \
    R(cuEventCreate, CUresult, (CUevent *phEvent, unsigned int flags))                        \
    R(cuEventRecord, CUresult, (CUevent hEvent, CUstream hStream))                            \
    R(cuEventQuery, CUresult, (CUevent hEvent))                                               \
    R(cuEventElapsedTime, CUresult, (float *ms, CUevent hStart, CUevent hEnd))                \
    R(cuEventElapsedTime_v2, CUresult, (float *ms, CUevent hStart, CUevent hEnd))             \
    R(cuEventDestroy_v2, CUresult, (CUevent hEvent))                                          \
    R(cuStreamIsCapturing, CUresult, (CUstream hStream, CUstreamCaptureStatus *status))      \
    R(cuGraphGetNodes, CUresult, (CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes))      \
    R(cuGraphNodeGetType, CUresult, (CUgraphNode hNode, CUgraphNodeType *type))               \
    R(cuGraphMemAllocNodeGetParams, CUresult, (CUgraphNode hNode, CUDA_MEM_ALLOC_NODE_PARAMS *params_out)) \
    R(cuGraphChildGraphNodeGetGraph, CUresult, (CUgraphNode hNode, CUgraph *phGraph))         \
    R(cuDeviceGetGraphMemAttribute, CUresult, (CUdevice device, CUgraphMem_attribute attr, void *value)) \
    R(cuModuleGetLoadingMode, CUresult, (CUmoduleLoadingMode *mode))

#define GS_NVML_HOOKS(N)                                                                      \
    N(nvmlDeviceGetMemoryInfo, nvmlReturn_t, (nvmlDevice_t device, nvmlMemory_t *memory))     \
    N(nvmlDeviceGetMemoryInfo_v2, nvmlReturn_t, (nvmlDevice_t device, nvmlMemory_v2_t *memory))

#define GS_NVML_REALS(R)                                                                      \
    R(nvmlInit_v2, nvmlReturn_t, (void))                                                      \
    R(nvmlShutdown, nvmlReturn_t, (void))                                                     \
    R(nvmlDeviceGetCount_v2, nvmlReturn_t, (unsigned int *count))                             \
    R(nvmlDeviceGetHandleByIndex_v2, nvmlReturn_t, (unsigned int index, nvmlDevice_t *device)) \
    R(nvmlDeviceGetUUID, nvmlReturn_t, (nvmlDevice_t device, char *uuid, unsigned int length)) \
    R(nvmlDeviceGetIndex, nvmlReturn_t, (nvmlDevice_t device, unsigned int *index))            \
    R(nvmlDeviceGetComputeRunningProcesses_v3, nvmlReturn_t,                                  \
      (nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_t *infos))                   \
    R(nvmlDeviceGetConfComputeMemSizeInfo, nvmlReturn_t, (nvmlDevice_t device, void *info))  \
    R(nvmlDeviceGetRunningProcessDetailList, nvmlReturn_t, (nvmlDevice_t device, void *list)) \
    R(nvmlDeviceGetPowerUsage, nvmlReturn_t, (nvmlDevice_t device, unsigned int *power))      \
    R(nvmlDeviceGetEnforcedPowerLimit, nvmlReturn_t, (nvmlDevice_t device, unsigned int *limit)) \
    R(nvmlDeviceGetUtilizationRates, nvmlReturn_t, (nvmlDevice_t device, nvmlUtilization_t *utilization)) \
    R(nvmlDeviceGetProcessUtilization, nvmlReturn_t,                                          \
      (nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization, unsigned int *processSamplesCount, \
       unsigned long long lastSeenTimeStamp))

#endif /* GPUSLICE_HOOKS_H */
