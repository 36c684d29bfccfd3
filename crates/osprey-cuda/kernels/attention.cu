// Gated full attention, decode (model-spec §3.5):
//   attn_prep    — q/k RMSNorm (zero-centred, already 1+w), partial RoPE on the first rotary dims,
//                  K/V appended to the cache at the device-side position: bf16, or int8 rows
//                  with a scale each (--kv-cache int8, store_int8_row). Grid Hq + Hkv.
//   attn_decode  — split-KV (flash-decoding); the splits in use follow the device-side position:
//                  ~40 positions each (48 to 112) below 32K, 128 from there up to 128K, then one
//                  per 1024 (up to 512; splits_in_use). The grid is the
//                  resident blocks (2 per SM, fixed so the CUDA graph never changes), walking the
//                  (KV head, split) items. An item is a contiguous range of positions of one KV
//                  head for all of its (up to 8) query heads: the block's 4 warps take steps of 8
//                  positions each (every K/V row read once, by one warp, straight into registers),
//                  the next step's loads in flight while this one is used; scores and weighted
//                  values on the tensor cores (mma.sync bf16, f32 accumulate; layout at the
//                  kernel), online softmax in fp32; the warps merge through shared memory in a
//                  fixed order. Then the blocks meet (grid_meet) and merge the splits
//                  (merge_splits), applying the sigmoid output gate. attn_decode_int8: the same
//                  on the int8 cache.
//   The splits were first merged by a launch of their own (attn_combine: warps over splits, 16
//   splits' loads in flight, a quarter of a head's dims per block); merged in attn_decode
//   instead, from 48K first: 128K 513.5 -> 520.5 tok/s, int8 cache 595.4 -> 597.9
//   (cuda-decode-attn-merge-last-alloc.json), where below 48K it lost (4K 768 -> 736,
//   cuda-decode-attn-merge-in-decode.json); since the decode step changed around it, at every
//   position: 4K 823.4 -> 834.4, 32K 716.1 -> 739.8 (cuda-decode-attn-merge-all.json).
//   Now (commit d318e6c, timeline at 4K, after the launch's release): Q staged 0.5 us (median
//   block), attended 1.8, shares in shared memory 2.8, met 5.4, splits merged 6.5, the launch
//   7.7 us exit to exit against 8 MB of K/V (1.0 TB/s: the meeting and merge are most of it).
// Shapes: head_dim D = 256, Hq = 16, Hkv = 2 (up to 8 query heads per KV head).
// Bytes: 2 KiB of K/V per position (bf16), e.g. 8 MB at 4K context, 268 MB at 128K; int8 half.
// Measured (H200, full-size model, inside the decode graph): commit 1c5da43 (a warp per query
// head, each K/V row read by 8 warps through L1; grid (Hkv, 512)): 22.1 us at 4K; warps over
// positions on that grid (8 warps, 1 block per SM, so the 256 busy blocks ran in two waves
// among 768 idle ones): 19.3 us; resident blocks walking items: 11.8 us at 4K (8 MB, 0.7 TB/s:
// launch, q staging and the merge dominate). Whole decode step at 128K: 154 -> 213 -> 257 tok/s.
// Scores and values on the tensor cores (this form; the CUDA-core form before it spent ~170 warp
// instructions per position and was issue-bound): 12.2 -> 8.1 us at 4K, ~123 -> ~92 us per layer
// at 128K (268 MB: ~2.9 TB/s); step at 128K 319 -> 356 tok/s
// (bench/results/cuda-decode-attention-tensor-cores.json). Then 128 splits up to 128K instead of
// one per 256 positions beyond 32K (4 items per block, each paying its Q staging, first loads
// and merge, at 128K), the first K/V loads issued before Q is staged: 128K 356 -> 388 tok/s,
// ~4.2 TB/s for the K/V beyond 4K (bench/results/cuda-decode-attention-splits.json).
// attn_combine over (head, quarter of its dims) with 16 splits' loads in flight: 59.0 -> 35.6 us
// a step in the graph at 4K (commit 87ba61e, bench/results/cuda-decode-attn-combine.json).
// attn_prep reads its norm weight and the position and computes the rotation before the wait,
// and is launched early: the step at 4K 600.4 -> 609.0 tok/s (cuda-decode-early-loads-2.json).
// attn_decode_int8 (the int8 cache: 1 KiB a position, 134 MB a layer at 128K, plus 1 MB of
// scales): 41 us a layer at 128K in the graph (3.3 TB/s) against attn_decode's 65 (4.1 TB/s);
// the step at 128K 451 -> 516 tok/s (commit 45c5c7f, cuda-decode-int8kv-full.json). Two steps
// in flight a warp, L2 prefetches, 16 positions a step, the cache head-major, the score MMAs in 4
// accumulator chains instead of 2, each warp's steps copied 1-3 ahead into a cp.async ring: no
// faster (the *-ablation.json files named in README). What holds it: two warps a scheduler. ncu
// (128K, one launch alone): 45% of the warps' stall cycles wait on the first use of a step's K
// bytes (long scoreboard), DRAM at 3.2 TB/s; the ring turned that into shared-memory waits and
// 2.4 TB/s (cuda-decode-int8-kv-ring-ablation.json). A warp step is ~300 instructions (32 HMMA,
// 80 PRMT and 64 HADD2 turning bytes into f16, the softmax). More warps an SM through the ring
// (2 slots, 3 blocks an SM at 164 registers, branch wip/int8-kv-ring-3): 128K 523 -> 473
// (cuda-decode-session20-ablations.json). Fewer instructions a position: the scores on the integer
// tensor cores (Q as two signed bytes a dim, the stored K codes as B fragments: the loop 728 -> 539
// SASS instructions per two steps) gained 0.5% at 128K and lost 0.9% at 4K (branch wip/s21-imma,
// cuda-decode-int8-imma-scores-ablation.json): the loads' latency holds it, not the instructions.
#include "common.cuh"

