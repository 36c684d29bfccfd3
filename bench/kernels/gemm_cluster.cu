// Prototype: the prefill's wgmma GEMM (gemm_q4_wgmma in crates/osprey-cuda/kernels/gemm.cu,
// included as is) with its blocks in clusters of 2 along the weight rows, the two blocks of a
// cluster sharing one copy of their 128 positions' activations: each requests half of every
// group's activation tile by TMA (a 2D tensor map, box 8 k x 128 positions = one core-matrix
// column of wgmma's K-major layout) multicast into both blocks' shared memory.
// Why: ncu on gemm_q4_wgmma (GDN in_proj, 4K prompt) shows L2 63% busy and 1.39 GB read from L2
// for a 137 GFLOP launch; every 256-row block re-reads its positions' activations (16 KB a group)
// next to 8 KB of codes, so a pair sharing them reads 2 x 8 + 16 KB instead of 2 x 24 per group
// (-33% L2 traffic). Dense launches only (the routed GEMMs gather rows, which a 2D box cannot).
// Pipeline per block: full[s] (this block's expected 16 KB of the group in slot s, completed by
// the TMA bytes of both blocks) and empty[s] (2 arrivals: both blocks have retired the wgmma that
// read slot s) mbarriers; codes and scale/bias words stay on cp.async per block, as in the engine.
// Checked against gemm_q4_wgmma on the same inputs (relative RMS of the outputs); timed as 10
// launches in a CUDA graph, best of 5, on the 4K-prompt dense shapes.
// Written without a GPU at hand (compiled here with nvcc -c): NOT YET RUN.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gemm_cluster.cu -o /tmp/gemm_cluster && /tmp/gemm_cluster
#include "../../crates/osprey-cuda/kernels/gemm.cu"
#include "harness.cuh"
#include <cmath>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <vector>

#define MC_SLOTS 5
#define MC_AHEAD 3
#define MC_X_BYTES (WG_POS * 128)
#define MC_SMEM_BYTES (MC_SLOTS * (MC_X_BYTES + WG_CODE_BYTES) + 2 * WG_SB_BYTES + 2 * WG_W_BYTES + 2 * MC_SLOTS * 8)

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// one arrival on the mbarrier at the same offset in block `rank` of the cluster
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(rank));
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
// box {k0, row0} of the tensor map into `dst` of every block in `mask`, completing on `bar` there
__device__ __forceinline__ void tma_multicast_2d(void* dst, const CUtensorMap* map, int k0, int row0, uint64_t* bar,
                                                 uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
        "%3}], [%4], %5;" ::"r"(smem_addr(dst)),
        "l"(map), "r"(k0), "r"(row0), "r"(smem_addr(bar)), "h"(mask)
        : "memory");
}

