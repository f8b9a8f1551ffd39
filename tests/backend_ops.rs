//! Every op of the IR, alone in a small graph, compiled by the real passes and run by the
//! GPU executor (the lowering of `prepare()`) and the CPU reference executor, at awkward
//! shapes (odd sizes, sizes off the kernels' tiles, one token and several), with weights in
//! float and quantized formats, also cut into small chunks. Outputs (or the caches an op
//! writes) are compared by normalised mean squared error `Σ(g−c)² / Σc²` against a bound per
//! op; integer outputs must be equal.
//!
//! The list of op names is read from `Op::name` in graph/src/ops.rs, and every name must have
//! a case that ran; `variant_names` has no wildcard arm, so a new variant does not compile
//! until it is listed here.
//!
//! Environment: `MARKBASE_TEST_SEED=<n>` replays a seed (the default one is fixed and
//! printed); `MARKBASE_OPS_FILTER=<text>` runs the cases whose op or description contains it;
//! `MARKBASE_OPS_PERF=1` also times each case's op on the GPU (median of 5 steps) and prints
//! µs, GB/s and TFLOP/s (no assertion on them); `MARKBASE_OPS_VERBOSE=1` prints each case's
//! time; `MARKBASE_OPS_POISON=1` perturbs the CPU's results (every case must then fail).
//! The test fails, never skips, without a GPU adapter.

#[path = "common/ops_harness.rs"]
mod ops_harness;

use std::collections::BTreeMap;

use markbase::cpu::ops::SampleParams;
use markbase::graph::ir::{Graph, InputKind, StateKind};
use markbase::graph::ops::{BinaryOp, HeadRange, KvAppend, NormScale, Op, TensorType, UnaryOp, SAMPLE_PARAMS};
use markbase::graph::quant::{FloatType, QuantMode, WeightFormat};
use ops_harness::{quant, Case, Check, Read, B, VOCAB};
use petgraph::graph::NodeIndex;
use rand::Rng;

// ------------------------------------------------------------------ tolerances
//
// Bounds on the NMSE, by family: about 100x the worst seen on lavapipe over several seeds
// (in brackets), and no tighter than what another f32 implementation of the same math may
// differ by on a hardware GPU: fused multiply-adds, another summation order (NMSE about
// K x 1e-14 for dot products of K terms), a few ulps in exp/tanh/sin/cos/inverseSqrt.
//
// Data movement (embed of any table format, slice, reshape, cache writes): the
// same values (0). 1e-10 leaves room only for a quantized
// table's `scale * q + bias` fused on the GPU.
const EXACT: Check = Check::Nmse(1e-10);
// Elementwise arithmetic (add, mul, scale): one f32 op per value [0].
const ELEMENTWISE: Check = Check::Nmse(1e-11);
// tanh, softcap, GELU, GeGLU, SiLU: the GPU's tanh is accurate to about 1e-7 absolute, not
// relative (lavapipe), and GELU's `1 + tanh(u)` cancels at negative inputs (gelu(-3) is
// 1e-3 of the input), so a single value may differ by 1e-5 relative [5e-13 over rows of
// values in ±3, 3e-12 for GeGLU].
const TRANSCENDENTAL: Check = Check::Nmse(1e-8);
// The same near 0 (inputs in ±1e-3): relative errors of 1e-4 [2e-8].
const NEAR_ZERO: Check = Check::Nmse(1e-6);
// RMSNorms and softmaxes: a reduction over a row, a reciprocal square root or an exp [2e-14].
const NORM: Check = Check::Nmse(1e-11);
// RoPE (with its norm, and into a cache): sin/cos of angles up to 3e4 radians [5e-15].
const ROPE: Check = Check::Nmse(1e-11);
// Matmuls of every format, fused or gathered: dot products of up to 1024 terms in tiles,
// subgroups or K parts, from weights decoded alike [1e-12].
const MATMUL: Check = Check::Nmse(1e-10);
// Attention: scores, exp and the weighted sum over the keys, split partials merged [1e-13
// over up to 96 keys, 3e-11 over 4096 (perf mode)].
const ATTENTION: Check = Check::Nmse(1e-10);

#[path = "backend_ops/audio_cases.rs"]
mod audio_cases;

// ------------------------------------------------------------------ op list

/// The op names each variant of `Op` stands for. No wildcard arm: a new variant does not
/// compile until it is listed (its names then need cases, checked at run time).
fn variant_names(op: &Op) -> &'static [&'static str] {
    match op {
        Op::Embed { .. } => &["embed"],
        Op::MatMul => &["matmul"],
        Op::GatherMatMul => &["gather_matmul"],
        Op::MoeGroup { .. } => &["moe_group"],
        Op::GroupedMatMul => &["grouped_matmul"],
        Op::RmsNorm { .. } => &["rms_norm"],
        Op::RmsNormAdd { .. } => &["rms_norm_add"],
        Op::NormMatMul { .. } => &["norm_matmul"],
        Op::NormGeGlu { .. } => &["norm_geglu"],
        Op::Rope { .. } => &["rope"],
        Op::NormRope { .. } => &["norm_rope"],
        Op::KvWrite { .. } => &["kv_write"],
        Op::KvWriteBatched => &["kv_write_batched"],
        Op::AttentionBatched { .. } => &["attention_batched"],
        Op::ArgmaxRows => &["argmax_rows"],
        Op::SampleRows => &["sample_rows"],
        Op::KvWriteNormRope { .. } => &["kv_write_norm_rope"],
        Op::Attention { .. } => &["attention"],
        Op::NormRopeAttention { .. } => &["norm_rope_attention"],
        Op::Binary { .. } => &["add", "mul"],
        Op::Unary { .. } => &["scale", "gelu", "softcap", "relu", "silu"],
        Op::GeGlu => &["geglu"],
        Op::TopK { .. } => &["top_k"],
        Op::TopKSoftmax => &["top_k_softmax"],
        Op::WeightedSum => &["weighted_sum"],
        Op::Reshape { .. } => &["reshape"],
        Op::Slice { .. } => &["slice"],
        Op::Argmax => &["argmax"],
        Op::Sample => &["sample"],
        Op::Clamp => &["clamp"],
        Op::Rope2d { .. } => &["rope_2d"],
        Op::FullAttention { .. } => &["full_attention"],
        Op::AvgPool { .. } => &["avg_pool"],
        Op::LayerNorm { .. } => &["layer_norm"],
        Op::Scatter => &["scatter"],
        Op::Conv2d { .. } => &["conv2d"],
        Op::CumulativeGroupNorm { .. } => &["cumulative_group_norm"],
        Op::MaskRows => &["mask_rows"],
        Op::StridedRows { .. } => &["strided_rows"],
        Op::Glu => &["glu"],
        Op::DepthwiseConv1d => &["depthwise_conv1d"],
        Op::AudioAttention { .. } => &["audio_attention"],
    }
}

/// Every name `Op::name` returns, read from its source.
fn op_names_in_source() -> Vec<String> {
    let src = include_str!("../graph/src/ops.rs");
    let start = src.find("pub fn name(&self) -> &'static str").expect("Op::name in ops.rs");
    let body = &src[start..];
    let body = &body[..body.find("\n    }\n").expect("end of Op::name")];
    let mut names: Vec<String> = body.lines().filter_map(|l| l.split("=> \"").nth(1)).map(|s| s.trim_end_matches("\",").to_string()).collect();
    names.sort();
    names.dedup();
    assert!(names.len() >= 28, "read only {} op names from ops.rs", names.len());
    names
}

