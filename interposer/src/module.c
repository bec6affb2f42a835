/*
 * module.c - module and library loads: cuModuleLoad*, cuLibraryLoad*, and the
 * calls that load a function's code when loading is lazy
 * (cuModuleGetFunction, cuLibraryGetKernel, cuKernelGetFunction, cuFuncLoad), or load a
 * library in another context (cuLibraryGetModule, cuLibraryGetGlobal); and
 * cuCtxSetLimit, whose stack size, printf FIFO and malloc heap limits
 * reserve device memory (the stack for every thread the device can run).
 *
 * Code and those reserves take device memory no allocation hook sees.  After each of these
 * calls succeeds, what the process really holds is reconciled with its
 * charge (reconcile.c): at once when a device is near its cap, otherwise by
 * waking the background sampler, so the caller pays for an NVML query only
 * near the cap.  Far from the cap loads are not refused: their size is unknown beforehand.
 * Near it (gs_near_cap), a load or a function lookup is admitted only if the headroom covers
 * one code chunk, GS_CODE_CHUNK (2 MiB, the driver's page: what each JAX/XLA executable's load
 * took on the H200), on top of what the process already holds uncharged (gs_reconcile_gap);
 * otherwise it is refused with CUDA_ERROR_OUT_OF_MEMORY, which the driver documents for these
 * calls, and the driver is not called.  The chunk is reserved for the call (atomic across the
 * container's processes, counted in flight) and returned after it, before the reconcile
 * charges what the load really took.  The image gives no sound bound on what a load takes (a
 * PTX image is compiled first; a cubin's globals and constant banks are sized by its
 * sections, and the driver's own structures are not documented), so one chunk is assumed, and
 * a module or library load is judged once made (load_undone): where the reading after it finds
 * the container past its cap (the load took more than the chunk and more than was left), the
 * code is unloaded again through the driver, measured again, and the call refused.  A lookup
 * (cuModuleGetFunction, cuLibraryGetKernel, cuKernelGetFunction, cuFuncLoad, cuLibraryGetModule,
 * cuLibraryGetGlobal) cannot be undone (no call unloads one function's code, and the handle may be
 * in use already): one taking more than the chunk still passes the cap by the rest, until the
 * reconcile charges it.  Without NVML's per-process figure nothing is measured, and a load
 * stands as a lookup does.
 * A limit's growth is known beforehand (the new value less the one the context
 * started with; for the stack, per thread, times the threads the device runs
 * at once): it is reserved before the call and refused with
 * CUDA_ERROR_OUT_OF_MEMORY past the cap, as the driver documents.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpuslice.h"

#define GS_CODE_CHUNK GS_PAGE

/* Near the cap, the code chunk a load may take is reserved: 0 admitted (*held: the bytes
 * reserved, 0 far from the cap or outside a slot), -1 refused.  Not from a driver callback under
 * a lock of ours (gs_t_held): such a load passes, as before, and the reconcile charges it. */
__attribute__((noinline)) static int load_admit_near(int slot, const char *name, uint64_t *held)
{
    gs_reconcile_slot(slot);
    uint64_t want = gs_add_sat(GS_CODE_CHUNK, gs_reconcile_gap(slot));
    gs_inflight_begin(); /* the reservation stands for memory the driver may not show yet */
    if (gs_reserve_raw(slot, want) != 0) {
        gs_inflight_end();
        GS_INFO("%s refused: the cap leaves less than the %llu bytes a code load may take", name,
                (unsigned long long)want);
        return -1;
    }
    *held = want;
    return 0;
}

/* Lookups repeat: some launchers ask for a kernel's function before every launch (TVM-FFI's
 * cubin launcher calls cuKernelGetFunction each time), and only the first lookup of a function
 * in a context can load its code.  The lookups made before (by target, name and context) are
 * kept here: a repeated one is neither admitted near the cap (an NVML query, and a refusal
 * within a chunk of the cap, on every launch) nor wakes the sampler (a futex wake on every
 * launch).  Open addressing, lock-free; full, a lookup is treated as new (admitted, as
 * before).  Emptied when a context goes (gs_ctx_teardown_seq moved): a new context may get an
 * old one's handle, and its functions are not loaded there yet; and after an unload (g_unloads).
 * A key holds that epoch as read before its lookup's driver call: a lookup that returns after
 * another thread emptied the table for a newer epoch adds a key no later lookup matches
 * (without it, a lookup in a context being destroyed could put its key back after the
 * emptying, for a new context given the old handle). */
#define GS_SEEN_SLOTS 4096 /* a power of 2 */
#define GS_SEEN_PROBES 16
static uint64_t g_seen[GS_SEEN_SLOTS];
static unsigned g_seen_epoch;

/* The driver may give a new module or library an unloaded one's handle (and a new library's
 * kernels an unloaded one's kernels' handles): each unload, each load, and each first
 * cuLibraryGetKernel gives the handle a new generation, which the keys of lookups in it hold
 * (a kernel's handle goes with its library's unload unseen, hence the last).  Before, the new
 * module's first lookups passed as repeats, unadmitted at the cap (`-k loaded_again`, from
 * before unloads were hooked).  Kept per bucket of handles, lock-free: a bucket two handles
 * share moves for both (a lookup admitted again, as a first one), and a generation is never
 * given twice, so no stale key can match. */
