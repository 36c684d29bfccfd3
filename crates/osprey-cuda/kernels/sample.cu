// Token handoff on the GPU: the embedding row of the token in the device-side input slot, and the
// choice over the logits written straight back into that slot, with the position advanced, so a
// captured decode step replays with no host round trip.
//   embed      — dequantises one row of the 4-bit embedding (H values). Grid 1 block.
//   argmax_partial / argmax_final — two-pass argmax over the valid vocabulary (ties: lower id);
//                    they stand aside when sampling is switched on (SampleParams.active).
//   sample_token — the host sampler's semantics (crates/osprey-engine/src/sampler.rs) on the GPU:
//                    repetition / presence / frequency penalties from device-side token counts,
//                    then greedy, or top-k (k <= 256) by an exact 4-pass radix select of the k-th
//                    largest logit (warp-aggregated shared-memory histograms), the candidates
//                    sorted (logit desc, id asc) by a bitonic sort, temperature softmax, top-p,
//                    min-p, and a draw from a counter-based generator (seed, step): the same seed
//                    gives the same tokens on this backend (not the host's ChaCha stream).
//                    One block of 1024 threads.
// Measured (H200, commit e06983b): embed 19 us (one block, latency-bound), argmax 24 us over the
// 1 MB of logits (two passes).
#include "common.cuh"

struct EmbedArgs {
    const uint32_t* codes;
    const __nv_bfloat16* scales;
    const __nv_bfloat16* biases;
    const int* token;
    float* x;
    int H, group, bits;
};

extern "C" __global__ void embed(EmbedArgs a) {
    step_overlap_begin();
    step_inputs_ready();
    const size_t row = (size_t)*a.token;
    const int per_word = 32 / a.bits, wpr = a.H / per_word, gpr = a.H / a.group;
    const uint32_t mask = (1u << a.bits) - 1;
    for (int i = threadIdx.x; i < a.H; i += blockDim.x) {
        uint32_t w = a.codes[row * wpr + i / per_word];
        float q = (float)((w >> ((i % per_word) * a.bits)) & mask);
        int g = i / a.group;
        a.x[i] = bf16_to_f32(a.scales[row * gpr + g]) * q + bf16_to_f32(a.biases[row * gpr + g]);
    }
}

struct SampleParams {
    float temperature, top_p, min_p, presence, frequency, repetition;
    int top_k;
    int active;  // 1: sample_token chooses (argmax stands aside)
    unsigned long long seed;
};

struct ArgmaxArgs {
    const SampleParams* params;
    const float* logits;
    float* part_val;
    int* part_idx;
    int* token;       // next step's input slot
    int* pos;         // advanced by one
    int* history;     // generated ids, indexed by step
    int* step;
    int n;
};

extern "C" __global__ void __launch_bounds__(256) argmax_partial(ArgmaxArgs a) {
    step_overlap_begin();
    step_inputs_ready();
    if (a.params->active) return;
    __shared__ float sv[256];
    __shared__ int si[256];
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += gridDim.x * blockDim.x) {
        float v = a.logits[i];
        if (v > best) { best = v; bi = i; }
    }
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = sv[threadIdx.x + s];
            int oi = si[threadIdx.x + s];
            if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x])) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        a.part_val[blockIdx.x] = sv[0];
        a.part_idx[blockIdx.x] = si[0];
    }
}

extern "C" __global__ void argmax_final(ArgmaxArgs a, int parts) {
    step_overlap_begin();
    step_inputs_ready();
    if (threadIdx.x != 0 || a.params->active) return;
    float best = -INFINITY;
    int bi = 0;
    for (int p = 0; p < parts; ++p) {
        if (a.part_val[p] > best || (a.part_val[p] == best && a.part_idx[p] < bi)) { best = a.part_val[p]; bi = a.part_idx[p]; }
    }
    *a.token = bi;
    a.history[*a.step] = bi;
    *a.step += 1;
    *a.pos += 1;
}

#define SAMPLE_THREADS 1024
#define MAX_SAMPLE_K 256
#define MAX_CAND 1024

struct SampleArgs {
    const SampleParams* params;
    float* logits;   // [n], penalties applied in place
    int* seen;       // [n] prompt + output counts
    int* output;     // [n] output counts
    int* token;
    int* pos;
    int* history;
    int* step;
    int n;
};

