//! The fixture comparisons catch the classic Gemma bugs: each bug is planted in the
//! built graphs (op attributes rewritten before compilation) of the smallest fixture
//! of each family, and the CPU reference's comparison with mlx-lm must then fail.

mod common;

use std::cell::Cell;

use markbase::graph::ir::{Graph, NodeKind};
use markbase::graph::ops::{NormScale, Op, TensorType};
use markbase::model::DeviceKind;

/// A planted bug.
#[derive(Clone, Copy, Debug)]
enum Bug {
    /// The token embedding's scale replaced by `f(scale, hidden_size)`.
    EmbedScale(fn(f32, usize) -> f32),
    /// Every attention's scale replaced by `f(scale, head_dim)`.
    AttnScale(fn(f32, usize) -> f32),
    /// Every norm's `1 + w` convention swapped with `w`.
    NormSwap,
    /// Every RoPE base `from` replaced by `to`.
    RopeBase { from: f32, to: f32 },
}

fn set(x: &mut f32, v: f32) -> bool {
    let changed = *x != v;
    *x = v;
    changed
}

fn swap_norm(s: &mut NormScale) -> bool {
    *s = match *s {
        NormScale::OnePlusW => NormScale::W,
        NormScale::W => NormScale::OnePlusW,
        NormScale::None => return false,
    };
    true
}

impl Bug {
    fn norm(self, s: &mut NormScale) -> bool {
        matches!(self, Bug::NormSwap) && swap_norm(s)
    }
    fn theta(self, theta: &mut f32) -> bool {
        match self {
            Bug::RopeBase { from, to } if *theta == from => set(theta, to),
            _ => false,
        }
    }
    fn attn(self, scale: &mut f32, ty: &TensorType) -> bool {
        match self {
            Bug::AttnScale(f) => set(scale, f(*scale, ty.last())),
            _ => false,
        }
    }

    /// Plants the bug in one op producing `ty`; whether the op changed. Every variant is
    /// listed, so that a new op carrying one of these attributes cannot be missed.
    fn plant(self, op: &mut Op, ty: &TensorType, hidden: usize) -> bool {
        match op {
            Op::Embed { scale, .. } => match self {
                Bug::EmbedScale(f) if ty.last() == hidden => set(scale, f(*scale, hidden)),
                _ => false,
            },
            Op::RmsNorm { scale, .. } | Op::RmsNormAdd { scale, .. } | Op::NormMatMul { scale, .. } | Op::NormGeGlu { scale, .. } => {
                self.norm(scale)
            }
            Op::Rope { theta, .. } | Op::Rope2d { theta } => self.theta(theta),
            Op::NormRope { scale, theta, .. } | Op::KvWriteNormRope { scale, theta, .. } => self.norm(scale) | self.theta(theta),
            Op::Attention { scale, .. } | Op::AttentionBatched { scale, .. } | Op::FullAttention { scale } => self.attn(scale, ty),
            Op::NormRopeAttention { scale, norm, theta, .. } => self.attn(scale, ty) | self.norm(norm) | self.theta(theta),
            Op::MatMul
            | Op::GatherMatMul
            | Op::MoeGroup { .. }
            | Op::GroupedMatMul
            | Op::KvWrite { .. }
            | Op::KvWriteBatched
            | Op::ArgmaxRows
            | Op::SampleRows
            | Op::Binary { .. }
            | Op::Unary { .. }
            | Op::GeGlu
            | Op::TopK { .. }
            | Op::TopKSoftmax
            | Op::WeightedSum
            | Op::Reshape { .. }
            | Op::Slice { .. }
            | Op::Argmax
            | Op::Sample
            | Op::Clamp
            | Op::AvgPool { .. }
            | Op::LayerNorm { .. }
            | Op::Scatter
            | Op::Conv2d { .. }
            | Op::CumulativeGroupNorm { .. }
            | Op::MaskRows
            | Op::StridedRows { .. }
            | Op::Glu
            | Op::DepthwiseConv1d
            | Op::AudioAttention { .. } => false,
        }
    }

    /// Plants the bug in every op of `g`; the number of ops changed.
    fn apply(self, g: &mut Graph, hidden: usize) -> usize {
        let mut changed = 0;
        for n in g.op_nodes().collect::<Vec<_>>() {
            let node = &mut g.g[n];
            if let NodeKind::Op { op } = &mut node.kind {
                changed += self.plant(op, &node.ty, hidden) as usize;
            }
        }
        changed
    }
}

