/*
 * nextopen.h - for the test preloads that override open(2): the next open in the lookup order
 * (the interposer's, libc's), called with the path, the flags and, where open takes one, the
 * mode the caller passed.
 */
#ifndef GS_TEST_NEXTOPEN_H
#define GS_TEST_NEXTOPEN_H

#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <sys/types.h>

/* Inside `int open(const char *path, int flags, ...)`: `fd` gets the next open's answer */
#define GS_NEXT_OPEN(fd, path, flags)                                                       \
    do {                                                                                    \
        static int (*next_)(const char *, int, ...);                                        \
        if (!next_) next_ = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, "open");      \
        mode_t mode_ = 0;                                                                   \
        if ((flags) & (O_CREAT | O_TMPFILE)) {                                              \
            va_list ap_;                                                                    \
            va_start(ap_, flags);                                                           \
            mode_ = (mode_t)va_arg(ap_, int);                                               \
            va_end(ap_);                                                                    \
        }                                                                                   \
        (fd) = next_((path), (flags), mode_);                                               \
    } while (0)

#endif
