//! KV caches split across storage bindings (`markbase::gpu::kv`): with the KV binding limit
//! lowered to a few slots' bytes, every cache of the tiny fixtures spans several buffers (the
//! full-attention caches 6 to 11, the sliding rings 2), and the GPU's logits are those of the
//! same GPU with one buffer per cache and of the CPU reference, through a prefill whose steps
//! cross chunk boundaries and decode steps at every position across them and around the rings.

mod common;

use markbase::model::{DeviceKind, GenerateParams, GraphKey, Model, ModelOptions};

const CONTEXT: usize = 64;
const CHUNK: usize = 16;
/// 12 slots of the fixtures' 256-byte rows (2 kv heads of 32), 6 of Gemma 4's global 512-byte
/// rows (head dim 64).
const KV_BINDING: u64 = 3072;
/// The sequence: the prompt is prefilled (steps of 16 and 8), the rest decoded one by one.
const LEN: usize = 60;
const PROMPT: usize = 22;

fn model(name: &str, device: DeviceKind, kv: Option<u64>) -> Model {
    let opts = ModelOptions { device, max_context: CONTEXT, prefill_chunk: CHUNK, max_kv_binding: kv, ..Default::default() };
    Model::load(common::fixture(name), opts).unwrap()
}

/// The fixture's reference tokens, repeated to `LEN`.
fn sequence(name: &str) -> Vec<u32> {
    let r = common::reference(name);
    (0..LEN).map(|i| r.tokens[i % r.tokens.len()]).collect()
}

/// Logits of every position: the prompt prefilled, then one decode step per token.
fn stepped(m: &mut Model, seq: &[u32]) -> Vec<f32> {
    m.reset();
    let mut rows = m.forward(&seq[..PROMPT], true, None).unwrap().logits.unwrap();
    for &t in &seq[PROMPT..] {
        rows.extend(m.forward(&[t], true, None).unwrap().logits.unwrap());
    }
    rows
}

/// The kernels of graph `key` (run once) that take a cache chunk.
fn chunk_kernels(m: &mut Model, key: GraphKey) -> usize {
    m.gpu_kernels(key).unwrap().iter().filter(|(_, k)| k.contains("chunk")).count()
}

fn check(name: &str) {
    let seq = sequence(name);
    let vocab = common::reference(name).vocab;
    let bound = common::bound(name).logits;
    // another summation order than one buffer's (more splits): a quarter of the fixture's
    // bound from mlx-lm (1e-5 on Gemma 3; Gemma 4 amplifies such changes ~10x)
    let near = bound / 4.0;
    let mut cpu = model(name, DeviceKind::Cpu, None);
    let mut whole = model(name, DeviceKind::Gpu(None), None);
    let mut chunked = model(name, DeviceKind::Gpu(None), Some(KV_BINDING));
    let want: Vec<f32> = cpu.logits(&seq).unwrap().concat();

    // prefill of the whole sequence in steps of 16, 16, 16, 8, 4
    let one = whole.logits(&seq).unwrap().concat();
    let got = chunked.logits(&seq).unwrap().concat();
    let d = common::compare(&format!("{name}: chunked prefill vs one buffer"), &got, &one, vocab, near).unwrap();
    let c = common::compare(&format!("{name}: chunked prefill vs CPU"), &got, &want, vocab, bound).unwrap();
    let w = common::compare(&format!("{name}: one-buffer prefill vs CPU"), &one, &want, vocab, bound).unwrap();
    println!("{name}: prefill: {d:.1e} from one buffer, {c:.1e} from the CPU (one buffer: {w:.1e})");
    let key = |tokens| GraphKey { tokens, all_logits: true, sample: false, images: false };
    assert!(chunk_kernels(&mut chunked, key(16)) > 0, "{name}: the prefill took no cache chunk");
    assert_eq!(chunk_kernels(&mut whole, key(16)), 0, "{name}: one-buffer caches took chunk kernels");

    // decode steps at positions 22..59: across chunk boundaries and the sliding rings' wraps
    let one = stepped(&mut whole, &seq);
    let got = stepped(&mut chunked, &seq);
    let d = common::compare(&format!("{name}: chunked decode vs one buffer"), &got, &one, vocab, near).unwrap();
    let c = common::compare(&format!("{name}: chunked decode vs CPU"), &got, &want, vocab, bound).unwrap();
    let w = common::compare(&format!("{name}: one-buffer decode vs CPU"), &one, &want, vocab, bound).unwrap();
    println!("{name}: decode: {d:.1e} from one buffer, {c:.1e} from the CPU (one buffer: {w:.1e})");
    assert!(chunk_kernels(&mut chunked, key(1)) > 0, "{name}: the decode took no cache chunk");

    // a pipelined greedy generation gives the same tokens
    let p = GenerateParams { max_tokens: 36, stop_at_eos: false, text: false, ..Default::default() };
    let gen = |m: &mut Model| -> Vec<u32> { m.generate(&seq[..20], p.clone()).unwrap().map(|x| x.unwrap().token).collect() };
    assert_eq!(gen(&mut chunked), gen(&mut whole), "{name}: generations differ");
}

#[test]
fn gemma3_chunked_caches_match_one_buffer_and_the_cpu() {
    check("gemma3_text-q4");
}

/// Gemma 4: its last layers read the caches of earlier ones (KV sharing); the MoE fixture's
/// full-attention layers take their values from the keys.
#[test]
fn gemma4_chunked_caches_match_one_buffer_and_the_cpu() {
    check("gemma4_dense_ple-q4");
    check("gemma4_moe-q4");
}

/// Caches of one buffer per layer take the kernels and dispatches they always took: a lowered
/// limit the caches fit changes nothing.
#[test]
fn caches_within_the_limit_are_one_buffer() {
    let name = "gemma3_text-q4";
    let seq = sequence(name);
    let mut whole = model(name, DeviceKind::Gpu(None), None);
    let mut roomy = model(name, DeviceKind::Gpu(None), Some(64 * 256));
    let a = whole.logits(&seq[..24]).unwrap();
    let b = roomy.logits(&seq[..24]).unwrap();
    assert_eq!(a, b);
    let key = GraphKey { tokens: 16, all_logits: true, sample: false, images: false };
    assert_eq!(whole.gpu_kernels(key).unwrap(), roomy.gpu_kernels(key).unwrap());
}
