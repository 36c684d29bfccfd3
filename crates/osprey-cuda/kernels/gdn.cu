// Gated DeltaNet decode step, fused: causal conv (state K-1 deep) + SiLU, L2 norm of q and k,
// q scaling, β and the log-decay g, and the gated delta update of the fp32 state with the output
// of the updated state (taken from the decayed state's products, see gdn_step). The per-head
// gated RMSNorm that follows is fused into the out_proj GEMV's prologue (gemv.cu), so heads can
// be split across blocks here.
//
// Shapes: Dk = Dv = 128, Hv value heads (32) over Hk key heads (16), conv kernel K (4).
// Geometry: grid (Hv, 4): each block owns 32 state columns of one head; thread t owns column
// t % 32 of that range and rows [16·(t/32), +16): 16 fp32 state values in registers, read and
// written once (each warp reads 128-byte row segments). Columns are independent in the delta
// rule, so no cross-block reduction is needed; q and k are recomputed per block (cheap).
// Conv state is double-buffered by position parity: q/k channels are shared by Hv/Hk value heads,
// so every block reads the old buffer and exactly one block writes each channel of the new one.
// Bytes: state 64 KB read + 64 KB written per head (4.2 MB per layer), the dominant cost.
// Measured (H200, commit e06983b, launched alone with events): 10.1 us per layer for 4.2 MB of
// state traffic = 0.42 TB/s (11% of 3.7 TB/s); latency of its short dependent phases dominates.
// The conv's loads then waited on each other (a runtime tap count: each tap's FMA before the
// next tap's loads; the state shift reloaded what the conv had read, after its stores); with the
// taps fixed at 4, every conv input requested at once and the conv state read before the wait:
// 9.5 -> 6.5 us per launch alone, the step at 4K 558.6 -> 591.0 tok/s
// (bench/results/cuda-decode-early-loads-2.json). Every sum after the conv in one pass and one
// barrier (the norms applied as scalars afterwards, the output without a second pass; nine
// barriers before): 2.46 -> 2.22 us per launch in the 4K timeline, the step at 4K 815.8 -> 821.7
// tok/s, 32K +0.6%, 128K +0.3% (bench/results/cuda-decode-gdn-one-barrier.json).
#include "common.cuh"

#define DK 128
#define DV 128
#define COLS 32
#define COL_SPLITS (DV / COLS)
#define ROW_GROUPS 8
#define ROWS_PER (DK / ROW_GROUPS)
// conv taps (the host admits only this: decoder.rs check_shapes)
#define CONV_K 4

struct GdnArgs {
    const float* qkv;        // [conv_dim] raw projections (pre-conv)
    const float* b;          // [Hv]
    const float* a;          // [Hv]
    const float* conv_w;     // [conv_dim, K]
    const float* conv_in;    // [(K-1), conv_dim] state at even positions' read side
    float* conv_out;         // [(K-1), conv_dim] the other buffer
    const float* a_log;      // [Hv]
    const float* dt_bias;    // [Hv]
    float* state;            // [Hv, Dk, Dv]
    float* o;                // [Hv*Dv] delta-rule output (before the gated norm)
    const int* pos;          // selects the conv parity
    int hk, hv, conv_dim;
    // speculative verify step (speculative.cu): role 1 (row 0) reads the current buffer and
    // writes the other, role 2 (row 1) reads the other and writes the current one; `cur` says
    // which of state / state_alt is current. Role 0 (the one-token step) updates `state` in place.
    float* state_alt;
    const int* cur;
    int role;
    int _pad;
};

// One channel's conv inputs: its 4 taps and the 3 older inputs (the conv state), requested
// together before the dependency wait (no kernel of this step writes them: the state is this
// kernel's own, from the step before), then the new input once the projections are in; reused
// for the state shift instead of reloaded (the tap count is a compile-time constant, so no loop
// waits on a load).
struct ConvChannel {
    float4 w;
    float old[CONV_K - 1];
    float x;
};

__device__ __forceinline__ ConvChannel load_taps(const GdnArgs& p, const float* cin, int ch) {
    ConvChannel c;
    c.w = reinterpret_cast<const float4*>(p.conv_w)[ch];
#pragma unroll
    for (int j = 0; j < CONV_K - 1; ++j) c.old[j] = cin[j * p.conv_dim + ch];
    c.x = 0.f;
    return c;
}

__device__ __forceinline__ float conv_silu(const ConvChannel& c) {
    float s = c.w.x * c.old[0];
    s = fmaf(c.w.y, c.old[1], s);
    s = fmaf(c.w.z, c.old[2], s);
    return siluf(fmaf(c.w.w, c.x, s));
}

// The channel's state one position on: the two newest old inputs, then the new one.
__device__ __forceinline__ void shift_conv(const GdnArgs& p, const ConvChannel& c, float* cout, int ch) {
#pragma unroll
    for (int j = 0; j < CONV_K - 2; ++j) cout[j * p.conv_dim + ch] = c.old[j + 1];
    cout[(CONV_K - 2) * p.conv_dim + ch] = c.x;
}

