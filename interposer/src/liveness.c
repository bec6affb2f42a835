/*
 * liveness.c - whether the processes of the container's region (region.c) live, and the
 * reclaim of the dead: their identity (pid, pid namespace, start time), the liveness tokens
 * that tell an exec'd image from the process that registered, and the sweeps.
 *
 * Dead processes (pid gone, pid reused, a zombie, or another pid namespace =
 * an earlier incarnation of the container) are reclaimed when a process
 * attaches (those before the first live one), when a reservation would
 * exceed the cap (those holding memory of its device), when a memory view is
 * asked for (rate-limited per process), and by a sweep at most every 2 s per
 * container (at an attach, or by the sampler thread).  The view's and the
 * sweep's /proc reads are made without the mutex.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "region_internal.h"

#define LD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

static uint64_t g_last_reclaim_ns;
#define GS_SWEEP_NS 2000000000ull /* at most one sweep for dead processes per container this often */

/* ---- process identity ----------------------------------------------------- */

uint64_t gs_pidns_inode(void)
{
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), 0 if
 * unknown; *state gets field 3 ('Z' for a zombie), or 0; *threads (if not
 * NULL) field 20, the number of threads, or 0.  The command name (field 2) is
 * skipped to its last ')': it may hold spaces and parentheses. */
static uint64_t proc_stat(pid_t pid, char *state, int *threads)
{
    char path[64], buf[1024];
    *state = 0;
    if (threads) *threads = 0;
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    if (p[1] == ' ' && p[2]) *state = p[2];
    for (int field = 2; field < 22 && p; field++) {
        p = strchr(p + 1, ' ');
        if (field == 19 && p && threads) *threads = atoi(p + 1);
    }
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

uint64_t gs_proc_start_time(pid_t pid)
{
    char state;
    return proc_stat(pid, &state, NULL);
}

/* ---- liveness tokens ------------------------------------------------------ */

/* A process that execs a program keeps its pid and start time, so by those its slot lives on
 * while the old image's memory is gone; the new image recognises the slot as its old one only
 * if it uses CUDA.  So a registering process also takes an open-file-description lock on a byte
 * of the region file (GPUSLICE_TOKEN_BASE + its slot index) through a descriptor that exec
 * closes, and notes its pid in the slot's token: the byte unlocked while the pid lives means
 * its image is gone.  A fork child closes its copy (the lock stays its parent's); a child made
 * without the fork handlers shares the parent's descriptor, where a query cannot tell the
 * parent's lock from its own, so it never takes a token for gone. */
static int g_token_fd = -1;
static int32_t g_token_pid; /* the process that opened g_token_fd */
static int64_t g_token_byte = -1;
int gs_token_off; /* no more tokens: this process went to a private region */
static pthread_mutex_t g_token_mu = PTHREAD_MUTEX_INITIALIZER;

/* The region file through a descriptor of this process's own, or -1 (a private region, or the
 * path no longer names the mapped file). */
static int token_fd(void)
{
    pthread_mutex_lock(&g_token_mu);
    if (g_token_fd < 0 && gs_region_file_ino) {
        char path[4096];
        int fd = open(gs_env_region_path(path, sizeof(path)), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        struct stat st;
        if (fd >= 0 && (fstat(fd, &st) != 0 || st.st_dev != gs_region_file_dev || st.st_ino != gs_region_file_ino)) {
            close(fd);
            fd = -1;
        }
        g_token_fd = fd;
        g_token_pid = (int32_t)getpid();
    }
    int fd = g_token_pid == (int32_t)getpid() ? g_token_fd : -1;
    pthread_mutex_unlock(&g_token_mu);
    return fd;
}

static int token_lock(int fd, int64_t byte, short type, int cmd)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = (off_t)(GPUSLICE_TOKEN_BASE + (uint64_t)byte),
                       .l_len = 1};
    if (fcntl(fd, cmd, &fl) != 0) return -1;
    return cmd == F_OFD_GETLK ? fl.l_type != F_UNLCK : 0;
}

/* Whether the file system keeps flock(2) and open-file-description locks apart, as local ones
 * do.  NFS emulates flock with a whole-file byte-range lock, which a token would block: every
 * process's map_file (regionopen.c) would wait on it for the holder's life. */
