/*
 * arrays.c - arrays and mipmapped arrays (cuArrayCreate, cuArray3DCreate, cuMipmappedArrayCreate,
 * of both generations, and their destroys), charged as allocations (GS_CHARGED_ALLOC,
 * mem_internal.h); and the mappings of cuMemCreate allocations into sparse arrays' tiles
 * (cuMemMapArrayAsync), counted in their handles' records (vmm.c).
 */
#define _GNU_SOURCE
#include "mem_internal.h"

/* ---- arrays --------------------------------------------------------------- */

/* Bytes per element of the formats whose elements are texels of whole bytes: the listed ones
 * exactly, any other at 4 bytes per channel, which is never less than it needs.  The normalized
 * formats name their channels (UNORM_INT8X4: four of a byte), at least NumChannels: at 4 bytes
 * a channel an 8192 x 8192 UNORM_INT8X4 array was charged 1 GiB for 256 MiB
 * (`test_memory.py -k normalized_formats`) */
static uint64_t element_bytes(CUarray_format format, unsigned channels)
{
    uint64_t per;
    unsigned named = 0; /* the channels the format names */
    switch (format) {
    case 0x01: case 0x08: per = 1; break;            /* (un)signed int8 */
    case 0x02: case 0x09: case 0x10: per = 2; break; /* (un)signed int16, half */
    case 0x03: case 0x0a: case 0x20: per = 4; break; /* (un)signed int32, float */
    case 0x50: return 4;                             /* UNORM_INT_101010_2: one packed word */
    case 0xc0: case 0xc1: case 0xc2: case 0xc6: case 0xc7: case 0xc8: /* [US]NORM_INT8X1/2/4 */
        per = 1;
        named = 1u << ((format - 0xc0) % 3);
        break;
    case 0xc3: case 0xc4: case 0xc5: case 0xc9: case 0xca: case 0xcb: /* [US]NORM_INT16X1/2/4 */
        per = 2;
        named = 1u << ((format - 0xc3) % 3);
        break;
    default: per = 4; break;
    }
    if (channels < named) channels = named;
    return per * (channels ? channels : 1);
}

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    return b && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

/* Block-compressed formats (CUDA 11.5): Width and Height count texels, stored in blocks of
 * 4 x 4 of 8 bytes (BC1, BC4: half a byte a texel) or 16 (BC2, BC3, BC5, BC6H, BC7: one byte);
 * 0 for another format.  At 4 bytes a channel a 4096 x 4096 BC1 texture (8 MiB) was charged
 * 256 MiB (`test_memory.py -k compressed_and_yuv`) */
static unsigned block_bytes(CUarray_format format)
{
    switch (format) {
    case 0x91: case 0x92: case 0x97: case 0x98: return 8; /* BC1 (sRGB), BC4 (signed) */
    case 0x93: case 0x94: case 0x95: case 0x96: case 0x99: case 0x9a: case 0x9b: case 0x9c: case 0x9d:
    case 0x9e: return 16;
    default: return 0;
    }
}

/* The YUV formats: bytes a pixel of the luma (or of the packed pixel), and of each chroma pair
 * (U and V together) with the chroma's subsampling across and down (4:2:0 halves both, 4:2:2
 * the width); 10- and 12-bit samples take 16-bit words.  0 for another format.  At 4 bytes a
 * channel a 3-channel 1920 x 1080 NV12 frame (3.0 MiB) was charged 23.7 MiB */
struct yuv_layout {
    unsigned luma, pair, across, down;
};

static int yuv_layout(CUarray_format format, struct yuv_layout *y)
{
    switch (format) {
    case 0xb0: *y = (struct yuv_layout){1, 2, 2, 2}; return 1;             /* NV12 */
    case 0x9f: case 0xa1: *y = (struct yuv_layout){2, 4, 2, 2}; return 1; /* P010, P016 */
    case 0xa2: *y = (struct yuv_layout){1, 2, 2, 1}; return 1;             /* NV16 */
    case 0xa3: case 0xa4: *y = (struct yuv_layout){2, 4, 2, 1}; return 1; /* P210, P216 */
    case 0xa5: *y = (struct yuv_layout){2, 0, 1, 1}; return 1;             /* YUY2: Y and U or V */
    case 0xa6: case 0xa7: *y = (struct yuv_layout){4, 0, 1, 1}; return 1; /* Y210, Y216 */
    case 0xa8: case 0xa9: *y = (struct yuv_layout){4, 0, 1, 1}; return 1; /* AYUV, Y410 (one word) */
    case 0xb1: *y = (struct yuv_layout){8, 0, 1, 1}; return 1;             /* Y416 */
    case 0xb2: case 0xb4: *y = (struct yuv_layout){3, 0, 1, 1}; return 1; /* 4:4:4 8-bit planes */
    case 0xb3: case 0xb5: *y = (struct yuv_layout){6, 0, 1, 1}; return 1; /* 4:4:4 10/16-bit planes */
    default: return 0;
    }
}

