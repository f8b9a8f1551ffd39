//! Slice copies (`copy.wgsl`).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::Op;

use crate::gpu::device::GpuError;
use crate::gpu::kernels::{div_ceil, grid, params_struct, COMMON, ELEM_WG, Kernel, KernelSpec, Kernels};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const COPY: &str = include_str!("../../../wgsl/copy.wgsl");

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::Copy => "copy".into(),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::Copy => Source::new(&[COMMON, COPY]).c("WG", ELEM_WG),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    vec![KernelSpec::Copy]
}

impl Kernels {
    pub fn copy(&self) -> Result<CopyKernel, GpuError> {
        Ok(CopyKernel { kernel: self.get(KernelSpec::Copy)?, maxg: self.maxg() })
    }
}

params_struct! {
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
    pub fn elements(&self) -> usize {
        self.outer as usize * self.len as usize * self.inner as usize
    }
}

/// Slice copy of 32-bit elements. Bindings: 0 params, 1 src, 2 dst.
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

/// Lowers the copy ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::Slice { axis, start, len } => {
            let k = kernels.copy().map_err(cx.kerr())?;
            let cp = CopyParams::slice(&cx.shape_of(0), *axis, *start, *len);
            let p = cx.uni(bytemuck::bytes_of(&cp))?;
            let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.out()?);
            cx.push(k.kernel.clone(), bg, k.groups(&cp));
        }
        _ => return Err(cx.not_ours("copy")),
    }
    Ok(())
}
