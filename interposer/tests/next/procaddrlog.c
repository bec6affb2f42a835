/*
 * procaddrlog.c - libgsprocaddrlog.so: preloaded before the interposer (or alone), it records
 * what a program is handed by cuGetProcAddress / cuGetProcAddress_v2, as the CUDA runtime
 * receives it.  It wraps dlsym (forwarding with dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34"), as
 * dlwrap.c does): the program's dlsym of "cuGetProcAddress[_v2]" gets a wrapper around what the
 * next dlsym answered (the interposer's hook, or the driver's function without it), and so does
 * a cuGetProcAddress request for "cuGetProcAddress" itself (the runtime asks for it again).
 * Each request the wrapper forwards is appended to GSPROCADDR_LOG as one line:
 *   "<symbol> <cudaVersion> <flags> <rc> <status> <file> <name>" (symbol "" written as two quotes)
 * <file> the basename of the object the answer lies in, <name> the exported symbol at exactly
 * that address ("-" for none: not an export, or no answer); <status> -1 where the caller passed
 * no symbolStatus (cuGetProcAddress) or the v2 entry point was not used.
 * Every dlsym of a "cu*" name is logged as "dlsym <name> <file> <symbol>".  Test-only.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long cuuint64_t;
typedef CUresult (*procaddr_v1)(const char *, void **, int, cuuint64_t);
typedef CUresult (*procaddr_v2)(const char *, void **, int, cuuint64_t, int *);
typedef void *(*dlsym_fn)(void *, const char *);

static dlsym_fn next_dlsym;
static procaddr_v1 real_v1;
static procaddr_v2 real_v2;

static void emit(const char *fmt, ...)
{
    const char *path = getenv("GSPROCADDR_LOG");
    if (!path || !*path) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    if (n <= 0) return;
    if ((size_t)n >= sizeof(line)) n = (int)sizeof(line) - 1;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return;
    (void)!write(fd, line, (size_t)n);
    close(fd);
}

static void where(void *p, const char **file, const char **name)
{
    Dl_info info;
    *file = "-";
    *name = "-";
    if (!p || !dladdr(p, &info)) return;
    if (info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        *file = slash ? slash + 1 : info.dli_fname;
    }
    if (info.dli_sname && info.dli_saddr == p) *name = info.dli_sname;
}

static CUresult wrap_v1(const char *symbol, void **pfn, int version, cuuint64_t flags);
static CUresult wrap_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status);

/* a procedure-address function handed to the program: remember it, hand out our wrapper */
static void *wrap(void *fn)
{
    const char *file, *name;
    where(fn, &file, &name);
    if (!fn) return fn;
    if (strcmp(name, "cuGetProcAddress_v2") == 0) {
        real_v2 = (procaddr_v2)fn;
        return (void *)wrap_v2;
    }
    if (strcmp(name, "cuGetProcAddress") == 0) {
        real_v1 = (procaddr_v1)fn;
        return (void *)wrap_v1;
    }
    return fn;
}

static void record(const char *symbol, void **pfn, int version, cuuint64_t flags, CUresult rc, int status)
{
    const char *file, *name;
    void *got = rc == 0 && pfn ? *pfn : NULL;
    where(got, &file, &name);
    const char *shown = !symbol ? "(null)" : symbol[0] ? symbol : "\"\"";
    emit("%s %d %llu %d %d %s %s\n", shown, version, (unsigned long long)flags, rc, status, file, name);
    if (got && symbol && strcmp(symbol, "cuGetProcAddress") == 0) *pfn = wrap(got);
}

static CUresult wrap_v1(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    CUresult rc = real_v1(symbol, pfn, version, flags);
    record(symbol, pfn, version, flags, rc, -1);
    return rc;
}

static CUresult wrap_v2(const char *symbol, void **pfn, int version, cuuint64_t flags, int *status)
{
    int own = -1;
    CUresult rc = real_v2(symbol, pfn, version, flags, status ? status : &own);
    record(symbol, pfn, version, flags, rc, status ? *status : own);
    return rc;
}

__attribute__((visibility("default"))) void *dlsym(void *handle, const char *name)
{
    if (!next_dlsym) {
        next_dlsym = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!next_dlsym) abort();
    }
    void *r = next_dlsym(handle, name);
    const char *n = name; /* declared nonnull; callers still pass NULL sometimes */
    __asm__("" : "+r"(n));
    if (n && n[0] == 'c' && n[1] == 'u') {
        const char *file, *sname;
        where(r, &file, &sname);
        emit("dlsym %s %s %s\n", n, file, sname);
        r = wrap(r);
    }
    return r;
}
