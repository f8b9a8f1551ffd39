//! Prompts with two images (the tiny mlx-vlm fixtures of Gemma 4 and Gemma 3): the images
//! encoded from their files, their soft tokens scattered into the prompt's embeddings, the
//! decoder's logits of every position against the references (HF semantics: soft rows are not
//! scaled; E2B/E4B decoders stay causal, Gemma 3's image spans attend to themselves
//! bidirectionally), on the CPU reference executor and the GPU with NaN checks on.

use std::path::PathBuf;
use std::sync::Arc;

use markbase::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
use markbase::exec::{Executor, GraphKey};
use markbase::gpu::runtime::GpuExecutor;
use markbase::loader::Checkpoint;
use markbase::model::DeviceKind;
use markbase::vision::encode::{soft_prompt, ImageEncoder, Modality, Placeholders, SoftTokens};
use markbase::vision::load_image;

#[path = "common/prompt_graph.rs"]
mod prompt_graph;

fn dir_of(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm").join(family)
}

fn npy_f32(family: &str, n: &str) -> Vec<f32> {
    markbase::npy::read_f32(&dir_of(family).join(format!("ref/{n}.npy"))).unwrap().data
}

/// Within 5e-4 of max |logit| everywhere; the same argmax wherever the reference's top two
/// are more than 1e-3 of max |logit| apart. Returns the error relative to max |logit|.
fn check_logits(what: &str, got: &[f32], want: &[f32], vocab: usize) -> Result<f32, String> {
    assert_eq!(got.len(), want.len(), "{what}");
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
    let m = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let e = got.iter().zip(want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / m;
    if e > 5e-4 {
        return Err(format!("{what}: {e:.2e} of max |logit|"));
    }
    let argmax = |r: &[f32]| r.iter().enumerate().fold((0, f32::MIN), |a, (i, &v)| if v > a.1 { (i, v) } else { a }).0;
    for (t, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let mut s = w.to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        if s[0] - s[1] > 1e-3 * m && argmax(g) != argmax(w) {
            return Err(format!("{what}: argmax differs at position {t}"));
        }
    }
    Ok(e)
}

/// The fixture prompt of `family` with its two images: the merged embeddings and the logits
/// of every position against the reference `logits`, on the CPU and the GPU (`planted`: a
/// graph edit before compiling, for the planted-bug tests). Returns the CPU's and the GPU's
/// logits errors relative to max |logit|.
pub fn two_image_prompt(family: &str, planted: Option<&dyn Fn(&mut markbase::graph::Graph)>) -> Result<(f32, f32), String> {
    let dir = dir_of(family);
    let cp = Checkpoint::open(&dir).unwrap();
    let vc = cp.vision_config().unwrap().unwrap();
    let ids: Vec<u32> = markbase::npy::read_i32(&dir.join("ref/input_ids.npy")).unwrap().data.iter().map(|&v| v as u32).collect();
    let mut enc = ImageEncoder::open(&dir, DeviceKind::Cpu, None, false).unwrap();
    let soft: Vec<_> = ["square", "wide"].iter().map(|n| enc.encode(&load_image(&dir.join(format!("{n}.png"))).unwrap()).unwrap()).collect();
    let p = soft_prompt(&ids, &Placeholders { image: Some(vc.image_token), audio: None }, &soft).unwrap();
    let t = ids.len();
    let n = p.soft_rows.len() / vc.text_hidden;
    let (c, w) = prompt_graph::merged_graph(&cp, t, n, planted);
    let positions: Vec<u32> = (0..t as u32).collect();
    let until = p.attend_until(0);
    let step = StepInputs { tokens: &p.tokens, positions: &positions, soft_rows: &p.soft_rows, soft_index: &p.soft_index, attend_until: &until, ..Default::default() };
    let want = npy_f32(family, "logits");
    let vocab = want.len() / t;
    let w = Arc::new(w);
    let out = exec::run(&c, &mut CpuWeights::new(w.clone()), &mut CpuState::default(), &step).unwrap();
    // the decoder's input: text rows scaled by sqrt(D), image rows the soft tokens as they are
    let merged = npy_f32(family, "merged_embeds");
    let m = merged.iter().fold(0f32, |a, b| a.max(b.abs()));
    let e = out["merged"].f().iter().zip(&merged).fold(0f32, |a, (x, y)| a.max((x - y).abs())) / m;
    println!("{family} cpu merged embeddings: {e:.2e}");
    assert!(e <= 3e-5, "merged embeddings: {e:.2e}");
    let cpu = check_logits(&format!("{family} cpu"), out["logits"].f(), &want, vocab)?;
    println!("{family} cpu logits: {cpu:.2e} of max |logit|");
    let mut gpu = GpuExecutor::new(None, w, true).unwrap_or_else(|e| panic!("no GPU adapter: {e}"));
    let key = GraphKey { tokens: t, all_logits: true, sample: false, images: false };
    let got = gpu.run(key, &c, &step, true).unwrap().logits.unwrap();
    let e = check_logits(&format!("{family} gpu"), &got, &want, vocab)?;
    println!("{family} gpu logits: {e:.2e} of max |logit|");
    Ok((cpu, e))
}

#[test]
fn gemma4_prompt_with_two_images_matches_mlx_vlm() {
    two_image_prompt("gemma4", None).unwrap();
}

/// Gemma 3: each image's soft tokens attend to each other bidirectionally on every layer
/// (sliding layers within the window), as HF's mask does (mlx-vlm's causal decoder differs:
/// its logits, `logits_causal`, are far from HF's).
#[test]
fn gemma3_prompt_with_two_images_matches_hf_mask() {
    let causal = npy_f32("gemma3", "logits_causal");
    let want = npy_f32("gemma3", "logits");
    let m = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let apart = causal.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs())) / m;
    assert!(apart > 1e-2, "the reference's masks hardly differ: {apart:.2e}");
    two_image_prompt("gemma3", None).unwrap();
}

