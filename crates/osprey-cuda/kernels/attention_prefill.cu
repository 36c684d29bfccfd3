// Gated full attention, prefill of a chunk of T tokens at positions P..P+T-1 (model-spec §3.5):
//   attn_prep_rows — per token and head: q/k RMSNorm, partial RoPE, q to bf16 [T, Hq, D]; K and V
//                    appended to the cache (bf16, or int8 rows with a scale each). Grid
//                    (T, Hq + Hkv), D threads.
//   kv_expand_int8 — with the int8 cache: its rows up to the chunk's end as bf16 in a scratch
//                    buffer the attention then reads in place of the cache (prefill within
//                    0.6% of the bf16 cache's at 4K-128K: cuda-prefill-int8kv-ab.json).
//   attn_prefill   — causal flash attention on the tensor cores. A block owns 128 queries of one
//                    query head (8 warps x 16 rows) and walks the keys 0..P+T-1 of its KV head
//                    (GQA: Hq/Hkv query heads share a KV head, whose tiles then come from L2;
//                    earlier chunks' keys come from the cache) in tiles of 64, double-buffered
//                    with cp.async: S = Q·Kᵀ with mma.sync m16n8k16 (bf16, fp32 accumulate),
//                    online softmax in fp32 registers (exp2, scaled by log2 e), P kept in
//                    registers as the A operand of O += P·V. Fragments come from shared memory by
//                    ldmatrix (V through its transposing form, so V stays row-major). The
//                    epilogue divides by the row sums and applies the sigmoid output gate,
//                    writing f32 [T, Hq·D]. Query tiles run last-first (the causal tail is the
//                    longest).
// Shapes: D = 256; shared memory Q 128x264 + 2 x (K 64x264 + V 64x264) bf16 (~198 KB, dynamic,
// opted in by the host). Registers: O is 16x256 fp32 per warp (128 per thread).
// Ceiling: bf16 mma ~790 TFLOP/s (gpu.md); causal work is 4·T·(P + T/2)·D FLOP per head.
// Measured (H200, commit 7bf2668): 4K prompt, 10 layers, 1.37 TFLOP in 8.8 ms = 156 TFLOP/s
// (20%); the first version (64-query blocks, synchronous loads, scalar fragment loads) took 38 ms.
// attn_prefill_wgmma (bottom of the file) is the default since commit 93b0802: 7.8 ms at 4K, and
// 288 TFLOP/s (36%) on the last 4K chunk of a 128K prompt against 255 for this kernel
// (bench/kernels/attn_prefill.cu, bench/results/cuda-prefill-attention-wgmma.json); with its K
// tiles by TMA 421 TFLOP/s on that chunk, with K and V by TMA 656 TFLOP/s (83%; 30.1 -> 13.2 ms)
// and 4.5 ms at 4K (cuda-prefill-attention-kv-tma.json).
#include "common.cuh"
#include "wgmma.cuh"

#define D 256
#define QT 128
#define KT 64
#define QK_STRIDE (D + 8)

struct AttnPrepRowsArgs {
    const float* qg;          // [T, Hq, 2D]: per head D query then D gate values
    const float* k;           // [T, Hkv·D]
    const float* v;           // [T, Hkv·D]
    const float* q_norm;      // [D]
    const float* k_norm;      // [D]
    __nv_bfloat16* q_out;     // [T, Hq, D]
    void* k_cache;            // [max_pos, Hkv, D]: bf16, or biased int8 codes when k_scale is set
    void* v_cache;
    float* k_scale;           // int8 cache: [Hkv, max_pos] row scales (store_int8_row); else null
    float* v_scale;
    float eps, theta;
    int start, hq, hkv, rotary, max_pos;
};

