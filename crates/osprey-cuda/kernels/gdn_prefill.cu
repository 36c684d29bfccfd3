// Gated DeltaNet prefill over a chunk of T tokens starting at position P (model-spec §3.4):
//   gdn_conv       — causal depthwise conv (kernel K) over the chunk, reading the K-1 earlier
//                    inputs from the conv state, + SiLU. Grid (T, conv_dim/256).
//   gdn_conv_state — the last K-1 inputs become the conv state of position P+T (the decode step's
//                    parity buffer). One thread per channel, rows in ascending order, so it is
//                    safe when the state buffer read and the one written are the same.
//   gdn_qk_gates   — L2 norm of q and k per key head (q also scaled by 1/sqrt(Dk)), in place;
//                    β = sigmoid(b) and the decay exp(-exp(A_log)·softplus(a + dt_bias)) per
//                    value head. Grid T, 8 warps.
//   gdn_scan       — the gated delta rule, token by token, with the fp32 state in registers:
//                    a warp owns 4 state columns (value dims) of one head; lane l holds rows
//                    4l..4l+3 of them (16 floats), loaded once per chunk and stored once. Per
//                    token: decay, k·S (warp sums), the delta update, S·q (warp sums); the next
//                    token's q, k, v, β, decay are loaded while this one is computed.
//                    Grid (Hv, Dv/16), 4 warps per block.
// Shapes: Dk = Dv = 128, Hv value heads over Hk key heads (value head h reads key head h/(Hv/Hk)).
// Ceiling: the scan is a dependent chain per token (two warp reductions); the state traffic is
// 64 KB per head per chunk, not per token.
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
    float* gates;          // [T, Hv, 2]: β, decay
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
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* row = p.conv_out + (size_t)t * p.conv_dim;
    // vectors 0..Hk-1 are q heads, Hk..2Hk-1 k heads
    for (int v = warp; v < 2 * p.hk; v += 8) {
        float4* x = reinterpret_cast<float4*>(row + v * DK) + lane;
        float4 val = *x;
        float inv = rsqrtf(warp_sum(val.x * val.x + val.y * val.y + val.z * val.z + val.w * val.w) + 1e-6f);
        if (v < p.hk) inv *= rsqrtf((float)DK);
        val.x *= inv; val.y *= inv; val.z *= inv; val.w *= inv;
        *x = val;
    }
    for (int h = threadIdx.x; h < p.hv; h += blockDim.x) {
        const float xa = p.a[(size_t)t * p.hv + h] + p.dt_bias[h];
        const float softplus = xa > 20.f ? xa : log1pf(__expf(xa));
        p.gates[((size_t)t * p.hv + h) * 2] = sigmoidf(p.b[(size_t)t * p.hv + h]);
        p.gates[((size_t)t * p.hv + h) * 2 + 1] = __expf(-__expf(p.a_log[h]) * softplus);
    }
}

#define SCAN_COLS 4
#define SCAN_WARPS 4

struct TokenInputs {
    float4 q, k, v;
    float2 gate;
};

__device__ __forceinline__ TokenInputs load_token(const GdnPrefillArgs& p, int t, int h, int kh, int j0, int lane) {
    const float* row = p.conv_out + (size_t)t * p.conv_dim;
    TokenInputs in;
    in.q = reinterpret_cast<const float4*>(row + kh * DK)[lane];
    in.k = reinterpret_cast<const float4*>(row + (p.hk + kh) * DK)[lane];
    in.v = *reinterpret_cast<const float4*>(row + 2 * p.hk * DK + h * DV + j0);
    in.gate = *reinterpret_cast<const float2*>(p.gates + ((size_t)t * p.hv + h) * 2);
    return in;
}

extern "C" __global__ void __launch_bounds__(SCAN_WARPS * 32) gdn_scan(GdnPrefillArgs p) {
    const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kh = h / (p.hv / p.hk);
    const int j0 = (blockIdx.y * SCAN_WARPS + warp) * SCAN_COLS;
    float* S = p.state + (size_t)h * DK * DV;
    float s[4][SCAN_COLS];  // rows 4·lane + i, columns j0 + c
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 r = *reinterpret_cast<const float4*>(S + (4 * lane + i) * DV + j0);
        s[i][0] = r.x; s[i][1] = r.y; s[i][2] = r.z; s[i][3] = r.w;
    }
    TokenInputs cur = load_token(p, 0, h, kh, j0, lane);
    for (int t = 0; t < p.T; ++t) {
        TokenInputs nxt = cur;
        if (t + 1 < p.T) nxt = load_token(p, t + 1, h, kh, j0, lane);
        const float beta = cur.gate.x, decay = cur.gate.y;
        const float kv[4] = {cur.k.x, cur.k.y, cur.k.z, cur.k.w};
        const float qv[4] = {cur.q.x, cur.q.y, cur.q.z, cur.q.w};
        const float vv[4] = {cur.v.x, cur.v.y, cur.v.z, cur.v.w};
        float m[SCAN_COLS];
#pragma unroll
        for (int c = 0; c < SCAN_COLS; ++c) {
            m[c] = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[i][c] *= decay;
                m[c] = fmaf(s[i][c], kv[i], m[c]);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int c = 0; c < SCAN_COLS; ++c) m[c] += __shfl_xor_sync(FULL_MASK, m[c], o);
        float out[SCAN_COLS];
#pragma unroll
        for (int c = 0; c < SCAN_COLS; ++c) {
            const float d = beta * (vv[c] - m[c]);
            out[c] = 0.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[i][c] = fmaf(kv[i], d, s[i][c]);
                out[c] = fmaf(s[i][c], qv[i], out[c]);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int c = 0; c < SCAN_COLS; ++c) out[c] += __shfl_xor_sync(FULL_MASK, out[c], o);
        if (lane == 0)
            *reinterpret_cast<float4*>(p.o + (size_t)t * p.hv * DV + h * DV + j0) = make_float4(out[0], out[1], out[2], out[3]);
        cur = nxt;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
        *reinterpret_cast<float4*>(S + (4 * lane + i) * DV + j0) = make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
}
