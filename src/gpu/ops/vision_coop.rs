//! The vision towers' bidirectional attention (`Op::FullAttention`) on f16 tiles
//! (`vision_attn_coop.wgsl`): a flash attention whose products run on cooperative matrices
//! (tensor cores) where the f16 GEMM's mode is [`CoopMode::Tensor`] (see
//! [`VISION_ATTN_COOP_DEFAULT`]), or as their twin with a plain FMA loop ([`CoopMode::Fma`]: the
//! tests' software rasterizer checks the tiling, staging, scaling, softmax and epilogue there).
//! Elsewhere (mode `Off`, Metal's 8 x 8 matrices, head dims past [`MAX_D`], too little workgroup
//! memory, or `MARKBASE_VISION_ATTN=tiled`) the f32 kernels of `vision.wgsl` run.
//!
//! A workgroup of 128 invocations takes [`QT`] queries of one head and walks the keys in tiles of
//! 32 (or 16); queries and keys are scaled per row by powers of two and split into hi + lo f16 pairs
//! (three products: about f32's accuracy at any magnitude); the weights and V go as pairs too
//! by default ([`hilo`]).

use crate::gpu::kernels::{div_ceil, grid, KernelSpec, Kernels, F16_SPLIT};
use crate::gpu::shader::Source;
use super::gemm_f16::CoopMode;
use super::Family;

const ATTN_COOP: &str = include_str!("../../../wgsl/vision_attn_coop.wgsl");

/// Queries per workgroup (4 groups of 16: `vision_attn_coop.wgsl`'s QT).
pub const QT: usize = 64;
/// The largest head dim the kernel takes (padded to a multiple of 16).
pub const MAX_D: usize = 128;

/// Whether adapters with cooperative matrices ([`CoopMode::Tensor`]) take the cooperative-matrix
/// kernel by default (else only with `MARKBASE_VISION_ATTN=coop`; the FMA twin, [`CoopMode::Fma`],
/// is taken either way). On an H100 it matches the CPU as closely as the twin (4.7e-8 of max|out|
/// on the tests' first case; the score dump within 5.2e-7 of sum |q k|), the towers' fixtures
/// pass against mlx-vlm with it, and SigLIP's encode takes 238 ms against the f32 tiled
/// kernel's 994.
pub const VISION_ATTN_COOP_DEFAULT: bool = true;

/// Which products of the cooperative-matrix kernel run on cooperative matrices: (S = Q K^T,
/// O += P V); the other takes the twin's FMA loop in the same kernel, to tell which product is
/// wrong on a GPU. `MARKBASE_VISION_ATTN_COOP` = `qk`, `pv` or `both` (the default). Read when a
/// kernel is built (and named).
pub fn coop_products() -> (bool, bool) {
    match std::env::var("MARKBASE_VISION_ATTN_COOP").as_deref() {
        Ok("qk") => (true, false),
        Ok("pv") => (false, true),
        _ => (true, true),
    }
}

/// Elements (f16) of the kernel's f16 buffer for heads padded to `16 d16` and tiles of `kt` keys:
/// K's hi and lo rows (V's in their place later), each group's weights P (hi, and lo with
/// `hilo_p`); at least a tile of queries (staged there first).
pub fn hs_len(d16: u8, kt: u8, hilo_p: bool) -> u32 {
    let (ld, kt) = (16 * d16 as u32 + 8, kt as u32);
    let pw = 4 * 16 * (kt + 8) * (1 + hilo_p as u32);
    // K's rows, or V's transposed (rows of kt + 8 per dim)
    let kv = if v_transposed() { (2 * kt * ld).max(2 * 16 * d16 as u32 * (kt + 8)) } else { 2 * kt * ld };
    (kv + pw).max(QT as u32 * ld)
}

/// A diagnostic: a subgroup barrier before each run of cooperative-matrix operations
/// (`MARKBASE_VISION_ATTN_SGB=1`), to tell whether divergence before them is what goes wrong on a
/// GPU. Read when a kernel is built (and named).
pub fn converge() -> bool {
    std::env::var("MARKBASE_VISION_ATTN_SGB").is_ok_and(|v| v == "1")
}

