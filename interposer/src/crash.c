/*
 * crash.c - GPUSLICE_CRASH_REPORT=1: a process that dies of SIGSEGV, SIGBUS,
 * SIGILL, SIGFPE or SIGABRT first writes what killed it to stderr.
 *
 * For the GPU check (scripts/gpu-check.sh sets it in its children), where no
 * debugger runs: on 2026-12-04 every process under a compute limit died of
 * SIGSEGV on an H200 and the only clue was that the thread had no Python
 * frame.  Off unless the variable is set: a program's own signal handlers are
 * its business.  Installed when the library first resolves libcuda or NVML, so
 * programs that never touch them are untouched either way.
 *
 * The report, one line each, all prefixed "gpuslice: [pid] crash:":
 *   SIGSEGV (code 1) at 0x10 in thread 1234 'python3'
 *   libgpuslice.so at 0x7f.. (/path/libgpuslice.so)
 * then the thread's stack as glibc's backtrace_symbols_fd writes it, one
 * frame a line ("/path/libgpuslice.so(+0x1a2b)[0x7f..]": an offset in the
 * file, which `addr2line -f -e /path/libgpuslice.so 0x1a2b` names, the
 * library being built with -g).  The frames come through the signal frame, so
 * the faulting function is among the first few.
 *
 * Then the handler that was there before (Python's faulthandler, which dumps
 * every thread's Python stack) is put back and the signal raised again (a
 * fault: the handler returns and the instruction faults again, so that handler
 * sees the fault itself): the process still dies of it, with the same status.
 * The library's own threads get an alternate signal stack (the handler must run after a stack overflow,
 * which is how the sampler thread died); others use whatever they have.
 * Only async-signal-safe calls in the handler, backtrace() aside (loaded once
 * at installation, so that its first call in the handler does not dlopen).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gpuslice.h"

#define CRASH_ALTSTACK (64 * 1024)
#define CRASH_FRAMES 48

static const int crash_signals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
#define CRASH_NSIG (sizeof(crash_signals) / sizeof(crash_signals[0]))
static struct sigaction crash_previous[CRASH_NSIG];
static int crash_on;
static int crash_reporting; /* a second fault inside the handler goes straight to the old one */
static char crash_lib_line[512];
static size_t crash_lib_len;

/* ---- formatting without stdio ---------------------------------------------- */

struct crash_line {
    char buf[256];
    size_t len;
};

static void put_str(struct crash_line *l, const char *s)
{
    while (*s && l->len < sizeof(l->buf) - 1) l->buf[l->len++] = *s++;
}

static void put_num(struct crash_line *l, unsigned long long v, unsigned base)
{
    char digits[24];
    int n = 0;
    do {
        digits[n++] = "0123456789abcdef"[v % base];
        v /= base;
    } while (v && n < (int)sizeof(digits));
    if (base == 16) put_str(l, "0x");
    while (n > 0 && l->len < sizeof(l->buf) - 1) l->buf[l->len++] = digits[--n];
}

static void put_prefix(struct crash_line *l)
{
    put_str(l, "gpuslice: [");
    put_num(l, (unsigned long long)getpid(), 10);
    put_str(l, "] crash: ");
}

static void emit(struct crash_line *l)
{
    l->buf[l->len++] = '\n';
    ssize_t w = write(STDERR_FILENO, l->buf, l->len);
    (void)w;
}

static const char *signal_name(int sig)
{
    switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGILL: return "SIGILL";
    case SIGFPE: return "SIGFPE";
    case SIGABRT: return "SIGABRT";
    default: return "signal";
    }
}

/* ---- the handler ------------------------------------------------------------ */

static void put_back(int sig)
{
    for (size_t i = 0; i < CRASH_NSIG; i++)
        if (crash_signals[i] == sig) sigaction(sig, &crash_previous[i], NULL);
}

