//! The library's checks of user input, its stop reasons and continued sequences
//! (CPU executor on a tiny fixture).

use markbase::memory::Needs;
use markbase::model::{DeviceKind, GenerateParams, Model, ModelOptions, SampleParams, StopReason};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gemma3_text-q4");

fn cpu_model(max_context: usize) -> Result<Model, markbase::Error> {
    Model::load(FIXTURE, ModelOptions { device: DeviceKind::Cpu, max_context, prefill_chunk: 8, ..Default::default() })
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams { max_tokens, stop_at_eos: false, ..Default::default() }
}

#[test]
fn sampling_parameters_are_validated() {
    let ok = SampleParams::default();
    assert!(ok.validate().is_ok());
    assert!(SampleParams { temperature: 0.7, top_k: 40, top_p: 0.9, min_p: 0.05, repetition_penalty: 1.1, seed: 3 }.validate().is_ok());
    assert!(SampleParams { top_p: 1.0, min_p: 1.0, ..ok }.validate().is_ok());
    let bad = [
        (SampleParams { temperature: f32::NAN, ..ok }, "temperature"),
        (SampleParams { temperature: -0.1, ..ok }, "temperature"),
        (SampleParams { temperature: f32::INFINITY, ..ok }, "temperature"),
        (SampleParams { top_p: 0.0, ..ok }, "top-p"),
        (SampleParams { top_p: 1.5, ..ok }, "top-p"),
        (SampleParams { top_p: f32::NAN, ..ok }, "top-p"),
        (SampleParams { min_p: 5.0, ..ok }, "min-p"),
        (SampleParams { min_p: -0.5, ..ok }, "min-p"),
        (SampleParams { repetition_penalty: 0.0, ..ok }, "repetition penalty"),
        (SampleParams { repetition_penalty: f32::NAN, ..ok }, "repetition penalty"),
    ];
    let mut m = cpu_model(64).unwrap();
    for (p, what) in bad {
        let e = p.validate().unwrap_err();
        assert!(e.contains(what), "{p:?}: {e}");
        // and the model refuses them too
        let e = m.generate(&[2, 5, 9], GenerateParams { sampling: p, ..Default::default() }).err().expect("accepted");
        assert!(matches!(e, markbase::Error::Sampling(_)), "{e:?}");
        assert!(e.to_string().contains(what), "{e}");
        assert!(m.forward(&[2, 5], false, Some(&p)).is_err());
    }
}

#[test]
fn context_lengths_are_checked_in_the_users_terms() {
    let e = cpu_model(0).err().unwrap();
    assert!(matches!(e, markbase::Error::Input(_)), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("at least 1 token"), "{e}");
    // the fixture's config has 1024 positions
    let e = cpu_model(4096).err().unwrap().to_string();
    assert!(e.contains("1024 positions") && e.contains("max_position_embeddings"), "{e}");
    assert!(cpu_model(1024).is_ok());
    let mut m = cpu_model(8).unwrap();
    let e = m.generate(&[2; 9], greedy(4)).err().unwrap().to_string();
    assert!(e.contains("9 tokens") && e.contains("context of 8"), "{e}");
}

#[test]
fn generation_says_why_it_stopped() {
    let mut m = cpu_model(12).unwrap();
    let mut g = m.generate(&[2, 5, 9, 11], greedy(40)).unwrap();
    let n = g.by_ref().map(|p| p.unwrap()).count();
    // 4 prompt tokens: 8 more positions, and the token sampled after the last one
    assert_eq!(n, 9);
    assert_eq!(g.stop_reason(), Some(StopReason::ContextFull));
    drop(g);
    let mut g = m.generate(&[2, 5, 9, 11], greedy(3)).unwrap();
    assert_eq!(g.by_ref().count(), 3);
    assert_eq!(g.stop_reason(), Some(StopReason::MaxTokens));
    drop(g);
    let mut g = m.generate(&[2, 5], greedy(0)).unwrap();
    assert_eq!(g.by_ref().count(), 0);
    assert_eq!(g.stop_reason(), Some(StopReason::MaxTokens));
}

