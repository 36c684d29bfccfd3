// Sparse MoE decode. The step runs moe_routed_experts below 48K positions and, after the router
// launch, moe_experts from there (bottom of the file): the router's rows (moe_routed_experts
// only), selection, gate/up + SwiGLU and the down projections of the routed and shared experts in
// one launch. The two-launch form
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
__device__ __forceinline__ float key_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// Routing of one token: the router's logits over `experts`, top `k`, renormalised or not.
struct Routing {
    const float* logits;
    int experts, k, renorm;
};

// PER_LANE logits a lane (E <= 32·PER_LANE): each round scans PER_LANE keys, so 256 experts take
// the 8-wide form, not MAX_E's 16 (half of them padding): the step at 4K 657 -> 668 tok/s
// (bench/results/cuda-decode-select-experts-8-per-lane.json).
// (lv: the lane's logits, lane + 32·i; those at E and past it are ignored)
// on_chosen(r, e) runs in every lane once round r has chosen expert e (warp-uniform): a block
// can ask for its slot's weights before the later rounds.
struct NoChoiceHook {
    __device__ void operator()(int, int) const {}
};
template <int PER_LANE, typename OnChosen = NoChoiceHook>
__device__ __forceinline__ void select_from(const float (&lv)[PER_LANE], const Routing& a, int* ids, float* wts, TopK* out,
                                            OnChosen on_chosen = {}) {
    const int lane = threadIdx.x & 31, E = a.experts;
    uint32_t key[PER_LANE];  // 0: not a candidate (no finite logit has key 0)
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) key[i] = lane + 32 * i < E ? order_key(lv[i]) : 0u;
    float mx = 0.f, chosen = 0.f, my_p = 0.f;
    int my_id = 0;
    // the rounds as a loop, not unrolled: moe_experts_h2048 192 instructions shorter, 4K 753.4 ->
    // 770.0 tok/s, 32K 660.0 -> 671.4, 128K 501.4 -> 511.0 (bench/results/cuda-decode-code-size.json),
    // more than the selection's own time (not instruction fetch: ncu has fetch stalls at 6% of the
    // step's warp cycles, bench/results/cuda-decode-ncu-graph-stalls.json)
#pragma unroll 1
    for (int r = 0; r < a.k; ++r) {
        uint32_t bk = 0u;
        int bi = 0;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            if (key[i] > bk) {
                bk = key[i];
                bi = i;
            }
        }
        const uint32_t top = __reduce_max_sync(FULL_MASK, bk);
        const uint32_t e = __reduce_min_sync(FULL_MASK, bk == top ? (uint32_t)(lane + 32 * bi) : 0xFFFFFFFFu);
        // (a select per key, not a store at a computed index: that kept the keys in local memory)
        const bool mine = (int)(e & 31) == lane;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) key[i] = mine && i == (int)(e >> 5) ? 0u : key[i];
        on_chosen(r, (int)e);
        const float v = key_value(top);
        if (r == 0) mx = v;
        const float p = __expf(v - mx);
        chosen += p;
        if (lane == r) {
            my_id = (int)e;
            my_p = p;
        }
    }
    // the softmax over every expert only when the weights are not renormalised to the chosen
    float denom = chosen;
    if (!a.renorm) {
        float all = 0.f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            if (lane + 32 * i < E) all += __expf(lv[i] - mx);
        denom = warp_sum(all);
    }
    if (lane < a.k) {
        const float w = my_p / denom;
        ids[lane] = my_id;
        wts[lane] = w;
        if (out) {
            out->ids[lane] = my_id;
            out->w[lane] = w;
        }
    }
}

template <int PER_LANE, typename OnChosen = NoChoiceHook>
__device__ __forceinline__ void select_experts_n(const Routing& a, int* ids, float* wts, TopK* out, OnChosen on_chosen = {}) {
    const int lane = threadIdx.x & 31;
    float lv[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) lv[i] = lane + 32 * i < a.experts ? a.logits[lane + 32 * i] : -INFINITY;
    select_from(lv, a, ids, wts, out, on_chosen);
}

