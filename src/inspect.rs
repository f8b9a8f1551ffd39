//! `markbase inspect`: what a checkpoint is, from its config and tensor headers,
//! plus the loader's problem report.
//!
//! Everything is derived without copying tensor data. For families the graph
//! builder does not support yet, the expected-tensor check is skipped (and said
//! so); everything else is still printed.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use markbase_graph::{BuildOptions, Family, LayerType, ModelConfig};
use serde_json::{json, Value};

use crate::loader::towers::TowerSummary;
use crate::loader::{read_config, Checkpoint, Report};

/// One decoder layer.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LayerInfo {
    pub index: usize,
    /// "sliding" or "full".
    #[serde(rename = "type")]
    pub kind: String,
    pub head_dim: usize,
    pub kv_heads: usize,
    pub intermediate: usize,
    /// The layer whose KV cache this one reads (itself unless KV-shared).
    pub kv_source: usize,
}

/// MoE settings.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MoeInfo {
    pub experts: Option<usize>,
    pub top_k: Option<usize>,
    pub intermediate: Option<usize>,
}

/// Result of [`inspect`]; always produced, with `error` set when the checkpoint
/// could not be opened (then only what the config gives is filled in).
#[derive(Clone, Debug)]
pub struct InspectReport {
    pub dir: PathBuf,
    /// Fatal error (config unusable, weight files unreadable).
    pub error: Option<String>,
    pub model_type: Option<String>,
    pub family: Option<Family>,
    pub prefix: Option<String>,
    pub files: Vec<String>,
    /// e.g. "sliding×5, full×1".
    pub layer_summary: String,
    pub layers: Vec<LayerInfo>,
    pub hidden_size: Option<usize>,
    pub num_heads: Option<usize>,
    pub vocab_size: Option<usize>,
    /// Parameters (quantized weights counted unpacked); from the tensor headers.
    pub params: Option<u64>,
    /// Quantization per module group, e.g. ("mlp", "affine 4-bit g64").
    pub quant: Vec<(String, String)>,
    pub moe: Option<MoeInfo>,
    /// Stored bytes of all text-model tensors.
    pub weight_bytes: Option<u64>,
    /// KV-cache bytes per 1024 tokens (f32 K+V over the layers that own a cache).
    pub kv_bytes_per_1k: Option<u64>,
    pub tower_tensors: usize,
    /// The vision and audio towers (`None`: the checkpoint could not be opened).
    pub towers: Option<TowerSummary>,
    /// What the loader inferred from the tensors.
    pub notes: Vec<String>,
    /// `None` when the expected-tensor check ran; else why it could not.
    pub check_unavailable: Option<String>,
    pub report: Option<Report>,
}

/// Inspects the checkpoint in `dir`.
pub fn inspect(dir: impl AsRef<Path>) -> InspectReport {
    let dir = dir.as_ref();
    let mut r = InspectReport {
        dir: dir.to_path_buf(),
        error: None,
        model_type: None,
        family: None,
        prefix: None,
        files: vec![],
        layer_summary: String::new(),
        layers: vec![],
        hidden_size: None,
        num_heads: None,
        vocab_size: None,
        params: None,
        quant: vec![],
        moe: None,
        weight_bytes: None,
        kv_bytes_per_1k: None,
        tower_tensors: 0,
        towers: None,
        notes: vec![],
        check_unavailable: None,
        report: None,
    };
    let cp = match Checkpoint::open(dir) {
        Ok(cp) => cp,
        Err(e) => {
            r.error = Some(e.to_string());
            if let Some(rep) = e.report() {
                r.report = Some(rep.clone());
            }
            // Still describe what the config says.
            if let Ok((_, cfg)) = read_config(dir) {
                fill_config(&mut r, &cfg);
            }
            return r;
        }
    };
    let cfg = cp.config();
    fill_config(&mut r, cfg);
    r.prefix = Some(cp.prefix().to_string());
    r.files = cp.files().iter().map(|p| p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned())).collect();
    r.tower_tensors = cp.tower_tensors().len();
    r.notes = cp.notes().to_vec();
    r.weight_bytes = Some(cp.tensors().map(|t| t.nbytes() as u64).sum());

    let params = cp.params();
    r.params = Some(params.iter().map(|p| p.shape.iter().product::<usize>() as u64).sum());
    // Formats per module group, in a fixed order.
    let mut groups: BTreeMap<(usize, &'static str), BTreeMap<String, usize>> = BTreeMap::new();
    for p in &params {
        let rel = strip_layer(p.name.strip_prefix(cp.prefix()).unwrap_or(&p.name));
        let g = group_of(rel, p.module);
        *groups.entry(g).or_default().entry(p.format.describe()).or_default() += 1;
    }
    r.quant = groups
        .into_iter()
        .map(|((_, g), fmts)| {
            let d = if fmts.len() == 1 {
                fmts.into_keys().next().unwrap_or_default()
            } else {
                let mut v: Vec<(String, usize)> = fmts.into_iter().collect();
                v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                v.iter().map(|(f, n)| format!("{f} ×{n}")).collect::<Vec<_>>().join(", ")
            };
            (g.to_string(), d)
        })
        .collect();

    r.towers = Some(cp.tower_summary());
    match cp.build(BuildOptions::prefill(1, 1)) {
        Ok(graph) => {
            let mut rep = cp.check(&graph);
            // the vision tower's tensors, checked as the text model's are; its errors leave the
            // text model usable, so they are listed as warnings that say what they cost
            let vision = match cp.vision_config() {
                Ok(Some(vc)) => cp.check_vision(&vc).problems,
                Ok(None) => vec![],
                Err(e) => vec![crate::loader::Problem::error("config.json", e.to_string())],
            };
            for mut p in vision {
                if p.is_error() {
                    p.severity = crate::loader::Severity::Warning;
                    p.message.push_str(" (images cannot be used)");
                }
                rep.push(p);
            }
            r.report = Some(rep);
        }
        Err(e) => {
            r.check_unavailable = Some(format!("expected-tensor check unavailable ({e})"));
            let mut rep = Report::new(dir, cp.prefix());
            rep.extend(cp.open_problems().iter().cloned());
            r.report = Some(rep);
        }
    }
    r
}

