// Prototype: the router launch and the expert gate/up launch of a decode MoE block as ONE kernel,
// its blocks in clusters of 8 that share the router's logits through distributed shared memory,
// against the engine's two launches (gemv_q for router | shared gate logit | shared gate | shared
// up, then moe_gate_up), both included as is from crates/osprey-cuda/kernels.
// Why: the step is bound by dependent launches (~6 us of fixed cost each: launch, prologue, first
// memory round trip, flush). The router (6.3 us in the graph for 1.8 MB) exists only because the
// expert selection needs all 256 logits; a cluster of 8 blocks can compute them together (32 rows
// each, from L2 after the first cluster) and exchange them without a kernel boundary, so every
// cluster holds the selection after one cluster barrier. The shared expert's gate/up rows are
// independent of the routing and spread over all blocks of the same launch. If it works: 2 launches
// per MoE block instead of 3 (router + gate/up = 17.7 us per layer in the graph today).
// Geometry (E = 256 experts): 128 blocks of 256 threads (16 clusters of 8, one block per SM),
// every row requested before the input is normalised; block b takes expert
// tiles [2b, 2b + 2) of the 256 (slot, 16 intermediate rows) tiles, 4 warps splitting K of each
// (8 groups per warp, two batches of 4), and shared-expert rows [4b, 4b + 4).
// Checked here against the two-launch path on the same inputs (selected experts equal, h relative
// RMS); timed as 24 launches with 24 different inputs (so the selected experts change), best of 5.
// Measured (H200, commit dba0e69, bench/results/cuda-moe-harnesses-h200.json): correct (0 selected
// experts differ, h relative RMS 2.9e-6) but 48.2 us against 17.3 for the two launches: not wired.
// Not yet profiled; suspects: cluster scheduling (8 co-resident SMs of one GPC per cluster) and
// the cluster barrier behind every block's 32 router rows.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/moe_fused.cu -o /tmp/moe_fused && /tmp/moe_fused
#include "../../crates/osprey-cuda/kernels/gemv.cu"
#include "../../crates/osprey-cuda/kernels/moe.cu"
#include "harness.cuh"
#include <cmath>
#include <cooperative_groups.h>

namespace cg = cooperative_groups;

#define CLUSTER 8
// router rows per warp: E / CLUSTER / 8 warps (256 experts: 4)
#define ROUTER_ROWS 4
#define LAUNCHES 24

