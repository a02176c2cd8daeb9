// Logits processing on the device, so that only token ids leave the GPU: greedy (argmax),
// top-k candidates, and full sampling (temperature, top-k, top-p) with a uniform random
// number per row drawn on the host from the request's seeded RNG.

// Greedy over one row: index of the largest logit (the lowest index on ties, like
// sampling::argmax). Called by the whole block (blockDim a multiple of 32, at most
// 1024); the result is valid in thread 0.
__device__ u32 row_argmax(const float* x, int vocab) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    float best = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = x[i];
        if (v > best) {  // strided scan: first hit per thread is its lowest index
            best = v;
            idx = i;
        }
    }
    if (idx == 0x7fffffff) idx = vocab;  // only NaN / -inf seen: never chosen over a value
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, best, o);
        int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
        if (v2 > best || (v2 == best && i2 < idx)) {
            best = v2;
            idx = i2;
        }
    }
    __syncthreads();  // bv / bi may still be read by a previous call
    if (lane == 0) {
        bv[warp] = best;
        bi[warp] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (bv[w] > best || (bv[w] == best && bi[w] < idx)) {
                best = bv[w];
                idx = bi[w];
            }
    }
    return idx < vocab ? (u32)idx : 0u;
}

// Greedy token of each row. One block per row.
extern "C" __global__ void tandem_argmax(const float* logits, int vocab, u32* out) {
    u32 r = row_argmax(logits + (u64)blockIdx.x * vocab, vocab);
    if (threadIdx.x == 0) out[blockIdx.x] = r;
}

// Order-preserving map of f32 to u32 (larger float -> larger key; -0 below +0, like
// f32::total_cmp).
__device__ __forceinline__ u32 f2key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key2f(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

#define TOPK_MAX 256

// The sort key of element i. SCALED = false: the raw logit (top-k). SCALED = true: the
// logit times 1 / temperature, the value the host sampler sorts, and 0 for a non-finite
// logit (below every finite one: the host drops them).
template <bool SCALED>
__device__ __forceinline__ u32 elem_key(const float* x, int i, float inv_t) {
    float v = x[i];
    if (!SCALED) return f2key(v);
    return isfinite(v) ? f2key(v * inv_t) : 0u;
}

// Radix select of the k-th largest key of a row (1 <= k <= vocab) in four 8-bit passes.
// Called by the whole block; every thread gets the key (*kth) and how many of the
// entries equal to it belong to the top k (*rest, the rest being strictly above).
template <bool SCALED>
__device__ void radix_select(const float* x, int vocab, float inv_t, u32 k, u32* kth,
                             u32* rest_out) {
    __shared__ u32 hist[256];
    __shared__ u32 sel_digit, sel_rest;
    const int tid = threadIdx.x;
    u32 prefix = 0, mask = 0;
    u32 rest = k;  // how many still to find among keys matching `prefix`
    for (int pass = 0; pass < 4; pass++) {
        int shift = 24 - 8 * pass;
        __syncthreads();  // hist / sel_* may still be read (previous pass or call)
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = tid; i < vocab; i += blockDim.x) {
            u32 key = elem_key<SCALED>(x, i, inv_t);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 cum = 0;
            int dsel = 0;
            for (int dg = 255; dg >= 0; dg--) {
                if (cum + hist[dg] >= rest) {
                    dsel = dg;
                    break;
                }
                cum += hist[dg];
            }
            sel_digit = (u32)dsel;
            sel_rest = rest - cum;
        }
        __syncthreads();
        prefix |= sel_digit << shift;
        mask |= 255u << shift;
        rest = sel_rest;
    }
    *kth = prefix;
    *rest_out = rest;
}