#define GS_GEN_SLOTS 4096 /* a power of 2 */
static unsigned g_gen[GS_GEN_SLOTS];
static unsigned g_gens;

/* Unloads so far: each empties the table of lookups too.  Handles derived from an unloaded module
 * or library (cuLibraryGetModule's module, the functions and kernels a program enumerates) get no
 * generation of their own, and a reload at the old handle may give them the old ones': a
 * function's first lookup in a reloaded library's module passed as a repeat at the cap (`-k
 * reloaded_library`). */
static unsigned g_unloads;

static unsigned *gen_of(const void *handle)
{
    return &g_gen[gs_hash_step(0, (uint64_t)(uintptr_t)handle) & (GS_GEN_SLOTS - 1)];
}

static void gen_new(const void *handle)
{
    __atomic_store_n(gen_of(handle), __atomic_add_fetch(&g_gens, 1, __ATOMIC_SEQ_CST), __ATOMIC_SEQ_CST);
}

/* A first lookup's `made` handle (a kernel, a function) gets a new generation, unless it shares
 * the bucket of `what` (the handle it was looked up in, whose generation the made one's load or
 * first lookup moved already): moving it would make every later lookup in `what` a first one
 * (a kernel's function may be the kernel's own handle) */
static void made_new(const void *what, const void *made)
{
    if (!what || gen_of(made) != gen_of(what)) gen_new(made);
}

/* A lookup's key: the hook (its name: calls on the same handle and name are told apart), what it
 * looks in (a module, a library, a kernel, a function) and its generation, the name (FNV-1a), the
 * context, the epoch */
static uint64_t lookup_key(const char *hook, const void *what, const char *fname, CUcontext ctx, unsigned epoch)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *c = fname; c && *c; c++) h = (h ^ (unsigned char)*c) * 0x100000001b3ull;
    h = gs_hash_step(h, (uint64_t)(uintptr_t)hook);
    h = gs_hash_step(gs_hash_step(h, (uint64_t)(uintptr_t)what), (uint64_t)(uintptr_t)ctx);
    h = gs_hash_step(h, (uint64_t)__atomic_load_n(gen_of(what), __ATOMIC_SEQ_CST) << 32 | epoch);
    return h ? h : 1; /* 0 marks an empty slot */
}

/* 1 if `key` was looked up before (in `epoch`); clears a stale table first */
static int seen_before(uint64_t key, unsigned epoch)
{
    if (GS_UNLIKELY(__atomic_load_n(&g_seen_epoch, __ATOMIC_ACQUIRE) != epoch)) {
        for (unsigned i = 0; i < GS_SEEN_SLOTS; i++) __atomic_store_n(&g_seen[i], 0, __ATOMIC_RELAXED);
        __atomic_store_n(&g_seen_epoch, epoch, __ATOMIC_RELEASE);
        return 0;
    }
    for (unsigned i = 0; i < GS_SEEN_PROBES; i++) {
        uint64_t v = __atomic_load_n(&g_seen[(key + i) & (GS_SEEN_SLOTS - 1)], __ATOMIC_RELAXED);
        if (v == key) return 1;
        if (!v) return 0;
    }
    return 0;
}

static void seen_add(uint64_t key)
{
    for (unsigned i = 0; i < GS_SEEN_PROBES; i++) {
        uint64_t *slot = &g_seen[(key + i) & (GS_SEEN_SLOTS - 1)], empty = 0;
        if (__atomic_compare_exchange_n(slot, &empty, key, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED) || empty == key)
            return;
    }
}

/* `what`/`fname`: a lookup's target and name (*key: its key, to be kept once it succeeds); NULL
 * for a load.  0 admitted, -1 refused, 1 a repeated lookup (passed straight through) */
static inline int load_admit(const char *name, const void *what, const char *fname, int *slot, uint64_t *held,
                             uint64_t *key)
{
    *key = 0;
    if (gs_t_held) return 0;
    gs_devices_ready();
    CUcontext ctx;
    *slot = gs_current_slot(&ctx);
    if (what) {
        /* odd: never the initial 0; the sum grows with either count */
        unsigned epoch = (gs_teardown_seq() | 1u) + 2u * __atomic_load_n(&g_unloads, __ATOMIC_SEQ_CST);
        *key = lookup_key(name, what, fname, ctx, epoch);
        if (seen_before(*key, epoch)) return 1;
    }
    if (*slot < 0 || GS_LIKELY(!gs_near_cap(*slot, GS_CODE_CHUNK))) return 0;
    return load_admit_near(*slot, name, held);
}

static void load_settle(int slot, uint64_t held)
{
    gs_budget_release(slot, held);
    gs_inflight_end();
}

/* Loaded eagerly (CU_MODULE_EAGER_LOADING), a library goes into every context at once, each
 * device's, not only the current one (lazily, into a context only when needed there, which its
 * own calls admit).  Only the current device was admitted: a load from device 0's context took
 * device 1, at its cap, to 1,026 MiB under 1,024 (`test_near_cap_growth.py -k eager_library`).
 * Each other slot with a context of the process that is near its cap is admitted too (the
 * loading mode asked only then), `held` per slot; -1 refused, nothing left held. */
