/*
 * next.c - built twice, as libnexta.so (-DNEXT_A) and libnextb.so: each
 * defines gs_next_marker(); libnexta's gs_next_probe() asks
 * dlsym(RTLD_NEXT, "gs_next_marker"), which must find libnextb's even though
 * dlsym is overridden by the preloaded interposer.
 */
#define _GNU_SOURCE
#include <dlfcn.h>

#ifdef NEXT_A
#define MARK 'a'
#else
#define MARK 'b'
#endif

int gs_next_marker(void)
{
    return MARK;
}

#ifdef NEXT_A
int gs_next_probe(void)
{
    int (*f)(void) = (int (*)(void))dlsym(RTLD_NEXT, "gs_next_marker");
    return f ? f() : -1;
}
#endif
