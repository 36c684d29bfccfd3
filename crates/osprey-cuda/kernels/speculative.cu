// Speculative decoding's bookkeeping on the GPU: the verify step (decoder.rs `SpecDev`) runs two
// rows through the model, row 0 the step's input token at position p and row 1 a drafted token
// at p + 1, each row through the one-token kernels with its own scratch; then spec_accept, in the
// same graph, keeps the draft when row 0's greedy choice equals it and drafts the next token, so
// a replay yields one or two tokens with no host round trip.
//
//   spec_accept — one block of 1024 threads. Thread 0: with c0, c1 the rows' choices and d the
//     draft, the tokens that follow the input are c0 and, when c0 == d, c1; they are appended to
//     the context, the next input (c1 or c0) and position (p + 2 or p + 1) written for row 0 and
//     the position after it for row 1, and the Gated DeltaNet state kept: row 0 wrote the state
//     after its token into the layers' other buffer, row 1 the state after its own into the
//     current one (gdn.cu GdnArgs role), so a rejected draft only flips the `cur` flag. The
//     record (count, c0, c1, position) goes to the host after the replay.
//     Then the draft for the next replay: a known answer's token where one is given (checks and
//     the best-case benchmark), else prompt lookup as speculative.rs NgramDrafter does it: the
//     latest earlier position whose last up-to-3 tokens match the context's last tokens, the
//     longest match first, proposes the token after it (every thread scans its share of the
//     positions, one shared max of (length, position)); no match drafts the input again (a draft
//     costs the same whether it is right or not).
// Measured: see bench/results/cuda-speculative-*.json.
#include "common.cuh"

#define SPEC_MAX_N 3

struct SpecArgs {
    const int* chosen;  // [2] the rows' greedy choices (their lm_head TokenChoice slots)
    int* token0;        // row 0's input slot (the next step's token)
    int* token1;        // row 1's input slot (the next draft)
    int* pos0;          // row 0's position
    int* pos1;          // row 1's position (pos0 + 1)
    int* cur;           // which GDN state buffer is current (0: the layers' own)
    int* context;       // [max_context + 2] tokens by position (prompt, then the chosen ones)
    int* record;        // [4] tokens this replay (1 or 2), c0, c1, the position after
    const int* answer;  // known answer: answer[q - span[0]] drafts position q < span[0] + span[1]
    const int* span;    // [2] (from, len); len 0: prompt lookup
    int accept;         // 0: only draft (the first replay's draft, after the host set the input)
    int _pad;
};

__device__ __forceinline__ unsigned long long match_key(int len, int end) {
    return ((unsigned long long)len << 32) | (unsigned)end;
}

extern "C" __global__ void __launch_bounds__(1024) spec_accept(SpecArgs a) {
    __shared__ int P;
    __shared__ unsigned long long best;
    if (threadIdx.x == 0) {
        int np = *a.pos0;
        if (a.accept) {
            const int p = np, c0 = a.chosen[0], c1 = a.chosen[1];
            const bool kept = c0 == *a.token1;
            a.context[p + 1] = c0;
            if (kept) a.context[p + 2] = c1;
            np = p + 1 + (kept ? 1 : 0);
            *a.token0 = kept ? c1 : c0;
            *a.pos0 = np;
            *a.pos1 = np + 1;
            if (!kept) *a.cur ^= 1;
            a.record[0] = kept ? 2 : 1;
            a.record[1] = c0;
            a.record[2] = c1;
            a.record[3] = np;
        }
        P = np;
        best = 0;
    }
    __syncthreads();
    const int p = P, q = p + 1;
    const int from = a.span[0], len = a.span[1];
    if (q >= from && q < from + len) {
        if (threadIdx.x == 0) *a.token1 = a.answer[q - from];
        return;
    }
    int last[SPEC_MAX_N];
#pragma unroll
    for (int i = 0; i < SPEC_MAX_N; ++i) last[i] = p - i >= 0 ? a.context[p - i] : -1;
    unsigned long long mine = 0;
    for (int e = p - 1 - (int)threadIdx.x; e >= 0; e -= blockDim.x) {
        int n = 0;  // tokens of the match ending at e
#pragma unroll
        for (int i = 0; i < SPEC_MAX_N; ++i) {
            if (n != i || e - i < 0 || a.context[e - i] != last[i]) break;
            n = i + 1;
        }
        if (n > 0) mine = max(mine, match_key(n, e));
    }
    if (mine) atomicMax(&best, mine);
    __syncthreads();
    if (threadIdx.x == 0) *a.token1 = best ? a.context[(int)(best & 0xFFFFFFFFu) + 1] : a.context[p];
}
