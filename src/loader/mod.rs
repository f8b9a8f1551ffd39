//! Loading MLX checkpoints.
//!
//! [`Checkpoint::open`] reads `config.json`, finds the safetensors shard(s),
//! memory-maps them and parses their headers (defensively, see [`safetensors`]).
//! Tensor data is never reinterpreted in place (MLX does not align it); every
//! tensor handed out is a copy of its stored bytes ([`RawTensor`]).
//!
//! The checkpoint is a [`WeightResolver`] for the graph builders: a module is
//! quantized iff `<name>.scales` exists; its mode/bits/group size come from the
//! config (override for the module path, else the global entry) and are checked
//! against the tensor shapes by [`Checkpoint::check`] / [`Checkpoint::load_weights`],
//! which collect every problem into one [`Report`].

pub mod adjust;
pub mod names;
pub mod report;
pub mod safetensors;
pub mod towers;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use markbase_graph::builder::{ConfigResolver, WeightResolver};
use markbase_graph::config::ConfigError;
use markbase_graph::ir::WeightParam;
use markbase_graph::quant::{FloatType, QuantMode, QuantSpec, WeightFormat};
use markbase_graph::{BuildOptions, Graph, ModelConfig};
use memmap2::Mmap;
use rayon::prelude::*;
use serde_json::Value;

use crate::weights::{RawDType, RawTensor, WeightData, Weights};

pub use adjust::{adjust_config, Adjusted};
pub use names::{canonical, detect_prefix, is_tower, Part};
pub use report::{Problem, Report, Severity};
pub use safetensors::Defect;

/// Why a checkpoint cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("{}: {msg}", path.display())]
    Io { path: PathBuf, msg: String },
    /// `config.json` is unusable (not JSON, unknown model type, bad field).
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    /// No `model.safetensors` / `model-*.safetensors` in the directory.
    #[error("{}: no model.safetensors or model-*-of-*.safetensors found", .0.display())]
    NoWeights(PathBuf),
    /// The graph could not be built for this checkpoint.
    #[error("{0}")]
    Build(String),
    /// Problems in the files or tensors; the report lists all of them.
    #[error("{0}")]
    Invalid(Report),
}

impl LoadError {
    /// The report, for [`LoadError::Invalid`].
    pub fn report(&self) -> Option<&Report> {
        match self {
            LoadError::Invalid(r) => Some(r),
            _ => None,
        }
    }
}

/// One tensor of the checkpoint, by its canonical name.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Canonical full name (MoE expert stacks under `experts.switch_glu.*`).
    pub name: String,
    /// Name as stored in the file (differs for renamed/fused expert tensors).
    pub stored_name: String,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// dtype as written in the header, and the parsed one if markbase can use it.
    pub dtype_name: String,
    pub dtype: Option<RawDType>,
    /// Shape of this (canonical) tensor.
    pub shape: Vec<usize>,
    /// Absolute byte range of the *stored* tensor in its file.
    pub offset: usize,
    pub len: usize,
    pub part: Part,
    /// Set when the header describes bytes that cannot be read.
    pub defect: Option<Defect>,
}

impl TensorInfo {
    /// Bytes of this canonical tensor.
    pub fn nbytes(&self) -> usize {
        match self.part {
            Part::Whole | Part::Transposed => self.len,
            Part::Half { .. } => self.len / 2,
        }
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

struct Shard {
    path: PathBuf,
    /// File name, for messages.
    name: String,
    map: Mmap,
}

/// Progress of [`Checkpoint::load_weights_with`]: bytes copied so far, and in total.
pub type ProgressFn = dyn Fn(u64, u64) + Send + Sync;

/// Options of [`Checkpoint::load_weights_with`].
#[derive(Default)]
pub struct LoadOptions<'a> {
    /// Called after each tensor is copied with `(bytes_loaded, bytes_total)`;
    /// may be called from several threads.
    pub progress: Option<&'a (dyn Fn(u64, u64) + Send + Sync + 'a)>,
}

/// An opened MLX checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    config: ModelConfig,
    config_json: Value,
    prefix: String,
    shards: Vec<Shard>,
    /// Text-model and other non-tower tensors, by canonical name.
    tensors: BTreeMap<String, TensorInfo>,
    /// Vision/audio tower and projector tensors (stored names), not part of the text model.
    towers: Vec<String>,
    /// The tower tensors by name (see [`towers`]).
    tower_index: BTreeMap<String, TensorInfo>,
    /// Problems found while opening (header defects, config/tensor disagreements).
    problems: Vec<Problem>,
    notes: Vec<String>,
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> LoadError {
    LoadError::Io { path: path.to_path_buf(), msg: e.to_string() }
}

