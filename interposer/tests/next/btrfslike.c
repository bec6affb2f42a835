/*
 * btrfslike.c - libgsbtrfslike.so: preloaded before the interposer, it makes the files of the
 * file system holding the directory GS_TEST_BTRFS_DIR report, to stat(2), fstat and lstat, a
 * device number of their own, as btrfs does: there st_dev is the subvolume's anonymous device
 * (00:29, say), while /proc/PID/maps names a mapped file by its superblock's (00:28).  Overlayfs
 * before Linux 6.7 differed the same way (maps named the underlying file).  Other file systems
 * are left alone.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#define EXPORT __attribute__((visibility("default")))

static int (*real_stat)(const char *, struct stat *);
static int (*real_fstat)(int, struct stat *);
static int (*real_lstat)(const char *, struct stat *);

static void resolve(void)
{
    if (!real_stat) real_stat = (int (*)(const char *, struct stat *))dlsym(RTLD_NEXT, "stat");
    if (!real_fstat) real_fstat = (int (*)(int, struct stat *))dlsym(RTLD_NEXT, "fstat");
    if (!real_lstat) real_lstat = (int (*)(const char *, struct stat *))dlsym(RTLD_NEXT, "lstat");
}

/* What a file of that file system reports: another minor on the same major */
static void fake_dev(int rc, struct stat *st)
{
    const char *dir = getenv("GS_TEST_BTRFS_DIR");
    struct stat d;
    if (rc != 0 || !dir || !dir[0] || real_stat(dir, &d) != 0 || st->st_dev != d.st_dev) return;
    st->st_dev = makedev(major(st->st_dev), minor(st->st_dev) + 1);
}

EXPORT int stat(const char *path, struct stat *st)
{
    resolve();
    int rc = real_stat(path, st);
    fake_dev(rc, st);
    return rc;
}

EXPORT int fstat(int fd, struct stat *st)
{
    resolve();
    int rc = real_fstat(fd, st);
    fake_dev(rc, st);
    return rc;
}

EXPORT int lstat(const char *path, struct stat *st)
{
    resolve();
    int rc = real_lstat(path, st);
    fake_dev(rc, st);
    return rc;
}