#define D 256
#define MIN_SPLITS 128
#define POSITIONS_PER_SPLIT 1024
// Below SHORT_CONTEXT positions, about SHORT_POSITIONS_PER_SPLIT positions a split, between
// SHORT_MIN_SPLITS and SHORT_MAX_SPLITS of them: fewer items and less to merge where each is a
// step or two of its warps. Swept on the H200 (a fixed count at every length, 32..128): the best
// count grows with the context, 32-48 at 256 positions, 96 at 2K-4K, 112 at 16K, 128 at 32K
// (bench/results/cuda-decode-session40-ablations.json: 4K +0.5%, 256 +0.4%, 32K +-0).
#define SHORT_CONTEXT 32768
#define SHORT_POSITIONS_PER_SPLIT 40
#define SHORT_MIN_SPLITS 48
#define SHORT_MAX_SPLITS 112

// Splits in use for `len` visible positions (attn_decode_items and merge_splits agree).
__device__ __forceinline__ int splits_in_use(int len, int max_splits) {
    const int wanted = len < SHORT_CONTEXT
                           ? min(SHORT_MAX_SPLITS, max(SHORT_MIN_SPLITS, (len + SHORT_POSITIONS_PER_SPLIT - 1) / SHORT_POSITIONS_PER_SPLIT))
                           : max(MIN_SPLITS, (len + POSITIONS_PER_SPLIT - 1) / POSITIONS_PER_SPLIT);
    return min(max_splits, wanted);
}

struct PrepArgs {
    const float* qg;     // [Hq, 2D]: per head, D query rows then D gate rows
    const float* k;      // [Hkv, D]
    const float* v;      // [Hkv, D]
    const float* q_norm; // [D]
    const float* k_norm; // [D]
    float* q_out;        // [Hq, D]
    void* k_cache;       // [max_pos, Hkv, D]: bf16, or biased int8 codes when k_scale is set
    void* v_cache;
    float* k_scale;      // int8 cache: [Hkv, max_pos] row scales (store_int8_row); else null
    float* v_scale;
    const int* pos;
    float eps, theta;
    int hq, hkv, rotary, max_pos;
};

extern "C" __global__ void __launch_bounds__(D) attn_prep(PrepArgs a) {
    __shared__ float x[D], scratch[32];
    const int b = blockIdx.x, d = threadIdx.x;
    const bool is_q = b < a.hq;
    const int head = is_q ? b : b - a.hq;
    step_overlap_begin();
    // what no kernel of this step writes, before the wait: the norm weight, the position (the
    // step before moved it) and the rotation it sets
    const float w = is_q ? a.q_norm[d] : a.k_norm[d];
    const int pos = *a.pos, half = a.rotary / 2;
    float s = 0.f, c = 1.f;
    if (d < a.rotary) {
        const int f = d < half ? d : d - half;
        const float inv = 1.f / powf(a.theta, (float)(2 * f) / (float)a.rotary);
        sincosf((float)pos * inv, &s, &c);
    }
    step_inputs_ready();
    // the projections' values in one round trip (v's too, for the cache: unpredicated, a query
    // head's block reads KV head 0's and drops it, so the compiler issues it with the first)
    const float v_val = a.v[(is_q ? 0 : head) * D + d];
    float val = is_q ? a.qg[head * 2 * D + d] : a.k[head * D + d];
    float ss = block_sum(val * val, scratch);
    val *= rsqrtf(ss / D + a.eps) * w;
    x[d] = val;
    __syncthreads();
    if (d < a.rotary) val = d < half ? x[d] * c - x[d + half] * s : x[d] * c + x[d - half] * s;
    if (is_q) {
        a.q_out[head * D + d] = val;
    } else if (a.k_scale) {
        const size_t row = ((size_t)pos * a.hkv + head) * D;
        const size_t at = (size_t)head * a.max_pos + pos;
        store_int8_row(val, static_cast<uint8_t*>(a.k_cache) + row, a.k_scale + at, scratch);
        store_int8_row(v_val, static_cast<uint8_t*>(a.v_cache) + row, a.v_scale + at, scratch);
    } else {
        size_t at = ((size_t)pos * a.hkv + head) * D + d;
        static_cast<__nv_bfloat16*>(a.k_cache)[at] = __float2bfloat16(val);
        static_cast<__nv_bfloat16*>(a.v_cache)[at] = __float2bfloat16(v_val);
    }
}

