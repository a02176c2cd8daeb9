// Token embedding lookup: out[t][i] = dequant(table row tokens[t])[i].
// Grid: x = token, y = ceil(dim / blockDim.x). Any GGML row type (Q8_0 / F16 / F32 / ...).
extern "C" __global__ void tandem_embed(const u8* table, int ty, u64 row_bytes,
                                        const u32* tokens, int n_tok, int dim, float* out) {
    int t = blockIdx.x;
    int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= n_tok || i >= dim) return;
    const u8* row = table + (u64)tokens[t] * row_bytes;
    out[(u64)t * dim + i] = load_elem(row, ty, i);
}
