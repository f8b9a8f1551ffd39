//! The CPU reference executor: runs a compiled graph op by op in f32,
//! dequantizing weights, on the same graph the GPU runs. It is the oracle of
//! the kernel and model tests and the `cpu` backend of the benchmarks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use petgraph::graph::NodeIndex;

use markbase_graph::ir::{InputKind, NodeKind, StateKind};
use markbase_graph::ops::Op;
use markbase_graph::passes::Compiled;

use crate::cpu::{audio_ops, ops, vision_ops};
use crate::quant;
use crate::weights::Weights;

/// A value during execution.
#[derive(Clone, Debug)]
pub enum Val {
    F(Arc<Vec<f32>>),
    U(Arc<Vec<u32>>),
}

impl Val {
    pub fn f(&self) -> &[f32] {
        match self {
            Val::F(v) => v,
            Val::U(_) => panic!("expected an f32 value"),
        }
    }
    pub fn u(&self) -> &[u32] {
        match self {
            Val::U(v) => v,
            Val::F(_) => panic!("expected a u32 value"),
        }
    }
}

/// KV caches and other persistent state, shared by the prefill and decode graphs.
#[derive(Default)]
pub struct CpuState {
    pub caches: HashMap<StateKind, Vec<f32>>,
}

impl CpuState {
    pub fn clear(&mut self) {
        self.caches.clear();
    }
}

/// Dequantized weights, cached per name.
/// Clones share the cache of dequantized weights (the sessions of one engine hold one copy).
#[derive(Clone)]
pub struct CpuWeights {
    pub weights: Arc<Weights>,
    cache: Arc<Mutex<HashMap<String, Arc<Vec<f32>>>>>,
}

impl CpuWeights {
    pub fn new(weights: Arc<Weights>) -> Self {
        CpuWeights { weights, cache: Arc::default() }
    }

    fn full(&mut self, name: &str) -> Result<Arc<Vec<f32>>, String> {
        let mut cache = self.cache.lock().map_err(|_| "the dequantized weight cache is poisoned".to_string())?;
        if let Some(v) = cache.get(name) {
            return Ok(v.clone());
        }
        let w = self.weights.get(name).ok_or_else(|| format!("weight {name} not loaded"))?;
        let v = Arc::new(quant::dequantize(w)?);
        cache.insert(name.to_string(), v.clone());
        Ok(v)
    }

    fn rows(&self, name: &str, ids: &[u32], clamp: Option<u32>, d: usize) -> Result<Vec<f32>, String> {
        let w = self.weights.get(name).ok_or_else(|| format!("weight {name} not loaded"))?;
        let n_rows = w.param.shape[0];
        let mut out = vec![0f32; ids.len() * d];
        for (t, &id) in ids.iter().enumerate() {
            let id = match clamp {
                Some(c) if id >= c => 0,
                _ => id,
            } as usize;
            if id >= n_rows {
                return Err(format!("token id {id} out of range for {name} ({n_rows} rows)"));
            }
            quant::dequantize_rows(w, id..id + 1, &mut out[t * d..(t + 1) * d]);
        }
        Ok(out)
    }
}

/// Output values of one step, by output name.
pub type Outputs = HashMap<String, Val>;

/// Host-written inputs of one step.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepInputs<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    /// Sampling parameter words (graphs with `Op::Sample`).
    pub sampling: [u32; 8],
    /// Recent token ids for the repetition penalty.
    pub recent: &'a [u32],
    /// Image patches and their columns and rows (vision tower graphs).
    pub pixels: &'a [f32],
    pub patch_x: &'a [u32],
    pub patch_y: &'a [u32],
    /// Soft-token rows and, per token, the row it takes plus one (graphs built with them).
    pub soft_rows: &'a [f32],
    pub soft_index: &'a [u32],
    /// Per token, the last position it attends to (graphs with attention bounds, see
    /// `InputKind::AttnPositions`): its image span's last position, else its own.
    pub attend_until: &'a [u32],
    /// Log-mel features `[T, F]` and each frame's validity (audio tower graphs).
    pub features: &'a [f32],
    pub audio_valid: &'a [u32],
    /// The sequence slot of each row (graphs over a batch's caches).
    pub slot_ids: &'a [u32],
    /// Each row's sampling parameter words `[T, 8]` and recent ids `[T, R]` (a batch's
    /// decode graphs that sample).
    pub row_sampling: &'a [u32],
    pub row_recent: &'a [u32],
}

