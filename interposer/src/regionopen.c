/*
 * regionopen.c - opening the container's region file (region.c): never through a symlink,
 * an older library's file replaced, one from an earlier boot reset; and the private region a
 * process falls back to.
 *
 * If the file cannot be used, the process falls back to a private anonymous
 * region: its own caps still hold, without sharing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "region_internal.h"

static pthread_mutex_t g_open_mu = PTHREAD_MUTEX_INITIALIZER;
dev_t gs_region_file_dev; /* the region file mapped (0, 0: a private region) */
ino_t gs_region_file_ino;
const void *gs_region_file_addr;

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

void gs_region_init_mutex(pthread_mutex_t *m)
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
    gs_region_init_mutex(&r->lock.mutex);
    __atomic_store_n(&r->magic, GPUSLICE_REGION_MAGIC, __ATOMIC_RELEASE);
}

/* A webhook-managed process without the container's region grants no memory (write_slot): with
 * a region of its own each process would get a whole cap, and a tenant who can break the
 * shared file (a symlink or a directory planted at its path) would multiply the budget. */
int gs_region_private_managed;

/* HAMi-core's shared cache starts with this int32 (its initialized_flag) once set up. */
#define HAMI_CORE_REGION_FLAG 19920718

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

/* On btrfs a store into a page written back since needs new blocks (copy on write), allocated
 * blocks or not: on a full file system every process of the container died of SIGBUS at its
 * next store into the region (a new process at its first).  A file without copy on write keeps
 * its blocks; the attribute takes only on an empty file. */
static void no_cow(int fd, off_t size)
{
    struct statfs fs;
    int flags;
    if (size || fstatfs(fd, &fs) != 0 || (unsigned long)fs.f_type != 0x9123683EUL /* btrfs */ ||
        ioctl(fd, FS_IOC_GETFLAGS, &flags) != 0)
        return;
    flags |= FS_NOCOW_FL;
    if (ioctl(fd, FS_IOC_SETFLAGS, &flags) != 0) GS_DEBUG("region file: no FS_NOCOW_FL: %s", strerror(errno));
}

/* Whether a region file of another version (its process slots laid out otherwise) has a process
 * of this run of the container registered: a slot marked live whose pid namespace is this
 * process's (all processes of a container share one; a restarted container gets a new one).
 * Every version keeps the header's first fields, the process table at the same offset and each
 * slot's first fields {pid, state, pidns} (the header's rules); the slot size is the header's
 * size spread over its max_procs.  1: such a process, alive, 0: none, -1: cannot tell. */