// Unsigned key with the order of the float.
__device__ __forceinline__ unsigned orderable(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Uniform in [0, 1) from (seed, step): splitmix64.
__device__ __forceinline__ float uniform01(unsigned long long seed, unsigned long long step) {
    unsigned long long z = seed + (step + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

// x comes before y: larger logit, then lower id.
__device__ __forceinline__ bool before(float xv, int xi, float yv, int yi) { return xv > yv || (xv == yv && xi < yi); }

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_token(SampleArgs a) {
    step_overlap_begin();
    step_inputs_ready();
    const SampleParams P = *a.params;
    if (!P.active) return;
    __shared__ unsigned hist[257];
    __shared__ float cv[MAX_CAND];
    __shared__ int ci[MAX_CAND];
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    __shared__ unsigned s_prefix;
    __shared__ int s_k, ncand, chosen;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // penalties in place, and the greedy choice
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = tid; i < a.n; i += SAMPLE_THREADS) {
        float l = a.logits[i];
        if (P.repetition != 1.f && a.seen[i] > 0) l = l > 0.f ? l / P.repetition : l * P.repetition;
        const int o = a.output[i];
        if (o > 0) l -= P.presence + P.frequency * (float)o;
        a.logits[i] = l;
        if (l > best) { best = l; bi = i; }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, best, off);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
        if (before(ov, oi, best, bi)) { best = ov; bi = oi; }
    }
    if (lane == 0) { red_v[warp] = best; red_i[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        best = red_v[lane];
        bi = red_i[lane];
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, best, off);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
            if (before(ov, oi, best, bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) chosen = bi;
    }
    __syncthreads();

    if (P.temperature > 0.f && P.top_k > 1) {
        // the k-th largest key, one byte at a time from the top
        unsigned prefix = 0, mask = 0;
        int k = min(P.top_k, MAX_SAMPLE_K);
        for (int shift = 24; shift >= 0; shift -= 8) {
            if (tid < 257) hist[tid] = 0;
            __syncthreads();
            for (int base = 0; base < a.n; base += SAMPLE_THREADS) {
                const int i = base + tid;
                unsigned bin = 256;
                if (i < a.n) {
                    const unsigned key = orderable(a.logits[i]);
                    if ((key & mask) == prefix) bin = (key >> shift) & 255u;
                }
                const unsigned peers = __match_any_sync(FULL_MASK, bin);
                if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
            }
            __syncthreads();
            if (tid == 0) {
                int above = 0;
                for (int b = 255; b >= 0; --b) {
                    if (above + (int)hist[b] >= k) {
                        s_prefix = prefix | ((unsigned)b << shift);
                        s_k = k - above;
                        break;
                    }
                    above += hist[b];
                }
            }
            __syncthreads();
            prefix = s_prefix;
            k = s_k;
            mask |= 255u << shift;
        }
        // candidates: every logit at or above the k-th largest
        if (tid == 0) ncand = 0;
        __syncthreads();
        for (int i = tid; i < a.n; i += SAMPLE_THREADS) {
            const float l = a.logits[i];
            if (orderable(l) >= prefix) {
                const int slot = atomicAdd(&ncand, 1);
                if (slot < MAX_CAND) { cv[slot] = l; ci[slot] = i; }
            }
        }
        __syncthreads();
        const int m = min(ncand, MAX_CAND);
        if (tid >= m) { cv[tid] = -INFINITY; ci[tid] = 0x7fffffff; }
        __syncthreads();
        // bitonic sort of the 1024 slots, best first
        for (int size = 2; size <= MAX_CAND; size <<= 1) {
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                const int j = tid ^ stride;
                if (j > tid) {
                    const bool first_half = (tid & size) == 0;
                    const bool swap = first_half ? before(cv[j], ci[j], cv[tid], ci[tid]) : before(cv[tid], ci[tid], cv[j], ci[j]);
                    if (swap) {
                        const float tv = cv[tid]; cv[tid] = cv[j]; cv[j] = tv;
                        const int ti = ci[tid]; ci[tid] = ci[j]; ci[j] = ti;
                    }
                }
                __syncthreads();
            }
        }
        if (tid == 0) {
            const int kk = min(min(P.top_k, MAX_SAMPLE_K), m);
            float p[MAX_SAMPLE_K];
            float sum = 0.f;
            for (int r = 0; r < kk; ++r) {
                p[r] = __expf((cv[r] - cv[0]) / P.temperature);
                sum += p[r];
            }
            int keep = kk;
            if (P.top_p < 1.f) {
                float acc = 0.f;
                for (int r = 0; r < kk; ++r) {
                    acc += p[r] / sum;
                    if (acc >= P.top_p) { keep = r + 1; break; }
                }
            }
            if (P.min_p > 0.f) {
                const float floor = P.min_p * p[0] / sum;
                int r = 0;
                while (r < keep && p[r] / sum >= floor) ++r;
                keep = max(r, 1);
            }
            float total = 0.f;
            for (int r = 0; r < keep; ++r) total += p[r];
            float u = uniform01(P.seed, (unsigned long long)*a.step) * total;
            int pick = keep - 1;
            for (int r = 0; r < keep; ++r) {
                if (u < p[r]) { pick = r; break; }
                u -= p[r];
            }
            chosen = ci[pick];
        }
        __syncthreads();
    }
    if (tid == 0) {
        const int t = chosen;
        *a.token = t;
        a.history[*a.step] = t;
        *a.step += 1;
        *a.pos += 1;
        a.seen[t] += 1;
        a.output[t] += 1;
    }
}
