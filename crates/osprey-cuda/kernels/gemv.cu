// Quantised GEMV for batch-1 decode: y = W x for MLX affine 4/8-bit rows, several matrices that
// share one input in one launch ("segments": e.g. GDN in_proj_qkv | z | b | a), 4- and 8-bit rows
// mixed (the router and shared-expert gate are 8-bit).
//
// Shapes: K (input width) a multiple of 64 up to 4096, group 32/64/128.
// Five kernels (gemv_q and gemv_q_resident also as _k2048 copies compiled for K 2048, the model's
// hidden size: runtime shapes cost the router launch 2/3 of its instructions; compiled in, 4K
// 681.5 -> 705.9 tok/s, bench/results/cuda-decode-shape-specialised.json):
//   gemv_q_pair — a lone 4-bit group-64 segment at K 4096 without a full-width norm (the GDN
//     out_proj with its gated head norm, the attention o_proj, both added into the residual):
//     each 16-row tile over two blocks, one K half each (bottom of the file).
//   gemv_q_resident — launches of only 4-bit group-64 rows, K 2048 or 4096, whose share per block
//     fits in shared memory (GDN in_proj, attention q|k|v): one block
//     of 16 warps per SM, its whole run of 16-row tiles requested at once by bulk copies before
//     griddepcontrol.wait; behind an early moe_experts 8 warps and a ninth that streams the run
//     in order, a few tiles ahead, each multiplied as it lands (decoder.rs
//     RESIDENT_THREADS_AFTER_EARLY_EXPERTS); multiplied from shared memory (below).
//   gemv_q_ring — launches of one 4-bit group-64 segment, K 2048 or 4096, too big for that (the
//     lm_head): a block per SM streams its run of tiles through a ring of shared-memory stages
//     (bulk copies, a producer warp, full/empty mbarriers), the same multiply (below).
//   gemv_q_tiles — other launches with enough 4-bit group-64 rows (>= 2 tiles per SM): 16-row
//     tiles on the integer tensor cores (tiles.cuh: x as two signed bytes per element, mma
//     m16n8k32), 4 warps per tile splitting K, two tiles per block at a time, 256 threads,
//     grid = resident blocks (3 per SM); a warp requests its groups 4 at a time, the next
//     batch (of this tile or its next) in flight while this one is multiplied, and the very first
//     batch before the prologue; the 4 partial sums of a tile meet in a double buffer behind one
//     slot barrier.
//   gemv_q — the rest (the router's 8-bit rows with the shared expert's): a warp per row, lane l
//     reading 16-byte chunks l, l+32, ... (whole 512-byte spans per warp); launched early, each
//     warp's first row requested before the wait; a row's loads all in flight at once (with
//     each chunk's scale converted in its own branch they went out a chunk per round trip:
//     fixed, the step at 4K 591.0 -> 597.8 tok/s, cuda-decode-early-loads-2.json).
// Prologue: x is loaded once per block into padded shared memory (gemv_q_resident: straight into
// the tiles' byte form) and, optionally, RMS-normalised with a weight (the layer's pre-norm), or
// per-head RMS-normalised and gated by silu(z) (the GDN output norm), fused here instead of
// separate kernels; sums of x per 16 elements (rows) or per group (tiles) are precomputed so the
// affine bias costs one FMA: y = Σ s·(q·x) + b·Σx.
// Epilogue: write, or add into the output (residual add fused).
// Ceiling: bytes of codes + scales + biases / ~3.7 TB/s streaming read (budget.md); one thread
// per SM bulk-copying 16 KB requests streams 4.5-4.75 TB/s (bench/kernels/tma_read.cu).
// Measured (H200, full-size model, inside the decode graph: what issuing the family twice adds
// to a step), commit ca2b34f: GDN in_proj 6.9 us (14.2 MB = 2.1 TB/s; gemv_q_tiles took 12.1),
// GDN out_proj 6.4 us (gemv_q_pair since: 4.8, commit 3739dce); lm_head by gemv_q_ring 73-78
// us (286 MB = 3.7-3.9 TB/s; 99-105 by gemv_q_tiles; bench/results/cuda-decode-lm-head-ring*.json).
// What bounds gemv_q_resident: the wait and its prologue (~1 + ~2 us, chained) and the multiply
// from shared memory (issue throughput; bench/kernels/gemv_resident.cu,
// cuda-decode-quad-dot-lean.json).
#include "tiles.cuh"

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

// Row `row` of a segment's output: written, or added into it (the residual add).
__device__ __forceinline__ void write_row(const Segment& s, int row, float y) {
    if (s.accumulate) s.out[row] += y;
    else s.out[row] = y;
}

// The greedy token choice fused into the lm_head launch: every block keeps the largest
// (logit, id) key of the rows it wrote (ties: the lower id), folds it into `best` with one
// atomicMax, and the last block to finish (a counter after a fence) writes the chosen id into the
// next step's input slot, the history, and advances step and position, then clears best and done
// for the next replay. It stands aside (only clears) while the sampler chooses. One allocation
// per decoder, written once by the host.
struct TokenChoice {
    unsigned long long best;  // 0 between steps
    unsigned int done;        // blocks finished this step; 0 between steps
    int n;                    // valid vocabulary: rows at or past it are padding
    const int* sampling;      // SampleParams.active (sample.cu): 1 while the sampler chooses
    int* token;               // next step's input slot
    int* pos;
    int* history;
    int* step;
    int record;  // 0: only the token slot is written (a speculative verify row, speculative.cu)
    int _pad;
};

__device__ __forceinline__ unsigned long long choice_key(float logit, int id) {
    return ((unsigned long long)order_key(logit) << 32) | (0xFFFFFFFFu - (uint32_t)id);
}

__device__ __forceinline__ void choose_token(TokenChoice* c, unsigned long long best, float* scratch) {
    unsigned long long* warp_best = reinterpret_cast<unsigned long long*>(scratch);  // one per warp (<= 16)
    __shared__ bool last;
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(FULL_MASK, best, o);
        best = other > best ? other : best;
    }
    __syncthreads();  // scratch is free
    if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long b = 0;
        for (int w = 0; w < (int)blockDim.x / 32; ++w) b = warp_best[w] > b ? warp_best[w] : b;
        if (b) atomicMax(&c->best, b);
        __threadfence();
        last = atomicAdd(&c->done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
        __threadfence();
        const unsigned long long k = atomicExch(&c->best, 0ull);
        c->done = 0;
        if (!*c->sampling) {
            const int id = (int)(0xFFFFFFFFu - (uint32_t)k);
            *c->token = id;
            if (c->record) {
                c->history[*c->step] = id;
                *c->step += 1;
                *c->pos += 1;
            }
        }
    }
}

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
    int tiles;  // 1: 4-bit group-64 segments run as tensor-core tiles (the host sets it for big launches)
    int prefetch;  // 1: ask L2 for this block's share of the weights before waiting on the predecessor
    int stages;    // gemv_q_resident: tiles a block holds in shared memory (at least its share)
    TokenChoice* choice;  // the lm_head launch (gemv_q_ring, gemv_q_tiles, gemv_q): greedy token choice
    float* normed;        // gemv_q, gemv_q_tiles: block 0 writes the normalised input here (moe_experts reads it)
    // gemv_q_resident2, gemv_q_ring2: the second activation row (the speculative verify step's),
    // its token choice and each segment's output for it (written, or added as the segment says)
    const float* x1;
    TokenChoice* choice1;
    float* out1[MAX_SEGS];
    const float* gate_z1;  // gemv_q_pair2: the second row's gate input
};

