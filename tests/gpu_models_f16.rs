//! Whole model fixtures with the prefill GEMMs on f16 tiles, against mlx-lm's float32 logits,
//! under the same per-fixture bounds as the f32 path (`common::bound`: 10x the observed error,
//! 1e-5 to 1e-4 of max|logit|, far inside the 1e-3 that f16 inputs are allowed) and the same
//! argmax wherever mlx-lm's top-2 gap exceeds 1e-3 x max|logit|. The GEMMs stage each input as
//! a hi + lo pair of f16; one f16 per input (`MARKBASE_COOP_HILO=0`) misses these bounds. Where the adapter has
//! cooperative matrices and `MARKBASE_COOP` is unset or names them, on tensor cores; elsewhere
//! (CI's software rasterizer) on their FMA twin, the same tiling, scaling and f16 rounding.
//! The MoE fixtures' expert GEMMs run grouped on f16 tiles as well (`gemm_f16_grouped`).
//! Without an adapter these tests fail, never skip.

mod common;

use common::{bound, compare, reference, FixtureRun};
use markbase::model::DeviceKind;

fn run(names: &[&str]) {
    // the twin unless asked for cooperative matrices (before any device opens)
    if std::env::var("MARKBASE_COOP").is_err() {
        std::env::set_var("MARKBASE_COOP", "fma");
    }
    // the fixtures' weights are small: every one on the f16 GEMM
    std::env::set_var("MARKBASE_COOP_MIN", "0");
    let mut failed = vec![];
    for name in names {
        let r = reference(name);
        let mut run = FixtureRun::new(name, DeviceKind::Gpu(None), None).unwrap();
        let t = r.tokens.len();
        let (logits, _) = run.step(&r.tokens, false).unwrap();
        let kernels = run.gpu_kernels(t).unwrap();
        let count = |p: &str| kernels.iter().filter(|(_, k)| k.starts_with(p)).count();
        let (f16, f32) = (count("gemm_f16["), count("gemm["));
        assert!(f16 > 0 && f32 == 0, "{name}: {f16} f16 GEMMs and {f32} f32 GEMMs in the {t}-token prefill");
        // the MoE's expert GEMMs: grouped on f16 tiles too
        let (g16, g32) = (count("gemm_f16_grouped["), count("gemm_grouped["));
        assert!(g32 == 0 && (g16 > 0) == name.contains("moe"), "{name}: {g16} f16 and {g32} f32 grouped GEMMs in the {t}-token prefill");
        let names = |p: &str| {
            let mut v: Vec<&str> = kernels.iter().filter(|(_, k)| k.starts_with(p)).map(|(_, k)| k.as_str()).collect();
            v.sort();
            v.dedup();
            v.join(", ")
        };
        match compare(&format!("{name} prefill ({f16} f16 GEMMs, {g16} grouped)"), &logits, &r.prefill, r.vocab, bound(name).logits) {
            Ok(e) => println!("{name}: {f16} f16 GEMMs ({}), {g16} grouped ({}), logits |Δ|/max {e:.2e}", names("gemm_f16["), names("gemm_f16_grouped[")),
            Err(e) => {
                println!("FAIL {e}");
                failed.push(e);
            }
        }
    }
    assert!(failed.is_empty(), "{} fixtures fail:\n{}", failed.len(), failed.join("\n"));
}

#[test]
fn fixtures_with_f16_gemms_match_mlx_lm() {
    run(&[
        "gemma3_text-bf16",
        "gemma3_text-q4",
        "gemma3_text-q8",
        "gemma3_mm-q4",
        "gemma3_text-q3g32",
        "gemma3_text-mxfp4",
        "gemma3_text-nvfp4",
        "gemma4_dense_ple-bf16",
        "gemma4_dense_ple-q4",
        "gemma4_moe-q4",
        "gemma4_moe-nvfp4gs",
    ]);
}
