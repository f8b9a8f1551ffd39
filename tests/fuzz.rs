//! Property-based fuzzing of the parsers users reach: safetensors headers and the
//! shard index, `config.json` through graph building and compiling, the tokenizer
//! with the chat template, and the server's request bodies through their checks.
//! Every input must give `Ok` or a clear `Err` (for a request: a 4xx): never a panic,
//! never an absurd allocation, always in bounded time.
//!
//! Each target starts from the real fixtures (the server's: real request bodies) and
//! mutates them. The corpus under `tests/fuzz-corpus/` (seeds and regressions) is
//! replayed on every run. `MARKBASE_FUZZ_CASES=<n>` sets the number of generated cases
//! per target (default 1024); `MARKBASE_FUZZ_SECS=<s>` the time one case may take
//! (default 20); `MARKBASE_FUZZ_SEED=<n>` replays a run (each run prints its seed).

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use markbase::graph::{build_from_config, compile, BuildOptions, ModelConfig, PhasePolicy};
use markbase::loader::Checkpoint;
use markbase::tokenizer::{Message, Tokenizer};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Value};

/// Largest single allocation a case may make: beyond it the allocator names the cases in
/// flight and refuses (the process aborts), so an absurd size fails on any machine.
const MAX_ALLOC: usize = 1 << 31;

struct Capped;

// SAFETY: forwards to the system allocator; only refuses (null) sizes beyond MAX_ALLOC.
unsafe impl std::alloc::GlobalAlloc for Capped {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        if l.size() > MAX_ALLOC {
            if let Ok(v) = IN_FLIGHT.try_lock() {
                // Straight to the stream: the test harness's captured output is lost on abort.
                for (_, _, what) in v.iter() {
                    let _ = writeln!(std::io::stderr(), "fuzz case allocates {} bytes on input: {what}", l.size());
                }
            }
            return std::ptr::null_mut();
        }
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: Capped = Capped;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus").join(target);
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn cases() -> u32 {
    std::env::var("MARKBASE_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(1024)
}

fn case_limit() -> Duration {
    Duration::from_secs(std::env::var("MARKBASE_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(20))
}

/// How far the cases of a target got (printed with `--nocapture`, so that a target whose
/// inputs all fail early shows it).
#[derive(Default)]
struct Reach(Vec<AtomicUsize>);

impl Reach {
    fn new(n: usize) -> Reach {
        Reach((0..n).map(|_| AtomicUsize::new(0)).collect())
    }
    fn hit(&self, stage: usize) {
        self.0[stage].fetch_add(1, Ordering::Relaxed);
    }
    fn print(&self, target: &str, stages: &[&str]) {
        let s: Vec<String> = stages.iter().zip(&self.0).map(|(n, c)| format!("{n} {}", c.load(Ordering::Relaxed))).collect();
        eprintln!("{target}: {} cases; {}", cases(), s.join(", "));
    }
}

/// The generator's seed: `MARKBASE_FUZZ_SEED`, or a fresh one from the OS (each run explores
/// new cases). Printed, and named in every failure, so that a failing run can be replayed.
fn seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| match std::env::var("MARKBASE_FUZZ_SEED") {
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("MARKBASE_FUZZ_SEED={s} is not a u64")),
        Err(_) => {
            use std::hash::{BuildHasher, Hasher};
            // the standard library's hasher keys come from the OS's random source
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.finish()
        }
    })
}

/// A runner for `target`, its seed printed (and in the failure message, through [`run`]).
fn runner(target: &str) -> TestRunner {
    let seed = seed();
    println!("{target}: seed {seed} (MARKBASE_FUZZ_SEED={seed} replays it), {} cases", cases());
    let rng_seed = proptest::test_runner::RngSeed::Fixed(seed);
    TestRunner::new(Config { cases: cases(), failure_persistence: None, max_shrink_iters: 256, rng_seed, ..Config::default() })
}

/// Runs `test` on the cases of `strat`; a failure names the seed that replays it.
fn run<S: Strategy>(target: &str, strat: &S, test: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    if let Err(e) = runner(target).run(strat, test) {
        let seed = seed();
        panic!("{target}: {e}\n(seed {seed}: MARKBASE_FUZZ_SEED={seed} MARKBASE_FUZZ_CASES={} replays it)", cases());
    }
}

/// The cases in flight (by test thread): their start and their input, watched by a thread
/// that ends the process, naming the input, when one runs past twice the limit (a hang
/// never returns to report itself).
static IN_FLIGHT: Mutex<Vec<(std::thread::ThreadId, Instant, String)>> = Mutex::new(vec![]);

fn watchdog() {
    static START: Once = Once::new();
    START.call_once(|| {
        std::thread::spawn(|| loop {
            std::thread::sleep(Duration::from_millis(500));
            let v = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((_, t, what)) = v.iter().find(|(_, t, _)| t.elapsed() > 2 * case_limit()) {
                let _ = writeln!(std::io::stderr(), "fuzz case hangs (running for {:?}) on input: {what}", t.elapsed());
                std::process::exit(101);
            }
        });
    });
}

/// Runs `f`, turning a panic or an overlong run into a test failure that shows `what`.
fn guarded<T>(what: &dyn Fn() -> String, f: impl FnOnce() -> T) -> Result<T, TestCaseError> {
    watchdog();
    let me = std::thread::current().id();
    IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner()).push((me, Instant::now(), what()));
    let t = Instant::now();
    let r = catch_unwind(AssertUnwindSafe(f));
    IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner()).retain(|(id, _, _)| *id != me);
    let dt = t.elapsed();
    match r {
        Ok(v) if dt <= case_limit() => Ok(v),
        Ok(_) => Err(TestCaseError::fail(format!("took {dt:?} (limit {:?}) on input: {}", case_limit(), what()))),
        Err(p) => {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            Err(TestCaseError::fail(format!("panicked ({msg}) on input: {}", what())))
        }
    }
}