/// A diagnostic (`MARKBASE_VISION_ATTN_DUMP=scores`): the kernel writes the first key tile's
/// scores (scaled queries times scaled keys, as the products leave them) over the first 32 (or
/// 16) columns of each query's output row and stops there (`tests/vision_attn_coop.rs` checks
/// them). Read when a kernel is built (and named).
pub fn dump_scores() -> bool {
    std::env::var("MARKBASE_VISION_ATTN_DUMP").is_ok_and(|v| v == "scores" || v == "global")
}

/// With [`dump_scores`], `MARKBASE_VISION_ATTN_DUMP=global`: the cooperative-matrix products'
/// scores are stored straight into the output (row stride heads x D) instead of through the
/// workgroup's score rows, so that a dump tells a wrong store into workgroup memory from wrong
/// products (the twin's scores still go through workgroup memory; query tiles must be whole).
pub fn dump_global() -> bool {
    std::env::var("MARKBASE_VISION_ATTN_DUMP").is_ok_and(|v| v == "global")
}

/// Whether V is staged transposed (`[d][key]`, loaded column-major by the P V product, as the
/// GEMM loads its weights) instead of as its rows (loaded row-major): `MARKBASE_VISION_ATTN_VT=0`
/// keeps the rows.
pub fn v_transposed() -> bool {
    std::env::var("MARKBASE_VISION_ATTN_VT").map_or(true, |v| v != "0")
}

/// Workgroup memory (bytes) of the kernel: the f16 buffer, the groups' scores (64 rows of 36
/// f32), the per-invocation maxima (2 x 128), the keys' factors (2 x `kt`), the queries' scales
/// and factors (2 x QT) and the flag (a vec4).
pub fn smem_bytes(d16: u8, kt: u8, hilo_p: bool) -> u32 {
    let f32s = 64 * 36 + 2 * 128 + 2 * kt as u32 + 2 * QT as u32;
    2 * hs_len(d16, kt, hilo_p) + 4 * f32s + 16
}

/// Which of the weights P and V go as hi + lo pairs: (P, V). Both by default: on random data
/// (`tests/vision_attn_coop.rs`) both split stay within 1e-6 of max|out| (a few times the f32
/// reference's own error where scores are large), either as one f16 moves outputs by 1e-4 to
/// 5e-4 of it. `MARKBASE_VISION_ATTN_HILO` = `0` (neither), `p`, `v` or `1` (both) sets it.
pub fn hilo() -> (bool, bool) {
    match std::env::var("MARKBASE_VISION_ATTN_HILO").as_deref() {
        Ok("0") | Ok("off") => (false, false),
        Ok("p") => (true, false),
        Ok("v") => (false, true),
        _ => (true, true),
    }
}

/// The kernel for heads of `d` with a key mask (`mask`) under `kernels`' options, where it runs:
/// the f16 GEMM's mode is `Fma` (the twin), or `Tensor` (cooperative matrices) with
/// `MARKBASE_VISION_ATTN=coop` or [`VISION_ATTN_COOP_DEFAULT`]; and [`shape_for`] finds a shape.
/// `MARKBASE_VISION_ATTN=tiled` keeps the f32 kernels.
pub fn spec_for(kernels: &Kernels, d: usize, mask: bool) -> Option<KernelSpec> {
    let sel = std::env::var("MARKBASE_VISION_ATTN");
    if sel.as_deref().is_ok_and(|v| v == "tiled" || v == "f32") {
        return None;
    }
    let coop = match kernels.opts.coop {
        CoopMode::Tensor if VISION_ATTN_COOP_DEFAULT || sel.as_deref() == Ok("coop") => true,
        CoopMode::Fma => false,
        CoopMode::Tensor | CoopMode::Off | CoopMode::Tensor8 => return None,
    };
    shape_for(kernels.limits.max_compute_workgroup_storage_size, coop, d, mask)
}

