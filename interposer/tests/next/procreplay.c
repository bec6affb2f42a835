/*
 * procreplay.c - replays cuGetProcAddress requests as the CUDA runtime makes them.
 *
 * Reads "<symbol> <cudaVersion> <flags>" lines from stdin (symbol "" for the empty name the
 * runtime asks first), looks cuGetProcAddress_v2 up as the runtime does
 * (dlsym(dlopen("libcuda.so.1"), "cuGetProcAddress_v2"), which the interposer's dlsym answers)
 * and prints, for each request, what it hands out:
 *   "<symbol> <cudaVersion> <flags> <rc> <status> <file> <name> <offset>"
 * <file> the basename of the object the answer lies in, <name> the exported symbol at exactly
 * that address, "-" for none (no answer, or an address that is not an export), <offset> the
 * answer's offset in that object (hex; the same in every process, unlike the address).
 * tests/interposer/test_cudart.py replays the real runtime's recorded requests with it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*procaddr_v2)(const char *, void **, int, unsigned long long, int *);

int main(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        fprintf(stderr, "procreplay: %s\n", dlerror());
        return 2;
    }
    procaddr_v2 get = (procaddr_v2)dlsym(h, "cuGetProcAddress_v2");
    if (!get) {
        fprintf(stderr, "procreplay: no cuGetProcAddress_v2\n");
        return 2;
    }
    Dl_info self;
    if (dladdr((void *)get, &self) && self.dli_fname) {
        const char *slash = strrchr(self.dli_fname, '/');
        printf("dlsym cuGetProcAddress_v2 %s\n", slash ? slash + 1 : self.dli_fname);
    }
    char line[512], symbol[256];
    int version;
    unsigned long long flags;
    while (fgets(line, sizeof(line), stdin)) {
        if (sscanf(line, "%255s %d %llu", symbol, &version, &flags) != 3) continue;
        const char *sym = strcmp(symbol, "\"\"") == 0 ? "" : symbol;
        void *fn = NULL;
        int status = -1;
        int rc = get(sym, &fn, version, flags, &status);
        const char *file = "-", *name = "-";
        unsigned long offset = 0;
        Dl_info info;
        if (rc == 0 && fn && dladdr(fn, &info)) {
            offset = (unsigned long)((char *)fn - (char *)info.dli_fbase);
            if (info.dli_fname) {
                const char *slash = strrchr(info.dli_fname, '/');
                file = slash ? slash + 1 : info.dli_fname;
            }
            if (info.dli_sname && info.dli_saddr == fn) name = info.dli_sname;
        }
        printf("%s %d %llu %d %d %s %s %lx\n", symbol, version, flags, rc, status, file, name, offset);
    }
    return 0;
}