template <typename OnChosen = NoChoiceHook>
__device__ __forceinline__ void select_experts(const Routing& a, int* ids, float* wts, TopK* out, OnChosen on_chosen = {}) {
    if (a.experts <= 256) select_experts_n<8>(a, ids, wts, out, on_chosen);
    else select_experts_n<MAX_E / 32>(a, ids, wts, out, on_chosen);
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

// One of the route matrices moe_routed_experts multiplies: 4- or 8-bit rows of H in groups of 64.
struct RouteMatrix {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
    int rows, bits;
};
#define ROUTE_MATRICES 4
// route rows a block takes at most (row b, b + grid, ...: the host checks)
#define ROUTE_MAX_ROWS 16

// ---- moe_experts: the routed and shared experts in one launch -----------------------------------
// The down projection without waiting for all of h: the 32 blocks of a routed slot (each a
// 16-row gate/up tile pair of its expert, as moe_gate_up) write their 16 values of h to global
// memory, each beside the launch's tag in one 64-bit store, and read the slot's 512 back until
// every one carries the tag: reading h is the meeting, so it waits only for the slot's blocks and
// costs no fence, counter or extra round trip (a fence, an atomic count and a spin before reading
// h: 4K 643.3 -> 656.6 tok/s, moe_experts 647 -> 610 us a step in the timeline, the meeting and
// the read of h 3.8 -> 2.6 us; bench/results/cuda-decode-tagged-meeting.json). Then each
// multiplies the slot's whole h (I = 512, contiguous 256-byte rows) into H/32 rows of its
// expert's down matrix and adds them into the residual (float4 atomics: 9 adds per element, the
// 8 slots and the shared expert). Every block is resident at once (the host checks the
// occupancy, else it runs the pair), so the wait cannot starve. The first H/16 blocks also take
// a 16-row tile of the shared expert's down matrix (its gate and up projections come from the
// router launch, or in moe_routed_experts from the launch's own blocks; such a block computes the
// shared h itself), requested before the wait. The grid
// is k·I/16 blocks, two per SM in one wave. The residual is written while blocks still run, so
// the normalised input comes from the router launch (its block 0 writes it: GemvArgs.normed).
// Down rows as the GEMV's 16-row tiles (tiles.cuh tile_load / tile_compute_s8: h as two signed
// bytes per element), a tile's groups split over 2-4 warps, requested once the gate/up tiles are multiplied.
// Measured (H200, 4K context, inside the decode graph, per layer; the pair: gate/up 8.4 us +
// down 6.6): 16-column slices of the down matrix per block and 32 blocks for the shared expert
// 22.9 us (4x the L2 sectors: 8 useful bytes of each row's 32; and a second wave); groups of 4
// blocks sharing a 64-row group of h through a thread-block cluster 18.0-20.4 us (the cluster
// launch itself costs ~6 us: the kernel stripped to its gate/up part took 15.9 us with the
// cluster, 9.8 without; bench/results/cuda-decode-moe-experts-probes.json); through global
// memory 13.7 us (72 atomic adds per residual element, of which the atomics cost ~1.6 us).
// This form: 12.1 us per layer, the step at 4K 533.2 -> 555.6 tok/s against the pair, 128K
// 402.3 -> 415.2 (commit d64ef9e, bench/results/cuda-decode-moe-experts.json).
// Its gate/up part repeats moe_gate_up's on purpose: written once as shared helpers, this kernel
// compiled differently (95 registers instead of 107) and the step lost 2% (555.6 -> 543.5 tok/s
// at 4K, commit cffab1f).
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
    float* h;                   // [k, I] (value, tag) pairs: each block's 16 values of h, for the rest of its slot
    int* meet;                  // [k]: each slot's last tag (only grows)
    int experts, renorm, H, I, k;
    // moe_routed_experts only (the router launch's rows, computed by this launch's blocks)
    RouteMatrix route[ROUTE_MATRICES];  // the router [E], the shared expert's gate logit [1], gate and up [I]
    const float* norm_weight;           // the MoE block's input RMSNorm
    unsigned long long* routed;         // [E + 1 + 2I] (value, tag): the route matrices' rows, in that order
    int* route_meet;                    // the last launch's tag for them (only grows)
    float eps;
};

// h of one slot (I <= 512) in shared memory, padded, and as the tiles' two-byte form
#define EXPERTS_MAX_I 512

