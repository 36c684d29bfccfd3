//! The batch-1 decode step on the GPU. Per Gated DeltaNet layer: 3 kernels for the mixer (fused
//! input projections with the RMSNorm prologue, the fused recurrent step, out_proj with the
//! residual add) and 1 for the MoE (moe_routed_experts: the router's and the shared expert's
//! rows, selection, gate/up/SwiGLU and, once a slot's blocks have met, each block's rows of its
//! expert's down projection added into the residual; `OSPREY_DECODE_MOE=router` runs the router
//! and shared-expert projections as a launch of their own, then the rest as moe_experts, `=pair`
//! also splits the last into gate/up and down).
//! Attention layers use 5 for the mixer. The step ends with the lm_head GEMV, whose last block
//! writes the greedy choice into the input slot and advances the position, so replaying the
//! captured graph generates with no host round trip.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream,
    DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use osprey_engine::sampler::{PositionLogprobs, Sampler, SamplingParams};
use osprey_engine::KvCache;
use osprey_model::config::ModelConfig;
use osprey_model::tensor::{FloatBuf, Linear, Matrix, MatrixData};
use osprey_model::weights::{GdnProjections, Mixer, ModelWeights};

use crate::args::*;
use crate::timeline::Mark;

mod prefill;
mod speculative;
pub use prefill::GdnPrefill;
pub use speculative::{Drafts, SpecRun};

/// Most attention splits over the context (flash-decoding; sizes the partial results): the kernel
/// uses 128 up to 128K positions and one per 1024 beyond (attention.cu), over a fixed grid.
const SPLITS: usize = 512;
/// attn_decode's threads a block (attention.cu WARPS warps).
const ATTN_THREADS: u32 = 128;
/// attn_decode's blocks an SM when they fit (two: 255 registers a thread).
const ATTN_BLOCKS_PER_SM: usize = 2;
/// Shared memory of one 16-row tile of 4-bit group-64 rows at width `k`: codes, scales, biases.
fn tile_smem(k: usize) -> usize {
    16 * (k / 2 + 2 * (k / 64) * 2)
}

/// Shared memory of the input at width `k` in the tiles' byte form (tiles.cuh resident_input):
/// two signed bytes per element (16 B per 8-element slot) and (scale, sum) per 64-group, then 32
/// floats of reduction scratch.
fn x_bytes_smem(k: usize) -> usize {
    (k / 64) * (8 * 16 + 8) + 32 * 4
}

/// gemv_q_resident's block where the experts do not launch early (`OSPREY_CUDA_OVERLAP=0` or
/// `prefetch`): 16 warps, two per K-slice (gemv.cu RES_KSLICES), each taking every other tile of
/// the block's run (measured at 4K: 627.0 -> 629.1 tok/s against 8 warps, three round sets on one
/// H200 each, bench/results/cuda-decode-session14-ablations.json).
const RESIDENT_THREADS: u32 = 512;
/// gemv_q_resident's block where the experts launch early (the default step): 8 warps. Its launches
/// (the next layer's input projections) are early too; an SM's 64K registers decide when they
/// land. Generic kernels: 512 threads x 94 registers only once both moe_experts blocks (256 x 95
/// then) had left, 256 threads once one had, so their tile copies went out sooner (4K 667.0 ->
/// 673.5 tok/s; at 128K, moe_experts plain, 8 warps lose 0.4%:
/// bench/results/cuda-decode-resident-threads-ablation.json). Compiled for the model's shape
/// (gemv_q_resident_k2048 at 72 registers, moe_experts_h2048 at 80) 256 threads fit beside both
/// blocks and 512 beside one (cuda-decode-shape-specialised.json). Now at 90 and 82 (88
/// allocated) registers, 256 threads fit beside one experts block; capped at 80 (beside both,
/// with no register to spare) the timeline still had its blocks land as the experts left, and 16
/// warps lost (4K 766.6 -> 756.8 tok/s; bench/results/cuda-decode-session29-ablations.json).
/// Plus a ninth warp that streams the block's tiles in order, a few ahead of the multiply, which
/// takes each as it lands (gemv.cu RES_RING_DEPTH): 4K 862.7 -> 872.0 tok/s, 32K 765.0 -> 767.5
/// (bench/results/cuda-decode-session38-ablations.json).
const RESIDENT_THREADS_AFTER_EARLY_EXPERTS: u32 = 256 + 32;
/// Most tiles a streamed gemv_q_resident block takes: one barrier each (gemv.cu RES_MAX_STREAMED).
const RESIDENT_MAX_STREAMED: usize = 16;
/// Just over half of an H200 SM's 228 KB of shared memory (1 KB of each block's is reserved).
const RESIDENT_MIN_SMEM: usize = 115 * 1024;
/// gemv_q_resident (gemv.cu) for `tiles` 16-row tiles of `k` inputs (4-bit, group 64) on `sms`
/// multiprocessors with `smem` bytes of shared memory per block: (blocks, tiles per block,
/// dynamic shared memory bytes). None when the kernel does not take K (a multiple of 2048 up to
/// 4096: its 8 warps take whole quads of groups and its prologue at most two 8-element slots
/// per thread) or a block's whole share does not fit.
fn resident_launch(
    tiles: usize,
    k: usize,
    sms: usize,
    smem: usize,
    rows: usize,
) -> Option<(usize, usize, usize)> {
    if tiles == 0 || sms == 0 || !k.is_multiple_of(2048) || k > 4096 {
        return None;
    }
    let blocks = tiles.min(sms);
    let per_block = tiles.div_ceil(blocks);
    // the tiles, each activation row's x (`rows`: 2 for gemv_q_resident2; the scratch words
    // once), and the mbarriers (one, or one a tile when streamed)
    let bytes = per_block * tile_smem(k) + rows * x_bytes_smem(k) - (rows - 1) * 32 * 4
        + 8 * RESIDENT_MAX_STREAMED;
    // at least half an SM's shared memory, so that blocks launched early (programmatic dependent
    // launch) land one per SM instead of two on the SMs that free up first
    // (never more than a block may take: on a part with less shared memory the padding is moot)
    (bytes <= smem).then_some((blocks, per_block, bytes.max(RESIDENT_MIN_SMEM).min(smem)))
}

/// Warps of a gemv_q_k2048 block (gemv.cu GEMV_K2048_WARPS).
const GEMV_K2048_WARPS: usize = 10;

/// gemv_q_k2048's grid for `rows` rows on `sms` SMs: (blocks, threads). At most one block per SM,
/// a row per warp while the rows last (beyond, the warps loop over the rest).
fn k2048_row_launch(rows: usize, sms: usize) -> (u32, u32) {
    let blocks = rows.div_ceil(GEMV_K2048_WARPS).min(sms).max(1);
    (blocks as u32, (32 * GEMV_K2048_WARPS) as u32)
}

/// gemv_q_pair (gemv.cu) takes K = 4096 only (compiled in there, PAIR_K): each of a tile's two
/// blocks multiplies one half and adds its sums into the output.
const PAIR_K: usize = 4096;
/// Shared memory of a gemv_q_pair block at least this, so that at most two blocks share an SM
/// (measured: 5.09 vs 6.68 us per out_proj unpadded, bench/kernels/gemv_pair.cu).
const PAIR_MIN_SMEM: usize = 80 * 1024;

/// gemv_q_pair's dynamic shared memory at width `k`: the whole tile, its half of x (with the
/// reduction scratch), the 8 warps' 16 sums, the barrier.
fn pair_smem(k: usize) -> usize {
    pair_rows_smem(k, 1)
}

/// The same for `rows` activation rows (2: gemv_q_pair2): each row's half of x and sums, the
/// reduction scratch once.
fn pair_rows_smem(k: usize, rows: usize) -> usize {
    tile_smem(k) + rows * (x_bytes_smem(k / 2) + 8 * 16 * 4) - (rows - 1) * 32 * 4 + 8
}

/// What a gemv_q_pair block asks for at K = 4096: its need padded to PAIR_MIN_SMEM, within the
/// device's opt-in limit.
fn pair_launch_smem(smem_optin: usize) -> usize {
    pair_smem(PAIR_K).max(PAIR_MIN_SMEM).min(smem_optin)
}

/// Tiles per stage of gemv_q_ring (gemv.cu RING_TILES) and its warps (8 multiply, 1 produces).
const RING_TILES: usize = 2;
const RING_THREADS: u32 = 9 * 32;
/// Fewest tiles per SM for which gemv_q_ring streams a launch (below, the tile kernel).
const RING_MIN_TILES_PER_SM: usize = 16;
/// Shared memory gemv_q_ring declares statically (the token choice's flag; rounded up): what a
/// block may take dynamically is the opt-in limit less this.
const RING_STATIC_SMEM: usize = 1024;

/// gemv_q_ring (gemv.cu) for `tiles` 16-row tiles of `k` inputs (4-bit, group 64) on `sms` SMs
/// with `smem` bytes of shared memory a block may take, multiplying `rows` activation rows (2:
/// gemv_q_ring2): (blocks, ring stages, dynamic shared memory bytes). None for K the kernel does
/// not take (a multiple of 2048 up to 4096), a launch of fewer than RING_MIN_TILES_PER_SM tiles
/// per SM, or fewer than two stages that fit.
fn ring_launch(
    tiles: usize,
    k: usize,
    sms: usize,
    smem: usize,
    rows: usize,
) -> Option<(usize, usize, usize)> {
    if sms == 0 || !k.is_multiple_of(2048) || k > 4096 || tiles < RING_MIN_TILES_PER_SM * sms {
        return None;
    }
    // per stage: its tiles and the 8 warps' 16 partial sums per tile and row; then each row's x
    // (the scratch words once)
    let stage = RING_TILES * (tile_smem(k) + rows * 8 * 16 * 4);
    let fixed = rows * x_bytes_smem(k) - (rows - 1) * 32 * 4;
    // and two mbarriers per stage
    let stages = smem.saturating_sub(fixed) / (stage + 16);
    let per_block_stages = tiles.div_ceil(sms).div_ceil(RING_TILES);
    let stages = stages.min(per_block_stages);
    (stages >= 2).then_some((sms, stages, fixed + stages * (stage + 16)))
}

/// Dynamic shared memory of a moe_gate_up block (moe.cu): a 16-row gate and up tile pair's
/// codes, scales and biases, x as two signed bytes per element and (scale, sum) per group, the
/// partial sums of every quad of both tiles, scratch, the selection and the barrier.
fn gate_up_smem(hidden: usize) -> usize {
    let quads = hidden / 256;
    2 * tile_smem(hidden) + x_bytes_smem(hidden) + 2 * quads * 16 * 4 + 2 * 16 * 4 + 8
}

/// moe_gate_up's and moe_experts' grid: a block per 16-row gate/up tile pair (16 intermediate
/// rows) of each routed slot.
fn gate_up_blocks(c: &ModelConfig) -> usize {
    c.num_experts_per_tok * c.moe_intermediate_size / 16
}

/// Whether moe_experts takes this shape (moe.cu): I at most 512 in an even number of groups;
/// each block's H/(I/16) rows of the down matrix as 1, 2 or 4 tiles whose groups split evenly
/// over the warps, at most 4 and an even number per warp; a shared-expert tile for each of the
/// first H/16 blocks.
fn experts_fit(c: &ModelConfig) -> bool {
    let (h, i, k) = (
        c.hidden_size,
        c.moe_intermediate_size,
        c.num_experts_per_tok,
    );
    if i > 512 || !i.is_multiple_of(128) || !h.is_multiple_of(i) {
        return false;
    }
    let (fblocks, gps) = (i / 16, i / 64);
    let tiles = h / fblocks / 16;
    if ![1, 2, 4].contains(&tiles) || h != tiles * 16 * fblocks {
        return false;
    }
    let wpt = (8 / tiles).min(gps / 2);
    let gpw = gps / wpt;
    // the slot's meeting stages each part of h in the gate tile's codes (16·H bytes), as moe.cu
    // lays it out: 8 parts' fragments (TILE_BATCH = 4 groups of 8 16-byte slots) and group
    // scales (float2), then each part's f32 values at TILE_BATCH · 64-value strides
    let staged_h = 8 * 4 * 8 * 16 + 8 * 4 * 8 + (wpt - 1) * 4 * 64 * 4 + gpw * 64 * 4;
    gps.is_multiple_of(wpt)
        && gpw <= 4
        && gpw.is_multiple_of(2)
        && h / 16 <= k * fblocks
        && staged_h <= 16 * h
}

/// Rows moe_routed_experts computes in place of the router launch: the router's logits, the
/// shared expert's gate logit, then its gate and up projections.
fn route_rows(c: &ModelConfig) -> usize {
    c.num_experts + 1 + 2 * c.shared_expert_intermediate_size
}

/// Whether moe_routed_experts takes this shape (moe.cu): block b takes rows b, b + grid, ...
/// (at most ROUTE_MAX_ROWS), every block at least one, so that warp 0, seeing rows
/// 0 .. max(E, grid) - 1 (at most 256, 8 a lane) with this launch's tag, knows that every block
/// has read x and the old tag; a row's scales and biases copied 16 bytes at a time (the hidden
/// size a multiple of 512); the shared expert as wide as a routed one.
fn routed_fit(c: &ModelConfig) -> bool {
    let (rows, blocks) = (route_rows(c), gate_up_blocks(c));
    experts_fit(c)
        && c.hidden_size.is_multiple_of(512)
        && c.shared_expert_intermediate_size == c.moe_intermediate_size
        && c.num_experts.max(blocks) <= 256
        && rows >= blocks
        && rows.div_ceil(blocks) <= ROUTE_MAX_ROWS
}

/// Words of an embedding row per thread of common.cuh embed_row (its EMBED_WORDS): sample.cu embed
/// (decode) and act.cu embed_rows (prefill).
const EMBED_WORDS: usize = 4;

/// Whether embed_row takes the embedding's rows: 256 threads of at most EMBED_WORDS words
/// each, a word's elements inside one group.
fn check_embed(hidden: usize, bits: usize, group: usize) -> Result<()> {
    if hidden * bits > 32 * 256 * EMBED_WORDS || group < 32 / bits {
        bail!("embed_tokens: {bits}-bit rows of {hidden} in groups of {group} are past the CUDA embed kernel");
    }
    Ok(())
}

/// How the decode step runs a MoE block: one launch, moe_routed_experts (the default where the
/// shape fits); `OSPREY_DECODE_MOE=router` the router launch, then moe_experts; `=pair` the
/// router launch, then moe_gate_up and moe_down once all of h is written. The last two stay for
/// ablation and for shapes the one launch does not take.
const MOE_ENV: &str = "OSPREY_DECODE_MOE";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum MoeForm {
    Routed,
    Router,
    Pair,
}

impl MoeForm {
    /// The form `env` (OSPREY_DECODE_MOE) asks for, or the fastest that fits.
    fn choose(env: Option<&str>, experts: bool, routed: bool) -> Result<MoeForm> {
        let best = match (experts, routed) {
            (true, true) => MoeForm::Routed,
            (true, false) => MoeForm::Router,
            _ => MoeForm::Pair,
        };
        Ok(match env {
            None | Some("") | Some("routed") => best,
            Some("router") if experts => MoeForm::Router,
            Some("router") | Some("pair") => MoeForm::Pair,
            Some(other) => bail!("{MOE_ENV}={other}: expected routed, router or pair"),
        })
    }
}

/// Largest GEMV whose weights are prefetched into L2 (60 MB) while its predecessor drains.
const PREFETCH_MAX_BYTES: usize = 32 << 20;
/// A directory of `<family>.cubin` files loaded instead of the embedded kernels where present
/// (instrumented builds: tools/timeline_kernels.py).
pub const KERNELS_DIR_ENV: &str = "OSPREY_KERNELS_DIR";

