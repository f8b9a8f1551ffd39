//! Shared helpers of the model test suites: fixture references, the bounds of each
//! fixture (family and quantization) against mlx-lm's float32 outputs, and a fixture
//! runner that reads every decoder layer's output besides the logits.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use markbase::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
use markbase::graph::ir::{Graph, GraphKind};
use markbase::graph::ops::{DType, Op};
use markbase::graph::passes::{compile, Compiled, PhasePolicy};
use markbase::graph::{BuildOptions, FuseOptions, Outputs};
use markbase::gpu::runtime::GpuExecutor;
use markbase::loader::Checkpoint;
use markbase::model::{DeviceKind, Executor, GraphKey, Model, ModelOptions};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Reads the f32/i32 tensors of a `reference.safetensors`.
pub struct Reference {
    pub tokens: Vec<u32>,
    pub prefill: Vec<f32>,
    pub decode: Vec<f32>,
    pub vocab: usize,
    /// Output of decoder layer i over the whole prompt, `[T, H]` (mlx-lm's layer call).
    pub hidden: Vec<Vec<f32>>,
}

pub fn reference(name: &str) -> Reference {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).expect("reference.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse reference");
    let f32s = |n: &str| -> (Vec<f32>, Vec<usize>) {
        let t = st.tensor(n).unwrap_or_else(|_| panic!("{n} missing"));
        (t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(), t.shape().to_vec())
    };
    let tok = st.tensor("tokens").unwrap();
    let tokens = tok.data().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32).collect();
    let (prefill, shape) = f32s("logits_prefill");
    let (decode, _) = f32s("logits_decode");
    let layers = st.names().iter().filter(|n| n.starts_with("hidden_")).count();
    let hidden = (0..layers).map(|i| f32s(&format!("hidden_{i}")).0).collect();
    Reference { tokens, prefill, decode, vocab: shape[1], hidden }
}

/// Largest |Δ| between two equally long slices (an error when one is not finite).
pub fn max_abs_diff(what: &str, got: &[f32], want: &[f32]) -> Result<f32, String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, the reference has {}", got.len(), want.len()));
    }
    let mut maxd = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if !g.is_finite() {
            return Err(format!("{what}: non-finite value {g} at {i}"));
        }
        maxd = maxd.max((g - w).abs());
    }
    Ok(maxd)
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// How far a fixture's outputs may be from mlx-lm's float32 ones, relative to the
/// reference's largest magnitude: `logits` for the logits, `hidden[i]` for decoder
/// layer i's output (max |Δ| of the layer over max |ref| of the layer).
#[derive(Clone, Debug)]
pub struct Bound {
    pub logits: f32,
    pub hidden: Vec<f32>,
}

