/*
 * config.c - the environment and the limits file, read once at device discovery (never on a
 * hot path).
 *
 * Memory cap of the container's device i (i = the device's index inside the
 * container, NVML order, which CUDA_VISIBLE_DEVICES does not change):
 *   CUDA_DEVICE_MEMORY_LIMIT_<i> above 0, else CUDA_DEVICE_MEMORY_LIMIT (HAMi-core
 *   syntax: a number of bytes with an optional k/m/g/t suffix, binary units),
 *   else GPUSLICE_MEMORY_PERCENT (1..100) of the device's real total (NVML's
 *   total, the figure the node agent publishes; cuDeviceTotalMem without NVML).
 * Compute: CUDA_DEVICE_SM_LIMIT_<i> above 0, else CUDA_DEVICE_SM_LIMIT (percent of
 *   GPU time, a '%' after it allowed; 0 or 100 = no limit; above 100 is an error, ignored
 *   like any unreadable value).
 * Region file: CUDA_DEVICE_MEMORY_SHARED_CACHE, else /tmp/gpuslice-<uid>.region.
 * GPUSLICE_RECONCILE_MARGIN: see reconcile.c (size syntax, default 256m).
 * GPUSLICE_SM_LIMIT_MODE: "throughput" (default: GPU time is charged with the
 *   clock compensation of clockcomp.c) or "time" (plain share of GPU time).
 * GPUSLICE_SM_TIMESLICE_CORRECTION: "nvml" (default) or "off", read by slices.c.
 * GPUSLICE_SM_LIMIT_GANG: "on" (default: a launch waits for the clocks of all the container's
 *   devices under a compute limit that live processes use, budget.c) or "off" (its own only).
 *
 * The limits file (/etc/gpuslice/limits): the webhook also writes the limit
 * names above and the region path as NAME=VALUE lines into a pod annotation,
 * which kubelet mounts read-only at that path (a downwardAPI volume, a subPath
 * snapshot taken at container start).  Where that file exists, those names are
 * read from it alone and the environment's values are ignored (one warning if
 * they differ): a tenant's shell cannot start a process with other limits or
 * another region.  The file is the webhook's, so anything the webhook would not
 * write (a line that is not NAME=VALUE, a value its reader would skip, a NUL, more
 * than 4 KiB or 16 names, no region path, no memory limit) makes it untrusted: a
 * dropped line could be the one that limits.  An untrusted or unreadable file
 * grants no device memory (fail closed, with an error naming the annotation).
 * Unknown names are skipped with an error (a newer webhook's).
 * GPUSLICE_LIMITS_FILE names another file only where /etc/gpuslice/limits does
 * not exist (tests; a container without the mount gains nothing from it).
 *
 * Webhook-managed containers (the limits file or GPUSLICE_POD_UID): the webhook writes the
 * un-indexed names as explicit env entries, which win over anything a tenant
 * injects through envFrom, but it cannot strip envFrom.  So in that mode
 * whatever could only loosen the slice is ignored, with one warning: the
 * indexed CUDA_DEVICE_MEMORY_LIMIT_<i> / CUDA_DEVICE_SM_LIMIT_<i>, a
 * GPUSLICE_RECONCILE_MARGIN below the default, and GPUSLICE_REAL_LIBCUDA /
 * GPUSLICE_REAL_LIBNVML (real.c), GPUSLICE_SM_LIMIT_MODE=time; and where both CUDA_DEVICE_MEMORY_LIMIT and
 * GPUSLICE_MEMORY_PERCENT are set (the webhook writes one of them), the
 * smaller cap applies.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpuslice.h"

/* Every variable the library reads comes through here.  A secure-execution process (set-user-ID
 * or set-group-ID, file capabilities: AT_SECURE) runs with its caller's environment: a path there
 * (GPUSLICE_REAL_LIBCUDA, CUDA_DEVICE_MEMORY_SHARED_CACHE) made a root program load the caller's
 * library or turn a root-owned file into the region.  It reads none (secure_getenv), only the
 * limits file. */
const char *gs_getenv(const char *name)
{
    return secure_getenv(name);
}

