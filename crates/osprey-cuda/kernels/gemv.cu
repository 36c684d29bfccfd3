// Quantised GEMV for batch-1 decode: y = W x for MLX affine 4/8-bit rows, several matrices that
// share one input in one launch ("segments": e.g. GDN in_proj_qkv | z | b | a), 4- and 8-bit rows
// mixed (the router and shared-expert gate are 8-bit).
//
// Shapes: K (input width) a multiple of 64 up to 4096, group 32/64/128.
// Geometry: 256 threads = 8 warps; a warp owns ROWS consecutive rows at a time (grid-stride over
// row units); lane l reads 16-byte chunks l, l+32, ... of each row, so a warp reads whole 512-byte
// spans. All codes, scales and biases of the unit are loaded before any arithmetic (ROWS x chunks
// 16-byte loads in flight per lane), and each x chunk is read from shared memory once and reused
// for the ROWS rows.
// Prologue: x is loaded once per block into padded shared memory and, optionally, RMS-normalised
// with a weight (the layer's pre-norm), or per-head RMS-normalised and gated by silu(z) (the GDN
// output norm), fused here instead of separate kernels; sums of x per 16 elements are precomputed
// so the affine bias costs one FMA per chunk: y = Σ s·(q·x) + b·Σx.
// Epilogue: write, or add into the output (residual add fused).
// Ceiling: bytes of codes + scales + biases / ~3.7 TB/s streaming read (budget.md).
#include "common.cuh"

#define MAX_SEGS 4
#define MAX_K 4096
#define ROWS 2
#define MAX_CPL 4  // chunks per lane: K=4096 at 4 bits, K=2048 at 8 bits

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
    int _pad;
};

// Thread t owns the E consecutive elements [E·t, E·t + E) of the input, E = max(K/256, 4) (so
// 4, 8 or 16; K/E threads take part): all of its x, weight and gate values are loaded in one batch
// of 16-byte loads, so the prologue costs one memory round trip instead of one per loop iteration.
#define MAX_E 16

__device__ __forceinline__ void load_input(const GemvArgs& a, float* xs, float* chunk_sum, float* scratch) {
    const int K = a.K, E = max(K / (int)blockDim.x, 4), t = threadIdx.x, base = t * E;
    const bool active = base < K;
    float v[MAX_E], w[MAX_E], z[MAX_E], hw[MAX_E];
#pragma unroll
    for (int q = 0; q < MAX_E / 4; ++q) {
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
    for (int e = 0; e < MAX_E; ++e) if (active && e < E) ss += v[e] * v[e];
    if (a.norm_weight) {
        ss = block_sum(ss, scratch);
        const float inv = rsqrtf(ss / K + a.eps);
#pragma unroll
        for (int e = 0; e < MAX_E; ++e) if (e < E) v[e] *= inv * w[e];
    } else if (a.head_norm) {
        // the head_dim/E (<= 32) consecutive threads of one head reduce by shuffles
        for (int o = 1; o < a.head_dim / E; o <<= 1) ss += __shfl_xor_sync(FULL_MASK, ss, o);
        const float inv = rsqrtf(ss / a.head_dim + a.eps);
#pragma unroll
        for (int e = 0; e < MAX_E; ++e) if (e < E) v[e] *= inv * hw[e] * siluf(z[e]);
    }
    // sums of 16-element chunks: a thread holds E/16 whole chunks, or 16/E threads share one
    float cs = 0.f;
#pragma unroll
    for (int e = 0; e < MAX_E; ++e) {
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

// ROWS rows [row0, row0 + n) of segment s (all of one bit width), K columns.
template <int BITS, int CPL>
__device__ __forceinline__ void rows_dot(const Segment& s, int row0, int n, int K, int group, const float* xs,
                                         const float* chunk_sum, float* y) {
    const int lane = threadIdx.x & 31;
    constexpr int EPC = BITS == 4 ? 32 : 16;  // elements per 16-byte chunk
    const int chunks = K / EPC, gpr = K / group, wpr = K * BITS / 32;
    uint4 w[ROWS][CPL];
    float sc[ROWS][CPL], bi[ROWS][CPL];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
            int c = lane + 32 * j;
            if (r < n && c < chunks) {
                size_t row = (size_t)(row0 + r);
                w[r][j] = __ldcs(reinterpret_cast<const uint4*>(s.codes + row * wpr) + c);
                int g = (c * EPC) / group;
                sc[r][j] = bf16_to_f32(s.scales[row * gpr + g]);
                bi[r][j] = bf16_to_f32(s.biases[row * gpr + g]);
            } else {
                w[r][j] = make_uint4(0, 0, 0, 0);
                sc[r][j] = 0.f;
                bi[r][j] = 0.f;
            }
        }
    }
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll
    for (int j = 0; j < CPL; ++j) {
        int c = lane + 32 * j;
        if (c >= chunks) break;
        float x[EPC];
        const float4* xv = reinterpret_cast<const float4*>(xs + pad_idx(c * EPC));
#pragma unroll
        for (int q = 0; q < EPC / 4; ++q) {
            float4 t = xv[q];
            x[4 * q] = t.x; x[4 * q + 1] = t.y; x[4 * q + 2] = t.z; x[4 * q + 3] = t.w;
        }
        float xsum = BITS == 4 ? chunk_sum[2 * c] + chunk_sum[2 * c + 1] : chunk_sum[c];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            uint32_t ws[4] = {w[r][j].x, w[r][j].y, w[r][j].z, w[r][j].w};
            // 8 independent partial sums: short FMA dependency chains
            float d[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                if (BITS == 4) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) d[e] = fmaf(nib(ws[k], e), x[8 * k + e], d[e]);
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e) d[(k & 1) * 4 + e] = fmaf(byte_code(ws[k], e), x[4 * k + e], d[(k & 1) * 4 + e]);
                }
            }
            const float dot = ((d[0] + d[1]) + (d[2] + d[3])) + ((d[4] + d[5]) + (d[6] + d[7]));
            acc[r] = fmaf(sc[r][j], dot, fmaf(bi[r][j], xsum, acc[r]));
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) y[r] = warp_sum(acc[r]);
}