__device__ __forceinline__ QRows rows_of(const Segment& s) { return QRows{s.codes, s.scales, s.biases, s.rows}; }

// Thread t owns the E consecutive elements [E·t, E·t + E) of the input, E = max(K/256, 4) (so
// 4, 8 or 16; K/E threads take part): all of its x, weight and gate values are loaded in one batch
// of 16-byte loads, so the prologue costs one memory round trip instead of one per loop iteration.
#define MAX_ELEMS 16

// KC: K compiled in (0: the arguments'): KC/256 elements a thread, so a launch needs at least 256
// threads; past the 256th they take no part (gemv_q_k2048 runs 320)
template <int KC>
__device__ __forceinline__ void load_input(const GemvArgs& a, float* xs, float* chunk_sum, float* scratch) {
    const int K = KC ? KC : a.K, E = KC ? max(KC / 256, 4) : max(K / (int)blockDim.x, 4), t = threadIdx.x, base = t * E;
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

// One row's codes, scales and biases for this lane, loaded ahead of use: scales and biases kept
// as raw bf16 and lanes past the row's chunks load its last one (valid memory, unused), so no
// branch or conversion sits between the loads and all of them are in flight at once (converted
// in their branch, each chunk's scale waited out its round trip before the next chunk's loads).
struct RowLoads {
    uint4 w[MAX_CPL];
    __nv_bfloat16 sc[MAX_CPL], bi[MAX_CPL];
};

__device__ __forceinline__ void load_row(const Segment& s, int row, int K, int group, RowLoads& L) {
    const int lane = threadIdx.x & 31;
    const int epc = s.bits == 4 ? 32 : 16;
    const int chunks = K / epc, gpr = K / group;
    const uint4* codes = reinterpret_cast<const uint4*>(s.codes + (size_t)row * (K * s.bits / 32));
    const __nv_bfloat16* scales = s.scales + (size_t)row * gpr;
    const __nv_bfloat16* biases = s.biases + (size_t)row * gpr;
#pragma unroll
    for (int j = 0; j < MAX_CPL; ++j) {
        const int c = min(lane + 32 * j, chunks - 1), g = (c * epc) / group;
        L.w[j] = __ldcs(codes + c);
        L.sc[j] = scales[g];
        L.bi[j] = biases[g];
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
            acc = fmaf(bf16_to_f32(L.sc[j]), d, fmaf(bf16_to_f32(L.bi[j]), xsum, acc));
        }
    }
    return warp_sum(acc);
}

// gemv_q_tiles: K is split TILE_KPARTS ways (warps per tile), two tiles per block at a time; the
// next batch (of this tile or the warp's next one) is in flight while this one is multiplied.
#define TILE_KPARTS 4
#define TILE_SLOTS (8 / TILE_KPARTS)

// The TILE_KPARTS warps of one slot meet (barrier ids are immediates, so only these are reserved).
__device__ __forceinline__ void slot_barrier(int slot) {
    if (slot == 0) asm volatile("bar.sync 1, %0;" ::"n"(32 * TILE_KPARTS) : "memory");
    else asm volatile("bar.sync 2, %0;" ::"n"(32 * TILE_KPARTS) : "memory");
}

// Work units: 16-row tiles for 4-bit group-64 segments, single rows otherwise.
// (a row-only launch, gemv_q, has a.tiles == 0: TILES false says so at compile time)
template <bool TILES>
__device__ __forceinline__ bool tiled(const GemvArgs& a, const Segment& s) { return TILES && a.tiles && s.bits == 4 && a.group == 64; }

// Work units of the launch's tiled segments (16-row tiles) or of its untiled ones (rows).
template <bool TILES>
__device__ __forceinline__ int unit_count(const GemvArgs& a, bool tiles) {
    int n = 0;
    for (int i = 0; i < a.nseg; ++i)
        if (tiled<TILES>(a, a.seg[i]) == tiles) n += tiles ? (a.seg[i].rows + 15) / 16 : a.seg[i].rows;
    return n;
}

// Unit u of those: its segment, and its index inside it (`local`).
template <bool TILES>
__device__ __forceinline__ int locate_unit(const GemvArgs& a, bool tiles, int u, int& local) {
    int si = 0;
    for (; si < a.nseg; ++si) {
        if (tiled<TILES>(a, a.seg[si]) != tiles) continue;
        const int n = tiles ? (a.seg[si].rows + 15) / 16 : a.seg[si].rows;
        if (u < n) break;
        u -= n;
    }
    local = u;
    return si;
}

