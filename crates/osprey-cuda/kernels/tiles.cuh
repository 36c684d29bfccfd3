// Tensor-core tiles of 4-bit group-64 rows times one activation vector, shared by the decode
// GEMV (gemv.cu) and the MoE expert projections (moe.cu): 16 rows per warp-tile, x carried as
// two signed bytes per element on the integer tensor cores.
#pragma once
#include "common.cuh"

// ---- 4-bit, group-64 rows on the integer tensor cores ------------------------------------------
// A warp owns a tile of 16 rows. Per 64-element group, each of its 4 column-threads (lane % 4 = q)
// loads one 8-byte pair of code words per row (words 2q, 2q + 1). x is carried per group G as
// x ≈ s_G · (h + l / 254) with h = rint(x / s_G) and l the rounded remainder in 254ths (s_G =
// max|x| / 127 over the group, so |h|, |l| <= 127): the error is at most s_G / 508, about 2^-16
// of the group's largest element (bf16 activations, as MLX multiplies them, carry 2^-9 of each).
// A code word gives its A fragments in two LOP3s and a shift (nibbles 0,2,4,6 and 1,3,5,7 as
// bytes), and mma m16n8k32 takes 32 k per instruction with exact s32 sums: a group costs 4 mma
// and 12 ALU operations per warp, where bf16 fragments (x as bf16 hi + lo, codes as 128 + q)
// cost 8 mma and 28 (measured: lm_head 124 -> 100 us, in_proj 11.9 -> 11.1 us standalone). No
// offset is added to the codes, so nothing cancels when the bias term is applied.
// Storage of x: lane (g, q) of k-tile T (0, 1) of group G multiplies the nibbles of code word
// 2q + T; its b0 bytes are x[G·64 + 8(2q + T) + 2i], b1 bytes x[... + 2i + 1] (i = 0..3), hi and
// lo parts in one uint4 at xb8[(2G + T)·4 + q]; gx[G] = (s_G, Σ x over the group).

// A warp's groups are requested TILE_BATCH at a time. Lane (g, q) holds one 8-byte pair of code
// words per row and group, and the scales and biases of groups Gb + 2q, Gb + 2q + 1 (one bf16
// pair each), which every lane takes by shuffles.
#define TILE_BATCH 4

// Rows of one 4-bit group-64 matrix in the MLX layout.
struct QRows {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
    int rows;
};

struct TileBatch {
    uint2 wa[TILE_BATCH], wb[TILE_BATCH];
    __nv_bfloat162 sA, bA, sB, bB;
};

__device__ __forceinline__ __nv_bfloat162 shfl_bf162(__nv_bfloat162 v, int src) {
    const uint32_t u = __shfl_sync(FULL_MASK, *reinterpret_cast<uint32_t*>(&v), src);
    return *reinterpret_cast<const __nv_bfloat162*>(&u);
}

// Requests the scales and biases of groups [Gb, min(Gb + TILE_BATCH, g1)) of rows row0 + g and
// row0 + g + 8: lane (g, q) holds groups Gb + 2q, Gb + 2q + 1 (Gb even: the host runs tiles only
// when K is a multiple of 512).
__device__ __forceinline__ void tile_load_scales(const QRows& s, int K, int row0, int Gb, int g1, TileBatch& b) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, gpr = K / 64;
    const size_t la = (size_t)min(row0 + g, s.rows - 1), lb = (size_t)min(row0 + g + 8, s.rows - 1);
    const int pair = (Gb >> 1) + q;
    const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.f, 0.f);
    const bool has = Gb + 2 * q < g1;
    b.sA = has ? reinterpret_cast<const __nv_bfloat162*>(s.scales + la * gpr)[pair] : zero2;
    b.bA = has ? reinterpret_cast<const __nv_bfloat162*>(s.biases + la * gpr)[pair] : zero2;
    b.sB = has ? reinterpret_cast<const __nv_bfloat162*>(s.scales + lb * gpr)[pair] : zero2;
    b.bB = has ? reinterpret_cast<const __nv_bfloat162*>(s.biases + lb * gpr)[pair] : zero2;
}

// Requests groups [Gb, min(Gb + TILE_BATCH, g1)) of rows row0 + g and row0 + g + 8.
__device__ __forceinline__ void tile_load(const QRows& s, int K, int row0, int Gb, int g1, TileBatch& b) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int wpr = K / 8;
    const size_t la = (size_t)min(row0 + g, s.rows - 1), lb = (size_t)min(row0 + g + 8, s.rows - 1);
    const uint2* ca = reinterpret_cast<const uint2*>(s.codes + la * wpr) + q + 4 * Gb;
    const uint2* cb = reinterpret_cast<const uint2*>(s.codes + lb * wpr) + q + 4 * Gb;