/// A scratch directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!("markbase-fuzz-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::write(dir.join(name), bytes).unwrap();
}

fn short(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    if s.len() > 4000 { format!("{}... ({} bytes)", &s[..s.floor_char_boundary(4000)], b.len()) } else { s.into_owned() }
}

// ---------------------------------------------------------------------------
// 1. safetensors headers and the shard index

const ST_FIXTURES: &[&str] = &["gemma3_text-q4", "gemma3_text-q4sharded", "gemma3_text-mxfp4", "gemma4_dense_ple-q4", "gemma3_mm-q4", "gemma3n-q4"];

/// A file's header JSON (as bytes) and its data section.
fn split_file(bytes: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let n = header_len(bytes)?;
    Some((bytes[8..8 + n].to_vec(), bytes[8 + n..].to_vec()))
}

/// The header length of a file whose length field is within the file.
fn header_len(bytes: &[u8]) -> Option<usize> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().unwrap());
    (n <= (bytes.len() - 8) as u64).then_some(n as usize)
}

fn join_file(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header);
    v.extend_from_slice(data);
    v
}

/// Odd JSON values for a header or config field.
fn odd_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(i64::MIN)),
        Just(json!(u64::MAX)),
        Just(json!(1u64 << 32)),
        Just(json!(1u64 << 62)),
        Just(json!(1.5)),
        Just(json!(1e300)),
        Just(json!("x")),
        Just(json!("")),
        Just(Value::Null),
        Just(json!(true)),
        Just(json!([])),
        Just(json!({})),
        Just(json!([1, 2, 3])),
        (0u64..100_000).prop_map(|x| json!(x)),
        (-4i64..5000).prop_map(|x| json!(x)),
    ]
}

fn odd_dims() -> impl Strategy<Value = Value> {
    prop::collection::vec(
        prop_oneof![Just(json!(0)), Just(json!(-1)), Just(json!(u64::MAX)), Just(json!(1u64 << 40)), Just(json!(2.5)), Just(json!("3")), (0u64..70).prop_map(|x| json!(x))],
        0..5,
    )
    .prop_map(Value::Array)
}

