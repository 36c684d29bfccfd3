// Token handoff on the GPU: the embedding row of the token in the device-side input slot, and the
// choice over the logits written straight back into that slot, with the position advanced, so a
// captured decode step replays with no host round trip.
//   embed      — dequantises one row of the 4- or 8-bit embedding (H values). Grid 1 block of
//                256 threads, each its words of the row.
//   (greedy: the lm_head launch chooses, gemv.cu TokenChoice; it stands aside when sampling is
//    switched on, SampleParams.active)
//   sample_token — the host sampler's semantics (crates/osprey-engine/src/sampler.rs) on the GPU:
//                    repetition / presence / frequency penalties from device-side token counts,
//                    then greedy, or top-k (k <= 256) by an exact 4-pass radix select of the k-th
//                    largest logit (warp-aggregated shared-memory histograms), the candidates
//                    sorted (logit desc, id asc) by a bitonic sort, temperature softmax, top-p,
//                    min-p, and a draw from a counter-based generator (seed, step): the same seed
//                    gives the same tokens on this backend (not the host's ChaCha stream).
//                    One block of 1024 threads, over the candidates sample_prepass left.
//   sample_prepass — the first pass over the vocabulary spread over 128 blocks: penalties, then
//                    each slice's top-k candidates (see the kernel).
// Measured (H200): embed 1.5 us of the 4K step's timeline (7.9 with its loads a round trip per
// 256 elements, commit 2797367); commit e06983b: a two-pass argmax
// kernel pair 24 us over the 1 MB of logits launched alone (fused into the lm_head since: no
// measurable change to the step, bench/results/cuda-decode-lm-head-argmax-fused.json). Sampling (top-k 20, top-p 0.95), launched alone with events:
// 410 us when sample_token read the whole vocabulary in one block, 90 us with the prepass
// (4K-context decode with sampling 330 -> 370 tok/s, commit 14b6745), 62 us with k candidates
// per prepass block instead of 256 slots (529.8 -> 540.2 tok/s, commit d237fc7,
// bench/results/cuda-decode-sampler-candidates.json); in the step's timeline the prepass 9.5 us
// and sample_token 15.9 after their releases, 25.6 and 29.7 before each radix pass's bin was
// found by a warp scan (752.7 -> 768.9 tok/s, commit ef84881, cuda-decode-sampler-scan.json).
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
    embed_row(a.codes, a.scales, a.biases, (size_t)*a.token, a.H, a.group, a.bits, a.x);
}

struct SampleParams {
    float temperature, top_p, min_p, presence, frequency, repetition;
    int top_k;
    int active;  // 1: sample_token chooses (the lm_head's greedy choice stands aside)
    unsigned long long seed;
};

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
    // `parts` blocks of sample_prepass apply the penalties and leave their slice's best k
    // candidates here (prepass_stride); sample_token selects among those
    float* cand_v;   // [parts * MAX_SAMPLE_K] at most
    int* cand_i;
    int parts;
    int _pad;
};

#define PREPASS_THREADS 256
#define PREPASS_MAX_SLICE 4096

// Candidates each prepass block leaves: top-k's k (at most MAX_SAMPLE_K), or its best one when
// greedy; sample_token reads parts times as many.
__device__ __forceinline__ int prepass_stride(const SampleParams& P) {
    return P.temperature > 0.f && P.top_k > 1 ? min(P.top_k, MAX_SAMPLE_K) : 1;
}

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

// The sampler's penalties on one logit (repetition on every seen token, presence and frequency
// on generated ones), as crates/osprey-engine/src/sampler.rs applies them.
__device__ __forceinline__ float penalised(const SampleParams& P, float l, int seen, int o) {
    if (P.repetition != 1.f && seen > 0) l = l > 0.f ? l / P.repetition : l * P.repetition;
    if (o > 0) l -= P.presence + P.frequency * (float)o;
    return l;
}

