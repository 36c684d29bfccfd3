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

// Slot idx (8 consecutive threads per group) of x's two-signed-byte form from its 8 values v:
// the group's scale from the largest magnitude of its 8 slots (shuffles: every lane of the warp
// must call), hi and lo bytes packed as the fragments take them, (scale, Σx) by the group's first
// slot.
__device__ __forceinline__ void write_slot(const float* v, int idx, bool active, uint4* xb8, float2* gx) {
    float mx = 0.f, sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
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
        if ((idx & 7) == 0) gx[idx >> 3] = make_float2(s, sum);
    }
}

// The first of the 8 elements that fragment slot idx takes.
__device__ __forceinline__ int slot_first_element(int idx) {
    const int G = idx >> 3, T = (idx >> 2) & 1, q = idx & 3;
    return G * 64 + 8 * (2 * q + T);
}

__device__ __forceinline__ void build_x_s8(const float* xs, int K, uint4* xb8, float2* gx) {
    // 8 consecutive threads per group: thread (T, q) of group G holds the 8 elements its fragments
    // take; the passes are block-uniform so every lane of a warp meets the shuffles
    const int items = K / 64 * 8;
    for (int pass = 0; pass < items; pass += blockDim.x) {
        const int idx = pass + threadIdx.x;
        const bool active = idx < items;
        const int e0 = slot_first_element(idx);
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = active ? xs[pad_idx(e0 + j)] : 0.f;
        write_slot(v, idx, active, xb8, gx);
    }
}

// Adds groups [Gb, min(Gb + TILE_BATCH, g1)) to the dot products of rows g (yA) and g + 8 (yB);
// every lane holds them (x sits in all 8 columns of B, so no lane masks it). xq and gx hold x's
// groups from xg0 on.
__device__ __forceinline__ void tile_compute_s8(const TileBatch& b, int Gb, int g1, const uint4* xq, const float2* gx, float& yA,
                                                float& yB, int xg0 = 0) {
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
            const uint4 xf = xq[(2 * (G - xg0) + T) * 4];
            mma_s8(dh, a0, a1, a2, a3, xf.x, xf.y);
            mma_s8(dl, a0, a1, a2, a3, xf.z, xf.w);
        }
        const float2 gs = gx[G - xg0];
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

// ---- tiles multiplied from shared memory (gemv_q_resident, moe_gate_up) ----
// Shared-memory layout of n tiles: codes [n][16 rows][K/2 B], scales and biases [n][16][K/64].
// copy_q4_rows puts rows [r0, r0 + rows) of a stored matrix at tile `slot` (rows may run over
// several consecutive tiles) with one bulk copy each of codes, scales and biases; they arrive on
// `bar`, which must expect q4_rows_bytes(rows, K) for them.
__device__ __forceinline__ uint32_t q4_rows_bytes(int rows, int K) { return rows * (K / 2 + K / 64 * 4); }

__device__ __forceinline__ void copy_q4_rows(char* codes, __nv_bfloat16* scales, __nv_bfloat16* biases, size_t slot,
                                             const uint32_t* src_codes, const __nv_bfloat16* src_scales,
                                             const __nv_bfloat16* src_biases, size_t r0, int rows, int K, uint64_t* bar) {
    const int gpr = K / 64;
    bulk_copy_to_shared(codes + slot * 16 * (K / 2), src_codes + r0 * (K / 8), rows * (K / 2), bar);
    bulk_copy_to_shared(scales + slot * 16 * gpr, src_scales + r0 * gpr, rows * gpr * 2, bar);
    bulk_copy_to_shared(biases + slot * 16 * gpr, src_biases + r0 * gpr, rows * gpr * 2, bar);
}

// The multiply reads the tiles from shared memory, where rows K/2 bytes apart share banks; read
// as tile_load reads global memory (lane (g, q) taking rows g and g + 8 of one group at a time)
// the 8 rows of a load meet in 8-way bank conflicts and the shared-memory pipe bounds the kernel
// (1,320 cycles per 4 groups of a tile per warp at 8 warps per SM). So a warp takes its groups
// four at a time ("quads") and lane row g takes group (j + g) mod 4 of the quad at step j: the
// rows of one load fall on different banks (774 cycles). The mma's 8 columns, all holding x in
// the tile kernel, now hold each its own group and byte: columns n and n + 4 (n < 4) get group
// (j + n) mod 4, n its high bytes and n + 4 its low bytes, so one mma per k-tile gives row g's
// product with both bytes of its own group's x, in columns c = g mod 4 (lane q = c / 2) and
// c + 4 (lane q + 2); the two lanes' sums meet in store_quad_sums. (Before, the high and low
// bytes took an mma each with every column holding the same byte: twice the mma.sync issue.)

