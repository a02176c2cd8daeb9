// Rotary embedding in place. x: [n_tok][n_heads][head_dim]; one thread per rotated pair.
// cos_t / sin_t: [max_pos][rot_dim / 2], the RopeTable values. neox = 0: pairs
// (2i, 2i+1) (RopeStyle::Normal, llama); neox = 1: pairs (i, i + rot_dim / 2).
extern "C" __global__ void tandem_rope(float* x, int n_tok, int n_heads, int head_dim,
                                       int rot_half, const int* pos, const float* cos_t,
                                       const float* sin_t, int neox) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 total = (u64)n_tok * n_heads * rot_half;
    if (idx >= total) return;
    int i = (int)(idx % rot_half);
    u64 th = idx / rot_half;  // token * n_heads + head
    int t = (int)(th / n_heads);
    float* head = x + th * head_dim;
    int a = neox ? i : 2 * i;
    int b = neox ? i + rot_half : 2 * i + 1;
    u64 c = (u64)pos[t] * rot_half + i;
    float cs = cos_t[c], sn = sin_t[c];
    float x0 = head[a], x1 = head[b];
    head[a] = x0 * cs - x1 * sn;
    head[b] = x0 * sn + x1 * cs;
}
