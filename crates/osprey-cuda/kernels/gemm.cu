// Quantised GEMM for prefill, on the tensor cores: C[p, n] = Σ_k A[p, k] · W[n, k] for a block of
// positions p (tokens, or the rows routed to one expert) and MLX affine 4- or 8-bit weight rows W.
// One kernel serves the dense projections (GDN in_proj / out_proj, attention q|k|v / o, shared
// expert, router) and the grouped expert GEMMs (rows grouped by expert on the GPU, route.cu).
//
// Data: A is bf16 in the perm64 order of common.cuh (written by act.cu and the epilogues here);
// W stays as stored (packed codes, bf16 scale and bias per group; never a dequantised copy).
// Per 64-element group a thread of an mma quad (lane % 4 = q) loads the code words 2q, 2q+1
// (4-bit; 4q..4q+3 at 8 bits) of its rows g and g+8, turns pairs of codes into bf16 with a shift,
// one LOP3 (0x4300 | code = 128 + code exactly), a subtract and one bf16 FMA with the group's
// scale and bias (one rounding per weight, as bf16 weights would have), and multiplies them by
// A fragments read as two 16-byte words from shared memory (the perm64 order makes the four
// k-tiles of a group contiguous per thread). fp32 accumulation.
//
// Geometry: 256 threads = 8 warps side by side along n; warp tile 32 weight rows (two 16-row mma
// tiles; in the SwiGLU epilogue the same 16 rows of gate and of up) x BM = 8·MT positions; block
// tile 256 (SwiGLU: 128) rows x BM positions. A tiles stream through a 3-stage cp.async ring;
// each warp's weight words for the next group are loaded while this group is multiplied.
// Grid: x = column blocks, y = position tiles (dense) or tile slots of the grouped plan (route.cu
// writes (expert, first position, end) per slot and the number used; spare slots exit).
// Epilogues: store f32, add into f32 (residual), SwiGLU to bf16 perm64 (expert and shared
// gate/up), times a per-row routing weight to bf16 (expert down, as a bf16 model's expert output is;
// the combine adds a token's eight in fp32). Dense launches too small to
// fill the GPU (short prompts, the router) split K over grid z into partial sums that
// gemm_reduce adds in a fixed order.
// Ceiling: bf16 dense mma ~790 TFLOP/s measured (gpu.md); mma.sync reaches about 2/3 of it.
// gemm_q4_wgmma (bottom of the file) takes the launches with whole 128-position tiles (dense
// projections from 128 positions, the routed gate/up and down from 48 rows per expert): warpgroup
// MMA from shared memory, each weight dequantised once per block into shared memory.
// Measured (H200, 4K prompt, full-size model): GDN in_proj (30 layers) 31.0 ms on mma.sync (200
// TFLOP/s) -> 23.4 ms with gemm_q4_wgmma fed by cp.async -> 22.2 with TMA copies -> 15.4 with the
// epilogue staged through shared memory (bench/results/cuda-prefill-tma-epilogue.json). What
// limited it, taken apart in bench/kernels/wgmma_layout.cu (the loop alone, operands in L2, clocks
// per 64-wide K group: wgmma alone 1,137, with the dequantisation 1,662, with per-thread cp.async
// copies 2,866, with TMA copies 1,825) and bench/kernels/gemm_wgmma.cu (the whole kernel on
// in_proj's shape: 3,267 clocks per group and block against 2,245 on one long-K wave: each
// block's epilogue of 128 scattered 4-byte stores per thread, all blocks of a wave at once, cost
// ~16 us per block; staged, 2,301 clocks, 462 TFLOP/s). Routed gate/up 31.5 -> 17.9 ms over 40
// layers (tiles as wide as their rows: n32..n128, bench/results/cuda-prefill-tile-width.json; an
// expert's last <= 32 rows joined to its last full tile, 20.0 -> 17.9,
// cuda-prefill-grouped-tail.json); the routed down projection (K = 512, 8 groups a block) moved
// from mma.sync (16.4 ms) to gemm_q4_wgmma (12.3, with the tails 11.3) once the epilogue was staged.
// Dropped: a mma.sync kernel with ldmatrix and shared-memory dequantisation (256 x 128 tiles,
// 28.1 ms on in_proj); producer/consumer warpgroups over named barriers (15-25%
// slower, commit 201c26b); the weights as wgmma's A operand from registers (in_proj 26.5 vs 23.9
// ms, commit 0c8bd67).
#include "common.cuh"
#include "wgmma.cuh"

#define GEMM_WARPS 8
#define A_STRIDE 72  // bf16 per shared row: 64 + 8 padding (144 bytes: conflict-free 16-byte reads)
#define STAGES 3

#define EPI_STORE 0
#define EPI_ADD 1
#define EPI_SWIGLU 2
#define EPI_SCALED 3

