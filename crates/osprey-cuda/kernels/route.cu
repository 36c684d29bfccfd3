// MoE routing for prefill, all on the GPU (no host sync inside a layer):
//   route_topk    — per token: softmax over the router logits, top-k (ties: lower expert id),
//                   renormalised when the config says so; counts rows per expert; the shared
//                   expert gate's logit (its single weight row). One warp per token.
//   route_plan    — one block: exclusive scan of the counts into each expert's first position, and
//                   the GEMM tile plan (expert, first position, end) per tile of BM positions; an
//                   expert's last rows, when at most `tail`, join its last full tile (a kernel
//                   reads a tile's rows as min(end - first, BM + tail if end - first <= BM + tail)).
//   route_scatter — gives every (token, slot) its position in the expert-grouped order: the A row
//                   (token) of the position, its routing weight, and where the token finds it.
//   moe_combine   — x[t] += Σ_slots y[position] (already weighted) + sigmoid(shared gate) · shared,
//                   then the next layer's input RMSNorm of x[t] into its bf16 GEMM input.
// Positions inside one expert's range come in whatever order the atomics give, but each result
// depends only on its own row, and the combine sums a token's slots in slot order: deterministic.
// Measured (H200, commit 7bf2668, 4K prompt, 40 layers): routing 1.7 ms; combine 3.8 ms for
// ~10.7 GB of f32 expert outputs read = 2.8 TB/s (76% of ~3.7 TB/s); with bf16 outputs and the
// next layer's norm fused, 2.7 ms (commit ccad216; the separate norms it replaced took 1.0).
#include "common.cuh"

struct RouteArgs {
    const float* logits;   // [T, E]
    int* ids;              // [T, k]
    float* weights;        // [T, k]
    int* counts;           // [E] (zeroed before route_topk)
    int* fill;             // [E] (zeroed by route_plan)
    int* offsets;          // [E]
    int4* tiles;           // [max tiles]
    int* tile_count;
    int* a_rows;           // [T·k] token of each position
    float* row_weight;     // [T·k] routing weight of each position
    int* slot_pos;         // [T·k] position of (token, slot)
    const __nv_bfloat16* act;          // [T, H] bf16 perm64: the router's input
    const uint32_t* gate_codes;        // the shared expert gate's one weight row (MLX affine)
    const __nv_bfloat16* gate_scales;
    const __nv_bfloat16* gate_biases;
    float* shared_gate;                // [T] its logit
    int T, E, k, renorm, bm, max_tiles;
    int H, gate_bits, gate_group;
    int tail;              // route_plan: an expert's last rows, when at most this many, join its last full tile
};

// The shared expert gate's logit of token t: one weight row · the token's activations, by one warp
// (lane l takes logical elements 8l.. of every 256; the activations are in the perm64 order).
// A GEMM launch for this single row cost as much as the router's 256 (its blocks compute 256-row
// tiles); here it is a 4 KB read per token.
__device__ __forceinline__ float shared_gate_logit(const RouteArgs& a, int t, int lane) {
    const __nv_bfloat16* x = a.act + (size_t)t * a.H;
    const int words_per_8 = a.gate_bits / 4;  // code words holding 8 elements
    float acc = 0.f;
    for (int k0 = 8 * lane; k0 < a.H; k0 += 256) {
        const float s = __bfloat162float(a.gate_scales[k0 / a.gate_group]);
        const float b = __bfloat162float(a.gate_biases[k0 / a.gate_group]);
        const uint32_t* w = a.gate_codes + k0 / 8 * words_per_8;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float code = a.gate_bits == 4 ? nib(w[0], i) : byte_code(w[i >> 2], i & 3);
            acc = fmaf(fmaf(code, s, b), __bfloat162float(x[perm64(k0 + i)]), acc);
        }
    }
    return warp_sum(acc);
}

#define MAX_E_PER_LANE (MAX_E / 32)

extern "C" __global__ void route_topk(RouteArgs a) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (warp >= a.T) return;
    const float* l = a.logits + (size_t)warp * a.E;
    float v[MAX_E_PER_LANE];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < MAX_E_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < a.E ? l[e] : -INFINITY;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float all = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_E_PER_LANE; ++i) all += lane + 32 * i < a.E ? __expf(v[i] - mx) : 0.f;
    all = warp_sum(all);
    int sel[MAX_TOPK];
    float selp[MAX_TOPK], chosen = 0.f;
    for (int r = 0; r < a.k; ++r) {
        // this lane's best remaining (lowest id on ties), then the warp's
        float best = -INFINITY;
        int bid = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MAX_E_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (e < a.E && (v[i] > best || (v[i] == best && e < bid))) {
                best = v[i];
                bid = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(FULL_MASK, best, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bid, o);
            if (ob > best || (ob == best && oi < bid)) {
                best = ob;
                bid = oi;
            }
        }
        sel[r] = bid;
        selp[r] = __expf(best - mx);
        chosen += selp[r];
#pragma unroll
        for (int i = 0; i < MAX_E_PER_LANE; ++i)
            if (lane + 32 * i == bid) v[i] = -INFINITY;
    }
    const float gate_logit = shared_gate_logit(a, warp, lane);
    if (lane == 0) {
        a.shared_gate[warp] = gate_logit;
        const float denom = a.renorm ? chosen : all;
        for (int r = 0; r < a.k; ++r) {
            a.ids[warp * a.k + r] = sel[r];
            a.weights[warp * a.k + r] = selp[r] / denom;
            atomicAdd(a.counts + sel[r], 1);
        }
    }
}

