//! Attention (`attention.wgsl`), optionally split over the keys with the partials merged in
//! the pass (`split_merge.wgsl`) or by a combine dispatch (`attn_combine.wgsl`); over chunked
//! caches a dispatch per chunk and ring lap, merged by the combine (see [`crate::gpu::kv`]).

use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::{NormScale, Op};
use markbase_graph::quant::FloatType;

use crate::gpu::device::{Gpu, GpuError};
use crate::gpu::kv::MAX_KV_PARTS;
use crate::gpu::kernels::{div_ceil, dt_code, env_on, params_struct, COMMON, Kernel, KernelSpec, Kernels};
use crate::gpu::ops::rope::{check_pairs, RopeParams};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const ATTENTION: &str = include_str!("../../../wgsl/attention.wgsl");
const ATTN_COMBINE: &str = include_str!("../../../wgsl/attn_combine.wgsl");
const SPLIT_MERGE: &str = include_str!("../../../wgsl/split_merge.wgsl");

/// Largest head dim the attention kernel takes.
pub const MAX_HEAD_DIM: usize = 512;

const ATTN_WG: u32 = 128;

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::Attention { dpt, split, qrope, merge, append, chunk } => format!(
            "attention[dpt{dpt}{}{}{}{}{}]",
            if *split { " split" } else { "" },
            if *split && *merge { " merge" } else { "" },
            qrope.map_or(String::new(), |w| format!(" norm_rope[{}]", w.map_or("none", |t| t.name()))),
            if *append { " append" } else { "" },
            if *chunk { " chunk" } else { "" }
        ),
        KernelSpec::AttnCombine => "attn_combine".into(),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::Attention { dpt, split, qrope, merge, append, chunk } => {
            let coop = sg && env_on("MARKBASE_ATTN_COOP");
            let files: &[&'static str] = if split && merge { &[COMMON, SPLIT_MERGE, ATTENTION] } else { &[COMMON, ATTENTION] };
            Source::new(files)
                .c("WG", ATTN_WG)
                .c("DPT", dpt)
                .c("QV4", dpt * ATTN_WG / 4)
                .c("QPL", (dpt * ATTN_WG / 4).div_ceil(8))
                .c("NDT", qrope.flatten().map_or(2, dt_code))
                .flag("SPLIT", split)
                .flag("MERGE", split && merge)
                .flag("CHUNK", chunk)
                .flag("QROPE", qrope.is_some())
                .flag("APPEND", append && qrope.is_some())
                .flag("HAS_NW", qrope.flatten().is_some())
                .flag("SUBGROUP", sg)
                .flag("COOP", coop)
                .flag("PREFETCH", coop && env_on("MARKBASE_ATTN_PREFETCH"))
        }
        KernelSpec::AttnCombine => Source::new(&[COMMON, SPLIT_MERGE, ATTN_COMBINE]).c("WG", ATTN_WG),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    let mut v = Vec::new();
    for dpt in [1, 2, 4] {
        for split in [false, true] {
            v.push(KernelSpec::Attention { dpt, split, qrope: None, merge: false, append: false, chunk: false });
            v.push(KernelSpec::Attention { dpt, split, qrope: Some(Some(FloatType::Bf16)), merge: split, append: false, chunk: false });
            v.push(KernelSpec::Attention { dpt, split, qrope: Some(Some(FloatType::Bf16)), merge: split, append: true, chunk: false });
        }
        v.push(KernelSpec::Attention { dpt, split: true, qrope: None, merge: false, append: false, chunk: true });
        v.push(KernelSpec::Attention { dpt, split: true, qrope: Some(Some(FloatType::Bf16)), merge: false, append: true, chunk: true });
    }
    v.push(KernelSpec::AttnCombine);
    v
}

impl Kernels {
    /// Attention for head dim `d`; `nsplit > 1` splits each query's keys over that many
    /// workgroups (decode over long contexts), merged in the pass
    /// ([`KernelOptions::merge_splits`]) or by a combine dispatch.
    pub fn attention(&self, d: usize, nsplit: usize) -> Result<AttentionKernel, GpuError> {
        self.attention_with(d, nsplit, None, false)
    }

