//! A batch of sequences over one KV cache of sequence slots (`batched.wgsl`): the cache write
//! (`Op::KvWriteBatched`) and the attention (`Op::AttentionBatched`) of rows that each belong
//! to a sequence slot.

use bytemuck::{Pod, Zeroable};
use markbase_graph::ops::Op;

use crate::gpu::kernels::{div_ceil, grid, params_struct, ELEM_WG, KernelSpec};
use crate::gpu::shader::Source;
use super::{Family, LowerCtx};

const BATCHED: &str = include_str!("../../../wgsl/batched.wgsl");

/// Invocations of an attention workgroup (eight per key of a block; head dims per step).
const ATTN_WG: u32 = 256;
/// Head dims per invocation: the attention takes heads of up to `ATTN_WG * MAXD` dims.
const MAXD: u32 = 2;

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::Batched { attention: false } => "kv_write_batched".into(),
        KernelSpec::Batched { attention: true } => "attention_batched".into(),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::Batched { attention } => Source::new(&[BATCHED])
            .c("WG", if attention { ATTN_WG } else { ELEM_WG })
            .c("MAXD", MAXD)
            .flag("KV_WRITE", !attention)
            .flag("ATTENTION", attention),
        _ => return None,
    })
}

fn variants() -> Vec<KernelSpec> {
    vec![KernelSpec::Batched { attention: false }, KernelSpec::Batched { attention: true }]
}

params_struct! {
    /// `batched.wgsl`'s params.
    #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
    pub struct BatchedParams {
        pub t: u32,
        pub nq: u32,
        pub nkv: u32,
        pub d: u32,
        pub s: u32,
        pub n: u32,
        pub window: u32,
        pub scale: f32,
        pub spans: u32,
        pub _p0: u32,
        pub _p1: u32,
        pub _p2: u32,
    }
}

/// Lowers the batched cache write and attention.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    let (dev, kernels) = (cx.dev(), cx.kernels);
    // the caches: `[N, S, nkv, D]`, one buffer (a batch's caches are not split across bindings)
    let cache_in = 3;
    if cx.kv_chunks(cx.ins[cache_in]).is_some() {
        return Err(cx.fail("a batch's KV cache over the storage binding limit: lower --ctx-size or --parallel"));
    }
    let cs = cx.shape_of(cache_in);
    let (n, s, nkv, d) = (cs[0], cs[1], cs[2], cs[3]);
    let t = cx.shape_of(0)[0];
    match cx.op {
        Op::KvWriteBatched => {
            let k = kernels.get(KernelSpec::Batched { attention: false }).map_err(cx.kerr())?;
            let prm = BatchedParams { t: t as u32, nq: nkv as u32, nkv: nkv as u32, d: d as u32, s: s as u32, n: n as u32, ..Default::default() };
            let p = cx.uni(bytemuck::bytes_of(&prm))?;
            let bg = k.bind_buffers(dev, &[(0, &p), (1, &cx.input(0)?), (2, &cx.input(1)?), (3, &cx.input(2)?), (4, &cx.out()?)]);
            let groups = grid(div_ceil(t * nkv * d, ELEM_WG as usize) as u64, kernels.maxg());
            cx.push(k, bg, groups);
        }
        Op::AttentionBatched { scale, window } => {
            let nq = cx.node.ty.shape[1];
            if d > (ATTN_WG * MAXD) as usize {
                return Err(cx.fail(format!("head dim {d} over the batched attention's {}", ATTN_WG * MAXD)));
            }
            let k = kernels.get(KernelSpec::Batched { attention: true }).map_err(cx.kerr())?;
            let w = window.map_or(0, |w| w.min(u32::MAX as usize) as u32);
            // attention bounds `[2, T]`: a prompt's image spans see themselves whole
            let spans = (cx.shape_of(1).len() == 2) as u32;
            let prm = BatchedParams { t: t as u32, nq: nq as u32, nkv: nkv as u32, d: d as u32, s: s as u32, n: n as u32, window: w, scale: *scale, spans, ..Default::default() };
            let p = cx.uni(bytemuck::bytes_of(&prm))?;
            let bufs = [(0, &p), (1, &cx.input(0)?), (2, &cx.input(1)?), (3, &cx.input(2)?), (4, &cx.input(3)?), (5, &cx.input(4)?), (6, &cx.out()?)];
            let bg = k.bind_buffers(dev, &bufs);
            cx.push(k, bg, [nq as u32, t as u32, 1]);
        }
        _ => return Err(cx.fail(format!("{} is not an op of the batched kernels", cx.op.name()))),
    }
    Ok(())
}
