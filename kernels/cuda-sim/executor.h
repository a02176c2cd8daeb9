// The CPU executor's internals: one launch runs block after block on the calling OS
// thread; a block's CUDA threads are fibers (scheduler.cpp) switched only inside the
// synchronizing built-ins. checks.cpp adds the race, bounds and uninitialized-read
// detectors that run with the checked kernel libraries.
#ifndef TSIM_EXECUTOR_H
#define TSIM_EXECUTOR_H

#include <stdint.h>

#include <string>
#include <vector>

#include "image.h"
#include "tsim_abi.h"

namespace tsim {

// In which order the threads of a block are resumed (warp by warp; see README.md).
enum class Order : int { Forward = 0, Reverse = 1, Random = 2 };

struct Options {
    Order order = Order::Forward;
    uint64_t seed = 1;
    // Run the checked kernel library: race, bounds and uninitialized-shared-read detection.
    bool checks = false;
};

struct Range {
    uintptr_t lo, hi;  // [lo, hi)
};

// What the driver hands the executor for one launch.
struct LaunchEnv {
    const tsim_kernel* kernel = nullptr;
    bool checked = false;  // `kernel` comes from a checked (instrumented) library
    tsim_dim3 grid{}, block{};
    unsigned smem = 0;
    void** params = nullptr;
    // Checked launches: every readable or writable range a kernel may touch besides shared
    // memory and its own stack (live device allocations, the library's own image), sorted.
    std::vector<Range> memory;
    // Checked launches: the library's static shared memory (its thread-local block) on
    // this OS thread.
    Range static_smem{0, 0};
    // Checked launches: the library's thread-local symbols (naming shared variables).
    const std::vector<TlsSymbol>* tls_symbols = nullptr;
    // Set by run_launch: fiber switches the launch took.
    mutable uint64_t switches = 0;
};

enum LaneState : uint8_t { LANE_READY, LANE_RUNNING, LANE_AT_BARRIER, LANE_AT_WARP, LANE_EXITED };

struct Exec;

// A CUDA thread. Lives at the top of its stack (TSIM_LANE_RESERVE bytes).
struct Lane {
    tsim_lane pub;   // what kernels see; pub.block points at `blk`
    tsim_block blk;  // this thread's copy of its block's coordinates
    void* sp;        // saved stack pointer while suspended
    Exec* exec;
    uint32_t linear;  // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
    uint16_t warp, lane;
    LaneState state;
    // Where it waits (barrier or warp operation), or its last synchronization.
    const char* file;
    int line;
    // The pending warp operation.
    int wkind;
    unsigned wmask;
    int warg, wwidth;
    uint64_t wval, wres;
};
static_assert(sizeof(Lane) <= TSIM_LANE_RESERVE, "the lane descriptor outgrew its reserve");

struct Warp {
    uint32_t exist;    // lanes of this warp the block has
    uint32_t exited;   // of those, lanes that returned
    uint32_t waiting;  // lanes waiting at a warp operation
    uint32_t ready;    // lanes ready to run (the order picks among them)
};

struct CheckState;  // checks.cpp

struct Exec {
    // Fiber stacks: `slots` regions of TSIM_STACK_BYTES each, aligned to it.
    char* stacks = nullptr;
    uint32_t slots = 0;
    void* sched_sp = nullptr;  // the launching thread's own stack while fibers run
    Lane* lanes[1024];
    uint32_t nthreads = 0, nwarps = 0;
    Warp warps[32];
    uint8_t warp_order[32];
    uint32_t warp_pos = 0;
    uint32_t live = 0, at_barrier = 0;
    // Barrier counter, monotonic over the blocks this thread runs: +1 at every block start
    // and every completed __syncthreads (the race detector's intervals).
    uint64_t bar_epoch = 0, block_first_epoch = 0;
    // Warp syncs completed (monotonic, the race detector's warp-level ordering).
    uint64_t wsync_seq = 0;
    const LaunchEnv* env = nullptr;
    Options opt;
    uint64_t rng = 0;
    tsim_dim3 block_idx{};
    bool failed = false;
    std::string error;
    uint64_t switches = 0;
    std::vector<char> dyn_smem;  // dynamic shared memory of the running launch
    CheckState* checks = nullptr;  // set during checked launches
};

// Runs every block of a launch; returns "" or the report of the first defect found.
std::string run_launch(const LaunchEnv& env, const Options& opt);

// Per-process totals (for the suites' printed figures).
struct Stats {
    uint64_t launches, blocks, threads, switches, checked_launches;
    uint64_t cpu_ns;  // CPU time of the launching threads inside launches
};
Stats stats();

// The calling OS thread's executor options (set through tsim_set_thread_options).
Options& thread_options();

// Ends the launch with a defect report: never returns to the calling CUDA thread.
[[noreturn]] void fail(Lane* who, const std::string& what);
// "thread (x,y,z) of block (x,y,z)".
std::string describe(const Lane* l);

// checks.cpp
void checks_begin_launch(Exec& ex);
void checks_end_launch(Exec& ex);
void checks_on_syncwarp(Exec& ex, unsigned warp, unsigned mask);
void checks_atomic(Lane* l, void* p, unsigned size);

}  // namespace tsim

#endif
