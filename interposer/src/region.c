/*
 * region.c - the container's shared region and its memory budget: the region's lock, this
 * process's slot in it, its devices and the budget.  (Opening the file, or a private region
 * when it cannot be used: regionopen.c.  Whether a process lives, and the reclaim of dead
 * ones: liveness.c.)
 *
 * The region file (gpuslice_region.h) is mapped MAP_SHARED by every CUDA
 * process of the container.  Usage changes only under its robust,
 * process-shared mutex, which keeps device.used_bytes == sum of the live
 * processes' used_bytes.  A process killed while holding the mutex leaves it
 * EOWNERDEAD: the next locker reclaims dead processes and recomputes every
 * sum from the process entries, so no state can stay half-updated.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "region_internal.h"

#define LD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

struct gpuslice_region *gs_region;
struct gpuslice_proc *gs_region_me;
/* the pid gs_region_me was registered with: written under the region's lock, read without it too
 * (me_unlocked, the sampler's; the exit detach), atomically */
static int32_t g_my_pid;
/* The pid of the process whose exit began (the destructor below), 0 before.  A pid, not a
 * flag: a vfork() child that calls exit() runs the destructor in its parent's memory, and a flag
 * set there was its parent's for the rest of its life (every allocation of a program that did so
 * before its first CUDA call was refused: it could not register; one that did so later lost its
 * sampler) */
static int32_t g_exiting_pid;

int gs_exiting(void)
{
    int32_t pid = __atomic_load_n(&g_exiting_pid, __ATOMIC_ACQUIRE);
    return pid && pid == (int32_t)getpid(); /* (no system call before the exit) */
}
static uint64_t g_charge_seq;
uint64_t gs_own_cap[GPUSLICE_MAX_DEVICES];
int gs_unsettled;
int gs_inflight;
__thread unsigned gs_t_inflight;
int gs_managed_seen;

uint64_t gs_charge_seq(void)
{
    return __atomic_load_n(&g_charge_seq, __ATOMIC_ACQUIRE);
}

/* ---- locking and reclaim -------------------------------------------------- */

/* After a holder died: drop the dead, then recompute each sum from the entries. */
static void repair_locked(void)
{
    struct gpuslice_region *r = gs_region;
    gs_region_reclaim_dead_locked(-1);
    for (unsigned d = 0; d < GPUSLICE_MAX_DEVICES; d++) {
        uint64_t sum = 0;
        for (unsigned i = 0; i < GPUSLICE_MAX_PROCS; i++)
            if (LD(&r->procs[i].state) == GPUSLICE_PROC_LIVE) sum = gs_add_sat(sum, LD(&r->procs[i].used_bytes[d]));
        ST(&r->devices[d].used_bytes, sum);
    }
}

/* The region whose lock this thread holds, or NULL.  Unlocked is the region that was locked
 * (another thread may swap gs_region for a private one meanwhile: gs_region_go_private).  While it is
 * held, log lines wait in a buffer until the unlock (a write to a full stderr pipe would hold
 * every process of the container), and the exit destructor does not wait for it (exit() from a
 * signal handler that interrupted this thread inside the lock would wait on itself, and every
 * other process of the container with it; the lock's robustness hands the region over when
 * the process is gone). */
static __thread struct gpuslice_region *volatile t_locked; /* volatile: a signal handler reads it */

int gs_region_lock(void)
{
    struct gpuslice_region *r = gs_region;
    pthread_mutex_t *m = &r->lock.mutex;
    /* set before the lock is taken and cleared after it is given back: a signal inside
     * pthread_mutex_lock may come when the lock is already this thread's */
    t_locked = r;
    gs_log_defer(1);
    for (int attempt = 0; attempt < 2; attempt++) {
        int rc = pthread_mutex_lock(m);
        if (rc == 0) return 0;
        if (rc == EOWNERDEAD) {
            GS_WARN("a process died holding the region lock: repairing the region");
            repair_locked();
            pthread_mutex_consistent(m);
            return 0;
        }
        if (rc != ENOTRECOVERABLE && rc != EINVAL) {
            GS_ERROR("cannot lock the region: %s", strerror(rc));
            break;
        }
        /* EINVAL: the lock's bytes are damaged (the file was written over) */
        GS_ERROR("region lock %s: reinitialising it", rc == EINVAL ? "damaged" : "not recoverable");
        gs_region_init_mutex(m);
    }
    t_locked = NULL;
    gs_log_defer(0);
    return -1;
}

