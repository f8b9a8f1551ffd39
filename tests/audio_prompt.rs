//! Audio clips in Gemma 4 prompts (the tiny Gemma 4 fixture of `tools/make_vlm_fixtures.py`,
//! its one-block audio tower and decoder): the soft tokens of a clip's features and the
//! logits of a chat turn holding an image and the clip against mlx-vlm's, on the CPU
//! reference executor and the GPU; the chat prompt of a WAV file against HF's processing;
//! and every kind of bad input, each a typed error.

use std::path::PathBuf;
use std::sync::Arc;

use markbase::audio::encode::AudioEncoder;
use markbase::audio::{self, Features, LoadOptions};
use markbase::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
use markbase::loader::Checkpoint;
use markbase::model::{DeviceKind, GenerateParams, Model, ModelOptions};
use markbase::vision::encode::soft_prompt;
use markbase::vision::load_image;
use markbase::vision::prompt::Part;
use markbase::Error;

#[path = "common/prompt_graph.rs"]
mod prompt_graph;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm/gemma4")
}

fn clip_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/audio/chirp_16k_s32_stereo.wav")
}

fn f32s(name: &str) -> Vec<f32> {
    markbase::npy::read_f32(&dir().join(format!("ref/{name}.npy"))).unwrap().data
}

fn ids(name: &str) -> Vec<u32> {
    markbase::npy::read_i32(&dir().join(format!("ref/{name}.npy"))).unwrap().data.iter().map(|&v| v as u32).collect()
}

fn load(device: DeviceKind, chunk: usize, max_context: usize) -> Model {
    let o = ModelOptions { device, prefill_chunk: chunk, max_context, ..Default::default() };
    Model::load(dir(), o).unwrap_or_else(|e| panic!("{device:?}: {e}"))
}

/// The reference's features of the clip (HF's extractor: 25 frames, the last 4 padding).
fn ref_features() -> Features {
    let data = f32s("audio_features");
    let mask: Vec<bool> = markbase::npy::read_u8(&dir().join("ref/audio_valid.npy")).unwrap().data.iter().map(|&v| v != 0).collect();
    let frames = mask.len();
    Features { frames, bins: data.len() / frames, data, mask, soft_tokens: 0, samples: 0 }
}

/// Max |got − want| over max |want|.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let mx = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    got.iter().zip(want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / mx
}

/// Logits within 5e-4 of max |logit| of the reference, and the same argmax at every position
/// whose reference top-2 gap exceeds 1e-3 of max |logit|. Returns the error.
fn check_logits(what: &str, got: &[f32], want: &[f32], vocab: usize) -> f32 {
    let e = rel_err(got, want);
    let mx = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    assert!(e <= 5e-4, "{what}: logits {e:.2e} of max |logit|");
    let argmax = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap();
    for (pos, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let mut sorted = w.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > 1e-3 * mx {
            assert_eq!(argmax(g), argmax(w), "{what}: argmax at position {pos}");
        }
    }
    e
}

/// The chat turn of the reference, `[image, text, audio]`, on `device` in prefill steps of at
/// most `chunk` tokens: the clip's soft tokens (from the reference's features) and the turn's
/// logits against mlx-vlm's.
fn check_reference(device: DeviceKind, chunk: usize) {
    let mut m = load(device, chunk, 128);
    let img = m.encode_images(&[load_image(&dir().join("square.png")).unwrap()]).unwrap();
    let mut enc = AudioEncoder::open(&dir(), device, true).unwrap();
    let clip = enc.encode_features(&ref_features()).unwrap();
    assert_eq!(clip.tokens, 6, "the tower's 7 rows less the one of padding frames");
    let es = rel_err(&clip.data, &f32s("audio_soft"));
    assert!(es <= 1e-5, "{device:?}: audio soft tokens {es:.2e} of max");
    let ids = ids("audio_chat_ids");
    let soft = [img, vec![clip]].concat();
    let got = m.forward_with_images(&ids, &soft, true, None).unwrap().logits.unwrap();
    let e = check_logits(&format!("{device:?}"), &got, &f32s("audio_logits"), got.len() / ids.len());
    println!("{device:?} chunk {chunk}: audio soft tokens {es:.2e}, logits {e:.2e} of max |logit|");
    // the check sees the clip: its rows swapped end for end fail the bound
    let mut swapped = soft.clone();
    let last = swapped.last_mut().unwrap();
    last.data = last.data.chunks(last.width).rev().flatten().copied().collect();
    m.reset();
    let bad = m.forward_with_images(&ids, &swapped, true, None).unwrap().logits.unwrap();
    let eb = rel_err(&bad, &f32s("audio_logits"));
    assert!(eb > 5e-4, "{device:?}: the clip's rows in reverse order pass ({eb:.2e})");
}

