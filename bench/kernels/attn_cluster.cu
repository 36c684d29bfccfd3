// Cluster-based decode attention at short context: the question to answer before building it
// (session 40, lead 3). attn_decode's 264 resident blocks meet through global memory before they
// merge the splits: in the 4K timeline ~2 us pass from the last block's shares to the meeting and
// ~1 us more to merge, of a 7.3 us launch. One cluster of blocks per KV head would merge through
// distributed shared memory instead, with no grid meeting, but fewer SMs then stream the K/V.
// Can 2 clusters of 16 blocks (32 SMs) stream a 4K context's K/V (8 MB) and merge in well under
// 7 us? This harness times that shape with attn_decode's load pattern and a stand-in merge:
//   - each block streams its contiguous share of one KV head's positions as attn_decode's warps
//     do: 8 positions a warp step, each position's K and V rows (512 B each) as one 16-byte load
//     a lane, DEPTH steps in flight a warp, the bytes folded into a checksum;
//   - with the merge, every block writes an 8 KB partial (8 heads x 256 floats) into its shared
//     memory, the cluster meets (barrier.cluster), and block r sums slice r of every peer's
//     partial through distributed shared memory, then the cluster meets again.
// Reported: us per launch (16 launches in a graph over 3 caches 300 MB apart, best of 5), for the
// resident grid attn_decode runs (264 x 4 warps, streaming only: the floor of today's shape
// before its meeting) and for 2 clusters of 16 and 4 clusters of 8 (2 a head: a 2-way merge
// through global memory would remain, not timed) at 4, 8 and 16 warps, with and without the
// merge; contexts 2K, 4K, 8K. The cluster shapes need 16 (or 8) SMs of one GPC free at once;
// cudaOccupancyMaxActiveClusters is printed for each.
// Run on the GPU machine:  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//     bench/kernels/attn_cluster.cu -o /tmp/attn_cluster && /tmp/attn_cluster
#include <cooperative_groups.h>

#include "harness.cuh"

namespace cg = cooperative_groups;

#define HEADS 2
#define ROW_UINT4 32  // a K or V row of one head: 256 bf16 = 512 B

template <int WARPS, int DEPTH, bool MERGE>
__global__ void __launch_bounds__(WARPS * 32, 1) stream_kv(const uint4* k, const uint4* v, int positions, float* out, int* sink) {
    __shared__ float part[8 * 256];
    const int per_head = gridDim.x / HEADS, head = blockIdx.x / per_head, share = blockIdx.x % per_head;
    const int span = (positions + per_head - 1) / per_head, p0 = share * span, p1 = min(positions, p0 + span);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint32_t acc = 0;
    uint4 buf[DEPTH][16];
    const auto load = [&](int p, uint4(&b)[16]) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const size_t row = ((size_t)min(p + j, p1 - 1) * HEADS + head) * ROW_UINT4 + lane;
            b[j] = __ldcs(k + row);
            b[8 + j] = __ldcs(v + row);
        }
    };
    const auto fold = [&](const uint4(&b)[16]) {
#pragma unroll
        for (int j = 0; j < 16; ++j) acc ^= b[j].x + b[j].y * 3u + b[j].z * 5u + b[j].w * 7u;
    };
    const int stride = WARPS * 8;
    int p = p0 + warp * 8;
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
        if (p + d * stride < p1) load(p + d * stride, buf[d]);
    for (; p < p1; p += DEPTH * stride) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int q = p + d * stride;
            if (q >= p1) break;
            fold(buf[d]);
            if (q + DEPTH * stride < p1) load(q + DEPTH * stride, buf[d]);
        }
    }
    if constexpr (MERGE) {
        cg::cluster_group cluster = cg::this_cluster();
        for (int i = threadIdx.x; i < 8 * 256; i += blockDim.x) part[i] = (float)(acc ^ (uint32_t)i);
        cluster.sync();
        const int rank = (int)cluster.block_rank(), blocks = (int)cluster.num_blocks(), slice = 8 * 256 / blocks;
        for (int i = threadIdx.x; i < slice; i += blockDim.x) {
            float s = 0.f;
            for (int r = 0; r < blocks; ++r) s += cluster.map_shared_rank(part, r)[rank * slice + i];
            out[(size_t)blockIdx.x * slice + i] = s;
        }
        cluster.sync();
    } else if (acc == 0x12345678u) {
        sink[0] = (int)acc;
    }
}

template <int WARPS, int DEPTH, bool MERGE>
static void time_shape(const char* name, int blocks, int cluster, const uint4* const (&kv)[3][2], int positions, float* out,
                       int* sink, cudaStream_t st, bool& first) {
    auto kernel = stream_kv<WARPS, DEPTH, MERGE>;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(WARPS * 32);
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = cluster > 1 ? 1 : 0;
    if (cluster > 8) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    int clusters = 0;
    if (cluster > 1) CK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg));
    const double us = graph_us(st, 16, [&](int i) {
        CK(cudaLaunchKernelEx(&cfg, kernel, kv[i % 3][0], kv[i % 3][1], positions, out, sink));
    });
    printf("%s{\"shape\": \"%s\", \"positions\": %d, \"blocks\": %d, \"cluster\": %d, \"warps\": %d, \"depth\": %d, "
           "\"merge\": %s, \"max_active_clusters\": %d, \"us_per_launch\": %.2f, \"tb_per_s\": %.2f}",
           first ? "" : ",\n  ", name, positions, blocks, cluster, WARPS, DEPTH, MERGE ? "true" : "false", clusters, us,
           (double)positions * HEADS * 2 * 512 / (us * 1e-6) / 1e12);
    first = false;
}

int main() {
    const int max_positions = 8192;
    const size_t rows = (size_t)max_positions * HEADS, bytes = rows * 512;
    // three K/V pairs 300 MB apart, so that consecutive launches read from DRAM, not L2
    char* pool;
    const size_t gap = 300u << 20;
    CK(cudaMalloc(&pool, 6 * gap));
    CK(cudaMemset(pool, 1, 6 * gap));
    const uint4* kv[3][2];
    for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 2; ++j) kv[i][j] = reinterpret_cast<const uint4*>(pool + (2 * i + j) * gap);
    (void)bytes;
    float* out;
    int* sink;
    CK(cudaMalloc(&out, 264 * 2048 * sizeof(float)));
    CK(cudaMalloc(&sink, sizeof(int)));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    bool first = true;
    printf("{\"results\": [\n  ");
    for (int positions : {2048, 4096, 8192}) {
        time_shape<4, 2, false>("grid 264 (attn_decode's), streaming only", 264, 1, kv, positions, out, sink, st, first);
        time_shape<4, 2, false>("2 x 16, streaming only", 32, 1, kv, positions, out, sink, st, first);
        time_shape<8, 2, false>("2 x 16, streaming only", 32, 1, kv, positions, out, sink, st, first);
        time_shape<16, 1, false>("2 x 16, streaming only", 32, 1, kv, positions, out, sink, st, first);
        time_shape<4, 2, true>("2 x 16, merged in the cluster", 32, 16, kv, positions, out, sink, st, first);
        time_shape<8, 2, true>("2 x 16, merged in the cluster", 32, 16, kv, positions, out, sink, st, first);
        time_shape<16, 1, true>("2 x 16, merged in the cluster", 32, 16, kv, positions, out, sink, st, first);
        time_shape<8, 2, true>("4 x 8, merged in each cluster", 32, 8, kv, positions, out, sink, st, first);
        time_shape<8, 2, true>("8 x 8, merged in each cluster", 64, 8, kv, positions, out, sink, st, first);
    }
    printf("\n]}\n");
    return 0;
}
