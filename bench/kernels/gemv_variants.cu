// Decode GEMV variants, measured standalone on the H200 (session 4): a frozen record of the
// experiment behind gemv.cu's current tile path, kept so the figures can be reproduced.
//   v0  — the tile layout at commit 1c5da43: 4 warps per 16-row tile split K, one group's codes in
//         flight per warp, two block barriers per pair of tiles, 3 blocks per SM;
//   v1  — v0 with a warp's 8 groups requested at once (2 blocks per SM);
//   v2  — a warp owns whole tiles over all of K, batches double-buffered across its tiles;
//   v3  — K split P ways, batches of B groups in flight ahead of the work (the first before the
//         prologue), partial sums through a double buffer and a slot barrier (gemv.cu took P4 B4);
//   prologue only, and a plain 16-byte streaming read of the codes (the floor).
// 4-bit MLX affine weights, group 64, random values; each shape is replicated past the 60 MB L2
// so every launch reads from HBM; 20 launches captured in a CUDA graph, best of 5 replays.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gemv_variants.cu -o /tmp/gemv_variants && /tmp/gemv_variants
// Results: bench/results/cuda-gemv-variants-h200.json.
#include "../../crates/osprey-cuda/kernels/common.cuh"
#include <cstdio>
#include <vector>
#include <cstdlib>
#include <cuda.h>
#include <cuda_runtime.h>

struct Segment {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
    float* out;
    int rows;
    int bits;
    int accumulate;
    int _pad;
};
struct Args { Segment seg; const float* x; int K; };

#define MAX_K 4096
__device__ __forceinline__ __nv_bfloat162 shfl_bf162(__nv_bfloat162 v, int src) {
    const uint32_t u = __shfl_sync(FULL_MASK, *reinterpret_cast<uint32_t*>(&v), src);
    return *reinterpret_cast<const __nv_bfloat162*>(&u);
}
__device__ __forceinline__ void build_x_fragments(const float* xs, int K, uint4* xb) {
    for (int idx = threadIdx.x; idx < K / 16 * 4; idx += blockDim.x) {
        const int tile = idx >> 2, q = idx & 3, grp = tile >> 2, t = tile & 3;
        const int e0 = grp * 64 + (2 * q + (t >> 1)) * 8, sh = (t & 1) * 2;
        const float v[4] = {xs[pad_idx(e0 + sh)], xs[pad_idx(e0 + sh + 4)], xs[pad_idx(e0 + sh + 1)], xs[pad_idx(e0 + sh + 5)]};
        float hi[4], lo[4];
        for (int i = 0; i < 4; ++i) { hi[i] = __bfloat162float(__float2bfloat16_rn(v[i])); lo[i] = v[i] - hi[i]; }
        xb[idx] = make_uint4(pack_bf16(hi[0], hi[1]), pack_bf16(hi[2], hi[3]), pack_bf16(lo[0], lo[1]), pack_bf16(lo[2], lo[3]));
    }
}
// prologue: x -> xs (padded), chunk sums of 16, group sums of 64, fragments
__device__ __forceinline__ void prologue(const Args& a, float* xs, float* chunk_sum, float* gsum, uint4* xb) {
    for (int i = threadIdx.x; i < a.K; i += blockDim.x) xs[pad_idx(i)] = a.x[i];
    __syncthreads();
    for (int c = threadIdx.x; c < a.K / 16; c += blockDim.x) {
        float s = 0.f; for (int j = 0; j < 16; ++j) s += xs[pad_idx(c * 16 + j)];
        chunk_sum[c] = s;
    }
    build_x_fragments(xs, a.K, xb);
    __syncthreads();
    for (int G = threadIdx.x; G < a.K / 64; G += blockDim.x)
        gsum[G] = (chunk_sum[4 * G] + chunk_sum[4 * G + 1]) + (chunk_sum[4 * G + 2] + chunk_sum[4 * G + 3]);
    __syncthreads();
}