#[derive(Clone, Debug)]
enum StEdit {
    /// Set a field of the `i`-th entry (`dtype`, `shape`, `data_offsets`) or remove it.
    Field { entry: usize, field: &'static str, value: Option<Value> },
    Shape { entry: usize, dims: Value },
    Dtype { entry: usize, dtype: &'static str },
    /// Offsets `[a, b]` relative to the data length (`a`/`b` in 1/16ths, plus a delta).
    Offsets { entry: usize, a: i64, b: i64 },
    RemoveEntry { entry: usize },
    /// A second entry under an existing name (written as a duplicate JSON key).
    DuplicateKey { entry: usize },
    ReplaceEntry { entry: usize, value: Value },
    Deep { depth: usize },
    Metadata { value: Value },
}

#[derive(Clone, Debug)]
enum StMutation {
    Json(Vec<StEdit>),
    FlipByte { pos: usize, val: u8 },
    Truncate { keep: usize },
    HeaderLen { len: u64 },
    NonUtf8 { pos: usize },
    IndexEdit { key: usize, value: Value },
    IndexRaw { text: String },
    DropFile,
}

fn st_edit() -> impl Strategy<Value = StEdit> {
    let e = any::<usize>();
    prop_oneof![
        (e, prop::sample::select(vec!["dtype", "shape", "data_offsets"]), prop::option::of(odd_value())).prop_map(|(entry, field, value)| StEdit::Field { entry, field, value }),
        (e, odd_dims()).prop_map(|(entry, dims)| StEdit::Shape { entry, dims }),
        (e, prop::sample::select(vec!["F32", "BF16", "F16", "U32", "U8", "I64", "F8_E4M3", "BOOL", "F4", "C64", "Q4", "", "bf16"])).prop_map(|(entry, dtype)| StEdit::Dtype { entry, dtype }),
        (e, -2i64..20, -2i64..20).prop_map(|(entry, a, b)| StEdit::Offsets { entry, a, b }),
        e.prop_map(|entry| StEdit::RemoveEntry { entry }),
        e.prop_map(|entry| StEdit::DuplicateKey { entry }),
        (e, odd_value()).prop_map(|(entry, value)| StEdit::ReplaceEntry { entry, value }),
        prop_oneof![Just(100usize), Just(200), Just(100_000)].prop_map(|depth| StEdit::Deep { depth }),
        odd_value().prop_map(|value| StEdit::Metadata { value }),
    ]
}

fn st_mutation() -> impl Strategy<Value = StMutation> {
    prop_oneof![
        4 => prop::collection::vec(st_edit(), 1..4).prop_map(StMutation::Json),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(pos, val)| StMutation::FlipByte { pos, val }),
        1 => any::<usize>().prop_map(|keep| StMutation::Truncate { keep }),
        1 => prop_oneof![Just(0u64), Just(1), Just(2), Just(u64::MAX), Just(1 << 40), Just((100 << 20) + 1), 0u64..70_000].prop_map(|len| StMutation::HeaderLen { len }),
        1 => any::<usize>().prop_map(|pos| StMutation::NonUtf8 { pos }),
        1 => (any::<usize>(), prop_oneof![odd_value(), Just(json!("../config.json")), Just(json!("missing.safetensors")), Just(json!("model-00001-of-00003.safetensors"))]).prop_map(|(key, value)| StMutation::IndexEdit { key, value }),
        1 => prop_oneof![Just(String::new()), Just("{".to_string()), Just("[]".to_string()), Just("{\"weight_map\": 5}".to_string()), Just("{\"weight_map\": {}}".to_string()), ".{0,40}"].prop_map(|text| StMutation::IndexRaw { text }),
        1 => Just(StMutation::DropFile),
    ]
}

/// Applies JSON edits to a header; returns the new header bytes.
fn edit_header(header: &[u8], data_len: usize, edits: &[StEdit]) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<serde_json::Map<String, Value>>(header) else { return header.to_vec() };
    let mut extra = String::new();
    let names: Vec<String> = v.keys().filter(|k| *k != "__metadata__").cloned().collect();
    if names.is_empty() {
        return header.to_vec();
    }
    let pick = |i: usize| names[i % names.len()].clone();
    let off = |x: i64| -> Value {
        let q = (data_len as i64 * x.clamp(0, 16)) / 16;
        json!(q + if x < 0 { x } else if x > 16 { x * 1_000_000_007 } else { 0 })
    };
    for e in edits {
        match e {
            StEdit::Field { entry, field, value } => {
                if let Some(Value::Object(o)) = v.get_mut(&pick(*entry)) {
                    match value {
                        Some(x) => o.insert(field.to_string(), x.clone()),
                        None => o.remove(*field),
                    };
                }
            }
            StEdit::Shape { entry, dims } => {
                if let Some(Value::Object(o)) = v.get_mut(&pick(*entry)) {
                    o.insert("shape".into(), dims.clone());
                }
            }
            StEdit::Dtype { entry, dtype } => {
                if let Some(Value::Object(o)) = v.get_mut(&pick(*entry)) {
                    o.insert("dtype".into(), json!(dtype));
                }
            }
            StEdit::Offsets { entry, a, b } => {
                if let Some(Value::Object(o)) = v.get_mut(&pick(*entry)) {
                    o.insert("data_offsets".into(), json!([off(*a), off(*b)]));
                }
            }
            StEdit::RemoveEntry { entry } => {
                v.remove(&pick(*entry));
            }
            StEdit::DuplicateKey { entry } => {
                let n = pick(*entry);
                if let Some(x) = v.get(&n) {
                    extra.push_str(&format!(",{}:{}", json!(n), x));
                }
            }
            StEdit::ReplaceEntry { entry, value } => {
                v.insert(pick(*entry), value.clone());
            }
            StEdit::Deep { depth } => {
                extra.push_str(&format!(",\"deep\":{}0{}", "[".repeat(*depth), "]".repeat(*depth)));
            }
            StEdit::Metadata { value } => {
                v.insert("__metadata__".into(), value.clone());
            }
        }
    }
    let mut s = serde_json::to_string(&Value::Object(v)).unwrap();
    if !extra.is_empty() {
        s.pop();
        if s.len() == 1 {
            extra.remove(0);
        }
        s.push_str(&extra);
        s.push('}');
    }
    s.into_bytes()
}

/// The files of a fixture checkpoint: (name, bytes), with the index and safetensors files.
fn fixture_files(name: &str) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(fixtures().join(name))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n == "config.json" || n.starts_with("model"))
        .map(|n| {
            let b = std::fs::read(fixtures().join(name).join(&n)).unwrap();
            (n, b)
        })
        .collect();
    v.sort();
    v
}

fn mutate_checkpoint(files: &mut Vec<(String, Vec<u8>)>, m: &StMutation, which: usize) {
    let st: Vec<usize> = (0..files.len()).filter(|&i| files[i].0.ends_with(".safetensors")).collect();
    if st.is_empty() {
        return;
    }
    let fi = st[which % st.len()];
    let bytes = &mut files[fi].1;
    match m {
        StMutation::Json(edits) => {
            let Some((h, d)) = split_file(bytes) else { return };
            *bytes = join_file(&edit_header(&h, d.len(), edits), &d);
        }
        StMutation::FlipByte { pos, val } => {
            // Mostly inside the length field and the header.
            let n = header_len(bytes).unwrap_or(0);
            let p = pos % (8 + n + 16).min(bytes.len()).max(1);
            if bytes.is_empty() {
                return;
            }
            bytes[p] = *val;
        }
        StMutation::Truncate { keep } => bytes.truncate(keep % (bytes.len() + 1)),
        StMutation::HeaderLen { len } => {
            if bytes.len() >= 8 {
                bytes[..8].copy_from_slice(&len.to_le_bytes());
            }
        }
        StMutation::NonUtf8 { pos } => {
            if let Some(n) = header_len(bytes).filter(|&n| n > 0) {
                bytes[8 + pos % n] = 0xff;
            }
        }
        StMutation::IndexEdit { key, value } => {
            if let Some(f) = files.iter_mut().find(|f| f.0 == "model.safetensors.index.json") {
                let Ok(mut v) = serde_json::from_slice::<Value>(&f.1) else { return };
                if let Some(Value::Object(m)) = v.get_mut("weight_map") {
                    let keys: Vec<String> = m.keys().cloned().collect();
                    if !keys.is_empty() {
                        m.insert(keys[key % keys.len()].clone(), value.clone());
                    }
                }
                f.1 = serde_json::to_vec(&v).unwrap();
            }
        }
        StMutation::IndexRaw { text } => {
            if let Some(f) = files.iter_mut().find(|f| f.0 == "model.safetensors.index.json") {
                f.1 = text.clone().into_bytes();
            }
        }
        StMutation::DropFile => {
            files.remove(fi);
        }
    }
}