// ------------------------------------------------------------------ case building

/// What a case's builder sets besides the graph.
struct Ctx {
    b: B,
    positions: Vec<u32>,
    attend_until: Vec<u32>,
    tokens: Vec<u32>,
    sampling: [u32; 8],
    recent: Vec<u32>,
    slot_ids: Vec<u32>,
    row_sampling: Vec<u32>,
    row_recent: Vec<u32>,
    reads: Vec<Read>,
    flops: f64,
    chunked: bool,
    prelude: Option<(Graph, Vec<u32>, Vec<u32>)>,
    /// The dtype of the case's vector weights (norm weights, scales), by turns.
    vec: WeightFormat,
}

struct Cases {
    v: Vec<Case>,
    seed: u64,
}

impl Cases {
    /// Adds a case of op `op` over `t` tokens: `f` builds the op (and its producers) and
    /// returns its node and an f32 value of the graph (for the executor's `logits`).
    fn add(&mut self, op: &'static str, desc: String, t: usize, check: Check, f: impl FnOnce(&mut Ctx) -> (NodeIndex, NodeIndex)) {
        let i = self.v.len();
        let seed = self.seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut b = B::new(&format!("c{i}"), seed, t);
        let tokens = (0..t).map(|_| b.rng.gen_range(0..VOCAB as u32)).collect();
        let mut cx = Ctx {
            b,
            positions: (0..t as u32).collect(),
            attend_until: vec![],
            tokens,
            sampling: [0; 8],
            recent: vec![],
            slot_ids: vec![],
            row_sampling: vec![],
            row_recent: vec![],
            reads: vec![Read::Out],
            flops: 0.0,
            chunked: false,
            prelude: None,
            vec: [BF16, F16, F32][i % 3],
        };
        let (node, aux) = f(&mut cx);
        let got = cx.b.g.node(node).op().map(|o| o.name());
        assert_eq!(got, Some(op), "case {i} ({desc}) tests {got:?}");
        let vec = cx.vec;
        let (graph, weights) = cx.b.finish(node, aux);
        let desc = if graph.inputs(node).iter().any(|&i| graph.node(i).weight().is_some_and(|p| !p.module && p.format == vec)) {
            format!("{desc} vectors {}", fmt_name(vec))
        } else {
            desc
        };
        let desc = if cx.chunked {
            // the op's matrices, as the chunked device holds them
            let g = &graph;
            let names: Vec<&str> = g.inputs(node).iter().filter_map(|&i| g.node(i).weight().filter(|p| p.module).map(|p| p.name.as_str())).collect();
            let chunks: Vec<usize> = weights.iter().filter(|w| names.contains(&w.param.name.as_str())).map(ops_harness::chunk_count).collect();
            assert!(chunks.iter().any(|&n| n >= 2), "case {i} ({desc}): chunked, but its matrices take {chunks:?} chunks");
            format!("{desc} chunks {chunks:?}")
        } else {
            desc
        };
        self.v.push(Case {
            op,
            desc,
            seed,
            prelude: cx.prelude,
            graph,
            node,
            weights,
            tokens: cx.tokens,
            positions: cx.positions,
            attend_until: cx.attend_until,
            sampling: cx.sampling,
            recent: cx.recent,
            slot_ids: cx.slot_ids,
            row_sampling: cx.row_sampling,
            row_recent: cx.row_recent,
            check,
            reads: cx.reads,
            chunked: cx.chunked,
            flops: cx.flops,
        });
    }
}

/// A prelude graph writing random rows at positions `0..t0` into the k and v caches of layer
/// `layer` (`[slots, nkv, d]`), run before the case's graph.
fn fill_caches(cx: &mut Ctx, layer: usize, t0: usize, (slots, nkv, d): (usize, usize, usize)) {
    let mut b = B::new(&format!("{}.prelude{layer}", cx.b.tag), cx.b.rng.gen(), t0);
    let mut last = None;
    let mut aux = None;
    for value in [false, true] {
        let x = b.act(&[t0, nkv, d], 1.5);
        let c = b.cache(layer, value, &[slots, nkv, d]);
        last = Some(b.op(Op::KvWrite { heads: None }, &[x, b.positions, c]));
        aux = Some(x);
    }
    let tokens: Vec<u32> = (0..t0).map(|_| b.rng.gen_range(0..VOCAB as u32)).collect();
    let (g, w) = b.finish(last.unwrap(), aux.unwrap());
    cx.b.weights.extend(w);
    cx.prelude = Some((g, tokens, (0..t0 as u32).collect()));
}

const BF16: WeightFormat = WeightFormat::Float { dtype: FloatType::Bf16 };
const F16: WeightFormat = WeightFormat::Float { dtype: FloatType::F16 };
const F32: WeightFormat = WeightFormat::Float { dtype: FloatType::F32 };

/// The matrix formats under test, each with a row length valid for it and off the 64-wide
/// tiles where the format allows.
fn matrix_formats() -> Vec<(WeightFormat, usize)> {
    vec![
        (BF16, 45),
        (F16, 77),
        (F32, 45),
        (quant(QuantMode::Affine, 4, 64, false), 320),
        (quant(QuantMode::Affine, 8, 32, false), 224),
        (quant(QuantMode::Affine, 3, 64, false), 192),
        (quant(QuantMode::Mxfp4, 4, 32, false), 224),
        (quant(QuantMode::Mxfp8, 8, 32, false), 96),
        (quant(QuantMode::Nvfp4, 4, 16, false), 208),
        (quant(QuantMode::Nvfp4, 4, 16, true), 208),
    ]
}

fn fmt_name(f: WeightFormat) -> String {
    f.describe().replace(' ', "")
}

fn norm_kind(s: NormScale) -> &'static str {
    if s == NormScale::OnePlusW {
        "norm0"
    } else {
        "norm"
    }
}

/// The norm weight of a norm op of convention `s` over `d` (none for `NormScale::None`).
fn norm_weight(b: &mut B, s: NormScale, d: usize, dtype: WeightFormat) -> Vec<NodeIndex> {
    if s == NormScale::None {
        vec![]
    } else {
        vec![b.weight(norm_kind(s), &[d], dtype, false)]
    }
}

// ------------------------------------------------------------------ the cases