struct GemmArgs {
    const __nv_bfloat16* a;        // [positions or tokens, K] bf16, perm64 order
    const int* a_rows;             // A row of each position (null: the position itself)
    const uint32_t* codes[2];      // [1]: the up projection (EPI_SWIGLU)
    const __nv_bfloat16* scales[2];
    const __nv_bfloat16* biases[2];
    long long expert_rows;         // rows between consecutive experts of a stack (0: dense)
    const int4* tiles;             // grouped plan: (expert, first position, end, _) per slot
    const int* tile_count;
    float* out;                    // [positions, ldo] f32
    __nv_bfloat16* out_h;          // EPI_SWIGLU: [positions, N] bf16 perm64; EPI_SCALED: [positions, ldo] bf16
    const float* row_scale;        // EPI_SCALED: routing weight per position
    int M;                         // dense: positions
    int N, K, group, ldo, epilogue;
    int k_splits;                  // > 1: split-K, block z writes partial sums to out + z·M·ldo
    int _pad;
};


// A weight row's codes for one group, as this thread needs them.
template <int BITS> struct Codes;
template <> struct Codes<4> { uint2 w; };
template <> struct Codes<8> { uint4 w; };

template <int BITS>
struct WeightRegs {
    Codes<BITS> c[2][2];  // [tile][row half]
    __nv_bfloat16 s[2][2], b[2][2];
};

template <int BITS>
__device__ __forceinline__ void load_weights(WeightRegs<BITS>& W, const uint32_t* const (&row)[2][2],
                                             const __nv_bfloat16* const (&srow)[2][2], const __nv_bfloat16* const (&brow)[2][2],
                                             int G, int q, int group_shift) {
    // unsigned offsets: no sign extension in the 64-bit address arithmetic; group sizes are powers
    // of two (32, 64, 128)
    const unsigned gi = (unsigned)(G * 64 + 16 * q) >> group_shift, word = (unsigned)G * (BITS * 2) + (unsigned)q * (BITS / 2);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if constexpr (BITS == 4) W.c[i][r].w = __ldg(reinterpret_cast<const uint2*>(row[i][r] + word));
            else W.c[i][r].w = __ldg(reinterpret_cast<const uint4*>(row[i][r] + word));
            W.s[i][r] = srow[i][r][gi];
            W.b[i][r] = brow[i][r][gi];
        }
}

__device__ __forceinline__ uint32_t dequant_pair4(uint32_t v, __nv_bfloat162 s, __nv_bfloat162 b) {
    // (v & 0x000F000F) | 0x43004300 as one LOP3 (written as C, the compiler emits an AND and an OR)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(v) : "r"(v), "r"(0x000F000Fu), "r"(0x43004300u));
    __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162*>(&v);
    x = __hfma2(__hsub2(x, __float2bfloat162_rn(128.f)), s, b);
    return *reinterpret_cast<uint32_t*>(&x);
}

// A fragment halves of k-tile t for one row: lo = (elements j 0,1), hi = (j 2,3) in perm64 terms.
template <int BITS>
__device__ __forceinline__ void dequant_row(const WeightRegs<BITS>& W, int i, int r, int t, uint32_t& lo, uint32_t& hi) {
    const int sh = (t & 1) * 2;
    if constexpr (BITS == 4) {
        const uint32_t wv = (t >> 1) ? W.c[i][r].w.y : W.c[i][r].w.x;
        const __nv_bfloat162 s = __bfloat162bfloat162(W.s[i][r]), b = __bfloat162bfloat162(W.b[i][r]);
        lo = dequant_pair4(wv >> (4 * sh), s, b);
        hi = dequant_pair4(wv >> (4 * sh + 4), s, b);
    } else {
        const uint32_t w0 = (t >> 1) ? W.c[i][r].w.z : W.c[i][r].w.x;
        const uint32_t w1 = (t >> 1) ? W.c[i][r].w.w : W.c[i][r].w.y;
        const float s = __bfloat162float(W.s[i][r]), b = __bfloat162float(W.b[i][r]);
        lo = pack_bf16(fmaf(byte_code(w0, sh), s, b), fmaf(byte_code(w1, sh), s, b));
        hi = pack_bf16(fmaf(byte_code(w0, sh + 1), s, b), fmaf(byte_code(w1, sh + 1), s, b));
    }
}

// mma.sync epilogues: output n at position pos stored or added into the f32 output (residual); a
// split-K block z writes its partial sums to slice z.
__device__ __forceinline__ void store_result(const GemmArgs& p, int pos, int n, float v) {
    float* o = p.out + (size_t)blockIdx.z * p.M * p.ldo + (size_t)pos * p.ldo + n;
    if (p.epilogue == EPI_ADD) *o += v;
    else *o = v;
}
// SwiGLU: silu(gate) · up of output n at position pos, bf16 in the perm64 order.
__device__ __forceinline__ void store_swiglu(const GemmArgs& p, int pos, int n, float gate, float up) {
    p.out_h[(size_t)pos * p.N + perm64(n)] = __float2bfloat16(siluf(gate) * up);
}