extern "C" __global__ void __launch_bounds__(D) attn_prep_rows(AttnPrepRowsArgs a) {
    __shared__ float x[D], scratch[32];
    const int t = blockIdx.x, b = blockIdx.y, d = threadIdx.x, pos = a.start + t;
    const bool is_q = b < a.hq;
    const int head = is_q ? b : b - a.hq;
    float val = is_q ? a.qg[((size_t)t * a.hq + head) * 2 * D + d] : a.k[((size_t)t * a.hkv + head) * D + d];
    const float ss = block_sum(val * val, scratch);
    val *= rsqrtf(ss / D + a.eps) * (is_q ? a.q_norm[d] : a.k_norm[d]);
    x[d] = val;
    __syncthreads();
    const int half = a.rotary / 2;
    if (d < a.rotary) {
        const int f = d < half ? d : d - half;
        const float inv = 1.f / powf(a.theta, (float)(2 * f) / (float)a.rotary);
        float s, c;
        sincosf((float)pos * inv, &s, &c);
        val = d < half ? x[d] * c - x[d + half] * s : x[d] * c + x[d - half] * s;
    }
    const float v_val = is_q ? 0.f : a.v[((size_t)t * a.hkv + head) * D + d];
    if (is_q) {
        a.q_out[((size_t)t * a.hq + head) * D + d] = __float2bfloat16(val);
    } else if (a.k_scale) {
        const size_t row = ((size_t)pos * a.hkv + head) * D;
        const size_t at = (size_t)head * a.max_pos + pos;
        store_int8_row(val, static_cast<uint8_t*>(a.k_cache) + row, a.k_scale + at, scratch);
        store_int8_row(v_val, static_cast<uint8_t*>(a.v_cache) + row, a.v_scale + at, scratch);
    } else {
        const size_t at = ((size_t)pos * a.hkv + head) * D + d;
        static_cast<__nv_bfloat16*>(a.k_cache)[at] = __float2bfloat16(val);
        static_cast<__nv_bfloat16*>(a.v_cache)[at] = __float2bfloat16(v_val);
    }
}

struct KvExpandArgs {
    const uint8_t* k_cache;   // [max_pos, Hkv, D] biased int8 codes
    const uint8_t* v_cache;
    const float* k_scale;     // [Hkv, max_pos]
    const float* v_scale;
    __nv_bfloat16* k_out;     // [positions, Hkv, D]
    __nv_bfloat16* v_out;
    int positions, hkv, max_pos;
};

// The int8 cache's first `positions` rows as bf16 for the prefill attention (which reads bf16
// tiles by TMA): code times its row's scale, rounded to bf16. Grid (ceil(positions·Hkv·D / 8 /
// 256), 2: K, V), 256 threads, 8 codes a thread (one 8-byte load, one 16-byte store).
extern "C" __global__ void __launch_bounds__(256) kv_expand_int8(KvExpandArgs a) {
    const bool is_v = blockIdx.y == 1;
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= (size_t)a.positions * a.hkv * D) return;
    const size_t row = i / D;
    const int pos = (int)(row / a.hkv), head = (int)(row % a.hkv);
    const float s = (is_v ? a.v_scale : a.k_scale)[(size_t)head * a.max_pos + pos];
    const uint2 codes = *reinterpret_cast<const uint2*>((is_v ? a.v_cache : a.k_cache) + i);
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint32_t w = j < 2 ? codes.x : codes.y;
        const int n = 2 * (j % 2);
        o[j] = pack_bf16((byte_code(w, n) - 128.f) * s, (byte_code(w, n + 1) - 128.f) * s);
    }
    *reinterpret_cast<uint4*>((is_v ? a.v_out : a.k_out) + i) = out;
}

struct AttnPrefillArgs {
    const __nv_bfloat16* q;        // [T, Hq, D]
    const __nv_bfloat16* k_cache;  // [max_pos, Hkv, D]
    const __nv_bfloat16* v_cache;
    const float* qg;               // [T, Hq, 2D] (the gate half)
    float* out;                    // [T, Hq·D]
    float scale_log2;              // 1/sqrt(D) · log2(e)
    int T, start, hq, hkv;
};


