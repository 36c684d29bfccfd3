// Gated DeltaNet prefill over a chunk of T tokens starting at position P (model-spec §3.4):
//   gdn_conv_qk_gates — one block per token, 8 warps: causal depthwise conv (kernel 4) + SiLU of
//                    the token's channels, reading the 3 earlier inputs from the conv state; per
//                    key head (a warp, lane l channels 4l..4l+3) the L2 norms of q and k (q also
//                    by 1/sqrt(Dk)) and q·k; per value head β = sigmoid(b), the decay
//                    exp(-exp(A_log)·softplus(a + dt_bias)) and its key head's q·k. Written once
//                    (a conv kernel then a norm/gates kernel that re-read and re-wrote q and k took
//                    7.6 ms at a 4K prompt over 30 layers, this one 3.7 with gdn_conv_state;
//                    bench/results/cuda-harnesses-gemv-hfma2-cluster-conv-h200.json,
//                    cuda-prefill-full.json).
//   gdn_conv_state — the last K-1 inputs become the conv state of position P+T (the decode step's
//                    parity buffer). One thread per channel, rows in ascending order, so it is
//                    safe when the state buffer read and the one written are the same; runs after
//                    gdn_conv_qk_gates, which reads the old state.
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
//   gdn_chunk_prep / gdn_chunk_state / gdn_chunk_out — the same recurrence in the chunked (WY) form,
//                    chunks of 64 tokens, its products on the tensor cores (TF32 mma, see below):
//                    the default from 64 tokens. An earlier fp32 CUDA-core version of it was slower
//                    than the scan (4K prompt: 21.2K vs 23.0K tok/s end to end, commit 9a9dbcb).
// Shapes: Dk = Dv = 128, Hv value heads over Hk key heads (value head h reads key head h/(Hv/Hk)).
// Ceiling: the scan is a dependent chain per token (two warp reductions); the state traffic is
// 64 KB per head per chunk, not per token. Measured (H200, 4K prompt, 30 layers): register scan
// 1.15 ms per layer (0.28 us per token); chunked form 0.21 (prep) + 0.25 (state pass) + 0.14
// (output) = 0.60 ms per layer (the output with the gated norm fused since: 0.19, against 0.14 +
// 0.06 apart); the state pass moves ~820 MB per layer (W, K and U staged by each
// of a head's 4 column blocks, the states saved for the output), ~3.3 TB/s: bandwidth-bound.
// conv + norms + gates 0.12 ms per layer for ~270 MB moved (~2.2 TB/s).
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

extern "C" __global__ void gdn_conv_state(GdnPrefillArgs p) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.conv_dim) return;
    for (int i = 0; i < p.kernel - 1; ++i) p.state_out[(size_t)i * p.conv_dim + c] = conv_input(p, p.T + i, c);
}

#define CONV_K 4           // causal conv taps (the model's linear_conv_kernel_dim)
#define CONV_MAX_QUADS 8   // float4 channel quads per thread: conv_dim <= 8 · 256 · 4 = 8192

// Block t (one token), 256 threads. Thread i takes channel quads i + 256j (j < 8), so warp w holds
// heads w + 8j whole (a float4 per lane): every quad's 4 input rows and 4 tap words are requested
// before any is used. v heads are stored at once; q and k heads go through shared memory (a key
// head's q and k may sit in different warps), then warp w normalises key heads w, w + 8, ...
extern "C" __global__ void __launch_bounds__(256) gdn_conv_qk_gates(GdnPrefillArgs p) {
    extern __shared__ float4 qk_rows[];  // [2·hk heads][32 quads]
    __shared__ float qk[64];
    const int t = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int quads = p.conv_dim / 4, qk_quads = 2 * p.hk * (DK / 4);
    float4 v[CONV_MAX_QUADS];
#pragma unroll
    for (int j = 0; j < CONV_MAX_QUADS; ++j) {
        const int c4 = tid + 256 * j;
        if (c4 >= quads) continue;
        const float4* w = reinterpret_cast<const float4*>(p.conv_w) + 4 * c4;  // taps of channels 4·c4 + i
        const float4 w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
        const float wt[4][CONV_K] = {{w0.x, w0.y, w0.z, w0.w}, {w1.x, w1.y, w1.z, w1.w}, {w2.x, w2.y, w2.z, w2.w}, {w3.x, w3.y, w3.z, w3.w}};
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < CONV_K; ++k) {
            const int i = t + k;  // extended-sequence index: K-1 state rows, then the chunk
            const float4 in = reinterpret_cast<const float4*>(i < CONV_K - 1 ? p.state_in + (size_t)i * p.conv_dim
                                                                               : p.qkv + (size_t)(i - (CONV_K - 1)) * p.conv_dim)[c4];
            s[0] = fmaf(wt[0][k], in.x, s[0]);
            s[1] = fmaf(wt[1][k], in.y, s[1]);
            s[2] = fmaf(wt[2][k], in.z, s[2]);
            s[3] = fmaf(wt[3][k], in.w, s[3]);
        }
        v[j] = make_float4(siluf(s[0]), siluf(s[1]), siluf(s[2]), siluf(s[3]));
    }
    float4* row = reinterpret_cast<float4*>(p.conv_out + (size_t)t * p.conv_dim);
