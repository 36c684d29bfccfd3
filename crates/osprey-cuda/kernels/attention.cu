// Gated full attention, decode (model-spec §3.5):
//   attn_prep    — q/k RMSNorm (zero-centred, already 1+w), partial RoPE on the first rotary dims,
//                  K/V appended to the bf16 cache at the device-side position. Grid Hq + Hkv.
//   attn_decode  — split-KV (flash-decoding) over a fixed grid (Hkv, max splits) so the CUDA graph
//                  never changes; the splits in use follow the device-side position: 64 up to 16K
//                  positions, then one per 256 positions (up to 512 at 128K), blocks past them exit
//                  at once. A long context so keeps enough blocks, each with its loads in flight,
//                  to stream the cache; a short one pays for no extra partial results.
//                  Each block owns a contiguous range of positions for one KV head
//                  and all its query heads (one warp per query head, GQA: each K/V row is read from
//                  HBM once and reused by the 8 warps through L1); each warp keeps 8 positions' K
//                  and V loads in flight at once; online softmax in fp32.
//   attn_combine — merges the splits, applies the sigmoid output gate. Grid Hq.
// Shapes: head_dim D = 256 (8 dims per lane), Hq = 16, Hkv = 2.
// Bytes: 2 KiB of K/V per position (bf16), e.g. 8 MB at 4K context.
// Measured (H200, launched alone with events, 4K context): commit e06983b: decode 25.3 us for
// 8 MB of K/V = 0.33 TB/s (9% of 3.7 TB/s); prep 5.4 us; combine 10.4 us. Commit 3885b19: decode
// 28.7 us at 4K (the grid's 896 idle blocks cost ~3 us); whole decode step at 128K context
// 118 -> 154 tok/s, 64K 172 -> 208, 32K 227 -> 248 from the splits that follow the context.
#include "common.cuh"

#define D 256
#define MIN_SPLITS 64
#define POSITIONS_PER_SPLIT 256

// Splits in use for `len` visible positions (attn_decode and attn_combine agree through this).
__device__ __forceinline__ int splits_in_use(int len, int max_splits) {
    return min(max_splits, max(MIN_SPLITS, (len + POSITIONS_PER_SPLIT - 1) / POSITIONS_PER_SPLIT));
}

struct PrepArgs {
    const float* qg;     // [Hq, 2D]: per head, D query rows then D gate rows
    const float* k;      // [Hkv, D]
    const float* v;      // [Hkv, D]
    const float* q_norm; // [D]
    const float* k_norm; // [D]
    float* q_out;        // [Hq, D]
    __nv_bfloat16* k_cache;  // [max_pos, Hkv, D]
    __nv_bfloat16* v_cache;
    const int* pos;
    float eps, theta;
    int hq, hkv, rotary;
};

extern "C" __global__ void __launch_bounds__(D) attn_prep(PrepArgs a) {
    step_overlap_begin();
    step_inputs_ready();
    __shared__ float x[D], scratch[32];
    const int b = blockIdx.x, d = threadIdx.x, pos = *a.pos;
    const bool is_q = b < a.hq;
    const int head = is_q ? b : b - a.hq;
    float val = is_q ? a.qg[head * 2 * D + d] : a.k[head * D + d];
    float ss = block_sum(val * val, scratch);
    val *= rsqrtf(ss / D + a.eps) * (is_q ? a.q_norm[d] : a.k_norm[d]);
    x[d] = val;
    __syncthreads();
    const int half = a.rotary / 2;
    if (d < a.rotary) {
        int f = d < half ? d : d - half;
        float inv = 1.f / powf(a.theta, (float)(2 * f) / (float)a.rotary);
        float s, c;
        sincosf((float)pos * inv, &s, &c);
        val = d < half ? x[d] * c - x[d + half] * s : x[d] * c + x[d - half] * s;
    }
    if (is_q) {
        a.q_out[head * D + d] = val;
    } else {
        size_t at = ((size_t)pos * a.hkv + head) * D + d;
        a.k_cache[at] = __float2bfloat16(val);
        a.v_cache[at] = __float2bfloat16(a.v[head * D + d]);
    }
}