struct DecodeArgs {
    const float* q;         // [Hq, D]
    const void* k_cache;    // [max_pos, Hkv, D]: bf16 (attn_decode) or biased int8 (attn_decode_int8)
    const void* v_cache;
    const float* k_scale;   // int8: [Hkv, max_pos] row scales
    const float* v_scale;
    float* part_acc;        // [Hq, max splits, D]
    float* part_ml;         // [Hq, max splits, 2]
    const float* qg;        // the output gate's input at [h, D + d]
    float* out;             // [Hq, D]: the gated attention output
    unsigned* meet;         // the launch's blocks meet on it before merging the splits (grid_meet)
    const int* pos;         // this token's position; positions 0..=pos are visible
    float scale;
    int hq, hkv, splits;    // splits: the grid's (the most in use)
    int max_pos;
};

// Query heads per KV head the kernel is laid out for (fewer are padded with zero queries).
#define G 8
// Positions a warp takes at once: one n8 tile of scores.
#define PSTEP 8
// Warps per block: 4, so two blocks fit on an SM (255 registers per thread: two steps' K/V and the
// 64 accumulators), and warp w stages Q's k steps 4w .. 4w + 3, the 16 of D = 256.
#define WARPS 4
// The int8 form weighs its values by P·scale_v·V_SCALE_UP in f16 (undone in the merge): P·scale_v
// alone falls below f16's normal range (6.1e-5) for small weights of small rows; scaled by 256
// it stays finite up to |V| = 127/256 · 65504 ≈ 32500.
#define V_SCALE_UP 256.f

// D += A·B for one m16n8k8 tile: A 16x8, B 8x8 (bf16 or f16), f32 accumulate.
__device__ __forceinline__ void mma_bf16_k8(float* d, uint32_t a0, uint32_t a1, uint32_t b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}
__device__ __forceinline__ void mma_f16_k8(float* d, uint32_t a0, uint32_t a1, uint32_t b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

__device__ __forceinline__ uint32_t word_of(const uint4& u, int w) { return w == 0 ? u.x : w == 1 ? u.y : w == 2 ? u.z : u.w; }

// The K/V of one warp step (PSTEP positions from p) as lane (g, q) multiplies them. Positions past
// p1 repeat the last one (their scores are masked).
// bf16 cache:
//   k[u]: 16-byte piece 4u + q of the K row of position p + g (dims 8(4u + q) .. +7), u < 8;
//   v[j], v[4 + j]: piece 8j + g of the V rows of positions p + 2q and p + 2q + 1, j < 4.
// Both are coalesced: the 4 lanes of a K row read 64 contiguous bytes per load, the 8 lanes of a
// V row 128.
struct KvStep {
    uint4 k[8], v[8];
};
// int8 cache (half the bytes, same pattern):
//   k[u]: 16-byte piece 4u + q of the K row of position p + g (dims 64u + 16q .. +15), u < 4;
//   v[j], v[2 + j]: piece 8j + g of the V rows of positions p + 2q and p + 2q + 1, j < 2;
//   ks, vs: the row scales of positions p + 2q, p + 2q + 1 (the positions of this lane's scores).
struct KvStepInt8 {
    uint4 k[4], v[4];
    float ks[2], vs[2];
};

__device__ __forceinline__ void load_kv_step(const DecodeArgs& a, int kvh, int p, int p1, KvStep& b) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const __nv_bfloat16* kc = static_cast<const __nv_bfloat16*>(a.k_cache);
    const __nv_bfloat16* vc = static_cast<const __nv_bfloat16*>(a.v_cache);
    const uint4* kr = reinterpret_cast<const uint4*>(kc + ((size_t)min(p + g, p1 - 1) * a.hkv + kvh) * D);
    const uint4* v0 = reinterpret_cast<const uint4*>(vc + ((size_t)min(p + 2 * q, p1 - 1) * a.hkv + kvh) * D);
    const uint4* v1 = reinterpret_cast<const uint4*>(vc + ((size_t)min(p + 2 * q + 1, p1 - 1) * a.hkv + kvh) * D);
#pragma unroll
    for (int u = 0; u < 8; ++u) b.k[u] = __ldcs(kr + 4 * u + q);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        b.v[j] = __ldcs(v0 + 8 * j + g);
        b.v[4 + j] = __ldcs(v1 + 8 * j + g);
    }
}

