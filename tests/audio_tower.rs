//! Gemma 4's audio tower as a compiled graph against mlx-vlm's (the tiny tower of
//! `tools/make_audio_tower_fixtures.py`), intermediate by intermediate on the CPU reference
//! executor and on the GPU: the subsampling convs, the input projection, each conformer block, the output
//! projection and the soft tokens. A divergence names the first intermediate past its bound.

use std::path::PathBuf;
use std::sync::Arc;

use markbase::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
use markbase::graph::ir::{Graph, NodeKind};
use markbase::graph::ops::{Op, UnaryOp};
use markbase::graph::passes::{compile, PhasePolicy};
use markbase::gpu::runtime::GpuExecutor;
use markbase::exec::{Executor, GraphKey};
use markbase::loader::Checkpoint;

mod common;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/audio_tower/gemma4")
}

const CLIPS: [&str; 2] = ["speech_16k", "tone1k_48k_s24"];

/// The references: `<clip>.<name>` as f32 (u8 masks widened).
struct Refs(Vec<u8>);

impl Refs {
    fn open() -> Refs {
        Refs(std::fs::read(dir().join("ref.safetensors")).unwrap())
    }

    fn get(&self, name: &str) -> Vec<f32> {
        let st = safetensors::SafeTensors::deserialize(&self.0).unwrap();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        match t.dtype() {
            safetensors::Dtype::F32 => t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
            safetensors::Dtype::U8 => t.data().iter().map(|&b| b as f32).collect(),
            d => panic!("{name}: {d:?}"),
        }
    }
}

/// Max |got − want| over max |want|.
fn rel_err(what: &str, got: &[f32], want: &[f32]) -> f32 {
    let d = common::max_abs_diff(what, got, want).unwrap_or_else(|e| panic!("{e}"));
    d / want.iter().fold(0f32, |a, b| a.max(b.abs()))
}

/// Bounds (relative to the reference's largest magnitude), about 10x the error observed on
/// the CPU reference over both clips (in brackets: the largest seen), in model order: the
/// first one exceeded names the diverging stage.
const BOUNDS: [(&str, f32); 7] = [
    ("sscp0", 1e-6),     // [0: bit-exact]
    ("sscp1", 3e-6),     // [2.8e-7]
    ("subsample", 6e-6), // [5.9e-7]
    ("block0", 6e-6),    // [5.6e-7]
    ("block1", 7e-6),    // [6.4e-7]
    ("encoder", 6e-6),   // [6.0e-7]
    ("soft", 1e-5),      // [1.0e-6]
];

/// The tower of the fixture over one clip on the CPU: each intermediate's error, in
/// [`BOUNDS`] order.
fn run_clip(cp: &Checkpoint, refs: &Refs, clip: &str, bug: Option<Bug>) -> Vec<(&'static str, f32)> {
    let (g, features, valid) = graph(cp, refs, clip);
    let (w, rep) = cp.load_audio_tower(&g).unwrap();
    assert!(rep.is_empty(), "{rep}");
    let mut g = g;
    if let Some(bug) = bug {
        let changed = bug(&mut g);
        assert!(changed > 0, "the planted bug changes nothing");
    }
    let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
    let step = StepInputs { features: &features, audio_valid: &valid, ..Default::default() };
    let out = exec::run(&c, &mut CpuWeights::new(Arc::new(w)), &mut CpuState::default(), &step).unwrap();
    errors(refs, clip, out["valid_rows"].u(), |what| out[what].f().to_vec())
}

/// Checks the valid rows against the reference and returns each intermediate's error, in
/// [`BOUNDS`] order (`value`: an intermediate by name).
fn errors(refs: &Refs, clip: &str, valid_rows: &[u32], value: impl Fn(&str) -> Vec<f32>) -> Vec<(&'static str, f32)> {
    let rows: Vec<f32> = valid_rows.iter().map(|&v| v as f32).collect();
    assert_eq!(rows, refs.get(&format!("{clip}.sscp_valid")), "{clip}: valid rows");
    BOUNDS
        .iter()
        .map(|&(what, _)| {
            let got = value(what);
            assert!(got.iter().all(|x| x.is_finite()), "{clip} {what}: not finite");
            (what, rel_err(what, &got, &refs.get(&format!("{clip}.{what}"))))
        })
        .collect()
}

