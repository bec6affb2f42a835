/*
 * exitsignal - allocate and free 1 MiB in a loop until SIGALRM, whose handler calls exit(0)
 * (undefined behaviour, common in C programs): the library's exit destructor then runs on a
 * thread that may be inside the region's lock.
 *
 *   exitsignal MICROSECONDS
 */
#include <signal.h>
#include <stdlib.h>
#include <sys/time.h>

#include "cuda_abi.h"

CUresult cuInit(unsigned int flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);

static void leave(int sig)
{
    (void)sig;
    exit(0);
}

int main(int argc, char **argv)
{
    CUcontext ctx;
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS ||
        cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
        return 1;
    signal(SIGALRM, leave);
    struct itimerval when = {{0, 0}, {0, argc > 1 ? atol(argv[1]) : 20000}};
    setitimer(ITIMER_REAL, &when, NULL);
    for (;;) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, 1 << 20) == CUDA_SUCCESS) cuMemFree_v2(p);
    }
}
