//! Kernel parameter blocks, laid out exactly as the `struct`s in kernels/*.cu (repr(C), device
//! pointers as u64). Each is passed by value as the kernel's single parameter.

use cudarc::driver::DeviceRepr;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct Segment {
    pub codes: u64,
    pub scales: u64,
    pub biases: u64,
    pub out: u64,
    pub rows: i32,
    pub bits: i32,
    pub accumulate: i32,
    pub pad: i32,
}

pub const MAX_SEGS: usize = 4;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct GemvArgs {
    pub seg: [Segment; MAX_SEGS],
    pub x: u64,
    pub norm_weight: u64,
    pub gate_z: u64,
    pub head_norm: u64,
    pub eps: f32,
    pub nseg: i32,
    pub k: i32,
    pub group: i32,
    pub head_dim: i32,
    pub tiles: i32,
    /// 1: each block asks L2 for its share of the weights before waiting on its predecessor.
    pub prefetch: i32,
    /// gemv_q_resident: tiles a block holds in shared memory (at least its share).
    pub stages: i32,
    /// The lm_head launch: its `TokenChoice` (device address), 0 elsewhere.
    pub choice: u64,
    /// gemv_q, gemv_q_tiles: block 0 writes the normalised input here (the MoE router launch,
    /// for moe_experts); 0 elsewhere.
    pub normed: u64,
    /// gemv_q_resident2, gemv_q_ring2: the second activation row, its token choice and each
    /// segment's output for it.
    pub x1: u64,
    pub choice1: u64,
    pub out1: [u64; MAX_SEGS],
    /// gemv_q_pair2: the second row's gate input.
    pub gate_z1: u64,
}

/// gemv.cu `TokenChoice`: the greedy token choice fused into the lm_head launch (one per
/// decoder; `best` and `done` are cleared by the kernel after each step).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct TokenChoice {
    pub best: u64,
    pub done: u32,
    pub n: i32,
    pub sampling: u64,
    pub token: u64,
    pub pos: u64,
    pub history: u64,
    pub step: u64,
    /// 0: only `token` is written (a speculative verify row)
    pub record: i32,
    pub _pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ExpertStack {
    pub codes: u64,
    pub scales: u64,
    pub biases: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct GateUpArgs {
    pub gate: ExpertStack,
    pub up: ExpertStack,
    pub topk: u64,
    pub x: u64,
    pub norm_weight: u64,
    pub eps: f32,
    pub router_logits: u64,
    pub experts: i32,
    pub renorm: i32,
    pub shared_gate_proj: u64,
    pub shared_up_proj: u64,
    pub shared_gate_logit: u64,
    pub h: u64,
    pub hidden: i32,
    pub inter: i32,
    pub k: i32,
}

/// moe.cu `ExpertsArgs`: the routed and shared experts of one MoE block in one launch.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ExpertsArgs {
    pub gate: ExpertStack,
    pub up: ExpertStack,
    pub down: ExpertStack,
    pub shared_down: ExpertStack,
    pub xn: u64,
    pub x: u64,
    pub router_logits: u64,
    pub shared_gate_proj: u64,
    pub shared_up_proj: u64,
    pub shared_gate_logit: u64,
    pub h: u64,
    pub meet: u64,
    pub experts: i32,
    pub renorm: i32,
    pub hidden: i32,
    pub inter: i32,
    pub k: i32,
    /// moe_routed_experts only: the router, the shared expert's gate logit, gate and up rows
    pub route: [RouteMatrix; ROUTE_MATRICES],
    pub norm_weight: u64,
    pub routed: u64,
    pub route_meet: u64,
    pub eps: f32,
}

