// Gated full attention, decode (model-spec §3.5):
//   attn_prep    — q/k RMSNorm (zero-centred, already 1+w), partial RoPE on the first rotary dims,
//                  K/V appended to the bf16 cache at the device-side position. Grid Hq + Hkv.
//   attn_decode  — split-KV (flash-decoding); the splits in use follow the device-side position:
//                  128 up to 32K positions, then one per 256 (up to 512 at 128K). The grid is the
//                  resident blocks (2 per SM, fixed so the CUDA graph never changes), walking the
//                  (KV head, split) items. An item is a contiguous range of positions of one KV
//                  head for all of its (up to 8) query heads: the block's 4 warps take batches
//                  of 4 positions each (every K/V row read once, by one warp), the next batch's
//                  loads in flight while this one is used; a lane holds 8 dims of all 8 heads, the
//                  32 partial scores of a batch are summed by a transposing butterfly (31
//                  shuffles, lane l ends with score l); online softmax in fp32; the warps merge
//                  through shared memory in a fixed order.
//   attn_combine — merges the splits (warps over splits, lanes over dims, several splits' loads in
//                  flight), applies the sigmoid output gate. Grid Hq.
// Shapes: head_dim D = 256 (8 dims per lane), Hq = 16, Hkv = 2.
// Bytes: 2 KiB of K/V per position (bf16), e.g. 8 MB at 4K context, 268 MB at 128K.
// Measured (H200, full-size model, inside the decode graph): commit 1c5da43 (a warp per query
// head, each K/V row read by 8 warps through L1; grid (Hkv, 512)): 22.1 us at 4K; warps over
// positions on that grid (8 warps, 1 block per SM, so the 256 busy blocks ran in two waves
// among 768 idle ones): 19.3 us; resident blocks walking items: 11.8 us at 4K (8 MB, 0.7 TB/s:
// launch, q staging and the merge dominate). Whole decode step at 128K: 154 -> 213 -> 257 tok/s.
#include "common.cuh"

#define D 256
#define MIN_SPLITS 128
// the partial results a combine block weighs (the host's SPLITS is at most this)
#define MAX_SPLITS_SMEM 1024
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

// Query heads per KV head the kernel is laid out for (fewer are padded with zero queries).
#define G 8
// Positions a warp takes at once: G·PB = 32 scores, one per lane after the butterfly reduction.
#define PB 4

// One stage of the transposing butterfly below: lanes with bit HALF set keep the upper half of
// their values and send the lower, the others the reverse; each kept value adds its partner's.
template <int HALF>
__device__ __forceinline__ void butterfly_stage(float (&v)[32], int lane) {
    const bool upper = lane & HALF;
#pragma unroll
    for (int i = 0; i < HALF; ++i) {
        const float send = upper ? v[i] : v[i + HALF];
        const float keep = upper ? v[i + HALF] : v[i];
        v[i] = keep + __shfl_xor_sync(FULL_MASK, send, HALF);
    }
}

// Sums 32 per-lane partial values across the warp with 31 shuffles (a transposing butterfly):
// afterwards lane l holds the full sum of value l.
__device__ __forceinline__ float butterfly_sum32(float (&v)[32]) {
    const int lane = threadIdx.x & 31;
    butterfly_stage<16>(v, lane);
    butterfly_stage<8>(v, lane);
    butterfly_stage<4>(v, lane);
    butterfly_stage<2>(v, lane);
    butterfly_stage<1>(v, lane);
    return v[0];
}

struct KvBatch {
    uint4 k[PB], v[PB];
};

__device__ __forceinline__ void load_kv(const DecodeArgs& a, int g, int p, int p1, KvBatch& b) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < PB; ++j) {
        const int pj = min(p + j, p1 - 1);
        const size_t at = ((size_t)pj * a.hkv + g) * D + lane * 8;
        b.k[j] = __ldcs(reinterpret_cast<const uint4*>(a.k_cache + at));
        b.v[j] = __ldcs(reinterpret_cast<const uint4*>(a.v_cache + at));
    }
}

// Warps per block: 4, so two blocks fit on an SM (the kernel holds ~225 registers per thread).
#define WARPS 4

extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) attn_decode(DecodeArgs a) {
    __shared__ __align__(16) float qs[G][D];
    __shared__ __align__(16) float merge_acc[WARPS / 2][G][D];
    __shared__ float merge_ml[WARPS][G][2];
    step_overlap_begin();
    step_inputs_ready();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = a.hq / a.hkv;
    const int len = *a.pos + 1, used = splits_in_use(len, a.splits);
    const int chunk = (len + used - 1) / used;
    // work items (KV head, split) over a grid of resident blocks: no block waits for a slot
    // behind blocks with nothing to do, whatever the context
    for (int item = blockIdx.x; item < a.hkv * used; item += gridDim.x) {
        const int g = item % a.hkv, split = item / a.hkv;
        const int p0 = split * chunk, p1 = min(len, p0 + chunk);
        for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
            const int h = i / D;
            qs[h][i % D] = h < group ? a.q[(g * group + h) * D + i % D] * a.scale : 0.f;
        }
        __syncthreads();
        // lane l's running softmax state is that of head l / PB (replicated over its PB lanes);
        // acc[h][i] is dim lane·8 + i of head h
        float m = -INFINITY, l = 0.f, acc[G][8];
#pragma unroll
        for (int h = 0; h < G; ++h)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;
        // warp w takes batches of PB consecutive positions, WARPS·PB apart; the next batch's K/V is
        // in flight while this one is used
        const int stride = WARPS * PB;
        int p = p0 + warp * PB;
        KvBatch cur, nxt;
        if (p < p1) load_kv(a, g, p, p1, cur);
        for (; p < p1; p += stride) {
            if (p + stride < p1) load_kv(a, g, p + stride, p1, nxt);
            float kf[PB][8];
#pragma unroll
            for (int j = 0; j < PB; ++j) {
                const __nv_bfloat162* hk = reinterpret_cast<const __nv_bfloat162*>(&cur.k[j]);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = __bfloat1622float2(hk[i]);
                    kf[j][2 * i] = f.x;
                    kf[j][2 * i + 1] = f.y;
                }
            }
            float part[G * PB];
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const float4 q0 = *reinterpret_cast<const float4*>(&qs[h][lane * 8]);
                const float4 q1 = *reinterpret_cast<const float4*>(&qs[h][lane * 8 + 4]);
#pragma unroll
                for (int j = 0; j < PB; ++j) {
                    float d = q0.x * kf[j][0];
                    d = fmaf(q0.y, kf[j][1], d); d = fmaf(q0.z, kf[j][2], d); d = fmaf(q0.w, kf[j][3], d);
                    d = fmaf(q1.x, kf[j][4], d); d = fmaf(q1.y, kf[j][5], d); d = fmaf(q1.z, kf[j][6], d);
                    d = fmaf(q1.w, kf[j][7], d);
                    part[h * PB + j] = d;
                }
            }
            // lane l now holds the score of head l / PB at position p + l % PB
            float s = butterfly_sum32(part);
            if (p + lane % PB >= p1) s = -INFINITY;
            float bm = s;
#pragma unroll
            for (int o = 1; o < PB; o <<= 1) bm = fmaxf(bm, __shfl_xor_sync(FULL_MASK, bm, o));
            const float m_new = fmaxf(m, bm);
            const float corr = __expf(m - m_new), w = __expf(s - m_new);
            float wsum = w;
#pragma unroll
            for (int o = 1; o < PB; o <<= 1) wsum += __shfl_xor_sync(FULL_MASK, wsum, o);
            l = l * corr + wsum;
            m = m_new;
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const float ch = __shfl_sync(FULL_MASK, corr, h * PB);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[h][i] *= ch;
            }
#pragma unroll
            for (int j = 0; j < PB; ++j) {
                const __nv_bfloat162* hv = reinterpret_cast<const __nv_bfloat162*>(&cur.v[j]);
                float vf[8];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 f = __bfloat1622float2(hv[i]);
                    vf[2 * i] = f.x;
                    vf[2 * i + 1] = f.y;
                }
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float wh = __shfl_sync(FULL_MASK, w, h * PB + j);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(wh, vf[i], acc[h][i]);
                }
            }
            cur = nxt;
        }
        // merge the warps: common maximum per head, then a fixed-order tree over shared memory
        if (lane % PB == 0) {
            merge_ml[warp][lane / PB][0] = m;
            merge_ml[warp][lane / PB][1] = l;
        }
        __syncthreads();
        float scale_h[G];
        float M[G], L[G];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            M[h] = -INFINITY;
            for (int w2 = 0; w2 < WARPS; ++w2) M[h] = fmaxf(M[h], merge_ml[w2][h][0]);
            L[h] = 0.f;
            for (int w2 = 0; w2 < WARPS; ++w2) {
                const float mw = merge_ml[w2][h][0];
                L[h] += mw == -INFINITY ? 0.f : merge_ml[w2][h][1] * __expf(mw - M[h]);
            }
            const float mine = merge_ml[warp][h][0];
            scale_h[h] = mine == -INFINITY ? 0.f : __expf(mine - M[h]);
        }
