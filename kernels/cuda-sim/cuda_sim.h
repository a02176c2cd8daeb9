// CUDA built-ins for compiling the project's .cu files as C++17 with g++ and running them
// on the CPU executor (libcuda.so.1 of this directory; README.md says what it proves and
// what it does not). Included before common.cuh and each .cu file; never seen by NVRTC.
//
// Execution model: every CUDA thread is a fiber with its own stack; the executor runs the
// threads of one block at a time and switches between them only inside the built-ins
// below that synchronize (__syncthreads, shuffles, ballot, __syncwarp). So between two
// synchronizations a thread runs alone: shared memory needs no locks, atomics are plain
// read-modify-writes, and a race between threads shows up as an ordering dependence (the
// thread orders of the executor and its race detector look for those).
//
// Float semantics (what g++ is told, see build.rs): IEEE binary32 per operation, round to
// nearest even, no FMA contraction (-ffp-contract=off), no fast-math, denormals kept;
// expf / sqrtf are glibc's (sqrtf and division correctly rounded, as on the GPU without
// fast-math; expf within 1 ulp where the GPU's is within 2). NVRTC contracts a * b + c
// into FMAs, so float results may differ from a GPU's in the last bits; integer and f16
// conversion results are exact.
#ifndef TANDEM_CUDA_SIM_H
#define TANDEM_CUDA_SIM_H

#define TANDEM_CUDA_SIM 1

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>

#include "tsim_abi.h"

#if !defined(__x86_64__)
#error "the CUDA CPU executor supports x86-64 only (its fiber switch is x86-64 assembly)"
#endif

// ---- Qualifiers ----
#ifdef TSIM_SCAN
// build.rs preprocesses each .cu with TSIM_SCAN to list its kernels: every __global__
// function, written `__global__ void name(` as this project does.
#define __global__ __tsim_kernel__
#else
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
// Static shared memory: one copy per executing OS thread; the executor runs one block at a
// time per OS thread, so it is the block's shared memory.
#define __shared__ static thread_local
// Dynamic shared memory (`extern __shared__ T name[]` on the GPU; common.cuh declares it
// through this macro so that the CPU build gets the launch's buffer instead).
#define TANDEM_DYNAMIC_SMEM(T, name) T* const name = (T*)tsim_this_lane()->block->dyn_smem

typedef struct tsim_dim3 uint3;
typedef struct tsim_dim3 dim3;

// The calling CUDA thread: its descriptor sits at the top of its stack (tsim_abi.h).
static __forceinline__ const struct tsim_lane* tsim_this_lane() {
    uintptr_t sp;
    __asm__("movq %%rsp, %0" : "=r"(sp));
    return (const struct tsim_lane*)tsim_lane_address(sp);
}

#define threadIdx (tsim_this_lane()->thread_idx)
#define blockIdx (tsim_this_lane()->block->block_idx)
#define blockDim (tsim_this_lane()->block->block_dim)
#define gridDim (tsim_this_lane()->block->grid_dim)
#define warpSize 32

// ---- Synchronization ----
#define __syncthreads() tsim_syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) tsim_syncwarp_at(__FILE__, __LINE__, ##__VA_ARGS__)
#define __threadfence() __asm__ __volatile__("" ::: "memory")
#define __threadfence_block() __asm__ __volatile__("" ::: "memory")

static __forceinline__ void tsim_syncwarp_at(const char* f, int l, unsigned mask = 0xffffffffu) {
    tsim_warp_op(TSIM_SYNCWARP, mask, 0, 0, 32, f, l);
}

template <class T>
static __forceinline__ uint64_t tsim_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a wide type");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}

template <class T>
static __forceinline__ T tsim_from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}

template <class T>
static __forceinline__ T tsim_shfl(int kind, const char* f, int l, unsigned mask, T v, int arg,
                                   int width = 32) {
    return tsim_from_bits<T>(tsim_warp_op(kind, mask, tsim_bits(v), arg, width, f, l));
}

