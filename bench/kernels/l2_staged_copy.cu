// Does staging a layer's input projection in L2 shorten its copy into shared memory, and how fast
// can a few loader blocks stage it? The decode step's GDN in_proj (gemv_q_resident) copies its
// 14.2 MB of tiles from DRAM only once the MoE's blocks have left its SMs (tiles in 4.6-5.1 us
// after the experts end, multiplied at 6.9-7.4: cuda-decode-next-in-proj-fold-ablation.json);
// DRAM is idle through the MoE's routing (~5.6 us). If loader blocks on a side branch of the
// graph could stage the next in_proj in L2 there, in_proj would copy from L2.
//   staged_copy — the in_proj's copies: 132 blocks, thread 0 of each asking the copy engine for 6
//                 tiles (16 KB of codes, 1 KB of scales, 1 KB of biases each: 14.2 MB in all) at
//                 once and waiting for them; each block's start and landing times (globaltimer);
//   stage_l2    — N loader blocks of 256 threads asking L2 for the same bytes: every thread
//                 prefetch.global.L2::evict_last over 128-byte lines (mode 0), or thread 0 of each
//                 block cp.async.bulk.prefetch.L2 over 16 KB chunks (mode 1);
//   delay       — one thread spinning d us (lets the prefetches land before the copies);
//   other       — 13 MB of other weights streamed through L2 between staging and copying (the
//                 MoE's expert tiles), to see whether the staged lines survive.
// Each case: L2 flushed (a 256 MB memset), then the kernels in one stream; reported: the copy's
// span (first block's start to last block's landing) and the median block's start-to-landing,
// median of 7 runs.
// Then each loader alone, event-timed from a flushed L2 less an empty launch.
// Ran on the H200 (bench/results/cuda-l2-staged-copy-h200.json): the copy 5.7 us from DRAM, 2.0
// us just after the same copy, 3.3-3.4 us after any staging (lines or bulk, any loader count or
// delay); the loaders ask at ~0.25 TB/s a block (8 blocks 8.5 us, 16 blocks 4.4 us).
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/l2_staged_copy.cu -o /tmp/l2_staged_copy && /tmp/l2_staged_copy
#include "harness.cuh"

#define BLOCKS 132
#define TILES 6
#define CODES_TILE 16384
#define SIDE_TILE 1024
#define TILE_BYTES (CODES_TILE + 2 * SIDE_TILE)
// the three arrays: codes, and scales and biases each
constexpr size_t CODE_BYTES = (size_t)BLOCKS * TILES * CODES_TILE, SIDE_BYTES = (size_t)BLOCKS * TILES * SIDE_TILE;

extern "C" __global__ void __launch_bounds__(32, 1)
    staged_copy(const char* codes, const char* scales, const char* biases, unsigned long long* start, unsigned long long* land) {
    extern __shared__ __align__(128) char tiles[];
    __shared__ __align__(8) uint64_t full;
    if (threadIdx.x != 0) return;
    const unsigned long long t0 = now_ns();
    mbar_init(&full, 1);
    mbar_init_fence();
    mbar_arrive_expect_bytes(&full, TILES * TILE_BYTES);
    const size_t b = blockIdx.x;
    bulk_copy_to_shared(tiles, codes + b * TILES * CODES_TILE, TILES * CODES_TILE, &full);
    bulk_copy_to_shared(tiles + TILES * CODES_TILE, scales + b * TILES * SIDE_TILE, TILES * SIDE_TILE, &full);
    bulk_copy_to_shared(tiles + TILES * (CODES_TILE + SIDE_TILE), biases + b * TILES * SIDE_TILE, TILES * SIDE_TILE, &full);
    mbar_wait(&full, 0);
    start[b] = t0;
    land[b] = now_ns();
}

// the three arrays' bytes, every one of them asked of L2 by the loader grid
extern "C" __global__ void __launch_bounds__(256) stage_l2(const char* codes, const char* scales, const char* biases, int mode) {
    const size_t cb = CODE_BYTES, sb = SIDE_BYTES;
    if (mode == 0) {
        const size_t lines = (cb + 2 * sb) / 128, stride = (size_t)gridDim.x * blockDim.x;
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < lines; i += stride) {
            const size_t o = i * 128;
            const char* p = o < cb ? codes + o : o < cb + sb ? scales + (o - cb) : biases + (o - cb - sb);
            asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p) : "memory");
        }
        return;
    }
    if (threadIdx.x != 0) return;
    const size_t chunks = cb / CODES_TILE;
    for (size_t i = blockIdx.x; i < chunks; i += gridDim.x)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(codes + i * CODES_TILE), "r"(CODES_TILE) : "memory");
    for (size_t i = blockIdx.x; i < 2 * sb / CODES_TILE; i += gridDim.x) {
        const char* p = i < sb / CODES_TILE ? scales + i * CODES_TILE : biases + (i - sb / CODES_TILE) * CODES_TILE;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(CODES_TILE) : "memory");
    }
}

extern "C" __global__ void delay(unsigned ns) {
    const unsigned long long t0 = now_ns();
    while (now_ns() - t0 < ns) {
    }
}

// other weights through L2 (read by every thread, 16 bytes at a time)
extern "C" __global__ void other(const uint4* src, size_t n16, int* sink) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = src[i];
        acc ^= v.x ^ v.w;
    }
    if (acc == 123456789) sink[0] = (int)acc;
}