/// Error of each fixture today, relative to the reference's largest magnitude: the
/// largest over the CPU reference and the GPU (lavapipe), prefill and decode, of the
/// logits, and of each layer's output. Measured with this suite's own printout
/// (`cargo test --release --test cpu_reference --test gpu_models -- --nocapture`);
/// a new or regenerated fixture needs its row. Gemma 4's errors are ~10× Gemma 3's on
/// both devices, and grow through the layers.
#[rustfmt::skip]
const OBSERVED: &[(&str, f32, &[f32])] = &[
    // (fixture, logits, hidden by layer)
    ("gemma3_text-bf16", 1.7e-6, &[7.7e-7, 7.9e-7, 1.1e-6, 1.1e-6, 1.2e-6, 1.8e-6]),
    ("gemma3_text-q4", 4.1e-6, &[8.3e-7, 7.8e-7, 9.6e-7, 1.0e-6, 1.4e-6, 1.6e-6]),
    ("gemma3_text-q4sharded", 4.1e-6, &[8.3e-7, 7.8e-7, 9.6e-7, 1.0e-6, 1.4e-6, 1.6e-6]),
    ("gemma3_text-q8", 1.4e-6, &[6.1e-7, 7.3e-7, 8.3e-7, 9.6e-7, 1.0e-6, 1.4e-6]),
    ("gemma3_text-q2g64", 1.5e-6, &[6.4e-7, 7.6e-7, 8.2e-7, 9.4e-7, 1.2e-6, 1.3e-6]),
    ("gemma3_text-q3g32", 1.8e-6, &[6.9e-7, 8.9e-7, 1.1e-6, 7.7e-7, 7.6e-7, 9.7e-7]),
    ("gemma3_text-q5g64", 2.1e-6, &[9.4e-7, 7.1e-7, 8.1e-7, 1.1e-6, 1.2e-6, 1.6e-6]),
    ("gemma3_text-q6g128", 1.5e-6, &[6.6e-7, 8.8e-7, 9.3e-7, 1.2e-6, 1.4e-6, 1.5e-6]),
    ("gemma3_text-mixed36", 1.6e-6, &[7.1e-7, 8.9e-7, 1.1e-6, 1.0e-6, 1.5e-6, 1.6e-6]),
    ("gemma3_text-mxfp4", 2.3e-6, &[7.6e-7, 1.1e-6, 1.6e-6, 1.3e-6, 1.7e-6, 1.7e-6]),
    ("gemma3_text-mxfp8", 1.6e-6, &[7.3e-7, 7.5e-7, 9.8e-7, 1.0e-6, 1.0e-6, 1.1e-6]),
    ("gemma3_text-nvfp4", 1.4e-6, &[6.2e-7, 1.1e-6, 1.0e-6, 1.0e-6, 1.3e-6, 1.3e-6]),
    ("gemma3_mm-bf16", 1.4e-6, &[6.9e-7, 9.5e-7, 9.3e-7, 9.4e-7]),
    ("gemma3_mm-q4", 2.7e-6, &[8.6e-7, 1.1e-6, 1.0e-6, 1.2e-6]),
    ("gemma4_dense_ple-bf16", 1.4e-5, &[2.3e-6, 2.8e-6, 7.0e-6, 9.5e-6, 9.1e-6, 9.6e-6]),
    ("gemma4_dense_ple-q4", 2.2e-5, &[1.8e-6, 3.1e-6, 5.5e-6, 5.8e-6, 6.5e-6, 6.7e-6]),
    ("gemma4_dense_ple-mxfp4", 1.1e-5, &[1.5e-6, 2.5e-6, 3.8e-6, 4.4e-6, 6.2e-6, 6.5e-6]),
    ("gemma4_moe-bf16", 1.9e-5, &[1.2e-6, 3.0e-6, 1.1e-5, 1.3e-5, 1.4e-5, 1.3e-5]),
    ("gemma4_moe-bf16-hffused", 1.9e-5, &[1.2e-6, 3.0e-6, 1.1e-5, 1.3e-5, 1.4e-5, 1.3e-5]),
    ("gemma4_moe-q4", 1.6e-5, &[1.3e-6, 3.6e-6, 4.3e-6, 7.8e-6, 6.6e-6, 1.4e-5]),
    ("gemma4_moe-q4-hfnames", 1.6e-5, &[1.3e-6, 3.6e-6, 4.3e-6, 7.8e-6, 6.6e-6, 1.4e-5]),
    ("gemma4_moe-nvfp4gs", 1.2e-5, &[1.6e-6, 3.7e-6, 8.4e-6, 8.6e-6, 9.1e-6, 1.0e-5]),
];

/// Headroom over [`OBSERVED`]: another summation order (a fused kernel, another GPU)
/// moves these errors by a few times at most, while the smallest planted constant bug
/// (the embedding scale off by one bf16 rounding, 1e-4 relative) moves them by 30-100×.
const HEADROOM: f32 = 10.0;

/// The bound of fixture `name` (one per family and quantization): [`HEADROOM`] × its
/// [`OBSERVED`] errors, the same on both devices (their errors are within 4× of each other).
pub fn bound(name: &str) -> Bound {
    let &(_, logits, hidden) = OBSERVED
        .iter()
        .find(|(n, ..)| *n == name)
        .unwrap_or_else(|| panic!("{name}: no observed error in tests/common OBSERVED; measure it and add a row"));
    Bound { logits: HEADROOM * logits, hidden: hidden.iter().map(|h| HEADROOM * h).collect() }
}

