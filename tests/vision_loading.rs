//! Loading the vision tower and projector of mlx-vlm checkpoints: float and quantized towers
//! beside float and quantized text, the by-block diagnostics of missing and mis-shaped
//! tensors, the audio tower listed but not fatal, and what `inspect` shows.

use std::collections::BTreeMap;
use std::path::PathBuf;

use markbase::graph::vision::TowerKind;
use markbase::graph::{BuildOptions, WeightFormat};
use markbase::loader::Checkpoint;

fn vlm(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm").join(name)
}

/// Opens `name`, checks and loads its text model and its vision tower; returns the checkpoint.
fn load_both(name: &str) -> Checkpoint {
    let cp = Checkpoint::open(vlm(name)).unwrap();
    let g = cp.build(BuildOptions::prefill(4, 16)).unwrap();
    let text = cp.check(&g);
    assert!(!text.has_errors(), "{name}: text: {text}");
    assert!(text.problems.iter().all(|p| !p.subject.contains("vision") && !p.subject.contains("audio")), "{name}: tower tensors in the text report: {text}");
    cp.load_weights(&g).unwrap_or_else(|e| panic!("{name}: text: {e}"));
    let vc = cp.vision_config().unwrap().expect("a vision tower");
    let (w, rep) = cp.load_vision(&vc).unwrap_or_else(|e| panic!("{name}: vision: {e}"));
    assert_eq!(w.map.len(), cp.vision_params(&vc).len(), "{name}: every vision weight loaded");
    assert!(rep.errors().next().is_none());
    cp
}

#[test]
fn gemma4_vision_and_audio_towers_load() {
    let cp = load_both("gemma4");
    let vc = cp.vision_config().unwrap().unwrap();
    assert_eq!(vc.kind, TowerKind::Gemma4Vit);
    assert_eq!((vc.hidden, vc.layers, vc.heads, vc.head_dim, vc.position_table, vc.pool), (64, 2, 2, 32, 128, 3));
    assert!(vc.clipped && !vc.standardize);
    assert_eq!((vc.image_token, vc.boi_token, vc.eoi_token, vc.text_hidden), (500, 501, 502, 64));
    // clip bounds are 0-d tensors of every clipped linear (7 per layer)
    let clips = cp.vision_params(&vc).iter().filter(|p| p.shape.is_empty()).count();
    assert_eq!(clips, 2 * 7 * 4);
    assert!(!cp.audio_tensors().is_empty());
    // the audio tower is Gemma 4's, which runs: its tensors are the audio check's, not the
    // vision check's
    let rep = cp.check_vision(&vc);
    assert!(rep.warnings().all(|p| !p.message.contains("audio")), "{rep}");
    let ac = cp.audio_config().unwrap().unwrap();
    assert!(cp.check_audio(&ac).is_empty());
}

#[test]
fn gemma3_siglip_loads() {
    let cp = load_both("gemma3");
    let vc = cp.vision_config().unwrap().unwrap();
    assert_eq!(vc.kind, TowerKind::Siglip);
    assert_eq!((vc.hidden, vc.layers, vc.patch, vc.image_size, vc.tokens_per_image, vc.pool), (64, 2, 14, 224, 16, 4));
    assert!(cp.audio_tensors().is_empty());
    assert!(cp.check_vision(&vc).is_empty(), "{}", cp.check_vision(&vc));
}

/// bf16 towers beside a quantized text model (affine and mxfp4), and towers quantized too.
#[test]
fn quantized_text_and_towers() {
    for name in ["gemma4-q4", "gemma4-mxfp4"] {
        let cp = load_both(name);
        let vc = cp.vision_config().unwrap().unwrap();
        let formats: Vec<_> = cp.vision_params(&vc).iter().map(|p| p.format).collect();
        assert!(formats.iter().all(|f| matches!(f, WeightFormat::Float { .. })), "{name}: the towers stay float");
        let text_q = cp.params().iter().filter(|p| matches!(p.format, WeightFormat::Quantized { .. })).count();
        assert!(text_q > 0, "{name}: the text is quantized");
    }
    let cp = load_both("gemma3-q8-towers");
    let vc = cp.vision_config().unwrap().unwrap();
    let q: Vec<_> = cp.vision_params(&vc).into_iter().filter(|p| matches!(p.format, WeightFormat::Quantized { .. })).collect();
    assert!(q.iter().any(|p| p.name.ends_with("mlp.fc1")), "{:?}", q.iter().map(|p| &p.name).collect::<Vec<_>>());
    let s = cp.tower_summary();
    assert!(s.vision_storage.iter().any(|st| st.contains("8-bit")) && s.vision_storage.iter().any(|st| st == "F16"), "{:?}", s.vision_storage);
}