// The top k (<= TOPK_MAX) entries of a row, given radix_select's (kth, rest): the keys
// above kth and the `rest` lowest-index entries equal to it, sorted by key descending,
// index ascending (a bitonic sort over TOPK_MAX slots; unused slots sort last).
template <bool SCALED>
__device__ void collect_sorted(const float* x, int vocab, float inv_t, u32 kth, u32 rest,
                               u32* ckey, u32* cidx) {
    __shared__ u32 n_above;
    const int tid = threadIdx.x;
    __syncthreads();  // ckey / cidx / n_above may still be read by the caller
    if (tid == 0) n_above = 0;
    for (int i = tid; i < TOPK_MAX; i += blockDim.x) {
        ckey[i] = 0;  // sorts after every real key (the smallest one, -NaN, aside)
        cidx[i] = 0xffffffffu;
    }
    __syncthreads();
    for (int i = tid; i < vocab; i += blockDim.x) {
        u32 key = elem_key<SCALED>(x, i, inv_t);
        if (key > kth) {
            u32 at = atomicAdd(&n_above, 1u);
            ckey[at] = key;
            cidx[at] = (u32)i;
        }
    }
    __syncthreads();
    if (tid < 32) {
        // Ties at the threshold: the lowest indices, found in index order by one warp.
        u32 base = n_above, taken = 0;
        for (int c0 = 0; c0 < vocab && taken < rest; c0 += 32) {
            int i = c0 + tid;
            bool eq = i < vocab && elem_key<SCALED>(x, i, inv_t) == kth;
            u32 bal = __ballot_sync(0xffffffffu, eq);
            u32 rank = __popc(bal & ((1u << tid) - 1u));
            if (eq && taken + rank < rest) {
                ckey[base + taken + rank] = kth;
                cidx[base + taken + rank] = (u32)i;
            }
            taken += __popc(bal);
        }
    }
    __syncthreads();
    // Bitonic sort of TOPK_MAX entries: key descending, index ascending.
    for (int size = 2; size <= TOPK_MAX; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < TOPK_MAX; i += blockDim.x) {
                int j = i ^ stride;
                if (j > i) {
                    bool desc = (i & size) == 0;
                    u32 ki = ckey[i], kj = ckey[j], ii = cidx[i], ij = cidx[j];
                    bool i_first = ki > kj || (ki == kj && ii < ij);
                    if (desc != i_first) {
                        ckey[i] = kj;
                        ckey[j] = ki;
                        cidx[i] = ij;
                        cidx[j] = ii;
                    }
                }
            }
            __syncthreads();
        }
    }
}

// Top-k of each row, sorted by value descending (lowest index first on ties): a radix
// select finds the k-th largest key, the keys above it and the lowest-index ties are
// compacted, and a bitonic sort orders the k candidates.
// One block of 1024 threads per row; 1 <= k <= min(TOPK_MAX, vocab).
extern "C" __global__ void tandem_topk(const float* logits, int vocab, int k, float* out_val,
                                       u32* out_idx) {
    __shared__ u32 ckey[TOPK_MAX];
    __shared__ u32 cidx[TOPK_MAX];
    const float* x = logits + (u64)blockIdx.x * vocab;
    u32 kth, rest;
    radix_select<false>(x, vocab, 1.0f, (u32)k, &kth, &rest);
    collect_sorted<false>(x, vocab, 1.0f, kth, rest, ckey, cidx);
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        out_val[(u64)blockIdx.x * k + i] = key2f(ckey[i]);
        out_idx[(u64)blockIdx.x * k + i] = cidx[i];
    }
}

