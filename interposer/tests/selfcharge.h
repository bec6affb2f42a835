/*
 * selfcharge.h - for the test programs: what the region charges this process on the container's
 * device slot 0 (the library's own count), read from CUDA_DEVICE_MEMORY_SHARED_CACHE.
 */
#ifndef GPUSLICE_TESTS_SELFCHARGE_H
#define GPUSLICE_TESTS_SELFCHARGE_H

#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gpuslice_region.h"

/* 0 and *charge set, or -1 where the region cannot be read */
static inline int self_charge(uint64_t *charge)
{
    const char *path = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    int fd = path ? open(path, O_RDONLY) : -1;
    const struct gpuslice_region *r =
        fd < 0 ? MAP_FAILED : mmap(NULL, sizeof(*r), PROT_READ, MAP_SHARED, fd, 0);
    if (fd >= 0) close(fd);
    if (r == MAP_FAILED) return -1;
    *charge = 0;
    for (int i = 0; i < GPUSLICE_MAX_PROCS; i++)
        if (r->procs[i].pid == getpid()) *charge = r->procs[i].used_bytes[0];
    munmap((void *)r, sizeof(*r));
    return 0;
}

#endif