/// Opens, checks and loads the checkpoint in `dir`; any result but a panic is fine.
fn exercise_checkpoint(dir: &Path, reach: &Reach) {
    let Ok(cp) = Checkpoint::open(dir) else { return };
    reach.hit(0);
    for o in [BuildOptions::prefill(2, 8), BuildOptions::decode(8, 4)] {
        if let Ok(g) = cp.build(o) {
            reach.hit(1);
            let _ = cp.check(&g);
            if let Ok((w, _)) = cp.load_weights(&g) {
                reach.hit(2);
                drop(w);
            }
        }
    }
    for t in cp.tensors().map(|t| t.name.clone()).collect::<Vec<_>>() {
        let _ = cp.read(&t);
    }
}

#[test]
fn fuzz_safetensors() {
    // The corpus: header-only or whole small files written as model.safetensors beside
    // a fixture's config.json.
    let cfg = std::fs::read(fixtures().join("gemma3_text-q4/config.json")).unwrap();
    let reach = Reach::new(3);
    for (name, bytes) in corpus("safetensors") {
        let t = TempDir::new("st-corpus");
        write(&t.0, "config.json", &cfg);
        write(&t.0, "model.safetensors", &bytes);
        guarded(&|| format!("corpus file {name}"), || exercise_checkpoint(&t.0, &reach)).unwrap();
    }
    let originals: Vec<Vec<(String, Vec<u8>)>> = ST_FIXTURES.iter().map(|n| fixture_files(n)).collect();
    let strat = (0..ST_FIXTURES.len(), any::<usize>(), prop::collection::vec(st_mutation(), 1..3));
    run("safetensors", &strat, |(fx, which, muts)| {
        let mut files = originals[fx].clone();
        for m in &muts {
            mutate_checkpoint(&mut files, m, which);
        }
        let t = TempDir::new("st");
        for (n, b) in &files {
            write(&t.0, n, b);
        }
        let what = || {
            let hs: Vec<String> = files.iter().filter(|f| f.0.ends_with(".safetensors")).map(|f| format!("{}: {}", f.0, short(&f.1[..f.1.len().min(8 + 4000)]))).collect();
            format!("fixture {} mutations {muts:?}\n{}", ST_FIXTURES[fx], hs.join("\n"))
        };
        guarded(&what, || exercise_checkpoint(&t.0, &reach))
    });
    reach.print("safetensors", &["opened", "built", "loaded"]);
}

// ---------------------------------------------------------------------------
// 2. config.json through graph building and compiling

const CONFIG_FIXTURES: &[&str] = &["gemma3_text-q4", "gemma3_mm-q4", "gemma3n-q4", "gemma4_dense_ple-q4", "gemma4_moe-q4", "gemma4_moe-nvfp4gs", "gemma3_text-mixed36"];

/// Fields worth setting even where a fixture lacks them.
const CONFIG_KEYS: &[&str] = &[
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
    "vocab_size", "sliding_window", "sliding_window_pattern", "layer_types", "rope_parameters", "rope_scaling", "rope_theta",
    "rope_local_base_freq", "query_pre_attn_scalar", "max_position_embeddings", "num_kv_shared_layers", "num_experts", "top_k_experts",
    "moe_intermediate_size", "enable_moe_block", "hidden_size_per_layer_input", "vocab_size_per_layer_input", "num_global_key_value_heads",
    "attention_k_eq_v", "use_double_wide_mlp", "final_logit_softcapping", "rms_norm_eps", "tie_word_embeddings", "quantization",
    "altup_num_inputs", "altup_active_idx", "laurel_rank", "activation_sparsity_pattern", "eos_token_id", "bos_token_id", "model_type",
    "text_config",
];

#[derive(Clone, Debug)]
enum CfgEdit {
    /// Set or remove a key (an existing one, `key` mod their count, or one of `CONFIG_KEYS`) at top
    /// level or in `text_config`.
    Set { nested: bool, known: bool, key: usize, value: Option<Value> },
    /// Replace one element of an array field (layer_types, intermediate_size, ...).
    ArrayElem { nested: bool, key: usize, index: usize, value: Value },
    /// Odd quantization: a global or per-module entry.
    Quant { module: Option<usize>, value: Value },
    /// Odd rope parameters.
    Rope { nested: bool, which: &'static str, field: &'static str, value: Value },
}

