//! Images in generation through the library's session API (the tiny Gemma 3 and Gemma 4
//! vision fixtures, with their tokenizers and chat templates): the chat prompt of an image and
//! text against Hugging Face's processor, the prompt's logits in small prefill steps and the
//! greedy continuation against the references (Gemma 3: HF's image-span mask), on the CPU
//! reference executor and the GPU; and the input errors.

use std::path::PathBuf;

use markbase::engine::span_steps;
use markbase::model::{DeviceKind, GenerateParams, Model, ModelOptions};
use markbase::vision::load_image;
use markbase::vision::prompt::Part;

fn dir(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm").join(family)
}

fn ids(family: &str, name: &str) -> Vec<u32> {
    markbase::npy::read_i32(&dir(family).join(format!("ref/{name}.npy"))).unwrap().data.iter().map(|&v| v as u32).collect()
}

/// The chat turn of the references: the square image, then text.
fn parts(family: &str) -> Vec<Part> {
    vec![Part::Image(load_image(&dir(family).join("square.png")).unwrap()), Part::Text("w17 w29 w40".into())]
}

fn load(family: &str, device: DeviceKind, chunk: usize) -> Model {
    let o = ModelOptions { device, prefill_chunk: chunk, max_context: 128, ..Default::default() };
    Model::load(dir(family), o).unwrap_or_else(|e| panic!("{family} on {device:?}: {e}"))
}

/// The chat prompt's ids equal HF's; its logits (fed in prefill steps of at most `chunk`
/// tokens) are within 5e-4 of max |logit| of the reference; the greedy continuation is the
/// reference's. Returns the logits error.
fn check(family: &str, device: DeviceKind, chunk: usize) -> f32 {
    let mut m = load(family, device, chunk);
    let p = m.prompt(&parts(family), true).unwrap();
    assert_eq!(p.ids, ids(family, "chat_ids"), "{family}: chat prompt ids");
    // the generation's graphs compiled up front
    let params = GenerateParams { max_tokens: 4, stop_at_eos: false, ..Default::default() };
    m.prepare_with_images(&p.ids, &p.soft, &params.sampling).unwrap();
    let compiled = m.engine().compiled_graphs();
    let toks: Vec<u32> = m.generate_prompt(&p, params).unwrap().map(|t| t.unwrap().token).collect();
    assert_eq!(toks, ids(family, "chat_greedy"), "{family} {device:?}: greedy tokens");
    assert_eq!(m.engine().compiled_graphs(), compiled, "graphs compiled during the generation");
    let want = markbase::npy::read_f32(&dir(family).join("ref/chat_logits.npy")).unwrap().data;
    m.reset();
    let got = m.forward_with_images(&p.ids, &p.soft, true, None).unwrap().logits.unwrap();
    let want = &want[..got.len()];
    let mx = want.iter().fold(0f32, |a, b| a.max(b.abs()));
    let e = got.iter().zip(want).fold(0f32, |a, (g, w)| a.max((g - w).abs())) / mx;
    assert!(e <= 5e-4, "{family} {device:?}: prompt logits {e:.2e} of max |logit|");
    println!("{family} {device:?} chunk {chunk}: prompt logits {e:.2e} of max |logit|, greedy tokens {toks:?}");
    e
}

/// Gemma 3's image span (16 soft tokens) fed in one step although steps are of 16 tokens at
/// most: the step before it ends at its start.
#[test]
fn gemma3_image_chat_on_cpu_and_gpu() {
    let n = ids("gemma3", "chat_ids").len();
    assert_eq!(span_steps(n, 16, &[(4, 20)]).unwrap(), [4, 16, 4, 2, 1]);
    check("gemma3", DeviceKind::Cpu, 16);
    check("gemma3", DeviceKind::Gpu(None), 16);
}

/// Gemma 4 stays causal over images: its 64-token run may be cut into steps.
#[test]
fn gemma4_image_chat_on_cpu_and_gpu() {
    check("gemma4", DeviceKind::Cpu, 16);
    check("gemma4", DeviceKind::Gpu(None), 32);
}

