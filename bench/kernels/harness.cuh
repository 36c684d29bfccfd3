// Shared pieces of the standalone kernel harnesses in this folder: error checks, timing, a
// grid-wide barrier for resident launches, and random quantised weights and activations.
#pragma once
#include "../../crates/osprey-cuda/kernels/common.cuh"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cuda.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

// `reps` event timings of launch() on `st`, each after prepare() (untimed); milliseconds.
template <class Prepare, class Launch>
std::vector<float> timings_ms(cudaStream_t st, int reps, Prepare prepare, Launch launch) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> out;
    for (int r = 0; r < reps; ++r) {
        prepare();
        CK(cudaEventRecord(e0, st));
        launch();
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        out.push_back(ms);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return out;
}

// Best of 5 timings of `launch()` on `st`, after one untimed run; milliseconds.
template <class Launch>
float best_ms(cudaStream_t st, Launch launch) {
    launch();
    CK(cudaStreamSynchronize(st));
    const std::vector<float> t = timings_ms(st, 5, [] {}, launch);
    return *std::min_element(t.begin(), t.end());
}

// Microseconds per launch: `launches` calls of launch(i) captured in one CUDA graph on `st`,
// best of 5 replays.
template <class Launch>
double graph_us(cudaStream_t st, int launches, Launch launch) {
    cudaGraph_t gr;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < launches; ++i) launch(i);
    CK(cudaStreamEndCapture(st, &gr));
    CK(cudaGraphInstantiate(&ge, gr, 0));
    const double us = best_ms(st, [&] { CK(cudaGraphLaunch(ge, st)); }) * 1e3 / launches;
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(gr));
    return us;
}

// The GPU's global clock, nanoseconds (for times measured inside a kernel).
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The input-read chain (input_read.cu, loader_sms.cu): thread t's 8 consecutive floats of an
// H-wide vector (two float4, as tiles.cuh resident_values) and the block's sum of their squares;
// then, for the next launch, those values scaled by 1/sqrt(total/H + 1) into dst.
__device__ __forceinline__ float read_slots_sum_squares(const float* src, float4& a, float4& b, float* scratch) {
    a = reinterpret_cast<const float4*>(src)[2 * threadIdx.x];
    b = reinterpret_cast<const float4*>(src)[2 * threadIdx.x + 1];
    const float ss = a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
    return block_sum(ss, scratch);
}
__device__ __forceinline__ void write_slots_scaled(float* dst, float4 a, float4 b, float total, int H) {
    float4* d = reinterpret_cast<float4*>(dst) + 2 * threadIdx.x;
    const float s = 1.f / sqrtf(total / H + 1.f);
    d[0] = make_float4(a.x * s, a.y * s, a.z * s, a.w * s);
    d[1] = make_float4(b.x * s, b.y * s, b.z * s, b.w * s);
}

// `n` per-block nanoseconds on the device: their median and maximum, microseconds.
static void median_max_us(const unsigned* spent, int n, double& median, double& max) {
    std::vector<unsigned> ns(n);
    CK(cudaMemcpy(ns.data(), spent, n * 4, cudaMemcpyDeviceToHost));
    std::sort(ns.begin(), ns.end());
    median = ns[n / 2] * 1e-3;
    max = ns[n - 1] * 1e-3;
}

// An arrival counter and a generation flag in global memory (zeroed before the launch).
struct GridBarrier {
    unsigned* count;
    unsigned* generation;
};

__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// All blocks of a resident grid meet: the last to arrive resets the count and bumps the generation.
__device__ __forceinline__ void grid_barrier(GridBarrier b) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned gen = ld_acquire_u32(b.generation);
        __threadfence();
        if (atomicAdd(b.count, 1) == gridDim.x - 1) {
            *b.count = 0;
            __threadfence();
            atomicAdd(b.generation, 1);
        } else {
            while (ld_acquire_u32(b.generation) == gen) __nanosleep(32);
        }
    }
    __syncthreads();
}

// Random 4- or 8-bit group-64 weights in the MLX layout: codes, then per group a scale of
// scale_unit·(1..7) and a bias of -bias_unit·(0..4) (host copies, uploaded as often as needed).
struct HostQ4 {
    std::vector<uint32_t> codes;
    std::vector<__nv_bfloat16> scales, biases;
};