// This block's positions [m0, m_end) and expert: slot blockIdx.y of the grouped plan, or tile
// blockIdx.y of `bm` positions of a dense launch. False for a spare slot of the plan.
__device__ __forceinline__ bool block_positions(const GemmArgs& p, int bm, int& expert, int& m0, int& m_end) {
    if (p.tiles) {
        if ((int)blockIdx.y >= *p.tile_count) return false;
        const int4 t = p.tiles[blockIdx.y];
        expert = t.x;
        m0 = t.y;
        m_end = t.z;
    } else {
        expert = 0;
        m0 = blockIdx.y * bm;
        m_end = p.M;
    }
    return true;
}

template <int BITS, int MT>
__device__ __forceinline__ void gemm_body(const GemmArgs& p) {
    constexpr int BM = MT * 8;
    __shared__ __align__(16) __nv_bfloat16 As[STAGES][BM][A_STRIDE];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const bool swiglu = p.epilogue == EPI_SWIGLU;

    int expert, m0, m_end;
    if (!block_positions(p, BM, expert, m0, m_end)) return;

    const int K = p.K;
    // this block's share of the K groups (all of them unless split-K)
    const int g_begin = K / 64 * blockIdx.z / p.k_splits, groups = K / 64 * (blockIdx.z + 1) / p.k_splits - g_begin;
    const int wpr = K * BITS / 32, spr = K / p.group, group_shift = __ffs(p.group) - 1;
    const int n_base = blockIdx.x * GEMM_WARPS * (swiglu ? 16 : 32) + warp * (swiglu ? 16 : 32);
    const uint32_t* row[2][2];
    const __nv_bfloat16* srow[2][2];
    const __nv_bfloat16* brow[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int n = min(swiglu ? n_base + r * 8 + g : n_base + i * 16 + r * 8 + g, p.N - 1);
            const size_t rr = (size_t)expert * p.expert_rows + n;
            const int mi = swiglu ? i : 0;
            row[i][r] = p.codes[mi] + rr * wpr;
            srow[i][r] = p.scales[mi] + rr * spr;
            brow[i][r] = p.biases[mi] + rr * spr;
        }

    // A rows this thread copies: BM rows x 8 chunks of 16 bytes per group
    constexpr int CHUNKS = BM * 8, PER_THREAD = (CHUNKS + 255) / 256;
    const __nv_bfloat16* src[PER_THREAD];
    bool valid[PER_THREAD];
#pragma unroll
    for (int c = 0; c < PER_THREAD; ++c) {
        const int chunk = tid + 256 * c, rr = chunk >> 3, pos = m0 + rr;
        valid[c] = chunk < CHUNKS && pos < m_end;
        const int arow = valid[c] ? (p.a_rows ? p.a_rows[pos] : pos) : 0;
        src[c] = p.a + (size_t)arow * K + (size_t)g_begin * 64 + (chunk & 7) * 8;
    }
    auto load_a = [&](int G, int slot) {
#pragma unroll
        for (int c = 0; c < PER_THREAD; ++c) {
            const int chunk = tid + 256 * c;
            if (chunk < CHUNKS) cp_async16(&As[slot][chunk >> 3][(chunk & 7) * 8], src[c] + G * 64, valid[c]);
        }
    };

    float acc[2][MT][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < groups) load_a(s, s);
        cp_async_commit();
    }
    // group G multiplied with `use` while `fill` receives group G + 1; the two swap roles each
    // group, so no register copy waits for a load still in flight
    auto step = [&](const WeightRegs<BITS>& use, WeightRegs<BITS>& fill, int G) {
        if (G + 1 < groups) load_weights<BITS>(fill, row, srow, brow, g_begin + G + 1, q, group_shift);
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (G + STAGES - 1 < groups) load_a(G + STAGES - 1, (G + STAGES - 1) % STAGES);
        cp_async_commit();
        const int slot = G % STAGES;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            uint4 bf[MT];
#pragma unroll
            for (int j = 0; j < MT; ++j) bf[j] = reinterpret_cast<const uint4*>(&As[slot][j * 8 + g][q * 16])[half];
#pragma unroll
            for (int tt = 0; tt < 2; ++tt) {
                const int t = half * 2 + tt;
                uint32_t af[2][4];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    dequant_row<BITS>(use, i, 0, t, af[i][0], af[i][2]);
                    dequant_row<BITS>(use, i, 1, t, af[i][1], af[i][3]);
                }
#pragma unroll
                for (int j = 0; j < MT; ++j) {
                    const uint32_t b0 = tt ? bf[j].z : bf[j].x, b1 = tt ? bf[j].w : bf[j].y;
#pragma unroll
                    for (int i = 0; i < 2; ++i) mma_bf16(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], b0, b1);
                }
            }
        }
    };
    WeightRegs<BITS> w0, w1;
    load_weights<BITS>(w0, row, srow, brow, g_begin, q, group_shift);
    for (int G = 0; G < groups; G += 2) {
        step(w0, w1, G);
        if (G + 1 < groups) step(w1, w0, G + 1);
    }
    cp_async_wait<0>();

    // epilogue: acc[i][j][e] is weight row (g + 8·(e/2)) of tile i, position 2q + e%2 of m-tile j
    if (p.epilogue == EPI_SCALED) {
        // bf16 pairs of neighbouring outputs: lanes g and g ^ 1 swap one value each, so the even
        // lane stores both rows at position 2q and the odd lane both at 2q + 1 (one 4-byte store
        // instead of two 2-byte ones; N even)
        const bool odd = g & 1;
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int eh = 0; eh < 2; ++eh)
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const float v0 = acc[i][j][2 * eh], v1 = acc[i][j][2 * eh + 1];
                    const float recv = __shfl_xor_sync(FULL_MASK, odd ? v0 : v1, 4);
                    const int pos = m0 + j * 8 + 2 * q + odd, n = n_base + i * 16 + eh * 8 + (g & ~1);
                    if (pos >= m_end || n >= p.N) continue;
                    const float w = p.row_scale[pos];
                    *reinterpret_cast<__nv_bfloat162*>(p.out_h + (size_t)pos * p.ldo + n) =
                        __floats2bfloat162_rn((odd ? recv : v0) * w, (odd ? v1 : recv) * w);
                }
        return;
    }
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int pos = m0 + j * 8 + 2 * q + (e & 1);
            if (pos >= m_end) continue;
            if (swiglu) {
                const int n = n_base + (e >> 1) * 8 + g;
                if (n < p.N) store_swiglu(p, pos, n, acc[0][j][e], acc[1][j][e]);
                continue;
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int n = n_base + i * 16 + (e >> 1) * 8 + g;
                if (n >= p.N) continue;
                store_result(p, pos, n, acc[i][j][e]);
            }
        }
}