template <int BITS>
__device__ __forceinline__ void dispatch(const Segment& s, int row0, int n, int K, int group, const float* xs,
                                         const float* cs, float* y) {
    constexpr int EPC = BITS == 4 ? 32 : 16;
    const int cpl = (K / EPC + 31) / 32;
    if (cpl <= 1) rows_dot<BITS, 1>(s, row0, n, K, group, xs, cs, y);
    else if (cpl <= 2) rows_dot<BITS, 2>(s, row0, n, K, group, xs, cs, y);
    else if (cpl <= 4) rows_dot<BITS, 4>(s, row0, n, K, group, xs, cs, y);
    else rows_dot<BITS, MAX_CPL>(s, row0, n, K, group, xs, cs, y);  // the host checks cpl <= MAX_CPL
}

extern "C" __global__ void __launch_bounds__(256) gemv_q(GemvArgs a) {
    __shared__ __align__(16) float xs[MAX_K + MAX_K / 8];
    __shared__ float chunk_sum[MAX_K / 16];
    __shared__ float scratch[32];
    load_input(a, xs, chunk_sum, scratch);

    int units = 0;
    for (int i = 0; i < a.nseg; ++i) units += (a.seg[i].rows + ROWS - 1) / ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int u = blockIdx.x * 8 + warp; u < units; u += gridDim.x * 8) {
        int si = 0, local = u;
        while (local >= (a.seg[si].rows + ROWS - 1) / ROWS) { local -= (a.seg[si].rows + ROWS - 1) / ROWS; ++si; }
        const Segment& s = a.seg[si];
        const int row0 = local * ROWS, n = min(ROWS, s.rows - row0);
        float y[ROWS];
        if (s.bits == 4) dispatch<4>(s, row0, n, a.K, a.group, xs, chunk_sum, y);
        else dispatch<8>(s, row0, n, a.K, a.group, xs, chunk_sum, y);
        if (lane < n) {
            float v = y[0];
#pragma unroll
            for (int r = 1; r < ROWS; ++r) if (lane == r) v = y[r];
            if (s.accumulate) s.out[row0 + lane] += v; else s.out[row0 + lane] = v;
        }
    }
}