// The grid is sized to the resident blocks (the prologue is paid once per block); each warp walks
// work units: 16-row tensor-core tiles (4-bit, group 64) or single rows (8-bit, other groups).
// TILES: the launch has tiles (a.tiles); compiled apart so row-only launches (the router, the
// output projections) carry none of the tile path's registers through their prologue.
template <bool TILES, int KC = 0, int GROUP = 0, int WARPS = 8>
__device__ __forceinline__ void gemv_body(const GemvArgs& a) {
    const int K = KC ? KC : a.K, group = GROUP ? GROUP : a.group;
    __shared__ __align__(16) float xs[MAX_K + MAX_K / 8];
    __shared__ float chunk_sum[MAX_K / 16];
    __shared__ uint4 xb8[MAX_K / 64 * 8];
    __shared__ float2 gx[MAX_K / 64];
    __shared__ float scratch[32];
    step_overlap_begin();
    if (a.prefetch) {
        for (int i = 0; i < a.nseg; ++i) {
            const Segment& s = a.seg[i];
            prefetch_share_l2(s.codes, (size_t)s.rows * K * s.bits / 8);
            prefetch_share_l2(s.scales, (size_t)s.rows * (K / group) * 2);
            prefetch_share_l2(s.biases, (size_t)s.rows * (K / group) * 2);
        }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // a row-only launch (gemv_q: the host launches it only with rows, and early): each warp's
    // first row requested before the wait, so it streams under the predecessor; unbranched (a
    // warp past the last row loads that one and drops it) so no conversion waits on it there.
    // Measured at 4K: the router launch 611 -> 619 tok/s; before the prologue but launched in
    // order, 586-608 (with 3 blocks per SM the row spilled to local memory, whose stores waited
    // for the loads); cuda-decode-early-loads-2.json.
    const int rows_total = unit_count<TILES>(a, false), first_row = blockIdx.x * WARPS + warp;
    RowLoads first;
    if (!TILES) {
        int fl;
        const Segment& s = a.seg[locate_unit<TILES>(a, false, min(first_row, rows_total - 1), fl)];
        load_row(s, fl, K, group, first);
    }
    step_inputs_ready();
    unsigned long long best = 0;  // with a.choice: this thread's largest choice_key
    // tiles: slot `slot` of block b takes tiles b·SLOTS + slot, then every gridDim·SLOTS on; warp
    // kp of the slot owns groups [g0, g1) of them. Its first batch of weights is requested before
    // the prologue (weights depend on no earlier kernel), so the prologue hides under that latency.
    const int total_tiles = unit_count<TILES>(a, true);
    const int slot = warp / TILE_KPARTS, kp = warp % TILE_KPARTS, gpr = K / 64;
    const int g0 = kp * gpr / TILE_KPARTS, g1 = (kp + 1) * gpr / TILE_KPARTS;
    int tile = blockIdx.x * TILE_SLOTS + slot, local;
    int si = locate_unit<TILES>(a, true, tile, local), row0 = local * 16;
    TileBatch cur, nxt;
    if (TILES && tile < total_tiles) tile_load(rows_of(a.seg[si]), K, row0, g0, g1, cur);
    load_input<KC>(a, xs, chunk_sum, scratch);
    if (a.normed && blockIdx.x == 0)
        for (int i = threadIdx.x; i < K; i += blockDim.x) a.normed[i] = xs[pad_idx(i)];
    step_phase(2);  // x in

    if (TILES) {
        build_x_s8(xs, K, xb8, gx);
        __syncthreads();
        // partial sums of a slot's tiles meet in a double buffer, one slot barrier per tile
        __shared__ float part[2][TILE_SLOTS][TILE_KPARTS][16];
        const int batches = (g1 - g0 + TILE_BATCH - 1) / TILE_BATCH;
        const int stride = gridDim.x * TILE_SLOTS;
        int bi = 0, it = 0;
        const uint4* xq = xb8 + (lane & 3);
        float yA = 0.f, yB = 0.f;
        while (tile < total_tiles) {
            // the next (tile, batch) requested before this one is used
            int nt = tile, nbi = bi + 1, nrow0 = row0, nsi = si;
            if (nbi == batches) {
                nbi = 0;
                nt += stride;
                nsi = locate_unit<TILES>(a, true, nt, local);
                nrow0 = local * 16;
            }
            if (nt < total_tiles) tile_load(rows_of(a.seg[nsi]), K, nrow0, g0 + nbi * TILE_BATCH, g1, nxt);
            tile_compute_s8(cur, g0 + bi * TILE_BATCH, g1, xq, gx, yA, yB);
            if (nbi == 0) {
                float* mine = part[it & 1][slot][kp];
                if ((lane & 3) == 0) {
                    mine[lane >> 2] = yA;
                    mine[(lane >> 2) + 8] = yB;
                }
                slot_barrier(slot);
                const Segment& s = a.seg[si];
                if (kp == 0 && lane < 16 && row0 + lane < s.rows) {
                    float y = 0.f;
#pragma unroll
                    for (int k = 0; k < TILE_KPARTS; ++k) y += part[it & 1][slot][k][lane];
                    write_row(s, row0 + lane, y);
                    if (a.choice && row0 + lane < a.choice->n) best = max(best, choice_key(y, row0 + lane));
                }
                yA = yB = 0.f;
                ++it;
            }
            tile = nt; bi = nbi; row0 = nrow0; si = nsi; cur = nxt;
        }
    }
    // rows: every unit of the untiled segments, one per warp
    for (int u = first_row; u < rows_total; u += gridDim.x * WARPS) {
        const Segment& s = a.seg[locate_unit<TILES>(a, false, u, local)];
        RowLoads L = first;
        if (TILES || u != first_row) load_row(s, local, K, group, L);
        const float y = row_dot(s, L, K, xs, chunk_sum);
        if (lane == 0) {
            write_row(s, local, y);
            if (a.choice && local < a.choice->n) best = max(best, choice_key(y, local));
        }
    }
    step_phase(3);  // rows written
    if (a.choice) choose_token(a.choice, best, scratch);
}

// gemv_q at 2 blocks per SM: its first row held across the prologue fits in registers (at 3 it
// spilled)
extern "C" __global__ void __launch_bounds__(256, 2) gemv_q(GemvArgs a) { gemv_body<false>(a); }
// gemv_q_k2048: the router launch (K 2048, group 64), compiled for that shape: with K and the group
// known, the prologue's per-thread loops and the row's chunk and group indices fold to constants,
// and with TILES false no segment is asked whether it is tiled (ncu: 1,350 instructions a warp for
// its one row, 2/3 of them indexing and the generic prologue). Blocks of GEMV_K2048_WARPS warps, one
// per SM (the host sizes the grid to the rows, at most one block an SM): the router launch's 1,281
// rows fill 129 SMs with 10 rows each, where 161 blocks of 8 had 29 SMs taking two blocks (16 rows)
// and finishing last: 4K 741.7 -> 751.3 tok/s, 128K 500.1 -> 502.0
// (bench/results/cuda-decode-router-one-block-per-sm.json). Its prologue (load_input<2048>) takes 8
// elements a thread, so the warps past the eighth only multiply.
#define GEMV_K2048_WARPS 10
extern "C" __global__ void __launch_bounds__(GEMV_K2048_WARPS * 32, 1) gemv_q_k2048(GemvArgs a) {
    gemv_body<false, 2048, 64, GEMV_K2048_WARPS>(a);
}
extern "C" __global__ void __launch_bounds__(256, 3) gemv_q_tiles(GemvArgs a) { gemv_body<true>(a); }

// ---- resident tiles: a block's whole share in shared memory, requested before the wait ----
// gemv_q_resident: launches of only 4-bit group-64 rows, K 2048 or 4096, whose share per block
// fits in shared memory (GDN in_proj, attention q|k|v). One block of 16
// warps per SM takes a contiguous run of 16-row tiles; its first thread asks the copy engine for
// all of their codes, scales and biases (one copy per run inside a segment) before
// griddepcontrol.wait. The engine launches it alone with programmatic dependent launch
// (decoder.rs OVERLAP_ENV): its blocks start while the predecessor runs and the weights stream
// under it. A block takes at least half an SM's shared memory (the host pads it): blocks placed
// early would otherwise land two on the SMs that free up first and leave others idle (measured:
// 442 tok/s padded with every kernel under programmatic launch, 411 unpadded; launched early
// alone, padded: 463; bench/results/cuda-decode-overlap-resident.json).
// The multiply (quad_dot) and the prologue (resident_input) are in tiles.cuh, shared with moe.cu.
// Measured (bench/kernels/gemv_resident.cu, chains of 30 launches of one shape with programmatic
// dependent launch, H200): in_proj 5.9 us (gemv_q_tiles 12.5; its bytes at 4.3 TB/s: 3.3), q|k|v
// 5.0 (11.3), out_proj 5.8 (11.0); in the decode graph, in_proj 8.1 us (12.1 with gemv_q_tiles).
// Timeline of the step (tools/timeline_kernels.py, full-size model at 4K, its phase marks, 16
// warps, commit f01a27e): after the launch's release the median block has asked for its tiles at
// 0.8 us (its blocks land only as moe_experts' leave), has x at 3.8 and the tiles at 4.6 (14.2 MB
// for in_proj, sharing DRAM with the early-launched gdn_step's state and out_proj's tiles) and has
// multiplied at 6.7; a launch is 9.2 us exit to exit. (With 8 warps: x at 3.2, tiles 3.8, a 2.6 us
// multiply, 10.6 us a launch, measured with the older probe that stretched each phase.) The multiply's
// warps: K is split RES_KSLICES ways, and each further group of RES_KSLICES warps takes every
// (warps / RES_KSLICES)-th tile of the run: with 16 warps it takes 2.0 us, 4K 627.0 -> 629.1
// tok/s (bench/results/cuda-decode-session14-ablations.json). A barrier per tile, so the
// multiply starts on the first tile, lost (621-624): the multiply then waits on the stream.
#define RES_KSLICES 8
// Streamed in order (the experts-early graph's launches, whose blocks have a ninth warp; session
// 38): the block's first RES_RING_DEPTH tiles are asked for before the wait and each later one by
// the ninth warp once the tile RES_RING_DEPTH before it has landed, every tile on its own barrier,
// and the multiply takes each tile as it lands. Asked for all at once, every block's tiles land
// together at the end of the GPU's 14 MB stream (each request's bytes come spread over all of it)
// and the 2 us multiply starts only then; in order, the early tiles are multiplied while the
// later stream, and x (8 KB from L2), no longer queued behind the whole stream, is in 2.3 us
// after the release instead of 3.6 (GDN in_proj's median block multiplied 6.1 us after the
// release instead of 6.7). A/B on one machine: 4K 867.5 -> 881.6 tok/s, 32K 766.0 -> 771.0;
// depth 2 -0.7% (too little in flight for the bandwidth), 4 +1.3%; per-tile barriers with all
// tiles asked at once -1.1%, and asked only once x is in -4.1% (x in 1.8 us, but the first
// tiles then at 6.7); as landed, against its parent: 4K 862.7 -> 872.0, 32K 765.0 -> 767.5,
// 128K unchanged (bench/results/cuda-decode-session38-ablations.json).
#define RES_RING_DEPTH 3
// most tiles a streamed block takes (its barriers; the host reserves them: resident_launch)
#define RES_MAX_STREAMED 16

// Block b takes tiles [b·T/grid, (b+1)·T/grid) of the launch's segments; a.stages >= its tile
// count (the host sizes the dynamic shared memory by it: resident_launch in decoder.rs).
// Shared memory: codes [stages][16 rows][K/2 B], scales and biases [stages][16][K/64], then x.
// ROWS activation rows (1, or 2 for gemv_q_resident2: x and x1, each segment's rows into its out
// and out1[segment]): each tile multiplied by every row as it is unpacked.
template <int KC, int ROWS = 1>
__device__ __forceinline__ void gemv_resident_body(const GemvArgs& a) {
    extern __shared__ __align__(128) char resident_dynamic_smem[];
    char* smem = resident_dynamic_smem;
    const int K = KC ? KC : a.K, gpr = K / 64, S = a.stages;
    const int total = unit_count<true>(a, true);
    const int t0 = (int)((long long)blockIdx.x * total / gridDim.x), t1 = (int)((long long)(blockIdx.x + 1) * total / gridDim.x);
    const int n = t1 - t0;
    char* codes = smem;
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + (size_t)S * 16 * (K / 2));
    __nv_bfloat16* biases = scales + (size_t)S * 16 * gpr;
    uint4* xb8 = reinterpret_cast<uint4*>(biases + (size_t)S * 16 * gpr);  // [ROWS][gpr * 8]
    float2* gx = reinterpret_cast<float2*>(xb8 + ROWS * gpr * 8);          // [ROWS][gpr]
    float* scratch = reinterpret_cast<float*>(gx + ROWS * gpr);
    uint64_t* full = reinterpret_cast<uint64_t*>(scratch + 32);  // [RES_MAX_STREAMED] when streamed
    // a ninth warp (256 + 32 threads) asks for the tiles in order
    const bool has_streamer = (blockDim.x & 255) == 32, streamed = has_streamer && n <= RES_MAX_STREAMED;
    // tile i of the run on barrier i
    const auto ask_tile = [&](int i) {
        int local;
        const Segment& s = a.seg[locate_unit<true>(a, true, t0 + i, local)];
        const int rows = min(16, s.rows - local * 16);
        mbar_arrive_expect_bytes(&full[i], q4_rows_bytes(rows, K));
        copy_q4_rows(codes, scales, biases, i, s.codes, s.scales, s.biases, local * 16, rows, K, &full[i]);
    };
    // K 2048 with 8 K-slices: warp w's 32 slots of x are exactly the groups of its quad, so each
    // warp takes in its own quad of x and starts multiplying without waiting for the others (with
    // gemv_q_pair's barrier after x dropped the same way: 4K 899.6 -> 915.9 tok/s, 32K 787.1 ->
    // 799.7; bench/results/cuda-decode-warp-x.json)
    constexpr bool WARP_X = KC == 2048 && 2048 / 64 / (4 * RES_KSLICES) == 1;
    step_overlap_begin();
    if (threadIdx.x == 0) {
        for (int i = 0; i < (streamed ? n : 1); ++i) mbar_init(&full[i], 1);
        mbar_init_fence();
    }
    // (with no block barrier after x, the barriers' initialisation is published here, before
    // the wait, ahead of the copies)
    if constexpr (WARP_X) __syncthreads();
    if (threadIdx.x == 0 && streamed) {
        for (int i = 0; i < min(RES_RING_DEPTH, n); ++i) ask_tile(i);
        step_phase(2);  // copies asked for
    } else if (threadIdx.x == 0) {
        // runs of consecutive tiles inside one segment: one copy each of codes, scales, biases
        uint32_t bytes = 0;
        for (int t = t0; t < t1;) {
            int local;
            const Segment& s = a.seg[locate_unit<true>(a, true, t, local)];
            const int run = min(t1 - t, (s.rows + 15) / 16 - local), rows = min(run * 16, s.rows - local * 16);
            bytes += q4_rows_bytes(rows, K);
            t += run;
        }
        mbar_arrive_expect_bytes(full, bytes);
        for (int t = t0; t < t1;) {
            int local;
            const Segment& s = a.seg[locate_unit<true>(a, true, t, local)];
            const int run = min(t1 - t, (s.rows + 15) / 16 - local), r0 = local * 16, rows = min(run * 16, s.rows - r0);
            copy_q4_rows(codes, scales, biases, t - t0, s.codes, s.scales, s.biases, r0, rows, K, full);
            t += run;
        }
        step_phase(2);  // copies asked for
    }
    // the norm weight (no kernel writes it) into registers before the wait: loaded after it, a
    // DRAM miss behind the launch's tile stream, it held x's prologue (with the streamed tiles
    // multiplied singly, below: 4K 877.5 -> 892.3 tok/s, 32K 769.2 -> 781.1;
    // bench/results/cuda-decode-session39-ablations.json)
    float nw[2][8];
    if (a.norm_weight) load_norm_slots(a.norm_weight, K, nw);
    step_inputs_ready();
    if constexpr (WARP_X) {
        // the full-width RMSNorm's 1/rms applied to the sums at the end (resident_values<true>):
        // each warp leaves its sum of squares of row r in scratch[16 r + warp]
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const XInput in{r ? a.x1 : a.x, a.norm_weight, a.gate_z, a.head_norm, a.eps, K, a.head_dim};
            float v[2][8];
            const float ss = warp_sum(resident_values<true>(in, v, scratch, nw));
            write_slots(v, K, xb8 + r * gpr * 8, gx + r * gpr);
            if ((threadIdx.x & 31) == 0) scratch[16 * r + (threadIdx.x >> 5)] = ss;
        }
        __syncwarp();
        // 16 warps (the graph without early experts): warp w + 8 multiplies the quad warp w wrote
        if (blockDim.x >= 512) __syncthreads();
    } else {
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            resident_input(XInput{r ? a.x1 : a.x, a.norm_weight, a.gate_z, a.head_norm, a.eps, K, a.head_dim},
                           xb8 + r * gpr * 8, gx + r * gpr, scratch, nw);
        __syncthreads();  // also publishes the barriers' initialisation
    }
    step_phase(3);  // x in (WARP_X: warp 0's)
    if (has_streamer && (int)threadIdx.x >= (int)blockDim.x - 32) {
        // the streaming warp: the rest of the run, each tile once the one RES_RING_DEPTH before it
        // has landed; then only the final barrier
        if (streamed && (int)threadIdx.x == (int)blockDim.x - 32)
            for (int i = RES_RING_DEPTH; i < n; ++i) {
                mbar_wait(&full[i - RES_RING_DEPTH], 0);
                ask_tile(i);
            }
    } else {
        // (the streaming warp's 32 threads leave phases at blockDim.x / 256: 288 / 256 = 1)
        const int warp = threadIdx.x >> 5, kslice = warp % RES_KSLICES, phase = warp / RES_KSLICES;
        const int phases = blockDim.x / (32 * RES_KSLICES), g0 = kslice * gpr / RES_KSLICES, quads = gpr / (4 * RES_KSLICES);
        QuadX X[ROWS];
        const QuadLane L0 = quad_lane(K, g0);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (quads == 1) load_quad_x(xb8 + r * gpr * 8, gx + r * gpr, g0, X[r]);
        if (!streamed) {
            mbar_wait(full, 0);
            step_phase(4);  // tiles in
        }
        // a warp leaves its 16 partial sums of a tile in the first 64 bytes of its own K-slice of the
        // tile's codes, which only it reads (row r's in the r-th 64 bytes). Tiles go two at a time (unrolled over all tiles the code
        // outgrows the instruction cache): a warp's quad_dot is a chain of shared-memory loads, mma
        // and conversions that one tile alone leaves mostly waiting at 4 warps a scheduler (GDN
        // in_proj's median block multiplied 2.05 -> 1.79 us after its tiles are in; 4K 772.8 -> 777.5
        // tok/s, 32K +0.4%, 128K -0.1%: bench/results/cuda-decode-resident-tile-pairs.json)
        // Streamed, each tile is multiplied alone as it lands: a pair waits for its second tile,
        // so the last pair started a tile later (4K 875.4 -> 885.6 tok/s, 32K 768.2 -> 776.4;
        // bench/results/cuda-decode-session39-ablations.json).
        int i = phase;
        if (quads == 1 && !streamed) {
#pragma unroll 1
            for (; i + phases < n; i += 2 * phases) {
                char* s0 = codes + (size_t)i * 16 * (K / 2);
                char* s1 = s0 + (size_t)phases * 16 * (K / 2);
                const size_t o0 = (size_t)i * 16 * gpr, o1 = o0 + (size_t)phases * 16 * gpr;
                float a0[ROWS], b0[ROWS], a1[ROWS], b1[ROWS];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) a0[r] = b0[r] = a1[r] = b1[r] = 0.f;
                quad_dot_rows<ROWS>(s0, scales + o0, biases + o0, L0, X, a0, b0);
                quad_dot_rows<ROWS>(s1, scales + o1, biases + o1, L0, X, a1, b1);
                if (i == phase) step_phase_after(6, __float_as_uint(b1[0]));  // warp 0's first two tile products
                __syncwarp();
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    store_quad_sums(reinterpret_cast<float*>(s0 + g0 * 32 + 64 * r), a0[r], b0[r]);
                    store_quad_sums(reinterpret_cast<float*>(s1 + g0 * 32 + 64 * r), a1[r], b1[r]);
                }
            }
        }
