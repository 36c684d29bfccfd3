// Where gemm_q4_wgmma's time per 64-wide K group goes: its main loop (crates/osprey-cuda/kernels/
// gemm.cu, included) rebuilt with parts switched off, on one tile per SM (132 blocks of 256
// threads, 256 weight rows x 128 positions, 512 groups each), all operands L2-resident:
//   mma    — the two warpgroups' wgmma alone (no barrier, no copies, no dequantisation);
//   +sync  — and the per-group barrier with its proxy fence;
//   +deq   — and the dequantisation of the next group's weights from shared memory;
//   +copy  — and per-thread cp.async copies (activations and codes): the loop as it was;
//   tma    — the copies by TMA through 2-D tensor maps, activations in the 128-byte swizzle;
//   tma-w  — TMA for the weights, cp.async for the activations (a gathered launch);
// the first four with the activations as gemm_q4_wgmma had them (no swizzle) and swizzled.
// Ran on the H200 at b3c9dde (bench/results/cuda-prefill-wgmma-loop-probe.json; that version kept
// the per-thread copies' codes in their own half-major layout), clocks per group: mma 1,137, +deq
// 1,662, +copy 2,866, tma 1,825, tma-w 2,106.
// Values are random and the products are not checked: this measures time only.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/wgmma_layout.cu -o /tmp/wgmma_layout && /tmp/wgmma_layout
#include "../../crates/osprey-cuda/kernels/gemm.cu"
#include "harness.cuh"

struct Maps {
    TensorMap x, codes, scales;
};

template <bool SWZ>
__device__ __forceinline__ void issue_group(float (&d)[2][64], const unsigned char* W, const unsigned char* X, bool first) {
    fence_accumulators(d[0]);
    fence_accumulators(d[1]);
    wgmma_fence();
#pragma unroll
    for (int s4 = 0; s4 < 4; ++s4) {
        const uint64_t db = SWZ ? wg_desc_sw128(X + 32 * s4) : wg_desc(X + 2 * s4 * (WG_POS * 16), WG_POS * 16, 128);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const uint64_t da = SWZ ? wg_desc_sw128(W + m * 64 * 128 + 32 * s4)
                                    : wg_desc(W + 2 * s4 * (WG_ROWS * 16) + m * 64 * 16, WG_ROWS * 16, 128);
            wgmma_ss<128>(d[m], da, db, !first || s4 > 0);
        }
    }
    wgmma_commit();
    fence_accumulators(d[0]);
    fence_accumulators(d[1]);
}

// MODE: 0 mma, 1 +sync, 2 +deq, 3 +copy, 4 copies by TMA (activations swizzled), 5 activations by
// cp.async and codes, scales and biases by TMA (a gathered launch)
template <bool SWZ, int MODE>
__global__ void __launch_bounds__(256, 1) loop_probe(const __nv_bfloat16* a, const uint32_t* codes, const __nv_bfloat16* sb,
                                                     int groups, float* sink, const __grid_constant__ Maps maps) {
    extern __shared__ __align__(1024) unsigned char smem[];
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + WG_SLOTS * (WG_X_BYTES + WG_CODE_BYTES) + 2 * WG_SB_BYTES + 2 * WG_W_BYTES);
    unsigned char* Xs = smem;
    uint4* Cs = reinterpret_cast<uint4*>(smem + WG_SLOTS * WG_X_BYTES);
    uint4* SBs = reinterpret_cast<uint4*>(smem + WG_SLOTS * (WG_X_BYTES + WG_CODE_BYTES));
    unsigned char* Ws = smem + WG_SLOTS * (WG_X_BYTES + WG_CODE_BYTES) + 2 * WG_SB_BYTES;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int K = 2048, gpr = K / 64;
    // operands: tile blockIdx.x % 8 of a 1024-position x 2048-row problem (L2-resident)
    const int tile = blockIdx.x & 7;
    const uint32_t* crow[2];
    const uint4* sbrow[2];
    for (int i = 0; i < 2; ++i) {
        const int r = (tid >> 1) + 128 * i + 256 * tile;
        crow[i] = codes + (size_t)r * (K / 8) + 4 * (tid & 1);
        sbrow[i] = reinterpret_cast<const uint4*>(sb + (size_t)r * gpr);
    }
    const __nv_bfloat16* src[4];
    for (int c = 0; c < 4; ++c) {
        const int chunk = tid + 256 * c;
        src[c] = a + (size_t)(128 * tile + (chunk >> 3)) * K + (chunk & 7) * 8;
    }
    if (tid == 0) {
        for (int i = 0; i < WG_SLOTS; ++i) mbar_init(&full[i], 1);
        mbar_init_fence();
    }
    __syncthreads();
    auto load_stage = [&](int G) {
        if (MODE >= 4) {
            if (G < groups && tid == 0) {
                const int slot = G % WG_SLOTS, Gk = G % gpr;
                const bool sbs = (G & 7) == 0;
                mbar_arrive_expect_bytes(&full[slot], (MODE == 4 ? WG_X_BYTES : 0) + WG_CODE_BYTES + (sbs ? 2 * WG_SB_BYTES / 2 : 0));
                if (MODE == 4) tma_load_2d(Xs + slot * WG_X_BYTES, &maps.x, Gk * 64, 128 * tile, &full[slot]);
                tma_load_2d(Cs + slot * 2 * WG_ROWS, &maps.codes, Gk * 8, 256 * tile, &full[slot]);
                if (sbs) {
                    uint4* dst = SBs + ((G >> 3) & 1) * 2 * WG_ROWS;
                    tma_load_2d(dst, &maps.scales, Gk, 256 * tile, &full[slot]);
                    tma_load_2d(dst + WG_ROWS, &maps.scales, Gk, 256 * tile, &full[slot]);
                }
            }
            if (MODE == 5 && G < groups) {
                const int slot = G % WG_SLOTS, Gk = G % gpr;
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int chunk = tid + 256 * c, p = chunk >> 3;
                    cp_async16(Xs + slot * WG_X_BYTES + p * 128 + (((chunk & 7) ^ (p & 7)) << 4), src[c] + Gk * 64, true);
                }
            }
            cp_async_commit();
            return;
        }
        if (MODE >= 3 && G < groups) {
            const int slot = G % WG_SLOTS, Gk = G % gpr;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int chunk = tid + 256 * c;
                cp_async16(Xs + slot * WG_X_BYTES + (chunk & 7) * (WG_POS * 16) + (chunk >> 3) * 16, src[c] + Gk * 64, true);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = (tid >> 1) + 128 * i;
                cp_async16(Cs + (slot * WG_ROWS + r) * 2 + (tid & 1), crow[i] + Gk * 8, true);
                if ((G & 7) == 0) cp_async16(SBs + (((G >> 3) & 1) * 2 + (tid & 1)) * WG_ROWS + r, sbrow[i] + (Gk >> 3), true);
            }
        }
        cp_async_commit();
    };
    float d[2][64];
    for (int G = 0; G < WG_AHEAD; ++G) load_stage(G);
    cp_async_wait<WG_AHEAD - 1>();
    __syncthreads();
    if (MODE >= 4) {
        mbar_wait(&full[0], 0);
        mbar_wait(&full[1], 0);
    }
    if (MODE >= 2) wgmma_dequant_row(0, 0, Cs, SBs, Ws, tid, tid);
    for (int G = 0; G < groups; ++G) {
        if (MODE >= 4 && G + 1 < groups) mbar_wait(&full[(G + 1) % WG_SLOTS], ((G + 1) / WG_SLOTS) & 1);
        if (MODE >= 1) {
            cp_async_wait<WG_AHEAD - 2>();
            fence_proxy_async();
            __syncthreads();
        }
        load_stage(G + WG_AHEAD);
        const unsigned char* W = Ws + (G & 1) * WG_W_BYTES + wg * (SWZ ? 128 * 128 : 128 * 16);
        const unsigned char* X = Xs + (G % WG_SLOTS) * WG_X_BYTES;
        issue_group<SWZ>(d, W, X, G == 0);
        wgmma_wait<1>();
        if (MODE >= 2 && G + 1 < groups) wgmma_dequant_row(G + 1, (G + 1) % WG_SLOTS, Cs, SBs, Ws, tid, tid);
    }
    wgmma_wait<0>();
    fence_accumulators(d[0]);
    fence_accumulators(d[1]);
    cp_async_wait<0>();
    float s = 0.f;
    for (int m = 0; m < 2; ++m)
        for (int i = 0; i < 64; ++i) s += d[m][i];
    if (s == 1234.5f) sink[tid] = s;
}

