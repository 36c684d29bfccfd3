// Quantised GEMV for batch-1 decode: y = W x for MLX affine 4/8-bit rows, several matrices that
// share one input in one launch ("segments": e.g. GDN in_proj_qkv | z | b | a), 4- and 8-bit rows
// mixed (the router and shared-expert gate are 8-bit).
//
// Shapes: K (input width) a multiple of 64 up to 4096, group 32/64/128.
// Geometry: 256 threads = 8 warps, grid = resident blocks (3 per SM); a warp walks rows
// grid-stride, lane l reading 16-byte chunks l, l+32, ... of each row (whole 512-byte spans per
// warp), with the next row's codes, scales and biases in flight while the current row is summed.
// Prologue: x is loaded once per block into padded shared memory and, optionally, RMS-normalised
// with a weight (the layer's pre-norm), or per-head RMS-normalised and gated by silu(z) (the GDN
// output norm), fused here instead of separate kernels; sums of x per 16 elements are precomputed
// so the affine bias costs one FMA per chunk: y = Σ s·(q·x) + b·Σx.
// Epilogue: write, or add into the output (residual add fused).
// Ceiling: bytes of codes + scales + biases / ~3.7 TB/s streaming read (budget.md).
// Measured (H200, commit e06983b, launched alone with events, full-size model): GDN in_proj
// 14.2 MB in 18.8 us = 0.75 TB/s (20% of 3.7 TB/s); lm_head 286 MB in 226 us = 1.27 TB/s (34%).
// Bound by instruction issue (~4.3 per weight) and short-kernel latency, not bandwidth.
#include "common.cuh"

#define MAX_SEGS 4
#define MAX_K 4096

struct Segment {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
    float* out;
    int rows;
    int bits;
    int accumulate;  // 1: out += W x (residual add)
    int _pad;
};

struct GemvArgs {
    Segment seg[MAX_SEGS];
    const float* x;
    const float* norm_weight;  // RMSNorm weight over all K (null: none)
    const float* gate_z;       // with head_norm: y = norm_head(x) * w * silu(z)
    const float* head_norm;    // per-head RMSNorm weight [head_dim] (null: none)
    float eps;
    int nseg;
    int K;
    int group;
    int head_dim;
    // routing: when `topk` is set, the last block to finish selects the experts from segment 0's
    // output (the router logits), so no separate launch is needed
    int experts;
    TopK* topk;
    int* done_counter;
    int k;
    int renorm;
};

// Thread t owns the E consecutive elements [E·t, E·t + E) of the input, E = max(K/256, 4) (so
// 4, 8 or 16; K/E threads take part): all of its x, weight and gate values are loaded in one batch
// of 16-byte loads, so the prologue costs one memory round trip instead of one per loop iteration.
#define MAX_ELEMS 16

