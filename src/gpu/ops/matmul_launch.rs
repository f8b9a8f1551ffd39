//! The matmul launchers: the params every matmul kernel reads (`gemv.wgsl`, `gemm.wgsl`,
//! `gemm_coop.wgsl`), the shape of one dispatch, and [`MatMulKernel`], which binds and dispatches
//! a kernel that [`super::matmul`]'s selection picked.

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::NormScale;

use crate::gpu::kernels::{div_ceil, norm_mode, params_struct, Kernel, KernelSpec};
use crate::gpu::weights::GpuWeight;
use super::gemm_f16;
use super::matmul::{gemm_ksplit, gemm_tile_rows, gemm_tiles, gemv_tokx};

params_struct! {
    /// Params of `gemv.wgsl` / `gemm.wgsl` (binding 0).
    #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
    pub struct MatMulParams {
        pub t: u32,
        pub k: u32,
        pub rows: u32,
        pub row_start: u32,
        pub ldy: u32,
        pub e_start: u32,
        pub e_count: u32,
        pub s: u32,
        pub x_bcast: u32,
        /// Experts of the whole stack (grouped GEMM: where the pair list starts).
        pub experts: u32,
        /// Fused norm (`Gemv` with `norm`): 0 no weight, 1 `w`, 2 `1 + w`; and its epsilon.
        pub norm_mode: u32,
        pub norm_eps: f32,
        /// Rows of the second and third weight (`GemvCat`).
        pub rows2: u32,
        pub rows3: u32,
        /// Parts of K (split GEMM).
        pub ksplit: u32,
        pub _pad: u32,
    }
}

/// Shape of one matmul dispatch (one weight chunk).
#[derive(Clone, Copy, Debug)]
pub struct MatMulDims {
    /// Tokens (gathered: T*S pairs).
    pub t: usize,
    pub k: usize,
    /// Rows of the chunk (gathered: N, rows per expert).
    pub rows: usize,
    /// Output column of the chunk's first row (gathered: 0).
    pub row_start: usize,
    /// Row stride of y (N of the whole weight).
    pub ldy: usize,
    pub gather: Option<GatherDims>,
    /// Fused RMSNorm of x (`Op::NormMatMul`): its scale convention and epsilon.
    pub norm: Option<(NormScale, f32)>,
    /// Rows of the second and third weight whose outputs follow (`GemvCat`; 0 without).
    pub cat: [usize; 2],
    /// Parts of K of a split GEMM (0: [`gemm_ksplit`]'s choice).
    pub ksplit: usize,
}

/// Gathered-matmul extras.
#[derive(Clone, Copy, Debug)]
pub struct GatherDims {
    /// Experts per token.
    pub s: usize,
    /// Experts held by the chunk.
    pub e_start: usize,
    pub e_count: usize,
    /// x is `[T, K]`, shared by a token's S pairs (else `[T, S, K]`).
    pub x_bcast: bool,
    /// Experts of the whole stack.
    pub experts: usize,
}

impl MatMulDims {
    /// Dims of chunk `c` of `w` for `t` tokens (plain matmul).
    pub fn plain(w: &GpuWeight, c: usize, t: usize) -> Self {
        let ch = &w.chunks[c];
        MatMulDims { t, k: w.k, rows: ch.rows, row_start: ch.row_start, ldy: w.rows, gather: None, norm: None, cat: [0; 2], ksplit: 0 }
    }
    /// Dims of one token through 2 or 3 single-chunk weights side by side (`GemvCat`).
    pub fn cat(ws: &[&GpuWeight]) -> Self {
        let rows = |i: usize| ws.get(i).map_or(0, |w| w.rows);
        let ldy = ws.iter().map(|w| w.rows).sum();
        MatMulDims { t: 1, k: ws[0].k, rows: rows(0), row_start: 0, ldy, gather: None, norm: None, cat: [rows(1), rows(2)], ksplit: 0 }
    }
    /// With a fused norm in front.
    pub fn with_norm(self, scale: NormScale, eps: f32) -> Self {
        MatMulDims { norm: Some((scale, eps)), ..self }
    }
    /// Dims of chunk `c` of the expert stack `w` for `tokens` tokens with `s` experts each.
    pub fn gathered(w: &GpuWeight, c: usize, tokens: usize, s: usize, x_bcast: bool) -> Self {
        let (e_start, e_count) = w.chunk_experts(c);
        MatMulDims {
            t: tokens * s,
            k: w.k,
            rows: w.rows_per_expert,
            row_start: 0,
            ldy: w.rows_per_expert,
            gather: Some(GatherDims { s, e_start, e_count, x_bcast, experts: w.experts }),
            norm: None,
            cat: [0; 2],
            ksplit: 0,
        }
    }
}

