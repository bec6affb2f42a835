/*
 * minimal.c - a "driver" that exports almost nothing: every hook whose real
 * function is missing must answer CUDA_ERROR_NOT_SUPPORTED (or, used as the
 * NVML library, NVML_ERROR_FUNCTION_NOT_FOUND) instead of calling through NULL.
 */
#include "cuda_abi.h"

__attribute__((visibility("default"))) CUresult cuDriverGetVersion(int *v)
{
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 13000;
    return CUDA_SUCCESS;
}
