/*
 * region_internal.h - what the region's files share: region.c (the region's lock, this
 * process's slot, devices, the budget), regionopen.c (opening the file, the private fallback)
 * and liveness.c (whether a process lives, reclaiming the dead).  Internal to those three
 * files (the library's other declarations, gs_region and the budget: gpuslice.h).
 */
#ifndef GPUSLICE_REGION_INTERNAL_H
#define GPUSLICE_REGION_INTERNAL_H

#include <pthread.h>
#include <sys/types.h>

#include "gpuslice.h"

/* ---- region.c ------------------------------------------------------------- */

/* This process's slot in the region, NULL until it registers (at its first charge) or after its
 * slot was found reclaimed; read without the lock (atomically) by the sampler and the sweep */
extern struct gpuslice_proc *gs_region_me;
int gs_region_lock(void);   /* 0 = taken (a dead holder's region repaired first), -1 = cannot be */
void gs_region_unlock(void);

/* ---- regionopen.c --------------------------------------------------------- */

extern dev_t gs_region_file_dev; /* the region file mapped (0, 0: a private region) */
extern ino_t gs_region_file_ino;
extern const void *gs_region_file_addr; /* where it is mapped (liveness.c finds it in /proc/self/maps) */
/* A webhook-managed process without the container's region grants no memory (region.c's
 * write_slot) */
extern int gs_region_private_managed;
void gs_region_init_mutex(pthread_mutex_t *m); /* robust, process-shared */
void gs_region_go_private(void);               /* a region of this process's own from now on */
void gs_region_open_after_fork_child(void);

/* ---- liveness.c ----------------------------------------------------------- */

uint64_t gs_pidns_inode(void);          /* this process's pid namespace, 0 if unknown */
uint64_t gs_proc_start_time(pid_t pid); /* in clock ticks since boot, 0 if unknown */
extern int gs_token_off;                /* no more tokens: this process went to a private region */
int gs_token_take(unsigned index);      /* slot `index`'s token (one held for another given back); 1 if taken */
void gs_token_give_back(void);
void gs_region_reclaim_dead_locked(int slot); /* every dead process, or those holding memory of `slot` */
int gs_region_attached_locked(void);          /* a live process is attached (the dead before it reclaimed) */
int gs_region_claim_sweep(void);              /* 1: this process sweeps the container now */
void gs_region_sweep_dead(void);              /* the dead, their /proc entries read without the lock */
void gs_liveness_after_fork_child(void);

#endif /* GPUSLICE_REGION_INTERNAL_H */