/// Matmul launcher. Bindings: 0 params, 1 x (f32), 2 y (f32, written), 3 routing (gathered
/// GEMV: the ids, u32 `[T*S]`; grouped GEMM: the `Op::MoeGroup` value), 4 norm weight (fused
/// norm with a weight), 8 packed weights, 9 scales (affine: scale and bias pairs), 11 global scale (as
/// the format has them).
pub struct MatMulKernel {
    pub kernel: Arc<Kernel>,
    pub spec: KernelSpec,
    pub(crate) maxg: u32,
}

impl MatMulKernel {
    pub fn is_gemv(&self) -> bool {
        matches!(self.spec, KernelSpec::Gemv { .. } | KernelSpec::GemvCat { .. })
    }

    pub fn params(&self, d: &MatMulDims) -> MatMulParams {
        let g = d.gather.unwrap_or(GatherDims { s: 1, e_start: 0, e_count: 0, x_bcast: false, experts: 0 });
        MatMulParams {
            t: d.t as u32,
            k: d.k as u32,
            rows: d.rows as u32,
            row_start: d.row_start as u32,
            ldy: d.ldy as u32,
            e_start: g.e_start as u32,
            e_count: g.e_count as u32,
            s: g.s as u32,
            x_bcast: g.x_bcast as u32,
            experts: g.experts as u32,
            norm_mode: d.norm.map_or(0, |(s, _)| norm_mode(s)),
            norm_eps: d.norm.map_or(0.0, |(_, e)| e),
            rows2: d.cat[0] as u32,
            rows3: d.cat[1] as u32,
            ksplit: self.ksplit(d) as u32,
            _pad: 0,
        }
    }

    /// The f16 GEMM: it reads x / s in f16 (binding 1, [`gemm_f16::x16_bytes`]) and the row
    /// scales (binding 7), written by a [`Kernels::row_scale`] dispatch before it
    /// ([`MatMulKernel::bind_group_f16`]).
    pub fn is_f16(&self) -> bool {
        matches!(self.spec, KernelSpec::GemmF16 { .. })
    }

    /// Bind group of the f16 GEMM: chunk `c` of `w`, the activations `x16` and their row scales
    /// `scales`; the grouped one's `Op::MoeGroup` value `groups`; the split one's partial sums and
    /// counters `split` (as [`MatMulKernel::bind_group_split`]'s).
    #[allow(clippy::too_many_arguments)]
    pub fn bind_group_f16(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x16: &wgpu::Buffer,
        y: &wgpu::Buffer,
        scales: &wgpu::Buffer,
        groups: Option<&wgpu::Buffer>,
        split: Option<(&wgpu::Buffer, &wgpu::Buffer)>,
        w: &GpuWeight,
        c: usize,
    ) -> wgpu::BindGroup {
        let mut extra = vec![(7, scales)];
        extra.extend(groups.map(|g| (3, g)));
        if let Some((part, done)) = split {
            extra.extend([(5, part), (6, done)]);
        }
        self.bind(device, params, x16, y, &extra, w, None, c)
    }

    /// Whether the kernel cuts K into parts (and binds [`MatMulKernel::split_scratch_bytes`]).
    pub fn is_split(&self) -> bool {
        matches!(self.spec, KernelSpec::Gemm { split: true, .. } | KernelSpec::GemmF16 { split: true, .. })
    }

    /// Parts of K of dispatch `d` (1 unless split).
    pub fn ksplit(&self, d: &MatMulDims) -> usize {
        if !self.is_split() {
            return 1;
        }
        if d.ksplit > 0 {
            return d.ksplit;
        }
        match self.spec {
            KernelSpec::GemmF16 { .. } => gemm_f16::ksplit_for(&self.spec, d.rows, d.k, d.t),
            _ => gemm_ksplit(gemm_tiles(d.rows, d.t, false), d.k),
        }
    }

    /// Bytes of the split GEMM's partial sums and of its counters for dispatch `d`.
    pub fn split_scratch_bytes(&self, d: &MatMulDims) -> (u64, u64) {
        let (tiles, tile) = match self.spec {
            KernelSpec::GemmF16 { mt, nt, .. } => (gemm_f16::tiles(d.rows, d.t, mt, nt) as u64, 32 * mt as u64 * gemm_f16::tile_rows(nt) as u64),
            _ => (gemm_tiles(d.rows, d.t, false) as u64, 64 * 64),
        };
        (tiles * self.ksplit(d) as u64 * tile * 4, tiles * 4)
    }

    /// Bind group of a split GEMM: chunk `c` of `w`, partial sums `part`, counters `done` (zeroed
    /// before the first dispatch; each dispatch leaves them zeroed).
    #[allow(clippy::too_many_arguments)]
    pub fn bind_group_split(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        part: &wgpu::Buffer,
        done: &wgpu::Buffer,
        w: &GpuWeight,
        c: usize,
    ) -> wgpu::BindGroup {
        self.bind(device, params, x, y, &[(5, part), (6, done)], w, None, c)
    }

