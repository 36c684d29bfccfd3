// What a decode step built of resident blocks that stream their next weights would gain (session
// 41's lead). Today every projection is a launch whose blocks land only as the previous launch's
// leave, so its weights stream after the hand-over, on the critical path (GDN in_proj: x in 2.3 us
// after its release, multiplied 6.1); taking them from L2 instead wins little (an SM takes bytes in
// at ~58 GB/s: sm_ingest.cu). Here a chain of LAYERS layers, each two dependent GEMVs on the
// model's shapes at K 2048 (A: GDN in_proj, 12,352 rows; B: 4,096 rows, an out_proj's bytes), the
// next reading the previous one's output (RMS-normalised), runs two ways:
//   launches — gemv_q_resident_k2048 (gemv.cu, as the step runs it: 8 warps and a streaming ninth,
//              programmatic dependent launch, 115 KB of shared memory at least), 2 launches a layer
//              in one CUDA graph;
//   resident — one launch of one block an SM: a producer warp streams the block's tiles of every
//              phase of every layer, in order, through a ring of RING tile slots (full/empty
//              mbarriers), never waiting on the data dependencies; 8 consumer warps wait for the
//              phase's input (a grid-wide count of finished blocks, acquire), normalise it,
//              multiply the tiles as they land (quad_dot, as gemv_q_resident), write the rows and
//              count the block finished (release).
// Both compute the same rows in the same order: the final outputs are compared (relative RMS).
// Reported: us per layer each way, the DRAM floor (the layer's 18.9 MB at 4.4 TB/s), and the
// resident form's phases step by step (thread 0's clock64: median cycles over blocks and layers).
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/resident_stream.cu -o /tmp/resident_stream && /tmp/resident_stream
// Measured (H200, session 42; bench/results/cuda-decode-session42-ablations.json): launches 10.0
// us a layer, resident 10.6-10.7 (ring of 6, 10 or 12 tiles), 10.35 without streaming ahead; the
// floor 4.3. Streaming ahead gains nothing: with the tiles already in shared memory a phase is
// still ~0.5 us of meeting (the grid's count), ~0.95 us for x (8 KB from L2, its norm, its byte
// form), the multiply (A's ~5.9 tiles 5,470 cycles = 2.8 us, ~900 a tile and warp at 8 warps an
// SM; B's ~1.9 tiles 2,440) and ~0.15 us for the rows. Two tiles a round (PAIRS) cut the median
// multiply 12% but the chain's slowest blocks lost (11.5 us a layer). Streaming ahead, thread 0
// found every tile already in shared memory when it came to multiply it (LANDED: 138,937 of
// 138,960 with a ring of 10, all with 12; 90% without streaming ahead), so the multiply is the
// SM's own work, ~1,000 cycles a 16 x 2048 tile and warp at 8 warps an SM (16 KB a microsecond
// an SM: as fast as DRAM fills the GPU, but only from the moment x is in); the two k-tiles of
// a step in separate accumulators instead of one chain of two mma (SPLITACC) cut it 2%, and 16
// multiplying warps instead of 8 (WARPS_C) 13% while x's prologue grew 1,880 -> 2,900 cycles
// (13.2 us a layer against 11.1).
#include "../../crates/osprey-cuda/kernels/gemv.cu"
#include "harness.cuh"

#define LAYERS 30
#ifndef RING
#define RING 10
#endif
// AHEAD 0: the producer streams a phase's tiles only once the phase's input is ready (what a
// persistent kernel gains without streaming ahead: the launches' hand-overs alone)
#ifndef AHEAD
#define AHEAD 1
#endif
// PAIRS 1: the consumers multiply two tiles a round (more independent work per warp)
#ifndef PAIRS
#define PAIRS 0
#endif
#define K_ 2048
#define GPR_ (K_ / 64)
#define A_ROWS 12352
#define B_ROWS 4096
// WARPS_C: multiplying warps (8, or 16: two a K-slice, taking alternate tiles)
#ifndef WARPS_C
#define WARPS_C 8
#endif
#define CONSUMERS (32 * WARPS_C)
#define MAX_PHASE_TILES 8

