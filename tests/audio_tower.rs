//! The audio towers as compiled graphs against mlx-vlm's (the tiny towers of
//! `tools/make_audio_tower_fixtures.py`, Gemma 4, and `tools/make_gemma3n_audio_fixtures.py`,
//! Gemma 3n), intermediate by intermediate on the CPU reference executor and on the GPU: the
//! subsampling convs, the input projection, each conformer block, the tower's output and the
//! soft tokens. A divergence names the first intermediate past its bound.

use std::path::PathBuf;
use std::sync::Arc;

use markbase::audio::encode::slot_inputs;
use markbase::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
use markbase::graph::ir::{Graph, NodeKind};
use markbase::graph::ops::{Op, UnaryOp};
use markbase::graph::passes::{compile, PhasePolicy};
use markbase::gpu::runtime::GpuExecutor;
use markbase::exec::{Executor, GraphKey};
use markbase::loader::Checkpoint;

mod common;

/// A tiny tower fixture: its directory, clips and bounds.
struct Fixture {
    dir: &'static str,
    clips: [&'static str; 2],
    /// CPU and GPU bounds, in model order.
    bounds: &'static [(&'static str, f32)],
    gpu_bounds: &'static [(&'static str, f32)],
    /// Row masks the graph outputs and the references they equal.
    masks: &'static [(&'static str, &'static str)],
}

impl Fixture {
    fn dir(&self) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/audio_tower").join(self.dir)
    }

    fn checkpoint(&self) -> Checkpoint {
        Checkpoint::open(self.dir()).unwrap()
    }

    fn refs(&self) -> Refs {
        Refs(std::fs::read(self.dir().join("ref.safetensors")).unwrap())
    }
}

const GEMMA4: Fixture = Fixture { dir: "gemma4", clips: ["speech_16k", "tone1k_48k_s24"], bounds: &BOUNDS, gpu_bounds: &GPU_BOUNDS, masks: &[("valid_rows", "sscp_valid")] };
const GEMMA3N: Fixture = Fixture { dir: "gemma3n", clips: ["speech_16k", "tone1k_60f"], bounds: &BOUNDS_3N,
    gpu_bounds: &GPU_BOUNDS_3N,
    masks: &[("sscp_valid", "sscp_valid"), ("valid_rows", "valid_rows")],
};

/// The references: `<clip>.<name>` as f32 (u8 masks widened).
struct Refs(Vec<u8>);

impl Refs {

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

/// A clip's tower inputs: the features, the frame mask and (Gemma 3n) the slots' rows and
/// sources.
struct Inputs {
    features: Vec<f32>,
    valid: Vec<u32>,
    ids: Vec<u32>,
    index: Vec<u32>,
}

impl Inputs {
    fn step(&self) -> StepInputs<'_> {
        StepInputs { features: &self.features, audio_valid: &self.valid, tokens: &self.ids, soft_index: &self.index, ..Default::default() }
    }
}

/// The tower of the fixture over one clip on the CPU: each intermediate's error, in bounds
/// order.
fn run_clip(fx: &Fixture, cp: &Checkpoint, refs: &Refs, clip: &str, bug: Option<Bug>) -> Vec<(&'static str, f32)> {
    let (g, inputs) = graph(cp, refs, clip);
    run_inputs(fx, cp, refs, clip, g, &inputs, bug)
}

fn run_inputs(fx: &Fixture, cp: &Checkpoint, refs: &Refs, clip: &str, g: Graph, inputs: &Inputs, bug: Option<Bug>) -> Vec<(&'static str, f32)> {
    let (w, rep) = cp.load_audio_tower(&g).unwrap();
    assert!(rep.is_empty(), "{rep}");
    let mut g = g;
    if let Some(bug) = bug {
        let changed = bug(&mut g);
        assert!(changed > 0, "the planted bug changes nothing");
    }
    let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
    let out = exec::run(&c, &mut CpuWeights::new(Arc::new(w)), &mut CpuState::default(), &inputs.step()).unwrap();
    errors(fx, refs, clip, |what| out[what].u().to_vec(), |what| out[what].f().to_vec())
}

