// Gated DeltaNet prefill over a chunk of T tokens starting at position P (model-spec §3.4):
//   gdn_conv       — causal depthwise conv (kernel K) over the chunk, reading the K-1 earlier
//                    inputs from the conv state, + SiLU. Grid (T, conv_dim/256).
//   gdn_conv_state — the last K-1 inputs become the conv state of position P+T (the decode step's
//                    parity buffer). One thread per channel, rows in ascending order, so it is
//                    safe when the state buffer read and the one written are the same.
//   gdn_qk_gates   — L2 norm of q and k per key head (q also scaled by 1/sqrt(Dk)), in place,
//                    and q·k; per value head β = sigmoid(b), the decay
//                    exp(-exp(A_log)·softplus(a + dt_bias)) and its key head's q·k. Grid T, 8 warps.
//   gdn_scan       — the gated delta rule, token by token, with the fp32 state in registers:
//                    a warp owns 2 state columns (value dims) of one head; lane l holds rows
//                    4l..4l+3 of them (8 floats), loaded once per chunk and stored once. Per
//                    token, with S the state before the token and g its decay:
//                      m = g·Sᵀk, a = g·Sᵀq (one reduction round for both), d = β(v − m),
//                      o = a + (q·k)·d, S ← g·S + k dᵀ
//                    so the output needs no second reduction after the update. The 2-column
//                    reductions transpose as they go (5 shuffles instead of 10; lane 16c ends
//                    with column c), then d is broadcast. The block's inputs (q, k of its key
//                    head, its 16 v columns, β/decay/q·k) stream through shared memory 16 tokens
//                    at a time with cp.async, double-buffered: global latency (~1 us under load)
//                    is far longer than one token of work. Grid (Hv, Dv/16), 8 warps per block:
//                    2048 warps in all, so each scheduler has several independent chains
//                    (measured: 4 columns per warp, 1024 warps, issued only half the cycles).
//   gdn_chunk_prep / gdn_chunk_scan — the same recurrence in the chunked (WY) form, chunks of 64
//                    tokens, all fp32 on the CUDA cores (see below). The first version was slower
//                    than the scan at every length (H200, 4K prompt, 30 layers: prep 21.7 ms +
//                    scan 40.8 ms vs 34.7 ms; its inner loops waited on global loads); this one
//                    stages every chunk's inputs in shared memory and is closer but still slower
//                    (4K prompt: 21.2K vs 23.0K tok/s end to end, commit 9a9dbcb,
//                    bench/results/cuda-prefill-gdn-forms.json). `osprey bench prefill` times both.
// Shapes: Dk = Dv = 128, Hv value heads over Hk key heads (value head h reads key head h/(Hv/Hk)).
// Ceiling: the scan is a dependent chain per token (two warp reductions); the state traffic is
// 64 KB per head per chunk, not per token. Measured (H200, commit 7bf2668, 4K prompt): scan
// 1.15 ms per layer (0.28 us per token; 2.9 ms in the first version with global loads one token
// ahead); conv + norms + gates 0.25 ms per layer for ~400 MB moved (~1.6 TB/s).
#include "common.cuh"

#define DK 128
#define DV 128

struct GdnPrefillArgs {
    const float* qkv;      // [T, conv_dim] projections (pre-conv)
    float* conv_out;       // [T, conv_dim] after conv + SiLU (q, k normalised in place later)
    const float* conv_w;   // [conv_dim, K]
    const float* state_in; // [(K-1), conv_dim] conv state at position P
    float* state_out;      // [(K-1), conv_dim] conv state at position P+T
    const float* b;        // [T, Hv]
    const float* a;        // [T, Hv]
    const float* a_log;    // [Hv]
    const float* dt_bias;  // [Hv]
    float* gates;          // [T, Hv, 4]: β, decay, q·k of the key head, log decay
    float* state;          // [Hv, Dk, Dv] recurrent state
    float* o;              // [T, Hv·Dv]
    int T, conv_dim, kernel, hk, hv;
};

// input e(i) of the extended sequence [conv state rows, chunk rows] at channel c
__device__ __forceinline__ float conv_input(const GdnPrefillArgs& p, int i, int c) {
    const int K1 = p.kernel - 1;
    return i < K1 ? p.state_in[(size_t)i * p.conv_dim + c] : p.qkv[(size_t)(i - K1) * p.conv_dim + c];
}

