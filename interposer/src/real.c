/*
 * real.c - the real functions and the dlsym override.
 *
 * The real libcuda / libnvidia-ml are dlopen'ed on first use (never from the
 * constructor) by their standard sonames, or from GPUSLICE_REAL_LIBCUDA /
 * GPUSLICE_REAL_LIBNVML (paths, for tests; ignored, by the dlsym override as
 * well, in a managed container).  If the program already reached a library through dlsym, the file it
 * came from is preferred.  Every real function is resolved once, under
 * pthread_once, into typed pointers; a missing one stays NULL and its hook
 * answers CUDA_ERROR_NOT_SUPPORTED or NVML_ERROR_FUNCTION_NOT_FOUND instead
 * of calling through NULL.
 *
 * dlsym is overridden for the exact names in hooks.h only.  RTLD_NEXT lookups
 * of other names are forwarded as a tail call, so glibc still sees the
 * original caller's return address and searches after the right object.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "dlsym_versions.h"
#include "gpuslice.h"

struct gs_cuda_real gs_cuda;
struct gs_nvml_real gs_nvml;
int gs_cuda_resolved;
int gs_nvml_resolved;

typedef void *(*dlsym_fn)(void *, const char *);

/* dlsym is called by sanitizer runtimes before they are initialised: the
 * dlsym path itself must not be instrumented. */
#define GS_NO_SANITIZE __attribute__((no_sanitize_address, no_sanitize("undefined")))
static dlsym_fn real_dlsym_ptr;

GS_NO_SANITIZE static dlsym_fn find_real_dlsym(void)
{
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    dlsym_fn f = __atomic_load_n(&real_dlsym_ptr, __ATOMIC_ACQUIRE);
    if (GS_LIKELY(f != NULL)) return f;
    for (size_t i = 0; i < sizeof(versions) / sizeof(versions[0]) && !f; i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (f) __atomic_store_n(&real_dlsym_ptr, f, __ATOMIC_RELEASE);
    return f;
}

/* A second copy of this library after us (preloaded twice from two files: a copy named by
 * LD_PRELOAD beside /etc/ld.so.preload's, two versions) is what RTLD_NEXT finds for dlsym, and
 * its dlsym handed this copy its hooks as the driver's functions: each allocation was charged
 * twice (600 MiB for 300 held). Its object exports gpuslice_version, which its dlsym finds
 * there and libc's does not; libc's own dlsym is the real one then, and the second copy, which
 * the program never calls, stays idle. Asked before the driver's functions are looked up (a
 * hooked name, the resolution), never from the first dlsym calls: a sanitizer runtime calls
 * dlsym before its initialisation, and dlopen is intercepted. */
GS_NO_SANITIZE static void settle_real_dlsym(void)
{
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    static int settled;
    if (GS_LIKELY(__atomic_load_n(&settled, __ATOMIC_ACQUIRE))) return;
    dlsym_fn f = find_real_dlsym();
    Dl_info info;
    void *h = f && dladdr((void *)f, &info) && info.dli_fname && info.dli_fname[0]
                  ? dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD)
                  : NULL;
    if (h && f(h, "gpuslice_version")) {
        void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
        dlsym_fn own = NULL;
        for (size_t i = 0; libc && i < sizeof(versions) / sizeof(versions[0]) && !own; i++)
            own = (dlsym_fn)dlvsym(libc, "dlsym", versions[i]);
        if (own) __atomic_store_n(&real_dlsym_ptr, own, __ATOMIC_RELEASE);
        if (libc) dlclose(libc);
    }
    if (h) dlclose(h);
    __atomic_store_n(&settled, 1, __ATOMIC_RELEASE);
}

GS_NO_SANITIZE void *gs_real_dlsym(void *handle, const char *name)
{
    dlsym_fn f = find_real_dlsym();
    return f ? f(handle, name) : NULL;
}

/* ---- the hook table ------------------------------------------------------- */

#define GS_DECLARE_CUDA(name, ret, params, base, ver, pt) GS_EXPORT ret name params;
#define GS_DECLARE_NVML(name, ret, params) GS_EXPORT ret name params;
GS_CUDA_HOOKS(GS_DECLARE_CUDA)
GS_NVML_HOOKS(GS_DECLARE_NVML)

