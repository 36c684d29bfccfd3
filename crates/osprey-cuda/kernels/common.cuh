// Shared helpers for Osprey's CUDA kernels (sm_90a). Activations are f32; weights stay in the
// MLX affine layout (packed u32 codes, bf16 scale and bias per group); KV cache is bf16.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float bf16_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block; `scratch` holds 32 floats. All threads get the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.f;
    return warp_sum(t);
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + __expf(-x)); }
__device__ __forceinline__ float siluf(float x) { return x / (1.f + __expf(-x)); }

// Exact float of a 4-bit code without the slow int->float unit: 2^23 + q as bits, minus 2^23.
__device__ __forceinline__ float nib(uint32_t w, int n) {
    return __uint_as_float(0x4B000000u | ((w >> (4 * n)) & 0xFu)) - 8388608.f;
}
__device__ __forceinline__ float byte_code(uint32_t w, int n) {
    return __uint_as_float(0x4B000000u | ((w >> (8 * n)) & 0xFFu)) - 8388608.f;
}

// Shared-memory index of activation element i, padded by 4 floats every 32 so that lanes
// reading consecutive 32-element chunks with float4 loads hit distinct banks.
__device__ __forceinline__ int pad_idx(int i) { return i + ((i >> 5) << 2); }

// ---- routing: the router GEMV's last block writes the selected experts here ----
#define MAX_TOPK 16
#define MAX_E 512

struct TopK {
    int ids[MAX_TOPK];
    float w[MAX_TOPK];
};
