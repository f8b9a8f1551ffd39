//! One engine, many sessions: sessions share the weights, kernels and compiled graphs of
//! their engine, and each generates exactly what it generates alone, interleaved step by
//! step or on threads of their own.

mod common;

use std::sync::Arc;

use markbase::engine::{DeviceKind, Engine};
use markbase::model::GenerateParams;

const N: usize = 12;

fn params() -> GenerateParams {
    GenerateParams { max_tokens: N, stop_at_eos: false, text: false, ..Default::default() }
}

fn prompts(name: &str) -> [Vec<u32>; 2] {
    let r = common::reference(name);
    [r.tokens[..7].to_vec(), r.tokens[9..20].to_vec()]
}

fn alone(engine: &Arc<Engine>, prompt: &[u32]) -> Vec<u32> {
    let mut s = engine.session().unwrap();
    let out: Vec<u32> = s.generate(prompt, params()).unwrap().map(|p| p.unwrap().token).collect();
    assert_eq!(out.len(), N);
    out
}

fn interleaved_and_threaded(name: &str, device: DeviceKind) {
    let engine = Engine::load(common::fixture(name), common::fixture_options(device)).unwrap();
    let [p1, p2] = prompts(name);
    let (want1, want2) = (alone(&engine, &p1), alone(&engine, &p2));
    assert_ne!(want1, want2, "{name}: the two prompts should continue differently");
    let graphs = engine.compiled_graphs();

    // step by step, alternating
    let (mut a, mut b) = (engine.session().unwrap(), engine.session().unwrap());
    let (mut ga, mut gb) = (a.generate(&p1, params()).unwrap(), b.generate(&p2, params()).unwrap());
    let (mut got1, mut got2) = (vec![], vec![]);
    for _ in 0..N {
        got1.push(ga.next().unwrap().unwrap().token);
        got2.push(gb.next().unwrap().unwrap().token);
    }
    assert!(ga.next().is_none() && gb.next().is_none());
    assert_eq!((&got1, &got2), (&want1, &want2), "{name}: interleaved sessions differ from alone");

    // on two threads at once
    let run = |p: Vec<u32>| {
        let e = engine.clone();
        std::thread::spawn(move || alone(&e, &p))
    };
    let (t1, t2) = (run(p1), run(p2));
    assert_eq!((t1.join().unwrap(), t2.join().unwrap()), (want1, want2), "{name}: threaded sessions differ from alone");
    // the sessions compiled nothing new: the engine's graphs serve them all
    assert_eq!(engine.compiled_graphs(), graphs, "{name}");
}

#[test]
fn sessions_on_one_engine_match_alone_on_gpu() {
    for name in ["gemma3_text-q4", "gemma4_moe-q4"] {
        interleaved_and_threaded(name, DeviceKind::Gpu(None));
    }
}

#[test]
fn sessions_on_one_engine_match_alone_on_cpu() {
    interleaved_and_threaded("gemma4_dense_ple-q4", DeviceKind::Cpu);
}
