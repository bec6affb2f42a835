/*
 * region.c - the container's shared region and its memory budget.
 *
 * The region file (gpuslice_region.h) is mapped MAP_SHARED by every CUDA
 * process of the container.  Usage changes only under its robust,
 * process-shared mutex, which keeps device.used_bytes == sum of the live
 * processes' used_bytes.  A process killed while holding the mutex leaves it
 * EOWNERDEAD: the next locker reclaims dead processes and recomputes every
 * sum from the process entries, so no state can stay half-updated.
 *
 * Dead processes (pid gone, pid reused, a zombie, or another pid namespace =
 * an earlier incarnation of the container) are reclaimed when a process
 * attaches (those before the first live one), when a reservation would
 * exceed the cap (those holding memory of its device), when a memory view is
 * asked for (rate-limited per process), and by a sweep at most every 2 s per
 * container (at an attach, or by the sampler thread).  The view's and the
 * sweep's /proc reads are made without the mutex.
 *
 * If the file cannot be used, the process falls back to a private anonymous
 * region: its own caps still hold, without sharing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "gpuslice.h"

#define LD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ST(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

struct gpuslice_region *gs_region;
static struct gpuslice_proc *g_me;
static int32_t g_my_pid; /* the pid g_me was registered with */
int gs_exiting;
static pthread_mutex_t g_open_mu = PTHREAD_MUTEX_INITIALIZER;
static dev_t g_file_dev; /* the region file mapped (0, 0: a private region) */
static ino_t g_file_ino;
static uint64_t g_last_reclaim_ns;
#define GS_SWEEP_NS 2000000000ull /* at most one sweep for dead processes per container this often */
static uint64_t g_charge_seq;
int gs_unsettled;
int gs_inflight;

uint64_t gs_charge_seq(void)
{
    return __atomic_load_n(&g_charge_seq, __ATOMIC_ACQUIRE);
}

/* ---- process identity ----------------------------------------------------- */

static uint64_t pidns_inode(void)
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

static uint64_t proc_start_time(pid_t pid)
{
    char state;
    return proc_stat(pid, &state, NULL);
}

static void read_boot_id(uint8_t out[16])
{
    char buf[64];
    memset(out, 0, 16);
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return;
    buf[n] = '\0';
    int k = 0;
    for (ssize_t i = 0; i + 1 < n && k < 16; i++) {
        unsigned v;
        if (buf[i] == '-') continue;
        if (sscanf(buf + i, "%2x", &v) != 1) break;
        out[k++] = (uint8_t)v;
        i++;
    }
}

/* ---- opening -------------------------------------------------------------- */

static void init_mutex(pthread_mutex_t *m)
{
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(m, &attr);
    pthread_mutexattr_destroy(&attr);
}

static void init_region(struct gpuslice_region *r, const uint8_t boot_id[16])
{
    memset(r, 0, sizeof(*r));
    r->version = GPUSLICE_REGION_VERSION;
    r->size = (uint32_t)sizeof(*r);
    r->max_devices = GPUSLICE_MAX_DEVICES;
    r->max_procs = GPUSLICE_MAX_PROCS;
    memcpy(r->boot_id, boot_id, 16);
    init_mutex(&r->lock.mutex);
    __atomic_store_n(&r->magic, GPUSLICE_REGION_MAGIC, __ATOMIC_RELEASE);
}

/* A webhook-managed process without the container's region grants no memory (write_slot): with
 * a region of its own each process would get a whole cap, and a tenant who can break the
 * shared file (a symlink or a directory planted at its path) would multiply the budget. */
static int g_private_managed;
uint64_t gs_own_cap[GPUSLICE_MAX_DEVICES];

/* What a process without the container's shared region gets, for the messages that say so. */
static const char *private_effect(void)
{
    return gs_env_managed() ? "no device memory is granted to this process" : "caps apply to this process alone";
}