    pub fn groups(&self, d: &MatMulDims) -> [u32; 3] {
        let m = self.maxg as usize;
        match self.spec {
            KernelSpec::Gemv { rows, tt, gather, .. } => {
                let (rg, ty) = (div_ceil(d.rows, rows as usize).min(m) as u32, if gather { d.t } else { div_ceil(d.t, tt as usize) }.min(m) as u32);
                // several tokens, not gathered: the token groups along x (gemv.wgsl's TOKX)
                if gemv_tokx(gather, tt) {
                    [ty, rg, 1]
                } else {
                    [rg, ty, 1]
                }
            }
            KernelSpec::GemvCat { rows, .. } => {
                let g: usize = [d.rows, d.cat[0], d.cat[1]].iter().map(|&r| div_ceil(r, rows as usize)).sum();
                [g.min(m) as u32, 1, 1]
            }
            KernelSpec::GroupedGemm { .. } => {
                // a slot per possible tile: each expert's last tile may be partial
                let experts = d.gather.map_or(0, |g| g.e_count);
                [div_ceil(d.rows, 64).min(m) as u32, (div_ceil(d.t, 64) + experts).min(m) as u32, 1]
            }
            KernelSpec::GemmF16 { mt, nt, grouped, .. } => {
                let [x, y, _] = gemm_f16::gemm_groups(d.rows, d.t, mt, nt, d.gather.filter(|_| grouped).map(|g| g.e_count), self.maxg);
                [x, y, self.ksplit(d) as u32]
            }
            KernelSpec::Gemm { wide, .. } => {
                [div_ceil(d.rows, gemm_tile_rows(wide)).min(m) as u32, div_ceil(d.t, 64).min(m) as u32, self.ksplit(d) as u32]
            }
            _ => [div_ceil(d.rows, 64).min(m) as u32, div_ceil(d.t, 64).min(m) as u32, 1],
        }
    }

    /// Bind group for chunk `c` of `w`.
    pub fn bind_group(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        routing: Option<&wgpu::Buffer>,
        w: &GpuWeight,
        c: usize,
    ) -> wgpu::BindGroup {
        self.bind(device, params, x, y, routing.map(|r| (3, r)).as_slice(), w, None, c)
    }

    /// Bindings 0-2, the extras (`(binding, buffer)`), chunk `c` of `w` at 8.. and of the dual
    /// GEMV's second weight `wu` at 12...
    #[allow(clippy::too_many_arguments)]
    fn bind(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        extra: &[(u32, &wgpu::Buffer)],
        w: &GpuWeight,
        wu: Option<&GpuWeight>,
        c: usize,
    ) -> wgpu::BindGroup {
        let mut res = vec![(0, params.as_entire_binding()), (1, x.as_entire_binding()), (2, y.as_entire_binding())];
        res.extend(extra.iter().map(|&(b, buf)| (b, buf.as_entire_binding())));
        res.extend(w.bindings(c));
        if let Some(wu) = wu {
            res.extend(wu.bindings(c).into_iter().map(|(b, r)| (b + 4, r)));
        }
        self.kernel.bind_group(device, &res)
    }

    /// Bind group for chunk `c` of `w` behind a fused norm with weight `nw`; with `wu`, of the
    /// gate `w` and the up `wu` (dual GEMV).
    #[allow(clippy::too_many_arguments)]
    pub fn bind_group_norm(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        nw: Option<&wgpu::Buffer>,
        w: &GpuWeight,
        wu: Option<&GpuWeight>,
        c: usize,
    ) -> wgpu::BindGroup {
        self.bind(device, params, x, y, nw.map(|b| (4, b)).as_slice(), w, wu, c)
    }

    /// Bind group for the single-chunk weights `ws` (at 8.., 12.., 16..) behind a fused norm with
    /// weight `nw` (`GemvCat`).
    pub fn bind_group_cat(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        nw: Option<&wgpu::Buffer>,
        ws: &[&GpuWeight],
    ) -> wgpu::BindGroup {
        let mut res = vec![(0, params.as_entire_binding()), (1, x.as_entire_binding()), (2, y.as_entire_binding())];
        if let Some(b) = nw {
            res.push((4, b.as_entire_binding()));
        }
        for (i, w) in ws.iter().enumerate() {
            res.extend(w.bindings(0).into_iter().map(|(b, r)| (b + 4 * i as u32, r)));
        }
        self.kernel.bind_group(device, &res)
    }

    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, d: &MatMulDims) {
        self.kernel.dispatch(pass, bg, self.groups(d));
    }
}
