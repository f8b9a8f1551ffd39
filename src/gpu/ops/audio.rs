//! The audio towers' ops (`audio.wgsl`): the subsampling conv, Gemma 3n's cumulative group
//! norm, row masks and strides, GLU, the causal depthwise conv and the local
//! relative-position attention (its relative position embeddings computed by a matmul
//! dispatch before it).

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::Op;
use markbase_graph::quant::FloatType;

use crate::gpu::kernels::{div_ceil, dt_code, grid, params_struct, COMMON, ELEM_WG, KernelSpec};
use crate::gpu::shader::Source;
use super::matmul::matmul_into;
use super::{Family, LowerCtx};

const AUDIO: &str = include_str!("../../../wgsl/audio.wgsl");

/// Invocations of the attention kernel (one workgroup per query and head).
const ATTN_WG: u32 = 64;
/// Invocations of the cumulative group norm's passes (one workgroup per row).
const CGN_WG: u32 = 256;

/// Largest head dim and window of the attention kernel (its workgroup arrays).
pub const MAX_AUDIO_HEAD_DIM: usize = 256;
pub const MAX_AUDIO_WINDOW: usize = 256;

/// A variant of `audio.wgsl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AudioKernel {
    /// The kernel's dtype.
    Conv2d { w: FloatType },
    /// The cumulative group norm's passes: each row's sum, each row's squared deviations
    /// from its running mean, the normalisation (the norm weight's dtype).
    CgnSum,
    CgnSq,
    CumulativeGroupNorm { w: FloatType },
    MaskRows,
    StridedRows,
    Glu,
    /// The kernel's dtype.
    DepthwiseConv1d { w: FloatType },
    /// The per-dim scale's dtype.
    Attention { pds: FloatType },
}

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    let KernelSpec::Audio(a) = spec else { return None };
    Some(match a {
        AudioKernel::Conv2d { w } => format!("conv2d[{}]", w.name()),
        AudioKernel::CgnSum => "cumulative_group_norm_sum".into(),
        AudioKernel::CgnSq => "cumulative_group_norm_sq".into(),
        AudioKernel::CumulativeGroupNorm { w } => format!("cumulative_group_norm[{}]", w.name()),
        AudioKernel::MaskRows => "mask_rows".into(),
        AudioKernel::StridedRows => "strided_rows".into(),
        AudioKernel::Glu => "glu".into(),
        AudioKernel::DepthwiseConv1d { w } => format!("depthwise_conv1d[{}]", w.name()),
        AudioKernel::Attention { pds } => format!("audio_attention[{}]", pds.name()),
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    let KernelSpec::Audio(a) = *spec else { return None };
    let src = Source::new(&[COMMON, AUDIO]);
    Some(match a {
        AudioKernel::Conv2d { w } => src.c("WG", ELEM_WG).c("WDT", dt_code(w)).flag("CONV2D", true),
        AudioKernel::CgnSum => src.c("WG", CGN_WG).flag("CGN_SUM", true),
        AudioKernel::CgnSq => src.c("WG", CGN_WG).flag("CGN_SQ", true),
        AudioKernel::CumulativeGroupNorm { w } => src.c("WG", CGN_WG).c("WDT", dt_code(w)).flag("CGN", true),
        AudioKernel::MaskRows => src.c("WG", ELEM_WG).flag("MASK", true),
        AudioKernel::StridedRows => src.c("WG", ELEM_WG).flag("STRIDED", true),
        AudioKernel::Glu => src.c("WG", ELEM_WG).flag("GLU", true),
        AudioKernel::DepthwiseConv1d { w } => src.c("WG", ELEM_WG).c("WDT", dt_code(w)).flag("DWCONV", true),
        AudioKernel::Attention { pds } => src.c("WG", ATTN_WG).c("PDT", dt_code(pds)).flag("ATTN", true),
    })
}

fn variants() -> Vec<KernelSpec> {
    [
        AudioKernel::Conv2d { w: FloatType::Bf16 },
        AudioKernel::Conv2d { w: FloatType::F32 },
        AudioKernel::CgnSum,
        AudioKernel::CgnSq,
        AudioKernel::CumulativeGroupNorm { w: FloatType::Bf16 },
        AudioKernel::CumulativeGroupNorm { w: FloatType::F32 },
        AudioKernel::MaskRows,
        AudioKernel::StridedRows,
        AudioKernel::Glu,
        AudioKernel::DepthwiseConv1d { w: FloatType::F16 },
        AudioKernel::Attention { pds: FloatType::Bf16 },
        AudioKernel::Attention { pds: FloatType::F32 },
    ]
    .into_iter()
    .map(KernelSpec::Audio)
    .collect()
}

params_struct! {
    /// Params of `audio.wgsl` (fields by op, see the WGSL).
    #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
    pub struct AudioParams {
        pub n: u32,
        pub row: u32,
        pub stride: u32,
        pub pad: u32,
        pub h: u32,
        pub w: u32,
        pub c: u32,
        pub o: u32,
        pub kh: u32,
        pub kw: u32,
        pub ho: u32,
        pub wo: u32,
        pub heads: u32,
        pub window: u32,
        pub cap: f32,
        pub key_scale: f32,
        pub pad_top: u32,
        pub eps: f32,
        pub _p0: u32,
        pub _p1: u32,
    }
}

/// Lowers the audio ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let shape = cx.node.ty.shape.clone();
    let numel = cx.node.ty.numel();
    let maxg = cx.kernels.maxg();
    let elem_groups = grid(div_ceil(numel, ELEM_WG as usize) as u64, maxg);
    let row = |s: &[usize]| s.iter().skip(1).product::<usize>();
    let (spec, params, binds, groups) = match cx.op {
        Op::Conv2d { stride, pad, time_pad } => {
            let (w, wt) = cx.vec_weight(1)?;
            let (xs, ws) = (cx.shape_of(0), cx.shape_of(1));
            let p = AudioParams {
                n: numel as u32,
                stride: *stride as u32,
                pad: *pad as u32,
                pad_top: time_pad[0] as u32,
                h: xs[0] as u32,
                w: xs[1] as u32,
                c: xs[2] as u32,
                o: ws[0] as u32,
                kh: ws[1] as u32,
                kw: ws[2] as u32,
                ho: shape[0] as u32,
                wo: shape[1] as u32,
                ..Default::default()
            };
            (AudioKernel::Conv2d { w: wt }, p, vec![(3, w)], elem_groups)
        }
        Op::CumulativeGroupNorm { eps } => {
            let (w, wt) = cx.vec_weight(1)?;
            let p = AudioParams { h: shape[0] as u32, row: row(&shape) as u32, c: cx.node.ty.last() as u32, eps: *eps, ..Default::default() };
            let stats = row_stats(cx, &p)?;
            (AudioKernel::CumulativeGroupNorm { w: wt }, p, vec![(3, w), (4, stats)], grid(shape[0] as u64, maxg))
        }
        Op::MaskRows => {
            let p = AudioParams { n: numel as u32, row: row(&shape) as u32, ..Default::default() };
            (AudioKernel::MaskRows, p, vec![(3, cx.input(1)?)], elem_groups)
        }
        Op::StridedRows { stride } => {
            let p = AudioParams { n: numel as u32, row: row(&shape) as u32, stride: *stride as u32, ..Default::default() };
            (AudioKernel::StridedRows, p, vec![], elem_groups)
        }
        Op::Glu => {
            let p = AudioParams { n: numel as u32, row: cx.node.ty.last() as u32, ..Default::default() };
            (AudioKernel::Glu, p, vec![], elem_groups)
        }
        Op::DepthwiseConv1d => {
            let (w, wt) = cx.vec_weight(1)?;
            let p = AudioParams { n: numel as u32, row: shape[1] as u32, kw: cx.shape_of(1)[1] as u32, ..Default::default() };
            (AudioKernel::DepthwiseConv1d { w: wt }, p, vec![(3, w)], elem_groups)
        }
        Op::AudioAttention { window, softcap, key_scale } => {
            let (t, heads, d) = (shape[0], shape[1], shape[2]);
            if d > MAX_AUDIO_HEAD_DIM || *window > MAX_AUDIO_WINDOW {
                return Err(cx.fail(format!("head dim {d} or window {window} over {MAX_AUDIO_HEAD_DIM}")));
            }
            let (pds, pt) = cx.vec_weight(4)?;
            let rel = relative_embeddings(cx, *window)?;
            let p = AudioParams { n: (t * heads) as u32, row: d as u32, heads: heads as u32, window: *window as u32, cap: *softcap, key_scale: *key_scale, ..Default::default() };
            let binds = vec![(3, cx.input(1)?), (4, cx.input(2)?), (5, cx.input(3)?), (6, pds), (7, rel)];
            (AudioKernel::Attention { pds: pt }, p, binds, grid((t * heads) as u64, maxg))
        }
        _ => return Err(cx.not_ours("audio")),
    };
    cx.push_one(KernelSpec::Audio(spec), bytemuck::bytes_of(&params), &binds, groups)
}

