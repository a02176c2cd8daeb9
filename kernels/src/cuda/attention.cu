// Causal attention over the paged KV pool, scale 1 / sqrt(head_dim), GQA: query head h
// reads KV head h / (n_heads / n_kv_heads).
//
// Pool layout (one layer's K or V, identical to the CPU PagedKvCache):
//   byte offset of (position p of a sequence, KV head g) =
//     (table[p / block_tokens] * block_tokens + p % block_tokens) * row_bytes + g * head_bytes
//   where a row is one token's n_kv_heads * head_dim values stored as `ty` (F32/F16/Q8_0).
// tables: all sequences' block tables concatenated; tbl_off[q] is where query q's starts.
// q, out: [n_queries][n_heads][head_dim] f32. n_ctx[q]: positions 0..n_ctx[q] are visible,
// or with a sliding window (window > 0) only the last `window` of them:
// max(0, n_ctx[q] - window)..n_ctx[q] (llama.cpp's standard SWA mask).
//
// Both kernels use the online ("flash") softmax: scores are consumed 32 positions at a
// time, lane j scoring position t0 + j, keeping a running max m, normaliser l and the
// rescaled output accumulator, so no kernel ever holds a whole row of scores.
// head_dim <= 256 (each lane owns head_dim / 32 <= 8 output dims).

#define ATT_MAX_DPL 8

// q (shared memory, f32) . one stored head row.
__device__ __forceinline__ float dot_head(const float* q, const u8* k, int ty, int hd) {
    float s = 0.0f;
    if (ty == T_F16) {
        const u32* k2 = (const u32*)k;  // head_bytes = 2 * hd with hd even: 4-byte aligned
        for (int d = 0; d < hd / 2; d++) {
            u32 w = k2[d];
            s += q[2 * d] * h2f((u16)(w & 0xffff)) + q[2 * d + 1] * h2f((u16)(w >> 16));
        }
    } else if (ty == T_F32) {
        const float* kf = (const float*)k;
        for (int d = 0; d < hd; d++) s += q[d] * kf[d];
    } else {
        for (int d = 0; d < hd; d++) s += q[d] * load_elem(k, ty, d);
    }
    return s;
}

// One warp per (query, head); blockDim = 128 (4 heads of one query), grid = (ceil(n_heads
// / 4), n_sel). qsel lists which queries this launch handles (the single-token ones).
// Dynamic shared memory: 4 * head_dim floats.
extern "C" __global__ void tandem_attn_decode(const float* q, float* out, const int* qsel,
                                              const int* n_ctx, const int* tbl_off,
                                              const u32* tables, const u8* kpool,
                                              const u8* vpool, int ty, int row_bytes,
                                              int head_bytes, int bt, int n_heads,
                                              int n_kv_heads, int hd, float scale,
                                              int window) {
    TANDEM_DYNAMIC_SMEM(float, att_smem);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int h = blockIdx.x * 4 + warp;
    if (h >= n_heads) return;  // no block-wide barrier below: only __syncwarp
    int qi = qsel[blockIdx.y];
    float* qs = att_smem + warp * hd;
    const float* qg = q + ((u64)qi * n_heads + h) * hd;
    for (int d = lane; d < hd; d += 32) qs[d] = qg[d];
    __syncwarp();
    int g = h / (n_heads / n_kv_heads);
    int n = n_ctx[qi];
    const u32* tbl = tables + tbl_off[qi];
    float m = NEG_INF, l = 0.0f;
    float acc[ATT_MAX_DPL];
#pragma unroll
    for (int i = 0; i < ATT_MAX_DPL; i++) acc[i] = 0.0f;
    int lo = window > 0 ? max(0, n - window) : 0;
    for (int t0 = lo; t0 < n; t0 += 32) {
        int t = t0 + lane;
        float s = NEG_INF;
        if (t < n) s = dot_head(qs, kpool + kv_slot(tbl, t, bt) * row_bytes + (u64)g * head_bytes, ty, hd) * scale;
        float m_new = fmaxf(m, warp_max(s));  // finite: position t0 is always valid
        float p = t < n ? expf(s - m_new) : 0.0f;
        float alpha = expf(m - m_new);
        l = l * alpha + warp_sum(p);
#pragma unroll
        for (int i = 0; i < ATT_MAX_DPL; i++) acc[i] *= alpha;
        int cnt = min(32, n - t0);
        for (int j = 0; j < cnt; j++) {
            float pj = __shfl_sync(0xffffffffu, p, j);
            const u8* vr = vpool + kv_slot(tbl, t0 + j, bt) * row_bytes + (u64)g * head_bytes;
#pragma unroll
            for (int i = 0; i < ATT_MAX_DPL; i++) {
                int d = lane + 32 * i;
                if (d < hd) acc[i] += pj * load_elem(vr, ty, d);
            }
        }
        m = m_new;
    }
    float* o = out + ((u64)qi * n_heads + h) * hd;
    float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < ATT_MAX_DPL; i++) {
        int d = lane + 32 * i;
        if (d < hd) o[d] = acc[i] * inv;
    }
}