// The online softmax of a thread's two query rows (a: fragment row g, b: g + 8) in both
// attention kernels: running maxima and sums over the key tiles seen so far.
struct RowPairSoftmax {
    float mx_a = -INFINITY, mx_b = -INFINITY, sum_a = 0.f, sum_b = 0.f;
    // Folds in a tile whose row maxima are tmax_a / tmax_b over this thread's keys (reduced over the
    // quad here): returns the references the tile's exponentials subtract (finite even for a row
    // with nothing visible yet, so exp2 never sees inf - inf) and the factors that rescale what
    // was accumulated before; the sums are rescaled here.
    __device__ __forceinline__ void fold(float tmax_a, float tmax_b, float& ref_a, float& ref_b, float& corr_a,
                                         float& corr_b) {
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            tmax_a = fmaxf(tmax_a, __shfl_xor_sync(FULL_MASK, tmax_a, off));
            tmax_b = fmaxf(tmax_b, __shfl_xor_sync(FULL_MASK, tmax_b, off));
        }
        const float new_a = fmaxf(mx_a, tmax_a), new_b = fmaxf(mx_b, tmax_b);
        ref_a = new_a == -INFINITY ? 0.f : new_a;
        ref_b = new_b == -INFINITY ? 0.f : new_b;
        corr_a = exp2f(mx_a - ref_a);
        corr_b = exp2f(mx_b - ref_b);
        mx_a = new_a;
        mx_b = new_b;
        sum_a *= corr_a;
        sum_b *= corr_b;
    }
    // 1 / row sum over the quad (0 for a row that saw nothing)
    __device__ __forceinline__ void inverse_sums(float& inv_a, float& inv_b) {
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            sum_a += __shfl_xor_sync(FULL_MASK, sum_a, off);
            sum_b += __shfl_xor_sync(FULL_MASK, sum_b, off);
        }
        inv_a = sum_a > 0.f ? 1.f / sum_a : 0.f;
        inv_b = sum_b > 0.f ? 1.f / sum_b : 0.f;
    }
};

#define AWARPS 8

