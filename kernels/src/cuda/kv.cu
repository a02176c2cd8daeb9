// KV cache writes and transfer packing.
//
// Device KV buffers: one allocation for all layers' K pools ([layer][pool]) and one for
// the V pools, each pool laid out exactly like the CPU PagedKvCache pool:
// (block * block_tokens + pos % block_tokens) * row_bytes, a row being one token's kv_dim
// values stored as F32 / F16 / Q8_0.
// Packed transfer buffer (the body of the TKV1 export after its 32-byte header, see
// dataplane model::kv_transfer): for each layer, K rows of positions 0..n, then V rows.

// Store n_tok tokens' post-rope K and V (f32 [n_tok][kv_dim]) into their slots
// (slot = block * block_tokens + pos % block_tokens); a negative slot (a padding row of
// a captured decode graph) stores nothing. One thread per 32-value chunk, so Q8_0 blocks
// are encoded whole; encoding matches quant::quantize_row bit for bit.
extern "C" __global__ void tandem_kv_store(const float* k, const float* v, const i64* slots,
                                           int n_tok, int kv_dim, int ty, int row_bytes,
                                           u8* kpool, u8* vpool) {
    int chunks = kv_dim / QK;
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)n_tok * chunks * 2) return;
    int c = (int)(idx % chunks);
    u64 rest = idx / chunks;
    int which = (int)(rest % 2);
    int t = (int)(rest / 2);
    i64 slot = slots[t];
    if (slot < 0) return;
    const float* src = (which ? v : k) + (u64)t * kv_dim + c * QK;
    u8* row = (which ? vpool : kpool) + (u64)slot * row_bytes;
    if (ty == T_F32) {
        float* dst = (float*)row + c * QK;
        for (int i = 0; i < QK; i++) dst[i] = src[i];
    } else if (ty == T_F16) {
        u16* dst = (u16*)row + c * QK;
        for (int i = 0; i < QK; i++) dst[i] = f2h(src[i]);
    } else {  // Q8_0
        u8* b = row + c * 34;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(src[i]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        *(u16*)b = f2h(d);
        for (int i = 0; i < QK; i++)
            b[2 + i] = (u8)(i8)__float2int_rn(fminf(fmaxf(src[i] * id, -127.0f), 127.0f));
    }
}

// Pack: out row r = (layer * 2 + kv) * n_tok + pos  <-  that layer's K (kv = 0) or V pool
// row of `pos`. One block per row; rows are copied as 16-bit words (KV row sizes are even).
extern "C" __global__ void tandem_kv_gather(const u8* kpools, const u8* vpools, u64 pool_bytes,
                                            const u32* table, int bt, int n_tok, int row_bytes,
                                            u8* out) {
    u64 r = blockIdx.x;
    u64 lm = r / n_tok;
    int pos = (int)(r % n_tok);
    const u8* pools = (lm & 1) ? vpools : kpools;
    const u16* src =
        (const u16*)(pools + (lm >> 1) * pool_bytes + kv_slot(table, pos, bt) * row_bytes);
    u16* dst = (u16*)(out + r * row_bytes);
    for (int i = threadIdx.x; i < row_bytes / 2; i += blockDim.x) dst[i] = src[i];
}

// Unpack: the inverse of tandem_kv_gather, into the receiver's own blocks.
extern "C" __global__ void tandem_kv_scatter(const u8* packed, u64 pool_bytes, const u32* table,
                                             int bt, int n_tok, int row_bytes, u8* kpools,
                                             u8* vpools) {
    u64 r = blockIdx.x;
    u64 lm = r / n_tok;
    int pos = (int)(r % n_tok);
    u8* pools = (lm & 1) ? vpools : kpools;
    const u16* src = (const u16*)(packed + r * row_bytes);
    u16* dst = (u16*)(pools + (lm >> 1) * pool_bytes + kv_slot(table, pos, bt) * row_bytes);
    for (int i = threadIdx.x; i < row_bytes / 2; i += blockDim.x) dst[i] = src[i];
}
