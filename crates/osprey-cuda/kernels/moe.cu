// Sparse MoE decode. The step runs moe_experts (bottom of the file): selection, gate/up + SwiGLU
// and the down projections of the routed and shared experts in one launch. The two-launch form
// stays for ablation (OSPREY_DECODE_MOE=pair) and for shapes moe_experts does not take: routed
// experts' gate+up+SwiGLU for the top-k slots, then one "virtual" GEMV for the down projections of
// all k experts plus the shared expert, with the routing weights and the shared expert's sigmoid
// gate folded into the activations, and the residual add fused.
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
// blocks that finish h's rows (a slot's 16-row gate/up tile pair each, as moe_gate_up) multiply
// them straight into the matching columns of their expert's down matrix and add the partial sums
// into the residual (float4 atomics), so no launch waits for all of h. Four consecutive blocks
// hold one 64-row group of h: each writes its 16 values to global memory and counts itself in
// (a fence, then an atomic), waits for the other three, and multiplies the whole group (32
// contiguous code bytes a row) for a quarter of the output rows. Every block is resident at once
// (the host checks the occupancy, else it runs the pair), so the wait cannot starve. Each block
// also takes H / 4k rows of one group of the shared expert's down matrix (its gate and up
// projections come from the router launch; the block computes the group's 64 values of h
// itself), requested before the wait; the grid is k·I/16 blocks, two per SM in one wave.
// The residual is written while blocks still run, so the normalised input comes from the router
// launch (its block 0 writes it: GemvArgs.normed), not from x.
// Down rows on the integer tensor cores as tiles.cuh's 16-row tiles (h as two signed bytes per
// element, one scale for the group); a warp's tiles' code words are requested together once the
// expert is known.
// Measured (H200, 4K context, inside the decode graph, per layer; the pair: gate/up 8.4 us +
// down 6.6): 16-column slices per block and 32 blocks for the shared expert 22.9 us (4x the L2
// sectors: 8 useful bytes of each row's 32; and a second wave); the group shared through a
// thread-block cluster of 4 instead of global memory 18.0-20.4 us, because the cluster launch
// itself costs ~6 us (the kernel stripped to its gate/up part: 15.9 us with the cluster, 9.8
// without; bench/results/cuda-decode-moe-experts-probes.json). This form: 13.7 us per layer
// (commit 28258e0; of it, down loads + multiply ~1.8 us and the atomics ~1.6 over the gate/up
// part), the step at 4K 534.5 -> 550.2 tok/s (bench/results/cuda-decode-moe-experts.json).
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
    float* h;                   // [k, I]: each block's 16 values of h, for the other three of its group
    int* meet;                  // [2, k·I/64]: blocks of each group arrived, and left (zero between launches)
    int experts, renorm, H, I, k;
};

#define EXPERT_GROUP 4

__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// down row tiles per warp at most: H / EXPERT_GROUP / 16 / 8 warps (H <= 2048)
#define DOWN_TILES_PER_WARP 4

// A warp's down tiles of one 64-column group G: lane (g, q) holds code words 2q, 2q + 1 of the
// group for rows g (wa) and g + 8 (wb), and lanes q == 0 the rows' scale and bias.
struct DownTiles {
    uint2 wa[DOWN_TILES_PER_WARP], wb[DOWN_TILES_PER_WARP];
    __nv_bfloat16 sa[DOWN_TILES_PER_WARP], ba[DOWN_TILES_PER_WARP], sb[DOWN_TILES_PER_WARP], bb[DOWN_TILES_PER_WARP];
};