__device__ __forceinline__ void load_input(const GemvArgs& a, float* xs, float* chunk_sum, float* scratch) {
    const int K = a.K, E = max(K / (int)blockDim.x, 4), t = threadIdx.x, base = t * E;
    const bool active = base < K;
    float v[MAX_ELEMS], w[MAX_ELEMS], z[MAX_ELEMS], hw[MAX_ELEMS];
#pragma unroll
    for (int q = 0; q < MAX_ELEMS / 4; ++q) {
        if (active && 4 * q < E) {
            float4 xv = *reinterpret_cast<const float4*>(a.x + base + 4 * q);
            v[4 * q] = xv.x; v[4 * q + 1] = xv.y; v[4 * q + 2] = xv.z; v[4 * q + 3] = xv.w;
            if (a.norm_weight) {
                float4 wv = *reinterpret_cast<const float4*>(a.norm_weight + base + 4 * q);
                w[4 * q] = wv.x; w[4 * q + 1] = wv.y; w[4 * q + 2] = wv.z; w[4 * q + 3] = wv.w;
            }
            if (a.head_norm) {
                float4 zv = *reinterpret_cast<const float4*>(a.gate_z + base + 4 * q);
                z[4 * q] = zv.x; z[4 * q + 1] = zv.y; z[4 * q + 2] = zv.z; z[4 * q + 3] = zv.w;
                float4 hv = *reinterpret_cast<const float4*>(a.head_norm + (base + 4 * q) % a.head_dim);
                hw[4 * q] = hv.x; hw[4 * q + 1] = hv.y; hw[4 * q + 2] = hv.z; hw[4 * q + 3] = hv.w;
            }
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < MAX_ELEMS; ++e) if (active && e < E) ss += v[e] * v[e];
    if (a.norm_weight) {
        ss = block_sum(ss, scratch);
        const float inv = rsqrtf(ss / K + a.eps);
#pragma unroll
        for (int e = 0; e < MAX_ELEMS; ++e) if (e < E) v[e] *= inv * w[e];
    } else if (a.head_norm) {
        // the head_dim/E (<= 32) consecutive threads of one head reduce by shuffles
        for (int o = 1; o < a.head_dim / E; o <<= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
        const float inv = rsqrtf(ss / a.head_dim + a.eps);
#pragma unroll
        for (int e = 0; e < MAX_ELEMS; ++e) if (e < E) v[e] *= inv * hw[e] * siluf(z[e]);
    }
    // sums of 16-element chunks: a thread holds E/16 whole chunks, or 16/E threads share one
    float cs = 0.f;
#pragma unroll
    for (int e = 0; e < MAX_ELEMS; ++e) {
        if (active && e < E) {
            xs[pad_idx(base + e)] = v[e];
            cs += v[e];
            if (E >= 16 && (e & 15) == 15) {
                chunk_sum[(base + e) / 16] = cs;
                cs = 0.f;
            }
        }
    }
    if (E < 16) {
        for (int o = 1; o < 16 / E; o <<= 1) cs += __shfl_xor_sync(FULL_MASK, cs, o);
        if (active && (t % (16 / E)) == 0) chunk_sum[base / 16] = cs;
    }
    __syncthreads();
}

// dot of one 16-byte chunk (c) of a 4-bit row with x, eight independent partial sums
__device__ __forceinline__ float chunk_dot4(uint4 w, const float* xs, int c) {
    const float4* xv = reinterpret_cast<const float4*>(xs + pad_idx(c * 32));
    uint32_t ws[4] = {w.x, w.y, w.z, w.w};
    float d[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float4 x0 = xv[2 * k], x1 = xv[2 * k + 1];
        d[0] = fmaf(nib(ws[k], 0), x0.x, d[0]);
        d[1] = fmaf(nib(ws[k], 1), x0.y, d[1]);
        d[2] = fmaf(nib(ws[k], 2), x0.z, d[2]);
        d[3] = fmaf(nib(ws[k], 3), x0.w, d[3]);
        d[4] = fmaf(nib(ws[k], 4), x1.x, d[4]);
        d[5] = fmaf(nib(ws[k], 5), x1.y, d[5]);
        d[6] = fmaf(nib(ws[k], 6), x1.z, d[6]);
        d[7] = fmaf(nib(ws[k], 7), x1.w, d[7]);
    }
    return ((d[0] + d[1]) + (d[2] + d[3])) + ((d[4] + d[5]) + (d[6] + d[7]));
}

__device__ __forceinline__ float chunk_dot8(uint4 w, const float* xs, int c) {
    const float4* xv = reinterpret_cast<const float4*>(xs + pad_idx(c * 16));
    uint32_t ws[4] = {w.x, w.y, w.z, w.w};
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float4 x0 = xv[k];
        d[0] = fmaf(byte_code(ws[k], 0), x0.x, d[0]);
        d[1] = fmaf(byte_code(ws[k], 1), x0.y, d[1]);
        d[2] = fmaf(byte_code(ws[k], 2), x0.z, d[2]);
        d[3] = fmaf(byte_code(ws[k], 3), x0.w, d[3]);
    }
    return (d[0] + d[1]) + (d[2] + d[3]);
}

// Up to MAX_CPL 16-byte chunks per lane per row (K = 4096 at 4 bits, 2048 at 8 bits).
#define MAX_CPL 4

// One row's codes, scales and biases for this lane, loaded ahead of use.
struct RowLoads {
    uint4 w[MAX_CPL];
    float sc[MAX_CPL], bi[MAX_CPL];
};

__device__ __forceinline__ void load_row(const Segment& s, int row, int K, int group, RowLoads& L) {
    const int lane = threadIdx.x & 31;
    const int epc = s.bits == 4 ? 32 : 16;
    const int chunks = K / epc, gpr = K / group;
    const uint4* codes = reinterpret_cast<const uint4*>(s.codes + (size_t)row * (K * s.bits / 32));
#pragma unroll
    for (int j = 0; j < MAX_CPL; ++j) {
        const int c = lane + 32 * j;
        if (c < chunks) {
            L.w[j] = __ldcs(codes + c);
            const int g = (c * epc) / group;
            L.sc[j] = bf16_to_f32(s.scales[(size_t)row * gpr + g]);
            L.bi[j] = bf16_to_f32(s.biases[(size_t)row * gpr + g]);
        }
    }
}

__device__ __forceinline__ float row_dot(const Segment& s, const RowLoads& L, int K, const float* xs, const float* chunk_sum) {
    const int lane = threadIdx.x & 31;
    const int chunks = K / (s.bits == 4 ? 32 : 16);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < MAX_CPL; ++j) {
        const int c = lane + 32 * j;
        if (c < chunks) {
            float d, xsum;
            if (s.bits == 4) { d = chunk_dot4(L.w[j], xs, c); xsum = chunk_sum[2 * c] + chunk_sum[2 * c + 1]; }
            else { d = chunk_dot8(L.w[j], xs, c); xsum = chunk_sum[c]; }
            acc = fmaf(L.sc[j], d, fmaf(L.bi[j], xsum, acc));
        }
    }
    return warp_sum(acc);
}