/// `separate`: the speculative verify step issues every kernel once per row, the two-row kernels
/// (gemv_q_resident2, gemv_q_ring2) unused (what they save, measured against it).
const VERIFY_ROWS_ENV: &str = "OSPREY_VERIFY_ROWS";

/// How the decode step's kernels may overlap: `early` (the default) programmatic dependent launch
/// for the kernels that read something no kernel of the step writes before waiting on their
/// predecessor: gemv_q_resident and gemv_q_ring (their weights), gdn_step (its layer's recurrent
/// and conv state), attn_prep (its norm weights and the rotation of the position), gemv_q (the
/// router launch: each warp's first row), attn_decode (K/V rows of earlier steps) and the
/// experts launch (its route rows and shared down tiles; see `experts_early`); `pdl` for
/// every kernel, `1` that with the GEMVs' L2 prefetches, `prefetch` the prefetches alone (at
/// kernel start, under the prologue), `0` plain graph launches.
/// Measured at 4K context: gemv_q_resident alone early 463 tok/s, none 448, every kernel 442
/// (bench/results/cuda-decode-overlap-resident.json); with gdn_step early too 498 vs 488, the
/// MoE down, gate/up or attention kernels early no gain (cuda-decode-early-launch.json); once
/// attn_prep read something before its wait, it early 600 -> 609; the router, the experts or
/// attn_combine early then 603, 589, 610; the router with its first rows before the wait (and
/// registers for them: 2 blocks per SM) early 611 -> 619 (cuda-decode-early-loads-2.json). With
/// gemv_q_stream, before gemv_q_resident, `pdl` was 1% faster than `0`
/// (cuda-decode-overlap-pdl-072c82a.json).
const OVERLAP_ENV: &str = "OSPREY_CUDA_OVERLAP";

/// See `OVERLAP_ENV`.
#[derive(Clone, Copy, Debug)]
struct StepOverlap {
    /// Launch with programmatic stream serialization (griddepcontrol in the kernels).
    pdl: bool,
    /// The kernels that read something before the wait launch with it (gemv_q_resident,
    /// gemv_q_ring, gdn_step, attn_decode): what they read then overlaps the predecessor. Set
    /// whenever `pdl` is (`early` alone: only these).
    early: bool,
    /// GEMVs of at most PREFETCH_MAX_BYTES ask L2 for their weights first thing.
    prefetch: bool,
}

impl StepOverlap {
    fn from_env() -> Self {
        match std::env::var(OVERLAP_ENV).as_deref() {
            Ok("1") => StepOverlap {
                pdl: true,
                early: true,
                prefetch: true,
            },
            Ok("pdl") => StepOverlap {
                pdl: true,
                early: true,
                prefetch: false,
            },
            Ok("early") => StepOverlap {
                pdl: false,
                early: true,
                prefetch: false,
            },
            Ok("prefetch") => StepOverlap {
                pdl: false,
                early: false,
                prefetch: true,
            },
            Ok("0") => StepOverlap {
                pdl: false,
                early: false,
                prefetch: false,
            },
            _ => StepOverlap {
                pdl: false,
                early: true,
                prefetch: false,
            },
        }
    }
}

/// Blocks of the sampler's prepass, the most candidates each keeps (sample.cu MAX_SAMPLE_K, top-k's
/// k) and the largest vocabulary slice a block holds in shared memory (PREPASS_MAX_SLICE).
const SAMPLE_PARTS: usize = 128;
const SAMPLE_MAX_K: usize = 256;
const SAMPLE_MAX_SLICE: usize = 4096;
/// Kernel families that choose the token and advance the position (never issued twice; the
/// lm_head's family is issued twice without its token choice).
const TOKEN_CHOICE_FAMILIES: [&str; 2] =
    ["sample prepass (when sampling)", "sample (when sampling)"];

/// A quantised matrix on the device, exactly as stored.
struct DevMatrix {
    codes: CudaSlice<u32>,
    scales: CudaSlice<u16>,
    biases: CudaSlice<u16>,
    cols: usize,
    bits: u32,
    group: usize,
}

fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

impl DevMatrix {
    fn words_per_row(&self) -> usize {
        self.cols * self.bits as usize / 32
    }
    fn groups_per_row(&self) -> usize {
        self.cols / self.group
    }
    /// Rows uploaded (every expert's, for a stack).
    fn rows(&self) -> usize {
        self.codes.len() / self.words_per_row()
    }
    /// Pointers to row `row0` onwards.
    fn at(&self, row0: usize, stream: &CudaStream) -> ExpertStack {
        ExpertStack {
            codes: ptr(&self.codes, stream) + (row0 * self.words_per_row() * 4) as u64,
            scales: ptr(&self.scales, stream) + (row0 * self.groups_per_row() * 2) as u64,
            biases: ptr(&self.biases, stream) + (row0 * self.groups_per_row() * 2) as u64,
        }
    }
}

/// A projection: a row window of an uploaded matrix.
#[derive(Clone)]
struct DevLinear {
    m: Arc<DevMatrix>,
    row0: usize,
    rows: usize,
}

impl DevLinear {
    /// The projection as one of moe_routed_experts' route matrices.
    fn route(&self, stream: &CudaStream) -> RouteMatrix {
        let s = self.m.at(self.row0, stream);
        RouteMatrix {
            codes: s.codes,
            scales: s.scales,
            biases: s.biases,
            rows: self.rows as i32,
            bits: self.m.bits as i32,
        }
    }

    fn segment(&self, out: u64, accumulate: bool, stream: &CudaStream) -> Segment {
        let s = self.m.at(self.row0, stream);
        Segment {
            codes: s.codes,
            scales: s.scales,
            biases: s.biases,
            out,
            rows: self.rows as i32,
            bits: self.m.bits as i32,
            accumulate: accumulate as i32,
            pad: 0,
        }
    }
}

enum LayerDev {
    Gdn {
        qkv: DevLinear,
        z: DevLinear,
        b: DevLinear,
        a: DevLinear,
        out: DevLinear,
        conv_w: CudaSlice<f32>,
        conv: [CudaSlice<f32>; 2],
        state: CudaSlice<f32>,
        a_log: CudaSlice<f32>,
        dt_bias: CudaSlice<f32>,
        norm: CudaSlice<f32>,
    },
    Attention {
        q: DevLinear,
        k: DevLinear,
        v: DevLinear,
        o: DevLinear,
        q_norm: CudaSlice<f32>,
        k_norm: CudaSlice<f32>,
        kv: KvCacheDev,
    },
}

/// An attention layer's K/V cache `[max_context, Hkv, D]`: bf16, or int8 codes (biased by 128)
/// with a scale per row.
struct KvCacheDev {
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    /// int8: the row scales `[Hkv, max_context]` of K and V.
    scales: Option<[CudaSlice<f32>; 2]>,
}

impl KvCacheDev {
    fn new(stream: &Arc<CudaStream>, kv: KvCache, rows: usize, d: usize) -> Result<Self> {
        let value_bytes = match kv {
            KvCache::Bf16 => 2,
            KvCache::Int8 => 1,
        };
        let bytes = rows * d * value_bytes;
        Ok(KvCacheDev {
            k: stream.alloc_zeros(bytes)?,
            v: stream.alloc_zeros(bytes)?,
            scales: match kv {
                KvCache::Bf16 => None,
                KvCache::Int8 => Some([stream.alloc_zeros(rows)?, stream.alloc_zeros(rows)?]),
            },
        })
    }

    /// Bytes on the device.
    fn bytes(&self) -> usize {
        self.k.len()
            + self.v.len()
            + self
                .scales
                .as_ref()
                .map_or(0, |s| 4 * (s[0].len() + s[1].len()))
    }
}

struct MoeDev {
    router: DevLinear,
    shared_gate_logit: DevLinear,
    shared_gate: DevLinear,
    shared_up: DevLinear,
    shared_down: DevLinear,
    gate: Arc<DevMatrix>,
    up: Arc<DevMatrix>,
    down: Arc<DevMatrix>,
}

struct LayerWeights {
    input_norm: CudaSlice<f32>,
    post_norm: CudaSlice<f32>,
    mixer: LayerDev,
    moe: MoeDev,
}

/// Scratch activations of one step.
struct Scratch {
    x: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    z: CudaSlice<f32>,
    b: CudaSlice<f32>,
    a: CudaSlice<f32>,
    y: CudaSlice<f32>,
    qg: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    q: CudaSlice<f32>,
    o: CudaSlice<f32>,
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    /// attn_decode's meeting counter (attention.cu grid_meet)
    attn_meet: CudaSlice<u32>,
    router: CudaSlice<f32>,
    shared_gate_logit: CudaSlice<f32>,
    shared_g: CudaSlice<f32>,
    shared_u: CudaSlice<f32>,
    h: CudaSlice<f32>,
    topk: CudaSlice<i32>,
    /// The MoE block's normalised input (the router launch writes it for moe_experts).
    xn: CudaSlice<f32>,
    /// moe_experts' meeting words: per routed slot, the last launch's tag for its values of h.
    /// Zeroed only here (as is h): tags only grow, so a value left by an earlier launch never
    /// carries the current one's.
    meet: CudaSlice<i32>,
    /// moe_routed_experts' route rows, (value, tag) pairs: the router's logits, the shared
    /// expert's gate logit, gate and up projections; and their last launch's tag (only grows).
    routed: CudaSlice<u64>,
    route_meet: CudaSlice<i32>,
    logits: CudaSlice<f32>,
    token: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    step: CudaSlice<i32>,
    history: CudaSlice<i32>,
    sample_params: CudaSlice<SampleParams>,
    /// The lm_head launch's greedy token choice (gemv.cu TokenChoice).
    choice: CudaSlice<TokenChoice>,
    /// Prompt + output and output-only counts per token id (sampling penalties).
    seen: CudaSlice<i32>,
    output: CudaSlice<i32>,
    /// The sampler prepass's candidates, [SAMPLE_PARTS * SAMPLE_MAX_K].
    cand_v: CudaSlice<f32>,
    cand_i: CudaSlice<i32>,
}

impl Scratch {
    /// One row's buffers for a step (the speculative verify step has a second).
    fn new(stream: &Arc<CudaStream>, c: &ModelConfig, max_context: usize) -> Result<Self> {
        let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        Ok(Scratch {
            x: stream.alloc_zeros(c.hidden_size)?,
            qkv: stream.alloc_zeros(c.conv_dim())?,
            z: stream.alloc_zeros(c.linear_value_dim())?,
            b: stream.alloc_zeros(c.linear_num_value_heads)?,
            a: stream.alloc_zeros(c.linear_num_value_heads)?,
            y: stream.alloc_zeros(c.linear_value_dim())?,
            qg: stream.alloc_zeros(2 * hq * d)?,
            k: stream.alloc_zeros(hkv * d)?,
            v: stream.alloc_zeros(hkv * d)?,
            q: stream.alloc_zeros(hq * d)?,
            o: stream.alloc_zeros(hq * d)?,
            part_acc: stream.alloc_zeros(hq * SPLITS * d)?,
            part_ml: stream.alloc_zeros(hq * SPLITS * 2)?,
            router: stream.alloc_zeros(c.num_experts)?,
            shared_gate_logit: stream.alloc_zeros(1)?,
            shared_g: stream.alloc_zeros(c.shared_expert_intermediate_size)?,
            shared_u: stream.alloc_zeros(c.shared_expert_intermediate_size)?,
            // routed slots, then the shared expert (moe_down reads it as one more segment;
            // moe_experts exchanges a slot's values through the routed part)
            // (moe_experts: k·I (value, tag) pairs)
            h: stream.alloc_zeros(
                (c.num_experts_per_tok + 1).max(2 * c.num_experts_per_tok)
                    * c.moe_intermediate_size,
            )?,
            topk: stream.alloc_zeros(32)?,
            xn: stream.alloc_zeros(c.hidden_size)?,
            meet: stream.alloc_zeros(c.num_experts_per_tok)?,
            logits: stream.alloc_zeros(c.vocab_size)?,
            token: stream.alloc_zeros(1)?,
            pos: stream.alloc_zeros(1)?,
            step: stream.alloc_zeros(1)?,
            history: stream.alloc_zeros(max_context)?,
            cand_v: stream.alloc_zeros(SAMPLE_PARTS * SAMPLE_MAX_K)?,
            cand_i: stream.alloc_zeros(SAMPLE_PARTS * SAMPLE_MAX_K)?,
            sample_params: stream.clone_htod(&[SampleParams::default()])?,
            choice: stream.clone_htod(&[TokenChoice::default()])?,
            seen: stream.alloc_zeros(c.vocab_size)?,
            output: stream.alloc_zeros(c.vocab_size)?,
            // allocated last: between part_ml and the MoE buffers it moved those (router logits,
            // h, the slots' meeting words), and the step at 4K lost 0.9% when only the graph from
            // 48K used it; here 4K was unchanged (bench/results/cuda-decode-attn-merge-last-alloc.json)
            attn_meet: stream.alloc_zeros(1)?,
            // last as well, for the same reason
            routed: stream.alloc_zeros(route_rows(c))?,
            route_meet: stream.alloc_zeros(1)?,
        })
    }
}

/// A profiled step's launches: each kernel family's name with the events around its launch.
type LaunchTimes = Vec<(&'static str, CudaEvent, CudaEvent)>;

/// One row of a step as `issue_rows` issues it: its scratch, where its lm_head's greedy choice
/// goes (a TokenChoice's device address), and how its GDN launches treat the recurrent state.
struct Row<'a> {
    s: &'a Scratch,
    choice: u64,
    /// A speculative verify row (gdn.cu GdnArgs role); None: the one-token step.
    gdn: Option<GdnRole<'a>>,
    /// Whether gdn_step and attn_decode may read their layer's state and K/V rows before the
    /// wait: not in the verify step's second row, whose first row wrote them in the same replay
    /// (the wait covers only the kernel before).
    state_early: bool,
}

#[derive(Clone, Copy)]
struct GdnRole<'a> {
    role: i32,
    /// every GDN layer's second state buffer, in layer order
    alt: &'a [CudaSlice<f32>],
    /// device address of the current-buffer flag
    cur: u64,
}

struct Functions {
    gemv: CudaFunction,
    /// gemv_q compiled for K 2048, group 64 (the router launch)
    gemv_k2048: CudaFunction,
    gemv_tiles: CudaFunction,
    gemv_resident: CudaFunction,
    /// gemv_q_resident compiled for K 2048 (the input projections)
    gemv_resident_k2048: CudaFunction,
    /// gemv_q_resident for two activation rows at K 2048 (the verify step's input projections)
    gemv_resident2_k2048: CudaFunction,
    gemv_ring: CudaFunction,
    /// gemv_q_ring compiled for K 2048 (the lm_head)
    gemv_ring_k2048: CudaFunction,
    /// gemv_q_ring for two activation rows at K 2048 (the verify step's lm_head)
    gemv_ring2_k2048: CudaFunction,
    gemv_pair: CudaFunction,
    /// gemv_q_pair for two activation rows (the verify step's output projections)
    gemv_pair2: CudaFunction,
    gate_up: CudaFunction,
    experts: CudaFunction,
    routed_experts: CudaFunction,
    down: CudaFunction,
    gdn: CudaFunction,
    prep: CudaFunction,
    /// split-KV decode attention, its blocks then meeting to merge the splits
    attn: CudaFunction,
    embed: CudaFunction,
    sample: CudaFunction,
    sample_prepass: CudaFunction,
    /// ceiling.cu: the streaming-read probe benchmarks judge a step against
    read_stream: CudaFunction,
    /// speculative.cu: the verify step's acceptance and next draft
    spec_accept: CudaFunction,
}

/// Time spent in one kernel family during a profiled step.
#[derive(Clone, Debug)]
pub struct KernelTime {
    pub kernel: &'static str,
    pub launches: usize,
    pub micros: f64,
}