fn fill_config(r: &mut InspectReport, cfg: &ModelConfig) {
    r.model_type = Some(cfg.model_type.clone());
    r.family = Some(cfg.family);
    r.hidden_size = Some(cfg.hidden_size);
    r.num_heads = Some(cfg.num_heads);
    r.vocab_size = Some(cfg.vocab_size);
    let ns = cfg.layer_types.iter().filter(|t| **t == LayerType::Sliding).count();
    let nf = cfg.layer_types.len() - ns;
    r.layer_summary = format!("sliding×{ns}, full×{nf}");
    r.layers = (0..cfg.num_layers)
        .map(|i| LayerInfo {
            index: i,
            kind: match cfg.layer_types[i] {
                LayerType::Sliding => "sliding".into(),
                LayerType::Full => "full".into(),
            },
            head_dim: cfg.layer_head_dim(i),
            kv_heads: cfg.layer_kv_heads(i),
            intermediate: cfg.layer_intermediate(i),
            kv_source: cfg.kv_source(i),
        })
        .collect();
    r.kv_bytes_per_1k = Some(cfg.kv_bytes_per_token() as u64 * 1024);
    if cfg.enable_moe_block {
        r.moe = Some(MoeInfo { experts: cfg.num_experts, top_k: cfg.top_k_experts, intermediate: cfg.moe_intermediate_size });
    }
}

/// `layers.3.mlp.up_proj` → `mlp.up_proj`.
fn strip_layer(rel: &str) -> &str {
    if let Some(rest) = rel.strip_prefix("layers.") {
        if let Some((n, tail)) = rest.split_once('.') {
            if n.parse::<usize>().is_ok() {
                return tail;
            }
        }
    }
    rel
}

/// Display group of a weight (sort key, name).
fn group_of(rel: &str, module: bool) -> (usize, &'static str) {
    let last = rel.rsplit('.').next().unwrap_or(rel);
    if rel.contains("norm") && (!module || rel.ends_with("norm.weight")) {
        return (20, "norms");
    }
    if rel.starts_with("embed_tokens_per_layer") {
        return (2, "embed_tokens_per_layer");
    }
    if rel.starts_with("embed_tokens") {
        return (1, "embed_tokens");
    }
    if rel.contains("lm_head") {
        return (3, "lm_head");
    }
    if rel.starts_with("self_attn.") && rel.ends_with("_proj") {
        return (4, "attention q/k/v/o");
    }
    if rel.starts_with("mlp.") {
        return (5, "mlp");
    }
    if rel.starts_with("experts.") {
        return (6, "experts");
    }
    if rel.starts_with("router.proj") {
        return (7, "router");
    }
    if rel.starts_with("per_layer") {
        return (8, "per-layer inputs");
    }
    if rel.starts_with("altup") {
        return if module { (9, "altup") } else { (21, "scalars") };
    }
    if rel.starts_with("laurel.") {
        return (10, "laurel");
    }
    if !module || matches!(last, "layer_scalar" | "scale" | "per_expert_scale") {
        return (21, "scalars");
    }
    (15, "other")
}

fn human_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut i = 0;
    while x >= 1024.0 && i < U.len() - 1 {
        x /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{x:.2} {}", U[i])
    }
}

fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