fn cfg_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => odd_value(),
        1 => Just(json!(1 << 20)),
        1 => Just(json!(4096)),
        1 => Just(json!(4097)),
        1 => Just(json!(1 << 24)),
        1 => prop::collection::vec(prop::sample::select(vec!["sliding_attention", "full_attention", "other"]), 0..6).prop_map(|v| json!(v)),
        1 => Just(json!({"group_size": 0, "bits": 4})),
        1 => Just(json!({"group_size": 64, "bits": 0})),
        1 => Just(json!({"group_size": 64, "bits": 99, "mode": "affine"})),
        1 => Just(json!({"group_size": 32, "bits": 4, "mode": "mxfp4"})),
        1 => Just(json!({"group_size": 7, "bits": 3, "mode": "nope"})),
    ]
}

fn cfg_edit() -> impl Strategy<Value = CfgEdit> {
    prop_oneof![
        4 => (any::<bool>(), any::<bool>(), any::<usize>(), prop::option::weighted(0.85, cfg_value())).prop_map(|(nested, known, key, value)| CfgEdit::Set { nested, known, key, value }),
        1 => (any::<bool>(), any::<usize>(), any::<usize>(), cfg_value()).prop_map(|(nested, key, index, value)| CfgEdit::ArrayElem { nested, key, index, value }),
        1 => (prop::option::of(any::<usize>()), cfg_value()).prop_map(|(module, value)| CfgEdit::Quant { module, value }),
        1 => (
            any::<bool>(),
            prop::sample::select(vec!["full_attention", "sliding_attention"]),
            prop::sample::select(vec!["rope_theta", "rope_type", "partial_rotary_factor", "factor"]),
            cfg_value()
        )
            .prop_map(|(nested, which, field, value)| CfgEdit::Rope { nested, which, field, value }),
    ]
}

fn edit_config(v: &mut Value, e: &CfgEdit) {
    fn target(v: &mut Value, nested: bool) -> Option<&mut serde_json::Map<String, Value>> {
        if nested && v.get("text_config").is_some_and(Value::is_object) { v.get_mut("text_config")?.as_object_mut() } else { v.as_object_mut() }
    }
    match e {
        CfgEdit::Set { nested, known, key, value } => {
            let Some(m) = target(v, *nested) else { return };
            let k = if *known || m.is_empty() { CONFIG_KEYS[key % CONFIG_KEYS.len()].to_string() } else { m.keys().nth(key % m.len()).unwrap().clone() };
            match value {
                Some(x) => m.insert(k, x.clone()),
                None => m.remove(&k),
            };
        }
        CfgEdit::ArrayElem { nested, key, index, value } => {
            let Some(m) = target(v, *nested) else { return };
            let arrays: Vec<String> = m.iter().filter(|(_, x)| x.as_array().is_some_and(|a| !a.is_empty())).map(|(k, _)| k.clone()).collect();
            if arrays.is_empty() {
                return;
            }
            let a = m.get_mut(&arrays[key % arrays.len()]).unwrap().as_array_mut().unwrap();
            let n = a.len();
            a[index % n] = value.clone();
        }
        CfgEdit::Quant { module, value } => {
            let Some(m) = v.as_object_mut() else { return };
            for qk in ["quantization", "quantization_config"] {
                let Some(Value::Object(q)) = m.get_mut(qk) else { continue };
                match module {
                    None => {
                        if let Value::Object(o) = value {
                            for (k, x) in o {
                                q.insert(k.clone(), x.clone());
                            }
                        } else {
                            q.insert("bits".into(), value.clone());
                        }
                    }
                    Some(i) => {
                        let keys: Vec<String> = q.keys().cloned().collect();
                        let k = keys.get(i % keys.len().max(1)).cloned().unwrap_or_else(|| "model.layers.0.mlp.down_proj".into());
                        q.insert(k, value.clone());
                    }
                }
            }
        }
        CfgEdit::Rope { nested, which, field, value } => {
            let Some(m) = target(v, *nested) else { return };
            let rp = m.entry("rope_parameters").or_insert_with(|| json!({}));
            if let Some(o) = rp.as_object_mut() {
                let w = o.entry(*which).or_insert_with(|| json!({}));
                if let Some(w) = w.as_object_mut() {
                    w.insert(field.to_string(), value.clone());
                }
            }
        }
    }
}

/// Parses `text` as a config and builds and compiles its decode and prefill graphs.
fn exercise_config(text: &str, reach: &Reach) {
    let Ok(cfg) = ModelConfig::from_json_str(text) else { return };
    reach.hit(0);
    for (o, policy) in [(BuildOptions::decode(16, 4), PhasePolicy::Step), (BuildOptions::prefill(3, 16), PhasePolicy::EmbedLayersHead)] {
        if let Ok(g) = build_from_config(&cfg, &o) {
            reach.hit(1);
            if compile(g, policy).is_ok() {
                reach.hit(2);
            }
        }
    }
}

#[test]
fn fuzz_config() {
    let reach = Reach::new(3);
    for (name, bytes) in corpus("config") {
        let text = String::from_utf8_lossy(&bytes).into_owned();
        guarded(&|| format!("corpus file {name}"), || exercise_config(&text, &reach)).unwrap();
    }
    let originals: Vec<Value> =
        CONFIG_FIXTURES.iter().map(|n| serde_json::from_str(&std::fs::read_to_string(fixtures().join(n).join("config.json")).unwrap()).unwrap()).collect();
    let strat = (0..CONFIG_FIXTURES.len(), prop::collection::vec(cfg_edit(), 1..5));
    run("config", &strat, |(fx, edits)| {
        let mut v = originals[fx].clone();
        for e in &edits {
            edit_config(&mut v, e);
        }
        let text = serde_json::to_string(&v).unwrap();
        guarded(&|| format!("fixture {} edits {edits:?}\nconfig.json: {text}", CONFIG_FIXTURES[fx]), || exercise_config(&text, &reach))
    });
    reach.print("config", &["parsed", "built", "compiled"]);
}