#[test]
fn image_and_clip_prompt_matches_mlx_vlm_on_the_cpu() {
    // steps of 16 tokens: the 64-token image run and the clip's run are cut across steps
    check_reference(DeviceKind::Cpu, 16);
}

#[test]
fn image_and_clip_prompt_matches_mlx_vlm_on_the_gpu() {
    check_reference(DeviceKind::Gpu(None), 32);
}

/// The decoder's input of the reference turn (the prompt's graph with its merge node as an
/// output): text rows scaled by sqrt(D), image and audio rows their soft tokens as they are.
#[test]
fn merged_embeddings_match_mlx_vlm() {
    let cp = Checkpoint::open(dir()).unwrap();
    let m = load(DeviceKind::Cpu, 128, 128);
    let mut soft = m.encode_images(&[load_image(&dir().join("square.png")).unwrap()]).unwrap();
    soft.push(AudioEncoder::open(&dir(), DeviceKind::Cpu, false).unwrap().encode_features(&ref_features()).unwrap());
    let ids = ids("audio_chat_ids");
    let p = soft_prompt(&ids, &m.engine().placeholders(), &soft).unwrap();
    let t = ids.len();
    let (c, w) = prompt_graph::merged_graph(&cp, t, p.soft_rows.len() / cp.config().hidden_size, None);
    let positions: Vec<u32> = (0..t as u32).collect();
    let until = p.attend_until(0);
    let step = StepInputs { tokens: &p.tokens, positions: &positions, soft_rows: &p.soft_rows, soft_index: &p.soft_index, attend_until: &until, ..Default::default() };
    let out = exec::run(&c, &mut CpuWeights::new(Arc::new(w)), &mut CpuState::default(), &step).unwrap();
    let e = rel_err(out["merged"].f(), &f32s("audio_merged_embeds"));
    println!("merged embeddings: {e:.2e} of max");
    assert!(e <= 3e-5, "merged embeddings: {e:.2e}");
}

/// The library's chat prompt of the WAV file itself: the ids are HF's processing of the turn,
/// the logits (our features, within 1e-4 of HF's) the reference's, and a greedy generation
/// runs after it.
#[test]
fn chat_prompt_of_a_wav_file_matches_hf() {
    let mut m = load(DeviceKind::Cpu, 32, 128);
    let samples = audio::load(&clip_path(), &LoadOptions::default()).unwrap();
    let parts = [Part::Image(load_image(&dir().join("square.png")).unwrap()), Part::Text("w23 w31".into()), Part::Audio(samples)];
    let p = m.prompt(&parts, true).unwrap();
    assert_eq!(p.ids, ids("audio_chat_ids"), "chat prompt ids");
    let got = m.forward_with_images(&p.ids, &p.soft, true, None).unwrap().logits.unwrap();
    let e = check_logits("wav", &got, &f32s("audio_logits"), got.len() / p.ids.len());
    println!("chat prompt from the WAV file: logits {e:.2e} of max |logit|");
    let toks: Vec<u32> = m.generate_prompt(&p, GenerateParams { max_tokens: 3, stop_at_eos: false, ..Default::default() }).unwrap().map(|t| t.unwrap().token).collect();
    assert_eq!(toks.len(), 3);
    // the same clip without the chat template: BOS, the text, the clip's run
    let plain = m.prompt(&parts[1..], false).unwrap();
    assert_eq!(&plain.ids[..3], &[2, 23, 31]);
    assert_eq!(plain.ids[3..].iter().filter(|&&t| t == 503).count(), 6);
}

