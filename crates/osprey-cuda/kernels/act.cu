// Prefill activations: the f32 residual stream and the bf16 inputs of the GEMMs (gemm.cu).
//   embed_rows      — dequantises the embedding rows of T tokens into x [T, H] f32.
//   norm_bf16       — per row: RMSNorm with a weight (the layers' pre-norms), or a plain copy,
//                     written as bf16 in perm64 order. Grid T blocks.
//   gated_norm_bf16 — the GDN output norm: per head RMSNorm with weight, times silu(z), to bf16
//                     perm64. Grid T blocks, one warp per head.
// All are elementwise passes over T rows (a few MB each); they exist so the GEMM reads bf16 once
// per tile instead of normalising per block. Measured (H200, commit 7bf2668, 4K prompt): the 80
// pre-norms 2.2 ms (~50 MB each, f32 in and bf16 out: ~1.8 TB/s), the 30 gated norms 1.9 ms.
#include "common.cuh"

struct EmbedRowsArgs {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
    const int* tokens;  // [T]
    float* x;           // [T, H]
    int H, group, bits;
};

// 256 threads a block (common.cuh embed_row), a block per token.
extern "C" __global__ void embed_rows(EmbedRowsArgs a) {
    embed_row(a.codes, a.scales, a.biases, (size_t)a.tokens[blockIdx.x], a.H, a.group, a.bits, a.x + (size_t)blockIdx.x * a.H);
}

struct NormArgs {
    const float* x;      // [T, ldx]
    const float* weight; // [K] RMSNorm weight (null: copy)
    const float* z;      // gated_norm_bf16: [T, K] gate
    __nv_bfloat16* out;  // [T, K] perm64
    float eps;
    int K, ldx, head_dim;
};

#define NORM_MAX_PER_THREAD 16

// 256 threads; K <= 4096.
extern "C" __global__ void __launch_bounds__(256) norm_bf16(NormArgs a) {
    __shared__ float scratch[32];
    const float* x = a.x + (size_t)blockIdx.x * a.ldx;
    float v[NORM_MAX_PER_THREAD];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_MAX_PER_THREAD; ++j) {
        const int i = threadIdx.x + 256 * j;
        v[j] = i < a.K ? x[i] : 0.f;
        ss += v[j] * v[j];
    }
    float inv = 1.f;
    if (a.weight) inv = rsqrtf(block_sum(ss, scratch) / a.K + a.eps);
    __nv_bfloat16* out = a.out + (size_t)blockIdx.x * a.K;
#pragma unroll
    for (int j = 0; j < NORM_MAX_PER_THREAD; ++j) {
        const int i = threadIdx.x + 256 * j;
        if (i < a.K) out[perm64(i)] = __float2bfloat16(a.weight ? v[j] * inv * a.weight[i] : v[j]);
    }
}

// 256 threads = 8 warps; heads of 128 (4 values per lane).
extern "C" __global__ void __launch_bounds__(256) gated_norm_bf16(NormArgs a) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, heads = a.K / a.head_dim;
    const float* x = a.x + (size_t)blockIdx.x * a.ldx;
    const float* z = a.z + (size_t)blockIdx.x * a.K;
    __nv_bfloat16* out = a.out + (size_t)blockIdx.x * a.K;
    for (int h = warp; h < heads; h += 8) {
        const int base = h * a.head_dim + lane * 4;
        const float4 v = *reinterpret_cast<const float4*>(x + base);
        const float4 zz = *reinterpret_cast<const float4*>(z + base);
        const float4 w = *reinterpret_cast<const float4*>(a.weight + lane * 4);
        const float inv = rsqrtf(warp_sum(v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w) / a.head_dim + a.eps);
        out[perm64(base)] = __float2bfloat16(v.x * inv * w.x * siluf(zz.x));
        out[perm64(base + 1)] = __float2bfloat16(v.y * inv * w.y * siluf(zz.y));
        out[perm64(base + 2)] = __float2bfloat16(v.z * inv * w.z * siluf(zz.z));
        out[perm64(base + 3)] = __float2bfloat16(v.w * inv * w.w * siluf(zz.w));
    }
}
