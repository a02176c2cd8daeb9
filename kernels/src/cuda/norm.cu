// RMSNorm, one block per row: out = x / sqrt(mean(x^2) + eps) * w. The expression order
// (x * scale) * w follows the scalar reference so that only the sum's order differs.
extern "C" __global__ void tandem_rmsnorm(const float* x, const float* w, float eps, int dim,
                                          float* out) {
    const float* xr = x + (u64)blockIdx.x * dim;
    float* o = out + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}

// RMSNorm in place, one block per row (the per-head norms of Q and K: a row is a head).
// The same sum and expression as tandem_rmsnorm: every thread reads its elements for the
// sum before the barrier in block_sum and writes only its own elements after it.
extern "C" __global__ void tandem_rmsnorm_inplace(float* x, const float* w, float eps, int dim) {
    float* xr = x + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xr[i] = xr[i] * scale * w[i];
}
