// Matrix products out[t][r] = sum_c W[r][c] * x[t][c] with the weights as stored in GGUF.
//
// Quantized weights multiply activations quantized to i8 blocks (see elementwise.cu), as
// the CPU backends do: BlockQ8 for the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
// BlockQ8K for the K-quants (Q4_K, Q5_K, Q6_K). Per 32-element (sub-)block an exact
// integer dot product (dp4a), then (d_w * d_x) * sumi, plus m_w * s_x for Q4_1 / Q5_1;
// a K-quant sub-block has the float scale d * sc_j (Q6_K: one per 16 elements) and the
// offset -dmin * m_j times d_x * (sum of its 32 activation codes, from BlockQ8K.bsums).
// Dequantization is fused: the codes are unpacked into int8 lanes in registers or shared
// memory and never written back as floats. Sums run in another order than on the CPU,
// so results agree with the CPU reference to rounding, not bit for bit.
//
//   mmvq_*: few tokens (decode). One warp per weight row; lane l reads blocks l, l+32, ...
//           so a warp's loads of a row are contiguous (coalesced). Up to MMV_T tokens per
//           launch row (grid.y covers more), so each weight block is read once per MMV_T;
//           the per-lane sums are reduced with as few shuffles as the token count allows
//           (store_row_sums).
//   mmq_*:  many tokens (prefill). 64 rows x 64 tokens per 256-thread block; 4 weight
//           blocks per stage staged through shared memory as int8 (thread t loads block
//           t % 4 of row t / 4: neighbouring threads read neighbouring bytes).
//   mmv_float: F32 / F16 / BF16 weights against f32 activations.

#define MMV_T 8
static_assert(MMV_T == 8, "store_row_sums transposes exactly 8 sums");
#define MQ_R 64
#define MQ_T 64
#define MQ_K 4

// Unpack one weight block into 8 words of 4 signed int8 each (word k = elements 4k..4k+3),
// the same element order as BlockQ8::qs, plus its scale d and (Q4_1) offset m.
template <int TY>
__device__ __forceinline__ void load_wblock(const u8* b, int* wq, float* d, float* m) {
    if (TY == T_Q5_0 || TY == T_Q5_1) {
        const int off = TY == T_Q5_1 ? 2 : 0;
        *d = h2f(ld16(b));
        *m = TY == T_Q5_1 ? h2f(ld16(b + 2)) : 0.0f;
        u32 qh = (u32)ld32_b2(b + 2 + off);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int w = ld32_b2(b + 6 + off + 4 * k);
            int lo = w & 0x0f0f0f0f, hi = (w >> 4) & 0x0f0f0f0f;
            // Bit 4 of elements 4k..4k+3 (low) and 16+4k.. (high) from qh, one per byte.
            u32 bl = (qh >> (4 * k)) & 15, bh = (qh >> (16 + 4 * k)) & 15;
            lo |= (int)(((bl & 1) | ((bl & 2) << 7) | ((bl & 4) << 14) | ((bl & 8) << 21)) << 4);
            hi |= (int)(((bh & 1) | ((bh & 2) << 7) | ((bh & 4) << 14) | ((bh & 8) << 21)) << 4);
            if (TY == T_Q5_0) {
                // q - 16 per byte; the result fits a signed byte, so the wrap is exact.
                lo = __vsub4(lo, 0x10101010);
                hi = __vsub4(hi, 0x10101010);
            }
            wq[k] = lo;
            wq[4 + k] = hi;
        }
    } else if (TY == T_Q8_0) {
        *d = h2f(ld16(b));
        *m = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) wq[k] = ld32_b2(b + 2 + 4 * k);
    } else {
        const int off = TY == T_Q4_1 ? 4 : 2;
        *d = h2f(ld16(b));
        *m = TY == T_Q4_1 ? h2f(ld16(b + 2)) : 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int w = ld32_b2(b + off + 4 * k);
            int lo = w & 0x0f0f0f0f, hi = (w >> 4) & 0x0f0f0f0f;
            if (TY == T_Q4_0) {
                // q - 8 per byte; the result fits a signed byte, so the wrap is exact.
                lo = __vsub4(lo, 0x08080808);
                hi = __vsub4(hi, 0x08080808);
            }
            wq[k] = lo;
            wq[4 + k] = hi;
        }
    }
}

template <int TY>
__device__ __forceinline__ int block_bytes() {
    return TY == T_Q8_0 ? 34 : TY == T_Q4_1 ? 20 : TY == T_Q5_0 ? 22 : TY == T_Q5_1 ? 24 : 18;
}