#[test]
fn a_continued_sequence_matches_a_fresh_one() {
    let first = [2u32, 5, 9, 11, 17];
    let turn = [23u32, 29, 31];
    let mut m = cpu_model(64).unwrap();
    let produced: Vec<u32> = m.generate(&first, greedy(4)).unwrap().map(|p| p.unwrap().token).collect();
    // the last token is not fed yet: the caches hold the prompt and all but it
    assert_eq!(m.tokens(), [&first[..], &produced[..3]].concat());
    let mut next: Vec<u32> = produced[3..].to_vec();
    next.extend_from_slice(&turn);
    let cached = m.position();
    let runs = m.runs;
    let cont: Vec<u32> = m.generate_after(&next, greedy(5)).unwrap().map(|p| p.unwrap().token).collect();
    // one prefill chunk of the new tokens, then 4 decode steps
    assert_eq!(m.runs - runs, 5);
    let all = [&first[..], &produced[..], &turn[..]].concat();
    assert_eq!(cached + next.len(), all.len());
    let fresh: Vec<u32> = m.generate(&all, greedy(5)).unwrap().map(|p| p.unwrap().token).collect();
    assert_eq!(cont, fresh);
    // a sliding-window layer (8 positions) has overwritten what an earlier cut needs
    let len = m.position();
    assert!(len > 8);
    assert!(!m.truncate(3));
    assert_eq!(m.position(), len);
    assert!(m.truncate(len - 1));
    // within the window, a cut sequence continues as a fresh one does
    let _ = m.generate(&[2, 5, 9], greedy(3)).unwrap().count();
    assert_eq!(m.position(), 5);
    assert!(m.truncate(2));
    let cut: Vec<u32> = m.generate_after(&[13], greedy(3)).unwrap().map(|p| p.unwrap().token).collect();
    let fresh: Vec<u32> = m.generate(&[2, 5, 13], greedy(3)).unwrap().map(|p| p.unwrap().token).collect();
    assert_eq!(cut, fresh);
}

#[test]
fn buffers_are_checked_against_the_device() {
    // one layer's keys: 512 MiB in 4096 slots of 128 KiB
    let n = Needs { kv_bytes: 4 << 30, largest_kv: 512 << 20, kv_rows: vec![(4096, 128 << 10)], largest_pool: 1 << 20, pool_bytes: 1 << 20, towers: vec![] };
    let limits = wgpu::Limits { max_storage_buffer_binding_size: 128 << 20, ..Default::default() };
    // caches over the binding limit are chunked
    assert!(n.fit_gpu("some adapter", &limits, 128 << 20, false).is_ok());
    // unless they need more chunks than the attention merges
    let e = n.fit_gpu("some adapter", &limits, 1 << 20, false).unwrap_err();
    assert!(e.contains("512 chunks") && e.contains("--max-context"), "{e}");
    let roomy = wgpu::Limits { max_storage_buffer_binding_size: 1 << 30, max_buffer_size: 1 << 30, ..Default::default() };
    assert!(n.fit_gpu("some adapter", &roomy, 1 << 30, false).is_ok());
    // intermediate buffers are not chunked
    let big_pool = Needs { largest_pool: 512 << 20, ..n.clone() };
    let e = big_pool.fit_gpu("some adapter", &limits, 128 << 20, false).unwrap_err();
    assert!(e.contains("512 MiB") && e.contains("128 MiB storage binding limit") && e.contains("--max-context"), "{e}");
    let small_buffers = wgpu::Limits { max_buffer_size: 256 << 20, ..roomy };
    assert!(big_pool.fit_gpu("some adapter", &small_buffers, 1 << 30, false).unwrap_err().contains("256 MiB buffer limit"));
    let huge = Needs { kv_bytes: u64::MAX / 2, ..n.clone() };
    let e = huge.fit_host().unwrap_err();
    assert!(e.contains("lower --max-context"), "{e}");
    // a software adapter's caches are host memory
    let e = huge.fit_gpu("some adapter", &roomy, 1 << 30, true).unwrap_err();
    assert!(e.contains("memory") && e.contains("lower --max-context"), "{e}");
    assert!(Needs { kv_bytes: 1 << 20, ..n }.fit_host().is_ok());
}