/// A copy of a session's state after its first `len` tokens: every Gated DeltaNet layer's conv
/// buffers (both parities: the step reads one and writes the other by position) and fp32
/// recurrent state, and the attention layers' K/V rows from `stashed_from` to `len` once a later
/// call was about to write over them (`stash_rows`; the rows below stay in the cache).
pub struct SessionCopy {
    gdn: Vec<CudaSlice<f32>>,
    len: usize,
    stashed_from: usize,
    /// Per attention layer, its rows `stashed_from..len` (empty until something is stashed).
    rows: Vec<StashedRows>,
}

/// An attention layer's K/V rows `[rows, Hkv, D]` and, for the int8 cache, their scales
/// `[Hkv, rows]`.
struct StashedRows {
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    scales: Option<[CudaSlice<f32>; 2]>,
}

/// How a cache buffer holds one position's values: in `runs` runs, `stride` apart, of `per`
/// values a position (K or V: one run, a row of Hkv·D values; the int8 scales: a run per KV
/// head, one value). A stash keeps each run's rows contiguous.
#[derive(Clone, Copy)]
struct RowRuns {
    runs: usize,
    stride: usize,
    per: usize,
}

impl RowRuns {
    /// `runs` runs of `max_context` positions each in `buffer`.
    fn of<T>(buffer: &CudaSlice<T>, runs: usize, max_context: usize) -> Self {
        RowRuns {
            runs,
            stride: buffer.len() / runs,
            per: buffer.len() / runs / max_context,
        }
    }

    /// A stash of rows `from..len`: rows `from..to` from `cache`, then `old` (rows `to..len`).
    fn stash<T: DeviceRepr + ValidAsZeroBits>(
        self,
        stream: &Arc<CudaStream>,
        cache: &CudaSlice<T>,
        old: Option<&CudaSlice<T>>,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        let (n, added, was, per) = (len - from, to - from, len - to, self.per);
        let mut out = stream.alloc_zeros::<T>(self.runs * n * per)?;
        for run in 0..self.runs {
            let (at, o) = (run * self.stride, run * n * per);
            stream.memcpy_dtod(
                &cache.slice(at + from * per..at + to * per),
                &mut out.slice_mut(o..o + added * per),
            )?;
            if let Some(old) = old {
                stream.memcpy_dtod(
                    &old.slice(run * was * per..(run + 1) * was * per),
                    &mut out.slice_mut(o + added * per..o + n * per),
                )?;
            }
        }
        Ok(out)
    }

    /// Writes rows `rows_from..len` of a stash of rows `stashed..len` back into `cache`.
    fn unstash<T>(
        self,
        stream: &Arc<CudaStream>,
        stash: &CudaSlice<T>,
        cache: &mut CudaSlice<T>,
        stashed: usize,
        rows_from: usize,
        len: usize,
    ) -> Result<()> {
        let (skip, was, per) = (rows_from - stashed, len - stashed, self.per);
        for run in 0..self.runs {
            let (at, o) = (run * self.stride, run * was * per);
            stream.memcpy_dtod(
                &stash.slice(o + skip * per..o + was * per),
                &mut cache.slice_mut(at + rows_from * per..at + len * per),
            )?;
        }
        Ok(())
    }
}

pub struct CudaDecoder {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    f: Functions,
    cfg: ModelConfig,
    embed: Arc<DevMatrix>,
    lm_head: DevLinear,
    final_norm: CudaSlice<f32>,
    layers: Vec<LayerWeights>,
    s: Scratch,
    /// The captured step (on first use): its position is read on the device, so one graph
    /// decodes at every position.
    graph: Option<CudaGraph>,
    pub max_context: usize,
    /// How the attention layers keep K/V.
    kv: KvCache,
    /// int8 cache: the rows a prefill chunk attends to, expanded to bf16 `[max_context, Hkv, D]`
    /// (K, V) for the prefill attention, which reads bf16 tiles.
    kv_expanded: Option<[CudaSlice<u8>; 2]>,
    /// Vocabulary ids the argmax may choose (tokenizer size; higher rows are padding).
    valid_vocab: usize,
    memory: Vec<(&'static str, usize)>,
    /// Multiprocessors of the device (sizes persistent-style grids).
    sms: usize,
    /// attn_decode's grid: blocks that are all resident at once (they meet before the merge).
    attn_blocks: usize,
    /// Shared memory a block may take (opt-in), all of it dynamic for gemv_q_resident.
    smem_optin: usize,
    /// Page-locked host copy of the logits (pageable downloads were slow on the H200 host).
    logits_host: cudarc::driver::PinnedHostSlice<f32>,
    /// Page-locked slots the chosen tokens are copied into, alternately, while the next step runs.
    token_slots: [cudarc::driver::PinnedHostSlice<i32>; 2],
    pk: prefill::PrefillKernels,
    /// Prefill activations, allocated for the chunk size of the first prefill.
    prefill: Option<prefill::PrefillScratch>,
    /// A scored prefill's logits rows on the device (`prefill::SCORED_ROWS` of them; allocated
    /// on first use).
    scored: Option<CudaSlice<f32>>,
    /// Their page-locked host copy, allocated only when rows come back (summaries stay on the
    /// device).
    scored_host: Option<cudarc::driver::PinnedHostSlice<f32>>,
    /// Decode steps' logit summaries (`run_steps` with log-probabilities): two slots on the
    /// device and their page-locked host copies, allocated on first use.
    step_summaries: Option<(CudaSlice<f32>, [cudarc::driver::PinnedHostSlice<f32>; 2])>,
    /// logit_partials' slices of the rows being summarised (`prefill::summarise_logits`).
    summary_partials: CudaSlice<f32>,
    gdn_prefill: GdnPrefill,
    /// Where the prefill runs its warpgroup-MMA GEMM (OSPREY_PREFILL_WGMMA).
    wgmma: prefill::Wgmma,
    /// Programmatic dependent launch and prefetches in the decode step (see `launch_step`).
    overlap: StepOverlap,
    /// The loaded kernel families, for the timeline probe's symbols (`record_timeline`).
    modules: HashMap<&'static str, Arc<CudaModule>>,
    /// How the MoE blocks run where the shape and the environment allow (moe_form_here: at a
    /// position).
    moe_form: MoeForm,
    /// The speculative verify step's buffers and graph (`run_speculative`; on first use).
    spec: Option<speculative::SpecDev>,
    /// Whether the verify step's rows share the launches of the kernels that take two rows
    /// (`VERIFY_ROWS_ENV`).
    fuse_rows: bool,
}

fn upload_f32(stream: &Arc<CudaStream>, v: &[f32]) -> Result<CudaSlice<f32>> {
    Ok(stream.clone_htod(v)?)
}

fn bf16_bits(f: &FloatBuf, what: &str) -> Result<Vec<u16>> {
    match f {
        FloatBuf::Bf16(b) => Ok(b.as_slice().to_vec()),
        _ => bail!(
            "{what}: the CUDA backend needs bf16 scales and biases (found {})",
            f.dtype_name()
        ),
    }
}

struct Uploader<'a> {
    stream: &'a Arc<CudaStream>,
    done: HashMap<*const Matrix, Arc<DevMatrix>>,
    bytes: usize,
}

impl Uploader<'_> {
    fn matrix(&mut self, m: &Arc<Matrix>, what: &str) -> Result<Arc<DevMatrix>> {
        if let Some(d) = self.done.get(&Arc::as_ptr(m)) {
            return Ok(d.clone());
        }
        let MatrixData::Quantized {
            bits,
            group,
            codes,
            scales,
            biases,
        } = &m.data
        else {
            bail!("{what}: the CUDA backend runs MLX-quantised checkpoints; this tensor is dense (convert the checkpoint once with `osprey quantize --model DIR --out DIR-4bit`)");
        };
        if !m.cols.is_multiple_of(64) || m.cols > 4096 || (*bits == 8 && m.cols > 2048) {
            bail!("{what}: input width {} at {bits} bits is not supported by the GEMV kernels (a multiple of 64, at most 4096 at 4 bits, 2048 at 8)", m.cols);
        }
        let d = Arc::new(DevMatrix {
            codes: self.stream.clone_htod(codes.as_slice())?,
            scales: self.stream.clone_htod(&bf16_bits(scales, what)?)?,
            biases: self.stream.clone_htod(&bf16_bits(biases, what)?)?,
            cols: m.cols,
            bits: *bits,
            group: *group,
        });
        self.bytes += m.storage_bytes();
        self.done.insert(Arc::as_ptr(m), d.clone());
        Ok(d)
    }
    fn linear(&mut self, l: &Linear, what: &str) -> Result<DevLinear> {
        Ok(DevLinear {
            m: self.matrix(&l.matrix, what)?,
            row0: l.row0,
            rows: l.rows,
        })
    }
}

/// What the GEMV does to its input before the product.
#[derive(Clone, Copy)]
enum Prologue {
    None,
    /// RMSNorm over the whole input with this weight.
    RmsNorm(u64),
    /// The same, block 0 also writing the normalised input to `out` (gemv_q, gemv_q_tiles: the
    /// MoE router launch, whose input moe_experts reads while it adds into x).
    RmsNormPublished {
        weight: u64,
        out: u64,
    },
    /// The GDN output norm: per-head RMSNorm with `weight`, times silu(z).
    GatedHeadNorm {
        weight: u64,
        z: u64,
        head_dim: usize,
    },
}