impl InspectReport {
    /// Whether the checkpoint has no error-level problem.
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.report.as_ref().is_none_or(|r| !r.has_errors())
    }

    /// Machine-readable form (`--json`).
    pub fn to_json(&self) -> Value {
        let problems: Vec<Value> = self
            .report
            .as_ref()
            .map(|r| r.sorted().into_iter().map(|p| serde_json::to_value(p).unwrap_or(Value::Null)).collect())
            .unwrap_or_default();
        json!({
            "dir": self.dir.display().to_string(),
            "ok": self.ok(),
            "error": self.error,
            "model_type": self.model_type,
            "family": self.family,
            "prefix": self.prefix,
            "files": self.files,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "vocab_size": self.vocab_size,
            "num_layers": self.layers.len(),
            "layer_summary": self.layer_summary,
            "layers": self.layers,
            "params": self.params,
            "quantization": self.quant.iter().map(|(g, d)| json!({"group": g, "format": d})).collect::<Vec<_>>(),
            "moe": self.moe,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_1k_tokens": self.kv_bytes_per_1k,
            "tower_tensors": self.tower_tensors,
            "towers": self.towers,
            "notes": self.notes,
            "check_unavailable": self.check_unavailable,
            "problems": problems,
        })
    }
}

impl fmt::Display for InspectReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "checkpoint: {}", self.dir.display())?;
        if let Some(e) = &self.error {
            writeln!(f, "ERROR: {e}")?;
        }
        if let (Some(mt), Some(fam)) = (&self.model_type, self.family) {
            write!(f, "model_type: {mt} (family {fam:?})")?;
            if let Some(p) = &self.prefix {
                write!(f, ", prefix `{p}`")?;
            }
            if !self.files.is_empty() {
                write!(f, ", {} file(s): {}", self.files.len(), self.files.join(", "))?;
            }
            writeln!(f)?;
        }
        if !self.layers.is_empty() {
            writeln!(f, "layers: {} ({})", self.layers.len(), self.layer_summary)?;
            let list: Vec<String> = self
                .layers
                .iter()
                .map(|l| {
                    let shared = if l.kv_source != l.index { format!(" kv←{}", l.kv_source) } else { String::new() };
                    format!("{}:{}{shared}", l.index, l.kind)
                })
                .collect();
            writeln!(f, "  {}", list.join(" "))?;
        }
        if let (Some(h), Some(nh), Some(v)) = (self.hidden_size, self.num_heads, self.vocab_size) {
            writeln!(f, "dims: hidden {h}, heads {nh}, vocab {v}")?;
        }
        if let Some(p) = self.params {
            writeln!(f, "parameters: {} ({p})", human_count(p))?;
        }
        if !self.quant.is_empty() {
            let q: Vec<String> = self.quant.iter().map(|(g, d)| format!("{g}: {d}")).collect();
            writeln!(f, "quantization: {}", q.join("; "))?;
        }
        if let Some(m) = &self.moe {
            let s = |x: Option<usize>| x.map_or("?".to_string(), |v| v.to_string());
            writeln!(f, "moe: {} experts, top-{}, expert intermediate {}", s(m.experts), s(m.top_k), s(m.intermediate))?;
        }
        if let Some(b) = self.weight_bytes {
            writeln!(f, "weight memory: {} ({b} bytes)", human_bytes(b))?;
        }
        if let Some(k) = self.kv_bytes_per_1k {
            let own = self.layers.iter().filter(|l| l.kv_source == l.index).count();
            writeln!(f, "kv cache: {} per 1k tokens (f32 K+V, {own} of {} layers own a cache)", human_bytes(k), self.layers.len())?;
        }
        if let Some(t) = &self.towers {
            if let Some(v) = &t.vision {
                writeln!(
                    f,
                    "vision tower: {v}, {} layers, {} parameters ({}), stored as {}, {} soft tokens per image",
                    t.vision_layers,
                    human_count(t.vision_params),
                    human_bytes(t.vision_bytes),
                    t.vision_storage.join(" + "),
                    t.soft_tokens
                )?;
            }
            let other = self.tower_tensors - t.audio_tensors.len();
            if t.vision.is_none() && other > 0 {
                writeln!(f, "towers: {other} vision tensors, not used (config.json has no supported vision_config)")?;
            }
            match (t.audio_layers, t.audio_tensors.len()) {
                (_, 0) => {}
                (Some(l), n) => writeln!(f, "audio tower: {} conformer of {l} blocks, {n} tensors", t.audio_tower.unwrap_or("a"))?,
                (None, n) => writeln!(f, "audio tower: {n} tensors, not used (this audio tower is not supported)")?,
            }
        } else if self.tower_tensors > 0 {
            writeln!(f, "towers: {} vision/audio tensors", self.tower_tensors)?;
        }
        for n in &self.notes {
            writeln!(f, "inferred: {n}")?;
        }
        if let Some(u) = &self.check_unavailable {
            writeln!(f, "note: {u}")?;
        }
        match &self.report {
            Some(rep) if rep.is_empty() => writeln!(f, "problems: none")?,
            Some(rep) => writeln!(f, "problems: {rep}")?,
            None => {}
        }
        Ok(())
    }
}
