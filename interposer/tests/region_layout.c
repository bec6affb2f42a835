/*
 * region_layout - the C side of tests/interposer/test_region_layout.py.
 *
 *   region_layout layout        "<name> <offset> <size>" for every field
 *   region_layout write PATH    write a region with known contents
 *   region_layout read PATH     print what a region (e.g. written by Python) holds
 */
#define _GNU_SOURCE
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "cuda_abi.h"
#include "gpuslice_region.h"

#define R struct gpuslice_region
#define D struct gpuslice_device
#define P struct gpuslice_proc
#define FIELD(T, f) printf("%s.%s %zu %zu\n", #T, #f, offsetof(T, f), sizeof(((T *)0)->f));

static void layout(void)
{
    printf("region %zu\n", sizeof(R));
    FIELD(R, magic) FIELD(R, version) FIELD(R, size) FIELD(R, max_devices) FIELD(R, max_procs)
    FIELD(R, device_count) FIELD(R, flags) FIELD(R, boot_id) FIELD(R, reclaimed_ns) FIELD(R, lock) FIELD(R, pod_uid)
    FIELD(R, pod_name) FIELD(R, pod_namespace) FIELD(R, container) FIELD(R, devices) FIELD(R, procs)
    printf("device %zu\n", sizeof(D));
    FIELD(D, uuid) FIELD(D, limit_bytes) FIELD(D, used_bytes) FIELD(D, total_bytes) FIELD(D, busy_ns)
    FIELD(D, throttle_vt_ns) FIELD(D, ctx_footprint_bytes) FIELD(D, sm_limit) FIELD(D, index)
    FIELD(D, sm_scale_milli) FIELD(D, idle_power_mw)
    printf("proc %zu\n", sizeof(P));
    FIELD(P, pid) FIELD(P, state) FIELD(P, pidns) FIELD(P, start_time) FIELD(P, used_bytes) FIELD(P, host_pid)
    FIELD(P, token) FIELD(P, measured_ns)
    printf("constant MAGIC %llu\nconstant VERSION %u\nconstant MAX_DEVICES %d\nconstant MAX_PROCS %d\n",
           (unsigned long long)GPUSLICE_REGION_MAGIC, GPUSLICE_REGION_VERSION, GPUSLICE_MAX_DEVICES,
           GPUSLICE_MAX_PROCS);
    printf("constant PROC_LIVE %u\n", GPUSLICE_PROC_LIVE);
    printf("constant TOKEN_BASE %llu\n", (unsigned long long)GPUSLICE_TOKEN_BASE);
    FIELD(nvmlMemory_t, total) FIELD(nvmlMemory_t, free) FIELD(nvmlMemory_t, used)
    FIELD(nvmlMemory_v2_t, version) FIELD(nvmlMemory_v2_t, total) FIELD(nvmlMemory_v2_t, reserved)
    FIELD(nvmlMemory_v2_t, free) FIELD(nvmlMemory_v2_t, used)
    FIELD(nvmlProcessInfo_t, pid) FIELD(nvmlProcessInfo_t, usedGpuMemory)
    FIELD(nvmlProcessInfo_t, gpuInstanceId) FIELD(nvmlProcessInfo_t, computeInstanceId)
    FIELD(nvmlUtilization_t, gpu) FIELD(nvmlUtilization_t, memory)
    FIELD(nvmlProcessUtilizationSample_t, pid) FIELD(nvmlProcessUtilizationSample_t, timeStamp)
    FIELD(nvmlProcessUtilizationSample_t, smUtil) FIELD(nvmlProcessUtilizationSample_t, memUtil)
    FIELD(nvmlProcessUtilizationSample_t, encUtil) FIELD(nvmlProcessUtilizationSample_t, decUtil)
    printf("nvmlsize nvmlProcessInfo_t %zu\n", sizeof(nvmlProcessInfo_t));
    printf("nvmlsize nvmlUtilization_t %zu\n", sizeof(nvmlUtilization_t));
    printf("nvmlsize nvmlProcessUtilizationSample_t %zu\n", sizeof(nvmlProcessUtilizationSample_t));
    printf("nvmlconst NVML_SUCCESS %d\n", NVML_SUCCESS);
    printf("nvmlconst NVML_ERROR_UNINITIALIZED %d\n", NVML_ERROR_UNINITIALIZED);
    printf("nvmlconst NVML_ERROR_INVALID_ARGUMENT %d\n", NVML_ERROR_INVALID_ARGUMENT);
    printf("nvmlconst NVML_ERROR_NOT_SUPPORTED %d\n", NVML_ERROR_NOT_SUPPORTED);
    printf("nvmlconst NVML_ERROR_NOT_FOUND %d\n", NVML_ERROR_NOT_FOUND);
    printf("nvmlconst NVML_ERROR_INSUFFICIENT_SIZE %d\n", NVML_ERROR_INSUFFICIENT_SIZE);
    printf("nvmlconst NVML_ERROR_FUNCTION_NOT_FOUND %d\n", NVML_ERROR_FUNCTION_NOT_FOUND);
    printf("nvmlconst NVML_DEVICE_UUID_V2_BUFFER_SIZE %d\n", NVML_DEVICE_UUID_V2_BUFFER_SIZE);
}

