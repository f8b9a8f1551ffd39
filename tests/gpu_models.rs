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
