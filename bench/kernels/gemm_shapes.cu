// The prefill GEMM (crates/osprey-cuda/kernels/gemm.cu, included as is) on the 4K-prompt shapes
// of the full model, standalone: TFLOP/s against the ~790 TFLOP/s bf16 ceiling, so GEMM variants
// can be compared in seconds of GPU time. Ran on the H200 at
// 9872248: dense 218, gate/up 216, down 123 TFLOP/s (cuda-kernel-harnesses-h200.json).
//   dense   — GDN in_proj: 4096 positions x 12352 rows x K 2048, f32 store (MT = 8);
//   gate/up — routed experts grouped by expert, uniform routing (4096 tokens x top-8 over 256
//             experts = 128 rows each), gate and up stacks of 512 rows, K 2048, SwiGLU to bf16;
//   down    — the same grouping, 2048 rows per expert, K 512, scaled by a routing weight.
// Random 4-bit codes, bf16 scales/biases and activations; 10 launches in a CUDA graph, best of 5.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gemm_shapes.cu -o /tmp/gemm_shapes && /tmp/gemm_shapes
#include "../../crates/osprey-cuda/kernels/gemm.cu"
#include "harness.cuh"
#include <vector>

static ExpertStack random_weights(size_t rows, int K) { return upload_q4(random_q4(rows, K, 0.002f, 0.01f)); }

static __nv_bfloat16* random_activations(size_t n) {
    std::vector<__nv_bfloat16> a(n);
    for (auto& v : a) v = __float2bfloat16((rand() % 2001 - 1000) / 1000.f);
    return upload(a);
}

// microseconds per launch: 10 launches in one CUDA graph, best of 5
static double time_launches(void (*kernel)(GemmArgs), const GemmArgs& g, dim3 grid) {
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    const double us = graph_us(st, 10, [&](int) { kernel<<<grid, 256, 0, st>>>(g); });
    CK(cudaStreamDestroy(st));
    return us;
}

static void report(const char* name, double us, double flop) {
    printf("%-8s %9.1f us  %7.1f TFLOP/s  (%4.1f%% of 790)\n", name, us, flop / us / 1e6, 100.0 * flop / us / 1e6 / 790.0);
}

int main() {
    const int T = 4096, H = 2048, I = 512, E = 256, TOPK = 8, MT = 8, BM = 8 * MT;
    const int P = T * TOPK, per_expert = P / E;
    // dense: GDN in_proj
    {
        const int N = 12352, K = H;
        ExpertStack w = random_weights(N, K);
        GemmArgs g{};
        g.a = random_activations((size_t)T * K);
        g.codes[0] = g.codes[1] = w.codes;
        g.scales[0] = g.scales[1] = w.scales;
        g.biases[0] = g.biases[1] = w.biases;
        CK(cudaMalloc(&g.out, (size_t)T * N * 4));
        g.M = T; g.N = N; g.K = K; g.group = 64; g.ldo = N; g.epilogue = EPI_STORE; g.k_splits = 1;
        report("dense", time_launches(gemm_q4_m8, g, dim3((N + 255) / 256, T / BM, 1)), 2.0 * T * N * K);
    }
    // the grouped plan: every expert's rows in tiles of BM positions
    std::vector<int4> plan;
    for (int e = 0; e < E; ++e)
        for (int m0 = e * per_expert; m0 < (e + 1) * per_expert; m0 += BM)
            plan.push_back(make_int4(e, m0, (e + 1) * per_expert, 0));
    std::vector<int> a_rows(P), count{(int)plan.size()};
    for (int p = 0; p < P; ++p) a_rows[p] = (int)(((long long)p * 7919) % T);
    std::vector<float> row_scale(P, 0.125f);
    int4* d_plan = upload(plan);
    int* d_count = upload(count);
    int* d_rows = upload(a_rows);
    float* d_scale = upload(row_scale);
    {
        ExpertStack gate = random_weights((size_t)E * I, H), up = random_weights((size_t)E * I, H);
        GemmArgs g{};
        g.a = random_activations((size_t)T * H);
        g.a_rows = d_rows;
        g.codes[0] = gate.codes; g.codes[1] = up.codes;
        g.scales[0] = gate.scales; g.scales[1] = up.scales;
        g.biases[0] = gate.biases; g.biases[1] = up.biases;
        g.expert_rows = I;
        g.tiles = d_plan; g.tile_count = d_count;
        CK(cudaMalloc(&g.out_h, (size_t)P * I * 2));
        g.M = P; g.N = I; g.K = H; g.group = 64; g.ldo = I; g.epilogue = EPI_SWIGLU; g.k_splits = 1;
        report("gate/up", time_launches(gemm_q4_m8, g, dim3((I + 127) / 128, (unsigned)plan.size(), 1)), 2.0 * P * 2 * I * H);
    }
    {
        ExpertStack down = random_weights((size_t)E * H, I);
        GemmArgs g{};
        g.a = random_activations((size_t)P * I);
        g.codes[0] = g.codes[1] = down.codes;
        g.scales[0] = g.scales[1] = down.scales;
        g.biases[0] = g.biases[1] = down.biases;
        g.expert_rows = H;
        g.tiles = d_plan; g.tile_count = d_count;
        g.row_scale = d_scale;
        CK(cudaMalloc(&g.out, (size_t)P * H * 4));
        g.M = P; g.N = H; g.K = I; g.group = 64; g.ldo = H; g.epilogue = EPI_SCALED; g.k_splits = 1;
        report("down", time_launches(gemm_q4_m8, g, dim3((H + 255) / 256, (unsigned)plan.size(), 1)), 2.0 * P * H * I);
    }
    return 0;
}
