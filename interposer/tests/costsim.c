/*
 * costsim - src/costs.c (each function's or executable graph's cost a launch, by the launch's
 * size) driven by scripted measurements.  No driver, no threads: the table's arithmetic alone,
 * compiled in.
 *
 *   costsim CMD...   learn FN SIZE NS   a launch of FN at SIZE threads took NS alone
 *                    est FN SIZE        prints "est FN SIZE NS" (NS 0: unknown)
 *                    forget FN          FN changed or went (gs_launch_cost_forget)
 *                    unload             code unloaded (gs_launch_costs_forget_all)
 *                    fill N             N other functions learnt, each at 1 thread and 1 ns
 *                                       (handles 0x10000000 + 64 k: the table's other entries)
 *
 * FN, SIZE and NS are numbers in any base strtoull reads (0x... for handles).
 */
#define _GNU_SOURCE
#include "costs.c"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

pthread_mutex_t thr_mu = PTHREAD_MUTEX_INITIALIZER;
__thread unsigned gs_t_held;
int gs_ctx_pending;
int thr_state = THROTTLE_ON;

void gs_context_drain(void)
{
}

static uint64_t num(const char *s)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    if (!*s || *end) {
        fprintf(stderr, "costsim: not a number: %s\n", s);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc;) {
        const char *cmd = argv[i];
        int need = !strcmp(cmd, "learn")                              ? 3
                   : !strcmp(cmd, "est")                              ? 2
                   : !strcmp(cmd, "forget") || !strcmp(cmd, "fill") ? 1
                   : !strcmp(cmd, "unload")                         ? 0
                                                                    : -1;
        if (need < 0 || i + need >= argc) {
            fprintf(stderr, "costsim: bad command at %s\n", cmd);
            return 2;
        }
        uint64_t a = need > 0 ? num(argv[i + 1]) : 0, b = need > 1 ? num(argv[i + 2]) : 0,
                 c = need > 2 ? num(argv[i + 3]) : 0;
        thr_mu_lock();
        if (!strcmp(cmd, "learn")) {
            thr_cost_learn_locked(a, b, c);
        } else if (!strcmp(cmd, "est")) {
            printf("est %#llx %llu %llu\n", (unsigned long long)a, (unsigned long long)b,
                   (unsigned long long)thr_cost_locked(a, b));
        } else if (!strcmp(cmd, "fill")) {
            for (uint64_t k = 0; k < a; k++) thr_cost_learn_locked(0x10000000ull + 64 * k, 1, 1);
        }
        thr_mu_unlock();
        if (!strcmp(cmd, "forget")) gs_launch_cost_forget(a);
        if (!strcmp(cmd, "unload")) gs_launch_costs_forget_all();
        i += need + 1;
    }
    return 0;
}
