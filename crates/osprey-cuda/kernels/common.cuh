// Shared helpers for Osprey's CUDA kernels (sm_90a). Activations are f32; weights stay in the
// MLX affine layout (packed u32 codes, bf16 scale and bias per group); KV cache is bf16, or int8
// with a scale per row (store_int8_row).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float bf16_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// A warp's and a block's reduction: `Reduce` folds a warp's values into one with a shuffle,
// `identity` pads the warps a block does not have; `scratch` holds 32 floats. All threads get the
// result.
template <float (*Reduce)(float)>
__device__ __forceinline__ float block_reduce(float v, float* scratch, float identity) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = Reduce(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : identity;
    return Reduce(t);
}
__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<warp_sum>(v, scratch, 0.f); }
__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce<warp_max>(v, scratch, -INFINITY); }

// ---- the int8 KV cache (--kv-cache int8) ----
// A K or V row (one position, one KV head: the block's blockDim.x values, one a thread) scaled so
// its largest magnitude is 127, rounded to nearest (ties to even: the CPU backend's
// round_ties_even), stored biased by 128 (byte = q + 128, so that int8_pair_f16 turns it into f16
// with one byte permute and one subtraction); the row's scale amax/127 goes to *scale. A zero row
// stores 128s and scale 0. Every thread of the block calls it.
__device__ __forceinline__ void store_int8_row(float x, uint8_t* row, float* scale, float* scratch) {
    const float amax = block_max(fabsf(x), scratch);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    row[threadIdx.x] = (uint8_t)(__float2int_rn(x * inv) + 128);
    if (threadIdx.x == 0) *scale = amax / 127.f;
}

// Bytes `sel` (a __byte_perm selector of the form 0x4Y4X: bytes X and Y of w) of biased int8
// codes as an exact f16 pair: 0x64 above a byte u is the f16 1024 + u, and 1024 + 128 off that
// leaves q = u - 128.
__device__ __forceinline__ uint32_t int8_pair_f16(uint32_t w, uint32_t sel) {
    const uint32_t biased = __byte_perm(w, 0x64646464u, sel);
    const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&biased), __half2half2(__ushort_as_half(0x6480)));
    return *reinterpret_cast<const uint32_t*>(&v);
}