static uint64_t array_bytes(size_t w, size_t h, size_t d, CUarray_format f, unsigned ch)
{
    uint64_t width = w ? w : 1, height = h ? h : 1, depth = d ? d : 1;
    unsigned block = block_bytes(f);
    struct yuv_layout y;
    if (block) return mul_sat(mul_sat(mul_sat((width + 3) / 4, (height + 3) / 4), depth), block);
    if (yuv_layout(f, &y)) {
        uint64_t plane = mul_sat(mul_sat(width, height), y.luma);
        uint64_t chroma = mul_sat(mul_sat((width + y.across - 1) / y.across, (height + y.down - 1) / y.down), y.pair);
        return mul_sat(gs_add_sat(plane, chroma), depth);
    }
    return mul_sat(mul_sat(mul_sat(width, height), depth), element_bytes(f, ch));
}

/* Sparse arrays and arrays with deferred mapping get no memory at creation:
 * it comes later from cuMemCreate allocations mapped into them (charged there). */
#define GS_ARRAY_NO_BACKING (0x40 /* CUDA_ARRAY3D_SPARSE */ | 0x80 /* CUDA_ARRAY3D_DEFERRED_MAPPING */)

/* The 2D and 3D creations of both generations (CUDA 2.x's descriptors have 32-bit sizes).  An
 * array without backing is recorded at no charge: its context's end finds it, and with it the
 * mappings of its tiles */
#define GS_ARRAY_HOOK(name, desc_t, depth, empty)                                                         \
    GS_EXPORT CUresult name(CUarray *pHandle, const desc_t *pAllocateArray)                               \
    {                                                                                                     \
        gs_cuda_init();                                                                                   \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                                               \
        if (!pHandle || !pAllocateArray) return CUDA_ERROR_INVALID_VALUE;                                 \
        const desc_t *a = pAllocateArray;                                                                 \
        GS_CHARGED_ALLOC(GS_KIND_ARRAY, pHandle, 0,                                                       \
                         (empty) ? 0 : array_bytes(a->Width, a->Height, (depth), a->Format, a->NumChannels), \
                         gs_cuda.name(pHandle, pAllocateArray), 0);                                       \
    }
GS_ARRAY_HOOK(cuArrayCreate_v2, CUDA_ARRAY_DESCRIPTOR, 1, 0)
GS_ARRAY_HOOK(cuArrayCreate, CUDA_ARRAY_DESCRIPTOR_v1, 1, 0)
GS_ARRAY_HOOK(cuArray3DCreate_v2, CUDA_ARRAY3D_DESCRIPTOR, a->Depth, (a->Flags & GS_ARRAY_NO_BACKING) != 0)
GS_ARRAY_HOOK(cuArray3DCreate, CUDA_ARRAY3D_DESCRIPTOR_v1, a->Depth, (a->Flags & GS_ARRAY_NO_BACKING) != 0)