/// Checks the row masks (`mask`: by name) against the reference and returns each
/// intermediate's error, in bounds order (`value`: an intermediate by name).
fn errors(fx: &Fixture, refs: &Refs, clip: &str, mask: impl Fn(&str) -> Vec<u32>, value: impl Fn(&str) -> Vec<f32>) -> Vec<(&'static str, f32)> {
    for &(what, want) in fx.masks {
        let got: Vec<f32> = mask(what).iter().map(|&v| v as f32).collect();
        assert_eq!(got, refs.get(&format!("{clip}.{want}")), "{clip}: {what}");
    }
    fx.bounds
        .iter()
        .map(|&(what, _)| {
            let got = value(what);
            assert!(got.iter().all(|x| x.is_finite()), "{clip} {what}: not finite");
            (what, rel_err(what, &got, &refs.get(&format!("{clip}.{what}"))))
        })
        .collect()
}

/// The tower graph of the fixture over one clip and its inputs. Gemma 4: the features of
/// padded frames (zeros in the reference's input) are garbled: the tower masks them, so the
/// references still hold. Gemma 3n reads every frame (HF's features of the padding).
fn graph(cp: &Checkpoint, refs: &Refs, clip: &str) -> (Graph, Inputs) {
    let ac = cp.audio_config().unwrap().expect("the fixture has an audio tower");
    let mut features = refs.get(&format!("{clip}.features"));
    let valid: Vec<u32> = refs.get(&format!("{clip}.valid")).iter().map(|&v| v as u32).collect();
    if ac.kind == markbase::graph::audio::AudioKind::Gemma4 {
        for (row, _) in features.chunks_mut(ac.features).zip(&valid).filter(|(_, &v)| v == 0) {
            row.iter_mut().enumerate().for_each(|(i, x)| *x = 3.0 - (i % 7) as f32);
        }
    }
    tower_inputs(cp, features, valid)
}

/// The tower graph for `features` and `valid`, and its inputs.
fn tower_inputs(cp: &Checkpoint, features: Vec<f32>, valid: Vec<u32>) -> (Graph, Inputs) {
    let ac = cp.audio_config().unwrap().expect("the fixture has an audio tower");
    let real: Vec<bool> = valid.iter().step_by(4 * ac.reduction).map(|&v| v != 0).collect();
    let (ids, index) = slot_inputs(&ac, &real);
    (cp.audio_tower_graph(&ac, valid.len()).unwrap(), Inputs { features, valid, ids, index })
}

/// The first intermediate past its bound, as a message.
fn first_divergence(fx: &Fixture, clip: &str, errs: &[(&str, f32)]) -> Option<String> {
    errs.iter().zip(fx.bounds).find(|((_, e), (_, b))| e > b).map(|((what, e), (_, b))| format!("{clip}: diverges at {what}: {e:.2e} > {b:.0e}"))
}

fn matches_on_the_cpu(fx: &Fixture) {
    let cp = fx.checkpoint();
    let refs = fx.refs();
    for clip in fx.clips {
        let errs = run_clip(fx, &cp, &refs, clip, None);
        for (what, e) in &errs {
            println!("cpu {clip} {what}: {e:.2e}");
        }
        if let Some(m) = first_divergence(fx, clip, &errs) {
            panic!("{m}");
        }
    }
}

#[test]
fn gemma4_audio_tower_matches_mlx_vlm_on_the_cpu() {
    matches_on_the_cpu(&GEMMA4);
}