/// Reads and parses `dir/config.json` (the raw JSON and the normalized config).
pub fn read_config(dir: &Path) -> Result<(Value, ModelConfig), LoadError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| io_err(&path, e))?;
    let cerr = |msg: String| LoadError::Config { path: path.clone(), msg };
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| cerr(format!("config.json is not valid JSON (line {} column {}: {e})", e.line(), e.column())))?;
    let cfg = ModelConfig::from_value(&v).map_err(|e| match e {
        ConfigError::UnknownModelType(t) => {
            cerr(format!("unsupported model_type `{t}` (supported: gemma3_text, gemma3, gemma4_text, gemma4, gemma3n)"))
        }
        other => cerr(other.to_string()),
    })?;
    Ok((v, cfg))
}

/// The safetensors files of `dir`: those named by `model.safetensors.index.json`
/// if it is present and valid, else `model*.safetensors` (sorted).
fn find_files(dir: &Path, problems: &mut Vec<Problem>) -> Result<(Vec<PathBuf>, BTreeMap<String, String>), LoadError> {
    let index = dir.join("model.safetensors.index.json");
    let mut weight_map = BTreeMap::new();
    if index.exists() {
        let parsed = std::fs::read_to_string(&index)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|e| e.to_string()));
        match parsed {
            Ok(v) => match v.get("weight_map").and_then(Value::as_object) {
                Some(m) => {
                    for (k, f) in m {
                        match f.as_str() {
                            Some(f) if !f.contains('/') && !f.contains('\\') && f != ".." => {
                                weight_map.insert(k.clone(), f.to_string());
                            }
                            _ => problems.push(Problem::warning("model.safetensors.index.json", format!("ignoring odd entry for `{k}`: {f}"))),
                        }
                    }
                }
                None => problems.push(Problem::warning("model.safetensors.index.json", "has no weight_map; globbing model*.safetensors")),
            },
            Err(e) => problems.push(Problem::warning("model.safetensors.index.json", format!("unreadable ({e}); globbing model*.safetensors"))),
        }
    }
    let mut files: Vec<PathBuf> = if !weight_map.is_empty() {
        let set: BTreeSet<&String> = weight_map.values().collect();
        set.into_iter().map(|f| dir.join(f)).collect()
    } else {
        let rd = std::fs::read_dir(dir).map_err(|e| io_err(dir, e))?;
        rd.filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors"))
            })
            .collect()
    };
    files.sort();
    if files.is_empty() {
        return Err(LoadError::NoWeights(dir.to_path_buf()));
    }
    Ok((files, weight_map))
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`.
    ///
    /// Fails when `config.json` is unusable, when no weight file exists, or when
    /// a weight file is unreadable as a whole (short file, absurd header length,
    /// invalid header JSON) — all such file problems are collected first. Problems
    /// of single tensors do not fail `open`; they are reported by
    /// [`check`](Self::check) and make [`load_weights`](Self::load_weights) fail.
    pub fn open(dir: impl AsRef<Path>) -> Result<Checkpoint, LoadError> {
        let dir = dir.as_ref().to_path_buf();
        let (config_json, config) = read_config(&dir)?;
        let mut problems = vec![];
        let (files, weight_map) = find_files(&dir, &mut problems)?;

        // Map and parse every file; collect all file-level failures.
        let mut shards = vec![];
        let mut headers = vec![];
        let mut fatal = Report::new(&dir, "");
        for path in &files {
            let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
            let file = match File::open(path) {
                Ok(f) => f,
                Err(e) => {
                    fatal.push(Problem::error(format!("{name}:"), format!("cannot be opened: {e}")));
                    continue;
                }
            };
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            if len < 8 {
                fatal.push(Problem::error(format!("{name}:"), format!("file is too short ({len} bytes) to be a safetensors file")));
                continue;
            }
            // SAFETY: the map is only read; the usual caveat of memory maps applies
            // (the file must not be truncated by another process while mapped).
            let map = match unsafe { Mmap::map(&file) } {
                Ok(m) => m,
                Err(e) => {
                    fatal.push(Problem::error(format!("{name}:"), format!("cannot be memory-mapped: {e}")));
                    continue;
                }
            };
            match safetensors::parse(&map, &name) {
                Ok(h) => {
                    headers.push((shards.len(), h));
                    shards.push(Shard { path: path.clone(), name, map });
                }
                Err(msg) => {
                    let msg = msg.strip_prefix(&format!("{name}: ")).unwrap_or(&msg).to_string();
                    fatal.push(Problem::error(format!("{name}:"), msg));
                }
            }
        }
        if fatal.has_errors() {
            return Err(LoadError::Invalid(fatal));
        }

        // Prefix from the embedding's name.
        let all_names = headers.iter().flat_map(|(_, h)| h.entries.iter().map(|e| e.name.as_str()));
        let detected = detect_prefix(all_names, config.default_prefix());
        let prefix = detected.clone().unwrap_or_else(|| config.default_prefix().to_string());
        if detected.is_none() {
            problems.push(Problem::error(
                format!("{prefix}embed_tokens.weight"),
                "missing: no `*embed_tokens.weight` tensor, cannot locate the text model".to_string(),
            ));
        }

        // Index of canonical names.
        let mut tensors: BTreeMap<String, TensorInfo> = BTreeMap::new();
        let mut towers = vec![];
        let mut tower_index = BTreeMap::new();
        let mut stored_in: BTreeMap<String, usize> = BTreeMap::new();
        for (fi, h) in &headers {
            let fname = &shards[*fi].name;
            if let Some(t) = &h.truncation {
                problems.push(Problem::error(fname, t.strip_prefix(&format!("{fname} ")).unwrap_or(t)));
            }
            for e in &h.entries {
                if let Some(prev) = stored_in.insert(e.name.clone(), *fi) {
                    problems.push(Problem::tensor(
                        Severity::Error,
                        &e.name,
                        &prefix,
                        format!("is stored twice ({} and {fname})", shards[prev].name),
                    ));
                    continue;
                }
                let tower = is_tower(&e.name);
                if tower {
                    towers.push(e.name.clone());
                }
                if let Some(d) = &e.defect {
                    if !d.truncated {
                        let sev = if tower { Severity::Warning } else { Severity::Error };
                        problems.push(Problem::tensor(sev, &e.name, &prefix, d.message.clone()));
                    }
                }
                if tower {
                    let info = TensorInfo {
                        name: e.name.clone(),
                        stored_name: e.name.clone(),
                        file: *fi,
                        dtype_name: e.dtype_name.clone(),
                        dtype: e.dtype,
                        shape: e.shape.clone(),
                        offset: h.data_start + e.begin,
                        len: e.end - e.begin,
                        part: Part::Whole,
                        defect: e.defect.clone(),
                    };
                    for d in towers::derived(&info) {
                        tower_index.insert(d.name.clone(), d);
                    }
                    tower_index.insert(e.name.clone(), info);
                    continue;
                }
                for (cname, part) in canonical(&e.name) {
                    let mut shape = e.shape.clone();
                    let mut defect = e.defect.clone();
                    if let Part::Half { .. } = part {
                        let n = shape.len();
                        if n < 2 || shape[n - 2] % 2 != 0 {
                            defect = defect.or(Some(Defect {
                                message: format!("fused gate_up_proj {shape:?} cannot be split in halves along axis -2"),
                                truncated: false,
                            }));
                            if e.defect.is_none() {
                                problems.push(Problem::tensor(Severity::Error, &e.name, &prefix, format!("has shape {shape:?}; a fused gate_up_proj needs an even axis -2")));
                            }
                        } else {
                            shape[n - 2] /= 2;
                        }
                    }
                    let info = TensorInfo {
                        name: cname.clone(),
                        stored_name: e.name.clone(),
                        file: *fi,
                        dtype_name: e.dtype_name.clone(),
                        dtype: e.dtype,
                        shape,
                        offset: h.data_start + e.begin,
                        len: e.end - e.begin,
                        part,
                        defect,
                    };
                    if let Some(other) = tensors.get(&cname) {
                        problems.push(Problem::tensor(
                            Severity::Error,
                            &cname,
                            &prefix,
                            format!("is given twice (as `{}` and `{}`)", other.stored_name, e.name),
                        ));
                        continue;
                    }
                    tensors.insert(cname, info);
                }
            }
        }
        // The index must agree with the files.
        for (name, f) in &weight_map {
            match stored_in.get(name) {
                Some(&fi) if shards[fi].name == *f => {}
                Some(&fi) => problems.push(Problem::tensor(
                    Severity::Warning,
                    name,
                    &prefix,
                    format!("is listed in model.safetensors.index.json under {f} but stored in {}", shards[fi].name),
                )),
                None => problems.push(Problem::tensor(
                    Severity::Error,
                    name,
                    &prefix,
                    format!("is listed in model.safetensors.index.json ({f}) but is not in the file"),
                )),
            }
        }

        let shape_of = |n: &str| tensors.get(n).map(|t| t.shape.clone());
        let adj = adjust_config(&config, &prefix, &shape_of);
        problems.extend(adj.problems);

        Ok(Checkpoint { dir, config: adj.config, config_json, prefix, shards, tensors, towers, tower_index, problems, notes: adj.notes })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The model config, adjusted to the tensors (see [`adjust_config`]).
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    /// `config.json` as read.
    pub fn config_json(&self) -> &Value {
        &self.config_json
    }
    /// Text-model tensor prefix (`model.`, `language_model.model.`, `model.language_model.`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// Paths of the safetensors files.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }
    /// A tensor by canonical full name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }
    /// All non-tower tensors by canonical name, sorted.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors.values()
    }
    /// Names of the vision/audio tower and projector tensors (not part of the text model).
    pub fn tower_tensors(&self) -> &[String] {
        &self.towers
    }
    /// Problems found while opening (included in every [`check`](Self::check) report).
    pub fn open_problems(&self) -> &[Problem] {
        &self.problems
    }
    /// What was inferred from the tensors (MoE settings), for display.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Copies the bytes of a tensor (by canonical name).
    pub fn read(&self, name: &str) -> Result<RawTensor, String> {
        let t = self.tensors.get(name).ok_or_else(|| format!("tensor `{name}` not in the checkpoint"))?;
        self.read_info(t)
    }

    fn read_info(&self, t: &TensorInfo) -> Result<RawTensor, String> {
        if let Some(d) = &t.defect {
            return Err(format!("tensor `{}`: {}", t.stored_name, d.message));
        }
        let dtype = t.dtype.ok_or_else(|| format!("tensor `{}`: unsupported dtype {}", t.stored_name, t.dtype_name))?;
        let map = &self.shards[t.file].map;
        let src = map.get(t.offset..t.offset + t.len).ok_or_else(|| format!("tensor `{}`: data out of file bounds", t.stored_name))?;
        let bytes = match t.part {
            Part::Whole => src.to_vec(),
            Part::Transposed => {
                // canonical [r, c] from stored [c, r]
                let (r, c) = (t.shape[0], t.shape[1]);
                let b = dtype.bytes();
                let mut v = vec![0u8; src.len()];
                for i in 0..r {
                    for j in 0..c {
                        v[(i * c + j) * b..(i * c + j + 1) * b].copy_from_slice(&src[(j * r + i) * b..(j * r + i + 1) * b]);
                    }
                }
                v
            }
            Part::Half { second } => {
                // Stored [..., 2*Im, C]: each leading index holds gate rows then up rows.
                let outer: usize = t.shape[..t.shape.len() - 2].iter().product();
                let half = t.nbytes() / outer.max(1);
                let mut v = Vec::with_capacity(t.nbytes());
                for e in 0..outer {
                    let base = e * 2 * half + if second { half } else { 0 };
                    v.extend_from_slice(&src[base..base + half]);
                }
                v
            }
        };
        Ok(RawTensor { dtype, shape: t.shape.clone(), bytes })
    }

    /// Builds the graph of this checkpoint (its adjusted config, its prefix and
    /// this checkpoint as the weight resolver).
    pub fn build(&self, mut opts: BuildOptions) -> Result<Graph, LoadError> {
        opts.prefix = Some(self.prefix.clone());
        markbase_graph::build(&self.config, self, &opts).map_err(|e| LoadError::Build(e.to_string()))
    }

    /// The quantization the checkpoint's shapes imply for module `name`, if it is quantized.
    pub fn inferred_spec(&self, name: &str, in_dim: usize) -> Option<QuantSpec> {
        let w = self.tensors.get(&format!("{name}.weight"))?;
        let s = self.tensors.get(&format!("{name}.scales"))?;
        infer_spec(w, s, in_dim)
    }

    /// Every weight of the text model found in the checkpoint, described as a
    /// graph would: modules (`X.weight` of rank ≥ 2, or with `X.scales`) with
    /// their float shape and format, and plain tensors. Works for any family
    /// (no graph builder needed).
    pub fn params(&self) -> Vec<WeightParam> {
        let mut out = vec![];
        for (name, t) in &self.tensors {
            let (module, mname) = match name.strip_suffix(".weight") {
                Some(m) if self.tensors.contains_key(&format!("{m}.scales")) || t.shape.len() >= 2 => (true, m),
                _ => (false, name.as_str()),
            };
            if !module {
                // Quantization companions belong to their module.
                let companion = [".scales", ".biases", ".global_scale"]
                    .iter()
                    .any(|s| name.strip_suffix(s).is_some_and(|m| self.tensors.contains_key(&format!("{m}.weight"))));
                if companion {
                    continue;
                }
                let dtype = float_type(t.dtype).unwrap_or(FloatType::Bf16);
                out.push(WeightParam { name: name.clone(), shape: t.shape.clone(), format: WeightFormat::Float { dtype }, module: false });
                continue;
            }
            let format = self.module_format(&self.tensors, mname, None);
            let shape = match format {
                WeightFormat::Quantized { spec, .. } if !t.shape.is_empty() => {
                    let mut s = t.shape.clone();
                    let last = s.len() - 1;
                    s[last] = s[last] * 32 / spec.bits.max(1);
                    s
                }
                _ => t.shape.clone(),
            };
            out.push(WeightParam { name: mname.to_string(), shape, format, module: true });
        }
        out
    }

    /// Format of module `name` (tensors `name.weight`, `name.scales`, ...).
    /// `shape`: the expected float shape when known (used when nothing is stored).
    /// `index`: the tensors it is looked up in (the text model's or the towers').
    fn module_format(&self, index: &BTreeMap<String, TensorInfo>, name: &str, shape: Option<&[usize]>) -> WeightFormat {
        let w = index.get(&format!("{name}.weight"));
        let s = index.get(&format!("{name}.scales"));
        if let Some(s) = s {
            let global_scale = index.contains_key(&format!("{name}.global_scale"));
            let in_dim = shape.and_then(|v| v.last().copied());
            // Config first (override, else global); the shapes only when the config is silent.
            let spec = self.config.quant.for_module(name).or_else(|| {
                let w = w?;
                let in_dim = in_dim.or_else(|| guess_in_dim(w, s))?;
                infer_spec(w, s, in_dim)
            });
            if let Some(spec) = spec {
                return WeightFormat::Quantized { spec, global_scale };
            }
        }
        match w {
            Some(w) => WeightFormat::Float { dtype: float_type(w.dtype).unwrap_or(FloatType::Bf16) },
            // Nothing stored: what the config would say (for the "missing" message).
            None => match shape {
                Some(sh) => ConfigResolver(&self.config).format(name, sh, true),
                None => WeightFormat::Float { dtype: FloatType::Bf16 },
            },
        }
    }

    /// Checks the checkpoint against `graph` without copying data: every weight
    /// parameter's tensors must exist with the right dtype and shape; tensors the
    /// graph does not use (other than tower tensors) are warnings. Includes the
    /// problems found by [`open`](Self::open).
    pub fn check(&self, graph: &Graph) -> Report {
        let mut r = Report::new(&self.dir, &self.prefix);
        r.extend(self.problems.iter().cloned());
        let mut used = HashSet::new();
        let mut seen = HashSet::new();
        for (_, p) in graph.weights() {
            if seen.insert(p.name.clone()) {
                self.check_param(&self.tensors, &self.prefix, p, &mut used, &mut r);
            }
        }
        for (name, t) in &self.tensors {
            if !used.contains(name.as_str()) {
                let what = if t.stored_name != *name { format!(" (stored as `{}`)", t.stored_name) } else { String::new() };
                r.push(Problem::tensor(Severity::Warning, name, &self.prefix, format!("unexpected tensor{what} ignored: not used by the model graph")));
            }
        }
        r
    }

    /// Checks the tensors of one weight parameter, looked up in `index` (names in problems
    /// relative to `pre`).
    fn check_param<'a>(&'a self, index: &'a BTreeMap<String, TensorInfo>, pre: &str, p: &WeightParam, used: &mut HashSet<&'a str>, r: &mut Report) {
        // Marks a tensor as used by the graph (if it exists).
        let mark = |used: &mut HashSet<&'a str>, full: &str| {
            if let Some((k, _)) = index.get_key_value(full) {
                used.insert(k.as_str());
            }
        };
        // Looks a tensor up, marking it used; reports missing / unreadable ones.
        let get = |used: &mut HashSet<&'a str>, r: &mut Report, full: &str, expect: &str| -> Option<&'a TensorInfo> {
            match index.get_key_value(full) {
                None => {
                    r.push(Problem::tensor(Severity::Error, full, pre, format!("missing (expected {expect})")));
                    None
                }
                Some((k, t)) => {
                    used.insert(k.as_str());
                    // Defects were reported by `open` (truncation once per file).
                    match &t.defect {
                        Some(_) => None,
                        None => Some(t),
                    }
                }
            }
        };
        let floats = "BF16/F16/F32";
        let shape_err = |r: &mut Report, full: &str, t: &TensorInfo, want: &[usize], why: &str| {
            if t.shape != want {
                r.push(Problem::tensor(Severity::Error, full, pre, format!("has shape {:?}, expected {want:?}{why}", t.shape)));
            }
        };
        let dtype_err = |r: &mut Report, full: &str, t: &TensorInfo, ok: &[RawDType], want: &str, why: &str| -> bool {
            if t.dtype.is_some_and(|d| ok.contains(&d)) {
                return true;
            }
            r.push(Problem::tensor(Severity::Error, full, pre, format!("has dtype {}, expected {want}{why}", t.dtype_name)));
            false
        };
        const FLOATS: [RawDType; 3] = [RawDType::Bf16, RawDType::F16, RawDType::F32];

        if !p.module {
            let expect = format!("{floats} {:?}", p.shape);
            if let Some(t) = get(used, r, &p.name, &expect) {
                if dtype_err(r, &p.name, t, &FLOATS, floats, "") {
                    shape_err(r, &p.name, t, &p.shape, "");
                }
            }
            return;
        }
        let wname = format!("{}.weight", p.name);
        let sname = format!("{}.scales", p.name);
        let bname = format!("{}.biases", p.name);
        let gname = format!("{}.global_scale", p.name);
        let in_dim = p.shape.last().copied().unwrap_or(0);
        let lead = &p.shape[..p.shape.len().saturating_sub(1)];
        let has = |n: &str| index.contains_key(n);
        match p.format {
            WeightFormat::Float { .. } => {
                if has(&sname) {
                    mark(used, &sname);
                    r.push(Problem::tensor(
                        Severity::Error,
                        &wname,
                        pre,
                        "is quantized in the checkpoint (.scales present) but the graph expects a float tensor",
                    ));
                }
                let expect = format!("{floats} {:?}", p.shape);
                if let Some(t) = get(used, r, &wname, &expect) {
                    if dtype_err(r, &wname, t, &FLOATS, floats, "") {
                        shape_err(r, &wname, t, &p.shape, "");
                    }
                }
            }
            WeightFormat::Quantized { spec, global_scale } => {
                if let Err(e) = spec.validate() {
                    r.push(Problem::tensor(Severity::Error, &wname, pre, e));
                }
                if !spec.fits(in_dim) {
                    r.push(Problem::tensor(Severity::Error, &wname, pre, format!("input dim {in_dim} cannot be stored as {}", spec.describe())));
                    return;
                }
                let mut wshape = lead.to_vec();
                wshape.push(spec.packed_cols(in_dim));
                let mut sshape = lead.to_vec();
                sshape.push(spec.groups(in_dim));
                let affine = spec.mode == QuantMode::Affine;
                let scale_dt = if affine { floats } else { "U8" };
                let w = get(used, r, &wname, &format!("U32 {wshape:?}"));
                let s = get(used, r, &sname, &format!("{scale_dt} {sshape:?}"));
                if self.config.quant.for_module(&p.name).is_none() {
                    r.push(Problem::tensor(
                        Severity::Warning,
                        &wname,
                        pre,
                        format!("is quantized but config.json has no quantization entry for it; using {} from the shapes", spec.describe()),
                    ));
                }
                // Config vs tensors: the shapes imply one (bits, group size).
                let mut disagree = false;
                if let (Some(w), Some(s)) = (w, s) {
                    if w.dtype == Some(RawDType::U32) && w.shape.len() == p.shape.len() && s.shape.len() == p.shape.len() {
                        if let Some(t) = infer_spec(w, s, in_dim) {
                            if (t.bits, t.group_size) != (spec.bits, spec.group_size) && w.shape[..lead.len()] == *lead {
                                disagree = true;
                                r.push(Problem::tensor(
                                    Severity::Error,
                                    &wname,
                                    pre,
                                    format!(
                                        "disagrees with the config: quantization config says {}-bit g{} but `{wname}` has {:?} u32 with scales {:?} (=> {}-bit g{}); config and tensors disagree",
                                        spec.bits, spec.group_size, w.shape, s.shape, t.bits, t.group_size
                                    ),
                                ));
                            }
                        }
                    }
                }
                if let Some(w) = w {
                    if dtype_err(r, &wname, w, &[RawDType::U32], "U32", " (packed quantized weight; .scales present)") && !disagree {
                        shape_err(r, &wname, w, &wshape, &format!(" ({} of {:?})", spec.describe(), p.shape));
                    }
                }
                let scale_ok: &[RawDType] = if affine { &FLOATS } else { &[RawDType::U8] };
                let why = if affine { " (affine scales)".to_string() } else { format!(" ({} scales)", spec.mode.name()) };
                if let Some(s) = s {
                    if dtype_err(r, &sname, s, scale_ok, scale_dt, &why) && !disagree {
                        shape_err(r, &sname, s, &sshape, "");
                    }
                }
                if affine {
                    if let Some(b) = get(used, r, &bname, &format!("{floats} {sshape:?}")) {
                        if dtype_err(r, &bname, b, &FLOATS, floats, " (affine biases)") && !disagree {
                            shape_err(r, &bname, b, &sshape, "");
                        }
                    }
                } else if has(&bname) {
                    mark(used, &bname);
                    r.push(Problem::tensor(
                        Severity::Error,
                        &bname,
                        pre,
                        format!("is present but mode {} has no biases (config and tensors disagree)", spec.mode.name()),
                    ));
                }
                if global_scale || has(&gname) {
                    let e: usize = if lead.len() >= 2 { lead[0] } else { 1 };
                    if spec.mode != QuantMode::Nvfp4 {
                        mark(used, &gname);
                        r.push(Problem::tensor(Severity::Error, &gname, pre, format!("is present but only nvfp4 has a global scale, not {}", spec.mode.name())));
                    } else if let Some(g) = get(used, r, &gname, &format!("F32 [{e}]")) {
                        if dtype_err(r, &gname, g, &[RawDType::F32], "F32", "") && g.numel() != e {
                            r.push(Problem::tensor(Severity::Error, &gname, pre, format!("has shape {:?}, expected [{e}] (one per expert)", g.shape)));
                        }
                    }
                }
            }
        }
    }

    /// Checks and copies every weight of `graph`. All problems are collected; any
    /// error makes this fail with the full [`Report`] (warnings are returned with
    /// the weights).
    pub fn load_weights(&self, graph: &Graph) -> Result<(Weights, Report), LoadError> {
        self.load_weights_with(graph, &LoadOptions::default())
    }

    /// [`load_weights`](Self::load_weights) with options (progress callback).
    pub fn load_weights_with(&self, graph: &Graph, opts: &LoadOptions) -> Result<(Weights, Report), LoadError> {
        let report = self.check(graph);
        if report.has_errors() {
            return Err(LoadError::Invalid(report));
        }
        let mut params: Vec<&WeightParam> = vec![];
        let mut seen = HashSet::new();
        for (_, p) in graph.weights() {
            if seen.insert(p.name.as_str()) {
                params.push(p);
            }
        }
        self.copy_params(&self.tensors, &params, report, opts)
    }

    /// Copies the tensors of `params` (checked already; looked up in `index`) into weights;
    /// read failures join `report`, and any error fails with it.
    fn copy_params(
        &self,
        index: &BTreeMap<String, TensorInfo>,
        params: &[&WeightParam],
        report: Report,
        opts: &LoadOptions,
    ) -> Result<(Weights, Report), LoadError> {
        let parts = |p: &WeightParam| -> Vec<String> {
            if p.module {
                [".weight", ".scales", ".biases", ".global_scale"].iter().map(|s| format!("{}{s}", p.name)).collect()
            } else {
                vec![p.name.clone()]
            }
        };
        let total: u64 = params.iter().flat_map(|p| parts(p)).filter_map(|n| index.get(&n)).map(|t| t.nbytes() as u64).sum();
        let done = AtomicU64::new(0);
        let read = |n: &str| -> Result<Option<RawTensor>, String> {
            match index.get(n) {
                None => Ok(None),
                Some(t) => {
                    let raw = self.read_info(t)?;
                    let now = done.fetch_add(raw.bytes.len() as u64, Ordering::Relaxed) + raw.bytes.len() as u64;
                    if let Some(cb) = opts.progress {
                        cb(now, total);
                    }
                    Ok(Some(raw))
                }
            }
        };
        let loaded: Vec<Result<WeightData, String>> = params
            .par_iter()
            .map(|p| {
                let (weight, scales, biases, global_scale) = if p.module {
                    let w = read(&format!("{}.weight", p.name))?.ok_or_else(|| format!("{}.weight missing", p.name))?;
                    let quant = matches!(p.format, WeightFormat::Quantized { .. });
                    let opt = |s: &str| if quant { read(&format!("{}{s}", p.name)) } else { Ok(None) };
                    (w, opt(".scales")?, opt(".biases")?, opt(".global_scale")?)
                } else {
                    (read(&p.name)?.ok_or_else(|| format!("{} missing", p.name))?, None, None, None)
                };
                Ok(WeightData { param: (*p).clone(), weight, scales, biases, global_scale })
            })
            .collect();
        let mut weights = Weights::default();
        let mut report = report;
        for l in loaded {
            match l {
                Ok(w) => weights.insert(w),
                Err(e) => report.push(Problem::error("load", e)),
            }
        }
        if report.has_errors() {
            return Err(LoadError::Invalid(report));
        }
        Ok((weights, report))
    }
}

impl WeightResolver for Checkpoint {
    /// A module is quantized iff `<name>.scales` exists; mode/bits/group from the
    /// config's override for the module path, else the global entry (else the
    /// shapes). Plain tensors: their stored float dtype.
    fn format(&self, name: &str, shape: &[usize], module: bool) -> WeightFormat {
        if module {
            return self.module_format(&self.tensors, name, Some(shape));
        }
        let dtype = self.tensors.get(name).and_then(|t| float_type(t.dtype)).unwrap_or(FloatType::Bf16);
        WeightFormat::Float { dtype }
    }

    fn exists(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.tensors.contains_key(&format!("{name}.weight"))
    }
}

fn float_type(d: Option<RawDType>) -> Option<FloatType> {
    match d? {
        RawDType::Bf16 => Some(FloatType::Bf16),
        RawDType::F16 => Some(FloatType::F16),
        RawDType::F32 => Some(FloatType::F32),
        _ => None,
    }
}

/// Input dim of a quantized module from its tensors alone: MLX's bits/group
/// combinations are few, so try them and accept the unique plausible one
/// (mode from the scale dtype). Used only when config and graph are silent.
fn guess_in_dim(w: &TensorInfo, s: &TensorInfo) -> Option<usize> {
    let wc = *w.shape.last()?;
    let sc = *s.shape.last()?;
    let cands: Vec<usize> = if s.dtype == Some(RawDType::U8) {
        vec![sc * 16, sc * 32]
    } else {
        [32, 64, 128].iter().map(|g| sc * g).collect()
    };
    let ok: Vec<usize> = cands.into_iter().filter(|&i| i > 0 && (wc * 32) % i == 0 && matches!(wc * 32 / i, 2 | 3 | 4 | 5 | 6 | 8)).collect();
    if ok.len() == 1 {
        Some(ok[0])
    } else {
        None
    }
}

/// The quantization implied by the stored shapes (mlx-lm's `infer_quant_config`):
/// bits = packed cols·32/in, group = in/scale cols, mode from the scale dtype.
fn infer_spec(w: &TensorInfo, s: &TensorInfo, in_dim: usize) -> Option<QuantSpec> {
    let wc = *w.shape.last()?;
    let sc = *s.shape.last()?;
    if in_dim == 0 || sc == 0 || !(wc * 32).is_multiple_of(in_dim) || !in_dim.is_multiple_of(sc) {
        return None;
    }
    let bits = wc * 32 / in_dim;
    let group_size = in_dim / sc;
    let mode = if s.dtype == Some(RawDType::U8) {
        match (bits, group_size) {
            (4, 16) => QuantMode::Nvfp4,
            (4, 32) => QuantMode::Mxfp4,
            (8, 32) => QuantMode::Mxfp8,
            _ => QuantMode::Affine,
        }
    } else {
        QuantMode::Affine
    };
    Some(QuantSpec { mode, bits, group_size })
}