GS_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                          unsigned int numMipmapLevels)
{
    gs_cuda_init();
    if (!gs_cuda.cuMipmappedArrayCreate) return CUDA_ERROR_NOT_SUPPORTED;
    if (!pHandle || !pMipmappedArrayDesc) return CUDA_ERROR_INVALID_VALUE;
    const CUDA_ARRAY3D_DESCRIPTOR *a = pMipmappedArrayDesc;
    uint64_t bytes = 0;
    /* a layered array's depth counts its layers, a cubemap's its faces (six per cube): every
     * level has them all; only a 3D array's depth halves with the level */
    int layers = (a->Flags & (0x01 /* CUDA_ARRAY3D_LAYERED */ | 0x04 /* CUDA_ARRAY3D_CUBEMAP */)) != 0;
    for (unsigned l = 0; l < numMipmapLevels && l < 64; l++) {
        size_t w = a->Width >> l, h = a->Height >> l, d = layers ? a->Depth : a->Depth >> l;
        uint64_t level = array_bytes(w ? w : 1, h ? h : 1, d ? d : 1, a->Format, a->NumChannels);
        bytes = gs_add_sat(bytes, level);
    }
    if (a->Flags & GS_ARRAY_NO_BACKING) bytes = 0; /* recorded all the same (above) */
    GS_CHARGED_ALLOC(GS_KIND_MIPMAP, pHandle, 0, bytes,
                     gs_cuda.cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels), 0);
}

/* An array destroyed takes the mappings of its tiles with it (sparse arrays).  Its record is
 * taken before the call; a refusal after a context's teardown began may only say that the
 * teardown destroyed the array, whose record it could not forget (taken): settled under the
 * context lock (gs_array_refused_after_teardown).  Put back at every refusal, it stayed charged
 * until the process exited: 250 MiB for 50 held, an 800 MiB allocation refused under a 1 GiB
 * cap (`test_memory.py -k destroy_refused`).  A reset that keeps the context active cannot be
 * told from the context's life, so a destroy holds the array fence as a creation does: a reset
 * waits for it, or it for the reset (then its record is gone, nothing put back). */
#define GS_ARRAY_DESTROY(kind, handle, call)                                          \
    do {                                                                              \
        struct gs_alloc rec, old;                                                     \
        uint64_t key_ = (uint64_t)(uintptr_t)(handle);                                \
        int fence_ = gs_array_fence_enter();                                          \
        unsigned seq0_ = gs_teardown_seq(); /* before the take: as free_dptr's */     \
        int had_ = gs_am_take(kind, key_, &rec) == 0;                                 \
        gs_inflight_begin(); /* freed before its charge goes: no reading may lower */ \
        if (fence_) gs_array_fence_call();                                            \
        CUresult rc = (call);                                                         \
        if (fence_) gs_array_fence_called();                                          \
        if (rc == CUDA_SUCCESS) {                                                     \
            if (had_) gs_budget_release(rec.slot, rec.size);                          \
            gs_array_drop_maps(key_);                                                 \
        } else if (had_ && gs_teardown_since(seq0_)) {                                \
            gs_array_refused_after_teardown(kind, key_, &rec, seq0_);                 \
        } else if (had_) {                                                            \
            gs_am_put(kind, key_, &rec, &old);                                        \
        }                                                                             \
        if (fence_) gs_array_fence_leave();                                           \
        gs_inflight_end();                                                            \
        return rc;                                                                    \
    } while (0)

GS_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    gs_cuda_init();
    if (!gs_cuda.cuArrayDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    GS_ARRAY_DESTROY(GS_KIND_ARRAY, hArray, gs_cuda.cuArrayDestroy(hArray));
}

GS_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    gs_cuda_init();
    if (!gs_cuda.cuMipmappedArrayDestroy) return CUDA_ERROR_NOT_SUPPORTED;
    GS_ARRAY_DESTROY(GS_KIND_MIPMAP, hMipmappedArray, gs_cuda.cuMipmappedArrayDestroy(hMipmappedArray));
}

/* ---- sparse arrays' tiles -------------------------------------------------- */

/* cuMemMapArrayAsync maps cuMemCreate allocations into the tiles of sparse (or deferred-mapping)
 * arrays.  Such a mapping keeps the allocation's memory as cuMemMap's does (a handle released
 * while it lasts keeps its charge): it is counted in the handle's record like one, and recorded
 * as GS_KIND_AMAP, keyed by the array and the subresource it covers, with the array as its
 * owner (destroying the array, or the context that holds it, drops its mappings).  An unmap is
 * matched to the mapping of exactly the same subresource; one that covers other tiles (part of
 * a mapping, or several) matches none, and what it undoes stays charged until the array goes:
 * the strict side.  The call is stream-ordered: mappings count from the call, and an unmap
 * returns its charge at the call, as stream-ordered frees do. */
