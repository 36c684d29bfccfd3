// Why the experts' top-8 selection takes ~1.8 us inside the decode step when its 8 rounds take
// 0.76 us alone (select_topk.cu: 1,499 cycles on one warp). Session 40 ruled out the two
// selecting warps of an SM (a 256-block grid, 2 blocks an SM: 1,642 cycles with one or two
// selecting). What the step has and those harnesses lacked: the per-round hook, in which the
// block's lane 0, in the round that chooses its slot's expert, initialises two mbarriers and asks
// the copy engine for the slot's gate and up tiles (fence.proxy.async, 6 bulk copies, 34 KB), and
// seven other warps working beside the selecting one (building x's byte form, polling L2 for
// tagged words). This times warp 0's 8 rounds (clock64, median and maximum over the blocks) in a
// 256 x 256 grid, 2 blocks an SM, every block selecting at once (a grid-wide arrival first):
//   plain  — select_from with no hook (session 40's grid harness);
//   hook   — moe.cu's hook, the copies from a 1 GB expert stack at the chosen expert's rows;
//   busy   — plain, warps 1-7 meanwhile polling an L2 word that never changes (as await_tagged);
//   both   — hook and busy.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/select_hook.cu -o /tmp/select_hook && /tmp/select_hook
#include "harness.cuh"
#include "../../crates/osprey-cuda/kernels/moe.cu"

#define H_ 2048
#define I_ 512

template <bool HOOK, bool BUSY>
__global__ void __launch_bounds__(256, 2) select_in_grid(const float* logits, const uint32_t* codes, const __nv_bfloat16* scales,
                                                         const __nv_bfloat16* biases, unsigned* arrive, volatile unsigned* never,
                                                         long long* out, int* sink) {
    extern __shared__ __align__(128) char hook_tiles[];
    char* tiles = hook_tiles;  // [gate, up][16][H/2]
    __nv_bfloat16* sc = reinterpret_cast<__nv_bfloat16*>(tiles + 2 * 16 * (H_ / 2));
    __nv_bfloat16* bi = sc + 2 * 16 * (H_ / 64);
    __shared__ __align__(8) uint64_t bars[2];
    __shared__ int ids[8];
    __shared__ float wts[8];
    __shared__ volatile int done;
    const int lane = threadIdx.x & 31, slot = blockIdx.x / (I_ / 16), f0 = (blockIdx.x % (I_ / 16)) * 16;
    if (threadIdx.x == 0) {
        done = 0;
        atomicAdd(arrive, 1u);
        while (atomicAdd(arrive, 0u) < gridDim.x) {}
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float lv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) lv[i] = logits[lane + 32 * i] + 1e-3f * (float)(blockIdx.x & 7);
        const auto ask_slot = [&](int r, int e) {
            if (!HOOK || r != slot || threadIdx.x != 0) return;
            const size_t row0 = (size_t)e * I_ + f0;
            fence_proxy_async();
            mbar_init(&bars[0], 1);
            mbar_init(&bars[1], 1);
            mbar_init_fence();
            mbar_arrive_expect_bytes(&bars[0], q4_rows_bytes(16, H_));
            mbar_arrive_expect_bytes(&bars[1], q4_rows_bytes(16, H_));
            copy_q4_rows(tiles, sc, bi, 0, codes, scales, biases, row0, 16, H_, &bars[0]);
            copy_q4_rows(tiles, sc, bi, 1, codes + (size_t)256 * I_ * H_ / 8, scales, biases, row0, 16, H_, &bars[1]);
        };
        __syncwarp();
        const long long t0 = clock64();
        select_from(lv, Routing{nullptr, 256, 8, 1}, ids, wts, nullptr, ask_slot);
        __syncwarp();
        const long long t1 = clock64();
        if (lane == 0) {
            out[blockIdx.x] = t1 - t0;
            done = 1;
        }
        if (HOOK && lane == 0) {
            mbar_wait(&bars[0], 0);
            mbar_wait(&bars[1], 0);
        }
    } else if (BUSY) {
        // warps 1-7 poll one L2 word (as await_tagged does for the shared expert's rows) until
        // warp 0 has selected
        unsigned seen = 0;
        while (!done) seen += __ldcg(const_cast<const unsigned*>(never) + (threadIdx.x & 7));
        if (seen == 0x7FFFFFFFu) sink[0] = (int)seen;
    }
    __syncthreads();
    if (HOOK && threadIdx.x == 0 && tiles[5] == 0x7F && sc[3] == __float2bfloat16(1234.f)) sink[0] = 1;
}