/// Planted bug: Gemma 3's attention causal inside the image spans too (every attention op
/// reads the plain positions instead of the attention bounds) fails the comparison.
#[test]
fn gemma3_causal_image_spans_fail() {
    let causal = |g: &mut markbase::graph::Graph| {
        use markbase::graph::ir::{InputKind, NodeKind};
        use petgraph::visit::EdgeRef;
        let input = |g: &markbase::graph::Graph, k: InputKind| g.g.node_indices().find(|&n| matches!(g.node(n).kind, NodeKind::Input { input } if input == k));
        let (bounds, pos) = (input(g, InputKind::AttnPositions).expect("attention bounds"), input(g, InputKind::Positions).unwrap());
        let edges: Vec<_> = g.g.edges(bounds).map(|e| (e.id(), e.target(), *e.weight())).collect();
        assert!(!edges.is_empty());
        for (id, to, slot) in edges {
            g.g.remove_edge(id);
            g.g.add_edge(pos, to, slot);
        }
    };
    let e = two_image_prompt("gemma3", Some(&causal)).expect_err("a causal decoder over the image spans passes");
    println!("causal image spans fail: {e}");
}

#[test]
fn image_spans_are_runs_of_image_tokens() {
    assert_eq!(markbase::vision::encode::span_ends(&[2, 7, 9, 9, 9, 8, 9, 5, 9, 9], 9), vec![0, 1, 4, 4, 4, 5, 6, 7, 9, 9]);
}

#[test]
fn placeholder_counts_must_match_the_images() {
    let ph = Placeholders { image: Some(9), audio: None };
    let soft = SoftTokens { tokens: 3, width: 2, data: vec![0.5; 6], kind: Modality::Image };
    let e = soft_prompt(&[2, 9, 9, 5], &ph, std::slice::from_ref(&soft)).unwrap_err().to_string();
    assert!(e.contains("2 image placeholders") && e.contains("3 soft tokens"), "{e}");
    let ok = soft_prompt(&[2, 9, 9, 9, 5], &ph, &[soft]).unwrap();
    assert_eq!(ok.soft_index, vec![0, 1, 2, 3, 0]);
    assert_eq!(ok.tokens, vec![2, 0, 0, 0, 5]);
}

/// Image and audio placeholders interleaved: each kind takes its own rows in order (image
/// rows first in the soft rows, then audio rows), both read as id 0; audio given to a model
/// without audio placeholders, or too few audio placeholders, is refused.
#[test]
fn image_and_audio_runs_take_their_own_rows() {
    let ph = Placeholders { image: Some(9), audio: Some(7) };
    let img = SoftTokens { tokens: 2, width: 2, data: vec![1.0, 1.0, 2.0, 2.0], kind: Modality::Image };
    let clip = SoftTokens { tokens: 2, width: 2, data: vec![3.0, 3.0, 4.0, 4.0], kind: Modality::Audio };
    let p = soft_prompt(&[2, 7, 9, 7, 9, 5], &ph, &[img.clone(), clip.clone()]).unwrap();
    assert_eq!(p.soft_rows, vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0]);
    assert_eq!(p.soft_index, vec![0, 3, 1, 4, 2, 0]);
    assert_eq!(p.tokens, vec![2, 0, 0, 0, 0, 5]);
    // image spans never swallow audio tokens (Gemma 3's bidirectional spans are images only)
    assert_eq!(p.span_ends, vec![0, 1, 2, 3, 4, 5]);
    let e = soft_prompt(&[2, 7, 9, 9, 5], &ph, &[img.clone(), clip.clone()]).unwrap_err().to_string();
    assert!(e.contains("1 audio placeholders") && e.contains("2 soft tokens"), "{e}");
    let e = soft_prompt(&[2, 9, 9, 5], &Placeholders { image: Some(9), audio: None }, &[img, clip]).unwrap_err().to_string();
    assert!(e.contains("takes no audio"), "{e}");
}
