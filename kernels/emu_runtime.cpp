// emu_runtime.cpp: the launcher of the `emu` device arm, appended (after the kernels and their
// MT_EMU_ENTRY lines) to the translation unit g++ compiles; kernels/emu.h describes the model.
//
// Entry points (extern "C", called by src/device/emu.rs):
// - mt_emu_thunk_<kernel>(void **args): calls the kernel with its arguments unpacked from the
//   same `void **` list cuLaunchKernel takes; mt_emu_signature_<kernel>() spells the parameter
//   types ('p' pointer, 'i' int, 'l' long long, 'u' unsigned long long, 'f' float) so that the
//   Rust side checks every launch's argument list before it runs;
// - mt_emu_launch(thunk, args, dims, report): runs a whole launch and returns 0, or fills the
//   report (a fault address, a deadlock or divergence message, the block and thread) and
//   returns non-zero. Launches are serialised; each returns when all its blocks are done.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

thread_local MtEmuFiber *mt_emu_fiber;
thread_local uint3 mt_emu_block_idx, mt_emu_block_dim, mt_emu_grid_dim;
thread_local unsigned char *mt_emu_dyn_shared;

// ---- argument unpacking -----------------------------------------------------------------------

template <typename T> constexpr char mt_emu_type_code() {
    if (std::is_pointer<T>::value) return 'p';
    if (std::is_same<T, int>::value) return 'i';
    if (std::is_same<T, long long>::value) return 'l';
    if (std::is_same<T, unsigned long long>::value) return 'u';
    if (std::is_same<T, float>::value) return 'f';
    return '?';
}
template <typename... A> const char *mt_emu_signature(void (*)(A...)) {
    static const char sig[] = {mt_emu_type_code<A>()..., '\0'};
    return sig;
}
template <typename... A, size_t... I>
void mt_emu_call_with(void (*f)(A...), void **args, std::index_sequence<I...>) {
    f(*reinterpret_cast<A *>(args[I])...);
}
template <typename... A> void mt_emu_call(void (*f)(A...), void **args) {
    mt_emu_call_with(f, args, std::index_sequence_for<A...>{});
}

// ---- fibers -----------------------------------------------------------------------------------