/// The kernel (`coop`: on cooperative matrices, else the twin) for heads of `d` with a key mask
/// under a workgroup-memory `limit`, where `d` is at most [`MAX_D`] and the memory fits: tiles of
/// 32 keys (at most 38 KiB), else of 16 (the software rasterizer's 32 KiB past D = 80), else
/// without the weights' lo parts. `MARKBASE_VISION_ATTN_KT=16` takes tiles of 16 keys.
pub fn shape_for(limit: u32, coop: bool, d: usize, mask: bool) -> Option<KernelSpec> {
    if d == 0 || d > MAX_D {
        return None;
    }
    let d16 = d.div_ceil(16) as u8;
    let (hp, hv) = hilo();
    let kt16 = std::env::var("MARKBASE_VISION_ATTN_KT").is_ok_and(|v| v == "16");
    [(32, hp), (16, hp), (16, false)]
        .into_iter()
        .filter(|&(kt, _)| !kt16 || kt == 16)
        .find(|&(kt, p)| smem_bytes(d16, kt, p) <= limit)
        .map(|(kt, hilo_p)| KernelSpec::VisionAttnF16 { coop, mask, d16, kt, hilo_p, hilo_v: hv, v4: d % 4 == 0, pf: prefetch(d16) })
}

/// Whether the next key tile's loads are issued before the P V products (in flight during them,
/// at the cost of 2 D16 vec4 registers per invocation), or after: before where the head dim is
/// at most 80 (`MARKBASE_VISION_ATTN_PF=0|1` sets it).
pub fn prefetch(d16: u8) -> bool {
    match std::env::var("MARKBASE_VISION_ATTN_PF").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => d16 <= 5,
    }
}

/// Workgroups over `t` queries of `heads` heads.
pub fn groups(t: usize, heads: usize, maxg: u32) -> [u32; 3] {
    grid((div_ceil(t, QT) * heads) as u64, maxg)
}

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    let KernelSpec::VisionAttnF16 { coop, mask, d16, kt, hilo_p, hilo_v, v4, pf } = *spec else { return None };
    let (qk, pv) = coop_products();
    Some(format!(
        "full_attention_f16[{} d{} k{}{}{}{}{}{}{}{}{}{}]",
        match (coop, qk, pv) {
            (false, ..) => "fma",
            (true, true, true) => "coop",
            (true, true, false) => "coop qk",
            _ => "coop pv",
        },
        16 * d16 as u32,
        kt,
        if hilo_p { " hilo_p" } else { "" },
        if hilo_v { " hilo_v" } else { "" },
        if mask { " mask" } else { "" },
        if v4 { " v4" } else { "" },
        if pf { " pf" } else { "" },
        if v_transposed() { " vt" } else { "" },
        if coop && converge() { " sgb" } else { "" },
        if dump_scores() { " dump_s" } else { "" },
        if coop && qk && dump_global() { " dump_g" } else { "" }
    ))
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    let KernelSpec::VisionAttnF16 { coop, mask, d16, kt, hilo_p, hilo_v, v4, pf } = *spec else { return None };
    let (qk, pv) = coop_products();
    Some(
        Source::new(&[ATTN_COOP, F16_SPLIT])
            .c("QT", QT as u32)
            .c("KT", kt as u32)
            .c("KB", kt as u32 / 16)
            .c("KH", kt as u32 / 2)
            .c("D16", d16 as u32)
            .c("HS", hs_len(d16, kt, hilo_p))
            .flag("COOP", coop)
            .flag("COOP_QK", coop && qk)
            .flag("COOP_PV", coop && pv)
            .flag("MASK", mask)
            .flag("HILO_P", hilo_p)
            .flag("HILO_V", hilo_v)
            .flag("V4", v4)
            .flag("PF", pf)
            .flag("VT", v_transposed())
            .flag("SGB", coop && converge())
            .flag("DUMP_S", dump_scores())
            .flag("DUMP_G", coop && qk && dump_global()),
    )
}

fn variants() -> Vec<KernelSpec> {
    let mut v = vec![];
    for coop in [false, true] {
        // SigLIP's 72 (padded to 80) and the largest, with each split; tiles of 16 keys; small
        // heads without vec4 loads
        for (d16, kt, hilo_p, hilo_v, mask, v4, pf) in [
            (5, 32, true, true, false, true, true),
            (5, 32, true, true, true, true, true),
            (5, 32, true, true, true, true, false),
            (8, 32, true, true, true, true, false),
            (5, 32, false, false, false, true, true),
            (8, 16, true, true, true, true, false),
            (6, 16, false, true, false, true, true),
            (1, 32, true, true, true, false, true),
            (4, 32, true, false, false, true, true),
        ] {
            v.push(KernelSpec::VisionAttnF16 { coop, mask, d16, kt, hilo_p, hilo_v, v4, pf });
        }
    }
    v
}
