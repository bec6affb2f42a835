/*
 * peek.h - a test program reads the preloaded library's own in-flight counts.
 *
 * Every hook that measures or reserves around a driver call raises gs_inflight (and, while a
 * charge may still be wrong, gs_unsettled) and lowers it again on each of its returns.  One
 * return path that forgets leaves the count raised for the process's life: the reconcile then
 * never gets a clean reading, so what the driver takes unseen stays uncharged and near-cap
 * loads are judged on a stale figure.  Nothing else shows it, so the test programs read the
 * counts themselves: both symbols are hidden (not exported), found here in the library file's
 * own symbol table (.symtab; the build keeps it) at the base the loader mapped it at.
 */
#ifndef GS_TEST_PEEK_H
#define GS_TEST_PEEK_H

#define _GNU_SOURCE
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct peek_lib {
    uintptr_t base;
    char path[4096];
};

static int peek_find_lib(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct peek_lib *lib = data;
    const char *slash = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    if (!slash || strcmp(slash + 1, "libgpuslice.so")) return 0;
    lib->base = info->dlpi_addr;
    snprintf(lib->path, sizeof(lib->path), "%s", info->dlpi_name);
    return 1;
}

/* The address of the library's symbol `name` (hidden ones too); NULL where the library is not
 * loaded or its file has no symbol table. */
static void *peek_symbol(const char *name)
{
    struct peek_lib lib = {0};
    if (!dl_iterate_phdr(peek_find_lib, &lib)) return NULL;
    int fd = open(lib.path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0) return NULL;
    if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(Elf64_Ehdr)) {
        close(fd);
        return NULL;
    }
    const unsigned char *f = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (f == MAP_FAILED) return NULL;
    void *found = NULL;
    const Elf64_Ehdr *eh = (const void *)f;
    size_t size = (size_t)st.st_size;
    if (!memcmp(eh->e_ident, ELFMAG, SELFMAG) && eh->e_ident[EI_CLASS] == ELFCLASS64 &&
        eh->e_shoff + (uint64_t)eh->e_shnum * sizeof(Elf64_Shdr) <= size) {
        const Elf64_Shdr *sh = (const void *)(f + eh->e_shoff);
        for (unsigned s = 0; s < eh->e_shnum && !found; s++) {
            if (sh[s].sh_type != SHT_SYMTAB || sh[s].sh_link >= eh->e_shnum) continue;
            const Elf64_Shdr *strs = &sh[sh[s].sh_link];
            if (sh[s].sh_offset + sh[s].sh_size > size || strs->sh_offset + strs->sh_size > size) continue;
            const Elf64_Sym *sym = (const void *)(f + sh[s].sh_offset);
            const char *str = (const char *)(f + strs->sh_offset);
            for (size_t k = 0; k < sh[s].sh_size / sizeof(*sym); k++) {
                if (sym[k].st_name >= strs->sh_size || ELF64_ST_TYPE(sym[k].st_info) != STT_OBJECT) continue;
                if (!strcmp(str + sym[k].st_name, name)) {
                    found = (void *)(lib.base + sym[k].st_value);
                    break;
                }
            }
        }
    }
    munmap((void *)f, size);
    return found;
}

/* 1 when the library's in-flight and unsettled counts are back where they were after the last
 * call to this (zero at first), waiting up to `ms` for the library's own threads (the sampler's
 * reconcile) to finish an operation of theirs; 0 when they are not, and then what they are becomes
 * the level later calls are held to (one leak is reported once, not at every later call); the
 * counts read in *inflight and *unsettled.  -1 where they cannot be read. */
static int peek_balanced(int ms, int *inflight, int *unsettled)
{
    static int *in, *un;
    static int looked, level_in, level_un;
    if (!looked) {
        looked = 1;
        in = peek_symbol("gs_inflight");
        un = peek_symbol("gs_unsettled");
    }
    if (!in || !un) return -1;
    for (int waited = 0;; waited++) {
        *inflight = __atomic_load_n(in, __ATOMIC_SEQ_CST);
        *unsettled = __atomic_load_n(un, __ATOMIC_SEQ_CST);
        if (*inflight == level_in && *unsettled == level_un) return 1;
        if (waited >= ms) break;
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    level_in = *inflight;
    level_un = *unsettled;
    return 0;
}

#endif