void gs_region_unlock(void)
{
    if (t_locked) pthread_mutex_unlock(&t_locked->lock.mutex);
    t_locked = NULL;
    gs_log_defer(0); /* and writes what waited */
}

/* gs_region_me, unless another process reclaimed our slot meanwhile (it took us for
 * dead: a pid namespace it cannot see into) and it may be someone else's now;
 * then we have no slot, and register again at the next charge. */
static struct gpuslice_proc *me_locked(void)
{
    if (gs_region_me && (LD(&gs_region_me->state) != GPUSLICE_PROC_LIVE || LD(&gs_region_me->pid) != g_my_pid)) {
        GS_WARN("this process's usage was reclaimed by another process: registering again");
        __atomic_store_n(&gs_region_me, NULL, __ATOMIC_RELEASE);
    }
    return gs_region_me;
}

static int register_locked(void)
{
    struct gpuslice_region *r = gs_region;
    /* After the exit detach a charge would leave a live-looking slot behind
     * (another thread still running, the sampler): refuse it. */
    if (gs_exiting()) return -1;
    for (int pass = 0; pass < 2 && !gs_region_me; pass++) {
        /* pass 0 too when a slot of our pid is live: this program replaced it by exec, and
         * the old image's memory went with its address space */
        int mine = 0;
        for (unsigned i = 0; i < GPUSLICE_MAX_PROCS && !pass && !mine; i++)
            mine = LD(&r->procs[i].state) == GPUSLICE_PROC_LIVE && LD(&r->procs[i].pid) == (int32_t)getpid();
        if (pass || mine) gs_region_reclaim_dead_locked(-1);
        for (unsigned i = 0; i < GPUSLICE_MAX_PROCS; i++) {
            struct gpuslice_proc *p = &r->procs[i];
            if (LD(&p->state) != GPUSLICE_PROC_FREE) continue;
            memset(p->used_bytes, 0, sizeof(p->used_bytes));
            /* the GPU time measured so far: a process registering again (its slot was
             * reclaimed) must not show its whole life as the others' next difference */
            for (unsigned d = 0; d < GPUSLICE_MAX_DEVICES; d++)
                ST(&p->measured_ns[d], __atomic_load_n(&gs_slice_measured_ns[d], __ATOMIC_RELAXED));
            ST(&p->host_pid, 0);
            /* atomic stores: the sweep reads a slot's identity without the lock (and locked,
             * reclaims it only if it is still the identity it found dead) */
            ST(&p->pid, (int32_t)getpid());
            ST(&p->pidns, gs_pidns_inode());
            ST(&p->start_time, gs_proc_start_time(getpid()));
            /* the token before the slot is live: a sweep reading it without the lock must
             * not find it noted and not yet held */
            ST(&p->token, gs_token_take(i) ? (uint32_t)getpid() : 0u);
            /* a release store: a reader without the lock (the sweep below, the node agent) that
             * sees the slot live sees the fields above, on weakly ordered CPUs (aarch64) too */
            __atomic_store_n(&p->state, GPUSLICE_PROC_LIVE, __ATOMIC_RELEASE);
            ST(&g_my_pid, p->pid);
            __atomic_store_n(&gs_region_me, p, __ATOMIC_RELEASE);
            break;
        }
    }
    if (!gs_region_me) GS_ERROR("region has no free process slot (%d in use)", GPUSLICE_MAX_PROCS);
    return gs_region_me ? 0 : -1;
}

/* ---- devices -------------------------------------------------------------- */

