//! Matmuls over quantized or float weights: the GEMV (`gemv.wgsl`: one to seven tokens, gathered
//! experts, fused norm, dual and concatenated weights) and the tiled GEMM (`gemm.wgsl`: plain, split
//! and expert-grouped).

use std::sync::Arc;

use petgraph::graph::NodeIndex;
use markbase_graph::ops::Op;
use markbase_graph::quant::FloatType;

use crate::gpu::device::GpuError;
use crate::gpu::kernels::{all_formats, div_ceil, dt_code, env_on, env_u32, weight_source, COMMON, Kernel, KernelSpec, Kernels, WEIGHTS};
use crate::gpu::shader::Source;
use crate::gpu::weights::{GpuFormat, GpuWeight};
use super::gemm_f16::{self, CoopMode};
use super::{Family, LowerCtx};
pub use super::matmul_launch::{GatherDims, MatMulDims, MatMulKernel, MatMulParams};

const GEMV: &str = include_str!("../../../wgsl/gemv.wgsl");
const GEMM: &str = include_str!("../../../wgsl/gemm.wgsl");
const GEMM_COMMON: &str = include_str!("../../../wgsl/gemm_common.wgsl");

/// From this many tokens on, a plain matmul uses the tiled GEMM instead of the GEMV.
pub const GEMM_MIN_T: usize = 8;
/// Tokens per workgroup of a batch decode step's GEMV from 4 rows on
/// ([`Kernels::matmul_rowwise`]; `MARKBASE_ROW_TT` overrides, 2 to 8).
pub const ROW_TT: u32 = 4;
/// Weight rows per workgroup of a batch decode step's GEMV (formats whose decoders allow more
/// than two): measured on an H100 (Gemma 3 12B), 8 rows against 4: a step of 2 rows 16.5 ms
/// against 19.3, 16 rows 65.1 against 82.7, 64 rows 226 against 291. (Staging the activations
/// through workgroup memory, for coalesced loads, measured slower: 18.0 / 87.4 / 311 ms.)
pub const ROW_R: u32 = 8;
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
pub(crate) fn gemm_tile_rows(wide: bool) -> usize {
    if wide {
        128
    } else {
        64
    }
}

/// Tiles of a GEMM over `rows` weight rows and `t` tokens.
pub(crate) fn gemm_tiles(rows: usize, t: usize, wide: bool) -> usize {
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

/// Whether a GEMV walks half blocks: affine 4-bit, K % 32 == 0, one block per step.
/// Two invocations share each 32-element block, each taking alternate runs of four elements,
/// so that every vec4 load of activations by a subgroup reads whole 32-byte sectors (an
/// invocation's own 128-byte block made each load touch as many lines as it has invocations).
/// Not for the dual GEMV: it reads two weights per step, and whole blocks measured faster.
/// Several tokens (not gathered: a batch's decode steps, short prompts) hold half as many
/// activations per step that way, and take it too unless `MARKBASE_ROW_HALF=0`.
fn gemv_half(fmt: GpuFormat, tt: u32, xvec: bool, bp2: bool, dual: bool) -> bool {
    (tt == 1 || env_on("MARKBASE_ROW_HALF")) && xvec && !bp2 && !dual && matches!(fmt, GpuFormat::Affine { bits: 4, .. })
}

/// The token count [`gemv_half`] decides by: the several-token path's (2) for a one-token group
/// of a batch's decode step (`several`).
fn tt_half(tt: u32, several: bool) -> u32 {
    if several {
        tt.max(2)
    } else {
        tt
    }
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

/// A GEMV workgroup size from `gemv_wg` held to at most `cap` invocations, unless
/// `MARKBASE_GEMV_WG` sets it.
fn gemv_wg_capped(wg: u32, cap: u32) -> u32 {
    if env_u32("MARKBASE_GEMV_WG").is_some() {
        wg
    } else {
        wg.min(cap)
    }
}

pub(crate) const FAMILY: Family = Family { name, source, variants };

/// Whether a GEMV walks its token groups along the grid's x (gemv.wgsl's TOKX): several
/// tokens, not gathered.
pub(crate) fn gemv_tokx(gather: bool, tt: u32) -> bool {
    !gather && tt > 1
}

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::Gemv { fmt, wg, rows, tt, gather, xvec, bp2, norm, dual, half, several } => format!(
            "gemv[{} wg{wg} r{rows} t{tt}{}{}{}{}{}{}{}]",
            fmt.describe(),
            if *several && *tt == 1 { " rowwise" } else { "" },
            if *dual { " geglu" } else { "" },
            match norm {
                Some(w) => format!(" norm[{}]", w.map_or("none", |t| t.name())),
                None => String::new(),
            },
            if *bp2 { " bp2" } else { "" },
            if *half && gemv_half(*fmt, tt_half(*tt, *several), *xvec, *bp2, *dual) { " half" } else { "" },
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
        _ => return None,
    })
}