static int other_version_in_use(int fd)
{
    struct {
        uint64_t magic;
        uint32_t version, size, max_devices, max_procs;
    } h;
    struct stat st;
    uint64_t my_ns = gs_pidns_inode();
    const size_t procs = offsetof(struct gpuslice_region, procs);
    if (!my_ns || pread(fd, &h, sizeof(h), 0) != (ssize_t)sizeof(h) || fstat(fd, &st) != 0) return -1;
    if (h.max_procs == 0 || h.max_procs > (1u << 20) || h.size <= procs || (off_t)h.size > st.st_size ||
        (h.size - procs) % h.max_procs != 0 || (h.size - procs) / h.max_procs < 16)
        return -1;
    size_t stride = (h.size - procs) / h.max_procs;
    for (uint32_t i = 0; i < h.max_procs; i++) {
        struct {
            int32_t pid;
            uint32_t state;
            uint64_t pidns;
        } p;
        if (pread(fd, &p, sizeof(p), (off_t)(procs + i * stride)) != (ssize_t)sizeof(p)) return -1;
        /* its pid is in this namespace: one gone (SIGKILLed, no process of its version left to
         * sweep it) uses nothing, and kept, the container's new processes were granted no
         * memory for the pod's life (a pid taken again since counts as in use) */
        if (p.state == GPUSLICE_PROC_LIVE && p.pidns == my_ns && p.pid > 0 && (kill(p.pid, 0) == 0 || errno != ESRCH))
            return 1;
    }
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
    int fd = -1, created = 0, waits = 0;
    for (int attempt = 0; fd < 0 && attempt < 3; attempt++) {
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
        created = fd >= 0;
        if (fd < 0 && errno == EEXIST) {
            fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
            /* its creator may not have made it 0666 yet (below): until then its mode is 0666 less
             * the creator's umask, 0644 under root's usual 022, and a non-root process refused
             * there was granted no memory for its life (half a second at most: a file that stays
             * so is not the container's region) */
            if (fd < 0 && errno == EACCES && waits++ < 250) {
                gs_sleep_ns(2000000);
                attempt--;
                continue;
            }
        }
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
    /* Another version's region: an older library's (a container restarted after an upgrade of
     * the node) or a newer one's (after a rollback) left by an earlier run of the container is
     * replaced by a new file; one a process of this run uses is left alone. */
    struct {
        uint64_t magic;
        uint32_t version;
    } head;
    int have_head = pread(fd, &head, sizeof(head), 0) == (ssize_t)sizeof(head);
    int32_t hami_flag;
    memcpy(&hami_flag, &head, sizeof(hami_flag));
    if (have_head && hami_flag == HAMI_CORE_REGION_FLAG) {
        /* CUDA_DEVICE_MEMORY_SHARED_CACHE is HAMi-core's name too: this file is its shared cache,
         * in use by its processes perhaps.  Written over, their semaphore and usage went. */
        GS_ERROR("region %s is HAMi-core's shared cache (CUDA_DEVICE_MEMORY_SHARED_CACHE names it): left alone; "
                 "give gpuslice's processes a path of their own: %s",
                 path, private_effect());
        flock(fd, LOCK_UN);
        close(fd);
        return NULL;
    }
    int other = have_head && head.magic == GPUSLICE_REGION_MAGIC && head.version != GPUSLICE_REGION_VERSION;
    int in_use = other ? other_version_in_use(fd) : 0;
    /* (not while a process of this run is registered in it: one that preloads another version
     * from the library dir, which holds every installed one, started a budget of its own beside
     * the old file's, 12 GiB held under an 8 GiB cap) */
    if (other && head.version < GPUSLICE_REGION_VERSION && in_use != 1 && unlink(path) == 0) {
        GS_WARN("region %s was written by an older library (version %u): replaced", path, head.version);
        flock(fd, LOCK_UN);
        close(fd);
        return map_file(path, boot_id, tries + 1);
    }
    /* A newer library's: left alone while a process of this run of the container may use it;
     * one left by an earlier run (a container restarted after the node's library was rolled
     * back) is nobody's, and kept, it granted a pod's processes no memory for the pod's life. */
    if (other && head.version > GPUSLICE_REGION_VERSION && in_use == 0 && unlink(path) == 0) {
        GS_WARN("region %s was written by a newer library (version %u) in an earlier run of this container: "
                "replaced",
                path, head.version);
        flock(fd, LOCK_UN);
        close(fd);
        return map_file(path, boot_id, tries + 1);
    }
    if (other) { /* another version's, kept: neither grown nor written */
        const char *why = in_use == 1  ? "a process of this run of the container uses it"
                          : in_use < 0 && head.version > GPUSLICE_REGION_VERSION ? "whether its processes are gone cannot be told"
                                                                                  : "it cannot be removed";
        GS_ERROR("region %s has version %u, this library writes version %u, and %s: %s", path, head.version,
                 GPUSLICE_REGION_VERSION, why, private_effect());
        flock(fd, LOCK_UN);
        close(fd);
        return NULL;
    }
    /* blocks allocated now, not at the first store (a full disk would kill the process with SIGBUS) */
    int grown = fstat(fd, &st) == 0;
    if (grown && st.st_size < (off_t)sizeof(*r)) {
        no_cow(fd, st.st_size);
        grown = posix_fallocate(fd, 0, sizeof(*r)) == 0;
    }
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
        gs_region_file_dev = own.st_dev;
        gs_region_file_ino = own.st_ino;
        gs_region_file_addr = r;
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
            gs_region_private_managed = gs_env_managed();
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

/* A region of this process's own, as when the file cannot be used (gs_region_open).  The shared
 * one stays mapped: another thread may be reading it. */
void gs_region_go_private(void)
{
    pthread_mutex_lock(&g_open_mu);
    void *p = mmap(NULL, sizeof(*gs_region), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
        gs_region_private_managed = gs_env_managed();
        init_region(p, gs_region->boot_id);
        gs_token_off = 1; /* the shared slot keeps its token; the private one needs none */
        __atomic_store_n(&gs_region_me, NULL, __ATOMIC_RELEASE);
        __atomic_store_n(&gs_region, (struct gpuslice_region *)p, __ATOMIC_RELEASE);
        GS_ERROR("the container's region cannot be used: %s", private_effect());
    }
    pthread_mutex_unlock(&g_open_mu);
}

void gs_region_open_after_fork_child(void)
{
    pthread_mutex_init(&g_open_mu, NULL); /* another thread may have held it at the fork */
}
