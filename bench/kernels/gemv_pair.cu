// gemv_q_pair (gemv.cu: each 16-row tile of a K = 4096 output projection split over a 2-block
// cluster, reduced through distributed shared memory) against gemv_q_resident (one block per
// tile) on the decode step's shapes: GDN out_proj (2048 x 4096, gated head norm) and attention
// o_proj (2048 x 4096, no norm). Checked against gemv_q_resident on the same inputs (relative
// RMS), then timed as chains of 30 launches over weight copies past the 60 MB L2, with
// programmatic dependent launch; pairs unpadded, or padded to at most two blocks per SM.
// Measured (H200, commit ac98e9f): out_proj 6.42 us resident, 6.68 pairs, 5.09 pairs padded;
// o_proj 4.63, 4.76, 3.71 (bench/results/cuda-decode-gemv-pair.json).
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gemv_pair.cu -o /tmp/gemv_pair && /tmp/gemv_pair
#include "../../crates/osprey-cuda/kernels/gemv.cu"
#include "harness.cuh"
#include <algorithm>
#include <cmath>
#include <vector>

#define CHAIN 30

// Dynamic shared memory of a pair block at width K: the whole tile's codes, scales and biases,
// half of x as signed bytes and (scale, sum) per group, scratch, the warps' sums, the peer's
// sums, the barrier.
static size_t pair_smem(int K) {
    const size_t gpr = K / 64;
    return 16 * (K / 2 + 2 * gpr * 2) + gpr / 2 * 8 * 16 + gpr / 2 * 8 + 32 * 4 + PAIR_WARPS * 16 * 4 + 16 * 4 + 8;
}

int main() {
    int sms = 0, smem_optin = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    CK(cudaFuncSetAttribute(gemv_q_resident, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
    CK(cudaFuncSetAttribute(gemv_q_resident, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    CK(cudaFuncSetAttribute(gemv_q_pair, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
    CK(cudaFuncSetAttribute(gemv_q_pair, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, gemv_q_pair));
    printf("gemv_q_pair: %d registers, %d B local, %zu B dynamic shared memory\n", fa.numRegs, (int)fa.localSizeBytes, pair_smem(4096));
    const int K = 4096, rows = 2048, tiles = rows / 16, head_dim = 128;
    const size_t bytes = (size_t)rows * (K / 2 + K / 64 * 4);
    const int copies = (int)std::min<size_t>(CHAIN, (150u << 20) / bytes + 1);
    const HostQ4 w = random_q4(rows, K, 0.01f, 0.05f);
    float* x = random_x(K);
    float* z = random_x(K);
    std::vector<float> ones(head_dim, 1.f);
    float* head_w = upload(ones);
    float* outs;
    CK(cudaMalloc(&outs, (size_t)copies * rows * 4));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    for (int gated = 1; gated >= 0; --gated) {
        std::vector<GemvArgs> args(copies);
        for (int c = 0; c < copies; ++c) {
            const ExpertStack d = upload_q4(w);
            GemvArgs a{};
            a.seg[0] = Segment{d.codes, d.scales, d.biases, outs + (size_t)c * rows, rows, 4, 0, 0};
            a.nseg = 1;
            a.x = x;
            a.eps = 1e-6f;
            a.K = K;
            a.group = 64;
            a.tiles = 1;
            a.stages = 1;
            if (gated) {
                a.gate_z = z;
                a.head_norm = head_w;
                a.head_dim = head_dim;
            }
            args[c] = a;
        }
        // kind 0: gemv_q_resident (1 tile per block, padded to one block per SM as decoder.rs
        // does); kind 1: pairs unpadded; kind 2: pairs padded to at most two blocks per SM
        auto run = [&](int kind, bool pdl) {
            std::vector<float> y((size_t)copies * rows);
            CK(cudaMemset(outs, 0, y.size() * 4));
            const double us = graph_us(st, CHAIN, [&](int i) {
                GemvArgs a = args[i % copies];
                cudaLaunchAttribute attr;
                if (kind == 0) {
                    const size_t smem = std::max<size_t>(resident_smem(K, (tiles + sms - 1) / sms), 115 * 1024);
                    const cudaLaunchConfig_t cfg = launch_256(st, std::min(tiles, sms), smem, pdl, attr);
                    CK(cudaLaunchKernelEx(&cfg, gemv_q_resident, a));
                } else {
                    const size_t smem = kind == 1 ? pair_smem(K) : std::max<size_t>(pair_smem(K), 80 * 1024);
                    const cudaLaunchConfig_t cfg = launch_256(st, 2 * tiles, smem, pdl, attr);
                    CK(cudaLaunchKernelEx(&cfg, gemv_q_pair, a));
                }
            });
            CK(cudaMemcpy(y.data(), outs, y.size() * 4, cudaMemcpyDeviceToHost));
            return std::make_pair(us, y);
        };
        printf("%s: %d x %d (%.1f MB, at 4.3 TB/s %.2f us), chains of %d launches over %d weight copies\n",
               gated ? "out_proj, gated head norm" : "o_proj, no norm", rows, K, bytes / 1e6, bytes / 4.3e6, CHAIN, copies);
        const auto ref = run(0, true);
        printf("  %-44s %7.2f us\n", "gemv_q_resident, pdl", ref.first);
        const char* names[] = {"", "gemv_q_pair, pdl", "gemv_q_pair padded to 2 per SM, pdl"};
        for (int kind = 1; kind <= 2; ++kind) {
            const auto got = run(kind, true);
            printf("  %-44s %7.2f us   rel RMS vs resident %.2e\n", names[kind], got.first, rel_rms_f(ref.second, got.second));
        }
    }
    return 0;
}
