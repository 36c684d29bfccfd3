// A decode GEMV on the CUDA cores in packed fp16 (gemv_h2), against the engine's tensor-core tile
// kernel (gemv_q_tiles from crates/osprey-cuda/kernels/gemv.cu, included as is) on the full
// model's decode shapes, and against a host reference in double precision.
// Why: the tile GEMV reads in_proj's 12.6 MB of codes in 9.3 us standalone where a plain
// streaming read takes 4.6 (cuda-gemv-variants-h200.json); what is left is the multiply (4-bit
// codes to s8 fragments, two mma per group for x's two bytes). On the CUDA cores one 4-bit weight
// costs 1.5 instructions plus a quarter of a conversion: per code word (8 weights), 4 x (LOP3 to
// put a nibble pair under fp16's 1024 exponent, HSUB2 to remove the 1024 exactly, HFMA2 with the
// matching pair of x), then the word's half2 sum to fp32 (2 conversions, 2 adds): ~2.5 issue
// slots per weight, for in_proj 25M weights ~2 us of ALU on 132 SMs, under the ~3.5 us its bytes
// take. Precision: codes exact in fp16, x rounded to fp16 (2^-12 relative), 8 products summed in
// fp16 then in fp32 (scale and bias applied per group in fp32).
// Also timed: the engine's row kernel (gemv_q, a warp per row in fp32), as the engine launches it.
// Geometry: a warp takes ROWS (2, 4 or 8; each timed) rows at a time; lane l reads 16 bytes (4
// words, half a group) of each row per 512-byte slice of K, so x's matching 32 values per slice
// stay in the lane's registers for every row (K / 1024 slices: 2 at K = 2048, 4 at 4096); per row
// the lanes' sums meet in 5 shuffles.
// 8 warps per block, all blocks resident, rows dealt round-robin by warp.
// Written without a GPU at hand (compiled here with nvcc -c): NOT YET RUN.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gemv_hfma2.cu -o /tmp/gemv_hfma2 && /tmp/gemv_hfma2
#include "../../crates/osprey-cuda/kernels/gemv.cu"
#include "harness.cuh"
#include <cmath>
#include <cuda_fp16.h>
#include <vector>

#define LAUNCHES 24
#define H2_WARPS 8

// one 4-bit segment (gemv.cu's Segment: codes, scales, biases, out, rows) times x of width K
struct H2Args {
    Segment seg;
    const float* x;
    int K;
};

// One lane's share of x for slice s: words 4l..4l+3 of the slice, each as 4 half2 pairs in the
// order the nibbles come out ((0, 4), (1, 5), (2, 6), (3, 7)), and the sum of those 32 x's.
template <int SLICES>
struct LaneX {
    __half2 h[SLICES][16];
    float sum[SLICES];
};

template <int SLICES>
__device__ __forceinline__ void load_lane_x(LaneX<SLICES>& lx, const float* x, int lane) {
#pragma unroll
    for (int s = 0; s < SLICES; ++s) {
        const float* xs = x + s * 1024 + lane * 32;
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float4 a = reinterpret_cast<const float4*>(xs + 8 * w)[0];
            const float4 b = reinterpret_cast<const float4*>(xs + 8 * w)[1];
            lx.h[s][4 * w + 0] = __floats2half2_rn(a.x, b.x);
            lx.h[s][4 * w + 1] = __floats2half2_rn(a.y, b.y);
            lx.h[s][4 * w + 2] = __floats2half2_rn(a.z, b.z);
            lx.h[s][4 * w + 3] = __floats2half2_rn(a.w, b.w);
            total += a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;
        }
        lx.sum[s] = total;
    }
}

// Σ code · x over one word's 8 weights, in fp32 from a fp16 pair sum.
__device__ __forceinline__ float word_dot(uint32_t v, const __half2* xh) {
    const __half2 magic = __half2half2(__ushort_as_half(0x6400));  // 1024
    __half2 acc = __float2half2_rn(0.f);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t bits = ((v >> (4 * i)) & 0x000F000Fu) | 0x64006400u;
        const __half2 c = __hsub2(*reinterpret_cast<const __half2*>(&bits), magic);
        acc = __hfma2(c, xh[i], acc);
    }
    const float2 f = __half22float2(acc);
    return f.x + f.y;
}