// x fragments of a quad as lane (g, q) needs them, [step][k-tile]: the high bytes for g < 4, the
// low for g >= 4 (the lane feeds column g); and per step the factors of this lane's result
// column: the x scale (divided by 254 in a low-byte column) and the group sum of x (0 in a
// low-byte column: the bias term is added once, by the high-byte lane).
struct QuadX {
    uint2 x[4][2];
    float2 gs[4];
};

__device__ __forceinline__ void load_quad_x(const uint4* xb8, const float2* gx, int gq, QuadX& X) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const uint2* xb = reinterpret_cast<const uint2*>(xb8) + (g >> 2);
    const bool low_column = q >= 2;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int G = gq + ((j + g) & 3);
        X.x[j][0] = xb[((2 * G) * 4 + q) * 2];
        X.x[j][1] = xb[((2 * G + 1) * 4 + q) * 2];
        // the column this lane reads out holds group gq + (j + c) mod 4 (c = g mod 4, as its row)
        const float2 gs = gx[gq + ((j + g) & 3)];
        X.gs[j] = low_column ? make_float2(gs.x * (1.f / 254.f), 0.f) : gs;
    }
}

// four bf16 (groups gq..gq + 3 of one row) rotated so that element j is group gq + (j + c) mod 4:
// the two words swapped when c >= 2, then a funnel shift by 16 bits when c is odd (4 instructions;
// a 64-bit variable rotate took about 7)
__device__ __forceinline__ unsigned long long rot_bf16x4(const __nv_bfloat16* p, int c) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    const uint32_t lo = (c & 2) ? v.y : v.x, hi = (c & 2) ? v.x : v.y, sh = (c & 1) * 16;
    return ((unsigned long long)__funnelshift_r(hi, lo, sh) << 32) | __funnelshift_r(lo, hi, sh);
}
__device__ __forceinline__ float bf16x4_at(unsigned long long u, int j) { return __uint_as_float((uint32_t)(u >> (16 * j)) << 16); }

// Lane (g, q)'s offsets into a tile for the quad [gq, gq + 4) at width K: byte offsets of its 8
// code bytes of rows g and g + 8 at step j (group gq + (j + c) mod 4, c = g mod 4), and the
// element offsets of the quad's scales (and biases) of rows g and g + 8. Computed once per quad
// position, not per tile: a kernel walking many tiles of one quad (gemv_q_resident, gemv_q_ring)
// otherwise recomputes them from the thread index for every tile.
struct QuadLane {
    int code_a[4], code_b[4];
    int sb_a, sb_b;
    int c;
};

// A value the compiler must keep in a register rather than recompute where it is used.
__device__ __forceinline__ int kept(int v) {
    asm volatile("" : "+r"(v));
    return v;
}

__device__ __forceinline__ QuadLane quad_lane(int K, int gq) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, gpr = K / 64;
    QuadLane L;
    L.c = kept(g & 3);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        L.code_a[j] = kept(g * (K / 2) + q * 8 + (gq + ((j + L.c) & 3)) * 32);
        L.code_b[j] = kept(L.code_a[j] + 8 * (K / 2));
    }
    L.sb_a = kept(g * gpr + gq);
    L.sb_b = kept((g + 8) * gpr + gq);
    return L;
}

// Adds the quad (QuadLane) of one tile (codes rows K/2 bytes apart, scales and biases rows K/64
// apart) to rows g (yA) and g + 8 (yB): the high-byte part in lanes q == (g mod 4) / 2, the
// low-byte part in lanes q + 2 (other lanes: mismatched groups).
// The quad's operands in lane (g, q): its code words of rows g and g + 8 at each step, and those
// rows' four scales and biases rotated as the steps take them.
__device__ __forceinline__ void load_quad(const char* stage, const __nv_bfloat16* sc, const __nv_bfloat16* bi, const QuadLane& L,
                                          uint2 (&wa)[4], uint2 (&wb)[4], unsigned long long& sA, unsigned long long& bA,
                                          unsigned long long& sB, unsigned long long& bB) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        wa[j] = *reinterpret_cast<const uint2*>(stage + L.code_a[j]);
        wb[j] = *reinterpret_cast<const uint2*>(stage + L.code_b[j]);
    }
    sA = rot_bf16x4(sc + L.sb_a, L.c), bA = rot_bf16x4(bi + L.sb_a, L.c);
    sB = rot_bf16x4(sc + L.sb_b, L.c), bB = rot_bf16x4(bi + L.sb_b, L.c);
}