// Partial dot products of rows row0+g and row0+g+8 over groups [g0, g1) (valid in lanes q == 0).
__device__ __forceinline__ void tile_mma_v0(const Segment& s, int row0, int K, int g0, int g1, const uint4* xb,
                                         const float* chunk_sum, float& outA, float& outB) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int wpr = K / 8, gpr = K / 64;
    const int rA = row0 + g, rB = row0 + g + 8;
    const size_t la = (size_t)min(rA, s.rows - 1), lb = (size_t)min(rB, s.rows - 1);
    const uint2* ca = reinterpret_cast<const uint2*>(s.codes + la * wpr) + q;
    const uint2* cb = reinterpret_cast<const uint2*>(s.codes + lb * wpr) + q;
    float yA = 0.f, yB = 0.f;
    uint2 wa = __ldcs(ca + 4 * g0), wb = __ldcs(cb + 4 * g0);
    // scales and biases (read by the q == 0 lanes, which finish the rows) travel one group ahead
    // with the codes, so no iteration waits on a load issued inside it
    __nv_bfloat16 sa = s.scales[la * gpr + g0], ba = s.biases[la * gpr + g0];
    __nv_bfloat16 sb = s.scales[lb * gpr + g0], bb = s.biases[lb * gpr + g0];
    for (int G = g0; G < g1; ++G) {
        // next group's codes in flight while this one is multiplied
        uint2 na = wa, nb = wb;
        __nv_bfloat16 nsa = sa, nba = ba, nsb = sb, nbb = bb;
        if (G + 1 < g1) {
            na = __ldcs(ca + 4 * (G + 1)); nb = __ldcs(cb + 4 * (G + 1));
            if (q == 0) {
                nsa = s.scales[la * gpr + G + 1]; nba = s.biases[la * gpr + G + 1];
                nsb = s.scales[lb * gpr + G + 1]; nbb = s.biases[lb * gpr + G + 1];
            }
        }
        const float sA = bf16_to_f32(sa), bA = bf16_to_f32(ba), sB = bf16_to_f32(sb), bB = bf16_to_f32(bb);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const uint32_t wA = (t >> 1) ? wa.y : wa.x, wB = (t >> 1) ? wb.y : wb.x;
            const int sh = (t & 1) * 2;
            const uint32_t a0 = ((wA >> (4 * sh)) & 0x000F000Fu) | 0x43004300u;
            const uint32_t a1 = ((wB >> (4 * sh)) & 0x000F000Fu) | 0x43004300u;
            const uint32_t a2 = ((wA >> (4 * sh + 4)) & 0x000F000Fu) | 0x43004300u;
            const uint32_t a3 = ((wB >> (4 * sh + 4)) & 0x000F000Fu) | 0x43004300u;
            uint4 xf = make_uint4(0, 0, 0, 0);
            if (g == 0) xf = xb[(G * 4 + t) * 4 + q];
            mma_bf16(d, a0, a1, a2, a3, xf.x, xf.y);
            mma_bf16(d, a0, a1, a2, a3, xf.z, xf.w);
        }
        if (q == 0) {
            const float xsum = (chunk_sum[4 * G] + chunk_sum[4 * G + 1]) + (chunk_sum[4 * G + 2] + chunk_sum[4 * G + 3]);
            yA = fmaf(sA, d[0] - 128.f * xsum, fmaf(bA, xsum, yA));
            yB = fmaf(sB, d[2] - 128.f * xsum, fmaf(bB, xsum, yB));
        }
        wa = na;
        wb = nb;
        sa = nsa; ba = nba; sb = nsb; bb = nbb;
    }
    outA = yA;
    outB = yB;
}

// Groups of a warp's K range whose codes are requested together (one memory round trip per
// TILE_GROUPS groups, instead of one per group).
#define TILE_GROUPS 8