fn data_movement(cs: &mut Cases) {
    // embed: float and quantized tables, clamp, one token and several, chunked tables
    for (fmt, d) in matrix_formats().into_iter().filter(|(f, _)| *f != quant(QuantMode::Nvfp4, 4, 16, true)) {
        for (t, clamp, chunked) in [(5, None, false), (1, Some(40u32), false), (7, Some(40), true)] {
            let desc = format!("{} [V={VOCAB}, D={d}] T={t} clamp={clamp:?}", fmt_name(fmt));
            cs.add("embed", desc, t, EXACT, |cx| {
                let table = cx.b.weight("table", &[VOCAB, d], fmt, true);
                if clamp.is_some() {
                    // ids at and above the clamp read row 0
                    cx.tokens = (0..t as u32).map(|i| [3, 40, 60, 12, 41, 0, 59][i as usize % 7]).collect();
                }
                cx.chunked = chunked;
                let e = cx.b.op(Op::Embed { scale: 1.7, clamp }, &[cx.b.tokens, table]);
                (e, e)
            });
        }
    }
    // reshape (a view), slice on every axis
    cs.add("reshape", "f32[5, 3, 15] from [5, 45]".into(), 5, EXACT, |cx| {
        let x = cx.b.act(&[5, 45], 1.0);
        let r = cx.b.op(Op::Reshape { shape: vec![5, 3, 15] }, &[x]);
        (r, x)
    });
    for (axis, start, len) in [(0usize, 1usize, 3usize), (1, 2, 3), (2, 5, 9), (2, 0, 1)] {
        cs.add("slice", format!("f32[6, 5, 19] axis {axis} [{start}, {})", start + len), 6, EXACT, |cx| {
            let x = cx.b.act(&[6, 5, 19], 1.0);
            (cx.b.op(Op::Slice { axis, start, len }, &[x]), x)
        });
    }
    // kv_write: all heads and a head range, a ring of slots, one token and several
    for (t, heads, pos0, slots) in [(5usize, None, 0u32, 8usize), (1, Some(HeadRange { start: 2, count: 2 }), 37, 16), (4, Some(HeadRange { start: 0, count: 2 }), 13, 6)] {
        let xh = if heads.is_some() { 5 } else { 2 };
        cs.add("kv_write", format!("x f32[{t}, {xh}, 24] heads {heads:?} cache [{slots}, 2, 24] pos {pos0}.."), t, EXACT, |cx| {
            let x = cx.b.act(&[t, xh, 24], 1.0);
            let c = cx.b.cache(0, false, &[slots, 2, 24]);
            cx.positions = (pos0..pos0 + t as u32).collect();
            cx.reads = vec![Read::State(StateKind::KvCache { layer: 0, value: false })];
            (cx.b.op(Op::KvWrite { heads }, &[x, cx.b.positions, c]), x)
        });
    }
}

fn elementwise(cs: &mut Cases) {
    for f in [BinaryOp::Add, BinaryOp::Mul] {
        let name = if f == BinaryOp::Add { "add" } else { "mul" };
        // same shape, a suffix broadcast of a value, weight operands ([D] and [1]) in each float dtype
        cs.add(name, "f32[5, 45] + f32[5, 45]".into(), 5, ELEMENTWISE, |cx| {
            let a = cx.b.act(&[5, 45], 2.0);
            let b = cx.b.act(&[5, 45], 2.0);
            (cx.b.op(Op::Binary { f }, &[a, b]), a)
        });
        cs.add(name, "f32[3, 7, 13] + f32[7, 13] (a value)".into(), 3, ELEMENTWISE, |cx| {
            let a = cx.b.act(&[3, 7, 13], 2.0);
            let b = cx.b.act(&[3, 7, 13], 2.0);
            let b0 = cx.b.op(Op::Slice { axis: 0, start: 1, len: 1 }, &[b]);
            let b0 = cx.b.op(Op::Reshape { shape: vec![7, 13] }, &[b0]);
            (cx.b.op(Op::Binary { f }, &[a, b0]), a)
        });
        for (dt, shape) in [(BF16, vec![45usize]), (F16, vec![45]), (F32, vec![45]), (BF16, vec![1])] {
            cs.add(name, format!("f32[5, 45] with weight {}{shape:?}", fmt_name(dt)), 5, ELEMENTWISE, |cx| {
                let a = cx.b.act(&[5, 45], 2.0);
                let w = cx.b.weight("vec", &shape, dt, false);
                (cx.b.op(Op::Binary { f }, &[a, w]), a)
            });
        }
    }
    for (name, f) in [
        ("scale", UnaryOp::Scale { factor: -0.37 }),
        ("gelu", UnaryOp::Gelu),
        ("softcap", UnaryOp::Softcap { cap: 3.0 }),
        ("relu", UnaryOp::Relu),
        ("silu", UnaryOp::Silu),
    ] {
        for (t, d, amp) in [(1usize, 1usize, 3.0f32), (7, 45, 3.0), (2, 1031, 3.0), (3, 45, 1e-3)] {
            let check = match f {
                UnaryOp::Scale { .. } | UnaryOp::Relu => ELEMENTWISE,
                _ if amp < 0.1 => NEAR_ZERO,
                _ => TRANSCENDENTAL,
            };
            cs.add(name, format!("f32[{t}, {d}] in ±{amp} {f:?}"), t, check, |cx| {
                let x = cx.b.act(&[t, d], amp);
                (cx.b.op(Op::Unary { f }, &[x]), x)
            });
        }
    }
    for (t, d) in [(1usize, 37usize), (5, 45)] {
        cs.add("geglu", format!("f32[{t}, {d}]"), t, TRANSCENDENTAL, |cx| {
            let g = cx.b.act(&[t, d], 4.0);
            let u = cx.b.act(&[t, d], 2.0);
            (cx.b.op(Op::GeGlu, &[g, u]), g)
        });
    }
}

fn norms(cs: &mut Cases) {
    for scale in [NormScale::OnePlusW, NormScale::W, NormScale::None] {
        for (t, d, dt) in [(3usize, 45usize, BF16), (1, 640, F32), (2, 4500, F16)] {
            cs.add("rms_norm", format!("f32[{t}, {d}] {scale:?} weight {}", fmt_name(dt)), t, NORM, |cx| {
                let x = cx.b.act(&[t, d], 3.0);
                let mut ins = vec![x];
                ins.extend(norm_weight(&mut cx.b, scale, d, dt));
                (cx.b.op(Op::RmsNorm { eps: 1e-6, scale }, &ins), x)
            });
        }
    }
    for (scale, scaled, t, d) in [(NormScale::OnePlusW, false, 4usize, 45usize), (NormScale::W, true, 1, 1152), (NormScale::None, true, 3, 77)] {
        cs.add("rms_norm_add", format!("f32[{t}, {d}] {scale:?} scaled={scaled}"), t, NORM, |cx| {
            let x = cx.b.act(&[t, d], 3.0);
            let r = cx.b.act(&[t, d], 1.0);
            let mut ins = vec![x, r];
            ins.extend(norm_weight(&mut cx.b, scale, d, cx.vec));
            if scaled {
                ins.push(cx.b.weight("scalar", &[1], cx.vec, false));
            }
            (cx.b.op(Op::RmsNormAdd { eps: 1e-6, scale, scaled }, &ins), x)
        });
    }
}

