// Shared pieces of the standalone kernel harnesses in this folder: error checks, timing, and a
// grid-wide barrier for resident launches.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

// Best of 5 timings of `launch()` on `st`, after one untimed run; milliseconds.
template <class Launch>
float best_ms(cudaStream_t st, Launch launch) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    launch();
    CK(cudaStreamSynchronize(st));
    float best = 1e9f;
    for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(e0, st));
        launch();
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        best = ms < best ? ms : best;
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return best;
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
