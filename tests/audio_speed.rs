//! Encode speed of the audio towers at their real shapes, with random weights:
//! `cargo test --release --test audio_speed -- --ignored --nocapture`.
//!
//! For Gemma 4 E2B/E4B's tower (about 305 M parameters) and Gemma 3n's (about 680 M), built
//! from their real `audio_config`, a synthetic clip (a chirp plus noise, 16 kHz) goes through
//! the real feature extractor (timed on the CPU) and the tower on the GPU (timed with
//! timestamps where the adapter has them, else the wall clock of the step after a warm-up;
//! median of 3). The weights are stored as mlx-vlm's converter ships them: the tower in bf16
//! (its modules are never quantized), `embed_audio`'s modules affine 4-bit g64 as in the
//! 4-bit conversions (`MARKBASE_AUDIO_SPEED_EMBED=bf16`: bf16, as in the bf16 ones).
//!
//! Settings: `MARKBASE_AUDIO_SPEED_SECONDS` (the clip's length, default 30),
//! `MARKBASE_AUDIO_SPEED_CPU=1` (also one run on the CPU reference executor, slow, and the
//! GPU's soft tokens against its), `MARKBASE_AUDIO_SPEED_TOWER=gemma4|gemma3n` (one tower).
//!
//! The small test at the end runs the same path over tiny towers and checks the GPU's soft
//! tokens against the CPU reference's.

use std::sync::Arc;
use std::time::Instant;

use markbase::audio::encode::TowerInputs;
use markbase::audio::{FeatureConfig, FeatureExtractor, Family};
use markbase::cpu::exec::{self, CpuState, CpuWeights};
use markbase::exec::{Executor, GraphKey, Profile};
use markbase::graph::audio::{AudioConfig, AudioKind};
use markbase::graph::builder::WeightResolver;
use markbase::graph::passes::{compile, Compiled, PhasePolicy};
use markbase::graph::quant::{FloatType, QuantSpec, WeightFormat};
use markbase::graph::tower::build_audio_tower;
use markbase::graph::ModelConfig;
use markbase::gpu::runtime::GpuExecutor;
use markbase::synthetic::{graph_weights, SyntheticResolver};
use markbase::weights::Weights;
use serde_json::{json, Value};

/// The real `audio_config` of Gemma 4 E2B/E4B (HF's defaults, which its converter writes).
fn gemma4_audio_config() -> Value {
    json!({"model_type": "gemma4_audio", "hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 8,
        "hidden_act": "silu", "subsampling_conv_channels": [128, 32], "conv_kernel_size": 5, "residual_weight": 0.5,
        "attention_chunk_size": 12, "attention_context_left": 13, "attention_context_right": 0,
        "attention_logit_cap": 50.0, "attention_invalid_logits_value": -1e9, "use_clipped_linears": true,
        "rms_norm_eps": 1e-6, "gradient_clipping": 1e10, "output_proj_dims": 1536})
}

/// The real `audio_config` of Gemma 3n E2B/E4B.
fn gemma3n_audio_config() -> Value {
    json!({"model_type": "gemma3n_audio", "input_feat_size": 128, "hidden_size": 1536, "conf_num_hidden_layers": 12,
        "conf_num_attention_heads": 8, "conf_attention_chunk_size": 12, "conf_attention_context_left": 13,
        "conf_attention_context_right": 0, "conf_attention_logit_cap": 50.0,
        "conf_attention_invalid_logits_value": -1e9, "conf_conv_kernel_size": 5, "conf_reduction_factor": 4,
        "conf_residual_weight": 0.5, "sscp_conv_channel_size": [128, 32], "sscp_conv_kernel_size": [[3, 3], [3, 3]],
        "sscp_conv_stride_size": [[2, 2], [2, 2]], "sscp_conv_group_norm_eps": 1e-3, "rms_norm_eps": 1e-6,
        "gradient_clipping": 1e10, "vocab_size": 128, "vocab_offset": 262272})
}

/// The audio config of `kind` with `audio` as its `audio_config`, over the text model of the
/// tiny fixture of that family given the real text width and vocabulary (Gemma 4 E2B: 1536,
/// 262144; Gemma 3n: 2048, 262400), which is all of it the tower reads.
fn audio_config(kind: AudioKind, audio: Value) -> AudioConfig {
    let (dir, hidden, vocab) = match kind {
        AudioKind::Gemma4 => ("gemma4", 1536, 262_144),
        AudioKind::Gemma3n => ("gemma3n", 2048, 262_400),
    };
    let path = format!("{}/tests/fixtures/audio_tower/{dir}/config.json", env!("CARGO_MANIFEST_DIR"));
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["text_config"]["hidden_size"] = json!(hidden);
    v["text_config"]["vocab_size"] = json!(vocab);
    v["audio_config"] = audio;
    let text = ModelConfig::from_value(&v).unwrap();
    let ac = AudioConfig::from_value(&v, &text).unwrap().unwrap();
    assert_eq!(ac.kind, kind);
    ac
}

