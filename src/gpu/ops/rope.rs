//! RoPE, with a per-head RMSNorm in front and rows written to a KV cache (`rope.wgsl`).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::{NormScale, Op};
use markbase_graph::quant::FloatType;

use crate::gpu::device::GpuError;
use crate::gpu::kernels::{div_ceil, dt_code, grid, norm_mode, params_struct, COMMON, Kernel, KernelSpec, Kernels};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const ROPE: &str = include_str!("../../../wgsl/rope.wgsl");

/// Largest rotary pair count of the rope params table.
pub const MAX_ROPE_PAIRS: usize = 256;

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::Rope { norm: None, .. } => "rope".into(),
        KernelSpec::Rope { norm: Some(w), cache, chunk } => format!(
            "norm_rope[{}{}{}]",
            w.map_or("none", |t| t.name()),
            if *cache { " cache" } else { "" },
            if *cache && *chunk { " chunk" } else { "" }
        ),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::Rope { norm, cache, chunk } => Source::new(&[COMMON, ROPE])
            .c("WG", 64)
            .c("NDT", norm.flatten().map_or(2, dt_code))
            .flag("NORM", norm.is_some())
            .flag("CACHE", cache && norm.is_some())
            .flag("CHUNK", chunk && cache && norm.is_some())
            .flag("HAS_NW", norm.flatten().is_some()),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    vec![
        KernelSpec::Rope { norm: None, cache: false, chunk: false },
        KernelSpec::Rope { norm: Some(None), cache: false, chunk: false },
        KernelSpec::Rope { norm: Some(Some(FloatType::Bf16)), cache: false, chunk: false },
        KernelSpec::Rope { norm: Some(Some(FloatType::F32)), cache: false, chunk: false },
        KernelSpec::Rope { norm: Some(Some(FloatType::Bf16)), cache: true, chunk: false },
        KernelSpec::Rope { norm: Some(Some(FloatType::Bf16)), cache: true, chunk: true },
    ]
}

impl Kernels {
    /// `norm`: an RMSNorm per head in front, with its weight's dtype (`Some(None)`: no weight).
    pub fn rope(&self, norm: Option<Option<FloatType>>) -> Result<RopeKernel, GpuError> {
        Ok(RopeKernel { kernel: self.get(KernelSpec::Rope { norm, cache: false, chunk: false })?, norm: norm.is_some(), maxg: self.maxg() })
    }

    /// `Op::KvWriteNormRope`: the norm-rope kernel writing rows to cache slots (binding 3 the cache).
    pub fn rope_to_cache(&self, norm: Option<FloatType>) -> Result<RopeKernel, GpuError> {
        self.rope_to_cache_chunk(norm, false)
    }

    /// [`Kernels::rope_to_cache`]; `chunk`: to one chunk of a chunked cache (its
    /// [`crate::gpu::kv::KvChunkParams`] at binding 5).
    pub fn rope_to_cache_chunk(&self, norm: Option<FloatType>, chunk: bool) -> Result<RopeKernel, GpuError> {
        Ok(RopeKernel { kernel: self.get(KernelSpec::Rope { norm: Some(norm), cache: true, chunk })?, norm: true, maxg: self.maxg() })
    }
}

params_struct! {
    /// Params of `rope.wgsl`: shape plus, per rotary pair, `frac(inv_freq / 2pi)` as a
    /// 64-bit fixed-point fraction of a turn (`[lo, hi]`, two pairs per entry).
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

/// An error unless the rope params table holds `pairs` rotary pairs.
pub(crate) fn check_pairs(cx: &LowerCtx, pairs: usize) -> Result<(), String> {
    if pairs > MAX_ROPE_PAIRS {
        return Err(cx.fail(format!("{pairs} rotary pairs exceed the kernel's {MAX_ROPE_PAIRS} (head dim too large)")));
    }
    Ok(())
}

/// Lowers the rope ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::Rope { theta, factor, rotary_pairs } | Op::NormRope { theta, factor, rotary_pairs, .. } => {
            let (x_heads, head0) = match op {
                Op::NormRope { heads: Some(r), .. } => (cx.shape_of(0)[1], r.start),
                _ => (cx.node.ty.shape[1], 0),
            };
            let s = &cx.node.ty.shape;
            check_pairs(cx, *rotary_pairs)?;
            let norm = match op {
                Op::NormRope { eps, scale, .. } => Some((*scale, *eps)),
                _ => None,
            };
            let wv = cx.norm_w()?;
            let k = kernels.rope(norm.map(|_| wv.map(|v| v.1))).map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(
                &k.params(s[0], s[1], s[2], *theta, *factor, *rotary_pairs).with_norm(norm).with_heads(x_heads, head0),
            ))?;
            let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.input(1)?, &cx.out()?, wv.map(|v| &v.0));
            cx.push(k.kernel.clone(), bg, k.groups(s[0], s[1], s[2]));
        }
        Op::KvWriteNormRope { eps, scale, theta, factor, rotary_pairs, heads } => {
            let s = &cx.node.ty.shape;
            check_pairs(cx, *rotary_pairs)?;
            let xs = cx.shape_of(0);
            let t = xs[0];
            let chunks = cx.kv_chunks(cx.n);
            let k = kernels.rope_to_cache_chunk(cx.norm_w()?.map(|v| v.1), chunks.is_some()).map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(
                &k.params(t, s[1], s[2], *theta, *factor, *rotary_pairs)
                    .with_norm(Some((*scale, *eps)))
                    .with_heads(xs[1], heads.map_or(0, |r| r.start))
                    .with_slots(s[0]),
            ))?;
            let Some(ch) = chunks else {
                let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.input(1)?, &cx.out()?, cx.norm_w()?.map(|v| &v.0));
                cx.push(k.kernel.clone(), bg, k.groups(t, s[1], s[2]));
                return Ok(());
            };
            // a dispatch per chunk, each writing the rows of its slots
            let (x, pos) = (cx.input(0)?, cx.input(1)?);
            for c in 0..ch.bufs.len() {
                let cp = cx.uni(bytemuck::bytes_of(&ch.params(c, 0, 0, 1)))?;
                let mut b = vec![(0, &p), (1, &x), (2, &pos), (3, &ch.bufs[c]), (5, &cp)];
                if let Some((w, _)) = cx.norm_w()? {
                    b.push((4, w));
                }
                let bg = k.kernel.bind_buffers(dev, &b);
                cx.push(k.kernel.clone(), bg, k.groups(t, s[1], s[2]));
            }
        }
        _ => return Err(cx.not_ours("rope")),
    }
    Ok(())
}
