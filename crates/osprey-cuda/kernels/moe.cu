// Sparse MoE decode: routed experts' gate+up+SwiGLU for the top-k slots, then one "virtual" GEMV
// for the down projections of all k experts plus the shared expert, with the routing weights and
// the shared expert's sigmoid gate folded into the activations, and the residual add fused.
//
// Shapes: hidden H (2048), expert intermediate I (512), E experts (256), top-k (8), 4-bit g64.
// moe_gate_up: 256 threads; each warp computes gate row f and up row f of one slot (k*I warps in
//   all); each block first redoes the top-k over the E router logits (cheap) and block 0 publishes
//   ids and weights for moe_down. Reads k*2*I*H/2 bytes (8.4 MB).
// moe_down: one warp per output row n; the row is 9 segments of I codes (8 experts + shared),
//   activations h (k*I + I floats, pre-weighted) in shared memory. Reads (k+1)*H*I/2 bytes (4.7 MB).
#include "common.cuh"

#define MAX_K_H 4096
#define MAX_TOPK 16
#define MAX_E 512
// routed + shared down activations: (k + 1) * I elements (11 * 512 for Qwen3-Next's top-10)
#define MAX_KV 6144

struct TopK {
    int ids[MAX_TOPK];
    float w[MAX_TOPK];
};

// softmax(logits) -> top-k (ties: lower index) -> optionally renormalised; warp 0 only.
__device__ void top_k(const float* logits, int E, int k, int renorm, TopK* out) {
    const int lane = threadIdx.x & 31;
    float vals[MAX_E / 32];
    const int per = (E + 31) / 32;
    float mx = -INFINITY;
    for (int j = 0; j < per; ++j) {
        int e = lane + 32 * j;
        vals[j] = e < E ? logits[e] : -INFINITY;
        mx = fmaxf(mx, vals[j]);
    }
    mx = warp_max(mx);
    float total = 0.f;
    for (int j = 0; j < per; ++j) {
        int e = lane + 32 * j;
        total += e < E ? __expf(vals[j] - mx) : 0.f;
    }
    total = warp_sum(total);
    float chosen = 0.f;
    for (int r = 0; r < k; ++r) {
        float best = -INFINITY;
        int bi = 0x7fffffff;
        for (int j = 0; j < per; ++j) {
            int e = lane + 32 * j;
            if (e < E && (vals[j] > best || (vals[j] == best && e < bi))) { best = vals[j]; bi = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(FULL_MASK, best, o);
            int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
        }
        float p = __expf(best - mx);
        chosen += p;
        if (lane == 0) { out->ids[r] = bi; out->w[r] = p; }
        for (int j = 0; j < per; ++j)
            if (lane + 32 * j == bi) vals[j] = -INFINITY;
    }
    __syncwarp();
    if (lane == 0) {
        float denom = renorm ? chosen : total;
        for (int r = 0; r < k; ++r) out->w[r] /= denom;
    }
}

struct ExpertStack {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
};

struct GateUpArgs {
    ExpertStack gate, up;     // [E*I, H]
    const float* router_logits;
    const float* x;           // residual stream
    const float* norm_weight; // post-attention norm
    float eps;
    float* h;                 // [k, I] SwiGLU outputs
    TopK* topk_out;           // published by block 0
    int H, I, E, k, renorm;
};

extern "C" __global__ void __launch_bounds__(256) moe_gate_up(GateUpArgs a) {
    __shared__ __align__(16) float xs[MAX_K_H + MAX_K_H / 8];
    __shared__ float chunk_sum[MAX_K_H / 32];
    __shared__ float scratch[32];
    __shared__ TopK tk;
    const int H = a.H;
    if (threadIdx.x < 32) top_k(a.router_logits, a.E, a.k, a.renorm, &tk);
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) { float v = a.x[i]; ss += v * v; }
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / H + a.eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) xs[pad_idx(i)] = a.x[i] * inv * a.norm_weight[i];
    __syncthreads();
    for (int c = threadIdx.x; c < H / 32; c += blockDim.x) {
        float s = 0.f;
        for (int j = 0; j < 32; ++j) s += xs[pad_idx(c * 32 + j)];
        chunk_sum[c] = s;
    }
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.topk_out = tk;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int total = a.k * a.I, gpr = H / 64, wpr = H / 8;
    for (int r = blockIdx.x * 8 + warp; r < total; r += gridDim.x * 8) {
        const int slot = r / a.I, f = r % a.I;
        const size_t row = (size_t)tk.ids[slot] * a.I + f;
        const uint4* gc = reinterpret_cast<const uint4*>(a.gate.codes + row * wpr);
        const uint4* uc = reinterpret_cast<const uint4*>(a.up.codes + row * wpr);
        float g = 0.f, u = 0.f;
        for (int c = lane; c < H / 32; c += 32) {
            uint4 wg = __ldcs(gc + c), wu = __ldcs(uc + c);
            int grp = c / 2;
            float cs = chunk_sum[c];
            // inline 4-bit chunk dots
            const float4* xv = reinterpret_cast<const float4*>(xs + pad_idx(c * 32));
            uint32_t g4[4] = {wg.x, wg.y, wg.z, wg.w}, u4[4] = {wu.x, wu.y, wu.z, wu.w};
            float dg = 0.f, du = 0.f;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float4 x0 = xv[2 * q], x1 = xv[2 * q + 1];
                float xx[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int n = 0; n < 8; ++n) {
                    dg = fmaf(nib(g4[q], n), xx[n], dg);
                    du = fmaf(nib(u4[q], n), xx[n], du);
                }
            }
            g = fmaf(bf16_to_f32(a.gate.scales[row * gpr + grp]), dg, fmaf(bf16_to_f32(a.gate.biases[row * gpr + grp]), cs, g));
            u = fmaf(bf16_to_f32(a.up.scales[row * gpr + grp]), du, fmaf(bf16_to_f32(a.up.biases[row * gpr + grp]), cs, u));
        }
        g = warp_sum(g);
        u = warp_sum(u);
        if (lane == 0) a.h[slot * a.I + f] = siluf(g) * u;
    }
}