fn rope(cs: &mut Cases) {
    // full and partial rotation, scaled frequencies, large positions
    for (t, h, d, pairs, theta, factor, pos0) in
        [(3usize, 3usize, 48usize, 24usize, 10_000f32, 1f32, 0u32), (1, 4, 64, 16, 1_000_000.0, 8.0, 4097), (5, 1, 256, 128, 10_000.0, 1.0, 31_000)]
    {
        let desc = format!("f32[{t}, {h}, {d}] pairs={pairs} theta={theta} factor={factor} pos {pos0}..");
        cs.add("rope", desc, t, ROPE, |cx| {
            let x = cx.b.act(&[t, h, d], 2.0);
            cx.positions = (pos0..pos0 + t as u32).collect();
            (cx.b.op(Op::Rope { theta, factor, rotary_pairs: pairs }, &[x, cx.b.positions]), x)
        });
    }
    for (scale, heads, t) in [(NormScale::W, None, 3usize), (NormScale::OnePlusW, Some(HeadRange { start: 1, count: 3 }), 1), (NormScale::None, Some(HeadRange { start: 4, count: 1 }), 2)] {
        let (xh, d) = (5usize, 32usize);
        cs.add("norm_rope", format!("f32[{t}, {xh}, {d}] {scale:?} heads {heads:?}"), t, ROPE, |cx| {
            let x = cx.b.act(&[t, xh, d], 2.0);
            cx.positions = (100..100 + t as u32).collect();
            let mut ins = vec![x, cx.b.positions];
            ins.extend(norm_weight(&mut cx.b, scale, d, cx.vec));
            let op = Op::NormRope { eps: 1e-6, scale, theta: 10_000.0, factor: 1.0, rotary_pairs: d / 2, heads };
            (cx.b.op(op, &ins), x)
        });
    }
    for (scale, heads, t, slots, pos0) in [(NormScale::W, Some(HeadRange { start: 4, count: 2 }), 1usize, 12usize, 29u32), (NormScale::OnePlusW, None, 3, 8, 5)] {
        let (xh, d) = (if heads.is_some() { 8 } else { 2 }, 64usize);
        cs.add("kv_write_norm_rope", format!("x f32[{t}, {xh}, {d}] {scale:?} heads {heads:?} cache [{slots}, 2, {d}] pos {pos0}.."), t, ROPE, |cx| {
            let x = cx.b.act(&[t, xh, d], 2.0);
            cx.positions = (pos0..pos0 + t as u32).collect();
            let mut ins = vec![x, cx.b.positions];
            ins.extend(norm_weight(&mut cx.b, scale, d, cx.vec));
            ins.push(cx.b.cache(0, false, &[slots, 2, d]));
            cx.reads = vec![Read::State(StateKind::KvCache { layer: 0, value: false })];
            let op = Op::KvWriteNormRope { eps: 1e-6, scale, theta: 10_000.0, factor: 1.0, rotary_pairs: d / 4, heads };
            (cx.b.op(op, &ins), x)
        });
    }
}

/// Positions `pos0..pos0 + t` and the attention bounds input where tokens `span` (indices of
/// the step) see each other: the bounds node.
fn span_bounds(cx: &mut Ctx, pos0: u32, t: usize, span: std::ops::Range<usize>) -> NodeIndex {
    cx.positions = (pos0..pos0 + t as u32).collect();
    cx.attend_until = (0..t).map(|i| pos0 + if span.contains(&i) { span.end as u32 - 1 } else { i as u32 }).collect();
    cx.b.g.input("attn_positions", InputKind::AttnPositions, TensorType::u32(&[2, t]))
}

fn attention(cs: &mut Cases) {
    // prefill and decode, causal and windowed, GQA, a ring of slots, split decode; attention
    // bounds (Gemma 3's image spans: tokens `span` of the step see the whole span), causal and
    // windowed (the window shorter than the span), odd head dims and counts
    for (t, nq, nkv, d, slots, window, pos0, span) in [
        (4usize, 4usize, 2usize, 32usize, 16usize, None, 3u32, None),
        (1, 4, 1, 64, 96, None, 90, None),
        (1, 2, 2, 32, 8, Some(8usize), 20, None),
        (5, 6, 3, 48, 12, Some(7), 9, None),
        // Gemma's head dims: 256 (split decode), 512 (the largest the kernel takes)
        (1, 2, 1, 256, 40, None, 39, None),
        (3, 2, 1, 512, 8, None, 5, None),
        (7, 4, 2, 40, 24, None, 5, Some(1..5usize)),
        (9, 3, 1, 36, 16, Some(4), 11, Some(2..8)),
        (5, 2, 2, 32, 8, None, 0, Some(0..5)),
    ] {
        let desc = format!("q f32[{t}, {nq}, {d}] kv [{slots}, {nkv}, {d}] window {window:?} pos {pos0}.. span {span:?}");
        cs.add("attention", desc, t, ATTENTION, |cx| {
            fill_caches(cx, 0, slots, (slots, nkv, d));
            let q = cx.b.act(&[t, nq, d], 1.0);
            let k = cx.b.cache(0, false, &[slots, nkv, d]);
            let v = cx.b.cache(0, true, &[slots, nkv, d]);
            cx.positions = (pos0..pos0 + t as u32).collect();
            let pos = match span {
                Some(span) => span_bounds(cx, pos0, t, span),
                None => cx.b.positions,
            };
            (cx.b.op(Op::Attention { scale: 1.0 / (d as f32).sqrt(), window }, &[q, pos, k, v]), q)
        });
    }
    // the fused q norm + RoPE + attention, and its appending one-token form
    for (t, heads, append, norm, window) in [
        (3usize, None, false, NormScale::W, None),
        (6, Some(HeadRange { start: 1, count: 4 }), false, NormScale::OnePlusW, Some(3)),
        (1, Some(HeadRange { start: 0, count: 4 }), false, NormScale::OnePlusW, Some(6usize)),
        (1, Some(HeadRange { start: 0, count: 4 }), true, NormScale::W, None),
        (1, Some(HeadRange { start: 0, count: 4 }), true, NormScale::None, Some(5)),
    ] {
        let (nq, nkv, d, slots, pos0) = (4usize, 2usize, 32usize, 40usize, 33u32);
        let xh = if append { nq + 2 * nkv } else if heads.is_some() { nq + 1 } else { nq };
        let desc = format!("x f32[{t}, {xh}, {d}] heads {heads:?} append={append} {norm:?} window {window:?} kv [{slots}, {nkv}, {d}]");
        cs.add("norm_rope_attention", desc, t, ATTENTION, |cx| {
            fill_caches(cx, 0, pos0 as usize, (slots, nkv, d));
            let x = cx.b.act(&[t, xh, d], 2.0);
            let k = cx.b.cache(0, false, &[slots, nkv, d]);
            let v = cx.b.cache(0, true, &[slots, nkv, d]);
            // six tokens: tokens 1..5 an image span (attention bounds), the window shorter
            let pos = if t == 6 { span_bounds(cx, pos0, t, 1..5) } else { cx.b.positions };
            cx.positions = (pos0..pos0 + t as u32).collect();
            let mut ins = vec![x, pos, k, v];
            let nw = if append { 2 } else { 1 };
            for _ in 0..nw {
                ins.extend(norm_weight(&mut cx.b, norm, d, cx.vec));
            }
            if append {
                // the step's key and value rows written into the caches, too
                cx.reads.extend([false, true].map(|value| Read::State(StateKind::KvCache { layer: 0, value })));
            }
            let append = append.then_some(KvAppend { k: HeadRange { start: nq, count: nkv }, v: HeadRange { start: nq + nkv, count: nkv } });
            let op = Op::NormRopeAttention {
                scale: 1.0 / (d as f32).sqrt(),
                window,
                eps: 1e-6,
                norm,
                theta: 10_000.0,
                factor: 1.0,
                rotary_pairs: d / 2,
                heads,
                append,
            };
            (cx.b.op(op, &ins), x)
        });
    }
}

