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
//   Q5_0 22 bytes / 32: f16 d, u32 qh, 16 B nibbles   value = (q - 16) * d, q = nib | bit << 4
//   Q5_1 24 bytes / 32: f16 d, f16 m, u32 qh, nibbles value = q * d + m
//   Nibbles: byte j holds element j (low) and element j + 16 (high); bit j of qh is bit 4
//   of element j's code.
//   K-quants, 256 elements (types.rs has the bit positions):
//   Q4_K 144 B: f16 d, f16 dmin, 12 B 6-bit scales/mins, 128 B nibbles
//               value = d * sc_j * q - dmin * m_j (sub-block j of 32)
//   Q5_K 176 B: as Q4_K with 32 B qh before the nibbles (bit j of qh[i]: element 32j + i)
//   Q6_K 210 B: 128 B ql, 64 B qh, 16 x i8 scales, f16 d; value = d * sc_s * (q - 32)
//   BlockQ8 (activations, 40 bytes): f32 d, f32 s = d * sum(q), 32 x i8 — quant::BlockQ8.
//   BlockQ8K (K-quant activations, 292 bytes): f32 d, 256 x i8, 16 x i16 sums of 16 codes
//   — quant::BlockQ8K.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;
typedef long long i64;
typedef unsigned long long u64;

#define QK 32
#define QK_K 256
// GGML type ids, as in types.rs.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_BF16 30

#define NEG_INF __int_as_float(0xff800000)

struct BlockQ8 {
    float d;
    float s;
    int qs[8];
};

struct BlockQ8K {
    float d;
    int qs[64];
    short bsums[16];
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

// The 6-bit scale and min of sub-block j (0..8) of a Q4_K / Q5_K super-block from its 12
// scale bytes `s` (quant::kquant_scales).
__device__ __forceinline__ void kquant_scale(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Element i of a row stored as `ty` (embedding rows, KV rows and heads), with the
// rounding steps of quant::dequantize_row (`__f*_rn`: never contracted into an fma).
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
        return __fadd_rn(__fmul_rn((float)q, h2f(ld16(b))), h2f(ld16(b + 2)));
    }
    case T_Q5_0:
    case T_Q5_1: {
        const int m = ty == T_Q5_1;
        const u8* b = row + (i / QK) * (22 + 2 * m);
        int j = i % QK;
        u32 qh = (u32)ld16(b + 2 + 2 * m) | ((u32)ld16(b + 4 + 2 * m) << 16);
        u8 byte = b[6 + 2 * m + (j & 15)];
        int q = (j < 16 ? (byte & 15) : (byte >> 4)) | (((qh >> j) & 1) << 4);
        return m ? __fadd_rn(__fmul_rn((float)q, h2f(ld16(b))), h2f(ld16(b + 2)))
                 : (float)(q - 16) * h2f(ld16(b));
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int five = ty == T_Q5_K;
        const u8* b = row + (i / QK_K) * (five ? 176 : 144);
        int e = i % QK_K, j = e / 32;
        int sc, m;
        kquant_scale(b + 4, j, &sc, &m);
        const u8* qs = b + (five ? 48 : 16);
        u8 byte = qs[e / 64 * 32 + e % 32];
        int q = (j & 1) ? (byte >> 4) : (byte & 15);
        if (five) q |= ((b[16 + e % 32] >> j) & 1) << 4;
        return __fsub_rn(__fmul_rn(__fmul_rn(h2f(ld16(b)), (float)sc), (float)q),
                         __fmul_rn(h2f(ld16(b + 2)), (float)m));
    }
    case T_Q6_K: {
        const u8* b = row + (i / QK_K) * 210;
        int e = i % QK_K, h = e / 128, k = e % 128 / 32, l = e % 32;
        u8 byte = b[64 * h + l + 32 * (k & 1)];
        int q = (k < 2 ? (byte & 15) : (byte >> 4)) | (((b[128 + 32 * h + l] >> (2 * k)) & 3) << 4);
        return __fmul_rn(__fmul_rn(h2f(ld16(b + 208)), (float)(i8)b[192 + e / 16]), (float)(q - 32));
    }
    }
    return 0.0f;
}

// Slot (block * block_tokens + offset) of position p through a sequence's block table.
__device__ __forceinline__ u64 kv_slot(const u32* tbl, int p, int bt) {
    return (u64)tbl[p / bt] * bt + p % bt;
}