static uint64_t amap_key(const CUarrayMapInfo *m)
{
    uint64_t h = 0x9e3779b97f4a7c15ull;
    h = gs_hash_step(h, (uint64_t)m->resourceType);
    h = gs_hash_step(h, (uintptr_t)m->resource.array);
    h = gs_hash_step(h, (uint64_t)m->subresourceType);
    if (m->subresourceType == CU_ARRAY_SPARSE_SUBRESOURCE_TYPE_MIPTAIL) {
        h = gs_hash_step(h, (uint64_t)m->subresource.miptail.layer);
        h = gs_hash_step(h, (uint64_t)m->subresource.miptail.offset);
        h = gs_hash_step(h, (uint64_t)m->subresource.miptail.size);
    } else {
        const unsigned *f = &m->subresource.sparseLevel.level;
        for (int i = 0; i < 8; i++) h = gs_hash_step(h, f[i]);
    }
    return h;
}

/* A mapping of the handle is gone: its charge returns if it was the handle's last reference */
void gs_amap_lose(uint64_t handle)
{
    struct gs_alloc rec;
    if (gs_vmm_count(handle, -1, &rec) == 1) gs_vmm_gone(&rec);
}

static void amap_dropped(int kind, uint64_t key, const struct gs_alloc *rec)
{
    (void)key;
    if (kind == GS_KIND_AMAP) gs_amap_lose(rec->aux);
}

/* Set before the first mapping into an array's tiles is recorded: until then no array has any,
 * and a destroy need not look (the look scans the whole table of allocations: 9,300
 * instructions per cuArrayDestroy, costs.py's array row, for the sparse arrays few programs
 * make) */
static int g_amaps_made;

void gs_array_drop_maps(uint64_t array)
{
    if (!__atomic_load_n(&g_amaps_made, __ATOMIC_ACQUIRE)) return;
    gs_am_drop_ctx(array, amap_dropped);
}

/* A mapping into an array's tiles put back (an unmap refused) or booked (a map) after a context's
 * teardown began: a teardown's forget drops the mappings of the arrays it takes with it, but not
 * one whose record an unmap had taken out, nor one booked after it.  Under the context lock,
 * after that teardown: with the array's own record gone (the array went with its context; a
 * sparse array is recorded at no charge) the mapping went too.  Put back at the refusal, it
 * counted a mapping of its handle for good: 350 MiB charged for 50 held once the handle was
 * released (`test_memory.py -k tile_mapping_racing`).  (An array this process never recorded,
 * made inside a driver callback, is taken for gone here too: its mapping returns early.) */
static void amap_settle(const CUarrayMapInfo *m)
{
    int kind = m->resourceType == CU_RESOURCE_TYPE_MIPMAPPED_ARRAY ? GS_KIND_MIPMAP : GS_KIND_ARRAY;
    int locked = gs_ctx_lock() == 0; /* not from inside a context call of this thread */
    struct gs_alloc rec;
    if (!gs_am_has(kind, (uint64_t)(uintptr_t)m->resource.array) && gs_am_take(GS_KIND_AMAP, amap_key(m), &rec) == 0) {
        gs_amap_lose(rec.aux);
        GS_INFO("a mapping into an array's tiles went with the array's context: its handle loses it");
    }
    if (locked) gs_ctx_unlock();
}

/* One operation: an unmap's record is taken before the call (after it, another thread may
 * already have mapped new memory there) and put back if the call fails; a map of a handle of
 * ours is counted before it and uncounted if it fails.  Either settled after a teardown
 * (amap_settle) */