fn matmuls(cs: &mut Cases) {
    // every format: one token (GEMV), a few (multi-token GEMV), 13 (GEMM); chunked for some
    for (fmt, k) in matrix_formats() {
        for (t, n, chunked) in [(1usize, 37usize, false), (5, 29, false), (13, 70, false), (1, 45, true), (9, 45, true)] {
            if chunked && !matches!(fmt, WeightFormat::Quantized { .. }) && fmt != BF16 {
                continue;
            }
            matmul(cs, "", fmt, (t, n, k), chunked);
        }
    }
    // a GEMM split over K (few tiles, long rows) and one of several tiles each way
    for (t, n, k) in [(11usize, 45usize, 1024usize), (70, 131, 320)] {
        matmul(cs, "", quant(QuantMode::Affine, 4, 64, false), (t, n, k), false);
    }
    // one-token fused norm + matmul: one weight, and q/k/v side by side
    let fmts = [(BF16, 45usize), (quant(QuantMode::Affine, 4, 64, false), 320), (quant(QuantMode::Affine, 8, 32, false), 224), (quant(QuantMode::Mxfp4, 4, 32, false), 224), (quant(QuantMode::Nvfp4, 4, 16, false), 208)];
    for (fmt, k) in fmts {
        for (ns, scale, chunked) in [(vec![37usize], NormScale::W, false), (vec![32, 16, 16], NormScale::OnePlusW, false), (vec![41, 11], NormScale::None, true)] {
            cs.add("norm_matmul", format!("{} x f32[1, {k}] w {ns:?} x {k} {scale:?}", fmt_name(fmt)), 1, MATMUL, |cx| {
                let x = cx.b.act(&[1, k], 3.0);
                let mut ins = vec![x];
                ins.extend(norm_weight(&mut cx.b, scale, k, cx.vec));
                for &n in &ns {
                    ins.push(cx.b.weight("w", &[n, k], fmt, true));
                }
                cx.chunked = chunked;
                cx.flops = 2.0 * (ns.iter().sum::<usize>() * k) as f64;
                (cx.b.op(Op::NormMatMul { eps: 1e-6, scale }, &ins), x)
            });
        }
        for (scale, chunked) in [(NormScale::W, false), (NormScale::OnePlusW, true)] {
            let n = 37;
            cs.add("norm_geglu", format!("{} x f32[1, {k}] w 2 x [{n}, {k}] {scale:?}", fmt_name(fmt)), 1, MATMUL, |cx| {
                let x = cx.b.act(&[1, k], 3.0);
                let mut ins = vec![x];
                ins.extend(norm_weight(&mut cx.b, scale, k, cx.vec));
                ins.push(cx.b.weight("wg", &[n, k], fmt, true));
                ins.push(cx.b.weight("wu", &[n, k], fmt, true));
                cx.chunked = chunked;
                cx.flops = 4.0 * (n * k) as f64;
                (cx.b.op(Op::NormGeGlu { eps: 1e-6, scale }, &ins), x)
            });
        }
    }
}

fn routing(cs: &mut Cases) {
    for (t, e, k) in [(1usize, 8usize, 2usize), (6, 37, 4), (3, 129, 8)] {
        cs.add("top_k", format!("logits f32[{t}, {e}] k={k}"), t, Check::Exact, |cx| {
            let l = cx.b.logits(e, 3.0);
            (cx.b.op(Op::TopK { k }, &[l]), l)
        });
        for scaled in [false, true] {
            cs.add("top_k_softmax", format!("logits f32[{t}, {e}] k={k} scale={scaled}"), t, NORM, |cx| {
                let l = cx.b.logits(e, 3.0);
                let ids = cx.b.op(Op::TopK { k }, &[l]);
                let mut ins = vec![l, ids];
                if scaled {
                    ins.push(cx.b.weight("scale", &[e], cx.vec, false));
                }
                (cx.b.op(Op::TopKSoftmax, &ins), l)
            });
        }
    }
    for (t, s, e) in [(6usize, 2usize, 7usize), (13, 3, 5), (1, 4, 16)] {
        cs.add("moe_group", format!("ids u32[{t}, {s}] experts={e}"), t, Check::Exact, |cx| {
            let l = cx.b.logits(e, 3.0);
            let ids = cx.b.op(Op::TopK { k: s }, &[l]);
            (cx.b.op(Op::MoeGroup { experts: e }, &[ids]), l)
        });
    }
    for (t, s, d) in [(1usize, 4usize, 45usize), (5, 2, 77)] {
        cs.add("weighted_sum", format!("x f32[{t}, {s}, {d}] w f32[{t}, {s}]"), t, NORM, |cx| {
            let x = cx.b.act(&[t, s, d], 2.0);
            let w = cx.b.act(&[t, s], 1.0);
            (cx.b.op(Op::WeightedSum, &[x, w]), w)
        });
    }
    // expert matmuls: gathered (x per token or per slot), grouped by expert
    let fmts = [(BF16, 45usize), (quant(QuantMode::Affine, 4, 64, false), 320), (quant(QuantMode::Mxfp4, 4, 32, false), 224), (quant(QuantMode::Nvfp4, 4, 16, true), 208)];
    for (fmt, k) in fmts {
        for (t, s, per_slot, grouped, chunked) in [(1usize, 2usize, false, false, false), (3, 2, true, false, true), (9, 2, false, true, false), (10, 3, true, true, true)] {
            expert_matmul(cs, "", fmt, (5, 19, k), (t, s), per_slot, grouped, chunked);
        }
    }
}

/// A gathered (or, `grouped`, grouped by expert) matmul of `t` tokens routed to `s` of the
/// `e` experts `[n, k]` of format `fmt`; x per token, or per slot.
#[allow(clippy::too_many_arguments)]
fn expert_matmul(cs: &mut Cases, prefix: &str, fmt: WeightFormat, (e, n, k): (usize, usize, usize), (t, s): (usize, usize), per_slot: bool, grouped: bool, chunked: bool) {
    let op = if grouped { "grouped_matmul" } else { "gather_matmul" };
    let desc = format!("{prefix}{} x f32[{t}{}, {k}] ids [{t}, {s}] w [{e}, {n}, {k}]", fmt_name(fmt), if per_slot { format!(", {s}") } else { String::new() });
    cs.add(op, desc, t, MATMUL, |cx| {
        let l = cx.b.logits(e, 3.0);
        let ids = cx.b.op(Op::TopK { k: s }, &[l]);
        let x = if per_slot { cx.b.act(&[t, s, k], 1.0) } else { cx.b.act(&[t, k], 1.0) };
        let w = cx.b.weight("experts", &[e, n, k], fmt, true);
        cx.chunked = chunked;
        cx.flops = 2.0 * (t * s * n * k) as f64;
        if grouped {
            let groups = cx.b.op(Op::MoeGroup { experts: e }, &[ids]);
            (cx.b.op(Op::GroupedMatMul, &[x, ids, w, groups]), l)
        } else {
            (cx.b.op(Op::GatherMatMul, &[x, ids, w]), l)
        }
    });
}

/// A matmul of `t` tokens by a weight `[n, k]` of format `fmt`.
fn matmul(cs: &mut Cases, prefix: &str, fmt: WeightFormat, (t, n, k): (usize, usize, usize), chunked: bool) {
    cs.add("matmul", format!("{prefix}{} x f32[{t}, {k}] w [{n}, {k}]", fmt_name(fmt)), t, MATMUL, |cx| {
        let x = cx.b.act(&[t, k], 1.0);
        let w = cx.b.weight("w", &[n, k], fmt, true);
        cx.chunked = chunked;
        cx.flops = 2.0 * (t * n * k) as f64;
        (cx.b.op(Op::MatMul, &[x, w]), x)
    });
}

