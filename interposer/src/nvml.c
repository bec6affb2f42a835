/*
 * nvml.c - what NVML tells the container about memory (nvidia-smi, pynvml).
 *
 * For a device with a cap, one answer is worked out from one reading of the driver's figures
 * and one of the region's: total = the cap (at most the real total), the container's usage
 * from the region (at most total), free = total - usage but never more than the device really
 * has free (other containers' usage counts there, as in cuMemGetInfo; so does the memory the
 * driver reserves, when the cap is the whole device).  What of the cap is neither the
 * container's nor free is reported as NVML reports memory the container cannot have: in
 * nvmlDeviceGetMemoryInfo_v2's reserved (total = reserved + used + free, as nvidia-smi -q
 * prints them; used = the container's usage), and in nvmlDeviceGetMemoryInfo's used, which
 * includes the reserved memory (used + free = total).  A whole-device slice so reads as the
 * driver's own answer.  Devices without a cap are reported as the driver does.  A process
 * that only uses NVML (nvidia-smi) reads the region without registering in it.
 *
 * Process lists (nvmlDeviceGetComputeRunningProcesses*) are passed through
 * unchanged: inside a container they show host pids, if any.
 */
#define _GNU_SOURCE
#include "gpuslice.h"

/* Capped view of one device from the driver's *total and *free: returns 0 if the device has no
 * cap, else 1 with *total the cap, *used the container's usage and *free what of the cap is
 * free (used + free <= total; the rest the device cannot give) */
static int capped(nvmlDevice_t device, unsigned long long *total, unsigned long long *used,
                  unsigned long long *free)
{
    gs_devices_view_ready();
    int slot = gs_nvml_slot(device);
    uint64_t limit = gs_slot_limit(slot);
    if (slot < 0 || !limit) return 0;
    gs_region_reclaim_soon();
    if (limit < *total) *total = limit;
    uint64_t u = gs_slot_used(slot); /* read once: another process may allocate meanwhile */
    *used = u < *total ? u : *total;
    if (*total - *used < *free) *free = *total - *used;
    return 1;
}

GS_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    gs_nvml_init();
    if (!gs_nvml.nvmlDeviceGetMemoryInfo) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = gs_nvml.nvmlDeviceGetMemoryInfo(device, memory);
    if (rc != NVML_SUCCESS) return rc;
    unsigned long long total = memory->total, used = 0, free = memory->free;
    if (capped(device, &total, &used, &free)) {
        memory->total = total;
        memory->free = free;
        memory->used = total - free; /* v1's used includes what is reserved */
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
    unsigned long long total = memory->total, used = 0, free = memory->free;
    if (capped(device, &total, &used, &free)) {
        memory->total = total;
        memory->used = used;
        memory->free = free;
        memory->reserved = total - used - free;
    }
    return NVML_SUCCESS;
}