static int tokens_allowed(int fd)
{
    struct statfs fs;
    if (fstatfs(fd, &fs) != 0) return 0;
    switch ((unsigned long)fs.f_type) {
    case 0xEF53:     /* ext2/3/4 */
    case 0x58465342: /* xfs */
    case 0x9123683E: /* btrfs */
    case 0x01021994: /* tmpfs */
    case 0x794C7630: /* overlayfs */
    case 0x2FC12FC1: /* zfs */
    case 0xF2F52010: /* f2fs */
        return 1;
    default:
        return 0;
    }
}

/* Take slot `index`'s token (giving back one held for another slot); 1 if taken. */
int gs_token_take(unsigned index)
{
    if (gs_token_off) return 0; /* (and the shared slot's byte stays held: that slot is live) */
    int fd = token_fd();
    if (fd < 0 || !tokens_allowed(fd)) return 0;
    if (g_token_byte >= 0 && g_token_byte != (int64_t)index) token_lock(fd, g_token_byte, F_UNLCK, F_OFD_SETLK);
    g_token_byte = -1;
    if (token_lock(fd, index, F_WRLCK, F_OFD_SETLK) != 0) return 0; /* a lock left by a child of a dead holder */
    g_token_byte = index;
    return 1;
}

void gs_token_give_back(void)
{
    int fd = token_fd();
    if (fd >= 0 && g_token_byte >= 0) token_lock(fd, g_token_byte, F_UNLCK, F_OFD_SETLK);
    g_token_byte = -1;
}

/* 0 only when slot `index`'s token is surely not held */
static int token_held(unsigned index)
{
    int fd = token_fd();
    return fd < 0 || token_lock(fd, index, F_WRLCK, F_OFD_GETLK) != 0;
}

/* The first line of /proc/self/maps that starts with `prefix`, at most `len` - 1 bytes of it;
 * 0 if there is none */
static int self_maps_line(const char *prefix, char *out, size_t len)
{
    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    char buf[4096];
    size_t have = 0, plen = strlen(prefix);
    int found = 0, skip = 0; /* skip: the rest of a line longer than buf, its start already seen */
    while (!found) {
        ssize_t n = read(fd, buf + have, sizeof(buf) - have);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        have += (size_t)n;
        size_t start = 0;
        for (;;) {
            char *nl = memchr(buf + start, '\n', have - start);
            size_t end = nl ? (size_t)(nl - buf) : have;
            if (!nl && (start || have < sizeof(buf))) break; /* a line read in part: more to come */
            if (!skip && end - start >= plen && memcmp(buf + start, prefix, plen) == 0) {
                size_t l = end - start < len - 1 ? end - start : len - 1;
                memcpy(out, buf + start, l);
                out[l] = '\0';
                found = 1;
                break;
            }
            skip = !nl;
            start = nl ? end + 1 : have;
            if (!nl) break;
        }
        memmove(buf, buf + start, have - start);
        have -= start;
    }
    close(fd);
    return found;
}

/* How /proc/PID/maps names the region file, " MAJ:MIN INODE ": as it names this process's own
 * mapping of it, not as fstat does.  On btrfs st_dev is the subvolume's anonymous device and maps
 * gives the superblock's (00:29 and 00:28); so did overlayfs before Linux 6.7, maps naming the
 * file beneath.  A process that had closed its token's descriptor was never found mapping the
 * region there, and its usage was reclaimed while it held it (8 GiB held under a 6 GiB cap). */
static char g_maps_name[64];

static void region_maps_name(char *want, size_t len)
{
    pthread_mutex_lock(&g_token_mu);
    if (!g_maps_name[0] && gs_region_file_addr) {
        char prefix[32], line[256], dev[32];
        unsigned long long ino;
        snprintf(prefix, sizeof(prefix), "%08lx-", (unsigned long)(uintptr_t)gs_region_file_addr);
        /* "start-end perms offset MAJ:MIN inode  path" */
        if (self_maps_line(prefix, line, sizeof(line)) && sscanf(line, "%*s %*s %*s %31s %llu", dev, &ino) == 2 &&
            ino == (unsigned long long)gs_region_file_ino)
            snprintf(g_maps_name, sizeof(g_maps_name), " %s %llu ", dev, ino);
    }
    if (g_maps_name[0])
        snprintf(want, len, "%s", g_maps_name);
    else /* (not found: as fstat names it, major and minor in hex) */
        snprintf(want, len, " %02x:%02x %llu ", major(gs_region_file_dev), minor(gs_region_file_dev),
                 (unsigned long long)gs_region_file_ino);
    pthread_mutex_unlock(&g_token_mu);
}