struct ReduceArgs {
    const float* partials;  // [splits, M, N]
    float* out;             // [M, ldo]
    int M, N, ldo, splits, add;
};

// Split-K epilogue: the partial sums in a fixed order (deterministic), stored or added.
extern "C" __global__ void gemm_reduce(ReduceArgs r) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, mn = (size_t)r.M * r.N;
    if (i >= mn) return;
    float v = 0.f;
    for (int z = 0; z < r.splits; ++z) v += r.partials[z * mn + i];
    float* o = r.out + (i / r.N) * r.ldo + i % r.N;
    *o = r.add ? *o + v : v;
}

// MT = 8 needs more than 128 registers (64 accumulators): one block per SM, no spills.
#define GEMM_KERNEL(BITS, MT, BLOCKS)                                                             \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS) gemm_q##BITS##_m##MT(GemmArgs p) { \
        gemm_body<BITS, MT>(p);                                                                  \
    }

GEMM_KERNEL(4, 2, 2)
GEMM_KERNEL(4, 4, 2)
GEMM_KERNEL(4, 8, 1)
GEMM_KERNEL(8, 2, 2)
GEMM_KERNEL(8, 8, 1)

// ---- warpgroup MMA: dequantised weights and activations from shared memory -----------------------
// gemm_q4_wgmma: 4-bit group-64 weights, block = 2 warpgroups, 256 weight rows x 128 positions;
// warpgroup wg multiplies its 128 weight rows (two m64 halves) by all 128 positions with wgmma
// m64n128k16, both operands from shared memory in the K-major layout: the weights without swizzle
// (core column kc = 8 k's of the group at kc · rows · 16 bytes, row r at r · 16; thread r
// dequantises block row r per group into it, one 16-byte store per code word, perm64 order = the
// activations' storage order, so the dot products are unchanged), the activations as rows of 128
// bytes with the 128-byte swizzle (16-byte chunk c of position p at p · 128 + (c ^ p % 8) · 16).
// Copies by the tensor memory accelerator (TMA; 2-D tensor maps built on the host per launch):
// per group the block's code words (256 rows x 32 bytes), every 8th group 8 groups' scales and
// biases (256 x 16 bytes each), and for dense launches the activations (128 positions x 128
// bytes, swizzled by the copy); thread 0 issues them, an mbarrier per ring slot counts their bytes.
// Grouped launches gather their positions' activations (a_rows), which a tensor map cannot:
// every thread copies 4 chunks of 16 bytes by cp.async into the same swizzled layout.
// Grouped tiles hold up to 160 positions: route_plan joins an expert's last <= 32 rows to its last
// full tile (a 4K prompt routes 128 ± 11 rows per expert: without it about half the experts spent
// a whole block, dequantisation included, on a few rows); those 32 take a second wgmma (n32) into
// their own accumulators, their activations a second tensor map of 32-position boxes.
// Why TMA: per-thread cp.async copies of the same bytes cost ~1,200 of ~2,870 clocks per group
// (bench/kernels/wgmma_layout.cu: the loop alone, operands in L2: wgmma only 1,137 clocks, with
// the dequantisation 1,662, with cp.async copies 2,866, with TMA copies 1,825, with TMA for the
// weights and cp.async for the activations 2,106).
// Why 256 rows: every block re-reads its 128 positions' activations from L2 for each group, so the
// L2 traffic per FLOP falls with the rows per block (measured with 128 rows: L2 75% busy, 2.5 GB
// read for one 137 GFLOP in_proj launch, slower than mma.sync).
// Step G: wait for ring slot G + 1 (activations, codes; a 5-slot ring three groups ahead; scales
// and biases 8 groups at a time in two more buffers), issue group G's wgmma on weight buffer
// G % 2, retire group G - 1's, dequantise group G + 1 into the buffer those read; group G's wgmma
// run on through the next step's barrier and copies.
// SwiGLU: the block's 256 rows are 128 gate + 128 up rows; each 16-row group of a warp holds 8 gate
// rows (g) and the up rows of the same outputs (g + 8), so both land in one thread; the copies
// bring 128 rows of each matrix ([matrix][128 rows] in shared memory).
// Split-K (dense launches of too few blocks, f32 epilogues only): block z takes K groups
// [z, z + 1) · K / 64 / k_splits, a whole number of 8-group scale batches, and writes partial sums.
// Needs N % 256 == 0 (SwiGLU: % 128), K % 512 == 0, group 64.
#define WG_POS 128
#define WG_TAIL 32  // positions a grouped tile may take past WG_POS: an expert's last few rows
#define WG_ROWS 256
#define WG_SLOTS 5  // groups G - 1 (wgmma in flight), G, G + 1, G + 2, G + 3
#define WG_AHEAD 3
#define WG_X_BYTES ((WG_POS + WG_TAIL) * 128)
#define WG_CODE_BYTES (WG_ROWS * 32)
#define WG_SB_BYTES (WG_ROWS * 32)
#define WG_W_BYTES (WG_ROWS * 128)
#define WG_OUT_STRIDE (WG_ROWS + 4)  // f32 per position of the epilogue's tile (no bank conflicts)
#define WG_OUT_H_STRIDE (128 + 8)    // bf16 per position of the SwiGLU epilogue's tile
#define WG_SMEM_BYTES (WG_SLOTS * (WG_X_BYTES + WG_CODE_BYTES + 8) + 2 * WG_SB_BYTES + 2 * WG_W_BYTES)