fn launch_cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaDecoder {
    /// Uploads `w` to GPU 0 and allocates the state for `max_context` positions.
    pub fn new(
        w: &ModelWeights,
        max_context: usize,
        valid_vocab: usize,
        kv: KvCache,
    ) -> Result<Self> {
        if !crate::kernels_built() {
            bail!("this build carries no CUDA kernels (nvcc was not found when it was built; set NVCC or CUDA_HOME and rebuild)");
        }
        let c = w.config.clone();
        check_shapes(&c)?;
        // SAFETY: only probes whether the driver library can be opened (cudarc panics otherwise).
        if !unsafe { sys::is_culib_present() } {
            bail!("the NVIDIA driver library (libcuda.so) was not found: no usable GPU on this machine");
        }
        let ctx = CudaContext::new(0).map_err(|e| anyhow!("no usable CUDA device: {e}"))?;
        // one stream, captured into a graph: cudarc's per-slice event tracking is not needed
        unsafe { ctx.disable_event_tracking() };
        // a created stream: the legacy default stream cannot be captured into a graph
        let stream = ctx.new_stream()?;
        let kernels_dir = std::env::var_os(KERNELS_DIR_ENV).map(std::path::PathBuf::from);
        if let Some(d) = kernels_dir.as_ref().filter(|d| !d.is_dir()) {
            bail!(
                "{KERNELS_DIR_ENV}={} is not a directory of <family>.cubin files",
                d.display()
            );
        }
        let mut modules = HashMap::new();
        for (name, cubin) in crate::CUBINS {
            let file = kernels_dir
                .as_ref()
                .map(|d| d.join(format!("{name}.cubin")));
            let bytes = match file.filter(|f| f.exists()) {
                Some(f) => {
                    tracing::warn!("kernels {name} from {} ({KERNELS_DIR_ENV})", f.display());
                    std::fs::read(&f).with_context(|| format!("reading {}", f.display()))?
                }
                None => cubin.to_vec(),
            };
            modules.insert(
                *name,
                ctx.load_module(Ptx::from_binary(bytes))
                    .with_context(|| format!("loading kernels {name}"))?,
            );
        }
        let func = |m: &str, f: &str| -> Result<CudaFunction> { Ok(modules[m].load_function(f)?) };
        // the model's shape compiled in where it matches (moe.cu moe_experts_h2048)
        let model_shape = c.hidden_size == 2048
            && c.moe_intermediate_size == 512
            && c.num_experts_per_tok == 8
            && c.num_experts == 256;
        let f = Functions {
            gemv: func("gemv", "gemv_q")?,
            gemv_k2048: func("gemv", "gemv_q_k2048")?,
            gemv_tiles: func("gemv", "gemv_q_tiles")?,
            gemv_resident: func("gemv", "gemv_q_resident")?,
            gemv_resident_k2048: func("gemv", "gemv_q_resident_k2048")?,
            gemv_resident2_k2048: func("gemv", "gemv_q_resident2_k2048")?,
            gemv_ring: func("gemv", "gemv_q_ring")?,
            gemv_ring_k2048: func("gemv", "gemv_q_ring_k2048")?,
            gemv_ring2_k2048: func("gemv", "gemv_q_ring2_k2048")?,
            gemv_pair: func("gemv", "gemv_q_pair")?,
            gemv_pair2: func("gemv", "gemv_q_pair2")?,
            gate_up: func("moe", "moe_gate_up")?,
            experts: func(
                "moe",
                if model_shape {
                    "moe_experts_h2048"
                } else {
                    "moe_experts"
                },
            )?,
            routed_experts: func(
                "moe",
                if model_shape {
                    "moe_routed_experts_h2048"
                } else {
                    "moe_routed_experts"
                },
            )?,
            down: func("moe", "moe_down")?,
            gdn: func("gdn", "gdn_step")?,
            prep: func("attention", "attn_prep")?,
            attn: func(
                "attention",
                match kv {
                    KvCache::Bf16 => "attn_decode",
                    KvCache::Int8 => "attn_decode_int8",
                },
            )?,
            embed: func("sample", "embed")?,
            sample: func("sample", "sample_token")?,
            sample_prepass: func("sample", "sample_prepass")?,
            read_stream: func("ceiling", "read_stream")?,
            spec_accept: func("speculative", "spec_accept")?,
        };
        let pk = prefill::PrefillKernels::load(&func)?;

        let mut up = Uploader {
            stream: &stream,
            done: HashMap::new(),
            bytes: 0,
        };
        let embed = up.matrix(&w.embed_tokens.matrix, "embed_tokens")?;
        check_embed(c.hidden_size, embed.bits as usize, embed.group)?;
        let lm_head = up.linear(&w.lm_head, "lm_head")?;
        let mut state_bytes = 0usize;
        let mut kv_bytes = 0usize;
        let mut layers = Vec::with_capacity(w.layers.len());
        for (i, l) in w.layers.iter().enumerate() {
            let mixer = match &l.mixer {
                Mixer::GatedDeltaNet(g) => {
                    let GdnProjections::Split { qkv, z, b, a } = &g.projections else {
                        bail!("layer {i}: the CUDA backend does not yet run Qwen3-Next's fused GDN projections");
                    };
                    let conv_len = (c.conv_kernel - 1) * c.conv_dim();
                    let state_len =
                        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
                    state_bytes += 4 * (2 * conv_len + state_len);
                    LayerDev::Gdn {
                        qkv: up.linear(qkv, "in_proj_qkv")?,
                        z: up.linear(z, "in_proj_z")?,
                        b: up.linear(b, "in_proj_b")?,
                        a: up.linear(a, "in_proj_a")?,
                        out: up.linear(&g.out_proj, "out_proj")?,
                        conv_w: upload_f32(&stream, &g.conv)?,
                        conv: [stream.alloc_zeros(conv_len)?, stream.alloc_zeros(conv_len)?],
                        state: stream.alloc_zeros(state_len)?,
                        a_log: upload_f32(&stream, &g.a_log)?,
                        dt_bias: upload_f32(&stream, &g.dt_bias)?,
                        norm: upload_f32(&stream, &g.norm)?,
                    }
                }
                Mixer::Attention(a) => {
                    let rows = max_context * c.num_key_value_heads;
                    let cache = KvCacheDev::new(&stream, kv, rows, c.head_dim).with_context(|| {
                        format!(
                            "allocating layer {i}'s KV cache for {max_context} positions: lower --max-context{}",
                            match kv {
                                KvCache::Bf16 => " or halve it with --kv-cache int8",
                                KvCache::Int8 => "",
                            }
                        )
                    })?;
                    kv_bytes += cache.bytes();
                    LayerDev::Attention {
                        q: up.linear(&a.q_proj, "q_proj")?,
                        k: up.linear(&a.k_proj, "k_proj")?,
                        v: up.linear(&a.v_proj, "v_proj")?,
                        o: up.linear(&a.o_proj, "o_proj")?,
                        q_norm: upload_f32(&stream, &a.q_norm)?,
                        k_norm: upload_f32(&stream, &a.k_norm)?,
                        kv: cache,
                    }
                }
            };
            let m = &l.moe;
            let experts = &m.experts;
            let check_expert = |lin: &Linear, what: &str| -> Result<()> {
                match &lin.matrix.data {
                    MatrixData::Quantized {
                        bits: 4, group: 64, ..
                    } => Ok(()),
                    _ => bail!(
                        "layer {i}: {what} must be 4-bit with group 64 for the CUDA MoE kernels"
                    ),
                }
            };
            check_expert(&experts[0].gate, "routed experts")?;
            check_expert(&m.shared.down, "shared expert down_proj")?;
            let same_stack = experts.iter().enumerate().all(|(e, x)| {
                Arc::ptr_eq(&x.gate.matrix, &experts[0].gate.matrix)
                    && x.gate.row0 == e * c.moe_intermediate_size
                    && Arc::ptr_eq(&x.up.matrix, &experts[0].up.matrix)
                    && x.up.row0 == e * c.moe_intermediate_size
                    && Arc::ptr_eq(&x.down.matrix, &experts[0].down.matrix)
                    && x.down.row0 == e * c.hidden_size
            });
            if !same_stack {
                bail!("layer {i}: the CUDA backend needs stacked MLX expert tensors (switch_mlp)");
            }
            let moe = MoeDev {
                router: up.linear(&m.router, "router")?,
                shared_gate_logit: up.linear(&m.shared_gate, "shared_expert_gate")?,
                shared_gate: up.linear(&m.shared.gate, "shared_expert.gate_proj")?,
                shared_up: up.linear(&m.shared.up, "shared_expert.up_proj")?,
                shared_down: up.linear(&m.shared.down, "shared_expert.down_proj")?,
                gate: up.matrix(&experts[0].gate.matrix, "expert gate_proj")?,
                up: up.matrix(&experts[0].up.matrix, "expert up_proj")?,
                down: up.matrix(&experts[0].down.matrix, "expert down_proj")?,
            };
            layers.push(LayerWeights {
                input_norm: upload_f32(&stream, &l.input_norm)?,
                post_norm: upload_f32(&stream, &l.post_attention_norm)?,
                mixer,
                moe,
            });
        }
        let weight_bytes = up.bytes;
        let final_norm = upload_f32(&stream, &w.final_norm)?;

        let (hq, d) = (c.num_attention_heads, c.head_dim);
        let mut s = Scratch::new(&stream, &c, max_context)?;
        let valid_vocab = valid_vocab.min(w.config.vocab_size);
        let choice = TokenChoice {
            n: valid_vocab as i32,
            sampling: ptr(&s.sample_params, &stream)
                + std::mem::offset_of!(SampleParams, active) as u64,
            token: ptr(&s.token, &stream),
            pos: ptr(&s.pos, &stream),
            history: ptr(&s.history, &stream),
            step: ptr(&s.step, &stream),
            record: 1,
            ..Default::default()
        };
        stream.memcpy_htod(&[choice], &mut s.choice)?;
        let scratch_bytes = 4
            * (c.hidden_size * 3
                + c.conv_dim()
                + 2 * c.linear_value_dim()
                + 4 * hq * d
                + hq * SPLITS * (d + 2)
                + 3 * c.vocab_size
                + max_context);
        stream.synchronize()?;
        // SAFETY: filled by a device copy before it is read
        let logits_host = unsafe { ctx.alloc_pinned_with_flags::<f32>(c.vocab_size, 0)? };
        let summary_partials = stream.alloc_zeros(prefill::summary_partials_len())?;
        // SAFETY: as above
        let token_slots = unsafe {
            [
                ctx.alloc_pinned_with_flags::<i32>(1, 0)?,
                ctx.alloc_pinned_with_flags::<i32>(1, 0)?,
            ]
        };
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as usize;
        // what a block may take dynamically beside the resident GEMV's static shared memory
        // (none, but the timeline probe's kernels keep a word there)
        let smem_optin = ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as usize
            - f.gemv_resident.shared_size_bytes()? as usize;
        for resident in [
            &f.gemv_resident,
            &f.gemv_resident_k2048,
            &f.gemv_resident2_k2048,
        ] {
            resident.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_optin as i32,
            )?;
        }
        for ring in [&f.gemv_ring, &f.gemv_ring_k2048, &f.gemv_ring2_k2048] {
            ring.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (smem_optin - RING_STATIC_SMEM) as i32,
            )?;
        }
        f.gate_up.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            gate_up_smem(c.hidden_size) as i32,
        )?;
        // (with their static shared memory past the 48 KB a launch may take without asking)
        for experts in [&f.experts, &f.routed_experts] {
            experts.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                gate_up_smem(c.hidden_size) as i32,
            )?;
        }
        for pair in [&f.gemv_pair, &f.gemv_pair2] {
            pair.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                pair_launch_smem(smem_optin) as i32,
            )?;
        }
        // the step's kernels prefer all of the unified memory as shared memory: a resident block
        // takes over half of it, and an SM takes its configuration from the blocks it runs, so the
        // next launch's blocks, landing early beside a predecessor's, fit only in what that left
        // configured. The resident GEMVs alone before: A/B on one H200, three rounds, 1K 912.0 ->
        // 915.2 tok/s, 4K 901.8 -> 903.4, 32K 786.5 -> 787.4, 128K 554.4 -> 555.2
        // (bench/results/cuda-decode-session41-ablations.json, "carve")
        for func in [
            &f.gemv_resident,
            &f.gemv_resident_k2048,
            &f.gemv_resident2_k2048,
            &f.experts,
            &f.routed_experts,
            &f.gemv_pair,
            &f.gemv_pair2,
            &f.gdn,
            &f.prep,
            &f.attn,
            &f.embed,
            &f.sample,
            &f.sample_prepass,
            &f.gemv_ring,
            &f.gemv_ring_k2048,
            &f.gemv_ring2_k2048,
        ] {
            func.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )?;
        }
        let kv_expanded = match kv {
            KvCache::Bf16 => None,
            KvCache::Int8 => {
                let bytes = 2 * max_context * c.num_key_value_heads * c.head_dim;
                Some([stream.alloc_zeros(bytes)?, stream.alloc_zeros(bytes)?])
            }
        };
        let mut memory = vec![
            ("weights", weight_bytes),
            (
                match kv {
                    KvCache::Bf16 => "kv cache (bf16)",
                    KvCache::Int8 => "kv cache (int8)",
                },
                kv_bytes,
            ),
            ("recurrent + conv state", state_bytes),
            ("scratch", scratch_bytes),
        ];
        if let Some(e) = &kv_expanded {
            memory.push((
                "int8 kv cache expanded for prefill",
                e[0].len() + e[1].len(),
            ));
        }
        // a routed slot's blocks wait for each other, so all of them must be resident at once
        let resident = |experts: &CudaFunction| -> Result<usize> {
            Ok(experts.occupancy_max_active_blocks_per_multiprocessor(
                256,
                gate_up_smem(c.hidden_size),
                None,
            )? as usize
                * sms)
        };
        let resident_experts = resident(&f.experts)?;
        // attn_decode's blocks meet before merging the splits: all of them must be resident, so
        // its occupancy sizes the grid
        let attn_per_sm =
            f.attn
                .occupancy_max_active_blocks_per_multiprocessor(ATTN_THREADS, 0, None)?
                as usize;
        if attn_per_sm == 0 {
            bail!("attn_decode does not fit on an SM of this GPU");
        }
        let attn_blocks = attn_per_sm.min(ATTN_BLOCKS_PER_SM) * sms;
        let resident_routed = resident(&f.routed_experts)?;
        let route_formats = layers.iter().all(|l| {
            let m = &l.moe;
            [
                &m.router,
                &m.shared_gate_logit,
                &m.shared_gate,
                &m.shared_up,
            ]
            .iter()
            .all(|d| d.m.group == 64 && matches!(d.m.bits, 4 | 8))
        });
        let experts = experts_fit(&c) && resident_experts >= gate_up_blocks(&c);
        let moe_form = MoeForm::choose(
            std::env::var(MOE_ENV).ok().as_deref(),
            experts,
            experts && routed_fit(&c) && route_formats && resident_routed >= gate_up_blocks(&c),
        )?;
        Ok(CudaDecoder {
            ctx,
            stream,
            f,
            cfg: c,
            embed,
            lm_head,
            final_norm,
            layers,
            s,
            graph: None,
            max_context,
            kv,
            kv_expanded,
            valid_vocab,
            memory,
            sms,
            attn_blocks,
            smem_optin,
            logits_host,
            token_slots,
            pk,
            prefill: None,
            scored: None,
            scored_host: None,
            step_summaries: None,
            summary_partials,
            gdn_prefill: GdnPrefill::Auto,
            wgmma: prefill::Wgmma::from_env(),
            overlap: StepOverlap::from_env(),
            modules,
            moe_form,
            spec: None,
            fuse_rows: std::env::var(VERIFY_ROWS_ENV).as_deref() != Ok("separate"),
        })
    }

    /// GPU memory taken at load, by part.
    pub fn memory_report(&self) -> &[(&'static str, usize)] {
        &self.memory
    }

    pub fn device_name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "CUDA device".into())
    }

    fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        ptr(s, &self.stream)
    }

    /// How the attention layers keep K/V.
    pub fn kv_cache(&self) -> KvCache {
        self.kv
    }

    /// The device address of an int8 cache's K (0) or V (1) row scales; 0 for a bf16 cache.
    fn kv_scale(&self, kv: &KvCacheDev, which: usize) -> u64 {
        kv.scales.as_ref().map_or(0, |s| self.p(&s[which]))
    }

    /// The token choice's parameters: the step's logits, slots and sampling state.
    fn sample_args(&self) -> SampleArgs {
        let s = &self.s;
        SampleArgs {
            params: self.p(&s.sample_params),
            logits: self.p(&s.logits),
            seen: self.p(&s.seen),
            output: self.p(&s.output),
            token: self.p(&s.token),
            pos: self.p(&s.pos),
            history: self.p(&s.history),
            step: self.p(&s.step),
            n: self.valid_vocab as i32,
            cand_v: self.p(&s.cand_v),
            cand_i: self.p(&s.cand_i),
            parts: SAMPLE_PARTS as i32,
            pad: 0,
        }
    }

    /// The token choice when sampling: the prepass over SAMPLE_PARTS blocks, then the selection
    /// in one block.
    fn launch_sample(&self, sa: &SampleArgs) -> Result<()> {
        self.launch_sample_prepass(sa)?;
        self.launch_sample_token(sa)
    }

    fn launch_sample_token(&self, sa: &SampleArgs) -> Result<()> {
        self.launch_step(&self.f.sample, launch_cfg((1, 1), 1024), sa)
    }

    fn launch_sample_prepass(&self, sa: &SampleArgs) -> Result<()> {
        self.launch_step(
            &self.f.sample_prepass,
            launch_cfg((SAMPLE_PARTS as u32, 1), 256),
            sa,
        )
    }

    fn gemv(
        &self,
        segs: &[Segment],
        x: u64,
        prologue: Prologue,
        k: usize,
        group: usize,
    ) -> Result<()> {
        self.gemv_choosing(segs, x, prologue, k, group, 0)
    }

    /// `gemv`, and with `choice` (a TokenChoice's device address; 0: none) the greedy token
    /// choice over its single segment's rows (gemv_q_ring, gemv_q_tiles or gemv_q: gemv.cu
    /// choose_token).
    fn gemv_choosing(
        &self,
        segs: &[Segment],
        x: u64,
        prologue: Prologue,
        k: usize,
        group: usize,
        choice: u64,
    ) -> Result<()> {
        let mut a = GemvArgs {
            x,
            choice,
            eps: self.cfg.rms_norm_eps,
            nseg: segs.len() as i32,
            k: k as i32,
            group: group as i32,
            ..Default::default()
        };
        match prologue {
            Prologue::None => {}
            Prologue::RmsNorm(w) => a.norm_weight = w,
            Prologue::RmsNormPublished { weight, out } => {
                a.norm_weight = weight;
                a.normed = out;
            }
            Prologue::GatedHeadNorm {
                weight,
                z,
                head_dim,
            } => {
                a.head_norm = weight;
                a.gate_z = z;
                a.head_dim = head_dim as i32;
            }
        }
        a.seg[..segs.len()].copy_from_slice(segs);
        // weights that fit well inside the 60 MB L2 are prefetched while the predecessor drains;
        // the lm_head (286 MB) would only evict its own lines
        let weight_bytes: usize = segs
            .iter()
            .map(|s| s.rows as usize * (k * s.bits as usize / 8 + k / group * 4))
            .sum();
        a.prefetch = i32::from(self.overlap.prefetch && weight_bytes <= PREFETCH_MAX_BYTES);
        // work units: 16-row tensor-core tiles (4-bit, group 64) when the launch has enough of
        // them to fill the GPU (measured: small launches are faster one row per warp), else rows;
        // a block takes two tiles or eight rows at a time, the grid is what stays resident
        let tileable = |s: &Segment| s.bits == 4 && group == 64;
        let tiles: usize = segs
            .iter()
            .filter(|s| tileable(s))
            .map(|s| (s.rows as usize).div_ceil(16))
            .sum();
        // launches of only such rows whose share per block fits in shared memory: the whole
        // share requested before the wait, so it streams while the predecessor runs (gemv.cu)
        let head_ok = match prologue {
            Prologue::GatedHeadNorm { head_dim, .. } => {
                head_dim.is_multiple_of(8) && (head_dim / 8).is_power_of_two() && head_dim <= 256
            }
            _ => true,
        };
        // a lone K = 4096 projection without a full-width norm, added into its output: each tile
        // over two blocks, whose halves meet by atomic adds
        let no_full_norm = !matches!(
            prologue,
            Prologue::RmsNorm(_) | Prologue::RmsNormPublished { .. }
        );
        let lone = segs.len() == 1 && tileable(&segs[0]);
        let added = segs.first().is_some_and(|s| s.accumulate != 0);
        if lone && added && k == PAIR_K && no_full_norm && head_ok && choice == 0 {
            let smem = pair_launch_smem(self.smem_optin);
            return self.launch_staged(&self.f.gemv_pair, a, (2 * tiles, 1, smem), 256);
        }
        // (only gemv_q and gemv_q_tiles publish their normalised input)
        let staged_ok = head_ok && a.normed == 0;
        if segs.iter().all(tileable) && staged_ok && choice == 0 {
            if let Some(launch) = resident_launch(tiles, k, self.sms, self.smem_optin, 1) {
                let threads = if self.experts_early() {
                    RESIDENT_THREADS_AFTER_EARLY_EXPERTS
                } else {
                    RESIDENT_THREADS
                };
                let resident = if k == 2048 {
                    &self.f.gemv_resident_k2048
                } else {
                    &self.f.gemv_resident
                };
                return self.launch_staged(resident, a, launch, threads);
            }
        }
        if segs.len() == 1 && segs.iter().all(tileable) && staged_ok {
            let smem = self.smem_optin - RING_STATIC_SMEM;
            if let Some(launch) = ring_launch(tiles, k, self.sms, smem, 1) {
                let ring = if k == 2048 {
                    &self.f.gemv_ring_k2048
                } else {
                    &self.f.gemv_ring
                };
                return self.launch_staged(ring, a, launch, RING_THREADS);
            }
        }
        let fills_gpu = tiles >= 2 * self.sms;
        // (each of a tile's 4 warps takes an even number of groups: the kernel reads scales and
        // biases in pairs, so K must be a multiple of 4 · 2 · 64)
        a.tiles = i32::from(fills_gpu && k.is_multiple_of(512));
        let units: usize = segs
            .iter()
            .map(|s| {
                if a.tiles == 1 && tileable(s) {
                    (s.rows as usize).div_ceil(16)
                } else {
                    s.rows as usize
                }
            })
            .sum();
        // (gemv_q_tiles resident at 3 blocks per SM, gemv_q at 2)
        let (per_block, resident) = if a.tiles == 1 { (2, 3) } else { (8, 2) };
        let blocks = units.div_ceil(per_block).min(self.sms * resident) as u32;
        if a.tiles == 1 {
            return self.launch_step(&self.f.gemv_tiles, launch_cfg((blocks, 1), 256), &a);
        }
        // gemv_q requests each warp's first row before its wait: launched early, it streams
        // under the predecessor
        let (gemv, blocks, threads) = if k == 2048 && group == 64 {
            let (blocks, threads) = k2048_row_launch(units, self.sms);
            (&self.f.gemv_k2048, blocks, threads)
        } else {
            (&self.f.gemv, blocks, 256)
        };
        self.launch_params(
            gemv,
            launch_cfg((blocks, 1), threads),
            &mut [&a as *const GemvArgs as *mut c_void],
            self.overlap.early,
        )
    }

    /// An input projection (RMS-normalised with `norm`, K 2048, resident 4-bit group-64
    /// segments) of two rows in one launch (gemv_q_resident2): `segs[r]` are row r's segments
    /// (the same weights, its own outputs), `xs[r]` its input. False where that kernel does not
    /// take the launch (the rows then take a launch each).
    fn gemv_two_rows(
        &self,
        segs: [&[Segment]; 2],
        xs: [u64; 2],
        norm: u64,
        group: usize,
    ) -> Result<bool> {
        let k = self.cfg.hidden_size;
        let [s0, s1] = segs;
        if !self.fuse_rows {
            return Ok(false);
        }
        let tileable = |s: &Segment| s.bits == 4;
        if k != 2048 || group != 64 || s0.len() != s1.len() || !s0.iter().all(tileable) {
            return Ok(false);
        }
        let tiles: usize = s0.iter().map(|s| (s.rows as usize).div_ceil(16)).sum();
        let Some(launch) = resident_launch(tiles, k, self.sms, self.smem_optin, 2) else {
            return Ok(false);
        };
        let mut a = GemvArgs {
            x: xs[0],
            x1: xs[1],
            norm_weight: norm,
            eps: self.cfg.rms_norm_eps,
            nseg: s0.len() as i32,
            k: k as i32,
            group: 64,
            ..Default::default()
        };
        a.seg[..s0.len()].copy_from_slice(s0);
        for (o, s) in a.out1.iter_mut().zip(s1) {
            *o = s.out;
        }
        let threads = if self.experts_early() {
            RESIDENT_THREADS_AFTER_EARLY_EXPERTS
        } else {
            RESIDENT_THREADS
        };
        self.launch_staged(&self.f.gemv_resident2_k2048, a, launch, threads)?;
        Ok(true)
    }

    /// An output projection (one 4-bit group-64 segment at K 4096 added into the residual) of
    /// two rows in one launch (gemv_q_pair2): `segs[r]` row r's segment (its residual as the
    /// output), `xs[r]` its input, `gated` the GDN output norm's (weight, each row's z, head
    /// size). False where that kernel does not take it (the rows then take a launch each).
    fn pair_two_rows(
        &self,
        segs: [Segment; 2],
        xs: [u64; 2],
        gated: Option<(u64, [u64; 2], usize)>,
        k: usize,
        group: usize,
    ) -> Result<bool> {
        let [s0, s1] = segs;
        let head_ok = gated
            .is_none_or(|(_, _, d)| d.is_multiple_of(8) && (d / 8).is_power_of_two() && d <= 256);
        let smem = pair_launch_smem(self.smem_optin);
        let fits = s0.bits == 4 && s0.accumulate != 0 && group == 64 && head_ok;
        if !self.fuse_rows || !fits || k != PAIR_K || pair_rows_smem(PAIR_K, 2) > smem {
            return Ok(false);
        }
        let mut a = GemvArgs {
            x: xs[0],
            x1: xs[1],
            eps: self.cfg.rms_norm_eps,
            nseg: 1,
            k: k as i32,
            group: 64,
            ..Default::default()
        };
        a.seg[0] = s0;
        a.out1[0] = s1.out;
        if let Some((weight, z, head_dim)) = gated {
            a.head_norm = weight;
            a.gate_z = z[0];
            a.gate_z1 = z[1];
            a.head_dim = head_dim as i32;
        }
        let tiles = (s0.rows as usize).div_ceil(16);
        self.launch_staged(&self.f.gemv_pair2, a, (2 * tiles, 1, smem), 256)?;
        Ok(true)
    }

    /// The lm_head of two rows (the verify step's) in one stream of its weights (gemv_q_ring2),
    /// each row's greedy choice into its TokenChoice; false where that kernel does not take the
    /// shape or there are not two rows (the rows then take a launch each).
    fn lm_head_two_rows(&self, rows: &[Row]) -> Result<bool> {
        let ([r0, r1], true) = (rows, self.fuse_rows) else {
            return Ok(false);
        };
        let k = self.cfg.hidden_size;
        let st = &self.stream;
        let seg = self.lm_head.segment(self.p(&r0.s.logits), false, st);
        let tiles = (seg.rows as usize).div_ceil(16);
        let smem = self.smem_optin - RING_STATIC_SMEM;
        let launch = ring_launch(tiles, k, self.sms, smem, 2);
        let (Some(launch), 2048, 64, 4) = (launch, k, self.lm_head.m.group, seg.bits) else {
            return Ok(false);
        };
        let mut a = GemvArgs {
            x: self.p(&r0.s.x),
            x1: self.p(&r1.s.x),
            out1: [self.p(&r1.s.logits), 0, 0, 0],
            choice: r0.choice,
            choice1: r1.choice,
            norm_weight: self.p(&self.final_norm),
            eps: self.cfg.rms_norm_eps,
            nseg: 1,
            k: k as i32,
            group: 64,
            ..Default::default()
        };
        a.seg[0] = seg;
        self.launch_staged(&self.f.gemv_ring2_k2048, a, launch, RING_THREADS)?;
        Ok(true)
    }

    /// A GEMV whose blocks stage their weights in shared memory (gemv_q_resident, gemv_q_ring,
    /// gemv_q_pair): `launch` is (blocks, tiles or stages per block, dynamic shared memory bytes;
    /// a pair block holds its one tile). Launched early: the weights' copies go out before the
    /// dependency wait.
    fn launch_staged(
        &self,
        f: &CudaFunction,
        mut a: GemvArgs,
        launch: (usize, usize, usize),
        threads: u32,
    ) -> Result<()> {
        let (blocks, stages, smem) = launch;
        a.tiles = 1;
        a.stages = stages as i32;
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        self.launch_params(
            f,
            cfg,
            &mut [&a as *const GemvArgs as *mut c_void],
            self.overlap.early,
        )
    }

    /// Launches one kernel of the decode step. With `overlap.pdl` (programmatic dependent launch),
    /// the kernel may be scheduled while its predecessor drains: every step kernel waits
    /// (griddepcontrol.wait) before touching anything an earlier kernel writes, and before that
    /// only prefetches what none of them writes (common.cuh).
    fn launch_step<A>(&self, f: &CudaFunction, cfg: LaunchConfig, args: &A) -> Result<()> {
        self.launch_params(
            f,
            cfg,
            &mut [args as *const A as *mut c_void],
            self.overlap.pdl,
        )
    }

    /// Launches a kernel that takes one parameter block, the ordinary way (prefill, and kernels
    /// run outside the decode step).
    fn launch<A>(&self, f: &CudaFunction, cfg: LaunchConfig, args: &A) -> Result<()> {
        self.launch_params(f, cfg, &mut [args as *const A as *mut c_void], false)
    }

    /// `params`: one pointer per kernel argument; `pdl`: programmatic dependent launch.
    fn launch_params(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
        pdl: bool,
    ) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: an all-zero attribute value is a valid (empty) union; the id selects its field
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl),
        };
        // SAFETY: `params` points at one parameter block per kernel argument, laid out as the
        // kernel declares them (args.rs), alive for the duration of the call
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        Ok(())
    }

    /// Issues every kernel of one decode step on the stream (recorded into the graph once).
    /// With `profile`, each launch is bracketed by events and its time returned by kernel family.
    /// With `doubled`, that kernel family's launches are issued twice (for `profile_step_in_graph`).
    fn issue_step(&self, profile: Option<&mut LaunchTimes>, doubled: Option<&str>) -> Result<()> {
        let row = Row {
            s: &self.s,
            choice: self.p(&self.s.choice),
            gdn: None,
            state_early: true,
        };
        self.issue_rows(profile, doubled, &[row], true)
    }

    /// Issues every kernel of a step whose rows are `rows` (`issue_step`: one; the speculative
    /// verify step: two), kernel by kernel: each launch for every row before the next kernel's,
    /// so that a kernel family taking several rows at once can stand in for a row loop. With
    /// `sample`, the sampler's launches follow (the one-token step).
    fn issue_rows(
        &self,
        mut profile: Option<&mut LaunchTimes>,
        doubled: Option<&str>,
        rows: &[Row],
        sample: bool,
    ) -> Result<()> {
        let c = &self.cfg;
        let st = &self.stream;
        let mut gdn_layer = 0;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        // `$body` once per row, with the row, its scratch and its residual stream's address
        macro_rules! per_row {
            ($row:ident, $s:ident, $x:ident => $body:block) => {
                for $row in rows {
                    let $s = $row.s;
                    let $x = self.p(&$s.x);
                    $body
                }
            };
            ($row:ident, $s:ident => $body:block) => {
                for $row in rows {
                    let $s = $row.s;
                    $body
                }
            };
        }
        // a layer's input projection of every row (RMS-normalised by the layer's input norm): one
        // launch for both rows where gemv_q_resident2 takes them, else a launch a row
        macro_rules! in_proj {
            ($name:expr, $segs_of:expr, $layer:expr, $group:expr) => {{
                let segs_of = $segs_of;
                let norm = self.p(&$layer.input_norm);
                let fused = match rows {
                    [r0, r1] => self.gemv_two_rows(
                        [&segs_of(r0.s), &segs_of(r1.s)],
                        [self.p(&r0.s.x), self.p(&r1.s.x)],
                        norm,
                        $group,
                    )?,
                    _ => false,
                };
                if !fused {
                    per_row!(row, s, x => {
                        let segs = segs_of(s);
                        timed!($name, self.gemv(&segs, x, Prologue::RmsNorm(norm), h, $group)?);
                    });
                }
            }};
        }
        macro_rules! timed {
            ($name:expr, $body:expr) => {
                timed!($name, _repeat => $body)
            };
            ($name:expr, $repeat:ident => $body:expr) => {{
                let start = match profile.as_deref_mut() {
                    Some(_) => Some(
                        self.ctx
                            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?,
                    ),
                    None => None,
                };
                if let Some(e) = &start {
                    e.record(st)?;
                }
                for issue in 0..if doubled == Some($name) { 2 } else { 1 } {
                    let $repeat = issue > 0;
                    $body;
                }
                if let (Some(p), Some(e0)) = (profile.as_deref_mut(), start) {
                    let e1 = self
                        .ctx
                        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
                    e1.record(st)?;
                    p.push(($name, e0, e1));
                }
            }};
        }
        per_row!(row, s, x => {
            let ea = EmbedArgs {
                codes: self.embed.at(0, st).codes,
                scales: self.embed.at(0, st).scales,
                biases: self.embed.at(0, st).biases,
                token: self.p(&s.token),
                x,
                hidden: h as i32,
                group: self.embed.group as i32,
                bits: self.embed.bits as i32,
            };
            timed!(
                "embed",
                self.launch_step(&self.f.embed, launch_cfg((1, 1), 256), &ea)?
            );
        });

        for l in &self.layers {
            match &l.mixer {
                LayerDev::Gdn {
                    qkv,
                    z,
                    b,
                    a,
                    out,
                    conv_w,
                    conv,
                    state,
                    a_log,
                    dt_bias,
                    norm,
                } => {
                    in_proj!(
                        "gdn in_proj (norm + qkv|z|b|a)",
                        |s: &Scratch| {
                            [
                                qkv.segment(self.p(&s.qkv), false, st),
                                z.segment(self.p(&s.z), false, st),
                                b.segment(self.p(&s.b), false, st),
                                a.segment(self.p(&s.a), false, st),
                            ]
                        },
                        l,
                        qkv.m.group
                    );
                    per_row!(row, s => {
                        let ga = GdnArgs {
                            qkv: self.p(&s.qkv),
                            b: self.p(&s.b),
                            a: self.p(&s.a),
                            conv_w: self.p(conv_w),
                            conv_in: self.p(&conv[0]),
                            conv_out: self.p(&conv[1]),
                            a_log: self.p(a_log),
                            dt_bias: self.p(dt_bias),
                            state: self.p(state),
                            o: self.p(&s.y),
                            pos: self.p(&s.pos),
                            hk: c.linear_num_key_heads as i32,
                            hv: c.linear_num_value_heads as i32,
                            conv_dim: c.conv_dim() as i32,
                            state_alt: row.gdn.map_or(0, |g| self.p(&g.alt[gdn_layer])),
                            cur: row.gdn.map_or(0, |g| g.cur),
                            role: row.gdn.map_or(0, |g| g.role),
                            _pad: 0,
                        };
                        timed!(
                            "gdn step (conv, l2, delta rule)",
                            self.launch_params(
                                &self.f.gdn,
                                launch_cfg((c.linear_num_value_heads as u32, 4), 256),
                                &mut [&ga as *const GdnArgs as *mut c_void],
                                self.overlap.early && row.state_early,
                            )?
                        );
                    });
                    gdn_layer += 1;
                    let fused = match rows {
                        [r0, r1] => self.pair_two_rows(
                            [
                                out.segment(self.p(&r0.s.x), true, st),
                                out.segment(self.p(&r1.s.x), true, st),
                            ],
                            [self.p(&r0.s.y), self.p(&r1.s.y)],
                            Some((
                                self.p(norm),
                                [self.p(&r0.s.z), self.p(&r1.s.z)],
                                c.linear_value_head_dim,
                            )),
                            c.linear_value_dim(),
                            out.m.group,
                        )?,
                        _ => false,
                    };
                    per_row!(row, s, x => {
                        if fused {
                            break;
                        }
                        let gated = Prologue::GatedHeadNorm {
                            weight: self.p(norm),
                            z: self.p(&s.z),
                            head_dim: c.linear_value_head_dim,
                        };
                        timed!(
                            "gdn gated norm + out_proj + residual",
                            self.gemv(
                                &[out.segment(x, true, st)],
                                self.p(&s.y),
                                gated,
                                c.linear_value_dim(),
                                out.m.group
                            )?
                        );
                    });
                }
                LayerDev::Attention {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                    kv,
                } => {
                    in_proj!(
                        "attn in_proj (norm + q|k|v)",
                        |s: &Scratch| {
                            [
                                q.segment(self.p(&s.qg), false, st),
                                k.segment(self.p(&s.k), false, st),
                                v.segment(self.p(&s.v), false, st),
                            ]
                        },
                        l,
                        q.m.group
                    );
                    per_row!(row, s => {
                        let pa = PrepArgs {
                            qg: self.p(&s.qg),
                            k: self.p(&s.k),
                            v: self.p(&s.v),
                            q_norm: self.p(q_norm),
                            k_norm: self.p(k_norm),
                            q_out: self.p(&s.q),
                            k_cache: self.p(&kv.k),
                            v_cache: self.p(&kv.v),
                            k_scale: self.kv_scale(kv, 0),
                            v_scale: self.kv_scale(kv, 1),
                            pos: self.p(&s.pos),
                            eps,
                            theta: c.rope_theta as f32,
                            hq: c.num_attention_heads as i32,
                            hkv: c.num_key_value_heads as i32,
                            rotary: c.rotary_dim as i32,
                            max_pos: self.max_context as i32,
                        };
                        let blocks = (c.num_attention_heads + c.num_key_value_heads) as u32;
                        timed!(
                            "attn q/k norm + rope + kv append",
                            self.launch_params(
                                &self.f.prep,
                                launch_cfg((blocks, 1), c.head_dim as u32),
                                &mut [&pa as *const PrepArgs as *mut c_void],
                                // its norm weights, the position and the rotation before the wait
                                self.overlap.early,
                            )?
                        );
                    });
                    per_row!(row, s => {
                        // the splits merged by attn_decode's blocks once they meet (no launch
                        // between it and o_proj): at 4K 823.4 -> 834.4 tok/s, 32K 716.1 -> 739.8
                        // against attn_combine's launch (bench/results/cuda-decode-attn-merge-all.json;
                        // from 48K since cuda-decode-attn-merge-last-alloc.json)
                        let da = DecodeArgs {
                            q: self.p(&s.q),
                            k_cache: self.p(&kv.k),
                            v_cache: self.p(&kv.v),
                            k_scale: self.kv_scale(kv, 0),
                            v_scale: self.kv_scale(kv, 1),
                            part_acc: self.p(&s.part_acc),
                            part_ml: self.p(&s.part_ml),
                            qg: self.p(&s.qg),
                            out: self.p(&s.o),
                            meet: self.p(&s.attn_meet),
                            pos: self.p(&s.pos),
                            scale: 1.0 / (c.head_dim as f32).sqrt(),
                            hq: c.num_attention_heads as i32,
                            hkv: c.num_key_value_heads as i32,
                            splits: SPLITS as i32,
                            max_pos: self.max_context as i32,
                        };
                        timed!(
                            "attn decode (split-KV) + merge + gate",
                            self.launch_params(
                                &self.f.attn,
                                // resident blocks walking (KV head, split) items, then meeting to
                                // merge the splits: all of them must be on the GPU at once
                                launch_cfg((self.attn_blocks as u32, 1), ATTN_THREADS),
                                &mut [&da as *const DecodeArgs as *mut c_void],
                                // its first K/V loads (rows of earlier steps) go out before the wait
                                self.overlap.early && row.state_early,
                            )?
                        );
                    });
                    let fused = match rows {
                        [r0, r1] => self.pair_two_rows(
                            [
                                o.segment(self.p(&r0.s.x), true, st),
                                o.segment(self.p(&r1.s.x), true, st),
                            ],
                            [self.p(&r0.s.o), self.p(&r1.s.o)],
                            None,
                            c.num_attention_heads * c.head_dim,
                            o.m.group,
                        )?,
                        _ => false,
                    };
                    per_row!(row, s, x => {
                        if fused {
                            break;
                        }
                        timed!(
                            "attn o_proj + residual",
                            self.gemv(
                                &[o.segment(x, true, st)],
                                self.p(&s.o),
                                Prologue::None,
                                c.num_attention_heads * c.head_dim,
                                o.m.group
                            )?
                        );
                    });
                }
            }
            let m = &l.moe;
            let moe_form = self.moe_form_here();
            per_row!(row, s, x => {
                if moe_form != MoeForm::Routed {
                    let segs = [
                        m.router.segment(self.p(&s.router), false, st),
                        m.shared_gate_logit
                            .segment(self.p(&s.shared_gate_logit), false, st),
                        m.shared_gate.segment(self.p(&s.shared_g), false, st),
                        m.shared_up.segment(self.p(&s.shared_u), false, st),
                    ];
                    let router_norm = if moe_form == MoeForm::Router {
                        Prologue::RmsNormPublished {
                            weight: self.p(&l.post_norm),
                            out: self.p(&s.xn),
                        }
                    } else {
                        Prologue::RmsNorm(self.p(&l.post_norm))
                    };
                    timed!(
                        "moe router + shared gate/up",
                        self.gemv(&segs, x, router_norm, h, m.router.m.group)?
                    );
                }
                if moe_form != MoeForm::Pair {
                    let routed = moe_form == MoeForm::Routed;
                    let ea = ExpertsArgs {
                        gate: m.gate.at(0, st),
                        up: m.up.at(0, st),
                        down: m.down.at(0, st),
                        shared_down: m.shared_down.m.at(m.shared_down.row0, st),
                        xn: self.p(&s.xn),
                        x,
                        router_logits: self.p(&s.router),
                        shared_gate_proj: self.p(&s.shared_g),
                        shared_up_proj: self.p(&s.shared_u),
                        shared_gate_logit: self.p(&s.shared_gate_logit),
                        h: self.p(&s.h),
                        meet: self.p(&s.meet),
                        experts: c.num_experts as i32,
                        renorm: i32::from(c.norm_topk_prob),
                        hidden: h as i32,
                        inter: c.moe_intermediate_size as i32,
                        k: c.num_experts_per_tok as i32,
                        route: [
                            m.router.route(st),
                            m.shared_gate_logit.route(st),
                            m.shared_gate.route(st),
                            m.shared_up.route(st),
                        ],
                        norm_weight: self.p(&l.post_norm),
                        routed: self.p(&s.routed),
                        route_meet: self.p(&s.route_meet),
                        eps,
                    };
                    let cfg = LaunchConfig {
                        grid_dim: (gate_up_blocks(c) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: gate_up_smem(h) as u32,
                    };
                    timed!(
                        if routed {
                            "moe router + experts (top-k, gate/up, swiglu, down) + residual"
                        } else {
                            "moe experts (top-k, gate/up, swiglu, down) + residual"
                        },
                        self.launch_params(
                            if routed {
                                &self.f.routed_experts
                            } else {
                                &self.f.experts
                            },
                            cfg,
                            &mut [&ea as *const ExpertsArgs as *mut c_void],
                            self.experts_early(),
                        )?
                    );
                } else {
                    let gu = GateUpArgs {
                        gate: m.gate.at(0, st),
                        up: m.up.at(0, st),
                        topk: self.p(&s.topk),
                        x,
                        norm_weight: self.p(&l.post_norm),
                        eps,
                        router_logits: self.p(&s.router),
                        experts: c.num_experts as i32,
                        renorm: i32::from(c.norm_topk_prob),
                        shared_gate_proj: self.p(&s.shared_g),
                        shared_up_proj: self.p(&s.shared_u),
                        shared_gate_logit: self.p(&s.shared_gate_logit),
                        h: self.p(&s.h),
                        hidden: h as i32,
                        inter: c.moe_intermediate_size as i32,
                        k: c.num_experts_per_tok as i32,
                    };
                    let cfg = LaunchConfig {
                        grid_dim: (gate_up_blocks(c) as u32, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: gate_up_smem(h) as u32,
                    };
                    timed!(
                        "moe top-k + expert gate/up + swiglu",
                        self.launch_step(&self.f.gate_up, cfg, &gu)?
                    );
                    let da = DownArgs {
                        down: m.down.at(0, st),
                        shared_down: m.shared_down.m.at(m.shared_down.row0, st),
                        h: self.p(&s.h),
                        topk: self.p(&s.topk),
                        x,
                        hidden: h as i32,
                        inter: c.moe_intermediate_size as i32,
                        k: c.num_experts_per_tok as i32,
                    };
                    timed!(
                        "moe down (8 experts + shared) + residual",
                        self.launch_step(
                            &self.f.down,
                            launch_cfg(
                                (h.div_ceil(16) as u32, 1),
                                32 * (c.num_experts_per_tok as u32 + 1)
                            ),
                            &da
                        )?
                    );
                }
            });
        }
        // the greedy choice rides on the lm_head launch (its repeat, when profiling, leaves it out)
        let fused = self.lm_head_two_rows(rows)?;
        per_row!(row, s, x => {
            if fused {
                break;
            }
            timed!("lm_head (final norm + gemv + argmax)", repeat => {
                self.gemv_choosing(
                    &[self.lm_head.segment(self.p(&s.logits), false, st)],
                    x,
                    Prologue::RmsNorm(self.p(&self.final_norm)),
                    h,
                    self.lm_head.m.group,
                    if repeat { 0 } else { row.choice },
                )?
            });
        });
        if sample {
            let sa = self.sample_args();
            // timed apart, so that the step's launches and their names pair up (`launch_order`)
            timed!(TOKEN_CHOICE_FAMILIES[0], self.launch_sample_prepass(&sa)?);
            timed!(TOKEN_CHOICE_FAMILIES[1], self.launch_sample_token(&sa)?);
        }
        Ok(())
    }

    /// Clears the session state: position 0, empty caches and recurrent state.
    pub fn reset(&mut self) -> Result<()> {
        let stream = self.stream.clone();
        for b in self.gdn_state_buffers_mut() {
            stream.memset_zeros(b)?;
        }
        self.start_at(0)
    }

    /// Moves the position to `pos` and restarts the step counter: the record of choices is
    /// indexed by steps since, which stay below the position only if they restart with it.
    fn start_at(&mut self, pos: usize) -> Result<()> {
        self.set_position(pos)?;
        self.stream.memcpy_htod(&[0i32], &mut self.s.step)?;
        Ok(())
    }

    /// Bytes of a `SessionCopy`'s GDN state.
    pub fn session_copy_bytes(&self) -> usize {
        self.gdn_state_buffers().map(|b| 4 * b.len()).sum()
    }

    /// Bytes of one position's K/V rows over all attention layers (what a stashed row costs).
    pub fn kv_row_bytes(&self) -> usize {
        self.kv_caches()
            .map(|c| {
                (c.k.len() + c.v.len()) / self.max_context
                    + c.scales
                        .as_ref()
                        .map_or(0, |s| 4 * (s[0].len() + s[1].len()) / self.max_context)
            })
            .sum()
    }

    /// Every GDN layer's conv buffers (both parities) and recurrent state: what a session copy
    /// saves, a reset clears and a restore writes back.
    fn gdn_state_buffers(&self) -> impl Iterator<Item = &CudaSlice<f32>> {
        self.layers.iter().flat_map(|l| match &l.mixer {
            LayerDev::Gdn { conv, state, .. } => vec![&conv[0], &conv[1], state],
            LayerDev::Attention { .. } => Vec::new(),
        })
    }

    fn gdn_state_buffers_mut(&mut self) -> impl Iterator<Item = &mut CudaSlice<f32>> {
        self.layers.iter_mut().flat_map(|l| match &mut l.mixer {
            LayerDev::Gdn { conv, state, .. } => {
                let [even, odd] = conv;
                vec![even, odd, state]
            }
            LayerDev::Attention { .. } => Vec::new(),
        })
    }

    fn kv_caches(&self) -> impl Iterator<Item = &KvCacheDev> {
        self.layers.iter().filter_map(|l| match &l.mixer {
            LayerDev::Attention { kv, .. } => Some(kv),
            LayerDev::Gdn { .. } => None,
        })
    }

    fn kv_caches_mut(&mut self) -> impl Iterator<Item = &mut KvCacheDev> {
        self.layers.iter_mut().filter_map(|l| match &mut l.mixer {
            LayerDev::Attention { kv, .. } => Some(kv),
            LayerDev::Gdn { .. } => None,
        })
    }

    /// Copies the session's GDN state after its first `len` tokens (what the device holds) into
    /// new buffers; device to device, on the stream. Its K/V rows stay in the cache.
    pub fn save_session(&self, len: usize) -> Result<SessionCopy> {
        let mut gdn = Vec::new();
        for b in self.gdn_state_buffers() {
            let mut to = self.stream.alloc_zeros::<f32>(b.len())?;
            self.stream.memcpy_dtod(b, &mut to)?;
            gdn.push(to);
        }
        Ok(SessionCopy {
            gdn,
            len,
            stashed_from: len,
            rows: Vec::new(),
        })
    }

    /// Copies the cache's K/V rows `from..to` into the front of `copy`'s stash (which holds the
    /// rows from `to` on), before a call writes other tokens' rows there.
    pub fn stash_rows(&self, copy: &mut SessionCopy, from: usize, to: usize) -> Result<()> {
        let len = copy.len;
        if to != copy.stashed_from || from > to {
            bail!(
                "cannot stash rows {from}..{to}: the copy's stash starts at {}",
                copy.stashed_from
            );
        }
        if from == to {
            return Ok(());
        }
        let (stream, max) = (&self.stream, self.max_context);
        let old = std::mem::take(&mut copy.rows);
        let mut rows = Vec::new();
        for (j, c) in self.kv_caches().enumerate() {
            let old = old.get(j);
            let kv = RowRuns::of(&c.k, 1, max);
            let k = kv.stash(stream, &c.k, old.map(|o| &o.k), from, to, len)?;
            let v = kv.stash(stream, &c.v, old.map(|o| &o.v), from, to, len)?;
            let scales = match &c.scales {
                None => None,
                Some([ks, vs]) => {
                    let r = RowRuns::of(ks, ks.len() / max, max);
                    let prev = old.and_then(|o| o.scales.as_ref());
                    Some([
                        r.stash(stream, ks, prev.map(|p| &p[0]), from, to, len)?,
                        r.stash(stream, vs, prev.map(|p| &p[1]), from, to, len)?,
                    ])
                }
            };
            rows.push(StashedRows { k, v, scales });
        }
        copy.rows = rows;
        copy.stashed_from = from;
        Ok(())
    }

    /// Puts a saved session back: its stashed K/V rows from `rows_from` (the cache holds that
    /// session's rows below it: the caller's book keeps track, `snapshots::StateBook`) and its
    /// GDN state, and moves the position to its length.
    pub fn restore_session(&mut self, copy: &SessionCopy, rows_from: usize) -> Result<()> {
        let (len, stashed) = (copy.len, copy.stashed_from);
        if rows_from < stashed || rows_from > len {
            bail!("rows {rows_from}..{len} are not all in the copy (it stashed {stashed}..{len})");
        }
        let (stream, max) = (self.stream.clone(), self.max_context);
        if rows_from < len {
            if copy.rows.len() != self.kv_caches().count() {
                bail!("the copy's stash has {} layers' rows", copy.rows.len());
            }
            for (c, st) in self.kv_caches_mut().zip(&copy.rows) {
                let kv = RowRuns::of(&c.k, 1, max);
                kv.unstash(&stream, &st.k, &mut c.k, stashed, rows_from, len)?;
                kv.unstash(&stream, &st.v, &mut c.v, stashed, rows_from, len)?;
                if let (Some(sc), Some(ss)) = (&mut c.scales, &st.scales) {
                    let r = RowRuns::of(&sc[0], sc[0].len() / max, max);
                    for (cache, stash) in sc.iter_mut().zip(ss) {
                        r.unstash(&stream, stash, cache, stashed, rows_from, len)?;
                    }
                }
            }
        }
        if copy.gdn.len() != self.gdn_state_buffers().count() {
            bail!("the saved state has {} GDN buffers", copy.gdn.len());
        }
        for (to, from) in self.gdn_state_buffers_mut().zip(&copy.gdn) {
            stream.memcpy_dtod(from, to)?;
        }
        self.start_at(len)
    }

    /// Moves the position (benchmarks: the work of a step depends only on the context length).
    pub fn set_position(&mut self, pos: usize) -> Result<()> {
        if pos >= self.max_context {
            bail!(
                "position {pos} is beyond the allocated context of {}",
                self.max_context
            );
        }
        self.stream.memcpy_htod(&[pos as i32], &mut self.s.pos)?;
        Ok(())
    }

    /// Puts `token` in the input slot (teacher forcing; otherwise the previous step's argmax is used).
    pub fn set_token(&mut self, token: u32) -> Result<()> {
        self.stream
            .memcpy_htod(&[token as i32], &mut self.s.token)?;
        Ok(())
    }

    /// Runs one decode step by replaying the captured graph (captured on first use).
    pub fn step(&mut self) -> Result<()> {
        self.capture_graph()?;
        self.graph()?.launch()?;
        Ok(())
    }

    /// Captures the step's graph if it is not yet.
    fn capture_graph(&mut self) -> Result<()> {
        if self.graph.is_none() {
            self.graph = Some(self.capture_step(None)?);
        }
        Ok(())
    }

    /// The step's graph, once `capture_graph` has run.
    fn graph(&self) -> Result<&CudaGraph> {
        self.graph
            .as_ref()
            .ok_or_else(|| anyhow!("no decode graph"))
    }

    /// How the step runs its MoE blocks: the one-launch form only where the experts launch
    /// early; launched plain, its route rows' copies and the launch itself are no longer hidden
    /// behind a predecessor, and the router launch + moe_experts measured faster.
    fn moe_form_here(&self) -> MoeForm {
        match self.moe_form {
            MoeForm::Routed if !self.experts_early() => MoeForm::Router,
            form => form,
        }
    }

    /// Whether the step launches its experts early, beside the out projection before them: at
    /// every position. First measured (router launch + moe_experts) as a gain at short context and
    /// a loss from ~56K (128K 451.5 -> 427.2 tok/s, cuda-decode-experts-early-bound.json), so
    /// the step had a second graph from 48K positions with the experts launched plain; with the
    /// step as it is now (routed experts, streamed input projections) the early graph is faster
    /// there too: 64K 654.4 -> 691.0, 128K 543.4 -> 554.5, int8 cache 64K 707.6 -> 766.6, 128K
    /// 631.2 -> 669.9, and from 16K the plain graph loses 7.6% at 32K
    /// (bench/results/cuda-decode-session40-ablations.json).
    fn experts_early(&self) -> bool {
        self.overlap.pdl || self.overlap.early
    }

    /// Captures one decode step as a CUDA graph (`doubled`: see `issue_step`).
    fn capture_step(&self, doubled: Option<&str>) -> Result<CudaGraph> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let issued = self.issue_step(None, doubled);
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0))?;
        issued?;
        graph.ok_or_else(|| anyhow!("graph capture produced no graph"))
    }

    /// Whether the GPU can choose tokens with these settings (greedy, or top-k of at most 256;
    /// otherwise the host samples from the logits).
    pub fn can_sample(p: &SamplingParams) -> bool {
        p.temperature == 0.0 || (1..=256).contains(&p.top_k)
    }

    /// How the captured step chooses its token from now on: `None` is argmax; a sampler's
    /// settings and token counts (for its penalties) switch the GPU sampler on. Greedy settings
    /// without penalties keep the lm_head launch's argmax. Restarts the step counter.
    pub fn set_sampling(&mut self, sampler: Option<&Sampler>) -> Result<()> {
        let mut params = SampleParams::default();
        if let Some(sm) = sampler {
            let p = sm.params();
            if !Self::can_sample(p) {
                bail!(
                    "top_k {} is beyond what the GPU sampler takes (1..=256, or greedy)",
                    p.top_k
                );
            }
            let penalties = p.repetition_penalty != 1.0
                || p.presence_penalty != 0.0
                || p.frequency_penalty != 0.0;
            let greedy = p.temperature == 0.0 || p.top_k == 1;
            params = SampleParams {
                temperature: p.temperature,
                top_p: p.top_p,
                min_p: p.min_p,
                presence: p.presence_penalty,
                frequency: p.frequency_penalty,
                repetition: p.repetition_penalty,
                top_k: p.top_k as i32,
                active: i32::from(penalties || !greedy),
                seed: p.seed,
            };
            let vocab = self.cfg.vocab_size;
            let dense = |m: &HashMap<u32, u32>| {
                let mut v = vec![0i32; vocab];
                for (&t, &n) in m {
                    if let Some(x) = v.get_mut(t as usize) {
                        *x = n as i32;
                    }
                }
                v
            };
            let (seen, output) = sm.counts();
            self.stream.memcpy_htod(&dense(seen), &mut self.s.seen)?;
            self.stream
                .memcpy_htod(&dense(output), &mut self.s.output)?;
        }
        self.stream
            .memcpy_htod(&[params], &mut self.s.sample_params)?;
        // the draws' counter and the record of choices start over: a seeded run draws the same
        // numbers whatever the device ran before (a resumed session is not reset)
        self.stream.memcpy_htod(&[0i32], &mut self.s.step)?;
        Ok(())
    }

    /// Runs decode steps from the current position with the token chosen on the GPU, the first
    /// step fed `first`. Each chosen token is copied into page-locked memory while the next
    /// step already runs and handed to `on_token` one step late, so no step waits for the host;
    /// stops when `on_token` returns false or after `max_steps` steps. With `logprobs` (the
    /// alternatives asked for), each step's logits are also summarised on the device
    /// (`summarise_logits`: the normaliser, the chosen token's logit, the top alternatives,
    /// over the valid ids) and the summary comes back with its token, ~0.2 KB instead of the
    /// ~1 MB of logits. Returns the number of steps run: the state then holds `first` and the first
    /// `steps - 1` chosen tokens.
    pub fn run_steps(
        &mut self,
        first: u32,
        max_steps: usize,
        logprobs: Option<usize>,
        on_token: &mut dyn FnMut(u32, Option<PositionLogprobs>) -> bool,
    ) -> Result<usize> {
        if let Some(top) = logprobs {
            prefill::check_summary_top(top)?;
        }
        let width = prefill::summary_width(prefill::MAX_SUMMARY_TOP);
        if logprobs.is_some() && self.step_summaries.is_none() {
            let device = self.stream.alloc_zeros::<f32>(2 * width)?;
            // SAFETY: page-locked host memory read only after the copy into it has completed
            let host = unsafe {
                [
                    self.ctx.alloc_pinned_with_flags::<f32>(width, 0)?,
                    self.ctx.alloc_pinned_with_flags::<f32>(width, 0)?,
                ]
            };
            self.step_summaries = Some((device, host));
        }
        self.set_token(first)?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let done = [self.ctx.new_event(flags)?, self.ctx.new_event(flags)?];
        let hand_over = |dec: &mut Self, slot: usize| -> Result<(u32, Option<PositionLogprobs>)> {
            done[slot].synchronize()?;
            let t = dec.token_slots[slot].as_slice()?[0] as u32;
            let summary = match (logprobs, dec.step_summaries.as_ref()) {
                (Some(top), Some((_, host))) => Some(prefill::position_logprobs(
                    &host[slot].as_slice()?[..prefill::summary_width(top)],
                    Some(t),
                )),
                _ => None,
            };
            Ok((t, summary))
        };
        for n in 0..max_steps {
            self.step()?;
            let slot = n % 2;
            self.stream
                .memcpy_dtoh(&self.s.token, &mut self.token_slots[slot])?;
            if let Some(top) = logprobs {
                let (device, _) = self.step_summaries.as_ref().expect("allocated above");
                let out = self.p(device) + (slot * width * 4) as u64;
                self.summarise_logits(
                    1,
                    self.p(&self.s.logits),
                    self.p(&self.s.token),
                    out,
                    self.valid_vocab,
                    top,
                )?;
                let (device, host) = self.step_summaries.as_mut().expect("allocated above");
                self.stream.memcpy_dtoh(
                    &device.slice(slot * width..(slot + 1) * width),
                    &mut host[slot],
                )?;
            }
            done[slot].record(&self.stream)?;
            if n > 0 {
                let (t, summary) = hand_over(self, 1 - slot)?;
                if !on_token(t, summary) {
                    return Ok(n + 1);
                }
            }
        }
        if max_steps > 0 {
            let (t, summary) = hand_over(self, (max_steps - 1) % 2)?;
            on_token(t, summary);
        }
        Ok(max_steps)
    }

    /// Runs only the token choice, `n` times over the logits of the last step, with the sampling
    /// set by `set_sampling` (checks of the GPU sampler: each run draws a new number); returns
    /// the choices. Leaves the step counter and position moved: reset before decoding on.
    pub fn choose_repeatedly(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.max_context {
            bail!(
                "at most {} choices fit the device's record",
                self.max_context
            );
        }
        self.stream.memcpy_htod(&[0i32], &mut self.s.step)?;
        let sa = self.sample_args();
        for _ in 0..n {
            self.launch_sample(&sa)?;
        }
        self.history(n)
    }

    /// Logits of the last step (synchronises), through a page-locked buffer.
    pub fn logits(&mut self) -> Result<Vec<f32>> {
        self.stream
            .memcpy_dtoh(&self.s.logits, &mut self.logits_host)?;
        self.stream.synchronize()?;
        Ok(self.logits_host.as_slice()?.to_vec())
    }

    /// The token the last step chose (synchronises).
    pub fn last_token(&self) -> Result<u32> {
        Ok(self.stream.clone_dtoh(&self.s.token)?[0] as u32)
    }

    /// Tokens chosen by the first `n` steps since `reset` or `set_sampling`.
    pub fn history(&self, n: usize) -> Result<Vec<u32>> {
        let h = self.stream.clone_dtoh(&self.s.history)?;
        Ok(h.into_iter().take(n).map(|t| t as u32).collect())
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// The device's streaming-read rate in bytes/s (ceiling.cu `read_stream`): the best of
    /// `rounds` timed reads of a `bytes` buffer (after one untimed), which should be well past
    /// L2's size; the buffer is freed before returning.
    pub fn measure_read_bandwidth(&self, bytes: usize, rounds: usize) -> Result<f64> {
        let vectors = bytes / 16;
        if vectors == 0 || rounds == 0 {
            bail!("a read probe needs a buffer and at least one round");
        }
        let src = self
            .stream
            .alloc_zeros::<u8>(vectors * 16)
            .with_context(|| format!("allocating {} MiB for the read probe", bytes >> 20))?;
        let sink = self.stream.alloc_zeros::<u32>(1)?;
        let args = ReadArgs {
            src: self.p(&src),
            vectors: vectors as u64,
            sink: self.p(&sink),
            key: 0xa5a5_a5a5,
            pad: 0,
        };
        let cfg = launch_cfg((8 * self.sms as u32, 1), 512);
        self.launch(&self.f.read_stream, cfg, &args)?;
        let mut best = f64::INFINITY;
        for _ in 0..rounds {
            best = best.min(self.seconds_of(|d| d.launch(&d.f.read_stream, cfg, &args))?);
        }
        Ok((vectors * 16) as f64 / best)
    }

    /// Seconds the work `issue` puts on the stream takes, by events around it (synchronises).
    fn seconds_of(&self, issue: impl FnOnce(&Self) -> Result<()>) -> Result<f64> {
        let start = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(&self.stream)?;
        issue(self)?;
        end.record(&self.stream)?;
        end.synchronize()?;
        Ok(start.elapsed_ms(&end)? as f64 / 1e3)
    }

    /// Times `steps` graph replays with CUDA events; returns seconds.
    pub fn time_steps(&mut self, steps: usize) -> Result<f64> {
        self.step()?;
        self.time_replays(self.graph()?, steps)
    }

    /// Seconds for `steps` replays of `graph` (after one untimed replay).
    fn time_replays(&self, graph: &CudaGraph, steps: usize) -> Result<f64> {
        graph.launch()?;
        self.synchronize()?;
        self.seconds_of(|_| {
            for _ in 0..steps {
                graph.launch()?;
            }
            Ok(())
        })
    }

    /// One step launched kernel by kernel with events around each: time per kernel family.
    pub fn profile_step(&mut self) -> Result<Vec<KernelTime>> {
        sum_events(&self.step_with_events()?)
    }

    /// The step's launches in issue order, by family name.
    pub fn launch_order(&mut self) -> Result<Vec<&'static str>> {
        Ok(self
            .step_with_events()?
            .into_iter()
            .map(|(name, _, _)| name)
            .collect())
    }

    /// One step launched kernel by kernel outside the graph, each launch between two events, in
    /// issue order (synchronised).
    fn step_with_events(&mut self) -> Result<LaunchTimes> {
        let mut events = Vec::new();
        self.issue_step(Some(&mut events), None)?;
        self.synchronize()?;
        Ok(events)
    }

    /// Replays the step's graph once with kernels that carry the timeline probe (loaded from
    /// KERNELS_DIR_ENV, built by tools/timeline_kernels.py) and returns every block's marks.
    pub fn record_timeline(&mut self) -> Result<Vec<Mark>> {
        use crate::timeline::{RawRecord, COUNTS_SYMBOL, PER_SM, RECORDS_SYMBOL, SMS};
        self.capture_graph()?;
        // the instrumented modules, with their per-SM mark counters
        let mut probed: Vec<_> = self
            .modules
            .iter()
            .filter_map(|(n, m)| {
                let counts = m.get_global(COUNTS_SYMBOL, &self.stream).ok()?;
                Some((*n, m.clone(), counts))
            })
            .collect();
        if probed.is_empty() {
            bail!("the loaded kernels carry no timeline probe: build them with tools/timeline_kernels.py and set {KERNELS_DIR_ENV} to that directory");
        }
        for (_, _, counts) in &mut probed {
            self.stream.memset_zeros(counts)?;
        }
        self.graph()?.launch()?;
        self.synchronize()?;
        let mut marks = Vec::new();
        for (name, m, counts) in &probed {
            // SAFETY: the probe declares `unsigned int timeline_counts[SMS]`
            let counts = self
                .stream
                .clone_dtoh(&unsafe { counts.transmute::<u32>(SMS) }.context("timeline counts")?)?;
            let records = m.get_global(RECORDS_SYMBOL, &self.stream)?;
            // SAFETY: the probe declares `TimelineRecord timeline_records[SMS * PER_SM]`, laid out as RawRecord
            let records = self.stream.clone_dtoh(
                &unsafe { records.transmute::<RawRecord>(SMS * PER_SM) }
                    .context("timeline records")?,
            )?;
            for (sm, &n) in counts.iter().enumerate() {
                if n as usize > PER_SM {
                    tracing::warn!("timeline: SM {sm} of {name} recorded {n} marks, kept {PER_SM}");
                }
                for r in &records[sm * PER_SM..sm * PER_SM + (n as usize).min(PER_SM)] {
                    marks.push(Mark {
                        module: name,
                        time_ns: r.time_ns,
                        mark: r.mark,
                        block: r.block,
                        grid: r.grid,
                    });
                }
            }
        }
        Ok(marks)
    }

    /// Each kernel family's cost inside the graph: the step is captured again with that family's
    /// launches issued twice, and the extra time per replay is what the family costs there,
    /// dependency gaps included and without the per-launch event overhead of `profile_step`
    /// (whose result names the families). The token choice is left out (issued twice it would
    /// advance the position twice). Every timing starts from a reset session at position
    /// `context`, so neither the cache nor the token record grows past `context + steps + 1`
    /// (clears the session).
    pub fn profile_step_in_graph(
        &mut self,
        families: &[KernelTime],
        context: usize,
        steps: usize,
    ) -> Result<Vec<KernelTime>> {
        self.reset()?;
        self.set_position(context)?;
        let base = self.time_steps(steps)?;
        let mut costs = Vec::new();
        for k in families {
            if TOKEN_CHOICE_FAMILIES.contains(&k.kernel) {
                continue;
            }
            // positioned first: the graph captured is the one for `context`
            self.reset()?;
            self.set_position(context)?;
            let graph = self.capture_step(Some(k.kernel))?;
            let doubled = self.time_replays(&graph, steps)?;
            costs.push(KernelTime {
                kernel: k.kernel,
                launches: k.launches,
                micros: (doubled - base) / steps as f64 * 1e6,
            });
        }
        Ok(costs)
    }

    /// Bytes one step must read at `context` positions: weights touched (projections, router,
    /// 8 routed + shared experts, lm_head, one embedding row), recurrent state read and written,
    /// and the K/V rows attended to.
    pub fn step_bytes(&self, context: usize) -> usize {
        let c = &self.cfg;
        let row_bytes = |m: &DevMatrix| m.words_per_row() * 4 + m.groups_per_row() * 4;
        let lin = |l: &DevLinear| l.rows * row_bytes(&l.m);
        let mut total = row_bytes(&self.embed) + lin(&self.lm_head);
        for l in &self.layers {
            total += match &l.mixer {
                LayerDev::Gdn {
                    qkv,
                    z,
                    b,
                    a,
                    out,
                    state,
                    ..
                } => lin(qkv) + lin(z) + lin(b) + lin(a) + lin(out) + 2 * 4 * state.len(),
                LayerDev::Attention { q, k, v, o, kv, .. } => {
                    // the cache's K and V rows (and an int8 cache's row scales) of `context`
                    // positions: its bytes are max_context such slices
                    lin(q) + lin(k) + lin(v) + lin(o) + context * kv.bytes() / self.max_context
                }
            };
            let m = &l.moe;
            let k = c.num_experts_per_tok;
            total += lin(&m.router)
                + lin(&m.shared_gate_logit)
                + lin(&m.shared_gate)
                + lin(&m.shared_up)
                + lin(&m.shared_down);
            total += k
                * (c.moe_intermediate_size * (row_bytes(&m.gate) + row_bytes(&m.up))
                    + c.hidden_size * row_bytes(&m.down));
        }
        total
    }
}

