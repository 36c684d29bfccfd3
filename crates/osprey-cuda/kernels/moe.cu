// Sparse MoE decode: routed experts' gate+up+SwiGLU for the top-k slots, then one "virtual" GEMV
// for the down projections of all k experts plus the shared expert, with the routing weights and
// the shared expert's sigmoid gate folded into the activations, and the residual add fused.
//
// Shapes: hidden H (2048), expert intermediate I (512), E experts (256), top-k (8), 4-bit g64.
// The experts are selected (softmax, top-k, renormalise) by warp 0 of every moe_gate_up block
//   from the router's logits (k rounds of a warp arg-max by redux.sync); block 0 also writes the
//   selection for moe_down. Selecting in the router GEMV's last block (after a fence and a
//   counter) cost 7 us of serial tail per layer; a block-wide rank of all E logits in every block
//   cost 10 us here; shuffle-tree rounds 4 us; redux.sync rounds 3.5 us.
// moe_gate_up: 256 threads, one block per 16-row tile pair (gate and up rows of one slot's
//   expert): once warp 0 has selected, its first lane asks the copy engine for the pair's codes,
//   scales and biases (bulk copies into shared memory) while every warp builds x's signed-byte
//   form; the multiply reads the tiles from shared memory by quads of groups (tiles.cuh
//   quad_dot) and 16 threads write w_slot · silu(g)·u. The first I threads of the grid also write
//   the shared expert's sigmoid(gate logit) · silu(g)·u after them, so h is the down projections'
//   whole input. Reads k*2*I*H/2 bytes (8.4 MB).
// moe_down: one block of k + 1 warps per 16 output rows; warp s multiplies the tile's rows of
//   segment s (routed slot s, then the shared expert) with h's segment s as signed bytes (the
//   same tiles), its weights requested before h is copied into shared memory; the k + 1 partial
//   sums meet in shared memory and add into the residual. Reads (k+1)*H*I/2 bytes (4.7 MB).
// The shared expert's down rows, known before routing, are asked of L2 first thing.
// Measured (H200, full-size model, inside the decode graph: what issuing the kernel twice adds
// to a step): commit b3b9f4f (a warp per row, f32 FMAs): gate/up with the selection 12.0 us,
// down 8.4 us; commit 072c82a (register tiles): gate/up 11.1 us for 8.4 MB (0.76 TB/s: the launch,
// the prologue and the selection before the first weight request dominate), down 6.3 us for
// 4.7 MB (0.75 TB/s); commit fbda03f (gate/up tiles by bulk copies, multiplied from shared
// memory): gate/up 8.4 us (1.0 TB/s), down 6.6 us. Standalone (bench/kernels/moe_decode.cu):
// gate/up 9.6 us, down 6.5 us.
#include "tiles.cuh"

// routed + shared down activations: (k + 1) * I elements (11 * 512 for Qwen3-Next's top-10)
#define MAX_KV 6144

struct GateUpArgs {
    ExpertStack gate, up;     // [E*I, H]
    TopK* topk;               // the selection, written by block 0 for moe_down
    const float* x;           // residual stream
    const float* norm_weight; // post-attention norm
    float eps;
    const float* router_logits;  // [E], from the router GEMV
    int experts;
    int renorm;               // 1: the top-k weights are renormalised to sum to 1
    const float* shared_gate_proj;  // [I] shared expert's gate projection (pre-activation)
    const float* shared_up_proj;    // [I]
    const float* shared_gate_logit; // [1]
    float* h;                 // [k + 1, I] down-projection inputs: w_slot · SwiGLU per routed slot,
                              // then sigmoid(shared gate) · SwiGLU of the shared expert
    int H, I, k;
};

// Softmax top-k of E (<= 512) router logits by one warp: lane l holds logits l, l + 32, ...
// as order-preserving integer keys; k rounds each take the largest remaining logit (ties: the
// lower index) with two single-instruction warp reductions (redux.sync max of the key, then
// min of the index among the lanes holding it) instead of shuffle trees.
// Leaves the k expert ids and weights in ids/wts (visible after the caller's next barrier), and
// in `out` when given.
#define MAX_E_PER_LANE (MAX_E / 32)
__device__ __forceinline__ float key_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// Routing of one token: the router's logits over `experts`, top `k`, renormalised or not.
struct Routing {
    const float* logits;
    int experts, k, renorm;
};