    /// `qrope`: q's norm (weight dtype) and RoPE in front (`Op::NormRopeAttention`; bindings 6
    /// the `RopeParams`, 7 the norm weight). `append` (with `qrope`, one token): the pass writes
    /// the step's key (normed, its weight at 10 of q's dtype, and rotated as q is) and value,
    /// heads of the q/k/v row ([`AttentionParams::with_append`]), into the caches it reads.
    pub fn attention_with(&self, d: usize, nsplit: usize, qrope: Option<Option<FloatType>>, append: bool) -> Result<AttentionKernel, GpuError> {
        self.attention_full(d, nsplit, qrope, self.opts.merge_splits, append)
    }

    /// [`Kernels::attention_with`] with `merge` given: split partials merged by the last
    /// workgroup of each head (see [`KernelOptions::merge_splits`]) or by a combine dispatch.
    pub fn attention_full(&self, d: usize, nsplit: usize, qrope: Option<Option<FloatType>>, merge: bool, append: bool) -> Result<AttentionKernel, GpuError> {
        let dpt = attention_dpt(d, nsplit, qrope, append)?;
        let split = nsplit > 1;
        let merge = split && merge;
        let kernel = self.get(KernelSpec::Attention { dpt, split, qrope, merge, append, chunk: false })?;
        let combine = if split && !merge { Some(self.get(KernelSpec::AttnCombine)?) } else { None };
        Ok(AttentionKernel { kernel, combine, nsplit: nsplit.max(1) as u32 })
    }

    /// Attention over chunked caches ([`crate::gpu::kv`]): a dispatch per chunk and ring lap,
    /// each writing its share of the `nsplit` partials (its [`crate::gpu::kv::KvChunkParams`]
    /// at binding 11), and the combine.
    pub fn attention_chunked(&self, d: usize, nsplit: usize, qrope: Option<Option<FloatType>>, append: bool) -> Result<AttentionKernel, GpuError> {
        let dpt = attention_dpt(d, nsplit, qrope, append)?;
        let kernel = self.get(KernelSpec::Attention { dpt, split: true, qrope, merge: false, append, chunk: true })?;
        Ok(AttentionKernel { kernel, combine: Some(self.get(KernelSpec::AttnCombine)?), nsplit: nsplit.max(2) as u32 })
    }
}

/// The output dims per invocation of head dim `d`, or why the kernel cannot take `d`, `nsplit`
/// splits or the append.
fn attention_dpt(d: usize, nsplit: usize, qrope: Option<Option<FloatType>>, append: bool) -> Result<u32, GpuError> {
    if append && qrope.is_none() {
        return Err(GpuError::Kernel { name: "attention".into(), msg: "appending the step's key needs q's norm and RoPE in the pass".into() });
    }
    if d == 0 || d % 4 != 0 || d > MAX_HEAD_DIM {
        return Err(GpuError::Kernel { name: "attention".into(), msg: format!("head dim {d} (must be a multiple of 4, <= 512)") });
    }
    // the merge (in the pass or by the combine) weighs a split per invocation
    if nsplit > ATTN_WG as usize {
        return Err(GpuError::Kernel { name: "attention".into(), msg: format!("{nsplit} splits (at most {ATTN_WG})") });
    }
    Ok(div_ceil(d, ATTN_WG as usize) as u32)
}

params_struct! {
    #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
    pub struct AttentionParams {
        pub t: u32,
        pub nq: u32,
        pub nkv: u32,
        pub d: u32,
        pub slots: u32,
        pub window: u32,
        pub nsplit: u32,
        /// 1: the positions binding holds attention bounds `[2, T]` (query `t` sees keys up
        /// to `pos[T + t]`).
        pub spans: u32,
        pub scale: f32,
        /// With append: the step's key heads start at head `k_head0` of q's row, its value heads
        /// at `v_head0`.
        pub k_head0: u32,
        pub v_head0: u32,
        pub _pad: u32,
    }
}

