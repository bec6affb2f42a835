/*
 * nfslike.c - libgsnfslike.so: preloaded before the interposer, it makes the file named by
 * GS_TEST_NFS_PATH look and lock as on NFS.  fstatfs and statfs of it report NFS_SUPER_MAGIC
 * (0x6969); flock(2) on it is done as NFS's client does it, as a byte-range lock on the whole
 * file (an open-file-description lock here: one owner per open file, as flock), so it
 * conflicts with any byte-range lock another open file holds on the file, a liveness token's
 * included.  Other files are left alone.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#define NFS_SUPER_MAGIC 0x6969
#define EXPORT __attribute__((visibility("default")))

/* Whether `fd` is (or `path` names) the file given in GS_TEST_NFS_PATH, now. */
static int is_target(int fd, const char *path)
{
    const char *want = getenv("GS_TEST_NFS_PATH");
    if (!want || !want[0]) return 0;
    struct stat a, b;
    if (stat(want, &b) != 0) return 0;
    if (path) return stat(path, &a) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
    return fstat(fd, &a) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

EXPORT int fstatfs(int fd, struct statfs *buf)
{
    static int (*next)(int, struct statfs *);
    if (!next) next = (int (*)(int, struct statfs *))dlsym(RTLD_NEXT, "fstatfs");
    int rc = next(fd, buf);
    if (rc == 0 && is_target(fd, NULL)) buf->f_type = NFS_SUPER_MAGIC;
    return rc;
}

EXPORT int statfs(const char *path, struct statfs *buf)
{
    static int (*next)(const char *, struct statfs *);
    if (!next) next = (int (*)(const char *, struct statfs *))dlsym(RTLD_NEXT, "statfs");
    int rc = next(path, buf);
    if (rc == 0 && is_target(-1, path)) buf->f_type = NFS_SUPER_MAGIC;
    return rc;
}

EXPORT int flock(int fd, int op)
{
    static int (*next)(int, int);
    if (!next) next = (int (*)(int, int))dlsym(RTLD_NEXT, "flock");
    if (!is_target(fd, NULL)) return next(fd, op);
    struct flock fl = {.l_whence = SEEK_SET, .l_start = 0, .l_len = 0}; /* the whole file */
    switch (op & ~LOCK_NB) {
    case LOCK_SH:
        fl.l_type = F_RDLCK;
        break;
    case LOCK_EX:
        fl.l_type = F_WRLCK;
        break;
    case LOCK_UN:
        fl.l_type = F_UNLCK;
        break;
    default:
        errno = EINVAL;
        return -1;
    }
    int rc = fcntl(fd, (op & LOCK_NB) || fl.l_type == F_UNLCK ? F_OFD_SETLK : F_OFD_SETLKW, &fl);
    if (rc != 0 && errno == EAGAIN) errno = EWOULDBLOCK;
    return rc;
}
