// Prototype: the GDN prefill's causal conv + SiLU, q/k L2 norms, q·k and gates as ONE kernel
// (gdn_conv_qk_gates), against the engine's gdn_conv then gdn_qk_gates (crates/osprey-cuda/
// kernels/gdn_prefill.cu, included as is; gdn_conv_state stays a separate launch either way: its
// state buffer may be the one the conv reads).
// Why: at a 4K prompt the three launches take 7.6 ms over 30 layers (0.25 ms a layer for ~400 MB
// moved); gdn_conv writes conv_out and gdn_qk_gates reads and rewrites its q and k halves. Fused,
// a block owns one token: it reads the 4 conv input rows (L2 serves the 3 its neighbours also
// read), writes the finished row once.
// Geometry: block t of T, 256 threads; thread i owns channels 4i + 1024j (j < 8) as float4, so
// warp w holds head w of every 1024-channel slice: q heads 8s + w (slices 0, 1), k heads (2, 3),
// v (4..7); a head's norm is one warp sum, and q head h meets k head h in the same lanes for q·k
// (the same reduction order as gdn_qk_gates). Needs conv_dim = 8192 (Hk = 16 key heads of 128,
// Hv = 32 value heads), kernel size 4.
// Checked against the engine's kernels on random inputs (conv_out and gates relative RMS);
// timed as 10 layers' worth of launches in a CUDA graph, best of 5, at T = 4096.
// Written without a GPU at hand (compiled here with nvcc -c): NOT YET RUN.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gdn_conv_fused.cu -o /tmp/gdn_conv_fused && /tmp/gdn_conv_fused
#include "../../crates/osprey-cuda/kernels/gdn_prefill.cu"
#include "harness.cuh"
#include <cmath>
#include <vector>

#define FUSED_CONV_DIM 8192

extern "C" __global__ void __launch_bounds__(256) gdn_conv_qk_gates(GdnPrefillArgs p) {
    __shared__ float qk[16];
    const int t = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int c = 4 * tid + 1024 * j;
        const float4 w0 = reinterpret_cast<const float4*>(p.conv_w)[c + 0];  // taps of channel c
        const float4 w1 = reinterpret_cast<const float4*>(p.conv_w)[c + 1];
        const float4 w2 = reinterpret_cast<const float4*>(p.conv_w)[c + 2];
        const float4 w3 = reinterpret_cast<const float4*>(p.conv_w)[c + 3];
        const float wt[4][4] = {{w0.x, w0.y, w0.z, w0.w}, {w1.x, w1.y, w1.z, w1.w}, {w2.x, w2.y, w2.z, w2.w}, {w3.x, w3.y, w3.z, w3.w}};
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = t + k;  // extended-sequence index: 3 state rows, then the chunk
            const float4 in = i < 3 ? reinterpret_cast<const float4*>(p.state_in + (size_t)i * p.conv_dim + c)[0]
                                    : reinterpret_cast<const float4*>(p.qkv + (size_t)(i - 3) * p.conv_dim + c)[0];
            s[0] = fmaf(wt[0][k], in.x, s[0]);
            s[1] = fmaf(wt[1][k], in.y, s[1]);
            s[2] = fmaf(wt[2][k], in.z, s[2]);
            s[3] = fmaf(wt[3][k], in.w, s[3]);
        }
        v[j] = make_float4(siluf(s[0]), siluf(s[1]), siluf(s[2]), siluf(s[3]));
    }
    // q heads (slices 0, 1) and k heads (2, 3): L2 norms, q also by 1/sqrt(128); then q·k
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        float4& q = v[s];
        float4& k = v[2 + s];
        const float qi = rsqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f) * rsqrtf((float)DK);
        const float ki = rsqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
        q.x *= qi; q.y *= qi; q.z *= qi; q.w *= qi;
        k.x *= ki; k.y *= ki; k.z *= ki; k.w *= ki;
        const float dot = warp_sum(q.x * k.x + q.y * k.y + q.z * k.z + q.w * k.w);
        if (lane == 0) qk[8 * s + warp] = dot;
    }
    float* row = p.conv_out + (size_t)t * p.conv_dim;