// ROWS rows per warp at a time (their codes all requested before any is multiplied)
template <int SLICES, int ROWS>
__global__ void __launch_bounds__(H2_WARPS * 32) gemv_h2(H2Args p) {
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * H2_WARPS + (threadIdx.x >> 5), warps = gridDim.x * H2_WARPS;
    LaneX<SLICES> lx;
    load_lane_x<SLICES>(lx, p.x, lane);
    const int wpr = p.K / 8, gpr = p.K / 64;
    for (int r0 = warp * ROWS; r0 < p.seg.rows; r0 += warps * ROWS) {
        uint4 c[ROWS][SLICES];
        __nv_bfloat16 sc[ROWS][SLICES], bi[ROWS][SLICES];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int row = min(r0 + r, p.seg.rows - 1);
#pragma unroll
            for (int s = 0; s < SLICES; ++s) {
                c[r][s] = __ldcs(reinterpret_cast<const uint4*>(p.seg.codes + (size_t)row * wpr + s * 128) + lane);
                const int gi = row * gpr + s * 16 + (lane >> 1);
                sc[r][s] = p.seg.scales[gi];
                bi[r][s] = p.seg.biases[gi];
            }
        }
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            acc[r] = 0.f;
#pragma unroll
            for (int s = 0; s < SLICES; ++s) {
                const float d = word_dot(c[r][s].x, &lx.h[s][0]) + word_dot(c[r][s].y, &lx.h[s][4]) +
                                word_dot(c[r][s].z, &lx.h[s][8]) + word_dot(c[r][s].w, &lx.h[s][12]);
                acc[r] = fmaf(__bfloat162float(sc[r][s]), d, fmaf(__bfloat162float(bi[r][s]), lx.sum[s], acc[r]));
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[r]);
            if (lane == 0 && r0 + r < p.seg.rows) p.seg.out[r0 + r] = v;
        }
    }
}

struct Shape {
    const char* name;
    int K;
    int rows;
};