extern "C" __global__ void gdn_conv(GdnPrefillArgs p) {
    const int t = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= p.conv_dim) return;
    float s = 0.f;
    for (int j = 0; j < p.kernel; ++j) s = fmaf(p.conv_w[c * p.kernel + j], conv_input(p, t + j, c), s);
    p.conv_out[(size_t)t * p.conv_dim + c] = siluf(s);
}

extern "C" __global__ void gdn_conv_state(GdnPrefillArgs p) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.conv_dim) return;
    for (int i = 0; i < p.kernel - 1; ++i) p.state_out[(size_t)i * p.conv_dim + c] = conv_input(p, p.T + i, c);
}

extern "C" __global__ void __launch_bounds__(256) gdn_qk_gates(GdnPrefillArgs p) {
    __shared__ float qk[64];
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* row = p.conv_out + (size_t)t * p.conv_dim;
    for (int kh = warp; kh < p.hk; kh += 8) {
        float4* qp = reinterpret_cast<float4*>(row + kh * DK) + lane;
        float4* kp = reinterpret_cast<float4*>(row + (p.hk + kh) * DK) + lane;
        float4 q = *qp, k = *kp;
        const float qi = rsqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f) * rsqrtf((float)DK);
        const float ki = rsqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
        q.x *= qi; q.y *= qi; q.z *= qi; q.w *= qi;
        k.x *= ki; k.y *= ki; k.z *= ki; k.w *= ki;
        *qp = q;
        *kp = k;
        const float dot = warp_sum(q.x * k.x + q.y * k.y + q.z * k.z + q.w * k.w);
        if (lane == 0) qk[kh] = dot;
    }
    __syncthreads();
    const int rep = p.hv / p.hk;
    for (int h = threadIdx.x; h < p.hv; h += blockDim.x) {
        const float xa = p.a[(size_t)t * p.hv + h] + p.dt_bias[h];
        const float softplus = xa > 20.f ? xa : log1pf(__expf(xa));
        const float g = -__expf(p.a_log[h]) * softplus;
        reinterpret_cast<float4*>(p.gates)[(size_t)t * p.hv + h] =
            make_float4(sigmoidf(p.b[(size_t)t * p.hv + h]), __expf(g), qk[h / rep], g);
    }
}

#define SCAN_COLS 2
#define SCAN_WARPS 8

#define SCAN_TOKENS 16

struct TokenInputs {
    float4 q, k, v, gate;  // gate: β, decay, q·k
};

// One stage of the block's inputs: SCAN_TOKENS tokens.
struct __align__(16) ScanStage {
    float q[SCAN_TOKENS][DK];
    float k[SCAN_TOKENS][DK];
    float v[SCAN_TOKENS][SCAN_WARPS * SCAN_COLS];
    float4 gate[SCAN_TOKENS];
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void load_stage(const GdnPrefillArgs& p, ScanStage& st, int t0, int h, int kh, int jb) {
    constexpr int QK_CHUNKS = SCAN_TOKENS * DK / 4, V_CHUNKS = SCAN_TOKENS * SCAN_WARPS * SCAN_COLS / 4;
    for (int c = threadIdx.x; c < 2 * QK_CHUNKS + V_CHUNKS + SCAN_TOKENS; c += blockDim.x) {
        int i, off;
        float* dst;
        const float* src;
        if (c < 2 * QK_CHUNKS) {
            const bool is_k = c >= QK_CHUNKS;
            const int cc = c - (is_k ? QK_CHUNKS : 0);
            i = cc / (DK / 4);
            off = (cc % (DK / 4)) * 4;
            dst = (is_k ? &st.k[i][0] : &st.q[i][0]) + off;
            src = p.conv_out + (size_t)(t0 + i) * p.conv_dim + ((is_k ? p.hk : 0) + kh) * DK + off;
        } else if (c < 2 * QK_CHUNKS + V_CHUNKS) {
            const int cc = c - 2 * QK_CHUNKS;
            i = cc / (SCAN_WARPS * SCAN_COLS / 4);
            off = (cc % (SCAN_WARPS * SCAN_COLS / 4)) * 4;
            dst = &st.v[i][off];
            src = p.conv_out + (size_t)(t0 + i) * p.conv_dim + 2 * p.hk * DK + h * DV + jb + off;
        } else {
            i = c - 2 * QK_CHUNKS - V_CHUNKS;
            dst = reinterpret_cast<float*>(&st.gate[i]);
            src = p.gates + ((size_t)(t0 + i) * p.hv + h) * 4;
        }
        const bool ok = t0 + i < p.T;
        cp_async16(dst, ok ? src : p.gates, ok);
    }
}

// Sum of v[c] over the warp for 2 columns at once; lane L ends with column L >> 4.
__device__ __forceinline__ float reduce2(const float (&v)[2], int lane) {
    const bool hi16 = lane & 16;
    float keep = hi16 ? v[1] : v[0];
    keep += __shfl_xor_sync(FULL_MASK, hi16 ? v[0] : v[1], 16);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) keep += __shfl_xor_sync(FULL_MASK, keep, o);
    return keep;
}

