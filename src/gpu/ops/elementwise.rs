//! GeGLU, binary and unary elementwise ops (`elementwise.wgsl`).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::{BinaryOp, Op, UnaryOp};
use markbase_graph::quant::FloatType;

use crate::gpu::device::GpuError;
use crate::gpu::kernels::{div_ceil, dt_code, grid, params_struct, COMMON, ELEM_WG, Kernel, KernelSpec, Kernels};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const ELEMENTWISE: &str = include_str!("../../../wgsl/elementwise.wgsl");

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::GeGlu => "geglu".into(),
        KernelSpec::Binary { b } => format!("binary[{}]", b.name()),
        KernelSpec::Unary => "unary".into(),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::GeGlu => Source::new(&[COMMON, ELEMENTWISE]).c("WG", ELEM_WG).c("BDT", 2).flag("GEGLU", true),
        KernelSpec::Binary { b } => {
            Source::new(&[COMMON, ELEMENTWISE]).c("WG", ELEM_WG).c("BDT", dt_code(b)).flag("BINARY", true)
        }
        KernelSpec::Unary => Source::new(&[COMMON, ELEMENTWISE]).c("WG", ELEM_WG).c("BDT", 2).flag("UNARY", true),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    let mut v = vec![KernelSpec::GeGlu, KernelSpec::Unary];
    for b in [FloatType::Bf16, FloatType::F16, FloatType::F32] {
        v.push(KernelSpec::Binary { b });
    }
    v
}

impl Kernels {
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
}

params_struct! {
    #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
    pub struct ElementwiseParams {
        pub n: u32,
        pub nb: u32,
        pub op: u32,
        pub _pad0: u32,
        pub f: f32,
        pub _pad: [u32; 3],
    }
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
            UnaryOp::Relu => (3, 0.0),
            UnaryOp::Silu => (4, 0.0),
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

/// Lowers the elementwise ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::Binary { f } => {
            let n_el = cx.node.ty.numel();
            let nb = cx.graph.node(cx.ins[1]).ty.numel();
            let (bbuf, bdt) = match cx.vecw(1) {
                Some((b, dt)) => (b.clone(), *dt),
                None => (cx.input(1)?, FloatType::F32),
            };
            let k = kernels.binary(bdt).map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&ElementwiseParams::binary(*f, n_el, nb)))?;
            let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.out()?, Some(&bbuf));
            cx.push(k.kernel.clone(), bg, k.groups(n_el));
        }
        Op::Unary { f } => {
            let n_el = cx.node.ty.numel();
            let k = kernels.unary().map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&ElementwiseParams::unary(*f, n_el)))?;
            let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.out()?, None);
            cx.push(k.kernel.clone(), bg, k.groups(n_el));
        }
        Op::GeGlu => {
            let n_el = cx.node.ty.numel();
            let k = kernels.geglu().map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&ElementwiseParams::geglu(n_el)))?;
            let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.out()?, Some(&cx.input(1)?));
            cx.push(k.kernel.clone(), bg, k.groups(n_el));
        }
        _ => return Err(cx.not_ours("elementwise")),
    }
    Ok(())
}
