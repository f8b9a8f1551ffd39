//! The machinery of the single-op harness (`tests/backend_ops.rs`): small graphs around one
//! op, built with random weights of any format, compiled by the real passes, run on the GPU
//! executor and the CPU reference executor, their outputs (or the caches written) compared.

use std::collections::HashMap;
use std::sync::Arc;

use markbase::cpu::exec::{self, CpuState, CpuWeights, StepInputs, Val};
use markbase::exec::{Executor, GraphKey, Profile};
use markbase::gpu::device::Gpu;
use markbase::gpu::runtime::{GpuExecutor, GpuShared};
use markbase::graph::ir::{Graph, GraphKind, InputKind, StateKind, WeightParam};
use markbase::graph::ops::{DType, Op, TensorType};
use markbase::graph::passes::{compile, Compiled, PhasePolicy};
use markbase::graph::quant::{FloatType, QuantMode, QuantSpec, WeightFormat};
use markbase::weights::{RawDType, RawTensor, WeightData, Weights};
use petgraph::graph::NodeIndex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How a case's result is judged.
#[derive(Clone, Copy, Debug)]
pub enum Check {
    /// Normalised mean squared error `Σ(g−c)² / Σc²` at most this.
    Nmse(f64),
    /// Integer outputs: every word equal.
    Exact,
}

/// What a case compares.
#[derive(Clone, Debug)]
pub enum Read {
    /// The graph output `out` (the op's value).
    Out,
    /// A state after the step (the cache an op wrote).
    State(StateKind),
}

/// One graph around one op, with what it needs to run.
pub struct Case {
    /// Name of the op under test (`Op::name`).
    pub op: &'static str,
    /// Shapes, formats and attributes, for messages.
    pub desc: String,
    pub seed: u64,
    /// A graph run first (filling caches), with its tokens and positions.
    pub prelude: Option<(Graph, Vec<u32>, Vec<u32>)>,
    pub graph: Graph,
    /// The node of the op under test.
    pub node: NodeIndex,
    pub weights: Vec<WeightData>,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// Per token, the last position it attends to (cases with attention bounds; else empty).
    pub attend_until: Vec<u32>,
    pub sampling: [u32; 8],
    pub recent: Vec<u32>,
    /// Each row's sequence slot, sampling words and recent ids (the batched ops' cases).
    pub slot_ids: Vec<u32>,
    pub row_sampling: Vec<u32>,
    pub row_recent: Vec<u32>,
    pub check: Check,
    /// What is compared (each with `check`).
    pub reads: Vec<Read>,
    /// Weights uploaded in small chunks.
    pub chunked: bool,
    /// Floating-point operations of the op (0: a bandwidth-bound op).
    pub flops: f64,
}

/// Stored bytes per matrix chunk on the chunked device: small enough to split every matrix
/// of the chunked cases into several chunks, large enough for one expert of their stacks.
pub const CHUNK_BYTES: u64 = 3072;

/// Chunks a matrix is uploaded in on the chunked device (the upload's rule: whole rows, or
/// whole experts of a stack, per chunk of at most [`CHUNK_BYTES`]).
pub fn chunk_count(w: &WeightData) -> usize {
    let fmt = markbase::gpu::weights::gpu_format(w).unwrap_or_else(|e| panic!("{e}"));
    let shape = &w.param.shape;
    let (a, b, c) = fmt.row_bytes(*shape.last().unwrap());
    let unit = if shape.len() == 3 { shape[1] } else { 1 };
    let units = shape[..shape.len() - 1].iter().product::<usize>() / unit;
    let per_chunk = (CHUNK_BYTES as usize / (a.max(b + c) * unit)).max(1);
    units.div_ceil(per_chunk)
}

/// Builds one case's graph: token and position inputs, random weights named after the case.
pub struct B {
    pub g: Graph,
    pub weights: Vec<WeightData>,
    pub rng: StdRng,
    pub tokens: NodeIndex,
    pub positions: NodeIndex,
    pub t: usize,
    /// Prefix of the names of the case's weights.
    pub tag: String,
    n: usize,
}

/// Rows of the random tables activations are gathered from.
pub const VOCAB: usize = 61;

impl B {
    pub fn new(tag: &str, seed: u64, t: usize) -> B {
        let mut g = Graph::new(t, if t == 1 { GraphKind::Decode } else { GraphKind::Prefill });
        let tokens = g.input("tokens", InputKind::Tokens, TensorType::u32(&[t]));
        let positions = g.input("positions", InputKind::Positions, TensorType::u32(&[t]));
        B { g, weights: vec![], rng: StdRng::seed_from_u64(seed), tokens, positions, t, tag: tag.to_string(), n: 0 }
    }

