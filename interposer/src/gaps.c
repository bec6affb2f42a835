/*
 * gaps.c - work between kernels, for the compute limit: copies, host
 * functions, waits, and their hooks.
 *
 * An interval runs from one event of the stream to the next, so whatever the stream did between
 * two launches was charged as kernel time: an async copy on a copy engine, a host function, a
 * wait for another stream's event or for a flag.  A 2 ms cuMemcpyHtoDAsync before each 2 ms
 * kernel got 16.8 % of kernel time at a 30 % limit (`test_throttle.py -k copies_host`: now
 * 30.7 %).  The hooks of those calls (with a limit)
 * mark the stream here, and its next launch records an event right before the kernel: the
 * interval up to it (a gap) is not charged.  One bit per stream key hash: a collision marks
 * another stream too (its next launch records an event it did not need: the gap it ends is idle
 * time, or nothing) or takes another's mark (that stream's gap is charged, as before).
 */
#define _GNU_SOURCE
#include "throttle.h"

uint64_t thr_gap_bits[GS_GAP_BITS / 64];   /* a copy, host function or wait since the last launch */
uint64_t thr_block_bits[GS_GAP_BITS / 64]; /* a memset since the last launch: no gap may end */

static void bits_set(uint64_t *bits, CUstream stream, int per_thread)
{
    unsigned b =
        (unsigned)(gs_hash_step(0, thr_stream_key(gs_effective_stream(stream, per_thread))) & (GS_GAP_BITS - 1));
    uint64_t bit = 1ull << (b & 63);
    if (!(__atomic_load_n(&bits[b >> 6], __ATOMIC_RELAXED) & bit)) __atomic_fetch_or(&bits[b >> 6], bit, __ATOMIC_RELAXED);
}

/* Whether the stream's bit was set since its last launch (and the bit cleared) */
static int bits_take(uint64_t *bits, uint64_t key)
{
    unsigned b = (unsigned)(gs_hash_step(0, key) & (GS_GAP_BITS - 1));
    uint64_t bit = 1ull << (b & 63);
    return (__atomic_load_n(&bits[b >> 6], __ATOMIC_RELAXED) & bit) &&
           (__atomic_fetch_and(&bits[b >> 6], ~bit, __ATOMIC_RELAXED) & bit);
}

static void gap_mark(CUstream stream, int per_thread)
{
    bits_set(thr_gap_bits, stream, per_thread);
}

static void gap_block(CUstream stream, int per_thread)
{
    bits_set(thr_block_bits, stream, per_thread);
}

/* A busy stream had other work queued since its last launch: an event right before this one
 * ends the gap, so that the kernel's interval starts after it */
static void gap_end_locked(struct tstream *s, const struct measured *m)
{
    if (s->count >= GS_RING) return; /* full: the gap is charged, as before */
    /* a kernel whose end event could not be recorded would fall into the gap (a review's find,
     * with a failing record: `test_throttle.py -k no_gap_after_a_failed_record`) */
    if (s->unended) return;
    CUevent g = thr_take_event(s);
    if (!g || gs_cuda.cuEventRecord(g, m->es) != CUDA_SUCCESS) {
        thr_drop_event(g);
        return;
    }
    int tail = (s->head + s->count) % GS_RING;
    s->ring[tail] = g;
    s->launches[tail] = 0;
    s->fn[tail] = s->est[tail] = 0;
    s->unknown[tail] = 0;
    s->rec_ns[tail] = gs_now_ns();
    s->count++;
    s->gaps++;
}

/* Right before the launch (thr_mu held, the stream's context current): an idle stream starts a
 * new interval here, so idle time is not counted; if that fails, no interval starts before the
 * next measured event.  A busy one after a copy, host function or wait ends that gap here.
 * Neither while another thread's launch on the stream is between its begin and its end's record:
 * its kernel may be queued already, and an event recorded now would come after it, so the kernel
 * would fall into the gap or before the new interval's start (charged nothing; found reviewing
 * the gaps: two threads on one stream, `test_throttle.py -k racing_on_one_stream`). */
