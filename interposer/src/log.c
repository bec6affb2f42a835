/*
 * log.c - logging (one write(2) per line, "gpuslice:" prefix, stderr), the
 * library constructor, fork handling, the version export and time helpers.
 *
 * LIBCUDA_LOG_LEVEL: 0 errors, 1 warnings (default), 2 info, 3+ debug.
 * The constructor only reads the log level: no dlopen, no files, so programs
 * that never touch CUDA (shells, ls, python) do not notice the library.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gpuslice.h"

int gs_log_level = GS_LOG_WARN;

static const char *const level_names[] = {"error", "warning", "info", "debug"};

/* A value the constructor could not use, said at the first CUDA call (gs_log_report_level): the
 * constructor says nothing, as programs that never touch CUDA must not notice the library */
static char g_bad_level[24];

void gs_log_init(void)
{
    const char *v = gs_getenv("LIBCUDA_LOG_LEVEL");
    if (v && *v) {
        char *end = NULL;
        long lvl = strtol(v, &end, 10);
        if (end && *end == '\0' && lvl >= 0 && end != v)
            gs_log_level = lvl > GS_LOG_DEBUG ? GS_LOG_DEBUG : (int)lvl;
        else
            snprintf(g_bad_level, sizeof(g_bad_level), "%s", v);
    }
}

void gs_log_report_level(void)
{
    if (g_bad_level[0]) GS_ERROR("ignoring LIBCUDA_LOG_LEVEL value '%s' (expected 0..3)", g_bad_level);
}

/* Lines written while the region's lock is held wait here for its unlock (gs_log_defer, inline
 * in gpuslice.h): a write to a full stderr pipe would otherwise hold every process of the
 * container.  The few such lines (a repair, a reclaim) fit; more are dropped. */
#define GS_LOG_PENDING 2048
__thread int gs_t_log_defer;
__thread char *gs_t_log_pending;
static __thread size_t t_pending_len;

static void keep(const char *line, size_t len)
{
    if (!gs_t_log_pending) gs_t_log_pending = malloc(GS_LOG_PENDING);
    if (!gs_t_log_pending || len > GS_LOG_PENDING - t_pending_len) return;
    memcpy(gs_t_log_pending + t_pending_len, line, len);
    t_pending_len += len;
}

/* To stderr, without SIGPIPE: where its reader has gone, a line of ours killed a program that
 * never writes there itself (a bad limit value was enough).  The signal our write raises is
 * taken back unless one was pending already; the line is lost, as any write to such a pipe. */
static void write_stderr(const void *buf, size_t len)
{
    sigset_t pipe_set, old, pending;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    int was_pending = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE);
    ssize_t w = write(STDERR_FILENO, buf, len);
    if (w < 0 && errno == EPIPE && !was_pending) {
        struct timespec none = {0, 0};
        while (sigtimedwait(&pipe_set, NULL, &none) < 0 && errno == EINTR) {
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

void gs_log_write(int level, const char *fmt, ...)
{
    char buf[512];
    int saved = errno;
    int n = snprintf(buf, sizeof(buf), "gpuslice: [%d] %s: ", (int)getpid(),
                     level_names[level < 0 ? 0 : level > GS_LOG_DEBUG ? GS_LOG_DEBUG : level]);
    if (n < 0) n = 0;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof(buf) - 2) len = sizeof(buf) - 2;
    buf[len++] = '\n';
    if (gs_t_log_defer) {
        keep(buf, len);
    } else {
        write_stderr(buf, len);
    }
    errno = saved;
}

void gs_log_flush(void)
{
    if (!gs_t_log_pending) return;
    int saved = errno;
    write_stderr(gs_t_log_pending, t_pending_len);
    free(gs_t_log_pending);
    gs_t_log_pending = NULL;
    t_pending_len = 0;
    errno = saved;
}

GS_EXPORT const char *gpuslice_version(void)
{
    return GS_VERSION;
}

uint64_t gs_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void gs_sleep_ns(uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void fork_prepare(void)
{
    gs_am_lock();
}

static void fork_parent(void)
{
    gs_am_unlock();
}

static void fork_child(void)
{
    /* The child holds none of the parent's device memory (a CUDA context does
     * not survive fork) and must register as a process of its own. */
    gs_am_after_fork_child(); /* releases what fork_prepare took */
    /* A parent that never resolved libcuda or NVML has touched nothing else (every hook resolves
     * first): its tables are as loaded.  Clearing them faulted in 530 KiB of zero pages and
     * took 0.4 ms in each fork of every program of the container (tests/next/forkrss.c). */
    if (!__atomic_load_n(&gs_cuda_resolved, __ATOMIC_ACQUIRE) && !__atomic_load_n(&gs_nvml_resolved, __ATOMIC_ACQUIRE))
        return;
    gs_pools_after_fork_child();
    gs_launch_after_fork_child();
    gs_graphmem_after_fork_child();
    gs_limits_after_fork_child();
    gs_lmem_after_fork_child();
    gs_context_after_fork_child();
    gs_reconcile_after_fork_child();
    gs_region_after_fork_child();
}

__attribute__((constructor)) static void gs_constructor(void)
{
    gs_log_init();
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}
