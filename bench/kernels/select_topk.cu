// What the MoE's top-8 selection costs by itself. In the 4K decode timeline (session 39) warp 0 of
// moe_routed_experts has the router's 256 logits polled 3.1 us after the launch's release and has
// selected at 4.9: 8 rounds of select_from (each an 8-key scan and two redux.sync), 0.5 us to
// round 0, then ~0.18 us a round. A top-8 by merges instead (each lane sorts its 8, five
// butterfly steps keep the top 8 of a lane's list and its partner's: no warp reduction) selected
// 1.3 us later in the step. This harness times both on one warp with nothing else running, warm
// (the selection repeated in a loop, each on logits perturbed by the last choice) and the
// launch's first selection.
// Ran on the H200 (bench/results/cuda-decode-session39-ablations.json): the 8 rounds take 1,499
// cycles (0.76 us at 1,980 MHz), the merged form 1,990, first and repeated alike; both forms
// choose the same experts. So the rounds are the faster code, and in the step (~1.8 us from the
// polled logits to the selection) each takes about twice what it takes alone.
// Build here: nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 bench/kernels/select_topk.cu
//   -L<cu13>/lib -lcudart_static -o select_topk (run the binary on the GPU machine).
#include "harness.cuh"
#include "../../crates/osprey-cuda/kernels/moe.cu"

__device__ __forceinline__ unsigned long long choice_word(uint32_t key, int e) {
    return ((unsigned long long)key << 32) | (0xFFFFu - (uint32_t)e);
}
__device__ __forceinline__ void order_pair(unsigned long long& hi, unsigned long long& lo) {
    const unsigned long long a = hi, b = lo;
    hi = a > b ? a : b;
    lo = a > b ? b : a;
}

// The merged top 8 of 8 words a lane (Batcher's 19-comparator sort, then five butterfly merges).
__device__ __forceinline__ void top8_words(unsigned long long (&c)[8]) {
    constexpr int NET[19][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {0, 4}, {1, 5}, {2, 6}, {3, 7}, {0, 1}, {2, 3},
                                {4, 5}, {6, 7}, {2, 4}, {3, 5}, {1, 4}, {3, 6}, {1, 2}, {3, 4}, {5, 6}};
#pragma unroll
    for (int n = 0; n < 19; ++n) order_pair(c[NET[n][0]], c[NET[n][1]]);
#pragma unroll 1
    for (int m = 1; m < 32; m <<= 1) {
        unsigned long long o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = __shfl_xor_sync(FULL_MASK, c[i], m);
#pragma unroll
        for (int i = 0; i < 8; ++i) c[i] = c[i] > o[7 - i] ? c[i] : o[7 - i];
#pragma unroll
        for (int d = 4; d > 0; d >>= 1)
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if ((i & d) == 0) order_pair(c[i], c[i + d]);
    }
}

__device__ __forceinline__ int select_merged(const float (&lv)[8], int* ids) {
    const int lane = threadIdx.x & 31;
    unsigned long long c[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = choice_word(order_key(lv[i]), lane + 32 * i);
    top8_words(c);
    int my_id = 0;
#pragma unroll
    for (int r = 0; r < 8; ++r)
        if (lane == r) my_id = (int)(0xFFFFu - (uint32_t)c[r]);
    if (lane < 8) ids[lane] = my_id;
    return __shfl_sync(FULL_MASK, my_id, 7);
}

// out[0]: cycles of the launch's first selection; out[1]: mean cycles of the next `reps`;
// out[2..9]: the last selection's experts (the two forms must agree).
template <bool MERGED>
__global__ void time_selection(const float* logits, int reps, long long* out) {
    __shared__ int ids[8];
    __shared__ float wts[8];
    const int lane = threadIdx.x & 31;
    float lv[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) lv[i] = logits[lane + 32 * i];
    long long first = 0, total = 0;
    int last = 0;
    for (int r = 0; r <= reps; ++r) {
#pragma unroll
        for (int i = 0; i < 8; ++i) lv[i] += 1e-30f * (float)last;  // each selection after the last
        const long long t0 = clock64();
        if constexpr (MERGED) {
            last = select_merged(lv, ids);
        } else {
            select_from(lv, Routing{nullptr, 256, 8, 1}, ids, wts, nullptr);
            __syncwarp();
            last = ids[7];
        }
        __syncwarp();
        const long long dt = clock64() - t0;
        if (r == 0) first = dt;
        else total += dt;
    }
    if (lane == 0) {
        out[0] = first;
        out[1] = total / reps;
        for (int i = 0; i < 8; ++i) out[2 + i] = ids[i];
    }
}

__global__ void touch(float* p) { p[threadIdx.x] += 1.f; }

int main() {
    std::vector<float> h(256);
    srand(7);
    for (float& v : h) v = (float)rand() / RAND_MAX * 4.f - 2.f;
    float *logits, *junk;
    long long* out;
    CK(cudaMalloc(&logits, 256 * sizeof(float)));
    CK(cudaMalloc(&junk, 1024 * sizeof(float)));
    CK(cudaMalloc(&out, 10 * sizeof(long long)));
    CK(cudaMemcpy(logits, h.data(), 256 * sizeof(float), cudaMemcpyHostToDevice));
    int clock_khz;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    printf("{\"clock_mhz\": %d, \"forms\": [", clock_khz / 1000);
    for (int form = 0; form < 2; ++form) {
        long long firsts = 0, means = 0, r[10] = {};
        const int runs = 20;
        for (int run = 0; run < runs; ++run) {
            touch<<<1, 1024>>>(junk);
            if (form == 0) time_selection<false><<<1, 32>>>(logits, 1000, out);
            else time_selection<true><<<1, 32>>>(logits, 1000, out);
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(r, out, sizeof(r), cudaMemcpyDeviceToHost));
            firsts += r[0];
            means += r[1];
        }
        printf("%s{\"form\": \"%s\", \"first_cycles\": %lld, \"warm_cycles\": %lld, \"experts\": [", form ? ", " : "",
               form ? "merged (sort + 5 butterfly merges)" : "8 rounds of redux.sync (select_from)", firsts / runs, means / runs);
        for (int i = 0; i < 8; ++i) printf("%s%lld", i ? ", " : "", r[2 + i]);
        printf("]}");
    }
    printf("]}\n");
    return 0;
}
