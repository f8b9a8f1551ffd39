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
//! prefill of the whole sequence (in chunks) must be finite at every position and agree with the
//! CPU within the family's bound ([`prefill_bound`]).
//!
//! MoE: a router whose k-th and (k+1)-th logits are closer than the two executors' rounding
//! (1e-6 to 1e-5 on these random weights) may pick another expert on the GPU, and that token's
//! hidden state then differs by O(1), as it would between any two correct engines. So the MoE
//! prefill is compared layer by layer in one step ([`moe_prefill_matches_cpu`]): every hidden state
//! agrees up to the first layer whose expert choice differs, and at that layer every token whose
//! choice differs is a near-tie of the CPU's router.
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

        if cfg.num_experts.is_some() {
            drop(gpu);
            moe_prefill_matches_cpu(name, &cfg, &weights, &seq);
            continue;
        }
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
        let bound = prefill_bound(&cfg);
        println!("{name}: GPU prefill of {} positions, max |Δ| {maxd:.3e} of max|logit| {scale:.3e} (bound {bound:.0e})", seq.len());
        assert!(maxd <= bound * scale, "{name}: max |Δ| {maxd} > {bound:.0e} x {scale}");
    }
}

/// The prefill bound, relative to max|logit|. Gemma 3: about 10x the H100/H200 figure (2.7e-5 over
/// 4,159 positions of the 270M shape). Gemma 4: about 3x the H100 figure of the E2B shape over 1,263
/// positions (2.4e-3 with the f32 GEMM, 7.0e-3 with f16 tiles). Gemma 4's attention has scale 1
/// over unit-RMS queries and keys; on random weights its scores are large and its softmax sharp,
/// so rounding differences grow 3-5x per layer (measured layer by layer on the 26B shape: 1e-5 of
/// the residual's scale after layer 0, 1.4e-3 after layer 5), where Gemma 3's stay near 1e-5.
fn prefill_bound(cfg: &ModelConfig) -> f32 {
    match cfg.family {
        markbase_graph::Family::Gemma3 => 3e-4,
        _ => 2e-2,
    }
}

/// Weight formats of weights in memory, for building graphs outside a [`Model`].
struct Resolver<'a>(&'a markbase::weights::Weights);

impl markbase_graph::builder::WeightResolver for Resolver<'_> {
    fn format(&self, name: &str, _shape: &[usize], _module: bool) -> markbase_graph::WeightFormat {
        let bf16 = markbase_graph::WeightFormat::Float { dtype: markbase_graph::FloatType::Bf16 };
        self.0.get(name).map_or(bf16, |w| w.param.format)
    }
    fn exists(&self, name: &str) -> bool {
        self.0.get(name).is_some()
    }
}

/// The MoE prefill of `seq` in one step, layer by layer, GPU against CPU (see the module docs):
/// the hidden states agree within the family's bound up to the first layer whose top-k expert
/// sets differ anywhere; there each differing token's CPU router has its k-th and (k+1)-th
/// logits within 1e-4 x the largest router logit; the GPU's logits are finite everywhere.
fn moe_prefill_matches_cpu(name: &str, cfg: &ModelConfig, weights: &Arc<markbase::weights::Weights>, seq: &[u32]) {
    use markbase::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
    use markbase::graph::ir::GraphKind;
    use markbase::graph::ops::Op;
    use markbase::graph::passes::{compile, PhasePolicy};
    use markbase::graph::{BuildOptions, Outputs};
    use markbase::gpu::runtime::GpuExecutor;
    use markbase::model::{Executor, GraphKey};
    let n = seq.len();
    let mut o = BuildOptions::prefill(n, n + 8);
    o.chunk = n;
    o.outputs = Outputs::AllLogits;
    o.kind = GraphKind::Prefill;
    let mut g = markbase_graph::build(cfg, &Resolver(weights), &o).unwrap();
    common::mark_layer_outputs(&mut g, cfg.num_layers, cfg.hidden_size).unwrap();
    let mut k = 0;
    for x in g.order() {
        if let Some(Op::TopK { k: kk }) = g.node(x).op() {
            k = *kk;
            let l = g.node(x).layer.unwrap();
            let logits = g.inputs(x)[0];
            g.set_output(&format!("ids_{l}"), x);
            g.set_output(&format!("router_{l}"), logits);
        }
    }
    assert!(k > 0, "{name}: no router in the graph");
    let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
    let positions: Vec<u32> = (0..n as u32).collect();
    let step = StepInputs { tokens: seq, positions: &positions, ..Default::default() };
    let t = std::time::Instant::now();
    let cpu = exec::run(&c, &mut CpuWeights::new(weights.clone()), &mut CpuState::default(), &step).unwrap();
    println!("{name}: CPU prefill of {n} positions in one step, {:.0}s", t.elapsed().as_secs_f64());
    let mut gx = GpuExecutor::new(None, weights.clone(), false).unwrap();
    let key = GraphKey { tokens: n, all_logits: true, sample: false, images: false };
    let logits = gx.run(key, &c, &step, true).unwrap().logits.unwrap();
    assert!(logits.iter().all(|v| v.is_finite()), "{name}: GPU prefill logits not finite");
    let (e, bound) = (cfg.num_experts.unwrap(), prefill_bound(cfg));
    let f32s = |v: Vec<u32>| -> Vec<f32> { v.into_iter().map(f32::from_bits).collect() };
    for l in 0..cfg.num_layers {
        let h = format!("hidden_{l}");
        let (gh, ch) = (f32s(gx.read_output(key, &c, &h).unwrap()), cpu[&h].f());
        let scale = ch.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = gh.iter().zip(ch).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        println!("{name}: layer {l}: hidden max |Δ| {d:.3e} of {scale:.3e}");
        let ids = format!("ids_{l}");
        let mut flips = vec![];
        if cpu.contains_key(&ids) {
            let gi = gx.read_output(key, &c, &ids).unwrap();
            let (ci, cr) = (cpu[&ids].u(), cpu[&format!("router_{l}")].f());
            let rmax = cr.iter().fold(0f32, |a, v| a.max(v.abs()));
            for t in 0..n {
                let (mut a, mut b) = (gi[t * k..(t + 1) * k].to_vec(), ci[t * k..(t + 1) * k].to_vec());
                a.sort_unstable();
                b.sort_unstable();
                if a != b {
                    let mut row = cr[t * e..(t + 1) * e].to_vec();
                    row.sort_by(|x, y| y.total_cmp(x));
                    flips.push((t, (row[k - 1] - row[k]) / rmax));
                }
            }
            if !flips.is_empty() {
                println!("{name}: layer {l}: top-{k} sets differ at {} tokens (gap / max router logit): {flips:?}", flips.len());
                assert!(flips.iter().all(|&(_, gap)| gap <= 1e-4), "{name}: layer {l}: an expert choice differs where the CPU's router is not a near-tie: {flips:?}");
                println!("{name}: the layers after {l} see those tokens' other experts; compared up to here");
                return;
            }
        }
        assert!(d <= bound * scale, "{name}: layer {l}: hidden max |Δ| {d} > {bound:.0e} x {scale} with the same experts everywhere");
    }
    let cl = cpu["logits"].f();
    let scale = cl.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = logits.iter().zip(cl).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    println!("{name}: every expert choice agrees; logits max |Δ| {d:.3e} of {scale:.3e}");
    assert!(d <= bound * scale, "{name}: logits max |Δ| {d} > {bound:.0e} x {scale}");
}