#pragma unroll
    for (int j = 0; j < CONV_MAX_QUADS; ++j) {
        const int c4 = tid + 256 * j;
        if (c4 >= quads) continue;
        if (c4 < qk_quads) qk_rows[c4] = v[j];
        else row[c4] = v[j];
    }
    __syncthreads();
    // key head kh: q and k normalised (q also by 1/sqrt(Dk)), and q·k
    for (int kh = warp; kh < p.hk; kh += 8) {
        float4 q = qk_rows[kh * (DK / 4) + lane], k = qk_rows[(p.hk + kh) * (DK / 4) + lane];
        const float qi = rsqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f) * rsqrtf((float)DK);
        const float ki = rsqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
        q.x *= qi; q.y *= qi; q.z *= qi; q.w *= qi;
        k.x *= ki; k.y *= ki; k.z *= ki; k.w *= ki;
        row[kh * (DK / 4) + lane] = q;
        row[(p.hk + kh) * (DK / 4) + lane] = k;
        const float dot = warp_sum(q.x * k.x + q.y * k.y + q.z * k.z + q.w * k.w);
        if (lane == 0) qk[kh] = dot;
    }
    __syncthreads();
    const int rep = p.hv / p.hk;
    for (int h = tid; h < p.hv; h += blockDim.x) {
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
    cp_async_commit();
    for (int t0 = 0, n = 0; t0 < p.T; t0 += SCAN_TOKENS, ++n) {
        if (t0 + SCAN_TOKENS < p.T) load_stage(p, stage[(n + 1) & 1], t0 + SCAN_TOKENS, h, kh, jb);
        cp_async_commit();
        cp_async_wait<1>();
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

// ---- chunked (WY) form, on the tensor cores ----------------------------------------------------
// Per chunk of C = 64 tokens and value head, with G the cumulative log decay inside the chunk
// (G_t = Σ_{s≤t} g_s ≤ 0), as in crates/osprey-engine/src/cpu/gdn.rs `chunked`:
//   A[t][s] = β_t (k_t·k_s) e^{G_t − G_s} (s < t), (I + A) U = β V, (I + A) W = β e^{G} K
//   M[t][s] = (q_t·k_s) e^{G_t − G_s} (s ≤ t)
// gdn_chunk_prep (all chunks in parallel): K Kᵀ and Q Kᵀ on the tensor cores, A and M from them, then
//   U and W by forward substitution (a thread per column of [U | W]).
// gdn_chunk_state (per head and 32 state columns, chunks in order; S = the state before the chunk):
//   saves S, U' = U − W S, S ← e^{G_last} S + Kᵀ (e^{G_last − G} ∘ U').
// gdn_chunk_out (all chunks in parallel): O = e^{G} ∘ (Q S) + M U'.
// Every exponent is ≤ 0, so nothing overflows. The products are mma.sync m16n8k8 TF32 (operands
// rounded to 10-bit mantissas, fp32 accumulation; the state itself is carried in fp32): 2^-11
// relative per operand, well inside the prefill check's tolerance (osprey check reports this form).
// Shared-memory row strides: 132 (≡ 4 mod 32) for operands read along rows, 136 / 40 (≡ 8 mod 32)
// for operands read down columns: an mma fragment's 32 reads hit 32 distinct banks either way.

#define CHUNK 64
#define ROW_STRIDE 132  // [rows][128] read along rows (A row-major, Bᵀ)
#define COL_STRIDE 136  // [rows][128] read down columns (A transposed, B)
#define A_STRIDE 68     // [64][64] read along rows
#define STATE_COLS 32   // state columns per gdn_chunk_state block
#define STATE_STRIDE 40 // [rows][32] read down columns

struct GdnChunkArgs {
    const float* conv_out;  // [T, conv_dim]: q, k normalised (gdn_conv_qk_gates), v
    const float* gates;     // [T, Hv, 4]
    float* wy;              // [T, Hv, 2·Dv]: U then W (Dk = Dv)
    float* u_new;           // [T, Hv, Dv]: U' = U − W S
    float* m;               // [T, Hv, C]
    float* g_cum;           // [Hv, chunks·C]: G per token
    float* chunk_states;    // [chunks, Hv, Dk, Dv]: the state before each chunk
    float* state;           // [Hv, Dk, Dv]
    const float* z;         // [T, Hv·Dv] output gate
    const float* norm;      // [Dv] gated RMSNorm weight
    __nv_bfloat16* out;     // [T, Hv·Dv] bf16 perm64: RMSNorm(o)·w·silu(z) per head, out_proj's input
    float eps;
    int T, conv_dim, hk, hv;
};

__device__ __forceinline__ uint32_t to_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Fragments of m16n8k8 (g = lane / 4, t = lane % 4). A is 16x8 at (m0, k0), B is 8x8 at (k0, n0).
// A[m][k] = X[m][k]
__device__ __forceinline__ void frag_a_rows(uint32_t (&a)[4], const float* X, int stride, int m0, int k0, int lane) {
    const float* r = X + (m0 + (lane >> 2)) * stride + k0 + (lane & 3);
    a[0] = to_tf32(r[0]);
    a[1] = to_tf32(r[8 * stride]);
    a[2] = to_tf32(r[4]);
    a[3] = to_tf32(r[8 * stride + 4]);
}
// A[m][k] = X[k][m]
__device__ __forceinline__ void frag_a_cols(uint32_t (&a)[4], const float* X, int stride, int m0, int k0, int lane) {
    const float* r = X + (k0 + (lane & 3)) * stride + m0 + (lane >> 2);
    a[0] = to_tf32(r[0]);
    a[1] = to_tf32(r[8]);
    a[2] = to_tf32(r[4 * stride]);
    a[3] = to_tf32(r[4 * stride + 8]);
}
// B[k][n] = X[n][k]
__device__ __forceinline__ void frag_b_rows(uint32_t (&b)[2], const float* X, int stride, int k0, int n0, int lane) {
    const float* r = X + (n0 + (lane >> 2)) * stride + k0 + (lane & 3);
    b[0] = to_tf32(r[0]);
    b[1] = to_tf32(r[4]);
}
// B[k][n] = X[k][n]
__device__ __forceinline__ void frag_b_cols(uint32_t (&b)[2], const float* X, int stride, int k0, int n0, int lane) {
    const float* r = X + (k0 + (lane & 3)) * stride + n0 + (lane >> 2);
    b[0] = to_tf32(r[0]);
    b[1] = to_tf32(r[4 * stride]);
}

// acc[j] += A[m0.., k] · B[k, n0 + 8j..] over k < K, A read along rows and B down columns.
template <int NT, int UNROLL>
__device__ __forceinline__ void mma_rows_cols(float (&acc)[NT][4], const float* A, int a_stride, int m0, const float* B,
                                              int b_stride, int n0, int K, int lane) {
#pragma unroll UNROLL
    for (int k0 = 0; k0 < K; k0 += 8) {
        uint32_t a[4];
        frag_a_rows(a, A, a_stride, m0, k0, lane);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            uint32_t b[2];
            frag_b_cols(b, B, b_stride, k0, n0 + 8 * j, lane);
            mma_tf32(acc[j], a, b);
        }
    }
}

// Copies `rows` rows of `width` floats (a multiple of 4) from src (row pitch src_pitch floats) to
// shared dst (row pitch dst_pitch); rows past `valid` are zero-filled.
__device__ __forceinline__ void stage_rows(float* dst, int dst_pitch, const float* src, size_t src_pitch, int rows,
                                           int width, int valid) {
    const int per_row = width / 4;
    for (int e = threadIdx.x; e < rows * per_row; e += blockDim.x) {
        const int r = e / per_row, c = 4 * (e % per_row);
        const bool ok = r < valid;
        cp_async16(dst + r * dst_pitch + c, src + (size_t)(ok ? r : 0) * src_pitch + c, ok);
    }
}

__device__ __forceinline__ int g_pitch(const GdnChunkArgs& p) { return (p.T + CHUNK - 1) / CHUNK * CHUNK; }

// Grid (chunks, Hv), 256 threads; dynamic shared memory GDN_CHUNK_PREP_SMEM floats.
#define GDN_CHUNK_PREP_SMEM ((2 * CHUNK * ROW_STRIDE + CHUNK * A_STRIDE + 2 * CHUNK) * 4)
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_prep(GdnChunkArgs p) {
    extern __shared__ __align__(16) float sm[];
    float* ks = sm;                         // [C][ROW_STRIDE]
    float* qs = ks + CHUNK * ROW_STRIDE;    // [C][ROW_STRIDE], later v
    float* A = qs + CHUNK * ROW_STRIDE;     // [C][A_STRIDE]
    float* G = A + CHUNK * A_STRIDE;
    float* beta = G + CHUNK;
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int t0 = c * CHUNK, n = min(CHUNK, p.T - t0);
    const int kh = h / (p.hv / p.hk);
    const float* rows = p.conv_out + (size_t)t0 * p.conv_dim;
    stage_rows(ks, ROW_STRIDE, rows + (p.hk + kh) * DK, p.conv_dim, CHUNK, DK, n);
    stage_rows(qs, ROW_STRIDE, rows + kh * DK, p.conv_dim, CHUNK, DK, n);
    cp_async_commit();
    if (warp == 0) {
        // β and the inclusive scan of the log decays, two tokens per lane
        float g2[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int t = 2 * lane + j;
            const float4 gt = t < n ? reinterpret_cast<const float4*>(p.gates)[(size_t)(t0 + t) * p.hv + h]
                                    : make_float4(0.f, 1.f, 0.f, 0.f);
            beta[t] = gt.x;
            g2[j] = gt.w;
        }
        g2[1] += g2[0];
        float run = g2[1];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float up = __shfl_up_sync(FULL_MASK, run, o);
            if (lane >= o) run += up;
        }
        const float before = run - g2[1];
        G[2 * lane] = before + g2[0];
        G[2 * lane + 1] = run;
        float* gc = p.g_cum + (size_t)h * g_pitch(p) + t0;
        gc[2 * lane] = before + g2[0];
        gc[2 * lane + 1] = run;
    }
    cp_async_wait<0>();
    __syncthreads();
    {
        // K Kᵀ and Q Kᵀ: warp = (16-row tile mt, half of the 64 columns)
        const int mt = warp & 3, nb = (warp >> 2) * 4;
        float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll 4
        for (int k0 = 0; k0 < DK; k0 += 8) {
            uint32_t ak[4], aq[4];
            frag_a_rows(ak, ks, ROW_STRIDE, 16 * mt, k0, lane);
            frag_a_rows(aq, qs, ROW_STRIDE, 16 * mt, k0, lane);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                uint32_t b[2];
                frag_b_rows(b, ks, ROW_STRIDE, k0, 8 * (nb + j), lane);
                mma_tf32(kk[j], ak, b);
                mma_tf32(qk[j], aq, b);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int t = 16 * mt + (lane >> 2) + 8 * (i >> 1), s = 8 * (nb + j) + 2 * (lane & 3) + (i & 1);
                const float decay = s <= t ? __expf(G[t] - G[s]) : 0.f;
                A[t * A_STRIDE + s] = s < t ? beta[t] * kk[j][i] * decay : 0.f;
                if (t < n) p.m[((size_t)(t0 + t) * p.hv + h) * CHUNK + s] = qk[j][i] * decay;
            }
    }
    __syncthreads();
    // v of the chunk into q's place, so the substitution below reads shared memory only
    stage_rows(qs, ROW_STRIDE, rows + 2 * p.hk * DK + h * DV, p.conv_dim, CHUNK, DV, n);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    // forward substitution, one column of [U | W] per thread, the column in registers
    const int j = tid;
    const bool is_u = j < DV;
    const float* vs = qs;
    float x[CHUNK];
#pragma unroll
    for (int t = 0; t < CHUNK; ++t) {
        float init = is_u ? beta[t] * vs[t * ROW_STRIDE + j] : beta[t] * __expf(G[t]) * ks[t * ROW_STRIDE + (j - DV)];
#pragma unroll
        for (int s = 0; s < t; ++s) init = fmaf(-A[t * A_STRIDE + s], x[s], init);
        x[t] = init;
    }
#pragma unroll
    for (int t = 0; t < CHUNK; ++t)
        if (t < n) p.wy[((size_t)(t0 + t) * p.hv + h) * 2 * DV + j] = x[t];
}

