/*
 * nocuda.c - a program that never loads libcuda, probing for it with dlsym
 * (RTLD_DEFAULT, RTLD_NEXT, the handle of dlopen(NULL): what Python's
 * ctypes.CDLL(None) looks names up in) and through a stub library's handle.
 * Prints "nocuda <default found> <next found> <main handle found> <stub's cuInit result>".
 * With a second argument (a libcuda), it then loads that globally and prints
 * "loaded <main handle's cuMemAlloc_v2 is RTLD_DEFAULT's> <found> <in libgpuslice>".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    void *d = dlsym(RTLD_DEFAULT, "cuInit");
    void *n = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    void *self = dlopen(NULL, RTLD_NOW);
    void *m = self ? dlsym(self, "cuInit") : NULL;
    int stub = -1;
    if (argc > 1) {
        void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        int (*init)(unsigned) = h ? (int (*)(unsigned))dlsym(h, "cuInit") : NULL;
        stub = init ? init(0) : -2;
    }
    printf("nocuda %d %d %d %d\n", d != NULL, n != NULL, m != NULL, stub);
    if (argc > 2 && dlopen(argv[2], RTLD_NOW | RTLD_GLOBAL)) {
        void *a = dlsym(self, "cuMemAlloc_v2");
        Dl_info info;
        /* by the file's name: the checkout's path may hold "gpuslice" (a clone of the repository) */
        const char *file = a && dladdr(a, &info) && info.dli_fname ? info.dli_fname : "";
        const char *slash = strrchr(file, '/');
        int ours = !strncmp(slash ? slash + 1 : file, "libgpuslice", 11);
        printf("loaded %d %d %d\n", a == dlsym(RTLD_DEFAULT, "cuMemAlloc_v2"), a != NULL, ours);
    }
    return 0;
}