static CUresult map_one(cuMemMapArrayAsync_fn real, CUarrayMapInfo *m, CUstream stream)
{
    struct gs_alloc rec, old;
    unsigned seq0 = gs_teardown_seq(); /* before the take, as free_dptr's */
    if (m->memOperationType == CU_MEM_OPERATION_TYPE_UNMAP) {
        int had = gs_am_take(GS_KIND_AMAP, amap_key(m), &rec) == 0;
        CUresult rc = real(m, 1, stream);
        if (had && rc == CUDA_SUCCESS) {
            gs_amap_lose(rec.aux);
        } else if (had) {
            gs_am_put(GS_KIND_AMAP, amap_key(m), &rec, &old);
            if (gs_teardown_since(seq0)) amap_settle(m);
        }
        return rc;
    }
    struct gs_alloc seen;
    if (m->memOperationType == CU_MEM_OPERATION_TYPE_MAP && m->memHandleType == CU_MEM_HANDLE_TYPE_GENERIC &&
        gs_am_update(GS_KIND_VMM, m->memHandle.memHandle, gs_vmm_peek, NULL, &seen) >= 0 && seen.ctx == GS_VMM_IMPORTED) {
        /* an imported handle into a sparse array's tiles: how much of the other process's
         * allocation that takes is not told here (cuMemMap's offset + size is), and counted
         * as a mapping of a handle charged nothing it went uncharged (review: 1.8 GiB held
         * under a 1 GiB cap); refused */
        GS_WARN("a handle imported from another process cannot be mapped into a sparse array under a memory cap");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    /* a map of a handle of ours is counted before the call (see gs_vmm_map_begin, vmm.c): a
     * release of its last reference meanwhile took its charge, the tiles' mapping uncounted */
    int counted = m->memOperationType == CU_MEM_OPERATION_TYPE_MAP && m->memHandleType == CU_MEM_HANDLE_TYPE_GENERIC &&
                  gs_vmm_map_begin(m->memHandle.memHandle, &rec) == 0;
    CUresult rc = real(m, 1, stream);
    if (rc != CUDA_SUCCESS && counted) gs_vmm_map_failed(m->memHandle.memHandle);
    if (rc != CUDA_SUCCESS || m->memOperationType != CU_MEM_OPERATION_TYPE_MAP) return rc;
    if (!counted) {
        /* not a handle of ours: the tiles' old mapping (one of ours, perhaps) is gone all the
         * same.  Kept, a released allocation's 300 MiB stayed charged until the array went
         * (`test_memory.py -k handle_not_charged`) */
        if (gs_am_take(GS_KIND_AMAP, amap_key(m), &old) == 0) gs_amap_lose(old.aux);
        return rc;
    }
    struct gs_alloc map = {.size = 1, .aux = m->memHandle.memHandle,
                           .ctx = (uint64_t)(uintptr_t)m->resource.array, .slot = rec.slot};
    __atomic_store_n(&g_amaps_made, 1, __ATOMIC_RELEASE);
    int put = gs_am_put(GS_KIND_AMAP, amap_key(m), &map, &old);
    if (put == 1) { /* the same tiles mapped again: the mapping they had is gone */
        gs_amap_lose(old.aux);
    } else if (put < 0) {
        gs_amap_lose(m->memHandle.memHandle); /* untracked: charged only while its handle lives */
        GS_WARN("cannot track a mapping into a sparse array: its memory is charged only while its handle lives");
    }
    if (put >= 0 && gs_teardown_since(seq0)) amap_settle(m);
    return rc;
}

/* The list is passed on one operation at a time, in order, on the same stream (so in the same
 * order on the device), up to the first that fails: what a list that fails part way did is then
 * known (the driver does not document a list as all or nothing; applied in order up to the
 * failing operation, the maps before it were left uncharged: 1200 MiB held under a 1 GiB cap,
 * found by review), and a list that maps tiles and unmaps them again is counted in its order
 * (the unmap found nothing to take and the mapping stayed charged) */
static CUresult map_array(cuMemMapArrayAsync_fn real, CUarrayMapInfo *list, unsigned count, CUstream stream)
{
    if (!list || !count) return real(list, count, stream);
    gs_inflight_begin(); /* an unmap of a released handle's last mapping frees its memory */
    CUresult rc = CUDA_SUCCESS;
    for (unsigned i = 0; i < count && rc == CUDA_SUCCESS; i++) rc = map_one(real, &list[i], stream);
    gs_inflight_end();
    return rc;
}

GS_EXPORT CUresult cuMemMapArrayAsync(CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemMapArrayAsync) return CUDA_ERROR_NOT_SUPPORTED;
    return map_array(gs_cuda.cuMemMapArrayAsync, mapInfoList, count, hStream);
}

GS_EXPORT CUresult cuMemMapArrayAsync_ptsz(CUarrayMapInfo *mapInfoList, unsigned int count, CUstream hStream)
{
    gs_cuda_init();
    if (!gs_cuda.cuMemMapArrayAsync_ptsz) return CUDA_ERROR_NOT_SUPPORTED;
    return map_array(gs_cuda.cuMemMapArrayAsync_ptsz, mapInfoList, count, hStream);
}