// One chunk's inputs of gdn_chunk_state, for the block's 32 state columns.
struct __align__(16) StateStage {
    float w[CHUNK * ROW_STRIDE];
    float k[CHUNK * COL_STRIDE];
    float u[CHUNK * STATE_STRIDE];
    float g[CHUNK];
};
#define GDN_CHUNK_STATE_SMEM ((int)(2 * sizeof(StateStage)) + (DK + CHUNK) * STATE_STRIDE * 4 + CHUNK * 4)

__device__ __forceinline__ void stage_state_inputs(const GdnChunkArgs& p, StateStage& st, int c, int h, int kh, int j0) {
    const int t0 = c * CHUNK, n = min(CHUNK, p.T - t0);
    const size_t row = (size_t)t0 * p.hv + h;
    stage_rows(st.w, ROW_STRIDE, p.wy + row * 2 * DV + DV, (size_t)p.hv * 2 * DV, CHUNK, DK, n);
    stage_rows(st.u, STATE_STRIDE, p.wy + row * 2 * DV + j0, (size_t)p.hv * 2 * DV, CHUNK, STATE_COLS, n);
    stage_rows(st.k, COL_STRIDE, p.conv_out + (size_t)t0 * p.conv_dim + (p.hk + kh) * DK, p.conv_dim, CHUNK, DK, n);
    stage_rows(st.g, CHUNK, p.g_cum + (size_t)h * g_pitch(p) + t0, 0, 1, CHUNK, 1);
}

