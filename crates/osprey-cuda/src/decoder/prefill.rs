//! Prefill on the GPU: a prompt runs in chunks of up to `chunk` tokens, each chunk through every
//! layer as a handful of batched kernels (tensor-core GEMMs on the stored 4/8-bit weights, the
//! GDN conv + chunked (WY) recurrence on the tensor cores, causal flash attention over the cache,
//! routing grouped on the GPU), continuing the same device state (KV cache, conv and recurrent
//! state) that the decode step uses. Only the last position's logits are computed. Scratch memory is bounded by
//! the chunk size, whatever the prompt length.

use anyhow::{bail, Context, Result};
use cudarc::driver::{sys, CudaEvent, CudaFunction, CudaSlice, LaunchConfig};

use super::{launch_cfg, CudaDecoder, DevLinear, DevMatrix, LayerDev, Prologue};
use crate::args::*;
use osprey_engine::sampler::PositionLogprobs;

/// Flash-attention tiles: shared memory Q 128x264 + 2 x (K 64x264 + V 64x264) bf16.
const ATTN_SMEM_BYTES: usize = (128 + 4 * 64) * 264 * 2;
/// attn_prefill_wgmma: Q 128x256 + 2 x (K 64x256 + V 64x256) bf16, unpadded, and the K and V
/// buffers' mbarriers.
const ATTN_WGMMA_SMEM_BYTES: usize = (128 + 4 * 64) * 256 * 2 + 4 * 8;
const ATTN_QUERY_TILE: usize = 128;
/// Tokens per chunk of the chunked GDN form, and its kernels' shared memory (f32; the row strides
/// 132, 136, 68 and 40 of gdn_prefill.cu).
const GDN_CHUNK: usize = 64;
/// Prep: K and Q (later V) 64x132, A 64x68, G and β.
const GDN_CHUNK_PREP_SMEM_BYTES: usize = (2 * 64 * 132 + 64 * 68 + 2 * 64) * 4;
/// State pass: two stages of (W 64x132, K 64x136, U 64x40, G 64), S 128x40, U' 64x40, decays 64.
const GDN_CHUNK_STATE_SMEM_BYTES: usize =
    (2 * (64 * 132 + 64 * 136 + 64 * 40 + 64) + (128 + 64) * 40 + 64) * 4;
/// Output: Q 64x132, S 128x136, M 64x68, U' 64x136, G 64, sums of squares 2x64, z 64x136.
const GDN_CHUNK_OUT_SMEM_BYTES: usize =
    (64 * 132 + 128 * 136 + 64 * 68 + 2 * 64 * 136 + 3 * 64) * 4;

/// gemm_q4_wgmma: 5 ring slots of (activations 160x128 bytes, codes 256x32, an mbarrier), two
/// buffers of 8 groups' scales and biases 256x32, two dequantised weight tiles 256x128 bytes.
const GEMM_WGMMA_SMEM_BYTES: usize = 5 * (160 * 128 + 256 * 32 + 8) + 2 * 256 * 32 + 2 * 256 * 128;
/// Positions a grouped gemm_q4_wgmma tile may take past its 128: an expert's last rows, when this
/// few, join its last full tile instead of costing a block of their own.
const WGMMA_TAIL: usize = 32;
/// Tile height / 8 of gemm_q4_wgmma (128 positions).
const WGMMA_MT: usize = 16;

/// route_plan's tail for a plan of tile height `mt` / 8: gemm_q4_wgmma's tiles take an expert's
/// last few rows, the mma.sync kernels' none.
fn plan_tail(mt: usize) -> i32 {
    if mt == WGMMA_MT {
        WGMMA_TAIL as i32
    } else {
        0
    }
}
/// Rows per expert (on average) from which the grouped gate/up GEMM runs gemm_q4_wgmma (at 64 per
/// expert, a 2K prompt, half its 128-position tiles' rows are empty and it still wins: gate/up
/// 23.0 -> 19.3 ms over 40 layers; from 16 rows, even with tiles as wide as their rows, a 1K
/// prompt lost: 24.0K -> 22.2K tok/s).
const WGMMA_FROM_ROWS_PER_EXPERT: usize = 48;

/// Where the prefill runs warpgroup MMA (the rest on mma.sync): `OSPREY_PREFILL_WGMMA=0` nowhere,
/// `dense` in the dense projections only, `gemm` in the dense projections and the grouped expert
/// gate/up GEMM, otherwise (the default) also in attention (attn_prefill_wgmma). For ablations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Wgmma {
    dense: bool,
    grouped: bool,
    attention: bool,
}

impl Wgmma {
    pub(super) fn from_env() -> Self {
        let (dense, grouped, attention) = match std::env::var("OSPREY_PREFILL_WGMMA").as_deref() {
            Ok("0") => (false, false, false),
            Ok("dense") => (true, false, false),
            Ok("gemm") => (true, true, false),
            _ => (true, true, true),
        };
        Wgmma {
            dense,
            grouped,
            attention,
        }
    }
}

/// Which form of the Gated DeltaNet recurrence the prefill runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnPrefill {
    /// The form measured fastest: the chunked form from `AUTO_CHUNKED_FROM` tokens of a prompt
    /// chunk, the register scan below (`osprey bench prefill` times both forms up to 16K).
    Auto,
    /// Token by token, the state in registers.
    Recurrent,
    /// 64-token chunks (WY form) on the tensor cores.
    Chunked,
}

/// Prompt-chunk length from which `Auto` runs the chunked GDN form.
const AUTO_CHUNKED_FROM: usize = GDN_CHUNK;

impl GdnPrefill {
    /// Whether a prompt chunk of `tokens` runs the chunked form.
    fn chunked(self, tokens: usize) -> bool {
        match self {
            GdnPrefill::Auto => tokens >= AUTO_CHUNKED_FROM,
            GdnPrefill::Recurrent => false,
            GdnPrefill::Chunked => true,
        }
    }
}

/// Split-K partial sums: a dense launch splits only when it has fewer blocks than SMs, so its
/// positions × outputs stay below 132 blocks × 64 × 256; at most 8 splits.
const MAX_K_SPLITS: usize = 8;
const PARTIAL_FLOATS: usize = MAX_K_SPLITS * 132 * 64 * 256;

/// Positions whose logits a scored prefill computes at once, by one lm_head GEMM (its weights
/// read once for them), before summarising or copying them back (16 MB on the device at the
/// real vocabulary, and as much page-locked on the host when rows come back; allocated on
/// first use).
pub(super) const SCORED_ROWS: usize = 16;

/// sample.cu SUMMARY_THREADS: logit_partials' and logit_merge's block.
const SUMMARY_THREADS: u32 = 256;

/// sample.cu SUMMARY_PARTS and SUMMARY_MAX_SLICE: the slices logit_partials splits a row into,
/// and the most ids one holds.
const SUMMARY_PARTS: usize = 128;
const SUMMARY_MAX_SLICE: usize = 2048;

/// Most alternatives a position's summary on the device holds (sample.cu SUMMARY_MAX_TOP: the
/// APIs ask at most 20).
pub(super) const MAX_SUMMARY_TOP: usize = 20;

/// The slices' partial summaries of the rows summarised at once (at most SCORED_ROWS).
pub(super) fn summary_partials_len() -> usize {
    SCORED_ROWS * SUMMARY_PARTS * summary_width(MAX_SUMMARY_TOP)
}

/// An error unless `top` alternatives fit a summary on the device.
pub(super) fn check_summary_top(top: usize) -> Result<()> {
    if top > MAX_SUMMARY_TOP {
        bail!("at most {MAX_SUMMARY_TOP} alternatives a position are summarised on the GPU, {top} asked");
    }
    Ok(())
}

/// Floats of one position's summary with `top` alternatives (sample.cu SummaryArgs.out).
pub(super) fn summary_width(top: usize) -> usize {
    2 + 2 * top
}