/// Bad input: a missing file, a file that is not audio, a model without an audio tower, a
/// clip over 30 s, empty or too short, NaN samples, markers or audio placeholders that
/// disagree with the clips, and a prompt whose clip overflows the context. Each is a typed
/// error naming the problem.
#[test]
fn audio_input_errors_are_typed() {
    let load_err = |p: &std::path::Path| audio::load(p, &LoadOptions::default()).unwrap_err();
    match load_err(&PathBuf::from("no-such-clip.wav")) {
        Error::Audio(m) => assert!(m.contains("no-such-clip.wav") && m.contains("cannot open"), "{m}"),
        e => panic!("{e:?}"),
    }
    match load_err(&dir().join("square.png")) {
        Error::Audio(m) => assert!(m.contains("square.png"), "{m}"),
        e => panic!("{e:?}"),
    }
    // a model without an audio tower
    let q4 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma3_text-q4");
    let text_only = Model::load(&q4, ModelOptions { device: DeviceKind::Cpu, max_context: 64, ..Default::default() }).unwrap();
    match text_only.prompt(&[Part::Audio(vec![0.1; 1600])], false).unwrap_err() {
        Error::Input(m) => assert!(m.contains("no audio tower"), "{m}"),
        e => panic!("{e:?}"),
    }
    // a clip over the 30 s the model takes
    let m = load(DeviceKind::Cpu, 32, 128);
    match m.prompt(&[Part::Audio(vec![0.1; 16_000 * 31])], false).unwrap_err() {
        Error::Audio(msg) => assert!(msg.contains("31.00 s") && msg.contains("at most 30.00 s"), "{msg}"),
        e => panic!("{e:?}"),
    }
    // no samples, and too few for one frame
    for (clip, want) in [(vec![], "no samples"), (vec![0.1; 10], "too short")] {
        match m.prompt(&[Part::Audio(clip)], false).unwrap_err() {
            Error::Audio(msg) => assert!(msg.contains(want), "{msg}"),
            e => panic!("{e:?}"),
        }
    }
    // NaN samples
    match m.prompt(&[Part::Audio(vec![f32::NAN; 1600])], false).unwrap_err() {
        Error::Audio(msg) => assert!(msg.contains("non-finite"), "{msg}"),
        e => panic!("{e:?}"),
    }
    // markers that disagree with the clips
    let clip = m.encode_clips(&[vec![0.1; 1600]]).unwrap();
    match m.text_prompt("<|audio|> w5 <|audio|>", clip.clone(), true).unwrap_err() {
        Error::Input(msg) => assert!(msg.contains("2 audio markers (<|audio|>) for 1 clips"), "{msg}"),
        e => panic!("{e:?}"),
    }
    // a clip beyond the context: 31 tokens of a 24-token context
    let p = m.prompt(&[Part::Text("w5".into()), Part::Audio(audio::load(&clip_path(), &LoadOptions::default()).unwrap())], false).unwrap();
    let mut small = load(DeviceKind::Cpu, 16, 8);
    match small.generate_prompt(&p, GenerateParams::default()).err().unwrap() {
        Error::Input(msg) => assert!(msg.contains("(6 of them the soft tokens of 1 clip)") && msg.contains("context of 8"), "{msg}"),
        e => panic!("{e:?}"),
    }
    // placeholder runs that disagree with the soft tokens
    let mut m = m;
    match m.forward_with_images(&p.ids[..5], &p.soft, false, None).unwrap_err() {
        Error::Input(msg) => assert!(msg.contains("audio placeholders"), "{msg}"),
        e => panic!("{e:?}"),
    }
}