struct FusedArgs {
    // x, its RMSNorm weight, eps, K = H, group 64; seg[0] the router (8-bit, E rows), seg[1] the
    // shared expert's gate logit (8-bit, 1 row), seg[2] / seg[3] its gate / up projections (4-bit)
    GemvArgs in;
    // the expert stacks, topk, h, experts, renorm, H, I, k (router_logits and the shared_* inputs
    // are produced here)
    GateUpArgs gu;
};

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(256, 1)
    moe_route_gate_up(const __grid_constant__ FusedArgs a) {
    __shared__ __align__(16) float xs[MAX_K + MAX_K / 8];
    __shared__ float chunk_sum[MAX_K / 16];
    __shared__ uint4 xb8[MAX_K / 64 * 8];
    __shared__ float2 gx[MAX_K / 64];
    __shared__ float scratch[32];
    __shared__ float slice[MAX_E / CLUSTER];  // this block's share of the router logits
    __shared__ float logits[MAX_E];           // all of them, gathered from the cluster
    __shared__ float shared_rows[8];          // this block's shared-expert gate (0..3) and up (4..7) rows
    __shared__ float shared_logit;
    __shared__ int ids[MAX_TOPK];
    __shared__ float wts[MAX_TOPK];
    __shared__ float part[8][32];
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank(), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int H = a.gu.H, I = a.gu.I, E = a.gu.experts, per = E / CLUSTER;
    // every row this block multiplies is requested before the input's normalisation: the router
    // rows of its rank (ROUTER_ROWS per warp), one shared-expert row per warp, and in warp 0 the
    // shared gate logit's row
    const Segment& shared_seg = a.in.seg[warp < 4 ? 2 : 3];
    const int f = blockIdx.x * 4 + (warp & 3);
    RowLoads rl[ROUTER_ROWS], sl, gl;
#pragma unroll
    for (int j = 0; j < ROUTER_ROWS; ++j)
        if (warp + 8 * j < per) load_row(a.in.seg[0], rank * per + warp + 8 * j, H, a.in.group, rl[j]);
    load_row(shared_seg, min(f, I - 1), H, a.in.group, sl);
    if (warp == 0) load_row(a.in.seg[1], 0, H, a.in.group, gl);
    step_overlap_begin();
    step_inputs_ready();
    load_input(a.in, xs, chunk_sum, scratch);
    build_x_s8(xs, H, xb8, gx);
#pragma unroll
    for (int j = 0; j < ROUTER_ROWS; ++j) {
        if (warp + 8 * j < per) {
            const float y = row_dot(a.in.seg[0], rl[j], H, xs, chunk_sum);
            if (lane == 0) slice[warp + 8 * j] = y;
        }
    }
    {
        const float y = row_dot(shared_seg, sl, H, xs, chunk_sum);
        if (lane == 0) shared_rows[warp] = y;
    }
    if (warp == 0) {
        const float y = row_dot(a.in.seg[1], gl, H, xs, chunk_sum);
        if (lane == 0) shared_logit = y;
    }
    cluster.sync();  // every rank's slice written (and this block's shared rows, x fragments)
    for (int i = threadIdx.x; i < E; i += blockDim.x) logits[i] = *cluster.map_shared_rank(&slice[i % per], i / per);
    if (threadIdx.x < 4 && blockIdx.x * 4 + threadIdx.x < I)
        a.gu.h[a.gu.k * I + blockIdx.x * 4 + threadIdx.x] =
            sigmoidf(shared_logit) * siluf(shared_rows[threadIdx.x]) * shared_rows[4 + threadIdx.x];
    __syncthreads();
    if (warp == 0) {
        GateUpArgs sel = a.gu;
        sel.router_logits = logits;  // generic addressing reaches shared memory
        select_experts(sel, ids, wts);
    }
    __syncthreads();
    // expert tiles: kparts warps per tile, 8 / kparts tiles per block at a time
    const int P = a.gu.kparts, per_block = 8 / P;
    const int wt = warp / P, kp = warp % P, gpr = H / 64, g0 = kp * gpr / P, g1 = (kp + 1) * gpr / P;
    const int fblocks = I / 16, total = a.gu.k * fblocks;
    const QRows gate{a.gu.gate.codes, a.gu.gate.scales, a.gu.gate.biases, E * I};
    const QRows up{a.gu.up.codes, a.gu.up.scales, a.gu.up.biases, E * I};
    for (int b0 = blockIdx.x * per_block; b0 < total; b0 += gridDim.x * per_block) {
        const int u = b0 + wt;
        if (u < total) {
            TileBatch gb[2], ub[2];
            gate_up_request(gate, up, H, ids[u / fblocks] * I + (u % fblocks) * 16, g0, g1, gb, ub);
            gate_up_multiply(gb, ub, g0, g1, xb8, gx, part[warp]);
        }
        __syncthreads();
        gate_up_write(a.gu, part, wts, b0, P, total);
        __syncthreads();
    }
    cluster.sync();  // no block leaves while another may still read its slice
}