#pragma unroll
    for (int j = 0; j < TILE_BATCH; ++j) {
        if (Gb + j < g1) {
            b.wa[j] = __ldcs(ca + 4 * j);
            b.wb[j] = __ldcs(cb + 4 * j);
        }
    }
    tile_load_scales(s, K, row0, Gb, g1, b);
}

__device__ __forceinline__ uint32_t pack_s8(const int* v) {
    return (uint32_t)(v[0] & 0xFF) | ((uint32_t)(v[1] & 0xFF) << 8) | ((uint32_t)(v[2] & 0xFF) << 16) | ((uint32_t)(v[3] & 0xFF) << 24);
}

__device__ __forceinline__ void build_x_s8(const float* xs, int K, uint4* xb8, float2* gx) {
    // 8 consecutive threads per group: thread (T, q) of group G holds the 8 elements its fragments
    // take; the passes are block-uniform so every lane of a warp meets the shuffles
    const int items = K / 64 * 8;
    for (int pass = 0; pass < items; pass += blockDim.x) {
        const int idx = pass + threadIdx.x;
        const bool active = idx < items;
        const int G = idx >> 3, T = (idx >> 2) & 1, q = idx & 3, e0 = G * 64 + 8 * (2 * q + T);
        float v[8], mx = 0.f, sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            v[j] = active ? xs[pad_idx(e0 + j)] : 0.f;
            mx = fmaxf(mx, fabsf(v[j]));
            sum += v[j];
        }
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
            sum += __shfl_xor_sync(FULL_MASK, sum, o);
        }
        const float s = mx / 127.f, inv = mx > 0.f ? 127.f / mx : 0.f;
        int h[8], l[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            h[j] = __float2int_rn(v[j] * inv);
            l[j] = max(-127, min(127, __float2int_rn((v[j] - (float)h[j] * s) * inv * 254.f)));
        }
        const int h0[4] = {h[0], h[2], h[4], h[6]}, h1[4] = {h[1], h[3], h[5], h[7]};
        const int l0[4] = {l[0], l[2], l[4], l[6]}, l1[4] = {l[1], l[3], l[5], l[7]};
        if (active) {
            xb8[idx] = make_uint4(pack_s8(h0), pack_s8(h1), pack_s8(l0), pack_s8(l1));
            if ((idx & 7) == 0) gx[G] = make_float2(s, sum);
        }
    }
}

// Adds groups [Gb, min(Gb + TILE_BATCH, g1)) to the dot products of rows g (yA) and g + 8 (yB);
// every lane holds them (x sits in all 8 columns of B, so no lane masks it).
__device__ __forceinline__ void tile_compute_s8(const TileBatch& b, int Gb, int g1, const uint4* xq, const float2* gx, float& yA,
                                                float& yB) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int j = 0; j < TILE_BATCH; ++j) {
        const int G = Gb + j;
        if (G >= g1) break;
        const int src = g * 4 + j / 2;
        const __nv_bfloat162 sA2 = shfl_bf162(b.sA, src), bA2 = shfl_bf162(b.bA, src);
        const __nv_bfloat162 sB2 = shfl_bf162(b.sB, src), bB2 = shfl_bf162(b.bB, src);
        int dh[4] = {0, 0, 0, 0}, dl[4] = {0, 0, 0, 0};
#pragma unroll
        for (int T = 0; T < 2; ++T) {
            const uint32_t wA = T ? b.wa[j].y : b.wa[j].x, wB = T ? b.wb[j].y : b.wb[j].x;
            const uint32_t a0 = wA & 0x0F0F0F0Fu, a2 = (wA >> 4) & 0x0F0F0F0Fu;
            const uint32_t a1 = wB & 0x0F0F0F0Fu, a3 = (wB >> 4) & 0x0F0F0F0Fu;
            const uint4 xf = xq[(2 * G + T) * 4];
            mma_s8(dh, a0, a1, a2, a3, xf.x, xf.y);
            mma_s8(dl, a0, a1, a2, a3, xf.z, xf.w);
        }
        const float2 gs = gx[G];
        const float dA = gs.x * fmaf((float)dl[0], 1.f / 254.f, (float)dh[0]);
        const float dB = gs.x * fmaf((float)dl[2], 1.f / 254.f, (float)dh[2]);
        const float sA = (j & 1) ? __high2float(sA2) : __low2float(sA2);
        const float bA = (j & 1) ? __high2float(bA2) : __low2float(bA2);
        const float sB = (j & 1) ? __high2float(sB2) : __low2float(sB2);
        const float bB = (j & 1) ? __high2float(bB2) : __low2float(bB2);
        yA = fmaf(sA, dA, fmaf(bA, gs.y, yA));
        yB = fmaf(sB, dB, fmaf(bB, gs.y, yB));
    }
}
