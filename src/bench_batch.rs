//! `bench --batch B,..`: the decode step of a batch of B sequences (the server's continuous
//! batching: one row per sequence through every matmul), timed step by step without the HTTP
//! side, so that its kernels can be measured and tuned at each batch size.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::batch::{Batch, Row};
use crate::engine::Engine;
use crate::gpu::runtime::Profile;
use crate::model::{DeviceKind, ModelOptions, SampleParams};
use markbase_graph::ModelConfig;
use crate::weights::Weights;

/// Prompt tokens each sequence holds before its decode steps are timed (at most).
pub const BATCH_PROMPT: usize = 64;

/// Times `gen` decode steps of `b` sequences for each `b` of `sizes` (median of `runs`),
/// after a prompt of up to [`BATCH_PROMPT`] tokens per sequence; with `profile`, the GPU time
/// of one step by op.
pub fn bench_batch(config: &ModelConfig, weights: Arc<Weights>, device: DeviceKind, sizes: &[usize], prompt: usize, gen: usize, runs: usize, profile: bool) -> Result<Vec<Value>, String> {
    let prompt = prompt.clamp(1, BATCH_PROMPT);
    let vocab = config.vocab_size as u32;
    let opts = ModelOptions { device, max_context: prompt + (gen + 2) * runs.max(1) + 8, ..Default::default() };
    let engine = Engine::from_parts(config.clone(), weights, None, &opts).map_err(|e| e.to_string())?;
    let greedy = SampleParams::default();
    let mut out = vec![];
    for &b in sizes {
        let mut batch = Batch::new(&engine, b).map_err(|e| e.to_string())?;
        // a different prompt per sequence
        let mut next = vec![0u32; b];
        for (s, n) in next.iter_mut().enumerate() {
            let ids: Vec<u32> = (0..prompt as u32).map(|i| 2 + (i * 7919 + s as u32 * 104_729) % (vocab - 2)).collect();
            *n = batch.prefill(s, &ids, false, Some((&greedy, 0))).map_err(|e| e.to_string())?.token;
        }
        let mut step = 1u32;
        let mut advance = |batch: &mut Batch, next: &mut Vec<u32>| -> Result<(), String> {
            let rows: Vec<Row> = next.iter().enumerate().map(|(s, &t)| Row { slot: s, token: t, sampling: &greedy, step }).collect();
            let toks = batch.decode(&rows, false).map_err(|e| e.to_string())?.tokens;
            next.copy_from_slice(&toks);
            step += 1;
            Ok(())
        };
        // warm-up: the decode graph and its pipelines
        advance(&mut batch, &mut next)?;
        let mut ms = vec![];
        for _ in 0..runs.max(1) {
            let t = std::time::Instant::now();
            for _ in 0..gen {
                advance(&mut batch, &mut next)?;
            }
            ms.push(t.elapsed().as_secs_f64() * 1e3 / gen as f64);
        }
        ms.sort_by(|a, c| a.total_cmp(c));
        let step_ms = ms[ms.len() / 2];
        let mut rec = json!({
            "sequences": b,
            "rows": batch.rows_for(b),
            "step_ms_median": step_ms,
            "step_ms_runs": ms,
            "tok_s": b as f64 * 1e3 / step_ms,
        });
        if let Some(k) = batch.decode_matmuls(b) {
            rec["matmul_kernels"] = json!(k);
        }
        if profile && !batch.set_profile(Profile::Kernels) {
            eprintln!("note: --profile times GPU dispatches; this backend's steps have no profile");
        } else if profile {
            advance(&mut batch, &mut next)?;
            if let Some(p) = batch.profile() {
                let c = batch.decode_graph(b).map_err(|e| e.to_string())?;
                let (total, by_op) = crate::bench::ops_by_weight(&c, &p);
                rec["gpu_profile_total_ms"] = json!(total * 1e3);
                rec["gpu_profile_by_op"] = json!(by_op);
            }
            batch.set_profile(Profile::Off);
        }
        eprintln!("batch of {b}: {step_ms:.2} ms per step, {:.1} tok/s", b as f64 * 1e3 / step_ms);
        out.push(rec);
    }
    Ok(out)
}
