/*
 * ctx_internal.h - what the context files share: context.c (the context lock, the teardown
 * sequence, the queue of context calls from driver callbacks, created contexts), footprint.c
 * (a new context's footprint, measured and charged), primary.c (primary contexts, the array
 * fence against their resets) and green.c (green contexts).  Internal to those four files (the
 * library's other declarations, gs_ctx_lock and the rest: gpuslice.h).
 */
#ifndef GPUSLICE_CTX_INTERNAL_H
#define GPUSLICE_CTX_INTERNAL_H

#include "gpuslice.h"

/* ---- context.c ------------------------------------------------------------ */

extern __thread unsigned gs_t_ctx_depth; /* how many times this thread holds the context lock */
/* Around a context's teardown under the context lock: gs_ctx_teardown_seq is odd meanwhile */
void gs_ctx_teardown_begin(void);
void gs_ctx_teardown_end(void);
void gs_ctx_release(CUcontext ctx); /* ctx went (under the context lock): what it held is returned */
/* Context calls made from driver callbacks, passed straight through and booked later */
enum gs_ctx_op { GS_OP_RETAIN, GS_OP_CREATE, GS_OP_RELEASE, GS_OP_RESET, GS_OP_DESTROY, GS_OP_ATTACH, GS_OP_DETACH };
void gs_ctx_defer(enum gs_ctx_op op, CUcontext ctx, CUdevice dev);
/* Is this context call a driver callback's that passes straight through, to be booked later (in
 * order, with every other such call)?  Under another lock of ours (gs_t_held), or inside the
 * device discovery, where no device is known yet: a context created there was recorded with no
 * device and never charged (100 MiB held uncharged without NVML's per-process figures), and the
 * calls on it must wait in the same queue, after its creation. */
static inline int gs_ctx_passes_through(void)
{
    return gs_t_held || gs_devices_discovering();
}

/* ---- footprint.c ---------------------------------------------------------- */

struct gs_ctx_charge {
    int slot;
    uint64_t reserved;
    uint64_t before;
    uint64_t mine; /* what the process was charged on the device once the estimate was reserved */
    uint64_t rest; /* what the container's other processes were charged on it then */
    int busy;      /* allocations or frees were inside the driver when the measurement began */
    int over;      /* made, but its measured footprint does not fit the cap: to be undone */
    int first;     /* the process's first context on the device */
    int nprocs;
    nvmlProcessInfo_t procs[GS_MAX_PIDS];
};

CUresult gs_ctx_charge_begin(CUdevice dev, struct gs_ctx_charge *c, int estimate_first);
uint64_t gs_ctx_charge_end(CUdevice dev, struct gs_ctx_charge *c, CUresult rc); /* bytes it stays charged with */
void gs_ctx_record(CUcontext ctx, int slot, uint64_t bytes, CUdevice dev);

/* ---- primary.c ------------------------------------------------------------ */

void gs_ctx_adopt_locked(CUcontext ctx, CUdevice dev, int primary); /* made from a driver callback */
CUresult gs_primary_retain_locked(CUcontext *pctx, CUdevice dev);
void gs_primary_ref(CUdevice dev);                       /* one more reference to dev's primary context */
void gs_primary_settle_if_last(CUdevice dev, int *last); /* before a release that may be the last */
void gs_primary_released(CUdevice dev, int settled);     /* a reference went */
void gs_primary_reset_done_locked(CUdevice dev);
int gs_primary_dev_of(CUcontext ctx); /* the device whose primary context ctx is, -1 if none */
void gs_primary_after_fork_child(void);

#endif /* GPUSLICE_CTX_INTERNAL_H */
