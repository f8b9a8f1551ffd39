//! The batched decode step (`markbase::batch`) on a tiny Gemma 3 fixture (sliding window 8),
//! on the CPU reference and on the GPU (lavapipe in CI): each sequence's logits against a
//! session running it alone (the one-sequence graphs), and batch invariance: 16 sequences
//! admitted at different steps, greedy and sampled, token-identical to each run alone (also
//! through Gemma 4's mixture-of-experts layers on the GPU); and
//! prompts with an image (the tiny Gemma 3 vision fixture) fed in a batch's slots.

use std::sync::Arc;

use markbase::batch::{Batch, Row};
use markbase::engine::{DeviceKind, Engine, ModelOptions, SampleParams};

const FIXTURE: &str = "tests/fixtures/gemma3_text-q4";
const SEQS: usize = 16;
const GEN: usize = 14;

fn engine(device: DeviceKind) -> Arc<Engine> {
    engine_of(FIXTURE, device)
}

fn engine_of(fixture: &str, device: DeviceKind) -> Arc<Engine> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(fixture);
    Engine::load(dir, ModelOptions { device, max_context: 64, prefill_chunk: 8, ..Default::default() }).expect("the fixture loads (a GPU test needs an adapter)")
}

fn gpu() -> DeviceKind {
    DeviceKind::Gpu(None)
}

/// Prompt `i`: 1 to 19 tokens (some span several prefill chunks of 8).
fn prompt(i: usize) -> Vec<u32> {
    let n = 1 + (i * 7) % 19;
    std::iter::once(2).chain((1..n).map(|j| ((i * 131 + j * 37) % 500 + 3) as u32)).collect()
}

/// Sequence `i`'s sampling: greedy, or temperature with top-p and its own seed, or a
/// repetition penalty.
fn params(i: usize) -> SampleParams {
    match i % 4 {
        1 => SampleParams { temperature: 0.9, top_p: 0.9, seed: 7 + i as u32, ..Default::default() },
        3 => SampleParams { temperature: 0.0, repetition_penalty: 1.3, ..Default::default() },
        _ => SampleParams { temperature: 0.0, ..Default::default() },
    }
}

/// A sequence being generated: its slot, the token to feed, the tokens so far.
struct Live {
    seq: usize,
    slot: usize,
    next: u32,
    out: Vec<u32>,
    /// The logits of each of its decode rows, as bits.
    bits: Vec<u32>,
}

/// Each sequence's tokens, and the bits of its decode rows' logits.
type Runs = Vec<(Vec<u32>, Vec<u32>)>;

/// Runs the sequences `order` through one batch of `slots` slots: sequence `order[k]` is
/// admitted at decode step `start(k)` into the first free slot (its prompt prefilled), and
/// every admitted sequence advances one token per step.
fn run(b: &mut Batch, order: &[usize], start: impl Fn(usize) -> usize) -> Runs {
    let ps: Vec<SampleParams> = (0..SEQS).map(params).collect();
    let v = b.engine().config.vocab_size;
    let mut done: Runs = vec![(vec![], vec![]); SEQS];
    let mut live: Vec<Live> = vec![];
    let mut next = 0;
    let mut step = 0;
    while next < order.len() || !live.is_empty() {
        while next < order.len() && start(next) <= step && live.len() < b.slots() {
            let seq = order[next];
            let slot = (0..b.slots()).find(|s| !live.iter().any(|l| l.slot == *s)).unwrap();
            b.reset(slot);
            let tok = b.prefill(slot, &prompt(seq), false, Some((&ps[seq], 0))).unwrap().token;
            live.push(Live { seq, slot, next: tok, out: vec![tok], bits: vec![] });
            next += 1;
        }
        if !live.is_empty() {
            let rows: Vec<Row> = live.iter().map(|l| Row { slot: l.slot, token: l.next, sampling: &ps[l.seq], step: l.out.len() as u32 }).collect();
            let out = b.decode(&rows, true).unwrap();
            assert_eq!(out.tokens.len(), live.len());
            let logits = out.logits.unwrap();
            for (r, (l, t)) in live.iter_mut().zip(out.tokens).enumerate() {
                l.out.push(t);
                l.next = t;
                l.bits.extend(logits[r * v..(r + 1) * v].iter().map(|x| x.to_bits()));
            }
        }
        live.retain(|l| {
            let end = l.out.len() >= GEN;
            if end {
                done[l.seq] = (l.out.clone(), l.bits.clone());
            }
            !end
        });
        step += 1;
    }
    done
}

fn invariance(device: DeviceKind) {
    invariance_of(FIXTURE, device);
}

