// The detectors of checked launches. The checked kernel libraries are compiled with GCC's
// thread-sanitizer instrumentation but without its runtime: every load and store of kernel
// code calls a hook (check_hooks.cpp) that lands in tsim_check_access here, with the
// address, size and whether it writes. Each access is classified:
//   - the calling CUDA thread's own stack (locals, its descriptor): not checked;
//   - shared memory (the library's static __shared__ block of this OS thread, and the
//     launch's dynamic shared memory): the race and uninitialized-read detectors;
//   - anything else must lie inside one live device allocation or the library's own image
//     (constant tables): otherwise an out-of-bounds (or freed-memory) access.
//
// Races. A barrier interval is the time between two __syncthreads of a block. Per byte of
// shared memory the detector keeps the last write (thread, interval, warp-sync count) and
// the reads since it in the current interval. A read of a byte another thread wrote in the
// same interval, or a write of a byte another thread read or wrote in it, is a race unless
// a __syncwarp whose mask holds both threads came in between (threads of one warp).
// Atomics conflict with plain accesses but not with each other. The detector looks at the
// accesses that actually happen in the order the scheduler ran them, so it finds races on
// the paths the test inputs take. Reads of a byte no thread of the block has written are
// reported too (shared memory starts undefined on a GPU).
#include <cxxabi.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <string>

#include "executor.h"

