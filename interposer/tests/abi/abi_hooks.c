/*
 * abi_hooks.c - every hook's signature in src/hooks.h, and every other driver
 * function the library calls, declared again after the toolkit's cuda.h: a
 * parameter or return type that differs from the driver's own declaration is
 * a "conflicting types" compile error, so abi_check does not build.
 * (__CUDA_API_VERSION_INTERNAL turns off cuda.h's renaming macros, such as
 * cuGetProcAddress -> cuGetProcAddress_v2, which would hide the real names.)
 */
#define __CUDA_API_VERSION_INTERNAL 1
#include <cuda.h>

/* Hooks of entry points newer than the toolkit (CUDA 13.2's and 13.3's, hooks.h) declare
 * functions its cuda.h lacks: checked only with a toolkit that has them.  Their one type of a
 * newer toolkit, declared here otherwise (hooks.h names it; cuda.h's own is then used) */
#if CUDA_VERSION < 13030
typedef void (*CUgraphRecaptureCallback)(void);
#endif

#include "hooks.h"

#define ABI_DECLARE(name, ret, params, base, ver, pt) ret CUDAAPI name params;
#define ABI_DECLARE_REAL(name, ret, params) ret CUDAAPI name params;
GS_CUDA_HOOKS(ABI_DECLARE)
GS_CUDA_REALS(ABI_DECLARE_REAL) /* the real functions we call without hooking them, too */

/* Referenced by abi_check, so this object is always linked into it. */
#define ABI_COUNT(name, ret, params, base, ver, pt) +1
const int abi_hooks_checked = 0 GS_CUDA_HOOKS(ABI_COUNT);