static double host_row(const HostQ4& w, const std::vector<float>& x, size_t row, int K) {
    double acc = 0.0;
    for (int g = 0; g < K / 64; ++g) {
        const double s = __bfloat162float(w.scales[row * (K / 64) + g]), b = __bfloat162float(w.biases[row * (K / 64) + g]);
        for (int k = 0; k < 64; ++k) {
            const int kk = g * 64 + k;
            const uint32_t word = w.codes[row * (K / 8) + kk / 8];
            const double code = (word >> (4 * (kk % 8))) & 0xF;
            acc += (s * code + b) * x[kk];
        }
    }
    return acc;
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const Shape shapes[] = {
        {"gdn_in_proj", 2048, 12352},
        {"attn_qkv", 2048, 9216},
        {"out_proj", 4096, 2048},
        {"lm_head", 2048, 248320},
    };
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    for (const Shape& sh : shapes) {
        const int K = sh.K;
        const size_t rows = sh.rows;
        const size_t bytes = rows * (K / 2 + K / 64 * 4);
        const int copies = (int)std::min<size_t>(LAUNCHES, std::max<size_t>(1, (150u << 20) / bytes + 1));
        const HostQ4 w = random_q4(rows, K, 0.01f, 0.05f);
        std::vector<float> xh(K);
        for (auto& v : xh) v = (rand() % 2001 - 1000) / 1000.f;
        float* x = upload(xh);
        float* outs;
        CK(cudaMalloc(&outs, (size_t)copies * rows * 4 * 2));
        std::vector<ExpertStack> mats;
        for (int c = 0; c < copies; ++c) mats.push_back(upload_q4(w));
        auto segment = [&](int c, float* out) { return Segment{mats[c].codes, mats[c].scales, mats[c].biases, out, (int)rows, 4, 0, 0}; };
        auto tile_args = [&](int c, float* out, int tiles) {
            GemvArgs a{};
            a.seg[0] = segment(c, out);
            a.nseg = 1;
            a.x = x;
            a.K = K;
            a.group = 64;
            a.tiles = tiles;
            return a;
        };
        auto h2_args = [&](int c, float* out) { return H2Args{segment(c, out), x, K}; };
        const int tiles = (int)(rows + 15) / 16;
        const int tile_grid = std::min((tiles + 1) / 2, 3 * sms);
        // variant 0: the tile kernel; 1, 2, 3: gemv_h2 with 2, 4, 8 rows per warp; 4: the engine's
        // row kernel (gemv_q: a warp per row, fp32 on the CUDA cores), as the engine launches it
        auto h2_kernel = [&](int variant) -> void (*)(H2Args) {
            if (K == 2048) return variant == 1 ? gemv_h2<2, 2> : variant == 2 ? gemv_h2<2, 4> : gemv_h2<2, 8>;
            return variant == 1 ? gemv_h2<4, 2> : variant == 2 ? gemv_h2<4, 4> : gemv_h2<4, 8>;
        };
        auto h2_grid = [&](int variant, int* per_sm) {
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, h2_kernel(variant), H2_WARPS * 32, 0));
            const size_t per_block = (size_t)H2_WARPS << variant;  // rows per block: warps x 2, 4, 8
            return (int)std::min<size_t>((size_t)*per_sm * sms, (rows + per_block - 1) / per_block);
        };
        int grids[5] = {tile_grid, 0, 0, 0, (int)std::min<size_t>((rows + 7) / 8, 3 * (size_t)sms)}, per_sms[5] = {};
        for (int v = 1; v <= 3; ++v) grids[v] = h2_grid(v, &per_sms[v]);  // before any capture
        auto run = [&](int variant) {
            return (float)graph_us(st, LAUNCHES, [&](int i) {
                const int c = i % copies;
                float* out = outs + ((size_t)(variant > 0) * copies + c) * rows;
                if (variant == 0) gemv_q_tiles<<<tile_grid, 256, 0, st>>>(tile_args(c, out, 1));
                else if (variant == 4) gemv_q<<<grids[4], 256, 0, st>>>(tile_args(c, out, 0));
                else h2_kernel(variant)<<<grids[variant], H2_WARPS * 32, 0, st>>>(h2_args(c, out));
            });
        };
        // relative RMS against the host reference on a sample of rows (the latest run's outputs)
        auto error = [&](size_t offset) {
            std::vector<float> y(rows);
            CK(cudaMemcpy(y.data(), outs + offset, rows * 4, cudaMemcpyDeviceToHost));
            double e = 0, ref2 = 0;
            for (size_t r = 0; r < rows; r += std::max<size_t>(1, rows / 2048)) {
                const double ref = host_row(w, xh, r, K);
                e += (y[r] - ref) * (y[r] - ref);
                ref2 += ref * ref;
            }
            return std::sqrt(e / ref2);
        };
        printf("%-12s %6zu x %d (%5.1f MB, floor at 3.7 TB/s %6.2f us):\n", sh.name, rows, K, bytes / 1e6, bytes / 3.7e6);
        const float t_tiles = run(0);
        printf("  tiles            %7.2f us  rel RMS vs host %.1e\n", t_tiles, error(0));
        const float t_rows = run(4);
        printf("  rows (gemv_q)    %7.2f us  rel RMS vs host %.1e\n", t_rows, error((size_t)copies * rows));
        for (int v = 1; v <= 3; ++v) {
            const float t = run(v);
            printf("  gemv_h2 %d rows   %7.2f us  rel RMS vs host %.1e  (%d blocks, %d per SM)\n", 1 << v, t,
                   error((size_t)copies * rows), grids[v], per_sms[v]);
        }
        for (auto& m : mats) {
            CK(cudaFree((void*)m.codes));
            CK(cudaFree((void*)m.scales));
            CK(cudaFree((void*)m.biases));
        }
        CK(cudaFree(outs));
        CK(cudaFree(x));
    }
    return 0;
}