static void settle_elsewhere(uint64_t held[GPUSLICE_MAX_DEVICES])
{
    for (int s = 0; s < GPUSLICE_MAX_DEVICES; s++)
        if (held[s]) load_settle(s, held[s]);
}

static int admit_elsewhere(int here, const char *name, uint64_t held[GPUSLICE_MAX_DEVICES])
{
    int asked = 0;
    for (CUdevice d = 0; d < gs_dev_count() && d < GS_MAX_CUDA_DEVS; d++) {
        int s = gs_dev_slot(d);
        if (s < 0 || s >= GPUSLICE_MAX_DEVICES || s == here || held[s] || !gs_reconcile_dev_contexts(d) ||
            GS_LIKELY(!gs_near_cap(s, GS_CODE_CHUNK)))
            continue;
        CUmoduleLoadingMode mode = CU_MODULE_LAZY_LOADING;
        if (!asked++ && (!gs_cuda.cuModuleGetLoadingMode || gs_cuda.cuModuleGetLoadingMode(&mode) != CUDA_SUCCESS ||
                         mode != CU_MODULE_EAGER_LOADING))
            return 0;
        if (load_admit_near(s, name, &held[s]) != 0) {
            settle_elsewhere(held);
            return -1;
        }
    }
    return 0;
}

/* A lookup of `fname` in `what`; `made`: the handle it returns, given a new generation (a
 * kernel's), or NULL.  What it loaded cannot be undone (no call unloads one function's code, nor
 * a library from one context, and the handle may be in use already): near the cap it is admitted
 * against one chunk, and what it takes beyond that is charged after it */