// Requests the warp's tiles: rows row0 + 16·(warp·tiles + j) .. of the stack (row0: the expert's
// first row plus the block's quarter).
__device__ __forceinline__ void down_tiles_load(const ExpertStack& m, size_t row0, int I, int G, int tiles, DownTiles& d) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3, gps = I / 64;
#pragma unroll
    for (int j = 0; j < DOWN_TILES_PER_WARP; ++j) {
        if (j >= tiles) break;
        const size_t ra = row0 + (size_t)(warp * tiles + j) * 16 + g, rb = ra + 8;
        d.wa[j] = __ldcs(reinterpret_cast<const uint2*>(m.codes + ra * (I / 8)) + 4 * G + q);
        d.wb[j] = __ldcs(reinterpret_cast<const uint2*>(m.codes + rb * (I / 8)) + 4 * G + q);
        if (q == 0) {
            d.sa[j] = m.scales[ra * gps + G];
            d.ba[j] = m.biases[ra * gps + G];
            d.sb[j] = m.scales[rb * gps + G];
            d.bb[j] = m.biases[rb * gps + G];
        }
    }
}

// The warp's tiles times h's group (hx8, hg: build_x_s8's form of 64 values), each row's
// scale and bias applied, into ys[row - the block's first row] (lanes q == 0).
__device__ __forceinline__ void down_tiles_multiply(const DownTiles& d, int tiles, const uint4* hx8, float2 hg, float* ys) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < DOWN_TILES_PER_WARP; ++j) {
        if (j >= tiles) break;
        int dh[4] = {0, 0, 0, 0}, dl[4] = {0, 0, 0, 0};
#pragma unroll
        for (int T = 0; T < 2; ++T) {
            const uint32_t wA = T ? d.wa[j].y : d.wa[j].x, wB = T ? d.wb[j].y : d.wb[j].x;
            const uint32_t a0 = wA & 0x0F0F0F0Fu, a2 = (wA >> 4) & 0x0F0F0F0Fu;
            const uint32_t a1 = wB & 0x0F0F0F0Fu, a3 = (wB >> 4) & 0x0F0F0F0Fu;
            const uint4 xf = hx8[T * 4 + q];
            mma_s8(dh, a0, a1, a2, a3, xf.x, xf.y);
            mma_s8(dl, a0, a1, a2, a3, xf.z, xf.w);
        }
        if (q == 0) {
            const int r = (warp * tiles + j) * 16 + g;
            const float da = hg.x * fmaf((float)dl[0], 1.f / 254.f, (float)dh[0]);
            const float db = hg.x * fmaf((float)dl[2], 1.f / 254.f, (float)dh[2]);
            ys[r] = fmaf(__bfloat162float(d.sa[j]), da, __bfloat162float(d.ba[j]) * hg.y);
            ys[r + 8] = fmaf(__bfloat162float(d.sb[j]), db, __bfloat162float(d.bb[j]) * hg.y);
        }
    }
}