/// One position's summary as `summarise_logits` wrote it (`next`: the token whose logit it
/// holds).
pub(super) fn position_logprobs(s: &[f32], next: Option<u32>) -> PositionLogprobs {
    PositionLogprobs {
        log_normaliser: s[0],
        next: next.map(|_| s[1]),
        top: s[2..]
            .chunks_exact(2)
            .map_while(|p| {
                u32::try_from(p[0].to_bits() as i32)
                    .ok()
                    .map(|id| (id, p[1]))
            })
            .collect(),
    }
}

/// sample.cu NO_NEXT: a position with no token after it.
const NO_NEXT: u32 = u32::MAX;

/// What a scored prefill keeps of each position's logits.
pub(super) enum Scoring<'a> {
    /// Every row, appended (`[positions, vocab]`).
    Rows(&'a mut Vec<f32>),
    /// Each row summarised on the device by `summarise_logits` into `out` (`2 + 2 top` floats a
    /// position, in the order of the call's tokens; `next`: the token after each position).
    Summaries {
        next: CudaSlice<u32>,
        out: CudaSlice<f32>,
        valid: usize,
        top: usize,
    },
}

pub(super) struct PrefillKernels {
    gemm4: [CudaFunction; 3],
    gemm4_wgmma: CudaFunction,
    logit_partials: CudaFunction,
    logit_merge: CudaFunction,
    gemm_reduce: CudaFunction,
    gemm8: [CudaFunction; 2],
    embed_rows: CudaFunction,
    norm_bf16: CudaFunction,
    gated_norm_bf16: CudaFunction,
    route_topk: CudaFunction,
    route_plan: CudaFunction,
    route_scatter: CudaFunction,
    moe_combine: CudaFunction,
    gdn_conv_qk_gates: CudaFunction,
    gdn_conv_state: CudaFunction,
    gdn_scan: CudaFunction,
    gdn_chunk_prep: CudaFunction,
    gdn_chunk_state: CudaFunction,
    gdn_chunk_out: CudaFunction,
    attn_prep_rows: CudaFunction,
    kv_expand_int8: CudaFunction,
    attn_prefill: CudaFunction,
    attn_prefill_wgmma: CudaFunction,
}

impl PrefillKernels {
    pub(super) fn load(func: &dyn Fn(&str, &str) -> Result<CudaFunction>) -> Result<Self> {
        // a kernel that takes more than 48 KB of dynamic shared memory must say so
        let with_smem = |module: &str, name: &str, bytes: usize| -> Result<CudaFunction> {
            let f = func(module, name)?;
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )?;
            Ok(f)
        };
        let attn_prefill = with_smem("attention_prefill", "attn_prefill", ATTN_SMEM_BYTES)?;
        let attn_prefill_wgmma = with_smem(
            "attention_prefill",
            "attn_prefill_wgmma",
            ATTN_WGMMA_SMEM_BYTES,
        )?;
        let gdn_chunk_prep = with_smem("gdn_prefill", "gdn_chunk_prep", GDN_CHUNK_PREP_SMEM_BYTES)?;
        let gdn_chunk_state =
            with_smem("gdn_prefill", "gdn_chunk_state", GDN_CHUNK_STATE_SMEM_BYTES)?;
        let gdn_chunk_out = with_smem("gdn_prefill", "gdn_chunk_out", GDN_CHUNK_OUT_SMEM_BYTES)?;
        let gemm4_wgmma = with_smem("gemm", "gemm_q4_wgmma", GEMM_WGMMA_SMEM_BYTES)?;
        Ok(PrefillKernels {
            gemm4_wgmma,
            logit_partials: func("sample", "logit_partials")?,
            logit_merge: func("sample", "logit_merge")?,
            gemm4: [
                func("gemm", "gemm_q4_m2")?,
                func("gemm", "gemm_q4_m4")?,
                func("gemm", "gemm_q4_m8")?,
            ],
            gemm8: [func("gemm", "gemm_q8_m2")?, func("gemm", "gemm_q8_m8")?],
            gemm_reduce: func("gemm", "gemm_reduce")?,
            embed_rows: func("act", "embed_rows")?,
            norm_bf16: func("act", "norm_bf16")?,
            gated_norm_bf16: func("act", "gated_norm_bf16")?,
            route_topk: func("route", "route_topk")?,
            route_plan: func("route", "route_plan")?,
            route_scatter: func("route", "route_scatter")?,
            moe_combine: func("route", "moe_combine")?,
            gdn_conv_qk_gates: func("gdn_prefill", "gdn_conv_qk_gates")?,
            gdn_conv_state: func("gdn_prefill", "gdn_conv_state")?,
            gdn_scan: func("gdn_prefill", "gdn_scan")?,
            gdn_chunk_prep,
            gdn_chunk_state,
            gdn_chunk_out,
            attn_prep_rows: func("attention_prefill", "attn_prep_rows")?,
            kv_expand_int8: func("attention_prefill", "kv_expand_int8")?,
            attn_prefill,
            attn_prefill_wgmma,
        })
    }
}

/// Activations of one chunk (sizes for `chunk` tokens).
pub(super) struct PrefillScratch {
    chunk: usize,
    max_tiles: usize,
    tokens: CudaSlice<i32>,
    x: CudaSlice<f32>,
    act: CudaSlice<u16>,
    /// GDN qkv projections, or the attention q|gate projections.
    proj: CudaSlice<f32>,
    /// GDN conv output, or the attention output.
    mixed: CudaSlice<f32>,
    z: CudaSlice<f32>,
    b: CudaSlice<f32>,
    a: CudaSlice<f32>,
    gates: CudaSlice<f32>,
    y: CudaSlice<f32>,
    wy: CudaSlice<f32>,
    u_new: CudaSlice<f32>,
    m: CudaSlice<f32>,
    g_cum: CudaSlice<f32>,
    chunk_states: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    q_bf16: CudaSlice<u16>,
    router: CudaSlice<f32>,
    shared_gate: CudaSlice<f32>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    counts: CudaSlice<i32>,
    fill: CudaSlice<i32>,
    offsets: CudaSlice<i32>,
    /// Two GEMM tile plans over the same grouping: for the gate/up projection, and for the down
    /// projection when its tile height differs (otherwise it reuses the first).
    tiles: [CudaSlice<i32>; 2],
    tile_count: [CudaSlice<i32>; 2],
    a_rows: CudaSlice<i32>,
    row_weight: CudaSlice<f32>,
    slot_pos: CudaSlice<i32>,
    expert_h: CudaSlice<u16>,
    expert_y: CudaSlice<u16>,
    /// Split-K partial sums of small dense GEMMs.
    partials: CudaSlice<f32>,
    shared_h: CudaSlice<u16>,
    shared_y: CudaSlice<f32>,
    pub(super) bytes: usize,
}

/// A GEMM over rows grouped by expert (route.cu's plan).
#[derive(Clone, Copy)]
struct Grouped {
    /// Tile height / 8 of the plan.
    mt: usize,
    /// Rows between consecutive experts of the weight stack.
    expert_rows: usize,
    /// A row of each position (0: the position itself).
    a_rows: u64,
    /// Routing weight of each position (0: none).
    row_scale: u64,
    /// Which of the two plans.
    plan: usize,
}

