/*
 * config.c - the environment, read once at device discovery (never on a hot path).
 *
 * Memory cap of the container's device i (i = the device's index inside the
 * container, NVML order, which CUDA_VISIBLE_DEVICES does not change):
 *   CUDA_DEVICE_MEMORY_LIMIT_<i>, else CUDA_DEVICE_MEMORY_LIMIT (HAMi-core
 *   syntax: a number of bytes with an optional k/m/g/t suffix, binary units),
 *   else GPUSLICE_MEMORY_PERCENT (1..100) of the device's real total (NVML's
 *   total, the figure the node agent publishes; cuDeviceTotalMem without NVML).
 * Compute: CUDA_DEVICE_SM_LIMIT_<i>, else CUDA_DEVICE_SM_LIMIT (percent of
 *   GPU time; 0, 100 or more = no limit).
 * Region file: CUDA_DEVICE_MEMORY_SHARED_CACHE, else /tmp/gpuslice-<uid>.region.
 * GPUSLICE_RECONCILE_MARGIN: see reconcile.c (size syntax, default 256m).
 * GPUSLICE_SM_LIMIT_MODE: "throughput" (default: GPU time is charged with the
 *   clock compensation of launch.c) or "time" (plain share of GPU time).
 * GPUSLICE_SM_TIMESLICE_CORRECTION: "nvml" (default) or "off", read by slices.c.
 *
 * Webhook-managed containers (GPUSLICE_POD_UID set): the webhook writes the
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpuslice.h"

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

int gs_env_managed(void)
{
    const char *v = getenv("GPUSLICE_POD_UID");
    return v && *v;
}

static int g_warned_indexed, g_warned_both;

static const char *env_indexed(const char *name, unsigned index, char *buf, size_t len)
{
    snprintf(buf, len, "%s_%u", name, index);
    const char *v = getenv(buf);
    if (v && *v) {
        if (!gs_env_managed()) return v;
        if (!__atomic_exchange_n(&g_warned_indexed, 1, __ATOMIC_RELAXED))
            GS_WARN("ignoring %s and every other per-device CUDA_DEVICE_*_LIMIT_<i>: GPUSLICE_POD_UID is set, "
                    "so the limits are the ones the webhook wrote", buf);
    }
    v = getenv(name);
    return v && *v ? v : NULL;
}

/* GPUSLICE_MEMORY_PERCENT of total; 0 = not set, invalid or unresolvable. */
static uint64_t env_percent_cap(uint64_t total)
{
    const char *v = getenv("GPUSLICE_MEMORY_PERCENT");
    if (!v || !*v) return 0;
    uint64_t pct = 0; /* the same syntax as the sizes, without a suffix */
    if (gs_parse_size(v, &pct) != 0 || pct < 1 || pct > 100) {
        GS_ERROR("ignoring GPUSLICE_MEMORY_PERCENT value '%s' (expected 1..100)", v);
        return 0;
    }
    if (!total) {
        GS_WARN("GPUSLICE_MEMORY_PERCENT=%llu: the device's total is unknown, no cap applied", (unsigned long long)pct);
        return 0;
    }
    return total / 100 * (uint64_t)pct + total % 100 * (uint64_t)pct / 100;
}

uint64_t gs_env_memory_limit(unsigned container_index, uint64_t total)
{
    char key[96];
    uint64_t limit = 0;
    const char *v = env_indexed("CUDA_DEVICE_MEMORY_LIMIT", container_index, key, sizeof(key));
    if (v && gs_parse_size(v, &limit) != 0) {
        /* an unreadable per-device value must not lift the container-wide cap */
        const char *all = getenv("CUDA_DEVICE_MEMORY_LIMIT");
        int indexed = v != all;
        GS_ERROR("ignoring %s value '%s' (expected e.g. 10240m or 10g)%s", indexed ? key : "CUDA_DEVICE_MEMORY_LIMIT",
                 v, indexed && all && *all ? "; CUDA_DEVICE_MEMORY_LIMIT applies" : "");
        v = indexed && all && *all && gs_parse_size(all, &limit) == 0 ? all : NULL;
        if (!v) limit = 0;
    }
    if (v && !gs_env_managed()) return limit; /* HAMi-core: the byte limit wins (0 = none) */
    uint64_t pct = env_percent_cap(total);
    if (limit && pct) {
        if (!__atomic_exchange_n(&g_warned_both, 1, __ATOMIC_RELAXED))
            GS_WARN("both CUDA_DEVICE_MEMORY_LIMIT and GPUSLICE_MEMORY_PERCENT are set with GPUSLICE_POD_UID: "
                    "the smaller cap applies");
        return limit < pct ? limit : pct;
    }
    return limit ? limit : pct;
}

uint64_t gs_env_reconcile_margin(void)
{
    const char *v = getenv("GPUSLICE_RECONCILE_MARGIN");
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
    char key[96];
    const char *v = env_indexed("CUDA_DEVICE_SM_LIMIT", container_index, key, sizeof(key));
    if (!v) return 0;
    char *end = NULL;
    long pct = strtol(v, &end, 10);
    if (!end || *end != '\0' || pct < 0) {
        GS_ERROR("ignoring CUDA_DEVICE_SM_LIMIT value '%s' (expected 0..100)", v);
        return 0;
    }
    return pct >= 100 ? 0 : (unsigned)pct;
}

int gs_env_sm_time_mode(void)
{
    const char *v = getenv("GPUSLICE_SM_LIMIT_MODE");
    if (!v || !*v || !strcmp(v, "throughput")) return 0;
    if (strcmp(v, "time") != 0) {
        GS_ERROR("ignoring GPUSLICE_SM_LIMIT_MODE value '%s' (expected throughput or time)", v);
        return 0;
    }
    if (gs_env_managed()) {
        GS_WARN("ignoring GPUSLICE_SM_LIMIT_MODE=time: GPUSLICE_POD_UID is set");
        return 0;
    }
    return 1;
}

const char *gs_env_region_path(char *buf, size_t len)
{
    const char *v = getenv("CUDA_DEVICE_MEMORY_SHARED_CACHE");
    if (v && *v) {
        snprintf(buf, len, "%s", v);
    } else {
        snprintf(buf, len, "/tmp/gpuslice-%u.region", (unsigned)getuid());
    }
    return buf;
}

void gs_copy_env(char *dst, size_t len, const char *name)
{
    const char *v = getenv(name);
    memset(dst, 0, len);
    if (v) {
        size_t n = strlen(v);
        if (n >= len) n = len - 1;
        memcpy(dst, v, n);
    }
}
