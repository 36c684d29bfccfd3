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
#define ROWS 4
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

__device__ __forceinline__ void load_input(const GemvArgs& a, float* xs, float* chunk_sum, float* scratch) {
    const int K = a.K;
    float scale = 1.f;
    if (a.norm_weight) {
        float ss = 0.f;
        for (int i = threadIdx.x; i < K; i += blockDim.x) { float v = a.x[i]; ss += v * v; }
        ss = block_sum(ss, scratch);
        scale = rsqrtf(ss / K + a.eps);
    }
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
        float v = a.x[i] * scale;
        if (a.norm_weight) v *= a.norm_weight[i];
        xs[pad_idx(i)] = v;
    }
    __syncthreads();
    if (a.head_norm) {
        // one warp per head: rms over head_dim, then w * silu(z)
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, hd = a.head_dim;
        for (int h = warp; h < K / hd; h += blockDim.x >> 5) {
            float ss = 0.f;
            for (int j = lane; j < hd; j += 32) { float v = xs[pad_idx(h * hd + j)]; ss += v * v; }
            ss = warp_sum(ss);
            float inv = rsqrtf(ss / hd + a.eps);
            for (int j = lane; j < hd; j += 32) {
                int i = h * hd + j;
                xs[pad_idx(i)] = xs[pad_idx(i)] * inv * a.head_norm[j] * siluf(a.gate_z[i]);
            }
        }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < K / 16; c += blockDim.x) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 16; ++j) s += xs[pad_idx(c * 16 + j)];
        chunk_sum[c] = s;
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
            float d = 0.f;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                if (BITS == 4) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) d = fmaf(nib(ws[k], e), x[8 * k + e], d);
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e) d = fmaf(byte_code(ws[k], e), x[4 * k + e], d);
                }
            }
            acc[r] = fmaf(sc[r][j], d, fmaf(bi[r][j], xsum, acc[r]));
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

extern "C" __global__ void __launch_bounds__(256, 2) gemv_q(GemvArgs a) {
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