/// Compares logits rows: max |Δ| ≤ `bound` × max|ref| and the same argmax wherever
/// the reference's top-2 gap exceeds 1e-3 × max|ref|. Returns max |Δ| / max|ref|.
pub fn compare(what: &str, got: &[f32], want: &[f32], vocab: usize, bound: f32) -> Result<f32, String> {
    let scale = max_abs(want);
    let maxd = max_abs_diff(what, got, want)?;
    if maxd > bound * scale {
        return Err(format!("{what}: max |Δ| {maxd:.3e} = {:.2e} × max|ref| {scale:.2}, bound {bound:.1e}", maxd / scale));
    }
    for (r, (gr, wr)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let (top, second) = top2(wr);
        if wr[top] - wr[second] > 1e-3 * scale {
            let ga = markbase::cpu::ops::argmax(gr) as usize;
            if ga != top {
                return Err(format!("{what}: row {r} argmax {ga} != mlx-lm {top}"));
            }
        }
    }
    Ok(maxd / scale)
}

/// Indices of the largest and second largest entries of `row`.
pub fn top2(row: &[f32]) -> (usize, usize) {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    (idx[0], idx[1])
}

/// Compares each decoder layer's output with the reference's `hidden_i`, in layer order:
/// the first layer past its bound `bounds[i]` (max |Δ| over max |ref| of that layer) is
/// the error. Returns the relative error of every layer.
pub fn compare_hidden(what: &str, got: &[Vec<f32>], want: &[Vec<f32>], bounds: &[f32]) -> Result<Vec<f32>, String> {
    if got.len() != want.len() || bounds.len() != want.len() {
        return Err(format!("{what}: {} layer outputs and {} bounds, the reference has {}", got.len(), bounds.len(), want.len()));
    }
    let mut errs = vec![];
    for (i, ((g, w), &bound)) in got.iter().zip(want).zip(bounds).enumerate() {
        let scale = max_abs(w);
        let rel = max_abs_diff(&format!("{what} layer {i}"), g, w)? / scale;
        if rel > bound {
            return Err(format!("{what}: layer {i} is the first to diverge: max |Δ| / max|ref| = {rel:.2e} (max|ref| {scale:.2}), bound {bound:.1e}"));
        }
        errs.push(rel);
    }
    Ok(errs)
}

/// Marks the output of every decoder layer as graph output `hidden_{i}`: the last op
/// node of layer i, in execution order, whose value is `f32[T, hidden_size]` (the
/// residual stream after the layer, Gemma 4's layer scalar included: what mlx-lm's
/// decoder layer returns and the fixtures store as `hidden_i`).
pub fn mark_layer_outputs(g: &mut Graph, layers: usize, hidden_size: usize) -> Result<(), String> {
    let want = [g.tokens, hidden_size];
    let mut last = vec![None; layers];
    for n in g.order() {
        let node = g.node(n);
        if let (Some(_), Some(l)) = (node.op(), node.layer) {
            if l < layers && node.ty.dtype == DType::F32 && node.ty.shape == want {
                last[l] = Some(n);
            }
        }
    }
    for (i, n) in last.into_iter().enumerate() {
        let n = n.ok_or_else(|| format!("layer {i} has no f32{want:?} op"))?;
        g.set_output(&format!("hidden_{i}"), n);
    }
    Ok(())
}

/// A change made to every graph before it is compiled (a planted bug).
pub type GraphEdit<'a> = &'a dyn Fn(&mut Graph);

enum Device {
    Cpu(CpuWeights, CpuState),
    Gpu(GpuExecutor),
}

/// Runs a fixture's graphs as [`Model`] builds them (max_context 64, prefill chunks of
/// 32, every position's logits), each decoder layer's output an extra graph output,
/// on the CPU reference or the GPU; an optional edit is applied to every graph.
pub struct FixtureRun<'a> {
    pub ck: Checkpoint,
    device: Device,
    graphs: HashMap<GraphKey, Compiled>,
    edit: Option<GraphEdit<'a>>,
    /// The fusion rules the graphs are built with (all by default).
    pub fuse: FuseOptions,
    pos: u32,
}

const MAX_CONTEXT: usize = 64;
const CHUNK: usize = 32;

