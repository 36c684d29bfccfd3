// A candidate for the decode step's K = 4096 output projections (GDN out_proj, attention o_proj:
// 2048 rows, 128 tiles, one tile per gemv_q_resident block): each tile split over a cluster of
// two blocks, block rank r taking K-half r. Both blocks bulk-copy the whole tile (the second
// read of each line is an L2 hit; one copy request per array, as gemv_q_resident makes, instead
// of 16 row-half requests), normalise only their half of x (the GDN gated norm is per 128-wide
// head, so the halves are independent; a full-K RMSNorm would need the two sums of squares
// exchanged and is not taken here), multiply one quad per warp instead of two, and rank 1 hands
// its 16 sums to rank 0 through distributed shared memory behind a cluster barrier: rank 0 adds
// them in a fixed order (deterministic) and writes the residual. The question: does halving
// each block's prologue and multiply beat gemv_q_resident on this shape (in the decode graph
// 6.4 us per GDN out_proj at ca2b34f; chain of launches 5.61 us, cuda-decode-quad-dot-lean.json)?
// Checked against gemv_q_resident on the same inputs (relative RMS), then timed as chains of 30
// launches over weight copies past the 60 MB L2, with programmatic dependent launch, blocks
// padded to one or two per SM. Written without a GPU (session 9): compiled, not yet run.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gemv_pair.cu -o /tmp/gemv_pair && /tmp/gemv_pair
#include "../../crates/osprey-cuda/kernels/gemv.cu"
#include "harness.cuh"
#include <algorithm>
#include <cmath>
#include <vector>

#define CHAIN 30
#define PAIR_WARPS 8

// Dynamic shared memory of a pair block at width K: the whole tile's codes, scales and biases,
// half of x as signed bytes and (scale, sum) per group, scratch, the warps' sums, the peer's
// sums, the barrier.
static size_t pair_smem(int K) {
    const size_t gpr = K / 64;
    return 16 * (K / 2 + 2 * gpr * 2) + gpr / 2 * 8 * 16 + gpr / 2 * 8 + 32 * 4 + PAIR_WARPS * 16 * 4 + 16 * 4 + 8;
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// *p (a shared-memory address of this block) in the peer block `rank` of the cluster
__device__ __forceinline__ void store_to_peer(float* p, unsigned rank, float v) {
    unsigned local = (unsigned)__cvta_generic_to_shared(p), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
}

// One segment of 4-bit group-64 rows at K 4096 (a half's 32 groups are one quad per warp),
// prologue none or the per-head gated norm. Grid: 2 blocks (one cluster) per 16-row tile.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(PAIR_WARPS * 32, 1) gemv_q_pair(GemvArgs a) {
    extern __shared__ __align__(128) char smem[];
    const int K = a.K, gpr = K / 64, half_g = gpr / 2, Kh = K / 2;
    const unsigned rank = cluster_rank();
    const Segment& s = a.seg[0];
    const int r0 = (blockIdx.x / 2) * 16, rows = min(16, s.rows - r0);
    char* codes = smem;  // [16][K/2 B], whole rows
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + 16 * (K / 2));  // [16][gpr]
    __nv_bfloat16* biases = scales + 16 * gpr;
    uint4* xb8 = reinterpret_cast<uint4*>(biases + 16 * gpr);  // this half's groups
    float2* gx = reinterpret_cast<float2*>(xb8 + half_g * 8);
    float* scratch = reinterpret_cast<float*>(gx + half_g);
    float* part = scratch + 32;            // [warp][16]
    float* peer = part + PAIR_WARPS * 16;  // [16] rank 1's sums, in rank 0
    uint64_t* full = reinterpret_cast<uint64_t*>(peer + 16);
    step_overlap_begin();
    if (threadIdx.x == 0) {
        mbar_init(full, 1);
        mbar_init_fence();
        mbar_arrive_expect_bytes(full, q4_rows_bytes(rows, K));
        copy_q4_rows(codes, scales, biases, 0, s.codes, s.scales, s.biases, r0, rows, K, full);
    }
    step_inputs_ready();
    resident_input(XInput{a.x + rank * Kh, nullptr, a.gate_z ? a.gate_z + rank * Kh : nullptr, a.head_norm, a.eps, Kh, a.head_dim},
                   xb8, gx, scratch);
    __syncthreads();  // also publishes the barrier's initialisation
    const int warp = threadIdx.x >> 5, quads = half_g / 4;
    float yA = 0.f, yB = 0.f;
    mbar_wait(full, 0);
    for (int qd = warp; qd < quads; qd += PAIR_WARPS) {
        QuadX X;
        load_quad_x(xb8, gx, 4 * qd, X);
        quad_dot(codes, scales, biases, quad_lane(K, (int)rank * half_g + 4 * qd), X, yA, yB);
    }
    store_quad_sums(part + warp * 16, yA, yB);
    __syncthreads();
    float y = 0.f;
    if (threadIdx.x < 16) {
#pragma unroll
        for (int w = 0; w < PAIR_WARPS; ++w) y += part[w * 16 + threadIdx.x];
        if (rank == 1) store_to_peer(peer + threadIdx.x, 0, y);
    }
    cluster_sync();
    if (rank == 0 && (int)threadIdx.x < rows) {
        y += peer[threadIdx.x];
        const int row = r0 + threadIdx.x;
        if (s.accumulate) s.out[row] += y; else s.out[row] = y;
    }
}