/// Stored formats as mlx-vlm ships them: the tower in bf16, `embed_audio`'s modules
/// quantized with `embed` where they fit (`None`: bf16).
struct AudioResolver {
    embed: Option<QuantSpec>,
}

impl WeightResolver for AudioResolver {
    fn format(&self, name: &str, shape: &[usize], module: bool) -> WeightFormat {
        match self.embed {
            Some(spec) if name.starts_with("embed_audio.") => SyntheticResolver { spec }.format(name, shape, module),
            _ => WeightFormat::Float { dtype: FloatType::Bf16 },
        }
    }
}

/// Random weights for the tower graph `g`; the clipped linears' bounds at ±100 (random
/// bounds would clamp everything).
fn random_weights(g: &markbase::graph::Graph) -> Weights {
    let mut w = graph_weights(g, false);
    let bounds: Vec<String> = g.weights().map(|(_, p)| p.name.clone()).filter(|n| n.ends_with("_min") || n.ends_with("_max")).collect();
    for name in bounds {
        let mut d = w.get(&name).unwrap().clone();
        let v: f32 = if name.ends_with("_min") { -100.0 } else { 100.0 };
        d.weight.bytes = d.weight.bytes.chunks(2).flat_map(|_| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
        w.insert(d);
    }
    w
}

/// `seconds` of a 16 kHz test signal: a chirp from 100 Hz to 6 kHz plus white noise.
fn chirp(seconds: f64) -> Vec<f32> {
    let rate = 16_000.0;
    let n = (seconds * rate) as usize;
    let (f0, f1) = (100.0, 6000.0);
    let mut s = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|i| {
            let t = i as f64 / rate;
            let phase = 2.0 * std::f64::consts::PI * (f0 * t + (f1 - f0) * t * t / (2.0 * seconds));
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let noise = (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            (0.5 * phase.sin() + 0.05 * noise) as f32
        })
        .collect()
}

fn family(kind: AudioKind) -> Family {
    match kind {
        AudioKind::Gemma4 => Family::Gemma4,
        AudioKind::Gemma3n => Family::Gemma3n,
    }
}

/// What one tower's run measured.
struct Measured {
    /// Feature extraction (CPU), the tower on the GPU (median), seconds.
    features_s: f64,
    gpu_s: f64,
    gpu_clock: &'static str,
    soft_tokens: usize,
    /// Max |GPU − CPU| over max |CPU| of the soft tokens, when the CPU ran.
    cpu: Option<(f64, f32)>,
}

/// Extracts the features of `clip`, builds and compiles the tower of `ac` over them with
/// random weights, and runs it on the GPU: a warm-up run, then `runs` timed ones.
fn measure(ac: &AudioConfig, embed: Option<QuantSpec>, clip: &[f32], runs: usize, cpu: bool) -> Measured {
    let fx = FeatureExtractor::new(FeatureConfig::defaults(family(ac.kind))).unwrap();
    assert_eq!(fx.config().feature_size, ac.features);
    let t0 = Instant::now();
    let f = fx.extract(clip).unwrap();
    let features_s = t0.elapsed().as_secs_f64();

    let g = build_audio_tower(ac, &AudioResolver { embed }, f.frames).unwrap();
    let tower: usize = g.weights().filter(|(_, p)| p.name.starts_with("audio_tower.")).map(|(_, p)| p.shape.iter().product::<usize>()).sum();
    let w = random_weights(&g);
    println!(
        "{} tower: {:.1} M parameters, {:.0} MB of weights; {} frames, {} encoder rows",
        ac.kind.name(),
        tower as f64 / 1e6,
        w.stored_bytes() as f64 / 1e6,
        f.frames,
        ac.encoder_rows(f.frames)
    );
    let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
    let biggest = c.alloc.pool_sizes.iter().max().copied().unwrap_or(0);
    println!("  {} pool buffers, the largest {:.1} MiB", c.alloc.pool_sizes.len(), biggest as f64 / (1 << 20) as f64);
    let inputs = TowerInputs::new(ac, &f.mask);
    let w = Arc::new(w);

    let mut gpu = GpuExecutor::new(None, w.clone(), false).unwrap_or_else(|e| panic!("no GPU adapter: {e}"));
    println!("  adapter: {}", gpu.adapter_summary());
    let (soft, gpu_s, gpu_clock) = time_gpu(&mut gpu, &c, &inputs, &f.data, runs);
    let soft = inputs.soft_tokens(ac, soft).unwrap();
    assert_eq!(soft.tokens, match ac.kind {
        AudioKind::Gemma4 => f.soft_tokens,
        AudioKind::Gemma3n => ac.soft_slots,
    });
    drop(gpu);

    let cpu = cpu.then(|| {
        let t0 = Instant::now();
        let out = exec::run(&c, &mut CpuWeights::new(w), &mut CpuState::default(), &inputs.step(&f.data)).unwrap();
        let s = t0.elapsed().as_secs_f64();
        let want = inputs.soft_tokens(ac, out["soft"].f().to_vec()).unwrap();
        let d = soft.data.iter().zip(&want.data).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        (s, d / want.data.iter().fold(0f32, |m, x| m.max(x.abs())))
    });
    Measured { features_s, gpu_s, gpu_clock, soft_tokens: soft.tokens, cpu }
}

/// The tower's `soft` output and its median GPU time over `runs` runs after a warm-up (which
/// prepares the graph): the sum of its phases' timestamps where the adapter has them, else
/// the wall clock of the step (upload of the features and read-back of the soft tokens
/// included).
fn time_gpu(gpu: &mut GpuExecutor, c: &Compiled, inputs: &TowerInputs, features: &[f32], runs: usize) -> (Vec<f32>, f64, &'static str) {
    let key = GraphKey { tokens: c.graph.tokens, all_logits: true, sample: false, images: false };
    let step = inputs.step(features);
    let t0 = Instant::now();
    gpu.run(key, c, &step, true).unwrap();
    println!("  warm-up run (prepares the graph): {:.3} s", t0.elapsed().as_secs_f64());
    let stamps = gpu.gpu.info.timestamps;
    gpu.set_profile(if stamps { Profile::Phases } else { Profile::Off });
    let mut soft = vec![];
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let t0 = Instant::now();
            soft = gpu.run(key, c, &step, true).unwrap().logits.unwrap();
            let wall = t0.elapsed().as_secs_f64();
            if stamps {
                gpu.profile().unwrap().phases.iter().sum()
            } else {
                wall
            }
        })
        .collect();
    gpu.set_profile(Profile::Off);
    println!("  runs: {:?} ms", times.iter().map(|t| (t * 1e4).round() / 10.0).collect::<Vec<_>>());
    times.sort_by(f64::total_cmp);
    (soft, times[times.len() / 2], if stamps { "GPU timestamps" } else { "wall clock" })
}