/* Whether process `pid` still maps the region file: its token's descriptor may have been closed
 * by the program itself (closefrom, a dup2 onto its number), which leaves the mapping; an exec
 * takes both.  Read only when a token is found not held, which is rare.  1 also when it cannot
 * be told (the maps unreadable, say another user's process). */
static int maps_region(int32_t pid)
{
    char path[64], buf[8192], want[64];
    snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 1;
    region_maps_name(want, sizeof(want));
    size_t have = 0, tail = 96; /* kept from one read to the next: longer than `want` */
    int found = 0;
    for (;;) {
        ssize_t n = read(fd, buf + have, sizeof(buf) - 1 - have);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            found = 1;
            break;
        }
        have += (size_t)n;
        buf[have] = '\0';
        if (strstr(buf, want) || n == 0) {
            found = found || strstr(buf, want) != NULL;
            break;
        }
        if (have > tail) {
            memmove(buf, buf + have - tail, tail);
            have = tail;
        }
    }
    close(fd);
    return found;
}

/* Who a process slot says it holds: what decides whether that process lives. */
struct ident {
    int32_t pid;
    uint32_t token;
    uint64_t pidns, start_time;
    unsigned index;
};

static struct ident ident_of(const struct gpuslice_proc *p)
{
    return (struct ident){.pid = LD(&p->pid), .token = LD(&p->token), .pidns = LD(&p->pidns),
                          .start_time = LD(&p->start_time), .index = (unsigned)(p - gs_region->procs)};
}

/* `mine`: the slot is this process's own (gs_region_me) */
static int ident_alive(struct ident id, int mine, uint64_t my_ns)
{
    if (id.pidns != my_ns) return 0; /* an earlier incarnation of the container */
    if (id.pid <= 0) return 0;       /* no process's (kill() would ask for a process group) */
    if (kill(id.pid, 0) != 0 && errno == ESRCH) return 0;
    char state;
    int threads;
    uint64_t start = proc_stat(id.pid, &state, &threads);
    /* killed (or ended), not yet reaped: its memory is gone; unless other threads still run (a
     * zombie thread-group leader whose main() ended with pthread_exit is a live process) */
    if (state == 'X' || (state == 'Z' && threads <= 1)) return 0;
    if (id.pid == getpid() && !mine && start == id.start_time) return 0; /* ours before an exec */
    if (start && id.start_time && start != id.start_time) return 0; /* the pid was reused */
    /* the same process, but another program since an exec? */
    return mine || id.token != (uint32_t)id.pid || token_held(id.index) || maps_region(id.pid);
}

static int proc_alive(const struct gpuslice_proc *p, uint64_t my_ns)
{
    return ident_alive(ident_of(p), p == gs_region_me, my_ns);
}

/* ---- reclaim -------------------------------------------------------------- */

/* Return a dead process's usage to the container and free its slot. */
static void reclaim_slot_locked(struct gpuslice_proc *p)
{
    struct gpuslice_region *r = gs_region;
    unsigned n = gs_region_devices(r);
    for (unsigned d = 0; d < n; d++) {
        uint64_t u = LD(&p->used_bytes[d]), du = LD(&r->devices[d].used_bytes);
        if (u) GS_INFO("reclaimed %llu bytes of dead process %d", (unsigned long long)u, (int)p->pid);
        ST(&r->devices[d].used_bytes, du > u ? du - u : 0);
    }
    ST(&p->state, GPUSLICE_PROC_FREE);
    memset(p->used_bytes, 0, sizeof(p->used_bytes));
    ST(&p->token, 0);
    ST(&p->pid, 0);
}

/* Reclaim every dead process, or (slot >= 0) those that hold memory of that device slot: a
 * refused reservation checks only the processes whose death could make room for it. */
void gs_region_reclaim_dead_locked(int slot)
{
    struct gpuslice_region *r = gs_region;
    uint64_t my_ns = gs_pidns_inode();
    for (unsigned i = 0; i < GPUSLICE_MAX_PROCS; i++) {
        struct gpuslice_proc *p = &r->procs[i];
        if (LD(&p->state) != GPUSLICE_PROC_LIVE || p == gs_region_me) continue;
        if (slot >= 0 && !LD(&p->used_bytes[slot])) continue;
        if (!proc_alive(p, my_ns)) reclaim_slot_locked(p);
    }
}

