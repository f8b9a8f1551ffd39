//! Greedy decoding (`argmax.wgsl`) and the sampler's stages (`sample.wgsl`, see [`super::sample`]).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::Op;

use crate::gpu::device::GpuError;
use crate::gpu::kernels::{params_struct, COMMON, Kernel, KernelSpec, Kernels};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const ARGMAX: &str = include_str!("../../../wgsl/argmax.wgsl");
const SAMPLE: &str = include_str!("../../../wgsl/sample.wgsl");

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::Argmax { wg } => format!("argmax[wg{wg}]"),
        KernelSpec::Sample { stage } => format!("sample[{}]", super::sample::STAGES[*stage as usize]),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::Argmax { wg } => Source::new(&[COMMON, ARGMAX]).c("WG", wg),
        KernelSpec::Sample { stage } => Source::new(&[COMMON, SAMPLE])
            .c("WG", super::sample::WG)
            .c("CHUNK", super::sample::CHUNK)
            .flag(&format!("STAGE_{}", super::sample::STAGES[stage as usize].to_uppercase()), true),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    let mut v = vec![KernelSpec::Argmax { wg: 256 }, KernelSpec::Argmax { wg: 1024 }];
    v.extend((0..super::sample::STAGES.len() as u32).map(|stage| KernelSpec::Sample { stage }));
    v
}

impl Kernels {
    pub fn argmax(&self) -> Result<ArgmaxKernel, GpuError> {
        let wg = self.limits.max_compute_invocations_per_workgroup.min(1024).min(self.limits.max_compute_workgroup_size_x);
        let wg = if wg.is_power_of_two() { wg } else { wg.next_power_of_two() / 2 };
        Ok(ArgmaxKernel { kernel: self.get(KernelSpec::Argmax { wg })? })
    }
}

params_struct! {
    #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
    pub struct ArgmaxParams {
        pub v: u32,
        pub offset: u32,
        /// The row of a batch (its token goes to `out[row]`; the sampler reads its words and
        /// recent ids at that row).
        pub row: u32,
        /// Recent ids per row (the sampler; 0: the whole binding, one row).
        pub recent_len: u32,
    }
}

impl ArgmaxParams {
    /// Argmax of the last row of `logits[T, V]`.
    pub fn last_row(t: usize, v: usize) -> Self {
        ArgmaxParams { v: v as u32, offset: ((t - 1) * v) as u32, row: 0, recent_len: 0 }
    }

    /// Row `r` of a batch's logits `[T, V]`, its token to `out[r]`, its recent ids `recent_len`
    /// words from `r * recent_len`.
    pub fn row(r: usize, v: usize, recent_len: usize) -> Self {
        ArgmaxParams { v: v as u32, offset: (r * v) as u32, row: r as u32, recent_len: recent_len as u32 }
    }
}

/// Argmax (one workgroup). Bindings: 0 params, 1 logits, 2 out (u32 `[1]`).
pub struct ArgmaxKernel {
    pub kernel: Arc<Kernel>,
}

impl ArgmaxKernel {
    pub fn bind_group(&self, device: &wgpu::Device, params: &wgpu::Buffer, logits: &wgpu::Buffer, out: &wgpu::Buffer) -> wgpu::BindGroup {
        self.kernel.bind_buffers(device, &[(0, params), (1, logits), (2, out)])
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup) {
        self.kernel.dispatch(pass, bg, [1, 1, 1]);
    }
}

/// Lowers the argmax ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::Argmax => {
            let ls = cx.shape_of(0);
            let k = kernels.argmax().map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&ArgmaxParams::last_row(ls[0], ls[1])))?;
            let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.out()?);
            cx.push(k.kernel.clone(), bg, [1, 1, 1]);
        }
        Op::Sample => {
            let ls = cx.shape_of(0);
            let s = crate::gpu::sample::Sampler::new(&cx.gpu, &kernels, ls[1]).map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&ArgmaxParams::last_row(ls[0], ls[1])))?;
            cx.acc.scratch.extend(s.scratch());
            for (k, bg, groups) in s.dispatches(dev, &p, &cx.input(0)?, &cx.input(1)?, &cx.input(2)?, &cx.out()?) {
                cx.push(k, bg, groups);
            }
        }
        Op::ArgmaxRows => {
            let ls = cx.shape_of(0);
            let k = kernels.argmax().map_err(cx.kerr())?;
            let (l, out) = (cx.input(0)?, cx.out()?);
            for r in 0..ls[0] {
                let p = cx.uni(bytemuck::bytes_of(&ArgmaxParams::row(r, ls[1], 0)))?;
                let bg = k.bind_group(dev, &p, &l, &out);
                cx.push(k.kernel.clone(), bg, [1, 1, 1]);
            }
        }
        Op::SampleRows => {
            // the sampler's dispatches once per row, one after the other on shared scratch
            let (ls, rs) = (cx.shape_of(0), cx.shape_of(2));
            let s = crate::gpu::sample::Sampler::new(&cx.gpu, &kernels, ls[1]).map_err(cx.kerr())?;
            cx.acc.scratch.extend(s.scratch());
            let (l, words, recent, out) = (cx.input(0)?, cx.input(1)?, cx.input(2)?, cx.out()?);
            for r in 0..ls[0] {
                let p = cx.uni(bytemuck::bytes_of(&ArgmaxParams::row(r, ls[1], rs[1])))?;
                for (k, bg, groups) in s.dispatches(dev, &p, &l, &words, &recent, &out) {
                    cx.push(k, bg, groups);
                }
            }
        }
        _ => return Err(cx.not_ours("argmax")),
    }
    Ok(())
}