__device__ __forceinline__ void select_experts(const Routing& a, int* ids, float* wts, TopK* out) {
    const int lane = threadIdx.x & 31, E = a.experts;
    float lv[MAX_E_PER_LANE];
    uint32_t key[MAX_E_PER_LANE];  // 0: not a candidate (no finite logit has key 0)
#pragma unroll
    for (int i = 0; i < MAX_E_PER_LANE; ++i) {
        lv[i] = lane + 32 * i < E ? a.logits[lane + 32 * i] : -INFINITY;
        key[i] = lane + 32 * i < E ? order_key(lv[i]) : 0u;
    }
    float mx = 0.f, chosen = 0.f, my_p = 0.f;
    int my_id = 0;
    for (int r = 0; r < a.k; ++r) {
        uint32_t bk = 0u;
        int bi = 0;
#pragma unroll
        for (int i = 0; i < MAX_E_PER_LANE; ++i) {
            if (key[i] > bk) {
                bk = key[i];
                bi = i;
            }
        }
        const uint32_t top = __reduce_max_sync(FULL_MASK, bk);
        const uint32_t e = __reduce_min_sync(FULL_MASK, bk == top ? (uint32_t)(lane + 32 * bi) : 0xFFFFFFFFu);
        if ((int)(e & 31) == lane) {
#pragma unroll
            for (int i = 0; i < MAX_E_PER_LANE; ++i)
                if (i == (int)(e >> 5)) key[i] = 0u;
        }
        const float v = key_value(top);
        if (r == 0) mx = v;
        const float p = __expf(v - mx);
        chosen += p;
        if (lane == r) {
            my_id = (int)e;
            my_p = p;
        }
    }
    float all = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_E_PER_LANE; ++i)
        if (lane + 32 * i < E) all += __expf(lv[i] - mx);
    all = warp_sum(all);
    if (lane < a.k) {
        const float w = my_p / (a.renorm ? chosen : all);
        ids[lane] = my_id;
        wts[lane] = w;
        if (out) {
            out->ids[lane] = my_id;
            out->w[lane] = w;
        }
    }
}

// One block per 16-row tile pair (gate and up rows f0..f0 + 15 of one slot's expert): warp 0
// selects the experts and its first lane asks the copy engine for the pair's codes, scales and
// biases at once (bulk copies into shared memory), then every warp builds x's byte form; the
// multiply reads the tiles from shared memory by quads of groups (tiles.cuh quad_dot), warp w
// taking quads w, w + 8, ... of the gate tile then the up tile; 16 threads add the quads' partial
// sums and write w_slot · silu(g)·u. Shared memory (dynamic, gate_up_smem in decoder.rs): codes
// [2][16][H/2], scales and biases [2][16][H/64] each, x [H/64][8] uint4 and [H/64] float2, the
// partial sums [2·H/256][16], the selection, scratch and the barrier.
extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up(GateUpArgs a) {
    extern __shared__ __align__(128) char smem[];
    const int H = a.H, gpr = H / 64, quads = gpr / 4, units = 2 * quads;
    char* codes = smem;  // [gate, up][16 rows][H/2]
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + 2 * 16 * (H / 2));  // [gate, up][16][gpr]
    __nv_bfloat16* biases = scales + 2 * 16 * gpr;
    uint4* xb8 = reinterpret_cast<uint4*>(biases + 2 * 16 * gpr);
    float2* gx = reinterpret_cast<float2*>(xb8 + gpr * 8);
    float* part = reinterpret_cast<float*>(gx + gpr);  // [unit][16]
    float* scratch = part + units * 16;
    float* wts = scratch + 32;
    int* ids = reinterpret_cast<int*>(wts + MAX_TOPK);
    uint64_t* full = reinterpret_cast<uint64_t*>(ids + MAX_TOPK);
    step_overlap_begin();
    // which experts' weights to read is only known from the router's output: nothing to fetch ahead
    step_inputs_ready();
    // the shared expert's down-projection input, finished here so moe_down only copies h
    const int gi = blockIdx.x * blockDim.x + threadIdx.x;
    if (gi < a.I)
        a.h[a.k * a.I + gi] = sigmoidf(a.shared_gate_logit[0]) * siluf(a.shared_gate_proj[gi]) * a.shared_up_proj[gi];
    const int fblocks = a.I / 16, u = blockIdx.x, slot = u / fblocks, f0 = (u % fblocks) * 16;
    if (threadIdx.x < 32) {
        select_experts(Routing{a.router_logits, a.experts, a.k, a.renorm}, ids, wts, blockIdx.x == 0 ? a.topk : nullptr);
        __syncwarp();
        if (threadIdx.x == 0) {
            const size_t row0 = (size_t)ids[slot] * a.I + f0;
            mbar_init(full, 1);
            mbar_init_fence();
            mbar_arrive_expect_bytes(full, 2 * q4_rows_bytes(16, H));
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const ExpertStack& m = t ? a.up : a.gate;
                copy_q4_rows(codes, scales, biases, t, m.codes, m.scales, m.biases, row0, 16, H, full);
            }
        }
    }
    resident_input(XInput{a.x, a.norm_weight, nullptr, nullptr, a.eps, H, 0}, xb8, gx, scratch);
    __syncthreads();  // x's bytes, the selection and the barrier's initialisation
    const int warp = threadIdx.x >> 5;
    mbar_wait(full, 0);
    QuadX X;
    for (int un = warp; un < units; un += 8) {
        const int t = un / quads, gq = (un % quads) * 4;
        load_quad_x(xb8, gx, gq, X);
        float yA = 0.f, yB = 0.f;
        quad_dot(codes + t * 16 * (H / 2), scales + t * 16 * gpr, biases + t * 16 * gpr, H, gq, X, yA, yB);
        store_quad_sums(part + un * 16, yA, yB);
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        const int r = threadIdx.x;
        float g = 0.f, uv = 0.f;
        for (int q = 0; q < quads; ++q) {
            g += part[q * 16 + r];
            uv += part[(quads + q) * 16 + r];
        }
        a.h[slot * a.I + f0 + r] = wts[slot] * (siluf(g) * uv);
    }
}