// Partial dot products of rows row0+g and row0+g+8 over groups [g0, g1) (valid in lanes q == 0).
__device__ __forceinline__ void tile_mma(const Segment& s, int row0, int K, int g0, int g1, const uint4* xb,
                                         const float* chunk_sum, float& outA, float& outB) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int wpr = K / 8, gpr = K / 64;
    const int rA = row0 + g, rB = row0 + g + 8;
    const size_t la = (size_t)min(rA, s.rows - 1), lb = (size_t)min(rB, s.rows - 1);
    const uint2* ca = reinterpret_cast<const uint2*>(s.codes + la * wpr) + q;
    const uint2* cb = reinterpret_cast<const uint2*>(s.codes + lb * wpr) + q;
    const __nv_bfloat162* scA = reinterpret_cast<const __nv_bfloat162*>(s.scales + la * gpr);
    const __nv_bfloat162* biA = reinterpret_cast<const __nv_bfloat162*>(s.biases + la * gpr);
    const __nv_bfloat162* scB = reinterpret_cast<const __nv_bfloat162*>(s.scales + lb * gpr);
    const __nv_bfloat162* biB = reinterpret_cast<const __nv_bfloat162*>(s.biases + lb * gpr);
    float yA = 0.f, yB = 0.f;
    for (int Gb = g0; Gb < g1; Gb += TILE_GROUPS) {
        // every code of the batch requested before any is used; lane (g, q) also fetches the
        // scales and biases of groups Gb + 2q, Gb + 2q + 1 (one bf16 pair each), which the
        // q == 0 lanes that finish the rows take by shuffles
        uint2 wa[TILE_GROUPS], wb[TILE_GROUPS];
#pragma unroll
        for (int j = 0; j < TILE_GROUPS; ++j) {
            if (Gb + j < g1) {
                wa[j] = __ldcs(ca + 4 * (Gb + j));
                wb[j] = __ldcs(cb + 4 * (Gb + j));
            }
        }
        const int pair = (Gb >> 1) + q;
        const bool has_pair = Gb + 2 * q < g1;
        const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.f, 0.f);
        const __nv_bfloat162 psA = has_pair ? scA[pair] : zero2, pbA = has_pair ? biA[pair] : zero2;
        const __nv_bfloat162 psB = has_pair ? scB[pair] : zero2, pbB = has_pair ? biB[pair] : zero2;
#pragma unroll
        for (int j = 0; j < TILE_GROUPS; ++j) {
            const int G = Gb + j;
            if (G >= g1) break;
            const int src = g * 4 + j / 2;
            const __nv_bfloat162 sA2 = shfl_bf162(psA, src), bA2 = shfl_bf162(pbA, src);
            const __nv_bfloat162 sB2 = shfl_bf162(psB, src), bB2 = shfl_bf162(pbB, src);
            float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const uint32_t wA = (t >> 1) ? wa[j].y : wa[j].x, wB = (t >> 1) ? wb[j].y : wb[j].x;
                const int sh = (t & 1) * 2;
                const uint32_t a0 = ((wA >> (4 * sh)) & 0x000F000Fu) | 0x43004300u;
                const uint32_t a1 = ((wB >> (4 * sh)) & 0x000F000Fu) | 0x43004300u;
                const uint32_t a2 = ((wA >> (4 * sh + 4)) & 0x000F000Fu) | 0x43004300u;
                const uint32_t a3 = ((wB >> (4 * sh + 4)) & 0x000F000Fu) | 0x43004300u;
                uint4 xf = make_uint4(0, 0, 0, 0);
                if (g == 0) xf = xb[(G * 4 + t) * 4 + q];
                mma_bf16(d, a0, a1, a2, a3, xf.x, xf.y);
                mma_bf16(d, a0, a1, a2, a3, xf.z, xf.w);
            }
            if (q == 0) {
                const float sA = (j & 1) ? __high2float(sA2) : __low2float(sA2);
                const float bA = (j & 1) ? __high2float(bA2) : __low2float(bA2);
                const float sB = (j & 1) ? __high2float(sB2) : __low2float(sB2);
                const float bB = (j & 1) ? __high2float(bB2) : __low2float(bB2);
                const float xsum = (chunk_sum[4 * G] + chunk_sum[4 * G + 1]) + (chunk_sum[4 * G + 2] + chunk_sum[4 * G + 3]);
                yA = fmaf(sA, d[0] - 128.f * xsum, fmaf(bA, xsum, yA));
                yB = fmaf(sB, d[2] - 128.f * xsum, fmaf(bB, xsum, yB));
            }
        }
    }
    outA = yA;
    outB = yB;
}