/// Runs the fixture comparison of `name` on the CPU reference with `bug` planted in every
/// graph and expects it to fail; the bug must have changed some op of every graph.
fn must_fail(name: &str, what: &str, bug: Bug) {
    let hidden = markbase::loader::Checkpoint::open(common::fixture(name)).unwrap().config().hidden_size;
    let (graphs, untouched) = (Cell::new(0), Cell::new(0));
    let edit = |g: &mut Graph| {
        graphs.set(graphs.get() + 1);
        if bug.apply(g, hidden) == 0 {
            untouched.set(untouched.get() + 1);
        }
    };
    let r = common::check_fixture_with(name, DeviceKind::Cpu, Some(&edit));
    assert!(graphs.get() > 0 && untouched.get() == 0, "{name} {what}: {} of {} graphs have no op to change", untouched.get(), graphs.get());
    let e = r.err().unwrap_or_else(|| panic!("{name} with {what} passes the fixture comparison"));
    // the logits alone (what a run without the layers' outputs sees) fail too
    let reference = common::reference(name);
    let mut run = common::FixtureRun::new(name, DeviceKind::Cpu, Some(&edit)).unwrap();
    let (logits, _) = run.step(&reference.tokens, false).unwrap();
    match common::compare(name, &logits, &reference.prefill, reference.vocab, common::bound(name).logits) {
        Ok(rel) => panic!("{name} with {what}: the prefill logits pass ({rel:.2e} of max)"),
        Err(l) => println!("{name} with {what} fails: {e}\n    logits alone: {l}"),
    }
}

fn bf16(x: f32) -> f32 {
    markbase::graph::builder::round_bf16(x)
}

const GEMMA3: [&str; 2] = ["gemma3_text-q2g64", "gemma3_mm-q4"];
const GEMMA4: [&str; 2] = ["gemma4_dense_ple-mxfp4", "gemma4_moe-nvfp4gs"];

/// The unmutated runs pass, so that the failures below are the bugs'.
#[test]
fn unmutated_fixtures_pass() {
    for name in GEMMA3.iter().chain(&GEMMA4) {
        common::check_fixture(name, DeviceKind::Cpu).unwrap();
    }
}

/// Gemma 3 scales the embedding by bf16(√H) (11.3125 for H = 128); exact √H is the
/// classic bug. Gemma 4's fixtures run with exact constants (mlx-lm in f32), so
/// rounding the scale to bf16 there is the same bug the other way round.
#[test]
fn embedding_scale() {
    for name in GEMMA3 {
        must_fail(name, "embedding scale √H instead of bf16(√H)", Bug::EmbedScale(|_, h| (h as f32).sqrt()));
    }
    for name in GEMMA4 {
        must_fail(name, "embedding scale bf16(√H) instead of √H", Bug::EmbedScale(|s, _| bf16(s)));
    }
}

/// gemma3_text: query_pre_attn_scalar (24) differs from head_dim (32), and 1/√head_dim
/// is the classic bug. gemma3_mm has query_pre_attn_scalar = head_dim, so its scale is
/// set 10% off. Gemma 4 attends with scale 1 (its q/k norms set the scale); the usual
/// 1/√D is the bug there.
#[test]
fn attention_scale() {
    must_fail("gemma3_text-q2g64", "attention scale 1/√head_dim", Bug::AttnScale(|_, d| (d as f32).powf(-0.5)));
    must_fail("gemma3_mm-q4", "attention scale × 1.1", Bug::AttnScale(|s, _| s * 1.1));
    for name in GEMMA4 {
        must_fail(name, "attention scale 1/√D instead of 1", Bug::AttnScale(|s, d| s / (d as f32).sqrt()));
    }
}

/// Gemma 3 norms scale by 1 + w, Gemma 4's by w: each swapped.
#[test]
fn norm_convention() {
    for name in GEMMA3.iter().chain(&GEMMA4) {
        must_fail(name, "norm 1+w and w swapped", Bug::NormSwap);
    }
}

/// The global layers' RoPE base 1,000,000 replaced by the local layers' 10,000.
#[test]
fn rope_base() {
    for name in GEMMA3.iter().chain(&GEMMA4) {
        must_fail(name, "RoPE base 10,000 instead of 1,000,000", Bug::RopeBase { from: 1e6, to: 1e4 });
    }
}
