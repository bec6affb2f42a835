/*
 * capturerace - global-mode stream captures while another thread launches under a compute
 * limit (what PyTorch does: torch.cuda.graph captures in global mode while other threads
 * may still launch).  A throttled launch that waits for budget must not query events once a
 * capture has begun: in global mode the driver forbids that in every thread, and the capture
 * is invalidated.
 *
 *   capturerace ROUNDS HOLD_MS [v1]
 * prints "captures ROUNDS invalidated N launcherrors M".  With v1 the captures begin with
 * CUDA 10.0's cuStreamBeginCapture (global mode, no mode argument), as old binaries do.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "../src/cuda_abi.h"

CUresult cuInit(unsigned flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuStreamBeginCapture(CUstream stream);
CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode);
CUresult cuStreamEndCapture(CUstream stream, CUgraph *graph);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream stream, void **params, void **extra);

#define KERNEL ((CUfunction)0x1234)

static CUcontext ctx;
static volatile int stop;
static int launch_errors;

static CUresult launch(CUstream stream)
{
    return cuLaunchKernel(KERNEL, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
}

/* Launches on a stream of its own until told to stop. */
static void *launcher(void *arg)
{
    (void)arg;
    CUstream stream = NULL;
    cuCtxSetCurrent(ctx);
    cuStreamCreate(&stream, 0);
    while (!stop)
        if (launch(stream) != CUDA_SUCCESS) launch_errors++;
    cuStreamSynchronize(stream);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: capturerace ROUNDS HOLD_MS\n");
        return 2;
    }
    int rounds = atoi(argv[1]), hold_ms = atoi(argv[2]), invalidated = 0;
    int v1 = argc > 3 && argv[3][0] == 'v' && argv[3][1] == '1';
    if (cuInit(0) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctx, 0) != CUDA_SUCCESS) return 1;
    cuCtxSetCurrent(ctx);
    pthread_t thread;
    if (pthread_create(&thread, NULL, launcher, NULL) != 0) return 1;
    usleep(200000); /* the launcher is waiting for budget by now */
    for (int r = 0; r < rounds; r++) {
        CUstream stream = NULL;
        CUgraph graph = NULL;
        cuStreamCreate(&stream, 0);
        CUresult begun = v1 ? cuStreamBeginCapture(stream)
                            : cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
        launch(stream);
        usleep((useconds_t)hold_ms * 1000);
        CUresult ended = cuStreamEndCapture(stream, &graph);
        if (begun != CUDA_SUCCESS || ended != CUDA_SUCCESS) invalidated++;
        usleep(20000);
    }
    stop = 1;
    pthread_join(thread, NULL);
    printf("captures %d invalidated %d launcherrors %d\n", rounds, invalidated, launch_errors);
    return 0;
}
