// Whether a weight stream slows other SMs' latency-bound reads. The decode step's critical chain
// is a run of small reads (x, a layer's route rows, tagged meeting words) that a stream of weight
// copies asked for by the same SMs delays by microseconds (cuda-decode-next-in-proj-fold-ablation.json,
// cuda-decode-prefetch-next-in-proj-ablation.json). If a few "loader" SMs streaming the next
// weights into L2 leave the other SMs' reads as fast as on an idle GPU, a decode step could keep
// DRAM busy through its latency-bound phases without slowing them.
//   reader — the chain of input_read.cu: 200 launches of 232 blocks (two per SM on the 116 SMs the
//            loader leaves), each reading all of x (8 KB, L2 hits) and summing its squares; also
//            each block its own cold 8 KB (DRAM);
//   loader — launched first on its own stream: 16 blocks of 1,024 threads and all of an SM's
//            shared memory (so no reader block lands beside one), streaming 4 GB by
//            cp.async.bulk.prefetch.L2 (into L2 only), or by bulk copies into shared memory, for
//            the whole chain.
// Reported: the chain's microseconds a launch and, inside one launch timed while the loader runs,
// each block's start-to-sum time.
// Ran on the H200 at e3212fa (bench/results/cuda-loader-sms-h200.json): L2-hit reads 0.61 us start to
// sum without the loader, 0.58 with it; cold DRAM reads 1.06 -> 1.28-1.34 us (max 1.25 -> 1.98).
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/loader_sms.cu -o /tmp/loader_sms && /tmp/loader_sms
#include "harness.cuh"

#define H 2048
#define LOADERS 16
#define CHUNK 16384

// mode 0: prefetch into L2; 1: bulk copies into shared memory (a ring of 8 chunks)
extern "C" __global__ void __launch_bounds__(1024, 1) loader(const char* src, size_t bytes, int mode, int* sink) {
    extern __shared__ __align__(128) char ring[];
    __shared__ __align__(8) uint64_t full[8];
    if (threadIdx.x != 0) return;
    const size_t per = bytes / gridDim.x / CHUNK * CHUNK;
    const char* base = src + blockIdx.x * per;
    const int n = (int)(per / CHUNK);
    if (mode == 0) {
        for (int i = 0; i < n; ++i)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + (size_t)i * CHUNK), "r"(CHUNK) : "memory");
        return;
    }
    for (int s = 0; s < 8; ++s) mbar_init(&full[s], 1);
    mbar_init_fence();
    for (int i = 0; i < min(8, n); ++i) {
        mbar_arrive_expect_bytes(&full[i], CHUNK);
        bulk_copy_to_shared(ring + i * CHUNK, base + (size_t)i * CHUNK, CHUNK, &full[i]);
    }
    int acc = 0;
    for (int i = 0; i < n; ++i) {
        const int s = i % 8;
        mbar_wait(&full[s], (i / 8) & 1);
        acc += ring[s * CHUNK + 5];
        if (i + 8 < n) {
            mbar_arrive_expect_bytes(&full[s], CHUNK);
            bulk_copy_to_shared(ring + s * CHUNK, base + (size_t)(i + 8) * CHUNK, CHUNK, &full[s]);
        }
    }
    if (acc == 123456789) sink[0] = acc;
}

// x: every block reads all of it (own == 0) or its own cold 8 KB at own + block·H (then advanced
// by the launch index so that no launch finds it in L2)
extern "C" __global__ void __launch_bounds__(256, 2) reader(float* x, const float* own, int* sink, unsigned* spent) {
    __shared__ float scratch[32];
    const unsigned long long t0 = now_ns();
    float4 a, b;
    const float total = read_slots_sum_squares(own ? own + (size_t)blockIdx.x * H : x, a, b, scratch);
    if (spent && threadIdx.x == 0) spent[blockIdx.x] = (unsigned)(now_ns() - t0);
    if (blockIdx.x == 0) write_slots_scaled(x, a, b, total, H);
    if (total == -1.f) sink[0] = 1;
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int grid = 2 * (sms - LOADERS), N = 200;
    const size_t stream_bytes = (size_t)4 << 30, cold_bytes = (size_t)N * grid * H * 4;
    char* big;
    float *x, *cold;
    int* sink;
    unsigned* spent;
    CK(cudaMalloc(&big, stream_bytes));
    CK(cudaMemset(big, 1, stream_bytes));
    CK(cudaMalloc(&cold, cold_bytes));
    CK(cudaMemset(cold, 0, cold_bytes));
    CK(cudaMalloc(&x, H * 4));
    CK(cudaMemset(x, 0, H * 4));
    CK(cudaMalloc(&sink, 64));
    CK(cudaMalloc(&spent, grid * 4));
    int smem_optin = 0;
    CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    const int loader_smem = smem_optin - 1024;  // less its static barriers, rounded up
    CK(cudaFuncSetAttribute(loader, cudaFuncAttributeMaxDynamicSharedMemorySize, loader_smem));
    cudaStream_t sl, sr;
    CK(cudaStreamCreateWithFlags(&sl, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&sr, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const char* loads[] = {"no loader", "loader: prefetch to L2", "loader: bulk copies to smem"};
    for (int cold_reads = 0; cold_reads < 2; ++cold_reads) {
        for (int mode = -1; mode < 2; ++mode) {
            for (int rep = 0; rep < 2; ++rep) {
                CK(cudaDeviceSynchronize());
                if (mode >= 0) loader<<<LOADERS, 1024, loader_smem, sl>>>(big, stream_bytes, mode, sink);
                CK(cudaEventRecord(e0, sr));
                for (int i = 0; i < N; ++i)
                    reader<<<grid, 256, 0, sr>>>(x, cold_reads ? cold + (size_t)i * grid * H : nullptr, sink,
                                                 i == N / 2 ? spent : nullptr);
                CK(cudaEventRecord(e1, sr));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                double median, max;
                median_max_us(spent, grid, median, max);
                CK(cudaStreamSynchronize(sl));
                if (rep == 1)
                    printf("%-12s %-30s %6.2f us a launch; start to sum median %.2f us, max %.2f\n",
                           cold_reads ? "own cold 8KB" : "shared x", loads[mode + 1], ms * 1e3 / N, median, max);
            }
        }
    }
    return 0;
}