__device__ __forceinline__ void load_kv_step(const DecodeArgs& a, int kvh, int p, int p1, KvStepInt8& b) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const uint8_t* kc = static_cast<const uint8_t*>(a.k_cache);
    const uint8_t* vc = static_cast<const uint8_t*>(a.v_cache);
    const int pe = min(p + 2 * q, p1 - 1), po = min(p + 2 * q + 1, p1 - 1);
    const uint4* kr = reinterpret_cast<const uint4*>(kc + ((size_t)min(p + g, p1 - 1) * a.hkv + kvh) * D);
    const uint4* v0 = reinterpret_cast<const uint4*>(vc + ((size_t)pe * a.hkv + kvh) * D);
    const uint4* v1 = reinterpret_cast<const uint4*>(vc + ((size_t)po * a.hkv + kvh) * D);
#pragma unroll
    for (int u = 0; u < 4; ++u) b.k[u] = __ldcs(kr + 4 * u + q);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        b.v[j] = __ldcs(v0 + 8 * j + g);
        b.v[2 + j] = __ldcs(v1 + 8 * j + g);
    }
    const size_t row = (size_t)kvh * a.max_pos;
    b.ks[0] = __ldcs(a.k_scale + row + pe);
    b.ks[1] = __ldcs(a.k_scale + row + po);
    b.vs[0] = __ldcs(a.v_scale + row + pe);
    b.vs[1] = __ldcs(a.v_scale + row + po);
}

// The online softmax of one warp step: scores x0, x1 of head g at positions p + 2q, p + 2q + 1
// (-inf where masked) update head g's maximum m, this lane's share l of its sum, and rescale acc
// (layout at attn_decode); returns the two positions' weights.
__device__ __forceinline__ float2 softmax_step(float x0, float x1, float& m, float& l, float (&acc)[16][4]) {
    const int q = threadIdx.x & 3;
    float bm = fmaxf(x0, x1);
    bm = fmaxf(bm, __shfl_xor_sync(FULL_MASK, bm, 1));
    bm = fmaxf(bm, __shfl_xor_sync(FULL_MASK, bm, 2));
    const float m_new = fmaxf(m, bm);  // finite: position p is visible
    const float corr = __expf(m - m_new), e0 = __expf(x0 - m_new), e1 = __expf(x1 - m_new);
    l = l * corr + (e0 + e1);
    m = m_new;
    // acc's columns are heads 2q and 2q + 1, whose corrections lanes 8q and 8q + 4 hold
    const float c0 = __shfl_sync(FULL_MASK, corr, 8 * q), c1 = __shfl_sync(FULL_MASK, corr, 8 * q + 4);
    if (!__all_sync(FULL_MASK, c0 == 1.f && c1 == 1.f)) {
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            acc[t][0] *= c0; acc[t][1] *= c1; acc[t][2] *= c0; acc[t][3] *= c1;
        }
    }
    return make_float2(e0, e1);
}

// One warp step: the scores of PSTEP positions from p, the online softmax and the weighted values
// into acc (layouts at attn_decode).
__device__ __forceinline__ void attend_step(const uint2 (*qfrag)[32], const KvStep& kv, int p, int p1, float& m, float& l,
                                            float (&acc)[16][4]) {
    const int lane = threadIdx.x & 31, q = lane & 3;
    float se[4] = {0.f, 0.f, 0.f, 0.f}, so[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < 8; ++u) {
        const uint2 qe = qfrag[2 * u][lane], qo = qfrag[2 * u + 1][lane];
        mma_bf16(se, qe.x, 0u, qe.y, 0u, kv.k[u].x, kv.k[u].y);
        mma_bf16(so, qo.x, 0u, qo.y, 0u, kv.k[u].z, kv.k[u].w);
    }
    const float x0 = p + 2 * q < p1 ? se[0] + so[0] : -INFINITY;
    const float x1 = p + 2 * q + 1 < p1 ? se[1] + so[1] : -INFINITY;
    const float2 e = softmax_step(x0, x1, m, l, acc);
    const uint32_t pb = pack_bf16(e.x, e.y);
#pragma unroll
    for (int t = 0; t < 16; ++t) {
        const uint32_t x = word_of(kv.v[t / 4], t % 4), y = word_of(kv.v[4 + t / 4], t % 4);
        mma_bf16_k8(acc[t], __byte_perm(x, y, 0x5410), __byte_perm(x, y, 0x7632), pb);
    }
}