#define GS_CODE_HOOK(name, params, args, what, fname, made)                  \
    GS_EXPORT CUresult name params                                           \
    {                                                                        \
        gs_cuda_init();                                                      \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                  \
        int slot_ = -1;                                                      \
        uint64_t held_ = 0, key_ = 0;                                        \
        int admit_ = load_admit(#name, (what), (fname), &slot_, &held_, &key_); \
        if (admit_ < 0) return CUDA_ERROR_OUT_OF_MEMORY;                     \
        if (admit_ > 0) return gs_cuda.name args; /* a repeated lookup */    \
        CUresult rc = gs_cuda.name args;                                     \
        if (held_) load_settle(slot_, held_);                                \
        if (rc == CUDA_SUCCESS && key_) seen_add(key_);                      \
        if (rc == CUDA_SUCCESS && (made)) made_new((what), (made));          \
        if (rc == CUDA_SUCCESS) gs_reconcile_after_load();                   \
        return rc;                                                           \
    }

/* Loaded eagerly?  Asked of the driver only for a library loaded while a device is near its cap */
static int loads_eagerly(void)
{
    CUmoduleLoadingMode mode = CU_MODULE_LAZY_LOADING;
    return gs_cuda.cuModuleGetLoadingMode && gs_cuda.cuModuleGetLoadingMode(&mode) == CUDA_SUCCESS &&
           mode == CU_MODULE_EAGER_LOADING;
}

/* A module or library the driver has just loaded (`handle`, from the current context's `slot`;
 * `lib`: a library) is measured where a device of ours is near its cap (gs_reconcile_after_load's
 * reading at once; far from it nothing changes).  If the container is then charged past the cap
 * on the load's device (a library loaded eagerly: on any device with a context of ours, as it
 * went into each), the load's real growth did not fit: it is unloaded through the driver, and
 * those devices are measured again at once, so that the charge the reading added for the code
 * goes with it.  Returns 1 if the load was undone (the hook answers CUDA_ERROR_OUT_OF_MEMORY,
 * *module or *library NULL).  Before, the load stood past the cap by what it took beyond the chunk
 * admitted: 1,026 MiB held under a 1,024 MiB cap after an 8 MiB load beside 1,018 MiB
 * (`test_near_cap_growth.py -k overshoot`).
 *  - The judgement needs a reading no allocation of ours was inside the driver across: one
 *    reserved but not yet taken hides as much of the load's growth (the load stood, and the
 *    allocation then took the process to 1,026 MiB).  Such a reading is taken again, every
 *    millisecond for up to 100 ms (gs_reconcile_load_over); a reading past the cap is past it
 *    however dirty (in-flight operations only hide growth).  After 100 ms without a clean one
 *    the load stands, as before.
 *  - The charge goes down the way every re-measurement's does (reconcile.c): to what the driver
 *    holds beyond the records, from a clean reading only, and not while a charge waits for a
 *    synchronisation (stream-ordered frees outstanding).  Until such a reading the code's charge
 *    stays (the strict side: allocations that would fit are refused meanwhile), the device
 *    marked for the sampler (woken) and for the next near-cap reservation.
 *  - Where the unload itself fails the load stands, charged what the driver holds (the reading
 *    that judged it; nothing is measured again, nothing went): the program keeps a handle it can
 *    unload, and the next allocation is refused.
 *  - Where NVML gives no per-process figure (or the host pid is not known) the reading charges
 *    nothing, the container is not seen past its cap, and the load stands as before. */
static int load_undone(const char *name, int slot, int lib, const void *handle)
{
    /* far from the cap, as gs_reconcile_after_load: the sampler woken, nothing more; nor from a
     * driver callback under a lock of ours, which must not wait for the context lock */
    if (GS_LIKELY(!gs_reconcile_near_any()) || gs_t_held) {
        gs_reconcile_wake();
        return 0;
    }
    /* a library loaded eagerly went into every context of ours: each device is judged */
    uint32_t judged = lib && loads_eagerly() ? ~0u : slot >= 0 && slot < GPUSLICE_MAX_DEVICES ? 1u << slot : 0;
    if (!gs_reconcile_load_over(judged)) return 0;
    CUresult urc = CUDA_ERROR_NOT_SUPPORTED;
    if (lib && gs_cuda.cuLibraryUnload)
        urc = gs_cuda.cuLibraryUnload((CUlibrary)(uintptr_t)handle);
    else if (!lib && gs_cuda.cuModuleUnload)
        urc = gs_cuda.cuModuleUnload((CUmodule)(uintptr_t)handle);
    if (urc != CUDA_SUCCESS) { /* the reading above charged what it holds: nothing went */
        GS_WARN("%s took the container past its cap and could not be unloaded (error %d): it stays, charged",
                name, (int)urc);
        return 0;
    }
    /* the code went: measured again where it was (a module in the current context only, a
     * library in every context it went into) */
    gs_reconcile_after_undo(judged);
    gen_new(handle); /* the driver may give the next load this handle */
    GS_INFO("%s refused: the code took the container past its cap; unloaded", name);
    return 1;
}

/* A load: `out` the handle it returns (given a new generation); `lib`: a library's load
 * (admitted on the other devices too when loading is eager).  Undone if its code took the
 * container past the cap (load_undone): *out is then NULL */
#define GS_LOAD_HOOK_(name, params, args, out, lib)                            \
    GS_EXPORT CUresult name params                                             \
    {                                                                          \
        gs_cuda_init();                                                        \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;                    \
        int slot_ = -1;                                                        \
        uint64_t held_ = 0, key_ = 0, others_[GPUSLICE_MAX_DEVICES] = {0};     \
        int admit_ = load_admit(#name, NULL, NULL, &slot_, &held_, &key_);     \
        if (admit_ == 0 && (lib) && !gs_t_held && admit_elsewhere(slot_, #name, others_) < 0) { \
            if (held_) load_settle(slot_, held_);                              \
            admit_ = -1;                                                       \
        }                                                                      \
        if (admit_ < 0) return CUDA_ERROR_OUT_OF_MEMORY;                       \
        CUresult rc = gs_cuda.name args;                                       \
        if (held_) load_settle(slot_, held_);                                  \
        if (lib) settle_elsewhere(others_);                                    \
        if (rc != CUDA_SUCCESS) return rc;                                     \
        if (GS_UNLIKELY(load_undone(#name, slot_, (lib), (const void *)*(out)))) { \
            *(out) = NULL;                                                     \
            return CUDA_ERROR_OUT_OF_MEMORY;                                   \
        }                                                                      \
        if (*(out)) made_new(NULL, (const void *)*(out));                      \
        return rc;                                                             \
    }
#define GS_LOAD_HOOK(name, params, args, out) GS_LOAD_HOOK_(name, params, args, out, 0)
#define GS_LIB_LOAD_HOOK(name, params, args, out) GS_LOAD_HOOK_(name, params, args, out, 1)

GS_LOAD_HOOK(cuModuleLoad, (CUmodule *module, const char *fname), (module, fname), module)
GS_LOAD_HOOK(cuModuleLoadData, (CUmodule *module, const void *image), (module, image), module)
GS_LOAD_HOOK(cuModuleLoadDataEx,
             (CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options,
              void **optionValues),
             (module, image, numOptions, options, optionValues), module)
GS_LOAD_HOOK(cuModuleLoadFatBinary, (CUmodule *module, const void *fatCubin), (module, fatCubin), module)
GS_CODE_HOOK(cuModuleGetFunction, (CUfunction *hfunc, CUmodule hmod, const char *name), (hfunc, hmod, name),
             (const void *)hmod, name, (const void *)*hfunc) /* a first one: its function (cuFuncLoad's) */
GS_LIB_LOAD_HOOK(cuLibraryLoadData,
             (CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
              unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
              unsigned int numLibraryOptions),
             (library, code, jitOptions, jitOptionsValues, numJitOptions, libraryOptions, libraryOptionValues,
              numLibraryOptions),
             library)
GS_LIB_LOAD_HOOK(cuLibraryLoadFromFile,
             (CUlibrary *library, const char *fileName, CUjit_option *jitOptions, void **jitOptionsValues,
              unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
              unsigned int numLibraryOptions),
             (library, fileName, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
              libraryOptionValues, numLibraryOptions),
             library)
GS_CODE_HOOK(cuLibraryGetKernel, (CUkernel *pKernel, CUlibrary library, const char *name), (pKernel, library, name),
             (const void *)library, name, (const void *)*pKernel) /* a first one: its kernel */
GS_CODE_HOOK(cuKernelGetFunction, (CUfunction *pFunc, CUkernel kernel), (pFunc, kernel), (const void *)kernel,
             (const char *)NULL, (const void *)*pFunc)
/* cuFuncLoad (CUDA 12.4) finalizes a lazily loaded function's loading: its code is loaded then, as
 * at its first launch.  It was not hooked: near the cap it loaded unadmitted (2 MiB of code past a
 * 1 GiB cap, `test_near_cap_growth.py -k cufuncload`).  A function loaded before in the context
 * passes straight through ("no effect", the driver says); each first lookup gives the function a
 * new generation (a reloaded module's function may get an unloaded one's handle).  Its keys are
 * its own (each hook's are): a kernel's function may have the kernel's handle, and
 * cuKernelGetFunction need not load its code. */
GS_CODE_HOOK(cuFuncLoad, (CUfunction function), (function), (const void *)function, (const char *)NULL,
             (const void *)NULL)
/* A library is loaded in a context when it is needed there: cuLibraryGetModule and
 * cuLibraryGetGlobal return the current context's module or global, and in a context the library
 * is not loaded in yet (one made after the load, a primary context retained again) they load its
 * code and globals there.  They were not hooked: 2 MiB past a 1 GiB cap (`test_near_cap_growth.py
 * -k new_context`).  Admitted like a lookup: asked again in the context, straight through. */
GS_CODE_HOOK(cuLibraryGetModule, (CUmodule *pMod, CUlibrary library), (pMod, library), (const void *)library,
             (const char *)NULL, (const void *)NULL)
GS_CODE_HOOK(cuLibraryGetGlobal, (CUdeviceptr *dptr, size_t *bytes, CUlibrary library, const char *name),
             (dptr, bytes, library, name), (const void *)library, name, (const void *)NULL)
/* Unloads give the code's memory back to the driver, where no hook sees it go: the reconcile only
 * adds, so it stayed charged until a context of the device went (a program that loads and
 * unloads JIT-compiled modules kept its peak; 130 MiB charged for 100 held after a 30 MiB
 * module's unload, `test_reconcile.py -k code_unloaded`).  After one, every device with a
 * context of ours is measured again (below): the next clean reading lowers
 * what was charged beyond the records to what the driver still holds, the sampler's (woken) or
 * the next near-cap reservation's.  No reading here: a runtime unloads every fatbin it
 * registered at exit, hundreds of calls.  The handle gets a new generation, and the lookups seen
 * are all forgotten (g_unloads). */
static void unloaded(const void *handle)
{
    gs_launch_costs_forget_all(); /* the code's handles may come back as another's (costs.c) */
    gs_lmem_forget_all();         /* and with another's local memory (lmem.c) */
    gen_new(handle);
    __atomic_add_fetch(&g_unloads, 1, __ATOMIC_SEQ_CST);
    /* every device with a context of ours: a library is loaded in each, and a module's own
     * context need not be the current one (another device's, or none: only the current
     * device measured again, its 30 MiB stayed charged for good, `test_reconcile.py -k
     * not_current`) */
    for (CUdevice d = 0; d < gs_dev_count() && d < GS_MAX_CUDA_DEVS; d++)
        if (gs_reconcile_dev_contexts(d)) gs_reconcile_remeasure(d);
    gs_reconcile_wake();
}

#define GS_UNLOAD_HOOK(name, T)                                \
    GS_EXPORT CUresult name(T handle)                          \
    {                                                          \
        gs_cuda_init();                                        \
        if (!gs_cuda.name) return CUDA_ERROR_NOT_SUPPORTED;    \
        CUresult rc = gs_cuda.name(handle);                    \
        if (rc == CUDA_SUCCESS) unloaded(handle);              \
        return rc;                                             \
    }
GS_UNLOAD_HOOK(cuModuleUnload, CUmodule)
GS_UNLOAD_HOOK(cuLibraryUnload, CUlibrary)

/* Limits set per context: each is charged for the most it was set to beyond the value the
 * context started with (that part is in its measured footprint), until the context goes or is
 * reset (gs_limits_forget_ctx).  A lowered limit keeps its charge: whether the driver frees
 * the difference is not known, and where NVML cannot tell, nothing would charge it again.  A
 * call is counted in flight (gs_inflight) from its reservation until its charge is settled, so
 * no measurement takes its reservation for memory the driver has not shown yet.  Should no
 * memory be left for the table, growth over the current value is reserved and kept until
 * the process exits. */
#define GS_LIMIT_CTXS 16 /* entries at first; the table doubles when full */
#define GS_LIMITS 3 /* CU_LIMIT_STACK_SIZE, CU_LIMIT_PRINTF_FIFO_SIZE, CU_LIMIT_MALLOC_HEAP_SIZE */
static pthread_mutex_t g_lim_mu = PTHREAD_MUTEX_INITIALIZER;  /* the table */
static pthread_mutex_t g_set_mu = PTHREAD_MUTEX_INITIALIZER;  /* one cuCtxSetLimit at a time: taken before
                                                                  anything gs_reserve may take, never under them */
struct gs_limits {
    CUcontext ctx; /* NULL = free */
    int slot;
    size_t base[GS_LIMITS];      /* the value when first seen */
    int known[GS_LIMITS];
    uint64_t charged[GS_LIMITS]; /* bytes */
    uint64_t current[GS_LIMITS]; /* bytes the value set last takes */
    size_t stack_seen;           /* the stack limit was at least this (cuCtxGetLimit) ... */
    unsigned stack_epoch;        /* ... as long as g_stack_epoch is still this (gs_limits_stack_for) */
};
/* Moves after every cuCtxSetLimit of the stack size through the hook (which may lower it): a
 * launch's view of a context's stack (stack_seen) holds only while it has not moved.  The driver
 * itself only ever raises the stack (cuda.h: it "isn't reset back"), which keeps that view a
 * lower bound. */
static unsigned g_stack_epoch;
static struct gs_limits *g_lim; /* under g_lim_mu */
static int g_nlim;

/* Bytes per unit of `limit`: the stack is per thread, for every thread the device runs at once;
 * 0 if the driver cannot say. */
static uint64_t limit_unit(CUlimit limit)
{
    if (limit != CU_LIMIT_STACK_SIZE) return 1;
    CUdevice dev;
    int sms = 0, per_sm = 0;
    if (!gs_cuda.cuCtxGetDevice || !gs_cuda.cuDeviceGetAttribute || gs_cuda.cuCtxGetDevice(&dev) != CUDA_SUCCESS ||
        gs_cuda.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) != CUDA_SUCCESS ||
        gs_cuda.cuDeviceGetAttribute(&per_sm, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, dev) !=
            CUDA_SUCCESS ||
        sms <= 0 || per_sm <= 0)
        return 0;
    return (uint64_t)sms * (uint64_t)per_sm;
}

/* The limit's entry for ctx (made if need be), or -1 when no memory is left for one; caller
 * holds g_lim_mu. */
static int lim_entry_locked(CUcontext ctx, int slot)
{
    int free_at = -1;
    for (int i = 0; i < g_nlim; i++) {
        if (g_lim[i].ctx == ctx) return i;
        if (!g_lim[i].ctx && free_at < 0) free_at = i;
    }
    if (free_at < 0) {
        int n = g_nlim ? 2 * g_nlim : GS_LIMIT_CTXS;
        struct gs_limits *t = realloc(g_lim, (size_t)n * sizeof(*t));
        if (!t) return -1;
        memset(t + g_nlim, 0, (size_t)(n - g_nlim) * sizeof(*t));
        free_at = g_nlim;
        g_lim = t;
        g_nlim = n;
    }
    memset(&g_lim[free_at], 0, sizeof(g_lim[free_at]));
    g_lim[free_at].ctx = ctx;
    g_lim[free_at].slot = slot;
    return free_at;
}

void gs_limits_forget_ctx(CUcontext ctx)
{
    gs_lmem_forget_all(); /* the context's functions went with it, and their handles may come back */
    pthread_mutex_lock(&g_lim_mu);
    for (int i = 0; i < g_nlim; i++) {
        if (g_lim[i].ctx != ctx) continue;
        for (int l = 0; l < GS_LIMITS; l++)
            if (g_lim[i].charged[l]) gs_budget_release(g_lim[i].slot, g_lim[i].charged[l]);
        memset(&g_lim[i], 0, sizeof(g_lim[i]));
    }
    pthread_mutex_unlock(&g_lim_mu);
}

int gs_limits_slack(int slot)
{
    int any = 0;
    pthread_mutex_lock(&g_lim_mu);
    for (int i = 0; i < g_nlim; i++)
        for (int l = 0; l < GS_LIMITS; l++)
            if (g_lim[i].ctx && g_lim[i].slot == slot && g_lim[i].charged[l] > g_lim[i].current[l]) any = 1;
    pthread_mutex_unlock(&g_lim_mu);
    return any;
}

uint64_t gs_limits_take_slack(int slot, uint64_t bytes)
{
    uint64_t taken = 0;
    pthread_mutex_lock(&g_lim_mu);
    for (int i = 0; i < g_nlim && taken < bytes; i++) {
        if (!g_lim[i].ctx || g_lim[i].slot != slot) continue;
        for (int l = 0; l < GS_LIMITS && taken < bytes; l++) {
            uint64_t slack = g_lim[i].charged[l] > g_lim[i].current[l] ? g_lim[i].charged[l] - g_lim[i].current[l] : 0;
            uint64_t take = slack < bytes - taken ? slack : bytes - taken;
            g_lim[i].charged[l] -= take;
            taken += take;
        }
    }
    if (taken) gs_budget_release(slot, taken);
    pthread_mutex_unlock(&g_lim_mu);
    return taken;
}

/* What is set now, in bytes beyond `base`; UINT64_MAX past counting. */
static uint64_t limit_bytes(size_t value, size_t base, uint64_t unit)
{
    uint64_t over = value > base ? (uint64_t)(value - base) : 0;
    return over > UINT64_MAX / unit ? UINT64_MAX : over * unit;
}

/* This thread is inside the hook's driver call, holding g_set_mu: a driver callback's own
 * cuCtxSetLimit (a profiler's) is accounted without taking it again */
static __thread int t_setting;

/* A limit whose memory is not known beforehand: the device runtime's (its synchronisation depth
 * and pending launch count set memory aside in amounts the driver does not document), and any
 * limit the driver cannot report.  Raised under a cap, this process's memory is measured at once
 * (not only near the cap): past the cap, the old value is set again and the call refused with
 * CUDA_ERROR_OUT_OF_MEMORY, as for the limits reserved beforehand.  A driver that sets the
 * memory aside later (at a launch) is charged by the reconcile then, and not refused. */
static CUresult set_then_measure(CUcontext ctx, int slot, CUlimit limit, size_t value)
{
    size_t was = 0;
    int judged = ctx && slot >= 0 && gs_slot_limit(slot) && gs_cuda.cuCtxGetLimit &&
                 gs_cuda.cuCtxGetLimit(&was, limit) == CUDA_SUCCESS && value > was;
    CUresult rc = gs_cuda.cuCtxSetLimit(limit, value);
    if (rc != CUDA_SUCCESS) return rc;
    if (!judged) {
        gs_reconcile_after_load();
        return rc;
    }
    gs_reconcile_slot(slot);
    uint64_t cap = gs_slot_limit(slot), used = gs_slot_used(slot);
    if (!cap || used <= cap) return rc;
    GS_INFO("cuCtxSetLimit(%d, %zu) refused: the container would hold %llu bytes of its %llu", (int)limit, value,
            (unsigned long long)used, (unsigned long long)cap);
    gs_cuda.cuCtxSetLimit(limit, was);
    CUdevice dev;
    if (gs_cuda.cuCtxGetDevice && gs_cuda.cuCtxGetDevice(&dev) == CUDA_SUCCESS) gs_reconcile_remeasure(dev);
    gs_reconcile_slot(slot); /* what the old value gives back */
    return CUDA_ERROR_OUT_OF_MEMORY;
}

GS_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value)
{
    gs_cuda_init();
    if (!gs_cuda.cuCtxSetLimit) return CUDA_ERROR_NOT_SUPPORTED;
    /* a driver callback under another lock of ours: it must not wait for the context lock (see
     * gs_t_held); the reconcile charges what the change took.  Inside this hook's own driver
     * call (t_setting) it is accounted without taking g_set_mu again: this thread holds it, and
     * the context lock before it */
    if (gs_t_held) {
        CUresult rc = gs_cuda.cuCtxSetLimit(limit, value);
        if (limit == CU_LIMIT_STACK_SIZE) __atomic_add_fetch(&g_stack_epoch, 1, __ATOMIC_RELEASE);
        return rc;
    }
    gs_devices_ready();
    CUcontext ctx;
    int slot = gs_current_slot(&ctx);
    uint64_t unit = slot >= 0 && limit >= 0 && limit < GS_LIMITS ? limit_unit(limit) : 0;
    size_t now = 0;
    if (!unit || !gs_cuda.cuCtxGetLimit || gs_cuda.cuCtxGetLimit(&now, limit) != CUDA_SUCCESS) {
        CUresult rc = set_then_measure(ctx, slot, limit, value);
        if (limit == CU_LIMIT_STACK_SIZE) __atomic_add_fetch(&g_stack_epoch, 1, __ATOMIC_RELEASE);
        return rc;
    }
    /* the context lock first, then g_set_mu: a driver callback inside this call may make a
     * context or allocate near the cap (which takes the context lock), and one inside another
     * thread's context call may set a limit.  Near the cap, reconciled first (not from inside
     * another context call: that one measures when it returns); the growth over the current
     * value stands for what is reserved below */
    unsigned depth = gs_ctx_enter();
    if (depth == 1 && GS_UNLIKELY(gs_near_cap(slot, limit_bytes(value, now, unit)))) gs_reconcile_slot_held(slot);
    int nested = t_setting;
    if (!nested) pthread_mutex_lock(&g_set_mu); /* after the context lock, which this thread holds */
    pthread_mutex_lock(&g_lim_mu);
    int e = lim_entry_locked(ctx, slot);
    if (e >= 0 && !g_lim[e].known[limit]) {
        g_lim[e].base[limit] = now;
        g_lim[e].known[limit] = 1;
    }
    /* with an entry, the charge is the most the limit was set to; without one (no room), the
     * growth over the current value, kept */
    uint64_t was = e >= 0 ? g_lim[e].charged[limit] : 0;
    uint64_t target = e >= 0 ? limit_bytes(value, g_lim[e].base[limit], unit) : limit_bytes(value, now, unit);
    pthread_mutex_unlock(&g_lim_mu);
    uint64_t grow = target > was ? target - was : 0;
    /* in flight for the whole call, before the charge changes: no reading that could lower a
     * charge (or take a limit's slack) falls between the driver's change and ours */
    gs_inflight_begin();
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    if (grow && gs_reserve_raw(slot, grow) != 0) {
        GS_INFO("cuCtxSetLimit(%d, %zu) refused: it would take %llu more bytes than the cap leaves", (int)limit,
                value, (unsigned long long)grow);
    } else {
        t_setting++;
        rc = gs_cuda.cuCtxSetLimit(limit, value);
        t_setting--;
        unsigned ep = limit == CU_LIMIT_STACK_SIZE ? __atomic_add_fetch(&g_stack_epoch, 1, __ATOMIC_RELEASE) : 0;
        pthread_mutex_lock(&g_lim_mu);
        int mine = e >= 0 && g_lim[e].ctx == ctx;
        if (rc == CUDA_SUCCESS && mine && limit == CU_LIMIT_STACK_SIZE) { /* what a launch compares with */
            g_lim[e].stack_seen = value;
            g_lim[e].stack_epoch = ep;
        }
        /* a callback inside the driver call may have set the same limit (accounted by its own
         * hook from the same `was`): the charge is the larger of the two, reserved once */
        uint64_t inner = mine ? g_lim[e].charged[limit] : was;
        if (rc == CUDA_SUCCESS && mine && inner > was) {
            if (grow) gs_budget_release(slot, (target < inner ? target : inner) - was);
            if (target > inner) g_lim[e].charged[limit] = target;
            g_lim[e].current[limit] = target;
        } else if (rc == CUDA_SUCCESS && mine) {
            if (grow) g_lim[e].charged[limit] = target;
            g_lim[e].current[limit] = target;
        } else if (grow && (rc != CUDA_SUCCESS || e >= 0)) {
            gs_budget_release(slot, grow); /* failed, or the context went meanwhile and its limits with it */
        }                                  /* (with no entry, the growth stays charged until the exit) */
        pthread_mutex_unlock(&g_lim_mu);
    }
    gs_inflight_end();
    if (!nested) pthread_mutex_unlock(&g_set_mu);
    gs_ctx_unlock();
    if (rc == CUDA_SUCCESS) gs_reconcile_after_load();
    return rc;
}

/* Before a launch near the cap (lmem.c): the driver grows a context's stack by itself when a
 * kernel needs more local memory per thread than the stack limit (cuda.h, CU_LIMIT_STACK_SIZE:
 * "The driver automatically increases the per-thread stack size for each kernel launch as
 * needed"), for every thread the device runs at once, and keeps it.  Here that growth is made
 * first the way an explicit cuCtxSetLimit(CU_LIMIT_STACK_SIZE, need) makes it: through the hook
 * above, reserved before the driver's call and refused past the cap.  The stack's size is asked
 * of the driver (cuCtxGetLimit) once per context until a cuCtxSetLimit of the stack may have
 * lowered it: a kernel needing no more than the stack seen costs no driver call. */
/* The stack size per thread last seen in ctx (canonical), 0 if not known now */
static size_t stack_seen(CUcontext ctx)
{
    unsigned ep = __atomic_load_n(&g_stack_epoch, __ATOMIC_ACQUIRE);
    size_t seen = 0;
    pthread_mutex_lock(&g_lim_mu);
    for (int i = 0; i < g_nlim; i++)
        if (g_lim[i].ctx == ctx && g_lim[i].stack_epoch == ep) seen = g_lim[i].stack_seen;
    pthread_mutex_unlock(&g_lim_mu);
    return seen;
}

int gs_limits_stack_covers(CUcontext ctx, size_t need)
{
    return need <= stack_seen(gs_ctx_canonical(ctx));
}

int gs_limits_stack_for(size_t need)
{
    CUcontext ctx;
    int slot = gs_current_slot(&ctx);
    if (slot < 0 || !ctx || !gs_cuda.cuCtxGetLimit) return 0;
    unsigned ep = __atomic_load_n(&g_stack_epoch, __ATOMIC_ACQUIRE);
    if (need <= stack_seen(ctx)) return 0;
    size_t now = 0;
    if (gs_cuda.cuCtxGetLimit(&now, CU_LIMIT_STACK_SIZE) != CUDA_SUCCESS) return 0; /* the driver's own growth */
    if (now < need) {
        /* the hook records the new size for the next launch (stack_seen) */
        CUresult rc = cuCtxSetLimit(CU_LIMIT_STACK_SIZE, need);
        GS_DEBUG("a launch needs %zu bytes of stack per thread, the context has %zu: %s", need, now,
                 rc == CUDA_SUCCESS ? "grown first" : rc == CUDA_ERROR_OUT_OF_MEMORY ? "refused" : "left to the driver");
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? -1 : 0;
    }
    pthread_mutex_lock(&g_lim_mu);
    int e = lim_entry_locked(ctx, slot);
    if (e >= 0) {
        g_lim[e].stack_seen = now;
        g_lim[e].stack_epoch = ep;
    }
    pthread_mutex_unlock(&g_lim_mu);
    return 0;
}

void gs_limits_after_fork_child(void)
{
    pthread_mutex_init(&g_lim_mu, NULL);
    pthread_mutex_init(&g_set_mu, NULL);
    if (g_lim) memset(g_lim, 0, (size_t)g_nlim * sizeof(*g_lim));
}