#define __shfl_sync(...) tsim_shfl(TSIM_SHFL_IDX, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) tsim_shfl(TSIM_SHFL_UP, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) tsim_shfl(TSIM_SHFL_DOWN, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) tsim_shfl(TSIM_SHFL_XOR, __FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(mask, pred) \
    ((unsigned)tsim_warp_op(TSIM_BALLOT, (mask), (pred) ? 1 : 0, 0, 32, __FILE__, __LINE__))
#define __any_sync(mask, pred) (__ballot_sync((mask), (pred)) != 0u)
#define __all_sync(mask, pred) (__ballot_sync((mask), (pred)) == (unsigned)(mask))

// ---- Atomics: plain read-modify-writes in the executor (threads never preempt each
// other), which also tells the race detector that the access is atomic. ----
static __forceinline__ unsigned atomicAdd(unsigned* p, unsigned v) {
    return (unsigned)tsim_atomic(TSIM_ATOMIC_ADD_U32, p, v, 0);
}
static __forceinline__ int atomicAdd(int* p, int v) {
    return (int)tsim_atomic(TSIM_ATOMIC_ADD_I32, p, (uint32_t)v, 0);
}
static __forceinline__ unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return tsim_atomic(TSIM_ATOMIC_ADD_U64, p, v, 0);
}
static __forceinline__ float atomicAdd(float* p, float v) {
    return tsim_from_bits<float>(tsim_atomic(TSIM_ATOMIC_ADD_F32, p, tsim_bits(v), 0));
}
static __forceinline__ unsigned atomicSub(unsigned* p, unsigned v) {
    return (unsigned)tsim_atomic(TSIM_ATOMIC_SUB_U32, p, v, 0);
}
static __forceinline__ int atomicMax(int* p, int v) {
    return (int)tsim_atomic(TSIM_ATOMIC_MAX_I32, p, (uint32_t)v, 0);
}
static __forceinline__ int atomicMin(int* p, int v) {
    return (int)tsim_atomic(TSIM_ATOMIC_MIN_I32, p, (uint32_t)v, 0);
}
static __forceinline__ unsigned atomicMax(unsigned* p, unsigned v) {
    return (unsigned)tsim_atomic(TSIM_ATOMIC_MAX_U32, p, v, 0);
}
static __forceinline__ unsigned atomicMin(unsigned* p, unsigned v) {
    return (unsigned)tsim_atomic(TSIM_ATOMIC_MIN_U32, p, v, 0);
}
static __forceinline__ unsigned atomicExch(unsigned* p, unsigned v) {
    return (unsigned)tsim_atomic(TSIM_ATOMIC_EXCH_U32, p, v, 0);
}
static __forceinline__ unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
    return (unsigned)tsim_atomic(TSIM_ATOMIC_CAS_U32, p, v, cmp);
}
static __forceinline__ unsigned atomicOr(unsigned* p, unsigned v) {
    return (unsigned)tsim_atomic(TSIM_ATOMIC_OR_U32, p, v, 0);
}
static __forceinline__ unsigned atomicAnd(unsigned* p, unsigned v) {
    return (unsigned)tsim_atomic(TSIM_ATOMIC_AND_U32, p, v, 0);
}
static __forceinline__ unsigned atomicXor(unsigned* p, unsigned v) {
    return (unsigned)tsim_atomic(TSIM_ATOMIC_XOR_U32, p, v, 0);
}

