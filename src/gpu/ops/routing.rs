//! MoE routing: top-k, top-k with softmax, the weighted sum of expert outputs
//! (`routing.wgsl`) and the grouping of pairs by expert (`moe_group.wgsl`).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::Op;
use markbase_graph::quant::FloatType;

use crate::gpu::device::GpuError;
use crate::gpu::kernels::{div_ceil, dt_code, grid, params_struct, COMMON, ELEM_WG, Kernel, KernelSpec, Kernels};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const ROUTING: &str = include_str!("../../../wgsl/routing.wgsl");
const MOE_GROUP: &str = include_str!("../../../wgsl/moe_group.wgsl");
const MOE_GROUP_WG: u32 = 256;

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::TopK => "top_k".into(),
        KernelSpec::TopKSoftmax { scale } => format!("top_k_softmax[{}]", scale.map_or("none", |t| t.name())),
        KernelSpec::WeightedSum => "weighted_sum".into(),
        KernelSpec::MoeGroup => "moe_group".into(),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::TopK => Source::new(&[COMMON, ROUTING]).c("WG", 64).c("SDT", 2).flag("TOPK", true),
        KernelSpec::TopKSoftmax { scale } => Source::new(&[COMMON, ROUTING])
            .c("WG", 64)
            .c("SDT", scale.map_or(2, dt_code))
            .flag("TOPK_SOFTMAX", true)
            .flag("HAS_SCALE", scale.is_some()),
        KernelSpec::WeightedSum => Source::new(&[COMMON, ROUTING]).c("WG", ELEM_WG).c("SDT", 2).flag("WSUM", true),
        KernelSpec::MoeGroup => Source::new(&[COMMON, MOE_GROUP]).c("WG", MOE_GROUP_WG),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    let mut v = vec![KernelSpec::TopK, KernelSpec::WeightedSum, KernelSpec::MoeGroup];
    v.extend([None, Some(FloatType::Bf16), Some(FloatType::F16), Some(FloatType::F32)].map(|scale| KernelSpec::TopKSoftmax { scale }));
    v
}

impl Kernels {
    pub fn top_k(&self) -> Result<RoutingKernel, GpuError> {
        Ok(RoutingKernel { kernel: self.get(KernelSpec::TopK)?, wg: 64, maxg: self.maxg() })
    }

    pub fn top_k_softmax(&self, scale: Option<FloatType>) -> Result<RoutingKernel, GpuError> {
        Ok(RoutingKernel { kernel: self.get(KernelSpec::TopKSoftmax { scale })?, wg: 64, maxg: self.maxg() })
    }

    pub fn weighted_sum(&self) -> Result<RoutingKernel, GpuError> {
        Ok(RoutingKernel { kernel: self.get(KernelSpec::WeightedSum)?, wg: ELEM_WG, maxg: self.maxg() })
    }

    /// `Op::MoeGroup`.
    pub fn moe_group(&self) -> Result<MoeGroupKernel, GpuError> {
        Ok(MoeGroupKernel { kernel: self.get(KernelSpec::MoeGroup)? })
    }
}

params_struct! {
    #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
    pub struct RoutingParams {
        pub t: u32,
        /// Experts (WeightedSum: S).
        pub e: u32,
        /// Selected per token (WeightedSum: D).
        pub k: u32,
        pub _pad: u32,
    }
}

/// TopK (bindings 0 params, 1 logits `[T, E]`, 2 ids out `[T, k]`), TopKSoftmax (0 params,
/// 1 logits, 2 ids, 3 out `[T, k]`, 4 scale `[E]` as stored) and WeightedSum (0 params,
/// 1 x `[T, S, D]`, 2 w `[T, S]`, 3 out `[T, D]`).
pub struct RoutingKernel {
    pub kernel: Arc<Kernel>,
    wg: u32,
    maxg: u32,
}