/// The tower graph of the fixture over one clip, the clip's features and frame mask. The
/// features of padded frames (zeros in the reference's input) are garbled: the tower masks
/// them, so the references still hold.
fn graph(cp: &Checkpoint, refs: &Refs, clip: &str) -> (Graph, Vec<f32>, Vec<u32>) {
    let ac = cp.audio_config().unwrap().expect("the fixture has an audio tower");
    let mut features = refs.get(&format!("{clip}.features"));
    let valid: Vec<u32> = refs.get(&format!("{clip}.valid")).iter().map(|&v| v as u32).collect();
    for (row, _) in features.chunks_mut(ac.features).zip(&valid).filter(|(_, &v)| v == 0) {
        row.iter_mut().enumerate().for_each(|(i, x)| *x = 3.0 - (i % 7) as f32);
    }
    (cp.audio_tower_graph(&ac, valid.len()).unwrap(), features, valid)
}

/// The first intermediate past its bound, as a message.
fn first_divergence(clip: &str, errs: &[(&str, f32)]) -> Option<String> {
    errs.iter().zip(BOUNDS).find(|((_, e), (_, b))| e > b).map(|((what, e), (_, b))| format!("{clip}: diverges at {what}: {e:.2e} > {b:.0e}"))
}

#[test]
fn gemma4_audio_tower_matches_mlx_vlm_on_the_cpu() {
    let cp = Checkpoint::open(dir()).unwrap();
    let refs = Refs::open();
    for clip in CLIPS {
        let errs = run_clip(&cp, &refs, clip, None);
        for (what, e) in &errs {
            println!("cpu {clip} {what}: {e:.2e}");
        }
        if let Some(m) = first_divergence(clip, &errs) {
            panic!("{m}");
        }
    }
}

#[test]
fn the_audio_check_finds_every_tensor() {
    let cp = Checkpoint::open(dir()).unwrap();
    let ac = cp.audio_config().unwrap().unwrap();
    assert_eq!((ac.hidden, ac.layers, ac.heads, ac.window, ac.conv_channels), (64, 2, 2, 12, [16, 8]));
    let r = cp.check_audio(&ac);
    assert!(r.is_empty(), "{r}");
}

/// A planted bug: rewrites ops of the built graph, returns how many it changed.
type Bug = fn(&mut Graph) -> usize;

/// Applies `f` to every op node (its name and op); the number of ops it changed.
fn rewrite(g: &mut Graph, f: impl Fn(&str, &mut Op) -> bool) -> usize {
    let ids: Vec<_> = g.op_nodes().collect();
    ids.into_iter()
        .filter(|&i| {
            let node = &mut g.g[i];
            match &mut node.kind {
                NodeKind::Op { op } => f(&node.name, op),
                _ => false,
            }
        })
        .count()
}

/// With `bug` planted, the comparison of `clip` must fail, first at `stage`.
fn must_diverge_at(clip: &str, stage: &str, bug: Bug) {
    let cp = Checkpoint::open(dir()).unwrap();
    let errs = run_clip(&cp, &Refs::open(), clip, Some(bug));
    match first_divergence(clip, &errs) {
        Some(m) => {
            println!("{m}");
            assert!(m.contains(&format!("diverges at {stage}:")), "expected the first divergence at {stage}: {m}");
        }
        None => panic!("{clip}: the planted bug passes every bound: {errs:?}"),
    }
}

/// The feed-forwards' residual weight 0.5 taken as 1 (the plain residual).
#[test]
fn planted_feed_forward_residual_weight() {
    must_diverge_at("speech_16k", "block0", |g| {
        rewrite(g, |_, op| match op {
            Op::Unary { f: UnaryOp::Scale { factor } } if *factor == 0.5 => {
                *factor = 1.0;
                true
            }
            _ => false,
        })
    });
}