// ---- Integer intrinsics (exact PTX semantics) ----
static __forceinline__ int __popc(unsigned x) { return __builtin_popcount(x); }
static __forceinline__ int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static __forceinline__ int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static __forceinline__ int __ffs(int x) { return __builtin_ffs(x); }
static __forceinline__ unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
// Four signed byte products summed into c, wrapping like the 32-bit hardware add.
// Written out byte by byte (no loop with variable shifts): g++ keeps a loop here, and it
// was most of the executor's time in the Q8 matmuls.
static __forceinline__ int __dp4a(int a, int b, int c) {
    const int p0 = (int)(int8_t)a * (int)(int8_t)b;
    const int p1 = (int)(int8_t)(a >> 8) * (int)(int8_t)(b >> 8);
    const int p2 = (int)(int8_t)(a >> 16) * (int)(int8_t)(b >> 16);
    const int p3 = (int)(int8_t)(a >> 24) * (int)(int8_t)(b >> 24);
    return (int)((uint32_t)c + (uint32_t)(p0 + p1 + p2 + p3));  // |p0+..+p3| <= 2^16
}
static __forceinline__ unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    return c + (a & 255u) * (b & 255u) + (a >> 8 & 255u) * (b >> 8 & 255u) +
           (a >> 16 & 255u) * (b >> 16 & 255u) + (a >> 24) * (b >> 24);
}
// Per-byte a - b modulo 256 (no saturation: that is __vsubss4).
static __forceinline__ unsigned __vsub4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (((a >> (8 * i)) - (b >> (8 * i))) & 255u) << (8 * i);
    return r;
}
static __forceinline__ int __vsub4(int a, int b) { return (int)__vsub4((unsigned)a, (unsigned)b); }

// ---- Bit casts and conversions ----
static __forceinline__ float __int_as_float(int i) { return tsim_from_bits<float>((uint32_t)i); }
static __forceinline__ float __uint_as_float(unsigned u) { return tsim_from_bits<float>(u); }
static __forceinline__ int __float_as_int(float f) { return (int)(uint32_t)tsim_bits(f); }
static __forceinline__ unsigned __float_as_uint(float f) { return (uint32_t)tsim_bits(f); }
// cvt.rni.s32.f32: nearest even, NaN -> 0, out of range saturates.
static __forceinline__ int __float2int_rn(float x) {
    if (x != x) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x < -2147483648.0f) return (-2147483647 - 1);
    return (int)__builtin_rintf(x);
}
static __forceinline__ int __float2int_rz(float x) {
    if (x != x) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x < -2147483648.0f) return (-2147483647 - 1);
    return (int)x;
}