// A value of h and its launch's tag in one 64-bit word: single-copy atomic, so a reader that sees
// the tag sees the value, and reading a slot's h is its meeting.
__device__ __forceinline__ void store_tagged(unsigned long long* p, float v, unsigned tag) {
    const unsigned long long w = ((unsigned long long)tag << 32) | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ unsigned long long load_tagged(const unsigned long long* p) {
    unsigned long long w;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
    return w;
}

// Reads the tagged words at(i) (i < N; a null pointer: none) until each carries `tag` (other blocks
// of the launch store them, reaching L2 in any order), all requested at once and again for those
// still missing; their values into v (-inf where at(i) is null). A launch whose writers cannot all
// be resident would never finish: after MEET_ROUNDS_LIMIT rounds it traps, an error the host reports.
template <int N, typename At>
__device__ __forceinline__ void await_tagged(At at, unsigned tag, float (&v)[N]) {
    unsigned long long w[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const unsigned long long* p = at(i);
        w[i] = p ? load_tagged(p) : ((unsigned long long)tag << 32) | __float_as_uint(-INFINITY);
    }
    for (unsigned rounds = 0;; ++rounds) {
        bool all = true;
#pragma unroll
        for (int i = 0; i < N; ++i) all &= (unsigned)(w[i] >> 32) == tag;
        if (all) break;
        if (rounds == MEET_ROUNDS_LIMIT) __trap();
#pragma unroll
        for (int i = 0; i < N; ++i)
            if ((unsigned)(w[i] >> 32) != tag) w[i] = load_tagged(at(i));
    }
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = __uint_as_float((unsigned)w[i]);
}

// Which route matrix row r (of all four, in order) is in; r becomes its row there.
__device__ __forceinline__ int route_matrix(const ExpertsArgs& a, int& r) {
    int m = 0;
    while (m < ROUTE_MATRICES - 1 && r >= a.route[m].rows) r -= a.route[m].rows, ++m;
    return m;
}

// Row r of a route matrix into shared memory by cp.async (16 bytes a thread at a time).
__device__ __forceinline__ void copy_route_row(const RouteMatrix& m, int r, int H, char* codes, __nv_bfloat16* scales,
                                               __nv_bfloat16* biases) {
    const int gpr = H / 64, cchunks = H * m.bits / 128, schunks = gpr / 8;
    const char* c = reinterpret_cast<const char*>(m.codes) + (size_t)r * (H * m.bits / 8);
    for (int i = threadIdx.x; i < cchunks + 2 * schunks; i += blockDim.x) {
        if (i < cchunks) {
            cp_async16(codes + 16 * i, c + 16 * i, true);
        } else {
            const int o = (i - cchunks) % schunks, t = (i - cchunks) / schunks;
            cp_async16((t ? biases : scales) + 8 * o, (t ? m.biases : m.scales) + (size_t)r * gpr + 8 * o, true);
        }
    }
}

// Row r of a route matrix asked of L2, a 128-byte line a thread (codes, then its scales and
// biases: H/64 bf16 each, one line). A hint: L2 is the GPU's point of coherence.
__device__ __forceinline__ void prefetch_route_row_l2(const RouteMatrix& m, int r, int H) {
    const int gpr = H / 64, lines = H * m.bits / 1024, t = threadIdx.x;
    const void* line = t < lines ? static_cast<const void*>(reinterpret_cast<const char*>(m.codes) + (size_t)r * (H * m.bits / 8) + 128 * t)
                       : t == lines ? static_cast<const void*>(m.scales + (size_t)r * gpr)
                                    : static_cast<const void*>(m.biases + (size_t)r * gpr);
    if (t <= lines + 1) asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
}

// The thread's part of a staged route row's dot product with its slots' values of x (f32: the
// selection compares these logits, so they are not taken through x's byte form); vs: the sums
// of those values, slot by slot. The experts kernels' 256 threads compiled in: with K known, a
// second slot that no thread has leaves no code (the unrolled rows outgrew the instruction cache).
__device__ __forceinline__ float route_dot(const char* codes, const __nv_bfloat16* sc, const __nv_bfloat16* bi, bool wide,
                                           const float (&v)[2][8], const float (&vs)[2], int K) {
    float p = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int idx = threadIdx.x + r * 256;
        if (r * 256 >= K / 8 || idx >= K / 8) break;
        const int e0 = slot_first_element(idx), g = e0 >> 6;
        float qv = 0.f;
        if (wide) {
            const uint2 w = *reinterpret_cast<const uint2*>(codes + e0);
#pragma unroll
            for (int j = 0; j < 4; ++j) qv += byte_code(w.x, j) * v[r][j] + byte_code(w.y, j) * v[r][4 + j];
        } else {
            const uint32_t w = *reinterpret_cast<const uint32_t*>(codes + e0 / 2);
#pragma unroll
            for (int j = 0; j < 8; ++j) qv += nib(w, j) * v[r][j];
        }
        p += bf16_to_f32(sc[g]) * qv + bf16_to_f32(bi[g]) * vs[r];
    }
    return p;
}