__device__ __forceinline__ void scan_token(const GdnPrefillArgs& p, const TokenInputs& in, float (&s)[4][SCAN_COLS],
                                           int t, int h, int j0, int lane) {
    const float beta = in.gate.x, decay = in.gate.y, qk = in.gate.z;
    const float kv[4] = {in.k.x, in.k.y, in.k.z, in.k.w};
    const float qv[4] = {in.q.x, in.q.y, in.q.z, in.q.w};
    float m[SCAN_COLS], a[SCAN_COLS];
#pragma unroll
    for (int c = 0; c < SCAN_COLS; ++c) {
        m[c] = 0.f;
        a[c] = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            m[c] = fmaf(s[i][c], kv[i], m[c]);
            a[c] = fmaf(s[i][c], qv[i], a[c]);
        }
    }
    const float mc = reduce2(m, lane) * decay, ac = reduce2(a, lane) * decay;
    const int col = lane >> 4;
    const float d = beta * ((col ? in.v.y : in.v.x) - mc);
    if ((lane & 15) == 0) p.o[(size_t)t * p.hv * DV + h * DV + j0 + col] = fmaf(qk, d, ac);
    float dc[SCAN_COLS];
#pragma unroll
    for (int c = 0; c < SCAN_COLS; ++c) dc[c] = __shfl_sync(FULL_MASK, d, 16 * c);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int c = 0; c < SCAN_COLS; ++c) s[i][c] = fmaf(s[i][c], decay, kv[i] * dc[c]);
}

extern "C" __global__ void __launch_bounds__(SCAN_WARPS * 32) gdn_scan(GdnPrefillArgs p) {
    __shared__ ScanStage stage[2];
    const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kh = h / (p.hv / p.hk);
    const int jb = blockIdx.y * SCAN_WARPS * SCAN_COLS, j0 = jb + warp * SCAN_COLS;
    float* S = p.state + (size_t)h * DK * DV;
    float s[4][SCAN_COLS];  // rows 4·lane + i, columns j0 + c
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 r = *reinterpret_cast<const float2*>(S + (4 * lane + i) * DV + j0);
        s[i][0] = r.x;
        s[i][1] = r.y;
    }
    load_stage(p, stage[0], 0, h, kh, jb);
    asm volatile("cp.async.commit_group;\n" ::);
    for (int t0 = 0, n = 0; t0 < p.T; t0 += SCAN_TOKENS, ++n) {
        if (t0 + SCAN_TOKENS < p.T) load_stage(p, stage[(n + 1) & 1], t0 + SCAN_TOKENS, h, kh, jb);
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();
        const ScanStage& st = stage[n & 1];
        const int count = min(SCAN_TOKENS, p.T - t0);
        for (int i = 0; i < count; ++i) {
            TokenInputs in;
            in.q = reinterpret_cast<const float4*>(st.q[i])[lane];
            in.k = reinterpret_cast<const float4*>(st.k[i])[lane];
            const float2 v = reinterpret_cast<const float2*>(st.v[i])[warp];
            in.v = make_float4(v.x, v.y, 0.f, 0.f);
            in.gate = st.gate[i];
            scan_token(p, in, s, t0 + i, h, j0, lane);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) *reinterpret_cast<float2*>(S + (4 * lane + i) * DV + j0) = make_float2(s[i][0], s[i][1]);
}