// ---------------------------------------------------------------------------
// 3. the tokenizer and the chat template

/// Gemma's chat template (as in Gemma 3's tokenizer_config.json).
const GEMMA_TEMPLATE: &str = "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\
{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}{%- set loop_messages = messages -%}{%- endif -%}\
{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\
{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}\
{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}\
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}\
{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}";

fn load_tokenizer() -> (Tokenizer, TempDir) {
    let t = TempDir::new("tok");
    let src = fixtures().join("gemma3_text-q4");
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        write(&t.0, f, &std::fs::read(src.join(f)).unwrap());
    }
    write(&t.0, "chat_template.jinja", GEMMA_TEMPLATE.as_bytes());
    (Tokenizer::load(&t.0, Some(2), &[1]).unwrap(), t)
}

/// Text with the tokenizer's special tokens, template syntax and odd Unicode mixed in.
fn fuzz_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        3 => any::<String>(),
        1 => prop::sample::select(vec!["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<pad>", "<unk>", "{{", "}}", "{%", "%}", "\u{fffd}", "\u{0}", "\u{feff}", "\u{10ffff}", "  \n\t", "e\u{301}"]).prop_map(String::from),
        1 => "[a-z ]{0,20}",
        1 => prop::collection::vec(any::<u8>(), 0..24).prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ];
    prop::collection::vec(piece, 0..6).prop_map(|v| v.concat())
}

fn exercise_tokenizer(tok: &Tokenizer, text: &str, ids: &[u32], messages: &[Message]) {
    let _ = tok.encode(text, true);
    let _ = tok.encode(text, false);
    let _ = tok.decode(ids);
    for i in 0..ids.len() {
        let _ = tok.decode_incremental(&ids[..i], ids[i]);
    }
    if let Ok(enc) = tok.encode(text, false) {
        let _ = tok.decode(&enc);
        for i in 0..enc.len().min(64) {
            let _ = tok.decode_incremental(&enc[..i], enc[i]);
        }
    }
    let _ = tok.apply_chat_template(messages, true);
    let _ = tok.apply_chat_template(messages, false);
    let _ = tok.encode_chat(messages);
}

#[test]
fn fuzz_tokenizer() {
    let (tok, _dir) = load_tokenizer();
    let vocab = tok.vocab_size() as u32;
    for (name, bytes) in corpus("tokenizer") {
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let ids: Vec<u32> = bytes.iter().map(|&b| b as u32 * 7).chain([vocab, u32::MAX]).collect();
        let msgs = vec![Message::system(&text), Message::user(&text), Message { role: text.clone(), content: text.clone() }];
        guarded(&|| format!("corpus file {name}"), || exercise_tokenizer(&tok, &text, &ids, &msgs)).unwrap();
    }
    let id = prop_oneof![4 => 0..vocab.max(1), 1 => vocab..vocab + 16, 1 => Just(u32::MAX), 1 => any::<u32>()];
    let role = prop_oneof![prop::sample::select(vec!["user", "assistant", "system", "model", "tool", ""]).prop_map(String::from), fuzz_text()];
    let msg = (role, fuzz_text()).prop_map(|(role, content)| Message { role, content });
    let strat = (fuzz_text(), prop::collection::vec(id, 0..24), prop::collection::vec(msg, 0..5));
    run("tokenizer", &strat, |(text, ids, msgs)| guarded(&|| format!("text {text:?} ids {ids:?} messages {msgs:?}"), || exercise_tokenizer(&tok, &text, &ids, &msgs)));
}

// ---------------------------------------------------------------------------
// 4. the server's request bodies: /v1/chat/completions and /v1/completions

/// Top-level fields of both endpoints' bodies, and a few they do not know.
const REQUEST_FIELDS: &[&str] = &[
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "seed", "n", "best_of", "logprobs", "top_logprobs", "ignore_eos",
    "echo", "suffix", "logit_bias", "tools", "response_format", "user", "x",
];

/// Token ids around the fixture's vocabulary (512) and the ends of the integer types.
fn request_ids() -> impl Strategy<Value = Value> {
    prop::collection::vec(prop_oneof![4 => 0u64..600, 1 => Just(u32::MAX as u64), 1 => Just(1u64 << 32), 1 => Just(u64::MAX)], 0..8).prop_map(|v| json!(v))
}

/// A chat message: odd roles, content as text, parts (text, image, audio, malformed) or junk.
fn request_message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        4 => prop::sample::select(vec!["system", "developer", "user", "assistant", "tool", "model", ""]).prop_map(|r| json!(r)),
        1 => odd_value(),
    ];
    let part = prop_oneof![
        3 => fuzz_text().prop_map(|t| json!({"type": "text", "text": t})),
        1 => Just(json!({"type": "text"})),
        1 => Just(json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}})),
        1 => Just(json!({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}})),
        1 => odd_value().prop_map(|v| json!({"type": v, "text": "w1"})),
        1 => odd_value(),
    ];
    let content = prop_oneof![
        3 => fuzz_text().prop_map(Value::String),
        2 => prop::collection::vec(part, 0..4).prop_map(Value::Array),
        1 => odd_value(),
    ];
    (role, prop::option::weighted(0.9, content)).prop_map(|(role, content)| match content {
        Some(c) => json!({"role": role, "content": c}),
        None => json!({"role": role}),
    })
}

