//! Loader and inspect tests over the fixture checkpoints (tests/fixtures) and
//! synthetic variations of them written into temporary directories.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use markbase::graph::ir::{GraphKind, WeightParam};
use markbase::graph::quant::{FloatType, QuantMode, QuantSpec, WeightFormat};
use markbase::graph::{BuildOptions, Family, Graph, WeightResolver};
use markbase::inspect::inspect;
use markbase::loader::{safetensors, Checkpoint, LoadError, LoadOptions, Report, Severity};
use markbase::quant::dequantize;
use rand::{Rng, SeedableRng};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Every fixture checkpoint (not the broken ones, not the quant cases).
fn fixture_dirs() -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(fixtures()) else { return vec![] };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join("config.json").exists() && p.file_name().is_some_and(|n| n != "broken" && n != "quant"))
        .collect();
    v.sort();
    v
}

fn name_of(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

/// The graph the builder makes, or (families it does not support yet) one weight
/// node per weight the checkpoint holds.
fn graph_for(cp: &Checkpoint) -> (Graph, bool) {
    match cp.build(BuildOptions::prefill(1, 1)) {
        Ok(g) => (g, true),
        Err(_) => (synthetic_graph(cp.params()), false),
    }
}

/// Gemma 3n's text-model weights as mlx-lm's `gemma3n` model declares them, from
/// `config.json` alone (not from the checkpoint's tensors): modules (`X.weight`,
/// quantizable) by module path, plain tensors by tensor name, with their float shapes;
/// formats as the checkpoint resolves them.
fn gemma3n_spec(cp: &Checkpoint) -> Vec<WeightParam> {
    let j = cp.config_json();
    let c = j.get("text_config").unwrap_or(j);
    let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("config {k}")) as usize;
    let (h, layers, d) = (n("hidden_size"), n("num_hidden_layers"), n("head_dim"));
    let (nq, nkv, pd, alt, rank) = (n("num_attention_heads"), n("num_key_value_heads"), n("hidden_size_per_layer_input"), n("altup_num_inputs"), n("laurel_rank"));
    let inter: Vec<usize> = match &c["intermediate_size"] {
        serde_json::Value::Array(a) => a.iter().map(|v| v.as_u64().unwrap() as usize).collect(),
        v => vec![v.as_u64().unwrap() as usize; layers],
    };
    let pre = cp.prefix();
    let mut out = vec![];
    let mut add = |rel: String, shape: Vec<usize>, module: bool| {
        let name = format!("{pre}{rel}");
        let format = cp.format(&name, &shape, module);
        out.push(WeightParam { name, shape, format, module });
    };
    add("embed_tokens".into(), vec![n("vocab_size"), h], true);
    add("embed_tokens_per_layer".into(), vec![n("vocab_size_per_layer_input"), layers * pd], true);
    add("per_layer_model_projection".into(), vec![layers * pd, h], true);
    add("per_layer_projection_norm.weight".into(), vec![pd], false);
    for k in 0..alt - 1 {
        add(format!("altup_projections.{k}"), vec![h, h], true);
        add(format!("altup_unembed_projections.{k}"), vec![h, h], true);
    }
    add("norm.weight".into(), vec![h], false);
    for i in 0..layers {
        let l = |rel: &str| format!("layers.{i}.{rel}");
        for norm in ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm"] {
            add(l(&format!("{norm}.weight")), vec![h], false);
        }
        for (proj, rows, cols) in [("q_proj", nq * d, h), ("k_proj", nkv * d, h), ("v_proj", nkv * d, h), ("o_proj", h, nq * d)] {
            add(l(&format!("self_attn.{proj}")), vec![rows, cols], true);
        }
        add(l("self_attn.q_norm.weight"), vec![d], false);
        add(l("self_attn.k_norm.weight"), vec![d], false);
        add(l("mlp.gate_proj"), vec![inter[i], h], true);
        add(l("mlp.up_proj"), vec![inter[i], h], true);
        add(l("mlp.down_proj"), vec![h, inter[i]], true);
        add(l("altup.correction_coefs"), vec![alt, alt], true);
        add(l("altup.prediction_coefs"), vec![alt * alt, alt], true);
        add(l("altup.modality_router"), vec![alt, h], true);
        add(l("altup.router_norm.weight"), vec![h], false);
        add(l("altup.correct_output_scale"), vec![h], false);
        add(l("laurel.linear_left"), vec![rank, h], true);
        add(l("laurel.linear_right"), vec![h, rank], true);
        add(l("laurel.post_laurel_norm.weight"), vec![h], false);
        add(l("per_layer_input_gate"), vec![pd, h], true);
        add(l("per_layer_projection"), vec![h, pd], true);
    }
    out
}