#[test]
fn the_audio_check_finds_every_tensor() {
    let cp = GEMMA4.checkpoint();
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

/// With `bug` planted, the comparison of `clip` of Gemma 4's fixture must fail, first at
/// `stage`.
fn must_diverge_at(clip: &str, stage: &str, bug: Bug) {
    must_diverge(&GEMMA4, clip, stage, bug);
}

fn must_diverge(fx: &Fixture, clip: &str, stage: &str, bug: Bug) {
    let errs = run_clip(fx, &fx.checkpoint(), &fx.refs(), clip, Some(bug));
    expect_divergence(fx, clip, stage, &errs);
}

fn expect_divergence(fx: &Fixture, clip: &str, stage: &str, errs: &[(&str, f32)]) {
    match first_divergence(fx, clip, errs) {
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
fn matches_on_the_gpu(fx: &Fixture) {
    let cp = fx.checkpoint();
    let refs = fx.refs();
    let mut failures = vec![];
    for clip in fx.clips {
        let (g, inputs) = graph(&cp, &refs, clip);
        assert!(markbase::gpu::ops::unsupported_op(&g).is_none(), "the GPU lowers every op of the tower");
        let (w, _) = cp.load_audio_tower(&g).unwrap();
        let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
        let mut gpu = GpuExecutor::new(None, Arc::new(w), true).unwrap_or_else(|e| panic!("no GPU adapter: {e}"));
        let key = GraphKey { tokens: c.graph.tokens, all_logits: true, sample: false, images: false };
        gpu.run(key, &c, &inputs.step(), true).unwrap();
        let masks: std::collections::HashMap<&str, Vec<u32>> = fx.masks.iter().map(|&(what, _)| (what, gpu.read_output(key, &c, what).unwrap())).collect();
        let values: std::collections::HashMap<&str, Vec<f32>> =
            fx.bounds.iter().map(|&(what, _)| (what, gpu.read_output(key, &c, what).unwrap().into_iter().map(f32::from_bits).collect())).collect();
        for ((what, e), (_, bound)) in errors(fx, &refs, clip, |w| masks[w].clone(), |what| values[what].clone()).into_iter().zip(fx.gpu_bounds) {
            println!("gpu {clip} {what}: {e:.2e}");
            if e > *bound {
                failures.push(format!("gpu {clip} {what}: {e:.2e} > {bound:.0e}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn gemma4_audio_tower_matches_mlx_vlm_on_the_gpu() {
    matches_on_the_gpu(&GEMMA4);
}

// ------------------------------------------------------------------ Gemma 3n

/// Bounds of Gemma 3n's tower on the CPU, about 10x the error observed (in brackets: the
/// largest seen over both clips, and over the speech clip from our own features of its WAV),
/// in model order.
const BOUNDS_3N: [(&str, f32); 8] = [
    ("sscp0", 8e-6),     // [2.9e-7; WAV 7.3e-7]
    ("sscp1", 8e-6),     // [2.5e-7; WAV 7.1e-7]
    ("subsample", 5e-6), // [3.8e-7; WAV 5.0e-7]
    ("block0", 8e-6),    // [6.0e-7; WAV 7.9e-7]
    ("block1", 1e-5),    // [9.3e-7; WAV 6.6e-7]
    ("encoder", 5e-6),   // [4.7e-7; WAV 4.8e-7]
    ("embedded", 7e-6),  // [6.6e-7; WAV 7.0e-7]
    ("soft", 7e-6),      // [6.6e-7; WAV 7.0e-7]
];

/// The same on the GPU (lavapipe in CI), about 10x the error observed there.
const GPU_BOUNDS_3N: [(&str, f32); 8] = [
    ("sscp0", 3e-6),     // [2.9e-7]
    ("sscp1", 4e-6),     // [3.1e-7]
    ("subsample", 5e-6), // [4.6e-7]
    ("block0", 7e-6),    // [6.5e-7]
    ("block1", 9e-6),    // [8.5e-7]
    ("encoder", 6e-6),   // [5.7e-7]
    ("embedded", 9e-6),  // [8.2e-7]
    ("soft", 9e-6),      // [8.2e-7]
];

#[test]
fn gemma3n_audio_tower_matches_mlx_vlm_on_the_cpu() {
    matches_on_the_cpu(&GEMMA3N);
}

#[test]
fn gemma3n_audio_tower_matches_mlx_vlm_on_the_gpu() {
    matches_on_the_gpu(&GEMMA3N);
}

#[test]
fn gemma3n_audio_config_and_tensors() {
    let cp = GEMMA3N.checkpoint();
    let ac = cp.audio_config().unwrap().unwrap();
    assert_eq!((ac.hidden, ac.layers, ac.heads, ac.window, ac.conv_channels, ac.reduction), (48, 2, 2, 13, [8, 4], 4));
    assert_eq!((ac.soft_slots, ac.vocab_size, ac.pad_row, ac.text_hidden), (188, 128, 127, 128));
    let r = cp.check_audio(&ac);
    assert!(r.is_empty(), "{r}");
    // 30 s of audio (2997 frames) fills the 188 slots; one more frame does not fit
    assert_eq!(ac.encoder_rows(2997), 188);
    assert!(cp.audio_tower_graph(&ac, 2997).is_ok());
    let e = cp.audio_tower_graph(&ac, 3009).unwrap_err().to_string();
    assert!(e.contains("over the 188"), "{e}");
    let shown = markbase::inspect::inspect(&GEMMA3N.dir()).to_string();
    assert!(shown.contains("audio tower: Gemma 3n conformer of 2 blocks, 53 tensors"), "{shown}");
}

/// Our features of the speech WAV (not HF's) through the tower: every intermediate still
/// matches mlx-vlm's within the bounds; with the pre-emphasis dropped they do not.
#[test]
fn gemma3n_wav_to_soft_tokens_and_planted_missing_preemphasis() {
    use markbase::audio::{self, FeatureConfig, FeatureExtractor, Family, LoadOptions};
    let fx = &GEMMA3N;
    let cp = fx.checkpoint();
    let refs = fx.refs();
    let wav = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/audio/speech_16k.wav");
    let samples = audio::load(&wav, &LoadOptions::default()).unwrap();
    let run = |preemphasis: f64| {
        let cfg = FeatureConfig { preemphasis, ..FeatureConfig::defaults(Family::Gemma3n) };
        let f = FeatureExtractor::new(cfg).unwrap().extract(&samples).unwrap();
        let (g, inputs) = tower_inputs(&cp, f.data, f.mask.iter().map(|&v| v as u32).collect());
        run_inputs(fx, &cp, &refs, "speech_16k", g, &inputs, None)
    };
    let errs = run(0.97);
    for (what, e) in &errs {
        println!("wav {what}: {e:.2e}");
    }
    if let Some(m) = first_divergence(fx, "speech_16k", &errs) {
        panic!("from the WAV: {m}");
    }
    let bad = run(0.0);
    println!("no pre-emphasis: {bad:?}");
    expect_divergence(fx, "speech_16k", "sscp0", &bad);
}

/// The attention's logits soft-capped at 5 instead of 50.
#[test]
fn gemma3n_planted_attention_softcap() {
    must_diverge(&GEMMA3N, "speech_16k", "block0", |g| {
        rewrite(g, |_, op| match op {
            Op::AudioAttention { softcap, .. } => {
                *softcap = 5.0;
                true
            }
            _ => false,
        })
    });
}

/// Gemma 4's window (`conf_attention_context_left − 1` keys) instead of Gemma 3n's.
#[test]
fn gemma3n_planted_attention_window() {
    must_diverge(&GEMMA3N, "speech_16k", "block0", |g| {
        rewrite(g, |_, op| match op {
            Op::AudioAttention { window, .. } => {
                *window -= 1;
                true
            }
            _ => false,
        })
    });
}

/// Gemma 4's key scaling (ln(1 + e) / ln 2) in Gemma 3n's attention.
#[test]
fn gemma3n_planted_key_scale() {
    must_diverge(&GEMMA3N, "speech_16k", "block0", |g| {
        rewrite(g, |_, op| match op {
            Op::AudioAttention { key_scale, .. } => {
                *key_scale = 1.894_636_1;
                true
            }
            _ => false,
        })
    });
}

/// The cumulative group norm replaced by the per-frame channel LayerNorm of Gemma 4's
/// subsampling.
#[test]
fn gemma3n_planted_group_norm_variant() {
    must_diverge(&GEMMA3N, "speech_16k", "sscp0", |g| {
        rewrite(g, |_, op| match op {
            Op::CumulativeGroupNorm { eps } => {
                *op = Op::LayerNorm { eps: *eps };
                true
            }
            _ => false,
        })
    });
}

/// The cumulative group norm's eps (`sscp_conv_group_norm_eps`, 1e-3) taken as the blocks'
/// `rms_norm_eps` (1e-6).
#[test]
fn gemma3n_planted_group_norm_eps() {
    must_diverge(&GEMMA3N, "speech_16k", "sscp0", |g| {
        rewrite(g, |_, op| match op {
            Op::CumulativeGroupNorm { eps } => {
                *eps = 1e-6;
                true
            }
            _ => false,
        })
    });
}

/// The subsampling convs padded symmetrically in time (Gemma 4's) instead of 0 above, 2 below.
#[test]
fn gemma3n_planted_symmetric_time_padding() {
    must_diverge(&GEMMA3N, "speech_16k", "sscp0", |g| {
        rewrite(g, |_, op| match op {
            Op::Conv2d { time_pad, .. } => {
                *time_pad = [1, 1];
                true
            }
            _ => false,
        })
    });
}

/// The padded encoder rows of the short clip not zeroed before `embed_audio`.
#[test]
fn gemma3n_planted_unmasked_encoder_rows() {
    must_diverge(&GEMMA3N, "tone1k_60f", "embedded", |g| {
        let find = |g: &Graph, name: &str| g.g.node_indices().find(|&i| g.g[i].name == name).unwrap();
        let (reduced, enc, norm) = (find(g, "a.reduced"), find(g, "a.encoder"), find(g, "a.embedded_norm"));
        let Some(e) = g.g.find_edge(enc, norm) else { return 0 };
        let slot = g.g.remove_edge(e).unwrap();
        g.g.add_edge(reduced, norm, slot);
        1
    });
}

/// The short clip's padded encoder rows given slots of their own (HF gives them the padding
/// embedding): the soft tokens differ.
#[test]
fn gemma3n_planted_padded_rows_in_slots() {
    let fx = &GEMMA3N;
    let (cp, refs) = (fx.checkpoint(), fx.refs());
    let (g, mut inputs) = graph(&cp, &refs, "tone1k_60f");
    let rows = refs.get("tone1k_60f.valid_rows").len();
    assert!(inputs.index[..rows].contains(&0), "the clip has padded encoder rows");
    inputs.index[..rows].iter_mut().enumerate().for_each(|(i, s)| *s = i as u32 + 1);
    let errs = run_inputs(fx, &cp, &refs, "tone1k_60f", g, &inputs, None);
    expect_divergence(fx, "tone1k_60f", "soft", &errs);
}

/// Gemma 3n's audio tensors get the loader's diagnostics: missing and mis-shaped tensors, by
/// block and all at once, before any clip is encoded.
#[test]
fn gemma3n_missing_and_misshaped_audio_tensors_are_reported_by_block() {
    let src = GEMMA3N.dir();
    let dir = std::env::temp_dir().join(format!("markbase-audio3n-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let gone = ["audio_tower.conformer.1.attention.attn.k_proj.weight", "embed_audio.hard_embedding_norm.weight"];
    let conv = "audio_tower.subsample_conv_projection.conv_1.conv.weight";
    let views: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !gone.contains(&n.as_str()))
        .map(|(n, t)| {
            if n != conv {
                return (n, t);
            }
            // half the output channels
            let s = t.shape();
            let half = safetensors::tensor::TensorView::new(t.dtype(), vec![s[0] / 2, s[1], s[2], s[3]], &t.data()[..t.data().len() / 2]).unwrap();
            (n, half)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let err = match markbase::audio::encode::AudioEncoder::open(&dir, markbase::model::DeviceKind::Cpu, false) {
        Ok(_) => panic!("a broken tower opened"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("layer 1: attention.attn.k_proj.weight missing"), "{err}");
    assert!(err.contains("embed_audio.hard_embedding_norm.weight missing"), "{err}");
    assert!(err.contains("conv_1.conv.weight has shape [2, 3, 3, 8], expected [4, 3, 3, 8]"), "{err}");
    std::fs::remove_dir_all(dir).ok();
}