int gs_parse_size(const char *text, uint64_t *out)
{
    const char *p = text;
    uint64_t v = 0;
    while (p && isspace((unsigned char)*p)) p++; /* " 2g" from a YAML value is still 2g */
    if (!p || !isdigit((unsigned char)*p)) return -1;
    while (isdigit((unsigned char)*p)) {
        uint64_t d = (uint64_t)(*p - '0');
        if (v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
        p++;
    }
    unsigned shift = 0;
    switch (tolower((unsigned char)*p)) {
    case '\0': break;
    case 'k': shift = 10; p++; break;
    case 'm': shift = 20; p++; break;
    case 'g': shift = 30; p++; break;
    case 't': shift = 40; p++; break;
    default: if (!isspace((unsigned char)*p)) return -1;
    }
    while (isspace((unsigned char)*p)) p++;
    if (*p != '\0') return -1;
    if (shift && v > (UINT64_MAX >> shift)) return -1;
    *out = v << shift;
    return 0;
}

/* ---- the limits file ---------------------------------------------------- */

#define GS_LIMITS_FILE "/etc/gpuslice/limits"
#define LIMITS_MAX 16

static struct {
    int active;     /* the file decides the limits (it exists, or GPUSLICE_LIMITS_FILE named one) */
    char broken[160]; /* why it cannot be trusted ("" = it can): then no memory is granted */
    unsigned n;
    char path[256];
    struct {
        char name[48];
        char value[208];
    } e[LIMITS_MAX];
} g_lim;
static pthread_once_t g_lim_once = PTHREAD_ONCE_INIT;

/* The names the file decides: the limits (indexed or not) and the region path.  -1 for an index
 * with a leading zero (CUDA_DEVICE_MEMORY_LIMIT_00): a limit name, but one no reader asks for
 * (they ask for _0), so its limit would be dropped. */
static int is_limit_name(const char *name, size_t len)
{
    static const char *const exact[] = {"CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT",
                                        "GPUSLICE_MEMORY_PERCENT", "CUDA_DEVICE_MEMORY_SHARED_CACHE"};
    for (unsigned i = 0; i < sizeof(exact) / sizeof(exact[0]); i++) {
        size_t k = strlen(exact[i]);
        if (len == k && !memcmp(name, exact[i], k)) return 1;
        if (i < 2 && len > k + 1 && !memcmp(name, exact[i], k) && name[k] == '_') {
            size_t d = k + 1;
            while (d < len && isdigit((unsigned char)name[d])) d++;
            if (d == len) return name[k + 1] == '0' && len > k + 2 ? -1 : 1;
        }
    }
    return 0;
}

static const char *file_value(const char *name)
{
    for (unsigned i = 0; i < g_lim.n; i++)
        if (!strcmp(g_lim.e[i].name, name)) return g_lim.e[i].value;
    return NULL;
}

/* The webhook writes this file: anything it would not write means tampering or a bug, and a
 * dropped line could be the one that limits (a per-device cap, the region path). */
__attribute__((format(printf, 1, 2))) static void distrust(const char *fmt, ...)
{
    if (g_lim.broken[0]) return; /* the first reason is the one to fix */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_lim.broken, sizeof(g_lim.broken), fmt, ap);
    va_end(ap);
}

static void parse_limits(char *text)
{
    unsigned line = 0;
    for (char *next, *s = text; s; s = next) {
        next = strchr(s, '\n');
        if (next) *next++ = '\0';
        line++;
        while (isspace((unsigned char)*s)) s++;
        size_t len = strlen(s);
        while (len && isspace((unsigned char)s[len - 1])) s[--len] = '\0';
        if (!*s || *s == '#') continue;
        char *eq = strchr(s, '=');
        if (!eq) {
            distrust("line %u is not NAME=VALUE", line);
            continue;
        }
        size_t nlen = (size_t)(eq - s);
        while (nlen && isspace((unsigned char)s[nlen - 1])) nlen--;
        const char *value = eq + 1;
        while (isspace((unsigned char)*value)) value++;
        int known = is_limit_name(s, nlen);
        if (!known) {
            /* a name a newer webhook may write: skipped, the rest applies */
            GS_ERROR("%s line %u: ignoring '%.*s' (not one of CUDA_DEVICE_MEMORY_LIMIT[_<i>], GPUSLICE_MEMORY_PERCENT, "
                     "CUDA_DEVICE_SM_LIMIT[_<i>], CUDA_DEVICE_MEMORY_SHARED_CACHE)",
                     g_lim.path, line, (int)(nlen < 64 ? nlen : 64), s);
            continue;
        }
        if (known < 0) {
            distrust("line %u names a device index with a leading zero", line);
            continue;
        }
        if (nlen >= sizeof(g_lim.e[0].name) || strlen(value) >= sizeof(g_lim.e[0].value)) {
            distrust("line %u is too long", line);
            continue;
        }
        s[nlen] = '\0';
        unsigned i = 0;
        while (i < g_lim.n && strcmp(g_lim.e[i].name, s) != 0) i++;
        if (i == LIMITS_MAX) {
            distrust("more than %u names", LIMITS_MAX);
            continue;
        }
        if (i == g_lim.n) g_lim.n++; /* a name given twice: the last line wins, as in a shell */
        memcpy(g_lim.e[i].name, s, nlen + 1);
        memcpy(g_lim.e[i].value, value, strlen(value) + 1);
    }
}

