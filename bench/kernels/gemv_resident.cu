// gemv_q_resident (crates/osprey-cuda/kernels/gemv.cu: a block's whole share of the weights in
// shared memory, requested before griddepcontrol.wait, two launches' blocks per SM) against
// gemv_q_tiles (3 blocks per SM, weights requested after the wait) on the full model's decode
// shapes: chains of 30 launches over weight copies past the 60 MB L2, in one CUDA graph, with and
// without programmatic dependent launch; microseconds per launch; outputs compared with
// gemv_q_tiles' (relative RMS). First, what bounds the multiply: mma.sync latency and throughput
// (cycles per instruction) and quad_dot over tiles already in shared memory (cycles per tile and
// warp at 8 and 16 warps per SM: growing with the warps, it is a throughput limit).
// Results: bench/results/cuda-decode-resident-gemv-h200.json.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gemv_resident.cu -o /tmp/gemv_resident && /tmp/gemv_resident
#include "../../crates/osprey-cuda/kernels/gemv.cu"
#include "harness.cuh"
#include <algorithm>
#include <cmath>
#include <vector>

#define CHAIN 30

// Tensor-core instruction timing: each warp runs CHAINS independent accumulator chains of R
// dependent mma.sync; cycles per instruction per warp (clock64), the slowest warp of the block.
template <int CHAINS, bool INT8>
__global__ void mma_timing(int R, long long* cycles, int* sink) {
    int d[CHAINS][4] = {};
    float f[CHAINS][4] = {};
    const uint32_t a = threadIdx.x * 0x01010101u, b = threadIdx.x ^ 0x5a5a5a5au;
    __syncthreads();
    const long long t0 = clock64();
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) {
            if (INT8) mma_s8(d[c], a, a + c, a, a, b, b + r);
            else mma_bf16(f[c], a, a + c, a, a, b, b + r);
        }
    }
    const long long t1 = clock64();
    int acc = 0;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) acc += d[c][0] + d[c][3] + (int)f[c][0] + (int)f[c][3];
    sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
    if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<unsigned long long*>(cycles), (unsigned long long)(t1 - t0));
}

// The multiply alone: each warp runs quad_dot over 6 tiles of shared memory R times
// (K = 2048, whatever the memory holds); cycles per tile per warp, the slowest warp.
__global__ void __launch_bounds__(256) tile_dot_timing(int R, long long* cycles, float* sink) {
    extern __shared__ __align__(128) char tiles_smem[];
    const int K = 2048, gpr = 32, n = 6;
    char* codes = tiles_smem;
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + n * 16 * (K / 2));
    __nv_bfloat16* biases = scales + n * 16 * gpr;
    uint4* xb8 = reinterpret_cast<uint4*>(biases + n * 16 * gpr);
    float2* gx = reinterpret_cast<float2*>(xb8 + gpr * 8);
    for (int i = threadIdx.x; i < (n * 16 * (K / 2) + 2 * n * 16 * gpr * 2 + gpr * 8 * 16) / 4; i += blockDim.x)
        reinterpret_cast<uint32_t*>(tiles_smem)[i] = i * 2654435761u & 0x3f3f3f3fu;
    for (int i = threadIdx.x; i < gpr; i += blockDim.x) gx[i] = make_float2(0.01f, 0.5f);
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g0 = warp * gpr / 8;
    float y = 0.f;
    QuadX X;
    load_quad_x(xb8, gx, g0, X);
    const long long t0 = clock64();
    for (int r = 0; r < R; ++r) {
#pragma unroll 1
        for (int i = 0; i < n; ++i) {
            float yA = 0.f, yB = 0.f;
            quad_dot(codes + i * 16 * (K / 2), scales + i * 16 * gpr, biases + i * 16 * gpr, K, g0, X, yA, yB);
            y += yA + yB;
        }
    }
    const long long t1 = clock64();
    sink[blockIdx.x * blockDim.x + threadIdx.x] = y;
    if (lane == 0) atomicMax(reinterpret_cast<unsigned long long*>(cycles), (unsigned long long)(t1 - t0));
}

static void time_tile_dot(int blocks_per_sm) {
    long long* cyc;
    float* sink;
    CK(cudaMalloc(&cyc, 8));
    CK(cudaMalloc(&sink, 132 * 4 * 256 * 4));
    const int smem = 6 * 16 * 1024 + 2 * 6 * 16 * 32 * 2 + 32 * 8 * 16 + 32 * 8;
    CK(cudaFuncSetAttribute(tile_dot_timing, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const int R = 200;
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
        CK(cudaMemset(cyc, 0, 8));
        tile_dot_timing<<<132 * blocks_per_sm, 256, smem>>>(R, cyc, sink);
        CK(cudaDeviceSynchronize());
        long long c;
        CK(cudaMemcpy(&c, cyc, 8, cudaMemcpyDeviceToHost));
        best = std::min(best, (double)c / (R * 6));
    }
    printf("  quad_dot, %d blocks of 8 warps per SM: %.0f cycles per tile per warp\n", blocks_per_sm, best);
    CK(cudaFree(cyc));
    CK(cudaFree(sink));
}

template <int CHAINS, bool INT8>
static void time_mma(int warps) {
    long long* cyc;
    int* sink;
    CK(cudaMalloc(&cyc, 8));
    CK(cudaMalloc(&sink, 1024 * 4 * 132));
    const int R = 1024;
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
        CK(cudaMemset(cyc, 0, 8));
        mma_timing<CHAINS, INT8><<<132, warps * 32>>>(R, cyc, sink);
        CK(cudaDeviceSynchronize());
        long long c;
        CK(cudaMemcpy(&c, cyc, 8, cudaMemcpyDeviceToHost));
        best = std::min(best, (double)c / (R * CHAINS));
    }
    printf("  %s, %2d warps per SM, %d chains per warp: %.1f cycles per instruction per warp (%.2f per SM)\n",
           INT8 ? "mma m16n8k32 s8  " : "mma m16n8k16 bf16", warps, CHAINS, best, best / warps);
    CK(cudaFree(cyc));
    CK(cudaFree(sink));
}

