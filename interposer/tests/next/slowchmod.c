/*
 * slowchmod.c - libgsslowchmod.so: preloaded before the interposer, it stops the process that
 * creates the file GS_TEST_CHMOD_PATH between its creation and its fchmod: there it touches
 * GS_TEST_CHMOD_HELD and waits (at most 20 s) until GS_TEST_CHMOD_GO exists.  In a process
 * whose open(2) of that file fails with EACCES it touches GS_TEST_CHMOD_REFUSED (the first
 * time).  Other files are left alone.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nextopen.h"

#define EXPORT __attribute__((visibility("default")))

static void touch(const char *var)
{
    const char *path = getenv(var);
    int fd = path && path[0] ? open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0666) : -1;
    if (fd >= 0) close(fd);
}

EXPORT int fchmod(int fd, mode_t mode)
{
    static int (*next)(int, mode_t);
    if (!next) next = (int (*)(int, mode_t))dlsym(RTLD_NEXT, "fchmod");
    const char *want = getenv("GS_TEST_CHMOD_PATH"), *go = getenv("GS_TEST_CHMOD_GO");
    struct stat a, b;
    if (want && go && stat(want, &b) == 0 && fstat(fd, &a) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) {
        touch("GS_TEST_CHMOD_HELD");
        for (int i = 0; i < 20000 && access(go, F_OK) != 0; i++) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    return next(fd, mode);
}

EXPORT int open(const char *path, int flags, ...)
{
    static int refused;
    int fd;
    GS_NEXT_OPEN(fd, path, flags);
    const char *want = getenv("GS_TEST_CHMOD_PATH");
    if (fd < 0 && errno == EACCES && !refused && want && strcmp(path, want) == 0) {
        int saved = errno;
        refused = 1;
        touch("GS_TEST_CHMOD_REFUSED");
        errno = saved;
    }
    return fd;
}