static void crash_handler(int sig, siginfo_t *info, void *uc)
{
    (void)uc;
    int saved = errno;
    /* the handler that was there before is back first, and the signal open while the report is
     * written: a fault in the report itself (the unwinder reading a smashed stack's frames) goes
     * to it.  Blocked, as a handler's own signal is, it made the kernel kill the process there,
     * and the program's handler (Python's faulthandler) never ran (`test_crash_report.py -k
     * unwinds`) */
    put_back(sig);
    if (!__atomic_exchange_n(&crash_reporting, 1, __ATOMIC_ACQ_REL)) {
        sigset_t own;
        sigemptyset(&own);
        sigaddset(&own, sig);
        pthread_sigmask(SIG_UNBLOCK, &own, NULL);
        struct crash_line l = {.len = 0};
        char name[17] = {0};
        prctl(PR_GET_NAME, name, 0, 0, 0);
        put_prefix(&l);
        put_str(&l, signal_name(sig));
        put_str(&l, " (code ");
        put_num(&l, info ? (unsigned long long)(long long)info->si_code : 0, 10);
        put_str(&l, ") at ");
        put_num(&l, info ? (unsigned long long)(uintptr_t)info->si_addr : 0, 16);
        put_str(&l, " in thread ");
        put_num(&l, (unsigned long long)syscall(SYS_gettid), 10);
        put_str(&l, " '");
        put_str(&l, name);
        put_str(&l, "'");
        emit(&l);
        if (crash_lib_len) {
            ssize_t w = write(STDERR_FILENO, crash_lib_line, crash_lib_len);
            (void)w;
        }
        void *frames[CRASH_FRAMES];
        int n = backtrace(frames, CRASH_FRAMES);
        if (n > 0) backtrace_symbols_fd(frames, n, STDERR_FILENO);
        pthread_sigmask(SIG_BLOCK, &own, NULL);
    }
    /* that handler takes it from here, or the default action: the process dies of the signal
     * all the same.  A fault (the kernel's, si_code > 0) happens again as this handler returns,
     * and that handler gets it with its own address and context: given a raise() instead
     * (SI_TKILL, no address), one that recovers from faults of its own (a guard page, a
     * runtime's null check) took it for another and died (`test_crash_report.py -k recovers`).
     * One sent (kill, raise, abort) or that would not recur (an asynchronous machine-check) is
     * sent again, pending until this handler returns */
    if (!info || info->si_code <= 0 || sig == SIGABRT || (sig == SIGBUS && info->si_code == BUS_MCEERR_AO))
        raise(sig);
    errno = saved;
}

/* ---- installation ----------------------------------------------------------- */

/* An alternate signal stack for the calling thread, unless it has one (the library's threads;
 * the thread that installs the handler).  Never freed: a thread's is in use until it ends, and
 * there are two or three. */
static void give_altstack(void)
{
    stack_t old;
    if (sigaltstack(NULL, &old) == 0 && !(old.ss_flags & SS_DISABLE)) return;
    stack_t st = {.ss_sp = malloc(CRASH_ALTSTACK), .ss_size = CRASH_ALTSTACK, .ss_flags = 0};
    if (st.ss_sp && sigaltstack(&st, NULL) != 0) free(st.ss_sp);
}

static void install(void)
{
    const char *v = gs_getenv("GPUSLICE_CRASH_REPORT");
    if (!v || !*v || strcmp(v, "0") == 0) return;
    void *warm[2];
    (void)backtrace(warm, 2); /* loads the unwinder now, not inside the handler */
    Dl_info self;
    if (dladdr((void *)install, &self) && self.dli_fname) {
        struct crash_line l = {.len = 0};
        put_prefix(&l);
        put_str(&l, "libgpuslice.so at ");
        put_num(&l, (unsigned long long)(uintptr_t)self.dli_fbase, 16);
        put_str(&l, " (");
        put_str(&l, self.dli_fname);
        put_str(&l, ")");
        l.buf[l.len++] = '\n';
        memcpy(crash_lib_line, l.buf, l.len);
        crash_lib_len = l.len;
    }
    give_altstack();
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = crash_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < CRASH_NSIG; i++) sigaction(crash_signals[i], &sa, &crash_previous[i]);
    __atomic_store_n(&crash_on, 1, __ATOMIC_RELEASE);
    GS_INFO("crash report on (GPUSLICE_CRASH_REPORT)");
}

static pthread_once_t crash_once = PTHREAD_ONCE_INIT;

void gs_crash_install(void)
{
    pthread_once(&crash_once, install);
}

void gs_crash_thread_start(void)
{
    if (__atomic_load_n(&crash_on, __ATOMIC_ACQUIRE)) give_altstack();
}