struct DecodeArgs {
    const float* q;                // [Hq, D]
    const __nv_bfloat16* k_cache;  // [max_pos, Hkv, D]
    const __nv_bfloat16* v_cache;
    float* part_acc;               // [Hq, max splits, D]
    float* part_ml;                // [Hq, max splits, 2]
    const int* pos;                // this token's position; positions 0..=pos are visible
    float scale;
    int hq, hkv, splits;           // splits: the grid's (the most in use)
};

// positions handled together by a warp: their K and V loads are all in flight at once
#define POS_BATCH 8

extern "C" __global__ void __launch_bounds__(256) attn_decode(DecodeArgs a) {
    step_overlap_begin();
    step_inputs_ready();
    const int g = blockIdx.x, split = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = a.hq / a.hkv;
    const int len = *a.pos + 1, used = splits_in_use(len, a.splits);
    if (split >= used) return;
    const int chunk = (len + used - 1) / used;
    const int p0 = split * chunk, p1 = min(len, p0 + chunk);
    for (int qh_local = warp; qh_local < group; qh_local += 8) {
        const int qh = g * group + qh_local;
        float q[8], acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = a.q[qh * D + lane * 8 + i] * a.scale;
        float m = -INFINITY, l = 0.f;
        for (int pb = p0; pb < p1; pb += POS_BATCH) {
            uint4 kr[POS_BATCH], vr[POS_BATCH];
#pragma unroll
            for (int j = 0; j < POS_BATCH; ++j) {
                int p = min(pb + j, p1 - 1);
                size_t at = ((size_t)p * a.hkv + g) * D + lane * 8;
                kr[j] = *reinterpret_cast<const uint4*>(a.k_cache + at);
                vr[j] = *reinterpret_cast<const uint4*>(a.v_cache + at);
            }
            float s[POS_BATCH];
#pragma unroll
            for (int j = 0; j < POS_BATCH; ++j) {
                const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&kr[j]);
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float2 f = __bfloat1622float2(h[i]);
                    d = fmaf(q[2 * i], f.x, fmaf(q[2 * i + 1], f.y, d));
                }
                s[j] = d;
            }
#pragma unroll
            for (int j = 0; j < POS_BATCH; ++j) s[j] = pb + j < p1 ? warp_sum(s[j]) : -INFINITY;
            float mb = m;
#pragma unroll
            for (int j = 0; j < POS_BATCH; ++j) mb = fmaxf(mb, s[j]);
            const float corr = __expf(m - mb);
            l *= corr;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] *= corr;
#pragma unroll
            for (int j = 0; j < POS_BATCH; ++j) {
                const float w = __expf(s[j] - mb);
                l += w;
                const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&vr[j]);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float2 f = __bfloat1622float2(h[i]);
                    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
                    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
                }
            }
            m = mb;
        }
        size_t base = ((size_t)qh * a.splits + split);
#pragma unroll
        for (int i = 0; i < 8; ++i) a.part_acc[base * D + lane * 8 + i] = acc[i];
        if (lane == 0) {
            a.part_ml[base * 2] = m;
            a.part_ml[base * 2 + 1] = l;
        }
    }
}

struct CombineArgs {
    const float* part_acc;
    const float* part_ml;
    const float* qg;   // gate rows live at [h, D + d]
    float* out;        // [Hq, D]
    const int* pos;
    int splits;        // the most splits (the partial results' stride)
};

extern "C" __global__ void __launch_bounds__(D) attn_combine(CombineArgs a) {
    step_overlap_begin();
    step_inputs_ready();
    const int h = blockIdx.x, d = threadIdx.x, used = splits_in_use(*a.pos + 1, a.splits);
    float M = -INFINITY;
#pragma unroll 16
    for (int s = 0; s < used; ++s) M = fmaxf(M, a.part_ml[((size_t)h * a.splits + s) * 2]);
    float L = 0.f, o = 0.f;
#pragma unroll 16
    for (int s = 0; s < used; ++s) {
        size_t b = (size_t)h * a.splits + s;
        float m = a.part_ml[b * 2];
        if (m == -INFINITY) continue;
        float w = __expf(m - M);
        L += a.part_ml[b * 2 + 1] * w;
        o += a.part_acc[b * D + d] * w;
    }
    a.out[h * D + d] = o / L * sigmoidf(a.qg[h * 2 * D + D + d]);
}