// Dense, store epilogue only (the harness's comparison); grid (N / 256, M / 128), x even.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(256, 1)
    gemm_q4_wgmma_mc(GemmArgs p, const __grid_constant__ CUtensorMap a_map) {
    extern __shared__ __align__(1024) unsigned char mc_smem[];
    unsigned char* Xs = mc_smem;                                                         // [slot][8 kc][128 pos][16 B]
    uint4* Cs = reinterpret_cast<uint4*>(mc_smem + MC_SLOTS * MC_X_BYTES);             // [slot][2 halves][256 rows]
    uint4* SBs = reinterpret_cast<uint4*>(mc_smem + MC_SLOTS * (MC_X_BYTES + WG_CODE_BYTES));
    unsigned char* Ws = mc_smem + MC_SLOTS * (MC_X_BYTES + WG_CODE_BYTES) + 2 * WG_SB_BYTES;
    uint64_t* full = reinterpret_cast<uint64_t*>(Ws + 2 * WG_W_BYTES);
    uint64_t* empty = full + MC_SLOTS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wg = warp >> 2;
    const uint32_t rank = cluster_rank(), peer = rank ^ 1;
    const int m0 = blockIdx.y * WG_POS, m_end = p.M;
    const int groups = p.K / 64, wpr = p.K / 8;

    if (tid == 0) {
        for (int s = 0; s < MC_SLOTS; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 2);
        }
        mbar_init_fence();
    }
    cluster_sync();  // both blocks' barriers exist before either sends bytes or arrivals

    const int st_half = tid & 1;
    const uint32_t* crow[2];
    const uint4* sbrow[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const size_t rr = min((int)blockIdx.x * WG_ROWS + (tid >> 1) + 128 * i, p.N - 1);
        crow[i] = p.codes[0] + rr * wpr + 4 * st_half;
        sbrow[i] = reinterpret_cast<const uint4*>((st_half ? p.biases[0] : p.scales[0]) + rr * groups);
    }
    // this block's codes and 8-group scale/bias words by cp.async; its half of the activation
    // planes (kc 4·rank .. 4·rank + 3) by TMA into both blocks, once both have released the slot
    auto load_stage = [&](int G) {
        if (G < groups) {
            const int slot = G % MC_SLOTS;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = (tid >> 1) + 128 * i;
                cp_async16(Cs + (slot * 2 + st_half) * WG_ROWS + r, crow[i] + G * 8, true);
                if ((G & 7) == 0) cp_async16(SBs + (((G >> 3) & 1) * 2 + st_half) * WG_ROWS + r, sbrow[i] + (G >> 3), true);
            }
            if (tid == 0) {
                if (G >= MC_SLOTS) mbar_wait(&empty[slot], (G / MC_SLOTS - 1) & 1);
                mbar_arrive_expect_bytes(&full[slot], MC_X_BYTES);
#pragma unroll
                for (int kc = 4 * rank; kc < 4 * rank + 4; ++kc)
                    tma_multicast_2d(Xs + slot * MC_X_BYTES + kc * (WG_POS * 16), &a_map, G * 64 + kc * 8, m0, &full[slot], 0x3);
            }
        }
        cp_async_commit();
    };
    auto dequant = [&](int G) { wgmma_dequant_row(G, G % MC_SLOTS, Cs, SBs, Ws, tid); };
    float d[2][64];

#pragma unroll
    for (int G = 0; G < MC_AHEAD; ++G) load_stage(G);
    cp_async_wait<MC_AHEAD - 1>();
    __syncthreads();
    dequant(0);
    for (int G = 0; G < groups; ++G) {
        cp_async_wait<MC_AHEAD - 2>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        // every warpgroup of this block retired wgmma(G - 2) at step G - 1: release its slot here
        // and in the peer (whose TMA writes this block's copy too)
        if (tid == 0 && G >= 2) {
            mbar_arrive_cluster(&empty[(G - 2) % MC_SLOTS], rank);
            mbar_arrive_cluster(&empty[(G - 2) % MC_SLOTS], peer);
        }
        load_stage(G + MC_AHEAD);
        mbar_wait(&full[G % MC_SLOTS], (G / MC_SLOTS) & 1);
        const unsigned char* W = Ws + (G & 1) * WG_W_BYTES + wg * 128 * 16;
        const unsigned char* X = Xs + (G % MC_SLOTS) * MC_X_BYTES;
        wgmma_issue_group(d, W, X, G == 0);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        if (G + 1 < groups) dequant(G + 1);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fence_accumulators(d[0]);
    fence_accumulators(d[1]);
    cp_async_wait<0>();

#pragma unroll
    for (int m = 0; m < 2; ++m) {
        const int wrow = 128 * wg + 64 * m + 16 * (warp & 3) + g;
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int pos = m0 + 8 * j + 2 * q + e;
                if (pos >= m_end) continue;
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    p.out[(size_t)pos * p.ldo + blockIdx.x * WG_ROWS + wrow + 8 * h] = d[m][4 * j + 2 * h + e];
            }
    }
    cluster_sync();  // the peer may still arrive on this block's barriers
}

