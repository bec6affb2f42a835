/*
 * config.c - the environment, read once at device discovery (never on a hot path).
 *
 * Memory cap of the container's device i (i = the device's index inside the
 * container, NVML order, which CUDA_VISIBLE_DEVICES does not change):
 *   CUDA_DEVICE_MEMORY_LIMIT_<i>, else CUDA_DEVICE_MEMORY_LIMIT (HAMi-core
 *   syntax: a number of bytes with an optional k/m/g/t suffix, binary units),
 *   else GPUSLICE_MEMORY_PERCENT (1..100) of the device's real total.
 * Compute: CUDA_DEVICE_SM_LIMIT_<i>, else CUDA_DEVICE_SM_LIMIT (percent of
 *   GPU time; 0, 100 or more = no limit).
 * Region file: CUDA_DEVICE_MEMORY_SHARED_CACHE, else /tmp/gpuslice-<uid>.region.
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
    default: return -1;
    }
    if (*p != '\0') return -1;
    if (shift && v > (UINT64_MAX >> shift)) return -1;
    *out = v << shift;
    return 0;
}

static const char *env_indexed(const char *name, unsigned index, char *buf, size_t len)
{
    snprintf(buf, len, "%s_%u", name, index);
    const char *v = getenv(buf);
    if (v && *v) return v;
    v = getenv(name);
    return v && *v ? v : NULL;
}

uint64_t gs_env_memory_limit(unsigned container_index, uint64_t total)
{
    char key[96];
    const char *v = env_indexed("CUDA_DEVICE_MEMORY_LIMIT", container_index, key, sizeof(key));
    if (v) {
        uint64_t bytes;
        if (gs_parse_size(v, &bytes) == 0) return bytes;
        GS_ERROR("ignoring CUDA_DEVICE_MEMORY_LIMIT value '%s' (expected e.g. 10240m or 10g)", v);
    }
    v = getenv("GPUSLICE_MEMORY_PERCENT");
    if (v && *v) {
        char *end = NULL;
        long pct = strtol(v, &end, 10);
        if (end && *end == '\0' && pct >= 1 && pct <= 100) {
            if (!total) {
                GS_WARN("GPUSLICE_MEMORY_PERCENT=%ld: the device's total is unknown, no cap applied", pct);
                return 0;
            }
            return total / 100 * (uint64_t)pct + total % 100 * (uint64_t)pct / 100;
        }
        GS_ERROR("ignoring GPUSLICE_MEMORY_PERCENT value '%s' (expected 1..100)", v);
    }
    return 0;
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