// ---- chunked (WY) form ------------------------------------------------------------------------
// Per chunk of C = 64 tokens and value head, with G the cumulative log decay inside the chunk
// (G_t = Σ_{s≤t} g_s ≤ 0), as in crates/osprey-engine/src/cpu/gdn.rs `chunked`:
//   A[t][s] = β_t (k_t·k_s) e^{G_t − G_s} (s < t), (I + A) U = β V, (I + A) W = β e^{G} K
//   M[t][s] = (q_t·k_s) e^{G_t − G_s} (s ≤ t), Q̃ = e^{G} Q, K̃ = e^{G_last − G} K
// (gdn_chunk_prep: everything that does not depend on the state, all chunks in parallel), then
// per chunk in order (gdn_chunk_scan, state S in shared memory):
//   U' = U − W S, O = Q̃ S + M U', S ← e^{G_last} S + K̃ᵀ U'.
// Every exponent is ≤ 0, so nothing overflows.

#define CHUNK 64
#define KS (DK + 1)  // padded rows: lanes reading different rows of one column hit distinct banks

struct GdnChunkArgs {
    const float* conv_out;  // [T, conv_dim]: q, k normalised (gdn_qk_gates), v
    const float* gates;     // [T, Hv, 4]
    float* wy;              // [T, Hv, 2·Dv]: U then W (Dk = Dv)
    float* qk_decayed;      // [T, Hv, 2·Dk]: Q̃ then K̃
    float* m;               // [T, Hv, C]
    float* chunk_decay;     // [chunks, Hv]: e^{G_last}
    float* state;           // [Hv, Dk, Dv]
    float* o;               // [T, Hv·Dv]
    int T, conv_dim, hk, hv;
};

// Grid (chunks, Hv), 256 threads; dynamic shared memory (2·64·129 + 64·65 + 128) floats.
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_prep(GdnChunkArgs p) {
    extern __shared__ float sm[];
    float* ks = sm;                  // [C][KS]
    float* qs = ks + CHUNK * KS;     // [C][KS]
    float* A = qs + CHUNK * KS;      // [C][C + 1]
    float* G = A + CHUNK * (CHUNK + 1);
    float* beta = G + CHUNK;
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int t0 = c * CHUNK, n = min(CHUNK, p.T - t0);
    const int kh = h / (p.hv / p.hk);
    for (int e = tid; e < CHUNK * DK; e += blockDim.x) {
        const int t = e / DK, i = e % DK;
        const float* row = p.conv_out + (size_t)(t0 + t) * p.conv_dim;
        ks[t * KS + i] = t < n ? row[(p.hk + kh) * DK + i] : 0.f;
        qs[t * KS + i] = t < n ? row[kh * DK + i] : 0.f;
    }
    if (tid < CHUNK) {
        const float4 gt = t0 + tid < p.T ? reinterpret_cast<const float4*>(p.gates)[(size_t)(t0 + tid) * p.hv + h]
                                         : make_float4(0.f, 1.f, 0.f, 0.f);
        beta[tid] = gt.x;
        G[tid] = gt.w;
    }
    __syncthreads();
    if (tid == 0)
        for (int t = 1; t < CHUNK; ++t) G[t] += G[t - 1];
    __syncthreads();
    // A (strictly lower) and M (lower with the diagonal); a warp shares t, lanes take s
    for (int e = tid; e < CHUNK * CHUNK; e += blockDim.x) {
        const int t = e / CHUNK, s = e % CHUNK;
        float kk = 0.f, qk = 0.f;
#pragma unroll 8
        for (int i = 0; i < DK; ++i) {
            const float kv = ks[s * KS + i];
            kk = fmaf(ks[t * KS + i], kv, kk);
            qk = fmaf(qs[t * KS + i], kv, qk);
        }
        const float decay = s <= t ? __expf(G[t] - G[s]) : 0.f;
        A[t * (CHUNK + 1) + s] = s < t ? beta[t] * kk * decay : 0.f;
        if (t < n) p.m[((size_t)(t0 + t) * p.hv + h) * CHUNK + s] = qk * decay;
    }
    __syncthreads();
    // decayed q and k out (q no longer needed after this)
    const float last = G[n - 1];
    for (int e = tid; e < n * DK; e += blockDim.x) {
        const int t = e / DK, i = e % DK;
        float* out = p.qk_decayed + ((size_t)(t0 + t) * p.hv + h) * 2 * DK;
        out[i] = qs[t * KS + i] * __expf(G[t]);
        out[DK + i] = ks[t * KS + i] * __expf(last - G[t]);
    }
    __syncthreads();
    // v of the chunk into q's place, so the substitution below reads shared memory only
    float* vs = qs;
    for (int e = tid; e < CHUNK * DV; e += blockDim.x) {
        const int t = e / DV, j = e % DV;
        vs[t * KS + j] = t < n ? p.conv_out[(size_t)(t0 + t) * p.conv_dim + 2 * p.hk * DK + h * DV + j] : 0.f;
    }
    __syncthreads();
    // forward substitution, one column of [U | W] per thread, the column in registers
    const int j = tid;
    const bool is_u = j < DV;
    float x[CHUNK];
#pragma unroll
    for (int t = 0; t < CHUNK; ++t) {
        float init = is_u ? beta[t] * vs[t * KS + j] : beta[t] * __expf(G[t]) * ks[t * KS + (j - DV)];
#pragma unroll
        for (int s = 0; s < t; ++s) init = fmaf(-A[t * (CHUNK + 1) + s], x[s], init);
        x[t] = init;
    }
#pragma unroll
    for (int t = 0; t < CHUNK; ++t)
        if (t < n) p.wy[((size_t)(t0 + t) * p.hv + h) * 2 * DV + j] = x[t];
    if (tid == 0) p.chunk_decay[c * p.hv + h] = __expf(last);
}