fn source(spec: &KernelSpec, sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::Gemv { fmt, wg, rows, tt, gather, xvec, bp2, norm, dual, half, several } => {
            let files: &[&'static str] = if dual { &[COMMON, WEIGHTS, weights_second(), GEMV] } else { &[COMMON, WEIGHTS, GEMV] };
            let rs = rows * tt * if dual { 2 } else { 1 };
            let half = half && gemv_half(fmt, tt_half(tt, several), xvec, bp2, dual);
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
                .flag("TT1", tt == 1 && !several)
                .flag("TOKX", gemv_tokx(gather, tt))
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
                .flag("TOKX", false)
                .flag("BP2", false)
                .flag("HALF", half)
                .flag("CAT", true)
                .flag("CAT3", n == 3);
            weight_source(s, fmt, true, xvec, half)
        }
        KernelSpec::Gemm { fmt, wide, split, xvec } => {
            let s = Source::new(&[COMMON, WEIGHTS, GEMM_COMMON, GEMM]).c("WG", 256);
            weight_source(s.flag("WIDE", wide).flag("SPLIT", split).flag("XVEC", xvec), fmt, false, false, false)
        }
        KernelSpec::GroupedGemm { fmt } => {
            weight_source(Source::new(&[COMMON, WEIGHTS, GEMM_COMMON, GEMM]).c("WG", 256).flag("GROUPED", true), fmt, false, false, false)
        }
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
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
                        v.push(KernelSpec::Gemv { fmt, wg: 128, rows: if tt == 1 { 8 } else { 4 }, tt, gather, xvec, bp2, norm: None, dual: false, half, several: false });
                        if tt == 1 && !gather && !bp2 {
                            // a batch's decode step of one row
                            v.push(KernelSpec::Gemv { fmt, wg: 128, rows: 8, tt, gather, xvec, bp2, norm: None, dual: false, half, several: true });
                        }
                        if tt == 1 && !gather {
                            let norm = Some(if bp2 { None } else { Some(FloatType::Bf16) });
                            v.push(KernelSpec::Gemv { fmt, wg: 128, rows: 8, tt, gather, xvec, bp2, norm, dual: false, half, several: false });
                            if !bp2 {
                                if half {
                                    // the dual GEMV walks whole blocks
                                    for rows in [4, 8] {
                                        v.push(KernelSpec::Gemv { fmt, wg: 128, rows, tt, gather, xvec, bp2, norm, dual: true, half: false, several: false });
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
    }
    v
}

impl Kernels {
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
        self.matmul_spec(KernelSpec::Gemv { fmt, wg, rows, tt, gather, xvec, bp2: false, norm, dual: true, half: false, several: false })
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
            KernelSpec::Gemv { fmt, wg, rows, tt, gather, xvec, bp2, norm, dual: false, half, several: false }
        } else {
            let wide = env_u32("MARKBASE_GEMM_WIDE").map_or(n.is_some_and(|n| gemm_tiles(n, t, true) >= GEMM_WIDE_MIN_TILES), |v| v != 0);
            if self.opts.coop != CoopMode::Off && n.is_none_or(|n| gemm_f16::takes_f16(n, k, t)) {
                return Ok(self.f16_spec(fmt, k, n.unwrap_or(usize::MAX), t, false));
            }
            let split = !wide && self.opts.merge_splits && n.is_some_and(|n| gemm_ksplit(gemm_tiles(n, t, false), k) > 1);
            KernelSpec::Gemm { fmt, wide, split, xvec: k % 4 == 0 }
        };
        Ok(spec)
    }

    /// Whether a batch's decode steps take the f16 GEMM ([`Kernels::matmul_rowwise`]) instead of
    /// the GEMV: with `MARKBASE_ROW_GEMM=f16` (`--batch-f16`) wherever the f16 GEMM is on (its
    /// FMA twin too). Measured on an H100 (Gemma 3 12B, steps of 2 / 16 / 64 rows): 57.5 / 60.5 /
    /// 74.2 ms against the GEMV's 14.6 / 47.2 / 150.2, so the GEMV stays the default: the f16
    /// GEMM's weight staging (about 124 GB/s of 4-bit weights) bounds its steps.
    pub fn row_gemm(&self) -> bool {
        std::env::var("MARKBASE_ROW_GEMM").is_ok_and(|v| v == "f16") && self.opts.coop != CoopMode::Off
    }

    /// The f16 GEMM's spec for `fmt` over `n` x `k` and `t` tokens (`grouped`: `t` per expert,
    /// on average; the default staging).
    fn f16_spec(&self, fmt: GpuFormat, k: usize, n: usize, t: usize, grouped: bool) -> KernelSpec {
        let (coop, hilo) = (self.opts.coop.coop().0, gemm_f16::hilo(fmt, k));
        let smem = self.limits.max_compute_workgroup_storage_size;
        let (mt, nt) = if grouped { (gemm_f16::tile_mt(coop, hilo, n, t, smem), 2) } else { gemm_f16::tile_shape(fmt, coop, hilo, n, t, smem) };
        let mut spec = self.f16_spec_mt(fmt, k, mt, nt, grouped);
        let cut = gemm_f16::prefill_split(&spec, n, k, t, self.opts.merge_splits);
        if let KernelSpec::GemmF16 { split, .. } = &mut spec {
            *split = cut;
        }
        spec
    }

    /// The f16 GEMM's spec for `fmt` over rows of `k` with tiles of `mt` x `nt`
    /// ([`gemm_f16::tile_shape`]), K whole: the split of the inputs the format takes, the
    /// default staging for those tiles.
    fn f16_spec_mt(&self, fmt: GpuFormat, k: usize, mt: u8, nt: u8, grouped: bool) -> KernelSpec {
        let ((coop, m8), hilo) = (self.opts.coop.coop(), gemm_f16::hilo(fmt, k));
        let center = hilo == gemm_f16::Hilo::X && gemm_f16::center(fmt, k);
        let (bk, db) = if grouped { (32, false) } else { gemm_f16::staging(coop, hilo, mt, nt, self.limits.max_compute_workgroup_storage_size) };
        KernelSpec::GemmF16 { fmt, coop, m8, hilo, mt, nt, vs: gemm_f16::vs(hilo), center, bk, db, grouped, split: false }
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
        if !matches!(spec, KernelSpec::Gemv { .. } | KernelSpec::GemvCat { .. } | KernelSpec::Gemm { .. } | KernelSpec::GroupedGemm { .. } | KernelSpec::GemmF16 { .. }) {
            return Err(GpuError::Kernel { name: spec.name(), msg: "not a matmul spec".into() });
        }
        Ok(MatMulKernel { kernel: self.get(spec)?, spec, maxg: self.maxg() })
    }

    /// The activations' pass of the f16 GEMM `mm` ([`KernelSpec::RowScale`]) over rows of `k`.
    pub fn row_scale(&self, mm: &MatMulKernel, k: usize) -> Result<Arc<Kernel>, GpuError> {
        let lo = matches!(mm.spec, KernelSpec::GemmF16 { hilo, .. } if hilo.x());
        let aug = match mm.spec {
            KernelSpec::GemmF16 { fmt: GpuFormat::Affine { group, .. }, center: true, .. } => group,
            _ => 0,
        };
        self.get(KernelSpec::RowScale { xvec: k % 4 == 0, lo, aug })
    }

    /// A matmul of a batch's decode step (`t` rows, one per sequence) over rows of `k`:
    /// the f16 GEMM with K in parts ([`Kernels::row_f16`]) where [`Kernels::row_gemm`] says so,
    /// else the several-token GEMV ([`Kernels::row_gemv`]). Either way, at every row count of the
    /// graphs a batch runs, for a given weight: a row's sums do not depend on the other rows.
    pub fn matmul_rowwise(&self, fmt: GpuFormat, k: usize, t: usize) -> Result<MatMulKernel, GpuError> {
        if self.row_gemm() {
            return self.row_f16(fmt, k);
        }
        self.row_gemv(fmt, k, t)
    }

    /// The f16 GEMM of a batch's decode steps over rows of `k` (the same kernel at every row
    /// count): tiles of 64 tokens, K in [`gemm_f16::ksplit`] parts (a number each dispatch's
    /// weight rows set) (where the backend
    /// merges splits in a kernel; else whole), each part's sums added in part order, so that a
    /// row's result is the same whatever the other rows. One tile of tokens up to 64 rows: the
    /// weights are decoded once per step, where the GEMV decodes them once per four rows.
    pub fn row_f16(&self, fmt: GpuFormat, k: usize) -> Result<MatMulKernel, GpuError> {
        fmt.check_k(k).map_err(|m| GpuError::Kernel { name: "matmul".into(), msg: m })?;
        // tiles of 64 tokens; `MARKBASE_ROW_MT=1` takes tiles of 32 (the same sums per row)
        let mt = if env_u32("MARKBASE_ROW_MT") == Some(1) { 1 } else { 2 };
        let mut spec = self.f16_spec_mt(fmt, k, mt, 2, false);
        if let KernelSpec::GemmF16 { split, .. } = &mut spec {
            *split = self.opts.merge_splits;
        }
        self.matmul_spec(spec)
    }

    /// The several-token GEMV of a batch's decode steps (`t` rows), in token groups of
    /// [`ROW_TT`] (2 for fewer rows, 1 for one row: the several-token path still), with the
    /// workgroup size of every several-token GEMV over rows of `k`. A row's sums are then those of the same row at any other row count: blocks
    /// split over the workgroup the same way, reduced in the same order (the token group and the
    /// rows per workgroup change only which accumulators a workgroup holds). The token groups of
    /// a row group are neighbouring workgroups, so that they read the same weights at about the
    /// same time.
    pub fn row_gemv(&self, fmt: GpuFormat, k: usize, t: usize) -> Result<MatMulKernel, GpuError> {
        // the GEMV of two tokens (its rows per workgroup and workgroup size are those of every
        // several-token GEMV), with the token group of this row count
        let mut spec = self.matmul_spec_for(fmt, k, 2, false, None, None)?;
        if let KernelSpec::Gemv { tt, rows, several, .. } = &mut spec {
            if t >= 4 {
                *tt = env_u32("MARKBASE_ROW_TT").unwrap_or(ROW_TT).clamp(2, 8);
            }
            // one row: groups of one token on the same path (no second token's work)
            if t == 1 {
                *tt = 1;
            }
            *several = true;
            // the decoders light enough for four rows take eight
            if *rows == 4 && env_u32("MARKBASE_GEMV_ROWS").is_none() {
                *rows = ROW_R;
            }
        }
        self.matmul_spec(spec)
    }

    /// `Op::GroupedMatMul`: the expert-grouped GEMM over an expert stack with rows of `k`.
    /// Dims: [`MatMulDims::gathered`]; binding 3 is the `Op::MoeGroup` value.
    pub fn grouped_matmul(&self, fmt: GpuFormat, k: usize) -> Result<MatMulKernel, GpuError> {
        fmt.check_k(k).map_err(|m| GpuError::Kernel { name: "grouped_matmul".into(), msg: m })?;
        self.matmul_spec(KernelSpec::GroupedGemm { fmt })
    }

    /// `Op::GroupedMatMul` over a stack of `experts` experts of `n` x `k` for `pairs` (token,
    /// expert) pairs: the f16 GEMM grouped where it is on and one expert's weight is large
    /// enough for the pairs' work ([`gemm_f16::takes_f16`] with the pairs as tokens), else
    /// [`Kernels::grouped_matmul`].
    pub fn grouped_matmul_rows(&self, fmt: GpuFormat, k: usize, n: usize, pairs: usize, experts: usize) -> Result<MatMulKernel, GpuError> {
        fmt.check_k(k).map_err(|m| GpuError::Kernel { name: "grouped_matmul".into(), msg: m })?;
        if self.opts.coop != CoopMode::Off && gemm_f16::takes_f16(n, k, pairs) {
            return self.matmul_spec(self.f16_spec(fmt, k, n, pairs.div_ceil(experts.max(1)), true));
        }
        self.grouped_matmul(fmt, k)
    }
}


/// Records the dispatches of `y = x Wᵀ` over `rows` rows of `x` (an `Op::MatMul`, or a
/// matmul another op's lowering needs): the f16 GEMM's row scales first where it runs (unless
/// the shared buffers hold those of node `src` already), then one dispatch per chunk of `w`.
pub(crate) fn matmul_into(cx: &mut LowerCtx, w: &GpuWeight, x: &wgpu::Buffer, src: Option<NodeIndex>, rows: usize, y: &wgpu::Buffer) -> Result<(), String> {
    let (dev, kernels) = (cx.dev(), cx.kernels);
    let k = if cx.row_batch {
        kernels.matmul_rowwise(w.format, w.k, rows)
    } else {
        kernels.matmul_rows(w.format, w.k, w.rows, rows, false)
    }
    .map_err(cx.kerr())?;
    let scales = if k.is_f16() { Some(f16_activations(cx, &k, w, x, src, rows)?) } else { None };
    for ci in 0..w.chunks.len() {
        let d = MatMulDims::plain(w, ci, rows);
        let p = cx.uni(bytemuck::bytes_of(&k.params(&d)))?;
        let bg = if k.is_split() {
            let (pb, cb) = k.split_scratch_bytes(&d);
            if cx.acc.split_scratch.as_ref().is_none_or(|(a, b)| a.size() < pb || b.size() < cb) {
                let pair = (cx.gpu.try_storage("gemm.partials", pb).map_err(|e| e.to_string())?, cx.gpu.try_storage("gemm.counters", cb).map_err(|e| e.to_string())?);
                cx.acc.scratch.extend([pair.0.clone(), pair.1.clone()]);
                cx.acc.split_scratch = Some(pair);
            }
            let (part, done) = cx.acc.split_scratch.as_ref().expect("allocated above");
            match &scales {
                Some((sb, xb)) => k.bind_group_f16(dev, &p, xb, y, sb, None, Some((part, done)), w, ci),
                None => k.bind_group_split(dev, &p, x, y, part, done, w, ci),
            }
        } else if let Some((sb, xb)) = &scales {
            k.bind_group_f16(dev, &p, xb, y, sb, None, None, w, ci)
        } else {
            k.bind_group(dev, &p, x, y, None, w, ci)
        };
        cx.push(k.kernel.clone(), bg, k.groups(&d));
    }
    Ok(())
}

/// Records the f16 GEMM `k`'s activations' pass over `rows` rows of `x` (rows of `w.k`; node
/// `src`'s value, where it is one) into the scratch buffers the graph's f16 GEMMs share (grown to
/// fit), unless they hold that already: returns the row scales and x / s in f16.
fn f16_activations(cx: &mut LowerCtx, k: &MatMulKernel, w: &GpuWeight, x: &wgpu::Buffer, src: Option<NodeIndex>, rows: usize) -> Result<(wgpu::Buffer, wgpu::Buffer), String> {
    let (dev, kernels) = (cx.dev(), cx.kernels);
    let rk = kernels.row_scale(k, w.k).map_err(cx.kerr())?;
    let of = src.map(|n| (n, rows, w.k, rk.name.clone()));
    if of.is_some() && cx.acc.x16_of == of {
        if let (Some(sb), Some(xb)) = (&cx.acc.row_scales, &cx.acc.x16) {
            return Ok((sb.clone(), xb.clone()));
        }
    }
    let bytes = (rows.max(1) * 4) as u64;
    if cx.acc.row_scales.as_ref().is_none_or(|b| b.size() < bytes) {
        let b = cx.gpu.try_storage("gemm.row_scales", bytes).map_err(|e| e.to_string())?;
        cx.acc.scratch.push(b.clone());
        cx.acc.row_scales = Some(b);
    }
    let bytes = gemm_f16::x16_bytes(&k.spec, rows, w.k);
    if cx.acc.x16.as_ref().is_none_or(|b| b.size() < bytes) {
        let b = cx.gpu.try_storage("gemm.x16", bytes).map_err(|e| e.to_string())?;
        cx.acc.scratch.push(b.clone());
        cx.acc.x16 = Some(b);
    }
    let sb = cx.acc.row_scales.clone().expect("allocated above");
    let xb = cx.acc.x16.clone().expect("allocated above");
    cx.acc.x16_of = of;
    let p = cx.uni(bytemuck::bytes_of(&k.params(&MatMulDims::plain(w, 0, rows))))?;
    let bg = rk.bind_buffers(dev, &[(0, &p), (1, x), (5, &xb), (7, &sb)]);
    cx.push(rk, bg, gemm_f16::row_scale_groups(rows, kernels.maxg()));
    Ok((sb, xb))
}

/// Lowers the matmul ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::MatMul => {
            let rows = cx.graph.node(cx.ins[0]).ty.rows();
            let (w, x, y) = (cx.mat(1)?, cx.input(0)?, cx.out()?);
            let src = cx.ins[0];
            matmul_into(cx, w, &x, Some(src), rows, &y)?;
        }
        Op::GatherMatMul => {
            let w = cx.mat(2)?;
            let ids_shape = cx.shape_of(1);
            let (t, s) = (ids_shape[0], ids_shape[1]);
            let bcast = cx.graph.node(cx.ins[0]).ty.shape.len() == 2;
            let k = kernels.matmul(w.format, w.k, t * s, true).map_err(cx.kerr())?;
            for ci in 0..w.chunks.len() {
                let d = MatMulDims::gathered(w, ci, t, s, bcast);
                let p = cx.uni(bytemuck::bytes_of(&k.params(&d)))?;
                let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.out()?, Some(&cx.input(1)?), w, ci);
                cx.push(k.kernel.clone(), bg, k.groups(&d));
            }
        }
        Op::GroupedMatMul => {
            let w = cx.mat(2)?;
            let ids_shape = cx.shape_of(1);
            let (t, s) = (ids_shape[0], ids_shape[1]);
            let bcast = cx.graph.node(cx.ins[0]).ty.shape.len() == 2;
            let k = kernels.grouped_matmul_rows(w.format, w.k, w.rows_per_expert, t * s, w.experts).map_err(cx.kerr())?;
            let (x, groups) = (cx.input(0)?, cx.input(3)?);
            // the f16 GEMM's activations: x's own rows (a token's, shared by its pairs, or a pair's)
            let scales = if k.is_f16() { Some(f16_activations(cx, &k, w, &x, None, if bcast { t } else { t * s })?) } else { None };
            for ci in 0..w.chunks.len() {
                let d = MatMulDims::gathered(w, ci, t, s, bcast);
                let p = cx.uni(bytemuck::bytes_of(&k.params(&d)))?;
                let bg = match &scales {
                    Some((sb, xb)) => k.bind_group_f16(dev, &p, xb, &cx.out()?, sb, Some(&groups), None, w, ci),
                    None => k.bind_group(dev, &p, &x, &cx.out()?, Some(&groups), w, ci),
                };
                cx.push(k.kernel.clone(), bg, k.groups(&d));
            }
        }
        Op::NormGeGlu { eps, scale } => {
            let (gi, ui) = (cx.ins.len() - 2, cx.ins.len() - 1);
            let (w, wu) = (cx.mat(gi)?, cx.mat(ui)?);
            if w.format != wu.format || w.k != wu.k || w.rows != wu.rows || w.chunks.len() != wu.chunks.len() {
                return Err(cx.fail("gate and up differ in format or shape"));
            }
            let rows = cx.graph.node(cx.ins[0]).ty.rows();
            if rows != 1 {
                return Err(cx.fail(format!("a fused GeGLU runs on one token, not {rows}")));
            }
            let nw = cx.norm_w()?;
            let k = kernels.norm_geglu(w.format, w.k, w.rows, nw.map(|v| v.1)).map_err(cx.kerr())?;
            for ci in 0..w.chunks.len() {
                let d = MatMulDims::plain(w, ci, rows).with_norm(*scale, *eps);
                let p = cx.uni(bytemuck::bytes_of(&k.params(&d)))?;
                let bg = k.bind_group_norm(dev, &p, &cx.input(0)?, &cx.out()?, nw.map(|v| &v.0), w, Some(wu), ci);
                cx.push(k.kernel.clone(), bg, k.groups(&d));
            }
        }
        Op::NormMatMul { eps, scale } => {
            let first_w = op.norm_weight_input().map_or(1, |i| i + 1);
            let ws = (first_w..cx.ins.len()).map(|i| cx.mat(i)).collect::<Result<Vec<_>, _>>()?;
            let rows = cx.graph.node(cx.ins[0]).ty.rows();
            let nw = cx.norm_w()?;
            if rows != 1 {
                return Err(cx.fail(format!("a fused norm runs on one token, not {rows}")));
            }
            let ldy = cx.node.ty.last();
            let cat = if ws.len() > 1 { kernels.norm_matmul_cat(&ws, nw.map(|v| v.1)).map_err(cx.kerr())? } else { None };
            if let Some(k) = cat {
                // every weight in one dispatch
                let d = MatMulDims::cat(&ws).with_norm(*scale, *eps);
                let p = cx.uni(bytemuck::bytes_of(&k.params(&d)))?;
                let bg = k.bind_group_cat(dev, &p, &cx.input(0)?, &cx.out()?, nw.map(|v| &v.0), &ws);
                cx.push(k.kernel.clone(), bg, k.groups(&d));
            } else {
                // weight by weight, chunk by chunk, each into its columns
                let mut col = 0;
                for w in &ws {
                    let k = kernels.norm_matmul(w.format, w.k, nw.map(|v| v.1)).map_err(cx.kerr())?;
                    for ci in 0..w.chunks.len() {
                        let d = MatMulDims::plain(w, ci, rows).with_norm(*scale, *eps);
                        let d = MatMulDims { row_start: col + d.row_start, ldy, ..d };
                        let p = cx.uni(bytemuck::bytes_of(&k.params(&d)))?;
                        let bg = k.bind_group_norm(dev, &p, &cx.input(0)?, &cx.out()?, nw.map(|v| &v.0), w, None, ci);
                        cx.push(k.kernel.clone(), bg, k.groups(&d));
                    }
                    col += w.rows;
                }
            }
        }
        _ => return Err(cx.not_ours("matmul")),
    }
    Ok(())
}
