// Sparse MoE decode: routed experts' gate+up+SwiGLU for the top-k slots, then one "virtual" GEMV
// for the down projections of all k experts plus the shared expert, with the routing weights and
// the shared expert's sigmoid gate folded into the activations, and the residual add fused.
//
// Shapes: hidden H (2048), expert intermediate I (512), E experts (256), top-k (8), 4-bit g64.
// moe_gate_up: 256 threads; each warp computes gate and up rows f, f+1 of one slot, all 16-byte
//   loads issued before the arithmetic; each block first redoes the top-k over the E router
//   logits (cheap) and block 0 publishes ids and weights for moe_down. Reads k*2*I*H/2 bytes (8.4 MB).
// moe_down: one warp per two output rows; a row is 9 segments of I codes (8 experts + shared),
//   activations h (k*I + I floats, pre-weighted) in shared memory, segment base pointers resolved
//   once per block. Reads (k+1)*H*I/2 bytes (4.7 MB).
#include "common.cuh"

#define MAX_K_H 4096
#define MAX_TOPK 16
#define MAX_CH 4  // 16-byte chunks per lane of a hidden-size row (H <= 4096)
#define MAX_E 512
// routed + shared down activations: (k + 1) * I elements (11 * 512 for Qwen3-Next's top-10)
#define MAX_KV 6144
// 16-byte chunks per lane of a down row: (k+1)·I/32 chunks over 32 lanes (144 → 5 for 8+1 × 512)
#define DOWN_CPL 6

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
#pragma unroll
    for (int j = 0; j < MAX_E / 32; ++j) {
        if (j >= per) { vals[j] = -INFINITY; continue; }
        int e = lane + 32 * j;
        vals[j] = e < E ? logits[e] : -INFINITY;
        mx = fmaxf(mx, vals[j]);
    }
    mx = warp_max(mx);
    float total = 0.f;
#pragma unroll
    for (int j = 0; j < MAX_E / 32; ++j) {
        int e = lane + 32 * j;
        total += j < per && e < E ? __expf(vals[j] - mx) : 0.f;
    }
    total = warp_sum(total);
    float chosen = 0.f;
    for (int r = 0; r < k; ++r) {
        float best = -INFINITY;
        int bi = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < MAX_E / 32; ++j) {
            int e = lane + 32 * j;
            if (j < per && e < E && (vals[j] > best || (vals[j] == best && e < bi))) { best = vals[j]; bi = e; }
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
#pragma unroll
        for (int j = 0; j < MAX_E / 32; ++j)
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
    __shared__ TopK tks[8];
    const int H = a.H;
    // every warp selects the experts itself (cheap, and no warp waits for another)
    TopK& tk = tks[threadIdx.x >> 5];
    top_k(a.router_logits, a.E, a.k, a.renorm, &tk);
    __syncwarp();
    // thread t owns E = max(H/256, 4) consecutive elements, loaded in one batch (see gemv.cu)
    const int E = max(H / (int)blockDim.x, 4), t = threadIdx.x, base = t * E;
    const bool active = base < H;
    float v[16], w[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        if (active && 4 * q < E) {
            float4 xv = *reinterpret_cast<const float4*>(a.x + base + 4 * q);
            float4 wv = *reinterpret_cast<const float4*>(a.norm_weight + base + 4 * q);
            v[4 * q] = xv.x; v[4 * q + 1] = xv.y; v[4 * q + 2] = xv.z; v[4 * q + 3] = xv.w;
            w[4 * q] = wv.x; w[4 * q + 1] = wv.y; w[4 * q + 2] = wv.z; w[4 * q + 3] = wv.w;
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) if (active && e < E) ss += v[e] * v[e];
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / H + a.eps);
    float cs = 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) {
        if (active && e < E) {
            float y = v[e] * inv * w[e];
            xs[pad_idx(base + e)] = y;
            cs += y;
        }
    }
    // 32-element chunks: 32/E threads share one
    for (int o = 1; o < 32 / E; o <<= 1) cs += __shfl_xor_sync(FULL_MASK, cs, o);
    if (active && (t % (32 / E)) == 0) chunk_sum[base / 32] = cs;
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.topk_out = tk;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int total = a.k * a.I, gpr = H / 64, wpr = H / 8, chunks = H / 32;
    // a warp owns two intermediate rows f, f+1 of one slot: 4 matrix rows, all loads issued first
    for (int r = (blockIdx.x * 8 + warp) * 2; r < total; r += gridDim.x * 16) {
        const int slot = r / a.I, f = r % a.I;
        const size_t row = (size_t)tk.ids[slot] * a.I + f;
        uint4 wg[2][MAX_CH], wu[2][MAX_CH];
        float sg[2][MAX_CH], bg[2][MAX_CH], su[2][MAX_CH], bu[2][MAX_CH];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
            for (int j = 0; j < MAX_CH; ++j) {
                int c = lane + 32 * j;
                if (c < chunks) {
                    size_t R = row + rr;
                    wg[rr][j] = __ldcs(reinterpret_cast<const uint4*>(a.gate.codes + R * wpr) + c);
                    wu[rr][j] = __ldcs(reinterpret_cast<const uint4*>(a.up.codes + R * wpr) + c);
                    sg[rr][j] = bf16_to_f32(a.gate.scales[R * gpr + c / 2]);
                    bg[rr][j] = bf16_to_f32(a.gate.biases[R * gpr + c / 2]);
                    su[rr][j] = bf16_to_f32(a.up.scales[R * gpr + c / 2]);
                    bu[rr][j] = bf16_to_f32(a.up.biases[R * gpr + c / 2]);
                }
            }
        }
        float g[2] = {0.f, 0.f}, u[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < MAX_CH; ++j) {
            int c = lane + 32 * j;
            if (c >= chunks) break;
            const float4* xv = reinterpret_cast<const float4*>(xs + pad_idx(c * 32));
            float xx[32];
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                float4 t = xv[q];
                xx[4 * q] = t.x; xx[4 * q + 1] = t.y; xx[4 * q + 2] = t.z; xx[4 * q + 3] = t.w;
            }
            const float cs = chunk_sum[c];
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                uint32_t g4[4] = {wg[rr][j].x, wg[rr][j].y, wg[rr][j].z, wg[rr][j].w};
                uint32_t u4[4] = {wu[rr][j].x, wu[rr][j].y, wu[rr][j].z, wu[rr][j].w};
                float pg[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, pu[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
#pragma unroll
                    for (int n = 0; n < 8; ++n) {
                        pg[n] = fmaf(nib(g4[q], n), xx[8 * q + n], pg[n]);
                        pu[n] = fmaf(nib(u4[q], n), xx[8 * q + n], pu[n]);
                    }
                }
                const float dg = ((pg[0] + pg[1]) + (pg[2] + pg[3])) + ((pg[4] + pg[5]) + (pg[6] + pg[7]));
                const float du = ((pu[0] + pu[1]) + (pu[2] + pu[3])) + ((pu[4] + pu[5]) + (pu[6] + pu[7]));
                g[rr] = fmaf(sg[rr][j], dg, fmaf(bg[rr][j], cs, g[rr]));
                u[rr] = fmaf(su[rr][j], du, fmaf(bu[rr][j], cs, u[rr]));
            }
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float gg = warp_sum(g[rr]), uu = warp_sum(u[rr]);
            if (lane == 0) a.h[slot * a.I + f + rr] = siluf(gg) * uu;
        }
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
    __shared__ const uint32_t* seg_codes[MAX_TOPK + 1];
    __shared__ const __nv_bfloat16* seg_scales[MAX_TOPK + 1];
    __shared__ const __nv_bfloat16* seg_biases[MAX_TOPK + 1];
    __shared__ float seg_w[MAX_TOPK];
    const int I = a.I, k = a.k, segs = k + 1, Kv = segs * I;
    const int gpr = I / 64, wpr = I / 8;
    if (threadIdx.x < segs) {
        const int s = threadIdx.x;
        const size_t row0 = s < k ? (size_t)a.topk->ids[s] * a.H : 0;
        const ExpertStack st = s < k ? a.down : a.shared_down;
        seg_codes[s] = st.codes + row0 * wpr;
        seg_scales[s] = st.scales + row0 * gpr;
        seg_biases[s] = st.biases + row0 * gpr;
        if (s < k) seg_w[s] = a.topk->w[s];
    }
    __syncthreads();
    const float sg = sigmoidf(a.shared_gate_logit[0]);