// Whether the format has an offset m (value = q * d + m) against BlockQ8.s.
template <int TY>
__device__ __forceinline__ bool has_m() {
    return TY == T_Q4_1 || TY == T_Q5_1;
}

// The warp's sums of acc[t] (one partial sum per lane) into out[t * rows] for t < nt; nt
// is the same for the whole warp. One or two tokens: a butterfly per token (5 shuffles
// each). More: one transposing butterfly for all MMV_T (9 shuffles instead of 40): at
// offset 16 each half of the warp keeps four of the sums and hands its partner the other
// four, at 8 two, at 4 one; lane l then holds token (l >> 2) & 7, and offsets 2 and 1
// finish the sum.
__device__ __forceinline__ void store_row_sums(const float* acc, int nt, int lane, float* out, int rows) {
    if (nt <= 2) {
#pragma unroll
        for (int t = 0; t < 2; t++) {
            if (t < nt) {
                float v = warp_sum(acc[t]);
                if (lane == 0) out[(u64)t * rows] = v;
            }
        }
        return;
    }
    float s4[4], s2[2];
    const bool h16 = lane & 16, h8 = lane & 8, h4 = lane & 4;
#pragma unroll
    for (int i = 0; i < 4; i++)
        s4[i] = (h16 ? acc[i + 4] : acc[i]) + __shfl_xor_sync(0xffffffffu, h16 ? acc[i] : acc[i + 4], 16);
#pragma unroll
    for (int i = 0; i < 2; i++)
        s2[i] = (h8 ? s4[i + 2] : s4[i]) + __shfl_xor_sync(0xffffffffu, h8 ? s4[i] : s4[i + 2], 8);
    float v = (h4 ? s2[1] : s2[0]) + __shfl_xor_sync(0xffffffffu, h4 ? s2[0] : s2[1], 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    const int t = (lane >> 2) & 7;
    if ((lane & 3) == 0 && t < nt) out[(u64)t * rows] = v;
}

template <int TY>
__device__ void mmvq(const u8* W, u64 row_bytes, int rows, int nb, const BlockQ8* X, int n_tok,
                     float* out) {
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * warps + (threadIdx.x >> 5);
    int t0 = blockIdx.y * MMV_T;
    if (row >= rows || t0 >= n_tok) return;
    int nt = min(MMV_T, n_tok - t0);
    float acc[MMV_T];
#pragma unroll
    for (int t = 0; t < MMV_T; t++) acc[t] = 0.0f;
    const u8* wr = W + (u64)row * row_bytes;
    for (int b = lane; b < nb; b += 32) {
        int wq[8];
        float d, m;
        load_wblock<TY>(wr + (u64)b * block_bytes<TY>(), wq, &d, &m);
#pragma unroll
        for (int t = 0; t < MMV_T; t++) {
            if (t < nt) {
                const BlockQ8* a = X + (u64)(t0 + t) * nb + b;
                int s = 0;
#pragma unroll
                for (int k = 0; k < 8; k++) s = __dp4a(wq[k], a->qs[k], s);
                acc[t] += (d * a->d) * (float)s;
                if (has_m<TY>()) acc[t] += m * a->s;
            }
        }
    }
    store_row_sums(acc, nt, lane, out + (u64)t0 * rows + row, rows);
}

template <int TY>
__device__ void mmq(const u8* W, u64 row_bytes, int rows, int nb, const BlockQ8* X, int n_tok,
                    float* out) {
    __shared__ int ws[MQ_R][MQ_K * 8 + 1];  // +1: rows land on different banks
    __shared__ float wd[MQ_R][MQ_K], wm[MQ_R][MQ_K];
    __shared__ int xs[MQ_T][MQ_K * 8 + 1];
    __shared__ float xd[MQ_T][MQ_K], xsum[MQ_T][MQ_K];
    const int tid = threadIdx.x;  // blockDim.x == 256
    const int r0 = blockIdx.x * MQ_R, t0 = blockIdx.y * MQ_T;
    const int tr = tid / 16, tt = tid % 16;  // this thread: rows tr + 16i, tokens tt + 16j
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    const int lr = tid / MQ_K, lk = tid % MQ_K;  // staging: row/token lr, block lk
    for (int k0 = 0; k0 < nb; k0 += MQ_K) {
        __syncthreads();
        {
            int r = r0 + lr, b = k0 + lk;
            int wq[8];
            float d = 0.0f, m = 0.0f;
            if (r < rows && b < nb) {
                load_wblock<TY>(W + (u64)r * row_bytes + (u64)b * block_bytes<TY>(), wq, &d, &m);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) wq[k] = 0;
            }
#pragma unroll
            for (int k = 0; k < 8; k++) ws[lr][lk * 8 + k] = wq[k];
            wd[lr][lk] = d;
            wm[lr][lk] = m;
            int t = t0 + lr;
            if (t < n_tok && b < nb) {
                const BlockQ8* a = X + (u64)t * nb + b;
#pragma unroll
                for (int k = 0; k < 8; k++) xs[lr][lk * 8 + k] = a->qs[k];
                xd[lr][lk] = a->d;
                xsum[lr][lk] = a->s;
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) xs[lr][lk * 8 + k] = 0;
                xd[lr][lk] = 0.0f;
                xsum[lr][lk] = 0.0f;
            }
        }
        __syncthreads();
#pragma unroll
        for (int kb = 0; kb < MQ_K; kb++) {
            int s[4][4];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) s[i][j] = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                int a[4], x[4];
#pragma unroll
                for (int i = 0; i < 4; i++) a[i] = ws[tr + 16 * i][kb * 8 + k];
#pragma unroll
                for (int j = 0; j < 4; j++) x[j] = xs[tt + 16 * j][kb * 8 + k];
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) s[i][j] = __dp4a(a[i], x[j], s[i][j]);
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    acc[i][j] += (wd[tr + 16 * i][kb] * xd[tt + 16 * j][kb]) * (float)s[i][j];
                    if (has_m<TY>()) acc[i][j] += wm[tr + 16 * i][kb] * xsum[tt + 16 * j][kb];
                }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = r0 + tr + 16 * i, t = t0 + tt + 16 * j;
            if (r < rows && t < n_tok) out[(u64)t * rows + r] = acc[i][j];
        }
}


