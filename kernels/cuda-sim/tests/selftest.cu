// The CPU executor's own test kernels (kernels/src/cuda/sim/tests.rs). Valid CUDA: the
// tests compile this file with NVRTC too (with common.cuh prepended, as every .cu) and load
// NVRTC's image, so they exercise the same path as the real kernels. Some kernels are
// deliberately wrong (a divergent barrier, a mask naming returned lanes, a race, an
// out-of-bounds read): the executor must report them.

// Barrier semantics: every thread writes its slot, then reads its neighbour's.
extern "C" __global__ void sim_barrier(int* out, int rounds) {
    __shared__ int slot[1024];
    int t = threadIdx.x, n = blockDim.x;
    int v = t;
    for (int r = 0; r < rounds; r++) {
        slot[t] = v;
        __syncthreads();
        v = slot[(t + 1) % n] + 1;
        __syncthreads();
    }
    out[blockIdx.x * n + t] = v;
}

// The same without the second barrier: a thread may overwrite its slot before its left
// neighbour read it (a write-after-read race the detector reports).
extern "C" __global__ void sim_barrier_missing(int* out, int rounds) {
    __shared__ int slot2[1024];
    int t = threadIdx.x, n = blockDim.x;
    int v = t;
    for (int r = 0; r < rounds; r++) {
        slot2[t] = v;
        __syncthreads();
        v = slot2[(t + 1) % n] + 1;
    }
    out[blockIdx.x * n + t] = v;
}

// Every shuffle flavour with widths 32, 16 and 8; out: [kind][width][lane] per warp.
extern "C" __global__ void sim_shuffles(const int* in, int* out, int arg) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int v = in[threadIdx.x];
    int* o = out + warp * 12 * 32;
    const int widths[3] = {32, 16, 8};
    for (int w = 0; w < 3; w++) {
        o[(0 * 3 + w) * 32 + lane] = __shfl_sync(0xffffffffu, v, arg, widths[w]);
        o[(1 * 3 + w) * 32 + lane] = __shfl_up_sync(0xffffffffu, v, (unsigned)arg, widths[w]);
        o[(2 * 3 + w) * 32 + lane] = __shfl_down_sync(0xffffffffu, v, (unsigned)arg, widths[w]);
        o[(3 * 3 + w) * 32 + lane] = __shfl_xor_sync(0xffffffffu, v, arg, widths[w]);
    }
}

// A float reduction over the warp with common.cuh's warp_sum, and a shuffle of doubles.
extern "C" __global__ void sim_warp_sum(const float* in, float* out, double* dout) {
    float s = warp_sum(in[threadIdx.x]);
    double d = __shfl_down_sync(0xffffffffu, (double)in[threadIdx.x] * 0.5, 1);
    out[threadIdx.x] = s;
    dout[threadIdx.x] = d;
}

// Ballot / any / all over a predicate per thread: out[3 * thread ..] = ballot, any, all.
extern "C" __global__ void sim_ballot(const int* pred, unsigned* out) {
    int p = pred[threadIdx.x];
    out[3 * threadIdx.x] = __ballot_sync(0xffffffffu, p);
    out[3 * threadIdx.x + 1] = __any_sync(0xffffffffu, p);
    out[3 * threadIdx.x + 2] = __all_sync(0xffffffffu, p);
}

// Atomics: a shared histogram of in[] (bins of 16) copied out, a global counter, and the
// order in which threads took tickets (how the executor orders them).
extern "C" __global__ void sim_atomics(const unsigned* in, int n, unsigned* hist, unsigned* counter,
                                       unsigned* order, float* fsum, int* imax) {
    __shared__ unsigned bins[16];
    for (int i = threadIdx.x; i < 16; i += blockDim.x) bins[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&bins[in[i] & 15], 1u);
    unsigned ticket = atomicAdd(counter, 1u);
    order[ticket] = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(fsum, 0.5f);
    atomicMax(imax, (int)(threadIdx.x * 7 % 101));
    __syncthreads();
    for (int i = threadIdx.x; i < 16; i += blockDim.x) atomicAdd(&hist[i], bins[i]);
}

// Defect: the first warp waits at one barrier, the others at another.
extern "C" __global__ void sim_divergent_barrier(int* out) {
    if (threadIdx.x < 32) __syncthreads();
    __syncthreads();
    out[threadIdx.x] = 1;
}

// Defect: half of the warp returns, the other half shuffles with a full mask.
extern "C" __global__ void sim_mask_names_returned_lanes(float* out) {
    int lane = threadIdx.x & 31;
    if (lane >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)lane, 1);
}