struct Layer {
    ExpertStack a, b;
    const float* x;  // A's input (2048)
    float* ya;       // A's output (12,352); B's input is its first 2048
    float* xb;       // B's output (4096); the next layer's x is its first 2048
};
struct Chain {
    Layer l[LAYERS];
    const float* norm_w;
    unsigned* done;  // blocks finished with a phase, over the launch
    long long* marks;  // [LAYERS * 2][grid][MARKS]: thread 0's clock at each step of a phase
    unsigned (*landed)[2];  // [phase][already landed when thread 0 reached the tile] (LANDED)
};
// LANDED 1: count the tiles thread 0 found already in shared memory when it came to multiply them
#ifndef LANDED
#define LANDED 0
#endif
// a phase's steps, timed by thread 0 of each block: its wait begins, the input is complete (the
// grid's count reached), x is in (read from L2, normalised, in the byte form), the tiles are
// multiplied, the rows are written (then the count)
#define MARKS 5

// SPLITACC 1: quad_dot with the two k-tiles of a step in separate accumulators (two independent
// mma instead of a chain of two), summed as integers after
#ifndef SPLITACC
#define SPLITACC 0
#endif
__device__ __forceinline__ void quad_dot_split(const char* stage, const __nv_bfloat16* sc, const __nv_bfloat16* bi, const QuadLane& L,
                                               const QuadX& X, float& yA, float& yB) {
    uint2 wa[4], wb[4];
    unsigned long long sA, bA, sB, bB;
    load_quad(stage, sc, bi, L, wa, wb, sA, bA, sB, bB);
    const bool odd = L.c & 1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int d0[4] = {0, 0, 0, 0}, d1[4] = {0, 0, 0, 0};
        {
            const uint32_t wA = wa[j].x, wB = wb[j].x;
            mma_s8(d0, wA & 0x0F0F0F0Fu, wB & 0x0F0F0F0Fu, (wA >> 4) & 0x0F0F0F0Fu, (wB >> 4) & 0x0F0F0F0Fu, X.x[j][0].x, X.x[j][0].y);
        }
        {
            const uint32_t wA = wa[j].y, wB = wb[j].y;
            mma_s8(d1, wA & 0x0F0F0F0Fu, wB & 0x0F0F0F0Fu, (wA >> 4) & 0x0F0F0F0Fu, (wB >> 4) & 0x0F0F0F0Fu, X.x[j][1].x, X.x[j][1].y);
        }
        const float2 gs = X.gs[j];
        const float dA = gs.x * (float)(odd ? d0[1] + d1[1] : d0[0] + d1[0]), dB = gs.x * (float)(odd ? d0[3] + d1[3] : d0[2] + d1[2]);
        yA = fmaf(bf16x4_at(sA, j), dA, fmaf(bf16x4_at(bA, j), gs.y, yA));
        yB = fmaf(bf16x4_at(sB, j), dB, fmaf(bf16x4_at(bB, j), gs.y, yB));
    }
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1) resident_chain(const __grid_constant__ Chain c) {
    extern __shared__ __align__(128) char smem[];
    char* codes = smem;  // [RING][16][K/2]
    __nv_bfloat16* scales = reinterpret_cast<__nv_bfloat16*>(codes + RING * 16 * (K_ / 2));
    __nv_bfloat16* biases = scales + RING * 16 * GPR_;
    uint4* xb8 = reinterpret_cast<uint4*>(biases + RING * 16 * GPR_);
    float2* gx = reinterpret_cast<float2*>(xb8 + GPR_ * 8);
    float* red = reinterpret_cast<float*>(gx + GPR_);        // [8]
    float* part = red + 8;                                    // [MAX_PHASE_TILES][8][16]
    uint64_t* full = reinterpret_cast<uint64_t*>(part + MAX_PHASE_TILES * 8 * 16);
    uint64_t* empty = full + RING;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tiles_of[2] = {(A_ROWS + 15) / 16, (B_ROWS + 15) / 16};
    if (threadIdx.x == 0) {
        for (int i = 0; i < RING; ++i) {
            mbar_init(&full[i], 1);
            mbar_init(&empty[i], 8);
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (warp == WARPS_C) {
        // the producer: every tile of this block, layer by layer, phase by phase
        if (lane == 0) {
            int seq = 0;
            for (int l = 0; l < LAYERS; ++l)
                for (int p = 0; p < 2; ++p) {
                    const ExpertStack& w = p ? c.l[l].b : c.l[l].a;
                    const int T = tiles_of[p], rows_total = p ? B_ROWS : A_ROWS;
                    const int t0 = (int)((long long)blockIdx.x * T / gridDim.x), t1 = (int)((long long)(blockIdx.x + 1) * T / gridDim.x);
                    if (!AHEAD) {
                        const unsigned target = gridDim.x * (2u * l + p);
                        unsigned n;
                        do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(c.done) : "memory");
                        while (n < target);
                    }
                    for (int t = t0; t < t1; ++t, ++seq) {
                        const int slot = seq % RING, rows = min(16, rows_total - t * 16);
                        if (seq >= RING) mbar_wait(&empty[slot], ((seq / RING) - 1) & 1);
                        mbar_arrive_expect_bytes(&full[slot], q4_rows_bytes(rows, K_));
                        copy_q4_rows(codes, scales, biases, slot, w.codes, w.scales, w.biases, (size_t)t * 16, rows, K_, &full[slot]);
                    }
                }
        }
        return;
    }
    int seq = 0;
    const int kslice = warp % 8;
    const int g0 = kslice * GPR_ / 8;
    const QuadLane L0 = quad_lane(K_, g0);
    for (int l = 0; l < LAYERS; ++l)
        for (int p = 0; p < 2; ++p) {
            // the phase's input: every block done with the phase before
            long long* mk = c.marks + ((size_t)(2 * l + p) * gridDim.x + blockIdx.x) * MARKS;
            if (threadIdx.x == 0) mk[0] = clock64();
            if (threadIdx.x == 0) {
                const unsigned target = gridDim.x * (2u * l + p);
                unsigned n, rounds = 0;
                do {
                    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(c.done) : "memory");
                    if (++rounds == MEET_ROUNDS_LIMIT) __trap();  // a block that never lands
                } while (n < target);
                mk[1] = clock64();
            }
            consumers_sync();
            const float* in = p ? c.l[l].ya : c.l[l].x;
            // thread t: the 8 elements of fragment slot t, RMS-normalised (norm weight all ones)
            float v[2][8];
            const int e0 = slot_first_element(threadIdx.x & 255);
            float4 x0 = __ldcg(reinterpret_cast<const float4*>(in + e0)), x1 = __ldcg(reinterpret_cast<const float4*>(in + e0 + 4));
            if (threadIdx.x >= 256) x0 = x1 = make_float4(0.f, 0.f, 0.f, 0.f);
            v[0][0] = x0.x; v[0][1] = x0.y; v[0][2] = x0.z; v[0][3] = x0.w;
            v[0][4] = x1.x; v[0][5] = x1.y; v[0][6] = x1.z; v[0][7] = x1.w;
            float ss = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                ss += v[0][j] * v[0][j];
                v[1][j] = 0.f;
            }
            ss = warp_sum(ss);
            if (lane == 0 && warp < 8) red[warp] = ss;
            consumers_sync();
            float total = 0.f;
#pragma unroll
            for (int w = 0; w < 8; ++w) total += red[w];
            const float inv = rsqrtf(total / K_ + 1e-6f);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[0][j] *= inv * __ldg(c.norm_w + e0 + j);
            write_slots(v, K_, xb8, gx);
            consumers_sync();
            if (threadIdx.x == 0) mk[2] = clock64();
            QuadX X;
            load_quad_x(xb8, gx, g0, X);
            const int T = tiles_of[p], rows_total = p ? B_ROWS : A_ROWS;
            const int t0 = (int)((long long)blockIdx.x * T / gridDim.x), t1 = (int)((long long)(blockIdx.x + 1) * T / gridDim.x);
            int t = t0;
#if WARPS_C > 8
            // two warps a K-slice: warp w takes tiles t0 + w / 8, t0 + w / 8 + 2, ...
            for (t = t0 + warp / 8; t < t1; t += 2) {
                const int sq = seq + (t - t0), slot = sq % RING;
                mbar_wait(&full[slot], (sq / RING) & 1);
                float yA = 0.f, yB = 0.f;
                quad_dot(codes + (size_t)slot * 16 * (K_ / 2), scales + slot * 16 * GPR_, biases + slot * 16 * GPR_, L0, X, yA, yB);
                store_quad_sums(part + ((t - t0) * 8 + kslice) * 16, yA, yB);
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[slot]);
            }
            seq += t1 - t0;
            t = t1;
