// Small element-wise kernels of the forward pass.

// gate = silu(gate) * up (SwiGLU); silu(x) = x / (1 + exp(-x)) as in the reference.
extern "C" __global__ void tandem_silu_mul(float* gate, const float* up, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate[i];
    gate[i] = g / (1.0f + expf(-g)) * up[i];
}

// gate = gelu(gate) * up (GeGLU), GELU's tanh approximation as in the reference:
// 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))).
extern "C" __global__ void tandem_gelu_mul(float* gate, const float* up, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate[i];
    gate[i] = 0.5f * g * (1.0f + tanhf(0.7978846f * g * (1.0f + 0.044715f * g * g))) * up[i];
}

// x[r][c] += bias[c] for rows of `width` (projection biases).
extern "C" __global__ void tandem_add_bias(float* x, const float* bias, u64 n, int width) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] += bias[i % (u64)width];
}

// x *= s (Gemma's embedding scale).
extern "C" __global__ void tandem_scale(float* x, float s, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] *= s;
}

// x += y (residual connections).
extern "C" __global__ void tandem_add(float* x, const float* y, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] += y[i];
}

// dst[r] = src[idx[r]] for rows of `dim` (the last token of each sequence that wants logits).
extern "C" __global__ void tandem_gather_rows(const float* src, const u32* idx, int n, int dim,
                                              float* dst) {
    int r = blockIdx.x;
    if (r >= n) return;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        dst[(u64)r * dim + i] = src[(u64)idx[r] * dim + i];
}

// Activations -> BlockQ8, one warp per 32-element block. Bit-identical to
// quant::quantize_act_row: d = amax / 127, id = 1 / d, q = rint(clamp(v * id, +-127)).
extern "C" __global__ void tandem_quantize_q8(const float* x, u64 n_blocks, BlockQ8* out) {
    u64 blk = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (blk >= n_blocks) return;  // whole warps leave together: blockDim is a multiple of 32
    float v = x[blk * QK + lane];
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q = __float2int_rn(fminf(fmaxf(v * id, -127.0f), 127.0f));
    int sum = warp_isum(q);
    ((i8*)out[blk].qs)[lane] = (i8)q;
    if (lane == 0) {
        out[blk].d = d;
        out[blk].s = d * (float)sum;
    }
}

// Activations -> BlockQ8K, one warp per 256-element super-block, lane l taking values
// 8l..8l+8. Bit-identical to quant::quantize_act_row_k: id = 127 / amax, d = 1 / id,
// q = rint(clamp(v * id, +-127)), bsums[k] = sum of codes 16k..16k+16 (lanes 2k, 2k+1).
extern "C" __global__ void tandem_quantize_q8k(const float* x, u64 n_blocks, BlockQ8K* out) {
    u64 blk = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (blk >= n_blocks) return;  // whole warps leave together: blockDim is a multiple of 32
    const float* v = x + blk * QK_K + 8 * lane;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
    amax = warp_max(amax);
    float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    float d = id != 0.0f ? 1.0f / id : 0.0f;
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int q = __float2int_rn(fminf(fmaxf(v[i] * id, -127.0f), 127.0f));
        ((i8*)out[blk].qs)[8 * lane + i] = (i8)q;
        sum += q;
    }
    int pair = sum + __shfl_xor_sync(0xffffffffu, sum, 1);
    if ((lane & 1) == 0) out[blk].bsums[lane >> 1] = (short)pair;
    if (lane == 0) out[blk].d = d;
}
