// Quantised GEMV for batch-1 decode: y = W x for MLX affine 4/8-bit rows, several matrices that
// share one input in one launch ("segments": e.g. GDN in_proj_qkv | z | b | a).
//
// Shapes: K (input width) a multiple of 512 (2048 or 4096 here), group 32/64/128.
// Geometry: 256 threads = 8 warps; each warp owns one row at a time (grid-stride); lane c reads
// 16-byte chunk c of the row (32 4-bit or 16 8-bit codes), so a warp reads 512 contiguous bytes.
// Prologue: x is loaded once per block into padded shared memory, optionally RMS-normalised with
// a weight (the layer's pre-norm, fused here instead of a separate kernel), and per-chunk sums Σx
// are precomputed (per 16 elements) so the affine bias costs one FMA per chunk: y = Σ s·(q·x) + b·Σx.
// Segments may mix 4- and 8-bit rows (the router and shared-expert gate are 8-bit).
// Epilogue: write, or add into the output (residual add fused).
// Ceiling: bytes of codes + scales + biases / ~3.7 TB/s streaming read (budget.md).
#include "common.cuh"

#define MAX_SEGS 4
#define MAX_K 4096

struct Segment {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
    float* out;
    int rows;
    int bits;
    int accumulate;  // 1: out += W x (residual add)
    int _pad;
};

struct GemvArgs {
    Segment seg[MAX_SEGS];
    const float* x;
    const float* norm_weight;  // null: use x as is
    float eps;
    int nseg;
    int K;
    int group;
};

__device__ __forceinline__ void load_input(const GemvArgs& a, float* xs, float* chunk_sum, float* scratch) {
    const int K = a.K;
    float scale = 1.f;
    if (a.norm_weight) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < K; i += blockDim.x) { float v = a.x[i]; ss += v * v; }
        ss = block_sum(ss, scratch);
        scale = rsqrtf(ss / K + a.eps);
    }
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
        float v = a.x[i] * scale;
        if (a.norm_weight) v *= a.norm_weight[i];
        xs[pad_idx(i)] = v;
    }
    __syncthreads();
    // sums of 16 consecutive elements for the bias term
    for (int c = threadIdx.x; c < K / 16; c += blockDim.x) {
        float s = 0.f;
        for (int j = 0; j < 16; ++j) s += xs[pad_idx(c * 16 + j)];
        chunk_sum[c] = s;
    }
    __syncthreads();
}

// dot of one 16-byte chunk (c) of a 4-bit row with x
__device__ __forceinline__ float chunk_dot4(uint4 w, const float* xs, int c) {
    const float4* xv = reinterpret_cast<const float4*>(xs + pad_idx(c * 32));
    uint32_t ws[4] = {w.x, w.y, w.z, w.w};
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float4 x0 = xv[2 * k], x1 = xv[2 * k + 1];
        acc = fmaf(nib(ws[k], 0), x0.x, acc);
        acc = fmaf(nib(ws[k], 1), x0.y, acc);
        acc = fmaf(nib(ws[k], 2), x0.z, acc);
        acc = fmaf(nib(ws[k], 3), x0.w, acc);
        acc = fmaf(nib(ws[k], 4), x1.x, acc);
        acc = fmaf(nib(ws[k], 5), x1.y, acc);
        acc = fmaf(nib(ws[k], 6), x1.z, acc);
        acc = fmaf(nib(ws[k], 7), x1.w, acc);
    }
    return acc;
}

__device__ __forceinline__ float chunk_dot8(uint4 w, const float* xs, int c) {
    const float4* xv = reinterpret_cast<const float4*>(xs + pad_idx(c * 16));
    uint32_t ws[4] = {w.x, w.y, w.z, w.w};
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float4 x0 = xv[k];
        acc = fmaf(byte_code(ws[k], 0), x0.x, acc);
        acc = fmaf(byte_code(ws[k], 1), x0.y, acc);
        acc = fmaf(byte_code(ws[k], 2), x0.z, acc);
        acc = fmaf(byte_code(ws[k], 3), x0.w, acc);
    }
    return acc;
}

// One row's dot product by one warp.
__device__ __forceinline__ float row_dot(const Segment& s, int row, int K, int group, const float* xs, const float* chunk_sum) {
    const int lane = threadIdx.x & 31;
    const int epc = s.bits == 4 ? 32 : 16;          // elements per 16-byte chunk
    const int chunks = K / epc;
    const int gpr = K / group;
    const uint4* codes = reinterpret_cast<const uint4*>(s.codes + (size_t)row * (K * s.bits / 32));
    float acc = 0.f;
    for (int c = lane; c < chunks; c += 32) {
        uint4 w = __ldcs(codes + c);  // streamed once: do not keep in L2
        int g = (c * epc) / group;
        float sc = bf16_to_f32(s.scales[(size_t)row * gpr + g]);
        float bi = bf16_to_f32(s.biases[(size_t)row * gpr + g]);
        float d, xsum;
        if (s.bits == 4) { d = chunk_dot4(w, xs, c); xsum = chunk_sum[2 * c] + chunk_sum[2 * c + 1]; }
        else { d = chunk_dot8(w, xs, c); xsum = chunk_sum[c]; }
        acc = fmaf(sc, d, fmaf(bi, xsum, acc));
    }
    return warp_sum(acc);
}

extern "C" __global__ void __launch_bounds__(256) gemv_q(GemvArgs a) {
    __shared__ __align__(16) float xs[MAX_K + MAX_K / 8];
    __shared__ float chunk_sum[MAX_K / 16];
    __shared__ float scratch[32];
    load_input(a, xs, chunk_sum, scratch);

    int total = 0;
    for (int i = 0; i < a.nseg; ++i) total += a.seg[i].rows;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int stride = gridDim.x * 8;
    for (int r = blockIdx.x * 8 + warp; r < total; r += stride) {
        int si = 0, local = r;
        while (local >= a.seg[si].rows) { local -= a.seg[si].rows; ++si; }
        const Segment& s = a.seg[si];
        float y = row_dot(s, local, a.K, a.group, xs, chunk_sum);
        if (lane == 0) {
            if (s.accumulate) s.out[local] += y; else s.out[local] = y;
        }
    }
}