// ROWS activation rows at once (the speculative verify step's two): the codes loaded and unpacked
// once, an mma per row.
template <int ROWS>
__device__ __forceinline__ void quad_dot_rows(const char* stage, const __nv_bfloat16* sc, const __nv_bfloat16* bi, const QuadLane& L,
                                              const QuadX (&X)[ROWS], float (&yA)[ROWS], float (&yB)[ROWS]) {
    uint2 wa[4], wb[4];
    unsigned long long sA, bA, sB, bB;
    load_quad(stage, sc, bi, L, wa, wb, sA, bA, sB, bB);
    const bool odd = L.c & 1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int d[ROWS][4];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) d[r][0] = d[r][1] = d[r][2] = d[r][3] = 0;
#pragma unroll
        for (int T = 0; T < 2; ++T) {
            const uint32_t wA = T ? wa[j].y : wa[j].x, wB = T ? wb[j].y : wb[j].x;
            const uint32_t a0 = wA & 0x0F0F0F0Fu, a2 = (wA >> 4) & 0x0F0F0F0Fu;
            const uint32_t a1 = wB & 0x0F0F0F0Fu, a3 = (wB >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) mma_s8(d[r], a0, a1, a2, a3, X[r].x[j][T].x, X[r].x[j][T].y);
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float2 gs = X[r].gs[j];
            const float dA = gs.x * (float)(odd ? d[r][1] : d[r][0]), dB = gs.x * (float)(odd ? d[r][3] : d[r][2]);
            yA[r] = fmaf(bf16x4_at(sA, j), dA, fmaf(bf16x4_at(bA, j), gs.y, yA[r]));
            yB[r] = fmaf(bf16x4_at(sB, j), dB, fmaf(bf16x4_at(bB, j), gs.y, yB[r]));
        }
    }
}

__device__ __forceinline__ void quad_dot(const char* stage, const __nv_bfloat16* sc, const __nv_bfloat16* bi, const QuadLane& L,
                                         const QuadX& X, float& yA, float& yB) {
    quad_dot_rows<1>(stage, sc, bi, L, reinterpret_cast<const QuadX(&)[1]>(X), reinterpret_cast<float(&)[1]>(yA),
                     reinterpret_cast<float(&)[1]>(yB));
}

// The same for a quad used once (its offsets computed here).
__device__ __forceinline__ void quad_dot(const char* stage, const __nv_bfloat16* sc, const __nv_bfloat16* bi, int K, int gq,
                                         const QuadX& X, float& yA, float& yB) {
    quad_dot(stage, sc, bi, quad_lane(K, gq), X, yA, yB);
}

// A warp's 16 row sums after quad_dot, into part[0..16): lane (g, q) with q == (g mod 4) / 2
// adds its low-byte partner q + 2 and holds rows g and g + 8. Every lane of the warp calls it.
__device__ __forceinline__ void store_quad_sums(float* part, float yA, float yB) {
    const int lane = threadIdx.x & 31, g = lane >> 2;
    yA += __shfl_xor_sync(FULL_MASK, yA, 2);
    yB += __shfl_xor_sync(FULL_MASK, yB, 2);
    if ((lane & 3) == ((g & 3) >> 1)) {
        part[g] = yA;
        part[g + 8] = yB;
    }
}

// The prologue straight into the tiles' two-signed-byte form (no f32 copy of x kept): thread t
// takes the 8 consecutive elements that fragment slot t of build_x_s8 takes (K/8 slots, at most
// two per thread), RMS-normalised over K with a weight, or per head and gated by silu(z).
struct XInput {
    const float* x;
    const float* norm_weight;  // RMSNorm weight over all K (null: none)
    const float* gate_z;       // with head_norm: y = norm_head(x) * w * silu(z)
    const float* head_norm;    // per-head RMSNorm weight [head_dim] (null: none)
    float eps;
    int K;
    int head_dim;
};

// The norm weight's values at the thread's slots, for resident_values: a kernel may ask for them
// before its wait (the weight is no kernel's output).
__device__ __forceinline__ void load_norm_slots(const float* w, int K, float (&nw)[2][8]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int idx = threadIdx.x + r * blockDim.x, e0 = slot_first_element(idx);
        const float4 w0 = idx < K / 8 ? *reinterpret_cast<const float4*>(w + e0) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 w1 = idx < K / 8 ? *reinterpret_cast<const float4*>(w + e0 + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
        nw[r][0] = w0.x; nw[r][1] = w0.y; nw[r][2] = w0.z; nw[r][3] = w0.w;
        nw[r][4] = w1.x; nw[r][5] = w1.y; nw[r][6] = w1.z; nw[r][7] = w1.w;
    }
}