// V0 / V1: a block takes 2 tiles at a time, 4 warps split K, partial sums meet in smem
template <int V>
__device__ __forceinline__ void slot_loop(const Args& a, const uint4* xb, const float* chunk_sum) {
    __shared__ float part[2][4][16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slot = warp >> 2, kpart = warp & 3;
    const int gpr = a.K / 64, total = (a.seg.rows + 15) / 16;
    for (int base = blockIdx.x * 2; base < total; base += gridDim.x * 2) {
        const int u = base + slot;
        if (u < total) {
            float yA, yB;
            if (V == 0) tile_mma_v0(a.seg, u * 16, a.K, kpart * gpr / 4, (kpart + 1) * gpr / 4, xb, chunk_sum, yA, yB);
            else tile_mma(a.seg, u * 16, a.K, kpart * gpr / 4, (kpart + 1) * gpr / 4, xb, chunk_sum, yA, yB);
            if ((lane & 3) == 0) { part[slot][kpart][lane >> 2] = yA; part[slot][kpart][(lane >> 2) + 8] = yB; }
        }
        __syncthreads();
        if (u < total && kpart == 0 && lane < 16) {
            const int row = u * 16 + lane;
            if (row < a.seg.rows) a.seg.out[row] = (part[slot][0][lane] + part[slot][1][lane]) + (part[slot][2][lane] + part[slot][3][lane]);
        }
        __syncthreads();
    }
}
extern "C" __global__ void __launch_bounds__(256, 3) gemv_v0(Args a) {
    __shared__ __align__(16) float xs[MAX_K + MAX_K / 8];
    __shared__ float chunk_sum[MAX_K / 16], gsum[MAX_K / 64];
    __shared__ uint4 xb[MAX_K / 16 * 4];
    prologue(a, xs, chunk_sum, gsum, xb);
    slot_loop<0>(a, xb, chunk_sum);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_v1(Args a) {
    __shared__ __align__(16) float xs[MAX_K + MAX_K / 8];
    __shared__ float chunk_sum[MAX_K / 16], gsum[MAX_K / 64];
    __shared__ uint4 xb[MAX_K / 16 * 4];
    prologue(a, xs, chunk_sum, gsum, xb);
    slot_loop<1>(a, xb, chunk_sum);
}

// V2: a warp owns whole 16-row tiles over all of K; batches of 8 groups double-buffered, the
// pipeline running on across the warp's tiles; no block barriers after the prologue
__device__ __forceinline__ uint32_t frag(uint32_t w) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "r"(0x000F000Fu), "r"(0x43004300u));
    return r;
}
#define B2 8
template <int NB> struct TileBatchT { uint2 wa[NB], wb[NB]; __nv_bfloat162 psA, pbA, psB, pbB; };
using TileBatch = TileBatchT<B2>;
template <int NB>
__device__ __forceinline__ void tile_load(const Segment& s, int K, int tile, int Gb, TileBatchT<NB>& b) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int wpr = K / 8, gpr = K / 64;
    const size_t la = (size_t)min(tile * 16 + g, s.rows - 1), lb = (size_t)min(tile * 16 + g + 8, s.rows - 1);
    const uint2* ca = reinterpret_cast<const uint2*>(s.codes + la * wpr) + q + 4 * Gb;
    const uint2* cb = reinterpret_cast<const uint2*>(s.codes + lb * wpr) + q + 4 * Gb;