/// The first two passes of a cumulative group norm (`p`: its params): a scratch buffer of
/// `2·T` values, each row's sum, then each row's squared deviations from its running mean.
fn row_stats(cx: &mut LowerCtx, p: &AudioParams) -> Result<wgpu::Buffer, String> {
    let stats = cx.gpu.try_storage(&format!("row statistics of {}", cx.node.name), (2 * p.h as u64 * 4).max(4)).map_err(|e| e.to_string())?;
    cx.acc.scratch.push(stats.clone());
    let x = cx.input(0)?;
    let groups = grid(p.h as u64, cx.kernels.maxg());
    for spec in [AudioKernel::CgnSum, AudioKernel::CgnSq] {
        let kernel = cx.kernels.get(KernelSpec::Audio(spec)).map_err(cx.kerr())?;
        let pb = cx.uni(bytemuck::bytes_of(p))?;
        let bg = kernel.bind_buffers(cx.dev(), &[(0, &pb), (1, &x), (2, &stats)]);
        cx.push(kernel, bg, groups);
    }
    Ok(stats)
}

/// The relative position embeddings of an audio attention, `R[dist] = rel · timing(dist)`
/// for `dist < window` (`[window, heads·D]`): the timing signals uploaded once, and a matmul
/// by the node's `rel` weight (input 5) recorded before the attention's dispatch.
fn relative_embeddings(cx: &mut LowerCtx, window: usize) -> Result<wgpu::Buffer, String> {
    let w = cx.mat(5)?;
    // rows of w.k values: an odd channel count leaves the last column unread (zero)
    let timing: Vec<f32> = (0..window)
        .flat_map(|dist| {
            let mut s = crate::cpu::audio_ops::timing_signal(dist, w.k);
            s.resize(w.k, 0.0);
            s
        })
        .collect();
    let sin = cx.gpu.try_upload(&format!("timing signals of {}", cx.node.name), bytemuck::cast_slice(&timing)).map_err(|e| e.to_string())?;
    let rel = cx.gpu.try_storage(&format!("relative embeddings of {}", cx.node.name), (window * w.rows * 4) as u64).map_err(|e| e.to_string())?;
    cx.acc.scratch.extend([sin.clone(), rel.clone()]);
    matmul_into(cx, w, &sin, None, window, &rel)?;
    Ok(rel)
}
