/*
 * gpuslice_region.h - the layout of a container's shared region file.
 *
 * One region per container, at $CUDA_DEVICE_MEMORY_SHARED_CACHE
 * (/var/run/gpuslice/region in a pod; the agent reads it on the host at
 * /var/lib/gpuslice/containers/<pod-uid>/<container>/region).  Every process
 * of the container that uses CUDA maps it MAP_SHARED and charges its device
 * memory to it, so all of them share one budget per device.
 *
 * This header is the single definition of the layout.  The Python mirror is
 * webhook/node/region.py; tests/interposer/test_region_layout.py checks that
 * the two agree field by field (offsets and sizes printed by a C program).
 *
 * Rules:
 *  - Fixed-width types only, little-endian (the host's byte order; x86_64 and
 *    aarch64 are both little-endian), every field naturally aligned, no
 *    implicit padding (static asserts below).
 *  - Writers change device and process usage only while holding `lock`, a
 *    robust, process-shared pthread mutex: a process killed while holding it
 *    leaves it EOWNERDEAD, and the next locker recomputes every device's
 *    used_bytes from the process entries.  Readers that do not take the lock
 *    (the agent) may see a value that is being changed, never a torn 64-bit
 *    field.
 *  - `magic` is written last when a region is initialised; a reader that sees
 *    the magic sees an initialised region.  Initialisation happens under an
 *    flock(2) of the file, so two processes starting at once agree.
 *  - A region written during an earlier boot (boot_id differs) is reset on
 *    open: its processes are gone, and its mutex may still look held.
 *  - Every version keeps magic, version, size and max_procs where they are, the
 *    process table at offset 2624 (its slot size: (size - 2624) / max_procs) and
 *    pid, state, pidns first in each slot: a library of another version reads
 *    them to tell a region of an earlier run of the container (replaced) from
 *    one a process of this run uses (regionopen.c).
 */
#ifndef GPUSLICE_REGION_H
#define GPUSLICE_REGION_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define GPUSLICE_REGION_MAGIC 0x4543494c53555047ULL /* "GPUSLICE" read as a little-endian u64 */
#define GPUSLICE_REGION_VERSION 2u /* 2: host_pid and measured_ns per process */

#define GPUSLICE_MAX_DEVICES 16
#define GPUSLICE_MAX_PROCS 1024
#define GPUSLICE_UUID_LEN 64   /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" + NUL fits */
#define GPUSLICE_POD_NAME_LEN 256
#define GPUSLICE_ID_LEN 64     /* pod uid, namespace, container name */
#define GPUSLICE_LOCK_BYTES 64 /* room for pthread_mutex_t on every 64-bit glibc target */
#define GPUSLICE_TOKEN_BASE (1ull << 30) /* liveness tokens: lock bytes far past the region's end */

/* gpuslice_proc.state */
#define GPUSLICE_PROC_FREE 0u
#define GPUSLICE_PROC_LIVE 1u

/* One physical GPU of the container, keyed by UUID. */
struct gpuslice_device {
    char uuid[GPUSLICE_UUID_LEN];  /* NVML form, "GPU-..."; empty = unused slot */
    uint64_t limit_bytes;          /* the cap; 0 = no cap (the device's total) */
    uint64_t used_bytes;           /* sum of every live process's used_bytes[slot] */
    uint64_t total_bytes;          /* the device's real total memory */
    uint64_t busy_ns;              /* GPU time the throttle measured for the container, other processes' slices removed (0 = not measured) */
    uint64_t throttle_vt_ns;       /* throttle's virtual time (CLOCK_MONOTONIC ns): launches wait until now >= vt */
    uint64_t ctx_footprint_bytes;  /* last measured footprint of one CUDA context on this device */
    uint32_t sm_limit;             /* % of GPU time, 1..99; 0 = no compute limit */
    uint32_t index;                /* the device's index inside the container (NVML order) */
    uint32_t sm_scale_milli;       /* compute charge per ns of GPU time, in 1/1000 (clock compensation); 0 = 1000 */
    uint32_t idle_power_mw;        /* lowest power seen with the GPU idle (0 = not seen yet) */
};

/* One process of the container that uses CUDA. */
struct gpuslice_proc {
    int32_t pid;                   /* in the container's pid namespace */
    uint32_t state;                /* GPUSLICE_PROC_FREE or GPUSLICE_PROC_LIVE */
    uint64_t pidns;                /* inode of /proc/self/ns/pid: another namespace = a dead container incarnation */
    uint64_t start_time;           /* field 22 of /proc/<pid>/stat: detects pid reuse */
    uint64_t used_bytes[GPUSLICE_MAX_DEVICES]; /* per device slot */
    uint32_t host_pid;             /* its pid in NVML's process lists (the host's); 0 = not known */
    uint32_t token;                /* = pid: it holds an open-file-description lock on byte
                                      GPUSLICE_TOKEN_BASE + its slot index of the region file, through
                                      a descriptor that exec closes: no such lock = its image is gone;
                                      0 = no token (liveness by pid and start time alone) */
    uint64_t measured_ns[GPUSLICE_MAX_DEVICES]; /* GPU time its launches' events measured per device slot,
                                                   other processes' slices included (written by it alone) */
};

struct gpuslice_region {
    uint64_t magic;                /* GPUSLICE_REGION_MAGIC, written last */
    uint32_t version;              /* GPUSLICE_REGION_VERSION */
    uint32_t size;                 /* sizeof(struct gpuslice_region) */
    uint32_t max_devices;          /* GPUSLICE_MAX_DEVICES */
    uint32_t max_procs;            /* GPUSLICE_MAX_PROCS */
    uint32_t device_count;         /* slots in use: devices[0 .. device_count) */
    uint32_t flags;                /* reserved, 0 */
    uint8_t boot_id[16];           /* kernel boot id at initialisation: a region from an earlier boot is reset */
    uint64_t reclaimed_ns;         /* CLOCK_MONOTONIC ns of the last sweep for dead processes, by any process */
    uint64_t reserved0;
    union {
        pthread_mutex_t mutex;     /* robust, process-shared */
        uint8_t bytes[GPUSLICE_LOCK_BYTES];
    } lock;
    char pod_uid[GPUSLICE_ID_LEN];
    char pod_name[GPUSLICE_POD_NAME_LEN];
    char pod_namespace[GPUSLICE_ID_LEN];
    char container[GPUSLICE_ID_LEN];
    struct gpuslice_device devices[GPUSLICE_MAX_DEVICES];
    struct gpuslice_proc procs[GPUSLICE_MAX_PROCS];
};

_Static_assert(sizeof(pthread_mutex_t) <= GPUSLICE_LOCK_BYTES, "mutex does not fit the lock area");
_Static_assert(sizeof(struct gpuslice_device) == 128, "device slot size");
_Static_assert(sizeof(struct gpuslice_proc) == 288, "process slot size");
_Static_assert(offsetof(struct gpuslice_region, lock) == 64, "lock offset");
_Static_assert(offsetof(struct gpuslice_region, pod_uid) == 128, "identity offset");
_Static_assert(offsetof(struct gpuslice_region, devices) == 576, "devices offset");
_Static_assert(offsetof(struct gpuslice_region, procs) == 2624, "procs offset");
_Static_assert(sizeof(struct gpuslice_region) == 2624 + 288 * GPUSLICE_MAX_PROCS, "region size");

#endif /* GPUSLICE_REGION_H */