// gemm_q4_wgmma's parameters: the GEMM's, and the tensor maps its copies read through.
struct WgmmaArgs {
    GemmArgs p;
    TensorMap x;          // activations [positions, K] bf16, box 64 x 128, 128-byte swizzle (not gathered)
    TensorMap x_tail;     // the same, box 64 x 32 (a grouped tile's positions past 128)
    TensorMap codes[2];   // [rows, K / 8] words, box 8 x 256 (SwiGLU: 8 x 128 of each matrix)
    TensorMap scales[2];  // [rows, K / 64] bf16, box 8 x 256 (SwiGLU: 8 x 128)
    TensorMap biases[2];
};

// gemm_q4_wgmma's dequantisation: group G of block row `row` into weight buffer G % 2 (K-major
// core-matrix layout, perm64 order), from the row `src` of the copies: code words in ring slot
// `slot` of Cs ([slot][256 rows][2 halves] uint4), scale and bias from the 8-group buffer of SBs
// ([2][scale, bias][256 rows] uint4).
__device__ __forceinline__ void wgmma_dequant_row(int G, int slot, const uint4* Cs, const uint4* SBs, unsigned char* Ws,
                                                  int row, int src) {
    const uint4* sb = SBs + ((G >> 3) & 1) * 2 * WG_ROWS + src;
    const uint32_t sw = reinterpret_cast<const uint32_t*>(sb)[(G & 7) >> 1];
    const uint32_t bw = reinterpret_cast<const uint32_t*>(sb + WG_ROWS)[(G & 7) >> 1];
    const int hi = (G & 1) * 16;
    const __nv_bfloat16_raw sr{(unsigned short)(sw >> hi)}, br{(unsigned short)(bw >> hi)};
    const __nv_bfloat162 s = __bfloat162bfloat162(__nv_bfloat16(sr)), b = __bfloat162bfloat162(__nv_bfloat16(br));
    unsigned char* dst = Ws + (G & 1) * WG_W_BYTES + row * 16;
    // rows 32 bytes apart: lanes 4..7 of each 8 read their second half first (no bank conflict)
    const int first = (src >> 2) & 1;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int h = hh ^ first;
        const uint4 c = Cs[(slot * WG_ROWS + src) * 2 + h];
        const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
            *reinterpret_cast<uint4*>(dst + (4 * h + i) * (WG_ROWS * 16)) =
                make_uint4(dequant_pair4(w[i], s, b), dequant_pair4(w[i] >> 4, s, b), dequant_pair4(w[i] >> 8, s, b),
                           dequant_pair4(w[i] >> 12, s, b));
    }
}

