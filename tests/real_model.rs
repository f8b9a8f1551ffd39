//! The real Gemma 3 270M (converted from Google's GGUF by tools/real_model.py and
//! checked against mlx-lm's float32 outputs by tools/real_model_refs.py).
//! `tools/setup-real-model.sh` (run by tools/test.sh and CI) creates models/;
//! without it these tests fail.
//!
//! The tests on the 4-bit checkpoint share one GPU engine (weights uploaded, kernels and graphs
//! built once), each on a session of its own.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use markbase::model::{DeviceKind, Engine, GenerateParams, Model, ModelOptions};
use markbase::tokenizer::{Message, Tokenizer};

fn models() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models")
}

fn ckpt(name: &str) -> PathBuf {
    let p = models().join(format!("gemma3-270m-{name}"));
    assert!(p.join("model.safetensors").exists(), "{} missing: run tools/setup-real-model.sh", p.display());
    p
}

struct Prompt {
    ids: Vec<u32>,
    gen: Vec<u32>,
    logits: Vec<f32>,
    gap: Vec<f32>,
}

fn refs(name: &str) -> Vec<Prompt> {
    let path = models().join("gemma3-270m-refs").join(format!("{name}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (run tools/setup-real-model.sh)", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |n: &str| -> Vec<u32> {
        st.tensor(n).unwrap().data().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32).collect()
    };
    let floats = |n: &str| -> Vec<f32> {
        st.tensor(n).unwrap().data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    (0..4)
        .map(|k| Prompt {
            ids: ints(&format!("p{k}.prompt_ids")),
            gen: ints(&format!("p{k}.gen_ids")),
            logits: floats(&format!("p{k}.logits")),
            gap: floats(&format!("p{k}.top2_gap")),
        })
        .collect()
}

/// The sliding layers' window (Gemma 3 270M).
const WINDOW: usize = 512;

/// Decode steps of the generation across the sliding window: `MARKBASE_LONG_TOKENS`, else 48
/// (16 before the window's end, 32 after it).
fn long_tokens() -> usize {
    std::env::var("MARKBASE_LONG_TOKENS").ok().and_then(|s| s.parse().ok()).unwrap_or(48)
}

/// A GPU engine of checkpoint `name` with room for every test's sequence.
fn gpu_engine(name: &str) -> Arc<Engine> {
    let max_context = 1100.max(WINDOW + long_tokens() + 8);
    let opts = ModelOptions { device: DeviceKind::Gpu(None), max_context, prefill_chunk: 128, ..Default::default() };
    Engine::load(ckpt(name), opts).unwrap()
}

/// A session on the shared 4-bit GPU engine.
fn q4() -> Model {
    static Q4: OnceLock<Arc<Engine>> = OnceLock::new();
    Q4.get_or_init(|| gpu_engine("q4")).session().unwrap()
}

/// As a fresh sequence, `prompt` then `tokens`: the logits of the prompt's last position and of
/// each of `tokens` (the prompt but its last token is prefilled without logits).
fn logits_after(m: &mut Model, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    let n = prompt.len() - 1;
    m.reset();
    m.forward(&prompt[..n], false, None).unwrap();
    let fed: Vec<u32> = std::iter::once(prompt[n]).chain(tokens.iter().copied()).collect();
    let rows: Vec<Vec<f32>> = m.forward(&fed, true, None).unwrap().logits.unwrap().chunks(m.config.vocab_size).map(|c| c.to_vec()).collect();
    assert_eq!(rows.len(), fed.len());
    rows
}

#[test]
fn tokenizer_and_chat_template() {
    let dir = ckpt("q4");
    let cfg = markbase::cli::read_config(&dir).unwrap();
    let tk = Tokenizer::load(&dir, cfg.bos_token_id, &cfg.eos_token_ids).unwrap();
    assert_eq!(tk.encode("The capital of France is", true).unwrap(), vec![2, 818, 5279, 529, 7001, 563]);
    assert_eq!(tk.encode_chat(&[Message::user("Hi")]).unwrap(), vec![2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107]);
    assert!(tk.stop_ids.contains(&1) && tk.stop_ids.contains(&106), "{:?}", tk.stop_ids);
    for s in ["héllo wörld 你好 🙂", "  two  spaces\n\ttab", "x = [1, 2, 3]  # ok"] {
        let ids = tk.encode(s, false).unwrap();
        assert_eq!(tk.decode(&ids).unwrap(), s);
    }
}

/// Forced decoding of mlx-lm's own greedy tokens (4 prompts x 32 positions: the prompt but its
/// last token prefilled, then that token and mlx-lm's 31 first ones in one step with the logits
/// of every position): argmax agrees at >= 99% of positions, the others near-ties of mlx-lm's
/// logits, and max |logit - mlx-lm| <= 1e-3 x max|logit|.
#[test]
fn forced_decoding_matches_mlx_lm() {
    for name in ["q4", "bf16"] {
        let mut m = if name == "q4" { q4() } else { gpu_engine(name).session().unwrap() };
        let v = m.config.vocab_size;
        let (mut agree, mut total, mut maxd, mut scale) = (0, 0, 0f32, 0f32);
        for (k, p) in refs(name).iter().enumerate() {
            let last = p.gen.len();
            let rows = logits_after(&mut m, &p.ids, &p.gen[..last - 1]);
            for j in 0..last {
                let got = &rows[j];
                let want = &p.logits[j * v..(j + 1) * v];
                for (a, b) in got.iter().zip(want) {
                    assert!(a.is_finite());
                    maxd = maxd.max((a - b).abs());
                    scale = scale.max(b.abs());
                }
                agree += (markbase::cpu::ops::argmax(got) == p.gen[j]) as usize;
                total += 1;
            }
            // a position where the GPU's argmax is not mlx-lm's must be a near-tie of mlx-lm's
            // logits: within twice the logits bound below
            let want_rows = p.logits.chunks(v).take(p.gen.len());
            let chosen: Vec<u32> = rows.iter().map(|r| markbase::cpu::ops::argmax(r)).collect();
            common::near_tie_misses(&format!("{name} p{k}"), want_rows, &chosen, 2e-3).unwrap_or_else(|e| panic!("{e}"));
        }
        println!("{name}: argmax agrees at {agree}/{total}; max |Δ| {maxd:.4} (max |logit| {scale:.2})");
        assert!(agree * 100 >= 99 * total, "{name}: argmax {agree}/{total}");
        assert!(maxd <= 1e-3 * scale, "{name}: max |Δ| {maxd} > 1e-3 x {scale}");
    }
}

/// Greedy generation (the GPU's decode steps) prints mlx-lm's tokens: all 32 for "1, 2, 3, 4,"
/// (top-2 gaps >= 0.7), whose text starts " 5, 6, 7, 8,"; for the other prompts up to the first
/// step whose top-2 gap is under 0.2 (only those steps are decoded: the tokens after a
/// near-tie need not be mlx-lm's).
#[test]
fn greedy_generation_matches_mlx_lm() {
    let mut m = q4();
    let counting = m.tokenizer().unwrap().encode("1, 2, 3, 4,", true).unwrap();
    let mut decoded = 0;
    for (k, p) in refs("q4").iter().enumerate() {
        let upto = if k == 0 { 32 } else { p.gap.iter().position(|&g| g < 0.2).unwrap_or(32) };
        // at least one step, so that every prompt runs its prefill and a decode
        let params = GenerateParams { max_tokens: upto.max(1), stop_at_eos: false, ..Default::default() };
        let pieces: Vec<_> = m.generate(&p.ids, params).unwrap().map(|x| x.unwrap()).collect();
        let got: Vec<u32> = pieces.iter().map(|x| x.token).collect();
        println!("p{k}: comparing {upto} tokens");
        assert_eq!(&got[..upto], &p.gen[..upto], "p{k}");
        decoded += got.len();
        if k == 0 {
            assert_eq!(p.ids, counting, "the first prompt is the counting one");
            let text: String = pieces.iter().map(|x| x.text.as_str()).collect();
            assert!(text.starts_with(" 5, 6, 7, 8,"), "{text:?}");
        }
    }
    println!("{decoded} decode steps");
}

/// A generation that decodes across the 512-token sliding window: a counting prompt of 496 to
/// 511 tokens, then 48 decode steps (`MARKBASE_LONG_TOKENS` sets more, e.g. 4096 on a fast GPU),
/// so that the sliding layers' ring wraps during decode and at least 32 steps run after it.
/// No NaN, and the CPU reference (teacher-forced on the same tokens) picks the same argmax at
/// >= 99% of steps, the others near-ties (within 2e-3 x max|logit|: twice the bound of the
/// forced decoding).
#[test]
fn generation_across_the_sliding_window_matches_cpu_reference() {
    let n = long_tokens();
    let mut m = q4();
    let tk = m.tokenizer().unwrap();
    let (mut text, mut k) = (String::new(), 1);
    let prompt = loop {
        text.push_str(&format!("{k}, "));
        k += 1;
        let ids = tk.encode(&text, true).unwrap();
        if ids.len() >= WINDOW - 16 {
            break ids;
        }
    };
    assert!(prompt.len() < WINDOW && prompt.len() + n >= WINDOW + 32, "the decode must cross the window by 32 steps: {} + {n}", prompt.len());
    assert!(prompt.len() + n <= m.max_context(), "{} + {n} tokens exceed the context", prompt.len());
    let params = GenerateParams { max_tokens: n, stop_at_eos: false, text: false, ..Default::default() };
    let t = std::time::Instant::now();
    let gen: Vec<u32> = m.generate(&prompt, params).unwrap().map(|x| x.unwrap().token).collect();
    println!("GPU: {} prompt tokens, {n} generated in {:.0}s", prompt.len(), t.elapsed().as_secs_f64());
    assert_eq!(gen.len(), n);
    // the CPU reference: the prompt (but its last token) without logits, then the logits of
    // every position from the prompt's last token on
    let opts = ModelOptions { device: DeviceKind::Cpu, max_context: prompt.len() + n, prefill_chunk: 256, ..Default::default() };
    let mut cpu = Model::load(ckpt("q4"), opts).unwrap();
    let t = std::time::Instant::now();
    let rows = logits_after(&mut cpu, &prompt, &gen[..n - 1]);
    println!("CPU reference: {} positions, {n} with logits, in {:.0}s", prompt.len() + n - 1, t.elapsed().as_secs_f64());
    common::greedy_agrees("gemma3-270m q4", &rows, 1, &gen, 2e-3);
}