#define GS_ENTRY_CUDA(name, ret, params, base, ver, pt) \
    {#name, #base, ver, pt, (void *)name, (void **)&gs_cuda.name},
const struct gs_hook gs_cuda_hooks[] = {GS_CUDA_HOOKS(GS_ENTRY_CUDA)};
const size_t gs_cuda_hook_count = sizeof(gs_cuda_hooks) / sizeof(gs_cuda_hooks[0]);

#define GS_ENTRY_NVML(name, ret, params) {#name, #name, 0, 0, (void *)name, (void **)&gs_nvml.name},
static const struct gs_hook nvml_hooks[] = {GS_NVML_HOOKS(GS_ENTRY_NVML)};

GS_NO_SANITIZE void *gs_hook_by_name(const char *name)
{
    if (name[0] == 'c' && name[1] == 'u') {
        for (size_t i = 0; i < gs_cuda_hook_count; i++)
            if (strcmp(gs_cuda_hooks[i].name, name) == 0) return gs_cuda_hooks[i].hook;
    } else if (strncmp(name, "nvml", 4) == 0) {
        for (size_t i = 0; i < sizeof(nvml_hooks) / sizeof(nvml_hooks[0]); i++)
            if (strcmp(nvml_hooks[i].name, name) == 0) return nvml_hooks[i].hook;
    }
    return NULL;
}

/* ---- resolution ----------------------------------------------------------- */

static char cuda_seen_path[4096]; /* the libcuda the program itself resolved through dlsym */
static char nvml_seen_path[4096];

/* GPUSLICE_REAL_LIBCUDA (nvml 0) / GPUSLICE_REAL_LIBNVML (nvml 1) where it is honoured: set, and
 * the container not managed (GPUSLICE_POD_UID or a limits file).  Decided once, with one warning
 * where it is ignored, and copied: open_library opens that file and the dlsym override trusts
 * it as the driver, so both must give the same answer (the override, reading the variable
 * itself, handed a managed process's code the real driver's functions). */
static char override_path[2][4096];
static pthread_once_t override_once[2] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};

static void read_override(int nvml)
{
    const char *env = nvml ? "GPUSLICE_REAL_LIBNVML" : "GPUSLICE_REAL_LIBCUDA";
    const char *v = gs_getenv(env);
    if (!v || !*v) return;
    if (gs_env_managed())
        GS_WARN("ignoring %s: the container is managed (GPUSLICE_POD_UID or the limits file), the driver's own "
                "library is used", env);
    else if (strlen(v) < sizeof(override_path[nvml]))
        memcpy(override_path[nvml], v, strlen(v) + 1);
}

static void read_cuda_override(void)
{
    read_override(0);
}

static void read_nvml_override(void)
{
    read_override(1);
}

GS_NO_SANITIZE static const char *real_override(int nvml)
{
    pthread_once(&override_once[nvml], nvml ? read_nvml_override : read_cuda_override);
    return override_path[nvml][0] ? override_path[nvml] : NULL;
}

static void *open_library(int nvml, const char *seen, const char *soname)
{
    const char *override = real_override(nvml);
    const char *path = override ? override : seen[0] ? seen : soname;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h && path != soname) h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!h) GS_INFO("cannot load %s: %s", path, dlerror());
    return h;
}

static void resolve_cuda(void)
{
    settle_real_dlsym();
    void *h = open_library(0, cuda_seen_path, "libcuda.so.1");
    if (h) {
#define GS_RESOLVE_CUDA(name, ret, params, base, ver, pt) gs_cuda.name = (name##_fn)gs_real_dlsym(h, #name);
#define GS_RESOLVE_CUDA_REAL(name, ret, params) gs_cuda.name = (name##_fn)gs_real_dlsym(h, #name);
        GS_CUDA_HOOKS(GS_RESOLVE_CUDA)
        GS_CUDA_REALS(GS_RESOLVE_CUDA_REAL)
        /* Our hooks must never be taken for the real thing (a library that
         * re-exports our symbols would make us call ourselves). */
        for (size_t i = 0; i < gs_cuda_hook_count; i++)
            if (*gs_cuda_hooks[i].real == gs_cuda_hooks[i].hook) *gs_cuda_hooks[i].real = NULL;
    }
    __atomic_store_n(&gs_cuda_resolved, 1, __ATOMIC_RELEASE);
    gs_crash_install();
}

static void resolve_nvml(void)
{
    settle_real_dlsym();
    void *h = open_library(1, nvml_seen_path, "libnvidia-ml.so.1");
    if (h) {
#define GS_RESOLVE_NVML(name, ret, params) gs_nvml.name = (name##_fn)gs_real_dlsym(h, #name);
        GS_NVML_HOOKS(GS_RESOLVE_NVML)
        GS_NVML_REALS(GS_RESOLVE_NVML)
        if ((void *)gs_nvml.nvmlDeviceGetMemoryInfo == (void *)nvmlDeviceGetMemoryInfo)
            gs_nvml.nvmlDeviceGetMemoryInfo = NULL;
        if ((void *)gs_nvml.nvmlDeviceGetMemoryInfo_v2 == (void *)nvmlDeviceGetMemoryInfo_v2)
            gs_nvml.nvmlDeviceGetMemoryInfo_v2 = NULL;
    }
    __atomic_store_n(&gs_nvml_resolved, 1, __ATOMIC_RELEASE);
    gs_crash_install();
}

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;

void gs_cuda_resolve(void)
{
    pthread_once(&cuda_once, resolve_cuda);
}

void gs_nvml_resolve(void)
{
    pthread_once(&nvml_once, resolve_nvml);
}