fn sampling(cs: &mut Cases) {
    for (t, v) in [(1usize, 999usize), (3, 4099)] {
        cs.add("argmax", format!("logits f32[{t}, {v}]"), t, Check::Exact, |cx| {
            let l = cx.b.logits(v, 4.0);
            (cx.b.op(Op::Argmax, &[l]), l)
        });
    }
    // where the CPU and the GPU are defined to agree: greedy (with and without a repetition
    // penalty) and a seeded draw that keeps one token (top_k = 1)
    let base = SampleParams::default();
    for (t, v, sp, what) in [
        (1usize, 999usize, SampleParams { temperature: 0.0, ..base }, "greedy"),
        (2, 4099, SampleParams { temperature: 0.0, repetition_penalty: 1.5, ..base }, "greedy, penalty 1.5"),
        (1, 1000, SampleParams { temperature: 1.0, top_k: 1, seed: 1234, repetition_penalty: 1.3, ..base }, "t=1 top_k=1 seeded, penalty 1.3"),
    ] {
        cs.add("sample", format!("logits f32[{t}, {v}] {what}"), t, Check::Exact, |cx| {
            let l = cx.b.logits(v, 4.0);
            let p = cx.b.g.input("sampling", InputKind::SamplingParams, TensorType::u32(&[SAMPLE_PARAMS]));
            let r = cx.b.g.input("recent", InputKind::RecentTokens, TensorType::u32(&[16]));
            // the recent tokens include the top ones of the rows, so that the penalty matters
            let n_recent = if sp.repetition_penalty != 1.0 { 12 } else { 0 };
            cx.sampling = sp.words(0, n_recent);
            cx.recent = (0..16).map(|i| (i * 83 + 7) % v as u32).collect();
            (cx.b.op(Op::Sample, &[l, p, r]), l)
        });
    }
}

/// The ops of a batch of sequences over one cache of sequence slots `[N, S, nkv, D]`: rows of
/// several slots (rings of S positions), idle rows (slot `IDLE`), windows, GQA.
fn batched(cs: &mut Cases) {
    const IDLE: u32 = u32::MAX;
    // the caches filled first through their flat layout ([N * S, nkv, D]: the same rows)
    let fill = |cx: &mut Ctx, (n, s, nkv, d): (usize, usize, usize, usize)| fill_caches(cx, 0, n * s, (n * s, nkv, d));
    for (slots, pos, (n, s, nkv, d)) in [
        (vec![2u32, 0, IDLE, 2, 1], vec![9u32, 0, 4, 3, 13], (3usize, 7usize, 2usize, 24usize)),
        (vec![1], vec![37], (2, 16, 1, 40)),
    ] {
        let t = slots.len();
        cs.add("kv_write_batched", format!("x f32[{t}, {nkv}, {d}] cache [{n}, {s}, {nkv}, {d}] slots {slots:?} pos {pos:?}"), t, EXACT, |cx| {
            fill(cx, (n, s, nkv, d));
            let x = cx.b.act(&[t, nkv, d], 1.0);
            let c = cx.b.cache(0, false, &[n, s, nkv, d]);
            let sl = cx.b.g.input("slot_ids", InputKind::SlotIds, TensorType::u32(&[t]));
            (cx.positions, cx.slot_ids) = (pos, slots);
            cx.reads = vec![Read::State(StateKind::KvCache { layer: 0, value: false })];
            (cx.b.op(Op::KvWriteBatched, &[x, cx.b.positions, sl, c]), x)
        });
    }
    for (slots, pos, (n, s, nq, nkv, d), window) in [
        (vec![1u32, IDLE, 0, 1], vec![10u32, 5, 3, 0], (3usize, 11usize, 6usize, 2usize, 40usize), None),
        (vec![0, 2, 1], vec![20, 6, 13], (3, 7, 4, 1, 24), Some(5usize)),
        (vec![1, 0], vec![299, 150], (2, 300, 2, 2, 256), Some(200)),
    ] {
        let t = slots.len();
        let desc = format!("q f32[{t}, {nq}, {d}] kv [{n}, {s}, {nkv}, {d}] slots {slots:?} pos {pos:?} window {window:?}");
        cs.add("attention_batched", desc, t, ATTENTION, |cx| {
            fill(cx, (n, s, nkv, d));
            let q = cx.b.act(&[t, nq, d], 1.0);
            let (kc, vc) = (cx.b.cache(0, false, &[n, s, nkv, d]), cx.b.cache(0, true, &[n, s, nkv, d]));
            let sl = cx.b.g.input("slot_ids", InputKind::SlotIds, TensorType::u32(&[t]));
            (cx.positions, cx.slot_ids) = (pos, slots);
            (cx.b.op(Op::AttentionBatched { scale: 1.0 / (d as f32).sqrt(), window }, &[q, cx.b.positions, sl, kc, vc]), q)
        });
    }
    for (t, v) in [(1usize, 999usize), (5, 4099)] {
        cs.add("argmax_rows", format!("logits f32[{t}, {v}]"), t, Check::Exact, |cx| {
            let l = cx.b.logits(v, 4.0);
            (cx.b.op(Op::ArgmaxRows, &[l]), l)
        });
    }
    // each row its own parameters, where the CPU and the GPU are defined to agree (as `sample`)
    let base = SampleParams::default();
    let rows = [
        SampleParams { temperature: 0.0, ..base },
        SampleParams { temperature: 1.0, top_k: 1, seed: 1234, repetition_penalty: 1.3, ..base },
        SampleParams { temperature: 0.0, repetition_penalty: 1.5, ..base },
    ];
    for (t, v) in [(3usize, 1000usize), (1, 4099)] {
        cs.add("sample_rows", format!("logits f32[{t}, {v}] rows greedy, t=1 top_k=1 seeded penalty 1.3, greedy penalty 1.5"), t, Check::Exact, |cx| {
            let l = cx.b.logits(v, 4.0);
            let p = cx.b.g.input("row_sampling", InputKind::RowSampling, TensorType::u32(&[t, SAMPLE_PARAMS]));
            let r = cx.b.g.input("row_recent", InputKind::RowRecent, TensorType::u32(&[t, 16]));
            for (i, sp) in rows.iter().take(t).enumerate() {
                let n_recent = if sp.repetition_penalty != 1.0 { 10 + i as u32 } else { 0 };
                cx.row_sampling.extend(sp.words(i as u32, n_recent));
                cx.row_recent.extend((0..16).map(|j| (j * 83 + 7 + i as u32 * 5) % v as u32));
            }
            (cx.b.op(Op::SampleRows, &[l, p, r]), l)
        });
    }
}