struct DownArgs {
    ExpertStack down;          // routed experts [E*H, I]
    ExpertStack shared_down;   // [H, Is]
    const float* h;            // [k, I]
    const float* shared_gate_proj;  // [Is] (pre-activation)
    const float* shared_up_proj;    // [Is]
    const float* shared_gate_logit; // [1]
    const TopK* topk;
    float* x;                  // residual stream, += result
    int H, I, k;
};

extern "C" __global__ void __launch_bounds__(256) moe_down(DownArgs a) {
    __shared__ __align__(16) float hs[MAX_KV + MAX_KV / 8];
    __shared__ float chunk_sum[MAX_KV / 32];
    __shared__ TopK tk;
    if (threadIdx.x == 0) tk = *a.topk;
    __syncthreads();
    const int I = a.I, k = a.k, segs = k + 1, Kv = segs * I;
    const float sg = sigmoidf(a.shared_gate_logit[0]);
    for (int i = threadIdx.x; i < Kv; i += blockDim.x) {
        int s = i / I, j = i % I;
        float v = s < k ? tk.w[s] * a.h[i] : sg * siluf(a.shared_gate_proj[j]) * a.shared_up_proj[j];
        hs[pad_idx(i)] = v;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < Kv / 32; c += blockDim.x) {
        float s = 0.f;
        for (int j = 0; j < 32; ++j) s += hs[pad_idx(c * 32 + j)];
        chunk_sum[c] = s;
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int cps = I / 32, gpr = I / 64, wpr = I / 8;
    for (int n = blockIdx.x * 8 + warp; n < a.H; n += gridDim.x * 8) {
        float acc = 0.f;
        for (int c = lane; c < segs * cps; c += 32) {
            int s = c / cps, cl = c % cps;
            const ExpertStack& st = s < k ? a.down : a.shared_down;
            size_t row = s < k ? (size_t)tk.ids[s] * a.H + n : (size_t)n;
            uint4 w = __ldcs(reinterpret_cast<const uint4*>(st.codes + row * wpr) + cl);
            const float4* xv = reinterpret_cast<const float4*>(hs + pad_idx(c * 32));
            uint32_t w4[4] = {w.x, w.y, w.z, w.w};
            float d = 0.f;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float4 x0 = xv[2 * q], x1 = xv[2 * q + 1];
                float xx[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int m = 0; m < 8; ++m) d = fmaf(nib(w4[q], m), xx[m], d);
            }
            int grp = cl / 2;
            acc = fmaf(bf16_to_f32(st.scales[row * gpr + grp]), d, fmaf(bf16_to_f32(st.biases[row * gpr + grp]), chunk_sum[c], acc));
        }
        acc = warp_sum(acc);
        if (lane == 0) a.x[n] += acc;
    }
}
