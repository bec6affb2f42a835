/*
 * dlwrap.c - libgsdlwrap.so: a tool preloaded before the interposer that wraps dlsym
 * and forwards with dlvsym(RTLD_NEXT, "dlsym", GSDLWRAP_VERSION), the common idiom
 * (HAMi-core's): glibc's version GLIBC_2.34 unless GSDLWRAP_VERSION names another
 * (GLIBC_2.2.5).  A versioned lookup skips an unversioned definition, so it must find
 * the interposer's dlsym under that version, or the program's lookups of the driver
 * reach the driver itself.  Prints "dlwrap <calls> <whether the next dlsym is libc's>"
 * at exit.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn next;
static int calls;

__attribute__((visibility("default"))) void *dlsym(void *handle, const char *name)
{
    if (!next) {
        const char *v = getenv("GSDLWRAP_VERSION");
        next = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", v && *v ? v : "GLIBC_2.34");
        if (!next) abort();
    }
    calls++;
    return next(handle, name);
}

__attribute__((destructor)) static void report(void)
{
    Dl_info info;
    int libc = next && dladdr((void *)next, &info) && info.dli_fname && strstr(info.dli_fname, "libc.so");
    fprintf(stderr, "dlwrap %d %d\n", calls, libc);
}