// Grid (Hv, Dv/32), 256 threads: the block owns state columns j0..j0+31 of one head, in shared
// memory, and walks the chunks in order, the next chunk's inputs staged (cp.async) while this one
// is computed. Per chunk: warp w computes U' for rows 16(w%4).., columns 16(w/4).. (k = 128), then
// the state rows 16w.. for all 32 columns (k = 64 tokens).
extern "C" __global__ void __launch_bounds__(256, 1) gdn_chunk_state(GdnChunkArgs p) {
    extern __shared__ __align__(16) float smc[];
    StateStage* st = reinterpret_cast<StateStage*>(smc);
    float* S = smc + 2 * sizeof(StateStage) / 4;  // [DK][STATE_STRIDE]
    float* Up = S + DK * STATE_STRIDE;            // [C][STATE_STRIDE]
    float* f = Up + CHUNK * STATE_STRIDE;         // e^{G_last − G_s}
    const int h = blockIdx.x, j0 = blockIdx.y * STATE_COLS, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int kh = h / (p.hv / p.hk);
    const int g = lane >> 2, q = lane & 3;
    float* Sg = p.state + (size_t)h * DK * DV;
    for (int e = tid; e < DK * STATE_COLS; e += blockDim.x)
        S[(e / STATE_COLS) * STATE_STRIDE + e % STATE_COLS] = Sg[(e / STATE_COLS) * DV + j0 + e % STATE_COLS];
    const int chunks = (p.T + CHUNK - 1) / CHUNK;
    stage_state_inputs(p, st[0], 0, h, kh, j0);
    cp_async_commit();
    for (int c = 0; c < chunks; ++c) {
        const int t0 = c * CHUNK, n = min(CHUNK, p.T - t0);
        if (c + 1 < chunks) stage_state_inputs(p, st[(c + 1) & 1], c + 1, h, kh, j0);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const StateStage& in = st[c & 1];
        const float g_last = in.g[n - 1];
        if (tid < CHUNK) f[tid] = tid < n ? __expf(g_last - in.g[tid]) : 0.f;
        float* saved = p.chunk_states + ((size_t)c * p.hv + h) * DK * DV + j0;
        for (int e = tid; e < DK * STATE_COLS / 4; e += blockDim.x) {
            const int i = e / (STATE_COLS / 4), jj = 4 * (e % (STATE_COLS / 4));
            *reinterpret_cast<float4*>(saved + i * DV + jj) = *reinterpret_cast<const float4*>(S + i * STATE_STRIDE + jj);
        }
        {
            // U' = U − W S
            const int mt = warp & 3, nb = (warp >> 2) * 2;
            float acc[2][4] = {};
            mma_rows_cols<2, 4>(acc, in.w, ROW_STRIDE, 16 * mt, S, STATE_STRIDE, 8 * nb, DK, lane);
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int t = 16 * mt + g + 8 * (i >> 1), col = 8 * (nb + j) + 2 * q + (i & 1);
                    const float u = in.u[t * STATE_STRIDE + col] - acc[j][i];
                    Up[t * STATE_STRIDE + col] = u;
                    if (t < n) p.u_new[((size_t)(t0 + t) * p.hv + h) * DV + j0 + col] = u;
                }
        }
        __syncthreads();
        {
            // S ← e^{G_last} S + Kᵀ (f ∘ U'), state rows 16·warp..
            const float decay = __expf(g_last);
            float acc[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    acc[j][i] = decay * S[(16 * warp + g + 8 * (i >> 1)) * STATE_STRIDE + 8 * j + 2 * q + (i & 1)];
#pragma unroll
            for (int k0 = 0; k0 < CHUNK; k0 += 8) {
                uint32_t a[4];
                frag_a_cols(a, in.k, COL_STRIDE, 16 * warp, k0, lane);
                const float f0 = f[k0 + q], f1 = f[k0 + q + 4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const float* u = Up + (k0 + q) * STATE_STRIDE + 8 * j + g;
                    const uint32_t b[2] = {to_tf32(f0 * u[0]), to_tf32(f1 * u[4 * STATE_STRIDE])};
                    mma_tf32(acc[j], a, b);
                }
            }
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    S[(16 * warp + g + 8 * (i >> 1)) * STATE_STRIDE + 8 * j + 2 * q + (i & 1)] = acc[j][i];
        }
        __syncthreads();  // S complete; this stage's buffer may be refilled
    }
    for (int e = tid; e < DK * STATE_COLS; e += blockDim.x)
        Sg[(e / STATE_COLS) * DV + j0 + e % STATE_COLS] = S[(e / STATE_COLS) * STATE_STRIDE + e % STATE_COLS];
}