extern "C" __global__ void __launch_bounds__(AWARPS * 32, 1) attn_prefill(AttnPrefillArgs a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Qs = reinterpret_cast<__nv_bfloat16*>(smem);
    __nv_bfloat16* Ks = Qs + QT * QK_STRIDE;       // [2][KT][QK_STRIDE]
    __nv_bfloat16* Vs = Ks + 2 * KT * QK_STRIDE;   // [2][KT][QK_STRIDE]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * QT, h = blockIdx.y, kvh = h / (a.hq / a.hkv);
    const int n_keys = min(a.start + m0 + QT, a.start + a.T);

    for (int c = tid; c < QT * D / 8; c += AWARPS * 32) {
        const int r = c / (D / 8), col = (c % (D / 8)) * 8;
        const bool ok = m0 + r < a.T;
        cp_async16(Qs + r * QK_STRIDE + col, a.q + ((size_t)(ok ? m0 + r : 0) * a.hq + h) * D + col, ok);
    }
    auto load_kv = [&](int k0, int buf) {
        for (int c = tid; c < KT * D / 8; c += AWARPS * 32) {
            const int r = c / (D / 8), col = (c % (D / 8)) * 8;
            const bool ok = k0 + r < n_keys;
            const size_t at = ((size_t)(ok ? k0 + r : 0) * a.hkv + kvh) * D + col;
            cp_async16(Ks + (buf * KT + r) * QK_STRIDE + col, a.k_cache + at, ok);
            cp_async16(Vs + (buf * KT + r) * QK_STRIDE + col, a.v_cache + at, ok);
        }
    };
    load_kv(0, 0);
    cp_async_commit();

    const int row_a = warp * 16 + g, row_b = row_a + 8;  // this thread's two query rows
    const int qpos_a = a.start + m0 + row_a, qpos_b = a.start + m0 + row_b;
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    RowPairSoftmax rows;
    // ldmatrix row addresses of this lane
    const int q_row = warp * 16 + (lane & 15), q_col = (lane >> 4) * 8;
    const int k_row = (lane & 7) + ((lane >> 4) << 3), k_col = ((lane >> 3) & 1) * 8;
    const int v_row = lane & 15, v_col = (lane >> 4) * 8;

    const int tiles = (n_keys + KT - 1) / KT;
    for (int it = 0; it < tiles; ++it) {
        const int k0 = it * KT, buf = it & 1;
        if (it + 1 < tiles) load_kv(k0 + KT, buf ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const __nv_bfloat16* Kb = Ks + buf * KT * QK_STRIDE;
        const __nv_bfloat16* Vb = Vs + buf * KT * QK_STRIDE;

        // S = Q Kᵀ for this warp's 16 rows x 64 keys
        float s[KT / 8][4];
#pragma unroll
        for (int n = 0; n < KT / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll 4
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t qa[4];
            ldsm_x4(qa, Qs + q_row * QK_STRIDE + kk * 16 + q_col);
#pragma unroll
            for (int n = 0; n < KT / 8; n += 2) {
                uint32_t kb[4];
                ldsm_x4(kb, Kb + (n * 8 + k_row) * QK_STRIDE + kk * 16 + k_col);
                mma_bf16(s[n], qa[0], qa[1], qa[2], qa[3], kb[0], kb[1]);
                mma_bf16(s[n + 1], qa[0], qa[1], qa[2], qa[3], kb[2], kb[3]);
            }
        }
        // mask, scale, online softmax (rows a: elements 0,1; rows b: 2,3)
        float tmax_a = -INFINITY, tmax_b = -INFINITY;
#pragma unroll
        for (int n = 0; n < KT / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int kp = k0 + n * 8 + 2 * q + (e & 1);
                const int qp = e < 2 ? qpos_a : qpos_b;
                const float v = (kp <= qp && kp < n_keys) ? s[n][e] * a.scale_log2 : -INFINITY;
                s[n][e] = v;
                if (e < 2) tmax_a = fmaxf(tmax_a, v); else tmax_b = fmaxf(tmax_b, v);
            }
        float ref_a, ref_b, corr_a, corr_b;
        rows.fold(tmax_a, tmax_b, ref_a, ref_b, corr_a, corr_b);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= corr_a; o[n][1] *= corr_a;
            o[n][2] *= corr_b; o[n][3] *= corr_b;
        }
        uint32_t pf[KT / 8][2];
#pragma unroll
        for (int n = 0; n < KT / 8; ++n) {
            const float p0 = exp2f(s[n][0] - ref_a), p1 = exp2f(s[n][1] - ref_a);
            const float p2 = exp2f(s[n][2] - ref_b), p3 = exp2f(s[n][3] - ref_b);
            rows.sum_a += p0 + p1;
            rows.sum_b += p2 + p3;
            pf[n][0] = pack_bf16(p0, p1);
            pf[n][1] = pack_bf16(p2, p3);
        }
        // O += P V: k-tiles of 16 keys are pairs of S n-tiles
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            const uint32_t a0 = pf[2 * kk][0], a1 = pf[2 * kk][1], a2 = pf[2 * kk + 1][0], a3 = pf[2 * kk + 1][1];
#pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                uint32_t vb[4];
                ldsm_x4_trans(vb, Vb + (kk * 16 + v_row) * QK_STRIDE + n * 8 + v_col);
                mma_bf16(o[n], a0, a1, a2, a3, vb[0], vb[1]);
                mma_bf16(o[n + 1], a0, a1, a2, a3, vb[2], vb[3]);
            }
        }
        __syncthreads();
    }
    float inv_a, inv_b;
    rows.inverse_sums(inv_a, inv_b);
    const int ta = m0 + row_a, tb = m0 + row_b;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int d = n * 8 + 2 * q;
        if (ta < a.T) {
            const float* gate = a.qg + ((size_t)ta * a.hq + h) * 2 * D + D + d;
            float* out = a.out + (size_t)ta * a.hq * D + h * D + d;
            out[0] = o[n][0] * inv_a * sigmoidf(gate[0]);
            out[1] = o[n][1] * inv_a * sigmoidf(gate[1]);
        }
        if (tb < a.T) {
            const float* gate = a.qg + ((size_t)tb * a.hq + h) * 2 * D + D + d;
            float* out = a.out + (size_t)tb * a.hq * D + h * D + d;
            out[0] = o[n][2] * inv_b * sigmoidf(gate[0]);
            out[1] = o[n][3] * inv_b * sigmoidf(gate[1]);
        }
    }
}