#endif
#if PAIRS
            // two tiles a round: their products' chains interleave
            for (; t + 1 < t1; t += 2, seq += 2) {
                const int s0 = seq % RING, s1 = (seq + 1) % RING;
                mbar_wait(&full[s0], (seq / RING) & 1);
                mbar_wait(&full[s1], ((seq + 1) / RING) & 1);
                float yA = 0.f, yB = 0.f, zA = 0.f, zB = 0.f;
                quad_dot(codes + (size_t)s0 * 16 * (K_ / 2), scales + s0 * 16 * GPR_, biases + s0 * 16 * GPR_, L0, X, yA, yB);
                quad_dot(codes + (size_t)s1 * 16 * (K_ / 2), scales + s1 * 16 * GPR_, biases + s1 * 16 * GPR_, L0, X, zA, zB);
                store_quad_sums(part + ((t - t0) * 8 + warp) * 16, yA, yB);
                store_quad_sums(part + ((t + 1 - t0) * 8 + warp) * 16, zA, zB);
                __syncwarp();
                if (lane == 0) {
                    mbar_arrive(&empty[s0]);
                    mbar_arrive(&empty[s1]);
                }
            }
#endif
            for (; t < t1; ++t, ++seq) {
                const int slot = seq % RING;
#if LANDED
                if (threadIdx.x == 0) {
                    uint32_t done;
                    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                                 : "=r"(done) : "r"(smem_addr(&full[slot])), "r"((seq / RING) & 1) : "memory");
                    atomicAdd(&c.landed[p][done], 1u);
                }