fn synthetic_graph(params: Vec<WeightParam>) -> Graph {
    let mut g = Graph::new(1, GraphKind::Prefill);
    for p in params {
        let label = p.name.clone();
        g.weight(&label, None, p);
    }
    g
}

/// Opens, builds and loads; the error (or warnings) as text.
fn full_load(dir: &Path) -> Result<Report, String> {
    let cp = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    let (g, _) = graph_for(&cp);
    let check = cp.check(&g);
    let r = cp.load_weights(&g).map(|(_, r)| r).map_err(|e| e.to_string());
    // The cheap check finds the same errors as the load.
    if let Err(e) = &r {
        assert!(check.has_errors(), "check missed: {e}");
    }
    r
}

/// A scratch directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!("markbase-loader-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    /// A copy of fixture `name` (top-level files only).
    fn copy_of(name: &str) -> TempDir {
        let t = TempDir::new(name);
        for e in std::fs::read_dir(fixtures().join(name)).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                std::fs::copy(e.path(), t.0.join(e.file_name())).unwrap();
            }
        }
        t
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A stored tensor: (name, dtype, shape, bytes).
type Stored = (String, String, Vec<usize>, Vec<u8>);

fn read_all(path: &Path) -> Vec<Stored> {
    let bytes = std::fs::read(path).unwrap();
    let h = safetensors::parse(&bytes, "x").unwrap();
    let mut v: Vec<(usize, Stored)> = h
        .entries
        .iter()
        .map(|e| (e.begin, (e.name.clone(), e.dtype_name.clone(), e.shape.clone(), bytes[h.data_start + e.begin..h.data_start + e.end].to_vec())))
        .collect();
    v.sort_by_key(|x| x.0);
    v.into_iter().map(|x| x.1).collect()
}

/// Writes a safetensors file the way MLX does (no padding, no alignment).
fn write_st(path: &Path, ts: &[Stored]) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "mlx"}));
    let mut off = 0;
    for (n, d, s, b) in ts {
        header.insert(n.clone(), serde_json::json!({"dtype": d, "shape": s, "data_offsets": [off, off + b.len()]}));
        off += b.len();
    }
    let h = serde_json::to_string(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    for (_, _, _, b) in ts {
        out.extend_from_slice(b);
    }
    std::fs::write(path, out).unwrap();
}

fn expected_prefix(model_type: &str) -> &'static str {
    match model_type {
        "gemma3_text" | "gemma4_text" => "model.",
        "gemma3" | "gemma4" => "language_model.model.",
        "gemma3n" => "model.language_model.",
        other => panic!("unexpected model_type {other}"),
    }
}

/// "affine 4-bit g64; ..." / "mxfp4 4-bit g32" of index.json → the global spec.
fn index_spec(desc: &str) -> Option<QuantSpec> {
    let first = desc.split(';').next()?;
    let mut it = first.split_whitespace();
    let mode = QuantMode::parse(it.next()?)?;
    let bits = it.next()?.strip_suffix("-bit")?.parse().ok()?;
    let group_size = it.next()?.strip_prefix('g')?.parse().ok()?;
    Some(QuantSpec { mode, bits, group_size })
}

#[test]
fn fixtures_exist() {
    let dirs = fixture_dirs();
    assert!(dirs.len() >= 20, "fixtures missing: {dirs:?}");
}