/// Copies fixture `name` into a temporary directory with its tensors changed by `edit`.
fn mutated(name: &str, tag: &str, edit: impl Fn(&mut BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>)) -> PathBuf {
    let src = vlm(name);
    let dir = std::env::temp_dir().join(format!("markbase-vision-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "preprocessor_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut m: BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec()))).collect();
    edit(&mut m);
    let views: Vec<(String, safetensors::tensor::TensorView)> =
        m.iter().map(|(n, (d, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn missing_and_misshaped_tower_tensors_are_reported_by_block() {
    let dir = mutated("gemma4", "broken", |m| {
        m.remove("vision_tower.encoder.layers.1.self_attn.k_proj.linear.weight");
        m.remove("embed_vision.embedding_projection.weight");
        let (_, s, b) = m.get_mut("vision_tower.encoder.layers.0.mlp.up_proj.linear.weight").unwrap();
        *s = vec![s[0] / 2, s[1]];
        b.truncate(b.len() / 2);
    });
    let cp = Checkpoint::open(&dir).unwrap();
    // the text model does not care
    let g = cp.build(BuildOptions::prefill(4, 16)).unwrap();
    assert!(!cp.check(&g).has_errors());
    let vc = cp.vision_config().unwrap().unwrap();
    let err = cp.load_vision(&vc).unwrap_err();
    let rep = err.report().expect("a report");
    let lines = rep.lines();
    let text = lines.join("\n");
    assert_eq!(rep.errors().count(), 3, "{text}");
    assert!(text.contains("layer 1: self_attn.k_proj.linear.weight missing"), "{text}");
    assert!(text.contains("layer 0: mlp.up_proj.linear.weight has shape [64, 64], expected [128, 64]"), "{text}");
    assert!(text.contains("embed_vision.embedding_projection.weight missing"), "{text}");
    // inspect lists them as warnings that cost the images, not the text model
    let ins = markbase::inspect::inspect(&dir);
    assert!(ins.ok(), "{ins}");
    let shown = ins.to_string();
    assert!(shown.contains("images cannot be used") && shown.contains("vision tower: gemma4 ViT, 2 layers"), "{shown}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_bad_vision_config_is_a_clear_error() {
    let dir = mutated("gemma3", "badcfg", |_| {});
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["mm_tokens_per_image"] = serde_json::json!(15);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let cp = Checkpoint::open(&dir).unwrap();
    let e = cp.vision_config().unwrap_err().to_string();
    assert!(e.contains("mm_tokens_per_image") && e.contains("15"), "{e}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn inspect_shows_the_towers() {
    let r = markbase::inspect::inspect(vlm("gemma4"));
    assert!(r.ok(), "{r}");
    let s = r.to_string();
    assert!(s.contains("vision tower: gemma4 ViT, 2 layers"), "{s}");
    assert!(s.contains("70 soft tokens per image") && s.contains("stored as F32"), "{s}");
    assert!(s.contains("audio tower: Gemma 4 conformer of 1 blocks, 70 tensors"), "{s}");
    let j = r.to_json();
    assert_eq!(j["towers"]["vision"], "gemma4 ViT");
    assert!(j["towers"]["vision_params"].as_u64().unwrap() > 100_000);
    let s = markbase::inspect::inspect(vlm("gemma3")).to_string();
    assert!(s.contains("vision tower: SigLIP, 2 layers") && s.contains("16 soft tokens per image"), "{s}");
    assert!(!s.contains("audio tower"), "{s}");
}
