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
// gate/up), store f32 times a per-row routing weight (expert down). Dense launches too small to
// fill the GPU (short prompts, the router) split K over grid z into partial sums that
// gemm_reduce adds in a fixed order.
// Ceiling: bf16 dense mma ~790 TFLOP/s measured (gpu.md); mma.sync reaches about 2/3 of it.
// Measured (H200, commit 7bf2668, 4K prompt, full-size model): routed experts 8.25 TFLOP in
// 51.5 ms = 160 TFLOP/s (20%); GDN in_proj 6.2 TFLOP in 30.6 ms = 200 TFLOP/s (25%). ncu: tensor
// pipe active 34%, 2 warps per scheduler (208 registers at 64-position tiles), most stalls on
// fixed-latency dependencies. Next: wgmma from dequantised shared-memory tiles.
#include "common.cuh"

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
    __nv_bfloat16* out_h;          // EPI_SWIGLU: [positions, N] bf16 perm64
    const float* row_scale;        // EPI_SCALED: routing weight per position
    int M;                         // dense: positions
    int N, K, group, ldo, epilogue;
    int k_splits;                  // > 1: split-K, block z writes partial sums to out + z·M·ldo
    int _pad;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

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
                                             int G, int q, int group) {
    const int gi = (G * 64 + 16 * q) / group;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if constexpr (BITS == 4) W.c[i][r].w = __ldg(reinterpret_cast<const uint2*>(row[i][r] + G * 8) + q);
            else W.c[i][r].w = __ldg(reinterpret_cast<const uint4*>(row[i][r] + G * 16) + q);
            W.s[i][r] = srow[i][r][gi];
            W.b[i][r] = brow[i][r][gi];
        }
}

__device__ __forceinline__ uint32_t dequant_pair4(uint32_t v, __nv_bfloat162 s, __nv_bfloat162 b) {
    v = (v & 0x000F000Fu) | 0x43004300u;
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

template <int BITS, int MT>
__device__ __forceinline__ void gemm_body(const GemmArgs& p) {
    constexpr int BM = MT * 8;
    __shared__ __align__(16) __nv_bfloat16 As[STAGES][BM][A_STRIDE];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const bool swiglu = p.epilogue == EPI_SWIGLU;

    int expert = 0, m0, m_end;
    if (p.tiles) {
        if ((int)blockIdx.y >= *p.tile_count) return;
        const int4 t = p.tiles[blockIdx.y];
        expert = t.x;
        m0 = t.y;
        m_end = t.z;
    } else {
        m0 = blockIdx.y * BM;
        m_end = p.M;
    }

    const int K = p.K;
    // this block's share of the K groups (all of them unless split-K)
    const int g_begin = K / 64 * blockIdx.z / p.k_splits, groups = K / 64 * (blockIdx.z + 1) / p.k_splits - g_begin;
    const int wpr = K * BITS / 32, spr = K / p.group;
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
    WeightRegs<BITS> cur, nxt;
    load_weights<BITS>(cur, row, srow, brow, g_begin, q, p.group);
    for (int G = 0; G < groups; ++G) {
        if (G + 1 < groups) load_weights<BITS>(nxt, row, srow, brow, g_begin + G + 1, q, p.group);
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
                    dequant_row<BITS>(cur, i, 0, t, af[i][0], af[i][2]);
                    dequant_row<BITS>(cur, i, 1, t, af[i][1], af[i][3]);
                }
#pragma unroll
                for (int j = 0; j < MT; ++j) {
                    const uint32_t b0 = tt ? bf[j].z : bf[j].x, b1 = tt ? bf[j].w : bf[j].y;
#pragma unroll
                    for (int i = 0; i < 2; ++i) mma_bf16(acc[i][j], af[i][0], af[i][1], af[i][2], af[i][3], b0, b1);
                }
            }
        }
        cur = nxt;
    }
    cp_async_wait<0>();

    // epilogue: acc[i][j][e] is weight row (g + 8·(e/2)) of tile i, position 2q + e%2 of m-tile j
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int pos = m0 + j * 8 + 2 * q + (e & 1);
            if (pos >= m_end) continue;
            if (swiglu) {
                const int n = n_base + (e >> 1) * 8 + g;
                if (n < p.N) p.out_h[(size_t)pos * p.N + perm64(n)] = __float2bfloat16(siluf(acc[0][j][e]) * acc[1][j][e]);
                continue;
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int n = n_base + i * 16 + (e >> 1) * 8 + g;
                if (n >= p.N) continue;
                float* o = p.out + (size_t)blockIdx.z * p.M * p.ldo + (size_t)pos * p.ldo + n;
                const float v = acc[i][j][e];
                if (p.epilogue == EPI_ADD) *o += v;
                else if (p.epilogue == EPI_SCALED) *o = v * p.row_scale[pos];
                else *o = v;
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
