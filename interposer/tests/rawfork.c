/*
 * rawfork - allocate 1 GiB, then make a child with _Fork(), which runs no fork handlers (as a
 * raw clone() or a vfork() child does), and let the child exit(); print "child 0", then wait
 * for FILE to exist before exiting itself.
 *
 *   rawfork FILE
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_abi.h"

CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
pid_t _Fork(void);

int main(int argc, char **argv)
{
    CUcontext ctx;
    CUdeviceptr p;
    if (argc < 2 || cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS ||
        cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
        return 1;
    printf("alloc %d\n", cuMemAlloc_v2(&p, 1ull << 30));
    fflush(stdout);
    pid_t child = _Fork();
    if (child == 0) exit(0);
    int status = -1;
    waitpid(child, &status, 0);
    printf("child %d\n", status);
    fflush(stdout);
    struct stat st;
    while (stat(argv[1], &st) != 0) usleep(5000);
    return 0;
}