struct Case {
    const char* name;
    int loaders, mode;  // loaders 0: no staging
    int delay_us;       // -1: no delay kernel
    bool copy_twice, other;
};

int main() {
    const size_t cb = CODE_BYTES, sb = SIDE_BYTES;
    const size_t flush_bytes = (size_t)256 << 20, other_bytes = (size_t)13 << 20;
    char *codes, *scales, *biases, *flush, *oth;
    unsigned long long *start, *land;
    int* sink;
    CK(cudaMalloc(&codes, cb));
    CK(cudaMalloc(&scales, sb));
    CK(cudaMalloc(&biases, sb));
    CK(cudaMalloc(&flush, flush_bytes));
    CK(cudaMalloc(&oth, other_bytes));
    CK(cudaMemset(codes, 1, cb));
    CK(cudaMemset(scales, 2, sb));
    CK(cudaMemset(biases, 3, sb));
    CK(cudaMemset(oth, 4, other_bytes));
    CK(cudaMalloc(&start, BLOCKS * 8));
    CK(cudaMalloc(&land, BLOCKS * 8));
    CK(cudaMalloc(&sink, 64));
    const int smem = TILES * TILE_BYTES;
    CK(cudaFuncSetAttribute(staged_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const Case cases[] = {
        {"cold (DRAM)", 0, 0, -1, false, false},
        {"hot (copied just before)", 0, 0, -1, true, false},
        {"staged by 8 blocks, lines, landed", 8, 0, 20, false, false},
        {"staged by 8 blocks, bulk, landed", 8, 1, 20, false, false},
        {"staged by 4 blocks, lines, no delay", 4, 0, -1, false, false},
        {"staged by 8 blocks, lines, no delay", 8, 0, -1, false, false},
        {"staged by 16 blocks, lines, no delay", 16, 0, -1, false, false},
        {"staged by 32 blocks, lines, no delay", 32, 0, -1, false, false},
        {"staged by 8 blocks, bulk, no delay", 8, 1, -1, false, false},
        {"staged by 16 blocks, bulk, no delay", 16, 1, -1, false, false},
        {"staged by 8 blocks, lines, 2 us", 8, 0, 2, false, false},
        {"staged by 8 blocks, lines, 4 us", 8, 0, 4, false, false},
        {"staged by 16 blocks, lines, 4 us", 16, 0, 4, false, false},
        {"staged by 8 blocks, bulk, 4 us", 8, 1, 4, false, false},
        {"staged by 8 blocks, lines, landed, 13 MB other", 8, 0, 20, false, true},
    };
    std::vector<unsigned long long> s(BLOCKS), l(BLOCKS);
    for (const Case& c : cases) {
        std::vector<double> spans, medians;
        for (int rep = 0; rep < 7; ++rep) {
            CK(cudaMemsetAsync(flush, rep, flush_bytes, st));
            if (c.copy_twice) staged_copy<<<BLOCKS, 32, smem, st>>>(codes, scales, biases, start, land);
            if (c.loaders) stage_l2<<<c.loaders, 256, 0, st>>>(codes, scales, biases, c.mode);
            if (c.delay_us >= 0) delay<<<1, 1, 0, st>>>(c.delay_us * 1000u);
            if (c.other) other<<<BLOCKS * 4, 256, 0, st>>>(reinterpret_cast<const uint4*>(oth), other_bytes / 16, sink);
            staged_copy<<<BLOCKS, 32, smem, st>>>(codes, scales, biases, start, land);
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(s.data(), start, BLOCKS * 8, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(l.data(), land, BLOCKS * 8, cudaMemcpyDeviceToHost));
            std::vector<double> per(BLOCKS);
            for (int b = 0; b < BLOCKS; ++b) per[b] = (l[b] - s[b]) * 1e-3;
            std::sort(per.begin(), per.end());
            spans.push_back((*std::max_element(l.begin(), l.end()) - *std::min_element(s.begin(), s.end())) * 1e-3);
            medians.push_back(per[BLOCKS / 2]);
        }
        std::sort(spans.begin(), spans.end());
        std::sort(medians.begin(), medians.end());
        printf("%-48s copy span %5.2f us, median block %5.2f us\n", c.name, spans[3], medians[3]);
    }
    // the loaders alone: event-timed from a flushed L2, less an empty launch (a kernel completes
    // only once its prefetches have: this is how long staging takes)
    auto timed_us = [&](auto launch) {
        int rep = 0;
        std::vector<float> ms = timings_ms(st, 7, [&] { CK(cudaMemsetAsync(flush, rep++, flush_bytes, st)); }, launch);
        std::sort(ms.begin(), ms.end());
        return ms[3] * 1e3;
    };
    const double empty = timed_us([&] { delay<<<1, 1, 0, st>>>(0u); });
    printf("empty launch %.2f us\n", empty);
    for (int mode = 0; mode < 2; ++mode)
        for (int n : {1, 2, 4, 8, 16, 32, 64, 132, 264}) {
            const double us = timed_us([&] { stage_l2<<<n, 256, 0, st>>>(codes, scales, biases, mode); }) - empty;
            printf("stage_l2 %-5s %3d blocks: %6.2f us for %.1f MB (%.2f TB/s)\n", mode ? "bulk" : "lines", n, us,
                   (cb + 2 * sb) / 1e6, (cb + 2 * sb) / us / 1e6);
        }
    return 0;
}