// ---- attn_prefill_wgmma: the same attention on warpgroup MMA ------------------------------------
// Block = 2 warpgroups x 64 queries of one query head (128 queries, like attn_prefill), keys in
// tiles of 64, double-buffered. Per tile and warpgroup: S = Q·Kᵀ as 16 wgmma m64n64k16 with Q and
// K from shared memory (Q in K-major core matrices: 16-byte column chunk kc of row r at
// kc·rows·16 + r·16; K as four 64-dim chunks of 64 keys x 128 bytes in the 128-byte swizzle), the
// online softmax on S in registers (each warp holds its 16 rows in the m16n8 accumulator layout),
// then O += P·V as 4 wgmma m64n256k16 with P from registers (the accumulator layout is the
// A-fragment layout of the same rows) and V from shared memory MN-major (the same four swizzled
// 64-dim chunks as K, read transposed). The mma.sync kernel above reads every K and V
// tile once per warp of 16 queries through ldmatrix; here the tensor cores read them once per
// warpgroup of 64 queries. Step it issues S(it) and P(it - 1)·V(it - 1) together and computes the
// softmax of S(it) while the second runs (O is rescaled after it lands; P double-buffered in
// registers), so the tensor cores are busy during the exponentials. Both warpgroups walk
// all the block's tiles (the first one's last tile is wholly masked: its P is zero; skipping it
// would make the wgmma issue divergent, which the compiler serialises); only tiles that cross a
// warpgroup's diagonal are masked.
// Shared memory: Q 128 x 256 + 2 x (K 64 x 256 + V 64 x 256) bf16 = 192 KB; K(it) and V(it) in
// buffer it % 2, K two steps ahead, V one. Registers: O 128, S 32, P 2 x 16 per thread.
// K and V come by TMA (3-D tensor maps over the caches [positions][KV heads][D], four boxes of 64
// dims x 64 keys per tile in the 128-byte swizzle, thread 0 issuing, an mbarrier per buffer; keys
// past the chunk lie outside the maps and read as zeros: a masked key's P is 0, but 0 times a
// stale NaN would not be), Q by cp.async.
#define WG_QT 128
#define WG_Q_BYTES (WG_QT * D * 2)
#define WG_KV_BYTES (KT * D * 2)
// V's descriptor (MN-major, 128-byte swizzle: 64-dim rows of 128 bytes, 8 keys per 1,024-byte
// atom): LBO between the 64-dim chunks, SBO between 8-key groups (checked on the H200: outputs
// bit-identical to attn_prefill's; with the roles swapped, relative RMS 1.2)
#define ATTN_V_LBO (KT * 128)
#define ATTN_V_SBO 1024

// attn_prefill_wgmma's parameters: the attention's, and the tensor maps of the K and V caches
// viewed as [start + T positions][KV heads][D] (boxes of 64 dims x 1 head x 64 keys, 128-byte
// swizzle; keys past the chunk read as zeros).
struct WgmmaAttnArgs {
    AttnPrefillArgs a;
    TensorMap k, v;
};

