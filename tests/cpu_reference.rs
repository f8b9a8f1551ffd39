//! The CPU reference executor against mlx-lm's float32 logits on every fixture
//! whose family has a graph builder.

mod common;

use markbase::model::DeviceKind;

fn run(names: &[&str]) {
    common::check_fixtures(names, DeviceKind::Cpu);
}

#[test]
fn gemma3_fixtures_match_mlx_lm() {
    run(&[
        "gemma3_text-bf16", "gemma3_text-q4", "gemma3_text-q8", "gemma3_text-q2g64", "gemma3_text-q3g32",
        "gemma3_text-q5g64", "gemma3_text-q6g128", "gemma3_text-mixed36", "gemma3_text-mxfp4", "gemma3_text-mxfp8",
        "gemma3_text-nvfp4", "gemma3_text-q4sharded", "gemma3_mm-bf16", "gemma3_mm-q4",
    ]);
}

#[test]
fn gemma4_dense_fixtures_match_mlx_lm() {
    run(&["gemma4_dense_ple-bf16", "gemma4_dense_ple-q4", "gemma4_dense_ple-mxfp4"]);
}

#[test]
fn gemma4_moe_fixtures_match_mlx_lm() {
    run(&["gemma4_moe-bf16", "gemma4_moe-q4", "gemma4_moe-nvfp4gs", "gemma4_moe-q4-hfnames", "gemma4_moe-bf16-hffused"]);
}
