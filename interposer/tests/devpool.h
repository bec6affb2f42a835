/*
 * devpool.h - for the test programs: a stream-ordered pool of device 0's memory made with
 * cuMemPoolCreate (CUmemPoolProps as the driver lays it out: type, handle types, location, the
 * rest zero).
 */
#ifndef GPUSLICE_TESTS_DEVPOOL_H
#define GPUSLICE_TESTS_DEVPOOL_H

#include "cuda_abi.h"

CUresult cuMemPoolCreate(CUmemoryPool *, const void *);

static inline CUresult device_pool_create(CUmemoryPool *pool)
{
    struct {
        int allocType, handleTypes;
        CUmemLocation location;
        char rest[64];
    } props = {CU_MEM_ALLOCATION_TYPE_PINNED, 0, {CU_MEM_LOCATION_TYPE_DEVICE, 0}, {0}};
    return cuMemPoolCreate(pool, &props);
}

#endif