/// The attention bounds input of a step: the positions, then `attend_until`.
pub fn attn_positions(step: &StepInputs, n: usize) -> Result<Vec<u32>, String> {
    let (p, u) = (step.positions, step.attend_until);
    if p.len() * 2 != n || u.len() != p.len() {
        return Err(format!("attention bounds: {} positions and {} span ends given, the graph takes {n} values", p.len(), u.len()));
    }
    if let Some((t, _)) = p.iter().zip(u).enumerate().find(|(_, (a, b))| b < a) {
        return Err(format!("token {t} attends to no further than position {}, before its own {}", u[t], p[t]));
    }
    Ok(p.iter().chain(u).copied().collect())
}

/// Runs `c` once.
pub fn run(c: &Compiled, w: &mut CpuWeights, state: &mut CpuState, step: &StepInputs) -> Result<Outputs, String> {
    let (tokens, positions) = (step.tokens, step.positions);
    let g = &c.graph;
    let reads = |k: InputKind| g.g.node_indices().any(|n| matches!(g.node(n).kind, NodeKind::Input { input } if input == k));
    if (reads(InputKind::Tokens) && tokens.len() != g.tokens) || (reads(InputKind::Positions) && positions.len() != g.tokens) {
        return Err(format!("graph takes {} tokens, got {}", g.tokens, tokens.len()));
    }
    let mut vals: Vec<Option<Val>> = vec![None; g.g.node_count()];
    let get = |vals: &Vec<Option<Val>>, n: NodeIndex| vals[n.index()].clone().expect("value computed before use");
    for n in g.order() {
        let node = g.node(n);
        let v = match &node.kind {
            NodeKind::Input { input } => match input {
                InputKind::Tokens => Val::U(Arc::new(tokens.to_vec())),
                InputKind::Positions => Val::U(Arc::new(positions.to_vec())),
                InputKind::AttnPositions => Val::U(Arc::new(attn_positions(step, node.ty.numel())?)),
                InputKind::SamplingParams => Val::U(Arc::new(step.sampling.to_vec())),
                InputKind::RecentTokens => {
                    let mut r = step.recent.to_vec();
                    r.resize(node.ty.numel(), 0);
                    Val::U(Arc::new(r))
                }
                // the inputs taken as a step gives them
                _ => {
                    let n = node.ty.numel();
                    match input {
                        InputKind::SlotIds if step.slot_ids.len() == n => Val::U(Arc::new(step.slot_ids.to_vec())),
                        InputKind::RowSampling if step.row_sampling.len() == n => Val::U(Arc::new(step.row_sampling.to_vec())),
                        InputKind::RowRecent if step.row_recent.len() == n => Val::U(Arc::new(step.row_recent.to_vec())),
                        InputKind::AudioFeatures if step.features.len() == n => Val::F(Arc::new(step.features.to_vec())),
                        InputKind::AudioValid if step.audio_valid.len() == n => Val::U(Arc::new(step.audio_valid.to_vec())),
                        InputKind::Pixels if step.pixels.len() == n => Val::F(Arc::new(step.pixels.to_vec())),
                        InputKind::PatchX if step.patch_x.len() == n => Val::U(Arc::new(step.patch_x.to_vec())),
                        InputKind::PatchY if step.patch_y.len() == n => Val::U(Arc::new(step.patch_y.to_vec())),
                        InputKind::SoftRows if step.soft_rows.len() == n => Val::F(Arc::new(step.soft_rows.to_vec())),
                        InputKind::SoftIndex if step.soft_index.len() == n => Val::U(Arc::new(step.soft_index.to_vec())),
                        _ => return Err(format!("input {} takes {n} values ({}), the step has a different count", node.name, node.ty.describe())),
                    }
                }
            },
            NodeKind::Weight { weight } => {
                // Weights are fetched by their consumers (embedding rows or full matrices).
                let _ = weight;
                continue;
            }
            NodeKind::State { state: st } => {
                let len = node.ty.numel();
                let e = state.caches.entry(st.clone()).or_insert_with(|| vec![0.0; len]);
                if e.len() != len {
                    return Err(format!("state {:?} has {} elements, graph expects {len}", st, e.len()));
                }
                continue;
            }
            NodeKind::Op { op } => {
                let ins = g.inputs(n);
                let wname = |i: usize| g.node(ins[i]).weight().map(|p| p.name.clone());
                let mut out = vec![0f32; node.ty.numel()];
                match op {
                    Op::Embed { scale, clamp } => {
                        let ids = get(&vals, ins[0]);
                        let d = node.ty.shape[1];
                        let mut r = w.rows(&wname(1).unwrap(), ids.u(), *clamp, d)?;
                        r.iter_mut().for_each(|x| *x *= scale);
                        Val::F(Arc::new(r))
                    }
                    Op::MatMul => {
                        let x = get(&vals, ins[0]);
                        let wt = weight_or_value(g, w, &vals, ins[1])?;
                        let (k, nn) = (g.node(ins[1]).ty.shape[1], g.node(ins[1]).ty.shape[0]);
                        ops::matmul(x.f(), &wt, k, nn, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::GatherMatMul => {
                        let x = get(&vals, ins[0]);
                        let ids = get(&vals, ins[1]);
                        let wt = weight_or_value(g, w, &vals, ins[2])?;
                        let ws = &g.node(ins[2]).ty.shape;
                        let (e, nn, k) = (ws[0], ws[1], ws[2]);
                        let s = g.node(ins[1]).ty.shape[1];
                        let x_per_slot = g.node(ins[0]).ty.shape.len() == 3;
                        for (r, &id) in ids.u().iter().enumerate() {
                            let id = id as usize;
                            if id >= e {
                                return Err(format!("expert id {id} out of range ({e} experts)"));
                            }
                            let xr = if x_per_slot { &x.f()[r * k..(r + 1) * k] } else { &x.f()[(r / s) * k..(r / s + 1) * k] };
                            ops::matmul(xr, &wt[id * nn * k..(id + 1) * nn * k], k, nn, &mut out[r * nn..(r + 1) * nn]);
                        }
                        Val::F(Arc::new(out))
                    }
                    Op::MoeGroup { experts } => {
                        let ids = get(&vals, ins[0]);
                        Val::U(Arc::new(ops::moe_group(ids.u(), *experts)?))
                    }
                    Op::GroupedMatMul => {
                        let x = get(&vals, ins[0]);
                        let ids = get(&vals, ins[1]);
                        let wt = weight_or_value(g, w, &vals, ins[2])?;
                        let groups = get(&vals, ins[3]);
                        let ws = &g.node(ins[2]).ty.shape;
                        let s = g.node(ins[1]).ty.shape[1];
                        let x_bcast = g.node(ins[0]).ty.shape.len() == 2;
                        ops::grouped_matmul(x.f(), x_bcast, ids.u(), s, groups.u(), &wt, ws[1], ws[2], &mut out)
                            .map_err(|e| format!("node {}: {e}", node.name))?;
                        Val::F(Arc::new(out))
                    }
                    Op::RmsNorm { eps, scale } => Val::F(Arc::new(normed_input(g, w, &vals, n, op, *eps, *scale)?)),
                    Op::RmsNormAdd { eps, scale, scaled } => {
                        let mut out = normed_input(g, w, &vals, n, op, *eps, *scale)?;
                        out.iter_mut().zip(get(&vals, ins[1]).f()).for_each(|(o, r)| *o += r);
                        if *scaled {
                            let s = weight_or_value(g, w, &vals, ins[ins.len() - 1])?;
                            out.iter_mut().for_each(|o| *o *= s[0]);
                        }
                        Val::F(Arc::new(out))
                    }
                    Op::NormGeGlu { eps, scale } => {
                        let k = g.node(ins[0]).ty.last();
                        let xn = normed_input(g, w, &vals, n, op, *eps, *scale)?;
                        let (gi, ui) = (ins[ins.len() - 2], ins[ins.len() - 1]);
                        let n = g.node(gi).ty.shape[0];
                        let mut gate = vec![0f32; out.len()];
                        ops::matmul(&xn, &weight_or_value(g, w, &vals, gi)?, k, n, &mut gate);
                        ops::matmul(&xn, &weight_or_value(g, w, &vals, ui)?, k, n, &mut out);
                        out.iter_mut().zip(&gate).for_each(|(u, &gt)| *u *= ops::gelu(gt));
                        Val::F(Arc::new(out))
                    }
                    Op::NormMatMul { eps, scale } => {
                        let k = g.node(ins[0]).ty.last();
                        let xn = normed_input(g, w, &vals, n, op, *eps, *scale)?;
                        let first_w = op.norm_weight_input().map_or(1, |i| i + 1);
                        // each weight's columns side by side
                        let (rows, ncat) = (xn.len() / k.max(1), node.ty.last());
                        let mut col = 0;
                        for &wi in &ins[first_w..] {
                            let wt = weight_or_value(g, w, &vals, wi)?;
                            let nw = g.node(wi).ty.shape[0];
                            let mut part = vec![0f32; rows * nw];
                            ops::matmul(&xn, &wt, k, nw, &mut part);
                            for r in 0..rows {
                                out[r * ncat + col..r * ncat + col + nw].copy_from_slice(&part[r * nw..(r + 1) * nw]);
                            }
                            col += nw;
                        }
                        Val::F(Arc::new(out))
                    }
                    Op::Rope { theta, factor, rotary_pairs } => {
                        let x = get(&vals, ins[0]);
                        let p = get(&vals, ins[1]);
                        let s = &node.ty.shape;
                        ops::rope(x.f(), p.u(), s[1], s[2], *theta, *factor, *rotary_pairs, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::NormRope { eps, scale, theta, factor, rotary_pairs, heads } => {
                        let rope = (*theta, *factor, *rotary_pairs);
                        Val::F(Arc::new(norm_rope_heads(g, w, &vals, n, op.norm_weight_input(), *heads, *eps, *scale, rope)?))
                    }
                    Op::KvWrite { heads } => {
                        let xv = get(&vals, ins[0]);
                        let x = ops::head_range(xv.f(), &g.node(ins[0]).ty.shape, *heads);
                        let p = get(&vals, ins[1]);
                        let key = state_key(g, ins[2]);
                        let row = node.ty.shape[1] * node.ty.shape[2];
                        let cache = state.caches.get_mut(&key).ok_or("state missing")?;
                        ops::kv_write(&x, p.u(), row, cache);
                        // The value is the cache; readers fetch it from the state.
                        Val::F(Arc::new(vec![]))
                    }
                    Op::KvWriteBatched => {
                        let (x, p, sl) = (get(&vals, ins[0]), get(&vals, ins[1]), get(&vals, ins[2]));
                        let s = &node.ty.shape;
                        let cache = state.caches.get_mut(&state_key(g, ins[3])).ok_or("state missing")?;
                        ops::kv_write_batched(x.f(), p.u(), sl.u(), s[0], s[2] * s[3], cache);
                        Val::F(Arc::new(vec![]))
                    }
                    Op::AttentionBatched { scale, window } => {
                        let (q, p, sl) = (get(&vals, ins[0]), get(&vals, ins[1]), get(&vals, ins[2]));
                        let (nq, d) = (node.ty.shape[1], node.ty.shape[2]);
                        let cs = &g.node(ins[3]).ty.shape;
                        let (seqs, slots, nkv) = (cs[0], cs[1], cs[2]);
                        // positions, or attention bounds: the positions, then each row's last visible one
                        let t = sl.u().len();
                        let (pos, until) = if p.u().len() == 2 * t { p.u().split_at(t) } else { (p.u(), p.u()) };
                        let hi = |t: usize| pos[t].max(until[t]) as usize;
                        if let Some(t) = (0..t).find(|&t| window.is_none() && hi(t) >= slots && (sl.u()[t] as usize) < seqs) {
                            return Err(format!("position {} (row {t}) exceeds the KV cache of {slots} slots", hi(t)));
                        }
                        let k = state.caches.get(&state_key(g, ins[3])).ok_or("state missing")?;
                        let v = state.caches.get(&state_key(g, ins[4])).ok_or("state missing")?;
                        ops::attention_batched(q.f(), pos, until, sl.u(), k, v, seqs, nq, nkv, d, *scale, *window, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::ArgmaxRows => {
                        let l = get(&vals, ins[0]);
                        let v = g.node(ins[0]).ty.shape[1];
                        Val::U(Arc::new(l.f().chunks_exact(v).map(ops::argmax).collect()))
                    }
                    Op::SampleRows => {
                        let (l, p, r) = (get(&vals, ins[0]), get(&vals, ins[1]), get(&vals, ins[2]));
                        let v = g.node(ins[0]).ty.shape[1];
                        let rl = g.node(ins[2]).ty.shape[1];
                        let toks = l.f().chunks_exact(v).enumerate().map(|(t, row)| {
                            let mut pw = [0u32; 8];
                            pw.copy_from_slice(&p.u()[t * 8..t * 8 + 8]);
                            ops::sample(row, &pw, &r.u()[t * rl..(t + 1) * rl])
                        });
                        Val::U(Arc::new(toks.collect()))
                    }
                    Op::KvWriteNormRope { eps, scale, theta, factor, rotary_pairs, heads } => {
                        let p = get(&vals, ins[1]);
                        let s = &node.ty.shape;
                        let rope = (*theta, *factor, *rotary_pairs);
                        let rows = norm_rope_heads(g, w, &vals, n, op.norm_weight_input(), *heads, *eps, *scale, rope)?;
                        let cache = state.caches.get_mut(&state_key(g, ins[ins.len() - 1])).ok_or("state missing")?;
                        ops::kv_write(&rows, p.u(), s[1] * s[2], cache);
                        Val::F(Arc::new(vec![]))
                    }
                    Op::Attention { scale, window } | Op::NormRopeAttention { scale, window, .. } => {
                        let q = match op {
                            Op::NormRopeAttention { eps, norm, theta, factor, rotary_pairs, heads, .. } => {
                                let rope = (*theta, *factor, *rotary_pairs);
                                Val::F(Arc::new(norm_rope_heads(g, w, &vals, n, op.norm_weight_input(), *heads, *eps, *norm, rope)?))
                            }
                            _ => get(&vals, ins[0]).clone(),
                        };
                        let p = get(&vals, ins[1]);
                        let (nq, d) = (node.ty.shape[1], node.ty.shape[2]);
                        let nkv = g.node(ins[2]).ty.shape[1];
                        let slots = g.node(ins[2]).ty.shape[0];
                        for (t, &pp) in p.u().iter().enumerate() {
                            // (with attention bounds, the span ends too)
                            if matches!(window, None) && pp as usize >= slots {
                                return Err(format!("position {pp} (token {t}) exceeds the KV cache of {slots} slots"));
                            }
                        }
                        if let Op::NormRopeAttention { eps, norm, theta, factor, rotary_pairs, append: Some(a), .. } = op {
                            // the step's key (normed with its own weight, the input after q's, and
                            // rotated) and value into the caches
                            let wk = op.norm_weight_input().map(|i| i + 1);
                            let kr = norm_rope_heads(g, w, &vals, n, wk, Some(a.k), *eps, *norm, (*theta, *factor, *rotary_pairs))?;
                            ops::kv_write(&kr, p.u(), nkv * d, state.caches.get_mut(&state_key(g, ins[2])).ok_or("state missing")?);
                            let (x, xs) = (get(&vals, ins[0]), &g.node(ins[0]).ty.shape);
                            let vx = ops::head_range(x.f(), xs, Some(a.v));
                            ops::kv_write(&vx, p.u(), nkv * d, state.caches.get_mut(&state_key(g, ins[3])).ok_or("state missing")?);
                        }
                        let k = &state.caches[&state_key(g, ins[2])];
                        let v = &state.caches[&state_key(g, ins[3])];
                        let t = node.ty.shape[0];
                        let (pos, until) = p.u().split_at(t);
                        let until = if until.is_empty() { pos } else { until };
                        ops::attention(q.f(), pos, until, k, v, nq, nkv, d, *scale, *window, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::Binary { f } => {
                        let a = get(&vals, ins[0]);
                        let b = weight_or_value(g, w, &vals, ins[1])?;
                        ops::binary(*f, a.f(), &b, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::Unary { f } => {
                        let x = get(&vals, ins[0]);
                        ops::unary(*f, x.f(), &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::GeGlu => {
                        let a = get(&vals, ins[0]);
                        let b = get(&vals, ins[1]);
                        ops::geglu(a.f(), b.f(), &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::TopK { k } => {
                        let l = get(&vals, ins[0]);
                        let mut o = vec![0u32; node.ty.numel()];
                        ops::top_k(l.f(), g.node(ins[0]).ty.shape[1], *k, &mut o);
                        Val::U(Arc::new(o))
                    }
                    Op::TopKSoftmax => {
                        let l = get(&vals, ins[0]);
                        let ids = get(&vals, ins[1]);
                        let sc = if ins.len() > 2 { Some(weight_or_value(g, w, &vals, ins[2])?) } else { None };
                        let e = g.node(ins[0]).ty.shape[1];
                        ops::top_k_softmax(l.f(), e, ids.u(), node.ty.shape[1], sc.as_deref().map(|v| v.as_slice()), &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::WeightedSum => {
                        let x = get(&vals, ins[0]);
                        let wt = get(&vals, ins[1]);
                        let xs = &g.node(ins[0]).ty.shape;
                        ops::weighted_sum(x.f(), wt.f(), xs[1], xs[2], &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::Reshape { .. } => get(&vals, ins[0]),
                    Op::Slice { axis, start, len } => {
                        let x = get(&vals, ins[0]);
                        ops::slice(x.f(), &g.node(ins[0]).ty.shape, *axis, *start, *len, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::Sample => {
                        let l = get(&vals, ins[0]);
                        let v = g.node(ins[0]).ty.shape[1];
                        let last = &l.f()[l.f().len() - v..];
                        let p = get(&vals, ins[1]);
                        let r = get(&vals, ins[2]);
                        let mut pw = [0u32; 8];
                        pw.copy_from_slice(&p.u()[..8]);
                        Val::U(Arc::new(vec![ops::sample(last, &pw, r.u())]))
                    }
                    Op::Clamp => {
                        let x = get(&vals, ins[0]);
                        let lo = weight_or_value(g, w, &vals, ins[1])?;
                        let hi = weight_or_value(g, w, &vals, ins[2])?;
                        vision_ops::clamp(x.f(), lo[0], hi[0], &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::Rope2d { theta } => {
                        let x = get(&vals, ins[0]);
                        let (px, py) = (get(&vals, ins[1]), get(&vals, ins[2]));
                        let s = &node.ty.shape;
                        vision_ops::rope_2d(x.f(), px.u(), py.u(), s[1], s[2], *theta, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::FullAttention { scale } => {
                        let (q, k, v) = (get(&vals, ins[0]), get(&vals, ins[1]), get(&vals, ins[2]));
                        let valid = ins.get(3).map(|&m| get(&vals, m));
                        let (nq, d) = (node.ty.shape[1], node.ty.shape[2]);
                        let nkv = g.node(ins[1]).ty.shape[1];
                        vision_ops::full_attention(q.f(), k.f(), v.f(), valid.as_ref().map(|m| m.u()), nq, nkv, d, *scale, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::AvgPool { rows, cols, k } => {
                        let x = get(&vals, ins[0]);
                        vision_ops::avg_pool(x.f(), *rows, *cols, *k, node.ty.last(), &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::LayerNorm { eps } => {
                        let x = get(&vals, ins[0]);
                        let wt = weight_or_value(g, w, &vals, ins[1])?;
                        let b = ins.get(2).map(|&b| weight_or_value(g, w, &vals, b)).transpose()?;
                        vision_ops::layer_norm(x.f(), &wt, b.as_deref().map(|v| v.as_slice()), node.ty.last(), *eps, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::Scatter => {
                        let (x, rows, src) = (get(&vals, ins[0]), get(&vals, ins[1]), get(&vals, ins[2]));
                        vision_ops::scatter(x.f(), rows.f(), src.u(), node.ty.last(), &mut out).map_err(|e| format!("node {}: {e}", node.name))?;
                        Val::F(Arc::new(out))
                    }
                    Op::Argmax => {
                        let l = get(&vals, ins[0]);
                        let v = g.node(ins[0]).ty.shape[1];
                        let last = &l.f()[l.f().len() - v..];
                        Val::U(Arc::new(vec![ops::argmax(last)]))
                    }
                    Op::Conv2d { stride, pad, time_pad } => {
                        let x = get(&vals, ins[0]);
                        let wt = weight_or_value(g, w, &vals, ins[1])?;
                        let (xs, ws) = (&g.node(ins[0]).ty.shape, &g.node(ins[1]).ty.shape);
                        audio_ops::conv2d(x.f(), (xs[0], xs[1], xs[2]), &wt, (ws[0], ws[1], ws[2]), *stride, *pad, *time_pad, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::CumulativeGroupNorm { eps } => {
                        let x = get(&vals, ins[0]);
                        let wt = weight_or_value(g, w, &vals, ins[1])?;
                        audio_ops::cumulative_group_norm(x.f(), node.ty.numel() / node.ty.shape[0], &wt, *eps, &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::MaskRows => {
                        let (x, valid) = (get(&vals, ins[0]), get(&vals, ins[1]));
                        audio_ops::mask_rows(x.f(), valid.u(), node.ty.numel() / node.ty.shape[0], &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::StridedRows { stride } => {
                        let xs = &g.node(ins[0]).ty;
                        let row = xs.numel() / xs.shape[0];
                        match get(&vals, ins[0]) {
                            Val::F(x) => Val::F(Arc::new(audio_ops::strided_rows(&x, row, *stride))),
                            Val::U(x) => Val::U(Arc::new(audio_ops::strided_rows(&x, row, *stride))),
                        }
                    }
                    Op::Glu => {
                        let x = get(&vals, ins[0]);
                        audio_ops::glu(x.f(), node.ty.last(), &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::DepthwiseConv1d => {
                        let x = get(&vals, ins[0]);
                        let wt = weight_or_value(g, w, &vals, ins[1])?;
                        audio_ops::depthwise_conv1d(x.f(), node.ty.last(), &wt, g.node(ins[1]).ty.shape[1], &mut out);
                        Val::F(Arc::new(out))
                    }
                    Op::AudioAttention { window, softcap, key_scale } => {
                        let (q, k, v, valid) = (get(&vals, ins[0]), get(&vals, ins[1]), get(&vals, ins[2]), get(&vals, ins[3]));
                        let pds = weight_or_value(g, w, &vals, ins[4])?;
                        let rel = weight_or_value(g, w, &vals, ins[5])?;
                        let (heads, d) = (node.ty.shape[1], node.ty.shape[2]);
                        audio_ops::audio_attention(q.f(), k.f(), v.f(), valid.u(), &pds, &rel, heads, d, *window, *softcap, *key_scale, &mut out);
                        Val::F(Arc::new(out))
                    }
                }
            }
        };
        vals[n.index()] = Some(v);
    }
    let mut outs = HashMap::new();
    for (name, n) in &g.outputs {
        outs.insert(name.clone(), vals[n.index()].clone().ok_or("output not computed")?);
    }
    Ok(outs)
}

fn state_key(g: &markbase_graph::Graph, n: NodeIndex) -> StateKind {
    let root = g.storage_root(n);
    match &g.node(root).kind {
        NodeKind::State { state } => state.clone(),
        _ => panic!("attention/kv_write input is not a state"),
    }
}

/// An operand that is either a weight (dequantized) or a computed value.
/// The first input of norm or fused-norm node `n` (op `op`), RMS-normed over its last dim
/// with the op's norm weight, if it has one.
fn normed_input(
    g: &markbase_graph::Graph,
    w: &mut CpuWeights,
    vals: &[Option<Val>],
    n: NodeIndex,
    op: &Op,
    eps: f32,
    scale: markbase_graph::ops::NormScale,
) -> Result<Vec<f32>, String> {
    let ins = g.inputs(n);
    let wt = match op.norm_weight_input() {
        Some(i) => Some(weight_or_value(g, w, vals, ins[i])?),
        None => None,
    };
    let x = vals[ins[0].index()].as_ref().ok_or("norm input not computed")?;
    let Val::F(x) = x else { return Err(format!("norm input of {} is not f32", g.node(n).name)) };
    let mut out = vec![0f32; x.len()];
    ops::rms_norm(x, wt.as_deref().map(|v| v.as_slice()), g.node(ins[0]).ty.last(), eps, scale, &mut out);
    Ok(out)
}

/// `rope(rms_norm(x))` per head row of node `n`'s first input `x: [T, H, D]` (heads `heads` of
/// it when given; positions its second input), normed with the weight at input `w_in` (none
/// without): the q/k norm and RoPE of `NormRope`, `KvWriteNormRope` and `NormRopeAttention`
/// (its queries and the key it appends).
#[allow(clippy::too_many_arguments)]
fn norm_rope_heads(
    g: &markbase_graph::Graph,
    w: &mut CpuWeights,
    vals: &[Option<Val>],
    n: NodeIndex,
    w_in: Option<usize>,
    heads: Option<markbase_graph::ops::HeadRange>,
    eps: f32,
    scale: markbase_graph::ops::NormScale,
    (theta, factor, pairs): (f32, f32, usize),
) -> Result<Vec<f32>, String> {
    let ins = g.inputs(n);
    let wt = w_in.map(|i| weight_or_value(g, w, vals, ins[i])).transpose()?;
    let (Some(Val::F(x)), Some(Val::U(pos))) = (&vals[ins[0].index()], &vals[ins[1].index()]) else {
        return Err(format!("inputs of {} not computed as f32 rows and u32 positions", g.node(n).name));
    };
    let shape = &g.node(ins[0]).ty.shape;
    // the positions (the first row of attention bounds)
    let pos = &pos[..shape[0]];
    let (h, d) = (heads.map_or(shape[1], |r| r.count), shape[2]);
    let rows = ops::head_range(x, shape, heads);
    let mut xn = vec![0f32; rows.len()];
    ops::rms_norm(&rows, wt.as_deref().map(|v| v.as_slice()), d, eps, scale, &mut xn);
    let mut out = vec![0f32; xn.len()];
    ops::rope(&xn, pos, h, d, theta, factor, pairs, &mut out);
    Ok(out)
}

fn weight_or_value(
    g: &markbase_graph::Graph,
    w: &mut CpuWeights,
    vals: &[Option<Val>],
    n: NodeIndex,
) -> Result<Arc<Vec<f32>>, String> {
    match g.node(n).weight() {
        Some(p) => w.full(&p.name),
        None => match vals[n.index()].clone() {
            Some(Val::F(v)) => Ok(v),
            _ => Err(format!("operand {} is not an f32 value", g.node(n).name)),
        },
    }
}