// Dynamic shared memory as moe_gate_up's (gate_up_smem in decoder.rs; the tile pair, x's bytes,
// the quads' partial sums, scratch, the selection and the barrier); h's forms and the down
// tiles' partial sums are static.
template <bool ROUTE, int HC, int IC, int KC, int EC>
__device__ __forceinline__ void moe_experts_body(const ExpertsArgs& a) {
    extern __shared__ __align__(128) char experts_dynamic_smem[];
    char* smem = experts_dynamic_smem;
    __shared__ __align__(16) float sall[EXPERTS_MAX_I + EXPERTS_MAX_I / 8];
    __shared__ uint4 sx8[EXPERTS_MAX_I / 64 * 8];
    __shared__ float2 sg[EXPERTS_MAX_I / 64];
    __shared__ float wpart[8][16], spart[8][16];
    __shared__ uint64_t up_full;  // moe_routed_experts: the up tile's barrier
    const int H = HC ? HC : a.H, I = IC ? IC : a.I, k = KC ? KC : a.k, gpr = H / 64, quads = gpr / 4, units = 2 * quads;
    char* codes = smem;  // [gate, up][16 rows][H/2]
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + 2 * 16 * (H / 2));
    __nv_bfloat16* biases = scales + 2 * 16 * gpr;
    uint4* xb8 = reinterpret_cast<uint4*>(biases + 2 * 16 * gpr);
    float2* gx = reinterpret_cast<float2*>(xb8 + gpr * 8);
    float* part = reinterpret_cast<float*>(gx + gpr);  // [unit][16]
    float* scratch = part + units * 16;
    float* wts = scratch + 32;
    int* ids = reinterpret_cast<int*>(wts + MAX_TOPK);
    uint64_t* full = reinterpret_cast<uint64_t*>(ids + MAX_TOPK);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int fblocks = I / 16, gps = I / 64, slot = blockIdx.x / fblocks, fi = blockIdx.x % fblocks, f0 = fi * 16;
    // this block's rows of its expert's down matrix: `tiles` 16-row tiles from r0, each tile's
    // groups split over wpt warps (an even number of groups each)
    const int rpb = H / fblocks, tiles = rpb / 16, wpt = min(8 / tiles, gps / 2), gpw = gps / wpt;
    const int r0 = fi * rpb, my_tile = warp / wpt, g0 = (warp % wpt) * gpw;
    const bool routed_warp = my_tile < tiles;
    // the shared expert's tile (blocks below H/16): warps 0 .. gps/2 - 1, two groups each
    const bool shared_tile = (int)blockIdx.x < H / 16, shared_warp = shared_tile && warp < gps / 2;
    TileBatch tb, sb;
    // moe_routed_experts: this block's route rows (b, b + grid, ...), staged where the gate/up
    // tiles go: their copies are asked for only once the rows are multiplied
    const int E = EC ? EC : a.experts;
    const int route_rows = ROUTE ? a.route[0].rows + a.route[1].rows + a.route[2].rows + a.route[3].rows : 0;
    const int my_routes = (int)blockIdx.x < route_rows ? (route_rows - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    step_overlap_begin();
    // weights no kernel writes: requested before the wait
    if (shared_warp)
        tile_load(QRows{a.shared_down.codes, a.shared_down.scales, a.shared_down.biases, H}, I, blockIdx.x * 16, 2 * warp,
                  2 * warp + 2, sb);
    unsigned wide = 0;  // bit j: route row j has 8-bit codes
    float nw[2][8];     // the MoE norm's weight at the thread's slots of x
    if constexpr (ROUTE) {
        for (int j = 0; j < my_routes; ++j) {
            int r = blockIdx.x + j * gridDim.x;
            const int m = route_matrix(a, r);
            copy_route_row(a.route[m], r, H, codes + j * H, scales + j * gpr, biases + j * gpr);
            if (a.route[m].bits == 8) wide |= 1u << j;
        }
        cp_async_commit();
        load_norm_slots(a.norm_weight, H, nw);
        // the route rows of the block half a grid on, asked of L2 by the first half: the last
        // blocks of the grid land only as out_proj's leave (~60 of 256 at 4K), and the selection
        // waits for their first rows, copied from DRAM only then. Selected 5.4 -> 5.1 us after the
        // release, 4K +0.3%, 32K +0.3% (bench/results/cuda-decode-route-rows-l2-merge-banks.json)
        if ((int)blockIdx.x < (int)gridDim.x / 2)
            for (int r = blockIdx.x + gridDim.x / 2; r < route_rows; r += gridDim.x) {
                int local = r;
                prefetch_route_row_l2(a.route[route_matrix(a, local)], local, H);
            }
    }
    step_inputs_ready();
    // this launch's tag for its slot's values of h: one past the last launch's
    const unsigned tag = (unsigned)__ldcg(a.meet + slot) + 1u;
    // and for the route rows (moe_routed_experts)
    const unsigned rtag = ROUTE ? (unsigned)__ldcg(a.route_meet) + 1u : 0u;
    float sgate = 0.f, sgp[EXPERTS_MAX_I / 256], sup[EXPERTS_MAX_I / 256];
    float v[2][8];  // moe_routed_experts: x's normalised values at the thread's slots
    if constexpr (ROUTE) {
        // the route rows: every block normalises x, multiplies its rows and publishes them tagged;
        // the slot's meeting below reads x's new values only after every block's first row is in
        // (the selection waits for rows 0 .. max(E, grid) - 1), so no block adds into x before
        // all have read it
        // x taken in without its 1/rms (resident_values<true>): the sums of squares go with the
        // first row's partial products, so one block barrier finds both, and the logits, linear
        // in x, are scaled after (4K 899.6 -> 901.5 tok/s, 32K 787.1 -> 790.1; with the GEMVs'
        // warp-local x, 915.9 -> 922.1: bench/results/cuda-decode-warp-x.json)
        __shared__ float wss[8];
        const float ss = warp_sum(resident_values<true>(XInput{a.x, a.norm_weight, nullptr, nullptr, a.eps, H, 0}, v, scratch, nw));
        float vs[2] = {0.f, 0.f};
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int j = 0; j < 8; ++j) vs[r] += v[r][j];
        cp_async_wait<0>();
        __syncthreads();  // every thread's copies of the rows
        // the block's first row (a router row: the selection waits for every block's first and
        // for nothing else) multiplied and published alone, before the others: the logits are
        // seen 0.8 us sooner (4.6 -> 3.8 us after the release, median launch at 4K), 4K 758.2 ->
        // 801.3 tok/s, 32K 662.3 -> 695.1 (bench/results/cuda-decode-route-first-row.json)
        {
            const float p0 = warp_sum(route_dot(codes, scales, biases, wide & 1u, v, vs, H));
            if (lane == 0) {
                wpart[warp][0] = p0;
                wss[warp] = ss;
            }
            __syncthreads();
            float sq = 0.f;
#pragma unroll
            for (int w = 0; w < 8; ++w) sq += wss[w];
            const float inv = rsqrtf(sq / H + a.eps);
            if (threadIdx.x == 0) {
                float y = 0.f;
                for (int w = 0; w < 8; ++w) y += wpart[w][0];
                store_tagged(a.routed + blockIdx.x, y * inv, rtag);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                vs[r] *= inv;
#pragma unroll
                for (int j = 0; j < 8; ++j) v[r][j] *= inv;
            }
        }
        // the other rows' products, then all their warp sums: independent chains side by side
        // (one row after another, each waiting on its own sums, took ~2.3 us)
        constexpr int RC = HC ? (EC + 1 + 2 * IC + KC * IC / 16 - 1) / (KC * IC / 16) : ROUTE_MAX_ROWS;
        float p[RC];
#pragma unroll
        for (int j = 1; j < RC; ++j)
            p[j] = j < my_routes ? route_dot(codes + j * H, scales + j * gpr, biases + j * gpr, (wide >> j) & 1u, v, vs, H) : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int j = 1; j < RC; ++j) p[j] += __shfl_xor_sync(FULL_MASK, p[j], o);
        if (lane == 0) {
#pragma unroll
            for (int j = 1; j < RC; ++j)
                if (j < my_routes) wpart[warp][j] = p[j];
        }
        __syncthreads();
        if (threadIdx.x >= 1 && (int)threadIdx.x < my_routes) {
            float y = 0.f;
            for (int w = 0; w < 8; ++w) y += wpart[w][threadIdx.x];
            store_tagged(a.routed + blockIdx.x + threadIdx.x * gridDim.x, y, rtag);
        }
    } else if (shared_tile) {
        // the shared expert's h inputs requested at once (each value waited for in turn before:
        // five round trips ahead of the selection's logits in the shared-tile blocks)
        sgate = a.shared_gate_logit[0];
#pragma unroll
        for (int j = 0; j < EXPERTS_MAX_I / 256; ++j) {
            const int i = threadIdx.x + 256 * j;
            sgp[j] = i < I ? a.shared_gate_proj[i] : 0.f;
            sup[j] = i < I ? a.shared_up_proj[i] : 0.f;
        }
    }
    if (threadIdx.x < 32) {
        // the slot's gate and up rows asked for as soon as the selection's round for the slot has
        // chosen its expert, not after all k rounds: 4K 798.1 -> 810.6 tok/s, 32K 693.9 -> 703.2
        // (bench/results/cuda-decode-route-first-row.json)
        const auto ask_slot = [&](int r, int e) {
            if (r != slot || threadIdx.x != 0) return;
            const size_t row0 = (size_t)e * I + f0;
            if constexpr (ROUTE) fence_proxy_async();  // the route rows' reads before the copies' writes
            // moe_routed_experts: the up tile on a barrier of its own, so that the gate tile is
            // multiplied while it lands (4K 809.6 -> 815.0 tok/s, 32K 703.0 -> 706.5:
            // bench/results/cuda-decode-route-first-row.json)
            uint64_t* up_bar = ROUTE ? &up_full : full;
            mbar_init(full, 1);
            if constexpr (ROUTE) mbar_init(up_bar, 1);
            mbar_init_fence();
            mbar_arrive_expect_bytes(full, (ROUTE ? 1 : 2) * q4_rows_bytes(16, H));
            if constexpr (ROUTE) mbar_arrive_expect_bytes(up_bar, q4_rows_bytes(16, H));
            copy_q4_rows(codes, scales, biases, 0, a.gate.codes, a.gate.scales, a.gate.biases, row0, 16, H, full);
            copy_q4_rows(codes, scales, biases, 1, a.up.codes, a.up.scales, a.up.biases, row0, 16, H, up_bar);
            step_phase(2);  // gate/up copies asked for
        };
        if constexpr (ROUTE) {
            float lv[8];
            const int seen = max(E, (int)gridDim.x);
            await_tagged([&](int i) { return lane + 32 * i < seen ? a.routed + lane + 32 * i : nullptr; }, rtag, lv);
            select_from(lv, Routing{nullptr, E, k, a.renorm}, ids, wts, nullptr, ask_slot);
            // every block has read the old tag (each wrote its first row with the new one): the
            // next launch's tag may go up
            if (threadIdx.x == 0 && blockIdx.x == 0) a.route_meet[0] = (int)rtag;
        } else {
            select_experts(Routing{a.router_logits, E, k, a.renorm}, ids, wts, nullptr);
        }
        __syncwarp();
        step_phase(8);  // selected
        // (the router launch's form asks after all rounds: its hook took moe_experts_h2048 from 80
        // to 83 registers, 88 allocated, and 128K 525.2 -> 515.5 tok/s; the routed kernel already
        // has 88)
        if constexpr (!ROUTE) ask_slot(slot, ids[slot]);
    }
    // x's bytes (warp 0 once it has asked for the tiles) and the shared expert's inputs, needed
    // only once x and the selection are in
    if constexpr (ROUTE) {
        write_slots(v, H, xb8, gx);
        if (shared_tile) {
            float in[1 + 2 * (EXPERTS_MAX_I / 256)];
            const unsigned long long* sh = a.routed + E;
            await_tagged(
                [&](int i) {
                    if (i == 0) return sh;
                    const int f = threadIdx.x + 256 * ((i - 1) % (EXPERTS_MAX_I / 256));
                    return f < I ? sh + 1 + ((i - 1) / (EXPERTS_MAX_I / 256)) * I + f : nullptr;
                },
                rtag, in);
            sgate = in[0];
#pragma unroll
            for (int j = 0; j < EXPERTS_MAX_I / 256; ++j) {
                sgp[j] = in[1 + j];
                sup[j] = in[1 + EXPERTS_MAX_I / 256 + j];
            }
        }
    }
    if (shared_tile) {
        const float gate = sigmoidf(sgate);
#pragma unroll
        for (int j = 0; j < EXPERTS_MAX_I / 256; ++j) {
            const int i = threadIdx.x + 256 * j;
            if (i < I) sall[pad_idx(i)] = gate * siluf(sgp[j]) * sup[j];
        }
    }
    if constexpr (!ROUTE) resident_input(XInput{a.xn, nullptr, nullptr, nullptr, 0.f, H, 0}, xb8, gx, scratch);
    __syncthreads();  // x's bytes, the selection, the barrier's initialisation, the shared h
    step_phase(3);    // x in
    if (shared_tile) build_x_s8(sall, I, sx8, sg);
    mbar_wait(full, 0);
    step_phase(4);  // gate/up tiles in (moe_routed_experts: the gate tile)
    // a warp takes one quad of groups of both tiles (gate and up): x's fragments and the lane's
    // offsets loaded once for the two, no division to find the tile (ncu had this loop at ~600
    // instructions a warp, issue-bound at 4 warps a scheduler)
    QuadX X;
    for (int qd = warp; qd < quads; qd += 8) {
        const int gq = qd * 4;
        load_quad_x(xb8, gx, gq, X);
        const QuadLane L = quad_lane(H, gq);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            if (ROUTE && t == 1) mbar_wait(&up_full, 0);
            float yA = 0.f, yB = 0.f;
            quad_dot(codes + t * 16 * (H / 2), scales + t * 16 * gpr, biases + t * 16 * gpr, L, X, yA, yB);
            store_quad_sums(part + (t * quads + qd) * 16, yA, yB);
        }
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        const int r = threadIdx.x;
        float g = 0.f, uv = 0.f;
        for (int q = 0; q < quads; ++q) {
            g += part[q * 16 + r];
            uv += part[(quads + q) * 16 + r];
        }
        store_tagged(reinterpret_cast<unsigned long long*>(a.h) + slot * I + f0 + r, wts[slot] * (siluf(g) * uv), tag);
    }
    // the shared tile meanwhile (its inputs are all here)
    if (shared_warp) {
        float yA = 0.f, yB = 0.f;
        tile_compute_s8(sb, 2 * warp, 2 * warp + 2, sx8 + (lane & 3), sg, yA, yB);
        if ((lane & 3) == 0) {
            spart[warp][lane >> 2] = yA;
            spart[warp][(lane >> 2) + 8] = yB;
        }
    }
    // the expert's down rows go out only now, once its gate/up tiles are in and multiplied and
    // this block's h is written: asked for with the gate/up copies (or right after they landed)
    // they shared DRAM with them and the tiles landed ~1 us later (4K 673.5 -> 681.6 tok/s, 128K
    // 455.5 -> 464.5; bench/results/cuda-decode-moe-down-rows-late.json); asked for before the h
    // sums, the 16 threads' shared-memory reads and the shared tile waited behind their ~3K
    // loads a block: h written 7.9 -> 6.9 us after the release, 4K 768.1 -> 772.1 tok/s, 32K
    // +0.6%, 128K +0.4% (bench/results/cuda-decode-moe-down-rows-after-h.json). They still have
    // the slot's meeting to arrive.
    const size_t e0 = (size_t)ids[slot] * H;
    if (routed_warp)
        tile_load(QRows{a.down.codes + e0 * (I / 8), a.down.scales + e0 * gps, a.down.biases + e0 * gps, H}, I,
                  r0 + my_tile * 16, g0, g0 + gpw, tb);
    step_phase(5);  // this block's h written (thread 0's part)
    // The slot's meeting, without a block barrier: the down groups g0 .. g0 + gpw (a "part" of h,
    // at most TILE_BATCH groups: 32 slots) are the same for the warps of every down tile, so one
    // warp per part (the first tile's) polls the part's values until each carries this launch's
    // tag (from L2: the slot's other blocks wrote them), coalesced (lane l takes elements l, l +
    // 32, ...; then its slot's 8 consecutive values from shared memory), writes their fragments'
    // form into the gate/up tiles' space (every warp is past those: the barrier before h's sums;
    // decoder.rs experts_fit admits only shapes whose staging fits the gate tile's codes), and
    // the part's other warps wait for it at a named barrier. Against polling all of h with
    // every thread, two block barriers and a 2-warp build of the bytes: 4K 924.4 -> 928.0 tok/s,
    // 32K 801.3 -> 806.0. Every warp polling its own part lost 2.2% (four times the L2 polls, and
    // uncoalesced 20%: the polls' loads slow the SM's other blocks' multiplies);
    // bench/results/cuda-decode-moe-h-parts.json. (A slot whose blocks cannot all be resident,
    // the host checks occupancy but another client may hold SMs, would never meet: the wait traps
    // after ~1 s of L2 round trips, an error the host reports, instead of hanging the GPU.)
    if (routed_warp) {
        const int part_of_h = warp % wpt;
        const bool poller = my_tile == 0;
        uint4* hxw = reinterpret_cast<uint4*>(codes) + part_of_h * (TILE_BATCH * 8);
        float2* hgw = reinterpret_cast<float2*>(reinterpret_cast<uint4*>(codes) + 8 * TILE_BATCH * 8) + part_of_h * TILE_BATCH;
        float* hst = reinterpret_cast<float*>(codes + 8 * TILE_BATCH * 8 * 16 + 8 * TILE_BATCH * 8) + part_of_h * (TILE_BATCH * 64);
        if (poller) {
            const unsigned long long* hs = reinterpret_cast<const unsigned long long*>(a.h) + slot * I + g0 * 64;
            float hv[TILE_BATCH * 2];
            await_tagged([&](int j) { return lane + 32 * j < gpw * 64 ? hs + lane + 32 * j : nullptr; }, tag, hv);
#pragma unroll
            for (int j = 0; j < TILE_BATCH * 2; ++j)
                if (lane + 32 * j < gpw * 64) hst[lane + 32 * j] = hv[j];
            __syncwarp();
            const bool on = lane < gpw * 8;
            const int e = on ? slot_first_element(g0 * 8 + lane) - g0 * 64 : 0;
            const float4 v0 = *reinterpret_cast<const float4*>(hst + e), v1 = *reinterpret_cast<const float4*>(hst + e + 4);
            float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = on ? v[j] : 0.f;
            write_slot(v, lane, on, hxw, hgw);
        }
        // (named barriers 1-4, one a part: wpt <= gps / 2 <= 4)
        switch (part_of_h) {
            case 0: asm volatile("bar.sync 1, %0;" ::"r"(32 * tiles) : "memory"); break;
            case 1: asm volatile("bar.sync 2, %0;" ::"r"(32 * tiles) : "memory"); break;
            case 2: asm volatile("bar.sync 3, %0;" ::"r"(32 * tiles) : "memory"); break;
            default: asm volatile("bar.sync 4, %0;" ::"r"(32 * tiles) : "memory"); break;
        }
        if (warp == 0) step_phase(6);  // warp 0's part of the slot met
        float yA = 0.f, yB = 0.f;
        tile_compute_s8(tb, g0, g0 + gpw, hxw + (lane & 3), hgw, yA, yB, g0);
        if ((lane & 3) == 0) {
            wpart[warp][lane >> 2] = yA;
            wpart[warp][(lane >> 2) + 8] = yB;
        }
    }
    __syncthreads();
    step_phase(7);  // down rows multiplied
    // the slot's tag for the next launch: every block of the slot read the old one before it
    // wrote its h, and this block's warps together have seen all of h with the new one, so the
    // first block advances it with a plain store. (The last block to leave advanced it after an
    // atomic count: thread 0 waited out that round trip before building h's bytes with its warp,
    // and the block with it: down rows multiplied 9.73 -> 9.47 us after the release, 4K 774.5 ->
    // 777.0 tok/s, 128K +0.3%; bench/results/cuda-decode-experts-tag-store.json)
    if (threadIdx.x == 0 && fi == 0) a.meet[slot] = (int)tag;
    // 4 rows per thread into the residual: the routed rows, then the shared tile's
    if ((int)threadIdx.x < rpb / 4) {
        const int r = 4 * threadIdx.x, t = r / 16;
        float y[4] = {0.f, 0.f, 0.f, 0.f};
        for (int w = t * wpt; w < (t + 1) * wpt; ++w)
#pragma unroll
            for (int j = 0; j < 4; ++j) y[j] += wpart[w][(r + j) % 16];
        atomicAdd(reinterpret_cast<float4*>(a.x + r0 + r), make_float4(y[0], y[1], y[2], y[3]));
    } else if (shared_tile && (int)threadIdx.x >= 32 && (int)threadIdx.x < 36) {
        const int r = 4 * (threadIdx.x - 32);
        float y[4] = {0.f, 0.f, 0.f, 0.f};
        for (int w = 0; w < gps / 2; ++w)
#pragma unroll
            for (int j = 0; j < 4; ++j) y[j] += spart[w][r + j];
        atomicAdd(reinterpret_cast<float4*>(a.x + blockIdx.x * 16 + r), make_float4(y[0], y[1], y[2], y[3]));
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_experts(ExpertsArgs a) { moe_experts_body<false, 0, 0, 0, 0>(a); }
// moe_experts_h2048: the model's shape (H 2048, I 512, top-8 of 256 experts) compiled in, so the
// block's slot, tile and group indices fold to constants (decoder.rs picks it when the config
// matches; with the resident GEMV compiled for K 2048 too, 4K 716.6 -> 720.7 tok/s, 32K and 128K
// +1.9%: bench/results/cuda-decode-shape-specialised.json). The 256 experts compiled in leave the
// selection one unpredicated 8-wide scan (the wider form and the bounds checks drop out): the
// slot's copies go out ~0.25 us sooner, 4K 716.0 -> 737.5 tok/s, 32K 641.2 -> 652.7, 128K 489.5 ->
// 495.2 (bench/results/cuda-decode-shape-specialised-2.json).
extern "C" __global__ void __launch_bounds__(256, 2) moe_experts_h2048(ExpertsArgs a) { moe_experts_body<false, 2048, 512, 8, 256>(a); }

// moe_routed_experts: moe_experts with the router launch's rows (the router, the shared expert's
// gate logit, gate and up projections) computed by its own blocks: before the wait each block
// copies its rows b, b + grid, ... (5, block 0 6, at the model's shape) into the space its gate/up
// tiles take later, and its slots of the norm weight into registers; after it, every block
// normalises x itself, multiplies its rows in f32 (side by side), publishes them tagged, and
// warp 0 selects once rows 0 .. max(E, grid) - 1 carry this launch's tag (the shared tile blocks
// wait for the shared expert's rows later, when they need them). One launch and one hand-over a
// layer fewer; the logits take one L2 round trip instead of a grid's completion.
// Measured (H200, full-size model, A/B against the router launch + moe_experts on one machine,
// bench/results/cuda-decode-routed-experts.json): 4K 742.6 -> 764.7 tok/s (+3.0%), 32K 662.5 ->
// 667.3; the rows one after another (each waiting on its own warp sums) 756.6. Timeline at 4K:
// selected 5.6 us after the release (x normalised 1.8, rows multiplied and published 3.6, the
// logits seen 5.1), where the router launch's form selected ~5.9 us after the out projection's
// release. Launched plain (the graph from 48K), its route rows' copies and its launch are no
// longer under a predecessor: 128K 521.2 -> 494.3, so that graph keeps the router launch.
extern "C" __global__ void __launch_bounds__(256, 2) moe_routed_experts(ExpertsArgs a) { moe_experts_body<true, 0, 0, 0, 0>(a); }
// Held to 88 registers (the fast logistic took ptxas to 89, a whole allocation step of 8 more: at
// 89 this launch lost 2.5% at 4K in session 34); 80 or 72 (no spills either) lose 5-6% at 4K
// (bench/results/cuda-decode-session35-ablations.json). __maxnreg__ replaces __launch_bounds__.
extern "C" __global__ void __maxnreg__(88) moe_routed_experts_h2048(ExpertsArgs a) {
    moe_experts_body<true, 2048, 512, 8, 256>(a);
}