#pragma unroll 1
        for (; i < n; i += phases) {
            char* stage = codes + (size_t)i * 16 * (K / 2);
            const __nv_bfloat16* sc = scales + (size_t)i * 16 * gpr;
            const __nv_bfloat16* bi = biases + (size_t)i * 16 * gpr;
            float yA[ROWS], yB[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) yA[r] = yB[r] = 0.f;
            if (streamed) mbar_wait(&full[i], 0);  // each tile waited for as it is taken
            if (quads == 1) quad_dot_rows<ROWS>(stage, sc, bi, L0, X, yA, yB);
            else {
#pragma unroll 1
                for (int qd = 0; qd < quads; ++qd) {
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) load_quad_x(xb8 + r * gpr * 8, gx + r * gpr, g0 + 4 * qd, X[r]);
                    quad_dot_rows<ROWS>(stage, sc, bi, quad_lane(K, g0 + 4 * qd), X, yA, yB);
                }
            }
            __syncwarp();
#pragma unroll
            for (int r = 0; r < ROWS; ++r) store_quad_sums(reinterpret_cast<float*>(stage + g0 * 32 + 64 * r), yA[r], yB[r]);
        }
    }
    __syncthreads();
    step_phase(5);  // multiplied
    float inv_rms[ROWS];
#pragma unroll
    for (int x = 0; x < ROWS; ++x) {
        inv_rms[x] = 1.f;
        if (WARP_X && a.norm_weight) {
            float ss = 0.f;
#pragma unroll
            for (int w = 0; w < RES_KSLICES; ++w) ss += scratch[16 * x + w];
            inv_rms[x] = rsqrtf(ss / K + a.eps);
        }
    }
