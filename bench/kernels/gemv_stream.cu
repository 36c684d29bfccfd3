// The decode GEMV's tile kernel (gemv_q_tiles) against the streamed form (gemv_q_stream: a block's
// tiles requested at once by 16 KB bulk copies into shared memory), both from
// crates/osprey-cuda/kernels/gemv.cu included as is, on the full model's decode shapes.
// Per shape: enough weight copies to pass the 60 MB L2, 24 launches cycling through them in one
// CUDA graph, best of 5 replays; microseconds per launch. Variants of the streamed form: the most
// stages (tiles per slot) that fit, 2 stages, and 2 or 1 stages with programmatic dependent
// launch. Outputs are compared with the tile kernel's (relative RMS difference).
// Ran on the H200 at 072c82a: bench/results/cuda-gemv-stream-h200.json (the engine streams only
// the K = 4096 output projections, where it wins: 7.0 vs 9.3 us).
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/gemv_stream.cu -o /tmp/gemv_stream && /tmp/gemv_stream
#include "../../crates/osprey-cuda/kernels/gemv.cu"
#include "harness.cuh"
#include <cmath>
#include <vector>

#define LAUNCHES 24

struct Shape {
    const char* name;
    int K;
    std::vector<int> rows;  // segments sharing x
};

static size_t stage_bytes(int K) { return 16 * (size_t)(K / 2); }

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int smem_optin = 0;
    CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, gemv_q_stream));
    CK(cudaFuncSetAttribute(gemv_q_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin - (int)fa.sharedSizeBytes));
    printf("gemv_q_stream: %d registers, %zu B static shared memory; %d B opt-in per block\n", fa.numRegs, fa.sharedSizeBytes,
           smem_optin);
    const Shape shapes[] = {
        {"gdn_in_proj", 2048, {8192, 4096, 32, 32}},
        {"attn_qkv", 2048, {9216}},
        {"out_proj", 4096, {2048}},
        {"lm_head", 2048, {248320}},
    };
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    for (const Shape& sh : shapes) {
        const int K = sh.K;
        size_t rows = 0;
        for (int r : sh.rows) rows += r;
        const size_t bytes = rows * (K / 2 + K / 64 * 4);
        const int copies = (int)std::min<size_t>(LAUNCHES, std::max<size_t>(1, (150u << 20) / bytes + 1));
        const HostQ4 w = random_q4(rows, K, 0.01f, 0.05f);
        float* x = random_x(K);
        std::vector<GemvArgs> args(copies);
        float* outs;
        CK(cudaMalloc(&outs, (size_t)copies * rows * 4));
        for (int c = 0; c < copies; ++c) {
            const ExpertStack d = upload_q4(w);
            GemvArgs a{};
            size_t r0 = 0;
            for (size_t i = 0; i < sh.rows.size(); ++i) {
                a.seg[i] = Segment{d.codes + r0 * K / 8, d.scales + r0 * K / 64, d.biases + r0 * K / 64, outs + c * rows + r0, sh.rows[i], 4, 0, 0};
                r0 += sh.rows[i];
            }
            a.nseg = (int)sh.rows.size();
            a.x = x;
            a.K = K;
            a.group = 64;
            a.tiles = 1;
            args[c] = a;
        }
        int tiles = 0;
        for (int r : sh.rows) tiles += (r + 15) / 16;
        const int tile_grid = std::min((tiles + 1) / 2, 3 * sms);
        const int stream_grid = std::min(tiles, sms);
        const int static_smem = (int)fa.sharedSizeBytes;
        auto stream_smem = [&](int S) { return (int)(STREAM_SLOTS * S * (stage_bytes(K) + (size_t)STREAM_WARPS * 16 * 4)); };
        int max_stages = 0;
        while (max_stages < STREAM_MAX_STAGES && stream_smem(max_stages + 1) + static_smem <= smem_optin) ++max_stages;
        auto run = [&](int variant, int S, bool pdl) {  // variant 0: tiles, 1: stream
            cudaGraph_t gr;
            cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < LAUNCHES; ++i) {
                GemvArgs a = args[i % copies];
                a.stages = S;
                cudaLaunchConfig_t cfg{};
                cudaLaunchAttribute attr{};
                attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
                attr.val.programmaticStreamSerializationAllowed = 1;
                cfg.blockDim = dim3(variant == 0 ? 256 : STREAM_SLOTS * STREAM_WARPS * 32);
                cfg.stream = st;
                cfg.attrs = &attr;
                cfg.numAttrs = pdl ? 1 : 0;
                if (variant == 0) {
                    cfg.gridDim = dim3(tile_grid);
                    CK(cudaLaunchKernelEx(&cfg, gemv_q_tiles, a));
                } else {
                    cfg.gridDim = dim3(stream_grid);
                    cfg.dynamicSmemBytes = stream_smem(S);
                    CK(cudaLaunchKernelEx(&cfg, gemv_q_stream, a));
                }
            }
            CK(cudaStreamEndCapture(st, &gr));
            CK(cudaGraphInstantiate(&ge, gr, 0));
            const float us = best_ms(st, [&] { CK(cudaGraphLaunch(ge, st)); }) * 1e3f / LAUNCHES;
            CK(cudaGraphExecDestroy(ge));
            CK(cudaGraphDestroy(gr));
            std::vector<float> y((size_t)copies * rows);
            CK(cudaMemcpy(y.data(), outs, y.size() * 4, cudaMemcpyDeviceToHost));
            CK(cudaMemset(outs, 0, y.size() * 4));
            return std::make_pair(us, y);
        };
        auto ref = run(0, 0, false);
        printf("%-12s %zu x %d, %d copies (%.1f MB each), read at 4.3 TB/s: %.2f us\n", sh.name, rows, K, copies, bytes / 1e6,
               bytes / 4.3e6);
        printf("  %-28s %7.2f us\n", "tiles (gemv_q_tiles)", ref.first);
        const struct { int S; bool pdl; } vs[] = {{max_stages, false}, {2, false}, {2, true}, {1, true}};
        for (auto v : vs) {
            auto got = run(1, v.S, v.pdl);
            double num = 0.0, den = 0.0;
            for (size_t i = 0; i < got.second.size(); ++i) {
                const double d = (double)got.second[i] - ref.second[i];
                num += d * d;
                den += (double)ref.second[i] * ref.second[i];
            }
            char label[64];
            snprintf(label, sizeof label, "stream S=%d%s", v.S, v.pdl ? " pdl" : "");
            printf("  %-28s %7.2f us   rel RMS vs tiles %.2e\n", label, got.first, sqrt(num / den));
        }
    }
    return 0;
}