// Sum over the block of a u32 per thread; every thread gets it.
__device__ u32 block_usum(u32 v) {
    __shared__ u32 upart[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) upart[warp] = v;
    __syncthreads();
    v = lane < nw ? upart[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Candidates of the device sampler: at most this many (the top ones) per row.
#define SAMPLE_CAP TOPK_MAX
// Written for a row the device cannot decide exactly; the host finishes it.
#define SAMPLE_DEFER 0xffffffffu

// Sampling, with the semantics of the host sampler (dataplane sampling.rs) step by step:
// greedy when 1/T <= 0; else over the finite logits scaled by 1/T, keep the top_k (0 =
// all) largest (ties by lowest index), sort them descending, p_i = exp(l_i - max) / sum,
// keep the smallest prefix whose cumulated p reaches top_p (if top_p < 1), and walk the
// kept p_i with r = u * (their sum): the first i with r < p_i (r -= p_i otherwise), else
// the last kept one.
// Only the SAMPLE_CAP largest candidates are materialised. The normaliser always covers
// the host's whole candidate set (a second selection finds its edge when top_k is larger
// than the cap). When the decision needs a candidate past the cap (the top_p prefix is
// not reached within it, or the walk with top_p = 1 passes it) or no logit is finite,
// the row's token is SAMPLE_DEFER and the host samples that row from its logits with the
// same u: so results equal the host's except for float rounding (expf and summation
// order), which can only matter when u lies within ~1e-6 of a boundary.
// params: per row 4 words (launch::SampleRow): f32 bits of 1/T, top_k, f32 bits of top_p,
// f32 bits of u in [0, 1). One block of 1024 threads per row.
extern "C" __global__ void tandem_sample(const float* logits, int vocab, const u32* params,
                                         u32* out) {
    __shared__ u32 ckey[SAMPLE_CAP];
    __shared__ u32 cidx[SAMPLE_CAP];
    __shared__ float prob[SAMPLE_CAP];
    const int tid = threadIdx.x;
    const float* x = logits + (u64)blockIdx.x * vocab;
    const u32* p = params + 4 * (u64)blockIdx.x;
    const float inv_t = __uint_as_float(p[0]);
    const u32 top_k = p[1];
    const float top_p = __uint_as_float(p[2]);
    const float u = __uint_as_float(p[3]);
    // Every branch below depends on values all threads of the block share, so the
    // barriers inside the helpers are reached by the whole block.
    if (!(inv_t > 0.0f)) {
        u32 r = row_argmax(x, vocab);
        if (tid == 0) out[blockIdx.x] = r;
        return;
    }
    u32 fin = 0;
    for (int i = tid; i < vocab; i += blockDim.x) fin += isfinite(x[i]) ? 1u : 0u;
    const u32 n_fin = block_usum(fin);
    if (n_fin == 0) {
        if (tid == 0) out[blockIdx.x] = SAMPLE_DEFER;
        return;
    }
    const u32 k_eff = (top_k > 0 && top_k < n_fin) ? top_k : n_fin;
    const u32 kc = min(k_eff, (u32)SAMPLE_CAP);
    u32 kth, rest;
    radix_select<true>(x, vocab, inv_t, kc, &kth, &rest);
    collect_sorted<true>(x, vocab, inv_t, kth, rest, ckey, cidx);
    const float m = key2f(ckey[0]);
    // Normaliser over the host's candidate set when it is wider than the cap.
    float zwide = 0.0f;
    if (k_eff > kc) {
        u32 edge = 0, edge_rest = 0;
        if (k_eff < n_fin) radix_select<true>(x, vocab, inv_t, k_eff, &edge, &edge_rest);
        float s = 0.0f;
        for (int i = tid; i < vocab; i += blockDim.x) {
            u32 key = elem_key<true>(x, i, inv_t);
            if (key > edge) s += expf(key2f(key) - m);
        }
        s = block_sum(s);
        if (edge_rest > 0) s += (float)edge_rest * expf(key2f(edge) - m);
        zwide = s;
    }
    if (tid != 0) return;
    // One thread, in the host's order, for the same f32 sums.
    float z = 0.0f;
    for (u32 i = 0; i < kc; i++) {
        prob[i] = expf(key2f(ckey[i]) - m);
        z += prob[i];
    }
    if (k_eff > kc) z = zwide;
    for (u32 i = 0; i < kc; i++) prob[i] /= z;
    u32 keep = k_eff;  // may lie past the cap (top_p >= 1, wide set)
    if (top_p < 1.0f) {
        float acc = 0.0f;
        keep = 0;
        for (u32 i = 0; i < kc; i++) {
            acc += prob[i];
            if (acc >= top_p) {
                keep = i + 1;
                break;
            }
        }
        if (keep == 0) {
            if (kc < k_eff) {
                out[blockIdx.x] = SAMPLE_DEFER;  // the prefix ends past the cap
                return;
            }
            keep = kc;
        }
    }
    if (keep <= kc) {
        float total = 0.0f;
        for (u32 i = 0; i < keep; i++) total += prob[i];
        float r = u * total;
        for (u32 i = 0; i < keep; i++) {
            if (r < prob[i]) {
                out[blockIdx.x] = cidx[i];
                return;
            }
            r -= prob[i];
        }
        out[blockIdx.x] = cidx[keep - 1];
        return;
    }
    // Every candidate is kept and they sum to 1 (the host's sum, up to rounding).
    float r = u;
    for (u32 i = 0; i < kc; i++) {
        if (r < prob[i]) {
            out[blockIdx.x] = cidx[i];
            return;
        }
        r -= prob[i];
    }
    out[blockIdx.x] = SAMPLE_DEFER;  // in the tail past the cap
}