struct DownArgs {
    ExpertStack down;          // routed experts [E*H, I]
    ExpertStack shared_down;   // [H, I]
    const float* h;            // [k + 1, I] weighted activations (moe_gate_up)
    const TopK* topk;
    float* x;                  // residual stream, += result
    int H, I, k;
};

// h (Kv floats, already weighted by moe_gate_up) into shared memory (padded, hs), then as
// signed-byte fragments (xb8, gx); the caller's barrier publishes them.
__device__ __forceinline__ void load_h_bytes(const float* h, int Kv, float* hs, uint4* xb8, float2* gx) {
    for (int i = threadIdx.x; i < Kv / 4; i += blockDim.x) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(h) + i);
        float* d = hs + pad_idx(4 * i);
        d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w;
    }
    __syncthreads();
    build_x_s8(hs, Kv, xb8, gx);
}

// One block per 16 output rows; warp s multiplies segment s (routed slot s, or the shared expert
// for s = k) of the tile's rows: I/64 groups, two batches of 4 requested at a time.
extern "C" __global__ void __launch_bounds__(32 * (MAX_TOPK + 1)) moe_down(DownArgs a) {
    __shared__ __align__(16) float hs[MAX_KV + MAX_KV / 8];
    __shared__ uint4 xb8[MAX_KV / 64 * 8];
    __shared__ float2 gx[MAX_KV / 64];
    __shared__ float part[MAX_TOPK + 1][16];
    const int I = a.I, k = a.k, segs = k + 1, Kv = segs * I, gps = I / 64;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = blockIdx.x * 16;
    step_overlap_begin();
    prefetch_share_l2(a.shared_down.codes, (size_t)a.H * I / 2);
    prefetch_share_l2(a.shared_down.scales, (size_t)a.H * gps * 2);
    prefetch_share_l2(a.shared_down.biases, (size_t)a.H * gps * 2);
    step_inputs_ready();
    const int e = warp < k ? a.topk->ids[warp] : 0;
    const ExpertStack st = warp < k ? a.down : a.shared_down;
    const size_t base = (size_t)e * a.H;
    const QRows rows{st.codes + base * (I / 8), st.scales + base * gps, st.biases + base * gps, a.H};
    TileBatch b[2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
        if (j * TILE_BATCH < gps) tile_load(rows, I, row0, j * TILE_BATCH, gps, b[j]);
    load_h_bytes(a.h, Kv, hs, xb8, gx);
    __syncthreads();
    const uint4* xq = xb8 + warp * gps * 8 + (lane & 3);
    const float2* gxs = gx + warp * gps;
    float yA = 0.f, yB = 0.f;
    for (int G0 = 0; G0 < gps; G0 += 2 * TILE_BATCH) {
        if (G0 > 0) {
#pragma unroll
            for (int j = 0; j < 2; ++j)
                if (G0 + j * TILE_BATCH < gps) tile_load(rows, I, row0, G0 + j * TILE_BATCH, gps, b[j]);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
            if (G0 + j * TILE_BATCH < gps) tile_compute_s8(b[j], G0 + j * TILE_BATCH, gps, xq, gxs, yA, yB);
    }
    if ((lane & 3) == 0) {
        part[warp][lane >> 2] = yA;
        part[warp][(lane >> 2) + 8] = yB;
    }
    __syncthreads();
    if (threadIdx.x < 16 && row0 + threadIdx.x < a.H) {
        float y = 0.f;
        for (int s = 0; s < segs; ++s) y += part[s][threadIdx.x];
        a.x[row0 + threadIdx.x] += y;
    }
}

// ---- moe_experts: the routed and shared experts in one launch -----------------------------------
// The down projection split over the experts' intermediate rows instead of its output rows: the
// block that finishes 16 rows of h (one slot's gate/up tile pair, as moe_gate_up) multiplies
// them straight into the 16 matching columns of its expert's down matrix and adds its H partial
// sums into the residual (float4 atomics), so no launch waits for all of h. Blocks past the
// routed ones take 16 intermediate rows of the shared expert (its gate and up projections come
// from the router launch); their down columns are requested before the dependency wait.
// The residual is written while blocks still run, so the normalised input comes from the router
// launch (its block 0 writes it: GemvArgs.normed), not from x.
// Down columns on the integer tensor cores: 16 output rows x 16 columns per m16n8k32 (k 16-31
// zero), h as two signed bytes per element with one scale for the 16 (hi bytes in mma columns
// 0-3, lo bytes in 4-7, as tiles.cuh's quads); a warp walks H/128 row tiles, every tile's code
// words requested together once the expert is known.
struct ExpertsArgs {
    ExpertStack gate, up;       // routed [E*I, H]
    ExpertStack down;           // routed [E*H, I]
    ExpertStack shared_down;    // [H, I]
    const float* xn;            // RMS-normalised input (the router launch's block 0)
    float* x;                   // residual stream, += routed and shared experts
    const float* router_logits; // [E]
    const float* shared_gate_proj;   // [I] (pre-activation)
    const float* shared_up_proj;     // [I]
    const float* shared_gate_logit;  // [1]
    int experts, renorm, H, I, k;
};

#define DOWN_COLS 16
// row tiles per warp at most: H / 16 / 8 warps (H <= 2048)
#define DOWN_TILES_PER_WARP 16
// runs of 4 output rows per thread at most in the scaling pass: H / 4 / 256
#define DOWN_QUADS_PER_THREAD 2

// A warp's code words of the down tiles it owns: lane (g, q) of tile j gets row g's (q == 0) or
// row g + 8's (q == 1) 8 code bytes of the block's 16 columns; lanes q >= 2 none.
__device__ __forceinline__ void down_codes_load(const ExpertStack& m, size_t row_base, int I, int f0, int tiles, uint2* w) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < DOWN_TILES_PER_WARP; ++j) {
        if (j >= tiles) break;
        const size_t row = row_base + (size_t)(warp * tiles + j) * 16 + g + 8 * q;
        w[j] = q < 2 ? __ldcs(reinterpret_cast<const uint2*>(m.codes + row * (I / 8) + f0 / 8)) : make_uint2(0u, 0u);
    }
}