static int parse_percent(const char *text, uint64_t *out);

/* Every value the way its reader will take it: one the reader would skip (and fall back to no
 * limit) must not reach it. */
static void check_values(void)
{
    for (unsigned i = 0; i < g_lim.n && !g_lim.broken[0]; i++) {
        const char *name = g_lim.e[i].name, *v = g_lim.e[i].value;
        uint64_t n = 0;
        int ok;
        if (!strncmp(name, "CUDA_DEVICE_MEMORY_LIMIT", 24)) {
            ok = gs_parse_size(v, &n) == 0 && n > 0;
        } else if (!strcmp(name, "GPUSLICE_MEMORY_PERCENT")) {
            ok = gs_parse_size(v, &n) == 0 && n >= 1 && n <= 100;
        } else if (!strncmp(name, "CUDA_DEVICE_SM_LIMIT", 20)) {
            /* its reader's own parse (a check of its own took 40 zeros and 30 for 30, which the
             * reader skipped: no compute limit), without the sign or '%' the webhook never writes */
            ok = isdigit((unsigned char)*v) && !strchr(v, '%') && parse_percent(v, &n) == 0;
        } else {
            ok = v[0] == '/';
        }
        if (!ok) distrust("%s has the value '%.40s'", name, v);
    }
    if (!g_lim.broken[0] && !file_value("CUDA_DEVICE_MEMORY_SHARED_CACHE"))
        distrust("it names no region (CUDA_DEVICE_MEMORY_SHARED_CACHE)");
    if (!g_lim.broken[0] && !file_value("CUDA_DEVICE_MEMORY_LIMIT") && !file_value("GPUSLICE_MEMORY_PERCENT"))
        distrust("it names no memory limit (CUDA_DEVICE_MEMORY_LIMIT or GPUSLICE_MEMORY_PERCENT)");
}

/* The environment's values the file overrides: said once, so nobody wonders why an
 * exported limit has no effect. */
static void warn_overridden_env(void)
{
    if (getauxval(AT_SECURE)) return; /* the environment is not read at all */
    for (char **ep = environ; ep && *ep; ep++) {
        const char *eq = strchr(*ep, '=');
        if (!eq || !is_limit_name(*ep, (size_t)(eq - *ep)) || !eq[1]) continue;
        char name[48];
        size_t nlen = (size_t)(eq - *ep);
        if (nlen >= sizeof(name)) continue;
        memcpy(name, *ep, nlen);
        name[nlen] = '\0';
        const char *mine = file_value(name);
        if (mine && !strcmp(mine, eq + 1)) continue;
        GS_WARN("ignoring %s=%.64s from the environment (and any other limit set there): the container's limits "
                "come from %s",
                name, eq + 1, g_lim.path);
        return;
    }
}

#define LIMITS_FILE_MAX 4096

static void load_limits(void)
{
    const char *path = GS_LIMITS_FILE;
    struct stat st;
    if (lstat(path, &st) != 0 && errno == ENOENT) {
        path = gs_getenv("GPUSLICE_LIMITS_FILE");
        if (!path || !*path) return;
    }
    g_lim.active = 1;
    snprintf(g_lim.path, sizeof(g_lim.path), "%s", path);
    char text[LIMITS_FILE_MAX + 1];
    size_t have = 0;
    /* not blocking: a FIFO planted where GPUSLICE_LIMITS_FILE points would hang the process */
    int err = 0, fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) err = errno;
    if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
        close(fd);
        fd = -1;
        err = EINVAL;
    }
    while (fd >= 0 && have < sizeof(text)) { /* one byte past the most a file may hold: too long */
        ssize_t r = read(fd, text + have, sizeof(text) - have);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) err = errno;
        if (r <= 0) break;
        have += (size_t)r;
    }
    if (fd >= 0) close(fd);
    if (err == EINVAL) {
        distrust("it is not a plain file");
    } else if (err) {
        distrust("it cannot be read (%s)", strerror(err));
    } else if (have > LIMITS_FILE_MAX) {
        distrust("it is longer than %u bytes", LIMITS_FILE_MAX);
    } else if (memchr(text, '\0', have)) {
        distrust("it holds a NUL byte");
    } else {
        text[have] = '\0';
        parse_limits(text);
        check_values();
    }
    if (g_lim.broken[0])
        GS_ERROR("the container's limits file %s cannot be trusted: %s", path, g_lim.broken);
    else
        GS_INFO("limits from %s: %u names", path, g_lim.n);
    warn_overridden_env();
}