/// Time per kernel family from (name, start, end) event triples.
fn sum_events(events: &[(&'static str, CudaEvent, CudaEvent)]) -> Result<Vec<KernelTime>> {
    let mut by: Vec<KernelTime> = Vec::new();
    for (name, a, b) in events {
        let us = a.elapsed_ms(b)? as f64 * 1e3;
        match by.iter_mut().find(|k| k.kernel == *name) {
            Some(k) => {
                k.launches += 1;
                k.micros += us;
            }
            None => by.push(KernelTime {
                kernel: name,
                launches: 1,
                micros: us,
            }),
        }
    }
    Ok(by)
}

fn check_shapes(c: &ModelConfig) -> Result<()> {
    let mut problems = Vec::new();
    if c.linear_key_head_dim != 128 || c.linear_value_head_dim != 128 {
        problems.push(format!(
            "Gated DeltaNet head dims {}x{} (the kernel is built for 128x128)",
            c.linear_key_head_dim, c.linear_value_head_dim
        ));
    }
    if c.linear_num_key_heads > 64
        || c.linear_num_key_heads == 0
        || !c
            .linear_num_value_heads
            .is_multiple_of(c.linear_num_key_heads)
    {
        problems.push(format!(
            "Gated DeltaNet heads {} value over {} key (at most 64 key heads, a whole multiple)",
            c.linear_num_value_heads, c.linear_num_key_heads
        ));
    }
    if c.head_dim != 256 {
        problems.push(format!(
            "attention head_dim {} (the kernel is built for 256)",
            c.head_dim
        ));
    }
    if c.conv_kernel != 4 || c.conv_dim() > 8192 {
        problems.push(format!(
            "Gated DeltaNet conv kernel {} over {} channels (the prefill conv is built for 4 taps, at most 8192 channels)",
            c.conv_kernel,
            c.conv_dim()
        ));
    }
    if c.num_attention_heads / c.num_key_value_heads > 8 {
        problems.push("more than 8 query heads per KV head".into());
    }
    if ![512, 1024, 2048, 4096].contains(&c.hidden_size) {
        problems.push(format!(
            "hidden size {} (512, 1024, 2048 or 4096: moe_gate_up splits a tile's K in even batches of 4 groups)",
            c.hidden_size
        ));
    }
    if c.num_experts > 512
        || c.num_experts_per_tok > 16
        || (c.num_experts_per_tok + 1) * c.moe_intermediate_size > 6144
    {
        problems.push(
            "MoE shape beyond the kernels' limits (512 experts, top-16, (k+1)·I ≤ 6144)".into(),
        );
    }
    if c.vocab_size > SAMPLE_PARTS * SAMPLE_MAX_SLICE {
        problems.push(format!(
            "vocabulary {} beyond the GPU sampler's {SAMPLE_PARTS} slices of {SAMPLE_MAX_SLICE}",
            c.vocab_size
        ));
    }
    if c.shared_expert_intermediate_size != c.moe_intermediate_size {
        problems.push(format!(
            "shared expert width {} differs from the experts' {} (moe_down reads it as one more expert)",
            c.shared_expert_intermediate_size, c.moe_intermediate_size
        ));
    }
    if !c.moe_intermediate_size.is_multiple_of(64) {
        problems.push(format!("moe_intermediate_size {}", c.moe_intermediate_size));
    }
    if !problems.is_empty() {
        bail!(
            "the CUDA backend does not support this model shape: {}",
            problems.join("; ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_launch_takes_one_block_per_sm_and_a_row_per_warp() {
        // the model's router launch: 256 router rows, the shared expert's gate logit, 2 x 512
        // shared gate/up rows
        let (blocks, threads) = k2048_row_launch(1281, 132);
        assert_eq!((blocks, threads), (129, 320));
        assert!(blocks as usize * GEMV_K2048_WARPS >= 1281);
        // more rows than warps on the GPU: one block per SM, the warps loop
        assert_eq!(k2048_row_launch(5000, 132).0, 132);
        assert_eq!(k2048_row_launch(1, 132).0, 1);
    }

    #[test]
    fn pair_blocks_of_two_rows_fit_the_padding_of_one() {
        // gemv_q_pair2's second row (its half of x and sums) fits in the shared memory a
        // gemv_q_pair block is padded to, so both launch with the same size
        assert_eq!(
            pair_rows_smem(PAIR_K, 2) - pair_smem(PAIR_K),
            x_bytes_smem(PAIR_K / 2) + 8 * 16 * 4 - 32 * 4
        );
        assert!(pair_rows_smem(PAIR_K, 2) <= PAIR_MIN_SMEM);
    }

    #[test]
    fn resident_gemv_launches_fit_and_leave_room_for_the_next() {
        let (sms, smem) = (132, 232_448);
        // GDN in_proj (12352 rows, K 2048): 772 tiles, at most 6 per block; two blocks fit on an
        // SM (228 KB, 1 KB reserved per block)
        let (blocks, per_block, bytes) = resident_launch(772, 2048, sms, smem, 1).unwrap();
        assert_eq!((blocks, per_block), (132, 6));
        // one block per SM, the rest free for the neighbouring launches
        assert!(
            2 * (bytes + 1024) > 233_472 && bytes + 1024 + 110 * 1024 <= 233_472,
            "{bytes}"
        );
        // the output projections (2048 rows, K 4096): one tile per block
        let (blocks, per_block, _) = resident_launch(128, 4096, sms, smem, 1).unwrap();
        assert_eq!((blocks, per_block), (128, 1));
        // an lm_head-sized launch does not fit; K the kernel does not take; nothing to run
        assert_eq!(resident_launch(15_520, 2048, sms, smem, 1), None);
        assert_eq!(resident_launch(64, 1024, sms, smem, 1), None);
        assert_eq!(resident_launch(64, 6144, sms, smem, 1), None);
        assert_eq!(resident_launch(0, 2048, sms, smem, 1), None);
        // less shared memory than the padding: padded only up to what a block may take
        assert_eq!(
            resident_launch(128, 4096, sms, 100_000, 1).unwrap().2,
            100_000
        );
        // two rows (gemv_q_resident2): the second row's x beside the same tiles
        let (_, per_block2, bytes2) = resident_launch(772, 2048, sms, smem, 2).unwrap();
        assert_eq!(per_block2, 6);
        let raw2 =
            6 * tile_smem(2048) + 2 * x_bytes_smem(2048) - 32 * 4 + 8 * RESIDENT_MAX_STREAMED;
        assert_eq!(bytes2, raw2.max(RESIDENT_MIN_SMEM));
        assert!(bytes2 >= bytes && bytes2 <= smem);
    }

    #[test]
    fn pair_blocks_hold_a_whole_tile_and_half_of_x() {
        // the harness's figure for gemv_q_pair at K = 4096 (bench/kernels/gemv_pair.cu, whose
        // blocks also held the peer's 16 sums: 41,928)
        assert_eq!(pair_smem(4096), 41_864);
        assert!(pair_smem(PAIR_K) < PAIR_MIN_SMEM);
    }

    #[test]
    fn ring_launch_streams_the_lm_head_in_stages_that_fit() {
        let (sms, smem) = (132, 232_448);
        // the lm_head: 248,320 rows at K 2048
        let (blocks, stages, bytes) = ring_launch(15_520, 2048, sms, smem, 1).unwrap();
        assert_eq!(blocks, sms);
        assert!(stages >= 4 && bytes <= smem, "{stages} stages in {bytes} B");
        // one more stage would not fit
        let stage = RING_TILES * (16 * (1024 + 2 * 32 * 2) + 8 * 16 * 4) + 16;
        assert!(bytes + stage > smem);
        // a short run takes only the stages its tiles need (with room for more)
        assert_eq!(ring_launch(16 * sms, 2048, sms, 1 << 20, 1).unwrap().1, 8);
        assert_eq!(ring_launch(15_520, 1024, sms, smem, 1), None);
        assert_eq!(ring_launch(15 * sms, 2048, sms, smem, 1), None);
        assert_eq!(ring_launch(15_520, 2048, sms, 40_000, 1), None);
        // two rows: each row's partial sums and x beside the same stages
        let (_, stages2, bytes2) = ring_launch(15_520, 2048, sms, smem, 2).unwrap();
        assert!(stages2 >= 2 && bytes2 <= smem);
        let stage2 = RING_TILES * (tile_smem(2048) + 2 * 8 * 16 * 4) + 16;
        assert_eq!(bytes2 - stages2 * stage2, 2 * x_bytes_smem(2048) - 32 * 4);
        assert!(bytes2 + stage2 > smem);
    }

    #[test]
    fn moe_experts_blocks_fit_two_per_sm_beside_an_early_resident_gemv_block() {
        // its static shared memory (moe.cu): the shared expert's h, padded and in the two-byte
        // form, the tiles' partial sums and the warps' sums of squares (the routed h goes through
        // the gate/up tiles' space: experts_fit); the dynamic part is moe_gate_up's
        const EXPERTS_STATIC_SMEM: usize = (576 * 4 + 64 * 16 + 8 * 8) + 2 * 8 * 16 * 4 + 8 * 4;
        for hidden in [512, 1024, 2048] {
            let block = gate_up_smem(hidden) + EXPERTS_STATIC_SMEM + 1024;
            assert!(2 * block + RESIDENT_MIN_SMEM + 1024 <= 233_472, "{hidden}");
        }
        assert_eq!(EXPERTS_STATIC_SMEM, 4448);
    }

    #[test]
    fn moe_experts_takes_the_real_and_tiny_shapes() {
        let mut c = qwen36();
        assert!(experts_fit(&c));
        c.num_experts_per_tok = 4;
        c.hidden_size = 512;
        assert!(experts_fit(&c));
        // 8 tiles per block: more than its warps can split
        c.hidden_size = 4096;
        assert!(!experts_fit(&c));
        c.hidden_size = 2048;
        c.moe_intermediate_size = 1024;
        assert!(!experts_fit(&c));
        // h's staging for the slot's meeting would outgrow the gate tile's codes
        c.hidden_size = 128;
        c.moe_intermediate_size = 128;
        assert!(!experts_fit(&c));
    }

    #[test]
    fn the_routed_experts_launch_takes_the_real_and_tiny_shapes() {
        let mut c = qwen36();
        // 256 blocks, 1,281 rows: 6 for block 0, 5 for the rest, every block a router row
        assert_eq!((route_rows(&c), gate_up_blocks(&c)), (1281, 256));
        assert!(routed_fit(&c));
        // the tiny preset: 16 experts, top-4, hidden 512: 128 blocks of 1,041 rows
        c.num_experts = 16;
        c.num_experts_per_tok = 4;
        c.hidden_size = 512;
        assert!(routed_fit(&c));
        // 32 blocks for 1,041 rows: 33 a block, past the staging space
        c.num_experts_per_tok = 1;
        assert!(!routed_fit(&c));
        // more than 256 experts: warp 0 holds 8 logits a lane
        let mut c = qwen36();
        c.num_experts = 512;
        assert!(!routed_fit(&c));
        let mut c = qwen36();
        c.shared_expert_intermediate_size = 1024;
        assert!(!routed_fit(&c));
        // (experts of 384 rows admit a hidden size of 768: its rows' scales are 24 bytes)
        let mut c = qwen36();
        c.moe_intermediate_size = 384;
        c.shared_expert_intermediate_size = 384;
        c.hidden_size = 768;
        assert!(experts_fit(&c) && !routed_fit(&c));
    }

    #[test]
    fn the_moe_form_follows_the_environment_within_what_fits() {
        use MoeForm::*;
        assert_eq!(MoeForm::choose(None, true, true).unwrap(), Routed);
        assert_eq!(MoeForm::choose(Some("router"), true, true).unwrap(), Router);
        assert_eq!(MoeForm::choose(Some("pair"), true, true).unwrap(), Pair);
        assert_eq!(MoeForm::choose(None, true, false).unwrap(), Router);
        assert_eq!(MoeForm::choose(Some("routed"), false, false).unwrap(), Pair);
        assert_eq!(MoeForm::choose(Some("router"), false, false).unwrap(), Pair);
        let err = MoeForm::choose(Some("fused"), true, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("OSPREY_DECODE_MOE=fused"), "{err}");
    }

    #[test]
    fn moe_gate_up_blocks_fit_two_per_sm_at_every_admitted_hidden_size() {
        for hidden in [512usize, 1024, 2048, 4096] {
            // quads of 4 groups per tile; two blocks (and their reserved 1 KB) in 228 KB
            assert!((hidden / 64).is_multiple_of(4), "{hidden}");
            assert!(2 * (gate_up_smem(hidden) + 1024) <= 233_472, "{hidden}");
        }
        // the full model (H 2048): codes 32 KB, scales and biases 4 KB, x 4.3 KB
        assert_eq!(
            gate_up_smem(2048),
            32_768 + 4_096 + 4_096 + 256 + 1_024 + 128 + 128 + 8
        );
    }

    fn qwen36() -> ModelConfig {
        ModelConfig::from_json_str(include_str!("../../../assets/qwen3.6-35b-a3b/config.json"))
            .expect("the bundled config parses")
    }

    #[test]
    fn the_model_shape_is_supported() {
        check_shapes(&qwen36()).expect("Qwen3.6-35B-A3B runs on the CUDA kernels");
    }

    #[test]
    fn the_embed_kernel_takes_the_model_rows_and_names_wider_ones() {
        check_embed(2048, 4, 64).unwrap();
        check_embed(4096, 8, 64).unwrap();
        let err = check_embed(8192, 8, 64).unwrap_err().to_string();
        assert!(err.contains("8-bit rows of 8192"), "{err}");
        assert!(check_embed(2048, 4, 4).is_err());
    }

    #[test]
    fn unsupported_shapes_are_named() {
        let mut c = qwen36();
        c.shared_expert_intermediate_size = 1024;
        let err = check_shapes(&c).unwrap_err().to_string();
        assert!(err.contains("shared expert width 1024"), "{err}");

        let mut c = qwen36();
        c.vocab_size = SAMPLE_PARTS * SAMPLE_MAX_SLICE + 1;
        let err = check_shapes(&c).unwrap_err().to_string();
        assert!(err.contains("vocabulary"), "{err}");

        let mut c = qwen36();
        c.head_dim = 128;
        c.hidden_size = 1000;
        let err = check_shapes(&c).unwrap_err().to_string();
        assert!(
            err.contains("head_dim 128") && err.contains("hidden size 1000"),
            "{err}"
        );

        let mut c = qwen36();
        c.conv_kernel = 3;
        let err = check_shapes(&c).unwrap_err().to_string();
        assert!(err.contains("conv kernel 3"), "{err}");
    }
}