int main() {
    const int H = 2048, I = 512, E = 256, K = 8, grid = 128, P = 4;
    const HostQ4 router = random_q(E, H, 8, 0.001f, 0.002f), gate_logit = random_q(1, H, 8, 0.001f, 0.002f);
    const HostQ4 sgate = random_q4(I, H, 0.01f, 0.05f), sup = random_q4(I, H, 0.01f, 0.05f);
    const HostQ4 gate = random_q4((size_t)E * I, H, 0.01f, 0.05f), up = random_q4((size_t)E * I, H, 0.01f, 0.05f);
    const ExpertStack d_router = upload_q4(router), d_gl = upload_q4(gate_logit), d_sg = upload_q4(sgate), d_su = upload_q4(sup);
    const ExpertStack d_gate = upload_q4(gate), d_up = upload_q4(up);
    std::vector<float> xs_host((size_t)LAUNCHES * H), nw(H);
    for (auto& v : xs_host) v = (rand() % 2001 - 1000) / 1000.f;
    for (auto& v : nw) v = 0.5f + (rand() % 1001) / 1000.f;
    float *d_x = upload(xs_host), *d_nw = upload(nw);
    float *d_logits, *d_gl_out, *d_sgo, *d_suo, *d_h_ref, *d_h;
    CK(cudaMalloc(&d_logits, E * 4));
    CK(cudaMalloc(&d_gl_out, 4));
    CK(cudaMalloc(&d_sgo, I * 4));
    CK(cudaMalloc(&d_suo, I * 4));
    CK(cudaMalloc(&d_h_ref, (K + 1) * I * 4));
    CK(cudaMalloc(&d_h, (K + 1) * I * 4));
    TopK *d_topk_ref, *d_topk;
    CK(cudaMalloc(&d_topk_ref, sizeof(TopK)));
    CK(cudaMalloc(&d_topk, sizeof(TopK)));

    auto gemv_args = [&](int i) {
        GemvArgs g{};
        g.seg[0] = Segment{d_router.codes, d_router.scales, d_router.biases, d_logits, E, 8, 0, 0};
        g.seg[1] = Segment{d_gl.codes, d_gl.scales, d_gl.biases, d_gl_out, 1, 8, 0, 0};
        g.seg[2] = Segment{d_sg.codes, d_sg.scales, d_sg.biases, d_sgo, I, 4, 0, 0};
        g.seg[3] = Segment{d_su.codes, d_su.scales, d_su.biases, d_suo, I, 4, 0, 0};
        g.nseg = 4;
        g.x = d_x + (size_t)i * H;
        g.norm_weight = d_nw;
        g.eps = 1e-6f;
        g.K = H;
        g.group = 64;
        return g;
    };
    auto gu_args = [&](int i, float* h, TopK* topk, int kparts) {
        GateUpArgs a{};
        a.gate = d_gate;
        a.up = d_up;
        a.topk = topk;
        a.x = d_x + (size_t)i * H;
        a.norm_weight = d_nw;
        a.eps = 1e-6f;
        a.router_logits = d_logits;
        a.experts = E;
        a.renorm = 1;
        a.shared_gate_proj = d_sgo;
        a.shared_up_proj = d_suo;
        a.shared_gate_logit = d_gl_out;
        a.h = h;
        a.H = H;
        a.I = I;
        a.k = K;
        a.kparts = kparts;
        return a;
    };
    const int rows_blocks = (E + 1 + 2 * I + 7) / 8;  // the engine's row-path grid (one row per warp)
    auto launch_ref = [&](int i, cudaStream_t st) {
        gemv_q<<<rows_blocks, 256, 0, st>>>(gemv_args(i));
        moe_gate_up<<<K * I / 16, 256, 0, st>>>(gu_args(i, d_h_ref, d_topk_ref, 8));
    };
    auto launch_fused = [&](int i, cudaStream_t st) {
        moe_route_gate_up<<<grid, 256, 0, st>>>(FusedArgs{gemv_args(i), gu_args(i, d_h, d_topk, P)});
    };

    // the same inputs through both paths
    int worst_ids = 0;
    double worst = 0.0;
    for (int i = 0; i < 4; ++i) {
        launch_ref(i, 0);
        launch_fused(i, 0);
        CK(cudaDeviceSynchronize());
        std::vector<float> a((K + 1) * I), b((K + 1) * I);
        TopK ta, tb;
        CK(cudaMemcpy(a.data(), d_h_ref, a.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), d_h, b.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&ta, d_topk_ref, sizeof(TopK), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(&tb, d_topk, sizeof(TopK), cudaMemcpyDeviceToHost));
        for (int s = 0; s < K; ++s) worst_ids += ta.ids[s] != tb.ids[s];
        double num = 0.0, den = 0.0;
        for (size_t j = 0; j < a.size(); ++j) {
            num += ((double)b[j] - a[j]) * ((double)b[j] - a[j]);
            den += (double)a[j] * a[j];
        }
        worst = std::fmax(worst, std::sqrt(num / den));
    }
    printf("fused vs two launches, 4 inputs: %d selected experts differ, h worst relative RMS %.2e\n", worst_ids, worst);

    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    auto time_graph = [&](bool fused) {
        return graph_us(st, LAUNCHES, [&](int i) { fused ? launch_fused(i, st) : launch_ref(i, st); });
    };
    printf("router gemv + moe_gate_up: %6.2f us per MoE block\n", time_graph(false));
    printf("moe_route_gate_up (fused): %6.2f us per MoE block\n", time_graph(true));
    return 0;
}
