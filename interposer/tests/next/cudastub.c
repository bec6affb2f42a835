/*
 * cudastub.c - libgscudastub.so: a library that is not the driver but exports a
 * driver name (a mock, a stub).  dlsym on its handle must return its own
 * function, and must not make the interposer take it for libcuda.
 */
__attribute__((visibility("default"))) int cuInit(unsigned flags)
{
    (void)flags;
    return 999;
}
