// A chain of decode GEMVs as separate launches in a CUDA graph against the same chain inside one
// resident launch with grid barriers between them: the gain a persistent decode kernel would get
// per phase, measured with the engine's own tile GEMV (crates/osprey-cuda/kernels/gemv.cu,
// included as is). Ran on the H200 at
// 9872248 (bf16 tile fragments then): 11.17 us per separate launch, 14.56 inside one launch
// (bench/results/cuda-kernel-harnesses-h200.json).
// Shape: GDN in_proj (12352 x 2048, 4-bit group 64), 30 GEMVs on 8 copies of the weights (past
// the 60 MB L2), no prologue norm; grid 3 blocks x 256 threads per SM in both forms. ptxas: the
// chain kernel spills more than gemv_q_tiles alone (~460 vs 128 bytes at the 80-register cap),
// so its figure is a lower bound on what a persistent kernel built for it would reach.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/persistent_chain.cu -o /tmp/persistent_chain && /tmp/persistent_chain
#include "../../crates/osprey-cuda/kernels/gemv.cu"
#include "harness.cuh"
#include <cmath>
#include <vector>

#define CHAIN 30
#define COPIES 8

struct Chain {
    GemvArgs step[CHAIN];
};

// the chain's arguments travel as one kernel parameter block (7.7 KB: Hopper takes up to 32 KB),
// read through the constant bank as a single launch's would be
extern "C" __global__ void __launch_bounds__(256, 3) gemv_chain(const __grid_constant__ Chain c, GridBarrier b) {
    for (int i = 0; i < CHAIN; ++i) {
        gemv_body<true>(c.step[i]);
        grid_barrier(b);
    }
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int N = 12352, K = 2048, grid = sms * 3;
    const HostQ4 w = random_q4(N, K, 0.01f, 0.05f);
    float* x = random_x(K);
    float *out_graph, *out_chain;
    CK(cudaMalloc(&out_graph, (size_t)CHAIN * N * 4));
    CK(cudaMalloc(&out_chain, (size_t)CHAIN * N * 4));
    Segment copies[COPIES];
    for (int c = 0; c < COPIES; ++c) {
        const ExpertStack d = upload_q4(w);
        copies[c] = Segment{d.codes, d.scales, d.biases, nullptr, N, 4, 0, 0};
    }
    auto args_for = [&](float* out, int i) {
        GemvArgs a{};
        a.seg[0] = copies[i % COPIES];
        a.seg[0].out = out + (size_t)i * N;
        a.x = x;
        a.nseg = 1;
        a.K = K;
        a.group = 64;
        a.tiles = 1;
        return a;
    };
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    // separate launches in one graph
    cudaGraph_t gr;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < CHAIN; ++i) {
        GemvArgs a = args_for(out_graph, i);
        gemv_q_tiles<<<grid, 256, 0, st>>>(a);
    }
    CK(cudaStreamEndCapture(st, &gr));
    CK(cudaGraphInstantiate(&ge, gr, 0));
    const float us_graph = best_ms(st, [&] { CK(cudaGraphLaunch(ge, st)); }) * 1e3f / CHAIN;
    // one resident launch with grid barriers
    Chain hchain;
    for (int i = 0; i < CHAIN; ++i) hchain.step[i] = args_for(out_chain, i);
    unsigned* bar;
    CK(cudaMalloc(&bar, 64));
    CK(cudaMemset(bar, 0, 64));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_chain, 256, 0));
    if (per_sm * sms < grid) {
        printf("only %d blocks per SM fit: the chain's grid would not be resident\n", per_sm);
        return 1;
    }
    const float us_chain = best_ms(st, [&] { gemv_chain<<<grid, 256, 0, st>>>(hchain, GridBarrier{bar, bar + 8}); }) * 1e3f / CHAIN;
    // the two forms compute the same outputs
    std::vector<float> a((size_t)CHAIN * N), b((size_t)CHAIN * N);
    CK(cudaMemcpy(a.data(), out_graph, a.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), out_chain, b.size() * 4, cudaMemcpyDeviceToHost));
    double diff = 0.0;
    for (size_t i = 0; i < a.size(); ++i) diff = fmax(diff, fabs((double)a[i] - b[i]));
    printf("in_proj GEMV x %d: separate launches %.2f us each, one launch with grid barriers %.2f us each "
           "(max |difference| %.3g)\n", CHAIN, us_graph, us_chain, diff);
    return 0;
}