impl<'a> FixtureRun<'a> {
    pub fn new(name: &str, device: DeviceKind, edit: Option<GraphEdit<'a>>) -> Result<Self, String> {
        let ck = Checkpoint::open(fixture(name)).map_err(|e| format!("{name}: {e}"))?;
        let probe = ck.build(BuildOptions::decode(MAX_CONTEXT, CHUNK)).map_err(|e| e.to_string())?;
        let w = Arc::new(ck.load_weights(&probe).map_err(|e| format!("{name}: {e}"))?.0);
        let device = match device {
            DeviceKind::Cpu => Device::Cpu(CpuWeights::new(w), CpuState::default()),
            DeviceKind::Gpu(b) => Device::Gpu(GpuExecutor::new(b, w, false)?),
        };
        Ok(FixtureRun { ck, device, graphs: HashMap::new(), edit, fuse: FuseOptions::all(), pos: 0 })
    }

    pub fn key(tokens: usize) -> GraphKey {
        GraphKey { tokens, all_logits: true, sample: false, images: false }
    }

    /// The compiled graph of `tokens` per step (built on first use, as `Model::graph`).
    pub fn graph(&mut self, tokens: usize) -> Result<&Compiled, String> {
        let key = Self::key(tokens);
        if !self.graphs.contains_key(&key) {
            let mut o = BuildOptions::prefill(tokens, MAX_CONTEXT);
            o.chunk = CHUNK;
            o.outputs = Outputs::AllLogits;
            o.kind = if tokens == 1 { GraphKind::Decode } else { GraphKind::Prefill };
            o.fuse = self.fuse.clone();
            let mut g = self.ck.build(o).map_err(|e| e.to_string())?;
            let cfg = self.ck.config();
            mark_layer_outputs(&mut g, cfg.num_layers, cfg.hidden_size)?;
            if let Some(edit) = self.edit {
                edit(&mut g);
            }
            let policy = if tokens == 1 { PhasePolicy::Step } else { PhasePolicy::EmbedLayersHead };
            self.graphs.insert(key, compile(g, policy).map_err(|e| e.to_string())?);
        }
        Ok(&self.graphs[&key])
    }

    /// Starts a new sequence.
    pub fn reset(&mut self) {
        self.pos = 0;
        match &mut self.device {
            Device::Cpu(_, s) => s.clear(),
            Device::Gpu(g) => g.reset(),
        }
    }

    /// Feeds `tokens` (one step) after the sequence so far: the logits of every
    /// position and, with `hidden`, every decoder layer's output.
    pub fn step(&mut self, tokens: &[u32], hidden: bool) -> Result<(Vec<f32>, Vec<Vec<f32>>), String> {
        let layers = self.ck.config().num_layers;
        let key = Self::key(tokens.len());
        self.graph(tokens.len())?;
        let positions: Vec<u32> = (self.pos..self.pos + tokens.len() as u32).collect();
        let step = StepInputs { tokens, positions: &positions, ..Default::default() };
        let c = &self.graphs[&key];
        let names: Vec<String> = if hidden { (0..layers).map(|i| format!("hidden_{i}")).collect() } else { vec![] };
        let out = match &mut self.device {
            Device::Cpu(w, s) => {
                let out = exec::run(c, w, s, &step)?;
                let logits = out["logits"].f().to_vec();
                (logits, names.iter().map(|n| out[n].f().to_vec()).collect())
            }
            Device::Gpu(g) => {
                let logits = g.run(key, c, &step, true)?.logits.ok_or("no logits read back")?;
                let mut hs = vec![];
                for n in &names {
                    hs.push(g.read_output(key, c, n)?.into_iter().map(f32::from_bits).collect());
                }
                (logits, hs)
            }
        };
        self.pos += tokens.len() as u32;
        Ok(out)
    }

    /// The kernel of each GPU dispatch of the graph of `tokens` per step (once run).
    pub fn gpu_kernels(&self, tokens: usize) -> Option<Vec<(petgraph::graph::NodeIndex, String)>> {
        match &self.device {
            Device::Gpu(g) => g.dispatch_kernels(Self::key(tokens)),
            Device::Cpu(..) => None,
        }
    }
}

/// The errors of one fixture run, relative to the reference's largest magnitudes.
#[derive(Clone, Debug, Default)]
pub struct Errors {
    pub prefill: f32,
    pub decode: f32,
    pub hidden: Vec<f32>,
}