// The scale and bias of the block's group for this thread's output rows: runs of 4 rows
// 4(t + 256 i) .. + 3 (i < DOWN_QUADS_PER_THREAD, while inside H).
__device__ __forceinline__ void down_affine_load(const ExpertStack& m, size_t row_base, int H, int I, int f0,
                                                 __nv_bfloat16* sc, __nv_bfloat16* bi) {
    const int gps = I / 64;
#pragma unroll
    for (int i = 0; i < DOWN_QUADS_PER_THREAD; ++i) {
        const int r = 4 * (threadIdx.x + i * blockDim.x);
        if (r >= H) break;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const size_t row = row_base + r + j;
            sc[4 * i + j] = m.scales[row * gps + f0 / 64];
            bi[4 * i + j] = m.biases[row * gps + f0 / 64];
        }
    }
}

// The block's 16 values of h (hv, set by threads 0-15) as two signed bytes each: hb[0..16) the
// high bytes, hb[16..32) the low ones, hs = (scale, Σh). Called by warp 0 only.
__device__ __forceinline__ void h_bytes(const float* hv, int8_t* hb, float2* hs) {
    const int lane = threadIdx.x & 31;
    const float v = lane < DOWN_COLS ? hv[lane] : 0.f;
    float mx = fabsf(v), sum = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
        sum += __shfl_xor_sync(FULL_MASK, sum, o);
    }
    const float s = mx / 127.f, inv = mx > 0.f ? 127.f / mx : 0.f;
    const int hi = __float2int_rn(v * inv);
    const int lo = max(-127, min(127, __float2int_rn((v - (float)hi * s) * inv * 254.f)));
    if (lane < DOWN_COLS) {
        hb[lane] = (int8_t)hi;
        hb[DOWN_COLS + lane] = (int8_t)lo;
    }
    if (lane == 0) *hs = make_float2(s, sum);
}