struct Shape {
    const char* name;
    int K;
    std::vector<int> rows;  // segments sharing x
};

int main() {
    int sms = 0, smem_optin = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, gemv_q_resident));
    CK(cudaFuncSetAttribute(gemv_q_resident, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
    CK(cudaFuncSetAttribute(gemv_q_resident, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    printf("gemv_q_resident: %d registers, %d B local; %d B opt-in shared memory per block\n", fa.numRegs, (int)fa.localSizeBytes,
           smem_optin);
    const Shape shapes[] = {
        {"gdn_in_proj", 2048, {8192, 4096, 32, 32}},
        {"attn_qkv", 2048, {9216}},
        {"out_proj", 4096, {2048}},
        {"shared_gate_up", 2048, {512, 512}},
    };
    printf("tensor-core instruction timing (one block per SM):\n");
    time_mma<1, true>(1);
    time_mma<4, true>(1);
    time_mma<4, true>(4);
    time_mma<4, true>(8);
    time_mma<4, true>(16);
    time_mma<1, false>(1);
    time_mma<4, false>(1);
    time_mma<4, false>(4);
    time_mma<4, false>(8);
    time_mma<4, false>(16);
    time_tile_dot(1);
    time_tile_dot(2);
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    std::vector<float> ones(4096, 1.f);
    float* norm_w = upload(ones);
    for (const Shape& sh : shapes) {
        const int K = sh.K;
        size_t rows = 0;
        int tiles = 0;
        for (int r : sh.rows) {
            rows += r;
            tiles += (r + 15) / 16;
        }
        const size_t bytes = rows * (K / 2 + K / 64 * 4);
        const int copies = (int)std::min<size_t>(CHAIN, std::max<size_t>(2, (150u << 20) / bytes + 1));
        const HostQ4 w = random_q4(rows, K, 0.01f, 0.05f);
        float* x = random_x(K);
        std::vector<GemvArgs> args(copies);
        float* outs;
        CK(cudaMalloc(&outs, (size_t)copies * rows * 4));
        for (int c = 0; c < copies; ++c) {
            const ExpertStack d = upload_q4(w);
            GemvArgs a{};
            size_t r0 = 0;
            for (size_t i = 0; i < sh.rows.size(); ++i) {
                a.seg[i] = Segment{d.codes + r0 * K / 8, d.scales + r0 * K / 64, d.biases + r0 * K / 64, outs + c * rows + r0, sh.rows[i], 4, 0, 0};
                r0 += sh.rows[i];
            }
            a.nseg = (int)sh.rows.size();
            a.x = x;
            a.norm_weight = norm_w;
            a.eps = 1e-6f;
            a.K = K;
            a.group = 64;
            a.tiles = 1;
            args[c] = a;
        }
        const int tile_grid = std::min((tiles + 1) / 2, 3 * sms);
        const int res_grid = std::min(tiles, sms);
        const int per_block = (tiles + res_grid - 1) / res_grid;
        const size_t res_smem = resident_smem(K, per_block);  // as decoder.rs's resident_launch
        int occupancy = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, gemv_q_resident, 256, res_smem));
        auto run = [&](bool resident, bool pdl) {
            std::vector<float> y((size_t)copies * rows);
            CK(cudaMemset(outs, 0, y.size() * 4));
            const double us = graph_us(st, CHAIN, [&](int i) {
                GemvArgs a = args[i % copies];
                a.stages = per_block;
                cudaLaunchAttribute attr;
                if (resident) {
                    const cudaLaunchConfig_t cfg = launch_256(st, res_grid, res_smem, pdl, attr);
                    CK(cudaLaunchKernelEx(&cfg, gemv_q_resident, a));
                } else {
                    const cudaLaunchConfig_t cfg = launch_256(st, tile_grid, 0, pdl, attr);
                    CK(cudaLaunchKernelEx(&cfg, gemv_q_tiles, a));
                }
            });
            CK(cudaMemcpy(y.data(), outs, y.size() * 4, cudaMemcpyDeviceToHost));
            return std::make_pair(us, y);
        };
        printf("%-14s %zu x %d, %d tiles (%d per block, %.1f KB shared memory, %d blocks per SM), %d copies of %.1f MB; read at 4.3 TB/s: %.2f us\n",
               sh.name, rows, K, tiles, per_block, res_smem / 1024.0, occupancy, copies, bytes / 1e6, bytes / 4.3e6);
        if (res_smem > (size_t)smem_optin) {
            printf("  does not fit\n");
            continue;
        }
        const auto ref = run(false, true);
        printf("  %-30s %7.2f us\n", "gemv_q_tiles, pdl", ref.first);
        printf("  %-30s %7.2f us\n", "gemv_q_tiles", run(false, false).first);
        for (int pdl = 1; pdl >= 0; --pdl) {
            const auto got = run(true, pdl);
            printf("  %-40s %7.2f us   rel RMS vs tiles %.2e\n", pdl ? "gemv_q_resident, pdl" : "gemv_q_resident", got.first,
                   rel_rms_f(ref.second, got.second));
        }
    }
    return 0;
}