#endif
                mbar_wait(&full[slot], (seq / RING) & 1);
                float yA = 0.f, yB = 0.f;
                if (SPLITACC) quad_dot_split(codes + (size_t)slot * 16 * (K_ / 2), scales + slot * 16 * GPR_, biases + slot * 16 * GPR_, L0, X, yA, yB);
                else quad_dot(codes + (size_t)slot * 16 * (K_ / 2), scales + slot * 16 * GPR_, biases + slot * 16 * GPR_, L0, X, yA, yB);
                store_quad_sums(part + ((t - t0) * 8 + warp) * 16, yA, yB);
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[slot]);
            }
            consumers_sync();
            if (threadIdx.x == 0) mk[3] = clock64();
            float* out = p ? c.l[l].xb : c.l[l].ya;
            for (int o = threadIdx.x; o < (t1 - t0) * 16; o += CONSUMERS) {
                const int i = o >> 4, r = o & 15, row = (t0 + i) * 16 + r;
                float y = 0.f;
#pragma unroll
                for (int w = 0; w < 8; ++w) y += part[(i * 8 + w) * 16 + r];
                if (row < rows_total) out[row] = y;
            }
            consumers_sync();
            if (threadIdx.x == 0) {
                mk[4] = clock64();
                asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c.done) : "memory");
            }
        }
}

