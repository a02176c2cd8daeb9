// Shared definitions, prepended by the Rust side to every .cu file before NVRTC compiles
// it (NVRTC has no include path here, and no CUDA headers are needed: half conversions
// use PTX `cvt` directly).
//
// The same files also compile as C++17 for the CPU executor (kernels/cuda-sim, which
// defines TANDEM_CUDA_SIM): the only differences are behind that macro here (the two
// inline-PTX conversions) and TANDEM_DYNAMIC_SMEM (dynamic shared memory).
//
// Byte layouts (little endian, identical to kernels/src/types.rs and quant.rs):
//   F32  4 bytes/elem      F16  IEEE half      BF16  upper 16 bits of an f32
//   Q8_0 34 bytes / 32: f16 d, 32 x i8            value = q * d
//   Q4_0 18 bytes / 32: f16 d, 16 B nibbles        value = (q - 8) * d
//   Q4_1 20 bytes / 32: f16 d, f16 m, 16 B nibbles value = q * d + m
//   Nibbles: byte j holds element j (low) and element j + 16 (high).
//   BlockQ8 (activations, 40 bytes): f32 d, f32 s = d * sum(q), 32 x i8 — quant::BlockQ8.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;
typedef long long i64;
typedef unsigned long long u64;

#define QK 32
// GGML type ids, as in types.rs.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q8_0 8
#define T_BF16 30

#define NEG_INF __int_as_float(0xff800000)

struct BlockQ8 {
    float d;
    float s;
    int qs[8];
};

// `extern __shared__ T name[]`: the launch's dynamic shared memory.
#ifndef TANDEM_DYNAMIC_SMEM
#define TANDEM_DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#endif

#ifdef TANDEM_CUDA_SIM
__device__ __forceinline__ float h2f(u16 h) { return tsim_h2f(h); }
__device__ __forceinline__ u16 f2h(float f) { return tsim_f2h(f); }
#else
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, like half::f16::from_f32 on the CPU side.
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Block sizes are even, so every f16 field and every quant block is 2-byte aligned; the
// nibble/int8 payloads are read as two 16-bit halves to stay legal for Q4_0 and Q8_0,
// whose 18- and 34-byte blocks break 4-byte alignment.
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ int ld32_b2(const u8* p) {
    const u16* q = (const u16*)p;
    return (int)((u32)q[0] | ((u32)q[1] << 16));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ int warp_isum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block whose size is a multiple of 32 (at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `part` may still be read by a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < nw ? part[lane] : 0.0f;
    return warp_sum(v);
}

// Element i of a row stored as `ty` (embedding rows, KV rows and heads).
__device__ __forceinline__ float load_elem(const u8* row, int ty, int i) {
    switch (ty) {
    case T_F32:
        return ((const float*)row)[i];
    case T_F16:
        return h2f(((const u16*)row)[i]);
    case T_BF16:
        return bf2f(((const u16*)row)[i]);
    case T_Q8_0: {
        const u8* b = row + (i / QK) * 34;
        return (float)(i8)b[2 + i % QK] * h2f(ld16(b));
    }
    case T_Q4_0: {
        const u8* b = row + (i / QK) * 18;
        int j = i % QK;
        u8 byte = b[2 + (j & 15)];
        int q = j < 16 ? (byte & 15) : (byte >> 4);
        return (float)(q - 8) * h2f(ld16(b));
    }
    case T_Q4_1: {
        const u8* b = row + (i / QK) * 20;
        int j = i % QK;
        u8 byte = b[4 + (j & 15)];
        int q = j < 16 ? (byte & 15) : (byte >> 4);
        return (float)q * h2f(ld16(b)) + h2f(ld16(b + 2));
    }
    }
    return 0.0f;
}

// Slot (block * block_tokens + offset) of position p through a sequence's block table.
__device__ __forceinline__ u64 kv_slot(const u32* tbl, int p, int bt) {
    return (u64)tbl[p / bt] * bt + p % bt;
}