impl AttentionParams {
    /// Where the step's key and value heads start in q's row (an appending pass).
    pub fn with_append(self, k_head0: usize, v_head0: usize) -> Self {
        AttentionParams { k_head0: k_head0 as u32, v_head0: v_head0 as u32, ..self }
    }
}

/// Attention. Bindings: 0 params, 1 q `[T, nq, D]`, 2 pos, 3 k, 4 v (`[S, nkv, D]`),
/// 5 out `[T, nq, D]` (split: the partials of [`AttnScratch`]; merged in the pass: the
/// output at 8 and the counters at 9).
/// Split combine bindings: 0 params (the same buffer), 1 partials, 2 out.
pub struct AttentionKernel {
    pub kernel: Arc<Kernel>,
    pub combine: Option<Arc<Kernel>>,
    pub nsplit: u32,
}

/// Scratch of a split attention: the partials, and a counter per query head when the pass
/// merges them (zeroed at creation; the merging workgroup zeroes its counter again).
pub struct AttnScratch {
    pub partials: wgpu::Buffer,
    pub counters: Option<wgpu::Buffer>,
}

impl AttentionKernel {
    #[allow(clippy::too_many_arguments)]
    pub fn params(&self, t: usize, nq: usize, nkv: usize, d: usize, slots: usize, scale: f32, window: Option<usize>) -> AttentionParams {
        assert!(nkv > 0 && nq % nkv == 0, "attention: {nq} heads over {nkv} kv heads");
        AttentionParams {
            t: t as u32,
            nq: nq as u32,
            nkv: nkv as u32,
            d: d as u32,
            slots: slots as u32,
            window: window.unwrap_or(0) as u32,
            nsplit: self.nsplit,
            spans: 0,
            scale,
            k_head0: 0,
            v_head0: 0,
            _pad: 0,
        }
    }

    /// Whether each head's last workgroup merges the split partials (splits, no combine).
    pub fn merges(&self) -> bool {
        self.nsplit > 1 && self.combine.is_none()
    }
    /// Bytes of the scratch buffer for split partials (per split: d values, then the max, the
    /// sum and two unused values, so that every split starts a vec4).
    pub fn partials_bytes(&self, t: usize, nq: usize, d: usize) -> u64 {
        (t * nq * self.nsplit as usize * (d + 4) * 4) as u64
    }
    /// The scratch buffers of a split attention over `t` queries of `nq` heads (`None`
    /// without splits).
    pub fn try_scratch(&self, gpu: &Gpu, name: &str, t: usize, nq: usize, d: usize) -> Result<Option<AttnScratch>, GpuError> {
        if self.nsplit <= 1 {
            return Ok(None);
        }
        let partials = gpu.try_storage(&format!("{name}.partials"), self.partials_bytes(t, nq, d))?;
        let counters = self.merges().then(|| gpu.try_storage(&format!("{name}.counters"), (t * nq * 4) as u64)).transpose()?;
        Ok(Some(AttnScratch { partials, counters }))
    }

