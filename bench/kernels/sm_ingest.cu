// How fast one SM takes bytes in from L2 (session 41). With every layer's experts and GDN input
// projections aliased to layer 0's (OSPREY_DEV_ALIAS, all in L2) the step gains only 4%: the
// gate/up tiles land ~2.5 us after they are asked for, L2 or DRAM. Is an SM's intake capped near
// DRAM's share (4.4-4.75 TB/s / 132 = ~36 GB/s), whatever the source? Each of 132 blocks (one an
// SM, 256 threads) copies its own 144 KB of a 19 MB buffer (in L2 after a warm-up launch) into
// shared memory, 8 times, timed by clock64 (median over blocks), as:
//   tma     — thread 0 asks for 9 bulk copies of 16 KB on one mbarrier;
//   lsu     — cp.async of 16 bytes by every thread (cp.async.cg), then wait_all + barrier;
//   ldg     — 16-byte loads into registers by every thread, stored to shared memory;
//   mixed   — half the bytes by bulk copies, half by cp.async.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/sm_ingest.cu -o /tmp/sm_ingest && /tmp/sm_ingest
#include "harness.cuh"

#define BYTES (144 * 1024)
#define REPS 8

template <int FORM>
__global__ void __launch_bounds__(256, 1) ingest(const char* src, long long* out, int* sink) {
    extern __shared__ __align__(128) char buf[];
    __shared__ __align__(8) uint64_t bar;
    const char* mine = src + (size_t)blockIdx.x * BYTES;
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        mbar_init_fence();
    }
    __syncthreads();
    const int tma_bytes = FORM == 0 ? BYTES : FORM == 3 ? BYTES / 2 : 0;
    long long t0 = clock64();
    for (int r = 0; r < REPS; ++r) {
        if (tma_bytes && threadIdx.x == 0) {
            mbar_arrive_expect_bytes(&bar, tma_bytes);
            for (int o = 0; o < tma_bytes; o += 16384) bulk_copy_to_shared(buf + o, mine + o, min(16384, tma_bytes - o), &bar);
        }
        if (FORM == 1 || FORM == 3) {
            for (int o = tma_bytes + threadIdx.x * 16; o < BYTES; o += 256 * 16) {
                const unsigned d = (unsigned)__cvta_generic_to_shared(buf + o);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(mine + o));
            }
            asm volatile("cp.async.wait_all;" ::: "memory");
        } else if (FORM == 2) {
            uint4 v[8];
            for (int o = threadIdx.x * 16; o < BYTES; o += 8 * 256 * 16) {
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (o + j * 256 * 16 < BYTES) v[j] = __ldcg(reinterpret_cast<const uint4*>(mine + o + j * 256 * 16));
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (o + j * 256 * 16 < BYTES) *reinterpret_cast<uint4*>(buf + o + j * 256 * 16) = v[j];
            }
        }
        if (tma_bytes) mbar_wait(&bar, r & 1);
        __syncthreads();
    }
    const long long t1 = clock64();
    if (threadIdx.x == 0) out[blockIdx.x] = t1 - t0;
    if (buf[threadIdx.x] == 0x7F) sink[0] = 1;
}

template <int FORM>
static void run(const char* name, const char* src, long long* out, int* sink, int sms, int clock_khz, bool& first) {
    CK(cudaFuncSetAttribute(ingest<FORM>, cudaFuncAttributeMaxDynamicSharedMemorySize, BYTES));
    ingest<FORM><<<sms, 256, BYTES>>>(src, out, sink);  // warm: the buffer into L2
    std::vector<long long> all;
    for (int rep = 0; rep < 5; ++rep) {
        ingest<FORM><<<sms, 256, BYTES>>>(src, out, sink);
        CK(cudaDeviceSynchronize());
        std::vector<long long> r(sms);
        CK(cudaMemcpy(r.data(), out, sms * sizeof(long long), cudaMemcpyDeviceToHost));
        all.insert(all.end(), r.begin(), r.end());
    }
    std::sort(all.begin(), all.end());
    const double cycles = (double)all[all.size() / 2], us = cycles / (clock_khz / 1e3);
    const double gbs = (double)BYTES * REPS / (us * 1e3);
    printf("%s{\"form\": \"%s\", \"median_cycles\": %.0f, \"us\": %.2f, \"GB_per_s_per_sm\": %.1f, \"TB_per_s_all\": %.2f}", first ? "" : ",\n  ",
           name, cycles, us, gbs, gbs * sms / 1e3);
    first = false;
}

int main() {
    int sms, clock_khz;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    char* src;
    long long* out;
    int* sink;
    CK(cudaMalloc(&src, (size_t)sms * BYTES));
    CK(cudaMemset(src, 1, (size_t)sms * BYTES));
    CK(cudaMalloc(&out, sms * sizeof(long long)));
    CK(cudaMalloc(&sink, sizeof(int)));
    bool first = true;
    printf("{\"note\": \"%d blocks (one an SM) each copying its own 144 KB (L2-resident) into shared memory 8 times; clock %d MHz\", \"results\": [\n  ", sms, clock_khz / 1000);
    run<0>("tma", src, out, sink, sms, clock_khz, first);
    run<1>("lsu", src, out, sink, sms, clock_khz, first);
    run<2>("ldg", src, out, sink, sms, clock_khz, first);
    run<3>("mixed", src, out, sink, sms, clock_khz, first);
    printf("\n]}\n");
    return 0;
}
