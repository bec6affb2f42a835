/*
 * pausemaps.c - libgspausemaps.so: preloaded before the interposer, it stops the process once,
 * just after it has read another process's /proc/<pid>/maps (the library reads it only to tell
 * whether a process whose liveness token nobody holds still maps the region: the sweep's check
 * without the region's lock).  At the close of that file it creates GS_TEST_PAUSED and waits
 * (up to 30 s) for GS_TEST_RESUME to exist, so that a test can change the region between the
 * sweep's check and its locked re-check.  Other files, and later reads, pass straight through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "nextopen.h"

#define EXPORT __attribute__((visibility("default")))

static int g_fd = -1; /* the maps file being read, until its close */
static int g_done;    /* paused once already */

static int others_maps(const char *path)
{
    char own[64];
    snprintf(own, sizeof(own), "/proc/%d/maps", (int)getpid());
    return strncmp(path, "/proc/", 6) == 0 && path[6] >= '0' && path[6] <= '9' &&
           strcmp(path + strlen(path) - 5, "/maps") == 0 && strcmp(path, own) != 0;
}

EXPORT int open(const char *path, int flags, ...)
{
    int fd;
    GS_NEXT_OPEN(fd, path, flags);
    if (fd >= 0 && !__atomic_load_n(&g_done, __ATOMIC_ACQUIRE) && others_maps(path))
        __atomic_store_n(&g_fd, fd, __ATOMIC_RELEASE);
    return fd;
}

EXPORT int close(int fd)
{
    static int (*next)(int);
    if (!next) next = (int (*)(int))dlsym(RTLD_NEXT, "close");
    int rc = next(fd);
    int want = fd;
    if (fd >= 0 && __atomic_compare_exchange_n(&g_fd, &want, -1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) &&
        !__atomic_exchange_n(&g_done, 1, __ATOMIC_ACQ_REL)) {
        const char *paused = getenv("GS_TEST_PAUSED"), *resume = getenv("GS_TEST_RESUME");
        if (paused && resume) {
            int m = openat(AT_FDCWD, paused, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
            if (m >= 0) next(m);
            struct stat st;
            for (int n = 0; stat(resume, &st) != 0 && n < 30000; n++) usleep(1000);
        }
    }
    return rc;
}