int gs_region_slot_by_uuid(const char *uuid)
{
    struct gpuslice_region *r = __atomic_load_n(&gs_region, __ATOMIC_ACQUIRE);
    if (!r || !uuid || !uuid[0]) return -1;
    unsigned n = gs_region_devices(r);
    for (unsigned d = 0; d < n; d++)
        if (strncmp(r->devices[d].uuid, uuid, GPUSLICE_UUID_LEN) == 0) return (int)d;
    return -1;
}

static void write_slot(struct gpuslice_device *s, const struct gs_devcfg *c)
{
    if (strncmp(s->uuid, c->uuid, GPUSLICE_UUID_LEN) != 0) {
        memset(s, 0, sizeof(*s));
        memcpy(s->uuid, c->uuid, GPUSLICE_UUID_LEN);
    }
    ST(&s->limit_bytes, gs_region_private_managed ? GS_CAP_NOTHING : c->limit);
    ST(&s->total_bytes, c->total);
    ST(&s->sm_limit, c->sm_limit);
    ST(&s->index, c->index);
    ST(&s->used_bytes, 0);
    /* the compute clock stays (a new UUID started from zero above): debt that the last
     * processes left is the device's, paid by the next ones; zeroed, three processes in turn
     * each ending with a 1 s kernel at 20 % ran back to back, at 100 % */
}

/* -1: the region's lock cannot be taken, or its device table (full of other devices) cannot
 * take one of this process's devices; the process is not registered then */
static int sync_locked(const struct gs_devcfg *devs, unsigned n, int do_register)
{
    if (gs_region_lock() != 0) return -1;
    struct gpuslice_region *r = gs_region;
    int idle = !gs_region_attached_locked();
    if (n > GPUSLICE_MAX_DEVICES) n = GPUSLICE_MAX_DEVICES;
    if (idle) {
        /* Nobody else is attached: this process's environment defines the container. */
        gs_copy_env(r->pod_uid, sizeof(r->pod_uid), "GPUSLICE_POD_UID");
        gs_copy_env(r->pod_name, sizeof(r->pod_name), "GPUSLICE_POD_NAME");
        gs_copy_env(r->pod_namespace, sizeof(r->pod_namespace), "GPUSLICE_POD_NAMESPACE");
        gs_copy_env(r->container, sizeof(r->container), "GPUSLICE_CONTAINER");
        for (unsigned i = 0; i < n; i++) {
            /* keep a slot's measured figures when its device stays in place */
            unsigned j = i;
            for (unsigned k = 0; k < GPUSLICE_MAX_DEVICES; k++)
                if (strncmp(r->devices[k].uuid, devs[i].uuid, GPUSLICE_UUID_LEN) == 0) j = k;
            if (j != i) {
                struct gpuslice_device tmp = r->devices[i];
                r->devices[i] = r->devices[j];
                r->devices[j] = tmp;
            }
            write_slot(&r->devices[i], &devs[i]);
        }
        for (unsigned i = n; i < GPUSLICE_MAX_DEVICES; i++) memset(&r->devices[i], 0, sizeof(r->devices[i]));
        ST(&r->device_count, n);
    } else {
        /* Others are attached: the region's limits stand; add devices it lacks. */
        for (unsigned i = 0; i < n; i++) {
            unsigned count = gs_region_devices(r);
            if (gs_region_slot_by_uuid(devs[i].uuid) >= 0 || count >= GPUSLICE_MAX_DEVICES) continue;
            memset(&r->devices[count], 0, sizeof(r->devices[count]));
            write_slot(&r->devices[count], &devs[i]);
            ST(&r->device_count, count + 1);
        }
    }
    for (unsigned i = 0; i < n; i++) {
        int slot = gs_region_slot_by_uuid(devs[i].uuid);
        if (slot < 0) { /* its allocations would pass uncharged */
            gs_region_unlock();
            GS_ERROR("region has no room for device %s: its %u device slots hold other devices", devs[i].uuid,
                     GPUSLICE_MAX_DEVICES);
            return -1;
        }
        if (gs_limits_from_file()) /* every process read the same file: its cap holds whatever the region says */
            __atomic_store_n(&gs_own_cap[slot], devs[i].limit, __ATOMIC_RELAXED);
    }
    if (do_register && !me_locked()) register_locked();
    gs_region_unlock();
    /* the dead beyond the first live one: one process of the container every 2 s */
    if (!idle && gs_region_claim_sweep()) gs_region_sweep_dead();
    return 0;
}