#pragma unroll
    for (int x = 0; x < ROWS; ++x)
        for (int o = threadIdx.x; o < n * 16; o += blockDim.x) {
            const int i = o >> 4, r = o & 15;
            int local;
            const int si = locate_unit<true>(a, true, t0 + i, local);
            const Segment& s = a.seg[si];
            const int row = local * 16 + r;
            if (row < s.rows) {
                const char* stage = codes + (size_t)i * 16 * (K / 2) + 64 * x;
                float y = 0.f;
#pragma unroll
                for (int w = 0; w < RES_KSLICES; ++w) y += reinterpret_cast<const float*>(stage + (w * gpr / RES_KSLICES) * 32)[r];
                y *= inv_rms[x];
                if (x == 0) write_row(s, row, y);
                else if (s.accumulate) a.out1[si][row] += y;
                else a.out1[si][row] = y;
            }
        }
}

extern "C" __global__ void __launch_bounds__(2 * RES_KSLICES * 32, 1) gemv_q_resident(GemvArgs a) { gemv_resident_body<0>(a); }
// gemv_q_resident_k2048: K 2048 (the GDN and attention input projections) compiled in
extern "C" __global__ void __launch_bounds__(2 * RES_KSLICES * 32, 1) gemv_q_resident_k2048(GemvArgs a) {
    gemv_resident_body<2048>(a);
}
// gemv_q_resident2_k2048: the input projections of the speculative verify step's two rows in one
// launch (speculative.cu)
extern "C" __global__ void __launch_bounds__(2 * RES_KSLICES * 32, 1) gemv_q_resident2_k2048(GemvArgs a) {
    gemv_resident_body<2048, 2>(a);
}