/// Prefill of all 24 tokens (logits and every layer's output), then prefill of 20 +
/// 4 decode steps, against mlx-lm, within [`bound`]; `edit` is applied to every graph.
/// A layer past the bound is reported before the logits (the first one that diverges).
pub fn check_fixture_with(name: &str, device: DeviceKind, edit: Option<GraphEdit>) -> Result<Errors, String> {
    check_fixture_fused(name, device, edit, FuseOptions::all())
}

/// [`check_fixture_with`] on graphs built with the fusion rules `fuse`.
pub fn check_fixture_fused(name: &str, device: DeviceKind, edit: Option<GraphEdit>, fuse: FuseOptions) -> Result<Errors, String> {
    let r = reference(name);
    let b = bound(name);
    let mut run = FixtureRun::new(name, device, edit)?;
    run.fuse = fuse;
    let moe = run.ck.config().enable_moe_block;
    let (logits, hidden) = run.step(&r.tokens, true)?;
    let hidden = compare_hidden(&format!("{name} prefill"), &hidden, &r.hidden, &b.hidden)?;
    let prefill = compare(&format!("{name} prefill"), &logits, &r.prefill, r.vocab, b.logits)?;
    if moe {
        check_expert_path(name, &mut run, r.tokens.len(), true);
    }
    run.reset();
    run.step(&r.tokens[..20], false)?;
    let mut dec = vec![];
    for j in 0..4 {
        dec.extend(run.step(&r.tokens[20 + j..21 + j], false)?.0);
    }
    if moe {
        check_expert_path(name, &mut run, 1, false);
    }
    let decode = compare(&format!("{name} decode"), &dec, &r.decode, r.vocab, b.logits)?;
    Ok(Errors { prefill, decode, hidden })
}

pub fn check_fixture(name: &str, device: DeviceKind) -> Result<Errors, String> {
    check_fixture_with(name, device, None)
}

/// The model options of the fixture runs (as [`FixtureRun`]'s) on `device`.
pub fn fixture_options(device: DeviceKind) -> ModelOptions {
    ModelOptions { device, max_context: MAX_CONTEXT, prefill_chunk: CHUNK, ..Default::default() }
}

/// The expert matmuls of the graph of `tokens` per step (run once already): `grouped`
/// (prefill) = one `moe_group` per layer feeding three `grouped_matmul`s, which the GPU
/// runs with the grouped GEMM (f32, or on f16 tiles); else (decode) the gathered matmul, a gathered GEMV on the GPU.
pub fn check_expert_path(name: &str, run: &mut FixtureRun, tokens: usize, grouped: bool) {
    let layers = run.ck.config().num_layers;
    let g = run.graph(tokens).unwrap().graph.clone();
    let count = |f: &dyn Fn(&Op) -> bool| g.op_nodes().filter(|&n| f(g.node(n).op().unwrap())).count();
    let groups = count(&|o| matches!(o, Op::MoeGroup { .. }));
    let grouped_mm = count(&|o| matches!(o, Op::GroupedMatMul));
    let gather_mm = count(&|o| matches!(o, Op::GatherMatMul));
    if grouped {
        assert_eq!((groups, grouped_mm, gather_mm), (layers, 3 * layers, 0), "{name}: prefill expert ops");
    } else {
        assert_eq!((groups, grouped_mm, gather_mm), (0, 0, 3 * layers), "{name}: decode expert ops");
    }
    let Some(kernels) = run.gpu_kernels(tokens) else { return };
    let mut seen = 0;
    for (n, kernel) in kernels {
        let ok = match g.node(n).op().unwrap() {
            Op::MoeGroup { .. } => kernel == "moe_group",
            // the f32 grouped GEMM, or the f16 one behind its activations' pass
            Op::GroupedMatMul => ["gemm_grouped[", "gemm_f16_grouped[", "row_scale["].iter().any(|p| kernel.starts_with(p)),
            Op::GatherMatMul => kernel.starts_with("gemv[") && kernel.contains(" gather"),
            _ => continue,
        };
        assert!(ok, "{name}: node {} runs {kernel}", g.node(n).name);
        seen += 1;
    }
    assert!(seen >= if grouped { 4 * layers } else { 3 * layers }, "{name}: {seen} expert dispatches");
}