// An entry point: weights of type TY against activation blocks ACT (BlockQ8 / BlockQ8K).
#define MM_ENTRY(name, fn, TY, ACT)                                                            \
    extern "C" __global__ void name(const u8* W, u64 row_bytes, int rows, int nb,             \
                                    const ACT* X, int n_tok, float* out) {                    \
        fn<TY>(W, row_bytes, rows, nb, X, n_tok, out);                                        \
    }

MM_ENTRY(tandem_mmvq_q4_0, mmvq, T_Q4_0, BlockQ8)
MM_ENTRY(tandem_mmvq_q4_1, mmvq, T_Q4_1, BlockQ8)
MM_ENTRY(tandem_mmvq_q5_0, mmvq, T_Q5_0, BlockQ8)
MM_ENTRY(tandem_mmvq_q5_1, mmvq, T_Q5_1, BlockQ8)
MM_ENTRY(tandem_mmvq_q8_0, mmvq, T_Q8_0, BlockQ8)
MM_ENTRY(tandem_mmq_q4_0, mmq, T_Q4_0, BlockQ8)
MM_ENTRY(tandem_mmq_q4_1, mmq, T_Q4_1, BlockQ8)
MM_ENTRY(tandem_mmq_q5_0, mmq, T_Q5_0, BlockQ8)
MM_ENTRY(tandem_mmq_q5_1, mmq, T_Q5_1, BlockQ8)
MM_ENTRY(tandem_mmq_q8_0, mmq, T_Q8_0, BlockQ8)

// ---- K-quants (BlockQ8K activations) ----

template <int TY>
__device__ __forceinline__ int kblock_bytes() {
    return TY == T_Q4_K ? 144 : TY == T_Q5_K ? 176 : 210;
}

