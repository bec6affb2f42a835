/*
 * abi.h - facts about the CUDA ABI that src/cuda_abi.h restates: sizes,
 * offsets and constants.  abi_cuda.c evaluates them against the toolkit's
 * cuda.h, abi_ours.c against our declarations; main() compares the two.
 */
#ifndef GPUSLICE_ABI_H
#define GPUSLICE_ABI_H

#include <stddef.h>

#define ABI_FACTS(F)                                                   \
    F(sizeof(CUresult)) F(sizeof(CUdevice)) F(sizeof(CUdeviceptr))     \
    F(sizeof(CUmemGenericAllocationHandle)) F(sizeof(CUuuid))          \
    F(sizeof(CUDA_ARRAY_DESCRIPTOR)) F(offsetof(CUDA_ARRAY_DESCRIPTOR, Height)) \
    F(offsetof(CUDA_ARRAY_DESCRIPTOR, Format)) F(offsetof(CUDA_ARRAY_DESCRIPTOR, NumChannels)) \
    F(sizeof(CUDA_ARRAY3D_DESCRIPTOR)) F(offsetof(CUDA_ARRAY3D_DESCRIPTOR, Depth)) \
    F(offsetof(CUDA_ARRAY3D_DESCRIPTOR, Format)) F(offsetof(CUDA_ARRAY3D_DESCRIPTOR, NumChannels)) \
    F(offsetof(CUDA_ARRAY3D_DESCRIPTOR, Flags))                        \
    F(sizeof(CUDA_ARRAY_DESCRIPTOR_v1)) F(offsetof(CUDA_ARRAY_DESCRIPTOR_v1, Format)) \
    F(offsetof(CUDA_ARRAY_DESCRIPTOR_v1, NumChannels)) F(sizeof(CUDA_ARRAY3D_DESCRIPTOR_v1)) \
    F(offsetof(CUDA_ARRAY3D_DESCRIPTOR_v1, Depth)) F(offsetof(CUDA_ARRAY3D_DESCRIPTOR_v1, Format)) \
    F(offsetof(CUDA_ARRAY3D_DESCRIPTOR_v1, Flags))                     \
    F(offsetof(CUmemAllocationProp, type)) F(offsetof(CUmemAllocationProp, location)) \
    F(offsetof(CUmemAllocationProp, location.type)) F(offsetof(CUmemAllocationProp, location.id)) \
    F(sizeof(CUlaunchConfig)) F(offsetof(CUlaunchConfig, sharedMemBytes)) \
    F(offsetof(CUlaunchConfig, hStream)) F(offsetof(CUlaunchConfig, numAttrs)) \
    F(sizeof(CUDA_LAUNCH_PARAMS)) F(offsetof(CUDA_LAUNCH_PARAMS, sharedMemBytes))  \
    F(offsetof(CUDA_LAUNCH_PARAMS, hStream)) F(offsetof(CUDA_LAUNCH_PARAMS, kernelParams)) \
    F(CUDA_SUCCESS) F(CUDA_ERROR_INVALID_VALUE) F(CUDA_ERROR_OUT_OF_MEMORY) \
    F(CUDA_ERROR_NOT_INITIALIZED) F(CUDA_ERROR_INVALID_DEVICE) F(CUDA_ERROR_INVALID_CONTEXT) \
    F(CUDA_ERROR_NOT_FOUND) F(CUDA_ERROR_NOT_READY) F(CUDA_ERROR_NOT_SUPPORTED) F(CUDA_ERROR_OPERATING_SYSTEM) \
    F(CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) F(CU_GET_PROC_ADDRESS_SUCCESS) \
    F(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT) F(CU_MEMPOOL_ATTR_USED_MEM_CURRENT) \
    F(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) F(sizeof(CUpointer_attribute)) \
    F(CU_MEM_LOCATION_TYPE_DEVICE) F(CU_MEM_LOCATION_TYPE_NONE) F(CU_MEM_LOCATION_TYPE_HOST)          \
    F(CU_MEM_ALLOCATION_TYPE_PINNED) F(CU_MEM_ALLOCATION_TYPE_MANAGED) F(sizeof(CUmemAllocationType)) \
    F(CU_STREAM_CAPTURE_STATUS_NONE) F((long)CU_STREAM_PER_THREAD) \
    F(CU_EVENT_DEFAULT) F(sizeof(CUjit_option)) F(sizeof(CUlibraryOption))  \
    F(sizeof(CUmemPoolProps)) F(offsetof(CUmemPoolProps, location)) F(offsetof(CUmemPoolProps, usage)) \
    F(sizeof(CUDA_MEM_ALLOC_NODE_PARAMS)) F(offsetof(CUDA_MEM_ALLOC_NODE_PARAMS, bytesize)) \
    F(offsetof(CUDA_MEM_ALLOC_NODE_PARAMS, dptr)) F(sizeof(CUDA_GRAPH_INSTANTIATE_PARAMS)) \
    F(offsetof(CUDA_GRAPH_INSTANTIATE_PARAMS, hUploadStream)) \
    F(offsetof(CUDA_GRAPH_INSTANTIATE_PARAMS, result_out)) F(sizeof(CUgraphNodeType)) \
    F(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT) F(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) \
    F(CU_GRAPH_NODE_TYPE_GRAPH) F(CU_GRAPH_NODE_TYPE_MEM_ALLOC) F(CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) \
    F(CU_GRAPH_NODE_TYPE_CONDITIONAL) F(CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH) F(CU_GRAPH_NODE_TYPE_KERNEL) \
    F(CUDA_GRAPH_INSTANTIATE_SUCCESS) F(CUDA_GRAPH_INSTANTIATE_ERROR) F(CU_LIMIT_STACK_SIZE)        \
    F(CU_LIMIT_PRINTF_FIFO_SIZE) F(CU_LIMIT_MALLOC_HEAP_SIZE) F(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) \
    F(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR) F(sizeof(CUlimit)) F(sizeof(CUdevice_attribute)) \
    F(sizeof(CUfunction_attribute)) F(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES) \
    F(sizeof(CUarrayMapInfo)) F(offsetof(CUarrayMapInfo, resource)) F(offsetof(CUarrayMapInfo, subresourceType)) \
    F(offsetof(CUarrayMapInfo, subresource.sparseLevel.extentDepth)) F(offsetof(CUarrayMapInfo, subresource.miptail.size)) \
    F(offsetof(CUarrayMapInfo, memOperationType)) F(offsetof(CUarrayMapInfo, memHandleType)) \
    F(offsetof(CUarrayMapInfo, memHandle)) F(offsetof(CUarrayMapInfo, offset)) \
    F(offsetof(CUarrayMapInfo, deviceBitMask)) F(CU_RESOURCE_TYPE_MIPMAPPED_ARRAY) \
    F(CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL) F(CU_MEM_OPERATION_TYPE_MAP) F(CU_MEM_OPERATION_TYPE_UNMAP) \
    F(CU_MEM_HANDLE_TYPE_GENERIC) F(sizeof(CUresourcetype)) F(sizeof(CUmemOperationType)) \
    F(sizeof(CUDA_EXTERNAL_MEMORY_HANDLE_DESC)) F(offsetof(CUDA_EXTERNAL_MEMORY_HANDLE_DESC, handle.fd)) \
    F(offsetof(CUDA_EXTERNAL_MEMORY_HANDLE_DESC, size)) F(offsetof(CUDA_EXTERNAL_MEMORY_HANDLE_DESC, flags)) \
    F(CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD)

struct abi_fact {
    const char *expr;
    long value;
};
extern const struct abi_fact abi_cuda[];
extern const int abi_cuda_count;

#define ABI_ENTRY(x) {#x, (long)(x)},

#endif