/* Whether a process is attached, the dead met on the way reclaimed.  It stops at the first
 * live one: checking a process reads its /proc entry, under the region's lock, and a process
 * attaching beside hundreds of others would check them all (a start-up storm of 200
 * processes took four times as long as without the library).  The dead it does not reach are
 * reclaimed before a reservation is refused, before a view, and by the sweep (the attaching
 * process's, after the lock, if the container's is due; the sampler's every 2 s). */
int gs_region_attached_locked(void)
{
    struct gpuslice_region *r = gs_region;
    uint64_t my_ns = gs_pidns_inode();
    for (unsigned i = 0; i < GPUSLICE_MAX_PROCS; i++) {
        struct gpuslice_proc *p = &r->procs[i];
        if (LD(&p->state) != GPUSLICE_PROC_LIVE) continue;
        if (p == gs_region_me || proc_alive(p, my_ns)) return 1;
        reclaim_slot_locked(p);
    }
    return 0;
}

/* Reclaim the dead, their /proc entries read without the region's lock: a process that checked
 * hundreds of others under it held every allocation of the container for milliseconds.  A slot
 * found dead is reclaimed under the lock only if it still holds the identity (pid, pid namespace,
 * start time) that was found dead: a dead process stays dead, and a slot taken since by another
 * process has another identity. */
#define GS_SWEEP_BATCH 64
void gs_region_sweep_dead(void)
{
    struct gpuslice_region *r = gs_region;
    uint64_t my_ns = gs_pidns_inode();
    unsigned i = 0;
    while (i < GPUSLICE_MAX_PROCS) {
        struct ident dead[GS_SWEEP_BATCH];
        unsigned at[GS_SWEEP_BATCH], n = 0;
        for (; i < GPUSLICE_MAX_PROCS && n < GS_SWEEP_BATCH; i++) {
            struct gpuslice_proc *p = &r->procs[i];
            /* (acquire: pairs with register_locked's release, so the identity read is the live one's) */
            if (__atomic_load_n(&p->state, __ATOMIC_ACQUIRE) != GPUSLICE_PROC_LIVE ||
                p == __atomic_load_n(&gs_region_me, __ATOMIC_ACQUIRE))
                continue;
            struct ident id = ident_of(p);
            if (id.pid <= 0 || ident_alive(id, 0, my_ns)) continue;
            dead[n] = id;
            at[n++] = i;
        }
        if (!n) continue;
        if (gs_region_lock() != 0) return;
        for (unsigned k = 0; k < n; k++) {
            struct gpuslice_proc *p = &r->procs[at[k]];
            struct ident now = ident_of(p);
            /* (and still without its token: the same process, exec'd into a CUDA program, may
             * have registered in the same slot since, with the same identity) */
            if (LD(&p->state) == GPUSLICE_PROC_LIVE && p != gs_region_me && now.pid == dead[k].pid &&
                now.pidns == dead[k].pidns && now.start_time == dead[k].start_time &&
                !(now.token == (uint32_t)now.pid && token_held(at[k])))
                reclaim_slot_locked(p);
        }
        gs_region_unlock();
    }
}

/* A sweep for the whole container, at most one every GS_SWEEP_NS: whoever claims the region's
 * clock first (a compare-and-swap) sweeps, however many processes ask. */
int gs_region_claim_sweep(void)
{
    struct gpuslice_region *r = __atomic_load_n(&gs_region, __ATOMIC_ACQUIRE);
    if (!r || gs_exiting()) return 0;
    uint64_t now = gs_now_ns(), last = LD(&r->reclaimed_ns);
    if (last <= now && now - last < GS_SWEEP_NS) return 0;
    return __atomic_compare_exchange_n(&r->reclaimed_ns, &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
}

void gs_region_reclaim_soon(void)
{
    uint64_t now = gs_now_ns();
    if (!gs_region || now - __atomic_load_n(&g_last_reclaim_ns, __ATOMIC_RELAXED) < 250000000ull) return;
    __atomic_store_n(&g_last_reclaim_ns, now, __ATOMIC_RELAXED);
    gs_region_sweep_dead();
}

void gs_liveness_after_fork_child(void)
{
    pthread_mutex_init(&g_token_mu, NULL);
    if (g_token_fd >= 0) close(g_token_fd); /* the parent's lock stays the parent's */
    g_token_fd = -1;
    g_token_byte = -1;
    g_last_reclaim_ns = 0;
}