#[test]
fn every_fixture_loads_cleanly_with_expected_formats() {
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures().join("index.json")).unwrap()).unwrap();
    for dir in fixture_dirs() {
        let name = name_of(&dir);
        let cp = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let cfg = cp.config();
        assert_eq!(cp.prefix(), expected_prefix(&cfg.model_type), "{name}");
        assert!(cp.open_problems().is_empty(), "{name}: {:?}", cp.open_problems());
        let (g, built) = graph_for(&cp);
        if cfg.family == Family::Gemma3 {
            assert!(built, "{name}: the Gemma 3 builder must accept it");
        }
        // Without a builder the weights expected are the family's spec, which the
        // checkpoint must hold exactly (names and float shapes).
        let g = if built {
            g
        } else {
            assert_eq!(cfg.family, Family::Gemma3n, "{name}: no builder and no weight spec");
            let spec = gemma3n_spec(&cp);
            let key = |p: &WeightParam| (p.name.clone(), p.shape.clone(), p.module);
            let want: std::collections::BTreeSet<_> = spec.iter().map(key).collect();
            let held: std::collections::BTreeSet<_> = cp.params().iter().map(key).collect();
            assert_eq!(want.len(), spec.len(), "{name}: spec names repeat");
            let missing: Vec<_> = want.difference(&held).collect();
            let extra: Vec<_> = held.difference(&want).collect();
            assert!(missing.is_empty() && extra.is_empty(), "{name}: missing {missing:?}, not in the spec {extra:?}");
            synthetic_graph(spec)
        };
        let (weights, report) = cp.load_weights(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(report.is_empty(), "{name}: {report}");
        assert!(!weights.map.is_empty());

        let desc = index[&name]["quantization"].as_str().unwrap_or("");
        let global = index_spec(desc);
        assert_eq!(cfg.quant.global.map(|g| (g.mode, g.bits, g.group_size)), global.map(|g| (g.mode, g.bits, g.group_size)), "{name}: {desc}");
        for (wname, w) in &weights.map {
            let p = &w.param;
            let quantized = p.module && cp.tensor(&format!("{wname}.scales")).is_some();
            match p.format {
                WeightFormat::Quantized { spec, global_scale } => {
                    assert!(quantized, "{name}: {wname}");
                    assert_eq!(Some(spec), cfg.quant.for_module(wname), "{name}: {wname}");
                    assert_eq!(global_scale, cp.tensor(&format!("{wname}.global_scale")).is_some());
                    assert_eq!(w.biases.is_some(), spec.mode == QuantMode::Affine);
                    assert_eq!(w.scales.as_ref().unwrap().dtype == markbase::weights::RawDType::U8, spec.mode != QuantMode::Affine);
                }
                WeightFormat::Float { dtype } => {
                    assert!(!quantized, "{name}: {wname}");
                    // All fixtures are bf16 checkpoints.
                    assert_eq!(dtype, FloatType::Bf16, "{name}: {wname}");
                    assert!(w.scales.is_none());
                }
            }
            let d = dequantize(w).unwrap_or_else(|e| panic!("{name}: {wname}: {e}"));
            assert_eq!(d.len(), p.shape.iter().product::<usize>());
            assert!(d.iter().all(|x| x.is_finite()), "{name}: {wname} has non-finite values");
        }
        if global.is_some() && !name.contains("mixed") {
            let emb = &weights.map[&format!("{}embed_tokens", cp.prefix())];
            assert_eq!(emb.param.format.describe().split(' ').next(), global.map(|g| g.mode.name()), "{name}");
        }
    }
}

#[test]
fn mixed_overrides_are_per_module() {
    let cp = Checkpoint::open(fixtures().join("gemma3_text-mixed36")).unwrap();
    let (g, _) = graph_for(&cp);
    let (w, _) = cp.load_weights(&g).unwrap();
    let bits: BTreeMap<usize, usize> = w
        .map
        .values()
        .filter_map(|w| match w.param.format {
            WeightFormat::Quantized { spec, .. } => Some(spec.bits),
            _ => None,
        })
        .fold(BTreeMap::new(), |mut m, b| {
            *m.entry(b).or_default() += 1;
            m
        });
    // The global says 4 bits but every module has its own override (3 or 6).
    assert_eq!(bits.keys().copied().collect::<Vec<_>>(), vec![3, 6], "{bits:?}");
}

#[test]
fn sharded_equals_single_file() {
    let a = Checkpoint::open(fixtures().join("gemma3_text-q4")).unwrap();
    let b = Checkpoint::open(fixtures().join("gemma3_text-q4sharded")).unwrap();
    assert_eq!(b.files().len(), 3);
    let (ga, _) = graph_for(&a);
    let (gb, _) = graph_for(&b);
    let (wa, _) = a.load_weights(&ga).unwrap();
    let (wb, _) = b.load_weights(&gb).unwrap();
    assert_eq!(wa.map.len(), wb.map.len());
    for (n, x) in &wa.map {
        assert_eq!(Some(x), wb.get(n), "{n}");
    }
}