// The values of the thread's slots (threadIdx.x and threadIdx.x + blockDim.x), normalised as `a`
// says (with the norm weight's values from nw where given: load_norm_slots); zero past K/8 slots.
// DEFER_RMS: the full-width RMSNorm's 1/rms is left out (no block-wide sum, so no block barrier)
// and the thread's sum of squares returned instead: the products are linear in x, so a kernel
// may scale its sums by 1/rms at the end, and x's bytes (relative to each group's largest
// element) come out the same. Otherwise it returns 0.
template <bool DEFER_RMS = false>
__device__ __forceinline__ float resident_values(const XInput& a, float (&v)[2][8], float* scratch,
                                                 const float (*nw)[8] = nullptr) {
    const int K = a.K, items = K / 8;
    float ss[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int idx = threadIdx.x + r * blockDim.x;
        const int e0 = slot_first_element(idx);
        if (idx < items) {
            const float4 x0 = *reinterpret_cast<const float4*>(a.x + e0), x1 = *reinterpret_cast<const float4*>(a.x + e0 + 4);
            v[r][0] = x0.x; v[r][1] = x0.y; v[r][2] = x0.z; v[r][3] = x0.w;
            v[r][4] = x1.x; v[r][5] = x1.y; v[r][6] = x1.z; v[r][7] = x1.w;
#pragma unroll
            for (int j = 0; j < 8; ++j) ss[r] += v[r][j] * v[r][j];
            if (a.norm_weight && nw) {
#pragma unroll
                for (int j = 0; j < 8; ++j) v[r][j] *= nw[r][j];
            } else if (a.norm_weight) {
                const float4 w0 = *reinterpret_cast<const float4*>(a.norm_weight + e0);
                const float4 w1 = *reinterpret_cast<const float4*>(a.norm_weight + e0 + 4);
                v[r][0] *= w0.x; v[r][1] *= w0.y; v[r][2] *= w0.z; v[r][3] *= w0.w;
                v[r][4] *= w1.x; v[r][5] *= w1.y; v[r][6] *= w1.z; v[r][7] *= w1.w;
            } else if (a.head_norm) {
                const float4 z0 = *reinterpret_cast<const float4*>(a.gate_z + e0), z1 = *reinterpret_cast<const float4*>(a.gate_z + e0 + 4);
                const float4 h0 = *reinterpret_cast<const float4*>(a.head_norm + e0 % a.head_dim);
                const float4 h1 = *reinterpret_cast<const float4*>(a.head_norm + e0 % a.head_dim + 4);
                v[r][0] *= h0.x * siluf(z0.x); v[r][1] *= h0.y * siluf(z0.y); v[r][2] *= h0.z * siluf(z0.z); v[r][3] *= h0.w * siluf(z0.w);
                v[r][4] *= h1.x * siluf(z1.x); v[r][5] *= h1.y * siluf(z1.y); v[r][6] *= h1.z * siluf(z1.z); v[r][7] *= h1.w * siluf(z1.w);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) v[r][j] = 0.f;
        }
    }
    if (a.norm_weight && DEFER_RMS) {
        return ss[0] + ss[1];
    } else if (a.norm_weight) {
        const float inv = rsqrtf(block_sum(ss[0] + ss[1], scratch) / K + a.eps);
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int j = 0; j < 8; ++j) v[r][j] *= inv;
    } else if (a.head_norm) {
        // a head's slots are head_dim/8 (<= 32) consecutive threads: they reduce by shuffles
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            for (int o = 1; o < a.head_dim / 8; o <<= 1) ss[r] += __shfl_xor_sync(FULL_MASK, ss[r], o);
            const float inv = rsqrtf(ss[r] / a.head_dim + a.eps);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[r][j] *= inv;
        }
    }
    return 0.f;
}

// The thread's slots of x's two-signed-byte form from their values.
__device__ __forceinline__ void write_slots(const float (&v)[2][8], int K, uint4* xb8, float2* gx) {
    const int items = K / 8;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int idx = threadIdx.x + r * blockDim.x;
        if (r * (int)blockDim.x >= items) break;  // block-uniform: every lane meets the shuffles
        write_slot(v[r], idx, idx < items, xb8, gx);
    }
}

__device__ __forceinline__ void resident_input(const XInput& a, uint4* xb8, float2* gx, float* scratch,
                                               const float (*nw)[8] = nullptr) {
    float v[2][8];
    resident_values(a, v, scratch, nw);
    write_slots(v, a.K, xb8, gx);
}
