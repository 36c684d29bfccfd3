// The decode step's MoE pair standalone: moe_gate_up (expert selection + routed gate/up + SwiGLU)
// and moe_down (8 experts + shared expert + residual), from crates/osprey-cuda/kernels/moe.cu
// included as is, on the full model's shapes: H 2048, I 512, 256 experts, top-8, 4-bit group 64.
// Each of the 24 launches of a graph has its own router logits, so the selected experts (and the
// 8.4 + 4.7 MB they read) change from launch to launch as between layers; the 302 + 151 MB of
// expert stacks are far past the 60 MB L2. Best of 5 replays, microseconds per launch: gate/up
// alone, down alone, and the pair as the step issues it. One pair is first checked against a
// double-precision host reference (the selection, h, and the residual update).
// The question behind it: gate/up takes 11 us in the decode graph for 8.4 MB (a 2 us read), and
// requesting its weights earlier inside the kernel did not help
// (bench/results/cuda-decode-gate-up-selection-ablation.json): where does the time go? Run it
// under `ncu --section SourceCounters` as well. Results: bench/results/cuda-moe-harnesses-h200.json
// (register tiles) and cuda-decode-moe-gate-up-resident.json (tiles in shared memory).
// moe_down_resident below is a candidate for the engine written at the end of session 8, after
// its device time ran out: compiled, not yet run on a GPU (its check line says whether it is right).
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/moe_decode.cu -o /tmp/moe_decode && /tmp/moe_decode
#include "../../crates/osprey-cuda/kernels/moe.cu"
#include "harness.cuh"
#include <algorithm>
#include <cmath>

#define LAUNCHES 24

// Variant under test (not in the engine): moe_down with the block's k + 1 segment tiles in shared
// memory, the form that took moe_gate_up from 11.6 to 8.4 us in the step: codes by bulk copies
// (one 4 KB copy per segment), scales and biases by 16-byte cp.async (each segment's are only
// 256 B, and one SM's copy engine pays ~100 ns per request), multiplied by quads (tiles.cuh
// quad_dot). Shared memory: moe_down_resident_smem.
__host__ __device__ inline int moe_down_resident_smem(int H, int I, int k) {
    const int segs = k + 1, gps = I / 64, Kv = segs * I;
    return segs * 16 * (I / 2 + 2 * gps * 2) + (Kv + Kv / 8) * 4 + Kv / 64 * 8 * 16 + Kv / 64 * 8 + segs * (gps / 4) * 16 * 4 + 8;
}

__global__ void __launch_bounds__(32 * (MAX_TOPK + 1)) moe_down_resident(DownArgs a) {
    extern __shared__ __align__(128) char down_smem[];
    const int I = a.I, k = a.k, segs = k + 1, Kv = segs * I, gps = I / 64, quads = gps / 4, row0 = blockIdx.x * 16;
    char* codes = down_smem;  // [seg][16 rows][I/2]
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + segs * 16 * (I / 2));  // [seg][16][gps]
    __nv_bfloat16* biases = scales + segs * 16 * gps;
    float* hs = reinterpret_cast<float*>(biases + segs * 16 * gps);  // Kv floats, padded
    uint4* xb8 = reinterpret_cast<uint4*>(hs + Kv + Kv / 8);
    float2* gx = reinterpret_cast<float2*>(xb8 + Kv / 64 * 8);
    float* part = reinterpret_cast<float*>(gx + Kv / 64);  // [unit][16]
    uint64_t* full = reinterpret_cast<uint64_t*>(part + segs * quads * 16);
    const int warp = threadIdx.x >> 5;
    step_overlap_begin();
    step_inputs_ready();
    auto seg_rows = [&](int s, ExpertStack& st) {
        st = s < k ? a.down : a.shared_down;
        return (size_t)(s < k ? a.topk->ids[s] : 0) * a.H + row0;
    };
    if (threadIdx.x == 0) {
        mbar_init(full, 1);
        mbar_init_fence();
        mbar_arrive_expect_bytes(full, segs * 16 * (I / 2));
        for (int s = 0; s < segs; ++s) {
            ExpertStack st;
            const size_t base = seg_rows(s, st);
            bulk_copy_to_shared(codes + s * 16 * (I / 2), st.codes + base * (I / 8), 16 * (I / 2), full);
        }
    }
    // each segment's scales and biases (16 rows x gps bf16 each) in 16-byte chunks
    const int chunks = 16 * gps * 2 / 16;  // per segment and kind
    for (int c = threadIdx.x; c < segs * 2 * chunks; c += blockDim.x) {
        const int s = c / (2 * chunks), kind = (c / chunks) & 1, j = c % chunks;
        ExpertStack st;
        const size_t base = seg_rows(s, st);
        const __nv_bfloat16* src = (kind ? st.biases : st.scales) + base * gps + j * 8;
        cp_async16((kind ? biases : scales) + s * 16 * gps + j * 8, src, true);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    load_h_bytes(a.h, Kv, hs, xb8, gx);
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();
    mbar_wait(full, 0);
    QuadX X;
    for (int un = warp; un < segs * quads; un += blockDim.x / 32) {
        const int s = un / quads, gq = (un % quads) * 4;
        load_quad_x(xb8 + s * gps * 8, gx + s * gps, gq, X);
        float yA = 0.f, yB = 0.f;
        quad_dot(codes + s * 16 * (I / 2), scales + s * 16 * gps, biases + s * 16 * gps, I, gq, X, yA, yB);
        store_quad_sums(part + un * 16, yA, yB);
    }
    __syncthreads();
    if (threadIdx.x < 16 && row0 + threadIdx.x < a.H) {
        float y = 0.f;
        for (int un = 0; un < segs * quads; ++un) y += part[un * 16 + threadIdx.x];
        a.x[row0 + threadIdx.x] += y;
    }
}