extern "C" __global__ void __launch_bounds__(256) gdn_step(GdnArgs p) {
    __shared__ float q[DK], k[DK], v[COLS], part[ROW_GROUPS][COLS], part_q[ROW_GROUPS][COLS], norms[3][DK / 32];
    const int h = blockIdx.x, split = blockIdx.y, t = threadIdx.x;
    const int rep = p.hv / p.hk, kh = h / rep, kd = p.hk * DK;
    const int v0 = 2 * kd + h * DV + split * COLS;
    const int jl = t & (COLS - 1), rg = t >> 5, i0 = rg * ROWS_PER, j = split * COLS + jl;
    // the buffer read and the one written (role: see GdnArgs)
    const int cur = p.role ? *p.cur : 0;
    const size_t head = (size_t)h * DK * DV;
    const float* S = ((p.role == 2 ? cur ^ 1 : cur) ? p.state_alt : p.state) + head;
    float* Sw = ((p.role == 1 ? cur ^ 1 : cur) ? p.state_alt : p.state) + head;

    // Only this kernel, once per step, touches this layer's state and conv state, so they are read
    // first: before the dependency wait when the step's kernels overlap (common.cuh; the position
    // and both states were last written by the step before, a graph replay that has finished).
    step_overlap_begin();
    float s[ROWS_PER];
#pragma unroll
    for (int r = 0; r < ROWS_PER; ++r) s[r] = S[(i0 + r) * DV + j];
    const float a_log = p.a_log[h], dt_bias = p.dt_bias[h];
    const int parity = *p.pos & 1;
    const float* cin = parity ? p.conv_out : p.conv_in;
    float* cout = parity ? const_cast<float*>(p.conv_in) : p.conv_out;
    // this head's q, k channels (key head kh) and this block's v channels
    const int chq = kh * DK + t, chk = kd + kh * DK + t, chv = v0 + (t - DK);
    const bool qk_thread = t < DK, v_thread = !qk_thread && t < DK + COLS;
    ConvChannel c0, c1;
    if (qk_thread) {
        c0 = load_taps(p, cin, chq);
        c1 = load_taps(p, cin, chk);
    } else if (v_thread) {
        c0 = load_taps(p, cin, chv);
    }
    step_inputs_ready();
    // the projections' values and the gates' inputs in one round trip
    const float b_in = p.b[h], a_in = p.a[h];
    if (qk_thread) {
        c0.x = p.qkv[chq];
        c1.x = p.qkv[chk];
    } else if (v_thread) {
        c0.x = p.qkv[chv];
    }

    // conv + SiLU; the key head's first block (and each block for its v channels) writes the
    // shifted conv state
    if (qk_thread) {
        q[t] = conv_silu(c0);
        k[t] = conv_silu(c1);
        if (h % rep == 0 && split == 0) {
            shift_conv(p, c0, cout, chq);
            shift_conv(p, c1, cout, chk);
        }
    } else if (v_thread) {
        v[t - DK] = conv_silu(c0);
        shift_conv(p, c0, cout, chv);
    }
    __syncthreads();
    step_phase(2);  // conv done
    // One pass over the state and one barrier for every sum the step needs. The L2 norms are
    // scalars, so they scale the sums afterwards: with k = rk·k̂ and q = rq·q̂ (q̂, k̂ the conv
    // outputs, rq with the 1/sqrt(Dk) scaling) and S the decayed state,
    //   mem = Sᵀk = rk·Sᵀk̂,   d = β(v − mem),
    //   o = (S + k dᵀ)ᵀq = rq·Sᵀq̂ + d·rk·rq·(k̂·q̂),
    // so the output needs no second pass over the updated state; Sᵀk̂, Sᵀq̂ (this thread's rows,
    // then the row groups' sums) and q̂·q̂, k̂·k̂, k̂·q̂ (warps 0-3, whose threads hold q̂ and k̂) meet
    // in shared memory behind one barrier.
    const float beta = sigmoidf(b_in);
    const float xa = a_in + dt_bias;
    const float softplus = xa > 20.f ? xa : log1pf(__expf(xa));
    const float decay = __expf(-__expf(a_log) * softplus);
    float sk = 0.f, sq = 0.f;
#pragma unroll
    for (int r = 0; r < ROWS_PER; ++r) {
        s[r] *= decay;
        sk = fmaf(s[r], k[i0 + r], sk);
        sq = fmaf(s[r], q[i0 + r], sq);
    }
    part[rg][jl] = sk;
    part_q[rg][jl] = sq;
    if (t < DK) {
        const float qv = q[t], kv = k[t];
        const float qq = warp_sum(qv * qv), kk = warp_sum(kv * kv), kq = warp_sum(kv * qv);
        if ((t & 31) == 0) {
            norms[0][t >> 5] = qq;
            norms[1][t >> 5] = kk;
            norms[2][t >> 5] = kq;
        }
    }
    __syncthreads();
    step_phase(3);  // the state's sums met
    float qq = 0.f, kk = 0.f, kq = 0.f;
#pragma unroll
    for (int w = 0; w < DK / 32; ++w) {
        qq += norms[0][w];
        kk += norms[1][w];
        kq += norms[2][w];
    }
    // l2 norms (eps inside the sum), q scaled by 1/sqrt(Dk)
    const float rq = rsqrtf(qq + 1e-6f) * rsqrtf((float)DK), rk = rsqrtf(kk + 1e-6f);
    float mem = 0.f;
#pragma unroll
    for (int g = 0; g < ROW_GROUPS; ++g) mem += part[g][jl];
    const float d = beta * (v[jl] - rk * mem);
#pragma unroll
    for (int r = 0; r < ROWS_PER; ++r) Sw[(i0 + r) * DV + j] = fmaf(rk * k[i0 + r], d, s[r]);
    if (rg == 0) {
        float out = 0.f;
#pragma unroll
        for (int g = 0; g < ROW_GROUPS; ++g) out += part_q[g][jl];
        p.o[h * DV + j] = rq * out + d * (rk * rq * kq);
    }
}
