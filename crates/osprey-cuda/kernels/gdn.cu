// Gated DeltaNet decode step, fused: causal conv (state K-1 deep) + SiLU, L2 norm of q and k,
// q scaling, β and the log-decay g, the gated delta update of the fp32 state with the output read
// from the updated state, and the gated RMSNorm — one block per value head.
//
// Shapes: Dk = Dv = 128, Hv value heads (32) over Hk key heads (16), conv kernel K (4).
// Geometry: grid Hv, 256 threads. Thread t owns state column j = t % 128 and rows
// [64·(t/128), +64): 64 fp32 values in registers, read and written once (coalesced rows).
// Conv state is double-buffered by position parity: q/k channels are shared by Hv/Hk value heads,
// so every block reads the old buffer and exactly one block writes each channel of the new one.
// Bytes: state 64 KB read + 64 KB written per head (4.2 MB per layer), the dominant cost.
#include "common.cuh"

#define DK 128
#define DV 128

struct GdnArgs {
    const float* qkv;        // [conv_dim] raw projections (pre-conv)
    const float* z;          // [Hv*Dv]
    const float* b;          // [Hv]
    const float* a;          // [Hv]
    const float* conv_w;     // [conv_dim, K]
    const float* conv_in;    // [(K-1), conv_dim] state at this step's parity
    float* conv_out;         // [(K-1), conv_dim] state for the next step
    const float* a_log;      // [Hv]
    const float* dt_bias;    // [Hv]
    const float* norm_w;     // [Dv]
    float* state;            // [Hv, Dk, Dv]
    float* y;                // [Hv*Dv]
    const int* pos;          // selects the conv parity
    float eps;
    int hk, hv, conv_dim, kernel;
};

__device__ __forceinline__ float conv_channel(const GdnArgs& p, const float* cin, int ch) {
    const int K = p.kernel;
    float s = 0.f;
    for (int j = 0; j < K - 1; ++j) s = fmaf(p.conv_w[ch * K + j], cin[j * p.conv_dim + ch], s);
    s = fmaf(p.conv_w[ch * K + K - 1], p.qkv[ch], s);
    return siluf(s);
}

__device__ __forceinline__ void shift_conv(const GdnArgs& p, const float* cin, float* cout, int ch) {
    const int K = p.kernel;
    for (int j = 0; j < K - 2; ++j) cout[j * p.conv_dim + ch] = cin[(j + 1) * p.conv_dim + ch];
    cout[(K - 2) * p.conv_dim + ch] = p.qkv[ch];
}

extern "C" __global__ void __launch_bounds__(256) gdn_step(GdnArgs p) {
    __shared__ float q[DK], k[DK], v[DV], part[2][DV], scratch[32];
    const int h = blockIdx.x, t = threadIdx.x;
    const int rep = p.hv / p.hk, kh = h / rep, kd = p.hk * DK;
    const int parity = *p.pos & 1;
    const float* cin = parity ? p.conv_out : p.conv_in;
    float* cout = parity ? const_cast<float*>(p.conv_in) : p.conv_out;

    // conv + SiLU for this head's q, k (key head kh) and v channels
    if (t < DK) {
        q[t] = conv_channel(p, cin, kh * DK + t);
        k[t] = conv_channel(p, cin, kd + kh * DK + t);
    } else if (t < DK + DV) {
        int j = t - DK;
        v[j] = conv_channel(p, cin, 2 * kd + h * DV + j);
    }
    __syncthreads();
    if (t < DK && h % rep == 0) {
        shift_conv(p, cin, cout, kh * DK + t);
        shift_conv(p, cin, cout, kd + kh * DK + t);
    } else if (t >= DK && t < DK + DV) {
        shift_conv(p, cin, cout, 2 * kd + h * DV + (t - DK));
    }
    // l2 norms (eps inside the sum), q scaled by 1/sqrt(Dk)
    float qq = t < DK ? q[t] * q[t] : 0.f;
    float kk = t < DK ? k[t] * k[t] : 0.f;
    qq = block_sum(qq, scratch);
    kk = block_sum(kk, scratch);
    __syncthreads();
    if (t < DK) {
        q[t] *= rsqrtf(qq + 1e-6f) * rsqrtf((float)DK);
        k[t] *= rsqrtf(kk + 1e-6f);
    }
    __syncthreads();

    const float beta = sigmoidf(p.b[h]);
    const float xa = p.a[h] + p.dt_bias[h];
    const float softplus = xa > 20.f ? xa : log1pf(__expf(xa));
    const float decay = __expf(-__expf(p.a_log[h]) * softplus);

    const int j = t & (DV - 1), half = t >> 7, i0 = half * (DK / 2);
    float* S = p.state + (size_t)h * DK * DV;
    float s[DK / 2];
    float m = 0.f;
#pragma unroll
    for (int r = 0; r < DK / 2; ++r) {
        s[r] = S[(i0 + r) * DV + j] * decay;
        m = fmaf(s[r], k[i0 + r], m);
    }
    part[half][j] = m;
    __syncthreads();
    const float d = beta * (v[j] - (part[0][j] + part[1][j]));
    __syncthreads();
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < DK / 2; ++r) {
        s[r] = fmaf(k[i0 + r], d, s[r]);
        o = fmaf(s[r], q[i0 + r], o);
        S[(i0 + r) * DV + j] = s[r];
    }
    part[half][j] = o;
    __syncthreads();
    // gated RMSNorm over the head's Dv outputs: w · norm(o) · silu(z)
    const float out = part[0][j] + part[1][j];
    float sq = half == 0 ? out * out : 0.f;
    sq = block_sum(sq, scratch);
    if (half == 0) {
        float n = out * rsqrtf(sq / DV + p.eps) * p.norm_w[j];
        p.y[h * DV + j] = n * siluf(p.z[h * DV + j]);
    }
}