template <bool SWZ, int MODE>
static void probe(const char* name, const __nv_bfloat16* a, const uint32_t* codes, const __nv_bfloat16* sb, float* sink,
                  const Maps& maps) {
    const size_t smem = WG_SLOTS * (WG_X_BYTES + WG_CODE_BYTES) + 2 * WG_SB_BYTES + 2 * WG_W_BYTES + 64;
    CK(cudaFuncSetAttribute(loop_probe<SWZ, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const int groups = 32 * 16;  // K = 2048 sixteen times over
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    const double us = graph_us(st, 4, [&](int) { loop_probe<SWZ, MODE><<<132, 256, smem, st>>>(a, codes, sb, groups, sink, maps); });
    CK(cudaGetLastError());
    CK(cudaStreamDestroy(st));
    const double flop = 132.0 * 256 * 128 * 64 * 2 * groups;
    int clock_khz;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    printf("%-6s %-7s %8.1f us  %6.1f TFLOP/s  %6.0f clocks per group (at %d MHz)\n", SWZ ? "sw128" : "none", name, us,
           flop / us / 1e6, us * clock_khz / 1e3 / groups, clock_khz / 1000);
}

int main() {
    std::vector<__nv_bfloat16> ha((size_t)1024 * 2048);
    for (auto& v : ha) v = __float2bfloat16((rand() % 2001 - 1000) / 1000.f);
    const __nv_bfloat16* a = upload(ha);
    const HostQ4 w = random_q4(2048, 2048, 0.002f, 0.01f);
    const uint32_t* codes = upload(w.codes);
    const __nv_bfloat16* sb = upload(w.scales);
    float* sink;
    CK(cudaMalloc(&sink, 256 * 4));
    Maps maps{};
    tensor_map(&maps.x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a, {2048, 1024}, {64, 128}, 2, true);
    tensor_map(&maps.codes, CU_TENSOR_MAP_DATA_TYPE_UINT32, codes, {256, 2048}, {8, 256}, 4, false);
    tensor_map(&maps.scales, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, sb, {32, 2048}, {8, 256}, 2, false);
    probe<false, 0>("mma", a, codes, sb, sink, maps);
    probe<false, 1>("+sync", a, codes, sb, sink, maps);
    probe<false, 2>("+deq", a, codes, sb, sink, maps);
    probe<false, 3>("+copy", a, codes, sb, sink, maps);
    probe<true, 0>("mma", a, codes, sb, sink, maps);
    probe<true, 3>("+copy", a, codes, sb, sink, maps);
    probe<true, 4>("tma", a, codes, sb, sink, maps);
    probe<true, 5>("tma-w", a, codes, sb, sink, maps);
    return 0;
}