int main() {
    int sms = 0, smem_optin = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    CK(cudaFuncSetAttribute(gemv_q_resident, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
    CK(cudaFuncSetAttribute(gemv_q_resident, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    CK(cudaFuncSetAttribute(gemv_q_pair, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
    CK(cudaFuncSetAttribute(gemv_q_pair, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, gemv_q_pair));
    printf("gemv_q_pair: %d registers, %d B local, %zu B dynamic shared memory\n", fa.numRegs, (int)fa.localSizeBytes, pair_smem(4096));
    const int K = 4096, rows = 2048, tiles = rows / 16, head_dim = 128;
    const size_t bytes = (size_t)rows * (K / 2 + K / 64 * 4);
    const int copies = (int)std::min<size_t>(CHAIN, (150u << 20) / bytes + 1);
    const HostQ4 w = random_q4(rows, K, 0.01f, 0.05f);
    float* x = random_x(K);
    float* z = random_x(K);
    std::vector<float> ones(head_dim, 1.f);
    float* head_w = upload(ones);
    float* outs;
    CK(cudaMalloc(&outs, (size_t)copies * rows * 4));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    for (int gated = 1; gated >= 0; --gated) {
        std::vector<GemvArgs> args(copies);
        for (int c = 0; c < copies; ++c) {
            const ExpertStack d = upload_q4(w);
            GemvArgs a{};
            a.seg[0] = Segment{d.codes, d.scales, d.biases, outs + (size_t)c * rows, rows, 4, 0, 0};
            a.nseg = 1;
            a.x = x;
            a.eps = 1e-6f;
            a.K = K;
            a.group = 64;
            a.tiles = 1;
            a.stages = 1;
            if (gated) {
                a.gate_z = z;
                a.head_norm = head_w;
                a.head_dim = head_dim;
            }
            args[c] = a;
        }
        // kind 0: gemv_q_resident (1 tile per block, padded to one block per SM as decoder.rs
        // does); kind 1: pairs unpadded; kind 2: pairs padded to at most two blocks per SM
        auto run = [&](int kind, bool pdl) {
            std::vector<float> y((size_t)copies * rows);
            CK(cudaMemset(outs, 0, y.size() * 4));
            const double us = graph_us(st, CHAIN, [&](int i) {
                GemvArgs a = args[i % copies];
                cudaLaunchAttribute attr;
                if (kind == 0) {
                    const size_t smem = std::max<size_t>(resident_smem(K, (tiles + sms - 1) / sms), 115 * 1024);
                    const cudaLaunchConfig_t cfg = launch_256(st, std::min(tiles, sms), smem, pdl, attr);
                    CK(cudaLaunchKernelEx(&cfg, gemv_q_resident, a));
                } else {
                    const size_t smem = kind == 1 ? pair_smem(K) : std::max<size_t>(pair_smem(K), 80 * 1024);
                    const cudaLaunchConfig_t cfg = launch_256(st, 2 * tiles, smem, pdl, attr);
                    CK(cudaLaunchKernelEx(&cfg, gemv_q_pair, a));
                }
            });
            CK(cudaMemcpy(y.data(), outs, y.size() * 4, cudaMemcpyDeviceToHost));
            return std::make_pair(us, y);
        };
        printf("%s: %d x %d (%.1f MB, at 4.3 TB/s %.2f us), chains of %d launches over %d weight copies\n",
               gated ? "out_proj, gated head norm" : "o_proj, no norm", rows, K, bytes / 1e6, bytes / 4.3e6, CHAIN, copies);
        const auto ref = run(0, true);
        printf("  %-44s %7.2f us\n", "gemv_q_resident, pdl", ref.first);
        const char* names[] = {"", "gemv_q_pair, pdl", "gemv_q_pair padded to 2 per SM, pdl"};
        for (int kind = 1; kind <= 2; ++kind) {
            const auto got = run(kind, true);
            printf("  %-44s %7.2f us   rel RMS vs resident %.2e\n", names[kind], got.first, rel_rms_f(ref.second, got.second));
        }
    }
    return 0;
}