impl RoutingKernel {
    pub fn params(&self, t: usize, e: usize, k: usize) -> RoutingParams {
        RoutingParams { t: t as u32, e: e as u32, k: k as u32, _pad: 0 }
    }
    /// Invocations: TopK T*E, TopKSoftmax T, WeightedSum T*D.
    pub fn groups(&self, invocations: usize) -> [u32; 3] {
        grid(div_ceil(invocations, self.wg as usize) as u64, self.maxg)
    }
    pub fn bind_group(&self, device: &wgpu::Device, bufs: &[(u32, &wgpu::Buffer)]) -> wgpu::BindGroup {
        self.kernel.bind_buffers(device, bufs)
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, invocations: usize) {
        self.kernel.dispatch(pass, bg, self.groups(invocations));
    }
}
// -------------------------------------------------------------------- expert grouping

params_struct! {
    #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
    pub struct MoeGroupParams {
        /// Pairs (T*S).
        pub pairs: u32,
        pub experts: u32,
        pub _pad: [u32; 2],
    }
}

/// `Op::MoeGroup` (one workgroup). Bindings: 0 params, 1 ids (u32 `[T*S]`), 2 out
/// (u32 `[E + 1 + T*S]`).
pub struct MoeGroupKernel {
    pub kernel: Arc<Kernel>,
}

impl MoeGroupKernel {
    pub fn params(&self, pairs: usize, experts: usize) -> MoeGroupParams {
        MoeGroupParams { pairs: pairs as u32, experts: experts as u32, _pad: [0; 2] }
    }
    pub fn bind_group(&self, device: &wgpu::Device, params: &wgpu::Buffer, ids: &wgpu::Buffer, out: &wgpu::Buffer) -> wgpu::BindGroup {
        self.kernel.bind_buffers(device, &[(0, params), (1, ids), (2, out)])
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup) {
        self.kernel.dispatch(pass, bg, [1, 1, 1]);
    }
}

/// Lowers the routing ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::TopK { k: kk } => {
            let ls = cx.shape_of(0);
            let k = kernels.top_k().map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&k.params(ls[0], ls[1], *kk)))?;
            let bg = k.bind_group(dev, &[(0, &p), (1, &cx.input(0)?), (2, &cx.out()?)]);
            cx.push(k.kernel.clone(), bg, k.groups(ls[0] * ls[1]));
        }
        Op::TopKSoftmax => {
            let ls = cx.shape_of(0);
            let kk = cx.node.ty.shape[1];
            let sc = if cx.ins.len() > 2 { Some(cx.vecw(2).ok_or("per-expert scale missing")?) } else { None };
            let k = kernels.top_k_softmax(sc.map(|s| s.1)).map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&k.params(ls[0], ls[1], kk)))?;
            let (lb, ib, ob) = (cx.input(0)?, cx.input(1)?, cx.out()?);
            let mut b: Vec<(u32, &wgpu::Buffer)> = vec![(0, &p), (1, &lb), (2, &ib), (3, &ob)];
            if let Some(s) = sc {
                b.push((4, &s.0));
            }
            let bg = k.bind_group(dev, &b);
            cx.push(k.kernel.clone(), bg, k.groups(ls[0]));
        }
        Op::WeightedSum => {
            let xs = cx.shape_of(0);
            let k = kernels.weighted_sum().map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&k.params(xs[0], xs[1], xs[2])))?;
            let bg = k.bind_group(dev, &[(0, &p), (1, &cx.input(0)?), (2, &cx.input(1)?), (3, &cx.out()?)]);
            cx.push(k.kernel.clone(), bg, k.groups(xs[0] * xs[2]));
        }
        Op::MoeGroup { experts } => {
            let pairs = cx.graph.node(cx.ins[0]).ty.numel();
            let k = kernels.moe_group().map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&k.params(pairs, *experts)))?;
            let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.out()?);
            cx.push(k.kernel.clone(), bg, [1, 1, 1]);
        }
        _ => return Err(cx.not_ours("routing")),
    }
    Ok(())
}
