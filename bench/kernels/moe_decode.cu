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
// A moe_down with its segment tiles in shared memory (bulk-copied codes, cp.async scales and
// biases, quad multiply) was right but not faster here (6.76 vs 6.54 us): commit 0f1b666,
// bench/results/cuda-decode-moe-down-resident-harness.json.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/moe_decode.cu -o /tmp/moe_decode && /tmp/moe_decode
#include "../../crates/osprey-cuda/kernels/moe.cu"
#include "harness.cuh"
#include <algorithm>
#include <cmath>

#define LAUNCHES 24

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

    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    auto graph_of = [&](bool with_gate_up, bool with_down) {
        return graph_us(st, LAUNCHES, [&](int i) {
            if (with_gate_up) moe_gate_up<<<gu_grid, gu_block, gu_smem, st>>>(gate_up_args(i));
            if (with_down) moe_down<<<dn_grid, dn_block, 0, st>>>(da);
        });
    };
    const double gu_bytes = 2.0 * K * I * (H / 2 + H / 64 * 4), dn_bytes = (K + 1.0) * H * (I / 2 + I / 64 * 4);
    printf("moe_gate_up alone   %6.2f us  (%.1f MB, read at 4.3 TB/s: %.2f us)\n", graph_of(true, false), gu_bytes / 1e6,
           gu_bytes / 4.3e6);
    printf("moe_down alone      %6.2f us  (%.1f MB, read at 4.3 TB/s: %.2f us)\n", graph_of(false, true), dn_bytes / 1e6,
           dn_bytes / 4.3e6);
    printf("gate/up + down pair %6.2f us\n", graph_of(true, true));
    return 0;
}
