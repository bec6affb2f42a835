/*
 * allocmap.c - what this process holds: (kind, handle) -> bytes charged, slot.
 *
 * Frees must return exactly what the allocation charged, so every successful
 * allocation is recorded here.  Open addressing with linear probing and
 * backward-shift deletion; the table lives in mmap'ed memory (no malloc on
 * the allocation path) and doubles when half full.  One process-local mutex.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>

#include "gpuslice.h"

struct slot_entry {
    uint64_t key;
    uint64_t size;
    uint64_t aux;
    uint64_t aux2_ctx;
    int32_t slot;
    int32_t kind; /* 0 = empty */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct slot_entry *g_tab;
static size_t g_cap; /* power of two */
static size_t g_len;

static size_t hash(int kind, uint64_t key)
{
    uint64_t h = (key ^ ((uint64_t)kind << 56)) * 0x9e3779b97f4a7c15ull;
    return (size_t)(h ^ (h >> 29));
}

static struct slot_entry *table_alloc(size_t cap)
{
    void *p = mmap(NULL, cap * sizeof(struct slot_entry), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void insert_raw(struct slot_entry *tab, size_t cap, const struct slot_entry *e)
{
    size_t i = hash(e->kind, e->key) & (cap - 1);
    while (tab[i].kind) i = (i + 1) & (cap - 1);
    tab[i] = *e;
}

static int grow_locked(void)
{
    size_t cap = g_cap ? g_cap * 2 : 1024;
    struct slot_entry *tab = table_alloc(cap);
    if (!tab) return -1;
    for (size_t i = 0; i < g_cap; i++)
        if (g_tab[i].kind) insert_raw(tab, cap, &g_tab[i]);
    if (g_tab) munmap(g_tab, g_cap * sizeof(struct slot_entry));
    g_tab = tab;
    g_cap = cap;
    return 0;
}

static struct slot_entry *find_locked(int kind, uint64_t key)
{
    if (!g_tab) return NULL;
    for (size_t i = hash(kind, key) & (g_cap - 1);; i = (i + 1) & (g_cap - 1)) {
        if (!g_tab[i].kind) return NULL;
        if (g_tab[i].kind == kind && g_tab[i].key == key) return &g_tab[i];
    }
}

int gs_am_put(int kind, uint64_t key, const struct gs_alloc *rec, struct gs_alloc *replaced)
{
    int rc = 0;
    pthread_mutex_lock(&g_mu);
    struct slot_entry *e = find_locked(kind, key);
    if (e) {
        /* The driver reused a handle we still hold (freed by a path we do not
         * see): the caller returns the old charge. */
        replaced->size = e->size;
        replaced->aux = e->aux;
        replaced->slot = e->slot;
        replaced->ctx = e->aux2_ctx;
        rc = 1;
        e->size = rec->size;
        e->aux = rec->aux;
        e->aux2_ctx = rec->ctx;
        e->slot = rec->slot;
    } else if ((g_len + 1) * 2 > g_cap && grow_locked() != 0) {
        rc = -1;
    } else {
        struct slot_entry ne = {.key = key, .size = rec->size, .aux = rec->aux, .aux2_ctx = rec->ctx,
                                .slot = rec->slot, .kind = kind};
        insert_raw(g_tab, g_cap, &ne);
        g_len++;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

static void copy_out(const struct slot_entry *e, struct gs_alloc *out)
{
    out->size = e->size;
    out->aux = e->aux;
    out->ctx = e->aux2_ctx;
    out->slot = e->slot;
}

static void remove_locked(struct slot_entry *e)
{
    /* backward-shift deletion keeps every probe chain unbroken */
    size_t hole = (size_t)(e - g_tab), mask = g_cap - 1;
    for (size_t j = (hole + 1) & mask; g_tab[j].kind; j = (j + 1) & mask) {
        size_t home = hash(g_tab[j].kind, g_tab[j].key) & mask;
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            g_tab[hole] = g_tab[j];
            hole = j;
        }
    }
    memset(&g_tab[hole], 0, sizeof(g_tab[hole]));
    g_len--;
}

int gs_am_take(int kind, uint64_t key, struct gs_alloc *out)
{
    pthread_mutex_lock(&g_mu);
    struct slot_entry *e = find_locked(kind, key);
    if (e) {
        copy_out(e, out);
        remove_locked(e);
    }
    pthread_mutex_unlock(&g_mu);
    return e ? 0 : -1;
}

int gs_am_has(int kind, uint64_t key)
{
    pthread_mutex_lock(&g_mu);
    int found = find_locked(kind, key) != NULL;
    pthread_mutex_unlock(&g_mu);
    return found;
}

int gs_am_update(int kind, uint64_t key, int (*fn)(struct gs_alloc *rec, void *arg), void *arg,
                 struct gs_alloc *out)
{
    pthread_mutex_lock(&g_mu);
    struct slot_entry *e = find_locked(kind, key);
    int rc = -1;
    if (e) {
        copy_out(e, out);
        rc = fn(out, arg);
        if (rc == 1) {
            remove_locked(e);
        } else if (rc == 0) {
            e->size = out->size;
            e->aux = out->aux;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

size_t gs_am_take_range(int kind, uint64_t lo, uint64_t hi, uint64_t *keys, struct gs_alloc *out, size_t max)
{
    size_t n = 0;
    pthread_mutex_lock(&g_mu);
    /* Contiguous records first (key + size is the next key), the common case;
     * the whole table only if they leave part of the range uncovered. */
    uint64_t at = lo;
    struct slot_entry *e;
    while (n < max && at < hi && (e = find_locked(kind, at)) != NULL) {
        keys[n] = at;
        copy_out(e, &out[n++]);
        at += e->size ? e->size : 1;
        remove_locked(e);
    }
    for (size_t i = 0; at < hi && i < g_cap && n < max; i++) {
        if (g_tab[i].kind != kind || g_tab[i].key < at || g_tab[i].key >= hi) continue;
        keys[n] = g_tab[i].key;
        copy_out(&g_tab[i], &out[n++]);
        remove_locked(&g_tab[i]);
        i--; /* the shift may have moved another entry into this place */
    }
    pthread_mutex_unlock(&g_mu);
    return n;
}

void gs_am_drop_ctx(uint64_t ctx, void (*fn)(int kind, uint64_t key, const struct gs_alloc *rec))
{
    struct {
        int kind;
        uint64_t key;
        struct gs_alloc rec;
    } batch[128];
    for (;;) {
        /* found and removed in one hold of the lock: the driver destroyed the context already, so
         * another thread's allocation may land at one of its addresses meanwhile, and its record
         * (another context's) must not be taken for the old one (it was, between a scan and the
         * takes after it: that allocation went uncharged for its life, found by review) */
        size_t n = 0;
        pthread_mutex_lock(&g_mu);
        for (size_t i = 0; i < g_cap && n < sizeof(batch) / sizeof(batch[0]); i++) {
            if (g_tab[i].kind && g_tab[i].kind != GS_KIND_CTX && g_tab[i].aux2_ctx == ctx) {
                batch[n].kind = g_tab[i].kind;
                batch[n].key = g_tab[i].key;
                copy_out(&g_tab[i], &batch[n++].rec);
                remove_locked(&g_tab[i]);
                i--; /* the shift may have moved another entry into this place */
            }
        }
        pthread_mutex_unlock(&g_mu);
        if (!n) return;
        for (size_t i = 0; i < n; i++) fn(batch[i].kind, batch[i].key, &batch[i].rec);
    }
}

void gs_am_lock(void)
{
    pthread_mutex_lock(&g_mu);
}

void gs_am_unlock(void)
{
    pthread_mutex_unlock(&g_mu);
}

void gs_am_after_fork_child(void)
{
    /* the fork's prepare handler took it in this (the forking) thread: released, not
     * re-initialised, so a thread checker does not take it for still held (a lock-order
     * report against the context lock in a child, found by review) */
    pthread_mutex_unlock(&g_mu);
    if (g_tab) memset(g_tab, 0, g_cap * sizeof(struct slot_entry));
    g_len = 0;
}