__device__ __forceinline__ void attend_step(const uint2 (*qfrag)[32], const KvStepInt8& kv, int p, int p1, float& m,
                                            float& l, float (&acc)[16][4]) {
    const int lane = threadIdx.x & 31, q = lane & 3;
    float se[4] = {0.f, 0.f, 0.f, 0.f}, so[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint2 qs = qfrag[4 * u + w][lane];
            const uint32_t kw = word_of(kv.k[u], w);
            mma_f16(w % 2 ? so : se, qs.x, 0u, qs.y, 0u, int8_pair_f16(kw, 0x4140), int8_pair_f16(kw, 0x4342));
        }
    }
    const float x0 = p + 2 * q < p1 ? (se[0] + so[0]) * kv.ks[0] : -INFINITY;
    const float x1 = p + 2 * q + 1 < p1 ? (se[1] + so[1]) * kv.ks[1] : -INFINITY;
    const float2 e = softmax_step(x0, x1, m, l, acc);
    const uint32_t pb = pack_f16(e.x * kv.vs[0] * V_SCALE_UP, e.y * kv.vs[1] * V_SCALE_UP);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            // bytes of positions p + 2q (x) and p + 2q + 1 (y) interleaved, two dims per word
            const uint32_t x = word_of(kv.v[j], w), y = word_of(kv.v[2 + j], w);
            const uint32_t lo = __byte_perm(x, y, 0x5140), hi = __byte_perm(x, y, 0x7362);
            mma_f16_k8(acc[8 * j + 2 * w], int8_pair_f16(lo, 0x4140), int8_pair_f16(lo, 0x4342), pb);
            mma_f16_k8(acc[8 * j + 2 * w + 1], int8_pair_f16(hi, 0x4140), int8_pair_f16(hi, 0x4342), pb);
        }
    }
}

// Warp w's share of Q's fragments (scaled; bf16, or f16 for the int8 cache), laid out to meet the
// K words of its step (KvStep, KvStepInt8).
__device__ __forceinline__ void stage_q(const DecodeArgs& a, int kvh, KvStep*, uint2 (*qfrag)[32]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int group = a.hq / a.hkv;
    const float sc = a.scale;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int u = 2 * warp + i;
        float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
        if (g < group) {
            const float4* src = reinterpret_cast<const float4*>(a.q + (size_t)(kvh * group + g) * D + 8 * (4 * u + q));
            x0 = src[0];
            x1 = src[1];
        }
        qfrag[2 * u][lane] = make_uint2(pack_bf16(x0.x * sc, x0.y * sc), pack_bf16(x0.z * sc, x0.w * sc));
        qfrag[2 * u + 1][lane] = make_uint2(pack_bf16(x1.x * sc, x1.y * sc), pack_bf16(x1.z * sc, x1.w * sc));
    }
}

__device__ __forceinline__ void stage_q(const DecodeArgs& a, int kvh, KvStepInt8*, uint2 (*qfrag)[32]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int group = a.hq / a.hkv;
    const float sc = a.scale;
    const float4* src = reinterpret_cast<const float4*>(a.q + (size_t)(kvh * group + g) * D + 64 * warp + 16 * q);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const float4 x = g < group ? src[w] : make_float4(0.f, 0.f, 0.f, 0.f);
        qfrag[4 * warp + w][lane] = make_uint2(pack_f16(x.x * sc, x.y * sc), pack_f16(x.z * sc, x.w * sc));
    }
}

// The dim of acc[t]'s rows g (its c0, c1; c2, c3 hold the next dim) and what undoes its scaling.
__device__ __forceinline__ int acc_dim(KvStep*, int t, int g) { return 8 * (8 * (t / 4) + g) + 2 * (t % 4); }
__device__ __forceinline__ int acc_dim(KvStepInt8*, int t, int g) { return 16 * (8 * (t / 8) + g) + 4 * ((t / 2) % 4) + 2 * (t % 2); }
__device__ __forceinline__ float acc_unscale(KvStep*) { return 1.f; }
__device__ __forceinline__ float acc_unscale(KvStepInt8*) { return 1.f / V_SCALE_UP; }
// Whether a warp's second step is loaded before the wait as well as its first (attn_decode_items):
// not for the int8 cache, whose kernels then lost 0.3% at 128K (their registers allocated anew)
__device__ __forceinline__ constexpr bool second_step_early(KvStep*) { return true; }
__device__ __forceinline__ constexpr bool second_step_early(KvStepInt8*) { return false; }

// Every block of the launch waits here for all the others (the grid is the resident blocks: the
// host sizes it by occupancy, so they are all on the GPU at once), the scheme of cooperative
// groups' grid sync: each block adds 1 and block 0 adds 2^31 - (blocks - 1), so the counter's top
// bit flips once per launch and its low bits come back to where they were (no reset). The
// arrival is a release (the block's partial results, ordered before it by the barrier, are seen
// by whoever sees the count) and the polls acquires: no sequentially consistent fence
// (__threadfence, MEMBAR.SC) either side, 4K +0.3%, 32K +0.2%, 128K +0.1%, int8 cache +0.2%
// (bench/results/cuda-decode-attn-meet-acquire.json).
__device__ __forceinline__ void grid_meet(unsigned* counter) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned add = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        unsigned old;
        asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(add) : "memory");
        for (unsigned rounds = 0;; ++rounds) {
            unsigned now;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(counter) : "memory");
            if ((now ^ old) & 0x80000000u) break;
            // a block that cannot become resident (another client holding SMs) would never
            // arrive: after ~1 s the launch fails with an error the host reports, no hang
            if (rounds == MEET_ROUNDS_LIMIT) __trap();
        }
    }
    __syncthreads();
}

