// Does the lm_head ring pay for its small requests? gemv_q_ring fills a stage (2 tiles, 32 rows at
// K 2048) with three bulk copies: 32 KB of codes and 2 KB each of scales and biases, from three
// arrays; the lm_head streams at ~3.9 TB/s in the step, where tma_read.cu streams one array at
// 4.46 TB/s in 16 KB requests, and ~1.1 TB/s in 1 KB ones (a fixed cost a request). Here each of
// 132 blocks streams its share of lm_head-shaped arrays (codes 254 MB, scales and biases 16 MB
// each) through a ring of 6 stages, with nothing multiplied:
//   three_copies — codes, scales, biases each by one bulk copy a stage (as gemv_q_ring);
//   codes_only   — the codes' bulk copy alone (what the scales and biases cost);
//   lsu_sb       — the codes by bulk copy, the scales and biases by cp.async of lanes 0-31
//                  (8 bytes a lane each, row l of the stage: a consumer warp's 4 groups).
// 16 launches in a graph over 3 copies of the arrays (past L2), best of 5.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/ring_requests.cu -o /tmp/ring_requests && /tmp/ring_requests
#include "harness.cuh"

#define STAGE_CODES (32 * 1024)
#define STAGE_SB (2 * 1024)
#define S 6

template <int FORM>
__global__ void __launch_bounds__(32) ring_read(const char* codes, const char* scales, const char* biases, int stages_total,
                                                int* sink) {
    extern __shared__ __align__(128) char ring[];
    __shared__ __align__(8) uint64_t full[S];
    const int lane = threadIdx.x;
    const int per = stages_total / gridDim.x, s0 = blockIdx.x * per;
    const auto fill = [&](int st) {
        const int slot = st % S;
        const size_t g = (size_t)(s0 + st);
        char* dst = ring + slot * (STAGE_CODES + 2 * STAGE_SB);
        if (lane == 0) {
            mbar_arrive_expect_bytes(&full[slot], STAGE_CODES + (FORM == 0 ? 2 * STAGE_SB : 0));
            bulk_copy_to_shared(dst, codes + g * STAGE_CODES, STAGE_CODES, &full[slot]);
            if (FORM == 0) {
                bulk_copy_to_shared(dst + STAGE_CODES, scales + g * STAGE_SB, STAGE_SB, &full[slot]);
                bulk_copy_to_shared(dst + STAGE_CODES + STAGE_SB, biases + g * STAGE_SB, STAGE_SB, &full[slot]);
            }
        }
        if (FORM == 2) {
            // lane l: 8 bytes of row l's scales and biases (4 groups of a K-slice), 64 B apart
            const unsigned d = (unsigned)__cvta_generic_to_shared(dst + STAGE_CODES + lane * 64);
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(scales + g * STAGE_SB + lane * 64));
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d + STAGE_SB), "l"(biases + g * STAGE_SB + lane * 64));
            asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];" ::"r"((unsigned)__cvta_generic_to_shared(&full[slot])));
        }
    };
    if (lane == 0) {
        for (int s = 0; s < S; ++s) mbar_init(&full[s], FORM == 2 ? 1 + 32 : 1);
        mbar_init_fence();
    }
    __syncwarp();
    for (int st = 0; st < min(S, per); ++st) fill(st);
    int acc = 0;
    for (int st = 0; st < per; ++st) {
        const int slot = st % S;
        mbar_wait(&full[slot], (st / S) & 1);
        acc += ring[slot * (STAGE_CODES + 2 * STAGE_SB) + 5 + lane];
        __syncwarp();
        if (st + S < per) fill(st + S);
    }
    if (acc == 123456789) sink[0] = acc;
}

template <int FORM>
static float run(cudaStream_t st, const char* buf, size_t copy_bytes, int stages_total, int sms, int* sink) {
    const int smem = S * (STAGE_CODES + 2 * STAGE_SB);
    CK(cudaFuncSetAttribute(ring_read<FORM>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const int L = 16;
    cudaGraph_t gr;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < L; ++i) {
        const char* base = buf + (size_t)(i % 3) * copy_bytes;
        const size_t codes_bytes = (size_t)stages_total * STAGE_CODES;
        ring_read<FORM><<<sms, 32, smem, st>>>(base, base + codes_bytes, base + codes_bytes + (size_t)stages_total * STAGE_SB, stages_total,
                                               sink);
    }
    CK(cudaStreamEndCapture(st, &gr));
    CK(cudaGraphInstantiate(&ge, gr, 0));
    return best_ms(st, [&] { CK(cudaGraphLaunch(ge, st)); }) * 1e3f / L;
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    // the lm_head: 248,320 rows = 7,760 stages of 32 rows
    const int stages_total = 7760 / sms * sms;
    const size_t copy_bytes = (size_t)stages_total * (STAGE_CODES + 2 * STAGE_SB);
    char* buf;
    CK(cudaMalloc(&buf, 3 * copy_bytes));
    CK(cudaMemset(buf, 1, 3 * copy_bytes));
    int* sink;
    CK(cudaMalloc(&sink, 64));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    const double all = (double)copy_bytes, codes = (double)stages_total * STAGE_CODES;
    const float a = run<0>(st, buf, copy_bytes, stages_total, sms, sink);
    const float b = run<1>(st, buf, copy_bytes, stages_total, sms, sink);
    const float c = run<2>(st, buf, copy_bytes, stages_total, sms, sink);
    printf("{\"MB\": %.1f, \"stages\": %d, \"results\": [\n", all / 1e6, S);
    printf("  {\"form\": \"three_copies\", \"us\": %.2f, \"TB_per_s\": %.2f},\n", a, all / a / 1e6);
    printf("  {\"form\": \"codes_only\", \"us\": %.2f, \"TB_per_s\": %.2f},\n", b, codes / b / 1e6);
    printf("  {\"form\": \"lsu_sb\", \"us\": %.2f, \"TB_per_s\": %.2f}\n]}\n", c, all / c / 1e6);
    return 0;
}
