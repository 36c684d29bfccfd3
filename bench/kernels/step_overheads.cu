// What a decode step pays per kernel boundary, measured standalone: the question behind a
// persistent (one launch per layer or per step) decode kernel. Ran on the H200 at
// 9872248: launch 1.03 us, chained 1.20, grid barrier 1.74 (bench/results/cuda-kernel-harnesses-h200.json).
//   launch   — N back-to-back launches of an empty kernel in one CUDA graph, at the decode step's
//              typical geometry (resident grid of 3 blocks x 256 threads per SM, 36 KB of static
//              shared memory like the GEMV): the fixed cost of one kernel boundary;
//   chained  — the same with each block reading one value the previous launch wrote (a data
//              dependency through L2, as between the step's kernels);
//   barrier  — one resident launch that crosses N grid-wide barriers (an arrival counter and a
//              generation flag in global memory, acquire/release): the cost that would replace
//              each boundary inside a persistent kernel.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/step_overheads.cu -o /tmp/step_overheads && /tmp/step_overheads
#include "harness.cuh"

extern "C" __global__ void __launch_bounds__(256, 3) empty_kernel(int* sink) {
    __shared__ int pad[9 * 1024];  // 36 KB, as the GEMV holds
    if (threadIdx.x == 0 && sink[0] == 123456789) { pad[0] = 1; sink[1] = pad[0]; }
}

extern "C" __global__ void __launch_bounds__(256, 3) chained_kernel(int* v, int step) {
    __shared__ int got;
    if (threadIdx.x == 0) got = *(volatile int*)v;  // what the previous launch wrote
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) *v = got + 1 + 0 * step;
}

extern "C" __global__ void __launch_bounds__(256, 3) barrier_kernel(GridBarrier b, int n, int* sink) {
    for (int i = 0; i < n; ++i) grid_barrier(b);
    if (blockIdx.x == 0 && threadIdx.x == 0) sink[0] = n;
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int N = 260, grid = sms * 3;
    int* buf;
    unsigned* bar;
    CK(cudaMalloc(&buf, 64));
    CK(cudaMalloc(&bar, 64));
    CK(cudaMemset(buf, 0, 64));
    CK(cudaMemset(bar, 0, 64));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    for (int kind = 0; kind < 3; ++kind) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        if (kind == 0) {
            for (int i = 0; i < N; ++i) empty_kernel<<<grid, 256, 0, st>>>(buf);
        } else if (kind == 1) {
            for (int i = 0; i < N; ++i) chained_kernel<<<grid, 256, 0, st>>>(buf, i);
        } else {
            barrier_kernel<<<grid, 256, 0, st>>>(GridBarrier{bar, bar + 8}, N, buf);
        }
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        const float ms = best_ms(st, [&] { CK(cudaGraphLaunch(ge, st)); });
        const char* name[] = {"empty launches", "chained launches", "grid barriers (one launch)"};
        printf("%-28s grid %4d x 256: %4d in %8.1f us = %6.2f us each\n", name[kind], grid, N, ms * 1e3, ms * 1e3 / N);
    }
    return 0;
}
