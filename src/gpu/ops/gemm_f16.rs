//! The prefill GEMM on f16 tiles (`gemm_coop.wgsl`), with the per-token scales of its activations
//! (`row_scale.wgsl`): on cooperative matrices (tensor cores) where the adapter has them
//! ([`CoopMode::Tensor`]), or as their twin with a plain FMA loop ([`CoopMode::Fma`], which runs
//! everywhere f16 does: the tests' software rasterizer checks the tiling, staging, scaling and
//! epilogue there). [`CoopMode::Off`] keeps the f32 GEMM of `gemm.wgsl`.
//!
//! A plain matmul of [`super::matmul::GEMM_MIN_T`] tokens or more runs as two dispatches: the row
//! scales of x into a scratch buffer shared by the graph's GEMMs, then the GEMM.

use crate::gpu::device::Gpu;
use crate::gpu::kernels::{all_formats, div_ceil, weight_source, COMMON, KernelSpec, WEIGHTS};
use crate::gpu::shader::Source;
use super::Family;

const GEMM_COMMON: &str = include_str!("../../../wgsl/gemm_common.wgsl");
const GEMM_COOP: &str = include_str!("../../../wgsl/gemm_coop.wgsl");
const ROW_SCALE: &str = include_str!("../../../wgsl/row_scale.wgsl");

/// Whether the f16 GEMM stages each input as two f16 (hi and lo: about f32's precision, three
/// products each); `MARKBASE_COOP_HILO=0` stages one f16 (one product, 11 bits).
pub fn hilo() -> bool {
    crate::gpu::kernels::env_on("MARKBASE_COOP_HILO")
}

/// Weights of fewer elements take the f32 GEMM even where the f16 one is on: on small weights
/// the row-scale dispatch and the hi/lo staging cost more than the tensor cores save. With 4M
/// (H100, pp512): gemma3-270m 41,100 -> 43,200-46,800 tok/s, gemma3-1b 13,600 -> 14,500, gemma4-e2b
/// 6,190 -> 6,330; the 12B's weights are all above it. `MARKBASE_COOP_MIN` sets it.
pub fn min_weight() -> usize {
    std::env::var("MARKBASE_COOP_MIN").ok().and_then(|v| v.parse().ok()).unwrap_or(MIN_WEIGHT)
}

const MIN_WEIGHT: usize = 4 << 20;

/// Tokens and rows of one workgroup's tile.
pub const TILE_T: usize = 64;
pub const TILE_N: usize = 128;

/// Which GEMM prefill takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoopMode {
    /// The f32 GEMM (`gemm.wgsl`).
    Off,
    /// The f16 GEMM with an FMA loop in place of the cooperative matrices.
    Fma,
    /// The f16 GEMM on cooperative matrices (16 x 16 x 16, f16 in, f32 accumulators).
    Tensor,
}

impl CoopMode {
    /// The mode for `gpu`: `Tensor` where the device was opened with cooperative matrices of
    /// 16 x 16 x 16 f16 -> f32 and subgroups of 32, else `Off`. `MARKBASE_COOP=0` (the CLI's
    /// `--no-coop`) forces `Off`, `MARKBASE_COOP=fma` the twin (on any adapter with f16).
    pub fn for_gpu(gpu: &Gpu) -> CoopMode {
        match std::env::var("MARKBASE_COOP").as_deref() {
            Ok("0") | Ok("off") => CoopMode::Off,
            Ok("fma") if gpu.info.shader_f16 => CoopMode::Fma,
            _ if gpu.info.coop_f16_16 && gpu.info.shader_f16 && gpu.info.subgroup_min_size == 32 && gpu.info.subgroup_max_size == 32 => {
                CoopMode::Tensor
            }
            _ => CoopMode::Off,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CoopMode::Off => "off",
            CoopMode::Fma => "fma",
            CoopMode::Tensor => "tensor",
        }
    }
}

/// Whether `props` (an adapter's cooperative-matrix configurations) hold the one the f16 GEMM
/// uses.
pub fn has_f16_16(props: &[wgpu::CooperativeMatrixProperties]) -> bool {
    props.iter().any(|p| {
        p.m_size == 16
            && p.n_size == 16
            && p.k_size == 16
            && p.ab_type == wgpu::CooperativeScalarType::F16
            && p.cr_type == wgpu::CooperativeScalarType::F32
    })
}

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::GemmF16 { fmt, coop, xvec, hilo } => format!(
            "gemm_f16[{}{}{}{}]",
            fmt.describe(),
            if *coop { " coop" } else { " fma" },
            if *hilo { " hilo" } else { "" },
            if *xvec { " xvec" } else { "" }
        ),
        KernelSpec::RowScale => "row_scale".into(),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::GemmF16 { fmt, coop, xvec, hilo } => {
            let s = Source::new(&[COMMON, WEIGHTS, GEMM_COMMON, GEMM_COOP]).c("WG", 256).c("PAD", if coop { 8 } else { 0 });
            weight_source(s.flag("COOP", coop).flag("XVEC", xvec).flag("HILO", hilo), fmt, false, false, false)
        }
        KernelSpec::RowScale => Source::new(&[GEMM_COMMON, ROW_SCALE]),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    let mut v = vec![KernelSpec::RowScale];
    for fmt in all_formats() {
        for coop in [false, true] {
            for (xvec, hilo) in [(false, true), (true, true), (true, false)] {
                v.push(KernelSpec::GemmF16 { fmt, coop, xvec, hilo });
            }
        }
    }
    v
}

/// Workgroups of the GEMM over `rows` rows and `t` tokens (each dimension capped at `maxg`; the
/// kernel walks the rest).
pub fn gemm_groups(rows: usize, t: usize, maxg: u32) -> [u32; 3] {
    [div_ceil(rows, TILE_N).min(maxg as usize) as u32, div_ceil(t, TILE_T).min(maxg as usize) as u32, 1]
}

/// Workgroups of the row scales of `t` tokens.
pub fn row_scale_groups(t: usize, maxg: u32) -> [u32; 3] {
    [t.clamp(1, maxg as usize) as u32, 1, 1]
}