#pragma unroll
    for (int j = 0; j < 8; ++j) reinterpret_cast<float4*>(row + 4 * tid + 1024 * j)[0] = v[j];
    __syncthreads();
    const int rep = p.hv / p.hk;
    for (int h = tid; h < p.hv; h += blockDim.x) {
        const float xa = p.a[(size_t)t * p.hv + h] + p.dt_bias[h];
        const float softplus = xa > 20.f ? xa : log1pf(__expf(xa));
        const float g = -__expf(p.a_log[h]) * softplus;
        reinterpret_cast<float4*>(p.gates)[(size_t)t * p.hv + h] =
            make_float4(sigmoidf(p.b[(size_t)t * p.hv + h]), __expf(g), qk[h / rep], g);
    }
}

static float* random_f(size_t n, float lo, float hi) {
    std::vector<float> v(n);
    for (auto& x : v) x = lo + (hi - lo) * (rand() % 10001) / 10000.f;
    return upload(v);
}

static double rel_rms(const float* a, const float* b, size_t n) {
    std::vector<float> x(n), y(n);
    CK(cudaMemcpy(x.data(), a, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(y.data(), b, n * 4, cudaMemcpyDeviceToHost));
    double e = 0, r = 0;
    for (size_t i = 0; i < n; ++i) {
        e += (double)(x[i] - y[i]) * (x[i] - y[i]);
        r += (double)y[i] * y[i];
    }
    return std::sqrt(e / r);
}

int main() {
    const int T = 4096, conv_dim = FUSED_CONV_DIM, K = 4, hk = 16, hv = 32, layers = 10;
    GdnPrefillArgs p{};
    p.qkv = random_f((size_t)T * conv_dim, -2.f, 2.f);
    p.conv_w = random_f((size_t)conv_dim * K, -0.5f, 0.5f);
    p.state_in = random_f((size_t)(K - 1) * conv_dim, -2.f, 2.f);
    p.b = random_f((size_t)T * hv, -3.f, 3.f);
    p.a = random_f((size_t)T * hv, -3.f, 3.f);
    p.a_log = random_f(hv, -1.f, 1.f);
    p.dt_bias = random_f(hv, -1.f, 1.f);
    CK(cudaMalloc(&p.conv_out, (size_t)T * conv_dim * 4));
    CK(cudaMalloc(&p.gates, (size_t)T * hv * 16));
    p.T = T;
    p.conv_dim = conv_dim;
    p.kernel = K;
    p.hk = hk;
    p.hv = hv;
    GdnPrefillArgs f = p;
    CK(cudaMalloc(&f.conv_out, (size_t)T * conv_dim * 4));
    CK(cudaMalloc(&f.gates, (size_t)T * hv * 16));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    auto engine = [&] {
        gdn_conv<<<dim3(T, conv_dim / 256), 256, 0, st>>>(p);
        gdn_qk_gates<<<T, 256, 0, st>>>(p);
    };
    auto fused = [&] { gdn_conv_qk_gates<<<T, 256, 0, st>>>(f); };
    engine();
    fused();
    CK(cudaStreamSynchronize(st));
    printf("conv_out relative RMS %.2e, gates relative RMS %.2e (fused vs engine; identical arithmetic expected)\n",
           rel_rms(f.conv_out, p.conv_out, (size_t)T * conv_dim), rel_rms(f.gates, p.gates, (size_t)T * hv * 4));
    const double te = graph_us(st, layers, [&](int) { engine(); }), tf = graph_us(st, layers, [&](int) { fused(); });
    const double bytes = 2.0 * T * conv_dim * 4;  // qkv read once from DRAM, conv_out written once
    printf("T %d: engine gdn_conv + gdn_qk_gates %.1f us, fused %.1f us per layer (floor %.1f us at 3.7 TB/s)\n", T, te, tf,
           bytes / 3.7e6);
    return 0;
}