#pragma unroll
    for (int j = 0; j < NB; ++j) { b.wa[j] = __ldcs(ca + 4 * j); b.wb[j] = __ldcs(cb + 4 * j); }
    const int pair = (Gb >> 1) + q;
    b.psA = reinterpret_cast<const __nv_bfloat162*>(s.scales + la * gpr)[pair];
    b.pbA = reinterpret_cast<const __nv_bfloat162*>(s.biases + la * gpr)[pair];
    b.psB = reinterpret_cast<const __nv_bfloat162*>(s.scales + lb * gpr)[pair];
    b.pbB = reinterpret_cast<const __nv_bfloat162*>(s.biases + lb * gpr)[pair];
}
template <int NB>
__device__ __forceinline__ void tile_compute(const TileBatchT<NB>& b, int Gb, const uint4* xq, const float* gsum, float& yA, float& yB) {
    const int lane = threadIdx.x & 31, g = lane >> 2;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
        const int G = Gb + j, src = g * 4 + j / 2;
        const __nv_bfloat162 sA2 = shfl_bf162(b.psA, src), bA2 = shfl_bf162(b.pbA, src);
        const __nv_bfloat162 sB2 = shfl_bf162(b.psB, src), bB2 = shfl_bf162(b.pbB, src);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const uint32_t wA = (t >> 1) ? b.wa[j].y : b.wa[j].x, wB = (t >> 1) ? b.wb[j].y : b.wb[j].x;
            const int sh = (t & 1) * 8;
            const uint4 xf = xq[(G * 4 + t) * 4];
            const uint32_t a0 = frag(wA >> sh), a1 = frag(wB >> sh), a2 = frag(wA >> (sh + 4)), a3 = frag(wB >> (sh + 4));
            mma_bf16(d, a0, a1, a2, a3, xf.x, xf.y);
            mma_bf16(d, a0, a1, a2, a3, xf.z, xf.w);
        }
        const float sA = (j & 1) ? __high2float(sA2) : __low2float(sA2);
        const float bA = (j & 1) ? __high2float(bA2) : __low2float(bA2);
        const float sB = (j & 1) ? __high2float(sB2) : __low2float(sB2);
        const float bB = (j & 1) ? __high2float(bB2) : __low2float(bB2);
        const float xs = gsum[G];
        yA = fmaf(sA, d[0] - 128.f * xs, fmaf(bA, xs, yA));
        yB = fmaf(sB, d[2] - 128.f * xs, fmaf(bB, xs, yB));
    }
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_v2(Args a) {
    __shared__ __align__(16) float xs[MAX_K + MAX_K / 8];
    __shared__ float chunk_sum[MAX_K / 16], gsum[MAX_K / 64];
    __shared__ uint4 xb[MAX_K / 16 * 4];
    prologue(a, xs, chunk_sum, gsum, xb);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3;
    const int gpr = a.K / 64, nb = gpr / B2, tiles = (a.seg.rows + 15) / 16;
    const int stride = gridDim.x * 8;
    int tile = blockIdx.x * 8 + warp;
    if (tile >= tiles) return;
    const uint4* xq = xb + q;
    TileBatch cur, nxt;
    tile_load(a.seg, a.K, tile, 0, cur);
    int bi = 0;
    float yA = 0.f, yB = 0.f;
    while (true) {
        // next (tile, batch) in flight while this one is multiplied
        int nt = tile, nbi = bi + 1;
        if (nbi == nb) { nbi = 0; nt += stride; }
        if (nt < tiles) tile_load(a.seg, a.K, nt, nbi * B2, nxt);
        tile_compute(cur, bi * B2, xq, gsum, yA, yB);
        if (nbi == 0) {
            if (q == 0) {
                const int r = tile * 16 + (lane >> 2);
                if (r < a.seg.rows) a.seg.out[r] = yA;
                if (r + 8 < a.seg.rows) a.seg.out[r + 8] = yB;
            }
            yA = yB = 0.f;
            if (nt >= tiles) break;
        }
        tile = nt; bi = nbi; cur = nxt;
    }
}