#[test]
fn moe_names_map_to_switch_glu() {
    // Flat `experts.*_proj.*` (hfnames) and fused HF `gate_up_proj` give the same
    // canonical tensors as the MLX `switch_glu` naming they were derived from.
    for (plain, renamed) in [("gemma4_moe-q4", "gemma4_moe-q4-hfnames"), ("gemma4_moe-bf16", "gemma4_moe-bf16-hffused")] {
        let a = Checkpoint::open(fixtures().join(plain)).unwrap();
        let b = Checkpoint::open(fixtures().join(renamed)).unwrap();
        let names_a: Vec<&str> = a.tensors().map(|t| t.name.as_str()).collect();
        let names_b: Vec<&str> = b.tensors().map(|t| t.name.as_str()).collect();
        assert_eq!(names_a, names_b, "{renamed}");
        let mut experts = 0;
        for n in names_a {
            assert_eq!(a.read(n).unwrap(), b.read(n).unwrap(), "{renamed}: {n}");
            experts += n.contains("experts.switch_glu.") as usize;
        }
        assert!(experts >= 18, "{renamed}: {experts}");
        assert!(b.tensors().any(|t| t.stored_name != t.name), "{renamed}: nothing renamed?");
        let (cb, ca) = (b.config(), a.config());
        assert!(cb.enable_moe_block && ca.enable_moe_block);
        assert_eq!((cb.num_experts, cb.top_k_experts, cb.moe_intermediate_size), (Some(8), Some(2), Some(64)));
        assert_eq!(ca.num_experts, cb.num_experts);
    }
    // The fused fixture's config lacks enable_moe_block: detected from router.proj.
    let b = Checkpoint::open(fixtures().join("gemma4_moe-bf16-hffused")).unwrap();
    assert!(b.notes().iter().any(|n| n.contains("enable_moe_block")), "{:?}", b.notes());
    let g = b.tensor("language_model.model.layers.0.experts.switch_glu.gate_proj.weight").unwrap();
    assert_eq!(g.shape, vec![8, 64, 128]);
    assert_eq!(g.stored_name, "language_model.model.layers.0.experts.gate_up_proj");
}

/// Rewrites the config of a copied fixture.
fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn moe_config_inferred_and_cross_checked() {
    let t = TempDir::copy_of("gemma4_moe-q4");
    edit_config(&t.0, |v| {
        let tc = v["text_config"].as_object_mut().unwrap();
        tc.remove("enable_moe_block");
        tc.remove("num_experts");
        tc.remove("moe_intermediate_size");
    });
    let cp = Checkpoint::open(&t.0).unwrap();
    let c = cp.config();
    assert!(c.enable_moe_block);
    assert_eq!((c.num_experts, c.moe_intermediate_size, c.top_k_experts), (Some(8), Some(64), Some(2)));
    assert!(cp.open_problems().is_empty(), "{:?}", cp.open_problems());
    assert!(cp.notes().iter().any(|n| n.contains("num_experts = 8")));

    edit_config(&t.0, |v| v["text_config"]["num_experts"] = serde_json::json!(4));
    let cp = Checkpoint::open(&t.0).unwrap();
    let errs: Vec<String> = cp.open_problems().iter().filter(|p| p.is_error()).map(|p| p.to_string()).collect();
    assert!(errs.iter().any(|e| e.contains("config num_experts = 4") && e.contains("experts.switch_glu.gate_proj")), "{errs:?}");
    assert!(errs.iter().any(|e| e.contains("router.proj")), "{errs:?}");

    edit_config(&t.0, |v| {
        let tc = v["text_config"].as_object_mut().unwrap();
        tc.remove("num_experts");
        tc.remove("top_k_experts");
    });
    let cp = Checkpoint::open(&t.0).unwrap();
    assert!(cp.open_problems().iter().any(|p| p.is_error() && p.message.contains("top_k_experts")));
}

#[test]
fn resolver_formats() {
    let cp = Checkpoint::open(fixtures().join("gemma4_moe-nvfp4gs")).unwrap();
    let p = cp.prefix().to_string();
    // Override without `mode` = affine, although the global mode is nvfp4.
    let router = cp.format(&format!("{p}layers.0.router.proj"), &[8, 128], true);
    assert_eq!(router, WeightFormat::Quantized { spec: QuantSpec::affine(8, 64), global_scale: false });
    let gate = cp.format(&format!("{p}layers.0.experts.switch_glu.gate_proj"), &[8, 64, 128], true);
    assert_eq!(gate, WeightFormat::Quantized { spec: QuantSpec { mode: QuantMode::Nvfp4, bits: 4, group_size: 16 }, global_scale: true });
    let norm = cp.format(&format!("{p}layers.0.input_layernorm.weight"), &[128], false);
    assert_eq!(norm, WeightFormat::Float { dtype: FloatType::Bf16 });
    assert!(cp.exists(&format!("{p}layers.0.router.proj")));
    assert!(cp.exists(&format!("{p}layers.0.layer_scalar")));
    assert!(!cp.exists("language_model.lm_head"));
    let gs = cp.read(&format!("{p}layers.0.experts.switch_glu.gate_proj.global_scale")).unwrap();
    assert_eq!((gs.dtype, gs.shape.clone()), (markbase::weights::RawDType::F32, vec![8]));
}

