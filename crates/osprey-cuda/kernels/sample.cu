// Token handoff on the GPU: the embedding row of the token in the device-side input slot, and the
// greedy choice over the logits written straight back into that slot, with the position advanced,
// so a captured decode step replays with no host round trip.
//   embed      — dequantises one row of the 4-bit embedding (H values). Grid 1 block.
//   argmax_partial / argmax_final — two-pass argmax over the valid vocabulary (ties: lower id).
// Measured (H200, commit e06983b): embed 19 us (one block, latency-bound), argmax 24 us over the
// 1 MB of logits (two passes).
#include "common.cuh"

struct EmbedArgs {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
    const int* token;
    float* x;
    int H, group, bits;
};

extern "C" __global__ void embed(EmbedArgs a) {
    const size_t row = (size_t)*a.token;
    const int per_word = 32 / a.bits, wpr = a.H / per_word, gpr = a.H / a.group;
    const uint32_t mask = (1u << a.bits) - 1;
    for (int i = threadIdx.x; i < a.H; i += blockDim.x) {
        uint32_t w = a.codes[row * wpr + i / per_word];
        float q = (float)((w >> ((i % per_word) * a.bits)) & mask);
        int g = i / a.group;
        a.x[i] = bf16_to_f32(a.scales[row * gpr + g]) * q + bf16_to_f32(a.biases[row * gpr + g]);
    }
}

struct ArgmaxArgs {
    const float* logits;
    float* part_val;
    int* part_idx;
    int* token;       // next step's input slot
    int* pos;         // advanced by one
    int* history;     // generated ids, indexed by step
    int* step;
    int n;
};

extern "C" __global__ void __launch_bounds__(256) argmax_partial(ArgmaxArgs a) {
    __shared__ float sv[256];
    __shared__ int si[256];
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += gridDim.x * blockDim.x) {
        float v = a.logits[i];
        if (v > best) { best = v; bi = i; }
    }
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = sv[threadIdx.x + s];
            int oi = si[threadIdx.x + s];
            if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        a.part_val[blockIdx.x] = sv[0];
        a.part_idx[blockIdx.x] = si[0];
    }
}

extern "C" __global__ void argmax_final(ArgmaxArgs a, int parts) {
    if (threadIdx.x != 0) return;
    float best = -INFINITY;
    int bi = 0;
    for (int p = 0; p < parts; ++p) {
        if (a.part_val[p] > best || (a.part_val[p] == best && a.part_idx[p] < bi)) { best = a.part_val[p]; bi = a.part_idx[p]; }
    }
    *a.token = bi;
    a.history[*a.step] = bi;
    *a.step += 1;
    *a.pos += 1;
}
