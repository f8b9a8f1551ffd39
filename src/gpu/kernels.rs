//! WGSL kernels and their launchers.
//!
//! [`Kernels`] builds (and caches) one compute pipeline per [`KernelSpec`]: a kernel
//! family specialized by generated `const`s and preprocessor flags (see
//! [`super::shader`]), in a subgroup or a non-subgroup variant chosen at creation.
//! Each op has a launcher (`MatMulKernel`, `RmsNormKernel`, ...) that
//! - computes the small uniform params struct for a shape (`params`),
//! - builds a bind group from caller-owned buffers (`bind_group`; build once, reuse),
//! - records its dispatch(es) into a caller-provided compute pass (`dispatch`).
//!
//! A runtime can therefore pre-build every bind group of a graph and encode a
//! whole phase in one compute pass; per step only params bytes may change.
//! Every params struct is `Pod`: write it with `queue.write_buffer` or create it
//! with [`Gpu::uniform`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::{BinaryOp, NormScale, UnaryOp};
use markbase_graph::quant::FloatType;

use super::device::{Backend, Gpu, GpuError};
use super::shader::{reflect_bindings, BindKind, Source};
use super::weights::{GpuFormat, GpuWeight};

const COMMON: &str = include_str!("../../wgsl/common.wgsl");
const WEIGHTS: &str = include_str!("../../wgsl/weights.wgsl");
const GEMV: &str = include_str!("../../wgsl/gemv.wgsl");
const GEMM: &str = include_str!("../../wgsl/gemm.wgsl");
const EMBED: &str = include_str!("../../wgsl/embed.wgsl");
const RMSNORM: &str = include_str!("../../wgsl/rmsnorm.wgsl");
const ROPE: &str = include_str!("../../wgsl/rope.wgsl");
const KV_WRITE: &str = include_str!("../../wgsl/kv_write.wgsl");
const ATTENTION: &str = include_str!("../../wgsl/attention.wgsl");
const ATTN_COMBINE: &str = include_str!("../../wgsl/attn_combine.wgsl");
const SPLIT_MERGE: &str = include_str!("../../wgsl/split_merge.wgsl");
const ELEMENTWISE: &str = include_str!("../../wgsl/elementwise.wgsl");
const ROUTING: &str = include_str!("../../wgsl/routing.wgsl");
const MOE_GROUP: &str = include_str!("../../wgsl/moe_group.wgsl");
const COPY: &str = include_str!("../../wgsl/copy.wgsl");
const ARGMAX: &str = include_str!("../../wgsl/argmax.wgsl");
const SAMPLE: &str = include_str!("../../wgsl/sample.wgsl");

/// From this many tokens on, a plain matmul uses the tiled GEMM instead of the GEMV.
pub const GEMM_MIN_T: usize = 8;
/// The GEMM takes 128-row tiles when that still makes this many tiles (`MARKBASE_GEMM_WIDE=0|1`
/// overrides). Measured on the H200 (affine 4-bit, µs): 512 tokens x 3840 rows (240 wide tiles)
/// 2317 against 2834 at 64 rows; 128 x 8192 (128) 337 against 358; 128 x 3840 (60) 1332 against
/// 811.
pub const GEMM_WIDE_MIN_TILES: usize = 96;
/// A GEMM of fewer 64 x 64 tiles than this cuts K into parts (Vulkan: see
/// [`KernelOptions::merge_splits`]) to reach about this many workgroups.
pub const GEMM_SPLIT_WORKGROUPS: usize = 396;
/// Each part of a split GEMM's K holds at least this many elements.
pub const GEMM_SPLIT_MIN_K: usize = 256;

/// Weight rows per GEMM tile (64 tokens each): 128 with the wide tiles, else 64.
fn gemm_tile_rows(wide: bool) -> usize {
    if wide {
        128
    } else {
        64
    }
}

/// Tiles of a GEMM over `rows` weight rows and `t` tokens.
fn gemm_tiles(rows: usize, t: usize, wide: bool) -> usize {
    div_ceil(rows, gemm_tile_rows(wide)) * div_ceil(t, 64)
}

/// Parts of K for a split GEMM of `tiles` 64 x 64 tiles (1: no split); `MARKBASE_GEMM_SPLIT`
/// overrides (0 or 1: none).
pub fn gemm_ksplit(tiles: usize, k: usize) -> usize {
    if let Some(v) = env_u32("MARKBASE_GEMM_SPLIT") {
        return (v as usize).max(1);
    }
    if tiles == 0 || tiles >= GEMM_SPLIT_WORKGROUPS {
        return 1;
    }
    div_ceil(GEMM_SPLIT_WORKGROUPS, tiles).min(k / GEMM_SPLIT_MIN_K).max(1)
}
/// Whether the one-token GEMV walks two blocks per step by default (`MARKBASE_GEMV_BP2=0|1`).
pub const GEMV_BP2: bool = false;

/// From this many rows per weight on, the dual GEMV takes 8 rows of each per workgroup (as
/// many as a plain GEMV) instead of 4: measured on the H200 with the transposed reduction,
/// Gemma 3 12B's 15,360 rows (1,920 workgroups) +3.6% decode and Gemma 4 31B's 21,504 +1.2%;
/// Gemma 3 1B's 6,912 -2.5%, Gemma 4 E2B's 6,144 -4.6%, Gemma 3 270M's 2,048 -9% (too few
/// workgroups to fill the GPU).
pub const GEMV_DUAL_WIDE_N: usize = 14336;

/// Below this many rows per weight, the dual GEMV takes 2 rows of each per workgroup instead
/// of 4: measured on the H200, Gemma 3 270M's 2,048 rows +4.7% decode; Gemma 3 1B's 6,912
/// -3% and Gemma 4 E2B's 6,144 -3.6% (so they keep 4).
pub const GEMV_DUAL_NARROW_N: usize = 4096;

/// Below this many rows in all, the q/k/v GEMV takes 2 rows per workgroup instead of 4:
/// measured on the H200, Gemma 3 270M's and 1B's 1,536 rows +2.6% and +2.2% decode; Gemma 4
/// E2B's 2,560 unchanged.
pub const GEMV_CAT_FEW_ROWS: usize = 2048;

/// A one-token GEMV over fewer than this many groups of 8 rows, with rows of at least
/// [`GEMV_FEW_MIN_K`], takes 4 rows per workgroup: twice the workgroups for a GPU that 8-row
/// groups leave half idle (`MARKBASE_GEMV_FEW=0` turns it off).
pub const GEMV_FEW_GROUPS: usize = 256;
pub const GEMV_FEW_MIN_K: usize = 4096;

fn few_long_rows(n: usize, k: usize) -> bool {
    n.div_ceil(8) < GEMV_FEW_GROUPS && k >= GEMV_FEW_MIN_K && env_on("MARKBASE_GEMV_FEW")
}

/// Whether a GEMV walks half blocks: one token, affine 4-bit, K % 32 == 0, one block per step.
/// Two invocations share each 32-element block, each taking alternate runs of four elements,
/// so that every vec4 load of activations by a subgroup reads whole 32-byte sectors (an
/// invocation's own 128-byte block made each load touch as many lines as it has invocations).
/// Not for the dual GEMV: it reads two weights per step, and whole blocks measured faster.
fn gemv_half(fmt: GpuFormat, tt: u32, xvec: bool, bp2: bool, dual: bool) -> bool {
    tt == 1 && xvec && !bp2 && !dual && matches!(fmt, GpuFormat::Affine { bits: 4, .. })
}

/// A GEMV's reduction consts for `rs` sums per invocation and `wg` invocations: RS, RS2 ..
/// RS16, RED_N, and `XRED` (the transposed subgroup reduction, gemv.wgsl) where `rs` is a power
/// of two up to 16. Measured on the H200 against a `subgroupAdd` per row: the 12B's plain GEMV
/// 25.0 -> 22.1 µs, decode +4.5%.
fn gemv_reduction(s: Source, rs: u32, wg: u32) -> Source {
    s.c("RS", rs)
        .c("RS2", rs / 2)
        .c("RS4", rs / 4)
        .c("RS8", rs / 8)
        .c("RS16", rs / 16)
        .c("RED_N", rs * wg)
        .flag("XRED", rs.is_power_of_two() && rs <= 16)
}

/// Largest head dim the attention kernel takes.
pub const MAX_HEAD_DIM: usize = 512;
/// Largest rotary pair count of the rope params table.
pub const MAX_ROPE_PAIRS: usize = 256;

const ATTN_WG: u32 = 128;
const ELEM_WG: u32 = 256;
const NORM_WG: u32 = 256;

/// weights.wgsl for a second weight (dual and concatenating GEMVs): its bindings 8..11 moved to
/// 12..15 and every binding and function name suffixed `_u`; the shared structs are left out.
fn weights_second() -> &'static str {
    static S: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    S.get_or_init(|| weights_renamed("_u", 4))
}

/// weights.wgsl for a third weight (concatenating GEMV): bindings 16..19, names suffixed `_v`.
fn weights_third() -> &'static str {
    static S: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    S.get_or_init(|| weights_renamed("_v", 8))
}

/// weights.wgsl with its bindings moved by `shift` and its names suffixed, structs left out.
fn weights_renamed(suffix: &str, shift: u32) -> String {
    {
        // every function and binding the file declares
        let names: Vec<&str> = WEIGHTS
            .lines()
            .filter_map(|l| match l.strip_prefix("fn ") {
                Some(rest) => rest.split('(').next(),
                None if l.starts_with("@group(") => l.split("> ").nth(1).and_then(|r| r.split(':').next()),
                None => None,
            })
            .map(str::trim)
            .collect();
        let mut out = String::new();
        let mut in_struct = false;
        for line in WEIGHTS.lines() {
            if line.starts_with("struct ") {
                in_struct = true;
            }
            if in_struct {
                in_struct = line != "}";
                continue;
            }
            let mut l = line.to_string();
            for b in 8..12 {
                l = l.replace(&format!("@binding({b})"), &format!("@binding({})", b + shift));
            }
            // rename whole identifiers
            let mut r = String::with_capacity(l.len() + 8);
            let mut word = String::new();
            let flush = |word: &mut String, r: &mut String| {
                if names.contains(&word.as_str()) {
                    word.push_str(suffix);
                }
                r.push_str(word);
                word.clear();
            };
            for ch in l.chars() {
                if ch.is_ascii_alphanumeric() || ch == '_' {
                    word.push(ch);
                } else {
                    flush(&mut word, &mut r);
                    r.push(ch);
                }
            }
            flush(&mut word, &mut r);
            out.push_str(&r);
            out.push('\n');
        }
        out
    }
}
const MOE_GROUP_WG: u32 = 256;

fn dt_code(t: FloatType) -> u32 {
    match t {
        FloatType::Bf16 => 0,
        FloatType::F16 => 1,
        FloatType::F32 => 2,
    }
}

