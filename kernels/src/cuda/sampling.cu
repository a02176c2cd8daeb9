// Logits processing on the device, so that only a token id (greedy) or k candidates
// (top-k / top-p sampling, finished on the host with the request's RNG) leave the GPU.

// Greedy: index of the largest logit of each row (the lowest index on ties, like
// sampling::argmax). One block per row, blockDim a multiple of 32 up to 1024.
extern "C" __global__ void tandem_argmax(const float* logits, int vocab, u32* out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* x = logits + (u64)blockIdx.x * vocab;
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
        out[blockIdx.x] = idx < vocab ? (u32)idx : 0u;
    }
}

// Order-preserving map of f32 to u32 (larger float -> larger key).
__device__ __forceinline__ u32 f2key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key2f(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

#define TOPK_MAX 256

// Top-k of each row, sorted by value descending (lowest index first on ties): a radix
// select finds the k-th largest key in four 8-bit passes over the row, the keys above it
// and the lowest-index ties are compacted, and a bitonic sort orders the k candidates.
// One block of 1024 threads per row; 1 <= k <= min(TOPK_MAX, vocab).
extern "C" __global__ void tandem_topk(const float* logits, int vocab, int k, float* out_val,
                                       u32* out_idx) {
    __shared__ u32 hist[256];
    __shared__ u32 ckey[TOPK_MAX];
    __shared__ u32 cidx[TOPK_MAX];
    __shared__ u32 sel_digit, sel_rest, n_above;
    const float* x = logits + (u64)blockIdx.x * vocab;
    const int tid = threadIdx.x;
    u32 prefix = 0, mask = 0;
    u32 rest = (u32)k;  // how many still to find among keys matching `prefix`
    for (int pass = 0; pass < 4; pass++) {
        int shift = 24 - 8 * pass;
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = tid; i < vocab; i += blockDim.x) {
            u32 key = f2key(x[i]);
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
        __syncthreads();  // sel_* are rewritten by the next pass
    }
    // prefix is now the k-th largest key; `rest` keys equal to it are needed.
    if (tid == 0) n_above = 0;
    for (int i = tid; i < TOPK_MAX; i += blockDim.x) {
        ckey[i] = 0;  // sorts after every real key (the smallest one, -NaN, aside)
        cidx[i] = 0xffffffffu;
    }
    __syncthreads();
    for (int i = tid; i < vocab; i += blockDim.x) {
        u32 key = f2key(x[i]);
        if (key > prefix) {
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
            bool eq = i < vocab && f2key(x[i]) == prefix;
            u32 bal = __ballot_sync(0xffffffffu, eq);
            u32 rank = __popc(bal & ((1u << tid) - 1u));
            if (eq && taken + rank < rest) {
                ckey[base + taken + rank] = prefix;
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
    for (int i = tid; i < k; i += blockDim.x) {
        out_val[(u64)blockIdx.x * k + i] = key2f(ckey[i]);
        out_idx[(u64)blockIdx.x * k + i] = cidx[i];
    }
}