// Grid (chunks, Hv), 256 threads: O = e^{G} ∘ (Q S) + M U' for one chunk of one head; warp w owns
// rows 16(w%4).. and columns 64(w/4)... The head's gated RMSNorm follows in place (each token's
// 128 values are in this block: the two warps of a row band add their halves' sums of squares
// through shared memory) and writes out_proj's bf16 input, so O never goes to memory in f32; the
// gate z is staged with the other inputs so its loads hide under theirs.
#define GDN_CHUNK_OUT_SMEM ((CHUNK * ROW_STRIDE + DK * COL_STRIDE + CHUNK * A_STRIDE + 2 * CHUNK * COL_STRIDE + 3 * CHUNK) * 4)
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_out(GdnChunkArgs p) {
    extern __shared__ __align__(16) float smo[];
    float* Q = smo;                          // [C][ROW_STRIDE]
    float* S = Q + CHUNK * ROW_STRIDE;       // [Dk][COL_STRIDE]
    float* M = S + DK * COL_STRIDE;          // [C][A_STRIDE]
    float* U = M + CHUNK * A_STRIDE;         // [C][COL_STRIDE]
    float* G = U + CHUNK * COL_STRIDE;
    float* half_ss = G + CHUNK;              // [2 column halves][C]
    float* Z = half_ss + 2 * CHUNK;          // [C][COL_STRIDE] the output gate
    const int c = blockIdx.x, h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t0 = c * CHUNK, n = min(CHUNK, p.T - t0);
    const int kh = h / (p.hv / p.hk);
    const size_t row = (size_t)t0 * p.hv + h;
    stage_rows(Z, COL_STRIDE, p.z + (size_t)t0 * p.hv * DV + h * DV, (size_t)p.hv * DV, CHUNK, DV, n);
    stage_rows(Q, ROW_STRIDE, p.conv_out + (size_t)t0 * p.conv_dim + kh * DK, p.conv_dim, CHUNK, DK, n);
    stage_rows(S, COL_STRIDE, p.chunk_states + ((size_t)c * p.hv + h) * DK * DV, DV, DK, DV, DK);
    stage_rows(M, A_STRIDE, p.m + row * CHUNK, (size_t)p.hv * CHUNK, CHUNK, CHUNK, n);
    stage_rows(U, COL_STRIDE, p.u_new + row * DV, (size_t)p.hv * DV, CHUNK, DV, n);
    stage_rows(G, CHUNK, p.g_cum + (size_t)h * g_pitch(p) + t0, 0, 1, CHUNK, 1);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    const int mt = warp & 3, nb = (warp >> 2) * 8, g = lane >> 2, q = lane & 3;
    float acc[8][4] = {};
    mma_rows_cols<8, 2>(acc, Q, ROW_STRIDE, 16 * mt, S, COL_STRIDE, 8 * nb, DK, lane);
    const float e0 = __expf(G[16 * mt + g]), e1 = __expf(G[16 * mt + g + 8]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        acc[j][0] *= e0;
        acc[j][1] *= e0;
        acc[j][2] *= e1;
        acc[j][3] *= e1;
    }
    mma_rows_cols<8, 2>(acc, M, A_STRIDE, 16 * mt, U, COL_STRIDE, 8 * nb, CHUNK, lane);
    // sums of squares of rows g and g + 8 over this warp's 64 columns (a quad holds a row's 64)
    float ss[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) ss[r] += acc[j][2 * r] * acc[j][2 * r] + acc[j][2 * r + 1] * acc[j][2 * r + 1];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        ss[r] += __shfl_xor_sync(FULL_MASK, ss[r], 1);
        ss[r] += __shfl_xor_sync(FULL_MASK, ss[r], 2);
        if (q == 0) half_ss[(warp >> 2) * CHUNK + 16 * mt + g + 8 * r] = ss[r];
    }
    __syncthreads();  // every warp's products done: Q's buffer stages the bf16 rows
    __nv_bfloat16* staged = reinterpret_cast<__nv_bfloat16*>(Q);  // [C][DV] perm64 within the head
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int t = 16 * mt + g + 8 * r;
        const float inv = rsqrtf((half_ss[t] + half_ss[CHUNK + t]) / DV + p.eps);
        const float* zr = Z + t * COL_STRIDE;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int d = 8 * (nb + j) + 2 * q;
            const float2 zz = *reinterpret_cast<const float2*>(zr + d);
            const float2 w = *reinterpret_cast<const float2*>(p.norm + d);
            staged[t * DV + perm64(d)] = __float2bfloat16(acc[j][2 * r] * inv * w.x * siluf(zz.x));
            staged[t * DV + perm64(d + 1)] = __float2bfloat16(acc[j][2 * r + 1] * inv * w.y * siluf(zz.y));
        }
    }
    __syncthreads();
    // each token's 256 bytes of this head out in 16-byte stores
    for (int c = threadIdx.x; c < n * DV / 8; c += blockDim.x) {
        const int t = c / (DV / 8), k8 = c % (DV / 8);
        *reinterpret_cast<uint4*>(p.out + (size_t)(t0 + t) * p.hv * DV + h * DV + 8 * k8) =
            reinterpret_cast<const uint4*>(staged + t * DV)[k8];
    }
}