    /// [`AttentionKernel::try_scratch`] for tests and tools.
    pub fn scratch(&self, gpu: &Gpu, name: &str, t: usize, nq: usize, d: usize) -> Option<AttnScratch> {
        self.try_scratch(gpu, name, t, nq, d).unwrap_or_else(|e| panic!("{e}"))
    }
    /// `out` is the final output, `scratch` the split's buffers (split only); `extra`: more
    /// bindings (q's rope params at 6 and norm weight at 7 with a fused q norm + RoPE).
    #[allow(clippy::too_many_arguments)]
    pub fn bind_groups(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        q: &wgpu::Buffer,
        pos: &wgpu::Buffer,
        k: &wgpu::Buffer,
        v: &wgpu::Buffer,
        out: &wgpu::Buffer,
        scratch: Option<&AttnScratch>,
        extra: &[(u32, &wgpu::Buffer)],
    ) -> (wgpu::BindGroup, Option<wgpu::BindGroup>) {
        let mut b = vec![(0, params), (1, q), (2, pos), (3, k), (4, v)];
        b.extend_from_slice(extra);
        if self.nsplit <= 1 {
            b.push((5, out));
            return (self.kernel.bind_buffers(device, &b), None);
        }
        let s = scratch.expect("split attention needs its scratch buffers");
        b.push((5, &s.partials));
        if self.merges() {
            b.push((8, out));
            b.push((9, s.counters.as_ref().expect("a merging split attention needs its counters")));
        }
        let a = self.kernel.bind_buffers(device, &b);
        let c = self.combine.as_ref().map(|c| c.bind_buffers(device, &[(0, params), (1, &s.partials), (2, out)]));
        (a, c)
    }
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &(wgpu::BindGroup, Option<wgpu::BindGroup>), t: usize, nq: usize) {
        self.kernel.dispatch(pass, &bg.0, [nq as u32, t as u32, self.nsplit]);
        if let (Some(c), Some(b)) = (&self.combine, &bg.1) {
            c.dispatch(pass, b, [nq as u32, t as u32, 1]);
        }
    }
}

/// A split count for decode attention: enough workgroups to fill a large GPU when
/// `heads * tokens` alone cannot, a split per 32 cache slots (`MARKBASE_ATTN_SPLIT_KEYS`),
/// at most 256 workgroups' worth. On the H200 32 keys per split decoded 12B 27% faster
/// than 256 at a 512-token context: a workgroup walks its keys serially.
pub fn attention_splits(slots: usize, heads: usize, t: usize) -> usize {
    if t > 1 {
        return 1;
    }
    let keys = std::env::var("MARKBASE_ATTN_SPLIT_KEYS").ok().and_then(|v| v.parse::<usize>().ok()).filter(|&k| k > 0).unwrap_or(32);
    let by_len = slots.div_ceil(keys);
    let by_occupancy = 256usize.div_ceil(heads.max(1));
    by_len.min(by_occupancy).clamp(1, 64)
}