// The down tiles' products with h's bytes into dot[row] (h's scale applied, the rows' own scale
// and bias not yet): code word q of a row holds columns 8q..8q+7, its even nibbles k 4q..4q+3 and
// its odd ones k 16+4q.. of the mma; lane (g, q)'s B holds the same columns of h, high bytes for
// g < 4 and low ones for g >= 4.
__device__ __forceinline__ void down_tiles(const uint2* w, int tiles, const int8_t* hb, float2 hs, float* dot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    uint32_t b0 = 0u, b1 = 0u;
    if (q < 2) {
        const int8_t* src = hb + (g < 4 ? 0 : DOWN_COLS) + 8 * q;
        b0 = (uint32_t)(uint8_t)src[0] | ((uint32_t)(uint8_t)src[2] << 8) | ((uint32_t)(uint8_t)src[4] << 16) | ((uint32_t)(uint8_t)src[6] << 24);
        b1 = (uint32_t)(uint8_t)src[1] | ((uint32_t)(uint8_t)src[3] << 8) | ((uint32_t)(uint8_t)src[5] << 16) | ((uint32_t)(uint8_t)src[7] << 24);
    }
#pragma unroll
    for (int j = 0; j < DOWN_TILES_PER_WARP; ++j) {
        if (j >= tiles) break;
        // lane q = 0 holds row g's words, q = 1 row g + 8's: trade word 1 of row g for word 0 of row g + 8
        const uint32_t got = __shfl_xor_sync(FULL_MASK, q == 0 ? w[j].y : w[j].x, 1);
        const uint32_t wA = q == 0 ? w[j].x : (q == 1 ? got : 0u), wB = q == 0 ? got : (q == 1 ? w[j].y : 0u);
        int d[4] = {0, 0, 0, 0};
        mma_s8(d, wA & 0x0F0F0F0Fu, wB & 0x0F0F0F0Fu, (wA >> 4) & 0x0F0F0F0Fu, (wB >> 4) & 0x0F0F0F0Fu, b0, b1);
        // lane (g, 0): high-byte sums of rows g and g + 8; lane (g, 2): the low-byte ones
        const int lo_a = __shfl_xor_sync(FULL_MASK, d[0], 2), lo_b = __shfl_xor_sync(FULL_MASK, d[2], 2);
        if (q == 0) {
            const int row = (warp * tiles + j) * 16 + g;
            dot[row] = hs.x * fmaf((float)lo_a, 1.f / 254.f, (float)d[0]);
            dot[row + 8] = hs.x * fmaf((float)lo_b, 1.f / 254.f, (float)d[2]);
        }
    }
}