#[test]
fn untied_lm_head_is_used() {
    let t = TempDir::copy_of("gemma3_text-bf16");
    let st = t.0.join("model.safetensors");
    let mut ts = read_all(&st);
    let emb = ts.iter().find(|x| x.0 == "model.embed_tokens.weight").unwrap().clone();
    ts.push(("lm_head.weight".into(), emb.1.clone(), emb.2.clone(), emb.3.clone()));
    write_st(&st, &ts);
    std::fs::remove_file(t.0.join("model.safetensors.index.json")).unwrap();
    let cp = Checkpoint::open(&t.0).unwrap();
    assert!(cp.exists("lm_head"));
    let (g, built) = graph_for(&cp);
    assert!(built);
    let (w, report) = cp.load_weights(&g).unwrap();
    assert!(report.is_empty(), "{report}");
    assert!(w.get("lm_head").is_some());
}

#[test]
fn tower_tensors_are_ignored_and_data_is_unaligned() {
    let t = TempDir::copy_of("gemma3_mm-q4");
    let st = t.0.join("model.safetensors");
    let mut ts = read_all(&st);
    // Odd-sized tower tensors first, so that every text tensor moves to an odd offset.
    ts.insert(0, ("vision_tower.vision_model.embeddings.patch_embedding.weight".into(), "BF16".into(), vec![3, 1], vec![1, 2, 3, 4, 5, 6]));
    ts.insert(0, ("multi_modal_projector.mm_soft_emb_norm.weight".into(), "U8".into(), vec![1], vec![7]));
    write_st(&st, &ts);
    std::fs::remove_file(t.0.join("model.safetensors.index.json")).unwrap();
    let cp = Checkpoint::open(&t.0).unwrap();
    assert_eq!(cp.tower_tensors().len(), 2);
    assert!(cp.tensors().any(|t| t.offset % 4 != 0));
    let (g, _) = graph_for(&cp);
    let (w, report) = cp.load_weights(&g).unwrap();
    assert!(report.is_empty(), "{report}");
    let orig = Checkpoint::open(fixtures().join("gemma3_mm-q4")).unwrap();
    let (w0, _) = orig.load_weights(&g).unwrap();
    for (n, x) in &w0.map {
        assert_eq!(Some(x), w.get(n), "{n}");
    }
}

#[test]
fn progress_reaches_total() {
    let cp = Checkpoint::open(fixtures().join("gemma3_text-q4")).unwrap();
    let (g, _) = graph_for(&cp);
    let last = AtomicU64::new(0);
    let calls = AtomicUsize::new(0);
    let total_seen = AtomicU64::new(0);
    let cb = |done: u64, total: u64| {
        calls.fetch_add(1, Ordering::Relaxed);
        last.fetch_max(done, Ordering::Relaxed);
        total_seen.store(total, Ordering::Relaxed);
        assert!(done <= total);
    };
    let (w, _) = cp.load_weights_with(&g, &LoadOptions { progress: Some(&cb) }).unwrap();
    let total = total_seen.load(Ordering::Relaxed);
    assert_eq!(last.load(Ordering::Relaxed), total);
    assert_eq!(total as usize, w.stored_bytes());
    assert!(calls.load(Ordering::Relaxed) >= w.map.len());
}

#[test]
fn broken_checkpoints_give_specific_messages() {
    let b = fixtures().join("broken");
    let cases: &[(&str, &[&str])] = &[
        ("missing-tensor", &["layer 1: self_attn.k_proj.weight missing (expected U32 [32, 16])"]),
        ("misshaped-tensor", &["layer 0: input_layernorm.weight has shape [120], expected [128]"]),
        ("wrong-dtype", &["layer 0: mlp.gate_proj.weight has dtype F32, expected U32 (packed quantized weight; .scales present)"]),
        ("truncated-file", &["model.safetensors is truncated: tensor `", "` data ends at byte ", " but the file has only "]),
        ("bad-json-header", &["model.safetensors: invalid safetensors header JSON (parse error at byte "]),
        ("offsets-past-end", &["norm.weight data_offsets [", "exceed the data section (size "]),
        ("absurd-header-size", &["model.safetensors: header length 1099511627776 exceeds file size "]),
        ("unknown-model-type", &["unsupported model_type `gemma_unknown` (supported: gemma3_text, gemma3, gemma4_text, gemma4, gemma3n)"]),
        ("config-not-json", &["config.json is not valid JSON (line "]),
        (
            "quant-bits-mismatch",
            &["quantization config says 8-bit g64 but `language_model.model.embed_tokens.weight` has [512, 16] u32 with scales [512, 2] (=> 4-bit g64); config and tensors disagree"],
        ),
    ];
    for (dir, want) in cases {
        let e = full_load(&b.join(dir)).expect_err(dir);
        for w in *want {
            assert!(e.contains(w), "{dir}: expected {w:?} in:\n{e}");
        }
        // Inspect never panics and says it is broken.
        let ir = inspect(b.join(dir));
        assert!(!ir.ok(), "{dir}");
        let _ = (ir.to_string(), ir.to_json());
    }
    // Only a warning for an extra tensor.
    let r = full_load(&b.join("extra-tensor")).unwrap();
    assert!(!r.has_errors());
    let w: Vec<String> = r.warnings().map(|p| p.to_string()).collect();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("layer 0: self_attn.extra_proj.weight unexpected tensor"), "{w:?}");
    assert_eq!(r.warnings().next().unwrap().tensor.as_deref(), Some("language_model.model.layers.0.self_attn.extra_proj.weight"));
}