void thr_begin_locked(struct measured *m)
{
    int blocked = bits_take(thr_block_bits, m->key), gap = bits_take(thr_gap_bits, m->key) && !blocked;
    struct tstream *s = thr_stream_get_locked(m->key, m->ctx, m->slot);
    if (!s) return;
    int racing = s->launching++;
    m->begun = 1;
    if (racing) return; /* its interval (a start, or the last end) stands; a gap stays charged */
    if (s->count) {
        if (gap) gap_end_locked(s, m);
        return;
    }
    thr_line_reference_locked(m->ctx, m->es, gs_now_ns());
    CUevent start = thr_take_event(s);
    thr_give_event(s, s->mark);
    s->mark = NULL;
    s->mark_ns = 0; /* no interval: nothing to advance against until one starts */
    if (start && gs_cuda.cuEventRecord(start, m->es) == CUDA_SUCCESS) {
        s->mark = start;
        s->mark_ns = gs_now_ns();
    } else {
        thr_drop_event(start);
    }
}

/* Copies, host functions and waits: with a compute limit the stream is marked, so that its next
 * launch ends the gap they leave between its kernels (gap_mark). */
#define GS_GAP_HOOK(name, params, args, pt)                                                                   \
    GS_AFTER_HOOK(name, params, args, if (rc == CUDA_SUCCESS && throttle_on()) gap_mark(hStream, pt))
/* the shapes: n arguments, then the stream; the stream, then n arguments */
#define GS_GAP_1(name, pt, A) GS_GAP_HOOK(name, (A a, CUstream hStream), (a, hStream), pt)
#define GS_GAP_2(name, pt, A, B) GS_GAP_HOOK(name, (A a, B b, CUstream hStream), (a, b, hStream), pt)
#define GS_GAP_3(name, pt, A, B, C) GS_GAP_HOOK(name, (A a, B b, C c, CUstream hStream), (a, b, c, hStream), pt)
#define GS_GAP_4(name, pt, A, B, C, D)                                                                        \
    GS_GAP_HOOK(name, (A a, B b, C c, D d, CUstream hStream), (a, b, c, d, hStream), pt)
#define GS_GAP_5(name, pt, A, B, C, D, E)                                                                     \
    GS_GAP_HOOK(name, (A a, B b, C c, D d, E e, CUstream hStream), (a, b, c, d, e, hStream), pt)
#define GS_GAP_7(name, pt, A, B, C, D, E, F, G)                                                               \
    GS_GAP_HOOK(name, (A a, B b, C c, D d, E e, F f, G g, CUstream hStream), (a, b, c, d, e, f, g, hStream), pt)
#define GS_GAP_8(name, pt, A, B, C, D, E, F, G, H)                                                            \
    GS_GAP_HOOK(name, (A a, B b, C c, D d, E e, F f, G g, H h, CUstream hStream), (a, b, c, d, e, f, g, h, hStream), \
                pt)
#define GS_STREAM_GAP_2(name, pt, A, B) GS_GAP_HOOK(name, (CUstream hStream, A a, B b), (hStream, a, b), pt)
#define GS_STREAM_GAP_3(name, pt, A, B, C)                                                                    \
    GS_GAP_HOOK(name, (CUstream hStream, A a, B b, C c), (hStream, a, b, c), pt)