/// The ReLU after each subsampling conv's LayerNorm dropped.
#[test]
fn planted_missing_subsampling_relu() {
    must_diverge_at("speech_16k", "sscp0", |g| {
        rewrite(g, |_, op| match op {
            Op::Unary { f } if *f == UnaryOp::Relu => {
                *f = UnaryOp::Scale { factor: 1.0 };
                true
            }
            _ => false,
        })
    });
}

/// The attention window one key too wide (`attention_context_left` 13 read as 13 keys).
#[test]
fn planted_attention_window_off_by_one() {
    must_diverge_at("speech_16k", "block0", |g| {
        rewrite(g, |_, op| match op {
            Op::AudioAttention { window, .. } => {
                *window += 1;
                true
            }
            _ => false,
        })
    });
}

/// The attention logits soft-capped at 5 instead of 50.
#[test]
fn planted_attention_softcap() {
    must_diverge_at("speech_16k", "block0", |g| {
        rewrite(g, |_, op| match op {
            Op::AudioAttention { softcap, .. } => {
                *softcap = 5.0;
                true
            }
            _ => false,
        })
    });
}

/// The padded frame of the short clip not masked before the first subsampling conv (the
/// conv reads the features themselves).
#[test]
fn planted_unmasked_padding_frame() {
    must_diverge_at("tone1k_48k_s24", "sscp0", |g| {
        let find = |g: &Graph, name: &str| g.g.node_indices().find(|&i| g.g[i].name == name).unwrap();
        let (feats, masked, conv) = (find(g, "a.features_3d"), find(g, "a.sscp0_masked"), find(g, "a.sscp0_conv"));
        let Some(e) = g.g.find_edge(masked, conv) else { return 0 };
        let slot = g.g.remove_edge(e).unwrap();
        g.g.add_edge(feats, conv, slot);
        1
    });
}

/// Bounds of the GPU (lavapipe in CI) against the same references: about 10x the error
/// observed there (in brackets), where the GPU's own rounding (another summation order in the
/// matmuls, its exp and tanh) adds to the CPU's.
const GPU_BOUNDS: [(&str, f32); 7] = [
    ("sscp0", 3e-6),     // [2.4e-7]
    ("sscp1", 3e-6),     // [3.0e-7]
    ("subsample", 5e-6), // [4.6e-7]
    ("block0", 8e-6),    // [7.8e-7]
    ("block1", 9e-6),    // [9.1e-7]
    ("encoder", 7e-6),   // [7.1e-7]
    ("soft", 1.3e-5),    // [1.3e-6]
];

/// The whole tower on the GPU (every op lowered to WGSL, NaN checks on) against mlx-vlm's
/// intermediates; fails, never skips, without an adapter.
#[test]
fn gemma4_audio_tower_matches_mlx_vlm_on_the_gpu() {
    let cp = Checkpoint::open(dir()).unwrap();
    let refs = Refs::open();
    let mut failures = vec![];
    for clip in CLIPS {
        let (g, features, valid) = graph(&cp, &refs, clip);
        assert!(markbase::gpu::ops::unsupported_op(&g).is_none(), "the GPU lowers every op of the tower");
        let (w, _) = cp.load_audio_tower(&g).unwrap();
        let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
        let mut gpu = GpuExecutor::new(None, Arc::new(w), true).unwrap_or_else(|e| panic!("no GPU adapter: {e}"));
        let key = GraphKey { tokens: c.graph.tokens, all_logits: true, sample: false, images: false };
        let step = StepInputs { features: &features, audio_valid: &valid, ..Default::default() };
        gpu.run(key, &c, &step, true).unwrap();
        let mut read = |what: &str| gpu.read_output(key, &c, what).unwrap();
        let valid_rows = read("valid_rows");
        let values: std::collections::HashMap<&str, Vec<f32>> =
            BOUNDS.iter().map(|&(what, _)| (what, read(what).into_iter().map(f32::from_bits).collect())).collect();
        for ((what, e), (_, bound)) in errors(&refs, clip, &valid_rows, |what| values[what].clone()).into_iter().zip(GPU_BOUNDS) {
            println!("gpu {clip} {what}: {e:.2e}");
            if e > bound {
                failures.push(format!("gpu {clip} {what}: {e:.2e} > {bound:.0e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