__device__ __forceinline__ int find_segment(const GemvArgs& a, int r, int& local) {
    int si = 0;
    local = r;
    while (local >= a.seg[si].rows) { local -= a.seg[si].rows; ++si; }
    return si;
}

// The grid is sized to the resident blocks (the prologue is paid once per block), and each warp
// walks its rows with the next row's loads issued before the current row's arithmetic.
// The grid is sized to the resident blocks (the prologue is paid once per block), and each warp
// walks its rows with the next row's loads issued before the current row's arithmetic.
extern "C" __global__ void __launch_bounds__(256, 3) gemv_q(GemvArgs a) {
    __shared__ __align__(16) float xs[MAX_K + MAX_K / 8];
    __shared__ float chunk_sum[MAX_K / 16];
    __shared__ float scratch[32];
    __shared__ int last_block;
    load_input(a, xs, chunk_sum, scratch);

    int total = 0;
    for (int i = 0; i < a.nseg; ++i) total += a.seg[i].rows;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int stride = gridDim.x * 8;
    int r = blockIdx.x * 8 + warp;
    if (r < total) {
        int local, si = find_segment(a, r, local);
        RowLoads cur, next;
        load_row(a.seg[si], local, a.K, a.group, cur);
        while (true) {
            const int rn = r + stride;
            int local_n = 0, si_n = 0;
            if (rn < total) {
                si_n = find_segment(a, rn, local_n);
                load_row(a.seg[si_n], local_n, a.K, a.group, next);
            }
            const Segment& s = a.seg[si];
            const float y = row_dot(s, cur, a.K, xs, chunk_sum);
            if (lane == 0) {
                if (s.accumulate) s.out[local] += y; else s.out[local] = y;
            }
            if (rn >= total) break;
            r = rn;
            si = si_n;
            local = local_n;
            cur = next;
        }
    }
    if (a.topk == nullptr) return;
    // last block done: every block's writes are visible after its fence and the counter
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last_block = atomicAdd(a.done_counter, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last_block) return;
    // block-parallel top-k: each thread ranks its logits against all others (ties: lower index),
    // so selection costs one pass over E values from shared memory instead of k serial rounds
    __threadfence();
    float* sl = xs;  // the input is no longer needed
    __shared__ int sel_id[MAX_TOPK];
    __shared__ float sel_logit[MAX_TOPK];
    const int E = a.experts;
    float mx = -INFINITY;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        sl[e] = __ldcg(a.seg[0].out + e);
        mx = fmaxf(mx, sl[e]);
    }
    mx = warp_max(mx);
    if (lane == 0) scratch[warp] = mx;
    __syncthreads();
    mx = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) mx = fmaxf(mx, scratch[w]);
    float all = 0.f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float v = sl[e];
        int rank = 0;
        for (int j = 0; j < E; ++j) {
            const float u = sl[j];
            rank += (u > v) || (u == v && j < e);
        }
        if (rank < a.k) {
            sel_id[rank] = e;
            sel_logit[rank] = v;
        }
        all += __expf(v - mx);
    }
    all = block_sum(all, scratch);
    if (threadIdx.x == 0) {
        float p[MAX_TOPK], chosen = 0.f;
        for (int r = 0; r < a.k; ++r) {
            p[r] = __expf(sel_logit[r] - mx);
            chosen += p[r];
        }
        const float denom = a.renorm ? chosen : all;
        for (int r = 0; r < a.k; ++r) {
            a.topk->ids[r] = sel_id[r];
            a.topk->w[r] = p[r] / denom;
        }
        *a.done_counter = 0;
    }
}