void gs_region_sync(const struct gs_devcfg *devs, unsigned n, int do_register)
{
    if (gs_region_open() != 0 || sync_locked(devs, n, do_register) == 0) return;
    /* The file is damaged (every process of the container can write it): a device left without a
     * slot would be used without a cap */
    gs_region_go_private();
    if (sync_locked(devs, n, do_register) != 0) GS_ERROR("this process's own region cannot be used either");
}

/* ---- the budget ----------------------------------------------------------- */

static int valid_slot(int slot)
{
    return gs_region && slot >= 0 && (unsigned)slot < gs_region_devices(gs_region);
}

static void charge_locked(int slot, uint64_t bytes)
{
    struct gpuslice_device *d = &gs_region->devices[slot];
    ST(&d->used_bytes, gs_add_sat(LD(&d->used_bytes), bytes));
    ST(&gs_region_me->used_bytes[slot], gs_add_sat(LD(&gs_region_me->used_bytes[slot]), bytes));
    __atomic_add_fetch(&g_charge_seq, 1, __ATOMIC_ACQ_REL);
}

int gs_budget_reserve(int slot, uint64_t bytes)
{
    if (!bytes || !valid_slot(slot)) return 0;
    if (gs_region_lock() != 0) return -1;
    if (!me_locked() && register_locked() != 0) {
        gs_region_unlock();
        return -1;
    }
    struct gpuslice_device *d = &gs_region->devices[slot];
    uint64_t limit = gs_cap_of(slot, LD(&d->limit_bytes));
    if (bytes > UINT64_MAX - LD(&d->used_bytes)) { /* no device has it; the sum would wrap */
        gs_region_unlock();
        return -1;
    }
    for (int pass = 0; limit && pass < 2; pass++) {
        if (pass) gs_region_reclaim_dead_locked(slot);
        uint64_t used = LD(&d->used_bytes);
        if (used <= limit && bytes <= limit - used) break;
        if (pass) {
            gs_region_unlock();
            GS_DEBUG("reservation of %llu bytes refused: %llu of %llu used", (unsigned long long)bytes,
                     (unsigned long long)used, (unsigned long long)limit);
            return -1;
        }
    }
    charge_locked(slot, bytes);
    gs_region_unlock();
    return 0;
}

void gs_budget_force(int slot, uint64_t bytes)
{
    if (!bytes || !valid_slot(slot) || gs_region_lock() != 0) return;
    if (me_locked() || register_locked() == 0) charge_locked(slot, bytes);
    gs_region_unlock();
}

void gs_budget_release(int slot, uint64_t bytes)
{
    if (!bytes || !valid_slot(slot) || gs_region_lock() != 0) return;
    if (me_locked()) {
        struct gpuslice_device *d = &gs_region->devices[slot];
        uint64_t mine = LD(&gs_region_me->used_bytes[slot]), du = LD(&d->used_bytes);
        uint64_t x = bytes < mine ? bytes : mine;
        ST(&gs_region_me->used_bytes[slot], mine - x);
        ST(&d->used_bytes, du > x ? du - x : 0);
        __atomic_add_fetch(&g_charge_seq, 1, __ATOMIC_ACQ_REL);
    }
    gs_region_unlock();
}

uint64_t gs_slot_used(int slot)
{
    return valid_slot(slot) ? LD(&gs_region->devices[slot].used_bytes) : 0;
}

uint64_t gs_slot_mine(int slot)
{
    /* Lock-free reader (the sampler): gs_region_me may be cleared meanwhile by the
     * destructor at exit; the slot it pointed to stays mapped. */
    struct gpuslice_proc *me = __atomic_load_n(&gs_region_me, __ATOMIC_ACQUIRE);
    return valid_slot(slot) && me ? LD(&me->used_bytes[slot]) : 0;
}