fn env_f64(k: &str, d: f64) -> f64 {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

#[test]
#[ignore]
fn audio_tower_encode_speed() {
    let seconds = env_f64("MARKBASE_AUDIO_SPEED_SECONDS", 30.0);
    let cpu = std::env::var("MARKBASE_AUDIO_SPEED_CPU").is_ok_and(|v| v == "1");
    let embed = match std::env::var("MARKBASE_AUDIO_SPEED_EMBED").as_deref() {
        Ok("bf16") => None,
        _ => Some(QuantSpec::affine(4, 64)),
    };
    let only = std::env::var("MARKBASE_AUDIO_SPEED_TOWER").unwrap_or_default();
    let clip = chirp(seconds);
    let towers = [(AudioKind::Gemma4, "gemma4", gemma4_audio_config()), (AudioKind::Gemma3n, "gemma3n", gemma3n_audio_config())];
    for (kind, name, audio) in towers {
        if !only.is_empty() && only != name {
            continue;
        }
        let ac = audio_config(kind, audio);
        let m = measure(&ac, embed, &clip, 3, cpu);
        let total = m.features_s + m.gpu_s;
        println!(
            "BENCH audio {name} {seconds} s: features {:.1} ms (CPU), tower {:.1} ms ({}, median of 3), real-time factor {:.1}x \
             (tower alone {:.1}x), {} soft tokens; tower bf16, embed_audio {}",
            m.features_s * 1e3,
            m.gpu_s * 1e3,
            m.gpu_clock,
            seconds / total,
            seconds / m.gpu_s,
            m.soft_tokens,
            embed.map_or("bf16".into(), |s| s.describe())
        );
        if let Some((s, err)) = m.cpu {
            println!("BENCH audio {name} {seconds} s on the CPU reference: {s:.2} s (real-time factor {:.2}x); GPU vs CPU soft tokens: {err:.2e}", seconds / s);
            assert!(err < 1e-3, "the GPU's soft tokens differ from the CPU reference's by {err:.2e}");
        }
    }
}

/// The same path over tiny towers (1 s of audio): the GPU's soft tokens match the CPU
/// reference's and come in the clip's count.
#[test]
fn tiny_towers_through_the_speed_path() {
    let clip = chirp(1.0);
    let tiny = [
        (AudioKind::Gemma4, json!({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "subsampling_conv_channels": [16, 8], "output_proj_dims": 64})),
        (AudioKind::Gemma3n, json!({"hidden_size": 64, "conf_num_hidden_layers": 2, "conf_num_attention_heads": 2, "sscp_conv_channel_size": [8, 4], "vocab_offset": 262272})),
    ];
    for (kind, audio) in tiny {
        let ac = audio_config(kind, audio);
        let m = measure(&ac, Some(QuantSpec::affine(4, 64)), &clip, 1, true);
        let (_, err) = m.cpu.unwrap();
        println!("{}: {} soft tokens, GPU vs CPU {err:.2e}", kind.name(), m.soft_tokens);
        assert_eq!(m.soft_tokens, if kind == AudioKind::Gemma4 { 25 } else { 188 });
        assert!(err < 1e-4, "{}: the GPU's soft tokens differ from the CPU reference's by {err:.2e}", kind.name());
    }
}