extern "C" __global__ void __launch_bounds__(256, 1) attn_prefill_wgmma(const __grid_constant__ WgmmaAttnArgs args) {
    extern __shared__ __align__(1024) unsigned char smem_wg[];
    const AttnPrefillArgs& a = args.a;
    unsigned char* Qs = smem_wg;                 // [32 kc][128 queries][16 B]
    unsigned char* Ks = Qs + WG_Q_BYTES;         // [2][4 dim chunks][64 keys][128 B], swizzled
    unsigned char* Vs = Ks + 2 * WG_KV_BYTES;    // [2][4 dim chunks][64 keys][128 B], swizzled
    uint64_t* k_landed = reinterpret_cast<uint64_t*>(Vs + 2 * WG_KV_BYTES);  // [buffer]
    uint64_t* v_landed = k_landed + 2;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3, wg = warp >> 2;
    const int m0 = (gridDim.x - 1 - blockIdx.x) * WG_QT, h = blockIdx.y, kvh = h / (a.hq / a.hkv);
    const int n_keys = min(a.start + m0 + WG_QT, a.start + a.T);
    if (tid == 0) {
        for (int i = 0; i < 2; ++i) {
            mbar_init(&k_landed[i], 1);
            mbar_init(&v_landed[i], 1);
        }
        mbar_init_fence();
    }
    __syncthreads();

    // copies: lane pairs read one 32-byte sector (chunks 2i, 2i + 1 of a row), a warp 16 rows, so
    // its shared-memory writes fill four whole 128-byte lines
    for (int c = tid; c < WG_QT * D / 8; c += 256) {
        const int pair = c >> 1, r = pair % WG_QT, kc = 2 * (pair / WG_QT) + (c & 1);
        const bool ok = m0 + r < a.T;
        cp_async16(Qs + kc * (WG_QT * 16) + r * 16, a.q + ((size_t)(ok ? m0 + r : 0) * a.hq + h) * D + kc * 8, ok);
    }
    // this thread's query rows (block rows row_a and row_a + 8) and its warpgroup's first position
    const int row_a = 64 * wg + 16 * (warp & 3) + g;
    const int qpos_a = a.start + m0 + row_a, qpos_b = qpos_a + 8;
    const int wg_first = a.start + m0 + 64 * wg;
    const int tiles = (n_keys + KT - 1) / KT;
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    RowPairSoftmax rows;

    // S(it) = Q K(it)ᵀ into s: s[4j + 2h + e] is row row_a + 8h, key 64·it + 8j + 2q + e; K(it)
    // waited for first (its TMA copies land on the buffer's mbarrier)
    auto issue_scores = [&](float (&s)[32], int it) {
        const unsigned char* Kb = Ks + (it & 1) * WG_KV_BYTES;
        mbar_wait(&k_landed[it & 1], (it >> 1) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_m64n64k16_ss(s, wg_desc(Qs + 2 * kk * (WG_QT * 16) + wg * 64 * 16, WG_QT * 16, 128),
                               wg_desc_sw128(Kb + (kk >> 2) * (KT * 128) + (kk & 3) * 32), kk > 0);
        wgmma_commit();
    };
    // O += P(it) V(it)
    auto issue_values = [&](const uint32_t (&pf)[KT / 16][4], int it) {
        const unsigned char* Vb = Vs + (it & 1) * WG_KV_BYTES;
        mbar_wait(&v_landed[it & 1], (it >> 1) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk)
            wgmma_m64n256k16_rs_tb(o, pf[kk], wg_desc(Vb + kk * 16 * 128, ATTN_V_LBO, ATTN_V_SBO) | ((uint64_t)1 << 62));
        wgmma_commit();
    };
    // the online softmax of S(it): running maxima and sums updated, P(it) as the A fragments of
    // the k16 steps (step kk covers S columns 16kk.., n-blocks 2kk and 2kk + 1); returns the
    // factors that rescale O (rows a, b) to the new maxima
    auto softmax = [&](const float (&s)[32], uint32_t (&pf)[KT / 16][4], int it, float& corr_a, float& corr_b) {
        const int k0 = it * KT;
        const bool diagonal = k0 + KT > wg_first;  // some key of the tile follows some query
        float x[32];
        float tmax_a = -INFINITY, tmax_b = -INFINITY;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int kp = k0 + 8 * (i >> 2) + 2 * q + (i & 1);
            const bool row_b = i & 2;
            x[i] = (!diagonal || kp <= (row_b ? qpos_b : qpos_a)) ? s[i] * a.scale_log2 : -INFINITY;
            if (row_b) tmax_b = fmaxf(tmax_b, x[i]);
            else tmax_a = fmaxf(tmax_a, x[i]);
        }
        float ref_a, ref_b;
        rows.fold(tmax_a, tmax_b, ref_a, ref_b, corr_a, corr_b);
#pragma unroll
        for (int j = 0; j < KT / 8; ++j) {
            const float p0 = exp2f(x[4 * j] - ref_a), p1 = exp2f(x[4 * j + 1] - ref_a);
            const float p2 = exp2f(x[4 * j + 2] - ref_b), p3 = exp2f(x[4 * j + 3] - ref_b);
            rows.sum_a += p0 + p1;
            rows.sum_b += p2 + p3;
            pf[j >> 1][2 * (j & 1)] = pack_bf16(p0, p1);
            pf[j >> 1][2 * (j & 1) + 1] = pack_bf16(p2, p3);
        }
    };
    // K(it) and V(it) go to buffer it % 2: K(it) once S(it - 2) is done, V(it) once P(it - 2) V(it - 2)
    // is, both known at the barrier ending step it - 2 (K) or it - 1 (V)
    // 64 keys' K or V rows from key 64·it of the KV head: four boxes of 64 dims into buffer it % 2
    auto load_tile = [&](unsigned char* buffers, const TensorMap* map, uint64_t* landed, int it) {
        if (tid != 0) return;
        unsigned char* dst = buffers + (it & 1) * WG_KV_BYTES;
        mbar_arrive_expect_bytes(&landed[it & 1], WG_KV_BYTES);
        for (int c = 0; c < D / 64; ++c) tma_load_3d(dst + c * (KT * 128), map, 64 * c, kvh, it * KT, &landed[it & 1]);
    };
    auto load_k = [&](int it) { load_tile(Ks, &args.k, k_landed, it); };
    auto load_v = [&](int it) { load_tile(Vs, &args.v, v_landed, it); };
    // Step it (>= 1): S(it) and P(it - 1) V(it - 1) issued together; the softmax of S(it) runs
    // while the second is still on the tensor cores; O is rescaled once it has landed. Then K(it + 2)
    // and V(it + 1) are copied in, a whole step ahead of their use.
    auto step = [&](uint32_t (&pf_prev)[KT / 16][4], uint32_t (&pf)[KT / 16][4], int it) {
        float s[32];
        issue_scores(s, it);
        issue_values(pf_prev, it - 1);
        wgmma_wait<1>();
        fence_accumulators(s);
        float corr_a, corr_b;
        softmax(s, pf, it, corr_a, corr_b);
        wgmma_wait<0>();
        fence_accumulators(o);
        // deep into a long context a row's maximum rarely moves: skip the 128 multiplies then
        if (__any_sync(FULL_MASK, corr_a != 1.f || corr_b != 1.f)) {
#pragma unroll
            for (int i = 0; i < 128; ++i) o[i] *= (i & 2) ? corr_b : corr_a;
        }
        __syncthreads();  // every warpgroup's wgmma of the buffers about to be refilled retired
        if (it + 2 < tiles) load_k(it + 2);
        if (it + 1 < tiles) load_v(it + 1);
    };

    load_k(0);
    load_v(0);
    if (tiles > 1) load_k(1);
    // Q's copies (the only ones by cp.async) landed and visible to the tensor cores
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    uint32_t pf0[KT / 16][4], pf1[KT / 16][4];
    {
        float s[32];
        issue_scores(s, 0);
        wgmma_wait<0>();
        fence_accumulators(s);
        float corr_a, corr_b;  // O is still zero
        softmax(s, pf0, 0, corr_a, corr_b);
        __syncthreads();
        if (tiles > 2) load_k(2);
        if (tiles > 1) load_v(1);
    }
    int it = 1;
    for (; it + 1 < tiles; it += 2) {
        step(pf0, pf1, it);
        step(pf1, pf0, it + 1);
    }
    if (it < tiles) {
        step(pf0, pf1, it);
        issue_values(pf1, it);
    } else {
        issue_values(pf0, it - 1);
    }
    wgmma_wait<0>();
    fence_accumulators(o);
    float inv_a, inv_b;
    rows.inverse_sums(inv_a, inv_b);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int t = m0 + row_a + 8 * hh;
        if (t >= a.T) continue;
        const float inv = hh ? inv_b : inv_a;
        const float* gate = a.qg + ((size_t)t * a.hq + h) * 2 * D + D;
        float* out = a.out + (size_t)t * a.hq * D + h * D;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            const int d = 8 * j + 2 * q;
            const float2 gt = *reinterpret_cast<const float2*>(gate + d);
            *reinterpret_cast<float2*>(out + d) =
                make_float2(o[4 * j + 2 * hh] * inv * sigmoidf(gt.x), o[4 * j + 2 * hh + 1] * inv * sigmoidf(gt.y));
        }
    }
}
