/*
 * lockhold - take the region's lock the way the library does and never let
 * go, so pytest can SIGKILL a process that holds it.
 *
 *   lockhold REGION READY_FILE [torn]
 *
 * With "torn", it first adds 1 GiB to device slot 0's used_bytes without
 * touching any process entry: an update cut in half by the kill.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gpuslice_region.h"

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: lockhold REGION READY_FILE [torn]\n");
        return 2;
    }
    int fd = open(argv[1], O_RDWR);
    if (fd < 0) {
        perror("open");
        return 1;
    }
    struct gpuslice_region *r = mmap(NULL, sizeof(*r), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED || r->magic != GPUSLICE_REGION_MAGIC) {
        fprintf(stderr, "lockhold: not a region\n");
        return 1;
    }
    int rc = pthread_mutex_lock(&r->lock.mutex);
    if (rc != 0 && rc != 130 /* EOWNERDEAD */) {
        fprintf(stderr, "lockhold: lock failed: %s\n", strerror(rc));
        return 1;
    }
    if (argc > 3 && strcmp(argv[3], "torn") == 0) r->devices[0].used_bytes += 1ull << 30;
    close(open(argv[2], O_CREAT | O_WRONLY, 0644));
    for (;;) pause();
}
