//! `markbase bench`: prefill and decode speed of one model on one or more
//! backends, with the bandwidth accounting and a GPU profile by phase and by op.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{json, Value};

use markbase_graph::ir::NodeKind;
use markbase_graph::ops::Op;
use markbase_graph::passes::Compiled;
use markbase_graph::quant::QuantSpec;
use markbase_graph::ModelConfig;

use crate::gpu::runtime::{Profile, ProfileResult};
use crate::model::{DeviceKind, GraphKey, Model, ModelOptions, SampleParams};
use crate::weights::Weights;

/// What to benchmark.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub prompt: usize,
    pub gen: usize,
    /// Timed decode runs (after one warm-up run).
    pub runs: usize,
    /// Bandwidth (bytes/s) to compare against; `None`: the adapter's, where known ([`known_bandwidth`]).
    pub bandwidth: Option<f64>,
    /// Also profile one decode step per op kind (timestamps inside passes).
    pub profile: bool,
    /// The fusion rules the graphs run.
    pub fuse: markbase_graph::FuseOptions,
    /// Soft tokens of the images a vision model encodes (Gemma 4; empty: 280 and 1,120).
    pub image_tokens: Vec<usize>,
    /// Instead of prefill and decode: a batch's decode step at each of these sequence counts
    /// ([`crate::bench_batch`]).
    pub batch: Vec<usize>,
}

/// Bytes of weights a decode step reads: every matrix a MatMul multiplies by in
/// full, expert stacks at `k/E` of their bytes, lookup tables not at all.
pub fn bytes_per_token(c: &Compiled, weights: &Weights) -> u64 {
    let g = &c.graph;
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    for n in g.op_nodes() {
        let op = g.node(n).op().unwrap();
        for (slot, i) in g.inputs(n).into_iter().enumerate() {
            let Some(p) = g.node(i).weight() else { continue };
            let Some(w) = weights.get(&p.name) else { continue };
            let full = (w.weight.bytes.len()
                + w.scales.as_ref().map_or(0, |t| t.bytes.len())
                + w.biases.as_ref().map_or(0, |t| t.bytes.len())) as u64;
            let b = match op {
                Op::Embed { .. } => 0,
                Op::GatherMatMul | Op::GroupedMatMul if slot == 2 => {
                    let s = g.node(g.inputs(n)[1]).ty.shape[1] as u64;
                    full * s / p.shape[0] as u64
                }
                _ => full,
            };
            let e = seen.entry(p.name.clone()).or_insert(0);
            *e = (*e).max(b);
        }
    }
    seen.values().sum()
}