#[test]
fn all_problems_are_collected() {
    // Several defects at once: all of them in one report, grouped by layer.
    let t = TempDir::copy_of("gemma3_text-q4");
    let st = t.0.join("model.safetensors");
    let mut ts = read_all(&st);
    ts.retain(|x| x.0 != "model.layers.1.self_attn.k_proj.weight" && x.0 != "model.layers.4.mlp.up_proj.biases");
    for x in ts.iter_mut() {
        if x.0 == "model.layers.3.input_layernorm.weight" {
            x.2 = vec![64];
            x.3.truncate(128);
        }
        if x.0 == "model.embed_tokens.scales" {
            x.1 = "U16".into();
        }
        if x.0 == "model.layers.2.self_attn.q_norm.weight" {
            x.1 = "F64".into();
            x.2 = vec![8];
        }
    }
    write_st(&st, &ts);
    std::fs::remove_file(t.0.join("model.safetensors.index.json")).unwrap();
    let cp = Checkpoint::open(&t.0).unwrap();
    let (g, _) = graph_for(&cp);
    let err = cp.load_weights(&g).unwrap_err();
    let LoadError::Invalid(r) = &err else { panic!("{err}") };
    let text = err.to_string();
    for w in [
        "embed_tokens.scales has dtype U16, expected BF16/F16/F32 (affine scales)",
        "layer 1: self_attn.k_proj.weight missing (expected U32 [64, 16])",
        "layer 2: self_attn.q_norm.weight has dtype F64, expected BF16/F16/F32",
        "layer 3: input_layernorm.weight has shape [64], expected [128]",
        "layer 4: mlp.up_proj.biases missing (expected BF16/F16/F32 [64, 2])",
    ] {
        assert!(text.contains(w), "expected {w:?} in:\n{text}");
    }
    assert_eq!(r.errors().count(), 5, "{text}");
    // Grouped by layer: global problems first, then layers in order.
    let layers: Vec<Option<usize>> = r.sorted().iter().map(|p| p.layer).collect();
    assert!(layers.windows(2).all(|w| w[0].map_or(0, |l| l + 1) <= w[1].map_or(0, |l| l + 1)));
}

#[test]
fn header_defects_are_reported_not_panics() {
    let t = TempDir::copy_of("gemma3_text-bf16");
    let st = t.0.join("model.safetensors");
    let ts = read_all(&st);
    // Hand-made header: an unknown dtype, an overlap, a size mismatch.
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    let mut data = vec![];
    for (n, d, s, b) in &ts {
        let (dt, begin) = match n.as_str() {
            "model.norm.weight" => ("XYZ".to_string(), off),
            "model.layers.0.post_attention_layernorm.weight" => (d.clone(), off.saturating_sub(4)),
            _ => (d.clone(), off),
        };
        let mut shape = s.clone();
        if n == "model.layers.5.input_layernorm.weight" {
            shape = vec![100];
        }
        header.insert(n.clone(), serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [begin, begin + b.len()]}));
        if begin == off {
            data.extend_from_slice(b);
            off += b.len();
        } else {
            data.truncate(begin);
            data.extend_from_slice(b);
            off = begin + b.len();
        }
    }
    let h = serde_json::to_string(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(&data);
    std::fs::write(&st, out).unwrap();
    let e = full_load(&t.0).unwrap_err();
    for w in ["norm.weight unknown dtype \"XYZ\"", "layer 0: post_attention_layernorm.weight data [", "overlaps tensor `", "layer 5: input_layernorm.weight BF16 [100] needs 200 bytes"] {
        assert!(e.contains(w), "expected {w:?} in:\n{e}");
    }
}