    /// A weight node of float shape `shape` stored as `format`; `module`: a matrix (else a
    /// vector weight); `kind` steers the values (`norm`: around 1, `norm0`: around 0).
    pub fn weight(&mut self, kind: &str, shape: &[usize], format: WeightFormat, module: bool) -> NodeIndex {
        self.n += 1;
        let name = format!("{}.{kind}{}", self.tag, self.n);
        let p = WeightParam { name, shape: shape.to_vec(), format, module };
        let seed = self.rng.gen();
        let wd = weight_data(&p, seed, kind == "norm0", &mut self.rng);
        self.weights.push(wd);
        self.g.weight(&p.name.clone(), None, p)
    }

    pub fn op(&mut self, op: Op, inputs: &[NodeIndex]) -> NodeIndex {
        self.n += 1;
        let name = format!("{}.{}{}", self.tag, op.name(), self.n);
        self.g.op(&name, None, op, inputs).unwrap_or_else(|e| panic!("{}: {e}", self.tag))
    }

    /// An f32 activation of `shape` (`shape[0]` = tokens), values in about `±amp`: rows of a
    /// random bf16 table gathered by the token ids, reshaped.
    pub fn act(&mut self, shape: &[usize], amp: f32) -> NodeIndex {
        assert_eq!(shape[0], self.t, "activations have a row per token");
        let d: usize = shape[1..].iter().product();
        let table = self.weight("table", &[VOCAB, d], float(FloatType::Bf16), true);
        let e = self.op(Op::Embed { scale: amp * (d as f32).sqrt(), clamp: None }, &[self.tokens, table]);
        if shape.len() == 2 {
            e
        } else {
            self.op(Op::Reshape { shape: shape.to_vec() }, &[e])
        }
    }

    /// Logits `[t, e]` without ties (in practice): the sum of two activations, computed
    /// exactly alike on both executors, so that integer ops read the same values.
    pub fn logits(&mut self, e: usize, amp: f32) -> NodeIndex {
        let a = self.act(&[self.t, e], amp);
        let b = self.act(&[self.t, e], amp / 7.0);
        self.op(Op::Binary { f: markbase::graph::ops::BinaryOp::Add }, &[a, b])
    }

    /// A KV-cache state `[slots, heads, d]`.
    pub fn cache(&mut self, layer: usize, value: bool, shape: &[usize]) -> NodeIndex {
        let name = format!("{}.cache{layer}{}", self.tag, if value { "v" } else { "k" });
        self.g.state(&name, None, StateKind::KvCache { layer, value }, TensorType::f32(shape))
    }

    /// Sets the outputs: `out` = `node`; `logits` and `token`, which the GPU executor wants,
    /// from `node` where its type allows, else from `f32_node`, a pool value (2-D or reshaped).
    pub fn finish(mut self, node: NodeIndex, f32_node: NodeIndex) -> (Graph, Vec<WeightData>) {
        self.g.set_output("out", node);
        let ty = self.g.node(node).ty.clone();
        let in_pool = self.g.node(self.g.storage_root(node)).op().is_some();
        let f = if ty.dtype == DType::F32 && in_pool { node } else { f32_node };
        let fty = self.g.node(f).ty.clone();
        self.g.set_output("logits", f);
        let token = if ty.dtype == DType::U32 {
            node
        } else {
            let l = if fty.shape.len() == 2 { f } else { self.op(Op::Reshape { shape: vec![fty.rows(), fty.last()] }, &[f]) };
            self.op(Op::Argmax, &[l])
        };
        self.g.set_output("token", token);
        (self.g, self.weights)
    }
}

pub fn float(dtype: FloatType) -> WeightFormat {
    WeightFormat::Float { dtype }
}

pub fn quant(mode: QuantMode, bits: usize, group_size: usize, global_scale: bool) -> WeightFormat {
    WeightFormat::Quantized { spec: QuantSpec { mode, bits, group_size }, global_scale }
}

fn encode(dtype: FloatType, shape: &[usize], v: &[f32]) -> RawTensor {
    match dtype {
        FloatType::F32 => RawTensor::from_f32(shape, v),
        FloatType::Bf16 => RawTensor {
            dtype: RawDType::Bf16,
            shape: shape.to_vec(),
            bytes: v.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect(),
        },
        FloatType::F16 => RawTensor {
            dtype: RawDType::F16,
            shape: shape.to_vec(),
            bytes: v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        },
    }
}

