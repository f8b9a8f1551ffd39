//! A Gemma 4 prompt with two images (the tiny mlx-vlm fixture): the images encoded from their
//! files, their soft tokens scattered into the prompt's embeddings, the decoder's logits of
//! every position against mlx-vlm's (HF semantics: E2B/E4B decoders stay causal, soft rows
//! are not scaled), on the CPU reference executor and the GPU with NaN checks on.

use std::path::PathBuf;
use std::sync::Arc;

use markbase::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
use markbase::exec::{Executor, GraphKey};
use markbase::graph::passes::{compile, PhasePolicy};
use markbase::graph::BuildOptions;
use markbase::gpu::runtime::GpuExecutor;
use markbase::loader::Checkpoint;
use markbase::model::DeviceKind;
use markbase::vision::encode::{image_prompt, ImageEncoder};
use markbase::vision::load_image;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm/gemma4")
}

fn npy_f32(n: &str) -> Vec<f32> {
    markbase::npy::read_f32(&dir().join(format!("ref/{n}.npy"))).unwrap().data
}

/// Within 5e-4 of max |logit| everywhere; the same argmax wherever the reference's top two
/// are more than 1e-3 of max |logit| apart. Returns the error relative to max |logit|.
fn check_logits(what: &str, got: &[f32], want: &[f32], vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
    let m = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let e = got.iter().zip(want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / m;
    assert!(e <= 5e-4, "{what}: {e:.2e} of max |logit|");
    let argmax = |r: &[f32]| r.iter().enumerate().fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a }).0;
    for (t, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let mut s = w.to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        if s[0] - s[1] > 1e-3 * m {
            assert_eq!(argmax(g), argmax(w), "{what}: position {t}");
        }
    }
    e
}

#[test]
fn gemma4_prompt_with_two_images_matches_mlx_vlm() {
    let cp = Checkpoint::open(dir()).unwrap();
    let vc = cp.vision_config().unwrap().unwrap();
    let ids: Vec<u32> = markbase::npy::read_i32(&dir().join("ref/input_ids.npy")).unwrap().data.iter().map(|&v| v as u32).collect();
    let mut enc = ImageEncoder::open(&dir(), DeviceKind::Cpu, None, false).unwrap();
    let soft: Vec<_> = ["square", "wide"].iter().map(|n| enc.encode(&load_image(&dir().join(format!("{n}.png"))).unwrap()).unwrap()).collect();
    let p = image_prompt(&ids, vc.image_token, &soft).unwrap();
    let t = ids.len();
    let n = p.soft_rows.len() / vc.text_hidden;
    let g = cp.build(BuildOptions { soft_rows: n, ..BuildOptions::prefill(t, t) }).unwrap();
    let (w, _) = cp.load_weights(&g).unwrap();
    let mut g = g;
    let merge = g.g.node_indices().find(|&i| g.node(i).name == "merge_soft_rows").expect("the merge node");
    g.set_output("merged", merge);
    let c = compile(g, PhasePolicy::EmbedLayersHead).unwrap();
    let positions: Vec<u32> = (0..t as u32).collect();
    let step = StepInputs { tokens: &p.tokens, positions: &positions, soft_rows: &p.soft_rows, soft_index: &p.soft_index, ..Default::default() };
    let want = npy_f32("logits");
    let vocab = want.len() / t;
    let w = Arc::new(w);
    let out = exec::run(&c, &mut CpuWeights::new(w.clone()), &mut CpuState::default(), &step).unwrap();
    // the decoder's input: text rows scaled by sqrt(D), image rows the soft tokens as they are
    let merged = npy_f32("merged_embeds");
    let m = merged.iter().fold(0f32, |a, b| a.max(b.abs()));
    let e = out["merged"].f().iter().zip(&merged).fold(0f32, |a, (x, y)| a.max((x - y).abs())) / m;
    println!("cpu merged embeddings: {e:.2e}");
    assert!(e <= 3e-5, "merged embeddings: {e:.2e}");
    let e = check_logits("cpu", out["logits"].f(), &want, vocab);
    println!("cpu logits: {e:.2e} of max |logit|");
    let mut gpu = GpuExecutor::new(None, w, true).unwrap_or_else(|e| panic!("no GPU adapter: {e}"));
    let key = GraphKey { tokens: t, all_logits: true, sample: false };
    let got = gpu.run(key, &c, &step, true).unwrap().logits.unwrap();
    let e = check_logits("gpu", &got, &want, vocab);
    println!("gpu logits: {e:.2e} of max |logit|");
}

#[test]
fn placeholder_counts_must_match_the_images() {
    let soft = markbase::vision::SoftTokens { tokens: 3, width: 2, data: vec![0.5; 6] };
    let e = image_prompt(&[2, 9, 9, 5], 9, &[soft.clone()]).unwrap_err().to_string();
    assert!(e.contains("2 image placeholders") && e.contains("3 soft tokens"), "{e}");
    let ok = image_prompt(&[2, 9, 9, 9, 5], 9, &[soft]).unwrap();
    assert_eq!(ok.soft_index, vec![0, 1, 2, 3, 0]);
    assert_eq!(ok.tokens, vec![2, 0, 0, 0, 5]);
}