/// `check_fixture` for each fixture, printing the errors; panics with every failure.
pub fn check_fixtures(names: &[&str], device: DeviceKind) {
    let mut failed = vec![];
    for name in names {
        match check_fixture(name, device) {
            Ok(e) => {
                let h: Vec<String> = e.hidden.iter().map(|x| format!("{x:.1e}")).collect();
                println!("{name}: logits |Δ|/max prefill {:.2e} decode {:.2e}; layers {}", e.prefill, e.decode, h.join(" "));
            }
            Err(e) => {
                println!("FAIL {e}");
                failed.push(e);
            }
        }
    }
    assert!(failed.is_empty(), "{} fixtures fail:\n{}", failed.len(), failed.join("\n"));
}
/// Greedy choices `tokens` against reference logits `rows` (one row per token): where a
/// token is not its row's argmax it must nearly tie with it, its logit within `tie` ×
/// max|row| of the row's largest. Returns the count of such near-tie misses.
pub fn near_tie_misses<'r>(what: &str, rows: impl IntoIterator<Item = &'r [f32]>, tokens: &[u32], tie: f32) -> Result<usize, String> {
    let mut misses = 0;
    let mut n = 0;
    for (j, (row, &t)) in rows.into_iter().zip(tokens).enumerate() {
        n += 1;
        if !row.iter().all(|v| v.is_finite()) {
            return Err(format!("{what}: NaN/Inf at step {j}"));
        }
        let top = markbase::cpu::ops::argmax(row);
        if top == t {
            continue;
        }
        let gap = row[top as usize] - row[t as usize];
        if gap > tie * max_abs(row) {
            return Err(format!("{what}: step {j} takes {t}, the reference's argmax {top} is ahead by {gap:.3e} (not a near-tie)"));
        }
        misses += 1;
    }
    if n != tokens.len() {
        return Err(format!("{what}: {n} rows for {} tokens", tokens.len()));
    }
    Ok(misses)
}

/// A greedy decode of `n` tokens on the GPU from the fixture's first 10 tokens, with a
/// 640-slot context, agrees with the CPU reference's argmax wherever the CPU's choice is
/// clear, with no NaN. Each device is within the fixture's logits bound of mlx-lm, so
/// they may disagree only where the top logits are within twice that bound.
pub fn long_decode_matches_cpu(name: &str, n: usize) {
    use markbase::model::GenerateParams;
    let r = reference(name);
    let prompt = &r.tokens[..10];
    let opts = ModelOptions { device: DeviceKind::Gpu(None), max_context: 640, prefill_chunk: 64, ..Default::default() };
    let mut gpu = Model::load(fixture(name), opts).unwrap();
    let p = GenerateParams { max_tokens: n, stop_at_eos: false, text: false, ..Default::default() };
    let gen: Vec<u32> = gpu.generate(prompt, p).unwrap().map(|x| x.unwrap().token).collect();
    assert_eq!(gen.len(), n);
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&gen[..n - 1]);
    let opts = ModelOptions { device: DeviceKind::Cpu, max_context: 640, prefill_chunk: 64, ..Default::default() };
    let mut cpu = Model::load(fixture(name), opts).unwrap();
    let rows = cpu.logits(&seq).unwrap();
    greedy_agrees(name, &rows, prompt.len(), &gen, 2.0 * bound(name).logits);
}

/// The CPU reference's logits `rows` (of the prompt and the generated tokens but the last)
/// are finite, and their argmax is the generated token `gen` but at near-ties (the top
/// logits within `tie` × max|row|), at most 1% of the steps.
pub fn greedy_agrees(name: &str, rows: &[Vec<f32>], prompt_len: usize, gen: &[u32], tie: f32) {
    let steps = rows[prompt_len - 1..].iter().map(|r| r.as_slice());
    let misses = near_tie_misses(name, steps, gen, tie).unwrap_or_else(|e| panic!("{e}"));
    let n = gen.len();
    println!("{name}: GPU greedy and CPU argmax agree at {}/{n} steps, the others near-ties", n - misses);
    assert!(misses * 100 <= n, "{name}: {misses}/{n} near-tie misses");
}