static int known(const uint8_t boot_id[16])
{
    for (int i = 0; i < 16; i++)
        if (boot_id[i]) return 1;
    return 0;
}

static struct gpuslice_region *map_file(const char *path, const uint8_t boot_id[16], int tries)
{
    /* Never through a symlink, and only a plain file of its own: the state dir is writable by
     * every user of the container, and a root process that followed a link planted there
     * would make the link's target world-writable and overwrite it.  Only the process that
     * creates the file makes it 0666 (for every user of the container, whatever the umask):
     * chmod'ing any file of this user found at the path made a root-owned 0600 file named
     * there world-writable (a set-user-ID program's caller chose the path, review). */
    int fd = -1, created = 0;
    for (int attempt = 0; fd < 0 && attempt < 3; attempt++) {
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
        created = fd >= 0;
        if (fd < 0 && errno == EEXIST) fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd >= 0 || errno != ENOENT) break; /* ENOENT: replaced meanwhile (an older version's) */
    }
    struct stat own;
    if (fd >= 0 && (fstat(fd, &own) != 0 || !S_ISREG(own.st_mode) || own.st_nlink != 1)) {
        close(fd);
        fd = -1;
        errno = EPERM;
    }
    if (fd < 0) {
        int err = errno;
        const char *why = err == ELOOP ? "a symbolic link" : err == EPERM ? "not a plain file" : strerror(err);
        if (gs_env_managed()) /* a pod's processes would each get a whole cap: grant nothing */
            GS_ERROR("cannot use region %s as uid %u (%s): no device memory is granted to this process (the "
                     "container's processes must share one region; the gpuslice node agent makes the state "
                     "directories writable for every user: is it running on this node?)",
                     path, (unsigned)geteuid(), why);
        else
            GS_WARN("cannot use region %s (%s): %s", path, why, private_effect());
        return NULL;
    }
    if (created) (void)fchmod(fd, 0666); /* every user of the container shares it */
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
    /* Still the file at the path?  Another process may have replaced an older library's file
     * (below) while this one waited for the lock of the file it had opened: that one is
     * nobody's now, and replacing again would unlink the new file under the processes in it
     * (two processes racing through an upgrade each got a whole cap). */
    struct stat at;
    if (tries < 8 && (lstat(path, &at) != 0 || at.st_dev != own.st_dev || at.st_ino != own.st_ino)) {
        flock(fd, LOCK_UN);
        close(fd);
        return map_file(path, boot_id, tries + 1);
    }
    struct gpuslice_region *r = NULL;
    struct stat st;
    /* An older library's region (a node upgraded under a running pod): its processes keep the
     * old file, mapped; this one starts a new file (a newer library's is left alone). */
    struct {
        uint64_t magic;
        uint32_t version;
    } head;
    if (pread(fd, &head, sizeof(head), 0) == (ssize_t)sizeof(head) && head.magic == GPUSLICE_REGION_MAGIC &&
        head.version < GPUSLICE_REGION_VERSION && unlink(path) == 0) {
        GS_WARN("region %s was written by an older library (version %u): replaced", path, head.version);
        flock(fd, LOCK_UN);
        close(fd);
        return map_file(path, boot_id, tries + 1);
    }
    /* blocks allocated now, not at the first store (a full disk would kill the process with SIGBUS) */
    int grown = fstat(fd, &st) == 0 &&
                (st.st_size >= (off_t)sizeof(*r) || posix_fallocate(fd, 0, sizeof(*r)) == 0);
    if (grown) {
        void *p = mmap(NULL, sizeof(*r), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) r = p;
    }
    if (!r) {
        GS_WARN("cannot map region %s (%s): %s", path, grown ? strerror(errno) : "no space for it", private_effect());
    } else if (__atomic_load_n(&r->magic, __ATOMIC_ACQUIRE) != GPUSLICE_REGION_MAGIC) {
        init_region(r, boot_id);
    } else if (r->version != GPUSLICE_REGION_VERSION || r->size != sizeof(*r)) {
        GS_ERROR("region %s has version %u size %u, this library writes version %u: %s", path, r->version, r->size,
                 GPUSLICE_REGION_VERSION, private_effect());
        munmap(r, sizeof(*r));
        r = NULL;
    } else if (memcmp(r->boot_id, boot_id, 16) != 0 && known(boot_id)) {
        /* (a process that cannot read the boot id resets nothing: that would drop the
         * usage of live processes; a region written by one takes the boot id now) */
        if (known(r->boot_id)) {
            GS_INFO("region %s is from an earlier boot: reset", path);
            init_region(r, boot_id);
        } else {
            memcpy(r->boot_id, boot_id, 16);
        }
    }
    if (r) {
        g_file_dev = own.st_dev;
        g_file_ino = own.st_ino;
    }
    flock(fd, LOCK_UN);
    close(fd);
    return r;
}