/// Random stored tensors for `p`: the synthetic models' values, re-stored in the float dtype
/// asked for, and (mx/nv formats) random per-group scales and global scales, so that a kernel
/// reading the wrong group's scale shows.
fn weight_data(p: &WeightParam, seed: u64, one_plus_w: bool, r: &mut StdRng) -> WeightData {
    let mut w = markbase::synthetic::random_weight(p, seed, one_plus_w);
    match p.format {
        WeightFormat::Float { dtype } => {
            if dtype != FloatType::Bf16 {
                let mut v = w.weight.to_f32();
                // values of more than bf16's 8 bits of mantissa
                v.iter_mut().for_each(|x| *x *= 1.0 + r.gen_range(-0.004..0.004f32));
                w.weight = encode(dtype, &p.shape, &v);
            }
            w.param.format = p.format;
        }
        WeightFormat::Quantized { spec, .. } => {
            if spec.mode == QuantMode::Mxfp8 {
                // no NaN codes (e4m3 0x7f / 0xff)
                w.weight.bytes.iter_mut().filter(|b| **b & 0x7f == 0x7f).for_each(|b| *b &= 0xfe);
            }
            if let Some(s) = w.scales.as_mut().filter(|_| spec.mode != QuantMode::Affine) {
                let (lo, hi) = if spec.mode == QuantMode::Nvfp4 { (0x18u8, 0x48u8) } else { (118, 132) };
                // e8m0 around 2^-9..2^4 scaled to the row length; e4m3 from 2^-4 to about 2^1
                let shift = if spec.mode == QuantMode::Nvfp4 { 0 } else { ((*p.shape.last().unwrap() as f32).sqrt().log2() as u8).min(8) };
                s.bytes.iter_mut().for_each(|b| *b = r.gen_range(lo..hi) - shift);
            }
            if let Some(g) = w.global_scale.as_mut() {
                let v: Vec<f32> = (0..g.numel()).map(|_| r.gen_range(0.5..2.0)).collect();
                *g = RawTensor::from_f32(&g.shape.clone(), &v);
            }
        }
    }
    w
}

/// The base seed: `MARKBASE_TEST_SEED`, else a fixed one.
pub fn base_seed() -> u64 {
    std::env::var("MARKBASE_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x0b5e_0d5e)
}

/// Normalised mean squared error of `got` against `want` (`Σ(g−c)²` when `want` is all zero;
/// infinite on a length mismatch or a non-finite value).
pub fn nmse(got: &[f32], want: &[f32]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &c) in got.iter().zip(want) {
        if !g.is_finite() || !c.is_finite() {
            return f64::INFINITY;
        }
        num += (g as f64 - c as f64).powi(2);
        den += (c as f64).powi(2);
    }
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// A value read back from either executor.
enum Got {
    F(Vec<f32>),
    U(Vec<u32>),
}

/// The result of one case.
pub struct Outcome {
    pub op: &'static str,
    pub desc: String,
    /// NMSE (f32 outputs) or the count of differing words (integer outputs).
    pub err: f64,
    pub bound: f64,
    pub failure: Option<String>,
    /// Median GPU µs of the op and how it was timed (perf mode).
    pub perf: Option<(f64, &'static str)>,
    /// Bytes the op reads and writes, and its floating-point operations.
    pub bytes: f64,
    pub flops: f64,
    /// The kernels of the op's dispatches on the GPU.
    pub kernels: Vec<String>,
}

fn step<'a>(tokens: &'a [u32], positions: &'a [u32], c: &'a Case) -> StepInputs<'a> {
    let rows = (&c.slot_ids[..], &c.row_sampling[..], &c.row_recent[..]);
    StepInputs { tokens, positions, sampling: c.sampling, recent: &c.recent, attend_until: &c.attend_until, slot_ids: rows.0, row_sampling: rows.1, row_recent: rows.2, ..Default::default() }
}

const PRELUDE: GraphKey = GraphKey { tokens: 0, all_logits: true, sample: false, images: false };
const MAIN: GraphKey = GraphKey { tokens: 0, all_logits: false, sample: false, images: false };

fn cpu_run(c: &Case, main: &Compiled, prelude: Option<&Compiled>) -> Result<Vec<Got>, String> {
    let mut ws = Weights::default();
    c.weights.iter().for_each(|w| ws.insert(w.clone()));
    let mut w = CpuWeights::new(Arc::new(ws));
    let mut st = CpuState::default();
    if let (Some(p), Some((_, t, pos))) = (prelude, &c.prelude) {
        exec::run(p, &mut w, &mut st, &step(t, pos, c))?;
    }
    let outs = exec::run(main, &mut w, &mut st, &step(&c.tokens, &c.positions, c))?;
    c.reads
        .iter()
        .map(|r| {
            Ok(match r {
                Read::Out => match outs.get("out").ok_or("no output out")? {
                    Val::F(v) => Got::F(v.to_vec()),
                    Val::U(v) => Got::U(v.to_vec()),
                },
                Read::State(k) => Got::F(st.caches.get(k).ok_or("state not written")?.clone()),
            })
        })
        .collect()
}

