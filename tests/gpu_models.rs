//! Whole models on the GPU against mlx-lm's float32 logits (the same checks as
//! the CPU reference suite). Without an adapter these tests fail, never skip.

mod common;

use markbase::model::DeviceKind;

fn run(names: &[&str]) {
    for name in names {
        let t = std::time::Instant::now();
        let (d, s) = common::check_fixture(name, DeviceKind::Gpu(None));
        println!("{name}: max |Δ| {d:.3e} (max |logit| {s:.2}), {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    }
}

#[test]
fn gemma3_fixtures_match_mlx_lm_on_gpu() {
    run(&[
        "gemma3_text-bf16", "gemma3_text-q4", "gemma3_text-q8", "gemma3_mm-bf16", "gemma3_mm-q4", "gemma3_text-q4sharded",
    ]);
}

#[test]
fn every_quant_mode_matches_mlx_lm_on_gpu() {
    run(&[
        "gemma3_text-q2g64", "gemma3_text-q3g32", "gemma3_text-q5g64", "gemma3_text-q6g128", "gemma3_text-mixed36",
        "gemma3_text-mxfp4", "gemma3_text-mxfp8", "gemma3_text-nvfp4",
    ]);
}

#[test]
fn gemma4_dense_fixtures_match_mlx_lm_on_gpu() {
    run(&["gemma4_dense_ple-bf16", "gemma4_dense_ple-q4", "gemma4_dense_ple-mxfp4"]);
}

#[test]
fn gemma4_moe_fixtures_match_mlx_lm_on_gpu() {
    run(&["gemma4_moe-bf16", "gemma4_moe-q4", "gemma4_moe-nvfp4gs", "gemma4_moe-q4-hfnames", "gemma4_moe-bf16-hffused"]);
}

/// Pipelined GPU generation (next step queued before the token is read, the token
/// fed back on the device) gives the CPU reference's greedy tokens, and the GPU's
/// sampled tokens follow the same seed as the CPU's sampler.
#[test]
fn pipelined_generation_matches_cpu() {
    use markbase::model::{GenerateParams, Model, ModelOptions, SampleParams};
    for name in ["gemma3_text-q4", "gemma4_dense_ple-q4"] {
        let r = common::reference(name);
        let prompt = &r.tokens[..12];
        let run = |device: DeviceKind, sampling: SampleParams| -> Vec<u32> {
            let opts = ModelOptions { device, max_context: 64, prefill_chunk: 16, ..Default::default() };
            let mut m = Model::load(common::fixture(name), opts).unwrap();
            let p = GenerateParams { max_tokens: 40, sampling, stop_at_eos: false, text: false };
            let g: Vec<u32> = m.generate(prompt, p).unwrap().map(|x| x.unwrap().token).collect();
            g
        };
        let greedy = SampleParams::default();
        let cpu = run(DeviceKind::Cpu, greedy);
        let gpu = run(DeviceKind::Gpu(None), greedy);
        assert_eq!(cpu.len(), 40);
        assert_eq!(cpu, gpu, "{name}: greedy tokens differ");
        let hot = SampleParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.0, repetition_penalty: 1.0, seed: 7 };
        let cpu = run(DeviceKind::Cpu, hot);
        let gpu = run(DeviceKind::Gpu(None), hot);
        let same = cpu.iter().zip(&gpu).take_while(|(a, b)| a == b).count();
        println!("{name}: sampled sequences agree on the first {same} of 40 tokens");
        assert!(same >= 20, "{name}: sampled sequences diverge at {same}: cpu {cpu:?} gpu {gpu:?}");
    }
}
