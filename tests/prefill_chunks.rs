//! A prompt of 100 tokens, far past the fixtures' 8-token sliding window, prefilled in chunks
//! of 4 and 16 (the sliding layers' ring wraps inside a chunk and between chunks): the GPU's
//! logits at every position agree with the CPU reference's within 1e-3 x max|logit| (about 10x
//! the largest error seen on lavapipe, 8.4e-5, for the MoE fixture in chunks of 4).

mod common;

use markbase::model::{DeviceKind, Model, ModelOptions};

#[test]
fn long_chunked_prefill_matches_cpu() {
    for name in ["gemma3_text-q4", "gemma4_dense_ple-q4", "gemma4_moe-q4"] {
        let r = common::reference(name);
        // the fixture's tokens, varied so that the prompt does not repeat
        let tokens: Vec<u32> = (0..100).map(|i| r.tokens[i % r.tokens.len()] ^ (i as u32 % 7)).collect();
        for chunk in [4, 16] {
            let logits = |device: DeviceKind| {
                let opts = ModelOptions { device, max_context: 128, prefill_chunk: chunk, ..Default::default() };
                Model::load(common::fixture(name), opts).unwrap().logits(&tokens).unwrap()
            };
            let (cpu, gpu) = (logits(DeviceKind::Cpu), logits(DeviceKind::Gpu(None)));
            assert_eq!(gpu.len(), tokens.len());
            let scale = cpu.iter().flatten().fold(0f32, |a, v| a.max(v.abs()));
            let mut worst = (0, 0f32);
            for (p, (a, b)) in gpu.iter().zip(&cpu).enumerate() {
                assert!(a.iter().all(|v| v.is_finite()), "{name}: chunks of {chunk}: position {p} not finite");
                let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                if d > worst.1 {
                    worst = (p, d);
                }
            }
            println!("{name}: chunks of {chunk}: max |Δ| {:.3e} of max|logit| {scale:.3e} at position {}", worst.1, worst.0);
            assert!(worst.1 <= 1e-3 * scale, "{name}: chunks of {chunk}: position {} off by {} > 1e-3 x {scale}", worst.0, worst.1);
        }
    }
}
