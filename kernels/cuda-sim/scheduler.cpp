// Fibers and their scheduler, and the synchronizing built-ins (__syncthreads, warp
// operations, atomics).
//
// A launch runs its blocks one after another on the calling OS thread. A block's threads
// are fibers on stacks of TSIM_STACK_BYTES; they are resumed warp by warp: the current
// warp's ready threads run (in its lane order) until none is ready, then the next warp in
// the warp order. A thread runs until it waits at a barrier or warp operation, or returns.
// A __syncthreads completes when every live (not yet returned) thread of the block waits
// at it; a warp operation when every lane of its mask waits at it. Whatever cannot
// complete is a defect and ends the launch with a report: threads waiting at different
// barriers, a mask naming a lane that returned or waits elsewhere, a lane reading a lane
// outside the mask, a deadlock.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include <atomic>
#include <mutex>
#include <string>

#include "executor.h"

extern "C" void tsim_switch(void** save_sp, void* next_sp);
extern "C" void tsim_fiber_start();
extern "C" void tsim_fiber_main();

namespace tsim {

namespace {

std::atomic<uint64_t> g_launches{0}, g_blocks{0}, g_threads{0}, g_switches{0}, g_checked{0}, g_cpu_ns{0};

uint64_t thread_cpu_ns() {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

thread_local Exec* t_exec = nullptr;
thread_local Options t_options;

Exec& this_exec() {
    if (!t_exec) t_exec = new Exec();  // kept for the thread's life: its stacks are reused
    return *t_exec;
}

inline Lane* current_lane() {
    uintptr_t sp;
    __asm__("movq %%rsp, %0" : "=r"(sp));
    return (Lane*)tsim_lane_address(sp);
}

uint64_t next_rand(Exec& ex) {  // xorshift64*
    ex.rng ^= ex.rng >> 12;
    ex.rng ^= ex.rng << 25;
    ex.rng ^= ex.rng >> 27;
    return ex.rng * 2685821657736338717ull;
}

void shuffle(Exec& ex, uint8_t* v, unsigned n) {
    for (unsigned i = n; i > 1; i--) {
        unsigned j = (unsigned)(next_rand(ex) % i);
        uint8_t t = v[i - 1];
        v[i - 1] = v[j];
        v[j] = t;
    }
}

// Reserves stacks for `n` threads (once per size; a guard page below each stack).
bool ensure_stacks(Exec& ex, uint32_t n) {
    if (ex.slots >= n) return true;
    if (ex.stacks) munmap(ex.stacks, (size_t)ex.slots * TSIM_STACK_BYTES);
    size_t bytes = (size_t)n * TSIM_STACK_BYTES;
    // Over-allocate to align the region to TSIM_STACK_BYTES, then trim.
    char* raw = (char*)mmap(nullptr, bytes + TSIM_STACK_BYTES, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return false;
    uintptr_t base = ((uintptr_t)raw + TSIM_STACK_BYTES - 1) & ~(uintptr_t)(TSIM_STACK_BYTES - 1);
    if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
    uintptr_t end = (uintptr_t)raw + bytes + TSIM_STACK_BYTES;
    if (end > base + bytes) munmap((void*)(base + bytes), end - (base + bytes));
    for (uint32_t i = 0; i < n; i++) mprotect((void*)(base + (size_t)i * TSIM_STACK_BYTES), 4096, PROT_NONE);
    ex.stacks = (char*)base;
    ex.slots = n;
    return true;
}

inline void push_ready(Exec& ex, Lane* l) {
    l->state = LANE_READY;
    ex.warps[l->warp].ready |= 1u << l->lane;
}

// The next thread to run: of the current warp's ready lanes the lowest (forward), the
// highest (reverse) or a random one; when the warp has none, the next warp in warp order.
inline Lane* pop_ready(Exec& ex) {
    for (uint32_t k = 0; k < ex.nwarps; k++) {
        unsigned wi = ex.warp_order[ex.warp_pos];
        Warp& w = ex.warps[wi];
        if (w.ready) {
            unsigned j;
            if (ex.opt.order == Order::Forward) {
                j = (unsigned)__builtin_ctz(w.ready);
            } else if (ex.opt.order == Order::Reverse) {
                j = 31u - (unsigned)__builtin_clz(w.ready);
            } else {
                unsigned nth = (unsigned)(next_rand(ex) % (unsigned)__builtin_popcount(w.ready));
                uint32_t r = w.ready;
                for (unsigned i = 0; i < nth; i++) r &= r - 1;
                j = (unsigned)__builtin_ctz(r);
            }
            w.ready &= ~(1u << j);
            Lane* l = ex.lanes[wi * 32 + j];
            l->state = LANE_RUNNING;
            return l;
        }
        if (++ex.warp_pos == ex.nwarps) ex.warp_pos = 0;
    }
    return nullptr;
}

// Suspends `me` (already marked waiting or exited) and resumes the next ready thread, or
// the scheduler when none is.
void yield_from(Lane* me) {
    Exec& ex = *me->exec;
    Lane* next = pop_ready(ex);
    if (next == me) return;  // it was the only one ready (pop_ready marked it running)
    ex.switches++;
    tsim_switch(&me->sp, next ? next->sp : ex.sched_sp);
}

// yield_from for a lane waiting at a warp operation: the next ready lane of its own warp
// (the current warp) in forward or reverse order, without the general search.
inline void yield_in_warp(Exec& ex, Lane* me) {
    Warp& w = ex.warps[me->warp];
    if (w.ready && ex.opt.order != Order::Random) {
        unsigned j = ex.opt.order == Order::Forward ? (unsigned)__builtin_ctz(w.ready)
                                                    : 31u - (unsigned)__builtin_clz(w.ready);
        w.ready &= ~(1u << j);
        Lane* next = ex.lanes[me->warp * 32u + j];
        next->state = LANE_RUNNING;
        ex.switches++;
        tsim_switch(&me->sp, next->sp);
        return;
    }
    yield_from(me);
}

bool same_site(const char* fa, int la, const char* fb, int lb) {
    return la == lb && (fa == fb || (fa && fb && strcmp(fa, fb) == 0));
}

std::string site(const char* f, int l) {
    if (!f) return "?";
    const char* slash = strrchr(f, '/');
    return std::string(slash ? slash + 1 : f) + ":" + std::to_string(l);
}

const char* kind_name(int k) {
    switch (k) {
    case TSIM_SHFL_IDX: return "__shfl_sync";
    case TSIM_SHFL_UP: return "__shfl_up_sync";
    case TSIM_SHFL_DOWN: return "__shfl_down_sync";
    case TSIM_SHFL_XOR: return "__shfl_xor_sync";
    case TSIM_BALLOT: return "__ballot_sync";
    case TSIM_SYNCWARP: return "__syncwarp";
    }
    return "warp operation";
}

std::string hex(unsigned v) {
    char b[16];
    snprintf(b, sizeof b, "0x%08x", v);
    return b;
}

void release_barrier(Exec& ex, Lane* releaser) {
    Lane* first = nullptr;
    for (uint32_t i = 0; i < ex.nthreads; i++) {
        Lane* l = ex.lanes[i];
        if (l->state != LANE_AT_BARRIER) continue;
        if (!first) first = l;
        else if (!same_site(first->file, first->line, l->file, l->line))
            fail(releaser ? releaser : l,
                 "divergent __syncthreads: " + describe(first) + " waits at " + site(first->file, first->line) +
                     ", " + describe(l) + " at " + site(l->file, l->line));
    }
    ex.at_barrier = 0;
    ex.bar_epoch++;
    if (ex.opt.order == Order::Random) shuffle(ex, ex.warp_order, ex.nwarps);
    for (uint32_t i = 0; i < ex.nthreads; i++)
        if (ex.lanes[i]->state == LANE_AT_BARRIER) push_ready(ex, ex.lanes[i]);
    ex.warp_pos = 0;
}

// The source lane of a shuffle, or -1 for "own value" (outside its width segment).
int shuffle_source(int kind, unsigned lane, int arg, int width) {
    unsigned seg = lane & ~(unsigned)(width - 1);
    switch (kind) {
    case TSIM_SHFL_IDX: return (int)(seg + ((unsigned)arg & (unsigned)(width - 1)));
    case TSIM_SHFL_UP: return (int)lane - arg < (int)seg ? -1 : (int)lane - arg;
    case TSIM_SHFL_DOWN: return lane + (unsigned)arg >= seg + (unsigned)width ? -1 : (int)(lane + (unsigned)arg);
    case TSIM_SHFL_XOR: {
        unsigned src = lane ^ (unsigned)arg;
        return src >= seg + (unsigned)width ? -1 : (int)src;  // later segments: own value
    }
    }
    return -1;
}

// The defects a warp operation can be called with (kept out of its hot path).
[[gnu::noinline, gnu::cold]] void bad_warp_op(Lane* me, int kind, unsigned mask, int width) {
    const Warp& w = me->exec->warps[me->warp];
    std::string op = std::string(kind_name(kind)) + " at " + site(me->file, me->line);
    if (!(mask & (1u << me->lane)))
        fail(me, op + ": mask " + hex(mask) + " does not include the calling lane " + std::to_string(me->lane));
    if (mask & ~w.exist)
        fail(me, op + ": mask " + hex(mask) + " names lanes the block does not have (warp lanes " + hex(w.exist) +
                     ")");
    if (mask & w.exited)
        fail(me, op + ": mask " + hex(mask) + " names lane " + std::to_string(__builtin_ctz(mask & w.exited)) +
                     ", which returned");
    fail(me, op + ": width " + std::to_string(width) + " is not a power of two up to 32");
}

// A warp operation's group that cannot complete as called: lanes of one mask at
// different operations or masks (why 0), at different sites (1), or a shuffle reading a
// lane outside the mask (2).
[[gnu::noinline, gnu::cold]] void bad_group(Lane* me, Lane* l, int why, int src) {
    if (why == 0)
        fail(me, std::string(kind_name(me->wkind)) + "(mask " + hex(me->wmask) + ") at " + site(me->file, me->line) +
                     " meets " + kind_name(l->wkind) + "(mask " + hex(l->wmask) + ") of " + describe(l) + " at " +
                     site(l->file, l->line) + ": lanes of one mask must take part in the same operation");
    if (why == 1)
        fail(me, std::string("divergent ") + kind_name(me->wkind) + ": " + describe(me) + " at " +
                     site(me->file, me->line) + ", " + describe(l) + " at " + site(l->file, l->line));
    fail(l, std::string(kind_name(l->wkind)) + " at " + site(l->file, l->line) + ": lane " + std::to_string(l->lane) +
                " reads lane " + std::to_string(src) + ", which is not in mask " + hex(l->wmask));
}

// The last lane of `mask` arrived: check the group, hand every lane its result, wake them.
[[gnu::noinline]] void complete_warp_op(Exec& ex, Lane* me, unsigned mask) {
    Warp& w = ex.warps[me->warp];
    Lane** lanes = &ex.lanes[me->warp * 32];
    const int kind = me->wkind;
    for (unsigned m = mask; m; m &= m - 1) {
        Lane* l = lanes[__builtin_ctz(m)];
        if (l->wkind != kind || l->wmask != mask) bad_group(me, l, 0, 0);
        if (kind != TSIM_SYNCWARP && !same_site(l->file, l->line, me->file, me->line)) bad_group(me, l, 1, 0);
    }
    if (kind == TSIM_BALLOT) {
        uint64_t ballot = 0;
        for (unsigned m = mask; m; m &= m - 1)
            if (lanes[__builtin_ctz(m)]->wval) ballot |= 1ull << __builtin_ctz(m);
        for (unsigned m = mask; m; m &= m - 1) lanes[__builtin_ctz(m)]->wres = ballot;
    } else if (kind != TSIM_SYNCWARP) {
        for (unsigned m = mask; m; m &= m - 1) {
            unsigned j = __builtin_ctz(m);
            Lane* l = lanes[j];
            int src = shuffle_source(kind, j, l->warg, l->wwidth);
            if (src < 0) {
                l->wres = l->wval;
            } else if (!(mask >> src & 1)) {
                bad_group(l, l, 2, src);
            } else {
                l->wres = lanes[src]->wval;
            }
        }
    }
    w.waiting &= ~mask;
    if (kind == TSIM_SYNCWARP && ex.env->checked) checks_on_syncwarp(ex, me->warp, mask);
    for (unsigned m = mask & ~(1u << me->lane); m; m &= m - 1) lanes[__builtin_ctz(m)]->state = LANE_READY;
    w.ready |= mask & ~(1u << me->lane);
    me->state = LANE_RUNNING;
    if (ex.opt.order == Order::Random && (next_rand(ex) & 1)) {  // sometimes not first
        push_ready(ex, me);
        yield_from(me);
    }
}

void lane_exit(Lane* me) {
    Exec& ex = *me->exec;
    Warp& w = ex.warps[me->warp];
    me->state = LANE_EXITED;
    ex.live--;
    w.exited |= 1u << me->lane;
    for (unsigned j = 0; j < 32; j++) {
        if (!(w.waiting >> j & 1)) continue;
        Lane* l = ex.lanes[me->warp * 32 + j];
        if (l->wmask >> me->lane & 1)
            fail(l, std::string(kind_name(l->wkind)) + "(mask " + hex(l->wmask) + ") at " + site(l->file, l->line) +
                        " waits for lane " + std::to_string(me->lane) + ", which returned");
    }
    if (ex.at_barrier && ex.at_barrier == ex.live) release_barrier(ex, nullptr);
    yield_from(me);
    abort();  // an exited fiber is never resumed
}

std::string deadlock_report(Exec& ex) {
    std::string r = "deadlock: no thread can proceed;";
    int shown = 0;
    for (uint32_t i = 0; i < ex.nthreads && shown < 6; i++) {
        Lane* l = ex.lanes[i];
        if (l->state == LANE_AT_BARRIER) {
            r += " " + describe(l) + " waits at __syncthreads " + site(l->file, l->line) + ";";
            shown++;
        } else if (l->state == LANE_AT_WARP) {
            r += " " + describe(l) + " waits at " + kind_name(l->wkind) + "(mask " + hex(l->wmask) + ") " +
                 site(l->file, l->line) + ";";
            shown++;
        }
    }
    return r + " (" + std::to_string(ex.live) + " of " + std::to_string(ex.nthreads) + " threads live)";
}

void run_block(Exec& ex, tsim_dim3 bidx) {
    const LaunchEnv& env = *ex.env;
    ex.block_idx = bidx;
    ex.bar_epoch++;
    ex.block_first_epoch = ex.bar_epoch;
    ex.live = ex.nthreads;
    ex.at_barrier = 0;
    tsim_block blk{bidx, env.block, env.grid, env.smem ? ex.dyn_smem.data() : nullptr, env.smem};
    for (uint32_t w = 0; w < ex.nwarps; w++) {
        Warp& wp = ex.warps[w];
        uint32_t n = ex.nthreads - w * 32 < 32 ? ex.nthreads - w * 32 : 32;
        wp.exist = n == 32 ? 0xffffffffu : (1u << n) - 1;
        wp.exited = wp.waiting = 0;
        wp.ready = 0;
        ex.warp_order[w] = (uint8_t)(ex.opt.order == Order::Reverse ? ex.nwarps - 1 - w : w);
    }
    if (ex.opt.order == Order::Random) shuffle(ex, ex.warp_order, ex.nwarps);
    for (uint32_t i = 0; i < ex.nthreads; i++) {
        Lane* l = (Lane*)tsim_lane_address((uintptr_t)(ex.stacks + (size_t)i * TSIM_STACK_BYTES));
        l->blk = blk;
        l->pub.block = &l->blk;
        l->pub.thread_idx = {i % env.block.x, (i / env.block.x) % env.block.y, i / (env.block.x * env.block.y)};
        l->exec = &ex;
        l->linear = i;
        l->warp = (uint16_t)(i / 32);
        l->lane = (uint16_t)(i % 32);
        l->file = nullptr;
        l->line = 0;
        l->wkind = 0;
        // First switch: pops six callee-saved registers, then returns into tsim_fiber_start.
        void** sp = (void**)((char*)l - 64);
        *--sp = (void*)tsim_fiber_start;
        for (int r = 0; r < 6; r++) *--sp = nullptr;
        l->sp = sp;
        ex.lanes[i] = l;
    }
    for (uint32_t i = 0; i < ex.nthreads; i++) push_ready(ex, ex.lanes[i]);
    ex.warp_pos = 0;
    Lane* first = pop_ready(ex);
    tsim_switch(&ex.sched_sp, first->sp);
    if (!ex.failed && ex.live > 0) {
        ex.failed = true;
        ex.error = deadlock_report(ex);
    }
}

}  // namespace

Options& thread_options() { return t_options; }

Stats stats() {
    return {g_launches.load(), g_blocks.load(), g_threads.load(), g_switches.load(), g_checked.load(),
            g_cpu_ns.load()};
}

std::string describe(const Lane* l) {
    char b[96];
    snprintf(b, sizeof b, "thread (%u,%u,%u) of block (%u,%u,%u)", l->pub.thread_idx.x, l->pub.thread_idx.y,
             l->pub.thread_idx.z, l->blk.block_idx.x, l->blk.block_idx.y, l->blk.block_idx.z);
    return b;
}

void fail(Lane* who, const std::string& what) {
    Exec& ex = *who->exec;
    if (!ex.failed) {
        ex.failed = true;
        ex.error = what;
    }
    ex.switches++;
    tsim_switch(&who->sp, ex.sched_sp);  // abandons every fiber of the block
    abort();
}

std::string run_launch(const LaunchEnv& env, const Options& opt) {
    Exec& ex = this_exec();
    uint32_t n = env.block.x * env.block.y * env.block.z;
    if (!ensure_stacks(ex, n)) return "cannot map stacks for " + std::to_string(n) + " threads";
    ex.env = &env;
    ex.opt = opt;
    ex.rng = opt.seed * 0x9e3779b97f4a7c15ull + g_launches.load() + 1;
    ex.nthreads = n;
    ex.nwarps = (n + 31) / 32;
    ex.failed = false;
    ex.error.clear();
    ex.switches = 0;
    // Room for the largest dynamic shared memory and a margin, so that an access past a
    // launch's size lands in the buffer (the checks report it as such) rather than in
    // whatever memory follows.
    if (ex.dyn_smem.size() < 48 * 1024 + 4096) ex.dyn_smem.resize(48 * 1024 + 4096);
    const uint64_t cpu0 = thread_cpu_ns();
    if (env.checked) checks_begin_launch(ex);
    uint64_t blocks = 0;
    for (unsigned z = 0; z < env.grid.z && !ex.failed; z++)
        for (unsigned y = 0; y < env.grid.y && !ex.failed; y++)
            for (unsigned x = 0; x < env.grid.x && !ex.failed; x++) {
                run_block(ex, {x, y, z});
                blocks++;
            }
    if (env.checked) checks_end_launch(ex);
    g_launches++;
    g_checked += env.checked ? 1 : 0;
    g_blocks += blocks;
    g_threads += blocks * n;
    g_switches += ex.switches;
    g_cpu_ns += thread_cpu_ns() - cpu0;
    env.switches = ex.switches;
    ex.env = nullptr;
    if (!ex.failed) return "";
    char where[64];
    snprintf(where, sizeof where, " (block (%u,%u,%u) of grid (%u,%u,%u))", ex.block_idx.x, ex.block_idx.y,
             ex.block_idx.z, env.grid.x, env.grid.y, env.grid.z);
    return std::string(env.kernel->name) + ": " + ex.error + where;
}

}  // namespace tsim

using namespace tsim;

extern "C" void tsim_fiber_main() {
    Lane* me = current_lane();
    const LaunchEnv& env = *me->exec->env;
    env.kernel->invoke(env.kernel->fn, env.params);
    lane_exit(me);
}

extern "C" __attribute__((visibility("default"))) void tsim_syncthreads(const char* file, int line) {
    Lane* me = current_lane();
    Exec& ex = *me->exec;
    me->state = LANE_AT_BARRIER;
    me->file = file;
    me->line = line;
    ex.at_barrier++;
    if (ex.at_barrier == ex.live) {
        release_barrier(ex, me);  // queues every waiting thread, this one included
    }
    yield_from(me);
}

extern "C" __attribute__((visibility("default"))) uint64_t tsim_warp_op(int kind, unsigned mask, uint64_t value,
                                                                        int arg, int width, const char* file,
                                                                        int line) {
    Lane* me = current_lane();
    Exec& ex = *me->exec;
    Warp& w = ex.warps[me->warp];
    const unsigned bit = 1u << me->lane;
    me->file = file;
    me->line = line;
    if (__builtin_expect(!(mask & bit) || (mask & ~w.exist) || (mask & w.exited) || width < 1 || width > 32 ||
                             (width & (width - 1)),
                         0))
        bad_warp_op(me, kind, mask, width);
    me->wkind = kind;
    me->wmask = mask;
    me->wval = value;
    me->warg = arg;
    me->wwidth = width;
    me->state = LANE_AT_WARP;
    w.waiting |= bit;
    if ((w.waiting & mask) == mask) {
        complete_warp_op(ex, me, mask);
    } else {
        yield_in_warp(ex, me);
    }
    return me->wres;
}

extern "C" __attribute__((visibility("default"))) uint64_t tsim_atomic(int op, void* p, uint64_t v, uint64_t cmp) {
    Lane* me = current_lane();
    if (me->exec->env->checked) checks_atomic(me, p, op == TSIM_ATOMIC_ADD_U64 ? 8 : 4);
    if (op == TSIM_ATOMIC_ADD_U64) {
        uint64_t* q = (uint64_t*)p;
        uint64_t old = *q;
        *q = old + v;
        return old;
    }
    uint32_t* q = (uint32_t*)p;
    uint32_t old = *q, x = (uint32_t)v, r = old;
    switch (op) {
    case TSIM_ATOMIC_ADD_U32:
    case TSIM_ATOMIC_ADD_I32: r = old + x; break;
    case TSIM_ATOMIC_SUB_U32: r = old - x; break;
    case TSIM_ATOMIC_ADD_F32: {
        float a, b;
        memcpy(&a, &old, 4);
        memcpy(&b, &x, 4);
        a += b;
        memcpy(&r, &a, 4);
        break;
    }
    case TSIM_ATOMIC_MAX_I32: r = (int32_t)old > (int32_t)x ? old : x; break;
    case TSIM_ATOMIC_MIN_I32: r = (int32_t)old < (int32_t)x ? old : x; break;
    case TSIM_ATOMIC_MAX_U32: r = old > x ? old : x; break;
    case TSIM_ATOMIC_MIN_U32: r = old < x ? old : x; break;
    case TSIM_ATOMIC_EXCH_U32: r = x; break;
    case TSIM_ATOMIC_CAS_U32: r = old == (uint32_t)cmp ? x : old; break;
    case TSIM_ATOMIC_OR_U32: r = old | x; break;
    case TSIM_ATOMIC_AND_U32: r = old & x; break;
    case TSIM_ATOMIC_XOR_U32: r = old ^ x; break;
    default: fail(me, "unknown atomic operation " + std::to_string(op));
    }
    *q = r;
    return old;
}
