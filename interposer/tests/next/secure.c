/*
 * secure.c - installed set-user-ID root and run by another user (AT_SECURE), with the
 * interposer preloaded through /etc/ld.so.preload: loads argv[1] if given (the fake
 * driver's callback library, which its $ORIGIN run path cannot find in such a process),
 * then calls cuInit through the interposer's export.  Prints
 * "secure <AT_SECURE> <cuInit's result> <a libcuda.so.1 loaded>".  The caller's
 * environment must not choose what the library loads or which file it makes the region.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <sys/auxv.h>

extern int cuInit(unsigned flags) __attribute__((weak)); /* the interposer's, where it is loaded */

int main(int argc, char **argv)
{
    if (argc > 1 && !dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL)) fprintf(stderr, "secure: %s\n", dlerror());
    int rc = cuInit ? cuInit(0) : -1;
    int loaded = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) != NULL;
    printf("secure %lu %d %d\n", getauxval(AT_SECURE), rc, loaded);
    return 0;
}
