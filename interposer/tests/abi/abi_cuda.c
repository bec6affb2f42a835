/* The ABI facts as the CUDA toolkit's cuda.h states them.  (Its CUDA 2.x
 * declarations, such as CUDA_ARRAY_DESCRIPTOR_v1, are there for the driver's
 * own build only: __CUDA_API_VERSION_INTERNAL.) */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>

#include "abi.h"

const struct abi_fact abi_cuda[] = {ABI_FACTS(ABI_ENTRY)};
const int abi_cuda_count = sizeof(abi_cuda) / sizeof(abi_cuda[0]);