// Defect: lanes 0-15 reduce with a 16-lane mask but read lanes 16-31 (offset 16).
extern "C" __global__ void sim_shuffle_outside_mask(float* out) {
    int lane = threadIdx.x & 31;
    float v = (float)lane;
    if (lane < 16) v += __shfl_xor_sync(0x0000ffffu, v, 16);
    out[threadIdx.x] = v;
}

// Defect: lane 0 waits at a barrier while its warp waits for it at a shuffle.
extern "C" __global__ void sim_deadlock(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x == 0) __syncthreads();
    else v = __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

// Warp-synchronous shared memory: lanes write, __syncwarp, then read another lane's slot
// (correct); with sync = 0 the read races with the write.
extern "C" __global__ void sim_warp_shared(float* out, int sync) {
    __shared__ float wbuf[32 * 32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    wbuf[warp * 32 + lane] = -1.0f;
    __syncthreads();
    wbuf[warp * 32 + lane] = (float)threadIdx.x;
    if (sync) __syncwarp();
    out[threadIdx.x] = wbuf[warp * 32 + (lane + 1) % 32];
}

// Defect: reads one element past the end of `in` when the last thread reads in[n].
extern "C" __global__ void sim_read_past_end(const float* in, int n, float* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i < n ? i : 0] = in[i];
}

// Defect: reads shared memory no thread wrote (`write` is 0; it keeps the compiler from
// folding the never-written array to zeros).
extern "C" __global__ void sim_uninitialized_shared(float* out, int write) {
    __shared__ float never[64];
    if (write) never[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = never[(threadIdx.x + 1) % 64];
}

// Dynamic shared memory: `n` floats per block, written and read back in reverse; a block
// reading past its dynamic shared memory (extra = 1) is reported.
extern "C" __global__ void sim_dynamic_smem(float* out, int n, int extra) {
    TANDEM_DYNAMIC_SMEM(float, dyn);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dyn[i] = (float)(i * 3);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = dyn[n - 1 - i + extra];
}

// Integer and conversion intrinsics, one input per thread (out: 6 words per thread).
extern "C" __global__ void sim_intrinsics(const int* a, const int* b, const float* f, int* out) {
    int t = threadIdx.x + blockIdx.x * blockDim.x;
    out[6 * t] = __dp4a(a[t], b[t], t * 1000);
    out[6 * t + 1] = (int)__vsub4((unsigned)a[t], (unsigned)b[t]);
    out[6 * t + 2] = __float2int_rn(f[t]);
    out[6 * t + 3] = __popc((unsigned)a[t]);
    out[6 * t + 4] = (int)__float_as_uint(f[t] * 3.0f);
    out[6 * t + 5] = min(a[t], b[t]) + max((unsigned)a[t] & 255u, 7u);
}

// The single-rounding float operations, one (a, b, c) triple per thread (out: 8 floats per
// thread). The last two are the pair that tells them from a contracted expression:
// __fadd_rn(__fmul_rn(a, b), c) rounds twice even where NVRTC would fuse a * b + c.
extern "C" __global__ void sim_rounded_ops(const float* a, const float* b, const float* c, float* out, int n) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    float x = a[t], y = b[t], z = c[t];
    float* o = out + 8 * t;
    o[0] = __fadd_rn(x, y);
    o[1] = __fsub_rn(x, y);
    o[2] = __fmul_rn(x, y);
    o[3] = __fdiv_rn(x, y);
    o[4] = __fsqrt_rn(fabsf(x));
    o[5] = __fmaf_rn(x, y, z);
    o[6] = __fadd_rn(__fmul_rn(x, y), z);
    o[7] = __fsub_rn(z, __fmul_rn(x, y));
}

// Half conversions: every f16 bit pattern to f32 (through common.cuh's h2f), and f32 bit
// patterns to f16 (f2h).
extern "C" __global__ void sim_halves(const unsigned* fbits, float* h2f_out, unsigned short* f2h_out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < 65536) h2f_out[i] = h2f((u16)i);
    if (i < n) f2h_out[i] = f2h(__uint_as_float(fbits[i]));
}

// A kernel with several parameter types for the trampoline and graph-capture tests:
// out[i] = a * i + b + c for i < n, where c arrives as a 64-bit value.
extern "C" __global__ void sim_params(float* out, float a, int b, unsigned long long c, u8 d, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * (float)i + (float)b + (float)c + (float)d;
}
