/*
 * fakestate.h - configuration and "physical" state shared by the fake
 * libcuda.so.1 and libnvidia-ml.so.1 (test doubles, never shipped).
 *
 * Environment:
 *   FAKE_CUDA_DEVICES   "UUID=SIZE,UUID=SIZE" (SIZE with k/m/g), the machine's
 *                       GPUs in NVML order; default one 16g device.
 *   FAKE_CUDA_STATE     path of a file holding each process's physical usage,
 *                       so usage is seen across processes like on a real GPU
 *                       (the fake NVML sums the live ones).  Optional.
 *   FAKE_CUDA_CTX_BYTES memory a context takes (default 0).
 *   FAKE_NVML_BASE_USED memory NVML reports used with no process (default 0).
 * See fakecuda.c for the driver's own knobs.
 */
#ifndef GPUSLICE_FAKESTATE_H
#define GPUSLICE_FAKESTATE_H

#define _GNU_SOURCE
#include <ctype.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FAKE_MAX_DEVS 20 /* past the library's 16 slots (test_views.py -k more_gpus_than) */
#define FAKE_MAX_PROCS 256

struct fake_dev {
    char uuid[64];
    uint64_t total;
};

static uint64_t fake_size(const char *s)
{
    char *end = NULL;
    uint64_t v = strtoull(s, &end, 10);
    switch (end ? tolower((unsigned char)*end) : 0) {
    case 'k': return v << 10;
    case 'm': return v << 20;
    case 'g': return v << 30;
    default: return v;
    }
}

static int fake_devices(struct fake_dev *out)
{
    const char *spec = getenv("FAKE_CUDA_DEVICES");
    if (!spec || !*spec) spec = "GPU-00000000-1111-2222-3333-444444444444=16g";
    int n = 0;
    while (*spec && n < FAKE_MAX_DEVS) {
        const char *eq = strchr(spec, '=');
        const char *comma = strchr(spec, ',');
        if (!eq || (comma && comma < eq)) break;
        size_t len = (size_t)(eq - spec);
        if (len >= sizeof(out[n].uuid)) len = sizeof(out[n].uuid) - 1;
        memcpy(out[n].uuid, spec, len);
        out[n].uuid[len] = '\0';
        out[n].total = fake_size(eq + 1);
        n++;
        if (!comma) break;
        spec = comma + 1;
    }
    return n;
}

struct fake_phys {
    struct {
        int32_t pid;
        int32_t pad;
        uint64_t used[FAKE_MAX_DEVS];
        uint64_t kernel_ns; /* kernel time queued so far (FAKE_GPU_SHARED) */
    } procs[FAKE_MAX_PROCS];
    uint64_t gpu_tail; /* FAKE_GPU_SHARED: when the last queued kernel of any process ends */
    struct {
        uint32_t seq;       /* the process's latest collective (fakelaunch.h), 0 = none */
        uint32_t pad;
        uint64_t start[8];  /* per collective number mod 8: when its kernel starts on the GPU */
    } coll[FAKE_MAX_PROCS];
};

/* FAKE_GPU_SHARED=1 (with FAKE_CUDA_STATE): the processes sharing the state file share one
 * GPU that runs one kernel at a time, in the order they were queued. */
static int fake_gpu_shared(void)
{
    const char *v = getenv("FAKE_GPU_SHARED");
    return v && *v == '1';
}

static struct fake_phys *fake_phys_map(void)
{
    static struct fake_phys *map;
    static int tried;
    if (tried) return map;
    tried = 1;
    const char *path = getenv("FAKE_CUDA_STATE");
    if (!path || !*path) return NULL;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) return NULL;
    if (ftruncate(fd, sizeof(struct fake_phys)) == 0) {
        void *p = mmap(NULL, sizeof(struct fake_phys), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) map = p;
    }
    close(fd);
    return map;
}

/* Physical usage of a device summed over live processes. */
static uint64_t fake_phys_used(int dev)
{
    struct fake_phys *m = fake_phys_map();
    uint64_t sum = 0;
    if (!m) return 0;
    for (int i = 0; i < FAKE_MAX_PROCS; i++) {
        int32_t pid = __atomic_load_n(&m->procs[i].pid, __ATOMIC_ACQUIRE);
        if (pid > 0 && (kill(pid, 0) == 0 || pid == getpid()))
            sum += __atomic_load_n(&m->procs[i].used[dev], __ATOMIC_RELAXED);
    }
    return sum;
}

#endif