// x comes before y: larger logit, then lower id.
__device__ __forceinline__ bool before(float xv, int xi, float yv, int yi) { return xv > yv || (xv == yv && xi < yi); }

// The warp's first (logit, id) by `before`, in every lane.
__device__ __forceinline__ void warp_best(float& best, int& bi) {
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, best, off);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
        if (before(ov, oi, best, bi)) { best = ov; bi = oi; }
    }
}

// The k-th largest of `count` keys (key(i), i < count), one byte at a time from the top: four
// histogram passes by the whole block (warp-aggregated shared-memory atomics), each narrowing the
// prefix. Every key at or above the returned one is among the k largest or tied with the k-th.
// Each pass's bin is found by warp 0 (8 bins a lane from the top, a shuffle scan of the lanes'
// counts): one thread walking the 256 bins took ~4 us a pass, most of a sampled step's 55 us
// of token choice (bench/results/cuda-decode-sampler-scan.json).
template <class Key>
__device__ unsigned kth_largest_key(int count, int k, Key key, unsigned* hist, unsigned* s_prefix, int* s_k) {
    const int tid = threadIdx.x, lane = tid & 31;
    unsigned prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int h = tid; h < 257; h += blockDim.x) hist[h] = 0;
        __syncthreads();
        for (int base = 0; base < count; base += blockDim.x) {
            const int i = base + tid;
            unsigned bin = 256;
            if (i < count) {
                const unsigned v = key(i);
                if ((v & mask) == prefix) bin = (v >> shift) & 255u;
            }
            const unsigned peers = __match_any_sync(FULL_MASK, bin);
            if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
        }
        __syncthreads();
        if (tid < 32) {
            // lane l: bins 255 - 8l down to 248 - 8l; fewer than k keys in all: the prefix stays
            int c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                c[j] = (int)hist[255 - 8 * lane - j];
                sum += c[j];
            }
            int incl = sum;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int t = __shfl_up_sync(FULL_MASK, incl, off);
                if (lane >= off) incl += t;
            }
            const unsigned reach = __ballot_sync(FULL_MASK, incl >= k);
            if (lane == 0) {
                *s_prefix = prefix;
                *s_k = k;
            }
            __syncwarp();
            if (reach && lane == __ffs(reach) - 1) {
                int above = incl - sum;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (above + c[j] >= k) {
                        *s_prefix = prefix | ((unsigned)(255 - 8 * lane - j) << shift);
                        *s_k = k - above;
                        break;
                    }
                    above += c[j];
                }
            }
        }
        __syncthreads();
        prefix = *s_prefix;
        k = *s_k;
        mask |= 255u << shift;
    }
    return prefix;
}

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

    // the values selected from: the prepass's candidates (penalised there) with their token ids
    const int count = a.parts * prepass_stride(P);
    // the greedy choice
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = tid; i < count; i += SAMPLE_THREADS) {
        const float l = a.cand_v[i];
        const int id = a.cand_i[i];
        if (before(l, id, best, bi)) { best = l; bi = id; }
    }
    warp_best(best, bi);
    if (lane == 0) { red_v[warp] = best; red_i[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        best = red_v[lane];
        bi = red_i[lane];
        warp_best(best, bi);
        if (lane == 0) chosen = bi;
    }
    __syncthreads();

    if (P.temperature > 0.f && P.top_k > 1) {
        const unsigned prefix = kth_largest_key(count, min(P.top_k, MAX_SAMPLE_K),
                                                [&](int i) { return orderable(a.cand_v[i]); }, hist, &s_prefix, &s_k);
        // candidates: every logit at or above the k-th largest
        if (tid == 0) ncand = 0;
        __syncthreads();
        for (int i = tid; i < count; i += SAMPLE_THREADS) {
            const float l = a.cand_v[i];
            if (orderable(l) >= prefix) {
                const int slot = atomicAdd(&ncand, 1);
                if (slot < MAX_CAND) { cv[slot] = l; ci[slot] = a.cand_i[i]; }
            }
        }
        __syncthreads();
        const int m = min(ncand, MAX_CAND);
        if (tid >= m) { cv[tid] = -INFINITY; ci[tid] = 0x7fffffff; }
        __syncthreads();
        // bitonic sort of the first power of two slots holding them, best first
        int slots = 2;
        while (slots < m) slots <<= 1;
        for (int size = 2; size <= slots; size <<= 1) {
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                const int j = tid ^ stride;
                if (tid < slots && j > tid) {
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

// The sampler's first pass spread over `parts` blocks: block b applies the penalties to its slice
// of the vocabulary (in place) and keeps, in cand_v/cand_i[b * k ...], every logit at or above
// the slice's k-th largest (an exact radix select in shared memory; k = top-k <= 256, so the
// global top-k is among the union) or, when greedy (k = 1), the slice's best; unused slots hold
// -inf. sample_token then reads parts · k candidates instead of the whole vocabulary (one
// 1024-thread block over ~1 MB four times was ~0.3 ms of a step; over parts · 256 slots whatever
// k, 88 us of a sampled step with top-k 20). A slice with more than k logits tied at its k-th
// largest keeps k of them in arrival order (exact ties of float logits at that boundary).
extern "C" __global__ void __launch_bounds__(PREPASS_THREADS) sample_prepass(SampleArgs a) {
    step_overlap_begin();
    step_inputs_ready();
    const SampleParams P = *a.params;
    if (!P.active) return;
    __shared__ float sl[PREPASS_MAX_SLICE];
    __shared__ unsigned hist[257];
    __shared__ float red_v[PREPASS_THREADS / 32];
    __shared__ int red_i[PREPASS_THREADS / 32];
    __shared__ unsigned s_prefix;
    __shared__ int s_k, ncand;
    const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int slice = (a.n + gridDim.x - 1) / gridDim.x;
    const int lo = b * slice, len = max(0, min(a.n, lo + slice) - lo);
    const int stride = prepass_stride(P);
    float* out_v = a.cand_v + (size_t)b * stride;
    int* out_i = a.cand_i + (size_t)b * stride;
    float best = -INFINITY;
    int bi = 0x7fffffff;
    // every logit and count of the thread's share requested before any is penalised and stored
    // (stored as it went, each of the 8 rounds waited for the last one's loads)
    constexpr int PER_THREAD = PREPASS_MAX_SLICE / PREPASS_THREADS;
    float lv[PER_THREAD];
    int seen[PER_THREAD], outc[PER_THREAD];
#pragma unroll
    for (int r = 0; r < PER_THREAD; ++r) {
        const int j = tid + r * PREPASS_THREADS;
        if (j < len) {
            lv[r] = a.logits[lo + j];
            seen[r] = P.repetition != 1.f ? a.seen[lo + j] : 0;
            outc[r] = a.output[lo + j];
        }
    }
#pragma unroll
    for (int r = 0; r < PER_THREAD; ++r) {
        const int j = tid + r * PREPASS_THREADS;
        if (j < len) {
            const float l = penalised(P, lv[r], seen[r], outc[r]);
            a.logits[lo + j] = l;
            sl[j] = l;
            if (before(l, lo + j, best, bi)) { best = l; bi = lo + j; }
        }
    }
    warp_best(best, bi);
    if (lane == 0) { red_v[warp] = best; red_i[warp] = bi; }
    if (tid == 0) ncand = 0;
    __syncthreads();
    const bool top_k = P.temperature > 0.f && P.top_k > 1;
    if (!top_k) {
        if (tid == 0) {
            for (int w = 1; w < PREPASS_THREADS / 32; ++w)
                if (before(red_v[w], red_i[w], red_v[0], red_i[0])) { red_v[0] = red_v[w]; red_i[0] = red_i[w]; }
            out_v[0] = red_v[0];
            out_i[0] = red_i[0];
        }
        return;
    }
    const unsigned prefix = kth_largest_key(len, min(stride, max(len, 1)),
                                            [&](int j) { return orderable(sl[j]); }, hist, &s_prefix, &s_k);
    for (int j = tid; j < len; j += PREPASS_THREADS) {
        if (orderable(sl[j]) >= prefix) {
            const int slot = atomicAdd(&ncand, 1);
            if (slot < stride) { out_v[slot] = sl[j]; out_i[slot] = lo + j; }
        }
    }
    __syncthreads();
    for (int r = min(ncand, stride) + tid; r < stride; r += PREPASS_THREADS) { out_v[r] = -INFINITY; out_i[r] = 0x7fffffff; }
}

// Log-probabilities where the logits are (prompt scoring for echo and lm-evaluation-harness's
// loglikelihood; each decode step's token when a reply asks for logprobs): a row's logits
// summarised on the device, so that a few floats cross to the host instead of the whole row
// (~1 MB at the real vocabulary). The summary: the log of the softmax's normaliser over the ids
// below `valid` (as the host's PositionLogprobs::of: the maximum, then the sum of exp(x - max)),
// the logit of a given token, and the `top` largest finite logits (logit desc, id asc:
// top_k_indices' order). Two launches a batch of rows:
//   logit_partials — grid (SUMMARY_PARTS, rows), 256 threads: block b takes its slice of the
//                    row (~1,940 ids) into shared memory, its maximum, its sum of exp(x - that
//                    maximum) and its `top` largest by `top` arg-max passes over the slice.
//   logit_merge    — a block a row: the slices' maxima and sums into the normaliser, and the
//                    top `top` of the SUMMARY_PARTS · top candidates by arg-max passes.
// Measured (H100, 256-token greedy replies over HTTP, full-size model): with one 1024-thread
// block a row walking the whole row `top` times, top_logprobs 5 cost 0.21 ms a token and 20 cost
// 0.67 (cuda-serve-logprobs-speed-h100.json, commit 0014cae).
#define SUMMARY_THREADS 256
#define SUMMARY_PARTS 128
#define SUMMARY_MAX_SLICE 2048
#define SUMMARY_MAX_TOP 20  // the APIs ask at most 20 (prefill.rs MAX_SUMMARY_TOP)
#define NO_NEXT 0xffffffffu
#define NO_ID 0x7fffffff

struct SummaryArgs {
    const float* logits;  // [rows, vocab]
    const unsigned* next; // [rows]: the token whose logit each summary holds, NO_NEXT where none
    float* out;           // [rows, 2 + 2 top]: log normaliser, next's logit (NaN: none), then
                          // (id as int bits, -1 past the finite logits; logit) pairs
    float* partials;      // [rows, SUMMARY_PARTS, 2 + 2 top]: each slice's maximum, sum and top
    int vocab, valid, top, _pad;
};

// The `top` largest finite values among n (value, id) pairs in shared memory, best first, by
// arg-max passes, each over the pairs after the one found last; written as (id bits, value)
// pairs to out (NO_ID as -1 and -inf past the finite ones). Every thread of the block calls it.
__device__ __forceinline__ void top_by_passes(const float* v, const int* id, int n, int top, float* out, float* best_v,
                                              int* best_i) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float last_v = INFINITY;
    int last_i = -1;
    for (int r = 0; r < top; ++r) {
        float bv = -INFINITY;
        int bi = NO_ID;
        for (int j = tid; j < n; j += SUMMARY_THREADS) {
            const float x = v[j];
            const int i = id[j];
            if (isfinite(x) && before(last_v, last_i, x, i) && before(x, i, bv, bi)) {
                bv = x;
                bi = i;
            }
        }
        warp_best(bv, bi);
        __syncthreads();  // the previous pass's reads of best_v / best_i are done
        if (lane == 0) {
            best_v[warp] = bv;
            best_i[warp] = bi;
        }
        __syncthreads();
        bv = lane < SUMMARY_THREADS / 32 ? best_v[lane] : -INFINITY;
        bi = lane < SUMMARY_THREADS / 32 ? best_i[lane] : NO_ID;
        warp_best(bv, bi);
        if (tid == 0) {
            out[2 * r] = __int_as_float(bi == NO_ID ? -1 : bi);
            out[2 * r + 1] = bi == NO_ID ? -INFINITY : bv;
        }
        last_v = bv;
        last_i = bi;
    }
}

extern "C" __global__ void __launch_bounds__(SUMMARY_THREADS) logit_partials(SummaryArgs a) {
    __shared__ float sv[SUMMARY_MAX_SLICE];
    __shared__ int si[SUMMARY_MAX_SLICE];
    __shared__ float scratch[32], best_v[32];
    __shared__ int best_i[32];
    const int tid = threadIdx.x, row = blockIdx.y;
    const int slice = (a.valid + SUMMARY_PARTS - 1) / SUMMARY_PARTS;
    const int lo = blockIdx.x * slice, n = max(0, min(a.valid, lo + slice) - lo);
    const float* x = a.logits + (size_t)row * a.vocab + lo;
    float* out = a.partials + ((size_t)row * SUMMARY_PARTS + blockIdx.x) * (2 + 2 * a.top);
    float m = -INFINITY;
    for (int j = tid; j < n; j += SUMMARY_THREADS) {
        const float v = x[j];
        sv[j] = v;
        si[j] = lo + j;
        m = fmaxf(m, v);
    }
    m = block_max(m, scratch);
    float s = 0.f;
    if (m > -INFINITY)
        for (int j = tid; j < n; j += SUMMARY_THREADS) s += __expf(sv[j] - m);
    s = block_sum(s, scratch);
    if (tid == 0) {
        out[0] = m;
        out[1] = s;
    }
    top_by_passes(sv, si, n, a.top, out + 2, best_v, best_i);
}

extern "C" __global__ void __launch_bounds__(SUMMARY_THREADS) logit_merge(SummaryArgs a) {
    __shared__ float cv[SUMMARY_PARTS * SUMMARY_MAX_TOP];
    __shared__ int ci[SUMMARY_PARTS * SUMMARY_MAX_TOP];
    __shared__ float scratch[32], best_v[32];
    __shared__ int best_i[32];
    const int tid = threadIdx.x, row = blockIdx.x, width = 2 + 2 * a.top;
    const float* part = a.partials + (size_t)row * SUMMARY_PARTS * width;
    const float* x = a.logits + (size_t)row * a.vocab;
    float* out = a.out + (size_t)row * width;
    float m = -INFINITY;
    for (int b = tid; b < SUMMARY_PARTS; b += SUMMARY_THREADS) m = fmaxf(m, part[b * width]);
    m = block_max(m, scratch);
    float s = 0.f;
    for (int b = tid; b < SUMMARY_PARTS; b += SUMMARY_THREADS) {
        const float mb = part[b * width];
        if (mb > -INFINITY) s += part[b * width + 1] * __expf(mb - m);
    }
    s = block_sum(s, scratch);
    if (tid == 0) {
        out[0] = m + __logf(s);
        const unsigned next = a.next[row];
        out[1] = next == NO_NEXT ? __int_as_float(0x7fc00000) : next < (unsigned)a.valid ? x[next] : -INFINITY;
    }
    // the candidates: every slice's top
    const int n = SUMMARY_PARTS * a.top;
    for (int j = tid; j < n; j += SUMMARY_THREADS) {
        const float* p = part + (j / a.top) * width + 2 + 2 * (j % a.top);
        const int id = __float_as_int(p[0]);
        ci[j] = id < 0 ? NO_ID : id;
        cv[j] = p[1];
    }
    __syncthreads();
    top_by_passes(cv, ci, n, a.top, out + 2, best_v, best_i);
}