// The splits' merge at the end of attn_decode, once every block has written its partial results
// (the work of a launch of its own before, attn_combine, whose launch and dependency wait cost
// ~3.8 us a layer at 4K): slices
// of MERGE_DIMS dims of one head over the blocks, 256 for 16 heads, so every block of the
// resident grid takes at most one. Thread t takes dim t mod MERGE_DIMS of the slice and splits
// t / MERGE_DIMS + 8i, 16 of them in flight at once (each with its own maximum, as the warps of
// a block merge), then the 8 split lanes meet: lanes l and l ^ 16 by shuffles, the warps in
// shared memory (`scratch`, 3 x 4 x MERGE_DIMS floats). The sigmoid output gate is applied here.
#define MERGE_DIMS 16
#define MERGE_LANES (32 * WARPS / MERGE_DIMS)
__device__ __forceinline__ void merge_pair(float& M, float& L, float& o, float M2, float L2, float o2) {
    const float Mn = fmaxf(M, M2);
    const float c1 = M == -INFINITY ? 0.f : __expf(M - Mn), c2 = M2 == -INFINITY ? 0.f : __expf(M2 - Mn);
    L = L * c1 + L2 * c2;
    o = o * c1 + o2 * c2;
    M = Mn;
}

// One batch of splits into a running merge (maximum M, sum of weights L, weighted value o): the
// batch's maximum first, then one rescale of the running sums and a weight per split; an empty
// split (maximum -inf) weighs nothing, and a batch of only empty ones changes nothing.
template <int BATCH>
__device__ __forceinline__ void merge_batch(const float2 (&ml)[BATCH], const float (&u)[BATCH], float& M, float& L, float& o) {
    float mb = M;
#pragma unroll
    for (int i = 0; i < BATCH; ++i) mb = fmaxf(mb, ml[i].x);
    if (mb == -INFINITY) return;  // every split so far empty
    const float c = M == -INFINITY ? 0.f : __expf(M - mb);
    L *= c;
    o *= c;
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
        const float w = ml[i].x == -INFINITY ? 0.f : __expf(ml[i].x - mb);
        L = fmaf(ml[i].y, w, L);
        o = fmaf(w, u[i], o);
    }
    M = mb;
}

__device__ __forceinline__ void merge_splits(const DecodeArgs& a, int used, float* scratch) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int slices = a.hq * (D / MERGE_DIMS), split_lane = threadIdx.x / MERGE_DIMS;
    for (int sl = blockIdx.x; sl < slices; sl += gridDim.x) {
        const int h = sl / (D / MERGE_DIMS), d = (sl % (D / MERGE_DIMS)) * MERGE_DIMS + threadIdx.x % MERGE_DIMS;
        const float gate_in = a.qg[h * 2 * D + D + d];
        float M = -INFINITY, L = 0.f, o = 0.f;
        constexpr int BATCH = 16;
        for (int s0 = split_lane; s0 < used; s0 += MERGE_LANES * BATCH) {
            float2 ml[BATCH];
            float u[BATCH];
#pragma unroll
            for (int i = 0; i < BATCH; ++i) {
                // past the splits in use: the last one's loads again, weighed 0 (unpredicated
                // loads, issued together)
                const int s = s0 + MERGE_LANES * i;
                const size_t at = (size_t)h * a.splits + min(s, used - 1);
                ml[i] = reinterpret_cast<const float2*>(a.part_ml)[at];
                u[i] = a.part_acc[at * D + d];
                if (s >= used) ml[i].x = -INFINITY;
            }
            merge_batch(ml, u, M, L, o);
        }
        step_phase(6);  // the slice's splits loaded and merged (each lane its share)
        merge_pair(M, L, o, __shfl_xor_sync(FULL_MASK, M, 16), __shfl_xor_sync(FULL_MASK, L, 16), __shfl_xor_sync(FULL_MASK, o, 16));
        if (lane < MERGE_DIMS) {
            scratch[(0 * WARPS + warp) * MERGE_DIMS + lane] = M;
            scratch[(1 * WARPS + warp) * MERGE_DIMS + lane] = L;
            scratch[(2 * WARPS + warp) * MERGE_DIMS + lane] = o;
        }
        __syncthreads();
        if (threadIdx.x < MERGE_DIMS) {
            for (int w2 = 1; w2 < WARPS; ++w2)
                merge_pair(M, L, o, scratch[(0 * WARPS + w2) * MERGE_DIMS + lane], scratch[(1 * WARPS + w2) * MERGE_DIMS + lane],
                           scratch[(2 * WARPS + w2) * MERGE_DIMS + lane]);
            a.out[h * D + d] = o / L * sigmoidf(gate_in);
        }
        __syncthreads();  // scratch is rewritten by the next slice
    }
}