static HostQ4 random_q(size_t rows, int K, int bits, float scale_unit, float bias_unit) {
    HostQ4 h;
    h.codes.resize(rows * K * bits / 32);
    for (auto& w : h.codes) w = (uint32_t)rand() * 2654435761u;
    h.scales.resize(rows * K / 64);
    h.biases.resize(rows * K / 64);
    for (size_t i = 0; i < h.scales.size(); ++i) {
        h.scales[i] = __float2bfloat16(scale_unit * (1 + rand() % 7));
        h.biases[i] = __float2bfloat16(-bias_unit * (rand() % 5));
    }
    return h;
}

static HostQ4 random_q4(size_t rows, int K, float scale_unit, float bias_unit) {
    return random_q(rows, K, 4, scale_unit, bias_unit);
}

template <typename T>
static T* upload(const std::vector<T>& v) {
    T* d;
    CK(cudaMalloc(&d, v.size() * sizeof(T)));
    CK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

// on the device as the kernels take a matrix (common.cuh's ExpertStack: codes, scales, biases)
static ExpertStack upload_q4(const HostQ4& h) { return ExpertStack{upload(h.codes), upload(h.scales), upload(h.biases)}; }

// K activations in [-1, 1] on the device
static float* random_x(int K) {
    std::vector<float> x(K);
    for (auto& v : x) v = (rand() % 2001 - 1000) / 1000.f;
    return upload(x);
}

// Dynamic shared memory of a gemv_q_resident block holding `tiles` tiles at width K (decoder.rs
// resident_launch, unpadded).
static size_t resident_smem(int K, int tiles) {
    const size_t gpr = K / 64;
    return (size_t)tiles * 16 * (K / 2 + 2 * gpr * 2) + gpr * 8 * 16 + gpr * 8 + 32 * 4 + 8;
}

// A launch on `st` of `grid` blocks of 256 threads with `smem` bytes of dynamic shared memory,
// with programmatic dependent launch when `pdl`; `attr` holds that attribute (it must outlive the
// launch call).
static cudaLaunchConfig_t launch_256(cudaStream_t st, int grid, size_t smem, bool pdl, cudaLaunchAttribute& attr) {
    attr = cudaLaunchAttribute{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(256);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = &attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cfg;
}

// Relative RMS difference of `got` from `want`.
static double rel_rms_f(const std::vector<float>& want, const std::vector<float>& got) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < want.size(); ++i) {
        const double d = (double)got[i] - want[i];
        num += d * d;
        den += (double)want[i] * want[i];
    }
    return sqrt(num / den);
}

// A TMA tensor map over the packed tensor at `base` of `dims` elements of elem_bytes (innermost
// first, e.g. {cols, rows}), boxes of `box` elements, optionally with the 128-byte swizzle, written
// to `out` (the kernels' 128-byte TensorMap). cuTensorMapEncodeTiled through the runtime's driver
// entry point, so the harnesses need no -lcuda.
static void tensor_map(void* out, CUtensorMapDataType t, const void* base, std::vector<uint64_t> dims, std::vector<uint32_t> box,
                       uint32_t elem_bytes, bool swizzle) {
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                                const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    static Encode encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult q;
        CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
        return reinterpret_cast<Encode>(fn);
    }();
    std::vector<cuuint64_t> gdims(dims.begin(), dims.end()), strides;
    cuuint64_t stride = elem_bytes;
    for (size_t i = 0; i + 1 < dims.size(); ++i) strides.push_back(stride *= dims[i]);
    std::vector<cuuint32_t> boxes(box.begin(), box.end()), element_strides(dims.size(), 1);
    CUtensorMap m;
    const CUresult r = encode(&m, t, (cuuint32_t)dims.size(), const_cast<void*>(base), gdims.data(), strides.data(), boxes.data(),
                              element_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE,
                              swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        printf("tensor map encode failed: %d\n", (int)r);
        exit(1);
    }
    memcpy(out, &m, 128);
}