// Sub-block j (0..8, 32 elements) of the K-quant super-block at `b`: its codes as 8 words
// of 4 int8 each in element order (Q6_K's q - 32 signed, Q4_K / Q5_K's unsigned q < 32),
// the float scales of its two 16-element halves (equal but for Q6_K) and its offset
// multiplier dmin * m_j (0 for Q6_K).
template <int TY>
__device__ __forceinline__ void load_ksub(const u8* b, int j, int* wq, float* dlo, float* dhi,
                                          float* m) {
    if (TY == T_Q6_K) {
        const int h = j >> 2, k = j & 3;
        const u8* ql = b + 64 * h + 32 * (k & 1);
        const u8* qh = b + 128 + 32 * h;
        const int shift = k >= 2 ? 4 : 0;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            int lo = (ld32_b2(ql + 4 * w) >> shift) & 0x0f0f0f0f;
            int hi = ((ld32_b2(qh + 4 * w) >> (2 * k)) & 0x03030303) << 4;
            wq[w] = __vsub4(lo | hi, 0x20202020);
        }
        const float d = h2f(ld16(b + 208));
        *dlo = d * (float)(i8)b[192 + 2 * j];
        *dhi = d * (float)(i8)b[193 + 2 * j];
        *m = 0.0f;
    } else {
        int sc, mn;
        kquant_scale(b + 4, j, &sc, &mn);
        *dlo = h2f(ld16(b)) * (float)sc;
        *dhi = *dlo;
        *m = h2f(ld16(b + 2)) * (float)mn;
        const u8* qs = b + (TY == T_Q5_K ? 48 : 16) + 32 * (j >> 1);
        const int shift = (j & 1) ? 4 : 0;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            int q = (ld32_b2(qs + 4 * w) >> shift) & 0x0f0f0f0f;
            if (TY == T_Q5_K) q |= ((ld32_b2(b + 16 + 4 * w) >> j) & 0x01010101) << 4;
            wq[w] = q;
        }
    }
}

// Sub-block j's part of one row times one token's super-block `a`.
template <int TY>
__device__ __forceinline__ float ksub_dot(const int* wq, float dlo, float dhi, float m,
                                          const BlockQ8K* a, int j) {
    int slo = 0, shi = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) slo = __dp4a(wq[k], a->qs[8 * j + k], slo);
#pragma unroll
    for (int k = 0; k < 4; k++) shi = __dp4a(wq[4 + k], a->qs[8 * j + 4 + k], shi);
    float v = (dlo * a->d) * (float)slo + (dhi * a->d) * (float)shi;
    if (TY != T_Q6_K) v -= (m * a->d) * (float)((int)a->bsums[2 * j] + (int)a->bsums[2 * j + 1]);
    return v;
}

// Few tokens: one warp per weight row, lane l takes sub-blocks l, l+32, ... (contiguous
// 32-element pieces of the row), up to MMV_T tokens per launch row.
template <int TY>
__device__ void mmvq_k(const u8* W, u64 row_bytes, int rows, int nb, const BlockQ8K* X,
                       int n_tok, float* out) {
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * warps + (threadIdx.x >> 5);
    int t0 = blockIdx.y * MMV_T;
    if (row >= rows || t0 >= n_tok) return;
    int nt = min(MMV_T, n_tok - t0);
    float acc[MMV_T];
#pragma unroll
    for (int t = 0; t < MMV_T; t++) acc[t] = 0.0f;
    const u8* wr = W + (u64)row * row_bytes;
    for (int sb = lane; sb < nb * 8; sb += 32) {
        const int b = sb >> 3, j = sb & 7;
        int wq[8];
        float dlo, dhi, m;
        load_ksub<TY>(wr + (u64)b * kblock_bytes<TY>(), j, wq, &dlo, &dhi, &m);
#pragma unroll
        for (int t = 0; t < MMV_T; t++) {
            if (t < nt) acc[t] += ksub_dot<TY>(wq, dlo, dhi, m, X + (u64)(t0 + t) * nb + b, j);
        }
    }
    // Only the nt sums there are (a butterfly of 5 shuffles per token reduced all MMV_T
    // of them: 40 shuffles for a single decode token).
    store_row_sums(acc, nt, lane, out + (u64)t0 * rows + row, rows);
}