// V3: warps split K P ways (8/P tiles per block at a time), a warp's batches pipelined across
// its tiles (the first requested before the prologue), partial sums meet through a double
// buffer and one named barrier per tile among the P warps of a slot; prologue builds the x
// fragments straight from global loads (no xs staging), with an RMS-norm-like block reduction
template <int P>
__device__ __forceinline__ void prologue_fast(const Args& a, uint4* xb, float* gsum, float* scratch) {
    // thread (grp, q) owns elements grp*64 + 16q .. +16 (the 4 k-tiles of its fragments)
    const int K = a.K, idx = threadIdx.x, grp = idx >> 2, q = idx & 3;
    const bool active = idx < K / 16;
    float v[16];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float4 f = active ? *reinterpret_cast<const float4*>(a.x + grp * 64 + 16 * q + 4 * i) : make_float4(0, 0, 0, 0);
        v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) ss += v[i] * v[i];
    ss = block_sum(ss, scratch);
    const float inv = ss > 0.f ? 1.f : 1.f;  // stands in for the norm's scale
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) { v[i] *= inv; s += v[i]; }
    s += __shfl_xor_sync(FULL_MASK, s, 1);
    s += __shfl_xor_sync(FULL_MASK, s, 2);
    if (active) {
        if (q == 0) gsum[grp] = s;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            // element e0 + sh + {0,4,1,5} with e0 = grp*64 + (2q + t/2)*8, sh = (t&1)*2, relative to 16q
            const int o = (t >> 1) * 8 + (t & 1) * 2;
            const float w4[4] = {v[o], v[o + 4], v[o + 1], v[o + 5]};
            float hi[4], lo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) { hi[i] = __bfloat162float(__float2bfloat16_rn(w4[i])); lo[i] = w4[i] - hi[i]; }
            xb[(grp * 4 + t) * 4 + q] = make_uint4(pack_bf16(hi[0], hi[1]), pack_bf16(hi[2], hi[3]), pack_bf16(lo[0], lo[1]), pack_bf16(lo[2], lo[3]));
        }
    }
    __syncthreads();
}

// the P warps of one slot meet; barrier ids are immediates so only those in use are reserved
template <int P>
__device__ __forceinline__ void slot_barrier(int slot) {
    switch (slot) {
        case 0: asm volatile("bar.sync 1, %0;" :: "n"(32 * P) : "memory"); break;
        case 1: asm volatile("bar.sync 2, %0;" :: "n"(32 * P) : "memory"); break;
        case 2: asm volatile("bar.sync 3, %0;" :: "n"(32 * P) : "memory"); break;
        default: asm volatile("bar.sync 4, %0;" :: "n"(32 * P) : "memory"); break;
    }
}

