// The prefill attention kernels side by side: attn_prefill (mma.sync, one warp per 16 queries)
// and attn_prefill_wgmma (warpgroup MMA, one warpgroup per 64 queries) on the same random bf16
// Q, K/V cache and gates, for a chunk of T queries after `start` cached positions (16 query heads,
// 2 KV heads, head dim 256: the model's shape). Checks the wgmma kernel against the mma.sync one
// (relative RMS of the outputs; both accumulate in fp32 from the same bf16 inputs, P rounded to
// bf16 the same way, so they differ by summation order only), then times both (best of 5) and
// reports TFLOP/s of the causal work 4·T·(start + T/2)·D per head. Ran on the H200 at beff07e
// (K and V by TMA; bench/results/cuda-prefill-attention-kv-tma.json): bit-identical on all four
// shapes; 4K from 0: 456 us (301 TFLOP/s), the last 4K chunk of 128K: 13.2 ms (656 TFLOP/s)
// against 34.2 ms for the mma.sync kernel.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/attn_prefill.cu -o /tmp/attn_prefill && /tmp/attn_prefill
#include "../../crates/osprey-cuda/kernels/attention_prefill.cu"
#include "harness.cuh"

static std::vector<__nv_bfloat16> random_bf16(size_t n, float unit, unsigned seed) {
    std::vector<__nv_bfloat16> v(n);
    srand(seed);
    for (auto& x : v) x = __float2bfloat16(unit * ((float)rand() / RAND_MAX * 2.f - 1.f));
    return v;
}

int main() {
    const int hq = 16, hkv = 2;
    const size_t smem_mma = (QT + 4 * KT) * QK_STRIDE * 2, smem_wg = WG_Q_BYTES + 4 * WG_KV_BYTES + 32;
    CK(cudaFuncSetAttribute(attn_prefill, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_mma));
    CK(cudaFuncSetAttribute(attn_prefill_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_wg));
    struct Case { int T, start; };
    const Case cases[] = {{300, 0}, {4096, 0}, {4096, 28672}, {4096, 126976}};
    printf("{\"cases\": [\n");
    bool first = true;
    for (const Case c : cases) {
        const size_t positions = (size_t)c.start + c.T;
        // q/k scaled so that scores spread over several units (softmax neither flat nor one-hot)
        auto q = upload(random_bf16((size_t)c.T * hq * D, 1.f, 1));
        auto kc = upload(random_bf16(positions * hkv * D, 0.25f, 2));
        auto vc = upload(random_bf16(positions * hkv * D, 1.f, 3));
        std::vector<float> qg_h((size_t)c.T * hq * 2 * D);
        srand(4);
        for (auto& x : qg_h) x = (float)rand() / RAND_MAX * 4.f - 2.f;
        auto qg = upload(qg_h);
        float *out_mma, *out_wg;
        const size_t out_n = (size_t)c.T * hq * D;
        CK(cudaMalloc(&out_mma, out_n * 4));
        CK(cudaMalloc(&out_wg, out_n * 4));
        AttnPrefillArgs a{q, kc, vc, qg, out_mma, 1.4426950408889634f / 16.f, c.T, c.start, hq, hkv};
        WgmmaAttnArgs b{a, {}, {}};
        b.a.out = out_wg;
        tensor_map(&b.k, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kc, {D, (uint64_t)hkv, positions}, {64, 1, 64}, 2, true);
        tensor_map(&b.v, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, vc, {D, (uint64_t)hkv, positions}, {64, 1, 64}, 2, true);
        const dim3 grid((c.T + QT - 1) / QT, hq);
        auto run_mma = [&] { attn_prefill<<<grid, 256, smem_mma>>>(a); };
        auto run_wg = [&] { attn_prefill_wgmma<<<grid, 256, smem_wg>>>(b); };
        run_mma();
        run_wg();
        CK(cudaDeviceSynchronize());
        std::vector<float> want(out_n), got(out_n);
        CK(cudaMemcpy(want.data(), out_mma, out_n * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(got.data(), out_wg, out_n * 4, cudaMemcpyDeviceToHost));
        const double rr = rel_rms_f(want, got);
        const double ms_mma = best_ms(0, run_mma), ms_wg = best_ms(0, run_wg);
        const double flop = 4.0 * c.T * (c.start + c.T / 2.0) * D * hq;
        printf("%s  {\"T\": %d, \"start\": %d, \"relative_rms_vs_mma\": %.3g, \"mma_sync_us\": %.1f, \"wgmma_us\": %.1f, "
               "\"mma_sync_tflop_per_s\": %.1f, \"wgmma_tflop_per_s\": %.1f}",
               first ? "" : ",\n", c.T, c.start, rr, ms_mma * 1e3, ms_wg * 1e3, flop / ms_mma / 1e9, flop / ms_wg / 1e9);
        first = false;
        CK(cudaFree(out_mma));
        CK(cudaFree(out_wg));
        CK(cudaFree(q));
        CK(cudaFree(kc));
        CK(cudaFree(vc));
        CK(cudaFree(qg));
    }
    printf("\n]}\n");
    return 0;
}