#[test]
fn steps_never_cut_a_span() {
    assert_eq!(span_steps(40, 16, &[]).unwrap(), [16, 16, 8]);
    assert_eq!(span_steps(40, 16, &[(10, 22), (30, 38)]).unwrap(), [8, 16, 16]);
    assert_eq!(span_steps(40, 16, &[(10, 22), (23, 38)]).unwrap(), [8, 2, 12, 16, 2]);
    assert_eq!(span_steps(20, 16, &[(0, 16)]).unwrap(), [16, 4]);
    let e = span_steps(40, 16, &[(2, 20)]).unwrap_err().to_string();
    assert!(e.contains("an image of 18 soft tokens") && e.contains("prefill step of 16"), "{e}");
    for n in 1..60 {
        let spans = [(3usize.min(n), 9usize.min(n)), (20usize.min(n), 31usize.min(n))];
        let steps = span_steps(n, 16, &spans).unwrap();
        assert_eq!(steps.iter().sum::<usize>(), n);
        let mut at = 0;
        for s in steps {
            at += s;
            assert!(!spans.iter().any(|&(a, b)| a < at && at < b), "{n}: a step ends at {at}, inside a span");
        }
    }
}

#[test]
fn image_input_errors() {
    // a model without a vision tower
    let q4 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma3_text-q4");
    let m = Model::load(&q4, ModelOptions { device: DeviceKind::Cpu, max_context: 64, ..Default::default() }).unwrap();
    let e = m.prompt(&parts("gemma3"), false).unwrap_err().to_string();
    assert!(e.contains("no vision tower"), "{e}");
    // images beyond the context
    let mut m = load("gemma3", DeviceKind::Cpu, 16);
    let p = m.prompt(&[parts("gemma3"), parts("gemma3")].concat(), false).unwrap();
    let mut m2 = Model::load(dir("gemma3"), ModelOptions { device: DeviceKind::Cpu, max_context: 24, prefill_chunk: 16, ..Default::default() }).unwrap();
    let e = m2.generate_prompt(&p, GenerateParams::default()).err().unwrap().to_string();
    assert!(e.contains(&format!("the prompt has {} tokens (32 of them the soft tokens of 2 images)", p.ids.len())) && e.contains("context of 24"), "{e}");
    // markers that disagree with the images
    let e = m.text_prompt("<start_of_image> w5 <start_of_image>", p.soft[..1].to_vec(), true).unwrap_err().to_string();
    assert!(e.contains("2 image markers (<start_of_image>) for 1 images"), "{e}");
    // placeholder runs that disagree with the soft tokens
    let e = m.forward_with_images(&p.ids[..10], &p.soft, false, None).unwrap_err().to_string();
    assert!(e.contains("image placeholders"), "{e}");
}

/// Gemma 3 with pan-and-scan on (crops of at least 32 px): the wide image makes two crops, and
/// the prompt holds HF's sentence around the whole image's run and the crops' (ids equal to
/// `Gemma3Processor`'s); the three runs are fed whole.
#[test]
fn gemma3_pan_and_scan_prompt_matches_hf() {
    let src = dir("gemma3");
    let tmp = std::env::temp_dir().join(format!("markbase-pan-and-scan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() && e.file_name() != "preprocessor_config.json" {
            std::fs::copy(e.path(), tmp.join(e.file_name())).unwrap();
        }
    }
    let mut pc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("preprocessor_config.json")).unwrap()).unwrap();
    pc["do_pan_and_scan"] = true.into();
    pc["pan_and_scan_min_crop_size"] = 32.into();
    std::fs::write(tmp.join("preprocessor_config.json"), pc.to_string()).unwrap();
    let mut m = Model::load(&tmp, ModelOptions { device: DeviceKind::Cpu, prefill_chunk: 16, max_context: 128, ..Default::default() }).unwrap();
    let parts = [Part::Image(load_image(&src.join("wide.png")).unwrap()), Part::Text("w17 w29 w40".into())];
    let p = m.prompt(&parts, true).unwrap();
    assert_eq!(p.soft[0].tokens, 48, "the whole image and two crops");
    assert_eq!(p.ids, ids("gemma3", "chat_ids_pan_and_scan"));
    let toks: Vec<u32> = m.generate_prompt(&p, GenerateParams { max_tokens: 2, ..Default::default() }).unwrap().map(|t| t.unwrap().token).collect();
    assert_eq!(toks.len(), 2);
    std::fs::remove_dir_all(&tmp).ok();
}

