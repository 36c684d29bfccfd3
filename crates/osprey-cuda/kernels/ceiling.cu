// The device's own ceilings, measured when a benchmark starts, so that a step's achieved rate is
// judged against the GPU it ran on (an H100's HBM3 reads ~25% slower than an H200's HBM3e) and
// not against a figure written down for another.
//   read_stream — a streaming read of a buffer much larger than L2 (the benchmark uses 1 GiB
//                 against a 50-60 MB L2), the rate every weight and K/V read of a decode step is
//                 bound by. Grid-stride over 16-byte vectors, four independent loads in flight
//                 per thread per iteration, not kept in L1; the XOR of all it read is stored
//                 only if it equals a key the buffer cannot produce (it is zeroed), so the loads
//                 cannot be dropped and nothing is written. Launch: 8 blocks of 512 threads an
//                 SM (a full SM's worth of warps, enough loads in flight to cover DRAM latency).
// Measured: the H200's ~3.7 TB/s (budget.md: a plain streaming-read probe over data past L2) is
// what the decode benchmark's JSON reported as its ceiling before this kernel; the benchmark's
// JSON now names the rate this kernel measured on the device at hand (read_ceiling_bytes_per_s).
#include "common.cuh"

struct ReadArgs {
    const uint4* src;    // [vectors], zeroed
    unsigned long long vectors;
    unsigned* sink;      // written only if the XOR equals `key` (never, for a zeroed buffer)
    unsigned key;
    int _pad;
};

extern "C" __global__ void __launch_bounds__(512) read_stream(ReadArgs a) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 acc = make_uint4(0u, 0u, 0u, 0u);
    for (; i + 3 * stride < a.vectors; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = __ldcs(a.src + i + j * stride);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc.x ^= v[j].x;
            acc.y ^= v[j].y;
            acc.z ^= v[j].z;
            acc.w ^= v[j].w;
        }
    }
    for (; i < a.vectors; i += stride) {
        const uint4 v = __ldcs(a.src + i);
        acc.x ^= v.x;
        acc.y ^= v.y;
        acc.z ^= v.z;
        acc.w ^= v.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == a.key) a.sink[0] = 1u;
}