namespace tsim {

namespace {

enum : uint8_t { W_ATOMIC = 1, R_ATOMIC_ONLY = 2 };

struct Shadow {
    uint64_t w_epoch;  // barrier interval of the last write (< block start: none this block)
    uint64_t w_wseq;   // warp syncs completed when it was written
    uint64_t r_epoch;  // interval of the reads recorded below
    uint64_t r_wseq;   // warp syncs completed at the latest of those reads
    uint32_t r_lanes;  // lanes that read (when r_warp is one warp)
    uint16_t w_tid;
    uint8_t r_warp;  // 0xff: readers in several warps
    uint8_t flags;
};

}  // namespace

struct CheckState {
    Range tls{0, 0}, dyn{0, 0}, dyn_cap{0, 0};
    std::vector<Shadow> tls_shadow, dyn_shadow;
    // common[(warp * 32 + a) * 32 + b]: wsync_seq of the last __syncwarp holding lanes a, b.
    std::vector<uint64_t> common;
    Range last_hit{0, 0};
    Exec* ex = nullptr;
};

namespace {

thread_local CheckState* t_checks = nullptr;

inline Lane* current_lane() {
    uintptr_t sp;
    __asm__("movq %%rsp, %0" : "=r"(sp));
    return (Lane*)tsim_lane_address(sp);
}

// __cxa_demangle recurses deeply on the kernels' template names: run on a fiber's 16 KiB
// stack it overflowed it (a SIGSEGV instead of the race report). It runs on a stack of
// its own; malloc'd result, or null when `name` is not a mangled name.
char* demangle(const char* name) {
    constexpr size_t kBytes = 1 << 20;
    static thread_local char* stack = nullptr;
    if (!stack && !(stack = (char*)malloc(kBytes))) return nullptr;
    struct Call {
        const char* name;
        char* out;
        static void run(void* p) {
            Call* c = (Call*)p;
            int st = 0;
            c->out = abi::__cxa_demangle(c->name, nullptr, nullptr, &st);
            if (st != 0) {
                free(c->out);
                c->out = nullptr;
            }
        }
    } call{name, nullptr};
    void* top = (void*)(((uintptr_t)stack + kBytes) & ~(uintptr_t)15);
    void (*fn)(void*) = &Call::run;
    void* arg = &call;
    // Switch rsp to `top`, call fn(arg) (System V: every caller-saved register clobbered),
    // switch back. rbx keeps the fiber's rsp across the call.
    __asm__ volatile(
        "movq %%rsp, %%rbx\n\t"
        "movq %0, %%rsp\n\t"
        "movq %2, %%rdi\n\t"
        "callq *%1\n\t"
        "movq %%rbx, %%rsp\n\t"
        :
        : "r"(top), "r"(fn), "r"(arg)
        : "rbx", "rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "xmm0", "xmm1", "xmm2", "xmm3",
          "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15",
          "memory", "cc");
    return call.out;
}

std::string code_at(const void* pc) {
    Dl_info info;
    if (pc && dladdr(pc, &info) && info.dli_sname) {
        int st = 0;
        char* dm = demangle(info.dli_sname);
        char b[64];
        snprintf(b, sizeof b, "+0x%lx", (unsigned long)((uintptr_t)pc - (uintptr_t)info.dli_saddr));
        std::string s = std::string(st == 0 && dm ? dm : info.dli_sname) + b;
        free(dm);
        return s;
    }
    char b[32];
    snprintf(b, sizeof b, "pc %p", pc);
    return b;
}

std::string where(const Lane* me, const void* pc) {
    std::string s = describe(me) + " at " + code_at(pc);
    if (me->file) {
        const char* slash = strrchr(me->file, '/');
        s += " (after the synchronization at " + std::string(slash ? slash + 1 : me->file) + ":" +
             std::to_string(me->line) + ")";
    }
    return s;
}

std::string thread_name(const Exec& ex, uint32_t tid) {
    return tid < ex.nthreads ? describe(ex.lanes[tid]) : "thread " + std::to_string(tid);
}

// "name[+offset]" of the shared variable at `off` of the static block, demangled.
std::string shared_name(const Exec& ex, uintptr_t off) {
    const std::vector<TlsSymbol>* syms = ex.env->tls_symbols;
    if (syms)
        for (const TlsSymbol& s : *syms)
            if (off >= s.offset && off < s.offset + s.size) {
                int st = 0;
                char* dm = demangle(s.name.c_str());
                std::string n = st == 0 && dm ? dm : s.name;
                free(dm);
                return n + " + " + std::to_string(off - s.offset);
            }
    return "static shared memory + " + std::to_string(off);
}

bool warp_ordered(const CheckState& c, unsigned warp, unsigned a, unsigned b, uint64_t after) {
    return c.common[(warp * 32 + a) * 32 + b] > after;
}

void check_shared(CheckState& c, Lane* me, Shadow* sh, const char* region, uintptr_t off, unsigned size,
                  bool write, bool atomic, const void* pc) {
    Exec& ex = *c.ex;
    const uint64_t now = ex.bar_epoch;
    const uint32_t tid = me->linear;
    const unsigned warp = me->warp, lane = me->lane;
    for (unsigned k = 0; k < size; k++) {
        Shadow& s = sh[k];
        const bool written = s.w_epoch >= ex.block_first_epoch;
        const bool w_conflict = written && s.w_tid != tid && s.w_epoch == now &&
                                !(atomic && (s.flags & W_ATOMIC)) &&
                                !(s.w_tid / 32 == warp && warp_ordered(c, warp, s.w_tid % 32, lane, s.w_wseq));
        auto at = [&] {  // only formatted for a report
            std::string where = region ? region + std::string(" + ") + std::to_string(off + k)
                                       : shared_name(ex, off + k);
            return where + " (an access of " + std::to_string(size) + " bytes)";
        };
        if (!write) {
            if (!written)
                fail(me, "read of uninitialized shared memory " + at() + " by " + where(me, pc) +
                             ": no thread of the block wrote it");
            if (w_conflict)
                fail(me, "race on shared memory " + at() + ": " + where(me, pc) + " reads what " +
                             thread_name(ex, s.w_tid) +
                             " wrote in the same barrier interval (no __syncthreads or __syncwarp between)");
            if (s.r_epoch != now) {
                s.r_epoch = now;
                s.r_lanes = 1u << lane;
                s.r_warp = (uint8_t)warp;
                s.r_wseq = ex.wsync_seq;
                s.flags = (uint8_t)((s.flags & W_ATOMIC) | (atomic ? R_ATOMIC_ONLY : 0));
            } else {
                if (s.r_warp != warp) s.r_warp = 0xff;
                s.r_lanes |= 1u << lane;
                s.r_wseq = ex.wsync_seq;
                if (!atomic) s.flags &= (uint8_t)~R_ATOMIC_ONLY;
            }
            continue;
        }
        if (w_conflict)
            fail(me, "race on shared memory " + at() + ": " + where(me, pc) + " overwrites what " +
                         thread_name(ex, s.w_tid) + " wrote in the same barrier interval");
        if (s.r_epoch == now && s.r_epoch >= ex.block_first_epoch && !(atomic && (s.flags & R_ATOMIC_ONLY))) {
            uint32_t others = s.r_warp == warp ? s.r_lanes & ~(1u << lane) : s.r_lanes;
            bool race = s.r_warp == 0xff || (s.r_warp != warp && s.r_lanes);
            for (unsigned x = 0; !race && x < 32; x++)
                if (others >> x & 1 && !warp_ordered(c, warp, x, lane, s.r_wseq)) race = true;
            if (race)
                fail(me, "race on shared memory " + at() + ": " + where(me, pc) +
                             " writes what other threads read in the same barrier interval (readers in " +
                             (s.r_warp == 0xff ? std::string("several warps") : "warp " + std::to_string(s.r_warp)) +
                             ")");
        }
        s.w_epoch = now;
        s.w_tid = (uint16_t)tid;
        s.w_wseq = ex.wsync_seq;
        s.flags = atomic ? W_ATOMIC : 0;
        s.r_epoch = 0;
    }
}

void check_global(CheckState& c, Lane* me, uintptr_t a, unsigned size, bool write, const void* pc) {
    const uintptr_t end = a + size;
    if (a >= c.last_hit.lo && end <= c.last_hit.hi) return;
    const std::vector<Range>& mem = c.ex->env->memory;
    auto it = std::upper_bound(mem.begin(), mem.end(), a, [](uintptr_t v, const Range& r) { return v < r.lo; });
    if (it != mem.begin()) {
        const Range& r = *(it - 1);
        if (a >= r.lo && end <= r.hi) {
            c.last_hit = r;
            return;
        }
    }
    char b[200];
    if (it != mem.begin() && a < (it - 1)->hi + 4096) {
        const Range& r = *(it - 1);
        snprintf(b, sizeof b, "%s of %u bytes at %p: offset %ld of the %lu-byte device buffer at %p (past its end)",
                 write ? "write" : "read", size, (void*)a, (long)(a - r.lo), (unsigned long)(r.hi - r.lo),
                 (void*)r.lo);
    } else if (it != mem.end() && it->lo < end + 4096) {
        snprintf(b, sizeof b, "%s of %u bytes at %p, %ld bytes before the device buffer at %p",
                 write ? "write" : "read", size, (void*)a, (long)(it->lo - a), (void*)it->lo);
    } else {
        snprintf(b, sizeof b, "%s of %u bytes at %p, in no live device buffer (freed, or never allocated)",
                 write ? "write" : "read", size, (void*)a);
    }
    fail(me, std::string("out-of-bounds ") + b + " by " + where(me, pc));
}

void access(Lane* me, const void* p, unsigned size, bool write, bool atomic, const void* pc) {
    CheckState& c = *t_checks;
    const uintptr_t a = (uintptr_t)p, end = a + size;
    const uintptr_t stack = (uintptr_t)me & ~(uintptr_t)(TSIM_STACK_BYTES - 1);
    if (a >= stack && end <= stack + TSIM_STACK_BYTES) return;
    if (a < c.tls.hi && end > c.tls.lo) {
        if (a < c.tls.lo || end > c.tls.hi) fail(me, "access straddles the static shared memory by " + where(me, pc));
        check_shared(c, me, &c.tls_shadow[a - c.tls.lo], nullptr, a - c.tls.lo, size, write, atomic, pc);
        return;
    }
    if (a < c.dyn_cap.hi && end > c.dyn_cap.lo) {
        if (a < c.dyn.lo || end > c.dyn.hi) {
            char b[128];
            snprintf(b, sizeof b, "out-of-bounds %s of %u bytes at dynamic shared memory +%ld (the launch has %lu)",
                     write ? "write" : "read", size, (long)(a - c.dyn.lo), (unsigned long)(c.dyn.hi - c.dyn.lo));
            fail(me, std::string(b) + " by " + where(me, pc));
        }
        check_shared(c, me, &c.dyn_shadow[a - c.dyn.lo], "dynamic shared memory", a - c.dyn.lo, size, write,
                     atomic, pc);
        return;
    }
    check_global(c, me, a, size, write, pc);
}

}  // namespace

void checks_begin_launch(Exec& ex) {
    if (!ex.checks) ex.checks = new CheckState();
    CheckState& c = *ex.checks;
    c.ex = &ex;
    const LaunchEnv& env = *ex.env;
    c.tls = env.static_smem;
    if (c.tls_shadow.size() < c.tls.hi - c.tls.lo) c.tls_shadow.resize(c.tls.hi - c.tls.lo);
    uintptr_t d = (uintptr_t)ex.dyn_smem.data();
    c.dyn = {d, d + env.smem};
    c.dyn_cap = {d, d + ex.dyn_smem.size()};
    if (c.dyn_shadow.size() < env.smem) c.dyn_shadow.resize(env.smem);
    if (c.common.empty()) c.common.assign(32 * 32 * 32, 0);
    c.last_hit = {0, 0};
    t_checks = &c;
}

void checks_end_launch(Exec& ex) {
    (void)ex;
    t_checks = nullptr;
}

void checks_on_syncwarp(Exec& ex, unsigned warp, unsigned mask) {
    CheckState& c = *ex.checks;
    ex.wsync_seq++;
    for (unsigned a = 0; a < 32; a++)
        if (mask >> a & 1)
            for (unsigned b = 0; b < 32; b++)
                if (mask >> b & 1) c.common[(warp * 32 + a) * 32 + b] = ex.wsync_seq;
}

void checks_atomic(Lane* l, void* p, unsigned size) {
    if (!t_checks) return;
    const void* pc = __builtin_return_address(0);
    access(l, p, size, false, true, pc);
    access(l, p, size, true, true, pc);
}

}  // namespace tsim

extern "C" __attribute__((visibility("default"))) void tsim_check_access(const void* p, unsigned size, int is_write,
                                                                         const void* pc) {
    if (!tsim::t_checks) return;  // not inside a checked launch on this thread (library set-up)
    tsim::access(tsim::current_lane(), p, size, is_write != 0, false, pc);
}