// gemv_q_ring: launches of one 4-bit group-64 segment too big for gemv_q_resident (the lm_head,
// 15,520 tiles at K 2048): one block per SM takes a contiguous run of 16-row tiles and streams it
// through a ring of shared-memory stages of RING_TILES tiles, each filled by three bulk copies
// (codes, scales, biases; 32 KB of codes per request) behind a `full` mbarrier. Warps 0..7
// multiply (quad_dot, as gemv_q_resident: each warp a K-slice of every tile) and release the
// stage on its `empty` mbarrier; warp 8 produces: it adds the 8 warps' partial sums of a released
// stage's rows, writes them (and keeps the greedy choice's best key), and refills the stage. The
// first `stages` requests go out before the dependency wait and the prologue.
// (An earlier streamed GEMV lost to gemv_q_tiles on the lm_head, 137 vs 101 us, while its
// bank-conflicted multiply took 1,320 cycles per tile-quad and warp; quad_dot takes 590.)
#define RING_TILES 2  // the producer warp's lane l takes row l of a stage: RING_TILES * 16 == 32
#define RING_CONSUMERS 8

// ROWS activation rows (1, or 2 for gemv_q_ring2: x and x1 into the segment's out and out1, each
// with its token choice): a stage's weights multiplied by every row as they are unpacked.
template <int KC, int ROWS = 1>
__device__ __forceinline__ void gemv_ring_body(const GemvArgs& a) {
    extern __shared__ __align__(128) char ring_dynamic_smem[];
    char* smem = ring_dynamic_smem;
    const Segment& s = a.seg[0];
    const int K = KC ? KC : a.K, gpr = K / 64, S = a.stages;
    const int total = (s.rows + 15) / 16;
    const int t0 = (int)((long long)blockIdx.x * total / gridDim.x), t1 = (int)((long long)(blockIdx.x + 1) * total / gridDim.x);
    const int stages_total = (t1 - t0 + RING_TILES - 1) / RING_TILES;
    const size_t tile_codes = (size_t)16 * (K / 2), tile_sb = (size_t)16 * gpr;
    char* codes = smem;  // [S][RING_TILES][16 rows][K/2 B]
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + S * RING_TILES * tile_codes);  // [S][RING_TILES][16][K/64]
    __nv_bfloat16* biases = scales + S * RING_TILES * tile_sb;
    float* part = reinterpret_cast<float*>(biases + S * RING_TILES * tile_sb);  // [S][RING_TILES][ROWS][warp][16]
    uint4* xb8 = reinterpret_cast<uint4*>(part + S * RING_TILES * ROWS * RING_CONSUMERS * 16);  // [ROWS][gpr * 8]
    float2* gx = reinterpret_cast<float2*>(xb8 + ROWS * gpr * 8);  // [ROWS][gpr]
    float* scratch = reinterpret_cast<float*>(gx + ROWS * gpr);
    uint64_t* full = reinterpret_cast<uint64_t*>(scratch + 32);
    uint64_t* empty = full + S;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool producer_lead = threadIdx.x == RING_CONSUMERS * 32;
    // stage st: tiles [t0 + st·RING_TILES, +RING_TILES) of this block's run, into slot st mod S
    auto fill = [&](int st) {
        const int slot = st % S, r0 = (t0 + st * RING_TILES) * 16;
        const int rows = min(min(RING_TILES, t1 - t0 - st * RING_TILES) * 16, s.rows - r0);
        mbar_arrive_expect_bytes(&full[slot], q4_rows_bytes(rows, K));
        copy_q4_rows(codes, scales, biases, slot * RING_TILES, s.codes, s.scales, s.biases, r0, rows, K, &full[slot]);
    };
    step_overlap_begin();
    if (producer_lead) {
        for (int i = 0; i < S; ++i) {
            mbar_init(&full[i], 1);
            mbar_init(&empty[i], RING_CONSUMERS);
        }
        mbar_init_fence();
        for (int st = 0; st < min(S, stages_total); ++st) fill(st);
    }
    // the final norm's weight before the wait, as gemv_q_resident's (4K +0.3%, 32K +0.4%)
    float nw[2][8];
    if (a.norm_weight) load_norm_slots(a.norm_weight, K, nw);
    step_inputs_ready();
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        resident_input(XInput{r ? a.x1 : a.x, a.norm_weight, a.gate_z, a.head_norm, a.eps, K, a.head_dim}, xb8 + r * gpr * 8,
                       gx + r * gpr, scratch, nw);
    __syncthreads();  // also publishes the barriers' initialisation
    unsigned long long best[ROWS];  // with a.choice: this thread's largest choice_key per row