/// Model-sized cases for the perf mode (Gemma-like widths; checked as the others are).
fn perf_cases(cs: &mut Cases) {
    let q4 = quant(QuantMode::Affine, 4, 64, false);
    for (fmt, t) in [(q4, 1usize), (q4, 128), (BF16, 1), (quant(QuantMode::Mxfp4, 4, 32, false), 1)] {
        matmul(cs, "perf ", fmt, (t, 4096, 4096), false);
    }
    let k = 2560;
    cs.add("norm_matmul", format!("perf {} x f32[1, {k}] q/k/v [2048, 512, 512]", fmt_name(q4)), 1, MATMUL, |cx| {
        let x = cx.b.act(&[1, k], 3.0);
        let mut ins = vec![x, cx.b.weight("norm", &[k], BF16, false)];
        for n in [2048, 512, 512] {
            ins.push(cx.b.weight("w", &[n, k], q4, true));
        }
        cx.flops = 2.0 * (3072 * k) as f64;
        (cx.b.op(Op::NormMatMul { eps: 1e-6, scale: NormScale::W }, &ins), x)
    });
    cs.add("norm_geglu", format!("perf {} x f32[1, {k}] w 2 x [10240, {k}]", fmt_name(q4)), 1, MATMUL, |cx| {
        let x = cx.b.act(&[1, k], 3.0);
        let nw = cx.b.weight("norm", &[k], BF16, false);
        let (g, u) = (cx.b.weight("wg", &[10240, k], q4, true), cx.b.weight("wu", &[10240, k], q4, true));
        cx.flops = 4.0 * (10240 * k) as f64;
        (cx.b.op(Op::NormGeGlu { eps: 1e-6, scale: NormScale::W }, &[x, nw, g, u]), x)
    });
    for (t, grouped) in [(1usize, false), (64, true)] {
        expert_matmul(cs, "perf ", q4, (32, 704, 2816), (t, 8), false, grouped, false);
    }
    for (t, slots) in [(1usize, 4096usize), (64, 512)] {
        let (nq, nkv, d) = (8usize, 2usize, 256usize);
        cs.add("attention", format!("perf q f32[{t}, {nq}, {d}] kv [{slots}, {nkv}, {d}]"), t, ATTENTION, |cx| {
            fill_caches(cx, 0, slots, (slots, nkv, d));
            let q = cx.b.act(&[t, nq, d], 1.0);
            let (kc, vc) = (cx.b.cache(0, false, &[slots, nkv, d]), cx.b.cache(0, true, &[slots, nkv, d]));
            let p0 = slots as u32 - t as u32;
            cx.positions = (p0..p0 + t as u32).collect();
            cx.flops = 4.0 * (t * nq * slots * d) as f64;
            (cx.b.op(Op::Attention { scale: 1.0 / (d as f32).sqrt(), window: None }, &[q, cx.b.positions, kc, vc]), q)
        });
    }
    cs.add("rms_norm", "perf f32[64, 4096] W".into(), 64, NORM, |cx| {
        let x = cx.b.act(&[64, 4096], 3.0);
        let w = cx.b.weight("norm", &[4096], BF16, false);
        (cx.b.op(Op::RmsNorm { eps: 1e-6, scale: NormScale::W }, &[x, w]), x)
    });
    cs.add("embed", format!("perf {} [V={VOCAB}, D=4096] T=64", fmt_name(q4)), 64, EXACT, |cx| {
        let table = cx.b.weight("table", &[VOCAB, 4096], q4, true);
        let e = cx.b.op(Op::Embed { scale: 1.0, clamp: None }, &[cx.b.tokens, table]);
        (e, e)
    });
    let v = 262_144;
    cs.add("argmax", format!("perf logits f32[1, {v}]"), 1, Check::Exact, |cx| {
        let l = cx.b.logits(v, 4.0);
        (cx.b.op(Op::Argmax, &[l]), l)
    });
    cs.add("sample", format!("perf logits f32[1, {v}] t=1 top_k=1"), 1, Check::Exact, |cx| {
        let l = cx.b.logits(v, 4.0);
        let p = cx.b.g.input("sampling", InputKind::SamplingParams, TensorType::u32(&[SAMPLE_PARAMS]));
        let r = cx.b.g.input("recent", InputKind::RecentTokens, TensorType::u32(&[16]));
        cx.sampling = SampleParams { temperature: 1.0, top_k: 1, seed: 7, ..SampleParams::default() }.words(0, 0);
        cx.recent = vec![0; 16];
        (cx.b.op(Op::Sample, &[l, p, r]), l)
    });
    cs.add("rope", "perf f32[64, 8, 256] pairs=128".into(), 64, ROPE, |cx| {
        let x = cx.b.act(&[64, 8, 256], 2.0);
        (cx.b.op(Op::Rope { theta: 10_000.0, factor: 1.0, rotary_pairs: 128 }, &[x, cx.b.positions]), x)
    });
    cs.add("add", "perf f32[64, 4096] + f32[64, 4096]".into(), 64, ELEMENTWISE, |cx| {
        let (a, b) = (cx.b.act(&[64, 4096], 2.0), cx.b.act(&[64, 4096], 2.0));
        (cx.b.op(Op::Binary { f: BinaryOp::Add }, &[a, b]), a)
    });
    audio_cases::audio_perf(cs);
}