static CUtensorMap activation_map(const __nv_bfloat16* a, int M, int K) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    if (!fn || found != cudaDriverEntryPointSuccess) {
        printf("cuTensorMapEncodeTiled unavailable\n");
        exit(1);
    }
    CUtensorMap map;
    const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)M};
    const cuuint64_t strides[1] = {(cuuint64_t)K * 2};
    const cuuint32_t box[2] = {8, WG_POS};
    const cuuint32_t elem[2] = {1, 1};
    const CUresult r = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)(
        &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)a, dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        printf("cuTensorMapEncodeTiled failed: %d\n", (int)r);
        exit(1);
    }
    return map;
}

int main() {
    const int wg_smem = WG_SMEM_BYTES;
    CK(cudaFuncSetAttribute(gemm_q4_wgmma, cudaFuncAttributeMaxDynamicSharedMemorySize, wg_smem));
    CK(cudaFuncSetAttribute(gemm_q4_wgmma_mc, cudaFuncAttributeMaxDynamicSharedMemorySize, MC_SMEM_BYTES));
    struct Shape {
        const char* name;
        int M, N, K;
    } shapes[] = {{"in_proj qkv", 4096, 8192, 2048}, {"in_proj z", 4096, 4096, 2048}, {"out_proj", 4096, 2048, 4096}};
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    for (const Shape& sh : shapes) {
        const ExpertStack w = upload_q4(random_q4(sh.N, sh.K, 0.002f, 0.01f));
        std::vector<__nv_bfloat16> ah((size_t)sh.M * sh.K);
        for (auto& v : ah) v = __float2bfloat16((rand() % 2001 - 1000) / 1000.f);
        __nv_bfloat16* a = upload(ah);
        float *out0, *out1;
        CK(cudaMalloc(&out0, (size_t)sh.M * sh.N * 4));
        CK(cudaMalloc(&out1, (size_t)sh.M * sh.N * 4));
        GemmArgs g{};
        g.a = a;
        g.codes[0] = g.codes[1] = w.codes;
        g.scales[0] = g.scales[1] = w.scales;
        g.biases[0] = g.biases[1] = w.biases;
        g.M = sh.M;
        g.N = sh.N;
        g.K = sh.K;
        g.group = 64;
        g.ldo = sh.N;
        g.epilogue = EPI_STORE;
        g.k_splits = 1;
        const CUtensorMap map = activation_map(a, sh.M, sh.K);
        const dim3 grid(sh.N / WG_ROWS, sh.M / WG_POS);
        auto timed = [&](bool mc, float* out) {
            GemmArgs ga = g;
            ga.out = out;
            return graph_us(st, 10, [&](int) {
                if (mc) gemm_q4_wgmma_mc<<<grid, 256, MC_SMEM_BYTES, st>>>(ga, map);
                else gemm_q4_wgmma<<<grid, 256, wg_smem, st>>>(ga);
            });
        };
        const double t0 = timed(false, out0), t1 = timed(true, out1);
        std::vector<float> y0((size_t)sh.M * sh.N), y1(y0.size());
        CK(cudaMemcpy(y0.data(), out0, y0.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(y1.data(), out1, y1.size() * 4, cudaMemcpyDeviceToHost));
        double e = 0, r2 = 0;
        for (size_t i = 0; i < y0.size(); ++i) {
            e += (double)(y1[i] - y0[i]) * (y1[i] - y0[i]);
            r2 += (double)y0[i] * y0[i];
        }
        const double flop = 2.0 * sh.M * sh.N * sh.K;
        printf("%-12s M %d N %d K %d: gemm_q4_wgmma %8.1f us (%5.1f TFLOP/s), clusters of 2 + TMA multicast %8.1f us "
               "(%5.1f TFLOP/s), outputs differ by %.1e relative RMS\n",
               sh.name, sh.M, sh.N, sh.K, t0, flop / t0 / 1e6, t1, flop / t1 / 1e6, std::sqrt(e / r2));
        CK(cudaFree(out0));
        CK(cudaFree(out1));
        CK(cudaFree(a));
        CK(cudaFree((void*)w.codes));
        CK(cudaFree((void*)w.scales));
        CK(cudaFree((void*)w.biases));
    }
    return 0;
}