// The GQA group's scores and weighted values on the tensor cores (mma.sync, f32 accumulate). A
// dot product or a weighted sum does not depend on the order of its terms, so each operand is
// read in whatever order its loads deliver, as long as both sides of a product agree.
// bf16 cache (attn_decode):
//   scores S (16 x 8: heads padded to 16, rows 8..15 zero; 8 positions) = Q (16 x 256) · K^T,
//     16 m16n8k16 steps; step s takes, in lane (g, q), dims 8(4⌊s/2⌋ + q) + 4(s mod 2) + {0,1}
//     (fragment k 2q, 2q+1) and + {2,3} (k 2q + 8, 2q + 9) of both Q row g and K row g.
//   values O^T (256 dims x 8 heads) += V^T (dims x 8 positions) · P^T, 16 m16n8k8 tiles; tile t
//     takes in lane (g, q) word t mod 4 of V piece 8⌊t/4⌋ + g of positions 2q and 2q + 1: its low
//     halves are fragment row g, its high halves row g + 8 (two byte permutes per tile); P^T's
//     fragment (positions 2q, 2q + 1 of head g) is exactly lane (g, q)'s two scores after the
//     softmax, so P never leaves the registers.
//   Lane (g, q) ends holding O[heads 2q, 2q + 1] at dims acc_dim(t, g) (+1 for c2, c3).
//   Q is rounded to bf16 (as K and V are stored) and P to bf16 for the product with V (f32 sums).
// int8 cache (attn_decode_int8): the codes turn into exact f16 (int8_pair_f16), so Q and P are
//   f16 (finer than bf16). Step s = 4u + w takes K word w of piece u: dims 64u + 16q + 4w + {0,1}
//   and + {2,3}; a score is scaled by its K row's scale. Tile 8j + 2w + h takes V word w of piece
//   8j + g of both positions, interleaved by bytes so each word holds a dim's two positions (dims
//   +2h, +2h + 1 of the word); P carries each V row's scale (times V_SCALE_UP).
template <typename Step>
__device__ __forceinline__ void attn_decode_items(const DecodeArgs& a) {
    __shared__ uint2 qfrag[16][32];  // [k step][lane]: Q's a0, a2 (rows 8..15 are zero)
    // a head's row padded by one word: the warps' shares (lane (g, q) stores dims 8g + c of heads
    // 2q, 2q + 1) hit 2 lanes a bank instead of 8; the shares in shared memory 3.6 -> 2.8 us after
    // the release at 4K, 4K +0.6%, 32K +0.5%, 128K +0.5% (bench/results/cuda-decode-route-rows-l2-merge-banks.json)
    __shared__ __align__(16) float merge_acc[WARPS][G][D + 1];
    __shared__ float merge_ml[WARPS][G][2];
    step_overlap_begin();
    // The position moves only between steps, and every K/V row but the newest (position len - 1,
    // appended by attn_prep just before) was written by earlier steps: a block's first loads
    // that stop short of it are issued before the dependency wait, under its predecessors.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int group = a.hq / a.hkv;
    const int len = *a.pos + 1, used = splits_in_use(len, a.splits);
    const int chunk = (len + used - 1) / used;
    bool waited = false;
    // work items (KV head, split) over a grid of resident blocks: no block waits for a slot
    // behind blocks with nothing to do, whatever the context
    for (int item = blockIdx.x; item < a.hkv * used; item += gridDim.x) {
        const int kvh = item % a.hkv, split = item / a.hkv;
        const int p0 = split * chunk, p1 = min(len, p0 + chunk);
        // warp w takes steps of PSTEP positions, WARPS·PSTEP apart; its first step's K/V is
        // requested before Q is staged, the next step's is in flight while one is used
        const int stride = WARPS * PSTEP;
        int p = p0 + warp * PSTEP;
        Step buf[2];
        // the warp's second step too (bf16 cache) when it stops short of the newest row: at 4K a
        // split is 33 positions, and warp 0's one-position second step was a round trip after
        // the wait (4K +0.4%, 32K +0.7%, 128K +0.6%; bench/results/cuda-decode-attn-second-step.json)
        bool second_loaded = false;
        if (!waited && p + PSTEP < len) {
            if (p < p1) load_kv_step(a, kvh, p, p1, buf[0]);
            if (second_step_early(buf) && p + stride < p1 && min(p + stride + PSTEP, p1) < len) {
                load_kv_step(a, kvh, p + stride, p1, buf[1]);
                second_loaded = true;
            }
            step_inputs_ready();
        } else {
            if (!waited) step_inputs_ready();
            if (p < p1) load_kv_step(a, kvh, p, p1, buf[0]);
        }
        waited = true;
        stage_q(a, kvh, buf, qfrag);
        __syncthreads();
        step_phase(2);  // Q staged
        // head g's running maximum (lanes of one g agree) and this lane's share of its sum
        float m = -INFINITY, l = 0.f, acc[16][4];
#pragma unroll
        for (int t = 0; t < 16; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
        // two steps per turn so that the buffers swap roles without a register copy
        for (; p < p1; p += 2 * stride) {
            if (p + stride < p1 && !second_loaded) load_kv_step(a, kvh, p + stride, p1, buf[1]);
            second_loaded = false;
            attend_step(qfrag, buf[0], p, p1, m, l, acc);
            if (p + stride >= p1) break;
            if (p + 2 * stride < p1) load_kv_step(a, kvh, p + 2 * stride, p1, buf[0]);
            attend_step(qfrag, buf[1], p + stride, p1, m, l, acc);
        }
        step_phase(3);  // the item's positions attended
        // merge the warps: common maximum per head, each warp's share scaled to it, summed in a
        // fixed order through shared memory
        l += __shfl_xor_sync(FULL_MASK, l, 1);
        l += __shfl_xor_sync(FULL_MASK, l, 2);
        if (q == 0) {
            merge_ml[warp][g][0] = m;
            merge_ml[warp][g][1] = l;
        }
        __syncthreads();
        float sc[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int h = 2 * q + c;
            float M = -INFINITY;
            for (int w2 = 0; w2 < WARPS; ++w2) M = fmaxf(M, merge_ml[w2][h][0]);
            const float mine = merge_ml[warp][h][0];
            sc[c] = mine == -INFINITY ? 0.f : __expf(mine - M) * acc_unscale(buf);
        }
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            const int d = acc_dim(buf, t, g);
            merge_acc[warp][2 * q][d] = acc[t][0] * sc[0];
            merge_acc[warp][2 * q + 1][d] = acc[t][1] * sc[1];
            merge_acc[warp][2 * q][d + 1] = acc[t][2] * sc[0];
            merge_acc[warp][2 * q + 1][d + 1] = acc[t][3] * sc[1];
        }
        // the split's maximum and weight sum of each head, by lanes 0..3 of warp 0 (two heads
        // each) before the barrier, not by thread 0 for all heads in turn after it: the timeline
        // had 2.5 us from the shares in shared memory to the partial results written; now the
        // launch at 4K is 9.3 -> 7.9 us after its release, 4K +0.6%, 32K +0.4%, 128K +0.2%
        // (bench/results/cuda-decode-attn-meet-acquire.json). The maximum is taken again here:
        // kept from the loop above, beside acc, it made attn_decode spill.
        if (warp == 0 && g == 0) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int h = 2 * q + c;
                if (h >= group) continue;
                float M = -INFINITY, L = 0.f;
                for (int w2 = 0; w2 < WARPS; ++w2) M = fmaxf(M, merge_ml[w2][h][0]);
                for (int w2 = 0; w2 < WARPS; ++w2) {
                    const float mw = merge_ml[w2][h][0];
                    L += mw == -INFINITY ? 0.f : merge_ml[w2][h][1] * __expf(mw - M);
                }
                const size_t at = 2 * ((size_t)(kvh * group + h) * a.splits + split);
                a.part_ml[at] = M;
                a.part_ml[at + 1] = L;
            }
        }
        __syncthreads();
        step_phase(4);  // the warps' shares in shared memory
        // the split's weighted values: each thread's G·D/(32·WARPS) sums 8 at a time, their
        // shared-memory loads in flight together (unrolled whole, attn_decode spilled)
#pragma unroll 8
        for (int j = 0; j < G * D / (32 * WARPS); ++j) {
            const int i = threadIdx.x + j * 32 * WARPS, h = i / D, d = i % D;
            if (h < group) {
                float o = 0.f;
#pragma unroll
                for (int w2 = 0; w2 < WARPS; ++w2) o += merge_acc[w2][h][d];
                a.part_acc[((size_t)(kvh * group + h) * a.splits + split) * D + d] = o;
            }
        }
        __syncthreads();  // qfrag and merge_* are rewritten by the next item
    }
    // every split's partial result written, the blocks meet, then merge the splits
    if (!waited) step_inputs_ready();  // the gate's input, from the attention in_proj
    grid_meet(a.meet);
    step_phase(5);  // met
    merge_splits(a, used, &merge_acc[0][0][0]);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) attn_decode(DecodeArgs a) { attn_decode_items<KvStep>(a); }
extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) attn_decode_int8(DecodeArgs a) { attn_decode_items<KvStepInt8>(a); }