/// Lowers the attention ops.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels, op) = (cx.dev(), cx.kernels, cx.op);
    match op {
        Op::Attention { scale, window } | Op::NormRopeAttention { scale, window, .. } => {
            let s = &cx.node.ty.shape;
            let (t, nq, d) = (s[0], s[1], s[2]);
            let ks = cx.shape_of(2);
            let (slots, nkv) = (ks[0], ks[1]);
            // q's norm and RoPE in the attention pass: their params and weight at 6, 7
            let qrope = match op {
                Op::NormRopeAttention { eps, norm, theta, factor, rotary_pairs, heads, .. } => {
                    check_pairs(cx, *rotary_pairs)?;
                    let rp = RopeParams::new(t, nq, d, *theta, *factor, *rotary_pairs)
                        .with_norm(Some((*norm, *eps)))
                        .with_heads(cx.shape_of(0)[1], heads.map_or(0, |r| r.start));
                    Some((cx.uni(bytemuck::bytes_of(&rp))?, cx.norm_w()?))
                }
                _ => None,
            };
            let qdt = qrope.as_ref().map(|q| q.1.map(|v| v.1));
            // the step's key and value appended by the pass: the key's norm weight at 10
            let append = match op {
                Op::NormRopeAttention { append: Some(a), norm, .. } => {
                    let wk = if *norm == NormScale::None { None } else { Some(cx.vecw(5).ok_or_else(|| format!("node {}: key norm weight missing", cx.node.name))?) };
                    if wk.map(|w| w.1) != qdt.flatten() {
                        return Err(cx.fail("the key's norm weight is not stored as the query's"));
                    }
                    Some((a, wk))
                }
                _ => None,
            };
            let chunks = match (cx.kv_chunks(cx.ins[2]), cx.kv_chunks(cx.ins[3])) {
                (None, None) => None,
                (Some(kc), Some(vc)) if kc.same_layout(&vc) => Some((kc, vc)),
                _ => return Err(cx.fail("keys and values chunked differently")),
            };
            // chunked caches: a dispatch per chunk and ring lap (a window's keys span two laps)
            // and their splits, merged by the combine
            let laps = if window.is_some() { 2 } else { 1 };
            let (nsplit, per_part) = match &chunks {
                None => (attention_splits(slots, nq, t), 1),
                Some((kc, _)) => {
                    let parts = laps * kc.bufs.len();
                    if parts > MAX_KV_PARTS {
                        return Err(cx.fail(format!("{parts} chunks of its KV cache, more than the {MAX_KV_PARTS} the merge takes: lower --max-context")));
                    }
                    let per = attention_splits(kc.chunk_slots, nq, t).min(MAX_KV_PARTS / parts).max(1);
                    (parts * per, per)
                }
            };
            let k = match chunks {
                None => kernels.attention_with(d, nsplit, qdt, append.is_some()),
                Some(_) => kernels.attention_chunked(d, nsplit, qdt, append.is_some()),
            }
            .map_err(cx.kerr())?;
            let mut params = k.params(t, nq, nkv, d, slots, *scale, *window);
            params.spans = (cx.shape_of(1).len() == 2) as u32;
            let params = append.map_or(params, |(a, _)| params.with_append(a.k.start, a.v.start));
            let p = cx.uni(bytemuck::bytes_of(&params))?;
            let mut extra: Vec<(u32, &wgpu::Buffer)> = vec![];
            if let Some((rb, nw)) = &qrope {
                extra.push((6, rb));
                if let Some((b, _)) = nw {
                    extra.push((7, b));
                }
            }
            if let Some((_, Some((b, _)))) = append {
                extra.push((10, b));
            }
            let sc = k.try_scratch(&cx.gpu, &cx.node.name, t, nq, d).map_err(|e| e.to_string())?;
            if let Some(sc) = &sc {
                cx.acc.scratch.push(sc.partials.clone());
                cx.acc.scratch.extend(sc.counters.clone());
            }
            if let Some((kc, vc)) = &chunks {
                let sc = sc.as_ref().ok_or_else(|| cx.fail("chunked attention without partials"))?;
                let (q, pos, out) = (cx.input(0)?, cx.input(1)?, cx.out()?);
                for lap in 0..laps {
                    for c in 0..kc.bufs.len() {
                        let split0 = (lap * kc.bufs.len() + c) * per_part;
                        let cp = cx.uni(bytemuck::bytes_of(&kc.params(c, lap, split0, per_part)))?;
                        let mut b = vec![(0, &p), (1, &q), (2, &pos), (3, &kc.bufs[c]), (4, &vc.bufs[c]), (5, &sc.partials), (11, &cp)];
                        b.extend_from_slice(&extra);
                        let bg = k.kernel.bind_buffers(dev, &b);
                        cx.push(k.kernel.clone(), bg, [nq as u32, t as u32, per_part as u32]);
                    }
                }
                let ck = k.combine.as_ref().ok_or_else(|| cx.fail("chunked attention without its combine"))?;
                let bg = ck.bind_buffers(dev, &[(0, &p), (1, &sc.partials), (2, &out)]);
                cx.push(ck.clone(), bg, [nq as u32, t as u32, 1]);
                return Ok(());
            }
            let (a, b) = k.bind_groups(dev, &p, &cx.input(0)?, &cx.input(1)?, &cx.input(2)?, &cx.input(3)?, &cx.out()?, sc.as_ref(), &extra);
            cx.push(k.kernel.clone(), a, [nq as u32, t as u32, k.nsplit]);
            if let (Some(ck), Some(b)) = (&k.combine, b) {
                cx.push(ck.clone(), b, [nq as u32, t as u32, 1]);
            }
        }
        _ => return Err(cx.not_ours("attention")),
    }
    Ok(())
}