static int limits_from_file(void)
{
    pthread_once(&g_lim_once, load_limits);
    return g_lim.active;
}

/* A limit name's value: from the limits file where there is one, else from the environment. */
static const char *limit_value(const char *name)
{
    const char *v = limits_from_file() ? file_value(name) : gs_getenv(name);
    return v && *v ? v : NULL;
}

int gs_limits_from_file(void)
{
    return limits_from_file();
}

int gs_env_managed(void)
{
    if (limits_from_file()) return 1;
    const char *v = gs_getenv("GPUSLICE_POD_UID");
    return v && *v;
}

static int g_warned_indexed, g_warned_both, g_warned_none;

static const char *env_indexed(const char *name, unsigned index, char *buf, size_t len)
{
    snprintf(buf, len, "%s_%u", name, index);
    const char *v = limit_value(buf);
    if (v) {
        if (limits_from_file() || !gs_env_managed()) return v; /* the file is the webhook's own */
        if (!__atomic_exchange_n(&g_warned_indexed, 1, __ATOMIC_RELAXED))
            GS_WARN("ignoring %s and every other per-device CUDA_DEVICE_*_LIMIT_<i>: GPUSLICE_POD_UID is set, "
                    "so the limits are the ones the webhook wrote", buf);
    }
    return limit_value(name);
}

/* The value of NAME_<index> where it is set, else of NAME, parsed into *out (0 where neither
 * is usable).  An indexed value that is unreadable or 0 falls back to NAME, as HAMi-core takes
 * an indexed value only above 0 (an indexed 0 lifted the container-wide cap, and a bad one the
 * compute limit; found by review).  Returns the value used, or NULL. */
static const char *indexed_value(const char *name, unsigned index, int (*parse)(const char *, uint64_t *),
                                 const char *expected, uint64_t *out)
{
    char key[96];
    const char *v = env_indexed(name, index, key, sizeof(key)), *all = limit_value(name);
    *out = 0;
    if (v && v != all) {
        if (parse(v, out) == 0 && *out) return v;
        if (parse(v, out) != 0)
            GS_ERROR("ignoring %s value '%s' (expected %s)%s%s%s", key, v, expected, all ? "; " : "", all ? name : "",
                     all ? " applies" : "");
        v = all;
    }
    if (v && parse(v, out) != 0) {
        GS_ERROR("ignoring %s value '%s' (expected %s)", name, v, expected);
        v = NULL;
    }
    if (!v) *out = 0;
    return v;
}

/* A percentage, 0..100: digits, a '%' after them or not, spaces around.  Above 100 it is not one:
 * 150 was taken for "no limit" without a word, and a per-device 150 lifted the container-wide
 * limit that an unreadable per-device value leaves in place */
static int parse_percent(const char *text, uint64_t *out)
{
    char buf[32];
    size_t n = strlen(text);
    while (n && isspace((unsigned char)text[n - 1])) n--;
    if (n && text[n - 1] == '%') n--;
    if (!n || n >= sizeof(buf)) return -1;
    memcpy(buf, text, n);
    buf[n] = '\0';
    for (const char *p = buf; *p; p++)
        if (isalpha((unsigned char)*p)) return -1; /* no size suffix */
    uint64_t v;
    if (gs_parse_size(buf, &v) != 0 || v > 100) return -1;
    *out = v;
    return 0;
}

/* GPUSLICE_MEMORY_PERCENT of total; 0 = not set, invalid or unresolvable. */
static uint64_t env_percent_cap(uint64_t total)
{
    const char *v = limit_value("GPUSLICE_MEMORY_PERCENT");
    if (!v) return 0;
    uint64_t pct = 0; /* the same syntax as the sizes, without a suffix */
    if (gs_parse_size(v, &pct) != 0 || pct < 1 || pct > 100) {
        GS_ERROR("ignoring GPUSLICE_MEMORY_PERCENT value '%s' (expected 1..100)", v);
        return 0;
    }
    if (!total) {
        GS_WARN("GPUSLICE_MEMORY_PERCENT=%llu: the device's total is unknown, no cap applied", (unsigned long long)pct);
        return 0;
    }
    /* In whole MiB of whole MiB, as the extender counts it: the agent publishes NVML's total in
     * MiB (rounded down) and the extender reserves memoryMiB * P / 100 MiB (rounded down).  A
     * cap of the exact share of the bytes was up to a MiB above what was reserved, so a slice
     * beside another that filled the rest of the GPU as counted overcommitted it. */
    uint64_t cap = total / GS_MIB * (uint64_t)pct / 100 * GS_MIB;
    if (!cap) /* a device under 100 MiB (test doubles): its share in bytes, not "no cap" */
        cap = total / 100 * (uint64_t)pct + total % 100 * (uint64_t)pct / 100;
    return cap;
}

