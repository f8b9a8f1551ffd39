//! GPU allocations that cannot succeed come back as errors naming the buffer and the
//! limit, never as a panic from wgpu's error handler. Runs on whatever adapter
//! `MARKBASE_BACKEND` picks (lavapipe in CI); without one the tests fail.

mod common;

use std::sync::Arc;

use markbase::cpu::exec::StepInputs;
use markbase::graph::passes::{compile, PhasePolicy};
use markbase::graph::BuildOptions;
use markbase::gpu::device::{fmt_bytes, Gpu};
use markbase::gpu::runtime::GpuExecutor;
use markbase::loader::Checkpoint;
use markbase::model::{Executor, GraphKey};

fn gpu() -> Gpu {
    Gpu::new().unwrap_or_else(|e| panic!("these tests need a GPU adapter (source tools/gpu-env.sh): {e}"))
}

#[test]
fn buffer_over_the_binding_limit_is_an_error_naming_it() {
    let gpu = gpu();
    let limit = gpu.limits().max_storage_buffer_binding_size;
    let e = gpu.try_storage("test buffer over the binding limit", limit + 4).unwrap_err().to_string();
    assert!(e.contains("test buffer over the binding limit"), "{e}");
    assert!(e.contains(&fmt_bytes(limit + 4)) && e.contains(&fmt_bytes(limit)), "{e}");
    assert!(e.contains("storage binding limit"), "{e}");
    // a buffer exactly at a small size still works after the refusal
    let b = gpu.try_storage("small buffer", 64).unwrap();
    assert_eq!(b.size(), 64);
}

#[test]
fn buffer_over_the_buffer_size_limit_is_an_error_naming_it() {
    let gpu = gpu();
    let limit = gpu.limits().max_buffer_size;
    let e = gpu.try_staging("test staging over the size limit", limit + 4).unwrap_err().to_string();
    assert!(e.contains("test staging over the size limit"), "{e}");
    assert!(e.contains(&fmt_bytes(limit)) && e.contains("buffer size limit"), "{e}");
    let e = gpu.try_upload("test upload", &[]).map(|b| b.size()).unwrap();
    assert_eq!(e, 4);
}

/// A full-attention layer's cache larger than one storage binding is split over several
/// (`gpu::kv`): the step runs, and gives the token of the same step with a small cache.
#[test]
fn kv_cache_over_the_binding_limit_runs_in_chunks() {
    let name = "gemma3_text-q4";
    let ck = Checkpoint::open(common::fixture(name)).unwrap();
    let cfg = ck.config();
    let probe = gpu();
    let limit = probe.limits().max_storage_buffer_binding_size;
    drop(probe);
    // a full-attention layer's key cache: max_context slots of kv_heads * head_dim f32
    let slot_bytes = (cfg.num_kv_heads * cfg.head_dim * 4) as u64;
    let step = StepInputs { tokens: &[2], positions: &[0], ..Default::default() };
    let key = GraphKey { tokens: 1, all_logits: false, sample: false, images: false };
    let mut tokens = vec![];
    for max_context in [64, (limit / slot_bytes + 64) as usize] {
        let g = ck.build(BuildOptions::prefill(1, max_context)).unwrap();
        let (w, _) = ck.load_weights(&g).unwrap();
        let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
        let mut exec = GpuExecutor::new(None, Arc::new(w), false).unwrap();
        let out = exec.run(key, &c, &step, false).unwrap_or_else(|e| panic!("max_context {max_context}: {e}"));
        tokens.push(out.token);
    }
    assert_eq!(tokens[0], tokens[1], "the chunked cache's step gives another token");
}

#[test]
fn device_error_during_a_step_is_an_error_of_the_step() {
    let name = "gemma3_text-q4";
    let ck = Checkpoint::open(common::fixture(name)).unwrap();
    let g = ck.build(BuildOptions::prefill(1, 64)).unwrap();
    let (w, _) = ck.load_weights(&g).unwrap();
    let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
    let mut exec = GpuExecutor::new(None, Arc::new(w), false).unwrap();
    let step = StepInputs { tokens: &[2], positions: &[0], ..Default::default() };
    let key = GraphKey { tokens: 1, all_logits: false, sample: false, images: false };
    exec.run(key, &c, &step, false).expect("a step on intact buffers");
    // the prepared bind groups still hold the KV caches: the next submission is invalid
    exec.destroy_states();
    let step = StepInputs { tokens: &[2], positions: &[1], ..Default::default() };
    let e = exec.run(key, &c, &step, false).unwrap_err();
    assert!(e.contains("device error during a step"), "{e}");
    // and it stays an error: the device's results can no longer be trusted
    let e = exec.run(key, &c, &step, false).unwrap_err();
    assert!(e.contains("device error during a step"), "{e}");
}
