/*
 * launchprobe - launch patterns that once escaped the compute limit (CUDA_DEVICE_SM_LIMIT),
 * run against the fake driver; each prints "MODE rc=RC launches=N share=S%" where S is the
 * fake GPU's kernel time (or, across processes, the kernels launched times FAKE_CUDA_KERNEL_US)
 * over the wall time.
 *
 *   launchprobe segs SECONDS PER      stream A: graphs of PER kernels, each waited for; a thread
 *                                     launches one kernel on stream B every GAP_US (if set)
 *   launchprobe holders SECONDS N     N streams each held by a stream wait (FAKE_WAIT_MS) with
 *                                     one kernel behind it; then kernels on one more stream
 *   launchprobe ctxloop SECONDS PER   create a context, launch PER kernels, wait for them
 *                                     without a hooked synchronisation, destroy the context
 *   launchprobe exitloop SECONDS PER  a child per job: PER kernels, a wait without a hooked
 *                                     synchronisation, TAIL_MS of host work (if set), exit
 *   launchprobe noctx SECONDS         kernels on a stream of the primary context launched
 *                                     from a thread with no current context
 *   launchprobe stale SECONDS         one kernel, 5.2 s idle, a kernel on a stream held by a
 *                                     stream wait (FAKE_WAIT_MS), 5.2 s idle, then kernels on
 *                                     the first stream (the share is theirs)
 *   launchprobe hostheld SECONDS MS   a kernel behind a stream wait (FAKE_WAIT_MS), MS of host
 *                                     work, a second kernel on that stream (how long its launch
 *                                     took: held_ms=, after the share), then kernels on another
 *                                     stream (the share is theirs)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../src/cuda_abi.h"

CUresult cuInit(unsigned flags);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned flags, CUdevice dev);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuStreamCreate(CUstream *stream, unsigned flags);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuStreamWaitValue32_v2(CUstream stream, CUdeviceptr addr, uint32_t value, unsigned flags);
CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream);
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream stream, void **params, void **extra);
uint64_t fake_cuda_kernel_ns(void);

#define KERNEL ((CUfunction)0x1234)

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static double kernel_us(void)
{
    const char *v = getenv("FAKE_CUDA_KERNEL_US");
    return v ? atof(v) : 10;
}

static CUresult launch(CUstream s)
{
    return cuLaunchKernel(KERNEL, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
}

/* Kernels on stream w for `secs` from now (*t0, *end set), counted in *n, until one fails. */
static CUresult launch_for(CUstream w, double secs, uint64_t *t0, uint64_t *end, uint64_t *n)
{
    CUresult rc = CUDA_SUCCESS;
    *t0 = now_ns();
    *end = *t0 + (uint64_t)(secs * 1e9);
    while (now_ns() < *end && !rc) {
        rc = launch(w);
        (*n)++;
    }
    return rc;
}

static CUcontext g_ctx;
static uint64_t g_end, g_b_launches;

static void *b_thread(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(g_ctx);
    CUstream b;
    cuStreamCreate(&b, 1);
    useconds_t gap = (useconds_t)atoi(getenv("GAP_US"));
    while (now_ns() < g_end) {
        if (launch(b)) break;
        g_b_launches++;
        usleep(gap);
    }
    cuStreamSynchronize(b);
    return NULL;
}

/* A stream held by a stream wait, and a kernel behind it */
static void *held_thread(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(g_ctx);
    CUstream h;
    if (!cuStreamCreate(&h, 1) && !cuStreamWaitValue32_v2(h, 0, 1, 0)) launch(h);
    return NULL;
}