/// One specialization of a kernel family (its prelude consts and flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelSpec {
    /// `wg` invocations, `rows` rows and `tt` tokens per workgroup; `xvec`: K % 32 == 0;
    /// `bp2`: two 32-element blocks per invocation and step (`tt == 1` only); `half`: half
    /// blocks where the kernel allows them (see `gemv_half`);
    /// `norm`: an RMSNorm of x fused in front (`tt == 1`, not gathered), with its
    /// weight's dtype (`Some(None)`: no weight).
    /// `dual`: two weights (gate and up) whose rows combine as `gelu(gate) * up` (`tt == 1`,
    /// not gathered, not `bp2`).
    Gemv { fmt: GpuFormat, wg: u32, rows: u32, tt: u32, gather: bool, xvec: bool, bp2: bool, norm: Option<Option<FloatType>>, dual: bool, half: bool },
    /// One token, a fused norm (weight dtype `norm`) and `n` (2 or 3) weights of one format
    /// whose outputs lie side by side (`Op::NormMatMul` over q, k and v).
    GemvCat { fmt: GpuFormat, wg: u32, rows: u32, xvec: bool, norm: Option<FloatType>, n: u32, half: bool },
    /// `wide`: 128 rows per workgroup tile instead of 64; `split`: K cut into parts merged by
    /// the last workgroup of each tile (not `wide`; see [`gemm_ksplit`]); `xvec`: K % 4 == 0
    /// (vec4 activation loads).
    Gemm { fmt: GpuFormat, wide: bool, split: bool, xvec: bool },
    /// The GEMM over the pairs of each expert (`Op::GroupedMatMul`).
    GroupedGemm { fmt: GpuFormat },
    Embed { fmt: GpuFormat },
    /// `res`: adds a residual (`Op::RmsNormAdd`); `scalar`: then multiplies by a scalar weight
    /// of that dtype.
    /// `steps`: rows of at most `8 * steps * NORM_WG` values held in registers (1 or 2; 0: any
    /// length, walked in steps).
    RmsNorm { w: Option<FloatType>, res: bool, scalar: Option<FloatType>, steps: u32 },
    /// `norm`: an RMSNorm per head in front (`Op::NormRope`), with its weight's dtype; `cache`:
    /// rows written to KV cache slots (`Op::KvWriteNormRope`).
    Rope { norm: Option<Option<FloatType>>, cache: bool },
    KvWrite,
    /// `dpt` output dims per invocation (`ceil(D / 128)`), `split`: partial outputs; `qrope`:
    /// q's RMSNorm (weight dtype) and RoPE in front (`Op::NormRopeAttention`); `merge` (with
    /// `split`): the last workgroup of each query head to finish merges the partials itself.
    Attention { dpt: u32, split: bool, qrope: Option<Option<FloatType>>, merge: bool, append: bool },
    AttnCombine,
    GeGlu,
    Binary { b: FloatType },
    Unary,
    TopK,
    TopKSoftmax { scale: Option<FloatType> },
    WeightedSum,
    /// `Op::MoeGroup` (one workgroup).
    MoeGroup,
    Copy,
    Argmax { wg: u32 },
    /// `Op::Sample`: stage `stage` of [`super::sample::STAGES`] (see [`super::sample`]).
    Sample { stage: u32 },
}

/// weights.wgsl's consts and flags for `fmt`; `vec2`: the packed words bound as `vec2<u32>` (the
/// GEMV's half blocks, 4-bit affine), else as `vec4<u32>` on the fast paths.
fn weight_source(src: Source, fmt: GpuFormat, fast: bool, k_mult32: bool, vec2: bool) -> Source {
    let (wfmt, fdt) = match fmt {
        GpuFormat::Affine { .. } => (0, 2),
        GpuFormat::Mxfp4 => (1, 2),
        GpuFormat::Mxfp8 => (2, 2),
        GpuFormat::Nvfp4 { .. } => (3, 2),
        GpuFormat::Float(t) => (4, dt_code(t)),
    };
    let sdt = match fmt {
        GpuFormat::Affine { scale, .. } => dt_code(scale),
        _ => 2,
    };
    let bits = if fmt.is_quantized() { fmt.bits() } else { 16 };
    let fast4 = fast && k_mult32 && fmt.is_quantized() && bits == 4;
    let fast8 = fast && k_mult32 && fmt.is_quantized() && bits == 8;
    let fast_bf16 = fast && k_mult32 && fmt == GpuFormat::Float(FloatType::Bf16);
    let fast_f32 = fast && k_mult32 && fmt == GpuFormat::Float(FloatType::F32);
    src.c("WFMT", wfmt)
        .c("WBITS", bits)
        .c("WGROUP", fmt.group())
        .c("SDT", sdt)
        .c("FDT", fdt)
        .flag("W_FLOAT", !fmt.is_quantized())
        .flag("W_QUANT", fmt.is_quantized())
        .flag("W_AFFINE", fmt.has_biases())
        .flag("W_GLOBAL", fmt.has_global())
        .flag("W_FAST4", fast4)
        .flag("W_FAST8", fast8)
        .flag("W_FASTBF16", fast_bf16)
        .flag("W_FASTF32", fast_f32)
        .flag("W_VEC4", !vec2 && (fast4 || fast8 || fast_bf16 || fast_f32))
        .flag("W_VEC2", vec2)
}

impl KernelSpec {
    /// Whether the spec has a subgroup variant (the others ignore the choice).
    pub fn uses_subgroups(&self) -> bool {
        matches!(self, KernelSpec::Gemv { .. } | KernelSpec::GemvCat { .. } | KernelSpec::RmsNorm { .. } | KernelSpec::Attention { .. })
    }

    pub fn name(&self) -> String {
        match self {
            KernelSpec::Gemv { fmt, wg, rows, tt, gather, xvec, bp2, norm, dual, half } => format!(
                "gemv[{} wg{wg} r{rows} t{tt}{}{}{}{}{}{}]",
                fmt.describe(),
                if *dual { " geglu" } else { "" },
                match norm {
                    Some(w) => format!(" norm[{}]", w.map_or("none", |t| t.name())),
                    None => String::new(),
                },
                if *bp2 { " bp2" } else { "" },
                if *half && gemv_half(*fmt, *tt, *xvec, *bp2, *dual) { " half" } else { "" },
                if *gather { " gather" } else { "" },
                if *xvec { "" } else { " masked" }
            ),
            KernelSpec::GemvCat { fmt, wg, rows, xvec, norm, n, half } => format!(
                "gemv[{} wg{wg} r{rows} t1 cat{n} norm[{}]{}{}]",
                fmt.describe(),
                norm.map_or("none", |t| t.name()),
                if *half && gemv_half(*fmt, 1, *xvec, false, false) { " half" } else { "" },
                if *xvec { "" } else { " masked" }
            ),
            KernelSpec::Gemm { fmt, wide, split, xvec } => {
                let flags = [(*wide, " wide"), (*split, " split"), (*xvec, " xvec")];
                format!("gemm[{}{}]", fmt.describe(), flags.iter().filter(|f| f.0).map(|f| f.1).collect::<String>())
            }
            KernelSpec::GroupedGemm { fmt } => format!("gemm_grouped[{}]", fmt.describe()),
            KernelSpec::Embed { fmt } => format!("embed[{}]", fmt.describe()),
            KernelSpec::RmsNorm { w, res, scalar, steps } => format!(
                "rms_norm[{}{}{}{}]",
                w.map_or("none", |t| t.name()),
                if *res { " add" } else { "" },
                scalar.map_or(String::new(), |t| format!(" scaled {}", t.name())),
                if *steps > 0 { format!(" reg{}", 8 * steps) } else { String::new() }
            ),
            KernelSpec::Rope { norm: None, .. } => "rope".into(),
            KernelSpec::Rope { norm: Some(w), cache } => format!("norm_rope[{}{}]", w.map_or("none", |t| t.name()), if *cache { " cache" } else { "" }),
            KernelSpec::KvWrite => "kv_write".into(),
            KernelSpec::Attention { dpt, split, qrope, merge, append } => format!(
                "attention[dpt{dpt}{}{}{}{}]",
                if *split { " split" } else { "" },
                if *split && *merge { " merge" } else { "" },
                qrope.map_or(String::new(), |w| format!(" norm_rope[{}]", w.map_or("none", |t| t.name()))),
                if *append { " append" } else { "" }
            ),
            KernelSpec::AttnCombine => "attn_combine".into(),
            KernelSpec::GeGlu => "geglu".into(),
            KernelSpec::Binary { b } => format!("binary[{}]", b.name()),
            KernelSpec::Unary => "unary".into(),
            KernelSpec::TopK => "top_k".into(),
            KernelSpec::TopKSoftmax { scale } => format!("top_k_softmax[{}]", scale.map_or("none", |t| t.name())),
            KernelSpec::WeightedSum => "weighted_sum".into(),
            KernelSpec::MoeGroup => "moe_group".into(),
            KernelSpec::Copy => "copy".into(),
            KernelSpec::Argmax { wg } => format!("argmax[wg{wg}]"),
            KernelSpec::Sample { stage } => format!("sample[{}]", super::sample::STAGES[*stage as usize]),
        }
    }