fn invariance_of(fixture: &str, device: DeviceKind) {
    let e = engine_of(fixture, device);
    let mut b = Batch::new(&e, SEQS).unwrap();
    let all: Vec<usize> = (0..SEQS).collect();
    // each alone (one row a step), in the last slot
    let alone: Runs = all.iter().map(|&i| run(&mut b, &[i], |_| 0)[i].clone()).collect();
    // all together, admitted two per step in reverse order (row counts 2 to 16, slots reused)
    let rev: Vec<usize> = all.iter().rev().cloned().collect();
    let together = run(&mut b, &rev, |k| k / 2);
    // more sequences than slots would need: 6 slots, admitted as they free up
    let mut small = Batch::new(&e, 6).unwrap();
    let queued = run(&mut small, &all, |_| 0);
    for i in 0..SEQS {
        assert_eq!(alone[i].0.len(), GEN);
        assert_eq!(together[i].0, alone[i].0, "sequence {i}: batched tokens differ from the sequence alone");
        assert_eq!(queued[i].0, alone[i].0, "sequence {i}: tokens in a batch of 6 slots differ from the sequence alone");
        // not only the tokens: every logit of every row, to the bit
        assert!(together[i].1 == alone[i].1, "sequence {i}: batched logits differ from the sequence alone");
        assert!(queued[i].1 == alone[i].1, "sequence {i}: logits in a batch of 6 slots differ from the sequence alone");
    }
    let distinct: std::collections::HashSet<&Vec<u32>> = alone.iter().map(|a| &a.0).collect();
    assert!(distinct.len() > SEQS / 2, "the sequences should continue differently: {alone:?}");
}

#[test]
fn cpu_batched_sequences_match_each_alone() {
    invariance(DeviceKind::Cpu);
}

#[test]
fn gpu_batched_sequences_match_each_alone() {
    invariance(gpu());
}

/// Gemma 4 with mixture-of-experts layers (top-k routing per row): the experts' pairs go
/// through the expert-grouped GEMM, whose tiles hold the pairs of one expert from every row;
/// each pair's sums must still not depend on the others. (The fixture's experts are small
/// enough for the f32 grouped GEMM; real-size experts take the f16 one where it is on, not
/// covered here.)
#[test]
fn gpu_moe_batched_sequences_match_each_alone() {
    invariance_of("tests/fixtures/gemma4_moe-q4", gpu());
}

/// The logits of a batch's rows against a session of the one-sequence graphs feeding the same
/// tokens (the batched ops against the plain ones), and idle rows harmless.
fn logits_match_sessions(device: DeviceKind, bound: f32) {
    let e = engine(device);
    let v = e.config.vocab_size;
    let mut b = Batch::new(&e, 5).unwrap();
    let greedy = SampleParams::default();
    let seqs = [3usize, 8, 11];
    let slots = [4usize, 0, 2];
    let mut sessions: Vec<_> = seqs.iter().map(|_| e.session().unwrap()).collect();
    let mut next = vec![];
    for ((&i, &slot), s) in seqs.iter().zip(&slots).zip(&mut sessions) {
        let p = prompt(i);
        let bl = b.prefill(slot, &p, true, None).unwrap().logits.unwrap();
        let sl = s.forward(&p, true, None).unwrap().logits.unwrap();
        let last = &sl[sl.len() - v..];
        assert_close(&bl, last, bound, "prefill");
        next.push(markbase::cpu::ops::argmax(last));
    }
    for step in 0..12 {
        let rows: Vec<Row> = slots.iter().zip(&next).map(|(&slot, &token)| Row { slot, token, sampling: &greedy, step: 0 }).collect();
        let out = b.decode(&rows, true).unwrap();
        let bl = out.logits.unwrap();
        assert_eq!(bl.len(), b.rows_for(rows.len()) * v);
        for (r, s) in sessions.iter_mut().enumerate() {
            let sl = s.forward(&[next[r]], true, None).unwrap().logits.unwrap();
            assert_close(&bl[r * v..(r + 1) * v], &sl, bound, &format!("decode step {step}, row {r}"));
            assert_eq!(out.tokens[r], markbase::cpu::ops::argmax(&bl[r * v..(r + 1) * v]), "the row's token is its argmax");
            next[r] = markbase::cpu::ops::argmax(&sl);
        }
        for (r, &slot) in slots.iter().enumerate() {
            assert_eq!(b.tokens(slot).len(), sessions[r].tokens().len());
        }
    }
    // the idle slots were never written: a sequence fed there now matches a fresh session
    let p = prompt(5);
    let bl = b.prefill(1, &p, true, None).unwrap().logits.unwrap();
    let sl = e.session().unwrap().forward(&p, true, None).unwrap().logits.unwrap();
    assert_close(&bl, &sl[sl.len() - v..], bound, "a fresh slot");
}

fn assert_close(got: &[f32], want: &[f32], bound: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
    let d = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d <= bound * scale, "{what}: max |diff| {d} over {bound} x {scale}");
}

#[test]
fn cpu_batch_logits_match_sessions() {
    logits_match_sessions(DeviceKind::Cpu, 1e-5);
}