static int write_region(const char *path)
{
    static R r;
    memset(&r, 0, sizeof(r));
    r.magic = GPUSLICE_REGION_MAGIC;
    r.version = GPUSLICE_REGION_VERSION;
    r.size = sizeof(r);
    r.max_devices = GPUSLICE_MAX_DEVICES;
    r.max_procs = GPUSLICE_MAX_PROCS;
    r.device_count = 2;
    strcpy(r.pod_uid, "0b7f6c9e-1111-2222-3333-444455556666");
    strcpy(r.pod_name, "trainer-0");
    strcpy(r.pod_namespace, "ml");
    strcpy(r.container, "main");
    for (int d = 0; d < 2; d++) {
        snprintf(r.devices[d].uuid, sizeof(r.devices[d].uuid), "GPU-%08d-aaaa-bbbb-cccc-dddddddddddd", d);
        r.devices[d].limit_bytes = (10ull << 30) + (uint64_t)d;
        r.devices[d].used_bytes = (3ull << 30) + (uint64_t)d;
        r.devices[d].total_bytes = 80ull << 30;
        r.devices[d].busy_ns = 123456789ull * (uint64_t)(d + 1);
        r.devices[d].sm_limit = 30 + (uint32_t)d;
        r.devices[d].index = (uint32_t)(d + 2);
        r.devices[d].sm_scale_milli = 1000 + 100 * (uint32_t)d;
        r.devices[d].idle_power_mw = 90000;
    }
    r.procs[5].pid = 4242;
    r.procs[5].state = GPUSLICE_PROC_LIVE;
    r.procs[5].used_bytes[0] = 1ull << 30;
    r.procs[5].used_bytes[1] = 2ull << 30;
    r.procs[5].host_pid = 3000000;
    r.procs[5].pidns = 4026532000ull;
    r.procs[5].start_time = 123456;
    r.procs[5].token = 4242;
    r.procs[5].measured_ns[0] = 5000000000ull;
    r.procs[5].measured_ns[1] = 7;
    r.procs[9].pid = 77; /* free slot with a stale pid: not a process */
    r.procs[9].state = GPUSLICE_PROC_FREE;
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(&r, sizeof(r), 1, f) != 1) return 1;
    return fclose(f) != 0;
}

static int read_region(const char *path)
{
    static R r;
    FILE *f = fopen(path, "rb");
    if (!f || fread(&r, sizeof(r), 1, f) != 1) return 1;
    fclose(f);
    printf("magic %d version %u size %u count %u\n", r.magic == GPUSLICE_REGION_MAGIC, r.version, r.size,
           r.device_count);
    printf("identity %s|%s|%s|%s\n", r.pod_uid, r.pod_name, r.pod_namespace, r.container);
    for (unsigned d = 0; d < r.device_count && d < GPUSLICE_MAX_DEVICES; d++)
        printf("device %s %" PRIu64 " %" PRIu64 " %u %" PRIu64 " %u %u\n", r.devices[d].uuid,
               r.devices[d].limit_bytes, r.devices[d].used_bytes, r.devices[d].sm_limit, r.devices[d].busy_ns,
               r.devices[d].index, r.devices[d].sm_scale_milli);
    for (int i = 0; i < GPUSLICE_MAX_PROCS; i++)
        if (r.procs[i].state == GPUSLICE_PROC_LIVE)
            printf("proc %d %" PRIu64 " %" PRIu64 " %u %" PRIu64 " %" PRIu64 "\n", r.procs[i].pid,
                   r.procs[i].used_bytes[0], r.procs[i].used_bytes[1], r.procs[i].host_pid,
                   r.procs[i].measured_ns[0], r.procs[i].measured_ns[1]);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "layout")) {
        layout();
        return 0;
    }
    if (argc >= 3 && !strcmp(argv[1], "write")) return write_region(argv[2]);
    if (argc >= 3 && !strcmp(argv[1], "read")) return read_region(argv[2]);
    fprintf(stderr, "usage: region_layout layout | write PATH | read PATH\n");
    return 2;
}