// Prefill: a tile is up to 16 consecutive query tokens of one sequence (tiles[3 * i] =
// first query index, [3 * i + 1] = count, [3 * i + 2] = table offset). grid = (n_heads,
// n_tiles), blockDim = 128: warp w owns queries 4w..4w+3 of the tile. K and V of `bk`
// positions at a time are dequantized once into shared memory and reused by all 16
// queries. Dynamic shared memory: (16 * (hd + 1) + bk * (hd + 1) + bk * hd) floats.
#define PF_Q 16
extern "C" __global__ void tandem_attn_prefill(const float* q, float* out, const int* tiles,
                                               const int* n_ctx, const u32* tables,
                                               const u8* kpool, const u8* vpool, int ty,
                                               int row_bytes, int head_bytes, int bt,
                                               int n_heads, int n_kv_heads, int hd, float scale,
                                               int bk, int window) {
    TANDEM_DYNAMIC_SMEM(float, att_smem);
    const int hp = hd + 1;  // padded rows: lane j reading row j hits bank (j + d) % 32
    float* Qs = att_smem;
    float* Ks = Qs + PF_Q * hp;
    float* Vs = Ks + bk * hp;
    int h = blockIdx.x, tile = blockIdx.y;
    int q0 = tiles[3 * tile], nq = tiles[3 * tile + 1];
    const u32* tbl = tables + tiles[3 * tile + 2];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = h / (n_heads / n_kv_heads);
    for (int idx = threadIdx.x; idx < PF_Q * hd; idx += blockDim.x) {
        int r = idx / hd, d = idx % hd;
        Qs[r * hp + d] = r < nq ? q[((u64)(q0 + r) * n_heads + h) * hd + d] : 0.0f;
    }
    int max_ctx = 0, min_lo = 1 << 30;
    for (int r = 0; r < nq; r++) {
        int n = n_ctx[q0 + r];
        max_ctx = max(max_ctx, n);
        min_lo = min(min_lo, window > 0 ? max(0, n - window) : 0);
    }
    float m[4], l[4], acc[4][ATT_MAX_DPL];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        m[r] = NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < ATT_MAX_DPL; i++) acc[r][i] = 0.0f;
    }
    // Chunks start where the tile's earliest window does (block-uniform: every thread
    // takes every barrier below).
    for (int k0 = min_lo / bk * bk; k0 < max_ctx; k0 += bk) {
        __syncthreads();  // previous tile fully consumed (and Qs written, first time)
        for (int idx = threadIdx.x; idx < bk * hd; idx += blockDim.x) {
            int j = idx / hd, d = idx % hd, t = k0 + j;
            float kv = 0.0f, vv = 0.0f;
            if (t < max_ctx) {
                u64 off = kv_slot(tbl, t, bt) * row_bytes + (u64)g * head_bytes;
                kv = load_elem(kpool + off, ty, d);
                vv = load_elem(vpool + off, ty, d);
            }
            Ks[j * hp + d] = kv;
            Vs[j * hd + d] = vv;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int qr = warp * 4 + r;
            if (qr >= nq) continue;  // uniform per warp
            int n = n_ctx[q0 + qr];
            int lo = window > 0 ? max(0, n - window) : 0;
            if (k0 >= n || k0 + bk <= lo) continue;  // no visible position in this chunk
            int t = k0 + lane;
            bool seen = lane < bk && t < n && t >= lo;
            float s = NEG_INF;
            if (seen) {
                const float* qv = Qs + qr * hp;
                const float* kr = Ks + lane * hp;
                float a = 0.0f;
                for (int d = 0; d < hd; d++) a += qv[d] * kr[d];
                s = a * scale;
            }
            float m_new = fmaxf(m[r], warp_max(s));
            float p = seen ? expf(s - m_new) : 0.0f;
            float alpha = expf(m[r] - m_new);
            l[r] = l[r] * alpha + warp_sum(p);
            int cnt = min(bk, n - k0);
#pragma unroll
            for (int i = 0; i < ATT_MAX_DPL; i++) acc[r][i] *= alpha;
            for (int j = 0; j < cnt; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int i = 0; i < ATT_MAX_DPL; i++) {
                    int d = lane + 32 * i;
                    if (d < hd) acc[r][i] += pj * Vs[j * hd + d];
                }
            }
            m[r] = m_new;
        }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int qr = warp * 4 + r;
        if (qr >= nq) continue;
        float* o = out + ((u64)(q0 + qr) * n_heads + h) * hd;
        float inv = 1.0f / l[r];
#pragma unroll
        for (int i = 0; i < ATT_MAX_DPL; i++) {
            int d = lane + 32 * i;
            if (d < hd) o[d] = acc[r][i] * inv;
        }
    }
}