/// The Gemma 4 fixture as a 26B/31B-style checkpoint (`use_bidirectional_attention: "vision"`),
/// copied to a temporary directory.
fn gemma4_vision_spans() -> PathBuf {
    let d = std::env::temp_dir().join(format!("markbase-gemma4-spans-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(dir("gemma4")).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
    }
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(d.join("config.json")).unwrap()).unwrap();
    cfg["text_config"]["use_bidirectional_attention"] = "vision".into();
    std::fs::write(d.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    d
}

/// Gemma 4 26B/31B (HF: `AND(sliding, OR(causal, same image))`): each image's span sees itself
/// on sliding layers only. In the graph, the sliding layers' attention reads the attention
/// bounds and the full-attention layers' the plain positions. The prompt's logits: the text
/// before the image as the causal model's; inside the span (the last soft token excepted, which
/// sees no more than causally) different from it; CPU and GPU within 5e-4 of max|logit|; the span
/// is fed in one step (a step of 16 tokens cannot take it). An unknown value is a config error.
#[test]
fn gemma4_large_image_spans_on_sliding_layers() {
    use markbase::graph::ops::Op;
    use markbase::graph::BuildOptions;
    use markbase::loader::Checkpoint;
    let d = gemma4_vision_spans();
    let ck = Checkpoint::open(&d).unwrap();
    assert!(ck.config().vision_spans_sliding);
    let g = ck.build(BuildOptions { soft_rows: 8, ..BuildOptions::prefill(8, 64) }).unwrap();
    let mut seen = vec![];
    for n in g.order() {
        if let Some(Op::Attention { window, .. }) = g.node(n).op() {
            let pos = g.node(g.inputs(n)[1]).name.clone();
            let want = if window.is_some() { "attn_positions" } else { "positions" };
            assert_eq!(pos, want, "layer {:?} (window {window:?}) reads {pos}", g.node(n).layer);
            seen.push(window.is_some());
        }
    }
    assert!(seen.contains(&true) && seen.contains(&false), "both kinds of layers: {seen:?}");

    let logits = |path: &PathBuf, device: DeviceKind, chunk: usize| {
        let o = ModelOptions { device, prefill_chunk: chunk, max_context: 128, ..Default::default() };
        let mut m = Model::load(path, o).unwrap();
        let p = m.prompt(&parts("gemma4"), true).unwrap();
        (m.forward_with_images(&p.ids, &p.soft, true, None).map(|o| o.logits.unwrap()), p.ids)
    };
    let (causal, ids) = logits(&dir("gemma4"), DeviceKind::Cpu, 128);
    let causal = causal.unwrap();
    let (cpu, _) = logits(&d, DeviceKind::Cpu, 128);
    let cpu = cpu.unwrap();
    let (gpu, _) = logits(&d, DeviceKind::Gpu(None), 128);
    let gpu = gpu.unwrap();
    let v = cpu.len() / ids.len();
    let image = Model::load(&d, ModelOptions { device: DeviceKind::Cpu, max_context: 128, ..Default::default() }).unwrap().engine().vision_config().unwrap().image_token;
    let (a, b) = (ids.iter().position(|&t| t == image).unwrap(), ids.iter().rposition(|&t| t == image).unwrap() + 1);
    let row = |x: &[f32], p: usize| x[p * v..(p + 1) * v].to_vec();
    let diff = |x: &[f32], y: &[f32]| x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
    for p in 0..a {
        assert_eq!(row(&cpu, p), row(&causal, p), "position {p}, before the image");
    }
    let inside = (a..b - 1).filter(|&p| diff(&row(&cpu, p), &row(&causal, p)) > 1e-3).count();
    println!("{} of the span's first {} positions differ from the causal model's", inside, b - 1 - a);
    assert_eq!(inside, b - 1 - a, "every image token but the last sees later ones on the sliding layer");
    let mx = cpu.iter().fold(0f32, |m, x| m.max(x.abs()));
    let e = diff(&gpu, &cpu) / mx;
    println!("GPU against CPU: {e:.2e} of max|logit|");
    assert!(e <= 5e-4, "GPU against CPU: {e:.2e} of max|logit|");
    // the span is fed whole: steps of 16 cannot take its tokens
    let (small, _) = logits(&d, DeviceKind::Cpu, 16);
    let e = small.unwrap_err().to_string();
    assert!(e.contains("does not fit a prefill step of 16"), "{e}");

    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(d.join("config.json")).unwrap()).unwrap();
    cfg["text_config"]["use_bidirectional_attention"] = "all".into();
    std::fs::write(d.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let e = Model::load(&d, ModelOptions { device: DeviceKind::Cpu, ..Default::default() }).err().unwrap().to_string();
    assert!(e.contains("use_bidirectional_attention") && e.contains("not supported"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}