#pragma unroll
        for (int h = 0; h < G; ++h)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[h][i] *= scale_h[h];
#pragma unroll
        for (int half = WARPS / 2; half >= 1; half >>= 1) {
            if (warp >= half && warp < 2 * half) {
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    float4* dst = reinterpret_cast<float4*>(&merge_acc[warp - half][h][lane * 8]);
                    dst[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
                    dst[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
                }
            }
            __syncthreads();
            if (warp < half) {
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float4* src = reinterpret_cast<const float4*>(&merge_acc[warp][h][lane * 8]);
                    const float4 u0 = src[0], u1 = src[1];
                    acc[h][0] += u0.x; acc[h][1] += u0.y; acc[h][2] += u0.z; acc[h][3] += u0.w;
                    acc[h][4] += u1.x; acc[h][5] += u1.y; acc[h][6] += u1.z; acc[h][7] += u1.w;
                }
            }
            __syncthreads();
        }
        if (warp == 0) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
                if (h >= group) continue;
                const size_t base = (size_t)(g * group + h) * a.splits + split;
                float4* dst = reinterpret_cast<float4*>(a.part_acc + base * D + lane * 8);
                dst[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
                dst[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
                if (lane == 0) {
                    a.part_ml[base * 2] = M[h];
                    a.part_ml[base * 2 + 1] = L[h];
                }
            }
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

// One block per query head: warp w sums splits w, w + 8, ... (lane: 8 dims, two float4 loads
// per split, several splits' loads in flight), the warps' sums meet in shared memory.
extern "C" __global__ void __launch_bounds__(256) attn_combine(CombineArgs a) {
    __shared__ float wts[MAX_SPLITS_SMEM];
    __shared__ __align__(16) float sums[8][D];
    __shared__ float scratch[32];
    step_overlap_begin();
    step_inputs_ready();
    const int h = blockIdx.x, used = splits_in_use(*a.pos + 1, a.splits);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* ml = a.part_ml + (size_t)h * a.splits * 2;
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < used; s += blockDim.x) mx = fmaxf(mx, ml[2 * s]);
    mx = warp_max(mx);
    if (lane == 0) scratch[warp] = mx;
    __syncthreads();
    float M = scratch[0];
    for (int w2 = 1; w2 < 8; ++w2) M = fmaxf(M, scratch[w2]);
    float lsum = 0.f;
    for (int s = threadIdx.x; s < used; s += blockDim.x) {
        const float m = ml[2 * s];
        const float w = m == -INFINITY ? 0.f : __expf(m - M);
        wts[s] = w;
        lsum += ml[2 * s + 1] * w;
    }
    const float L = block_sum(lsum, scratch);  // its barriers also publish wts
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int s = warp; s < used; s += 8) {
        const float4* src = reinterpret_cast<const float4*>(a.part_acc + ((size_t)h * a.splits + s) * D + lane * 8);
        const float4 u0 = __ldcg(src), u1 = __ldcg(src + 1);
        const float w = wts[s];
        o[0] = fmaf(w, u0.x, o[0]); o[1] = fmaf(w, u0.y, o[1]); o[2] = fmaf(w, u0.z, o[2]); o[3] = fmaf(w, u0.w, o[3]);
        o[4] = fmaf(w, u1.x, o[4]); o[5] = fmaf(w, u1.y, o[5]); o[6] = fmaf(w, u1.z, o[6]); o[7] = fmaf(w, u1.w, o[7]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sums[warp][lane * 8 + i] = o[i];
    __syncthreads();
    const int d = threadIdx.x;
    float t = 0.f;
#pragma unroll
    for (int w2 = 0; w2 < 8; ++w2) t += sums[w2][d];
    a.out[h * D + d] = t / L * sigmoidf(a.qg[h * 2 * D + D + d]);
}
