/*
 * nocuda.c - a program that never loads libcuda, probing for it with dlsym
 * (RTLD_DEFAULT, RTLD_NEXT) and through a stub library's handle.  Prints
 * "nocuda <default found> <next found> <stub's cuInit result>".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv)
{
    void *d = dlsym(RTLD_DEFAULT, "cuInit");
    void *n = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    int stub = -1;
    if (argc > 1) {
        void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
        int (*init)(unsigned) = h ? (int (*)(unsigned))dlsym(h, "cuInit") : NULL;
        stub = init ? init(0) : -2;
    }
    printf("nocuda %d %d %d\n", d != NULL, n != NULL, stub);
    return 0;
}
