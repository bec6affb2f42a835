/*
 * abi_check - compares src/cuda_abi.h with the toolkit's cuda.h, fact by
 * fact; prints "ok N facts, M hook signatures" (the signatures were checked
 * when abi_hooks.c compiled) or one line per mismatch and exits 1.
 */
#include <stdio.h>
#include <string.h>

#include "cuda_abi.h"
#include "abi.h"

static const struct abi_fact ours[] = {ABI_FACTS(ABI_ENTRY)};
extern const int abi_hooks_checked; /* abi_hooks.c: hook signatures that compiled against cuda.h */

int main(void)
{
    int n = (int)(sizeof(ours) / sizeof(ours[0])), bad = 0;
    if (n != abi_cuda_count) {
        printf("fact count differs: %d vs %d\n", n, abi_cuda_count);
        return 1;
    }
    for (int i = 0; i < n; i++) {
        if (ours[i].value != abi_cuda[i].value) {
            printf("mismatch %s: ours %ld, cuda.h %ld\n", ours[i].expr, ours[i].value, abi_cuda[i].value);
            bad++;
        }
    }
    if (!bad) printf("ok %d facts, %d hook signatures\n", n, abi_hooks_checked);
    return bad ? 1 : 0;
}
