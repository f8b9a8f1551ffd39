//! RMSNorm, with a residual added and a scalar weight (`rmsnorm.wgsl`).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::{NormScale, Op};
use markbase_graph::quant::FloatType;

use crate::gpu::device::GpuError;
use crate::gpu::kernels::{dt_code, env_u32, grid, norm_mode, params_struct, COMMON, Kernel, KernelSpec, Kernels};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const RMSNORM: &str = include_str!("../../../wgsl/rmsnorm.wgsl");
const NORM_WG: u32 = 256;

/// Register steps of an RMSNorm over rows of `d` values: the fewest that hold a row (up to 2:
/// 16 values per invocation; 3 measured slower than the loop on the H200), else 0 (the looping
/// kernel). `MARKBASE_NORM_REG=0` forces 0.
fn norm_steps(d: usize) -> u32 {
    let steps = d.div_ceil(8 * NORM_WG as usize).max(1);
    if steps > 2 || env_u32("MARKBASE_NORM_REG") == Some(0) {
        0
    } else {
        steps as u32
    }
}

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::RmsNorm { w, res, scalar, steps } => format!(
            "rms_norm[{}{}{}{}]",
            w.map_or("none", |t| t.name()),
            if *res { " add" } else { "" },
            scalar.map_or(String::new(), |t| format!(" scaled {}", t.name())),
            if *steps > 0 { format!(" reg{}", 8 * steps) } else { String::new() }
        ),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::RmsNorm { w, res, scalar, steps } => Source::new(&[COMMON, RMSNORM])
            .c("WG", NORM_WG)
            .c("NS", 8 * steps)
            .flag("REG", steps > 0)
            .c("NDT", w.map_or(2, dt_code))
            .c("SDT", scalar.map_or(2, dt_code))
            .flag("HAS_W", w.is_some())
            .flag("RES", res)
            .flag("SCALAR", scalar.is_some())
            .flag("SUBGROUP", sg),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for w in [None, Some(FloatType::Bf16), Some(FloatType::F16), Some(FloatType::F32)] {
        for steps in [0, 1, 2] {
            v.push(KernelSpec::RmsNorm { w, res: false, scalar: None, steps });
            v.push(KernelSpec::RmsNorm { w, res: true, scalar: None, steps });
            v.push(KernelSpec::RmsNorm { w, res: true, scalar: Some(w.unwrap_or(FloatType::F32)), steps });
        }
    }
    v
}

impl Kernels {
    /// `res`: plus a residual (`Op::RmsNormAdd`).
    /// Rows of `d` values.
    pub fn rms_norm(&self, w: Option<FloatType>, res: bool, d: usize) -> Result<RmsNormKernel, GpuError> {
        Ok(RmsNormKernel { kernel: self.get(KernelSpec::RmsNorm { w, res, scalar: None, steps: norm_steps(d) })?, maxg: self.maxg() })
    }

    /// `(res + rms_norm(x)) * s` with a scalar weight `s` of dtype `scalar` (`Op::RmsNormAdd`
    /// with `scaled`).
    pub fn rms_norm_add_scaled(&self, w: Option<FloatType>, scalar: FloatType, d: usize) -> Result<RmsNormKernel, GpuError> {
        Ok(RmsNormKernel { kernel: self.get(KernelSpec::RmsNorm { w, res: true, scalar: Some(scalar), steps: norm_steps(d) })?, maxg: self.maxg() })
    }
}

params_struct! {
    #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
    pub struct RmsNormParams {
        pub rows: u32,
        pub d: u32,
        pub eps: f32,
        pub mode: u32,
    }
}
/// RMSNorm. Bindings: 0 params, 1 x, 2 out, 3 w (when built with a weight dtype; stored
/// bytes), 4 residual (`res` kernels: `out = res + norm(x)`).
pub struct RmsNormKernel {
    pub kernel: Arc<Kernel>,
    maxg: u32,
}

impl RmsNormKernel {
    pub fn params(&self, rows: usize, d: usize, eps: f32, scale: NormScale) -> RmsNormParams {
        RmsNormParams { rows: rows as u32, d: d as u32, eps, mode: norm_mode(scale) }
    }
    pub fn groups(&self, rows: usize) -> [u32; 3] {
        grid(rows as u64, self.maxg)
    }
    /// `res`: the residual (kernels built with `res`); `scalar`: the scalar weight (kernels
    /// built with one).
    #[allow(clippy::too_many_arguments)]
    pub fn bind_group(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        out: &wgpu::Buffer,
        w: Option<&wgpu::Buffer>,
        res: Option<&wgpu::Buffer>,
        scalar: Option<&wgpu::Buffer>,
    ) -> wgpu::BindGroup {
        let mut b = vec![(0, params), (1, x), (2, out)];
        if let Some(w) = w {
            b.push((3, w));
        }
        if let Some(r) = res {
            b.push((4, r));
        }
        if let Some(s) = scalar {
            b.push((5, s));
        }
        self.kernel.bind_buffers(device, &b)
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, rows: usize) {
        self.kernel.dispatch(pass, bg, self.groups(rows));
    }
}

/// Lowers the rmsnorm ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::RmsNorm { eps, scale } | Op::RmsNormAdd { eps, scale, .. } => {
            let rows = cx.node.ty.rows();
            let d = cx.node.ty.last();
            let res = matches!(op, Op::RmsNormAdd { .. });
            let wv = cx.norm_w()?;
            // the layer scalar: a vector weight as stored, the last input
            let sv = match op {
                Op::RmsNormAdd { scaled: true, .. } => {
                    Some(cx.vecw(cx.ins.len() - 1).ok_or_else(|| format!("node {}: scalar weight missing", cx.node.name))?)
                }
                _ => None,
            };
            let k = match sv {
                Some(s) => kernels.rms_norm_add_scaled(wv.map(|v| v.1), s.1, d),
                None => kernels.rms_norm(wv.map(|v| v.1), res, d),
            }
            .map_err(cx.kerr())?;
            let p = cx.uni(bytemuck::bytes_of(&k.params(rows, d, *eps, *scale)))?;
            let rb = if res { Some(cx.input(1)?) } else { None };
            let bg = k.bind_group(dev, &p, &cx.input(0)?, &cx.out()?, wv.map(|v| &v.0), rb.as_ref(), sv.map(|v| &v.0));
            cx.push(k.kernel.clone(), bg, k.groups(rows));
        }
        _ => return Err(cx.not_ours("rmsnorm")),
    }
    Ok(())
}