// One group (4 k16 steps) of a warpgroup's wgmma, committed as one batch: its 128 weight rows at W
// (two m64 halves, accumulators d[0], d[1]; core-matrix layout) by the first N positions at X
// (swizzled rows) and, with TAIL, positions 128..159 into t[0], t[1]; the first group overwrites
// the accumulators.
template <int N, bool TAIL>
__device__ __forceinline__ void wgmma_issue_group(float (&d)[2][64], float (&t)[2][16], const unsigned char* W,
                                                  const unsigned char* X, bool first) {
    fence_accumulators(d[0]);
    fence_accumulators(d[1]);
    if constexpr (TAIL) {
        fence_accumulators(t[0]);
        fence_accumulators(t[1]);
    }
    wgmma_fence();
#pragma unroll
    for (int s4 = 0; s4 < 4; ++s4) {
        const uint64_t db = wg_desc_sw128(X + 32 * s4), dt = wg_desc_sw128(X + WG_POS * 128 + 32 * s4);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const uint64_t da = wg_desc(W + 2 * s4 * (WG_ROWS * 16) + m * 64 * 16, WG_ROWS * 16, 128);
            wgmma_ss<N>(d[m], da, db, !first || s4 > 0);
            if constexpr (TAIL) wgmma_ss<32>(t[m], da, dt, !first || s4 > 0);
        }
    }
    wgmma_commit();
    fence_accumulators(d[0]);
    fence_accumulators(d[1]);
    if constexpr (TAIL) {
        fence_accumulators(t[0]);
        fence_accumulators(t[1]);
    }
}

template <int N> struct TileWidth { static constexpr int value = N; };