#[test]
fn random_corruption_never_panics() {
    let src = fixtures().join("gemma3_mm-q4");
    let orig = std::fs::read(src.join("model.safetensors")).unwrap();
    let hlen = u64::from_le_bytes(orig[..8].try_into().unwrap()) as usize;
    let t = TempDir::copy_of("gemma3_mm-q4");
    let st = t.0.join("model.safetensors");
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let (mut ok, mut failed) = (0, 0);
    // MARKBASE_FUZZ_ITERS raises the count for a longer local run.
    let iters = std::env::var("MARKBASE_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    for i in 0..iters {
        let mut b = orig.clone();
        match i % 3 {
            // Truncation anywhere (header or data).
            0 => b.truncate(rng.gen_range(0..orig.len())),
            // Bit flips in the header (length word included).
            1 => {
                for _ in 0..rng.gen_range(1..4) {
                    let p = rng.gen_range(0..8 + hlen);
                    b[p] ^= 1 << rng.gen_range(0..8);
                }
            }
            // Byte garbage anywhere.
            _ => {
                for _ in 0..rng.gen_range(1..16) {
                    let p = rng.gen_range(0..b.len());
                    b[p] = rng.gen();
                }
            }
        }
        std::fs::write(&st, &b).unwrap();
        match full_load(&t.0) {
            Ok(_) => ok += 1,
            Err(e) => {
                assert!(!e.is_empty());
                failed += 1;
            }
        }
        let _ = inspect(&t.0).to_string();
    }
    assert!(failed > 100, "ok {ok}, failed {failed}");
}

#[test]
fn missing_files_and_dirs() {
    let t = TempDir::new("empty");
    assert!(matches!(Checkpoint::open(&t.0), Err(LoadError::Io { .. })));
    std::fs::copy(fixtures().join("gemma3_text-q4/config.json"), t.0.join("config.json")).unwrap();
    let e = Checkpoint::open(&t.0).err().unwrap();
    assert!(matches!(e, LoadError::NoWeights(_)), "{e}");
    // An index that names a missing shard.
    std::fs::write(t.0.join("model.safetensors.index.json"), r#"{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}"#).unwrap();
    let e = Checkpoint::open(&t.0).err().unwrap().to_string();
    assert!(e.contains("model-00001-of-00002.safetensors") && e.contains("cannot be opened"), "{e}");
    // Empty weight file.
    std::fs::remove_file(t.0.join("model.safetensors.index.json")).unwrap();
    std::fs::write(t.0.join("model.safetensors"), b"").unwrap();
    let e = Checkpoint::open(&t.0).err().unwrap().to_string();
    assert!(e.contains("too short"), "{e}");
}

#[test]
fn inspect_fixtures() {
    for dir in fixture_dirs() {
        let name = name_of(&dir);
        let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let tc = cfg.get("text_config").unwrap_or(&cfg);
        let layers = tc["num_hidden_layers"].as_u64().unwrap() as usize;
        let ir = inspect(&dir);
        assert!(ir.ok(), "{name}: {ir}");
        assert_eq!(ir.layers.len(), layers, "{name}");
        let fam = match cfg["model_type"].as_str().unwrap() {
            "gemma3" | "gemma3_text" => Family::Gemma3,
            "gemma3n" => Family::Gemma3n,
            _ => Family::Gemma4,
        };
        assert_eq!(ir.family, Some(fam), "{name}");
        let nfull = tc["layer_types"].as_array().unwrap().iter().filter(|t| t == &"full_attention").count();
        assert_eq!(ir.layer_summary, format!("sliding×{}, full×{nfull}", layers - nfull), "{name}");
        let q: BTreeMap<&str, &str> = ir.quant.iter().map(|(g, d)| (g.as_str(), d.as_str())).collect();
        assert_eq!(q.get("norms"), Some(&"bf16"), "{name}: {q:?}");
        let attn = q["attention q/k/v/o"];
        if name.ends_with("bf16") || name.ends_with("hffused") {
            assert_eq!(attn, "bf16", "{name}");
            assert_eq!(q["embed_tokens"], "bf16", "{name}");
        } else if name.contains("-q4") {
            assert_eq!(attn, "affine 4-bit g64", "{name}");
            assert_eq!(q["embed_tokens"], "affine 4-bit g64", "{name}");
        } else if name.contains("mxfp4") {
            assert_eq!(attn, "mxfp4 g32", "{name}");
        } else if name.contains("mixed") {
            assert!(attn.contains("affine 3-bit g64 ×") && attn.contains("affine 6-bit g64 ×"), "{name}: {attn}");
        }
        if name.starts_with("gemma4_moe") {
            let m = ir.moe.as_ref().unwrap();
            assert_eq!((m.experts, m.top_k, m.intermediate), (Some(8), Some(2), Some(64)), "{name}");
            assert!(q.contains_key("experts") && q.contains_key("router"), "{name}: {q:?}");
            if name.contains("nvfp4gs") {
                assert_eq!(q["experts"], "nvfp4 g16 +global_scale");
                assert_eq!(q["router"], "affine 8-bit g64");
            }
        } else {
            assert!(ir.moe.is_none(), "{name}");
        }
        // Parameters: count from index.json metadata (quantized weights unpacked).
        let idx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
        if let Some(n) = idx["metadata"]["total_parameters"].as_u64() {
            // mlx-lm counts leaf modules only, so it misses bare parameters of
            // non-leaf modules (`layer_scalar`, `router.scale`, `altup.correct_output_scale`...).
            let cp = Checkpoint::open(&dir).unwrap();
            let uncounted: u64 = cp
                .tensors()
                .filter(|t| ![".weight", ".scales", ".biases", ".global_scale"].iter().any(|s| t.name.ends_with(s)))
                .map(|t| t.numel() as u64)
                .sum();
            if !name.contains("hffused") {
                assert_eq!(ir.params, Some(n + uncounted), "{name}");
            }
        }
        let weight_bytes: u64 = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("model") && e.file_name().to_string_lossy().ends_with(".safetensors"))
            .map(|e| e.metadata().unwrap().len())
            .sum();
        assert!(ir.weight_bytes.unwrap() < weight_bytes && ir.weight_bytes.unwrap() > weight_bytes * 8 / 10, "{name}");
        assert!(ir.kv_bytes_per_1k.unwrap() > 0);
        // The builder's coverage decides whether the expected-tensor check ran.
        let built = Checkpoint::open(&dir).unwrap().build(BuildOptions::prefill(1, 1)).is_ok();
        assert_eq!(ir.check_unavailable.is_none(), built, "{name}");
        let text = ir.to_string();
        assert!(text.contains(&format!("layers: {layers} (")), "{name}: {text}");
        if !built {
            assert!(text.contains("expected-tensor check unavailable"), "{name}");
        }
        let j = ir.to_json();
        assert_eq!(j["num_layers"].as_u64(), Some(layers as u64));
        assert_eq!(j["ok"], serde_json::json!(true));
        assert!(j["quantization"].as_array().unwrap().len() >= 3);
    }
}