/* Our own process slot for the lock-free notes below, or NULL: not registered, or the slot was
 * reclaimed (it may be someone else's now) */
static struct gpuslice_proc *me_unlocked(void)
{
    struct gpuslice_proc *me = __atomic_load_n(&gs_region_me, __ATOMIC_ACQUIRE);
    if (!me || LD(&me->state) != GPUSLICE_PROC_LIVE || LD(&me->pid) != LD(&g_my_pid)) return NULL;
    return me;
}

/* A slot reclaimed and given to another process between the check and the store gets our
 * figure once: its readers take a figure lower than before as a new start (slices.c), and its
 * owner's next note corrects it */
void gs_region_note_measured(int slot, uint64_t total_ns)
{
    struct gpuslice_proc *me = me_unlocked();
    if (me && valid_slot(slot)) ST(&me->measured_ns[slot], total_ns);
}

void gs_region_note_host_pid(unsigned pid)
{
    struct gpuslice_proc *me = me_unlocked();
    if (me && LD(&me->host_pid) != pid) ST(&me->host_pid, pid);
}

uint64_t gs_slot_limit(int slot)
{
    return valid_slot(slot) ? gs_cap_of(slot, LD(&gs_region->devices[slot].limit_bytes)) : 0;
}

/* The sampler's: every 2 s one process of the container sweeps, so that a killed process's
 * memory leaves the container's figures (the agent's metrics read them) while the others run
 * on, not only at the next attach, refusal or view. */
void gs_region_sweep(void)
{
    if (me_unlocked() && gs_region_claim_sweep()) gs_region_sweep_dead();
}

void gs_region_after_fork_child(void)
{
    gs_region_open_after_fork_child();
    gs_liveness_after_fork_child(); /* the tokens, the rate of reclaims */
    __atomic_store_n(&gs_region_me, NULL, __ATOMIC_RELEASE); /* the child registers as itself on its first charge */
}

__attribute__((destructor)) static void region_detach(void)
{
    __atomic_store_n(&g_exiting_pid, (int32_t)getpid(), __ATOMIC_RELEASE);
    /* exit() from a signal handler inside the lock (above); or a child made without the fork
     * handlers (_Fork, clone, vfork + exit): gs_region_me is still its parent's slot, which it must not
     * empty (the slot of a child that charged through it is reclaimed once the parent is gone) */
    if (t_locked || LD(&g_my_pid) != (int32_t)getpid()) return;
    gs_launch_at_exit(); /* work in flight is charged while the slot is still ours */
    /* another thread may be attaching right now (discovery): the pointers are read as they are
     * written, atomically */
    if (!__atomic_load_n(&gs_region, __ATOMIC_ACQUIRE) || !__atomic_load_n(&gs_region_me, __ATOMIC_ACQUIRE) ||
        gs_region_lock() != 0)
        return;
    if (!me_locked()) { /* our slot was reclaimed: it may be someone else's now */
        gs_region_unlock();
        return;
    }
    struct gpuslice_region *r = gs_region;
    unsigned n = gs_region_devices(r);
    for (unsigned d = 0; d < n; d++) {
        uint64_t u = LD(&gs_region_me->used_bytes[d]), du = LD(&r->devices[d].used_bytes);
        ST(&r->devices[d].used_bytes, du > u ? du - u : 0);
    }
    memset(gs_region_me->used_bytes, 0, sizeof(gs_region_me->used_bytes));
    memset(gs_region_me->measured_ns, 0, sizeof(gs_region_me->measured_ns));
    ST(&gs_region_me->host_pid, 0);
    ST(&gs_region_me->token, 0);
    ST(&gs_region_me->state, GPUSLICE_PROC_FREE);
    ST(&gs_region_me->pid, 0);
    __atomic_store_n(&gs_region_me, NULL, __ATOMIC_RELEASE);
    gs_token_give_back();
    gs_region_unlock();
}