#[test]
fn gpu_batch_logits_match_sessions() {
    logits_match_sessions(gpu(), 2e-3);
}

#[test]
fn bad_rows_are_errors() {
    let e = engine(DeviceKind::Cpu);
    let mut b = Batch::new(&e, 2).unwrap();
    let g = SampleParams::default();
    assert!(b.decode(&[], false).is_err());
    assert!(b.decode(&[Row { slot: 2, token: 1, sampling: &g, step: 0 }], false).unwrap_err().to_string().contains("out of range"));
    let twice = [Row { slot: 0, token: 1, sampling: &g, step: 0 }, Row { slot: 0, token: 1, sampling: &g, step: 0 }];
    assert!(b.decode(&twice, false).unwrap_err().to_string().contains("twice"));
    assert!(b.decode(&[Row { slot: 0, token: 99999, sampling: &g, step: 0 }], false).unwrap_err().to_string().contains("vocabulary"));
    assert!(b.prefill(0, &[2; 65], false, None).unwrap_err().to_string().contains("context"));
    assert!(Batch::new(&e, 0).is_err());
}

/// Prompts with an image in a batch's slots (the tiny Gemma 3 vision fixture, whose image runs
/// attend to themselves): fed a plan step at a time beside a text sequence, their logits match
/// a session's, and so do the decode steps after them.
fn image_prompts_match_sessions(device: DeviceKind, bound: f32) {
    use markbase::vision::{load_image, prompt::Part};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let e = Engine::load(root.join("tests/fixtures/vlm/gemma3"), ModelOptions { device, max_context: 96, prefill_chunk: 16, ..Default::default() }).unwrap();
    let v = e.config.vocab_size;
    let mut b = Batch::new(&e, 3).unwrap();
    let greedy = SampleParams::default();
    b.prefill(0, &[2, 5, 9, 11], false, None).unwrap();
    let mut sessions = vec![];
    let mut next = vec![];
    for (slot, file) in [(2, "square.png"), (1, "wide.png")] {
        let mut s = e.session().unwrap();
        let img = load_image(&root.join("tests/fixtures/vlm/gemma3").join(file)).unwrap();
        let p = s.prompt(&[Part::Text("w1 w2 w3".into()), Part::Image(img), Part::Text("w4".into())], true).unwrap();
        let (ip, steps) = e.plan(&p.ids, &p.soft).unwrap();
        let ip = ip.unwrap();
        assert!(steps.len() > 1 && steps.iter().any(|s| s.1), "{steps:?}");
        // a step at a time, as the server's scheduler feeds them between decode steps
        let mut at = 0;
        let mut bl = None;
        for (k, step) in steps.iter().enumerate() {
            let out = b.prefill_soft(slot, &p.ids, &ip, at, &[*step], k + 1 == steps.len(), None).unwrap();
            at += step.0;
            bl = out.logits;
        }
        let sl = s.forward_with_images(&p.ids, &p.soft, true, None).unwrap().logits.unwrap();
        let last = &sl[sl.len() - v..];
        assert_close(&bl.unwrap(), last, bound, file);
        next.push(markbase::cpu::ops::argmax(last));
        sessions.push((slot, s));
    }
    for step in 0..4 {
        let rows: Vec<Row> = sessions.iter().zip(&next).map(|((slot, _), &token)| Row { slot: *slot, token, sampling: &greedy, step: 0 }).collect();
        let bl = b.decode(&rows, true).unwrap().logits.unwrap();
        for (r, (_, s)) in sessions.iter_mut().enumerate() {
            let sl = s.forward(&[next[r]], true, None).unwrap().logits.unwrap();
            assert_close(&bl[r * v..(r + 1) * v], &sl, bound, &format!("decode step {step}, row {r}"));
            next[r] = markbase::cpu::ops::argmax(&sl);
        }
    }
    // bad pieces are errors
    let (p, ip) = (vec![2u32; 4], e.plan(&[2, 3], &[]).unwrap().0);
    assert!(ip.is_none());
    let s = e.session().unwrap();
    let img = load_image(&root.join("tests/fixtures/vlm/gemma3/square.png")).unwrap();
    let q = s.prompt(&[Part::Image(img)], true).unwrap();
    let qp = e.plan(&q.ids, &q.soft).unwrap().0.unwrap();
    assert!(b.prefill_soft(0, &p, &qp, 0, &[(4, false)], false, None).unwrap_err().to_string().contains("steps to token"));
    assert!(b.prefill_soft(0, &q.ids, &qp, 0, &[(q.ids.len() + 1, false)], false, None).is_err());
}

#[test]
fn cpu_image_prompts_in_a_batch_match_sessions() {
    image_prompts_match_sessions(DeviceKind::Cpu, 1e-5);
}

#[test]
fn gpu_image_prompts_in_a_batch_match_sessions() {
    image_prompts_match_sessions(gpu(), 2e-3);
}
