// The interface between the CPU executor (libcuda.so.1, see README.md) and the kernel
// libraries it loads: what a kernel sees of its CUDA thread, the built-ins the executor
// implements, and the table a kernel library exports. C ABI, versioned: a kernel library
// built against another version is refused at load.
#ifndef TSIM_ABI_H
#define TSIM_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TSIM_ABI_VERSION 1

// Every CUDA thread runs on its own stack of TSIM_STACK_BYTES, aligned to its size; near
// its top sit TSIM_LANE_RESERVE bytes holding the thread's descriptor (struct tsim_lane
// first), so a kernel finds "its" thread from the stack pointer alone (no thread-local
// lookup). The descriptor's distance from the top varies with the stack's index (a cache
// colour): at one fixed offset, the 32 descriptors and stack tops of a warp, 64 KiB apart,
// would all map to the same cache sets and evict each other at every warp operation.
#define TSIM_STACK_BYTES (16 * 1024)
#define TSIM_LANE_RESERVE 512
#define TSIM_LANE_COLORS 32
#define TSIM_LANE_COLOR_BYTES 128

static inline uintptr_t tsim_lane_address(uintptr_t sp) {
    uintptr_t base = sp & ~(uintptr_t)(TSIM_STACK_BYTES - 1);
    return base + TSIM_STACK_BYTES - TSIM_LANE_RESERVE -
           ((base / TSIM_STACK_BYTES) % TSIM_LANE_COLORS) * TSIM_LANE_COLOR_BYTES;
}

struct tsim_dim3 {
    unsigned x, y, z;
};

struct tsim_block {
    struct tsim_dim3 block_idx, block_dim, grid_dim;
    void* dyn_smem;           // the launch's dynamic shared memory (extern __shared__)
    unsigned dyn_smem_bytes;  // as launched (sharedMemBytes)
};

struct tsim_lane {
    struct tsim_dim3 thread_idx;
    const struct tsim_block* block;
};

// Warp-level operations (tsim_warp_op's `kind`).
enum tsim_warp_kind {
    TSIM_SHFL_IDX = 1,
    TSIM_SHFL_UP = 2,
    TSIM_SHFL_DOWN = 3,
    TSIM_SHFL_XOR = 4,
    TSIM_BALLOT = 5,
    TSIM_SYNCWARP = 6,
};

// Atomic read-modify-write operations (tsim_atomic's `op`); the old value is returned.
enum tsim_atomic_op {
    TSIM_ATOMIC_ADD_U32 = 1,
    TSIM_ATOMIC_ADD_I32 = 2,
    TSIM_ATOMIC_ADD_F32 = 3,
    TSIM_ATOMIC_ADD_U64 = 4,
    TSIM_ATOMIC_MAX_I32 = 5,
    TSIM_ATOMIC_MIN_I32 = 6,
    TSIM_ATOMIC_MAX_U32 = 7,
    TSIM_ATOMIC_MIN_U32 = 8,
    TSIM_ATOMIC_EXCH_U32 = 9,
    TSIM_ATOMIC_CAS_U32 = 10,
    TSIM_ATOMIC_OR_U32 = 11,
    TSIM_ATOMIC_AND_U32 = 12,
    TSIM_ATOMIC_XOR_U32 = 13,
    TSIM_ATOMIC_SUB_U32 = 14,
};

// ---- Built-ins implemented by the executor (exported by libcuda.so.1) ----

// __syncthreads(): waits for every live thread of the block at this barrier.
void tsim_syncthreads(const char* file, int line);
// Shuffles, ballot, __syncwarp: waits for every lane of `mask` at an operation of the same
// kind and mask; returns the lane's result (the shuffled value, the ballot, or 0).
uint64_t tsim_warp_op(int kind, unsigned mask, uint64_t value, int arg, int width,
                      const char* file, int line);
// An atomic RMW on 4 or 8 bytes at `p` (shared or global); returns the old value's bits.
uint64_t tsim_atomic(int op, void* p, uint64_t value, uint64_t compare);
// Check builds only: every instrumented memory access of a kernel (see checks.cpp).
void tsim_check_access(const void* p, unsigned size, int is_write, const void* pc);

// ---- What a kernel library exports ----

// Calls kernel `fn` with its parameters unpacked from `params` (cuLaunchKernel's array of
// pointers to each argument), one instantiation per kernel signature.
typedef void (*tsim_invoke_fn)(void* fn, void** params);

struct tsim_kernel {
    const char* name;            // the extern "C" entry name (as NVRTC's module names it)
    const char* file;            // the .cu file that defines it
    void* fn;                    // the CPU-compiled kernel
    tsim_invoke_fn invoke;
    unsigned n_params;
    const unsigned short* param_sizes;  // bytes of each parameter, in order
};

// The library's kernels; `*abi` is set to TSIM_ABI_VERSION of the library's build.
typedef const struct tsim_kernel* (*tsim_kernels_fn)(size_t* count, unsigned* abi, int* checked);

#ifdef __cplusplus
}
#endif

#endif
