//! The embedding gather (`embed.wgsl`).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::Op;

use crate::gpu::device::GpuError;
use crate::gpu::kernels::{all_formats, div_ceil, params_struct, weight_source, COMMON, Kernel, KernelSpec, Kernels, WEIGHTS};
use crate::gpu::shader::Source;
use crate::gpu::weights::{GpuFormat, GpuWeight};
use super::{Family, LowerCtx};

const EMBED: &str = include_str!("../../../wgsl/embed.wgsl");

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::Embed { fmt } => format!("embed[{}]", fmt.describe()),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::Embed { fmt } => weight_source(Source::new(&[COMMON, WEIGHTS, EMBED]).c("WG", 64), fmt, false, false, false),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    all_formats().into_iter().map(|fmt| KernelSpec::Embed { fmt }).collect()
}

impl Kernels {
    pub fn embed(&self, fmt: GpuFormat) -> Result<EmbedKernel, GpuError> {
        Ok(EmbedKernel { kernel: self.get(KernelSpec::Embed { fmt })?, maxg: self.maxg() })
    }
}

params_struct! {
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

/// Lowers the embed ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::Embed { scale, clamp } => {
            let w = cx.mat(1)?;
            let k = kernels.embed(w.format).map_err(cx.kerr())?;
            let t = cx.node.ty.shape[0];
            for ci in 0..w.chunks.len() {
                let p = cx.uni(bytemuck::bytes_of(&k.params(w, ci, t, *scale, *clamp)))?;
                let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.out()?, w, ci);
                cx.push(k.kernel.clone(), bg, k.groups(t, w.k));
            }
        }
        _ => return Err(cx.not_ours("embed")),
    }
    Ok(())
}
