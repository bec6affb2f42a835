/*
 * clockcomp.c - the compute limit's clock compensation: the sampler thread's
 * NVML readings give each limited device the factor GPU time is debited times.
 *
 * Clock compensation (GPUSLICE_SM_LIMIT_MODE=throughput, the default).  A GPU
 * that the container leaves idle most of the time has power to spare, so the
 * container's kernels run at a higher clock than the same kernels would
 * under full load (H200, bf16 matmul: ~1950 MHz throttled to 30%, ~1515 MHz
 * power-capped at 100%), and C% of the time delivers more than C% of the
 * throughput.  The sampler estimates how much faster: with idle power P0,
 * power limit L, board power P and utilisation u (all from NVML), the GPU
 * fully busy with the current kernels would draw P0 + (P - P0) / u at the
 * present clock; if that exceeds L the clock would fall until it fits, and
 * dynamic power goes as about the cube of the clock (voltage follows the
 * clock), so the clock now is s = cbrt(((P - P0) / u) / (L - P0)) times the
 * full-load one.  GPU time is debited times s (per device, shared through the
 * region, from smoothed readings, 1 <= s <= 1.75).  A GPU already at its power limit gives
 * s = 1, and so does work that would not reach the limit even at full load
 * (memory-bound kernels), where time share and throughput share agree.
 */
#define _GNU_SOURCE
#include "throttle.h"

#define GS_UTIL_MIN 5u            /* below this utilisation (%) the power estimate is noise */
#define GS_WINDOW 4               /* samples the estimate averages (2 s at the sampler's 500 ms) */
#define GS_WARMUP_SAMPLES 2       /* busy samples after idle not used (power is a 1 s average) */
#define GS_IDLE_SAMPLES 2         /* consecutive samples at 0% utilisation before power counts as idle */

static double cube_root(double r)
{
    double x = r > 1 ? 1 + (r - 1) / 3 : 1;
    for (int i = 0; i < 40; i++) x = (2 * x + r / (x * x)) / 3;
    return x;
}

/* s in 1/1000 (1000..GS_SCALE_MAX_MILLI), or 0 when the readings say nothing
 * (too little utilisation, no power limit). */
unsigned gs_power_scale_milli(double power_mw, double limit_mw, double idle_mw, double util_pct)
{
    if (!(limit_mw > idle_mw) || !(util_pct >= GS_UTIL_MIN) || util_pct > 100) return 0;
    if (power_mw <= idle_mw) return 1000;
    double busy = (power_mw - idle_mw) * 100.0 / util_pct; /* dynamic power at full duty */
    double ratio = busy / (limit_mw - idle_mw);
    if (ratio <= 1) return 1000;
    double s = cube_root(ratio) * 1000.0;
    return s >= GS_SCALE_MAX_MILLI ? GS_SCALE_MAX_MILLI : (unsigned)(s + 0.5);
}

/* A limit: the sampler corrects for time slices (slices.c) and compensates the clock, and it
 * charges launches that a capture kept from being measured (gs_launch_charge_unmeasured) */
int gs_launch_wants_sampler(void)
{
    return __atomic_load_n(&thr_state, __ATOMIC_ACQUIRE) == THROTTLE_ON;
}

static void lower_idle_power(struct gpuslice_device *d, unsigned mw)
{
    unsigned old = __atomic_load_n(&d->idle_power_mw, __ATOMIC_RELAXED);
    while ((!old || mw < old) &&
           !__atomic_compare_exchange_n(&d->idle_power_mw, &old, mw, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* Sampler thread: one NVML reading per limited device.  Power and
 * utilisation are summed over the last GS_WINDOW useful samples and divided
 * once (the ratio of two noisy readings, taken sample by sample, is biased
 * upward, and power is averaged over a longer window than utilisation), then
 * give the device's sm_scale_milli (shared by the container's processes). */
void gs_launch_sample(void)
{
    /* sampler thread only */
    static int idle_run[GPUSLICE_MAX_DEVICES];
    static unsigned busy_run[GPUSLICE_MAX_DEVICES];
    static unsigned win_power[GPUSLICE_MAX_DEVICES][GS_WINDOW], win_util[GPUSLICE_MAX_DEVICES][GS_WINDOW];
    static unsigned win_next[GPUSLICE_MAX_DEVICES];
    struct gpuslice_region *r = gs_region;
    if (!r || !gs_launch_wants_sampler() || thr_time_mode) return;
    gs_nvml_init();
    if (!gs_nvml.nvmlDeviceGetPowerUsage || !gs_nvml.nvmlDeviceGetEnforcedPowerLimit ||
        !gs_nvml.nvmlDeviceGetUtilizationRates)
        return;
    struct gs_limited_dev lim[GPUSLICE_MAX_DEVICES];
    int nlim = gs_limited_devices(lim);
    for (int l = 0; l < nlim; l++) {
        int slot = lim[l].slot;
        nvmlDevice_t h = lim[l].nvml;
        struct gpuslice_device *d = &r->devices[slot];
        unsigned power = 0, limit = 0;
        nvmlUtilization_t util = {0, 0};
        if (gs_nvml.nvmlDeviceGetPowerUsage(h, &power) != NVML_SUCCESS ||
            gs_nvml.nvmlDeviceGetEnforcedPowerLimit(h, &limit) != NVML_SUCCESS ||
            gs_nvml.nvmlDeviceGetUtilizationRates(h, &util) != NVML_SUCCESS || util.gpu > 100)
            continue;
        /* board power is averaged over about a second: only a second idle sample in a row is idle power */
        idle_run[slot] = util.gpu ? 0 : idle_run[slot] + 1;
        if (idle_run[slot] >= GS_IDLE_SAMPLES && power) lower_idle_power(d, power);
        /* idle or nearly: nothing to learn, keep the last scale.  Just after idle, power
         * (averaged over a second, twice the sampling interval) still reads part of the idle
         * time: the first GS_WARMUP_SAMPLES busy samples are not used */
        busy_run[slot] = util.gpu < GS_UTIL_MIN ? 0 : busy_run[slot] + 1;
        if (busy_run[slot] <= GS_WARMUP_SAMPLES) continue;
        unsigned k = win_next[slot]++ % GS_WINDOW;
        win_power[slot][k] = power;
        win_util[slot][k] = util.gpu;
        double power_sum = 0, util_sum = 0;
        for (int i = 0; i < GS_WINDOW; i++) {
            power_sum += win_power[slot][i];
            util_sum += win_util[slot][i];
        }
        unsigned used = win_next[slot] < GS_WINDOW ? win_next[slot] : GS_WINDOW;
        unsigned idle = __atomic_load_n(&d->idle_power_mw, __ATOMIC_RELAXED);
        if (!idle || idle >= limit) idle = limit / 8; /* not seen yet: typical idle draw */
        unsigned s = gs_power_scale_milli(power_sum / used, limit, idle, util_sum / used);
        if (!s) continue;
        __atomic_store_n(&d->sm_scale_milli, s, __ATOMIC_RELAXED);
        GS_DEBUG("device slot %d: power %u/%u mW (idle %u), utilisation %u%% -> clock scale %u/1000", slot, power,
                 limit, idle, util.gpu, s);
    }
}