int main() {
    int sms = 0, smem_optin = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    std::vector<float> ones(K_, 1.f);
    float* norm_w = upload(ones);
    const HostQ4 wa = random_q4(A_ROWS, K_, 0.01f, 0.05f), wb = random_q4(B_ROWS, K_, 0.01f, 0.05f);
    Chain ch{};
    float* x0 = random_x(K_);
    std::vector<float*> xs(LAYERS + 1);
    xs[0] = x0;
    for (int l = 0; l < LAYERS; ++l) {
        Layer& L = ch.l[l];
        L.a = upload_q4(wa);
        L.b = upload_q4(wb);
        L.x = xs[l];
        CK(cudaMalloc(&L.ya, A_ROWS * 4));
        CK(cudaMalloc(&L.xb, B_ROWS * 4));
        xs[l + 1] = L.xb;
    }
    ch.norm_w = norm_w;
    CK(cudaMalloc(&ch.done, 4));
    CK(cudaMalloc(&ch.marks, (size_t)LAYERS * 2 * sms * MARKS * 8));
    CK(cudaMalloc(&ch.landed, 4 * sizeof(unsigned)));
    CK(cudaMemset(ch.landed, 0, 4 * sizeof(unsigned)));
    const double layer_mb = (double)(A_ROWS + B_ROWS) * (K_ / 2 + GPR_ * 4) / 1e6;

    // launches: gemv_q_resident_k2048 as the step runs it
    CK(cudaFuncSetAttribute(gemv_q_resident_k2048, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_optin));
    CK(cudaFuncSetAttribute(gemv_q_resident_k2048, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    auto gemv_args = [&](const ExpertStack& w, int rows, const float* x, float* out, int stages) {
        GemvArgs a{};
        a.seg[0] = Segment{w.codes, w.scales, w.biases, out, rows, 4, 0, 0};
        a.nseg = 1;
        a.x = x;
        a.norm_weight = norm_w;
        a.eps = 1e-6f;
        a.K = K_;
        a.group = 64;
        a.tiles = 1;
        a.stages = stages;
        return a;
    };
    const int sa = ((A_ROWS + 15) / 16 + sms - 1) / sms, sb = ((B_ROWS + 15) / 16 + sms - 1) / sms;
    const size_t smem_a = std::max(resident_smem(K_, sa) + 8 * 16, (size_t)115 * 1024), smem_b = std::max(resident_smem(K_, sb) + 8 * 16, (size_t)115 * 1024);
    const double launch_us = graph_us(st, 2 * LAYERS, [&](int i) {
        const Layer& L = ch.l[i / 2];
        const bool b = i & 1;
        const GemvArgs a = b ? gemv_args(L.b, B_ROWS, L.ya, L.xb, sb) : gemv_args(L.a, A_ROWS, L.x, L.ya, sa);
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t cfg = launch_256(st, sms, b ? smem_b : smem_a, true, attr);
        cfg.blockDim = dim3(256 + 32);
        CK(cudaLaunchKernelEx(&cfg, gemv_q_resident_k2048, a));
    }) * 2;
    std::vector<float> want(B_ROWS), got(B_ROWS);
    CK(cudaMemcpy(want.data(), xs[LAYERS], B_ROWS * 4, cudaMemcpyDeviceToHost));

    // resident: one launch for the chain
    const size_t smem_r = (size_t)RING * 16 * (K_ / 2 + GPR_ * 4) + GPR_ * 8 * 16 + GPR_ * 8 + 8 * 4 + MAX_PHASE_TILES * 8 * 16 * 4 + 2 * RING * 8;
    CK(cudaFuncSetAttribute(resident_chain, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_r));
    CK(cudaMemset(xs[LAYERS], 0, B_ROWS * 4));
    const float resident_ms = best_ms(st, [&] {
        CK(cudaMemsetAsync(ch.done, 0, 4, st));
        resident_chain<<<sms, CONSUMERS + 32, smem_r, st>>>(ch);
        CK(cudaGetLastError());
    });
    CK(cudaMemcpy(got.data(), xs[LAYERS], B_ROWS * 4, cudaMemcpyDeviceToHost));
    printf("{\"layers\": %d, \"layer_MB\": %.2f, \"dram_floor_us_per_layer\": %.2f,\n", LAYERS, layer_mb, layer_mb / 4.4);
    printf(" \"launches_us_per_layer\": %.2f, \"resident_us_per_layer\": %.2f, \"resident_ring_tiles\": %d, \"streams_ahead\": %d, \"rel_rms_outputs\": %.2e,\n",
           launch_us, resident_ms * 1e3 / LAYERS, RING, AHEAD, rel_rms_f(want, got));
    // the last launch's marks: median cycles of each step of a phase, by phase (A: 12,352 rows,
    // B: 4,096), over the blocks and layers (the first layer left out)
    std::vector<long long> mk((size_t)LAYERS * 2 * sms * MARKS);
    CK(cudaMemcpy(mk.data(), ch.marks, mk.size() * 8, cudaMemcpyDeviceToHost));
    const char* step[MARKS - 1] = {"input_wait", "x_in", "multiply", "rows_out"};
    printf(" \"phase_steps_median_cycles\": {");
    for (int p = 0; p < 2; ++p) {
        printf("%s\"%s\": {", p ? ", " : "", p ? "B" : "A");
        for (int k = 0; k < MARKS - 1; ++k) {
            std::vector<long long> d;
            for (int l = 1; l < LAYERS; ++l)
                for (int b = 0; b < sms; ++b) {
                    const long long* m = &mk[(((size_t)(2 * l + p)) * sms + b) * MARKS];
                    d.push_back(m[k + 1] - m[k]);
                }
            std::sort(d.begin(), d.end());
            printf("%s\"%s\": %lld", k ? ", " : "", step[k], d[d.size() / 2]);
        }
        printf("}");
    }
    printf("}");
    unsigned landed[2][2];
    CK(cudaMemcpy(landed, ch.landed, sizeof(landed), cudaMemcpyDeviceToHost));
    if (LANDED) printf(",\n \"tiles_already_landed\": {\"A\": [%u, %u], \"B\": [%u, %u]}", landed[0][1], landed[0][0] + landed[0][1], landed[1][1], landed[1][0] + landed[1][1]);
    printf("}\n");
    return 0;
}
