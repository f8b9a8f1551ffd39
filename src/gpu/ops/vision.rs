//! The vision towers' ops (`vision.wgsl`): clamp, 2-D RoPE, average pooling, LayerNorm, the
//! tiled bidirectional attention, and the scatter of soft-token rows into embeddings. The
//! attention takes the f16 kernel of [`super::vision_coop`] instead where it runs.

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::Op;
use markbase_graph::quant::FloatType;

use crate::gpu::kernels::{div_ceil, dt_code, grid, params_struct, COMMON, ELEM_WG, KernelSpec};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const VISION: &str = include_str!("../../../wgsl/vision.wgsl");

/// Invocations of the row kernels (LayerNorm, attention; attention heads are at most
/// 4 x this wide).
const ROW_WG: u32 = 64;

/// Largest head dim of the attention kernel, and timescales of the 2-D RoPE (D/4).
pub const MAX_VISION_HEAD_DIM: usize = 256;

/// Queries and keys per tile of the tiled attention (`vision.wgsl`'s QT and KT: 4 invocations
/// per query, 4 keys each), and the largest head dim it takes.
const TILED_QT: usize = 32;
const TILED_KT: usize = 16;
const TILED_MAX_D: usize = 128;

/// The row width in workgroup memory of the tiled attention over heads of `d` (`d` rounded up
/// to 4), or 0 where it does not fit (`smem` bytes of workgroup memory) or `d` is over
/// [`TILED_MAX_D`]: the per-query kernel then runs.
fn tiled_dm(d: usize, smem: u32) -> u32 {
    let dm = d.div_ceil(4) * 4;
    let bytes = 4 * ((TILED_QT + 2 * TILED_KT) * dm + TILED_QT * TILED_KT + 3 * TILED_QT);
    if d == 0 || d > TILED_MAX_D || bytes > smem as usize {
        0
    } else {
        dm as u32
    }
}