namespace {

const size_t STACK_BYTES = 64 << 10;
const int MAX_THREADS = 1024;

enum FiberState { RUNNABLE, AT_BARRIER, AT_WARP_OP, DONE };

struct Fiber : MtEmuFiber {
    void *sp;
    int linear;
    FiberState state;
#if !defined(__x86_64__)
    ucontext_t ctx;
#endif
};

struct Warp {
    int arrived, width, parity;
    MtEmuWarpOp op;
    unsigned long long words[2][32];
};

struct Report {
    int code; // 0 ok, 1 memory fault, 2 deadlock / divergence / bad launch
    int fault_write; // 1 write, 0 read, -1 unknown
    unsigned long long fault_addr;
    unsigned int block[3], thread[3];
    char message[480];
};

struct Launch {
    void (*thunk)(void **);
    void **args;
    uint3 grid, block;
    unsigned int shared_bytes;
    int reverse;
    unsigned long long blocks;
    std::atomic<unsigned long long> next;
    std::atomic<int> failed;
    std::mutex report_lock;
    Report *report;
};

struct Worker {
    std::vector<Fiber> fibers;
    unsigned char *stacks = nullptr;
    std::vector<Warp> warps;
    std::vector<unsigned char> dyn;
    void *sched_sp = nullptr;
#if !defined(__x86_64__)
    ucontext_t sched_ctx;
#endif
    Launch *launch = nullptr;
    int threads = 0, done = 0, bar_arrived = 0;
    bool error = false;
    char message[400];
    sigjmp_buf jmp;
    volatile sig_atomic_t in_kernel = 0;
    volatile unsigned long long fault_addr = 0;
    volatile int fault_write = -1;
};

thread_local Worker *tls_worker;

#if defined(__x86_64__)
// mt_emu_switch(save, load): pushes the callee-saved registers, stores the stack pointer in
// *save, switches to `load` and pops the same frame from it. The SSE/x87 control words are not
// switched: no kernel changes rounding modes, so every fiber runs with the worker's.
// mt_emu_fiber_start: a new fiber's first "return address"; calls r13(r12).
extern "C" void mt_emu_switch(void **save, void *load);
extern "C" void mt_emu_fiber_start();
asm(R"(
    .text
    .p2align 4
    .type mt_emu_switch,@function
mt_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size mt_emu_switch,.-mt_emu_switch
    .p2align 4
    .type mt_emu_fiber_start,@function
mt_emu_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size mt_emu_fiber_start,.-mt_emu_fiber_start
)");
#endif

void fiber_main(Fiber *f);

#if !defined(__x86_64__)
void fiber_main_ucontext(unsigned int hi, unsigned int lo) {
    fiber_main((Fiber *)(((uintptr_t)hi << 32) | lo));
}
#endif

// Switches from the running fiber back to the scheduler.
void to_scheduler(Fiber *f) {
    Worker *w = tls_worker;
#if defined(__x86_64__)
    mt_emu_switch(&f->sp, w->sched_sp);
#else
    swapcontext(&f->ctx, &w->sched_ctx);
#endif
}

void to_fiber(Worker *w, Fiber *f) {
    mt_emu_fiber = f;
    w->in_kernel = 1;
#if defined(__x86_64__)
    mt_emu_switch(&w->sched_sp, f->sp);
#else
    swapcontext(&w->sched_ctx, &f->ctx);
#endif
    w->in_kernel = 0;
}

void prepare_fiber(Worker *w, Fiber *f) {
    unsigned char *base = w->stacks + (size_t)f->linear * STACK_BYTES;
#if defined(__x86_64__)
    // Stack tops staggered by a cache line per fiber: tops a power of two apart would all map
    // to the same cache sets, and every switch would miss.
    uintptr_t top = ((uintptr_t)(base + STACK_BYTES - (size_t)(f->linear % 64) * 64)) & ~(uintptr_t)15;
    // Popped by mt_emu_switch: r15, r14, r13, r12, rbx, rbp, then the return address; the
    // entry then runs with the stack 16-byte aligned as at a call.
    unsigned long long *frame = (unsigned long long *)(top - 72);
    frame[0] = 0;                               // r15
    frame[1] = 0;                               // r14
    frame[2] = (unsigned long long)&fiber_main; // r13: entry
    frame[3] = (unsigned long long)f;           // r12: its argument
    frame[4] = 0;                               // rbx
    frame[5] = 0;                               // rbp
    frame[6] = (unsigned long long)&mt_emu_fiber_start;
    f->sp = frame;
#else
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = base;
    f->ctx.uc_stack.ss_size = STACK_BYTES;
    f->ctx.uc_link = nullptr;
    uintptr_t p = (uintptr_t)f;
    makecontext(&f->ctx, (void (*)())fiber_main_ucontext, 2, (unsigned int)(p >> 32), (unsigned int)p);
#endif
}

// Ends the block with an error raised from inside a fiber; the scheduler never resumes it.
[[noreturn]] void fail_in_fiber(const char *fmt, ...) {
    Worker *w = tls_worker;
    Fiber *f = (Fiber *)mt_emu_fiber;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->message, sizeof w->message, fmt, ap);
    va_end(ap);
    w->error = true;
    f->state = DONE;
    to_scheduler(f);
    std::abort(); // never resumed
}

void fiber_main(Fiber *f) {
    Worker *w = tls_worker;
    w->launch->thunk(w->launch->args);
    f->state = DONE;
    w->done++;
    to_scheduler(f);
    std::abort(); // never resumed
}

const char *op_name(MtEmuWarpOp op) {
    return op == MT_EMU_SHFL_DOWN ? "shfl_down" : op == MT_EMU_SHFL_XOR ? "shfl_xor" : op == MT_EMU_VOTE ? "vote" : "warp reduction";
}

} // namespace

void __syncthreads() {
    Worker *w = tls_worker;
    Fiber *f = (Fiber *)mt_emu_fiber;
    if (++w->bar_arrived == w->threads) {
        w->bar_arrived = 0;
        for (Fiber &o : w->fibers)
            if (o.state == AT_BARRIER) o.state = RUNNABLE;
        return;
    }
    f->state = AT_BARRIER;
    to_scheduler(f);
}

const unsigned long long *mt_emu_warp_exchange(unsigned long long word, MtEmuWarpOp op, int *lane, int *width) {
    Worker *w = tls_worker;
    Fiber *f = (Fiber *)mt_emu_fiber;
    Warp &wp = w->warps[f->linear / 32];
    *lane = f->linear % 32;
    *width = wp.width;
    if (wp.arrived == 0) {
        wp.op = op;
    } else if (wp.op != op) {
        fail_in_fiber("divergent warp: lane %d calls %s while other lanes of warp %d wait in %s", *lane,
                      op_name(op), f->linear / 32, op_name(wp.op));
    }
    const int parity = wp.parity;
    wp.words[parity][*lane] = word;
    if (++wp.arrived == wp.width) {
        wp.arrived = 0;
        wp.parity ^= 1;
        const int first = f->linear - *lane;
        for (int i = first; i < first + wp.width; i++)
            if (w->fibers[i].state == AT_WARP_OP) w->fibers[i].state = RUNNABLE;
    } else {
        f->state = AT_WARP_OP;
        to_scheduler(f);
    }
    return wp.words[parity];
}