GS_GAP_3(cuMemcpyAsync, 0, CUdeviceptr, CUdeviceptr, size_t)
GS_GAP_3(cuMemcpyAsync_ptsz, 1, CUdeviceptr, CUdeviceptr, size_t)
GS_GAP_5(cuMemcpyPeerAsync, 0, CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t)
GS_GAP_5(cuMemcpyPeerAsync_ptsz, 1, CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t)
GS_GAP_3(cuMemcpyHtoDAsync, 0, unsigned int, const void *, unsigned int) /* CUDA 2.x: 32-bit */
GS_GAP_3(cuMemcpyHtoDAsync_v2, 0, CUdeviceptr, const void *, size_t)
GS_GAP_3(cuMemcpyHtoDAsync_v2_ptsz, 1, CUdeviceptr, const void *, size_t)
GS_GAP_3(cuMemcpyDtoHAsync, 0, void *, unsigned int, unsigned int)
GS_GAP_3(cuMemcpyDtoHAsync_v2, 0, void *, CUdeviceptr, size_t)
GS_GAP_3(cuMemcpyDtoHAsync_v2_ptsz, 1, void *, CUdeviceptr, size_t)
GS_GAP_3(cuMemcpyDtoDAsync, 0, unsigned int, unsigned int, unsigned int)
GS_GAP_3(cuMemcpyDtoDAsync_v2, 0, CUdeviceptr, CUdeviceptr, size_t)
GS_GAP_3(cuMemcpyDtoDAsync_v2_ptsz, 1, CUdeviceptr, CUdeviceptr, size_t)
GS_GAP_4(cuMemcpyHtoAAsync, 0, CUarray, unsigned int, const void *, unsigned int)
GS_GAP_4(cuMemcpyHtoAAsync_v2, 0, CUarray, size_t, const void *, size_t)
GS_GAP_4(cuMemcpyHtoAAsync_v2_ptsz, 1, CUarray, size_t, const void *, size_t)
GS_GAP_4(cuMemcpyAtoHAsync, 0, void *, CUarray, unsigned int, unsigned int)
GS_GAP_4(cuMemcpyAtoHAsync_v2, 0, void *, CUarray, size_t, size_t)
GS_GAP_4(cuMemcpyAtoHAsync_v2_ptsz, 1, void *, CUarray, size_t, size_t)
GS_GAP_1(cuMemcpy2DAsync, 0, const CUDA_MEMCPY2D_v1 *)
GS_GAP_1(cuMemcpy2DAsync_v2, 0, const CUDA_MEMCPY2D *)
GS_GAP_1(cuMemcpy2DAsync_v2_ptsz, 1, const CUDA_MEMCPY2D *)
GS_GAP_1(cuMemcpy3DAsync, 0, const CUDA_MEMCPY3D_v1 *)
GS_GAP_1(cuMemcpy3DAsync_v2, 0, const CUDA_MEMCPY3D *)
GS_GAP_1(cuMemcpy3DAsync_v2_ptsz, 1, const CUDA_MEMCPY3D *)
GS_GAP_1(cuMemcpy3DPeerAsync, 0, const CUDA_MEMCPY3D_PEER *)
GS_GAP_1(cuMemcpy3DPeerAsync_ptsz, 1, const CUDA_MEMCPY3D_PEER *)
GS_GAP_8(cuMemcpyBatchAsync, 0, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *, size_t,
         size_t *)
GS_GAP_8(cuMemcpyBatchAsync_ptsz, 1, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
         size_t, size_t *)
GS_GAP_7(cuMemcpyBatchAsync_v2, 0, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *,
         size_t)
GS_GAP_7(cuMemcpyBatchAsync_v2_ptsz, 1, CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *,
         size_t *, size_t)
GS_GAP_4(cuMemcpy3DBatchAsync, 0, size_t, CUDA_MEMCPY3D_BATCH_OP *, size_t *, unsigned long long)
GS_GAP_4(cuMemcpy3DBatchAsync_ptsz, 1, size_t, CUDA_MEMCPY3D_BATCH_OP *, size_t *, unsigned long long)
GS_GAP_3(cuMemcpy3DBatchAsync_v2, 0, size_t, CUDA_MEMCPY3D_BATCH_OP *, unsigned long long)
GS_GAP_3(cuMemcpy3DBatchAsync_v2_ptsz, 1, size_t, CUDA_MEMCPY3D_BATCH_OP *, unsigned long long)
/* CUDA 13.2's single copies with attributes: before their hooks a runtime of 13.2 or later got
 * them unhooked, and their time was charged as kernel time (`test_throttle.py -k copies_host`) */