template <bool HOOK, bool BUSY>
static void run(const char* name, const float* logits, const uint32_t* codes, const __nv_bfloat16* scales,
                const __nv_bfloat16* biases, unsigned* arrive, unsigned* never, long long* out, int* sink, bool& first) {
    const int smem = 2 * 16 * (H_ / 2 + 2 * (H_ / 64) * 2);
    CK(cudaFuncSetAttribute(select_in_grid<HOOK, BUSY>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<long long> all;
    for (int rep = 0; rep < 5; ++rep) {
        CK(cudaMemset(arrive, 0, sizeof(unsigned)));
        select_in_grid<HOOK, BUSY><<<256, 256, smem>>>(logits, codes, scales, biases, arrive, never, out, sink);
        CK(cudaDeviceSynchronize());
        std::vector<long long> r(256);
        CK(cudaMemcpy(r.data(), out, 256 * sizeof(long long), cudaMemcpyDeviceToHost));
        all.insert(all.end(), r.begin(), r.end());
    }
    std::sort(all.begin(), all.end());
    printf("%s{\"form\": \"%s\", \"median_cycles\": %lld, \"p90_cycles\": %lld, \"max_cycles\": %lld}", first ? "" : ",\n  ", name,
           all[all.size() / 2], all[all.size() * 9 / 10], all.back());
    first = false;
}

int main() {
    std::vector<float> h(256);
    srand(7);
    for (float& v : h) v = (float)rand() / RAND_MAX * 4.f - 2.f;
    float* logits;
    uint32_t* codes;
    __nv_bfloat16 *scales, *biases;
    unsigned *arrive, *never;
    long long* out;
    int* sink;
    // gate and up stacks of 256 experts x 512 rows x 2048 (4-bit): 256 MB of codes each
    const size_t rows = (size_t)256 * I_;
    CK(cudaMalloc(&logits, 256 * sizeof(float)));
    CK(cudaMalloc(&codes, 2 * rows * H_ / 2));
    CK(cudaMalloc(&scales, rows * (H_ / 64) * 2));
    CK(cudaMalloc(&biases, rows * (H_ / 64) * 2));
    CK(cudaMalloc(&arrive, sizeof(unsigned)));
    CK(cudaMalloc(&never, 64));
    CK(cudaMalloc(&out, 256 * sizeof(long long)));
    CK(cudaMalloc(&sink, sizeof(int)));
    CK(cudaMemset(never, 0, 64));
    CK(cudaMemcpy(logits, h.data(), 256 * sizeof(float), cudaMemcpyHostToDevice));
    bool first = true;
    printf("{\"note\": \"warp 0's 8 selection rounds in a 256 x 256 grid (2 blocks an SM), clock64 cycles over 5 launches x 256 blocks\", \"results\": [\n  ");
    run<false, false>("plain", logits, codes, scales, biases, arrive, never, out, sink, first);
    run<true, false>("hook", logits, codes, scales, biases, arrive, never, out, sink, first);
    run<false, true>("busy", logits, codes, scales, biases, arrive, never, out, sink, first);
    run<true, true>("both", logits, codes, scales, biases, arrive, never, out, sink, first);
    printf("\n]}\n");
    return 0;
}
