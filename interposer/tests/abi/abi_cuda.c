/* The ABI facts as the CUDA toolkit's cuda.h states them. */
#include <cuda.h>

#include "abi.h"

const struct abi_fact abi_cuda[] = {ABI_FACTS(ABI_ENTRY)};
const int abi_cuda_count = sizeof(abi_cuda) / sizeof(abi_cuda[0]);