template <int P, int NB>
__device__ __forceinline__ void gemv_v3_body(const Args& a) {
    constexpr int SLOTS = 8 / P;
    __shared__ uint4 xb[MAX_K / 16 * 4];
    __shared__ float gsum[MAX_K / 64], scratch[32];
    __shared__ float part[2][SLOTS][P][16];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, q = lane & 3;
    const int slot = warp / P, kp = warp % P;
    const int gpr = a.K / 64, gper = gpr / P, nb = gper / NB, tiles = (a.seg.rows + 15) / 16;
    const int g0 = kp * gper;
    const int stride = gridDim.x * SLOTS;
    int tile = blockIdx.x * SLOTS + slot;
    TileBatchT<NB> cur, nxt;
    if (tile < tiles) tile_load(a.seg, a.K, tile, g0, cur);
    prologue_fast<P>(a, xb, gsum, scratch);
    if (tile >= tiles) return;
    const uint4* xq = xb + q;
    int bi = 0, it = 0;
    float yA = 0.f, yB = 0.f;
    while (true) {
        int nt = tile, nbi = bi + 1;
        if (nbi == nb) { nbi = 0; nt += stride; }
        if (nt < tiles) tile_load(a.seg, a.K, nt, g0 + nbi * NB, nxt);
        tile_compute(cur, g0 + bi * NB, xq, gsum, yA, yB);
        if (nbi == 0) {
            float* pp = part[it & 1][slot][kp];
            if (q == 0) { pp[lane >> 2] = yA; pp[(lane >> 2) + 8] = yB; }
            slot_barrier<P>(slot);
            if (kp == 0 && lane < 16) {
                const int r = tile * 16 + lane;
                float y = 0.f;
#pragma unroll
                for (int k = 0; k < P; ++k) y += part[it & 1][slot][k][lane];
                if (r < a.seg.rows) a.seg.out[r] = y;
            }
            yA = yB = 0.f;
            ++it;
            if (nt >= tiles) break;
        }
        tile = nt; bi = nbi; cur = nxt;
    }
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_v3p4b8(Args a) { gemv_v3_body<4, 8>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_v3p4b4(Args a) { gemv_v3_body<4, 4>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_v3p8b4(Args a) { gemv_v3_body<8, 4>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_v3p2b8(Args a) { gemv_v3_body<2, 8>(a); }
extern "C" __global__ void __launch_bounds__(256, 3) gemv_v3p2b4(Args a) { gemv_v3_body<2, 4>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) gemv_prologue_only(Args a) {
    __shared__ uint4 xb[MAX_K / 16 * 4];
    __shared__ float gsum[MAX_K / 64], scratch[32];
    prologue_fast<4>(a, xb, gsum, scratch);
    if (threadIdx.x == 0 && gsum[0] == 12345.f) a.seg.out[0] = 1.f;
}

// floor: stream the same bytes with 16-byte loads
extern "C" __global__ void read_floor(const uint4* p, size_t n, float* out) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = 1.f;
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

int main() {
    struct Shape { const char* name; int N, K; };
    Shape shapes[] = {{"gdn_in_proj", 12352, 2048}, {"out_proj", 2048, 4096}, {"attn_qkv", 9216, 2048}, {"lm_head", 248320, 2048}};
    for (auto& sh : shapes) {
        const int N = sh.N, K = sh.K;
        const size_t code_b = (size_t)N * K / 2, sc_b = (size_t)N * (K / 64) * 2;
        const size_t per = code_b + 2 * sc_b;
        const int copies = per > (200u << 20) ? 1 : (int)((300u << 20) / per) + 1;
        std::vector<uint32_t> hc(code_b / 4);
        for (auto& v : hc) v = rand() * 2654435761u;
        std::vector<__nv_bfloat16> hs(N * (K / 64)), hb(N * (K / 64));
        for (size_t i = 0; i < hs.size(); ++i) { hs[i] = __float2bfloat16(0.01f * (1 + rand() % 7)); hb[i] = __float2bfloat16(-0.05f * (rand() % 5)); }
        std::vector<float> hx(K);
        for (auto& v : hx) v = (rand() % 2001 - 1000) / 1000.f;
        std::vector<Args> args(copies);
        float* x; CK(cudaMalloc(&x, K * 4)); CK(cudaMemcpy(x, hx.data(), K * 4, cudaMemcpyHostToDevice));
        std::vector<float*> outs(10);
        for (auto& o : outs) CK(cudaMalloc(&o, N * 4));
        for (int c = 0; c < copies; ++c) {
            uint32_t* dc; __nv_bfloat16 *ds, *db;
            CK(cudaMalloc(&dc, code_b)); CK(cudaMalloc(&ds, sc_b)); CK(cudaMalloc(&db, sc_b));
            CK(cudaMemcpy(dc, hc.data(), code_b, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(ds, hs.data(), sc_b, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(db, hb.data(), sc_b, cudaMemcpyHostToDevice));
            args[c] = Args{Segment{dc, ds, db, nullptr, N, 4, 0, 0}, x, K};
        }
        const int tiles = (N + 15) / 16;
        struct V { const char* name; void* fn; int grid; };
        V vs[] = {{"v0 main(1-ahead,3/SM)", (void*)gemv_v0, std::min((tiles + 1) / 2, 132 * 3)},
                  {"v1 batched(2/SM)", (void*)gemv_v1, std::min((tiles + 1) / 2, 132 * 2)},
                  {"v2 warp-tiles dbuf", (void*)gemv_v2, std::min((tiles + 7) / 8, 132 * 2)},
                  {"v3 P4 B8 2/SM", (void*)gemv_v3p4b8, std::min((tiles + 1) / 2, 132 * 2)},
                  {"v3 P4 B4 3/SM", (void*)gemv_v3p4b4, std::min((tiles + 1) / 2, 132 * 3)},
                  {"v3 P8 B4 3/SM", (void*)gemv_v3p8b4, std::min(tiles, 132 * 3)},
                  {"v3 P2 B8 2/SM", (void*)gemv_v3p2b8, std::min((tiles + 3) / 4, 132 * 2)},
                  {"v3 P2 B4 3/SM", (void*)gemv_v3p2b4, std::min((tiles + 3) / 4, 132 * 3)},
                  {"prologue only", (void*)gemv_prologue_only, std::min((tiles + 1) / 2, 132 * 2)}};
        cudaStream_t st; CK(cudaStreamCreate(&st));
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        const int L = 20;
        std::vector<float> ref;
        for (int vi = 0; vi < 9; ++vi) {
            for (int c = 0; c < copies; ++c) args[c].seg.out = outs[vi];
            cudaGraph_t gr; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < L; ++i) {
                void* p[] = {&args[i % copies]};
                CK(cudaLaunchKernel(vs[vi].fn, dim3(vs[vi].grid), dim3(256), p, 0, st));
            }
            CK(cudaStreamEndCapture(st, &gr));
            CK(cudaGraphInstantiate(&ge, gr, 0));
            CK(cudaGraphLaunch(ge, st)); CK(cudaStreamSynchronize(st));
            float best = 1e9;
            for (int r = 0; r < 5; ++r) {
                CK(cudaEventRecord(e0, st)); CK(cudaGraphLaunch(ge, st)); CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms);
            }
            std::vector<float> h(N); CK(cudaMemcpy(h.data(), outs[vi], N * 4, cudaMemcpyDeviceToHost));
            double err = 0, nrm = 0;
            if (vi == 0) ref = h; else if (vi < 8) for (int i = 0; i < N; ++i) { err += (h[i] - ref[i]) * (double)(h[i] - ref[i]); nrm += ref[i] * (double)ref[i]; }
            const double us = best * 1000 / L;
            printf("%-12s %-24s grid %4d: %7.2f us  %6.2f TB/s  rel.err vs v0 %.2e\n", sh.name, vs[vi].name, vs[vi].grid, us, per / us / 1e6, vi ? sqrt(err / nrm) : 0.0);
        }
        // floor
        {
            cudaGraph_t gr; cudaGraphExec_t ge; float* o = outs[9];
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < L; ++i) read_floor<<<132 * 4, 512, 0, st>>>((const uint4*)args[i % copies].seg.codes, code_b / 16, o);
            CK(cudaStreamEndCapture(st, &gr)); CK(cudaGraphInstantiate(&ge, gr, 0));
            CK(cudaGraphLaunch(ge, st)); CK(cudaStreamSynchronize(st));
            float best = 1e9;
            for (int r = 0; r < 5; ++r) { CK(cudaEventRecord(e0, st)); CK(cudaGraphLaunch(ge, st)); CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); best = std::min(best, ms); }
            const double us = best * 1000 / L;
            printf("%-12s %-24s          : %7.2f us  %6.2f TB/s (codes only)\n", sh.name, "read floor", us, code_b / us / 1e6);
        }
    }
    return 0;
}