#pragma unroll 8
    for (int i = threadIdx.x; i < Kv; i += blockDim.x) {
        int s = i / I, j = i % I;
        float v = s < k ? seg_w[s] * a.h[i] : sg * siluf(a.shared_gate_proj[j]) * a.shared_up_proj[j];
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
    const int cps = I / 32, chunks = segs * cps;
    // a warp owns two output rows; each row is `segs` segments of I codes
    for (int n = (blockIdx.x * 8 + warp) * 2; n < a.H; n += gridDim.x * 16) {
        uint4 w[2][DOWN_CPL];
        float sc[2][DOWN_CPL], bi[2][DOWN_CPL];
#pragma unroll
        for (int j = 0; j < DOWN_CPL; ++j) {
            int c = lane + 32 * j;
            if (c < chunks) {
                int s = c / cps, cl = c % cps;
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    size_t row = (size_t)(n + rr);
                    w[rr][j] = __ldcs(reinterpret_cast<const uint4*>(seg_codes[s] + row * wpr) + cl);
                    sc[rr][j] = bf16_to_f32(seg_scales[s][row * gpr + cl / 2]);
                    bi[rr][j] = bf16_to_f32(seg_biases[s][row * gpr + cl / 2]);
                }
            }
        }
        float acc[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < DOWN_CPL; ++j) {
            int c = lane + 32 * j;
            if (c >= chunks) break;
            const float4* xv = reinterpret_cast<const float4*>(hs + pad_idx(c * 32));
            float xx[32];
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                float4 t = xv[q];
                xx[4 * q] = t.x; xx[4 * q + 1] = t.y; xx[4 * q + 2] = t.z; xx[4 * q + 3] = t.w;
            }
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                uint32_t w4[4] = {w[rr][j].x, w[rr][j].y, w[rr][j].z, w[rr][j].w};
                float pd[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
#pragma unroll
                    for (int m = 0; m < 8; ++m) pd[m] = fmaf(nib(w4[q], m), xx[8 * q + m], pd[m]);
                }
                const float d = ((pd[0] + pd[1]) + (pd[2] + pd[3])) + ((pd[4] + pd[5]) + (pd[6] + pd[7]));
                acc[rr] = fmaf(sc[rr][j], d, fmaf(bi[rr][j], chunk_sum[c], acc[rr]));
            }
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float v = warp_sum(acc[rr]);
            if (lane == 0) a.x[n + rr] += v;
        }
    }
}