GS_GAP_4(cuMemcpyWithAttributesAsync, 0, CUdeviceptr, CUdeviceptr, size_t, CUmemcpyAttributes *)
GS_GAP_4(cuMemcpyWithAttributesAsync_ptsz, 1, CUdeviceptr, CUdeviceptr, size_t, CUmemcpyAttributes *)
GS_GAP_2(cuMemcpy3DWithAttributesAsync, 0, CUDA_MEMCPY3D_BATCH_OP *, unsigned long long)
GS_GAP_2(cuMemcpy3DWithAttributesAsync_ptsz, 1, CUDA_MEMCPY3D_BATCH_OP *, unsigned long long)
GS_STREAM_GAP_2(cuLaunchHostFunc, 0, CUhostFn, void *)
GS_STREAM_GAP_2(cuLaunchHostFunc_ptsz, 1, CUhostFn, void *)
/* CUDA 13.2: a host function with its dispatch mode (a spinning driver thread, or blocking) */
GS_STREAM_GAP_3(cuLaunchHostFunc_v2, 0, CUhostFn, void *, unsigned int)
GS_STREAM_GAP_3(cuLaunchHostFunc_v2_ptsz, 1, CUhostFn, void *, unsigned int)
GS_STREAM_GAP_3(cuStreamAddCallback, 0, CUstreamCallback, void *, unsigned int)
GS_STREAM_GAP_3(cuStreamAddCallback_ptsz, 1, CUstreamCallback, void *, unsigned int)
GS_STREAM_GAP_2(cuStreamWaitEvent, 0, CUevent, unsigned int)
GS_STREAM_GAP_2(cuStreamWaitEvent_ptsz, 1, CUevent, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue32, 0, CUdeviceptr, cuuint32_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue32_ptsz, 1, CUdeviceptr, cuuint32_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue32_v2, 0, CUdeviceptr, cuuint32_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue32_v2_ptsz, 1, CUdeviceptr, cuuint32_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue64, 0, CUdeviceptr, cuuint64_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue64_ptsz, 1, CUdeviceptr, cuuint64_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue64_v2, 0, CUdeviceptr, cuuint64_t, unsigned int)
GS_STREAM_GAP_3(cuStreamWaitValue64_v2_ptsz, 1, CUdeviceptr, cuuint64_t, unsigned int)
GS_STREAM_GAP_3(cuStreamBatchMemOp, 0, unsigned int, CUstreamBatchMemOpParams *, unsigned int)
GS_STREAM_GAP_3(cuStreamBatchMemOp_ptsz, 1, unsigned int, CUstreamBatchMemOpParams *, unsigned int)
GS_STREAM_GAP_3(cuStreamBatchMemOp_v2, 0, unsigned int, CUstreamBatchMemOpParams *, unsigned int)
GS_STREAM_GAP_3(cuStreamBatchMemOp_v2_ptsz, 1, unsigned int, CUstreamBatchMemOpParams *, unsigned int)
/* a prefetch of managed memory is a copy; an external semaphore's wait, a wait */
GS_GAP_3(cuMemPrefetchAsync, 0, CUdeviceptr, size_t, CUdevice)
GS_GAP_3(cuMemPrefetchAsync_ptsz, 1, CUdeviceptr, size_t, CUdevice)
GS_GAP_4(cuMemPrefetchAsync_v2, 0, CUdeviceptr, size_t, CUmemLocation, unsigned int)
GS_GAP_4(cuMemPrefetchAsync_v2_ptsz, 1, CUdeviceptr, size_t, CUmemLocation, unsigned int)
/* CUDA 13.0's batched prefetches (a discard first or not) and 12.6's decompression engine:
 * copies too */
GS_GAP_7(cuMemPrefetchBatchAsync, 0, CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t,
         unsigned long long)
GS_GAP_7(cuMemPrefetchBatchAsync_ptsz, 1, CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t,
         unsigned long long)
GS_GAP_7(cuMemDiscardAndPrefetchBatchAsync, 0, CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t,
         unsigned long long)
GS_GAP_7(cuMemDiscardAndPrefetchBatchAsync_ptsz, 1, CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *,
         size_t, unsigned long long)
GS_GAP_4(cuMemBatchDecompressAsync, 0, CUmemDecompressParams *, size_t, unsigned int, size_t *)
GS_GAP_4(cuMemBatchDecompressAsync_ptsz, 1, CUmemDecompressParams *, size_t, unsigned int, size_t *)
GS_GAP_3(cuWaitExternalSemaphoresAsync, 0, const CUexternalSemaphore *, const CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS *,
         unsigned int)
GS_GAP_3(cuWaitExternalSemaphoresAsync_ptsz, 1, const CUexternalSemaphore *,
         const CUDA_EXTERNAL_SEMAPHORE_WAIT_PARAMS *, unsigned int)

/* Memsets: with a compute limit the stream is marked so that no gap is ended before its next
 * launch (gap_block): a memset may run as a kernel, and one queued before a marked copy fell
 * into that copy's gap, charged nothing (a review's find; before the gaps it was charged with
 * the next kernel, as again now) */
#define GS_NOGAP_HOOK(name, params, args, pt)                                                                 \
    GS_AFTER_HOOK(name, params, args, if (rc == CUDA_SUCCESS && throttle_on()) gap_block(hStream, pt))
#define GS_MEMSET(name, pt, T) GS_NOGAP_HOOK(name, (CUdeviceptr d, T v, size_t n, CUstream hStream), (d, v, n, hStream), pt)
#define GS_MEMSET_2D(name, pt, T)                                                                             \
    GS_NOGAP_HOOK(name, (CUdeviceptr d, size_t pitch, T v, size_t w, size_t h, CUstream hStream),             \
                  (d, pitch, v, w, h, hStream), pt)
