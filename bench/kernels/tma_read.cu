// How fast one SM's copy engine streams weights into shared memory, by request size: each of the
// 132 blocks (one thread) streams its contiguous share of a buffer through a ring of S stages of
// `chunk` bytes with cp.async.bulk + mbarrier (common.cuh), against plain 16-byte loads by every
// thread. The question behind the decode GEMV's bulk copies (gemv_q_stream then, gemv_q_resident
// now): one 16 KB request per tile, or one per row.
// Shapes: 14 MB (GDN in_proj's codes) and 286 MB (lm_head); 16 launches in a graph cycling over 3
// buffers 300 MB apart (past the 60 MB L2), best of 5.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/tma_read.cu -o /tmp/tma_read && /tmp/tma_read
#include "../../crates/osprey-cuda/kernels/common.cuh"
#include "harness.cuh"

extern "C" __global__ void tma_read(const char* src, size_t bytes, int chunk, int S, int* sink) {
    extern __shared__ __align__(128) char ring[];
    __shared__ __align__(8) uint64_t full[16];
    const size_t per = bytes / gridDim.x / chunk * chunk;
    const char* base = src + blockIdx.x * per;
    const int n = (int)(per / chunk);
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; ++s) mbar_init(&full[s], 1);
        mbar_init_fence();
        for (int i = 0; i < min(S, n); ++i) { mbar_arrive_expect_bytes(&full[i], chunk); bulk_copy_to_shared(ring + i * chunk, base + (size_t)i * chunk, chunk, &full[i]); }
        int acc = 0;
        for (int i = 0; i < n; ++i) {
            const int s = i % S;
            mbar_wait(&full[s], (i / S) & 1);
            acc += ring[s * chunk + 5];
            if (i + S < n) { mbar_arrive_expect_bytes(&full[s], chunk); bulk_copy_to_shared(ring + s * chunk, base + (size_t)(i + S) * chunk, chunk, &full[s]); }
        }
        if (acc == 123456789) sink[0] = acc;
    }
}
// plain loads, every thread, 16 B each, 4 in flight
extern "C" __global__ void plain_read(const uint4* src, size_t n16, int* sink) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) { uint4 v = __ldcs(src + i); acc ^= v.x ^ v.w; }
    if (acc == 123456789) sink[0] = acc;
}
int main() {
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute(tma_read, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    char* buf; const size_t total = 1ull << 30; CK(cudaMalloc(&buf, total)); CK(cudaMemset(buf, 1, total));
    int* sink; CK(cudaMalloc(&sink, 64));
    cudaStream_t st; CK(cudaStreamCreate(&st));
    for (size_t bytes : {(size_t)14 << 20, (size_t)286 << 20}) {
        for (int chunk : {1024, 4096, 16384}) for (int S : {4, 12}) {
            if ((size_t)S * chunk > 190 * 1024) continue;
            const int L = 16;
            cudaGraph_t gr; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < L; ++i) tma_read<<<sms, 32, S * chunk, st>>>(buf + (i % 3) * (300ull << 20) % (total - bytes), bytes, chunk, S, sink);
            CK(cudaStreamEndCapture(st, &gr)); CK(cudaGraphInstantiate(&ge, gr, 0));
            const float us = best_ms(st, [&] { CK(cudaGraphLaunch(ge, st)); }) * 1e3f / L;
            printf("tma  %4zu MB chunk %5d S %2d: %8.2f us  %.2f TB/s\n", bytes >> 20, chunk, S, us, bytes / us / 1e6);
        }
        for (int bpsm : {1, 4}) {
            const int L = 16;
            cudaGraph_t gr; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int i = 0; i < L; ++i) plain_read<<<sms * bpsm, 256, 0, st>>>((const uint4*)(buf + (i % 3) * (300ull << 20) % (total - bytes)), bytes / 16, sink);
            CK(cudaStreamEndCapture(st, &gr)); CK(cudaGraphInstantiate(&ge, gr, 0));
            const float us = best_ms(st, [&] { CK(cudaGraphLaunch(ge, st)); }) * 1e3f / L;
            printf("plain %4zu MB %d blocks/SM:       %8.2f us  %.2f TB/s\n", bytes >> 20, bpsm, us, bytes / us / 1e6);
        }
    }
}