/// A variant of `vision.wgsl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VisionKernel {
    /// Bound dtypes.
    Clamp { lo: FloatType, hi: FloatType },
    Rope2d,
    Pool,
    /// Weight and bias dtypes.
    LayerNorm { w: FloatType, b: Option<FloatType> },
    /// `mask`: a key-validity input; `dm`: 0 for a workgroup per query, else tiles of queries
    /// and keys in workgroup memory with rows of `dm` floats (the head dim rounded up to 4).
    Attention { mask: bool, dm: u32 },
    Scatter,
}

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    let KernelSpec::Vision(v) = spec else { return None };
    Some(match v {
        VisionKernel::Clamp { lo, hi } => format!("clamp[{} {}]", lo.name(), hi.name()),
        VisionKernel::Rope2d => "rope_2d".into(),
        VisionKernel::Pool => "avg_pool".into(),
        VisionKernel::LayerNorm { w, b } => format!("layer_norm[{}{}]", w.name(), b.map_or(String::new(), |b| format!(" bias {}", b.name()))),
        VisionKernel::Attention { mask, dm } => format!(
            "full_attention{}{}",
            if *mask { "[mask]" } else { "" },
            if *dm > 0 { format!("[tiled d{dm}]") } else { String::new() }
        ),
        VisionKernel::Scatter => "scatter".into(),
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    let KernelSpec::Vision(v) = *spec else { return None };
    let src = Source::new(&[COMMON, VISION]);
    Some(match v {
        VisionKernel::Clamp { lo, hi } => src.c("WG", ELEM_WG).c("LDT", dt_code(lo)).c("HDT", dt_code(hi)).flag("CLAMP", true),
        VisionKernel::Rope2d => src.c("WG", ELEM_WG).flag("ROPE2D", true),
        VisionKernel::Pool => src.c("WG", ELEM_WG).flag("POOL", true),
        VisionKernel::LayerNorm { w, b } => src
            .c("WG", ROW_WG)
            .c("WDT", dt_code(w))
            .c("BDT", b.map_or(2, dt_code))
            .flag("LNORM", true)
            .flag("HAS_B", b.is_some()),
        VisionKernel::Attention { mask, dm } => src
            .c("WG", if dm > 0 { 4 * TILED_QT as u32 } else { ROW_WG })
            .c("DM", dm.max(4))
            .c("DJ", dm.max(4) / 4)
            .c("QT", TILED_QT as u32)
            .c("KT", TILED_KT as u32)
            .flag("ATTN", true)
            .flag("TILED", dm > 0)
            .flag("MASK", mask),
        VisionKernel::Scatter => src.c("WG", ELEM_WG).flag("SCATTER", true),
    })
}

fn variants() -> Vec<KernelSpec> {
    [
        VisionKernel::Clamp { lo: FloatType::Bf16, hi: FloatType::F32 },
        VisionKernel::Rope2d,
        VisionKernel::Pool,
        VisionKernel::LayerNorm { w: FloatType::F16, b: Some(FloatType::Bf16) },
        VisionKernel::LayerNorm { w: FloatType::F32, b: None },
        VisionKernel::Attention { mask: false, dm: 0 },
        VisionKernel::Attention { mask: true, dm: 0 },
        VisionKernel::Attention { mask: false, dm: 72 },
        VisionKernel::Attention { mask: true, dm: 64 },
        VisionKernel::Scatter,
    ]
    .into_iter()
    .map(KernelSpec::Vision)
    .collect()
}

params_struct! {
    /// Params of `vision.wgsl` (fields by op, see the WGSL).
    #[derive(Clone, Copy, Debug, Pod, Zeroable)]
    pub struct VisionParams {
        pub n: u32,
        pub heads: u32,
        pub kv: u32,
        pub s: u32,
        pub d: u32,
        pub cols: u32,
        pub k: u32,
        pub _p0: u32,
        pub f: f32,
        pub _p1: u32,
        pub _p2: u32,
        pub _p3: u32,
        pub ts: [f32; MAX_VISION_HEAD_DIM],
    }
}

impl Default for VisionParams {
    fn default() -> Self {
        Zeroable::zeroed()
    }
}

/// Lowers the vision ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let shape = cx.node.ty.shape.clone();
    let numel = cx.node.ty.numel();
    let maxg = cx.kernels.maxg();
    let elem_groups = |n: usize| grid(div_ceil(n, ELEM_WG as usize) as u64, maxg);
    let (spec, params, binds, groups) = match cx.op {
        Op::Clamp => {
            let (lo, lt) = cx.vec_weight(1)?;
            let (hi, ht) = cx.vec_weight(2)?;
            let p = VisionParams { n: numel as u32, ..Default::default() };
            (VisionKernel::Clamp { lo: lt, hi: ht }, p, vec![(3, lo), (4, hi)], elem_groups(numel))
        }
        Op::Rope2d { theta } => {
            let d = shape[2];
            if d / 4 > MAX_VISION_HEAD_DIM {
                return Err(cx.fail(format!("head dim {d} is over {}", 4 * MAX_VISION_HEAD_DIM)));
            }
            let mut p = VisionParams { n: (shape[0] * shape[1]) as u32, heads: shape[1] as u32, d: d as u32, ..Default::default() };
            let ts = crate::cpu::vision_ops::rope_2d_timescales(*theta, d);
            p.ts[..ts.len()].copy_from_slice(&ts);
            (VisionKernel::Rope2d, p, vec![(3, cx.input(1)?), (4, cx.input(2)?)], elem_groups(numel / 2))
        }
        Op::AvgPool { cols, k, .. } => {
            let p = VisionParams { n: numel as u32, d: shape[1] as u32, cols: *cols as u32, k: *k as u32, f: 1.0 / (k * k) as f32, ..Default::default() };
            (VisionKernel::Pool, p, vec![], elem_groups(numel))
        }
        Op::LayerNorm { eps } => {
            let (w, wt) = cx.vec_weight(1)?;
            let mut binds = vec![(3, w)];
            let bt = if cx.ins.len() > 2 {
                let (b, bt) = cx.vec_weight(2)?;
                binds.push((4, b));
                Some(bt)
            } else {
                None
            };
            let rows = numel / shape[shape.len() - 1];
            let p = VisionParams { n: rows as u32, d: shape[shape.len() - 1] as u32, f: *eps, ..Default::default() };
            (VisionKernel::LayerNorm { w: wt, b: bt }, p, binds, grid(rows as u64, maxg))
        }
        Op::FullAttention { scale } => {
            let d = shape[2];
            if d > MAX_VISION_HEAD_DIM {
                return Err(cx.fail(format!("head dim {d} is over {MAX_VISION_HEAD_DIM}")));
            }
            let ks = cx.shape_of(1);
            let rows = shape[0] * shape[1];
            let p = VisionParams { n: rows as u32, heads: shape[1] as u32, kv: ks[1] as u32, s: ks[0] as u32, d: d as u32, f: *scale, ..Default::default() };
            let mut binds = vec![(3, cx.input(1)?), (4, cx.input(2)?)];
            let mask = cx.ins.len() > 3;
            if mask {
                binds.push((5, cx.input(3)?));
            }
            if let Some(spec) = super::vision_coop::spec_for(cx.kernels, d, mask) {
                let groups = super::vision_coop::groups(shape[0], shape[1], maxg);
                return cx.push_one(spec, bytemuck::bytes_of(&p), &binds, groups);
            }
            let dm = tiled_dm(d, cx.kernels.limits.max_compute_workgroup_storage_size);
            let groups = if dm > 0 { grid((div_ceil(shape[0], TILED_QT) * shape[1]) as u64, maxg) } else { grid(rows as u64, maxg) };
            (VisionKernel::Attention { mask, dm }, p, binds, groups)
        }
        Op::Scatter => {
            let d = shape[1];
            let p = VisionParams { n: numel as u32, d: d as u32, s: cx.shape_of(1)[0] as u32, ..Default::default() };
            (VisionKernel::Scatter, p, vec![(3, cx.input(1)?), (4, cx.input(2)?)], elem_groups(numel))
        }
        _ => return Err(cx.not_ours("vision")),
    };
    cx.push_one(KernelSpec::Vision(spec), bytemuck::bytes_of(&params), &binds, groups)
}