uint64_t gs_env_memory_limit(unsigned container_index, uint64_t total)
{
    uint64_t limit;
    const char *v = indexed_value("CUDA_DEVICE_MEMORY_LIMIT", container_index, gs_parse_size, "e.g. 10240m or 10g",
                                  &limit);
    if (v && !gs_env_managed()) return limit; /* HAMi-core: the byte limit wins (0 = none) */
    uint64_t pct = env_percent_cap(total);
    if (limit && pct) {
        if (!__atomic_exchange_n(&g_warned_both, 1, __ATOMIC_RELAXED))
            GS_WARN("both CUDA_DEVICE_MEMORY_LIMIT and GPUSLICE_MEMORY_PERCENT are set for a webhook-managed "
                    "container: the smaller cap applies");
        return limit < pct ? limit : pct;
    }
    uint64_t cap = limit ? limit : pct;
    if (limits_from_file() && (g_lim.broken[0] || !cap)) {
        /* The webhook always writes a usable memory limit: without one the file was tampered
         * with or its annotation is gone (kubelet then writes an empty file).  Grant nothing
         * rather than the whole device. */
        if (!__atomic_exchange_n(&g_warned_none, 1, __ATOMIC_RELAXED))
            GS_ERROR("%s gives no usable memory limit (%s; is the pod's gpuslice.io/limits.<container> annotation "
                     "missing?): no device memory is granted",
                     g_lim.path, g_lim.broken[0] ? g_lim.broken : "none resolves");
        return GS_CAP_NOTHING;
    }
    return cap;
}

uint64_t gs_env_reconcile_margin(void)
{
    const char *v = gs_getenv("GPUSLICE_RECONCILE_MARGIN");
    uint64_t m;
    if (!v || !*v) return GS_DEFAULT_MARGIN;
    if (gs_parse_size(v, &m) != 0) {
        GS_ERROR("ignoring GPUSLICE_RECONCILE_MARGIN value '%s' (expected e.g. 256m)", v);
        return GS_DEFAULT_MARGIN;
    }
    if (m < GS_DEFAULT_MARGIN && gs_env_managed()) {
        GS_WARN("ignoring GPUSLICE_RECONCILE_MARGIN=%s below the default: GPUSLICE_POD_UID is set", v);
        return GS_DEFAULT_MARGIN;
    }
    return m;
}

unsigned gs_env_sm_limit(unsigned container_index)
{
    uint64_t pct;
    indexed_value("CUDA_DEVICE_SM_LIMIT", container_index, parse_percent, "0..100", &pct);
    return pct >= 100 ? 0 : (unsigned)pct;
}

/* An env switch with two words: 1 if it names `other`; 0 if unset, empty, `dflt` or anything
 * else (that with an error naming both words) */
static int env_switch(const char *name, const char *dflt, const char *other)
{
    const char *v = gs_getenv(name);
    if (!v || !*v || !strcmp(v, dflt)) return 0;
    if (strcmp(v, other) != 0) {
        GS_ERROR("ignoring %s value '%s' (expected %s or %s)", name, v, dflt, other);
        return 0;
    }
    return 1;
}

int gs_env_sm_time_mode(void)
{
    if (!env_switch("GPUSLICE_SM_LIMIT_MODE", "throughput", "time")) return 0;
    if (gs_env_managed()) {
        GS_WARN("ignoring GPUSLICE_SM_LIMIT_MODE=time: GPUSLICE_POD_UID is set");
        return 0;
    }
    return 1;
}

int gs_env_sm_gang(void)
{
    return !env_switch("GPUSLICE_SM_LIMIT_GANG", "on", "off");
}

const char *gs_env_region_path(char *buf, size_t len)
{
    const char *v = limit_value("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (v) {
        snprintf(buf, len, "%s", v);
    } else {
        snprintf(buf, len, "/tmp/gpuslice-%u.region", (unsigned)getuid());
    }
    return buf;
}

void gs_copy_env(char *dst, size_t len, const char *name)
{
    const char *v = gs_getenv(name);
    memset(dst, 0, len);
    if (v) {
        size_t n = strlen(v);
        if (n >= len) n = len - 1;
        memcpy(dst, v, n);
    }
}