#[test]
fn inspect_gemma3_kv_memory() {
    let ir = inspect(fixtures().join("gemma3_text-q4"));
    // 6 layers, 2 kv heads x 32 dims, K+V in f32, 1024 tokens.
    assert_eq!(ir.kv_bytes_per_1k, Some(6 * 2 * 2 * 32 * 4 * 1024));
    assert!(ir.report.as_ref().unwrap().is_empty());
    let s = ir.to_string();
    assert!(s.contains("quantization: embed_tokens: affine 4-bit g64; attention q/k/v/o: affine 4-bit g64; mlp: affine 4-bit g64; norms: bf16"), "{s}");
}

#[test]
fn check_is_cheap_and_complete() {
    let cp = Checkpoint::open(fixtures().join("broken/missing-tensor")).unwrap();
    let (g, _) = graph_for(&cp);
    let r = cp.check(&g);
    assert_eq!(r.errors().count(), 1, "{r}");
    let p = r.errors().next().unwrap();
    assert_eq!((p.layer, p.severity), (Some(1), Severity::Error));
    assert_eq!(p.tensor.as_deref(), Some("language_model.model.layers.1.self_attn.k_proj.weight"));
}

#[test]
fn inspect_output_examples() {
    // Visible with --nocapture; also checks Display/JSON on a few shapes of model.
    for name in ["gemma3_text-mixed36", "gemma4_moe-nvfp4gs", "gemma3n-q4", "broken/truncated-file"] {
        let ir = inspect(fixtures().join(name));
        let text = ir.to_string();
        eprintln!("{text}");
        assert!(text.starts_with("checkpoint: "));
        assert!(serde_json::to_string(&ir.to_json()).unwrap().contains("\"layers\""));
    }
    eprintln!("{}", serde_json::to_string_pretty(&inspect(fixtures().join("gemma4_moe-q4")).to_json()).unwrap());
}
