/*
 * mainexit - a CUDA program whose main thread ends with pthread_exit() while another thread
 * keeps running and holding device memory (legal: the process lives until its last thread
 * exits; the kernel then shows the thread-group leader as a zombie in /proc/<pid>/stat).
 *
 *   mainexit SIZE_MIB READY_FILE STOP_FILE
 * allocates SIZE_MIB, creates READY_FILE, pthread_exit()s the main thread; the worker waits
 * for STOP_FILE, frees and exits.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "../src/cuda_abi.h"

CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);

static CUdeviceptr p;
static CUcontext ctx;
static const char *stop;

static void *worker(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(ctx);
    while (access(stop, F_OK) != 0) usleep(5000);
    printf("free %d\n", cuMemFree_v2(p));
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 4) return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    stop = argv[3];
    cuInit(0);
    printf("ctx %d\n", cuDevicePrimaryCtxRetain(&ctx, 0));
    cuCtxSetCurrent(ctx);
    printf("alloc %d\n", cuMemAlloc_v2(&p, (size_t)atoll(argv[1]) << 20));
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    fclose(fopen(argv[2], "w"));
    pthread_exit(NULL); /* the process goes on in the worker */
}
