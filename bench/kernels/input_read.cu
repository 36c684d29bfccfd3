// What it costs a decode kernel's blocks to read the step's input vector: every block of a
// 256-block launch (as moe_routed_experts) reads all 2,048 floats of x (8 KB), sums their squares
// (the RMS norm's block reduction) and one block writes x anew for the next launch, chained in a
// CUDA graph. The question behind it: the 4K timeline has x normalised ~1.8 us after the
// release in the experts launch (and in the folded input projection of
// cuda-decode-next-in-proj-fold-ablation.json): is that 256 blocks asking L2 for the same 64
// lines at once, which copies of x (replicas, block b reading copy b mod R) would spread?
//   chained   — each block reads one value the previous launch wrote (the boundary alone);
//   x, R=1    — every block reads the same 8 KB;
//   x, R=8/64/256 — block b reads copy b mod R; the previous launch's block r wrote copy r.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/input_read.cu -o /tmp/input_read && /tmp/input_read
#include "harness.cuh"

#define H 2048

extern "C" __global__ void __launch_bounds__(256, 2) chained_value(float* x, int* sink) {
    __shared__ float got;
    if (threadIdx.x == 0) got = __ldcg(x);
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) x[0] = got + 1.f;
    if (got == -1.f) sink[0] = 1;
}

// (spent: each block's nanoseconds from its start to its sum, when given)
extern "C" __global__ void __launch_bounds__(256, 2) read_input(float* x, int replicas, int* sink, unsigned* spent) {
    __shared__ float scratch[32];
    const unsigned long long t0 = now_ns();
    float4 a, b;
    const float total = read_slots_sum_squares(x + (size_t)(blockIdx.x % replicas) * H, a, b, scratch);
    if (spent && threadIdx.x == 0) spent[blockIdx.x] = (unsigned)(now_ns() - t0);
    if ((int)blockIdx.x < replicas) write_slots_scaled(x + (size_t)blockIdx.x * H, a, b, total, H);
    if (total == -1.f) sink[0] = 1;
}

int main() {
    const int N = 200, grid = 256;
    float* x;
    int* sink;
    CK(cudaMalloc(&x, (size_t)256 * H * 4));
    CK(cudaMemset(x, 0, (size_t)256 * H * 4));
    CK(cudaMalloc(&sink, 64));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    printf("chained (one value)      %6.2f us a launch\n", graph_us(st, N, [&](int) { chained_value<<<grid, 256, 0, st>>>(x, sink); }));
    unsigned* spent;
    CK(cudaMalloc(&spent, grid * 4));
    for (int r : {1, 8, 64, 256}) {
        const double us = graph_us(st, N, [&](int) { read_input<<<grid, 256, 0, st>>>(x, r, sink, nullptr); });
        // one more launch behind a chained one, timed inside: start to sum, per block
        chained_value<<<grid, 256, 0, st>>>(x, sink);
        read_input<<<grid, 256, 0, st>>>(x, r, sink, spent);
        double median, max;
        median_max_us(spent, grid, median, max);
        printf("x read, %3d copies       %6.2f us a launch; in the kernel, start to sum: median %.2f us, max %.2f\n", r, us,
               median, max);
    }
    return 0;
}