// Shared memory (dynamic, experts_smem in decoder.rs): the gate/up tile pair, x's bytes and the
// quads' partial sums as moe_gate_up (the tile's codes reused for dot[H] once multiplied), then
// h's 16 values, bytes and (scale, sum), scratch, the selection and the barrier.
extern "C" __global__ void __launch_bounds__(256, 2) moe_experts(ExpertsArgs a) {
    extern __shared__ __align__(128) char smem[];
    const int H = a.H, gpr = H / 64, quads = gpr / 4, units = 2 * quads;
    char* codes = smem;  // [gate, up][16 rows][H/2]
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + 2 * 16 * (H / 2));
    __nv_bfloat16* biases = scales + 2 * 16 * gpr;
    uint4* xb8 = reinterpret_cast<uint4*>(biases + 2 * 16 * gpr);
    float2* gx = reinterpret_cast<float2*>(xb8 + gpr * 8);
    float* part = reinterpret_cast<float*>(gx + gpr);  // [unit][16]
    float* hv = part + units * 16;                     // [16]
    float2* hs = reinterpret_cast<float2*>(hv + DOWN_COLS);
    int8_t* hb = reinterpret_cast<int8_t*>(hs + 1);    // [32]
    float* scratch = reinterpret_cast<float*>(hb + 2 * DOWN_COLS);
    float* wts = scratch + 32;
    int* ids = reinterpret_cast<int*>(wts + MAX_TOPK);
    uint64_t* full = reinterpret_cast<uint64_t*>(ids + MAX_TOPK);
    float* dot = reinterpret_cast<float*>(codes);  // [H], once the tiles are multiplied
    const int fblocks = a.I / DOWN_COLS, routed = a.k * fblocks;
    const bool shared = (int)blockIdx.x >= routed;
    const int slot = blockIdx.x / fblocks, f0 = (shared ? blockIdx.x - routed : blockIdx.x % fblocks) * DOWN_COLS;
    const int tiles = H / 16 / 8;
    uint2 w[DOWN_TILES_PER_WARP];
    __nv_bfloat16 sc[4 * DOWN_QUADS_PER_THREAD], bi[4 * DOWN_QUADS_PER_THREAD];
    step_overlap_begin();
    if (shared) {
        // weights no kernel writes: requested before the wait
        down_codes_load(a.shared_down, 0, a.I, f0, tiles, w);
        down_affine_load(a.shared_down, 0, H, a.I, f0, sc, bi);
    }
    step_inputs_ready();
    if (shared) {
        if (threadIdx.x < DOWN_COLS) {
            const int f = f0 + threadIdx.x;
            hv[threadIdx.x] = sigmoidf(a.shared_gate_logit[0]) * siluf(a.shared_gate_proj[f]) * a.shared_up_proj[f];
        }
    } else {
        if (threadIdx.x < 32) {
            select_experts(Routing{a.router_logits, a.experts, a.k, a.renorm}, ids, wts, nullptr);
            __syncwarp();
            if (threadIdx.x == 0) {
                const size_t row0 = (size_t)ids[slot] * a.I + f0;
                mbar_init(full, 1);
                mbar_init_fence();
                mbar_arrive_expect_bytes(full, 2 * q4_rows_bytes(16, H));
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const ExpertStack& m = t ? a.up : a.gate;
                    copy_q4_rows(codes, scales, biases, t, m.codes, m.scales, m.biases, row0, 16, H, full);
                }
            }
        }
        resident_input(XInput{a.xn, nullptr, nullptr, nullptr, 0.f, H, 0}, xb8, gx, scratch);
        __syncthreads();  // x's bytes, the selection and the barrier's initialisation
        // the expert is known: its down columns go out while the gate/up tiles arrive
        const size_t down_row0 = (size_t)ids[slot] * H;
        down_codes_load(a.down, down_row0, a.I, f0, tiles, w);
        down_affine_load(a.down, down_row0, H, a.I, f0, sc, bi);
        const int warp = threadIdx.x >> 5;
        mbar_wait(full, 0);
        QuadX X;
        for (int un = warp; un < units; un += 8) {
            const int t = un / quads, gq = (un % quads) * 4;
            load_quad_x(xb8, gx, gq, X);
            float yA = 0.f, yB = 0.f;
            quad_dot(codes + t * 16 * (H / 2), scales + t * 16 * gpr, biases + t * 16 * gpr, H, gq, X, yA, yB);
            store_quad_sums(part + un * 16, yA, yB);
        }
        __syncthreads();
        if (threadIdx.x < DOWN_COLS) {
            const int r = threadIdx.x;
            float g = 0.f, uv = 0.f;
            for (int q = 0; q < quads; ++q) {
                g += part[q * 16 + r];
                uv += part[(quads + q) * 16 + r];
            }
            hv[r] = wts[slot] * (siluf(g) * uv);
        }
    }
    __syncthreads();  // hv; the gate/up tiles are no longer read (dot reuses them)
    if (threadIdx.x < 32) h_bytes(hv, hb, hs);
    __syncthreads();
    down_tiles(w, tiles, hb, *hs, dot);
    __syncthreads();
    // this thread's runs of 4 rows: their scale and bias, then into the residual
    const float hsum = hs->y;
#pragma unroll
    for (int i = 0; i < DOWN_QUADS_PER_THREAD; ++i) {
        const int r = 4 * (threadIdx.x + i * blockDim.x);
        if (r >= H) break;
        float y[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            y[j] = fmaf(__bfloat162float(sc[4 * i + j]), dot[r + j], __bfloat162float(bi[4 * i + j]) * hsum);
        atomicAdd(reinterpret_cast<float4*>(a.x + r), make_float4(y[0], y[1], y[2], y[3]));
    }
}