// An unsigned key that orders as the float does (larger float, larger key).
__device__ __forceinline__ uint32_t order_key(float f) {
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
// The logistic function without IEEE division: `1.f / d` and `x / d` compile to a subroutine call
// (a slow path for denormal and huge d) that holds registers across it; __frcp_rn is one correctly
// rounded reciprocal, __fdividef one approximate reciprocal times x (2 ulp; for d past 2^126, i.e.
// x < -87, it gives 0 where silu(x) is ~-1e-36). gdn_step 55 -> 48 registers; 4K 851.7 -> 856.8
// tok/s, 128K 535.2 -> 539.8 (H200, bench/results/cuda-decode-session35-ablations.json).
__device__ __forceinline__ float sigmoidf(float x) { return __frcp_rn(1.f + __expf(-x)); }
__device__ __forceinline__ float siluf(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// Exact float of a 4-bit code without the slow int->float unit: 2^23 + q as bits, minus 2^23.
__device__ __forceinline__ float nib(uint32_t w, int n) {
    return __uint_as_float(0x4B000000u | ((w >> (4 * n)) & 0xFu)) - 8388608.f;
}
__device__ __forceinline__ float byte_code(uint32_t w, int n) {
    return __uint_as_float(0x4B000000u | ((w >> (8 * n)) & 0xFFu)) - 8388608.f;
}

// Shared-memory index of activation element i, padded by 4 floats every 32 so that lanes
// reading consecutive 32-element chunks with float4 loads hit distinct banks.
__device__ __forceinline__ int pad_idx(int i) { return i + ((i >> 5) << 2); }

// ---- embedding rows ----
// A thread's words of an embedding row (H / (32 / bits) words over a block of 256 threads; H at
// most 4096 at 8 bits: decoder.rs check_embed).
#define EMBED_WORDS 4

// Embedding row `row` (bits-wide codes, bf16 scale and bias per group) dequantised into x[0, H).
// Every word, scale and bias is requested before any is used: one memory round trip (a loop that
// stored each element before its next loads went round trip after round trip: 7.9 us of the
// decode step at 4K, bench/results/cuda-decode-embed-one-trip.json).
__device__ __forceinline__ void embed_row(const uint32_t* codes, const __nv_bfloat16* scales, const __nv_bfloat16* biases,
                                          size_t row, int H, int group, int bits, float* x) {
    const int per_word = 32 / bits, wpr = H / per_word, gpr = H / group;
    const uint32_t mask = (1u << bits) - 1;
    uint32_t w[EMBED_WORDS];
    __nv_bfloat16 sc[EMBED_WORDS], bi[EMBED_WORDS];
#pragma unroll
    for (int j = 0; j < EMBED_WORDS; ++j) {
        const int wi = threadIdx.x + j * blockDim.x, g = wi * per_word / group;
        if (wi < wpr) {
            w[j] = codes[row * wpr + wi];
            sc[j] = scales[row * gpr + g];
            bi[j] = biases[row * gpr + g];
        }
    }
#pragma unroll
    for (int j = 0; j < EMBED_WORDS; ++j) {
        const int wi = threadIdx.x + j * blockDim.x;
        if (wi < wpr) {
            const float s = bf16_to_f32(sc[j]), b = bf16_to_f32(bi[j]);
            for (int e = 0; e < per_word; ++e) x[wi * per_word + e] = s * (float)((w[j] >> (e * bits)) & mask) + b;
        }
    }
}

// ---- programmatic dependent launch (Hopper) ----
// With OSPREY_CUDA_OVERLAP=1 or =pdl the decode step's kernels are launched with programmatic stream
// serialization (decoder.rs): a kernel may be scheduled while its predecessor drains. Each one
//   1. lets its own successor be scheduled early (step_overlap_begin),
//   2. may prefetch what no kernel of the step writes (weights; its own layer's recurrent state),
//   3. waits for the predecessor's completion and memory flush (step_inputs_ready) before it
//      reads or writes anything an earlier kernel touches.
// Launched the ordinary way, both instructions do nothing.
__device__ __forceinline__ void step_overlap_begin() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void step_inputs_ready() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void step_phase(unsigned) {}  // a timeline mark (2..8) in probed builds
__device__ __forceinline__ void step_phase_after(unsigned, unsigned) {}  // the same, once a value is in

// Rounds of polling L2 before a kernel whose blocks meet (moe_experts' slots, attn_decode's grid)
// gives up on the meeting and traps (each round is an L2 round trip, at least ~0.5 us).
#define MEET_ROUNDS_LIMIT (1u << 21)

// Asks L2 for this block's 1/gridDim share of [base, base + bytes), one 128-byte line per thread
// per pass. A hint only: L2 is the GPU's point of coherence, so a prefetch can never yield stale data.
__device__ __forceinline__ void prefetch_share_l2(const void* base, size_t bytes) {
    const size_t per = ((bytes + gridDim.x - 1) / gridDim.x + 127) & ~(size_t)127;
    const size_t lo = (size_t)blockIdx.x * per, hi = min(bytes, lo + per);
    const char* p = static_cast<const char*>(base);
    for (size_t o = lo + (size_t)threadIdx.x * 128; o < hi; o += (size_t)blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
}

// ---- tensor cores ----
// D += A·B for one m16n8k16 tile: A 16x16 bf16 (row-major fragments), B 16x8 bf16, f32 accumulate.
__device__ __forceinline__ void mma_bf16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same with f16 A and B (the int8 KV cache's scores: f16 holds its codes exactly).
__device__ __forceinline__ void mma_f16(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D += A·B for one m16n8k32 tile of signed bytes, exact s32 accumulate.
__device__ __forceinline__ void mma_s8(int* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Storage order of bf16 activations feeding the prefill GEMM (gemm.cu): inside every 64-element
// group, logical element k = 8w + r (w the 4-bit code word, r its nibble) is stored at
// (4q + t)·4 + j with q = w/2, t = 2·(w%2) + (r/2)%2, j = 2·(r%2) + r/4. Thread q of an mma quad
// then finds the B fragments of all four k-tiles of a group in 32 contiguous bytes, in exactly the
// order its A fragments come out of the code words (see gemm.cu).
__device__ __forceinline__ int perm64(int k) {
    const int w = (k >> 3) & 7, r = k & 7;
    const int q = w >> 1, t = ((w & 1) << 1) | ((r >> 1) & 1), j = ((r & 1) << 1) | ((r >> 2) & 1);
    return (k & ~63) | (((q << 2) | t) << 2) | j;
}

// ---- routing: block 0 of moe_gate_up writes the selected experts here for moe_down ----
#define MAX_TOPK 16
#define MAX_E 512

struct TopK {
    int ids[MAX_TOPK];
    float w[MAX_TOPK];
};

// One stack of experts' matrices in the MLX layout: [E * rows, cols] codes, scales, biases.
struct ExpertStack {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
};

// ---- shared-memory staging and fragments (prefill kernels) ----
// 16 bytes global -> shared without registers; zero-filled when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
// closes this thread's group of cp.async copies; waits until at most N of its groups are in flight
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// four 8x8 bf16 matrices; lane l gives the row address of matrix l / 8
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// ---- bulk copies into shared memory (Hopper TMA, no tensor map) behind mbarriers ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// orders this thread's generic-proxy shared-memory accesses (stores, cp.async copies, loads) before
// its later async-proxy ones (the tensor cores' reads, bulk copies' writes); a barrier first
// publishes everyone's
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// makes the inits visible to the bulk-copy engine (and, after a barrier, to the other threads)
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// one arrival that also announces `bytes` still to land through bulk copies in this phase
__device__ __forceinline__ void mbar_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("{\n\t.reg .b64 state;\n\tmbarrier.arrive.shared::cta.b64 state, [%0];\n\t}" ::"r"(smem_addr(bar)) : "memory");
}

// waits for the phase of the given parity (0 for a barrier's first phase, 1 for its second, ...)
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra WAIT;\n\t}" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory; their
// arrival completes on `bar`
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
