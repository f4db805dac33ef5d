/* Single-copy reads against memcpy, on 4 KiB pages and on transparent huge pages.
 *
 * Why: meshtrain's single-copy schedules read peers' buffers with process_vm_readv, which pins
 * and maps the source pages one by one; this measures what that costs on this machine's kernel,
 * and whether 2 MiB pages (what the meshtrain binary advises for buffers of 2 MiB or more,
 * src/mem.rs) remove it. It reads the process's own memory, which takes the same kernel path
 * as reading a peer's.
 *
 * Build and run: cc -O2 -o cma_pages benches/cma_pages.c && ./cma_pages [MiB] [iterations]
 * Prints, for small then huge pages: memcpy GB/s and process_vm_readv GB/s of one buffer.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { HUGE = 2 << 20 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* A buffer of n bytes on a 2 MiB boundary, advised onto huge pages or away from them. */
static char *buffer(size_t n, int huge) {
    void *p = NULL;
    if (posix_memalign(&p, HUGE, n)) return NULL;
    madvise(p, n, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    memset(p, huge + 1, n);
    return p;
}

int main(int argc, char **argv) {
    size_t n = (size_t)(argc > 1 ? atol(argv[1]) : 32) << 20;
    int iters = argc > 2 ? atoi(argv[2]) : 20;
    if (n == 0 || iters < 1) {
        fprintf(stderr, "usage: cma_pages [MiB > 0] [iterations >= 1]\n");
        return 2;
    }
    for (int huge = 0; huge <= 1; huge++) {
        char *src = buffer(n, huge), *dst = buffer(n, huge);
        if (!src || !dst) {
            fprintf(stderr, "cma_pages: cannot allocate 2 x %zu bytes\n", n);
            return 1;
        }
        double t0 = now();
        for (int i = 0; i < iters; i++) {
            memcpy(dst, src, n);
            __asm__ volatile("" : : "r"(dst) : "memory");
        }
        double copy = (now() - t0) / iters;
        t0 = now();
        for (int i = 0; i < iters; i++) {
            struct iovec local = {dst, n}, remote = {src, n};
            if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) != (ssize_t)n) {
                perror("cma_pages: process_vm_readv");
                return 1;
            }
        }
        double cma = (now() - t0) / iters;
        printf("%zu MiB, %s pages: memcpy %.1f GB/s, process_vm_readv %.1f GB/s\n", n >> 20,
               huge ? "huge (2 MiB)" : "small (4 KiB)", n / copy / 1e9, n / cma / 1e9);
        free(src);
        free(dst);
    }
    return 0;
}