/// A TMA tensor map over the packed tensor at `base` of `dims` elements of `dtype` (bf16 or
/// 32-bit words; innermost first, e.g. [columns, rows]), copied in boxes of `boxes` elements;
/// `swizzle`: the 128-byte swizzle (rows of 128 bytes, as wgmma reads them).
fn tensor_map<const R: usize>(
    base: u64,
    dtype: sys::CUtensorMapDataType,
    dims: [usize; R],
    boxes: [u32; R],
    swizzle: bool,
) -> Result<TensorMap> {
    use sys::CUtensorMapDataType as T;
    let elem_bytes = if dtype == T::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 {
        2
    } else {
        4
    };
    let global_dims = dims.map(|d| d as u64);
    // bytes between consecutive indices of each outer dimension
    let mut strides = [0u64; R];
    let mut stride = elem_bytes as u64;
    for i in 1..R {
        stride *= dims[i - 1] as u64;
        strides[i - 1] = stride;
    }
    let element_strides = [1u32; R];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: encoding only writes `map` from the arrays, which outlive the call; the device
    // address is not touched until a kernel copies through the map
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            R as u32,
            base as *mut std::ffi::c_void,
            global_dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            if swizzle {
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
            } else {
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
            },
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        bail!("TMA tensor map over {dims:?} elements in boxes of {boxes:?}: {r:?}");
    }
    // SAFETY: written by the successful encode above
    let map = unsafe { map.assume_init() };
    Ok(TensorMap { opaque: map.opaque })
}

/// gemm_q4_wgmma's arguments for the launch `g` over the matrices of `w`: the tensor maps the
/// kernel reads, those of the activations (unless gathered through `a_rows`; the 32-position boxes
/// only for a grouped launch, whose tiles may have a tail) and, per matrix (two for SwiGLU), of
/// its codes, scales and biases from the launch's first row (a grouped launch: every expert's).
fn wgmma_args(g: GemmArgs, w: &[&DevLinear], positions: usize, grouped: bool) -> Result<WgmmaArgs> {
    use sys::CUtensorMapDataType as T;
    let (bf16, word) = (
        T::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        T::CU_TENSOR_MAP_DATA_TYPE_UINT32,
    );
    let swiglu = g.epilogue == EPI_SWIGLU;
    let box_rows = if swiglu { 128 } else { 256 };
    let k = g.k as usize;
    let mut args = WgmmaArgs {
        p: g,
        ..Default::default()
    };
    if g.a_rows == 0 {
        args.x = tensor_map(g.a, bf16, [k, positions], [64, 128], true)?;
        if grouped {
            args.x_tail = tensor_map(g.a, bf16, [k, positions], [64, WGMMA_TAIL as u32], true)?;
        }
    }
    for i in 0..if swiglu { 2 } else { 1 } {
        let l = w.get(i).copied().unwrap_or(w[0]);
        let rows = if grouped { l.m.rows() - l.row0 } else { l.rows };
        args.codes[i] = tensor_map(g.codes[i], word, [k / 8, rows], [8, box_rows], false)?;
        args.scales[i] = tensor_map(g.scales[i], bf16, [k / 64, rows], [8, box_rows], false)?;
        args.biases[i] = tensor_map(g.biases[i], bf16, [k / 64, rows], [8, box_rows], false)?;
    }
    Ok(args)
}

/// Whether gemm_q4_wgmma takes a weight matrix: 4-bit group-64 codes, K a multiple of 512 (its
/// scales and biases are staged 8 groups at a time), whole blocks of `rows_per_block` rows.
fn wgmma_fits(bits: u32, group: usize, cols: usize, rows: usize, rows_per_block: usize) -> bool {
    bits == 4 && group == 64 && cols.is_multiple_of(512) && rows.is_multiple_of(rows_per_block)
}

/// K splits of a dense gemm_q4_wgmma launch of `blocks` blocks over `groups` 64-wide K groups: none
/// when the blocks make half a wave, else the fewest (each a whole number of the kernel's 8-group
/// scale batches) that do; `None` when even 8 splits do not (mma.sync takes the launch). Measured
/// at a 256-token prompt over 30 layers: GDN in_proj 4.4 -> 3.2 ms, out_proj 2.2 -> 1.2 ms (the
/// mma.sync kernel's 16-position tiles dequantised every weight 16 times: instruction-bound).
fn wgmma_k_splits(blocks: usize, groups: usize, sms: usize) -> Option<usize> {
    [1, 2, 4, 8]
        .into_iter()
        .find(|&s| groups.is_multiple_of(8 * s) && 2 * blocks * s >= sms)
}

/// Position-tile height (8·MT rows) of the GEMM for about `rows` rows per weight matrix.
fn m_tiles(rows: usize) -> usize {
    if rows >= 48 {
        8
    } else if rows >= 20 {
        4
    } else {
        2
    }
}

