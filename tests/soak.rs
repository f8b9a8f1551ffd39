//! Soak: long greedy generations past every sliding window, for a fast GPU (ignored by
//! default: on lavapipe they would take hours).
//!
//! `MARKBASE_SOAK=gemma3-270m,gemma4-e2b,gemma4-26b-a4b MARKBASE_SOAK_TOKENS=4096
//! cargo test --release --test soak -- --ignored --nocapture`
//!
//! Each model is a synthetic shape (real widths, heads, experts and windows, random 4-bit
//! weights); Gemma 4's are cut to a few layers (`MARKBASE_SOAK_LAYERS`, default 6 for the MoE,
//! 10 for the dense model, with at least one full-attention layer and, for E2B, shared KV) so
//! that the CPU reference can replay the whole sequence. The GPU decodes greedily from a
//! 64-token prompt; then the CPU reference (teacher-forced on the same tokens) must pick the same
//! argmax at >= 99% of the steps, the others near-ties (2e-3 x max|logit|). Last, the GPU's own
//! prefill of the whole sequence must be finite at every position and agree with the CPU
//! within 2e-3 x max|logit| (prefill attention over every chunk and window).

mod common;

use std::sync::Arc;

use markbase::model::{DeviceKind, GenerateParams, Model, ModelOptions};
use markbase_graph::config::ModelConfig;
use markbase_graph::quant::QuantSpec;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// The synthetic shape `name`, cut to `layers` layers where that is asked for.
fn config(name: &str) -> ModelConfig {
    let mut v = markbase::synthetic::config_json(name).unwrap_or_else(|| panic!("unknown synthetic shape {name}"));
    let all = v["num_hidden_layers"].as_u64().unwrap() as usize;
    let default = match name {
        "gemma4-26b-a4b" | "gemma4-31b" => 6,
        "gemma4-e2b" | "gemma4-e4b" => 10,
        _ => all,
    };
    let layers = env_or("MARKBASE_SOAK_LAYERS", default).clamp(1, all);
    if layers < all {
        v["num_hidden_layers"] = layers.into();
        if let Some(shared) = v["num_kv_shared_layers"].as_u64() {
            // keep KV sharing, in the same proportion
            v["num_kv_shared_layers"] = ((shared as usize * layers) / all).into();
        }
    }
    ModelConfig::from_value(&v).unwrap()
}

#[test]
#[ignore]
fn soak_long_generation_matches_cpu_reference() {
    let names = std::env::var("MARKBASE_SOAK").unwrap_or_else(|_| "gemma3-270m,gemma4-e2b,gemma4-26b-a4b".into());
    let n = env_or("MARKBASE_SOAK_TOKENS", 4096);
    let prompt_len = 64;
    let chunk = env_or("MARKBASE_SOAK_CHUNK", 512);
    for name in names.split(',').filter(|s| !s.is_empty()) {
        let cfg = config(name);
        let t = std::time::Instant::now();
        let weights = Arc::new(markbase::synthetic::weights(&cfg, QuantSpec::affine(4, 64)).unwrap());
        println!("{name}: {} layers, weights in {:.0}s", cfg.num_layers, t.elapsed().as_secs_f64());
        let max_context = prompt_len + n + 8;
        let windows = [cfg.sliding_window];
        assert!(windows.iter().all(|&w| prompt_len + n > w), "{name}: the generation must pass every window {windows:?}");
        let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| 3 + (i * 7919) % (cfg.vocab_size as u32 - 3)).collect();

        let opts = ModelOptions { device: DeviceKind::Gpu(None), max_context, prefill_chunk: chunk, ..Default::default() };
        let mut gpu = Model::from_parts(cfg.clone(), weights.clone(), None, &opts).unwrap();
        let params = GenerateParams { max_tokens: n, stop_at_eos: false, text: false, ..Default::default() };
        let t = std::time::Instant::now();
        let gen: Vec<u32> = gpu.generate(&prompt, params).unwrap().map(|x| x.unwrap().token).collect();
        let dt = t.elapsed().as_secs_f64();
        println!("{name}: {}: {prompt_len}-token prompt, {n} tokens in {dt:.1}s ({:.0} tok/s)", gpu.device(), n as f64 / dt);
        assert_eq!(gen.len(), n, "{name}");

        let mut seq = prompt.clone();
        seq.extend_from_slice(&gen[..n - 1]);
        let opts = ModelOptions { device: DeviceKind::Cpu, max_context, prefill_chunk: chunk, ..Default::default() };
        let mut cpu = Model::from_parts(cfg.clone(), weights.clone(), None, &opts).unwrap();
        let t = std::time::Instant::now();
        let rows = cpu.logits(&seq).unwrap();
        println!("{name}: CPU reference, {} positions in {:.0}s", seq.len(), t.elapsed().as_secs_f64());
        common::greedy_agrees(name, &rows, prompt_len, &gen, 2e-3);

        gpu.reset();
        let g = gpu.logits(&seq).unwrap();
        let (mut maxd, mut scale) = (0f32, 0f32);
        for (p, (a, b)) in g.iter().zip(&rows).enumerate() {
            assert!(a.iter().all(|v| v.is_finite()), "{name}: GPU prefill logits not finite at position {p}");
            for (x, y) in a.iter().zip(b) {
                maxd = maxd.max((x - y).abs());
                scale = scale.max(y.abs());
            }
        }
        println!("{name}: GPU prefill of {} positions, max |Δ| {maxd:.3e} of max|logit| {scale:.3e}", seq.len());
        assert!(maxd <= 2e-3 * scale, "{name}: max |Δ| {maxd} > 2e-3 x {scale}");
    }
}