// One block of 512 threads (E <= 512): scans of the counts and of the tiles per expert.
extern "C" __global__ void __launch_bounds__(512) route_plan(RouteArgs a) {
    __shared__ int scan_pos[MAX_E], scan_tiles[MAX_E];
    const int e = threadIdx.x;
    const int c = e < a.E ? a.counts[e] : 0;
    int nt = (c + a.bm - 1) / a.bm;
    if (nt > 1 && c - (nt - 1) * a.bm <= a.tail) --nt;
    scan_pos[e] = c;
    scan_tiles[e] = nt;
    __syncthreads();
    // Hillis-Steele inclusive scans
    for (int o = 1; o < MAX_E; o <<= 1) {
        const int p = e >= o ? scan_pos[e - o] : 0, t = e >= o ? scan_tiles[e - o] : 0;
        __syncthreads();
        scan_pos[e] += p;
        scan_tiles[e] += t;
        __syncthreads();
    }
    if (e < a.E) {
        const int first = scan_pos[e] - c, tile0 = scan_tiles[e] - nt;
        a.offsets[e] = first;
        a.fill[e] = 0;
        for (int i = 0; i < nt && tile0 + i < a.max_tiles; ++i)
            a.tiles[tile0 + i] = make_int4(e, first + i * a.bm, first + c, 0);
    }
    if (e == MAX_E - 1) *a.tile_count = min(scan_tiles[MAX_E - 1], a.max_tiles);
}

extern "C" __global__ void route_scatter(RouteArgs a) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.T * a.k) return;
    const int e = a.ids[i];
    const int pos = a.offsets[e] + atomicAdd(a.fill + e, 1);
    a.a_rows[pos] = i / a.k;
    a.row_weight[pos] = a.weights[i];
    a.slot_pos[i] = pos;
}

struct CombineMoeArgs {
    float* x;                  // [T, H] residual stream
    const __nv_bfloat16* y;    // [T·k, H] weighted expert outputs (bf16), expert-grouped order
    const int* slot_pos;       // [T, k]
    const float* shared;       // [T, H] shared expert output
    const float* shared_gate;  // [T] shared expert gate logit
    const float* next_norm;    // the next layer's input RMSNorm weight [H] (null: the last layer)
    __nv_bfloat16* act;        // [T, H] bf16 perm64: the next layer's normalised input
    float eps;
    int T, H, k;
};

// Grid T blocks of 256 threads; float4 over the hidden dimension (H <= 4096). The block holds the
// token's finished residual row, so it also writes the next layer's RMS-normalised bf16 input
// (the separate norm launch and its re-read of x are saved).
#define COMBINE_MAX_QUADS 4
extern "C" __global__ void __launch_bounds__(256) moe_combine(CombineMoeArgs a) {
    const int t = blockIdx.x;
    __shared__ int pos[MAX_TOPK];
    __shared__ float scratch[32];
    if (threadIdx.x < a.k) pos[threadIdx.x] = a.slot_pos[t * a.k + threadIdx.x];
    __syncthreads();
    const float gate = sigmoidf(a.shared_gate[t]);
    float4 row[COMBINE_MAX_QUADS];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < COMBINE_MAX_QUADS; ++j) {
        const int i = (threadIdx.x + j * blockDim.x) * 4;
        if (i >= a.H) break;
        float4 acc = *reinterpret_cast<const float4*>(a.x + (size_t)t * a.H + i);
        const float4 s = *reinterpret_cast<const float4*>(a.shared + (size_t)t * a.H + i);
        float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int slot = 0; slot < a.k; ++slot) {
            const uint2 raw = *reinterpret_cast<const uint2*>(a.y + (size_t)pos[slot] * a.H + i);
            const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
            const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
            r.x += lo.x; r.y += lo.y; r.z += hi.x; r.w += hi.y;
        }
        acc.x += r.x + gate * s.x;
        acc.y += r.y + gate * s.y;
        acc.z += r.z + gate * s.z;
        acc.w += r.w + gate * s.w;
        *reinterpret_cast<float4*>(a.x + (size_t)t * a.H + i) = acc;
        row[j] = acc;
        ss += acc.x * acc.x + acc.y * acc.y + acc.z * acc.z + acc.w * acc.w;
    }
    if (!a.next_norm) return;
    const float inv = rsqrtf(block_sum(ss, scratch) / a.H + a.eps);
    __nv_bfloat16* out = a.act + (size_t)t * a.H;
#pragma unroll
    for (int j = 0; j < COMBINE_MAX_QUADS; ++j) {
        const int i = (threadIdx.x + j * blockDim.x) * 4;
        if (i >= a.H) break;
        const float4 w = *reinterpret_cast<const float4*>(a.next_norm + i);
        out[perm64(i)] = __float2bfloat16(row[j].x * inv * w.x);
        out[perm64(i + 1)] = __float2bfloat16(row[j].y * inv * w.y);
        out[perm64(i + 2)] = __float2bfloat16(row[j].z * inv * w.z);
        out[perm64(i + 3)] = __float2bfloat16(row[j].w * inv * w.w);
    }
}