fn gpu_run(c: &Case, ex: &mut GpuExecutor, main: &Compiled, prelude: Option<&Compiled>) -> Result<Vec<Got>, String> {
    if let (Some(p), Some((_, t, pos))) = (prelude, &c.prelude) {
        ex.run(PRELUDE, p, &step(t, pos, c), false)?;
    }
    ex.run(MAIN, main, &step(&c.tokens, &c.positions, c), false)?;
    let mut got = vec![];
    for r in &c.reads {
        got.push(match r {
            Read::Out => {
                let words = ex.read_output(MAIN, main, "out")?;
                match main.graph.node(main.graph.output("out").unwrap()).ty.dtype {
                    DType::F32 => Got::F(words.iter().map(|w| f32::from_bits(*w)).collect()),
                    DType::U32 => Got::U(words),
                }
            }
            Read::State(k) => Got::F(ex.read_state(k)?),
        });
    }
    Ok(got)
}

/// Bytes the op reads and writes: its inputs (weights as stored) and its output (a cache
/// write: the rows it writes).
fn op_bytes(g: &Graph, n: NodeIndex) -> f64 {
    let op = g.node(n).op().unwrap();
    let ins = g.inputs(n);
    let mut b = 0usize;
    for (i, &x) in ins.iter().enumerate() {
        let node = g.node(x);
        if op.writes_state() && i == ins.len() - 1 {
            continue;
        }
        b += node.weight().map_or(node.ty.bytes(), |p| p.stored_bytes());
    }
    b += if op.writes_state() { g.node(ins[0]).ty.bytes() } else if op.is_view() { 0 } else { g.node(n).ty.bytes() };
    b as f64
}

/// Median GPU time of the op's dispatches over a few steps: per-dispatch timestamps where
/// the adapter has them, else the wall-clock time of the step.
fn time_op(c: &Case, ex: &mut GpuExecutor, main: &Compiled) -> Result<(f64, &'static str), String> {
    let per_kernel = ex.gpu.info.timestamps_inside_passes;
    ex.set_profile(if per_kernel { Profile::Kernels } else { Profile::Off });
    let mut times = vec![];
    for it in 0..7 {
        let t0 = std::time::Instant::now();
        ex.run(MAIN, main, &step(&c.tokens, &c.positions, c), false)?;
        let wall = t0.elapsed().as_secs_f64();
        let s = if per_kernel {
            ex.profile().map_or(0.0, |p| p.dispatches.iter().filter(|d| d.0 == c.node).map(|d| d.1).sum())
        } else {
            wall
        };
        if it >= 2 {
            times.push(s);
        }
    }
    ex.set_profile(Profile::Off);
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2] * 1e6, if per_kernel { "timestamps" } else { "wall clock of the step" }))
}

/// The error of `got` against `want` under `check`, and what is wrong where it fails.
/// `poison`: the reference perturbed first (`MARKBASE_OPS_POISON=1`: every case must fail).
fn compare(got: Got, want: Got, check: Check, poison: bool) -> (f64, Option<String>) {
    let want = match want {
        Got::F(mut v) if poison => {
            let i = v.len() / 2;
            v[i] += 0.5 * v.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
            Got::F(v)
        }
        Got::U(mut v) if poison => {
            v[0] ^= 1;
            Got::U(v)
        }
        w => w,
    };
    match (&got, &want, check) {
        (Got::F(g), Got::F(w), Check::Nmse(bound)) => {
            let err = nmse(g, w);
            if err <= bound {
                return (err, None);
            }
            let worst = g.iter().zip(w).enumerate().max_by(|a, b| ((a.1 .0 - a.1 .1).abs()).total_cmp(&(b.1 .0 - b.1 .1).abs()));
            let at = worst.map_or(String::new(), |(i, (g, w))| format!("; worst at {i}: gpu {g} cpu {w}"));
            (err, Some(format!("NMSE {err:.3e} > bound {bound:.0e} ({} values{at})", w.len())))
        }
        (Got::U(g), Got::U(w), Check::Exact) => {
            let err = if g.len() != w.len() { f64::INFINITY } else { g.iter().zip(w).filter(|(a, b)| a != b).count() as f64 };
            if err == 0.0 {
                return (0.0, None);
            }
            let show = |v: &[u32]| format!("{:?}", &v[..v.len().min(24)]);
            (err, Some(format!("{err} of {} words differ: gpu {} cpu {}", w.len(), show(g), show(w))))
        }
        _ => (f64::INFINITY, Some("output kind does not match the check".into())),
    }
}