#pragma unroll
    for (int r = 0; r < ROWS; ++r) best[r] = 0;
    if (warp == RING_CONSUMERS) {
        for (int st = 0; st < stages_total; ++st) {
            const int slot = st % S;
            mbar_wait(&empty[slot], (st / S) & 1);
            // lane l: row l of the stage (RING_TILES * 16 == 32 rows)
            const int row = (t0 + st * RING_TILES) * 16 + lane;
            if (row < t1 * 16 && row < s.rows) {
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const float* p = part + ((size_t)(slot * RING_TILES + (lane >> 4)) * ROWS + r) * RING_CONSUMERS * 16 + (lane & 15);
                    float y = 0.f;
#pragma unroll
                    for (int w = 0; w < RING_CONSUMERS; ++w) y += p[w * 16];
                    if (r) a.out1[0][row] = y;
                    else write_row(s, row, y);
                    if (a.choice && row < a.choice->n) best[r] = max(best[r], choice_key(y, row));
                }
            }
            __syncwarp();  // the partials are read before the stage is refilled
            if (lane == 0 && st + S < stages_total) fill(st + S);
        }
    } else {
        const int g0 = warp * gpr / RING_CONSUMERS, quads = gpr / (4 * RING_CONSUMERS);
        QuadX X[ROWS];
        const QuadLane L0 = quad_lane(K, g0);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (quads == 1) load_quad_x(xb8 + r * gpr * 8, gx + r * gpr, g0, X[r]);
#pragma unroll 1
        for (int st = 0; st < stages_total; ++st) {
            const int slot = st % S, tiles = min(RING_TILES, t1 - t0 - st * RING_TILES);
            mbar_wait(&full[slot], (st / S) & 1);
            // where the stream stands when warp 0 takes a stage (the lm_head's 4.38 TB/s alone,
            // bench/kernels/ring_requests.cu, against ~3.9 in the step)
            if (st == 0) step_phase(2);  // first stage in
            if (st == S) step_phase(3);  // first refilled stage in
            if (st == stages_total / 2) step_phase(4);  // half the run in
            if (st == stages_total - 1) step_phase(5);  // last stage in
#pragma unroll 1
            for (int j = 0; j < tiles; ++j) {
                const size_t i = (size_t)slot * RING_TILES + j;
                float yA[ROWS], yB[ROWS];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) yA[r] = yB[r] = 0.f;
                if (quads == 1) quad_dot_rows<ROWS>(codes + i * tile_codes, scales + i * tile_sb, biases + i * tile_sb, L0, X, yA, yB);
                else {
#pragma unroll 1
                    for (int qd = 0; qd < quads; ++qd) {
#pragma unroll
                        for (int r = 0; r < ROWS; ++r) load_quad_x(xb8 + r * gpr * 8, gx + r * gpr, g0 + 4 * qd, X[r]);
                        quad_dot_rows<ROWS>(codes + i * tile_codes, scales + i * tile_sb, biases + i * tile_sb,
                                            quad_lane(K, g0 + 4 * qd), X, yA, yB);
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; ++r) store_quad_sums(part + ((i * ROWS + r) * RING_CONSUMERS + warp) * 16, yA[r], yB[r]);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[slot]);
        }
        step_phase(6);  // warp 0's stages multiplied
    }
    if (a.choice) choose_token(a.choice, best[0], scratch);
    if (ROWS > 1 && a.choice1) choose_token(a.choice1, best[ROWS - 1], scratch);
}

extern "C" __global__ void __launch_bounds__((RING_CONSUMERS + 1) * 32, 1) gemv_q_ring(GemvArgs a) { gemv_ring_body<0>(a); }
// gemv_q_ring_k2048: K 2048 (the lm_head) compiled in: 93 registers instead of 102, 4K 735.5 ->
// 737.5 tok/s (bench/results/cuda-decode-shape-specialised-2.json)
extern "C" __global__ void __launch_bounds__((RING_CONSUMERS + 1) * 32, 1) gemv_q_ring_k2048(GemvArgs a) {
    gemv_ring_body<2048>(a);
}
// gemv_q_ring2_k2048: the lm_head of the speculative verify step's two rows in one stream of its
// weights (speculative.cu)
extern "C" __global__ void __launch_bounds__((RING_CONSUMERS + 1) * 32, 1) gemv_q_ring2_k2048(GemvArgs a) {
    gemv_ring_body<2048, 2>(a);
}

// gemv_q_pair: one segment of 4-bit group-64 rows at K 4096 (the GDN out_proj and the attention
// o_proj), prologue none or the per-head gated norm, added into its output (the residual; the
// host takes it for no other). Each 16-row tile is split over two blocks, block 2t + r taking
// K-half r of tile t: both bulk-copy the whole tile (one request per array; the second read of a
// line is an L2 hit), normalise only their half of x (the gated norm is per 128-wide head, so the
// halves are independent; a full-K RMSNorm would need the two sums of squares exchanged and is
// not taken here), multiply one quad per warp instead of two, and add their 16 sums into the
// output with float atomics (the two halves land in either order, as the experts' adds do).
// Grid: 2 blocks per tile, dynamic shared memory padded so that at most two blocks share an SM.
// The halves met through distributed shared memory before (a 2-block cluster, rank 1's sums
// stored into rank 0 behind a cluster barrier, rank 0 adding them in a fixed order): the barrier
// took ~0.8 us of the launch's ~4.6 in the 4K timeline; the atomics instead: 4K 858.0 -> 868.7
// tok/s, 32K 757.2 -> 764.9, 128K 537.5 -> 542.1 (bench/results/cuda-decode-session37-ablations.json;
// one block of 16 warps per tile over the whole K, no atomics: 830.4 at 4K).
// Measured (bench/kernels/gemv_pair.cu, chains of 30 launches, pdl): out_proj 6.42 -> 5.09 us
// against gemv_q_resident, o_proj 4.63 -> 3.71. The gated prologue with its loads in one round
// trip (gated_half_input): out_proj 144 -> 132 us a step in the graph, the step at 4K 619.9 ->
// 629.9 tok/s (bench/results/cuda-decode-early-loads-2.json).
#define PAIR_WARPS 8
// the only K it takes (decoder.rs PAIR_K), compiled in: 50 registers instead of 70, 4K 734.4 ->
// 737.5 tok/s (bench/results/cuda-decode-shape-specialised-2.json)
#define PAIR_K 4096

// The thread's 8 values of the head-norm weight, loaded before the wait (no kernel writes it; after
// it, a DRAM miss beside x's and z's L2 reads: 4K 891.6 -> 895.6 tok/s, 32K 781.3 -> 784.8, 128K
// 543.0 -> 544.4, bench/results/cuda-decode-session39-ablations.json).
// (slot_first_element's formula written out here and in gated_half_input: calling the helper gave
// gemv_q_pair 8 more instructions and the step -0.15% at 4K, session 40)
__device__ __forceinline__ void load_half_head_weight(const float* hw, int K, int head_dim, float4& h0, float4& h1) {
    const int idx = threadIdx.x, G = idx >> 3, T = (idx >> 2) & 1, q = idx & 3;
    const int e0 = idx < K / 8 ? G * 64 + 8 * (2 * q + T) : 0, he = e0 % head_dim;
    h0 = *reinterpret_cast<const float4*>(hw + he);
    h1 = *reinterpret_cast<const float4*>(hw + he + 4);
}