int gs_region_open(void)
{
    if (__atomic_load_n(&gs_region, __ATOMIC_ACQUIRE)) return 0;
    pthread_mutex_lock(&g_open_mu);
    if (!gs_region) {
        char path[4096];
        uint8_t boot_id[16];
        read_boot_id(boot_id);
        struct gpuslice_region *r = map_file(gs_env_region_path(path, sizeof(path)), boot_id, 0);
        if (!r) {
            g_private_managed = gs_env_managed();
            void *p = mmap(NULL, sizeof(*r), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
            if (p != MAP_FAILED) {
                r = p;
                init_region(r, boot_id);
            }
        }
        __atomic_store_n(&gs_region, r, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&g_open_mu);
    return gs_region ? 0 : -1;
}

/* ---- locking and reclaim -------------------------------------------------- */

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
static int g_token_off; /* no more tokens: this process went to a private region */
static pthread_mutex_t g_token_mu = PTHREAD_MUTEX_INITIALIZER;

/* The region file through a descriptor of this process's own, or -1 (a private region, or the
 * path no longer names the mapped file). */
static int token_fd(void)
{
    pthread_mutex_lock(&g_token_mu);
    if (g_token_fd < 0 && g_file_ino) {
        char path[4096];
        int fd = open(gs_env_region_path(path, sizeof(path)), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        struct stat st;
        if (fd >= 0 && (fstat(fd, &st) != 0 || st.st_dev != g_file_dev || st.st_ino != g_file_ino)) {
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
 * process's map_file would wait on it for the holder's life. */
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
static int token_take(unsigned index)
{
    if (g_token_off) return 0; /* (and the shared slot's byte stays held: that slot is live) */
    int fd = token_fd();
    if (fd < 0 || !tokens_allowed(fd)) return 0;
    if (g_token_byte >= 0 && g_token_byte != (int64_t)index) token_lock(fd, g_token_byte, F_UNLCK, F_OFD_SETLK);
    g_token_byte = -1;
    if (token_lock(fd, index, F_WRLCK, F_OFD_SETLK) != 0) return 0; /* a lock left by a child of a dead holder */
    g_token_byte = index;
    return 1;
}

static void token_give_back(void)
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
    /* "start-end perms offset MAJ:MIN inode  path": major and minor in hex */
    snprintf(want, sizeof(want), " %02x:%02x %llu ", major(g_file_dev), minor(g_file_dev),
             (unsigned long long)g_file_ino);
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

/* `mine`: the slot is this process's own (g_me) */
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
    return ident_alive(ident_of(p), p == g_me, my_ns);
}

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
static void reclaim_dead_locked(int slot)
{
    struct gpuslice_region *r = gs_region;
    uint64_t my_ns = pidns_inode();
    for (unsigned i = 0; i < GPUSLICE_MAX_PROCS; i++) {
        struct gpuslice_proc *p = &r->procs[i];
        if (LD(&p->state) != GPUSLICE_PROC_LIVE || p == g_me) continue;
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
static int attached_locked(void)
{
    struct gpuslice_region *r = gs_region;
    uint64_t my_ns = pidns_inode();
    for (unsigned i = 0; i < GPUSLICE_MAX_PROCS; i++) {
        struct gpuslice_proc *p = &r->procs[i];
        if (LD(&p->state) != GPUSLICE_PROC_LIVE) continue;
        if (p == g_me || proc_alive(p, my_ns)) return 1;
        reclaim_slot_locked(p);
    }
    return 0;
}

/* After a holder died: drop the dead, then recompute each sum from the entries. */
static void repair_locked(void)
{
    struct gpuslice_region *r = gs_region;
    reclaim_dead_locked(-1);
    for (unsigned d = 0; d < GPUSLICE_MAX_DEVICES; d++) {
        uint64_t sum = 0;
        for (unsigned i = 0; i < GPUSLICE_MAX_PROCS; i++)
            if (LD(&r->procs[i].state) == GPUSLICE_PROC_LIVE) sum = gs_add_sat(sum, LD(&r->procs[i].used_bytes[d]));
        ST(&r->devices[d].used_bytes, sum);
    }
}

/* The region whose lock this thread holds, or NULL.  Unlocked is the region that was locked
 * (another thread may swap gs_region for a private one meanwhile: go_private).  While it is
 * held, log lines wait in a buffer until the unlock (a write to a full stderr pipe would hold
 * every process of the container), and the exit destructor does not wait for it (exit() from a
 * signal handler that interrupted this thread inside the lock would wait on itself, and every
 * other process of the container with it; the lock's robustness hands the region over when
 * the process is gone). */
static __thread struct gpuslice_region *volatile t_locked; /* volatile: a signal handler reads it */

static int region_lock(void)
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
        init_mutex(m);
    }
    t_locked = NULL;
    gs_log_defer(0);
    return -1;
}

static void region_unlock(void)
{
    if (t_locked) pthread_mutex_unlock(&t_locked->lock.mutex);
    t_locked = NULL;
    gs_log_defer(0); /* and writes what waited */
}

/* g_me, unless another process reclaimed our slot meanwhile (it took us for
 * dead: a pid namespace it cannot see into) and it may be someone else's now;
 * then we have no slot, and register again at the next charge. */
static struct gpuslice_proc *me_locked(void)
{
    if (g_me && (LD(&g_me->state) != GPUSLICE_PROC_LIVE || LD(&g_me->pid) != g_my_pid)) {
        GS_WARN("this process's usage was reclaimed by another process: registering again");
        __atomic_store_n(&g_me, NULL, __ATOMIC_RELEASE);
    }
    return g_me;
}

static int register_locked(void)
{
    struct gpuslice_region *r = gs_region;
    /* After the exit detach a charge would leave a live-looking slot behind
     * (another thread still running, the sampler): refuse it. */
    if (__atomic_load_n(&gs_exiting, __ATOMIC_ACQUIRE)) return -1;
    for (int pass = 0; pass < 2 && !g_me; pass++) {
        /* pass 0 too when a slot of our pid is live: this program replaced it by exec, and
         * the old image's memory went with its address space */
        int mine = 0;
        for (unsigned i = 0; i < GPUSLICE_MAX_PROCS && !pass && !mine; i++)
            mine = LD(&r->procs[i].state) == GPUSLICE_PROC_LIVE && LD(&r->procs[i].pid) == (int32_t)getpid();
        if (pass || mine) reclaim_dead_locked(-1);
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
            ST(&p->pidns, pidns_inode());
            ST(&p->start_time, proc_start_time(getpid()));
            /* the token before the slot is live: a sweep reading it without the lock must
             * not find it noted and not yet held */
            ST(&p->token, token_take(i) ? (uint32_t)getpid() : 0u);
            ST(&p->state, GPUSLICE_PROC_LIVE);
            g_my_pid = p->pid;
            __atomic_store_n(&g_me, p, __ATOMIC_RELEASE);
            break;
        }
    }
    if (!g_me) GS_ERROR("region has no free process slot (%d in use)", GPUSLICE_MAX_PROCS);
    return g_me ? 0 : -1;
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
    ST(&s->limit_bytes, g_private_managed ? GS_CAP_NOTHING : c->limit);
    ST(&s->total_bytes, c->total);
    ST(&s->sm_limit, c->sm_limit);
    ST(&s->index, c->index);
    ST(&s->used_bytes, 0);
    /* the compute clock stays (a new UUID started from zero above): debt that the last
     * processes left is the device's, paid by the next ones; zeroed, three processes in turn
     * each ending with a 1 s kernel at 20 % ran back to back, at 100 % */
}

static int claim_sweep(void);
static void sweep_dead(void);

/* -1: the region's lock cannot be taken, or its device table (full of other devices) cannot
 * take one of this process's devices; the process is not registered then */
static int sync_locked(const struct gs_devcfg *devs, unsigned n, int do_register)
{
    if (region_lock() != 0) return -1;
    struct gpuslice_region *r = gs_region;
    int idle = !attached_locked();
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
            region_unlock();
            GS_ERROR("region has no room for device %s: its %u device slots hold other devices", devs[i].uuid,
                     GPUSLICE_MAX_DEVICES);
            return -1;
        }
        if (gs_limits_from_file()) /* every process read the same file: its cap holds whatever the region says */
            __atomic_store_n(&gs_own_cap[slot], devs[i].limit, __ATOMIC_RELAXED);
    }
    if (do_register && !me_locked()) register_locked();
    region_unlock();
    /* the dead beyond the first live one: one process of the container every 2 s */
    if (!idle && claim_sweep()) sweep_dead();
    return 0;
}

/* A region of this process's own, as when the file cannot be used (gs_region_open).  The shared
 * one stays mapped: another thread may be reading it. */
static void go_private(void)
{
    pthread_mutex_lock(&g_open_mu);
    void *p = mmap(NULL, sizeof(*gs_region), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
        g_private_managed = gs_env_managed();
        init_region(p, gs_region->boot_id);
        g_token_off = 1; /* the shared slot keeps its token; the private one needs none */
        __atomic_store_n(&g_me, NULL, __ATOMIC_RELEASE);
        __atomic_store_n(&gs_region, (struct gpuslice_region *)p, __ATOMIC_RELEASE);
        GS_ERROR("the container's region cannot be used: %s", private_effect());
    }
    pthread_mutex_unlock(&g_open_mu);
}

void gs_region_sync(const struct gs_devcfg *devs, unsigned n, int do_register)
{
    if (gs_region_open() != 0 || sync_locked(devs, n, do_register) == 0) return;
    /* The file is damaged (every process of the container can write it): a device left without a
     * slot would be used without a cap */
    go_private();
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
    ST(&g_me->used_bytes[slot], gs_add_sat(LD(&g_me->used_bytes[slot]), bytes));
    __atomic_add_fetch(&g_charge_seq, 1, __ATOMIC_ACQ_REL);
}

int gs_budget_reserve(int slot, uint64_t bytes)
{
    if (!bytes || !valid_slot(slot)) return 0;
    if (region_lock() != 0) return -1;
    if (!me_locked() && register_locked() != 0) {
        region_unlock();
        return -1;
    }
    struct gpuslice_device *d = &gs_region->devices[slot];
    uint64_t limit = gs_cap_of(slot, LD(&d->limit_bytes));
    if (bytes > UINT64_MAX - LD(&d->used_bytes)) { /* no device has it; the sum would wrap */
        region_unlock();
        return -1;
    }
    for (int pass = 0; limit && pass < 2; pass++) {
        if (pass) reclaim_dead_locked(slot);
        uint64_t used = LD(&d->used_bytes);
        if (used <= limit && bytes <= limit - used) break;
        if (pass) {
            region_unlock();
            GS_DEBUG("reservation of %llu bytes refused: %llu of %llu used", (unsigned long long)bytes,
                     (unsigned long long)used, (unsigned long long)limit);
            return -1;
        }
    }
    charge_locked(slot, bytes);
    region_unlock();
    return 0;
}

void gs_budget_force(int slot, uint64_t bytes)
{
    if (!bytes || !valid_slot(slot) || region_lock() != 0) return;
    if (me_locked() || register_locked() == 0) charge_locked(slot, bytes);
    region_unlock();
}

void gs_budget_release(int slot, uint64_t bytes)
{
    if (!bytes || !valid_slot(slot) || region_lock() != 0) return;
    if (me_locked()) {
        struct gpuslice_device *d = &gs_region->devices[slot];
        uint64_t mine = LD(&g_me->used_bytes[slot]), du = LD(&d->used_bytes);
        uint64_t x = bytes < mine ? bytes : mine;
        ST(&g_me->used_bytes[slot], mine - x);
        ST(&d->used_bytes, du > x ? du - x : 0);
        __atomic_add_fetch(&g_charge_seq, 1, __ATOMIC_ACQ_REL);
    }
    region_unlock();
}

uint64_t gs_slot_used(int slot)
{
    return valid_slot(slot) ? LD(&gs_region->devices[slot].used_bytes) : 0;
}

uint64_t gs_slot_mine(int slot)
{
    /* Lock-free reader (the sampler): g_me may be cleared meanwhile by the
     * destructor at exit; the slot it pointed to stays mapped. */
    struct gpuslice_proc *me = __atomic_load_n(&g_me, __ATOMIC_ACQUIRE);
    return valid_slot(slot) && me ? LD(&me->used_bytes[slot]) : 0;
}

/* Our own process slot for the lock-free notes below, or NULL: not registered, or the slot was
 * reclaimed (it may be someone else's now) */
static struct gpuslice_proc *me_unlocked(void)
{
    struct gpuslice_proc *me = __atomic_load_n(&g_me, __ATOMIC_ACQUIRE);
    if (!me || LD(&me->state) != GPUSLICE_PROC_LIVE || LD(&me->pid) != g_my_pid) return NULL;
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

/* Reclaim the dead, their /proc entries read without the region's lock: a process that checked
 * hundreds of others under it held every allocation of the container for milliseconds.  A slot
 * found dead is reclaimed under the lock only if it still holds the identity (pid, pid namespace,
 * start time) that was found dead: a dead process stays dead, and a slot taken since by another
 * process has another identity. */
#define GS_SWEEP_BATCH 64
static void sweep_dead(void)
{
    struct gpuslice_region *r = gs_region;
    uint64_t my_ns = pidns_inode();
    unsigned i = 0;
    while (i < GPUSLICE_MAX_PROCS) {
        struct ident dead[GS_SWEEP_BATCH];
        unsigned at[GS_SWEEP_BATCH], n = 0;
        for (; i < GPUSLICE_MAX_PROCS && n < GS_SWEEP_BATCH; i++) {
            struct gpuslice_proc *p = &r->procs[i];
            if (LD(&p->state) != GPUSLICE_PROC_LIVE || p == __atomic_load_n(&g_me, __ATOMIC_ACQUIRE)) continue;
            struct ident id = ident_of(p);
            if (id.pid <= 0 || ident_alive(id, 0, my_ns)) continue;
            dead[n] = id;
            at[n++] = i;
        }
        if (!n) continue;
        if (region_lock() != 0) return;
        for (unsigned k = 0; k < n; k++) {
            struct gpuslice_proc *p = &r->procs[at[k]];
            struct ident now = ident_of(p);
            /* (and still without its token: the same process, exec'd into a CUDA program, may
             * have registered in the same slot since, with the same identity) */
            if (LD(&p->state) == GPUSLICE_PROC_LIVE && p != g_me && now.pid == dead[k].pid &&
                now.pidns == dead[k].pidns && now.start_time == dead[k].start_time &&
                !(now.token == (uint32_t)now.pid && token_held(at[k])))
                reclaim_slot_locked(p);
        }
        region_unlock();
    }
}

/* A sweep for the whole container, at most one every GS_SWEEP_NS: whoever claims the region's
 * clock first (a compare-and-swap) sweeps, however many processes ask. */
static int claim_sweep(void)
{
    struct gpuslice_region *r = __atomic_load_n(&gs_region, __ATOMIC_ACQUIRE);
    if (!r || __atomic_load_n(&gs_exiting, __ATOMIC_ACQUIRE)) return 0;
    uint64_t now = gs_now_ns(), last = LD(&r->reclaimed_ns);
    if (last <= now && now - last < GS_SWEEP_NS) return 0;
    return __atomic_compare_exchange_n(&r->reclaimed_ns, &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
}

void gs_region_reclaim_soon(void)
{
    uint64_t now = gs_now_ns();
    if (!gs_region || now - __atomic_load_n(&g_last_reclaim_ns, __ATOMIC_RELAXED) < 250000000ull) return;
    __atomic_store_n(&g_last_reclaim_ns, now, __ATOMIC_RELAXED);
    sweep_dead();
}

/* The sampler's: every 2 s one process of the container sweeps, so that a killed process's
 * memory leaves the container's figures (the agent's metrics read them) while the others run
 * on, not only at the next attach, refusal or view. */
void gs_region_sweep(void)
{
    if (me_unlocked() && claim_sweep()) sweep_dead();
}

void gs_region_after_fork_child(void)
{
    pthread_mutex_init(&g_open_mu, NULL); /* another thread may have held it at the fork */
    pthread_mutex_init(&g_token_mu, NULL);
    if (g_token_fd >= 0) close(g_token_fd); /* the parent's lock stays the parent's */
    g_token_fd = -1;
    g_token_byte = -1;
    __atomic_store_n(&g_me, NULL, __ATOMIC_RELEASE); /* the child registers as itself on its first charge */
    g_last_reclaim_ns = 0;
}

__attribute__((destructor)) static void region_detach(void)
{
    __atomic_store_n(&gs_exiting, 1, __ATOMIC_RELEASE);
    /* exit() from a signal handler inside the lock (above); or a child made without the fork
     * handlers (_Fork, clone, vfork + exit): g_me is still its parent's slot, which it must not
     * empty (the slot of a child that charged through it is reclaimed once the parent is gone) */
    if (t_locked || g_my_pid != (int32_t)getpid()) return;
    gs_launch_at_exit(); /* work in flight is charged while the slot is still ours */
    /* another thread may be attaching right now (discovery): the pointers are read as they are
     * written, atomically */
    if (!__atomic_load_n(&gs_region, __ATOMIC_ACQUIRE) || !__atomic_load_n(&g_me, __ATOMIC_ACQUIRE) ||
        region_lock() != 0)
        return;
    if (!me_locked()) { /* our slot was reclaimed: it may be someone else's now */
        region_unlock();
        return;
    }
    struct gpuslice_region *r = gs_region;
    unsigned n = gs_region_devices(r);
    for (unsigned d = 0; d < n; d++) {
        uint64_t u = LD(&g_me->used_bytes[d]), du = LD(&r->devices[d].used_bytes);
        ST(&r->devices[d].used_bytes, du > u ? du - u : 0);
    }
    memset(g_me->used_bytes, 0, sizeof(g_me->used_bytes));
    memset(g_me->measured_ns, 0, sizeof(g_me->measured_ns));
    ST(&g_me->host_pid, 0);
    ST(&g_me->token, 0);
    ST(&g_me->state, GPUSLICE_PROC_FREE);
    ST(&g_me->pid, 0);
    __atomic_store_n(&g_me, NULL, __ATOMIC_RELEASE);
    token_give_back();
    region_unlock();
}