// Shared memory (dynamic, experts_smem in decoder.rs): the gate/up tile pair, x's bytes and the
// quads' partial sums as moe_gate_up (the tile's codes reused for the block's output rows once
// multiplied), then the group's 64 h values (padded), their two-byte form and (scale, sum),
// scratch, the selection and the barrier.
extern "C" __global__ void __launch_bounds__(256, 2) moe_experts(ExpertsArgs a) {
    extern __shared__ __align__(128) char smem[];
    const int H = a.H, gpr = H / 64, quads = gpr / 4, units = 2 * quads;
    char* codes = smem;  // [gate, up][16 rows][H/2]
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + 2 * 16 * (H / 2));
    __nv_bfloat16* biases = scales + 2 * 16 * gpr;
    uint4* xb8 = reinterpret_cast<uint4*>(biases + 2 * 16 * gpr);
    float2* gx = reinterpret_cast<float2*>(xb8 + gpr * 8);
    float* part = reinterpret_cast<float*>(gx + gpr);   // [unit][16]
    // this block group's 64 values of h (hx8, hg, hall) and the shared expert's (sx8, sg, sall)
    uint4* hx8 = reinterpret_cast<uint4*>(part + units * 16);  // [8]
    uint4* sx8 = hx8 + 8;                                      // [8]
    float2* hg = reinterpret_cast<float2*>(sx8 + 8);
    float2* sg = hg + 1;
    float* hall = reinterpret_cast<float*>(sg + 1);  // [pad_idx(64)]
    float* sall = hall + 72;                         // [pad_idx(64)]
    float* scratch = sall + 72;
    float* wts = scratch + 32;
    int* ids = reinterpret_cast<int*>(wts + MAX_TOPK);
    uint64_t* full = reinterpret_cast<uint64_t*>(ids + MAX_TOPK);
    float* ys = reinterpret_cast<float*>(codes);  // [H / EXPERT_GROUP], once the tiles are multiplied
    const int rank = blockIdx.x % EXPERT_GROUP, group = blockIdx.x / EXPERT_GROUP;  // 4 blocks, one group of h
    const int fblocks = a.I / 16, gps = a.I / 64, groups = gridDim.x / EXPERT_GROUP;
    const int slot = blockIdx.x / fblocks, f0 = (blockIdx.x % fblocks) * 16, G = f0 / 64;
    // this block's output rows: the rank-th quarter
    const int rows = H / EXPERT_GROUP, tiles = rows / 16 / 8;
    const size_t quarter = (size_t)rank * rows;
    // and of the shared expert: group (block / 4) % gps, rows srow0 .. + srows (a 16-row tile per warp)
    const int sgroup = group % gps, srows = H / (EXPERT_GROUP * a.k), warp = threadIdx.x >> 5;
    const size_t srow0 = (size_t)(group / gps) * (H / a.k) + rank * srows;
    float* sys = ys + rows;  // [srows]
    DownTiles d, sd;
    step_overlap_begin();
    // weights no kernel writes: requested before the wait
    if (warp < srows / 16) down_tiles_load(a.shared_down, srow0, a.I, sgroup, 1, sd);
    step_inputs_ready();
    if (threadIdx.x < 64) {
        const int f = sgroup * 64 + threadIdx.x;
        sall[pad_idx(threadIdx.x)] = sigmoidf(a.shared_gate_logit[0]) * siluf(a.shared_gate_proj[f]) * a.shared_up_proj[f];
    }
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
    __syncthreads();  // x's bytes, the selection, the barrier's initialisation, the shared group's h
    // the expert is known: its down rows go out while the gate/up tiles arrive
    down_tiles_load(a.down, (size_t)ids[slot] * H + quarter, a.I, G, tiles, d);
    build_x_s8(sall, 64, sx8, sg);
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
    float hv = 0.f;  // threads 0-15: row f0 + t of h
    if (threadIdx.x < 16) {
        const int r = threadIdx.x;
        float g = 0.f, uv = 0.f;
        for (int q = 0; q < quads; ++q) {
            g += part[q * 16 + r];
            uv += part[(quads + q) * 16 + r];
        }
        hv = wts[slot] * (siluf(g) * uv);
    }
    // the group's 64 values of h in every block of the group, through global memory
    if (threadIdx.x < 16) a.h[slot * a.I + f0 + threadIdx.x] = hv;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&a.meet[group], 1);
        while (load_acquire(&a.meet[group]) < EXPERT_GROUP) {
        }
    }
    __syncthreads();
    if (threadIdx.x < 64) hall[pad_idx(threadIdx.x)] = __ldcg(&a.h[slot * a.I + G * 64 + threadIdx.x]);
    __syncthreads();
    // the last of the group to leave resets its counters for the next launch
    if (threadIdx.x == 0 && atomicAdd(&a.meet[groups + group], 1) == EXPERT_GROUP - 1) {
        a.meet[group] = 0;
        a.meet[groups + group] = 0;
    }
    build_x_s8(hall, 64, hx8, hg);
    __syncthreads();
    down_tiles_multiply(d, tiles, hx8, *hg, ys);
    if (warp < srows / 16) down_tiles_multiply(sd, 1, sx8, *sg, sys);
    __syncthreads();
    for (int i = threadIdx.x; i < rows / 4; i += blockDim.x) {
        const float4 y = reinterpret_cast<const float4*>(ys)[i];
        atomicAdd(reinterpret_cast<float4*>(a.x + quarter) + i, y);
    }
    for (int i = threadIdx.x; i < srows / 4; i += blockDim.x) {
        const float4 y = reinterpret_cast<const float4*>(sys)[i];
        atomicAdd(reinterpret_cast<float4*>(a.x + srow0) + i, y);
    }
}
