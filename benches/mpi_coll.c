/* Standalone MPI collective benchmark: the baseline that `meshtrain bench --vs-mpi` must agree
 * with. It runs the system MPI's collectives with exactly the rules of `meshtrain bench`
 * (src/bench/collectives.rs), so that the two MPI columns can be compared:
 *
 * - sizes: from --min to --max bytes, multiplied by --factor; each size is rounded down to whole
 *   f32 elements and to a multiple of the world size (at least one element per rank);
 * - per size: untimed calls, a barrier, timed calls; a rank's time is its average per call; the
 *   row's time is the slowest rank's (max over ranks). Timed calls: --iters, or as many as move
 *   --iter-bytes bytes (default 256M; 0: exactly --iters) when that is more, at most 1000;
 *   untimed calls: --warmup, or a tenth of the timed calls when that is more;
 * - buffers: f32, allocated and first touched (filled) before the warm-up, the same inputs as
 *   meshtrain's exact inputs; out of place; reductions are MPI_SUM; roots are rank 0;
 * - pages: with `--pages huge` (the default) a buffer of 2 MiB or more is a mapping of its own that
 *   starts on a 2 MiB boundary and is advised MADV_HUGEPAGE, as the meshtrain binary allocates
 *   every large buffer (src/mem.rs), so that both programs time the same memory; `--pages small`
 *   uses malloc (4 KiB pages where the kernel's transparent huge pages are in `madvise` mode).
 *
 * Output: CSV `coll,bytes,count,mpi_time_us` on rank 0, one line per size.
 * Build: mpicc -O2 -o mpi_coll benches/mpi_coll.c (`make bench` does).
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int huge_pages = 1;
enum { HUGE = 2 << 20 };

/* A buffer of `bytes`: see `--pages` in the header. NULL when out of memory. */
static void *alloc_buf(size_t bytes) {
    if (!huge_pages || bytes < HUGE) return malloc(bytes);
    size_t len = (bytes + 4095) / 4096 * 4096;
    char *raw = mmap(NULL, len + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char *start = (char *)(((size_t)raw + HUGE - 1) / HUGE * HUGE);
    if (start > raw) munmap(raw, (size_t)(start - raw));
    munmap(start + len, HUGE - (size_t)(start - raw));
    madvise(start, len, MADV_HUGEPAGE);
    return start;
}

static void free_buf(void *p, size_t bytes) {
    if (!huge_pages || bytes < HUGE) free(p);
    else munmap(p, (bytes + 4095) / 4096 * 4096);
}

static const char *ALL[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"};
enum { NCOLL = 6 };

/* "4K", "64M", "1G" or plain bytes; 0 on a malformed value. */
static size_t parse_size(const char *s) {
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) return 0;
    switch (*end) {
    case 'K': case 'k': v <<= 10; end++; break;
    case 'M': case 'm': v <<= 20; end++; break;
    case 'G': case 'g': v <<= 30; end++; break;
    default: break;
    }
    return *end == '\0' ? (size_t)v : 0;
}

/* One call of `coll` on n elements; returns 0, or -1 for an unknown name. */
static int one_call(const char *coll, const float *in, float *out, int n, int k, int me) {
    int block = n / k;
    if (!strcmp(coll, "all_reduce")) return MPI_Allreduce(in, out, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (!strcmp(coll, "all_gather")) return MPI_Allgather(in, block, MPI_FLOAT, out, block, MPI_FLOAT, MPI_COMM_WORLD);
    if (!strcmp(coll, "reduce_scatter")) return MPI_Reduce_scatter_block(in, out, block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (!strcmp(coll, "all_to_all")) return MPI_Alltoall(in, block, MPI_FLOAT, out, block, MPI_FLOAT, MPI_COMM_WORLD);
    if (!strcmp(coll, "broadcast")) return MPI_Bcast(out, n, MPI_FLOAT, 0, MPI_COMM_WORLD);
    if (!strcmp(coll, "reduce")) return MPI_Reduce(in, me == 0 ? out : NULL, n, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
    return -1;
}

/* Timed (and untimed) calls for a buffer of `bytes` bytes, the rule of `meshtrain bench`
 * (CollBench::rounds_for in src/bench/collectives.rs). */
enum { MAX_ITERS = 1000 };
static void rounds_for(size_t bytes, long warmup, long iters, size_t iter_bytes, int *w, int *t) {
    long it = iters;
    if (iter_bytes > 0) {
        size_t by = iter_bytes / (bytes ? bytes : 1);
        if (by > MAX_ITERS) by = MAX_ITERS;
        if ((long)by > it) it = (long)by;
    }
    if (it < 1) it = 1;
    *t = (int)it;
    *w = (int)(iter_bytes > 0 && it / 10 > warmup ? it / 10 : warmup);
}

/* Slowest rank's microseconds per call of `coll` on n elements. */
static double time_size(const char *coll, int n, int warmup, int iters, int k, int me) {
    size_t bytes = (size_t)n * sizeof(float);
    float *in = alloc_buf(bytes), *out = alloc_buf(bytes);
    if (!in || !out) {
        fprintf(stderr, "mpi_coll: rank %d: cannot allocate 2 x %d floats\n", me, n);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    for (int i = 0; i < n; i++) {
        in[i] = (float)((me * 7 + i * 3) % 11 - 5);
        out[i] = 0.0f;
    }
    for (int i = 0; i < warmup; i++) one_call(coll, in, out, n, k, me);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++) one_call(coll, in, out, n, k, me);
    double mine = (MPI_Wtime() - t0) * 1e6 / iters, slowest = 0.0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    free_buf(in, bytes);
    free_buf(out, bytes);
    return slowest;
}

static void usage(const char *why) {
    fprintf(stderr,
            "mpi_coll: %s\nusage: mpi_coll [COLL|all] [--min 4K] [--max 64M] [--factor 2] [--warmup 5] [--iters 20] [--iter-bytes 256M] [--pages huge|small]\n"
            "  COLL: all_reduce all_gather reduce_scatter all_to_all broadcast reduce\n",
            why);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int k, me;
    MPI_Comm_size(MPI_COMM_WORLD, &k);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    const char *what = "all";
    size_t min = 4 << 10, max = 64 << 20, factor = 2, iter_bytes = (size_t)256 << 20;
    int iter_bytes_ok = 1;
    long warmup = 5, iters = 20;
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a], *val = a + 1 < argc ? argv[a + 1] : NULL;
        if (arg[0] != '-') { what = arg; continue; }
        if (!val) { if (me == 0) usage("missing value after an option"); MPI_Finalize(); return 2; }
        a++;
        if (!strcmp(arg, "--min")) min = parse_size(val);
        else if (!strcmp(arg, "--max")) max = parse_size(val);
        else if (!strcmp(arg, "--factor")) factor = parse_size(val);
        else if (!strcmp(arg, "--warmup")) warmup = strtol(val, NULL, 10);
        else if (!strcmp(arg, "--iters")) iters = strtol(val, NULL, 10);
        else if (!strcmp(arg, "--iter-bytes")) { iter_bytes = parse_size(val); iter_bytes_ok = iter_bytes > 0 || !strcmp(val, "0"); }
        else if (!strcmp(arg, "--pages") && (!strcmp(val, "huge") || !strcmp(val, "small"))) huge_pages = !strcmp(val, "huge");
        else { if (me == 0) usage("unknown option or value"); MPI_Finalize(); return 2; }
    }
    int known = !strcmp(what, "all");
    for (int c = 0; c < NCOLL; c++) known |= !strcmp(what, ALL[c]);
    if (!known || min == 0 || max < min || factor < 2 || warmup < 0 || iters < 1 || !iter_bytes_ok || max / sizeof(float) > 0x7fffffff) {
        if (me == 0) usage(!known ? "unknown collective" : "need 0 < --min <= --max < 8G, --factor >= 2, --iters >= 1, --iter-bytes a size");
        MPI_Finalize();
        return 2;
    }
    if (me == 0) printf("coll,bytes,count,mpi_time_us\n");
    for (int c = 0; c < NCOLL; c++) {
        if (strcmp(what, "all") && strcmp(what, ALL[c])) continue;
        int last = -1;
        for (size_t bytes = min; bytes <= max; bytes *= factor) {
            size_t per = bytes / sizeof(float) / (size_t)k;
            int n = (int)((per ? per : 1) * (size_t)k);
            if (n == last) continue;
            last = n;
            int w, t;
            rounds_for((size_t)n * sizeof(float), warmup, iters, iter_bytes, &w, &t);
            double us = time_size(ALL[c], n, w, t, k, me);
            if (me == 0) {
                printf("%s,%zu,%d,%.2f\n", ALL[c], (size_t)n * sizeof(float), n, us);
                fflush(stdout);
            }
        }
    }
    MPI_Finalize();
    return 0;
}