/// Values for a request field: wrong types, edges of each number type, odd text, token ids,
/// messages, and the objects some fields take.
fn request_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => odd_value(),
        2 => prop::sample::select(vec![-0.0, 1e-45, 1e39, 0.5, 2.0, 20.0, 21.0, 4294967296.0, -1e-9]).prop_map(|x| json!(x)),
        2 => fuzz_text().prop_map(Value::String),
        2 => request_ids(),
        1 => prop::collection::vec(request_ids(), 0..3).prop_map(Value::Array),
        1 => prop::collection::vec(fuzz_text(), 0..6).prop_map(|v| json!(v)),
        2 => prop::collection::vec(request_message(), 0..5).prop_map(Value::Array),
        1 => prop::sample::select(vec![
            json!({"include_usage": true}),
            json!({"include_usage": "yes"}),
            json!({"type": "text"}),
            json!({"type": "json_object"}),
            json!({"5": 10}),
            json!([{"type": "function", "function": {"name": "f"}}]),
        ]),
    ]
}

#[derive(Clone, Debug)]
enum ReqEdit {
    /// Set or remove a top-level field (one of `REQUEST_FIELDS`).
    Field { key: usize, value: Option<Value> },
    /// Set or remove a field of the `index`-th message.
    Message { index: usize, field: &'static str, value: Option<Value> },
    /// Append a message.
    Push { message: Value },
    /// Nest a field's value `depth` arrays deep.
    Deep { key: usize, depth: usize },
}

#[derive(Clone, Debug)]
enum ReqBytes {
    /// Byte edits of the serialized body: set, delete, or insert a JSON-ish byte.
    Edit(Vec<(usize, u8, u8)>),
    Truncate(usize),
    /// Replace the body with random bytes.
    Random(Vec<u8>),
}

fn req_edit() -> impl Strategy<Value = ReqEdit> {
    prop_oneof![
        6 => (any::<usize>(), prop::option::weighted(0.85, request_value())).prop_map(|(key, value)| ReqEdit::Field { key, value }),
        3 => (any::<usize>(), prop::sample::select(vec!["role", "content", "name"]), prop::option::weighted(0.85, request_value()))
            .prop_map(|(index, field, value)| ReqEdit::Message { index, field, value }),
        1 => request_message().prop_map(|message| ReqEdit::Push { message }),
        1 => (any::<usize>(), prop_oneof![Just(2usize), Just(100), Just(127), Just(128), Just(10_000)]).prop_map(|(key, depth)| ReqEdit::Deep { key, depth }),
    ]
}

fn req_bytes() -> impl Strategy<Value = ReqBytes> {
    prop_oneof![
        4 => prop::collection::vec((any::<usize>(), 0u8..3, any::<u8>()), 1..5).prop_map(ReqBytes::Edit),
        1 => any::<usize>().prop_map(ReqBytes::Truncate),
        1 => prop::collection::vec(any::<u8>(), 0..200).prop_map(ReqBytes::Random),
    ]
}

fn edit_request(v: &mut Value, e: &ReqEdit) {
    let Some(m) = v.as_object_mut() else { return };
    match e {
        ReqEdit::Field { key, value } => {
            let k = REQUEST_FIELDS[key % REQUEST_FIELDS.len()].to_string();
            match value {
                Some(x) => m.insert(k, x.clone()),
                None => m.remove(&k),
            };
        }
        ReqEdit::Message { index, field, value } => {
            let Some(Value::Array(msgs)) = m.get_mut("messages") else { return };
            let n = msgs.len();
            let Some(Value::Object(msg)) = msgs.get_mut(index % n.max(1)) else { return };
            match value {
                Some(x) => msg.insert(field.to_string(), x.clone()),
                None => msg.remove(*field),
            };
        }
        ReqEdit::Push { message } => {
            if let Some(Value::Array(msgs)) = m.get_mut("messages") {
                msgs.push(message.clone());
            } else {
                m.insert("messages".into(), json!([message]));
            }
        }
        ReqEdit::Deep { key, depth } => {
            let k = REQUEST_FIELDS[key % REQUEST_FIELDS.len()].to_string();
            let mut x = m.remove(&k).unwrap_or(json!(1));
            // built from the inside out; serde_json drops deep values by recursion (on the
            // test's own stack), so very deep ones are written as text below
            for _ in 0..(*depth).min(100) {
                x = json!([x]);
            }
            m.insert(k, x);
        }
    }
}

/// The body's bytes: `v` serialized, very deep nesting spliced in as text, then byte edits.
fn request_body(v: &Value, edits: &[ReqEdit], bytes: &Option<ReqBytes>) -> Vec<u8> {
    let mut b = serde_json::to_vec(v).unwrap();
    for e in edits {
        if let ReqEdit::Deep { key, depth } = e {
            if *depth > 100 && b.last() == Some(&b'}') {
                b.pop();
                let sep = if b.len() > 1 { "," } else { "" };
                let k = REQUEST_FIELDS[key % REQUEST_FIELDS.len()];
                b.extend_from_slice(format!("{sep}\"{k}\":{}1{}}}", "[".repeat(*depth), "]".repeat(*depth)).as_bytes());
            }
        }
    }
    match bytes {
        None => {}
        Some(ReqBytes::Edit(edits)) => {
            for &(pos, op, byte) in edits {
                let i = pos % (b.len() + 1);
                match op {
                    0 if i < b.len() => b[i] = byte,
                    1 if i < b.len() => {
                        b.remove(i);
                    }
                    _ => b.insert(i, b"{}[]\",:0-e.\\u"[byte as usize % 13]),
                }
            }
        }
        Some(ReqBytes::Truncate(keep)) => b.truncate(keep % (b.len() + 1)),
        Some(ReqBytes::Random(r)) => b = r.clone(),
    }
    b
}

/// What a parse or check error must be: a client error (4xx) with a message, in the API's shape.
fn client_error(e: &markbase::server::api::ApiError) {
    assert!(e.status.is_client_error(), "status {} for a request's error: {}", e.status, e.message);
    assert!(!e.message.is_empty(), "an error without a message");
    let b = e.body();
    assert!(b["error"]["message"].is_string() && b["error"]["type"].is_string(), "{b}");
}

/// Parses `body` and checks it for both endpoints under each of `limits`: every request is
/// refused with a 4xx or comes out within what the checks promise.
fn exercise_request(body: &[u8], limits: &[markbase::server::api::Limits], reach: &Reach) {
    use markbase::server::api::{check, parse, Endpoint, MAX_TOP_LOGPROBS};
    for ep in [Endpoint::Chat, Endpoint::Completions] {
        for lim in limits {
            let r = match parse(body) {
                Ok(r) => r,
                Err(e) => return client_error(&e),
            };
            reach.hit(0);
            match check(r, ep, lim, || 7) {
                Err(e) => client_error(&e),
                Ok(c) => {
                    reach.hit(if ep == Endpoint::Chat { 1 } else { 2 });
                    let q = &c.req;
                    assert!(!q.prompt.is_empty() && q.prompt.len() <= lim.max_context, "prompt of {} tokens", q.prompt.len());
                    assert!(q.prompt.iter().all(|&t| (t as usize) < lim.vocab), "a token id past the vocabulary: {:?}", q.prompt);
                    assert!(q.max_tokens >= 1 && q.max_tokens <= lim.max_context - q.prompt.len() + 1, "max_tokens {}", q.max_tokens);
                    assert!(q.stop.len() <= 4, "{} stop strings", q.stop.len());
                    assert!(q.logprobs.is_none_or(|n| n <= MAX_TOP_LOGPROBS as usize), "logprobs {:?}", q.logprobs);
                    q.sampling.validate().unwrap_or_else(|e| panic!("accepted invalid sampling: {e}"));
                    assert!(c.stream || !c.include_usage, "include_usage without a stream");
                }
            }
        }
    }
}

#[test]
fn fuzz_server_requests() {
    let (tok, _dir) = load_tokenizer();
    let vocab = 512;
    // the engines whose towers encode the bodies' images and clips: a text-only fixture (media
    // refused) and the Gemma 4 vision fixture with its audio tower (media encoded on the CPU)
    let cpu = |name: &str| {
        let opts = markbase::model::ModelOptions { device: markbase::model::DeviceKind::Cpu, max_context: 256, ..Default::default() };
        markbase::engine::Engine::load(fixtures().join(name), opts).unwrap()
    };
    let (text, vlm) = (cpu("gemma3_text-q4"), cpu("vlm/gemma4"));
    let vtok = vlm.tokenizer().unwrap();
    let rate = markbase::audio::FeatureConfig::from_checkpoint(&fixtures().join("vlm/gemma4")).unwrap().sampling_rate;
    // the checkpoint's template with a short context (text only), and Gemma's turns with a long
    // one (the vision fixture's own tokenizer and vocabulary)
    let limits = [
        markbase::server::api::Limits { tokenizer: &tok, chat_template: Some(GEMMA_TEMPLATE), max_context: 48, vocab, engine: &text, audio_rate: rate },
        markbase::server::api::Limits {
            tokenizer: vtok,
            chat_template: None,
            max_context: 4096,
            vocab: vlm.config.vocab_size,
            engine: &vlm,
            audio_rate: rate,
        },
    ];
    let reach = Reach::new(3);
    let seeds = corpus("server");
    assert!(seeds.len() >= 8, "the server corpus is missing ({} files)", seeds.len());
    for (name, bytes) in &seeds {
        guarded(&|| format!("corpus file {name}"), || exercise_request(bytes, &limits, &reach)).unwrap();
    }
    // the corpus's JSON objects are the bodies the mutations start from
    let bases: Vec<Value> = seeds.iter().filter_map(|(_, b)| serde_json::from_slice::<Value>(b).ok()).filter(Value::is_object).collect();
    let strat = (0..bases.len(), prop::collection::vec(req_edit(), 0..4), prop::option::weighted(0.3, req_bytes()));
    run("server", &strat, |(base, edits, bytes)| {
        let mut v = bases[base].clone();
        for e in &edits {
            edit_request(&mut v, e);
        }
        let body = request_body(&v, &edits, &bytes);
        guarded(&|| format!("edits {edits:?} bytes {bytes:?}\nbody: {}", short(&body)), || exercise_request(&body, &limits, &reach))
    });
    reach.print("server", &["parsed", "chat accepted", "completion accepted"]);
}
