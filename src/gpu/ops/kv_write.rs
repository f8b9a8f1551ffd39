//! Rows written to KV cache slots (`kv_write.wgsl`).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::Op;

use crate::gpu::device::GpuError;
use crate::gpu::kernels::{div_ceil, grid, params_struct, COMMON, ELEM_WG, Kernel, KernelSpec, Kernels};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const KV_WRITE: &str = include_str!("../../../wgsl/kv_write.wgsl");

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::KvWrite { chunk: false } => "kv_write".into(),
        KernelSpec::KvWrite { chunk: true } => "kv_write[chunk]".into(),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::KvWrite { chunk } => Source::new(&[COMMON, KV_WRITE]).c("WG", ELEM_WG).flag("CHUNK", chunk),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    vec![KernelSpec::KvWrite { chunk: false }, KernelSpec::KvWrite { chunk: true }]
}

impl Kernels {
    pub fn kv_write(&self) -> Result<KvWriteKernel, GpuError> {
        Ok(KvWriteKernel { kernel: self.get(KernelSpec::KvWrite { chunk: false })?, maxg: self.maxg() })
    }

    /// The KV write to one chunk of a chunked cache (its [`crate::gpu::kv::KvChunkParams`] at
    /// binding 4).
    pub fn kv_write_chunk(&self) -> Result<KvWriteKernel, GpuError> {
        Ok(KvWriteKernel { kernel: self.get(KernelSpec::KvWrite { chunk: true })?, maxg: self.maxg() })
    }
}

params_struct! {
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

/// Lowers the kv_write ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::KvWrite { heads } => {
            let xs = cx.shape_of(0);
            let slots = cx.node.ty.shape[0];
            let row = cx.node.ty.shape[1] * cx.node.ty.shape[2];
            let x_off = heads.map_or(0, |r| r.start * xs[2]);
            let k = kernels.kv_write().map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&k.params_strided(xs[0], row, slots, xs[1] * xs[2], x_off)))?;
            let Some(ch) = cx.kv_chunks(cx.n) else {
                let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.input(1)?, &cx.out()?);
                cx.push(k.kernel.clone(), bg, k.groups(xs[0], row));
                return Ok(());
            };
            // a dispatch per chunk, each writing the rows of its slots
            let kc = kernels.kv_write_chunk().map_err(cx.kerr())?;
            let (x, pos) = (cx.input(0)?, cx.input(1)?);
            for c in 0..ch.bufs.len() {
                let cp = cx.uni(bytemuck::bytes_of(&ch.params(c, 0, 0, 1)))?;
                let bg = kc.kernel.bind_buffers(dev, &[(0, &p), (1, &x), (2, &pos), (3, &ch.bufs[c]), (4, &cp)]);
                cx.push(kc.kernel.clone(), bg, kc.groups(xs[0], row));
            }
        }
        _ => return Err(cx.not_ours("kv_write")),
    }
    Ok(())
}