/* Remember which file a program's libcuda / libnvidia-ml symbols come from. */
GS_NO_SANITIZE static void note_library(const char *name, void *real)
{
    char *dst = name[0] == 'c' ? cuda_seen_path : nvml_seen_path;
    int *resolved = name[0] == 'c' ? &gs_cuda_resolved : &gs_nvml_resolved;
    Dl_info info;
    if (dst[0] || __atomic_load_n(resolved, __ATOMIC_ACQUIRE)) return;
    if (dladdr(real, &info) && info.dli_fname && info.dli_fname[0] == '/') {
        size_t n = strlen(info.dli_fname);
        if (n < sizeof(cuda_seen_path)) memcpy(dst, info.dli_fname, n + 1);
    }
}

#define NOT_HOOKED ((void *)-1)

/* Is `addr` in one of the driver's files: libcuda.so* / the file GPUSLICE_REAL_LIBCUDA names
 * (cuda), libnvidia-ml.so* / GPUSLICE_REAL_LIBNVML (nvml), those two only where honoured? */
GS_NO_SANITIZE static int in_driver_files(void *addr, int cuda, int nvml)
{
    Dl_info info;
    if (!dladdr(addr, &info) || !info.dli_fname) return 0;
    const char *base = strrchr(info.dli_fname, '/');
    base = base ? base + 1 : info.dli_fname;
    if ((cuda && strncmp(base, "libcuda.so", 10) == 0) || (nvml && strncmp(base, "libnvidia-ml.so", 15) == 0))
        return 1;
    const char *c = cuda ? real_override(0) : NULL, *n = nvml ? real_override(1) : NULL;
    return (c && strcmp(c, info.dli_fname) == 0) || (n && strcmp(n, info.dli_fname) == 0);
}

/* Is `fn` the driver's function of that name (libcuda's for cu*, NVML's for nvml*)? */
GS_NO_SANITIZE static int from_driver(void *fn, const char *name)
{
    return in_driver_files(fn, name[0] == 'c', name[0] != 'c');
}

/* dlsym's answer for a hooked name, or NOT_HOOKED.  Kept out of dlsym itself
 * so that dlsym needs no stack frame and its forwarding stays a tail call.
 * The hook stands in for the driver's function only: a same-named function
 * of another library (a stub, a mock, a tracer) is returned as it is, and
 * where the driver's is not to be found the answer is NULL, as without us.
 * A handle whose scope holds this library finds our own export first:
 * RTLD_DEFAULT, and the handle of dlopen(NULL), the global scope, in which
 * Python's ctypes.CDLL(None) looks names up (it was handed our cuInit where no
 * driver was loaded, and calling it loaded one).  Whether the driver is there
 * is then asked as RTLD_NEXT from this library (which also answers RTLD_NEXT:
 * a library before us wrapping the function gets our hook, not itself).  The
 * driver's own lookups (`caller` is its code) get its functions: a driver
 * library that finds the functions of the driver it loads through dlsym, as
 * WSL2's libcuda does, was handed our hook, which calls that library, which
 * called the hook again until the stack ran out. */
GS_NO_SANITIZE __attribute__((noinline)) static void *hooked_dlsym(void *handle, const char *name, void *caller)
{
    void *hook = gs_hook_by_name(name);
    if (!hook) return NOT_HOOKED;
    settle_real_dlsym();
    void *real = handle == RTLD_NEXT ? hook : gs_real_dlsym(handle, name);
    if (real == hook) real = gs_real_dlsym(RTLD_NEXT, name);
    if (!real) return NULL;
    if (real == hook || !from_driver(real, name) || in_driver_files(caller, 1, 1)) return real;
    if (handle != RTLD_DEFAULT && handle != RTLD_NEXT) note_library(name, real);
    return hook;
}

/* Our dlsym, exported as glibc's dlsym@@GLIBC_2.34 and dlsym@<the architecture's first version>
 * (src/dlsym_versions.h, exports.map.in): exported unversioned, a wrapper loaded before us that
 * forwards with dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34"), as HAMi-core's does, skipped it and
 * reached libc's, so the runtime's dlsym(libcuda, "cuGetProcAddress_v2") got the driver's and
 * no cap held.  The real one is still found with dlvsym(RTLD_NEXT) from this library, which
 * searches the objects after it: libc's, never ours. */
#ifdef GS_DLSYM_OLD
#define GS_DLSYM_NAME gs_dlsym_new
__asm__(".symver gs_dlsym_new, dlsym@@" GS_DLSYM_NEW "\n\t"
        ".symver gs_dlsym_old, dlsym@" GS_DLSYM_OLD);
GS_EXPORT void *gs_dlsym_old(void *handle, const char *name) __attribute__((alias("gs_dlsym_new")));
#else
#define GS_DLSYM_NAME dlsym
#endif

GS_NO_SANITIZE GS_EXPORT void *GS_DLSYM_NAME(void *handle, const char *name)
{
    /* glibc declares name nonnull; callers still pass NULL sometimes */
    const char *n = name;
    __asm__("" : "+r"(n));
    if (n && ((n[0] == 'c' && n[1] == 'u') || n[0] == 'n')) {
        void *r = hooked_dlsym(handle, n, __builtin_return_address(0));
        if (r != NOT_HOOKED) return r;
    }
    dlsym_fn f = find_real_dlsym();
    if (GS_UNLIKELY(!f)) return NULL;
    return f(handle, name); /* tail call: glibc sees the caller's return address */
}