static CUcontext primary(void)
{
    CUcontext c;
    cuInit(0);
    cuDevicePrimaryCtxRetain(&c, 0);
    cuCtxSetCurrent(c);
    return c;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: launchprobe MODE SECONDS [N]\n");
        return 2;
    }
    const char *mode = argv[1];
    double secs = atof(argv[2]);
    int per = argc > 3 ? atoi(argv[3]) : 1;
    uint64_t t0 = now_ns(), end = t0 + (uint64_t)(secs * 1e9), n = 0, k0 = 0, held_ns = 0;
    int from_fake = 0; /* the share from the fake's kernel time, else from the launch count */
    CUresult rc = CUDA_SUCCESS;
    if (!strcmp(mode, "segs")) {
        g_ctx = primary();
        g_end = end;
        k0 = fake_cuda_kernel_ns();
        from_fake = 1;
        pthread_t th;
        int threaded = getenv("GAP_US") != NULL;
        if (threaded) pthread_create(&th, NULL, b_thread, NULL);
        CUstream a;
        cuStreamCreate(&a, 1);
        while (now_ns() < end && !rc) {
            rc = cuGraphLaunch((CUgraphExec)(uintptr_t)per, a);
            if (!rc) rc = cuStreamSynchronize(a);
            n += (uint64_t)per;
        }
        if (threaded) pthread_join(th, NULL);
        n += g_b_launches;
    } else if (!strcmp(mode, "holders")) {
        primary();
        for (int i = 0; i < per && !rc; i++) {
            CUstream h;
            rc = cuStreamCreate(&h, 1);
            if (!rc) rc = cuStreamWaitValue32_v2(h, 0, 1, 0);
            if (!rc) rc = launch(h);
        }
        CUstream w;
        cuStreamCreate(&w, 1);
        if (!rc) rc = launch_for(w, secs, &t0, &end, &n);
        cuStreamSynchronize(w);
    } else if (!strcmp(mode, "ctxloop")) {
        cuInit(0);
        while (now_ns() < end && !rc) {
            CUcontext c;
            rc = cuCtxCreate_v2(&c, 0, 0);
            if (rc) break;
            for (int i = 0; i < per && !rc; i++, n++) rc = launch(NULL);
            usleep((useconds_t)(kernel_us() * per)); /* the work runs; cuCtxDestroy waits for it */
            CUresult d = cuCtxDestroy_v2(c);
            if (!rc) rc = d;
        }
    } else if (!strcmp(mode, "exitloop")) {
        while (now_ns() < end && !rc) {
            pid_t p = fork();
            if (!p) {
                primary();
                CUresult r = CUDA_SUCCESS;
                for (int i = 0; i < per && !r; i++) r = launch(NULL);
                usleep((useconds_t)(kernel_us() * per)); /* waits for the GPU, unhooked */
                const char *tail = getenv("TAIL_MS"); /* then host work before the exit */
                if (tail) usleep((useconds_t)atoi(tail) * 1000);
                exit(r ? 1 : 0);
            }
            int st = 0;
            waitpid(p, &st, 0);
            if (!WIFEXITED(st) || WEXITSTATUS(st)) rc = (CUresult)999;
            n += (uint64_t)per;
        }
    } else if (!strcmp(mode, "noctx")) {
        CUcontext c = primary();
        CUstream w;
        cuStreamCreate(&w, 1);
        cuCtxSetCurrent(NULL);
        rc = launch_for(w, secs, &t0, &end, &n);
        cuCtxSetCurrent(c);
        cuStreamSynchronize(w);
    } else if (!strcmp(mode, "stale")) {
        /* the throttle's timeline of the context takes a reference event every 5 s, recorded
         * after a launch; this one's comes after a launch held by a stream wait */
        g_ctx = primary();
        CUstream w;
        rc = cuStreamCreate(&w, 1);
        if (!rc) rc = launch(w);
        if (!rc) rc = cuStreamSynchronize(w);
        usleep(5200000);
        pthread_t th; /* the fake driver holds a launch while its stream's queue is that long */
        pthread_create(&th, NULL, held_thread, NULL);
        pthread_detach(th);
        usleep(5200000);
        if (!rc) rc = launch_for(w, secs, &t0, &end, &n);
        cuStreamSynchronize(w);
    } else if (!strcmp(mode, "hostheld")) {
        /* the flag the wait is for would be set by the host after the second launch returns */
        primary();
        CUstream h, w;
        rc = cuStreamCreate(&h, 1);
        if (!rc) rc = cuStreamWaitValue32_v2(h, 0, 1, 0);
        if (!rc) rc = launch(h);
        usleep((useconds_t)per * 1000);
        uint64_t h0 = now_ns();
        if (!rc) rc = launch(h);
        held_ns = now_ns() - h0;
        if (!rc) rc = cuStreamCreate(&w, 1);
        if (!rc) rc = launch_for(w, secs, &t0, &end, &n);
        cuStreamSynchronize(w);
    } else {
        fprintf(stderr, "launchprobe: unknown mode %s\n", mode);
        return 2;
    }
    uint64_t wall = now_ns() - t0;
    double busy = from_fake ? (double)(fake_cuda_kernel_ns() - k0) : (double)n * kernel_us() * 1000;
    printf("%s rc=%d launches=%llu share=%.1f%%", mode, rc, (unsigned long long)n, 100.0 * busy / (double)wall);
    if (held_ns) printf(" held_ms=%llu", (unsigned long long)(held_ns / 1000000));
    printf("\n");
    return 0;
}