// The pair's gated prologue over its K half (one 8-element slot per thread: K/2 = 8 x 256): x and z
// requested together and unbranched, the head weight already in registers (resident_input's
// head-norm path asks for z and the weight only after x's sum of squares, one more round trip),
// then the per-head RMSNorm by shuffles among the head's head_dim/8 threads, gated by silu(z).
__device__ __forceinline__ void gated_half_input(const float* x, const float* z, const float4 h0, const float4 h1, float eps, int K,
                                                 int head_dim, uint4* xb8, float2* gx) {
    const int idx = threadIdx.x, G = idx >> 3, T = (idx >> 2) & 1, q = idx & 3;
    const bool on = idx < K / 8;
    const int e0 = on ? G * 64 + 8 * (2 * q + T) : 0;
    const float4 x0 = *reinterpret_cast<const float4*>(x + e0), x1 = *reinterpret_cast<const float4*>(x + e0 + 4);
    const float4 z0 = *reinterpret_cast<const float4*>(z + e0), z1 = *reinterpret_cast<const float4*>(z + e0 + 4);
    float v[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    const float zs[8] = {z0.x, z0.y, z0.z, z0.w, z1.x, z1.y, z1.z, z1.w};
    const float hs[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] *= hs[j] * siluf(zs[j]);
    for (int o = 1; o < head_dim / 8; o <<= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
    const float inv = rsqrtf(ss / head_dim + eps);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = on ? v[j] * inv : 0.f;
    write_slot(v, idx, on, xb8, gx);
}

// At most 48 registers (ptxas took 50, allocated 56: a warp's registers go 256 at a time, so a
// thread's in steps of 8; no spills at 48): 4K 849.9 -> 851.7 tok/s, 32K 752.2 -> 753.9, 128K
// 533.7 -> 534.0, every round above main's (bench/results/cuda-decode-session34-ablations.json;
// gemv_q_resident_k2048 held from 90 to 88 the same way: +-0)
// ROWS activation rows (1, or 2 for gemv_q_pair2: x and x1 (with gate_z1) added into the
// segment's out and out1[0]): the tile's codes unpacked once for both.
template <int ROWS>
__device__ __forceinline__ void gemv_pair_body(const GemvArgs& a) {
    extern __shared__ __align__(128) char smem[];
    const int K = PAIR_K, gpr = K / 64, half_g = gpr / 2, Kh = K / 2;
    const unsigned rank = blockIdx.x & 1;
    const Segment& s = a.seg[0];
    const int r0 = (blockIdx.x / 2) * 16, rows = min(16, s.rows - r0);
    char* codes = smem;  // [16][K/2 B], whole rows
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + 16 * (K / 2));  // [16][gpr]
    __nv_bfloat16* biases = scales + 16 * gpr;
    uint4* xb8 = reinterpret_cast<uint4*>(biases + 16 * gpr);  // this half's groups, [ROWS][half_g * 8]
    float2* gx = reinterpret_cast<float2*>(xb8 + ROWS * half_g * 8);  // [ROWS][half_g]
    float* scratch = reinterpret_cast<float*>(gx + ROWS * half_g);
    float* part = scratch + 32;  // [ROWS][warp][16]
    uint64_t* full = reinterpret_cast<uint64_t*>(part + ROWS * PAIR_WARPS * 16);
    step_overlap_begin();
    if (threadIdx.x == 0) {
        mbar_init(full, 1);
        mbar_init_fence();
    }
    // the barrier's initialisation published before the wait: warp w's 32 slots of x are the
    // groups of the quad it multiplies, so no block barrier follows x's prologue
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_bytes(full, q4_rows_bytes(rows, K));
        copy_q4_rows(codes, scales, biases, 0, s.codes, s.scales, s.biases, r0, rows, K, full);
    }
    float4 h0 = make_float4(0.f, 0.f, 0.f, 0.f), h1 = h0;
    if (a.head_norm) load_half_head_weight(a.head_norm, Kh, a.head_dim, h0, h1);
    step_inputs_ready();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float* x = (r ? a.x1 : a.x) + rank * Kh;
        if (a.head_norm)
            gated_half_input(x, (r ? a.gate_z1 : a.gate_z) + rank * Kh, h0, h1, a.eps, Kh, a.head_dim, xb8 + r * half_g * 8,
                             gx + r * half_g);
        else resident_input(XInput{x, nullptr, nullptr, nullptr, a.eps, Kh, 0}, xb8 + r * half_g * 8, gx + r * half_g, scratch);
    }
    __syncwarp();
    step_phase(2);  // x in (warp 0's)
    const int warp = threadIdx.x >> 5, quads = half_g / 4;
    float yA[ROWS], yB[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) yA[r] = yB[r] = 0.f;
    mbar_wait(full, 0);
    step_phase(3);  // tile in
    for (int qd = warp; qd < quads; qd += PAIR_WARPS) {
        QuadX X[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) load_quad_x(xb8 + r * half_g * 8, gx + r * half_g, 4 * qd, X[r]);
        step_phase_after(5, X[0].x[3][1].y);  // warp 0's x fragments in
        quad_dot_rows<ROWS>(codes, scales, biases, quad_lane(K, (int)rank * half_g + 4 * qd), X, yA, yB);
        step_phase_after(6, __float_as_uint(yB[0]));  // warp 0's quad product
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) store_quad_sums(part + (r * PAIR_WARPS + warp) * 16, yA[r], yB[r]);
    __syncthreads();
    step_phase(4);  // multiplied
    // thread 16 r + i adds row i of activation row r
    const int r = ROWS > 1 ? (int)threadIdx.x / 16 : 0, i = ROWS > 1 ? (int)threadIdx.x % 16 : (int)threadIdx.x;
    if (r < ROWS && i < rows) {
        float y = 0.f;
#pragma unroll
        for (int w = 0; w < PAIR_WARPS; ++w) y += part[(r * PAIR_WARPS + w) * 16 + i];
        atomicAdd((r ? a.out1[0] : s.out) + r0 + i, y);
    }
}

extern "C" __global__ void __maxnreg__(48) gemv_q_pair(GemvArgs a) { gemv_pair_body<1>(a); }
// gemv_q_pair2: the output projections of the speculative verify step's two rows in one launch
// (speculative.cu)
extern "C" __global__ void __maxnreg__(80) gemv_q_pair2(GemvArgs a) { gemv_pair_body<2>(a); }