namespace {

void ensure_capacity(Worker *w, int threads) {
    if (!w->stacks) {
        size_t bytes = STACK_BYTES * MAX_THREADS;
        void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            perror("emu: fiber stacks");
            std::abort();
        }
        w->stacks = (unsigned char *)p;
        // A guard page at the bottom of each stack: an overflow faults instead of corrupting.
        for (int i = 0; i < MAX_THREADS; i++) mprotect(w->stacks + (size_t)i * STACK_BYTES, 4096, PROT_NONE);
    }
    if ((int)w->fibers.size() < threads) w->fibers.resize(threads);
    w->warps.resize((threads + 31) / 32);
}

// Runs block `id` of the launch; false (with w->message set) on a deadlock or divergence.
bool run_block(Worker *w, Launch *l, unsigned long long id) {
    const int n = (int)(l->block.x * l->block.y * l->block.z);
    mt_emu_block_idx = {(unsigned)(id % l->grid.x), (unsigned)(id / l->grid.x % l->grid.y),
                        (unsigned)(id / ((unsigned long long)l->grid.x * l->grid.y))};
    mt_emu_block_dim = l->block;
    mt_emu_grid_dim = l->grid;
    if (l->shared_bytes) std::memset(w->dyn.data(), 0xff, l->shared_bytes);
    w->threads = n;
    w->done = 0;
    w->bar_arrived = 0;
    for (int i = 0; i < n; i++) {
        Fiber &f = w->fibers[i];
        f.linear = i;
        f.tid = {(unsigned)(i % l->block.x), (unsigned)(i / l->block.x % l->block.y),
                 (unsigned)(i / (l->block.x * l->block.y))};
        f.state = RUNNABLE;
        prepare_fiber(w, &f);
    }
    for (size_t k = 0; k < w->warps.size(); k++) {
        Warp &wp = w->warps[k];
        wp.arrived = 0;
        wp.parity = 0;
        wp.width = std::min(32, n - (int)k * 32);
    }
    while (w->done < n) {
        bool ran = false;
        for (int k = 0; k < n; k++) {
            Fiber &f = w->fibers[l->reverse ? n - 1 - k : k];
            if (f.state != RUNNABLE) continue;
            ran = true;
            to_fiber(w, &f);
            if (w->error) return false;
        }
        if (!ran) {
            int at_barrier = 0, at_warp = 0, first_warp = -1;
            for (int i = 0; i < n; i++) {
                at_barrier += w->fibers[i].state == AT_BARRIER;
                if (w->fibers[i].state == AT_WARP_OP) {
                    at_warp++;
                    if (first_warp < 0) first_warp = i;
                }
            }
            mt_emu_fiber = &w->fibers[first_warp >= 0 ? first_warp : 0];
            snprintf(w->message, sizeof w->message,
                     "deadlock: %d of %d threads wait at __syncthreads and %d in warp operations (thread %d "
                     "first), %d exited: every thread must reach each barrier and every lane of a warp each "
                     "warp operation",
                     at_barrier, n, at_warp, first_warp, w->done);
            return false;
        }
    }
    return true;
}

void record(Launch *l, int code, const char *message, int fault_write, unsigned long long addr) {
    std::lock_guard<std::mutex> g(l->report_lock);
    if (l->report->code) return;
    Report *r = l->report;
    r->code = code;
    r->fault_write = fault_write;
    r->fault_addr = addr;
    r->block[0] = mt_emu_block_idx.x, r->block[1] = mt_emu_block_idx.y, r->block[2] = mt_emu_block_idx.z;
    if (mt_emu_fiber) r->thread[0] = mt_emu_fiber->tid.x, r->thread[1] = mt_emu_fiber->tid.y, r->thread[2] = mt_emu_fiber->tid.z;
    snprintf(r->message, sizeof r->message, "%s", message);
}

// A worker's share of a launch: blocks taken in turn until none is left or one failed.
void work(Worker *w, Launch *l) {
    tls_worker = w;
    w->launch = l;
    w->error = false;
    mt_emu_fiber = nullptr;
    ensure_capacity(w, (int)(l->block.x * l->block.y * l->block.z));
    if (w->dyn.size() < l->shared_bytes) w->dyn.resize(l->shared_bytes);
    mt_emu_dyn_shared = w->dyn.data();
    if (sigsetjmp(w->jmp, 1)) {
        record(l, 1, "memory fault", w->fault_write, w->fault_addr);
        l->failed = 1;
        return;
    }
    while (!l->failed) {
        const unsigned long long k = l->next.fetch_add(1);
        if (k >= l->blocks) return;
        if (!run_block(w, l, l->reverse ? l->blocks - 1 - k : k)) {
            record(l, 2, w->message, -1, 0);
            l->failed = 1;
            return;
        }
    }
}