/// The bandwidth of an adapter known by name, in bytes/s: the H200's measured
/// device-to-device copy bandwidth (4.3 TB/s, the figure of the performance log).
pub fn known_bandwidth(device: &str) -> Option<f64> {
    device.contains("H200").then_some(4.3e12)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Most tokens of one prefill step of the bench: a longer prompt is fed in steps of this many
/// (one step's attention scores grow with its tokens times the context).
pub const BENCH_MAX_CHUNK: usize = 2048;

/// Benchmarks one model on one device. Returns a JSON record.
pub fn bench_one(name: &str, config: &ModelConfig, weights: Arc<Weights>, device: DeviceKind, o: &BenchOptions) -> Result<Value, String> {
    // the prompt in one prefill step, up to BENCH_MAX_CHUNK tokens (longer: steps of that many)
    let chunk = o.prompt.clamp(1, BENCH_MAX_CHUNK);
    let opts = ModelOptions { device, max_context: o.prompt + o.gen + 8, prefill_chunk: chunk, fuse: o.fuse.clone(), ..Default::default() };
    let mut m = Model::from_parts(config.clone(), weights.clone(), None, &opts)?;
    let dev = m.device();
    let vocab = config.vocab_size as u32;
    let prompt: Vec<u32> = (0..o.prompt as u32).map(|i| 2 + (i * 7919) % (vocab - 2)).collect();
    let bpt = {
        let c = m.graph(GraphKey { tokens: 1, all_logits: false, sample: false, images: false })?;
        bytes_per_token(c, &weights)
    };
    // Warm-up: build every graph and pipeline once.
    let dev_name = short_device(&dev);
    let t_warm = std::time::Instant::now();
    m.reset();
    let mut tok = m.forward(&prompt, false, None)?.token;
    // the first decode step builds the decode graph; the others time a step
    tok = m.forward(&[tok], false, None)?.token;
    let warm_decode = 4.min(o.gen).saturating_sub(1);
    let t_warm_decode = std::time::Instant::now();
    for _ in 0..warm_decode {
        tok = m.forward(&[tok], false, None)?.token;
    }
    let step_s = t_warm_decode.elapsed().as_secs_f64() / warm_decode.max(1) as f64;
    eprintln!("{dev_name}: warmed up in {:.1}s (graphs and pipelines built)", t_warm.elapsed().as_secs_f64());
    // Prefill.
    let mut pre = vec![];
    for i in 0..o.runs.max(1) {
        m.reset();
        let t = std::time::Instant::now();
        m.forward(&prompt, false, None)?;
        pre.push(t.elapsed().as_secs_f64());
        let ahead = if i == 0 {
            // the rest, from this run and the warm-up's decode steps
            format!(", about {:.0}s to go", pre[0] * (o.runs - 1) as f64 + step_s * (o.runs * o.gen) as f64)
        } else {
            String::new()
        };
        eprintln!("{dev_name}: prefill run {}/{}: {:.1} tok/s{ahead}", i + 1, o.runs, o.prompt as f64 / pre[i]);
    }
    let prefill_s = median(&mut pre);
    // Decode.
    let mut rates = vec![];
    let mut encode = vec![];
    let mut stats = None;
    // Decoding as generation runs it: greedy on the device; on a GPU the next step is
    // queued before the current token is read (the token is fed back on the device).
    let greedy = SampleParams::default();
    let pipelined = m.can_pipeline(&greedy);
    for _ in 0..o.runs.max(1) {
        m.reset();
        let mut tok = m.forward(&prompt, false, Some(&greedy))?.token;
        let t = std::time::Instant::now();
        if pipelined {
            m.submit_decode(Some(tok), &greedy)?;
        }
        for i in 0..o.gen {
            if pipelined {
                if i + 1 < o.gen {
                    m.submit_decode(None, &greedy)?;
                }
                tok = m.take_decode()?;
            } else {
                tok = m.forward(&[tok], false, Some(&greedy))?.token;
            }
            if let Some(s) = m.gpu_stats() {
                encode.push(s.encode_s);
                stats = Some(s);
            }
        }
        let _ = tok;
        rates.push(o.gen as f64 / t.elapsed().as_secs_f64());
        eprintln!("{dev_name}: decode run {}/{}: {:.1} tok/s", rates.len(), o.runs, rates[rates.len() - 1]);
    }
    let mut r2 = rates.clone();
    let decode = median(&mut r2);
    let (lo, hi) = (r2.first().cloned().unwrap_or(0.0), r2.last().cloned().unwrap_or(0.0));
    let achieved = bpt as f64 * decode;
    let mut rec = json!({
        "model": name,
        "device": dev,
        "prompt": o.prompt,
        "prefill_chunk": chunk,
        "gen": o.gen,
        "runs": o.runs,
        "prefill_tok_s": o.prompt as f64 / prefill_s,
        "decode_tok_s_median": decode,
        "decode_tok_s_runs": rates,
        "decode_tok_s_min": lo,
        "decode_tok_s_max": hi,
        "bytes_per_token": bpt,
        "achieved_GB_s": achieved / 1e9,
        "pipelined": pipelined,
    });
    if let Some(bw) = o.bandwidth.or_else(|| known_bandwidth(&dev)) {
        rec["bandwidth_GB_s"] = json!(bw / 1e9);
        rec["fraction_of_bandwidth"] = json!(achieved / bw);
        rec["bound_tok_s"] = json!(bw / bpt.max(1) as f64);
    }
    if let Some(s) = stats {
        rec["dispatches_per_step"] = json!(s.dispatches);
        rec["submits_per_step"] = json!(s.submits);
        rec["phases"] = json!(s.phases);
        rec["cpu_encode_us_median"] = json!(median(&mut encode) * 1e6);
    }
    // GPU time per phase, and per op kind.
    if let DeviceKind::Gpu(_) = device {
        let key = GraphKey { tokens: 1, all_logits: false, sample: false, images: false };
        m.set_profile(Profile::Phases);
        m.reset();
        // at the context the timed decode runs at (attention reads every cached key)
        let mut tok = m.forward(&prompt, false, None)?.token;
        tok = m.forward(&[tok], false, None)?.token;
        if let Some(p) = m.gpu_profile() {
            rec["gpu_ms_per_phase"] = json!(p.phases.iter().map(|s| s * 1e3).collect::<Vec<_>>());
        }
        // the same step sampling (temperature 0.7, top-p 0.9) instead of taking the argmax
        let sampled = SampleParams { temperature: 0.7, top_p: 0.9, seed: 1, ..Default::default() };
        m.forward(&[tok], false, Some(&sampled))?;
        if let Some(p) = m.gpu_profile() {
            rec["gpu_ms_per_phase_sampled"] = json!(p.phases.iter().map(|s| s * 1e3).collect::<Vec<_>>());
        }
        if o.profile {
            m.set_profile(Profile::Kernels);
            m.forward(&[tok], false, None)?;
            if let Some(p) = m.gpu_profile() {
                let c = m.graph(key)?;
                let (total, by_op) = ops_by_weight(c, &p);
                rec["gpu_profile_total_ms"] = json!(total * 1e3);
                rec["gpu_profile_by_op"] = json!(by_op);
                // The matmuls' own bandwidth.
                let mut mm_bytes = 0u64;
                let mut mm_s = 0.0;
                for (n, s) in &p.dispatches {
                    if matches!(c.graph.node(*n).op(), Some(Op::MatMul)) {
                        mm_s += s;
                    }
                }
                for n in c.graph.op_nodes() {
                    if matches!(c.graph.node(n).op(), Some(Op::MatMul)) {
                        let w = c.graph.inputs(n)[1];
                        if let Some(p) = c.graph.node(w).weight() {
                            if let Some(wd) = weights.get(&p.name) {
                                mm_bytes += (wd.weight.bytes.len()
                                    + wd.scales.as_ref().map_or(0, |t| t.bytes.len())
                                    + wd.biases.as_ref().map_or(0, |t| t.bytes.len())) as u64;
                            }
                        }
                    }
                }
                rec["matmul_GB_s"] = json!(mm_bytes as f64 / mm_s.max(1e-12) / 1e9);
            }
            // one prefill of the prompt (where it is one step)
            m.reset();
            m.forward(&prompt, false, None)?;
            if let (Some(p), true) = (m.gpu_profile(), prompt.len() <= chunk) {
                let c = m.graph(GraphKey { tokens: prompt.len(), all_logits: false, sample: false, images: false })?;
                let (total, by_op) = ops_by_weight(c, &p);
                rec["gpu_prefill_profile_total_ms"] = json!(total * 1e3);
                rec["gpu_prefill_profile_by_op"] = json!(by_op);
            }
        }
        m.set_profile(Profile::Off);
    }
    Ok(rec)
}

/// Time per op of a profiled run (a timestamp after every dispatch), summed by op, weights'
/// format and weights without their layer index (a fused GEMV names each of its weights):
/// the total seconds and one `{op, ms, dispatches, share}` per label.
pub(crate) fn ops_by_weight(c: &Compiled, p: &ProfileResult) -> (f64, Vec<Value>) {
    ops_by_weight_kernels(c, p, None)
}

/// [`ops_by_weight`], each row with the names of the kernels its dispatches ran (`kernels`: the
/// kernel of each dispatch, in execution order, as the executor lists them).
pub(crate) fn ops_by_weight_kernels(c: &Compiled, p: &ProfileResult, kernels: Option<&[(petgraph::graph::NodeIndex, String)]>) -> (f64, Vec<Value>) {
    let mut by_op: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    let mut names: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let kernels = kernels.filter(|k| k.len() == p.dispatches.len());
    for (i, (n, s)) in p.dispatches.iter().enumerate() {
        let node = c.graph.node(*n);
        let mut label = node.op().map(|o| o.name().to_string()).unwrap_or_default();
        let ws: Vec<(String, String)> = c
            .graph
            .inputs(*n)
            .iter()
            .filter_map(|&i| match &c.graph.node(i).kind {
                NodeKind::Weight { weight } if weight.module => Some((weight.format.describe(), weight_role(&weight.name))),
                _ => None,
            })
            .collect();
        if let Some((fmt, _)) = ws.first() {
            let names: Vec<&str> = ws.iter().map(|w| w.1.as_str()).collect();
            label = format!("{label} [{fmt}] {}", names.join("+"));
        }
        if let Some(k) = kernels.and_then(|k| k.get(i)).filter(|k| k.0 == *n) {
            let v = names.entry(label.clone()).or_default();
            if !v.contains(&k.1) {
                v.push(k.1.clone());
            }
        }
        let e = by_op.entry(label).or_insert((0.0, 0));
        e.0 += s;
        e.1 += 1;
    }
    let total: f64 = p.dispatches.iter().map(|d| d.1).sum();
    let rows = by_op
        .iter()
        .map(|(k, (s, n))| {
            let mut row = json!({"op": k, "ms": s * 1e3, "dispatches": n, "share": s / total.max(1e-12)});
            if let Some(ks) = names.get(k) {
                row["kernels"] = json!(ks);
            }
            row
        })
        .collect();
    (total, rows)
}

/// Loads what `bench` runs: a checkpoint directory or a synthetic shape.
pub fn source(model: Option<&std::path::Path>, synthetic: Option<&str>) -> Result<(String, ModelConfig, Arc<Weights>), String> {
    match (model, synthetic) {
        (Some(dir), None) => {
            crate::model::check_dir(dir)?;
            let ck = crate::loader::Checkpoint::open(dir).map_err(|e| e.to_string())?;
            let g = ck.build(markbase_graph::BuildOptions::decode(64, 16)).map_err(|e| e.to_string())?;
            let (w, _) = ck.load_weights(&g).map_err(|e| e.to_string())?;
            Ok((dir.display().to_string(), ck.config().clone(), Arc::new(w)))
        }
        (None, Some(name)) => {
            let t = std::time::Instant::now();
            let (cfg, w) = crate::synthetic::model(name, QuantSpec::affine(4, 64))?;
            eprintln!("synthetic {name}: {:.2} GB of weights generated in {:.1}s", w.stored_bytes() as f64 / 1e9, t.elapsed().as_secs_f64());
            Ok((format!("synthetic:{name}"), cfg, Arc::new(w)))
        }
        _ => Err("give exactly one of -m DIR or --synthetic NAME".into()),
    }
}

/// One table row per record, then the profiles.
pub fn table(rows: &[Value]) -> String {
    let mut s = table_header();
    for r in rows {
        s.push_str(&table_row(r));
    }
    s + &profile_tables(rows)
}

/// The head of the results table.
pub fn table_header() -> String {
    "| model | device | prefill tok/s | decode tok/s (median [min, max]) | bytes/token | GB/s | of bandwidth | dispatches/step | submits/step | CPU encode µs/step |\n|---|---|---|---|---|---|---|---|---|---|\n".into()
}

/// A number of a record, or `-` where it has none.
fn num(r: &Value, key: &str, digits: usize) -> String {
    match r.get(key).and_then(|v| v.as_f64()) {
        Some(v) if v.is_finite() => format!("{v:.digits$}"),
        _ => "-".into(),
    }
}

/// One row of the results table.
pub fn table_row(r: &Value) -> String {
    if let Some(e) = r.get("error") {
        return format!("| {} | {} | error: {} |\n", r["model"].as_str().unwrap_or(""), r["device"].as_str().unwrap_or(""), e.as_str().unwrap_or(""));
    }
    let gbs = r.get("achieved_GB_s").and_then(|v| v.as_f64()).unwrap_or(0.0);
    let fraction = match r.get("fraction_of_bandwidth").and_then(|v| v.as_f64()) {
        Some(f) => format!("{:.1}%", 100.0 * f),
        None => "-".into(),
    };
    format!(
        "| {} | {} | {} | {} [{}, {}] | {:.3} GB | {} | {fraction} | {} | {} | {} |\n",
        r["model"].as_str().unwrap_or(""),
        short_device(r["device"].as_str().unwrap_or("")),
        num(r, "prefill_tok_s", 1),
        num(r, "decode_tok_s_median", 1),
        num(r, "decode_tok_s_min", 1),
        num(r, "decode_tok_s_max", 1),
        r.get("bytes_per_token").and_then(|v| v.as_f64()).unwrap_or(0.0) / 1e9,
        num(r, "achieved_GB_s", if gbs < 10.0 { 2 } else { 0 }),
        r.get("dispatches_per_step").map(|v| v.to_string()).unwrap_or("-".into()),
        r.get("submits_per_step").map(|v| v.to_string()).unwrap_or("-".into()),
        num(r, "cpu_encode_us_median", 0),
    )
}

/// With `--profile`: one decode step and one prefill by op, largest first.
pub fn profile_tables(rows: &[Value]) -> String {
    let mut s = String::new();
    for r in rows {
        for (key, what) in [("gpu_profile", "one decode step".to_string()), ("gpu_prefill_profile", format!("one prefill of {} tokens", r["prompt"]))] {
            let Some(ops) = r.get(format!("{key}_by_op").as_str()).and_then(|v| v.as_array()) else {
                continue;
            };
            let mut ops: Vec<&Value> = ops.iter().collect();
            ops.sort_by(|a, b| b["ms"].as_f64().unwrap_or(0.0).total_cmp(&a["ms"].as_f64().unwrap_or(0.0)));
            s.push_str(&format!(
                "\n{} on {}: {what}, a timestamp after every dispatch ({:.3} ms in all; the timestamps slow it)\n| op [weights] | ms | dispatches | share |\n|---|---|---|---|\n",
                r["model"].as_str().unwrap_or(""),
                short_device(r["device"].as_str().unwrap_or("")),
                r[format!("{key}_total_ms").as_str()].as_f64().unwrap_or(f64::NAN)
            ));
            for e in ops {
                s.push_str(&format!(
                    "| {} | {:.3} | {} | {:.1}% |\n",
                    e["op"].as_str().unwrap_or(""),
                    e["ms"].as_f64().unwrap_or(f64::NAN),
                    e["dispatches"],
                    100.0 * e["share"].as_f64().unwrap_or(f64::NAN)
                ));
            }
        }
    }
    s
}

/// An adapter's description cut to its name and backend ("gpu: llvmpipe (vulkan)"): `--backend
/// all` may find one adapter through several backends.
pub fn short_device(dev: &str) -> String {
    let name = dev.split(" (").next().unwrap_or(dev);
    match ["vulkan", "metal", "dx12", "gl"].iter().find(|b| dev.contains(&format!("({b},"))) {
        Some(b) => format!("{name} ({b})"),
        None => name.to_string(),
    }
}

/// A weight's name without its layer index ("model.layers.3.mlp.down_proj" -> "mlp.down_proj"),
/// so that the profile sums one projection over the layers.
fn weight_role(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    match parts.iter().position(|p| p.parse::<usize>().is_ok()) {
        Some(i) => parts[i + 1..].join("."),
        None => name.to_string(),
    }
}