GS_MEMSET(cuMemsetD8Async, 0, unsigned char)
GS_MEMSET(cuMemsetD8Async_ptsz, 1, unsigned char)
GS_MEMSET(cuMemsetD16Async, 0, unsigned short)
GS_MEMSET(cuMemsetD16Async_ptsz, 1, unsigned short)
GS_MEMSET(cuMemsetD32Async, 0, unsigned int)
GS_MEMSET(cuMemsetD32Async_ptsz, 1, unsigned int)
GS_MEMSET_2D(cuMemsetD2D8Async, 0, unsigned char)
GS_MEMSET_2D(cuMemsetD2D8Async_ptsz, 1, unsigned char)
GS_MEMSET_2D(cuMemsetD2D16Async, 0, unsigned short)
GS_MEMSET_2D(cuMemsetD2D16Async_ptsz, 1, unsigned short)
GS_MEMSET_2D(cuMemsetD2D32Async, 0, unsigned int)
GS_MEMSET_2D(cuMemsetD2D32Async_ptsz, 1, unsigned int)
/* The memsets without a stream: asynchronous with respect to the host for device memory (the
 * driver API's "API synchronization behavior": only a pinned host or managed target makes them
 * wait), queued on the legacy stream, or the per-thread one for the _ptds variants.  Unhooked,
 * one queued on the legacy stream before a marked copy fell into the copy's gap, uncharged, as
 * the async ones did (`test_throttle.py -k memset_before_a_copy`) */
#define GS_SYNC_MEMSET(name, pt, P, T)                                                                        \
    GS_AFTER_HOOK(name, (P d, T v, P##_SIZE n), (d, v, n), if (rc == CUDA_SUCCESS && throttle_on()) gap_block(NULL, pt))
#define GS_SYNC_MEMSET_2D(name, pt, P, T)                                                                     \
    GS_AFTER_HOOK(name, (P d, P##_SIZE pitch, T v, P##_SIZE w, P##_SIZE h), (d, pitch, v, w, h),              \
                  if (rc == CUDA_SUCCESS && throttle_on()) gap_block(NULL, pt))
/* CUDA 2.x's take 32-bit pointers and sizes */
typedef unsigned int gs_ptr32;
#define gs_ptr32_SIZE unsigned int
#define CUdeviceptr_SIZE size_t
GS_SYNC_MEMSET(cuMemsetD8, 0, gs_ptr32, unsigned char)
GS_SYNC_MEMSET(cuMemsetD8_v2, 0, CUdeviceptr, unsigned char)
GS_SYNC_MEMSET(cuMemsetD8_v2_ptds, 1, CUdeviceptr, unsigned char)
GS_SYNC_MEMSET(cuMemsetD16, 0, gs_ptr32, unsigned short)
GS_SYNC_MEMSET(cuMemsetD16_v2, 0, CUdeviceptr, unsigned short)
GS_SYNC_MEMSET(cuMemsetD16_v2_ptds, 1, CUdeviceptr, unsigned short)
GS_SYNC_MEMSET(cuMemsetD32, 0, gs_ptr32, unsigned int)
GS_SYNC_MEMSET(cuMemsetD32_v2, 0, CUdeviceptr, unsigned int)
GS_SYNC_MEMSET(cuMemsetD32_v2_ptds, 1, CUdeviceptr, unsigned int)
GS_SYNC_MEMSET_2D(cuMemsetD2D8, 0, gs_ptr32, unsigned char)
GS_SYNC_MEMSET_2D(cuMemsetD2D8_v2, 0, CUdeviceptr, unsigned char)
GS_SYNC_MEMSET_2D(cuMemsetD2D8_v2_ptds, 1, CUdeviceptr, unsigned char)
GS_SYNC_MEMSET_2D(cuMemsetD2D16, 0, gs_ptr32, unsigned short)
GS_SYNC_MEMSET_2D(cuMemsetD2D16_v2, 0, CUdeviceptr, unsigned short)
GS_SYNC_MEMSET_2D(cuMemsetD2D16_v2_ptds, 1, CUdeviceptr, unsigned short)
GS_SYNC_MEMSET_2D(cuMemsetD2D32, 0, gs_ptr32, unsigned int)
GS_SYNC_MEMSET_2D(cuMemsetD2D32_v2, 0, CUdeviceptr, unsigned int)
GS_SYNC_MEMSET_2D(cuMemsetD2D32_v2_ptds, 1, CUdeviceptr, unsigned int)
