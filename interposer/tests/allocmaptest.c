/*
 * allocmaptest - src/allocmap.c (what the process holds, per handle) alone, compiled in.
 *
 *   allocmaptest SCENARIO   prints what the scenario checks, exits 1 if it does not hold
 *
 *   reuse    a context's end (gs_am_drop_ctx) while another thread's allocation in another
 *            context lands at one of the ended context's addresses (the driver destroyed it
 *            first, so its addresses are free): played by the first callback, between the
 *            records the end takes.  The other allocation's record must survive.
 *   many     20,000 records of two contexts, one context dropped: exactly its records go
 *            (the table grew and shifted entries back as they went).
 */
#define _GNU_SOURCE
#include "allocmap.c"

#include <stdio.h>

#define CTX_A 0xa000ull
#define CTX_B 0xb000ull

static int g_calls, g_foreign;
static uint64_t g_dropped;

static void reuse_cb(int kind, uint64_t key, const struct gs_alloc *rec)
{
    (void)kind;
    if (rec->ctx != CTX_A) g_foreign++;
    g_dropped += rec->size;
    if (g_calls++ == 0) { /* the other thread: context B allocates at A's other freed address */
        struct gs_alloc b = {.size = 300 << 20, .slot = 0, .ctx = CTX_B}, old;
        int put = gs_am_put(GS_KIND_DPTR, key == 0x1000 ? 0x2000 : 0x1000, &b, &old);
        printf("context B's allocation recorded (replaced a record: %d)\n", put);
    }
}

static int reuse(void)
{
    struct gs_alloc a = {.size = 100 << 20, .slot = 0, .ctx = CTX_A}, old, left;
    gs_am_put(GS_KIND_DPTR, 0x1000, &a, &old);
    gs_am_put(GS_KIND_DPTR, 0x2000, &a, &old);
    gs_am_drop_ctx(CTX_A, reuse_cb);
    int kept = gs_am_take(GS_KIND_DPTR, 0x1000, &left) == 0 || gs_am_take(GS_KIND_DPTR, 0x2000, &left) == 0;
    kept = kept && left.ctx == CTX_B && left.size == 300 << 20;
    printf("dropped %llu MiB of context A, records of another context taken: %d, B's record kept: %d\n",
           (unsigned long long)(g_dropped >> 20), g_foreign, kept);
    return g_dropped == 200 << 20 && !g_foreign && kept ? 0 : 1;
}

static void count_cb(int kind, uint64_t key, const struct gs_alloc *rec)
{
    (void)kind;
    (void)key;
    if (rec->ctx != CTX_A) g_foreign++;
    g_calls++;
}

static int many(void)
{
    enum { N = 20000 };
    struct gs_alloc old, left;
    for (uint64_t i = 0; i < N; i++) {
        struct gs_alloc r = {.size = 4096, .slot = 0, .ctx = i % 3 ? CTX_A : CTX_B};
        gs_am_put(GS_KIND_DPTR, 0x10000000ull + i * 4096, &r, &old);
    }
    gs_am_drop_ctx(CTX_A, count_cb);
    int b_left = 0, a_left = 0;
    for (uint64_t i = 0; i < N; i++)
        if (gs_am_take(GS_KIND_DPTR, 0x10000000ull + i * 4096, &left) == 0) ++*(left.ctx == CTX_B ? &b_left : &a_left);
    printf("dropped %d of context A (of %d), foreign %d; left: B %d, A %d\n", g_calls, N - (N + 2) / 3, g_foreign,
           b_left, a_left);
    return g_calls == N - (N + 2) / 3 && !g_foreign && b_left == (N + 2) / 3 && !a_left ? 0 : 1;
}

int main(int argc, char **argv)
{
    const char *s = argc > 1 ? argv[1] : "";
    if (!strcmp(s, "reuse")) return reuse();
    if (!strcmp(s, "many")) return many();
    fprintf(stderr, "usage: allocmaptest reuse|many\n");
    return 2;
}