#define SCAN_COLS_C 32
#define RS 132   // padded row stride of the staged [64][128] inputs (16-byte aligned, conflict-free)
#define MS 68    // padded row stride of M

__device__ __forceinline__ void cp_async16_ca(void* smem, const void* gmem, bool valid) {
    const unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "r"(valid ? 16 : 0));
}

// Grid (Hv, Dv/32), 256 threads: the block owns state columns j0..j0+31 of one head, in shared
// memory for the whole prompt chunk, and walks the 64-token chunks in order; each chunk's W, Q̃,
// K̃, M and U columns are first staged in shared memory (cp.async), so the inner loops read
// shared memory only. Dynamic shared memory: S 128x32, U' 64x32, W/Q̃/K̃ 64x132 each, M 64x68.
extern "C" __global__ void __launch_bounds__(256, 1) gdn_chunk_scan(GdnChunkArgs p) {
    extern __shared__ __align__(16) float smc[];
    float* S = smc;                          // [DK][32]
    float* Up = S + DK * SCAN_COLS_C;        // [C][32]
    float* W = Up + CHUNK * SCAN_COLS_C;     // [C][RS]
    float* Qd = W + CHUNK * RS;              // [C][RS]
    float* Kd = Qd + CHUNK * RS;             // [C][RS]
    float* M = Kd + CHUNK * RS;              // [C][MS]
    const int h = blockIdx.x, j0 = blockIdx.y * SCAN_COLS_C, tid = threadIdx.x;
    float* Sg = p.state + (size_t)h * DK * DV;
    for (int e = tid; e < DK * SCAN_COLS_C; e += blockDim.x) S[e] = Sg[(e / SCAN_COLS_C) * DV + j0 + e % SCAN_COLS_C];
    const int t = tid / 4, jq = (tid % 4) * 8;   // phase 1: row t, columns jq..jq+7
    const int i2 = tid / 2, jh = (tid % 2) * 16; // phase 2: state row i2, columns jh..jh+15
    const int chunks = (p.T + CHUNK - 1) / CHUNK;
    for (int c = 0; c < chunks; ++c) {
        const int t0 = c * CHUNK, n = min(CHUNK, p.T - t0);
        __syncthreads();  // the previous chunk's readers are done with the staging buffers
        // stage: W, Q̃, K̃ rows (32 chunks of 16 bytes each), M rows (16), U columns (8)
        for (int e = tid; e < CHUNK * (3 * 32 + 16 + 8); e += blockDim.x) {
            const int r = e / (3 * 32 + 16 + 8), k = e % (3 * 32 + 16 + 8);
            const bool ok = r < n;
            const size_t row = (size_t)(t0 + (ok ? r : 0)) * p.hv + h;
            float* dst;
            const float* src;
            if (k < 32) { dst = W + r * RS + 4 * k; src = p.wy + row * 2 * DV + DV + 4 * k; }
            else if (k < 64) { dst = Qd + r * RS + 4 * (k - 32); src = p.qk_decayed + row * 2 * DK + 4 * (k - 32); }
            else if (k < 96) { dst = Kd + r * RS + 4 * (k - 64); src = p.qk_decayed + row * 2 * DK + DK + 4 * (k - 64); }
            else if (k < 112) { dst = M + r * MS + 4 * (k - 96); src = p.m + row * CHUNK + 4 * (k - 96); }
            else { dst = Up + r * SCAN_COLS_C + 4 * (k - 112); src = p.wy + row * 2 * DV + j0 + 4 * (k - 112); }
            cp_async16_ca(dst, src, ok);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 0;\n" ::);
        __syncthreads();
        // W S and Q̃ S for row t, columns jq..jq+7
        float ws[8], qsum[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) ws[q] = qsum[q] = 0.f;
#pragma unroll 4
        for (int i = 0; i < DK; ++i) {
            const float wv = W[t * RS + i], qv = Qd[t * RS + i];
            const float4 s0 = *reinterpret_cast<const float4*>(&S[i * SCAN_COLS_C + jq]);
            const float4 s1 = *reinterpret_cast<const float4*>(&S[i * SCAN_COLS_C + jq + 4]);
            const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                ws[q] = fmaf(wv, sv[q], ws[q]);
                qsum[q] = fmaf(qv, sv[q], qsum[q]);
            }
        }
        // U' = U − W S (rows past the prompt stay zero)
#pragma unroll
        for (int q = 0; q < 8; ++q) Up[t * SCAN_COLS_C + jq + q] -= ws[q];
        __syncthreads();
        // O = Q̃ S + M U'
        for (int s = 0; s <= t; ++s) {
            const float mv = M[t * MS + s];
            const float4 u0 = *reinterpret_cast<const float4*>(&Up[s * SCAN_COLS_C + jq]);
            const float4 u1 = *reinterpret_cast<const float4*>(&Up[s * SCAN_COLS_C + jq + 4]);
            qsum[0] = fmaf(mv, u0.x, qsum[0]); qsum[1] = fmaf(mv, u0.y, qsum[1]);
            qsum[2] = fmaf(mv, u0.z, qsum[2]); qsum[3] = fmaf(mv, u0.w, qsum[3]);
            qsum[4] = fmaf(mv, u1.x, qsum[4]); qsum[5] = fmaf(mv, u1.y, qsum[5]);
            qsum[6] = fmaf(mv, u1.z, qsum[6]); qsum[7] = fmaf(mv, u1.w, qsum[7]);
        }
        if (t < n) {
            float* o = p.o + (size_t)(t0 + t) * p.hv * DV + h * DV + j0 + jq;
            *reinterpret_cast<float4*>(o) = make_float4(qsum[0], qsum[1], qsum[2], qsum[3]);
            *reinterpret_cast<float4*>(o + 4) = make_float4(qsum[4], qsum[5], qsum[6], qsum[7]);
        }
        // S ← e^{G_last} S + K̃ᵀ U' for state row i2 (its own elements only)
        const float decay = p.chunk_decay[c * p.hv + h];
        float acc[16];
#pragma unroll
        for (int q = 0; q < 16; ++q) acc[q] = S[i2 * SCAN_COLS_C + jh + q] * decay;
        for (int s = 0; s < n; ++s) {
            const float kv = Kd[s * RS + i2];
#pragma unroll
            for (int q4 = 0; q4 < 4; ++q4) {
                const float4 u = *reinterpret_cast<const float4*>(&Up[s * SCAN_COLS_C + jh + 4 * q4]);
                acc[4 * q4] = fmaf(kv, u.x, acc[4 * q4]);
                acc[4 * q4 + 1] = fmaf(kv, u.y, acc[4 * q4 + 1]);
                acc[4 * q4 + 2] = fmaf(kv, u.z, acc[4 * q4 + 2]);
                acc[4 * q4 + 3] = fmaf(kv, u.w, acc[4 * q4 + 3]);
            }
        }
#pragma unroll
        for (int q = 0; q < 16; ++q) S[i2 * SCAN_COLS_C + jh + q] = acc[q];
    }
    __syncthreads();
    for (int e = tid; e < DK * SCAN_COLS_C; e += blockDim.x) Sg[(e / SCAN_COLS_C) * DV + j0 + e % SCAN_COLS_C] = S[e];
}