fn run_case(c: &Case, shared: &GpuShared, perf: bool, poison: bool) -> Outcome {
    let mut o = Outcome { op: c.op, desc: format!("{} seed {}", c.desc, c.seed), err: 0.0, bound: 0.0, failure: None, perf: None, bytes: op_bytes(&c.graph, c.node), flops: c.flops, kernels: vec![] };
    let fail = |o: &mut Outcome, m: String| o.failure = Some(m);
    let compiled = |g: &Graph| compile(g.clone(), PhasePolicy::Step).map_err(|e| e.to_string());
    let main = match compiled(&c.graph) {
        Ok(m) => m,
        Err(e) => {
            fail(&mut o, format!("compile: {e}"));
            return o;
        }
    };
    let prelude = match c.prelude.as_ref().map(|p| compiled(&p.0)).transpose() {
        Ok(p) => p,
        Err(e) => {
            fail(&mut o, format!("compile prelude: {e}"));
            return o;
        }
    };
    let want = match cpu_run(c, &main, prelude.as_ref()) {
        Ok(w) => w,
        Err(e) => {
            fail(&mut o, format!("cpu: {e}"));
            return o;
        }
    };
    let mut ex = GpuExecutor::for_session(shared);
    let got = match gpu_run(c, &mut ex, &main, prelude.as_ref()) {
        Ok(g) => g,
        Err(e) => {
            fail(&mut o, format!("gpu: {e}"));
            return o;
        }
    };
    let mut kernels: Vec<String> = ex.dispatch_kernels(MAIN).unwrap_or_default().into_iter().filter(|d| d.0 == c.node).map(|d| d.1).collect();
    kernels.dedup();
    o.kernels = kernels;
    for ((r, g), w) in c.reads.iter().zip(got).zip(want) {
        let what = match r {
            Read::Out => String::new(),
            Read::State(k) => format!("{k:?}: "),
        };
        let (err, msg) = compare(g, w, c.check, poison);
        o.err = o.err.max(err);
        if let Some(m) = msg {
            fail(&mut o, format!("{what}{m}"));
        }
    }
    if let Check::Nmse(b) = c.check {
        o.bound = b;
    }
    if perf && o.failure.is_none() {
        match time_op(c, &mut ex, &main) {
            Ok(t) => o.perf = Some(t),
            Err(e) => fail(&mut o, format!("timing: {e}")),
        }
    }
    o
}

/// Runs every case (those whose op or description contains `MARKBASE_OPS_FILTER`, when set)
/// on the GPU and the CPU; returns the outcomes and the GPU's description.
pub fn run_all(cases: &[Case], perf: bool) -> (Vec<Outcome>, String) {
    let poison = std::env::var("MARKBASE_OPS_POISON").is_ok_and(|v| v == "1");
    let filter = std::env::var("MARKBASE_OPS_FILTER").ok().filter(|f| !f.is_empty());
    let chosen: Vec<&Case> =
        cases.iter().filter(|c| filter.as_ref().is_none_or(|f| c.op.contains(f.as_str()) || c.desc.contains(f.as_str()))).collect();
    let weights = |chunked: bool| {
        let mut ws = Weights::default();
        chosen.iter().filter(|c| c.chunked == chunked).flat_map(|c| &c.weights).for_each(|w| ws.insert(w.clone()));
        ws
    };
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("the op harness needs a GPU adapter: {e}"));
    let adapter = gpu.info.summary();
    let whole = GpuShared::with_gpu(gpu, &weights(false), false, None).unwrap_or_else(|e| panic!("upload: {e}"));
    // the chunked cases' weights on the same device, with its kernels
    let chunked = whole.with_weights(&weights(true), Some(CHUNK_BYTES)).unwrap_or_else(|e| panic!("upload: {e}"));
    let shared: HashMap<bool, GpuShared> = [(false, whole), (true, chunked)].into();
    let outcomes = chosen
        .iter()
        .map(|c| {
            let t = std::time::Instant::now();
            let o = run_case(c, &shared[&c.chunked], perf, poison);
            if std::env::var("MARKBASE_OPS_VERBOSE").is_ok_and(|v| v == "1") {
                println!("{:>8.1} ms  {} {}: {}", t.elapsed().as_secs_f64() * 1e3, c.op, c.desc, o.kernels.join(", "));
            }
            o
        })
        .collect();
    (outcomes, adapter)
}