type Events<'a> = Option<&'a mut Vec<(&'static str, CudaEvent, CudaEvent)>>;

impl CudaDecoder {
    /// Makes sure the scratch holds chunks of `chunk` tokens (grown, never shrunk).
    fn prefill_scratch(&mut self, chunk: usize) -> Result<()> {
        if self.prefill.as_ref().is_some_and(|s| s.chunk >= chunk) {
            return Ok(());
        }
        self.prefill = None;
        let c = &self.cfg;
        let st = &self.stream;
        let (h, d) = (c.hidden_size, c.head_dim);
        let (hq, hkv) = (c.num_attention_heads, c.num_key_value_heads);
        let vdim = c.linear_value_dim();
        let k = c.num_experts_per_tok;
        let max_k = h.max(vdim).max(hq * d);
        let max_tiles = (chunk * k).div_ceil(16) + c.num_experts;
        let f32s = [
            ("x", chunk * h),
            ("proj", chunk * c.conv_dim().max(2 * hq * d)),
            ("mixed", chunk * c.conv_dim().max(hq * d)),
            ("z", chunk * vdim),
            ("b", chunk * c.linear_num_value_heads),
            ("a", chunk * c.linear_num_value_heads),
            ("gates", chunk * c.linear_num_value_heads * 4),
            ("y", chunk * vdim),
            (
                "wy",
                chunk * c.linear_num_value_heads * 2 * c.linear_value_head_dim,
            ),
            (
                "u_new",
                chunk * c.linear_num_value_heads * c.linear_value_head_dim,
            ),
            ("m", chunk * c.linear_num_value_heads * GDN_CHUNK),
            (
                "g_cum",
                chunk.div_ceil(GDN_CHUNK) * GDN_CHUNK * c.linear_num_value_heads,
            ),
            (
                "chunk_states",
                chunk.div_ceil(GDN_CHUNK)
                    * c.linear_num_value_heads
                    * c.linear_key_head_dim
                    * c.linear_value_head_dim,
            ),
            ("k", chunk * hkv * d),
            ("v", chunk * hkv * d),
            ("router", chunk * c.num_experts),
            ("shared_gate", chunk),
            ("weights", chunk * k),
            ("row_weight", chunk * k),
            ("shared_y", chunk * h),
        ];
        let bytes = 4 * (f32s.iter().map(|(_, n)| n).sum::<usize>() + PARTIAL_FLOATS)
            + 2 * (chunk * max_k
                + chunk * k * h
                + chunk * hq * d
                + chunk * k * c.moe_intermediate_size
                + chunk * c.shared_expert_intermediate_size)
            + 4 * (chunk + 4 * chunk * k + 3 * c.num_experts + 8 * max_tiles + 2);
        let f = |n: usize| -> Result<CudaSlice<f32>> { Ok(st.alloc_zeros::<f32>(n)?) };
        let i = |n: usize| -> Result<CudaSlice<i32>> { Ok(st.alloc_zeros::<i32>(n)?) };
        let hb = |n: usize| -> Result<CudaSlice<u16>> { Ok(st.alloc_zeros::<u16>(n)?) };
        self.prefill = Some(PrefillScratch {
            chunk,
            max_tiles,
            tokens: i(chunk)?,
            x: f(f32s[0].1)?,
            act: hb(chunk * max_k)?,
            proj: f(f32s[1].1)?,
            mixed: f(f32s[2].1)?,
            z: f(f32s[3].1)?,
            b: f(f32s[4].1)?,
            a: f(f32s[5].1)?,
            gates: f(f32s[6].1)?,
            y: f(f32s[7].1)?,
            wy: f(f32s[8].1)?,
            u_new: f(f32s[9].1)?,
            m: f(f32s[10].1)?,
            g_cum: f(f32s[11].1)?,
            chunk_states: f(f32s[12].1)?,
            k: f(f32s[13].1)?,
            v: f(f32s[14].1)?,
            q_bf16: hb(chunk * hq * d)?,
            router: f(f32s[15].1)?,
            shared_gate: f(f32s[16].1)?,
            ids: i(chunk * k)?,
            weights: f(f32s[17].1)?,
            counts: i(c.num_experts)?,
            fill: i(c.num_experts)?,
            offsets: i(c.num_experts)?,
            tiles: [i(4 * max_tiles)?, i(4 * max_tiles)?],
            tile_count: [i(1)?, i(1)?],
            a_rows: i(chunk * k)?,
            row_weight: f(f32s[18].1)?,
            slot_pos: i(chunk * k)?,
            expert_h: hb(chunk * k * c.moe_intermediate_size)?,
            expert_y: hb(chunk * k * h)?,
            partials: f(PARTIAL_FLOATS)?,
            shared_h: hb(chunk * c.shared_expert_intermediate_size)?,
            shared_y: f(f32s[19].1)?,
            bytes,
        });
        Ok(())
    }

    /// Chooses the GDN form of later prefills (measurements and checks; the default is `Auto`).
    pub fn set_gdn_prefill(&mut self, form: GdnPrefill) {
        self.gdn_prefill = form;
    }

    /// Scratch bytes the prefill holds (after the first prefill; bounded by the chunk size).
    pub fn prefill_scratch_bytes(&self) -> Option<usize> {
        self.prefill.as_ref().map(|s| s.bytes)
    }

    /// Runs `tokens` at positions `start..` through the model in chunks of at most `chunk`
    /// tokens, leaving the device state at position `start + tokens.len()` and the last token's
    /// logits in the logits buffer (read them with `logits`). The caller keeps `start` equal to
    /// the number of tokens the device state holds.
    pub fn prefill(&mut self, start: usize, tokens: &[u32], chunk: usize) -> Result<()> {
        self.prefill_profiled(start, tokens, chunk, None, None)
    }

    /// `prefill`, also returning every position's logits, `[tokens.len(), vocab]` (row i: the
    /// logits after token i): each chunk's rows of the residual stream go through the final
    /// norm and the lm_head (a GEMM on bf16 input, as the prefill's other projections; the last
    /// position's logits, left as `prefill` leaves them, take the decode step's GEMV), and come
    /// back `SCORED_ROWS` rows at a time.
    pub fn prefill_scored(
        &mut self,
        start: usize,
        tokens: &[u32],
        chunk: usize,
    ) -> Result<Vec<f32>> {
        let mut all = Vec::with_capacity(tokens.len() * self.cfg.vocab_size);
        self.prefill_profiled(
            start,
            tokens,
            chunk,
            None,
            Some(&mut Scoring::Rows(&mut all)),
        )?;
        Ok(all)
    }

    /// `prefill`, summarising every position's logits for prompt log-probabilities where the
    /// lm_head writes them (`summarise_logits`: the softmax's log normaliser over the ids below
    /// `valid`, the logit of the token after the position — `tokens[i + 1]`, then `following`
    /// — and the `top` largest), so that only the summaries come back. The last position's
    /// logits are left as `prefill` leaves them (read them with `logits`).
    pub fn prefill_logprobs(
        &mut self,
        start: usize,
        tokens: &[u32],
        chunk: usize,
        following: Option<u32>,
        valid: usize,
        top: usize,
    ) -> Result<Vec<PositionLogprobs>> {
        check_summary_top(top)?;
        let next: Vec<u32> = (0..tokens.len())
            .map(|i| tokens.get(i + 1).copied().or(following).unwrap_or(NO_NEXT))
            .collect();
        let width = summary_width(top);
        let mut scoring = Scoring::Summaries {
            next: self.stream.clone_htod(&next)?,
            out: self.stream.alloc_zeros::<f32>(tokens.len() * width)?,
            valid: valid.min(self.cfg.vocab_size),
            top,
        };
        self.prefill_profiled(start, tokens, chunk, None, Some(&mut scoring))?;
        let Scoring::Summaries { out, .. } = scoring else {
            unreachable!("built as summaries above")
        };
        let out = self.stream.clone_dtoh(&out)?;
        Ok(out
            .chunks_exact(width)
            .zip(&next)
            .map(|(s, &after)| position_logprobs(s, (after != NO_NEXT).then_some(after)))
            .collect())
    }

    /// The first `rows` rows of the prefill's residual stream (the chunk just run, whose first
    /// position is the call's `first_position`) through the final norm and the lm_head, kept
    /// as `scoring` says.
    fn score_rows(
        &mut self,
        rows: usize,
        first_position: usize,
        scoring: &mut Scoring,
    ) -> Result<()> {
        let (vocab, h) = (self.cfg.vocab_size, self.cfg.hidden_size);
        if self.scored.is_none() {
            self.scored = Some(self.stream.alloc_zeros::<f32>(SCORED_ROWS * vocab)?);
        }
        if matches!(scoring, Scoring::Rows(_)) && self.scored_host.is_none() {
            // SAFETY: page-locked host memory read only after the copy into it has completed
            let host = unsafe {
                self.ctx
                    .alloc_pinned_with_flags::<f32>(SCORED_ROWS * vocab, 0)?
            };
            self.scored_host = Some(host);
        }
        // the final norm on every row at once (bf16, the GEMM's input), then the lm_head as one
        // GEMM per SCORED_ROWS positions: its 286 MB read once for them, not once a position
        let scratch = self.prefill.as_ref().expect("allocated by the prefill");
        let (x, act) = (self.p(&scratch.x), self.p(&scratch.act));
        self.norm_to_bf16(x, self.p(&self.final_norm), h, h, rows, act)?;
        for first in (0..rows).step_by(SCORED_ROWS) {
            let n = SCORED_ROWS.min(rows - first);
            let out = self.p(self.scored.as_ref().expect("allocated above"));
            let a = act + (first * h * 2) as u64;
            self.gemm(&[&self.lm_head], a, n, EPI_STORE, out, vocab, None)?;
            match scoring {
                Scoring::Rows(all) => {
                    let device = self.scored.as_ref().expect("allocated above");
                    let host = self.scored_host.as_mut().expect("allocated above");
                    let host = &mut host.as_mut_slice()?[..n * vocab];
                    self.stream.memcpy_dtoh(&device.slice(..n * vocab), host)?;
                    self.stream.synchronize()?;
                    all.extend_from_slice(host);
                }
                Scoring::Summaries {
                    next,
                    out: summaries,
                    valid,
                    top,
                } => {
                    let at = first_position + first;
                    self.summarise_logits(
                        n,
                        out,
                        self.p(next) + (at * 4) as u64,
                        self.p(summaries) + (at * summary_width(*top) * 4) as u64,
                        *valid,
                        *top,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The summaries of `rows` rows of logits at `logits` (`[rows, vocab]`, rows at most
    /// SCORED_ROWS): each row's over the ids below `valid`, with the logit of the id at `next`
    /// (one a row; an id of NO_NEXT: none) and the `top` largest, into `out`
    /// (`summary_width(top)` floats a row), by `logit_partials` (each row in SUMMARY_PARTS
    /// slices) and `logit_merge`.
    pub(super) fn summarise_logits(
        &self,
        rows: usize,
        logits: u64,
        next: u64,
        out: u64,
        valid: usize,
        top: usize,
    ) -> Result<()> {
        if rows > SCORED_ROWS || top > MAX_SUMMARY_TOP || valid > SUMMARY_PARTS * SUMMARY_MAX_SLICE
        {
            bail!(
                "logit summaries take at most {SCORED_ROWS} rows, {MAX_SUMMARY_TOP} alternatives and {} ids ({rows}, {top}, {valid} asked)",
                SUMMARY_PARTS * SUMMARY_MAX_SLICE
            );
        }
        let args = SummaryArgs {
            logits,
            next,
            out,
            partials: self.p(&self.summary_partials),
            vocab: self.cfg.vocab_size as i32,
            valid: valid as i32,
            top: top as i32,
            pad: 0,
        };
        self.launch(
            &self.pk.logit_partials,
            launch_cfg((SUMMARY_PARTS as u32, rows as u32), SUMMARY_THREADS),
            &args,
        )?;
        self.launch(
            &self.pk.logit_merge,
            launch_cfg((rows as u32, 1), SUMMARY_THREADS),
            &args,
        )
    }

    /// `prefill` with each launch bracketed by events (time per kernel family).
    pub fn profile_prefill(
        &mut self,
        start: usize,
        tokens: &[u32],
        chunk: usize,
    ) -> Result<Vec<super::KernelTime>> {
        let mut events = Vec::new();
        self.prefill_profiled(start, tokens, chunk, Some(&mut events), None)?;
        self.synchronize()?;
        super::sum_events(&events)
    }

    fn prefill_profiled(
        &mut self,
        start: usize,
        tokens: &[u32],
        chunk: usize,
        mut events: Events,
        mut scored: Option<&mut Scoring>,
    ) -> Result<()> {
        if tokens.is_empty() {
            bail!("prefill needs at least one token");
        }
        if chunk == 0 {
            bail!("the prefill chunk size must be at least 1");
        }
        let end = start + tokens.len();
        if end > self.max_context {
            bail!(
                "the context is full: {end} tokens, {} allocated on the GPU (raise --max-context)",
                self.max_context
            );
        }
        let chunk = chunk.min(tokens.len());
        self.prefill_scratch(chunk)?;
        let vocab = self.cfg.vocab_size;
        for (n, part) in tokens.chunks(chunk).enumerate() {
            if let Some(&bad) = part.iter().find(|&&t| t as usize >= vocab) {
                bail!("token id {bad} is outside the vocabulary ({vocab})");
            }
            let ids: Vec<i32> = part.iter().map(|&t| t as i32).collect();
            let scratch = self.prefill.as_mut().expect("allocated above");
            self.stream.memcpy_htod(&ids, &mut scratch.tokens)?;
            self.issue_chunk(start + n * chunk, part.len(), &mut events)?;
            if let Some(scoring) = scored.as_deref_mut() {
                self.score_rows(part.len(), n * chunk, scoring)?;
            }
        }
        // logits of the last token: final norm + lm_head on its row of the residual stream
        let s = self.prefill.as_ref().expect("allocated above");
        let last = (tokens.len() - 1) % chunk;
        let x_last = self.p(&s.x) + (last * self.cfg.hidden_size * 4) as u64;
        let lm = self
            .lm_head
            .segment(self.p(&self.s.logits), false, &self.stream);
        let group = self.lm_head.m.group;
        timed(self, &mut events, "lm_head (last position)", |d| {
            d.gemv(
                &[lm],
                x_last,
                Prologue::RmsNorm(d.p(&d.final_norm)),
                d.cfg.hidden_size,
                group,
            )
        })?;
        self.set_position(end.min(self.max_context - 1))?;
        Ok(())
    }

    /// One GEMM launch: `a` (bf16 perm64, K wide) times the rows of `w` (or of each routed
    /// expert with `grouped`), with the given epilogue.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        w: &[&DevLinear],
        a: u64,
        positions: usize,
        epilogue: i32,
        out: u64,
        ldo: usize,
        grouped: Option<Grouped>,
    ) -> Result<()> {
        let m = &w[0].m;
        let at = |l: &DevLinear| l.m.at(l.row0, &self.stream);
        let w1 = w.get(1).copied().unwrap_or(w[0]);
        let (s0, s1) = (at(w[0]), at(w1));
        let mut g = GemmArgs {
            a,
            codes: [s0.codes, s1.codes],
            scales: [s0.scales, s1.scales],
            biases: [s0.biases, s1.biases],
            m: positions as i32,
            n: w[0].rows as i32,
            k: m.cols as i32,
            group: m.group as i32,
            ldo: ldo as i32,
            epilogue,
            k_splits: 1,
            ..Default::default()
        };
        // the bf16 epilogues: SwiGLU (perm64) and the routed down projection
        if epilogue == EPI_SWIGLU || epilogue == EPI_SCALED {
            g.out_h = out;
        } else {
            g.out = out;
        }
        let s = self.prefill.as_ref().expect("prefill scratch");
        // 8-bit kernels come in tile heights 16 and 64 only
        let fit = |mt: usize| if m.bits == 8 && mt == 4 { 2 } else { mt };
        let rows_per_block = if epilogue == EPI_SWIGLU { 128 } else { 256 };
        let blocks_x = w[0].rows.div_ceil(rows_per_block);
        let wgmma_fits = wgmma_fits(m.bits, m.group, m.cols, w[0].rows, rows_per_block);
        let wgmma_tiles = positions.div_ceil(8 * WGMMA_MT);
        // at least half a wave of blocks: one block of 256 rows x 128 positions on wgmma beats the
        // mma.sync kernel's 2+ blocks per SM on the same work; short prompts split K to get there
        let wgmma_splits = if wgmma_fits && self.wgmma.dense && grouped.is_none() {
            let splittable =
                (epilogue == EPI_STORE || epilogue == EPI_ADD) && positions >= 8 * WGMMA_MT;
            wgmma_k_splits(blocks_x * wgmma_tiles, m.cols / 64, self.sms)
                .filter(|&s| s == 1 || (splittable && s * positions * w[0].rows <= PARTIAL_FLOATS))
        } else {
            None
        };
        let (mt, blocks_y) = match grouped {
            None if wgmma_splits.is_some() => (WGMMA_MT, wgmma_tiles),
            None => {
                // shorter position tiles when the launch would not fill the GPU twice over (short
                // prompts, narrow outputs such as the router): a few long blocks are latency-bound
                let mut mt = fit(m_tiles(positions));
                while mt > 2 && blocks_x * positions.div_ceil(8 * mt) < 2 * self.sms {
                    mt = fit(mt / 2);
                }
                (mt, positions.div_ceil(8 * mt))
            }
            Some(gr) => {
                if gr.mt == WGMMA_MT && !wgmma_fits {
                    bail!("grouped GEMM: 128-position tiles need 4-bit group-64 weights in whole blocks");
                }
                if fit(gr.mt) != gr.mt {
                    bail!(
                        "grouped GEMM: the plan's tile height has no {}-bit kernel",
                        m.bits
                    );
                }
                g.expert_rows = gr.expert_rows as i64;
                g.tiles = self.p(&s.tiles[gr.plan]);
                g.tile_count = self.p(&s.tile_count[gr.plan]);
                g.a_rows = gr.a_rows;
                g.row_scale = gr.row_scale;
                // the plan fills at most this many slots (every expert adds at most one partial
                // tile); the rest of the scratch's slots, sized for 16-row tiles, need no blocks
                let slots = positions.div_ceil(8 * gr.mt) + self.cfg.num_experts;
                (gr.mt, slots.min(s.max_tiles))
            }
        };
        let func = match (m.bits, mt) {
            (4, WGMMA_MT) => &self.pk.gemm4_wgmma,
            (4, 2) => &self.pk.gemm4[0],
            (4, 4) => &self.pk.gemm4[1],
            (4, _) => &self.pk.gemm4[2],
            (8, 2) => &self.pk.gemm8[0],
            (8, _) => &self.pk.gemm8[1],
            (b, _) => bail!("{b}-bit weights are not supported by the prefill GEMM"),
        };
        // a dense launch of a handful of blocks splits K (measured at 256 tokens: the router's 16
        // long, latency-bound blocks took 3.2 ms over 40 layers, split 8 ways 1.0 ms; splitting
        // launches of 32-128 blocks measured no better, so they keep whole K)
        let groups = m.cols / 64;
        let mut splits = wgmma_splits.unwrap_or(1);
        let few_blocks = blocks_x * blocks_y * 8 <= self.sms;
        if grouped.is_none()
            && mt != WGMMA_MT
            && few_blocks
            && (epilogue == EPI_STORE || epilogue == EPI_ADD)
        {
            let blocks = blocks_x * blocks_y;
            splits = self
                .sms
                .div_ceil(blocks.max(1))
                .min(groups / 4)
                .clamp(1, MAX_K_SPLITS);
            while splits > 1 && splits * positions * w[0].rows > PARTIAL_FLOATS {
                splits -= 1;
            }
        }
        let reduce = ReduceArgs {
            partials: self.p(&s.partials),
            out,
            m: positions as i32,
            n: w[0].rows as i32,
            ldo: ldo as i32,
            splits: splits as i32,
            add: i32::from(epilogue == EPI_ADD),
        };
        if splits > 1 {
            g.k_splits = splits as i32;
            g.out = reduce.partials;
            g.ldo = reduce.n;
            g.epilogue = EPI_STORE;
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks_x as u32, blocks_y as u32, splits as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        if mt == WGMMA_MT {
            let args = wgmma_args(g, w, positions, grouped.is_some())?;
            let cfg = LaunchConfig {
                shared_mem_bytes: GEMM_WGMMA_SMEM_BYTES as u32,
                ..cfg
            };
            self.launch(func, cfg, &args)?;
        } else {
            self.launch(func, cfg, &g)?;
        }
        if splits > 1 {
            let cells = positions * w[0].rows;
            self.launch(
                &self.pk.gemm_reduce,
                launch_cfg((cells.div_ceil(256) as u32, 1), 256),
                &reduce,
            )?;
        }
        Ok(())
    }

    fn norm_to_bf16(
        &self,
        x: u64,
        weight: u64,
        k: usize,
        ldx: usize,
        rows: usize,
        out: u64,
    ) -> Result<()> {
        let na = NormArgs {
            x,
            weight,
            out,
            eps: self.cfg.rms_norm_eps,
            k: k as i32,
            ldx: ldx as i32,
            ..Default::default()
        };
        self.launch(&self.pk.norm_bf16, launch_cfg((rows as u32, 1), 256), &na)?;
        Ok(())
    }

    /// Every kernel of one chunk of `t` tokens at positions `start..start + t`.
    fn issue_chunk(&self, start: usize, t: usize, events: &mut Events) -> Result<()> {
        let c = &self.cfg;
        let s = self.prefill.as_ref().expect("prefill scratch");
        let st = &self.stream;
        let (h, d) = (c.hidden_size, c.head_dim);
        let (hq, hkv) = (c.num_attention_heads, c.num_key_value_heads);
        let (hv, vdim) = (c.linear_num_value_heads, c.linear_value_dim());
        let x = self.p(&s.x);
        let act = self.p(&s.act);

        let emb = self.embed.at(0, st);
        let ea = EmbedRowsArgs {
            codes: emb.codes,
            scales: emb.scales,
            biases: emb.biases,
            tokens: self.p(&s.tokens),
            x,
            hidden: h as i32,
            group: self.embed.group as i32,
            bits: self.embed.bits as i32,
        };
        timed(self, events, "embed", |dd| {
            dd.launch(&dd.pk.embed_rows, launch_cfg((t as u32, 1), 256), &ea)?;
            Ok(())
        })?;

        // the first layer's input norm; every later one is written by the previous layer's combine
        let first = self.layers.first().context("a model without layers")?;
        timed(self, events, "rmsnorm -> bf16", |dd| {
            dd.norm_to_bf16(x, dd.p(&first.input_norm), h, h, t, act)
        })?;
        for (i, l) in self.layers.iter().enumerate() {
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
                    let conv_dim = c.conv_dim();
                    timed(self, events, "gemm gdn in_proj (qkv, z, b, a)", |dd| {
                        dd.gemm(&[qkv], act, t, EPI_STORE, dd.p(&s.proj), conv_dim, None)?;
                        dd.gemm(&[z], act, t, EPI_STORE, dd.p(&s.z), vdim, None)?;
                        dd.gemm(&[b], act, t, EPI_STORE, dd.p(&s.b), hv, None)?;
                        dd.gemm(&[a], act, t, EPI_STORE, dd.p(&s.a), hv, None)
                    })?;
                    let ga = GdnPrefillArgs {
                        qkv: self.p(&s.proj),
                        conv_out: self.p(&s.mixed),
                        conv_w: self.p(conv_w),
                        state_in: self.p(&conv[start & 1]),
                        state_out: self.p(&conv[(start + t) & 1]),
                        b: self.p(&s.b),
                        a: self.p(&s.a),
                        a_log: self.p(a_log),
                        dt_bias: self.p(dt_bias),
                        gates: self.p(&s.gates),
                        state: self.p(state),
                        o: self.p(&s.y),
                        t: t as i32,
                        conv_dim: conv_dim as i32,
                        kernel: c.conv_kernel as i32,
                        hk: c.linear_num_key_heads as i32,
                        hv: hv as i32,
                    };
                    let ch_blocks = conv_dim.div_ceil(256) as u32;
                    timed(self, events, "gdn conv + state, qk norm, gates", |dd| {
                        // the conv reads the old state before gdn_conv_state may overwrite it
                        let qk_rows = LaunchConfig {
                            shared_mem_bytes: (2 * c.linear_key_dim() * 4) as u32,
                            ..launch_cfg((t as u32, 1), 256)
                        };
                        dd.launch(&dd.pk.gdn_conv_qk_gates, qk_rows, &ga)?;
                        dd.launch(&dd.pk.gdn_conv_state, launch_cfg((ch_blocks, 1), 256), &ga)?;
                        Ok(())
                    })?;
                    if self.gdn_prefill.chunked(t) {
                        let ca = GdnChunkArgs {
                            conv_out: self.p(&s.mixed),
                            gates: self.p(&s.gates),
                            wy: self.p(&s.wy),
                            u_new: self.p(&s.u_new),
                            m: self.p(&s.m),
                            g_cum: self.p(&s.g_cum),
                            chunk_states: self.p(&s.chunk_states),
                            state: self.p(state),
                            z: self.p(&s.z),
                            norm: self.p(norm),
                            out: act,
                            eps: c.rms_norm_eps,
                            t: t as i32,
                            conv_dim: conv_dim as i32,
                            hk: c.linear_num_key_heads as i32,
                            hv: hv as i32,
                        };
                        let chunks = t.div_ceil(GDN_CHUNK) as u32;
                        let with_smem = |grid_dim: (u32, u32, u32), bytes: usize| LaunchConfig {
                            grid_dim,
                            block_dim: (256, 1, 1),
                            shared_mem_bytes: bytes as u32,
                        };
                        timed(self, events, "gdn chunked (WY) prep", |dd| {
                            let cfg = with_smem((chunks, hv as u32, 1), GDN_CHUNK_PREP_SMEM_BYTES);
                            dd.launch(&dd.pk.gdn_chunk_prep, cfg, &ca)
                        })?;
                        timed(self, events, "gdn chunked (WY) state pass", |dd| {
                            let split = (c.linear_value_head_dim / 32) as u32;
                            let cfg = with_smem((hv as u32, split, 1), GDN_CHUNK_STATE_SMEM_BYTES);
                            dd.launch(&dd.pk.gdn_chunk_state, cfg, &ca)
                        })?;
                        timed(self, events, "gdn chunked (WY) output + gated norm", |dd| {
                            let cfg = with_smem((chunks, hv as u32, 1), GDN_CHUNK_OUT_SMEM_BYTES);
                            dd.launch(&dd.pk.gdn_chunk_out, cfg, &ca)
                        })?;
                    } else {
                        timed(self, events, "gdn scan (delta rule)", |dd| {
                            dd.launch(
                                &dd.pk.gdn_scan,
                                launch_cfg((hv as u32, (c.linear_value_head_dim / 16) as u32), 256),
                                &ga,
                            )?;
                            Ok(())
                        })?;
                        let na = NormArgs {
                            x: self.p(&s.y),
                            weight: self.p(norm),
                            z: self.p(&s.z),
                            out: act,
                            eps: c.rms_norm_eps,
                            k: vdim as i32,
                            ldx: vdim as i32,
                            head_dim: c.linear_value_head_dim as i32,
                        };
                        timed(self, events, "gdn gated norm -> bf16", |dd| {
                            dd.launch(&dd.pk.gated_norm_bf16, launch_cfg((t as u32, 1), 256), &na)?;
                            Ok(())
                        })?;
                    }
                    timed(self, events, "gemm gdn out_proj + residual", |dd| {
                        dd.gemm(&[out], act, t, EPI_ADD, x, h, None)
                    })?;
                }
                LayerDev::Attention {
                    q,
                    k: kp,
                    v,
                    o,
                    q_norm,
                    k_norm,
                    kv,
                } => {
                    timed(self, events, "gemm attn q|k|v", |dd| {
                        dd.gemm(&[q], act, t, EPI_STORE, dd.p(&s.proj), 2 * hq * d, None)?;
                        dd.gemm(&[kp], act, t, EPI_STORE, dd.p(&s.k), hkv * d, None)?;
                        dd.gemm(&[v], act, t, EPI_STORE, dd.p(&s.v), hkv * d, None)
                    })?;
                    let pa = AttnPrepRowsArgs {
                        qg: self.p(&s.proj),
                        k: self.p(&s.k),
                        v: self.p(&s.v),
                        q_norm: self.p(q_norm),
                        k_norm: self.p(k_norm),
                        q_out: self.p(&s.q_bf16),
                        k_cache: self.p(&kv.k),
                        v_cache: self.p(&kv.v),
                        k_scale: self.kv_scale(kv, 0),
                        v_scale: self.kv_scale(kv, 1),
                        eps: c.rms_norm_eps,
                        theta: c.rope_theta as f32,
                        start: start as i32,
                        hq: hq as i32,
                        hkv: hkv as i32,
                        rotary: c.rotary_dim as i32,
                        max_pos: self.max_context as i32,
                    };
                    timed(self, events, "attn q/k norm + rope + kv append", |dd| {
                        dd.launch(
                            &dd.pk.attn_prep_rows,
                            launch_cfg((t as u32, (hq + hkv) as u32), d as u32),
                            &pa,
                        )?;
                        Ok(())
                    })?;
                    // the attention reads bf16: an int8 cache's rows up to the chunk's end are
                    // expanded first
                    let (k_cache, v_cache) = match &self.kv_expanded {
                        None => (self.p(&kv.k), self.p(&kv.v)),
                        Some([k_out, v_out]) => {
                            let ea = KvExpandArgs {
                                k_cache: self.p(&kv.k),
                                v_cache: self.p(&kv.v),
                                k_scale: self.kv_scale(kv, 0),
                                v_scale: self.kv_scale(kv, 1),
                                k_out: self.p(k_out),
                                v_out: self.p(v_out),
                                positions: (start + t) as i32,
                                hkv: hkv as i32,
                                max_pos: self.max_context as i32,
                            };
                            // 8 codes a thread, 256 threads a block; K and V
                            let blocks = ((start + t) * hkv * d).div_ceil(8 * 256) as u32;
                            timed(self, events, "attn int8 kv -> bf16", |dd| {
                                dd.launch(
                                    &dd.pk.kv_expand_int8,
                                    launch_cfg((blocks, 2), 256),
                                    &ea,
                                )?;
                                Ok(())
                            })?;
                            (self.p(k_out), self.p(v_out))
                        }
                    };
                    let fa = AttnPrefillArgs {
                        q: self.p(&s.q_bf16),
                        k_cache,
                        v_cache,
                        qg: self.p(&s.proj),
                        out: self.p(&s.mixed),
                        scale_log2: std::f32::consts::LOG2_E / (d as f32).sqrt(),
                        t: t as i32,
                        start: start as i32,
                        hq: hq as i32,
                        hkv: hkv as i32,
                    };
                    let cfg = LaunchConfig {
                        grid_dim: (t.div_ceil(ATTN_QUERY_TILE) as u32, hq as u32, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: ATTN_SMEM_BYTES as u32,
                    };
                    timed(self, events, "attn flash prefill + gate", |dd| {
                        if dd.wgmma.attention {
                            // the caches as [positions][KV heads][D], up to the chunk's end (the
                            // keys past it read as zeros)
                            let cache_map = |base: u64| {
                                tensor_map(
                                    base,
                                    sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                    [d, hkv, start + t],
                                    [64, 1, 64],
                                    true,
                                )
                            };
                            let args = WgmmaAttnArgs {
                                a: fa,
                                k: cache_map(fa.k_cache)?,
                                v: cache_map(fa.v_cache)?,
                            };
                            let cfg = LaunchConfig {
                                shared_mem_bytes: ATTN_WGMMA_SMEM_BYTES as u32,
                                ..cfg
                            };
                            dd.launch(&dd.pk.attn_prefill_wgmma, cfg, &args)
                        } else {
                            dd.launch(&dd.pk.attn_prefill, cfg, &fa)
                        }
                    })?;
                    timed(self, events, "gemm attn o_proj + residual", |dd| {
                        dd.norm_to_bf16(dd.p(&s.mixed), 0, hq * d, hq * d, t, act)?;
                        dd.gemm(&[o], act, t, EPI_ADD, x, h, None)
                    })?;
                }
            }
            let next_norm = self.layers.get(i + 1).map(|n| self.p(&n.input_norm));
            self.issue_moe(l, s, t, next_norm, events)?;
        }
        Ok(())
    }

    fn issue_moe(
        &self,
        l: &super::LayerWeights,
        s: &PrefillScratch,
        t: usize,
        next_norm: Option<u64>,
        events: &mut Events,
    ) -> Result<()> {
        let c = &self.cfg;
        let st = &self.stream;
        let h = c.hidden_size;
        let k = c.num_experts_per_tok;
        let (x, act) = (self.p(&s.x), self.p(&s.act));
        let m = &l.moe;
        timed(self, events, "rmsnorm -> bf16", |dd| {
            dd.norm_to_bf16(x, dd.p(&l.post_norm), h, h, t, act)
        })?;
        timed(self, events, "gemm router (8-bit)", |dd| {
            dd.gemm(
                &[&m.router],
                act,
                t,
                EPI_STORE,
                dd.p(&s.router),
                c.num_experts,
                None,
            )
        })?;
        let is = c.shared_expert_intermediate_size;
        timed(self, events, "gemm shared expert", |dd| {
            dd.gemm(
                &[&m.shared_gate, &m.shared_up],
                act,
                t,
                EPI_SWIGLU,
                dd.p(&s.shared_h),
                is,
                None,
            )?;
            dd.gemm(
                &[&m.shared_down],
                dd.p(&s.shared_h),
                t,
                EPI_STORE,
                dd.p(&s.shared_y),
                h,
                None,
            )
        })?;
        // tile heights from the rows per expert: gemm_q4_wgmma's 128 (+ a tail of up to 32) from 48
        // rows per expert (the down projection too since its epilogue is staged: 16.4 -> 12.3 ms
        // at 4K over 40 layers, 11.3 with the tails);
        // below, mma.sync with the down projection (K = I, a short loop) on tiles of at most 32
        // rows (measured at 4K: 20.2 vs 25.8 ms over 40 layers)
        let per_expert = t * k / c.num_experts;
        let (mt_up, mt_down) = if self.wgmma.grouped && per_expert >= WGMMA_FROM_ROWS_PER_EXPERT {
            (WGMMA_MT, WGMMA_MT)
        } else {
            let mt = m_tiles(per_expert);
            (mt, mt.min(4))
        };
        // the shared expert gate's single row: route_topk takes its logit per token
        let sg = &m.shared_gate_logit;
        if !matches!(sg.m.bits, 4 | 8) {
            bail!(
                "shared expert gate: {}-bit weights are not supported by the prefill routing",
                sg.m.bits
            );
        }
        let gate = sg.m.at(sg.row0, &self.stream);
        let ra = RouteArgs {
            logits: self.p(&s.router),
            ids: self.p(&s.ids),
            weights: self.p(&s.weights),
            counts: self.p(&s.counts),
            fill: self.p(&s.fill),
            offsets: self.p(&s.offsets),
            tiles: self.p(&s.tiles[0]),
            tile_count: self.p(&s.tile_count[0]),
            a_rows: self.p(&s.a_rows),
            row_weight: self.p(&s.row_weight),
            slot_pos: self.p(&s.slot_pos),
            act,
            gate_codes: gate.codes,
            gate_scales: gate.scales,
            gate_biases: gate.biases,
            shared_gate: self.p(&s.shared_gate),
            t: t as i32,
            e: c.num_experts as i32,
            k: k as i32,
            renorm: c.norm_topk_prob as i32,
            bm: (8 * mt_up) as i32,
            max_tiles: s.max_tiles as i32,
            h: h as i32,
            gate_bits: sg.m.bits as i32,
            gate_group: sg.m.group as i32,
            tail: plan_tail(mt_up),
        };
        // the down projection's tiles are gate/up's unless its tile height differs
        let down_plan = usize::from(mt_down != mt_up);
        timed(self, events, "routing (top-k, plan, scatter)", |dd| {
            // SAFETY: `counts` holds num_experts i32 on this stream's device
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    dd.p(&s.counts),
                    0,
                    4 * c.num_experts,
                    st.cu_stream(),
                )?;
            }
            dd.launch(
                &dd.pk.route_topk,
                launch_cfg((t.div_ceil(8) as u32, 1), 256),
                &ra,
            )?;
            dd.launch(&dd.pk.route_plan, launch_cfg((1, 1), 512), &ra)?;
            if down_plan == 1 {
                let plan = RouteArgs {
                    tiles: dd.p(&s.tiles[1]),
                    tile_count: dd.p(&s.tile_count[1]),
                    bm: (8 * mt_down) as i32,
                    tail: plan_tail(mt_down),
                    ..ra
                };
                dd.launch(&dd.pk.route_plan, launch_cfg((1, 1), 512), &plan)?;
            }
            dd.launch(
                &dd.pk.route_scatter,
                launch_cfg(((t * k).div_ceil(256) as u32, 1), 256),
                &ra,
            )?;
            Ok(())
        })?;
        let inter = c.moe_intermediate_size;
        let whole = |mat: &std::sync::Arc<DevMatrix>, rows: usize| DevLinear {
            m: mat.clone(),
            row0: 0,
            rows,
        };
        let (gate, up, down) = (
            whole(&m.gate, inter),
            whole(&m.up, inter),
            whole(&m.down, h),
        );
        timed(
            self,
            events,
            "gemm experts gate/up + swiglu (grouped)",
            |dd| {
                dd.gemm(
                    &[&gate, &up],
                    act,
                    t * k,
                    EPI_SWIGLU,
                    dd.p(&s.expert_h),
                    inter,
                    Some(Grouped {
                        mt: mt_up,
                        expert_rows: inter,
                        a_rows: dd.p(&s.a_rows),
                        row_scale: 0,
                        plan: 0,
                    }),
                )
            },
        )?;
        timed(self, events, "gemm experts down x weight (grouped)", |dd| {
            dd.gemm(
                &[&down],
                dd.p(&s.expert_h),
                t * k,
                EPI_SCALED,
                dd.p(&s.expert_y),
                h,
                Some(Grouped {
                    mt: mt_down,
                    expert_rows: h,
                    a_rows: 0,
                    row_scale: dd.p(&s.row_weight),
                    plan: down_plan,
                }),
            )
        })?;
        let ca = CombineMoeArgs {
            x,
            y: self.p(&s.expert_y),
            slot_pos: self.p(&s.slot_pos),
            shared: self.p(&s.shared_y),
            shared_gate: self.p(&s.shared_gate),
            next_norm: next_norm.unwrap_or(0),
            act,
            eps: c.rms_norm_eps,
            t: t as i32,
            h: h as i32,
            k: k as i32,
        };
        timed(self, events, "moe combine + residual (+ next norm)", |dd| {
            dd.launch(&dd.pk.moe_combine, launch_cfg((t as u32, 1), 256), &ca)?;
            Ok(())
        })
    }
}

/// Runs `body`, bracketed by events when profiling.
fn timed(
    d: &CudaDecoder,
    events: &mut Events,
    name: &'static str,
    body: impl FnOnce(&CudaDecoder) -> Result<()>,
) -> Result<()> {
    let Some(list) = events.as_deref_mut() else {
        return body(d);
    };
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = d.ctx.new_event(flags)?;
    start.record(&d.stream)?;
    body(d)?;
    let end = d.ctx.new_event(flags)?;
    end.record(&d.stream)?;
    list.push((name, start, end));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdn_form_follows_the_prompt_chunk_length() {
        assert!(!GdnPrefill::Auto.chunked(AUTO_CHUNKED_FROM - 1));
        assert!(GdnPrefill::Auto.chunked(AUTO_CHUNKED_FROM));
        assert!(GdnPrefill::Chunked.chunked(1));
        assert!(!GdnPrefill::Recurrent.chunked(4096));
    }

    #[test]
    fn short_prompts_split_k_to_fill_half_the_gpu_with_wgmma_blocks() {
        // a 4K prompt's in_proj qkv: 32 x 32 blocks, whole K
        assert_eq!(wgmma_k_splits(1024, 32, 132), Some(1));
        // a 256-token prompt: in_proj qkv (64 blocks), z (32), out_proj (16 blocks, K 4096)
        assert_eq!(wgmma_k_splits(64, 32, 132), Some(2));
        assert_eq!(wgmma_k_splits(32, 32, 132), Some(4));
        assert_eq!(wgmma_k_splits(16, 64, 132), Some(8));
        // attention k (512 rows, 4 blocks): 4 splits of 8 groups are not enough -> mma.sync
        assert_eq!(wgmma_k_splits(4, 32, 132), None);
    }

    #[test]
    fn wgmma_takes_the_model_projections_it_can_tile() {
        // GDN in_proj qkv (8192 x 2048), out_proj (2048 x 4096), expert down (2048 x 512)
        assert!(wgmma_fits(4, 64, 2048, 8192, 256));
        assert!(wgmma_fits(4, 64, 4096, 2048, 256));
        assert!(wgmma_fits(4, 64, 512, 2048, 256));
        // expert gate/up through the SwiGLU epilogue: 512 outputs in blocks of 128
        assert!(wgmma_fits(4, 64, 2048, 512, 128));
        // the 8-bit router, in_proj b/a (32 rows), another group size, K not a multiple of 512
        assert!(!wgmma_fits(8, 64, 2048, 256, 256));
        assert!(!wgmma_fits(4, 64, 2048, 32, 256));
        assert!(!wgmma_fits(4, 32, 2048, 8192, 256));
        assert!(!wgmma_fits(4, 64, 1600, 8192, 256));
    }
}