    /// The WGSL source of this spec.
    pub fn source(&self, subgroups: bool) -> Source {
        let sg = subgroups && self.uses_subgroups();
        match *self {
            KernelSpec::Gemv { fmt, wg, rows, tt, gather, xvec, bp2, norm, dual, half } => {
                let files: &[&'static str] = if dual { &[COMMON, WEIGHTS, weights_second(), GEMV] } else { &[COMMON, WEIGHTS, GEMV] };
                let rs = rows * tt * if dual { 2 } else { 1 };
                let half = half && gemv_half(fmt, tt, xvec, bp2, dual);
                let s = gemv_reduction(Source::new(files), rs, wg)
                    .flag("DUAL", dual)
                    .c("NDT", norm.flatten().map_or(2, dt_code))
                    .flag("PRENORM", norm.is_some())
                    .flag("HAS_NW", norm.flatten().is_some())
                    .c("WG", wg)
                    .c("R", rows)
                    .c("TT", tt)
                    .flag("SUBGROUP", sg)
                    .flag("GATHER", gather)
                    .flag("XVEC", xvec)
                    .flag("TT1", tt == 1)
                    .flag("BP2", bp2 && tt == 1)
                    .flag("HALF", half);
                // half blocks read their weights in 8-byte words
                weight_source(s, fmt, true, xvec, half)
            }
            KernelSpec::GemvCat { fmt, wg, rows, xvec, norm, n, half } => {
                let files: &[&'static str] =
                    if n == 3 { &[COMMON, WEIGHTS, weights_second(), weights_third(), GEMV] } else { &[COMMON, WEIGHTS, weights_second(), GEMV] };
                let half = half && gemv_half(fmt, 1, xvec, false, false);
                let s = gemv_reduction(Source::new(files), rows, wg)
                    .flag("DUAL", false)
                    .c("NDT", norm.map_or(2, dt_code))
                    .flag("PRENORM", true)
                    .flag("HAS_NW", norm.is_some())
                    .c("WG", wg)
                    .c("R", rows)
                    .c("TT", 1)
                    .flag("SUBGROUP", sg)
                    .flag("GATHER", false)
                    .flag("XVEC", xvec)
                    .flag("TT1", true)
                    .flag("BP2", false)
                    .flag("HALF", half)
                    .flag("CAT", true)
                    .flag("CAT3", n == 3);
                weight_source(s, fmt, true, xvec, half)
            }
            KernelSpec::Gemm { fmt, wide, split, xvec } => {
                let s = Source::new(&[COMMON, WEIGHTS, GEMM]).c("WG", 256);
                weight_source(s.flag("WIDE", wide).flag("SPLIT", split).flag("XVEC", xvec), fmt, false, false, false)
            }
            KernelSpec::GroupedGemm { fmt } => {
                weight_source(Source::new(&[COMMON, WEIGHTS, GEMM]).c("WG", 256).flag("GROUPED", true), fmt, false, false, false)
            }
            KernelSpec::Embed { fmt } => weight_source(Source::new(&[COMMON, WEIGHTS, EMBED]).c("WG", 64), fmt, false, false, false),
            KernelSpec::RmsNorm { w, res, scalar, steps } => Source::new(&[COMMON, RMSNORM])
                .c("WG", NORM_WG)
                .c("NS", 8 * steps)
                .flag("REG", steps > 0)
                .c("NDT", w.map_or(2, dt_code))
                .c("SDT", scalar.map_or(2, dt_code))
                .flag("HAS_W", w.is_some())
                .flag("RES", res)
                .flag("SCALAR", scalar.is_some())
                .flag("SUBGROUP", sg),
            KernelSpec::Rope { norm, cache } => Source::new(&[COMMON, ROPE])
                .c("WG", 64)
                .c("NDT", norm.flatten().map_or(2, dt_code))
                .flag("NORM", norm.is_some())
                .flag("CACHE", cache && norm.is_some())
                .flag("HAS_NW", norm.flatten().is_some()),
            KernelSpec::KvWrite => Source::new(&[COMMON, KV_WRITE]).c("WG", ELEM_WG),
            KernelSpec::Attention { dpt, split, qrope, merge, append } => {
                let coop = sg && env_on("MARKBASE_ATTN_COOP");
                let files: &[&'static str] = if split && merge { &[COMMON, SPLIT_MERGE, ATTENTION] } else { &[COMMON, ATTENTION] };
                Source::new(files)
                    .c("WG", ATTN_WG)
                    .c("DPT", dpt)
                    .c("QV4", dpt * ATTN_WG / 4)
                    .c("QPL", (dpt * ATTN_WG / 4).div_ceil(8))
                    .c("NDT", qrope.flatten().map_or(2, dt_code))
                    .flag("SPLIT", split)
                    .flag("MERGE", split && merge)
                    .flag("QROPE", qrope.is_some())
                    .flag("APPEND", append && qrope.is_some())
                    .flag("HAS_NW", qrope.flatten().is_some())
                    .flag("SUBGROUP", sg)
                    .flag("COOP", coop)
                    .flag("PREFETCH", coop && env_on("MARKBASE_ATTN_PREFETCH"))
            }
            KernelSpec::AttnCombine => Source::new(&[COMMON, SPLIT_MERGE, ATTN_COMBINE]).c("WG", ATTN_WG),
            KernelSpec::GeGlu => Source::new(&[COMMON, ELEMENTWISE]).c("WG", ELEM_WG).c("BDT", 2).flag("GEGLU", true),
            KernelSpec::Binary { b } => {
                Source::new(&[COMMON, ELEMENTWISE]).c("WG", ELEM_WG).c("BDT", dt_code(b)).flag("BINARY", true)
            }
            KernelSpec::Unary => Source::new(&[COMMON, ELEMENTWISE]).c("WG", ELEM_WG).c("BDT", 2).flag("UNARY", true),
            KernelSpec::TopK => Source::new(&[COMMON, ROUTING]).c("WG", 64).c("SDT", 2).flag("TOPK", true),
            KernelSpec::TopKSoftmax { scale } => Source::new(&[COMMON, ROUTING])
                .c("WG", 64)
                .c("SDT", scale.map_or(2, dt_code))
                .flag("TOPK_SOFTMAX", true)
                .flag("HAS_SCALE", scale.is_some()),
            KernelSpec::WeightedSum => Source::new(&[COMMON, ROUTING]).c("WG", ELEM_WG).c("SDT", 2).flag("WSUM", true),
            KernelSpec::MoeGroup => Source::new(&[COMMON, MOE_GROUP]).c("WG", MOE_GROUP_WG),
            KernelSpec::Copy => Source::new(&[COMMON, COPY]).c("WG", ELEM_WG),
            KernelSpec::Argmax { wg } => Source::new(&[COMMON, ARGMAX]).c("WG", wg),
            KernelSpec::Sample { stage } => Source::new(&[COMMON, SAMPLE])
                .c("WG", super::sample::WG)
                .c("CHUNK", super::sample::CHUNK)
                .flag(&format!("STAGE_{}", super::sample::STAGES[stage as usize].to_uppercase()), true),
        }
    }

    /// A representative set of every family and variant (for the naga target test).
    pub fn all_variants() -> Vec<KernelSpec> {
        let fmts = all_formats();
        let mut v = Vec::new();
        for &fmt in &fmts {
            for (tt, gather) in [(1, false), (3, false), (1, true)] {
                for xvec in [true, false] {
                    for bp2 in [false, true] {
                        if bp2 && tt != 1 {
                            continue;
                        }
                        // half blocks and, where they apply, whole blocks
                        let halves: &[bool] = if gemv_half(fmt, tt, xvec, bp2, false) { &[true, false] } else { &[true] };
                        for &half in halves {
                            v.push(KernelSpec::Gemv { fmt, wg: 128, rows: if tt == 1 { 8 } else { 4 }, tt, gather, xvec, bp2, norm: None, dual: false, half });
                            if tt == 1 && !gather {
                                let norm = Some(if bp2 { None } else { Some(FloatType::Bf16) });
                                v.push(KernelSpec::Gemv { fmt, wg: 128, rows: 8, tt, gather, xvec, bp2, norm, dual: false, half });
                                if !bp2 {
                                    if half {
                                        // the dual GEMV walks whole blocks
                                        for rows in [4, 8] {
                                            v.push(KernelSpec::Gemv { fmt, wg: 128, rows, tt, gather, xvec, bp2, norm, dual: true, half: false });
                                        }
                                    }
                                    if !fmt.has_global() {
                                        for n in [2, 3] {
                                            v.push(KernelSpec::GemvCat { fmt, wg: 128, rows: 4, xvec, norm: norm.flatten(), n, half });
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            for (wide, split) in [(false, false), (true, false), (false, true)] {
                for xvec in [false, true] {
                    v.push(KernelSpec::Gemm { fmt, wide, split, xvec });
                }
            }
            v.push(KernelSpec::GroupedGemm { fmt });
            v.push(KernelSpec::Embed { fmt });
        }
        for w in [None, Some(FloatType::Bf16), Some(FloatType::F16), Some(FloatType::F32)] {
            for steps in [0, 1, 2] {
                v.push(KernelSpec::RmsNorm { w, res: false, scalar: None, steps });
                v.push(KernelSpec::RmsNorm { w, res: true, scalar: None, steps });
                v.push(KernelSpec::RmsNorm { w, res: true, scalar: Some(w.unwrap_or(FloatType::F32)), steps });
            }
            v.push(KernelSpec::TopKSoftmax { scale: w });
        }
        for b in [FloatType::Bf16, FloatType::F16, FloatType::F32] {
            v.push(KernelSpec::Binary { b });
        }
        for dpt in [1, 2, 4] {
            for split in [false, true] {
                v.push(KernelSpec::Attention { dpt, split, qrope: None, merge: false, append: false });
                v.push(KernelSpec::Attention { dpt, split, qrope: Some(Some(FloatType::Bf16)), merge: split, append: false });
                v.push(KernelSpec::Attention { dpt, split, qrope: Some(Some(FloatType::Bf16)), merge: split, append: true });
            }
        }
        v.extend([
            KernelSpec::Rope { norm: None, cache: false },
            KernelSpec::Rope { norm: Some(None), cache: false },
            KernelSpec::Rope { norm: Some(Some(FloatType::Bf16)), cache: false },
            KernelSpec::Rope { norm: Some(Some(FloatType::F32)), cache: false },
            KernelSpec::Rope { norm: Some(Some(FloatType::Bf16)), cache: true },
            KernelSpec::KvWrite,
            KernelSpec::AttnCombine,
            KernelSpec::GeGlu,
            KernelSpec::Unary,
            KernelSpec::TopK,
            KernelSpec::WeightedSum,
            KernelSpec::MoeGroup,
            KernelSpec::Copy,
            KernelSpec::Argmax { wg: 256 },
            KernelSpec::Argmax { wg: 1024 },
        ]);
        v.extend((0..super::sample::STAGES.len() as u32).map(|stage| KernelSpec::Sample { stage }));
        v
    }
}

/// Every weight format the kernels decode.
pub fn all_formats() -> Vec<GpuFormat> {
    let mut v = vec![GpuFormat::Float(FloatType::Bf16), GpuFormat::Float(FloatType::F16), GpuFormat::Float(FloatType::F32)];
    for bits in [1, 2, 3, 4, 5, 6, 8] {
        v.push(GpuFormat::Affine { bits, group: 64, scale: FloatType::Bf16 });
    }
    v.push(GpuFormat::Affine { bits: 4, group: 32, scale: FloatType::F16 });
    v.push(GpuFormat::Affine { bits: 8, group: 128, scale: FloatType::F32 });
    v.extend([GpuFormat::Mxfp4, GpuFormat::Mxfp8, GpuFormat::Nvfp4 { global: false }, GpuFormat::Nvfp4 { global: true }]);
    v
}

/// Runtime checks wgpu/naga inject into the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShaderChecks {
    /// wgpu's default: bounds checks, loop bounding, integer-division guards.
    All,
    /// Bounds checks only (no loop bounding, no division guards): every kernel's loops
    /// have bounds from its params, and the divisors are shapes (never zero).
    BoundsOnly,
    /// No injected checks (`ShaderRuntimeChecks::unchecked`).
    None,
}

impl ShaderChecks {
    /// `MARKBASE_SHADER_CHECKS=all|bounds|none`, or `MARKBASE_UNCHECKED=1` for `none`; default `all`.
    pub fn from_env() -> ShaderChecks {
        if std::env::var("MARKBASE_UNCHECKED").is_ok_and(|v| v == "1") {
            return ShaderChecks::None;
        }
        match std::env::var("MARKBASE_SHADER_CHECKS").as_deref() {
            Ok("none") => ShaderChecks::None,
            Ok("bounds") => ShaderChecks::BoundsOnly,
            _ => ShaderChecks::All,
        }
    }
}

/// How pipelines are built.
#[derive(Clone, Copy, Debug)]
pub struct KernelOptions {
    /// Use the subgroup variants (requires the device's SUBGROUP feature and subgroups of at
    /// least 8 invocations: attention's scores shuffle within groups of eight).
    pub subgroups: bool,
    /// Injected runtime checks; anything but `All` goes through `create_shader_module_trusted`.
    pub checks: ShaderChecks,
    /// One-token affine 4-bit GEMVs over half blocks (two invocations per block: coalesced
    /// activation loads on a GPU); whole blocks cost less on a CPU adapter, where there is
    /// nothing to coalesce and twice the invocations cost twice the scale loads and sums.
    pub half_blocks: bool,
    /// Split decode attention merges its partials in the workgroup of each head that finishes
    /// last (a device-scope fence and an atomic counter per head) instead of a second
    /// dispatch. Vulkan only: its storage barriers are device-scope fences (SPIR-V), which
    /// the Metal, D3D12 and GL translations do not promise (nor MoltenVK, a Vulkan over Metal).
    pub merge_splits: bool,
}

impl KernelOptions {
    /// Subgroups when the device has them (of 8 invocations or more); checks from
    /// [`ShaderChecks::from_env`]; half blocks unless the adapter is a CPU.
    pub fn for_gpu(gpu: &Gpu) -> Self {
        KernelOptions {
            subgroups: gpu.info.subgroups && gpu.info.subgroup_min_size >= 8,
            checks: ShaderChecks::from_env(),
            half_blocks: gpu.info.device_type != "cpu",
            merge_splits: gpu.info.backend == Backend::Vulkan && !gpu.info.driver.contains("MoltenVK") && env_on("MARKBASE_ATTN_MERGE"),
        }
    }
}

/// A compiled kernel: pipeline plus the layout of its bind group (group 0).
pub struct Kernel {
    pub name: String,
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
    /// Binding numbers and kinds, sorted.
    pub bindings: Vec<(u32, BindKind)>,
}

impl Kernel {
    /// A bind group from `(binding, resource)` pairs; every binding of the kernel exactly once.
    pub fn bind_group(&self, device: &wgpu::Device, res: &[(u32, wgpu::BindingResource<'_>)]) -> wgpu::BindGroup {
        let mut want: Vec<u32> = self.bindings.iter().map(|b| b.0).collect();
        let mut have: Vec<u32> = res.iter().map(|r| r.0).collect();
        want.sort_unstable();
        have.sort_unstable();
        assert_eq!(want, have, "{}: bindings given {have:?}, kernel has {want:?}", self.name);
        let entries: Vec<wgpu::BindGroupEntry> =
            res.iter().map(|(b, r)| wgpu::BindGroupEntry { binding: *b, resource: r.clone() }).collect();
        device.create_bind_group(&wgpu::BindGroupDescriptor { label: Some(&self.name), layout: &self.layout, entries: &entries })
    }

    /// Like [`Kernel::bind_group`] with whole buffers.
    pub fn bind_buffers(&self, device: &wgpu::Device, bufs: &[(u32, &wgpu::Buffer)]) -> wgpu::BindGroup {
        let res: Vec<(u32, wgpu::BindingResource)> = bufs.iter().map(|(b, buf)| (*b, buf.as_entire_binding())).collect();
        self.bind_group(device, &res)
    }

    /// Records one dispatch.
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, groups: [u32; 3]) {
        if groups.contains(&0) {
            return;
        }
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, bg, &[]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
    }
}

/// Pipeline factory and cache.
pub struct Kernels {
    device: wgpu::Device,
    pub opts: KernelOptions,
    pub limits: wgpu::Limits,
    cache: Mutex<HashMap<KernelSpec, Arc<Kernel>>>,
}

/// Register steps of an RMSNorm over rows of `d` values: the fewest that hold a row (up to 2:
/// 16 values per invocation; 3 measured slower than the loop on the H200), else 0 (the looping
/// kernel). `MARKBASE_NORM_REG=0` forces 0.
fn norm_steps(d: usize) -> u32 {
    let steps = d.div_ceil(8 * NORM_WG as usize).max(1);
    if steps > 2 || env_u32("MARKBASE_NORM_REG") == Some(0) {
        0
    } else {
        steps as u32
    }
}

/// Splits `n` workgroups over x (and y when above the per-dimension limit); the
/// kernels walk `gid.x + gid.y * stride` so any coverage works.
fn grid(n: u64, max: u32) -> [u32; 3] {
    let n = n.max(1);
    if n <= max as u64 {
        [n as u32, 1, 1]
    } else {
        let y = n.div_ceil(max as u64).min(max as u64);
        [max, y as u32, 1]
    }
}

/// A switch read from the environment: on unless set to `0`.
fn env_on(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
}

/// A tuning override from the environment.
fn env_u32(name: &str) -> Option<u32> {
    std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok())
}

/// A GEMV workgroup size from `gemv_wg` held to at most `cap` invocations, unless
/// `MARKBASE_GEMV_WG` sets it.
fn gemv_wg_capped(wg: u32, cap: u32) -> u32 {
    if env_u32("MARKBASE_GEMV_WG").is_some() {
        wg
    } else {
        wg.min(cap)
    }
}

fn div_ceil(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl Kernels {
    pub fn new(gpu: &Gpu, opts: KernelOptions) -> Result<Kernels, GpuError> {
        if opts.subgroups && !gpu.info.subgroups {
            return Err(GpuError::Other("subgroup kernels requested but the device has no SUBGROUP feature".into()));
        }
        Ok(Kernels { device: gpu.device.clone(), opts, limits: gpu.info.limits.clone(), cache: Mutex::new(HashMap::new()) })
    }

    /// With [`KernelOptions::for_gpu`].
    pub fn for_gpu(gpu: &Gpu) -> Result<Kernels, GpuError> {
        Kernels::new(gpu, KernelOptions::for_gpu(gpu))
    }

    fn maxg(&self) -> u32 {
        self.limits.max_compute_workgroups_per_dimension
    }

    /// The pipeline of `spec`, built on first use.
    pub fn get(&self, spec: KernelSpec) -> Result<Arc<Kernel>, GpuError> {
        if let Some(k) = self.cache.lock().unwrap().get(&spec) {
            return Ok(k.clone());
        }
        let k = Arc::new(self.build(spec)?);
        self.cache.lock().unwrap().insert(spec, k.clone());
        Ok(k)
    }

    fn build(&self, spec: KernelSpec) -> Result<Kernel, GpuError> {
        let name = format!("{}{}", spec.name(), if self.opts.subgroups && spec.uses_subgroups() { "+sg" } else { "" });
        let text = spec.source(self.opts.subgroups).text();
        let kerr = |msg: String| GpuError::Kernel { name: name.clone(), msg };
        let bindings = reflect_bindings(&text).map_err(kerr)?;
        let dev = &self.device;
        let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor { label: Some(&name), source: wgpu::ShaderSource::Wgsl(text.as_str().into()) };
        let module = match self.opts.checks {
            ShaderChecks::All => dev.create_shader_module(desc),
            checks => {
                let mut rc = wgpu::ShaderRuntimeChecks::unchecked();
                rc.bounds_checks = checks == ShaderChecks::BoundsOnly;
                // SAFETY: every kernel loop is bounded by its params, integer divisors are
                // shapes the launchers check to be non-zero, and (for `None`) every index is
                // guarded by the shape in the params. Opt-in (MARKBASE_SHADER_CHECKS /
                // MARKBASE_UNCHECKED); CI runs the default, fully checked modules.
                unsafe { dev.create_shader_module_trusted(desc, rc) }
            }
        };
        let entries: Vec<wgpu::BindGroupLayoutEntry> = bindings
            .iter()
            .map(|&(binding, kind)| wgpu::BindGroupLayoutEntry {
                binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: match kind {
                        BindKind::Uniform => wgpu::BufferBindingType::Uniform,
                        BindKind::Read => wgpu::BufferBindingType::Storage { read_only: true },
                        BindKind::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let layout = dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(&name), entries: &entries });
        let pl = dev.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(&name),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&name),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions { constants: &[], zero_initialize_workgroup_memory: false },
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(kerr(e.to_string()));
        }
        Ok(Kernel { name, pipeline, layout, bindings })
    }

    // ---------------------------------------------------------------- matmul

    /// A matmul `y[T, N] = x[T, K] @ W^T` (or GatherMatMul when `gather`) for `t` tokens
    /// (`gather`: `t` = T*S pairs): the GEMV for `t < GEMM_MIN_T` or gathered, else the GEMM.
    pub fn matmul(&self, fmt: GpuFormat, k: usize, t: usize, gather: bool) -> Result<MatMulKernel, GpuError> {
        self.matmul_spec(self.matmul_spec_for(fmt, k, t, gather, None, None)?)
    }

    /// [`Kernels::matmul`] for a weight of `n` rows: a one-token GEMV over few, long rows takes
    /// half the rows per workgroup (see [`GEMV_FEW_GROUPS`]).
    pub fn matmul_rows(&self, fmt: GpuFormat, k: usize, n: usize, t: usize, gather: bool) -> Result<MatMulKernel, GpuError> {
        self.matmul_spec(self.matmul_spec_for(fmt, k, t, gather, None, Some(n))?)
    }

    /// `rms_norm(x) @ W^T` for one token (`Op::NormMatMul`): the GEMV with the norm
    /// in front; `norm`: the norm weight's dtype (`None`: no weight).
    pub fn norm_matmul(&self, fmt: GpuFormat, k: usize, norm: Option<FloatType>) -> Result<MatMulKernel, GpuError> {
        self.matmul_spec(self.matmul_spec_for(fmt, k, 1, false, Some(norm), None)?)
    }

    /// `gelu(rms_norm(x) @ Wg^T) * (rms_norm(x) @ Wu^T)` for one token (`Op::NormGeGlu`)
    /// over weights of `n` rows: the dual GEMV, half the rows per workgroup of each weight, or
    /// as many as a plain GEMV from [`GEMV_DUAL_WIDE_N`] rows on.
    pub fn norm_geglu(&self, fmt: GpuFormat, k: usize, n: usize, norm: Option<FloatType>) -> Result<MatMulKernel, GpuError> {
        let KernelSpec::Gemv { fmt, rows, tt, gather, xvec, norm, .. } = self.matmul_spec_for(fmt, k, 1, false, Some(norm), None)? else {
            return Err(GpuError::Kernel { name: "norm_geglu".into(), msg: "not a GEMV".into() });
        };
        let wide = n >= GEMV_DUAL_WIDE_N && rows >= 8;
        let narrow = n < GEMV_DUAL_NARROW_N;
        let rows = env_u32("MARKBASE_GEMV_DUAL_ROWS").unwrap_or(if wide {
            rows
        } else if narrow {
            (rows / 4).max(1)
        } else {
            (rows / 2).max(1)
        });
        // at most 128 invocations: Gemma 4 31B's gate/up (K = 5376) measured 5% faster than at 256
        let wg = env_u32("MARKBASE_GEMV_DUAL_WG").unwrap_or_else(|| gemv_wg_capped(self.gemv_wg(k, tt, false, false), 128));
        self.matmul_spec(KernelSpec::Gemv { fmt, wg, rows, tt, gather, xvec, bp2: false, norm, dual: true, half: false })
    }

    /// `Op::NormMatMul` over several weights in one dispatch, when they allow it: two or three,
    /// of one format without a global scale, one row length and one chunk each. `None`: run
    /// them one by one.
    pub fn norm_matmul_cat(&self, ws: &[&GpuWeight], norm: Option<FloatType>) -> Result<Option<MatMulKernel>, GpuError> {
        let w0 = ws[0];
        let alike = ws.iter().all(|w| w.format == w0.format && w.k == w0.k && w.chunks.len() == 1);
        if !(2..=3).contains(&ws.len()) || !alike || w0.format.has_global() {
            return Ok(None);
        }
        let KernelSpec::Gemv { fmt, wg, rows, xvec, half, .. } = self.matmul_spec_for(w0.format, w0.k, 1, false, Some(norm), None)? else {
            return Ok(None);
        };
        // half the rows of a plain GEMV per workgroup (like the dual GEMV): each row group is
        // unrolled once per weight; at most 128 invocations (measured faster than 256 on the
        // H200 for Gemma 3 12B's q/k/v, K = 3840), unless overridden
        // (a quarter of them for few rows in all: see GEMV_CAT_FEW_ROWS)
        let total: usize = ws.iter().map(|w| w.rows).sum();
        let rows = env_u32("MARKBASE_GEMV_CAT_ROWS").unwrap_or(if total < GEMV_CAT_FEW_ROWS { (rows / 4).max(1) } else { (rows / 2).max(1) });
        let wg = env_u32("MARKBASE_GEMV_CAT_WG").unwrap_or(gemv_wg_capped(wg, 128));
        Ok(Some(self.matmul_spec(KernelSpec::GemvCat { fmt, wg, rows, xvec, norm, n: ws.len() as u32, half })?))
    }

    /// The GEMV or GEMM spec of a matmul (not built); `n`: the weight's rows where they may
    /// pick the rows per workgroup.
    fn matmul_spec_for(&self, fmt: GpuFormat, k: usize, t: usize, gather: bool, norm: Option<Option<FloatType>>, n: Option<usize>) -> Result<KernelSpec, GpuError> {
        fmt.check_k(k).map_err(|m| GpuError::Kernel { name: "matmul".into(), msg: m })?;
        if norm.is_some() && (t != 1 || gather) {
            return Err(GpuError::Kernel { name: "norm_matmul".into(), msg: format!("a fused norm needs one token, not {t}") });
        }
        let xvec = k % 32 == 0;
        let gemv = gather || t < GEMM_MIN_T;
        let spec = if gemv {
            let tt = if gather { 1 } else { t.clamp(1, GEMM_MIN_T - 1) as u32 };
            // tuning overrides: MARKBASE_GEMV_ROWS, MARKBASE_GEMV_WG (power of two, in gemv_wg)
            // 8 rows per workgroup measured best for affine and float weights on the H200;
            // the fp4/fp8 decoders (per-element selects) run out of registers there: 2, except
            // mxfp4 for one token: 4; few, long rows of one token: 4
            let heavy = matches!(fmt, GpuFormat::Mxfp4 | GpuFormat::Mxfp8 | GpuFormat::Nvfp4 { .. });
            let few = tt == 1 && !gather && n.is_some_and(|n| few_long_rows(n, k));
            let rows = env_u32("MARKBASE_GEMV_ROWS").unwrap_or(if heavy && tt == 1 && fmt == GpuFormat::Mxfp4 {
                4
            } else if heavy {
                2
            } else if tt == 1 && !few {
                8
            } else {
                4
            });
            let bp2 = tt == 1 && env_u32("MARKBASE_GEMV_BP2").map_or(GEMV_BP2, |v| v != 0);
            let half = self.opts.half_blocks && gemv_half(fmt, tt, xvec, bp2, false);
            let wg = self.gemv_wg(k, tt, half, bp2);
            KernelSpec::Gemv { fmt, wg, rows, tt, gather, xvec, bp2, norm, dual: false, half }
        } else {
            let wide = env_u32("MARKBASE_GEMM_WIDE").map_or(n.is_some_and(|n| gemm_tiles(n, t, true) >= GEMM_WIDE_MIN_TILES), |v| v != 0);
            let split = !wide && self.opts.merge_splits && n.is_some_and(|n| gemm_ksplit(gemm_tiles(n, t, false), k) > 1);
            KernelSpec::Gemm { fmt, wide, split, xvec: k % 4 == 0 }
        };
        Ok(spec)
    }

    /// GEMV workgroup size: one invocation per step of a row (a block, half a block, or two
    /// blocks), up to 256 (128 with several tokens); `MARKBASE_GEMV_WG` overrides it.
    fn gemv_wg(&self, k: usize, tt: u32, half: bool, bp2: bool) -> u32 {
        let nblk = div_ceil(k, 32) as u32;
        let steps = if bp2 {
            nblk.div_ceil(2)
        } else if half {
            2 * nblk
        } else {
            nblk
        };
        let max_wg = (self.limits.max_compute_invocations_per_workgroup).min(if tt == 1 { 256 } else { 128 });
        let env = env_u32("MARKBASE_GEMV_WG");
        env.unwrap_or_else(|| steps.next_power_of_two()).next_power_of_two().clamp(32, max_wg)
    }

    /// A matmul launcher for an explicit `Gemv`/`Gemm`/`GroupedGemm` spec (tests, tuning).
    pub fn matmul_spec(&self, spec: KernelSpec) -> Result<MatMulKernel, GpuError> {
        if !matches!(spec, KernelSpec::Gemv { .. } | KernelSpec::GemvCat { .. } | KernelSpec::Gemm { .. } | KernelSpec::GroupedGemm { .. }) {
            return Err(GpuError::Kernel { name: spec.name(), msg: "not a matmul spec".into() });
        }
        Ok(MatMulKernel { kernel: self.get(spec)?, spec, maxg: self.maxg() })
    }

    /// `Op::GroupedMatMul`: the expert-grouped GEMM over an expert stack with rows of `k`.
    /// Dims: [`MatMulDims::gathered`]; binding 3 is the `Op::MoeGroup` value.
    pub fn grouped_matmul(&self, fmt: GpuFormat, k: usize) -> Result<MatMulKernel, GpuError> {
        fmt.check_k(k).map_err(|m| GpuError::Kernel { name: "grouped_matmul".into(), msg: m })?;
        self.matmul_spec(KernelSpec::GroupedGemm { fmt })
    }

    /// `Op::MoeGroup`.
    pub fn moe_group(&self) -> Result<MoeGroupKernel, GpuError> {
        Ok(MoeGroupKernel { kernel: self.get(KernelSpec::MoeGroup)? })
    }

    pub fn embed(&self, fmt: GpuFormat) -> Result<EmbedKernel, GpuError> {
        Ok(EmbedKernel { kernel: self.get(KernelSpec::Embed { fmt })?, maxg: self.maxg() })
    }

    /// `res`: plus a residual (`Op::RmsNormAdd`).
    /// Rows of `d` values.
    pub fn rms_norm(&self, w: Option<FloatType>, res: bool, d: usize) -> Result<RmsNormKernel, GpuError> {
        Ok(RmsNormKernel { kernel: self.get(KernelSpec::RmsNorm { w, res, scalar: None, steps: norm_steps(d) })?, maxg: self.maxg() })
    }

    /// `(res + rms_norm(x)) * s` with a scalar weight `s` of dtype `scalar` (`Op::RmsNormAdd`
    /// with `scaled`).
    pub fn rms_norm_add_scaled(&self, w: Option<FloatType>, scalar: FloatType, d: usize) -> Result<RmsNormKernel, GpuError> {
        Ok(RmsNormKernel { kernel: self.get(KernelSpec::RmsNorm { w, res: true, scalar: Some(scalar), steps: norm_steps(d) })?, maxg: self.maxg() })
    }

    /// `norm`: an RMSNorm per head in front, with its weight's dtype (`Some(None)`: no weight).
    pub fn rope(&self, norm: Option<Option<FloatType>>) -> Result<RopeKernel, GpuError> {
        Ok(RopeKernel { kernel: self.get(KernelSpec::Rope { norm, cache: false })?, norm: norm.is_some(), maxg: self.maxg() })
    }

    /// `Op::KvWriteNormRope`: the norm-rope kernel writing rows to cache slots (binding 3 the cache).
    pub fn rope_to_cache(&self, norm: Option<FloatType>) -> Result<RopeKernel, GpuError> {
        Ok(RopeKernel { kernel: self.get(KernelSpec::Rope { norm: Some(norm), cache: true })?, norm: true, maxg: self.maxg() })
    }

    pub fn kv_write(&self) -> Result<KvWriteKernel, GpuError> {
        Ok(KvWriteKernel { kernel: self.get(KernelSpec::KvWrite)?, maxg: self.maxg() })
    }

    /// Attention for head dim `d`; `nsplit > 1` splits each query's keys over that many
    /// workgroups (decode over long contexts), merged in the pass
    /// ([`KernelOptions::merge_splits`]) or by a combine dispatch.
    pub fn attention(&self, d: usize, nsplit: usize) -> Result<AttentionKernel, GpuError> {
        self.attention_with(d, nsplit, None, false)
    }

    /// `qrope`: q's norm (weight dtype) and RoPE in front (`Op::NormRopeAttention`; bindings 6
    /// the `RopeParams`, 7 the norm weight). `append` (with `qrope`, one token): the pass writes
    /// the step's key (normed, its weight at 10 of q's dtype, and rotated as q is) and value,
    /// heads of the q/k/v row ([`AttentionParams::with_append`]), into the caches it reads.
    pub fn attention_with(&self, d: usize, nsplit: usize, qrope: Option<Option<FloatType>>, append: bool) -> Result<AttentionKernel, GpuError> {
        self.attention_full(d, nsplit, qrope, self.opts.merge_splits, append)
    }

    /// [`Kernels::attention_with`] with `merge` given: split partials merged by the last
    /// workgroup of each head (see [`KernelOptions::merge_splits`]) or by a combine dispatch.
    pub fn attention_full(&self, d: usize, nsplit: usize, qrope: Option<Option<FloatType>>, merge: bool, append: bool) -> Result<AttentionKernel, GpuError> {
        if append && qrope.is_none() {
            return Err(GpuError::Kernel { name: "attention".into(), msg: "appending the step's key needs q's norm and RoPE in the pass".into() });
        }
        if d == 0 || d % 4 != 0 || d > MAX_HEAD_DIM {
            return Err(GpuError::Kernel { name: "attention".into(), msg: format!("head dim {d} (must be a multiple of 4, <= 512)") });
        }
        let dpt = div_ceil(d, ATTN_WG as usize) as u32;
        // the merge (in the pass or by the combine) weighs a split per invocation
        if nsplit > ATTN_WG as usize {
            return Err(GpuError::Kernel { name: "attention".into(), msg: format!("{nsplit} splits (at most {ATTN_WG})") });
        }
        let split = nsplit > 1;
        let merge = split && merge;
        let kernel = self.get(KernelSpec::Attention { dpt, split, qrope, merge, append })?;
        let combine = if split && !merge { Some(self.get(KernelSpec::AttnCombine)?) } else { None };
        Ok(AttentionKernel { kernel, combine, nsplit: nsplit.max(1) as u32 })
    }

    pub fn geglu(&self) -> Result<ElementwiseKernel, GpuError> {
        Ok(ElementwiseKernel { kernel: self.get(KernelSpec::GeGlu)?, maxg: self.maxg() })
    }

    /// Binary op with `b` stored as `b_dtype` (f32 for activations; bf16/f16 weights as stored).
    pub fn binary(&self, b_dtype: FloatType) -> Result<ElementwiseKernel, GpuError> {
        Ok(ElementwiseKernel { kernel: self.get(KernelSpec::Binary { b: b_dtype })?, maxg: self.maxg() })
    }

    pub fn unary(&self) -> Result<ElementwiseKernel, GpuError> {
        Ok(ElementwiseKernel { kernel: self.get(KernelSpec::Unary)?, maxg: self.maxg() })
    }

    pub fn top_k(&self) -> Result<RoutingKernel, GpuError> {
        Ok(RoutingKernel { kernel: self.get(KernelSpec::TopK)?, wg: 64, maxg: self.maxg() })
    }

    pub fn top_k_softmax(&self, scale: Option<FloatType>) -> Result<RoutingKernel, GpuError> {
        Ok(RoutingKernel { kernel: self.get(KernelSpec::TopKSoftmax { scale })?, wg: 64, maxg: self.maxg() })
    }

    pub fn weighted_sum(&self) -> Result<RoutingKernel, GpuError> {
        Ok(RoutingKernel { kernel: self.get(KernelSpec::WeightedSum)?, wg: ELEM_WG, maxg: self.maxg() })
    }

    pub fn copy(&self) -> Result<CopyKernel, GpuError> {
        Ok(CopyKernel { kernel: self.get(KernelSpec::Copy)?, maxg: self.maxg() })
    }

    pub fn argmax(&self) -> Result<ArgmaxKernel, GpuError> {
        let wg = self.limits.max_compute_invocations_per_workgroup.min(1024).min(self.limits.max_compute_workgroup_size_x);
        let wg = if wg.is_power_of_two() { wg } else { wg.next_power_of_two() / 2 };
        Ok(ArgmaxKernel { kernel: self.get(KernelSpec::Argmax { wg })? })
    }
}

// -------------------------------------------------------------------- matmul

/// Params of `gemv.wgsl` / `gemm.wgsl` (binding 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct MatMulParams {
    pub t: u32,
    pub k: u32,
    pub rows: u32,
    pub row_start: u32,
    pub ldy: u32,
    pub e_start: u32,
    pub e_count: u32,
    pub s: u32,
    pub x_bcast: u32,
    /// Experts of the whole stack (grouped GEMM: where the pair list starts).
    pub experts: u32,
    /// Fused norm (`Gemv` with `norm`): 0 no weight, 1 `w`, 2 `1 + w`; and its epsilon.
    pub norm_mode: u32,
    pub norm_eps: f32,
    /// Rows of the second and third weight (`GemvCat`).
    pub rows2: u32,
    pub rows3: u32,
    /// Parts of K (split GEMM).
    pub ksplit: u32,
    pub _pad: u32,
}

/// Shape of one matmul dispatch (one weight chunk).
#[derive(Clone, Copy, Debug)]
pub struct MatMulDims {
    /// Tokens (gathered: T*S pairs).
    pub t: usize,
    pub k: usize,
    /// Rows of the chunk (gathered: N, rows per expert).
    pub rows: usize,
    /// Output column of the chunk's first row (gathered: 0).
    pub row_start: usize,
    /// Row stride of y (N of the whole weight).
    pub ldy: usize,
    pub gather: Option<GatherDims>,
    /// Fused RMSNorm of x (`Op::NormMatMul`): its scale convention and epsilon.
    pub norm: Option<(NormScale, f32)>,
    /// Rows of the second and third weight whose outputs follow (`GemvCat`; 0 without).
    pub cat: [usize; 2],
    /// Parts of K of a split GEMM (0: [`gemm_ksplit`]'s choice).
    pub ksplit: usize,
}

/// Gathered-matmul extras.
#[derive(Clone, Copy, Debug)]
pub struct GatherDims {
    /// Experts per token.
    pub s: usize,
    /// Experts held by the chunk.
    pub e_start: usize,
    pub e_count: usize,
    /// x is `[T, K]`, shared by a token's S pairs (else `[T, S, K]`).
    pub x_bcast: bool,
    /// Experts of the whole stack.
    pub experts: usize,
}

impl MatMulDims {
    /// Dims of chunk `c` of `w` for `t` tokens (plain matmul).
    pub fn plain(w: &GpuWeight, c: usize, t: usize) -> Self {
        let ch = &w.chunks[c];
        MatMulDims { t, k: w.k, rows: ch.rows, row_start: ch.row_start, ldy: w.rows, gather: None, norm: None, cat: [0; 2], ksplit: 0 }
    }
    /// Dims of one token through 2 or 3 single-chunk weights side by side (`GemvCat`).
    pub fn cat(ws: &[&GpuWeight]) -> Self {
        let rows = |i: usize| ws.get(i).map_or(0, |w| w.rows);
        let ldy = ws.iter().map(|w| w.rows).sum();
        MatMulDims { t: 1, k: ws[0].k, rows: rows(0), row_start: 0, ldy, gather: None, norm: None, cat: [rows(1), rows(2)], ksplit: 0 }
    }
    /// With a fused norm in front.
    pub fn with_norm(self, scale: NormScale, eps: f32) -> Self {
        MatMulDims { norm: Some((scale, eps)), ..self }
    }
    /// Dims of chunk `c` of the expert stack `w` for `tokens` tokens with `s` experts each.
    pub fn gathered(w: &GpuWeight, c: usize, tokens: usize, s: usize, x_bcast: bool) -> Self {
        let (e_start, e_count) = w.chunk_experts(c);
        MatMulDims {
            t: tokens * s,
            k: w.k,
            rows: w.rows_per_expert,
            row_start: 0,
            ldy: w.rows_per_expert,
            gather: Some(GatherDims { s, e_start, e_count, x_bcast, experts: w.experts }),
            norm: None,
            cat: [0; 2],
            ksplit: 0,
        }
    }
}

/// Matmul launcher. Bindings: 0 params, 1 x (f32), 2 y (f32, written), 3 routing (gathered
/// GEMV: the ids, u32 `[T*S]`; grouped GEMM: the `Op::MoeGroup` value), 4 norm weight (fused
/// norm with a weight), 8 packed weights, 9 scales (affine: scale and bias pairs), 11 global scale (as
/// the format has them).
pub struct MatMulKernel {
    pub kernel: Arc<Kernel>,
    pub spec: KernelSpec,
    maxg: u32,
}

impl MatMulKernel {
    pub fn is_gemv(&self) -> bool {
        matches!(self.spec, KernelSpec::Gemv { .. } | KernelSpec::GemvCat { .. })
    }

    pub fn params(&self, d: &MatMulDims) -> MatMulParams {
        let g = d.gather.unwrap_or(GatherDims { s: 1, e_start: 0, e_count: 0, x_bcast: false, experts: 0 });
        MatMulParams {
            t: d.t as u32,
            k: d.k as u32,
            rows: d.rows as u32,
            row_start: d.row_start as u32,
            ldy: d.ldy as u32,
            e_start: g.e_start as u32,
            e_count: g.e_count as u32,
            s: g.s as u32,
            x_bcast: g.x_bcast as u32,
            experts: g.experts as u32,
            norm_mode: d.norm.map_or(0, |(s, _)| norm_mode(s)),
            norm_eps: d.norm.map_or(0.0, |(_, e)| e),
            rows2: d.cat[0] as u32,
            rows3: d.cat[1] as u32,
            ksplit: self.ksplit(d) as u32,
            _pad: 0,
        }
    }

    /// Whether the kernel cuts K into parts (and binds [`MatMulKernel::split_scratch_bytes`]).
    pub fn is_split(&self) -> bool {
        matches!(self.spec, KernelSpec::Gemm { split: true, .. })
    }

    /// Parts of K of dispatch `d` (1 unless split).
    pub fn ksplit(&self, d: &MatMulDims) -> usize {
        if !self.is_split() {
            return 1;
        }
        if d.ksplit > 0 {
            return d.ksplit;
        }
        gemm_ksplit(gemm_tiles(d.rows, d.t, false), d.k)
    }

    /// Bytes of the split GEMM's partial sums and of its counters for dispatch `d`.
    pub fn split_scratch_bytes(&self, d: &MatMulDims) -> (u64, u64) {
        let tiles = gemm_tiles(d.rows, d.t, false) as u64;
        (tiles * self.ksplit(d) as u64 * 64 * 64 * 4, tiles * 4)
    }

    /// Bind group of a split GEMM: chunk `c` of `w`, partial sums `part`, counters `done` (zeroed
    /// before the first dispatch; each dispatch leaves them zeroed).
    #[allow(clippy::too_many_arguments)]
    pub fn bind_group_split(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        part: &wgpu::Buffer,
        done: &wgpu::Buffer,
        w: &GpuWeight,
        c: usize,
    ) -> wgpu::BindGroup {
        self.bind(device, params, x, y, &[(5, part), (6, done)], w, None, c)
    }

    pub fn groups(&self, d: &MatMulDims) -> [u32; 3] {
        let m = self.maxg as usize;
        match self.spec {
            KernelSpec::Gemv { rows, tt, gather, .. } => {
                let ty = if gather { d.t } else { div_ceil(d.t, tt as usize) };
                [div_ceil(d.rows, rows as usize).min(m) as u32, ty.min(m) as u32, 1]
            }
            KernelSpec::GemvCat { rows, .. } => {
                let g: usize = [d.rows, d.cat[0], d.cat[1]].iter().map(|&r| div_ceil(r, rows as usize)).sum();
                [g.min(m) as u32, 1, 1]
            }
            KernelSpec::GroupedGemm { .. } => {
                // a slot per possible tile: each expert's last tile may be partial
                let experts = d.gather.map_or(0, |g| g.e_count);
                [div_ceil(d.rows, 64).min(m) as u32, (div_ceil(d.t, 64) + experts).min(m) as u32, 1]
            }
            KernelSpec::Gemm { wide, .. } => {
                [div_ceil(d.rows, gemm_tile_rows(wide)).min(m) as u32, div_ceil(d.t, 64).min(m) as u32, self.ksplit(d) as u32]
            }
            _ => [div_ceil(d.rows, 64).min(m) as u32, div_ceil(d.t, 64).min(m) as u32, 1],
        }
    }

    /// Bind group for chunk `c` of `w`.
    pub fn bind_group(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        routing: Option<&wgpu::Buffer>,
        w: &GpuWeight,
        c: usize,
    ) -> wgpu::BindGroup {
        self.bind(device, params, x, y, routing.map(|r| (3, r)).as_slice(), w, None, c)
    }

    /// Bindings 0-2, the extras (`(binding, buffer)`), chunk `c` of `w` at 8.. and of the dual
    /// GEMV's second weight `wu` at 12...
    #[allow(clippy::too_many_arguments)]
    fn bind(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        extra: &[(u32, &wgpu::Buffer)],
        w: &GpuWeight,
        wu: Option<&GpuWeight>,
        c: usize,
    ) -> wgpu::BindGroup {
        let mut res = vec![(0, params.as_entire_binding()), (1, x.as_entire_binding()), (2, y.as_entire_binding())];
        res.extend(extra.iter().map(|&(b, buf)| (b, buf.as_entire_binding())));
        res.extend(w.bindings(c));
        if let Some(wu) = wu {
            res.extend(wu.bindings(c).into_iter().map(|(b, r)| (b + 4, r)));
        }
        self.kernel.bind_group(device, &res)
    }

    /// Bind group for chunk `c` of the gate `w` and the up `wu` (dual GEMV) behind a fused
    /// norm with weight `nw`.
    #[allow(clippy::too_many_arguments)]
    pub fn bind_group_dual(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        nw: Option<&wgpu::Buffer>,
        w: &GpuWeight,
        wu: &GpuWeight,
        c: usize,
    ) -> wgpu::BindGroup {
        self.bind(device, params, x, y, nw.map(|b| (4, b)).as_slice(), w, Some(wu), c)
    }

    /// Bind group for the single-chunk weights `ws` (at 8.., 12.., 16..) behind a fused norm with
    /// weight `nw` (`GemvCat`).
    pub fn bind_group_cat(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        nw: Option<&wgpu::Buffer>,
        ws: &[&GpuWeight],
    ) -> wgpu::BindGroup {
        let mut res = vec![(0, params.as_entire_binding()), (1, x.as_entire_binding()), (2, y.as_entire_binding())];
        if let Some(b) = nw {
            res.push((4, b.as_entire_binding()));
        }
        for (i, w) in ws.iter().enumerate() {
            res.extend(w.bindings(0).into_iter().map(|(b, r)| (b + 4 * i as u32, r)));
        }
        self.kernel.bind_group(device, &res)
    }

    /// Bind group for chunk `c` of `w` behind a fused norm with weight `nw`.
    #[allow(clippy::too_many_arguments)]
    pub fn bind_group_norm(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        nw: Option<&wgpu::Buffer>,
        w: &GpuWeight,
        c: usize,
    ) -> wgpu::BindGroup {
        self.bind(device, params, x, y, nw.map(|b| (4, b)).as_slice(), w, None, c)
    }

    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, d: &MatMulDims) {
        self.kernel.dispatch(pass, bg, self.groups(d));
    }
}

// -------------------------------------------------------------------- embed

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct EmbedParams {
    pub t: u32,
    pub d: u32,
    pub row_start: u32,
    pub rows: u32,
    pub clamp: u32,
    pub has_clamp: u32,
    pub scale: f32,
    pub _pad: u32,
}

/// Embedding gather. Bindings: 0 params, 1 ids (u32 `[T]`), 2 out (f32 `[T, D]`), 8.. weights.
/// One dispatch per chunk of the table; each writes the tokens whose id it holds.
pub struct EmbedKernel {
    pub kernel: Arc<Kernel>,
    maxg: u32,
}

impl EmbedKernel {
    pub fn params(&self, w: &GpuWeight, c: usize, t: usize, scale: f32, clamp: Option<u32>) -> EmbedParams {
        let ch = &w.chunks[c];
        EmbedParams {
            t: t as u32,
            d: w.k as u32,
            row_start: ch.row_start as u32,
            rows: ch.rows as u32,
            clamp: clamp.unwrap_or(0),
            has_clamp: clamp.is_some() as u32,
            scale,
            _pad: 0,
        }
    }
    pub fn groups(&self, t: usize, d: usize) -> [u32; 3] {
        [div_ceil(div_ceil(d, 8), 64).min(self.maxg as usize) as u32, t.min(self.maxg as usize) as u32, 1]
    }
    #[allow(clippy::too_many_arguments)]
    pub fn bind_group(&self, device: &wgpu::Device, params: &wgpu::Buffer, ids: &wgpu::Buffer, out: &wgpu::Buffer, w: &GpuWeight, c: usize) -> wgpu::BindGroup {
        let mut res = vec![(0, params.as_entire_binding()), (1, ids.as_entire_binding()), (2, out.as_entire_binding())];
        res.extend(w.bindings(c));
        self.kernel.bind_group(device, &res)
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, t: usize, d: usize) {
        self.kernel.dispatch(pass, bg, self.groups(t, d));
    }
}

// -------------------------------------------------------------------- rms norm

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct RmsNormParams {
    pub rows: u32,
    pub d: u32,
    pub eps: f32,
    pub mode: u32,
}

/// Mode code of a norm's scale convention in the kernels' params.
fn norm_mode(s: NormScale) -> u32 {
    match s {
        NormScale::None => 0,
        NormScale::W => 1,
        NormScale::OnePlusW => 2,
    }
}

/// RMSNorm. Bindings: 0 params, 1 x, 2 out, 3 w (when built with a weight dtype; stored
/// bytes), 4 residual (`res` kernels: `out = res + norm(x)`).
pub struct RmsNormKernel {
    pub kernel: Arc<Kernel>,
    maxg: u32,
}

impl RmsNormKernel {
    pub fn params(&self, rows: usize, d: usize, eps: f32, scale: NormScale) -> RmsNormParams {
        RmsNormParams { rows: rows as u32, d: d as u32, eps, mode: norm_mode(scale) }
    }
    pub fn groups(&self, rows: usize) -> [u32; 3] {
        grid(rows as u64, self.maxg)
    }
    /// `res`: the residual (kernels built with `res`); `scalar`: the scalar weight (kernels
    /// built with one).
    #[allow(clippy::too_many_arguments)]
    pub fn bind_group(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
        w: Option<&wgpu::Buffer>,
        res: Option<&wgpu::Buffer>,
        scalar: Option<&wgpu::Buffer>,
    ) -> wgpu::BindGroup {
        let mut b = vec![(0, params), (1, x), (2, out)];
        if let Some(w) = w {
            b.push((3, w));
        }
        if let Some(r) = res {
            b.push((4, r));
        }
        if let Some(s) = scalar {
            b.push((5, s));
        }
        self.kernel.bind_buffers(device, &b)
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, rows: usize) {
        self.kernel.dispatch(pass, bg, self.groups(rows));
    }
}

// -------------------------------------------------------------------- rope

/// Params of `rope.wgsl`: shape plus, per rotary pair, `frac(inv_freq / 2pi)` as a
/// 64-bit fixed-point fraction of a turn (`[lo, hi]`, two pairs per entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct RopeParams {
    pub t: u32,
    pub heads: u32,
    pub d: u32,
    pub pairs: u32,
    /// Norm in front (norm kernels): 0 no weight, 1 `w`, 2 `1 + w`; and its epsilon.
    pub norm_mode: u32,
    pub norm_eps: f32,
    /// Heads of a row of x, and the first one read (a head range of a wider value).
    pub x_heads: u32,
    pub head0: u32,
    /// Cache slots (rows written to a KV cache).
    pub slots: u32,
    pub _pad: [u32; 3],
    pub tab: [[u32; 4]; 128],
}

impl RopeParams {
    /// Params of `t` tokens, `heads` heads of dim `d`, `pairs` rotated pairs (the table of
    /// their turn fractions); no norm, x holding exactly those heads.
    pub fn new(t: usize, heads: usize, d: usize, theta: f32, factor: f32, pairs: usize) -> Self {
        assert!(pairs <= MAX_ROPE_PAIRS && pairs <= d / 2, "rope: {pairs} pairs for head dim {d}");
        let mut tab = [[0u32; 4]; 128];
        for i in 0..pairs {
            let f = rope_turn_fraction(theta, factor, d, i);
            tab[i / 2][(i % 2) * 2] = f as u32;
            tab[i / 2][(i % 2) * 2 + 1] = (f >> 32) as u32;
        }
        RopeParams { t: t as u32, heads: heads as u32, d: d as u32, pairs: pairs as u32, norm_mode: 0, norm_eps: 0.0, x_heads: heads as u32, head0: 0, slots: 0, _pad: [0; 3], tab }
    }
    /// With the norm `(scale, eps)` in front.
    pub fn with_norm(self, norm: Option<(NormScale, f32)>) -> Self {
        match norm {
            Some((s, eps)) => RopeParams { norm_mode: norm_mode(s), norm_eps: eps, ..self },
            None => self,
        }
    }
    /// Reading heads `head0..head0 + heads` of an x with `x_heads` heads per row.
    pub fn with_heads(self, x_heads: usize, head0: usize) -> Self {
        RopeParams { x_heads: x_heads as u32, head0: head0 as u32, ..self }
    }
    /// Writing row (t, h) to slot `pos[t] % slots` of a cache.
    pub fn with_slots(self, slots: usize) -> Self {
        RopeParams { slots: slots as u32, ..self }
    }
}

/// `frac(inv_freq / 2pi) * 2^64` for the f32 `inv_freq` of `cpu::ops::rope_inv_freq`.
pub fn rope_turn_fraction(theta: f32, factor: f32, d: usize, i: usize) -> u64 {
    let inv = crate::cpu::ops::rope_inv_freq(theta, factor, d, i) as f64;
    let turns = inv / std::f64::consts::TAU;
    let frac = turns - turns.floor();
    // frac < 1: scale by 2^64 in two steps to keep the f64 exact.
    let hi = (frac * 4294967296.0).floor();
    let lo = ((frac * 4294967296.0 - hi) * 4294967296.0).floor();
    ((hi as u64) << 32) | (lo as u64 & 0xffff_ffff)
}

/// RoPE. Bindings: 0 params, 1 x `[T, heads, D]`, 2 pos (u32 `[T]`), 3 out, 4 norm weight
/// (norm kernels with a weight).
pub struct RopeKernel {
    pub kernel: Arc<Kernel>,
    /// Built with a norm in front (one workgroup per head row).
    norm: bool,
    maxg: u32,
}

impl RopeKernel {
    #[allow(clippy::too_many_arguments)]
    pub fn params(&self, t: usize, heads: usize, d: usize, theta: f32, factor: f32, pairs: usize) -> RopeParams {
        RopeParams::new(t, heads, d, theta, factor, pairs)
    }
    pub fn groups(&self, t: usize, heads: usize, d: usize) -> [u32; 3] {
        if self.norm {
            grid((t * heads) as u64, self.maxg)
        } else {
            grid(div_ceil(t * heads * (d / 2), 64) as u64, self.maxg)
        }
    }
    pub fn bind_group(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        pos: &wgpu::Buffer,
        out: &wgpu::Buffer,
        nw: Option<&wgpu::Buffer>,
    ) -> wgpu::BindGroup {
        let mut b = vec![(0, params), (1, x), (2, pos), (3, out)];
        if let Some(w) = nw {
            b.push((4, w));
        }
        self.kernel.bind_buffers(device, &b)
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, t: usize, heads: usize, d: usize) {
        self.kernel.dispatch(pass, bg, self.groups(t, heads, d));
    }
}

// -------------------------------------------------------------------- kv write

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct KvWriteParams {
    pub t: u32,
    pub row: u32,
    pub slots: u32,
    /// Row stride of x and the offset of the first element written (a head range of a wider value).
    pub x_ld: u32,
    pub x_off: u32,
    pub _pad: [u32; 3],
}

/// KV write. Bindings: 0 params, 1 x `[T, nkv, D]`, 2 pos, 3 cache `[S, nkv, D]` (written).
pub struct KvWriteKernel {
    pub kernel: Arc<Kernel>,
    maxg: u32,
}

impl KvWriteKernel {
    pub fn params(&self, t: usize, row: usize, slots: usize) -> KvWriteParams {
        KvWriteParams { t: t as u32, row: row as u32, slots: slots as u32, x_ld: row as u32, x_off: 0, _pad: [0; 3] }
    }
    /// Reading `row` elements from `x_off` of x rows of `x_ld`.
    pub fn params_strided(&self, t: usize, row: usize, slots: usize, x_ld: usize, x_off: usize) -> KvWriteParams {
        KvWriteParams { x_ld: x_ld as u32, x_off: x_off as u32, ..self.params(t, row, slots) }
    }
    pub fn groups(&self, t: usize, row: usize) -> [u32; 3] {
        grid(div_ceil(t * row, ELEM_WG as usize) as u64, self.maxg)
    }
    pub fn bind_group(&self, device: &wgpu::Device, params: &wgpu::Buffer, x: &wgpu::Buffer, pos: &wgpu::Buffer, cache: &wgpu::Buffer) -> wgpu::BindGroup {
        self.kernel.bind_buffers(device, &[(0, params), (1, x), (2, pos), (3, cache)])
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, t: usize, row: usize) {
        self.kernel.dispatch(pass, bg, self.groups(t, row));
    }
}

// -------------------------------------------------------------------- attention

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct AttentionParams {
    pub t: u32,
    pub nq: u32,
    pub nkv: u32,
    pub d: u32,
    pub slots: u32,
    pub window: u32,
    pub nsplit: u32,
    pub _pad0: u32,
    pub scale: f32,
    /// With append: the step's key heads start at head `k_head0` of q's row, its value heads
    /// at `v_head0`.
    pub k_head0: u32,
    pub v_head0: u32,
    pub _pad: u32,
}

impl AttentionParams {
    /// Where the step's key and value heads start in q's row (an appending pass).
    pub fn with_append(self, k_head0: usize, v_head0: usize) -> Self {
        AttentionParams { k_head0: k_head0 as u32, v_head0: v_head0 as u32, ..self }
    }
}

/// Attention. Bindings: 0 params, 1 q `[T, nq, D]`, 2 pos, 3 k, 4 v (`[S, nkv, D]`),
/// 5 out `[T, nq, D]` (split: the partials of [`AttnScratch`]; merged in the pass: the
/// output at 8 and the counters at 9).
/// Split combine bindings: 0 params (the same buffer), 1 partials, 2 out.
pub struct AttentionKernel {
    pub kernel: Arc<Kernel>,
    pub combine: Option<Arc<Kernel>>,
    pub nsplit: u32,
}

/// Scratch of a split attention: the partials, and a counter per query head when the pass
/// merges them (zeroed at creation; the merging workgroup zeroes its counter again).
pub struct AttnScratch {
    pub partials: wgpu::Buffer,
    pub counters: Option<wgpu::Buffer>,
}

impl AttentionKernel {
    #[allow(clippy::too_many_arguments)]
    pub fn params(&self, t: usize, nq: usize, nkv: usize, d: usize, slots: usize, scale: f32, window: Option<usize>) -> AttentionParams {
        assert!(nkv > 0 && nq % nkv == 0, "attention: {nq} heads over {nkv} kv heads");
        AttentionParams {
            t: t as u32,
            nq: nq as u32,
            nkv: nkv as u32,
            d: d as u32,
            slots: slots as u32,
            window: window.unwrap_or(0) as u32,
            nsplit: self.nsplit,
            _pad0: 0,
            scale,
            k_head0: 0,
            v_head0: 0,
            _pad: 0,
        }
    }

    /// Whether each head's last workgroup merges the split partials (splits, no combine).
    pub fn merges(&self) -> bool {
        self.nsplit > 1 && self.combine.is_none()
    }
    /// Bytes of the scratch buffer for split partials (per split: d values, then the max, the
    /// sum and two unused values, so that every split starts a vec4).
    pub fn partials_bytes(&self, t: usize, nq: usize, d: usize) -> u64 {
        (t * nq * self.nsplit as usize * (d + 4) * 4) as u64
    }
    /// The scratch buffers of a split attention over `t` queries of `nq` heads (`None`
    /// without splits).
    pub fn scratch(&self, gpu: &Gpu, name: &str, t: usize, nq: usize, d: usize) -> Option<AttnScratch> {
        if self.nsplit <= 1 {
            return None;
        }
        let partials = gpu.storage(&format!("{name}.partials"), self.partials_bytes(t, nq, d));
        let counters = self.merges().then(|| gpu.storage(&format!("{name}.counters"), (t * nq * 4) as u64));
        Some(AttnScratch { partials, counters })
    }
    /// `out` is the final output, `scratch` the split's buffers (split only); `extra`: more
    /// bindings (q's rope params at 6 and norm weight at 7 with a fused q norm + RoPE).
    #[allow(clippy::too_many_arguments)]
    pub fn bind_groups(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        q: &wgpu::Buffer,
        pos: &wgpu::Buffer,
        k: &wgpu::Buffer,
        v: &wgpu::Buffer,
        out: &wgpu::Buffer,
        scratch: Option<&AttnScratch>,
        extra: &[(u32, &wgpu::Buffer)],
    ) -> (wgpu::BindGroup, Option<wgpu::BindGroup>) {
        let mut b = vec![(0, params), (1, q), (2, pos), (3, k), (4, v)];
        b.extend_from_slice(extra);
        if self.nsplit <= 1 {
            b.push((5, out));
            return (self.kernel.bind_buffers(device, &b), None);
        }
        let s = scratch.expect("split attention needs its scratch buffers");
        b.push((5, &s.partials));
        if self.merges() {
            b.push((8, out));
            b.push((9, s.counters.as_ref().expect("a merging split attention needs its counters")));
        }
        let a = self.kernel.bind_buffers(device, &b);
        let c = self.combine.as_ref().map(|c| c.bind_buffers(device, &[(0, params), (1, &s.partials), (2, out)]));
        (a, c)
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &(wgpu::BindGroup, Option<wgpu::BindGroup>), t: usize, nq: usize) {
        self.kernel.dispatch(pass, &bg.0, [nq as u32, t as u32, self.nsplit]);
        if let (Some(c), Some(b)) = (&self.combine, &bg.1) {
            c.dispatch(pass, b, [nq as u32, t as u32, 1]);
        }
    }
}

/// A split count for decode attention: enough workgroups to fill a large GPU when
/// `heads * tokens` alone cannot, a split per 32 cache slots (`MARKBASE_ATTN_SPLIT_KEYS`),
/// at most 256 workgroups' worth. On the H200 32 keys per split decoded 12B 27% faster
/// than 256 at a 512-token context: a workgroup walks its keys serially.
pub fn attention_splits(slots: usize, heads: usize, t: usize) -> usize {
    if t > 1 {
        return 1;
    }
    let keys = std::env::var("MARKBASE_ATTN_SPLIT_KEYS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&k| k > 0).unwrap_or(32);
    let by_len = slots.div_ceil(keys);
    let by_occupancy = 256usize.div_ceil(heads.max(1));
    by_len.min(by_occupancy).clamp(1, 64)
}

// -------------------------------------------------------------------- elementwise

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct ElementwiseParams {
    pub n: u32,
    pub nb: u32,
    pub op: u32,
    pub _pad0: u32,
    pub f: f32,
    pub _pad: [u32; 3],
}

impl ElementwiseParams {
    pub fn geglu(n: usize) -> Self {
        ElementwiseParams { n: n as u32, nb: n as u32, ..Default::default() }
    }
    /// `nb`: element count of `b` (broadcast over `a`).
    pub fn binary(f: BinaryOp, n: usize, nb: usize) -> Self {
        let op = match f {
            BinaryOp::Add => 0,
            BinaryOp::Mul => 1,
        };
        ElementwiseParams { n: n as u32, nb: nb.max(1) as u32, op, ..Default::default() }
    }
    pub fn unary(f: UnaryOp, n: usize) -> Self {
        let (op, v) = match f {
            UnaryOp::Scale { factor } => (0, factor),
            UnaryOp::Gelu => (1, 0.0),
            UnaryOp::Softcap { cap } => (2, cap),
            UnaryOp::Tanh => (3, 0.0),
        };
        ElementwiseParams { n: n as u32, nb: 1, op, f: v, ..Default::default() }
    }
}

/// GeGLU / Binary / Unary. Bindings: 0 params, 1 a, 2 out, 3 b (GeGLU: up; Binary: b as stored).
pub struct ElementwiseKernel {
    pub kernel: Arc<Kernel>,
    maxg: u32,
}

impl ElementwiseKernel {
    pub fn groups(&self, n: usize) -> [u32; 3] {
        grid(div_ceil(n, ELEM_WG as usize) as u64, self.maxg)
    }
    pub fn bind_group(&self, device: &wgpu::Device, params: &wgpu::Buffer, a: &wgpu::Buffer, out: &wgpu::Buffer, b: Option<&wgpu::Buffer>) -> wgpu::BindGroup {
        let mut v = vec![(0, params), (1, a), (2, out)];
        if let Some(b) = b {
            v.push((3, b));
        }
        self.kernel.bind_buffers(device, &v)
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, n: usize) {
        self.kernel.dispatch(pass, bg, self.groups(n));
    }
}

// -------------------------------------------------------------------- routing

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct RoutingParams {
    pub t: u32,
    /// Experts (WeightedSum: S).
    pub e: u32,
    /// Selected per token (WeightedSum: D).
    pub k: u32,
    pub _pad: u32,
}

/// TopK (bindings 0 params, 1 logits `[T, E]`, 2 ids out `[T, k]`), TopKSoftmax (0 params,
/// 1 logits, 2 ids, 3 out `[T, k]`, 4 scale `[E]` as stored) and WeightedSum (0 params,
/// 1 x `[T, S, D]`, 2 w `[T, S]`, 3 out `[T, D]`).
pub struct RoutingKernel {
    pub kernel: Arc<Kernel>,
    wg: u32,
    maxg: u32,
}

impl RoutingKernel {
    pub fn params(&self, t: usize, e: usize, k: usize) -> RoutingParams {
        RoutingParams { t: t as u32, e: e as u32, k: k as u32, _pad: 0 }
    }
    /// Invocations: TopK T*E, TopKSoftmax T, WeightedSum T*D.
    pub fn groups(&self, invocations: usize) -> [u32; 3] {
        grid(div_ceil(invocations, self.wg as usize) as u64, self.maxg)
    }
    pub fn bind_group(&self, device: &wgpu::Device, bufs: &[(u32, &wgpu::Buffer)]) -> wgpu::BindGroup {
        self.kernel.bind_buffers(device, bufs)
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, invocations: usize) {
        self.kernel.dispatch(pass, bg, self.groups(invocations));
    }
}

// -------------------------------------------------------------------- expert grouping

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct MoeGroupParams {
    /// Pairs (T*S).
    pub pairs: u32,
    pub experts: u32,
    pub _pad: [u32; 2],
}

/// `Op::MoeGroup` (one workgroup). Bindings: 0 params, 1 ids (u32 `[T*S]`), 2 out
/// (u32 `[E + 1 + T*S]`).
pub struct MoeGroupKernel {
    pub kernel: Arc<Kernel>,
}

impl MoeGroupKernel {
    pub fn params(&self, pairs: usize, experts: usize) -> MoeGroupParams {
        MoeGroupParams { pairs: pairs as u32, experts: experts as u32, _pad: [0; 2] }
    }
    pub fn bind_group(&self, device: &wgpu::Device, params: &wgpu::Buffer, ids: &wgpu::Buffer, out: &wgpu::Buffer) -> wgpu::BindGroup {
        self.kernel.bind_buffers(device, &[(0, params), (1, ids), (2, out)])
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup) {
        self.kernel.dispatch(pass, bg, [1, 1, 1]);
    }
}

// -------------------------------------------------------------------- copy

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct CopyParams {
    pub outer: u32,
    pub len: u32,
    pub inner: u32,
    pub src_axis: u32,
    pub src_off: u32,
    pub dst_axis: u32,
    pub dst_off: u32,
    pub _pad: u32,
}

impl CopyParams {
    fn outer_inner(shape: &[usize], axis: usize) -> (usize, usize) {
        (shape[..axis].iter().product(), shape[axis + 1..].iter().product())
    }
    /// Slice `len` entries from `start` along `axis` of a tensor of `shape`.
    pub fn slice(shape: &[usize], axis: usize, start: usize, len: usize) -> Self {
        let (outer, inner) = Self::outer_inner(shape, axis);
        CopyParams {
            outer: outer as u32,
            len: len as u32,
            inner: inner as u32,
            src_axis: shape[axis] as u32,
            src_off: start as u32,
            dst_axis: len as u32,
            dst_off: 0,
            _pad: 0,
        }
    }
    /// One part of a concat: the part (size `len` along `axis`) goes to offset `off` of the
    /// output of shape `out_shape`.
    pub fn concat_part(out_shape: &[usize], axis: usize, off: usize, len: usize) -> Self {
        let (outer, inner) = Self::outer_inner(out_shape, axis);
        CopyParams {
            outer: outer as u32,
            len: len as u32,
            inner: inner as u32,
            src_axis: len as u32,
            src_off: 0,
            dst_axis: out_shape[axis] as u32,
            dst_off: off as u32,
            _pad: 0,
        }
    }
    pub fn elements(&self) -> usize {
        self.outer as usize * self.len as usize * self.inner as usize
    }
}

/// Slice / concat copy of 32-bit elements. Bindings: 0 params, 1 src, 2 dst.
pub struct CopyKernel {
    pub kernel: Arc<Kernel>,
    maxg: u32,
}

impl CopyKernel {
    pub fn groups(&self, p: &CopyParams) -> [u32; 3] {
        grid(div_ceil(p.elements(), ELEM_WG as usize) as u64, self.maxg)
    }
    pub fn bind_group(&self, device: &wgpu::Device, params: &wgpu::Buffer, src: &wgpu::Buffer, dst: &wgpu::Buffer) -> wgpu::BindGroup {
        self.kernel.bind_buffers(device, &[(0, params), (1, src), (2, dst)])
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, p: &CopyParams) {
        self.kernel.dispatch(pass, bg, self.groups(p));
    }
}

// -------------------------------------------------------------------- argmax

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct ArgmaxParams {
    pub v: u32,
    pub offset: u32,
    pub _pad: [u32; 2],
}

impl ArgmaxParams {
    /// Argmax of the last row of `logits[T, V]`.
    pub fn last_row(t: usize, v: usize) -> Self {
        ArgmaxParams { v: v as u32, offset: ((t - 1) * v) as u32, _pad: [0; 2] }
    }
}

/// Argmax (one workgroup). Bindings: 0 params, 1 logits, 2 out (u32 `[1]`).
pub struct ArgmaxKernel {
    pub kernel: Arc<Kernel>,
}

impl ArgmaxKernel {
    pub fn bind_group(&self, device: &wgpu::Device, params: &wgpu::Buffer, logits: &wgpu::Buffer, out: &wgpu::Buffer) -> wgpu::BindGroup {
        self.kernel.bind_buffers(device, &[(0, params), (1, logits), (2, out)])
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup) {
        self.kernel.dispatch(pass, bg, [1, 1, 1]);
    }
}