/// moe.cu ROUTE_MATRICES and ROUTE_MAX_ROWS.
pub const ROUTE_MATRICES: usize = 4;
pub const ROUTE_MAX_ROWS: usize = 16;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct RouteMatrix {
    pub codes: u64,
    pub scales: u64,
    pub biases: u64,
    pub rows: i32,
    pub bits: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct DownArgs {
    pub down: ExpertStack,
    pub shared_down: ExpertStack,
    pub h: u64,
    pub topk: u64,
    pub x: u64,
    pub hidden: i32,
    pub inter: i32,
    pub k: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct GdnArgs {
    pub qkv: u64,
    pub b: u64,
    pub a: u64,
    pub conv_w: u64,
    pub conv_in: u64,
    pub conv_out: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub state: u64,
    pub o: u64,
    pub pos: u64,
    pub hk: i32,
    pub hv: i32,
    pub conv_dim: i32,
    /// the speculative verify step's second state buffer, the current-buffer flag and this
    /// launch's role (gdn.cu); 0 / null in the one-token step
    pub state_alt: u64,
    pub cur: u64,
    pub role: i32,
    pub _pad: i32,
}

/// speculative.cu spec_accept's parameters (device addresses).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct SpecArgs {
    pub chosen: u64,
    pub token0: u64,
    pub token1: u64,
    pub pos0: u64,
    pub pos1: u64,
    pub cur: u64,
    pub context: u64,
    pub record: u64,
    pub answer: u64,
    pub span: u64,
    pub accept: i32,
    pub _pad: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct PrepArgs {
    pub qg: u64,
    pub k: u64,
    pub v: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub q_out: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    /// int8 cache: the row scales `[Hkv, max_pos]`; 0 with the bf16 cache.
    pub k_scale: u64,
    pub v_scale: u64,
    pub pos: u64,
    pub eps: f32,
    pub theta: f32,
    pub hq: i32,
    pub hkv: i32,
    pub rotary: i32,
    pub max_pos: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct DecodeArgs {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub k_scale: u64,
    pub v_scale: u64,
    pub part_acc: u64,
    pub part_ml: u64,
    pub qg: u64,
    pub out: u64,
    pub meet: u64,
    pub pos: u64,
    pub scale: f32,
    pub hq: i32,
    pub hkv: i32,
    pub splits: i32,
    pub max_pos: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct EmbedArgs {
    pub codes: u64,
    pub scales: u64,
    pub biases: u64,
    pub token: u64,
    pub x: u64,
    pub hidden: i32,
    pub group: i32,
    pub bits: i32,
}

/// sample.cu `SampleParams`: the sampling settings the captured step reads every replay.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub presence: f32,
    pub frequency: f32,
    pub repetition: f32,
    pub top_k: i32,
    /// 1: sample_token chooses; 0: the lm_head launch chooses greedily (gemv.cu TokenChoice).
    pub active: i32,
    pub seed: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct SampleArgs {
    pub params: u64,
    pub logits: u64,
    pub seen: u64,
    pub output: u64,
    pub token: u64,
    pub pos: u64,
    pub history: u64,
    pub step: u64,
    pub n: i32,
    pub cand_v: u64,
    pub cand_i: u64,
    pub parts: i32,
    pub pad: i32,
}

/// sample.cu `SummaryArgs`: a scored prefill's rows of logits summarised for prompt
/// log-probabilities (`logit_partials` + `logit_merge`).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct SummaryArgs {
    pub logits: u64,
    pub next: u64,
    pub out: u64,
    pub partials: u64,
    pub vocab: i32,
    pub valid: i32,
    pub top: i32,
    pub pad: i32,
}

/// ceiling.cu `ReadArgs`: the streaming-read probe.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ReadArgs {
    pub src: u64,
    pub vectors: u64,
    pub sink: u64,
    pub key: u32,
    pub pad: i32,
}

/// gemm.cu `GemmArgs`: the prefill GEMM, dense or grouped by expert.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct GemmArgs {
    pub a: u64,
    pub a_rows: u64,
    pub codes: [u64; 2],
    pub scales: [u64; 2],
    pub biases: [u64; 2],
    pub expert_rows: i64,
    pub tiles: u64,
    pub tile_count: u64,
    pub out: u64,
    pub out_h: u64,
    pub row_scale: u64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub group: i32,
    pub ldo: i32,
    pub epilogue: i32,
    /// 1, or the number of K splits (partial sums reduced by `gemm_reduce`).
    pub k_splits: i32,
    pub pad: i32,
}

/// wgmma.cuh `TensorMap`: a TMA tensor map as `cuTensorMapEncodeTiled` writes it (opaque).
#[repr(C, align(64))]
#[derive(Clone, Copy, Default, Debug)]
pub struct TensorMap {
    pub opaque: [u64; 16],
}

/// gemm.cu `WgmmaArgs`: gemm_q4_wgmma's GEMM arguments and the tensor maps of its copies.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct WgmmaArgs {
    pub p: GemmArgs,
    /// Activations [positions, K] bf16, box 64 x 128, 128-byte swizzle (not gathered).
    pub x: TensorMap,
    /// The same with boxes of 32 positions (a grouped tile's positions past 128).
    pub x_tail: TensorMap,
    /// Code words [rows, K / 8], box 8 x 256 (SwiGLU: 8 x 128 of each matrix).
    pub codes: [TensorMap; 2],
    /// Scales and biases [rows, K / 64] bf16, box 8 x 256 (SwiGLU: 8 x 128).
    pub scales: [TensorMap; 2],
    pub biases: [TensorMap; 2],
}

/// gemm.cu `ReduceArgs`: the split-K reduction.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ReduceArgs {
    pub partials: u64,
    pub out: u64,
    pub m: i32,
    pub n: i32,
    pub ldo: i32,
    pub splits: i32,
    pub add: i32,
}