// IEEE half <-> float, like PTX cvt.f32.f16 / cvt.rn.f16.f32 (round to nearest even,
// overflow to infinity, subnormals kept; a NaN stays a quiet NaN with its top payload).
static __forceinline__ float tsim_h2f(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return tsim_from_bits<float>(s | (uint32_t)tsim_bits(v));
    }
    if (e == 31) return tsim_from_bits<float>(s | 0x7f800000u | (m ? 0x400000u | (m << 13) : 0u));
    return tsim_from_bits<float>(s | ((e + 112u) << 23) | (m << 13));
}
static __forceinline__ uint16_t tsim_f2h(float f) {
    uint32_t x = (uint32_t)tsim_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to infinity
    if (ax < 0x38800000u) {  // below 2^-14: a subnormal half (units of 2^-24)
        float a = tsim_from_bits<float>(ax) * 16777216.0f;  // exact
        return (uint16_t)(sign | (uint32_t)__builtin_rintf(a));
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu), rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

// ---- Single-rounding float operations (PTX add.rn / sub.rn / mul.rn / div.rn /
// sqrt.rn / fma.rn .f32): each is one IEEE binary32 operation rounded to nearest even,
// never contracted with its neighbours into an fma (that is their purpose in the kernels:
// the rounding steps of the CPU reference). The empty asm makes the result opaque to the
// optimizer, so the guarantee does not depend on -ffp-contract=off. ----
static __forceinline__ float tsim_rounded(float r) {
    __asm__("" : "+x"(r));
    return r;
}
static __forceinline__ float __fadd_rn(float a, float b) { return tsim_rounded(a + b); }
static __forceinline__ float __fsub_rn(float a, float b) { return tsim_rounded(a - b); }
static __forceinline__ float __fmul_rn(float a, float b) { return tsim_rounded(a * b); }
static __forceinline__ float __fdiv_rn(float a, float b) { return tsim_rounded(a / b); }
static __forceinline__ float __fsqrt_rn(float a) { return tsim_rounded(sqrtf(a)); }
// One rounding of the exact a * b + c (glibc's fmaf is correctly rounded).
static __forceinline__ float __fmaf_rn(float a, float b, float c) { return tsim_rounded(fmaf(a, b, c)); }

// ---- Math: CUDA's device overloads in the global namespace ----
// glibc declares __expf / __logf itself: the fast-math intrinsics map to the accurate ones.
#define __expf(x) expf(x)
#define __logf(x) logf(x)
static __forceinline__ float __fdividef(float a, float b) { return a / b; }
static __forceinline__ float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static __forceinline__ float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
static __forceinline__ float min(float a, float b) { return fminf(a, b); }
static __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
static __forceinline__ double min(double a, double b) { return fmin(a, b); }
static __forceinline__ double max(double a, double b) { return fmax(a, b); }
// Integer min / max with the usual arithmetic conversions, as CUDA's mixed overloads.
template <class A, class B, class = std::enable_if_t<std::is_integral<A>::value && std::is_integral<B>::value>>
static __forceinline__ std::common_type_t<A, B> min(A a, B b) {
    typedef std::common_type_t<A, B> C;
    return (C)a < (C)b ? (C)a : (C)b;
}
template <class A, class B, class = std::enable_if_t<std::is_integral<A>::value && std::is_integral<B>::value>>
static __forceinline__ std::common_type_t<A, B> max(A a, B b) {
    typedef std::common_type_t<A, B> C;
    return (C)a > (C)b ? (C)a : (C)b;
}
template <class T>
static __forceinline__ T __ldg(const T* p) { return *p; }

// ---- Registration: build.rs appends TSIM_KERNEL(namespace, name) for every __global__
// function it finds in a .cu file (see README.md); the trampoline of each kernel is the
// instantiation of tsim_signature for its parameter types. ----
// Set-up code of the checked libraries that must not reach the race detector's hooks.
#define TSIM_NOT_CHECKED __attribute__((no_sanitize("thread")))

template <class... A>
struct tsim_signature {
    static constexpr unsigned short sizes[sizeof...(A) ? sizeof...(A) : 1] = {(unsigned short)sizeof(A)...};
    template <size_t... I>
    TSIM_NOT_CHECKED static void call(void* fn, void** p, std::index_sequence<I...>) {
        reinterpret_cast<void (*)(A...)>(fn)(*static_cast<std::remove_cv_t<A>*>(p[I])...);
    }
    TSIM_NOT_CHECKED static void invoke(void* fn, void** p) { call(fn, p, std::index_sequence_for<A...>{}); }
};

template <class... A>
TSIM_NOT_CHECKED static struct tsim_kernel tsim_make_kernel(const char* name, const char* file, void (*f)(A...)) {
    static_assert((std::is_trivially_copyable<A>::value && ...), "kernel parameters are copied as bytes");
    return {name, file, reinterpret_cast<void*>(f), &tsim_signature<A...>::invoke,
            (unsigned)sizeof...(A), tsim_signature<A...>::sizes};
}

// Appends a file's kernels to the library's table (tsim_registry.cpp).
extern "C" void tsim_register(const struct tsim_kernel* kernels, size_t n);

#define TSIM_KERNEL(ns, name) tsim_make_kernel(#name, ns::tsim_file, &ns::name),

#define TSIM_REGISTER(ns, ...)                                                        \
    namespace {                                                                       \
    struct tsim_registrar_##ns {                                                      \
        TSIM_NOT_CHECKED tsim_registrar_##ns() {                                      \
            static const struct tsim_kernel k[] = {__VA_ARGS__};                      \
            tsim_register(k, sizeof(k) / sizeof(k[0]));                               \
        }                                                                             \
    } tsim_registrar_instance_##ns;                                                   \
    }

#endif
