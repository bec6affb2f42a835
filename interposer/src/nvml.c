/*
 * nvml.c - what NVML tells the container about memory (nvidia-smi, pynvml).
 *
 * nvmlDeviceGetMemoryInfo and _v2 report, for a device with a cap:
 * total = the cap (at most the real total), used = the container's usage from
 * the region (at most total), free = total - used but never more than the
 * device really has free (other containers' usage counts there, as in
 * cuMemGetInfo), reserved = 0.  Devices
 * without a cap are reported as the driver does.  A process that only uses
 * NVML (nvidia-smi) reads the region without registering in it.
 *
 * Process lists (nvmlDeviceGetComputeRunningProcesses*) are passed through
 * unchanged: inside a container they show host pids, if any.
 */
#define _GNU_SOURCE
#include "gpuslice.h"

/* Capped view of one device; returns 0 if the device has no cap. */
static int capped(nvmlDevice_t device, unsigned long long *total, unsigned long long *used)
{
    gs_devices_view_ready();
    int slot = gs_nvml_slot(device);
    uint64_t limit = gs_slot_limit(slot);
    if (slot < 0 || !limit) return 0;
    gs_region_reclaim_soon();
    if (limit < *total) *total = limit;
    uint64_t u = gs_slot_used(slot);
    *used = u < *total ? u : *total;
    return 1;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    gs_nvml_init();
    if (!gs_nvml.nvmlDeviceGetMemoryInfo) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = gs_nvml.nvmlDeviceGetMemoryInfo(device, memory);
    if (rc != NVML_SUCCESS) return rc;
    unsigned long long total = memory->total, used = 0, real_free = memory->free;
    if (capped(device, &total, &used)) {
        memory->total = total;
        memory->used = used;
        memory->free = total - used < real_free ? total - used : real_free;
    }
    return NVML_SUCCESS;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    gs_nvml_init();
    if (!gs_nvml.nvmlDeviceGetMemoryInfo_v2) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = gs_nvml.nvmlDeviceGetMemoryInfo_v2(device, memory);
    if (rc != NVML_SUCCESS) return rc;
    unsigned long long total = memory->total, used = 0, real_free = memory->free;
    if (capped(device, &total, &used)) {
        memory->total = total;
        memory->reserved = 0;
        memory->used = used;
        memory->free = total - used < real_free ? total - used : real_free;
    }
    return NVML_SUCCESS;
}