/// The vision towers' ops: clamps with scalar bounds of each dtype, 2-D RoPE, bidirectional
/// attention over several key tiles (masked keys, GQA, SigLIP's head dim 72), pooling of
/// patch grids, LayerNorm with and without bias.
fn vision(cs: &mut Cases) {
    for (t, d) in [(3usize, 40usize), (17, 96)] {
        cs.add("clamp", format!("x f32[{t}, {d}] bounds [1]"), t, EXACT, |cx| {
            let x = cx.b.act(&[t, d], 2.0);
            let lo = cx.b.weight("norm0", &[1], cx.vec, false);
            let hi = cx.b.weight("norm", &[1], cx.vec, false);
            (cx.b.op(Op::Clamp, &[x, lo, hi]), x)
        });
    }
    for (t, h, d, theta) in [(5usize, 2usize, 64usize, 100.0f32), (12, 3, 32, 100.0), (7, 1, 72, 10_000.0)] {
        cs.add("rope_2d", format!("x f32[{t}, {h}, {d}] theta {theta}"), t, ROPE, |cx| {
            let x = cx.b.act(&[t, h, d], 1.0);
            // columns: the token ids, rows: the positions
            (cx.b.op(Op::Rope2d { theta }, &[x, cx.b.tokens, cx.b.positions]), x)
        });
    }
    for (t, nq, nkv, d, mask) in [(5usize, 2usize, 2usize, 32usize, false), (70, 4, 2, 72, true), (130, 2, 1, 64, true), (33, 3, 1, 13, true), (9, 2, 2, 256, false)] {
        let desc = format!("q f32[{t}, {nq}, {d}] kv [{t}, {nkv}, {d}] mask {mask}");
        cs.add("full_attention", desc, t, ATTENTION, |cx| {
            let q = cx.b.act(&[t, nq, d], 1.0);
            let k = cx.b.act(&[t, nkv, d], 1.0);
            let v = cx.b.act(&[t, nkv, d], 1.0);
            cx.flops = (4 * t * t * nq * d) as f64;
            let mut ins = vec![q, k, v];
            if mask {
                // keys with token id 0 are padding: every 5th
                for i in (0..t).step_by(5) {
                    cx.tokens[i] = 0;
                }
                ins.push(cx.b.tokens);
            }
            (cx.b.op(Op::FullAttention { scale: 1.0 / (d as f32).sqrt() }, &ins), q)
        });
    }
    // the f16 attention's shapes (`vision_attn_coop.wgsl`, where MARKBASE_COOP names the f16
    // kernels: the FMA twin with `fma`): tokens off its tiles of 64 queries and 32 keys, head dims
    // padded to 16s, grouped kv heads, masks (every 5th key, every key: zeros, all but the last),
    // queries and keys far past f16's range
    for (t, nq, nkv, d, mask, (aq, ak)) in [
        (1usize, 2usize, 2usize, 72usize, 0u8, (1.0f32, 1.0f32)),
        (17, 2, 1, 16, 1, (1.0, 1.0)),
        (100, 4, 2, 80, 1, (1.0, 1.0)),
        (257, 2, 2, 72, 1, (1.0, 1.0)),
        (45, 2, 2, 128, 0, (1.0, 1.0)),
        (33, 3, 1, 40, 2, (1.0, 1.0)),
        (40, 2, 1, 64, 3, (1.0, 1.0)),
        (66, 2, 1, 72, 1, (1e4, 1e-4)),
        (66, 2, 2, 72, 0, (3e4, 3e4)),
    ] {
        let desc = format!("q f32[{t}, {nq}, {d}] kv [{t}, {nkv}, {d}] mask {} |q| {aq:e} |k| {ak:e}", ["none", "5th", "all", "last only"][mask as usize]);
        cs.add("full_attention", desc, t, ATTENTION, |cx| {
            let q = cx.b.act(&[t, nq, d], aq);
            let k = cx.b.act(&[t, nkv, d], ak);
            let v = cx.b.act(&[t, nkv, d], 1.0);
            cx.flops = (4 * t * t * nq * d) as f64;
            let mut ins = vec![q, k, v];
            if mask > 0 {
                // keys with token id 0 are padding
                for i in 0..t {
                    if (mask == 1 && i % 5 == 0) || mask == 2 || (mask == 3 && i + 1 < t) {
                        cx.tokens[i] = 0;
                    }
                }
                ins.push(cx.b.tokens);
            }
            (cx.b.op(Op::FullAttention { scale: 1.0 / (d as f32).sqrt() }, &ins), q)
        });
    }
    for (rows, cols, k, d) in [(6usize, 9usize, 3usize, 40usize), (8, 4, 4, 24), (3, 5, 1, 7)] {
        let t = rows * cols;
        cs.add("avg_pool", format!("grid {rows}x{cols} k {k} x f32[{t}, {d}]"), t, NORM, |cx| {
            let x = cx.b.act(&[t, d], 1.0);
            (cx.b.op(Op::AvgPool { rows, cols, k }, &[x]), x)
        });
    }
    for (t, d) in [(1usize, 16usize), (9, 40)] {
        cs.add("scatter", format!("x f32[{t}, {d}] rows [{t}, {d}]"), t, EXACT, |cx| {
            let x = cx.b.act(&[t, d], 1.0);
            let rows = cx.b.act(&[t, d], 2.0);
            // token t takes row t - 1 of rows, token 0 keeps its own
            (cx.b.op(Op::Scatter, &[x, rows, cx.b.positions]), x)
        });
    }
    for (t, d, bias) in [(3usize, 72usize, true), (1, 1152, true), (6, 5, false)] {
        cs.add("layer_norm", format!("x f32[{t}, {d}] bias {bias}"), t, NORM, |cx| {
            let x = cx.b.act(&[t, d], 3.0);
            let mut ins = vec![x, cx.b.weight("norm", &[d], cx.vec, false)];
            if bias {
                ins.push(cx.b.weight("norm0", &[d], cx.vec, false));
            }
            (cx.b.op(Op::LayerNorm { eps: 1e-6 }, &ins), x)
        });
    }
}

fn all_cases(perf: bool) -> Vec<Case> {
    let mut cs = Cases { v: vec![], seed: ops_harness::base_seed() };
    if perf {
        perf_cases(&mut cs);
    }
    data_movement(&mut cs);
    elementwise(&mut cs);
    norms(&mut cs);
    rope(&mut cs);
    attention(&mut cs);
    matmuls(&mut cs);
    routing(&mut cs);
    sampling(&mut cs);
    batched(&mut cs);
    vision(&mut cs);
    audio_cases::audio(&mut cs);
    cs.v
}

#[test]
fn every_op_matches_the_cpu_reference() {
    let t0 = std::time::Instant::now();
    let seed = ops_harness::base_seed();
    println!("seed {seed} (MARKBASE_TEST_SEED={seed} replays it)");
    let perf = std::env::var("MARKBASE_OPS_PERF").is_ok_and(|v| v == "1");
    let cases = all_cases(perf);
    // every case's op is one of its variant's names
    for c in &cases {
        let op = c.graph.node(c.node).op().unwrap();
        assert!(variant_names(op).contains(&c.op), "{}: not a name of {op:?}", c.op);
    }
    let (outcomes, adapter) = ops_harness::run_all(&cases, perf);
    println!("adapter: {adapter}");
    // per op: cases, worst error relative to its bound
    let mut by_op: BTreeMap<&str, (usize, f64, f64)> = BTreeMap::new();
    for o in &outcomes {
        let e = by_op.entry(o.op).or_insert((0, f64::INFINITY, 0.0));
        e.0 += 1;
        e.1 = e.1.min(o.err);
        e.2 = e.2.max(o.err);
    }
    for (op, (n, lo, hi)) in &by_op {
        println!("{op:<20} {n:>3} cases  error {lo:.1e} .. {hi:.1e}");
    }
    if perf {
        println!("{:<20} {:>10} {:>9} {:>9}  case", "op", "µs", "GB/s", "TFLOP/s");
        for o in &outcomes {
            if let Some((us, how)) = o.perf {
                let tf = if o.flops > 0.0 { format!("{:.4}", o.flops / us * 1e-6) } else { "-".into() };
                println!("{:<20} {us:>10.1} {:>9.2} {tf:>9}  {} ({how}; {})", o.op, o.bytes / us * 1e-3, o.desc, o.kernels.join(", "));
            }
        }
    }
    let mut kernels: Vec<&str> = outcomes.iter().flat_map(|o| o.kernels.iter().map(|k| k.as_str())).collect();
    kernels.sort_unstable();
    kernels.dedup();
    println!("{} distinct kernels ran: {}", kernels.len(), kernels.join(" "));
    let failures: Vec<String> =
        outcomes.iter().filter_map(|o| o.failure.as_ref().map(|f| format!("{} [{}]: {f}", o.op, o.desc))).collect();
    println!("{} cases, {} failed, {:.1} s", outcomes.len(), failures.len(), t0.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "{} of {} cases failed (seed {seed}):\n{}", failures.len(), outcomes.len(), failures.join("\n"));
    // coverage: every op name of ops.rs has a case that ran (unless a filter chose a subset)
    if std::env::var("MARKBASE_OPS_FILTER").map_or(true, |f| f.is_empty()) {
        // (ops the GPU does not lower yet have no case)
        let cpu_only = markbase::gpu::ops::CPU_ONLY_OPS;
        let missing: Vec<String> =
            op_names_in_source().into_iter().filter(|n| !by_op.contains_key(n.as_str()) && !cpu_only.contains(&n.as_str())).collect();
        assert!(missing.is_empty(), "ops without a case: {missing:?}");
    }
}
