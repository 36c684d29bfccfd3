// What the experts' copy hook costs, part by part (session 41). In the step, a block's thread 0
// asks for its slot's gate and up tiles in the selection round that picks the slot's expert:
// fence.proxy.async, two mbarrier inits and their fence, two expect-tx arrivals, then 6 bulk
// copies (codes 16 KB, scales and biases 1 KB each, for gate and for up); select_hook.cu found
// that this takes ~1,900 cycles (~1 us), which delays the slot's copies by as much. Here thread 0
// of every block of a 256 x 256 grid (2 blocks an SM, all at once after a grid-wide arrival)
// times each part with clock64:
//   fence — fence.proxy.async.shared::cta;  init — the 2 inits + fence.mbarrier_init;
//   expect — the 2 expect-tx arrivals;       copies — the 6 bulk copies' issue.
// Forms: "as_moe" (the order above), "init_early" (barriers initialised and fenced before the
// arrival, as they could be before the kernel's dependency wait), "no_fence" (without the proxy
// fence: what it costs), "pending_load" (thread 0 has a DRAM load in flight when the hook starts,
// as the polling warp may: does the fence wait for it?).
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/hook_parts.cu -o /tmp/hook_parts && /tmp/hook_parts
#include "harness.cuh"
#include "../../crates/osprey-cuda/kernels/tiles.cuh"

#define H_ 2048
#define I_ 512

enum Form { AS_MOE, INIT_EARLY, NO_FENCE, PENDING_LOAD };

template <int FORM>
__global__ void __launch_bounds__(256, 2) hook_parts(const uint32_t* codes, const __nv_bfloat16* scales, const __nv_bfloat16* biases,
                                                     const float* far, unsigned* arrive, long long* out, int* sink) {
    extern __shared__ __align__(128) char hook_tiles[];
    char* tiles = hook_tiles;
    __nv_bfloat16* sc = reinterpret_cast<__nv_bfloat16*>(tiles + 2 * 16 * (H_ / 2));
    __nv_bfloat16* bi = sc + 2 * 16 * (H_ / 64);
    __shared__ __align__(8) uint64_t bars[2];
    const int e = (blockIdx.x * 37) % 256, f0 = (blockIdx.x % 32) * 16;
    if (threadIdx.x == 0) {
        if (FORM == INIT_EARLY) {
            mbar_init(&bars[0], 1);
            mbar_init(&bars[1], 1);
            mbar_init_fence();
        }
        atomicAdd(arrive, 1u);
        while (atomicAdd(arrive, 0u) < gridDim.x) {}
        float pending = 0.f;
        if (FORM == PENDING_LOAD) pending = __ldcg(far + (size_t)blockIdx.x * 4096);
        const size_t row0 = (size_t)e * I_ + f0;
        long long t[5];
        t[0] = clock64();
        if (FORM != NO_FENCE) fence_proxy_async();
        t[1] = clock64();
        if (FORM != INIT_EARLY) {
            mbar_init(&bars[0], 1);
            mbar_init(&bars[1], 1);
            mbar_init_fence();
        }
        t[2] = clock64();
        mbar_arrive_expect_bytes(&bars[0], q4_rows_bytes(16, H_));
        mbar_arrive_expect_bytes(&bars[1], q4_rows_bytes(16, H_));
        t[3] = clock64();
        copy_q4_rows(tiles, sc, bi, 0, codes, scales, biases, row0, 16, H_, &bars[0]);
        copy_q4_rows(tiles, sc, bi, 1, codes + (size_t)256 * I_ * H_ / 8, scales, biases, row0, 16, H_, &bars[1]);
        t[4] = clock64();
        for (int i = 0; i < 4; ++i) out[blockIdx.x * 4 + i] = t[i + 1] - t[i];
        mbar_wait(&bars[0], 0);
        mbar_wait(&bars[1], 0);
        if (pending == 1234.f || tiles[5] == 0x7F) sink[0] = 1;
    }
}

template <int FORM>
static void run(const char* name, const uint32_t* codes, const __nv_bfloat16* scales, const __nv_bfloat16* biases, const float* far,
                unsigned* arrive, long long* out, int* sink, bool& first) {
    const int smem = 2 * 16 * (H_ / 2 + 2 * (H_ / 64) * 2);
    CK(cudaFuncSetAttribute(hook_parts<FORM>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    std::vector<long long> parts[4];
    for (int rep = 0; rep < 5; ++rep) {
        CK(cudaMemset(arrive, 0, sizeof(unsigned)));
        hook_parts<FORM><<<256, 256, smem>>>(codes, scales, biases, far, arrive, out, sink);
        CK(cudaDeviceSynchronize());
        std::vector<long long> r(256 * 4);
        CK(cudaMemcpy(r.data(), out, r.size() * sizeof(long long), cudaMemcpyDeviceToHost));
        for (int b = 0; b < 256; ++b)
            for (int i = 0; i < 4; ++i) parts[i].push_back(r[b * 4 + i]);
    }
    const char* names[4] = {"fence", "init", "expect", "copies"};
    printf("%s{\"form\": \"%s\"", first ? "" : ",\n  ", name);
    for (int i = 0; i < 4; ++i) {
        std::sort(parts[i].begin(), parts[i].end());
        printf(", \"%s_median\": %lld, \"%s_p90\": %lld", names[i], parts[i][parts[i].size() / 2], names[i], parts[i][parts[i].size() * 9 / 10]);
    }
    printf("}");
    first = false;
}

int main() {
    const size_t rows = (size_t)256 * I_;
    uint32_t* codes;
    __nv_bfloat16 *scales, *biases;
    float* far;
    unsigned* arrive;
    long long* out;
    int* sink;
    CK(cudaMalloc(&codes, 2 * rows * H_ / 2));
    CK(cudaMalloc(&scales, rows * (H_ / 64) * 2));
    CK(cudaMalloc(&biases, rows * (H_ / 64) * 2));
    CK(cudaMalloc(&far, (size_t)256 * 4096 * sizeof(float)));
    CK(cudaMalloc(&arrive, sizeof(unsigned)));
    CK(cudaMalloc(&out, 256 * 4 * sizeof(long long)));
    CK(cudaMalloc(&sink, sizeof(int)));
    CK(cudaMemset(codes, 0, 2 * rows * H_ / 2));
    bool first = true;
    printf("{\"note\": \"thread 0 of each block of a 256 x 256 grid (2 an SM), clock64 cycles of each part of the experts' copy hook, 5 launches x 256 blocks\", \"results\": [\n  ");
    run<AS_MOE>("as_moe", codes, scales, biases, far, arrive, out, sink, first);
    run<INIT_EARLY>("init_early", codes, scales, biases, far, arrive, out, sink, first);
    run<NO_FENCE>("no_fence", codes, scales, biases, far, arrive, out, sink, first);
    run<PENDING_LOAD>("pending_load", codes, scales, biases, far, arrive, out, sink, first);
    printf("\n]}\n");
    return 0;
}