// Many tokens: mmq's 64 x 64 tile, staging MQ_K sub-blocks of 32 per stage (thread t
// loads sub-block t % 4 of row / token t / 4).
template <int TY>
__device__ void mmq_k(const u8* W, u64 row_bytes, int rows, int nb, const BlockQ8K* X,
                      int n_tok, float* out) {
    __shared__ int ws[MQ_R][MQ_K * 8 + 1];
    __shared__ float wlo[MQ_R][MQ_K], whi[MQ_R][MQ_K], wm[MQ_R][MQ_K];
    __shared__ int xs[MQ_T][MQ_K * 8 + 1];
    __shared__ float xd[MQ_T][MQ_K], xsum[MQ_T][MQ_K];
    const int tid = threadIdx.x;  // blockDim.x == 256
    const int r0 = blockIdx.x * MQ_R, t0 = blockIdx.y * MQ_T;
    const int tr = tid / 16, tt = tid % 16;
    const int nsb = nb * 8;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    const int lr = tid / MQ_K, lk = tid % MQ_K;
    for (int k0 = 0; k0 < nsb; k0 += MQ_K) {
        __syncthreads();
        {
            const int r = r0 + lr, sb = k0 + lk, b = sb >> 3, j = sb & 7;
            int wq[8];
            float dlo = 0.0f, dhi = 0.0f, m = 0.0f;
            if (r < rows && sb < nsb) {
                load_ksub<TY>(W + (u64)r * row_bytes + (u64)b * kblock_bytes<TY>(), j, wq, &dlo,
                              &dhi, &m);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) wq[k] = 0;
            }
#pragma unroll
            for (int k = 0; k < 8; k++) ws[lr][lk * 8 + k] = wq[k];
            wlo[lr][lk] = dlo;
            whi[lr][lk] = dhi;
            wm[lr][lk] = m;
            const int t = t0 + lr;
            if (t < n_tok && sb < nsb) {
                const BlockQ8K* a = X + (u64)t * nb + b;
#pragma unroll
                for (int k = 0; k < 8; k++) xs[lr][lk * 8 + k] = a->qs[8 * j + k];
                xd[lr][lk] = a->d;
                xsum[lr][lk] = a->d * (float)((int)a->bsums[2 * j] + (int)a->bsums[2 * j + 1]);
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) xs[lr][lk * 8 + k] = 0;
                xd[lr][lk] = 0.0f;
                xsum[lr][lk] = 0.0f;
            }
        }
        __syncthreads();
#pragma unroll
        for (int kb = 0; kb < MQ_K; kb++) {
            int slo[4][4], shi[4][4];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) slo[i][j] = shi[i][j] = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                int a[4], x[4];
#pragma unroll
                for (int i = 0; i < 4; i++) a[i] = ws[tr + 16 * i][kb * 8 + k];
#pragma unroll
                for (int j = 0; j < 4; j++) x[j] = xs[tt + 16 * j][kb * 8 + k];
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        if (k < 4)
                            slo[i][j] = __dp4a(a[i], x[j], slo[i][j]);
                        else
                            shi[i][j] = __dp4a(a[i], x[j], shi[i][j]);
                    }
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int r = tr + 16 * i, t = tt + 16 * j;
                    acc[i][j] += (wlo[r][kb] * xd[t][kb]) * (float)slo[i][j] +
                                 (whi[r][kb] * xd[t][kb]) * (float)shi[i][j];
                    if (TY != T_Q6_K) acc[i][j] -= wm[r][kb] * xsum[t][kb];
                }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = r0 + tr + 16 * i, t = t0 + tt + 16 * j;
            if (r < rows && t < n_tok) out[(u64)t * rows + r] = acc[i][j];
        }
}

MM_ENTRY(tandem_mmvq_q4_k, mmvq_k, T_Q4_K, BlockQ8K)
MM_ENTRY(tandem_mmvq_q5_k, mmvq_k, T_Q5_K, BlockQ8K)
MM_ENTRY(tandem_mmvq_q6_k, mmvq_k, T_Q6_K, BlockQ8K)
MM_ENTRY(tandem_mmq_q4_k, mmq_k, T_Q4_K, BlockQ8K)
MM_ENTRY(tandem_mmq_q5_k, mmq_k, T_Q5_K, BlockQ8K)
MM_ENTRY(tandem_mmq_q6_k, mmq_k, T_Q6_K, BlockQ8K)

// Float weights: one warp per row, lanes stride over columns (coalesced), MMV_T tokens.
extern "C" __global__ void tandem_mmv_float(const u8* W, int ty, u64 row_bytes, int rows, int cols,
                                            const float* x, int n_tok, float* out) {
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * warps + (threadIdx.x >> 5);
    int t0 = blockIdx.y * MMV_T;
    if (row >= rows || t0 >= n_tok) return;
    int nt = min(MMV_T, n_tok - t0);
    float acc[MMV_T];
#pragma unroll
    for (int t = 0; t < MMV_T; t++) acc[t] = 0.0f;
    const u8* wr = W + (u64)row * row_bytes;
    for (int c = lane; c < cols; c += 32) {
        float w = load_elem(wr, ty, c);
#pragma unroll
        for (int t = 0; t < MMV_T; t++)
            if (t < nt) acc[t] += w * x[(u64)(t0 + t) * cols + c];
    }
    store_row_sums(acc, nt, lane, out + (u64)t0 * rows + row, rows);
}
