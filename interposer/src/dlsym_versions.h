/*
 * dlsym_versions.h - the glibc versions our dlsym is also exported under, shared by
 * real.c (.symver) and exports.map.in (the version nodes).  Preprocessor only.
 *
 * glibc defines dlsym@@GLIBC_2.34 (since 2.34, in libc.so.6) and the architecture's
 * first version (GLIBC_2.2.5 on x86_64, GLIBC_2.17 on aarch64).  A wrapper loaded
 * before us that forwards with dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.x") asks for one
 * of them, and a versioned lookup skips an unversioned definition.  Elsewhere the
 * export stays unversioned only (GS_DLSYM_OLD undefined).
 */
#ifndef GPUSLICE_DLSYM_VERSIONS_H
#define GPUSLICE_DLSYM_VERSIONS_H

#if defined(__x86_64__)
#define GS_DLSYM_OLD "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define GS_DLSYM_OLD "GLIBC_2.17"
#endif
#define GS_DLSYM_NEW "GLIBC_2.34"

#endif /* GPUSLICE_DLSYM_VERSIONS_H */