static double dequant(const HostQ4& w, size_t row, int K, int k) {
    const uint32_t word = w.codes[row * (K / 8) + k / 8];
    const double q = (word >> (4 * (k % 8))) & 0xF;
    const size_t g = row * (K / 64) + k / 64;
    return (double)__bfloat162float(w.scales[g]) * q + (double)__bfloat162float(w.biases[g]);
}

static double silu(double v) { return v / (1.0 + std::exp(-v)); }

static double rel_rms(const std::vector<double>& want, const std::vector<float>& got) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return std::sqrt(num / den);
}

int main() {
    const int H = 2048, I = 512, E = 256, K = 8;
    const HostQ4 gate = random_q4((size_t)E * I, H, 0.01f, 0.05f), up = random_q4((size_t)E * I, H, 0.01f, 0.05f);
    const HostQ4 down = random_q4((size_t)E * H, I, 0.01f, 0.05f), sdown = random_q4(H, I, 0.01f, 0.05f);
    const ExpertStack dg = upload_q4(gate), du = upload_q4(up), dd = upload_q4(down), dsd = upload_q4(sdown);
    std::vector<float> logits((size_t)LAUNCHES * E), x(H), nw(H), sg(I), su(I), sl{0.3f};
    for (auto& v : logits) v = (rand() % 8001 - 4000) / 1000.f;
    for (auto& v : x) v = (rand() % 2001 - 1000) / 1000.f;
    for (auto& v : nw) v = 0.5f + (rand() % 1001) / 1000.f;
    for (auto& v : sg) v = (rand() % 2001 - 1000) / 500.f;
    for (auto& v : su) v = (rand() % 2001 - 1000) / 500.f;
    float *d_logits = upload(logits), *d_x = upload(x), *d_nw = upload(nw), *d_sg = upload(sg), *d_su = upload(su);
    float* d_sl = upload(sl);
    float* d_h;
    CK(cudaMalloc(&d_h, (size_t)(K + 1) * I * 4));
    TopK* d_topk;
    CK(cudaMalloc(&d_topk, sizeof(TopK)));

    auto gate_up_args = [&](int i) {
        GateUpArgs a{};
        a.gate = dg;
        a.up = du;
        a.topk = d_topk;
        a.x = d_x;
        a.norm_weight = d_nw;
        a.eps = 1e-6f;
        a.router_logits = d_logits + (size_t)i * E;
        a.experts = E;
        a.renorm = 1;
        a.shared_gate_proj = d_sg;
        a.shared_up_proj = d_su;
        a.shared_gate_logit = d_sl;
        a.h = d_h;
        a.H = H;
        a.I = I;
        a.k = K;
        return a;
    };
    DownArgs da{};
    da.down = dd;
    da.shared_down = dsd;
    da.h = d_h;
    da.topk = d_topk;
    da.x = d_x;
    da.H = H;
    da.I = I;
    da.k = K;
    // one block per 16-row tile pair; dynamic shared memory as decoder.rs's gate_up_smem
    const int groups = H / 64;
    const int gu_smem = 2 * 16 * (H / 2 + 2 * groups * 2) + groups * 8 * 16 + groups * 8 + 2 * (groups / 4) * 16 * 4 + 32 * 4 + 2 * 16 * 4 + 8;
    CK(cudaFuncSetAttribute(moe_gate_up, cudaFuncAttributeMaxDynamicSharedMemorySize, gu_smem));
    const dim3 gu_grid(K * I / 16), gu_block(256), dn_grid(H / 16), dn_block(32 * (K + 1));

    // one pair against the host
    moe_gate_up<<<gu_grid, gu_block, gu_smem>>>(gate_up_args(0));
    moe_down<<<dn_grid, dn_block>>>(da);
    CK(cudaDeviceSynchronize());
    std::vector<float> h((size_t)(K + 1) * I), x_after(H);
    TopK topk;
    CK(cudaMemcpy(h.data(), d_h, h.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(x_after.data(), d_x, H * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&topk, d_topk, sizeof(TopK), cudaMemcpyDeviceToHost));
    double ss = 0.0;
    for (float v : x) ss += (double)v * v;
    const double inv = 1.0 / std::sqrt(ss / H + 1e-6);
    std::vector<double> xn(H);
    for (int k = 0; k < H; ++k) xn[k] = x[k] * inv * nw[k];
    std::vector<int> order(E);
    for (int e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int p, int q) { return logits[p] > logits[q]; });
    double chosen = 0.0;
    for (int s = 0; s < K; ++s) chosen += std::exp((double)logits[order[s]] - logits[order[0]]);
    int id_mismatch = 0;
    std::vector<double> h_ref((size_t)(K + 1) * I), dx_ref(H, 0.0);
    for (int s = 0; s < K; ++s) {
        const int e = order[s];
        id_mismatch += topk.ids[s] != e;
        const double w = std::exp((double)logits[e] - logits[order[0]]) / chosen;
        for (int f = 0; f < I; ++f) {
            double g = 0.0, u = 0.0;
            for (int k = 0; k < H; ++k) {
                g += dequant(gate, (size_t)e * I + f, H, k) * xn[k];
                u += dequant(up, (size_t)e * I + f, H, k) * xn[k];
            }
            h_ref[(size_t)s * I + f] = w * silu(g) * u;
        }
    }
    for (int f = 0; f < I; ++f) h_ref[(size_t)K * I + f] = 1.0 / (1.0 + std::exp(-(double)sl[0])) * silu(sg[f]) * su[f];
    for (int n = 0; n < H; ++n) {
        for (int s = 0; s <= K; ++s) {
            const HostQ4& m = s < K ? down : sdown;
            const size_t row = s < K ? (size_t)order[s] * H + n : (size_t)n;
            for (int j = 0; j < I; ++j) dx_ref[n] += dequant(m, row, I, j) * h_ref[(size_t)s * I + j];
        }
    }
    std::vector<float> dx(H);
    for (int n = 0; n < H; ++n) dx[n] = x_after[n] - x[n];
    printf("check: selected experts %s the host's; h rel RMS %.2e, residual update rel RMS %.2e\n",
           id_mismatch ? "DIFFER from" : "match", rel_rms(h_ref, h), rel_rms(dx_ref, dx));
    // the variant on the same h, from the same residual
    const int dr_smem = moe_down_resident_smem(H, I, K);
    CK(cudaFuncSetAttribute(moe_down_resident, cudaFuncAttributeMaxDynamicSharedMemorySize, dr_smem));
    CK(cudaMemcpy(d_x, x.data(), H * 4, cudaMemcpyHostToDevice));
    moe_down_resident<<<dn_grid, dn_block, dr_smem>>>(da);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(x_after.data(), d_x, H * 4, cudaMemcpyDeviceToHost));
    for (int n = 0; n < H; ++n) dx[n] = x_after[n] - x[n];
    printf("check: moe_down_resident residual update rel RMS %.2e (%d B of shared memory)\n", rel_rms(dx_ref, dx), dr_smem);

    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    auto graph_of = [&](bool with_gate_up, bool with_down, bool resident_down = false) {
        return graph_us(st, LAUNCHES, [&](int i) {
            if (with_gate_up) moe_gate_up<<<gu_grid, gu_block, gu_smem, st>>>(gate_up_args(i));
            if (with_down && resident_down) moe_down_resident<<<dn_grid, dn_block, dr_smem, st>>>(da);
            else if (with_down) moe_down<<<dn_grid, dn_block, 0, st>>>(da);
        });
    };
    const double gu_bytes = 2.0 * K * I * (H / 2 + H / 64 * 4), dn_bytes = (K + 1.0) * H * (I / 2 + I / 64 * 4);
    printf("moe_gate_up alone   %6.2f us  (%.1f MB, read at 4.3 TB/s: %.2f us)\n", graph_of(true, false), gu_bytes / 1e6,
           gu_bytes / 4.3e6);
    printf("moe_down alone      %6.2f us  (%.1f MB, read at 4.3 TB/s: %.2f us)\n", graph_of(false, true), dn_bytes / 1e6,
           dn_bytes / 4.3e6);
    printf("gate/up + down pair %6.2f us\n", graph_of(true, true));
    printf("moe_down_resident alone %6.2f us; pair with it %6.2f us\n", graph_of(false, true, true), graph_of(true, true, true));
    return 0;
}