extern "C" __global__ void __launch_bounds__(256, 1) gemm_q4_wgmma(const __grid_constant__ WgmmaArgs args) {
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    const GemmArgs& p = args.p;
    unsigned char* Xs = wg_smem;                                                   // [slot][160 pos][128 B], swizzled
    uint4* Cs = reinterpret_cast<uint4*>(wg_smem + WG_SLOTS * WG_X_BYTES);         // [slot][256 rows][2 halves]
    uint4* SBs = reinterpret_cast<uint4*>(wg_smem + WG_SLOTS * (WG_X_BYTES + WG_CODE_BYTES));  // [2][scale, bias][256 rows]: 8 groups
    unsigned char* Ws = wg_smem + WG_SLOTS * (WG_X_BYTES + WG_CODE_BYTES) + 2 * WG_SB_BYTES;  // [2][8 kc][256 rows][16 B]
    uint64_t* landed = reinterpret_cast<uint64_t*>(Ws + 2 * WG_W_BYTES);          // [slot]: the slot's TMA bytes arrived
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wg = warp >> 2;
    const bool swiglu = p.epilogue == EPI_SWIGLU;
    const bool gather = p.a_rows != nullptr;

    int expert, m0, m_end;
    if (!block_positions(p, WG_POS, expert, m0, m_end)) return;
    if (tid == 0) {
        for (int i = 0; i < WG_SLOTS; ++i) mbar_init(&landed[i], 1);
        mbar_init_fence();
    }
    // this block's share of the K groups: all of them, or 1/k_splits (whole 8-group batches)
    const int groups = p.K / 64 / p.k_splits, g_begin = groups * blockIdx.z;
    // the block's first weight row in each matrix; block row r's copy row (SwiGLU: [matrix][128])
    const int row0 = expert * (int)p.expert_rows + (int)blockIdx.x * (swiglu ? 128 : WG_ROWS);
    const int src_row = swiglu ? ((tid & 15) >> 3) * 128 + 8 * (tid >> 4) + (tid & 7) : tid;

    // a grouped tile holds an expert's rows from m0: up to 128, or up to 160 when the plan merged
    // the expert's last few rows into its last tile (route_plan's tail)
    const int rows_out = min(m_end - m0, p.tiles && m_end - m0 <= WG_POS + WG_TAIL ? WG_POS + WG_TAIL : WG_POS);
    const bool tail = rows_out > WG_POS;
    const __nv_bfloat16* src[5];
#pragma unroll
    for (int c = 0; c < 5; ++c) {
        const int chunk = tid + 256 * c, r = chunk >> 3, pos = m0 + r;
        const bool valid = pos < m_end;
        src[c] = gather ? p.a + (size_t)(valid ? p.a_rows[pos] : 0) * p.K + (size_t)g_begin * 64 + (chunk & 7) * 8 : nullptr;
    }
    // group G's copies into its ring slot: TMA for the weights (and activations not gathered),
    // cp.async for gathered activations (positions 32c.. for c < quarters)
    auto load_stage = [&](int G, int quarters) {
        if (G < groups) {
            const int slot = G % WG_SLOTS, k = g_begin + G;
            if (tid == 0) {
                const bool sb = (G & 7) == 0;
                const int x_bytes = gather ? 0 : (tail ? WG_POS + WG_TAIL : WG_POS) * 128;
                mbar_arrive_expect_bytes(&landed[slot], x_bytes + WG_CODE_BYTES + (sb ? WG_SB_BYTES : 0));
                if (!gather) tma_load_2d(Xs + slot * WG_X_BYTES, &args.x, k * 64, m0, &landed[slot]);
                if (!gather && tail)
                    tma_load_2d(Xs + slot * WG_X_BYTES + WG_POS * 128, &args.x_tail, k * 64, m0 + WG_POS, &landed[slot]);
                uint4* sbs = SBs + ((G >> 3) & 1) * 2 * WG_ROWS;
                for (int mat = 0; mat < (swiglu ? 2 : 1); ++mat) {
                    const int r = mat * 128;
                    tma_load_2d(Cs + (slot * WG_ROWS + r) * 2, &args.codes[mat], k * 8, row0, &landed[slot]);
                    if (sb) {
                        tma_load_2d(sbs + r, &args.scales[mat], k, row0, &landed[slot]);
                        tma_load_2d(sbs + WG_ROWS + r, &args.biases[mat], k, row0, &landed[slot]);
                    }
                }
            }
            if (gather) {
#pragma unroll
                for (int c = 0; c < 5; ++c) {
                    const int chunk = tid + 256 * c, pos = chunk >> 3;
                    if (c < quarters)
                        cp_async16(Xs + slot * WG_X_BYTES + pos * 128 + (((chunk & 7) ^ (pos & 7)) << 4), src[c] + G * 64,
                                   m0 + pos < m_end);
                }
            }
        }
        cp_async_commit();
    };
    auto wait_stage = [&](int G) { mbar_wait(&landed[G % WG_SLOTS], (G / WG_SLOTS) & 1); };
    // group G of block row tid into weight buffer G % 2
    auto dequant = [&](int G) { wgmma_dequant_row(G, G % WG_SLOTS, Cs, SBs, Ws, tid, src_row); };
    float d[2][64];  // the first wgmma overwrites them (no zeroing: a register written outside
                     // wgmma between them serialises the pipeline)
    float dt[2][16];  // positions 128..159 of a tile with a tail

    // the K loop for a tile whose positions fit in the first N (wgmma n32, n64, n96 or n128; 160:
    // n128 and the tail's n32): only those positions' activations are gathered and multiplied
    auto k_loop = [&](auto width) {
        constexpr int N = decltype(width)::value;
        constexpr bool TAIL = N > WG_POS;
        __syncthreads();  // the barriers' initialisation
#pragma unroll
        for (int G = 0; G < WG_AHEAD; ++G) load_stage(G, N / 32);
        cp_async_wait<WG_AHEAD - 1>();
        wait_stage(0);
        __syncthreads();
        dequant(0);
        for (int G = 0; G < groups; ++G) {
            // slot G + 1 landed, everyone's copies and weight stores visible; every warpgroup has
            // retired wgmma(G - 2), so slot G + 3 (= G - 2) is free
            cp_async_wait<WG_AHEAD - 2>();
            if (G + 1 < groups) wait_stage(G + 1);
            fence_proxy_async();
            __syncthreads();
            load_stage(G + WG_AHEAD, N / 32);
            const unsigned char* W = Ws + (G & 1) * WG_W_BYTES + wg * 128 * 16;
            const unsigned char* X = Xs + (G % WG_SLOTS) * WG_X_BYTES;
            wgmma_issue_group<TAIL ? WG_POS : N, TAIL>(d, dt, W, X, G == 0);
            // wgmma(G - 1) retired: its weight buffer takes group G + 1 while wgmma(G) runs on
            wgmma_wait<1>();
            if (G + 1 < groups) dequant(G + 1);
        }
        wgmma_wait<0>();
        fence_accumulators(d[0]);
        fence_accumulators(d[1]);
        if constexpr (TAIL) {
            fence_accumulators(dt[0]);
            fence_accumulators(dt[1]);
        }
        cp_async_wait<0>();
    };
    // an expert's last tile often holds a few rows: the MMA as wide as the tile's rows
    const int width = (rows_out + 31) / 32;
    if (width == 5) k_loop(TileWidth<160>{});
    else if (width == 4) k_loop(TileWidth<128>{});
    else if (width == 3) k_loop(TileWidth<96>{});
    else if (width == 2) k_loop(TileWidth<64>{});
    else k_loop(TileWidth<32>{});

    // epilogue through shared memory (the ring is free once every wgmma has retired): the tile as
    // [positions][256 rows + 4] f32 (SwiGLU: 128 outputs, bf16 in perm64 order), then whole rows
    // to global memory in 16-byte pieces; an added output's loads all issued before its stores
    __syncthreads();
    float* tile = reinterpret_cast<float*>(wg_smem);
    __nv_bfloat16* tile_h = reinterpret_cast<__nv_bfloat16*>(wg_smem);
    // accumulators e and e + 2 of block row wrow at position pos: rows wrow and wrow + 8, or
    // SwiGLU's gate and up of one output
    auto stage = [&](int pos, int wrow, float a0, float a1) {
        if (swiglu) {
            tile_h[pos * WG_OUT_H_STRIDE + perm64(8 * (wrow >> 4) + g)] = __float2bfloat16(siluf(a0) * a1);
        } else {
            tile[pos * WG_OUT_STRIDE + wrow] = a0;
            tile[pos * WG_OUT_STRIDE + wrow + 8] = a1;
        }
    };
    // d[m][4j + 2h + e]: block row 128·wg + 64·m + 16·(warp % 4) + g + 8h, position 8j + 2q + e
    // (dt: position 128 + 8j + 2q + e)
#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const int wrow = 128 * wg + 64 * m + 16 * (warp & 3) + g;
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) stage(8 * j + 2 * q + e, wrow, d[m][4 * j + e], d[m][4 * j + 2 + e]);
        if (!tail) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) stage(WG_POS + 8 * j + 2 * q + e, wrow, dt[m][4 * j + e], dt[m][4 * j + 2 + e]);
    }
    __syncthreads();
    if (swiglu) {
        // 128 bf16 = 16 pieces per position: a warp takes two positions per pass
        const int n0 = blockIdx.x * 128;
        for (int r = warp * 2 + (lane >> 4); r < rows_out; r += 16) {
            const uint4 v = *reinterpret_cast<const uint4*>(tile_h + r * WG_OUT_H_STRIDE + (lane & 15) * 8);
            *reinterpret_cast<uint4*>(p.out_h + (size_t)(m0 + r) * p.N + n0 + (lane & 15) * 8) = v;
        }
        return;
    }
    // 256 f32 = 64 pieces per position: lane l takes pieces l and l + 32 of the warp's positions
    const int n0 = blockIdx.x * WG_ROWS;
    constexpr int BATCH = 8;  // positions per warp and batch
    for (int r0 = warp * BATCH; r0 < rows_out; r0 += GEMM_WARPS * BATCH) {
        float4 v[BATCH][2];
#pragma unroll
        for (int b = 0; b < BATCH; ++b)
#pragma unroll
            for (int c = 0; c < 2; ++c)
                v[b][c] = *reinterpret_cast<const float4*>(tile + (r0 + b) * WG_OUT_STRIDE + (lane + 32 * c) * 4);
        if (p.epilogue == EPI_ADD) {
            float4 o[BATCH][2];
#pragma unroll
            for (int b = 0; b < BATCH; ++b)
#pragma unroll
                for (int c = 0; c < 2; ++c)
                    o[b][c] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int b = 0; b < BATCH; ++b)
#pragma unroll
                for (int c = 0; c < 2; ++c)
                    if (r0 + b < rows_out)
                        o[b][c] = *reinterpret_cast<const float4*>(p.out + (size_t)(m0 + r0 + b) * p.ldo + n0 + (lane + 32 * c) * 4);
#pragma unroll
            for (int b = 0; b < BATCH; ++b)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    v[b][c].x += o[b][c].x;
                    v[b][c].y += o[b][c].y;
                    v[b][c].z += o[b][c].z;
                    v[b][c].w += o[b][c].w;
                }
        }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int pos = m0 + r0 + b;
            if (r0 + b >= rows_out) break;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int n = n0 + (lane + 32 * c) * 4;
                if (p.epilogue == EPI_SCALED) {
                    const float w = p.row_scale[pos];
                    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(p.out_h + (size_t)pos * p.ldo + n);
                    o[0] = __floats2bfloat162_rn(v[b][c].x * w, v[b][c].y * w);
                    o[1] = __floats2bfloat162_rn(v[b][c].z * w, v[b][c].w * w);
                } else {
                    *reinterpret_cast<float4*>(p.out + (size_t)blockIdx.z * p.M * p.ldo + (size_t)pos * p.ldo + n) = v[b][c];
                }
            }
        }
    }
}