pub const EPI_STORE: i32 = 0;
pub const EPI_ADD: i32 = 1;
pub const EPI_SWIGLU: i32 = 2;
pub const EPI_SCALED: i32 = 3;

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct RouteArgs {
    pub logits: u64,
    pub ids: u64,
    pub weights: u64,
    pub counts: u64,
    pub fill: u64,
    pub offsets: u64,
    pub tiles: u64,
    pub tile_count: u64,
    pub a_rows: u64,
    pub row_weight: u64,
    pub slot_pos: u64,
    pub act: u64,
    pub gate_codes: u64,
    pub gate_scales: u64,
    pub gate_biases: u64,
    pub shared_gate: u64,
    pub t: i32,
    pub e: i32,
    pub k: i32,
    pub renorm: i32,
    pub bm: i32,
    pub max_tiles: i32,
    pub h: i32,
    pub gate_bits: i32,
    pub gate_group: i32,
    /// route_plan: an expert's last rows, when at most this many, join its last full tile.
    pub tail: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct CombineMoeArgs {
    pub x: u64,
    pub y: u64,
    pub slot_pos: u64,
    pub shared: u64,
    pub shared_gate: u64,
    pub next_norm: u64,
    pub act: u64,
    pub eps: f32,
    pub t: i32,
    pub h: i32,
    pub k: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct EmbedRowsArgs {
    pub codes: u64,
    pub scales: u64,
    pub biases: u64,
    pub tokens: u64,
    pub x: u64,
    pub hidden: i32,
    pub group: i32,
    pub bits: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct NormArgs {
    pub x: u64,
    pub weight: u64,
    pub z: u64,
    pub out: u64,
    pub eps: f32,
    pub k: i32,
    pub ldx: i32,
    pub head_dim: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct GdnPrefillArgs {
    pub qkv: u64,
    pub conv_out: u64,
    pub conv_w: u64,
    pub state_in: u64,
    pub state_out: u64,
    pub b: u64,
    pub a: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    pub gates: u64,
    pub state: u64,
    pub o: u64,
    pub t: i32,
    pub conv_dim: i32,
    pub kernel: i32,
    pub hk: i32,
    pub hv: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct GdnChunkArgs {
    pub conv_out: u64,
    pub gates: u64,
    pub wy: u64,
    pub u_new: u64,
    pub m: u64,
    pub g_cum: u64,
    pub chunk_states: u64,
    pub state: u64,
    pub z: u64,
    pub norm: u64,
    pub out: u64,
    pub eps: f32,
    pub t: i32,
    pub conv_dim: i32,
    pub hk: i32,
    pub hv: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct AttnPrepRowsArgs {
    pub qg: u64,
    pub k: u64,
    pub v: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub q_out: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    /// int8 cache: the row scales `[Hkv, max_pos]`; 0 with the bf16 cache.
    pub k_scale: u64,
    pub v_scale: u64,
    pub eps: f32,
    pub theta: f32,
    pub start: i32,
    pub hq: i32,
    pub hkv: i32,
    pub rotary: i32,
    pub max_pos: i32,
}

/// attention_prefill.cu `KvExpandArgs`: the int8 cache's first rows as bf16.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct KvExpandArgs {
    pub k_cache: u64,
    pub v_cache: u64,
    pub k_scale: u64,
    pub v_scale: u64,
    pub k_out: u64,
    pub v_out: u64,
    pub positions: i32,
    pub hkv: i32,
    pub max_pos: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct AttnPrefillArgs {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub qg: u64,
    pub out: u64,
    pub scale_log2: f32,
    pub t: i32,
    pub start: i32,
    pub hq: i32,
    pub hkv: i32,
}

/// attention_prefill.cu `WgmmaAttnArgs`: attn_prefill_wgmma's arguments and the tensor maps of its
/// K and V caches ([start + T positions][KV heads][D], boxes of 64 dims x 1 head x 64 keys,
/// 128-byte swizzle).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct WgmmaAttnArgs {
    pub a: AttnPrefillArgs,
    pub k: TensorMap,
    pub v: TensorMap,
}

// SAFETY: plain-old-data with the C layout of the matching kernel structs.
unsafe impl DeviceRepr for GemvArgs {}
unsafe impl DeviceRepr for GateUpArgs {}
unsafe impl DeviceRepr for DownArgs {}
unsafe impl DeviceRepr for ExpertsArgs {}
unsafe impl DeviceRepr for GdnArgs {}
unsafe impl DeviceRepr for SpecArgs {}
unsafe impl DeviceRepr for PrepArgs {}
unsafe impl DeviceRepr for DecodeArgs {}
unsafe impl DeviceRepr for EmbedArgs {}
unsafe impl DeviceRepr for TokenChoice {}
unsafe impl DeviceRepr for SampleParams {}
unsafe impl DeviceRepr for SampleArgs {}
unsafe impl DeviceRepr for SummaryArgs {}
unsafe impl DeviceRepr for GemmArgs {}
unsafe impl DeviceRepr for WgmmaArgs {}
unsafe impl DeviceRepr for ReduceArgs {}
unsafe impl DeviceRepr for RouteArgs {}
unsafe impl DeviceRepr for CombineMoeArgs {}
unsafe impl DeviceRepr for EmbedRowsArgs {}
unsafe impl DeviceRepr for NormArgs {}
unsafe impl DeviceRepr for GdnPrefillArgs {}
unsafe impl DeviceRepr for AttnPrepRowsArgs {}
unsafe impl DeviceRepr for GdnChunkArgs {}
unsafe impl DeviceRepr for AttnPrefillArgs {}
unsafe impl DeviceRepr for KvExpandArgs {}
unsafe impl DeviceRepr for WgmmaAttnArgs {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_kernel_structs() {
        // sizes computed from the C declarations in kernels/*.cu (x86-64 / CUDA ABI)
        assert_eq!(std::mem::size_of::<Segment>(), 48);
        assert_eq!(
            std::mem::size_of::<GemvArgs>(),
            4 * 48 + 4 * 8 + 8 * 4 + 2 * 8 + 2 * 8 + 4 * 8 + 8
        );
        assert_eq!(
            std::mem::size_of::<TokenChoice>(),
            8 + 4 + 4 + 5 * 8 + 2 * 4
        );
        assert_eq!(
            std::mem::size_of::<GateUpArgs>(),
            2 * 24 + 3 * 8 + 8 + 8 + 2 * 4 + 4 * 8 + 4 * 4
        );
        assert_eq!(std::mem::size_of::<DownArgs>(), 2 * 24 + 3 * 8 + 3 * 4 + 4);
        assert_eq!(std::mem::size_of::<RouteMatrix>(), 3 * 8 + 2 * 4);
        assert_eq!(
            std::mem::size_of::<ExpertsArgs>(),
            4 * 24 + 8 * 8 + 5 * 4 + 4 + 4 * 32 + 3 * 8 + 4 + 4
        );
        assert_eq!(
            std::mem::size_of::<GdnArgs>(),
            11 * 8 + 3 * 4 + 4 + 2 * 8 + 2 * 4
        );
        assert_eq!(std::mem::size_of::<SpecArgs>(), 10 * 8 + 2 * 4);
        assert_eq!(std::mem::size_of::<PrepArgs>(), 11 * 8 + 24);
        assert_eq!(std::mem::size_of::<DecodeArgs>(), 11 * 8 + 20 + 4);
        assert_eq!(std::mem::size_of::<SampleParams>(), 8 * 4 + 8);
        assert_eq!(std::mem::size_of::<SampleArgs>(), 8 * 8 + 8 + 2 * 8 + 2 * 4);
        assert_eq!(std::mem::size_of::<SummaryArgs>(), 4 * 8 + 4 * 4);
        assert_eq!(std::mem::size_of::<GemmArgs>(), 14 * 8 + 8 * 4);
        // GemmArgs padded to the maps' 64-byte alignment, then 8 maps of 128 bytes
        assert_eq!(std::mem::size_of::<WgmmaArgs>(), 192 + 8 * 128);
        assert_eq!(std::mem::size_of::<ReduceArgs>(), 2 * 8 + 5 * 4 + 4);
        assert_eq!(std::mem::size_of::<RouteArgs>(), 16 * 8 + 10 * 4);
        assert_eq!(std::mem::size_of::<CombineMoeArgs>(), 7 * 8 + 4 * 4);
        assert_eq!(std::mem::size_of::<EmbedRowsArgs>(), 5 * 8 + 3 * 4 + 4);
        assert_eq!(std::mem::size_of::<NormArgs>(), 4 * 8 + 4 * 4);
        assert_eq!(std::mem::size_of::<GdnPrefillArgs>(), 12 * 8 + 5 * 4 + 4);
        assert_eq!(std::mem::size_of::<AttnPrepRowsArgs>(), 10 * 8 + 7 * 4 + 4);
        assert_eq!(std::mem::size_of::<KvExpandArgs>(), 6 * 8 + 3 * 4 + 4);
        assert_eq!(std::mem::size_of::<GdnChunkArgs>(), 11 * 8 + 5 * 4 + 4);
        assert_eq!(std::mem::size_of::<AttnPrefillArgs>(), 5 * 8 + 5 * 4 + 4);
        assert_eq!(std::mem::size_of::<WgmmaAttnArgs>(), 64 + 2 * 128);
    }
}
