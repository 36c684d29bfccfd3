// Gated full attention, prefill of a chunk of T tokens at positions P..P+T-1 (model-spec §3.5):
//   attn_prep_rows — per token and head: q/k RMSNorm, partial RoPE, q to bf16 [T, Hq, D]; K and V
//                    appended to the bf16 cache. Grid (T, Hq + Hkv), D threads.
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
#include "common.cuh"

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
    __nv_bfloat16* k_cache;   // [max_pos, Hkv, D]
    __nv_bfloat16* v_cache;
    float eps, theta;
    int start, hq, hkv, rotary;
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
    if (is_q) {
        a.q_out[((size_t)t * a.hq + head) * D + d] = __float2bfloat16(val);
    } else {
        const size_t at = ((size_t)pos * a.hkv + head) * D + d;
        a.k_cache[at] = __float2bfloat16(val);
        a.v_cache[at] = __float2bfloat16(a.v[((size_t)t * a.hkv + head) * D + d]);
    }
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
    asm volatile("cp.async.commit_group;\n" ::);

    const int row_a = warp * 16 + g, row_b = row_a + 8;  // this thread's two query rows
    const int qpos_a = a.start + m0 + row_a, qpos_b = a.start + m0 + row_b;
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float mx_a = -INFINITY, mx_b = -INFINITY, sum_a = 0.f, sum_b = 0.f;
    // ldmatrix row addresses of this lane
    const int q_row = warp * 16 + (lane & 15), q_col = (lane >> 4) * 8;
    const int k_row = (lane & 7) + ((lane >> 4) << 3), k_col = ((lane >> 3) & 1) * 8;
    const int v_row = lane & 15, v_col = (lane >> 4) * 8;

    const int tiles = (n_keys + KT - 1) / KT;
    for (int it = 0; it < tiles; ++it) {
        const int k0 = it * KT, buf = it & 1;
        if (it + 1 < tiles) load_kv(k0 + KT, buf ^ 1);
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
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
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            tmax_a = fmaxf(tmax_a, __shfl_xor_sync(FULL_MASK, tmax_a, off));
            tmax_b = fmaxf(tmax_b, __shfl_xor_sync(FULL_MASK, tmax_b, off));
        }
        const float new_a = fmaxf(mx_a, tmax_a), new_b = fmaxf(mx_b, tmax_b);
        // rows with nothing visible yet keep a finite reference so exp2 never sees inf - inf
        const float ref_a = new_a == -INFINITY ? 0.f : new_a, ref_b = new_b == -INFINITY ? 0.f : new_b;
        const float corr_a = exp2f(mx_a - ref_a), corr_b = exp2f(mx_b - ref_b);
        mx_a = new_a;
        mx_b = new_b;
        sum_a *= corr_a;
        sum_b *= corr_b;
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
            sum_a += p0 + p1;
            sum_b += p2 + p3;
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
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        sum_a += __shfl_xor_sync(FULL_MASK, sum_a, off);
        sum_b += __shfl_xor_sync(FULL_MASK, sum_b, off);
    }
    const float inv_a = sum_a > 0.f ? 1.f / sum_a : 0.f, inv_b = sum_b > 0.f ? 1.f / sum_b : 0.f;
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