struct sigaction old_segv, old_bus;

void on_fault(int sig, siginfo_t *si, void *ctx) {
    Worker *w = tls_worker;
    if (w && w->in_kernel) {
        w->in_kernel = 0;
        w->fault_addr = (unsigned long long)si->si_addr;
#if defined(__x86_64__)
        // Page-fault error code bit 1: the access was a write.
        w->fault_write = (((ucontext_t *)ctx)->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#endif
        siglongjmp(w->jmp, 1);
    }
    struct sigaction *old = sig == SIGSEGV ? &old_segv : &old_bus;
    if (old->sa_flags & SA_SIGINFO) {
        old->sa_sigaction(sig, si, ctx);
    } else if (old->sa_handler == SIG_DFL || old->sa_handler == SIG_IGN) {
        sigaction(sig, old, nullptr); // the access faults again and takes the default action
    } else {
        old->sa_handler(sig);
    }
}

// The worker pool: threads that live as long as the process, each with its own fiber stacks
// and an alternate signal stack (a fault on a fiber's guard page needs somewhere to run).
struct Pool {
    std::mutex launch_lock, m;
    std::condition_variable cv;
    std::vector<Worker *> workers;
    Launch *current = nullptr;
    unsigned long long generation = 0;
    int busy = 0;

    void start(int n) {
        for (int i = 0; i < n; i++) {
            Worker *w = new Worker();
            workers.push_back(w);
            std::thread([this, w] { loop(w); }).detach();
        }
    }

    void loop(Worker *w) {
        stack_t ss;
        ss.ss_sp = std::malloc(1 << 16);
        ss.ss_size = 1 << 16;
        ss.ss_flags = 0;
        sigaltstack(&ss, nullptr);
        unsigned long long seen = 0;
        for (;;) {
            Launch *l;
            {
                std::unique_lock<std::mutex> g(m);
                cv.wait(g, [&] { return generation != seen; });
                seen = generation;
                l = current;
            }
            work(w, l);
            std::lock_guard<std::mutex> g(m);
            if (--busy == 0) cv.notify_all();
        }
    }

    void run(Launch *l) {
        std::lock_guard<std::mutex> serial(launch_lock);
        std::unique_lock<std::mutex> g(m);
        current = l;
        busy = (int)workers.size();
        generation++;
        cv.notify_all();
        cv.wait(g, [&] { return busy == 0; });
    }
};

Pool *pool() {
    static Pool *p = [] {
        struct sigaction sa;
        std::memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &old_segv);
        sigaction(SIGBUS, &sa, &old_bus);
        Pool *p = new Pool();
        int n = (int)std::thread::hardware_concurrency();
        if (const char *env = getenv("MESHTRAIN_EMU_THREADS")) n = atoi(env);
        p->start(std::max(1, std::min(n, 8)));
        return p;
    }();
    return p;
}

} // namespace

// dims: grid x, y, z, block x, y, z, dynamic shared bytes, reverse order (0/1).
extern "C" int mt_emu_launch(void (*thunk)(void **), void **args, const unsigned int *dims, Report *report) {
    std::memset(report, 0, sizeof *report);
    report->fault_write = -1;
    const unsigned long long threads = (unsigned long long)dims[3] * dims[4] * dims[5];
    if (threads == 0 || threads > (unsigned long long)MAX_THREADS) {
        snprintf(report->message, sizeof report->message, "block of %llu threads (1..%d allowed)", threads, MAX_THREADS);
        return report->code = 2;
    }
    Launch l;
    l.thunk = thunk;
    l.args = args;
    l.grid = {dims[0], dims[1], dims[2]};
    l.block = {dims[3], dims[4], dims[5]};
    l.shared_bytes = dims[6];
    l.reverse = dims[7] != 0;
    l.blocks = (unsigned long long)dims[0] * dims[1] * dims[2];
    l.next = 0;
    l.failed = 0;
    l.report = report;
    pool()->run(&l);
    return report->code;
}

#define MT_EMU_ENTRY(name)                                                                       \
    extern "C" void mt_emu_thunk_##name(void **args) { mt_emu_call(name, args); }              \
    extern "C" const char *mt_emu_signature_##name() { return mt_emu_signature(name); }
