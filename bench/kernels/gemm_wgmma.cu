// gemm_q4_wgmma (crates/osprey-cuda/kernels/gemm.cu, included as is) on dense prefill shapes of
// the full model, standalone, with its TMA tensor maps built as the engine builds them: TFLOP/s
// against the ~790 TFLOP/s bf16 ceiling, and clocks per 64-wide K group and block (per wave).
//   in_proj — GDN in_proj q|k|v at a 4K prompt: 4096 positions x 8192 rows x K 2048, f32 store;
//   out_proj — 4096 x 2048 rows x K 4096, added into f32 (the residual);
//   long K  — 132 blocks (one wave) of 256 groups each: 4224 x 1024 x K 16384, the loop without
//             the per-block start and epilogue of short K.
// Random codes, scales, biases and activations; 10 launches in a CUDA graph, best of 5.
// Ran on the H200 (bench/results/cuda-prefill-gemm-wgmma-harness.json): with the epilogue's
// scattered stores (b3c9dde) 325 / 263 / 488 TFLOP/s, staged through shared memory (f31788f)
// 462 / 471 / 542.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gemm_wgmma.cu -o /tmp/gemm_wgmma && /tmp/gemm_wgmma
#include "../../crates/osprey-cuda/kernels/gemm.cu"
#include "harness.cuh"

static void dense(const char* name, int M, int N, int K, int epilogue) {
    const ExpertStack w = upload_q4(random_q4((size_t)N, K, 0.002f, 0.01f));
    std::vector<__nv_bfloat16> ha((size_t)M * K);
    for (auto& v : ha) v = __float2bfloat16((rand() % 2001 - 1000) / 1000.f);
    WgmmaArgs args{};
    GemmArgs& g = args.p;
    g.a = upload(ha);
    g.codes[0] = g.codes[1] = w.codes;
    g.scales[0] = g.scales[1] = w.scales;
    g.biases[0] = g.biases[1] = w.biases;
    CK(cudaMalloc(&g.out, (size_t)M * N * 4));
    CK(cudaMemset(g.out, 0, (size_t)M * N * 4));
    g.M = M; g.N = N; g.K = K; g.group = 64; g.ldo = N; g.epilogue = epilogue; g.k_splits = 1;
    tensor_map(&args.x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, g.a, {(uint64_t)K, (uint64_t)M}, {64, 128}, 2, true);
    for (int i = 0; i < 2; ++i) {
        tensor_map(&args.codes[i], CU_TENSOR_MAP_DATA_TYPE_UINT32, w.codes, {(uint64_t)K / 8, (uint64_t)N}, {8, 256}, 4, false);
        tensor_map(&args.scales[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, w.scales, {(uint64_t)K / 64, (uint64_t)N}, {8, 256}, 2, false);
        tensor_map(&args.biases[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, w.biases, {(uint64_t)K / 64, (uint64_t)N}, {8, 256}, 2, false);
    }
    const int smem = WG_SMEM_BYTES;
    CK(cudaFuncSetAttribute(gemm_q4_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid(N / 256, (M + 127) / 128, 1);
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    const double us = graph_us(st, 10, [&](int) { gemm_q4_wgmma<<<grid, 256, smem, st>>>(args); });
    CK(cudaGetLastError());
    CK(cudaStreamDestroy(st));
    int clock_khz;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    const double flop = 2.0 * M * N * K, waves = std::ceil(grid.x * grid.y / 132.0);
    printf("%-9s %9.1f us  %6.1f TFLOP/s (%4.1f%% of 790)  %5.0f clocks per group and block\n", name, us, flop / us / 1e6,
           100.0 * flop / us / 1e6 / 790.0, us * clock_khz / 1e3 / waves / (K / 64));
}

int main() {
    dense("in_proj", 4096, 8192, 2048, EPI_STORE);
    dense("out_proj", 4096, 2048, 4096, EPI_ADD);
    dense("long K", 4224, 1024, 16384, EPI_STORE);
    return 0;
}
