//! The CPU lowering of every op: plain f32 math on slices. It is the oracle
//! for the WGSL kernels and the body of the CPU reference executor.

use markbase_graph::ops::{BinaryOp, HeadRange, NormScale, UnaryOp};

/// GELU, tanh approximation, with the tanh argument clamped (see the numerics notes).
pub fn gelu(x: f32) -> f32 {
    let c = (2.0f32 / std::f32::consts::PI).sqrt();
    let u = (c * (x + 0.044715 * x * x * x)).clamp(-15.0, 15.0);
    0.5 * x * (1.0 + u.tanh())
}

/// `cap * tanh(x / cap)`.
pub fn softcap(x: f32, cap: f32) -> f32 {
    cap * (x / cap).clamp(-15.0, 15.0).tanh()
}

pub fn unary(f: UnaryOp, x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = match f {
            UnaryOp::Scale { factor } => v * factor,
            UnaryOp::Gelu => gelu(v),
            UnaryOp::Softcap { cap } => softcap(v, cap),
            UnaryOp::Relu => v.max(0.0),
            UnaryOp::Silu => v / (1.0 + (-v).exp()),
        };
    }
}

/// `a (op) b`, `b` broadcast over `a`'s leading dims (or a single element).
pub fn binary(f: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]) {
    let n = b.len().max(1);
    for (i, (o, &x)) in out.iter_mut().zip(a).enumerate() {
        let y = b[i % n];
        *o = match f {
            BinaryOp::Add => x + y,
            BinaryOp::Mul => x * y,
        };
    }
}

/// RMSNorm over rows of length `d`: `x / sqrt(mean(x^2) + eps)` times the scale.
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, d: usize, eps: f32, scale: NormScale, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f64 = xr.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let r = 1.0 / ((ss / d as f64) as f32 + eps).sqrt();
        for j in 0..d {
            let s = match (scale, w) {
                (NormScale::OnePlusW, Some(w)) => 1.0 + w[j],
                (NormScale::W, Some(w)) => w[j],
                _ => 1.0,
            };
            or[j] = xr[j] * r * s;
        }
    }
}

/// Inverse frequency of pair `i` of a head of dim `d`.
pub fn rope_inv_freq(theta: f32, factor: f32, d: usize, i: usize) -> f32 {
    let e = -2.0 * i as f64 / d as f64;
    ((theta as f64).powf(e) / factor as f64) as f32
}

/// Half-split RoPE on `x[T, heads, d]` in place-free form.
pub fn rope(x: &[f32], pos: &[u32], heads: usize, d: usize, theta: f32, factor: f32, pairs: usize, out: &mut [f32]) {
    out.copy_from_slice(x);
    let half = d / 2;
    for (t, &p) in pos.iter().enumerate() {
        for i in 0..pairs {
            let ang = p as f64 * rope_inv_freq(theta, factor, d, i) as f64;
            let (s, c) = (ang.sin() as f32, ang.cos() as f32);
            for h in 0..heads {
                let base = (t * heads + h) * d;
                let (a, b) = (x[base + i], x[base + i + half]);
                out[base + i] = a * c - b * s;
                out[base + i + half] = b * c + a * s;
            }
        }
    }
}

/// Writes rows of `x[T, row]` into `cache[S, row]` at slots `pos % S`.
/// Heads `r.start..r.start + r.count` of `x: [T, H, D]` (`shape`), or all of x without a range.
pub fn head_range<'a>(x: &'a [f32], shape: &[usize], r: Option<HeadRange>) -> std::borrow::Cow<'a, [f32]> {
    let Some(r) = r else { return std::borrow::Cow::Borrowed(x) };
    let (h, d) = (shape[1], shape[2]);
    let mut out = Vec::with_capacity(shape[0] * r.count * d);
    for t in 0..shape[0] {
        out.extend_from_slice(&x[(t * h + r.start) * d..(t * h + r.start + r.count) * d]);
    }
    std::borrow::Cow::Owned(out)
}

pub fn kv_write(x: &[f32], pos: &[u32], row: usize, cache: &mut [f32]) {
    let slots = cache.len() / row;
    for (t, &p) in pos.iter().enumerate() {
        let s = p as usize % slots;
        cache[s * row..(s + 1) * row].copy_from_slice(&x[t * row..(t + 1) * row]);
    }
}

/// Writes rows of `x[T, row]` into the batch cache `cache[N, S, row]`: row `t` at position
/// slot `pos[t] % S` of sequence slot `slot[t]`; rows with `slot[t] >= N` are skipped.
pub fn kv_write_batched(x: &[f32], pos: &[u32], slot: &[u32], seqs: usize, row: usize, cache: &mut [f32]) {
    let per = cache.len() / seqs.max(1);
    for (t, (&p, &s)) in pos.iter().zip(slot).enumerate() {
        if (s as usize) < seqs {
            kv_write(&x[t * row..(t + 1) * row], &[p], row, &mut cache[s as usize * per..(s as usize + 1) * per]);
        }
    }
}

/// [`attention`] of each row of `q[T, nq, d]` over its own sequence slot `slot[t]` of the
/// batch caches `k, v[N, S, nkv, d]` (rows with `slot[t] >= N`: zeros); `until`: each row's
/// last visible position where image spans attend to themselves (else `pos`).
#[allow(clippy::too_many_arguments)]
pub fn attention_batched(q: &[f32], pos: &[u32], until: &[u32], slot: &[u32], k: &[f32], v: &[f32], seqs: usize, nq: usize, nkv: usize, d: usize, scale: f32, window: Option<usize>, out: &mut [f32]) {
    let per = k.len() / seqs.max(1);
    let qrow = nq * d;
    for (t, ((&p, &u), &s)) in pos.iter().zip(until).zip(slot).enumerate() {
        let o = &mut out[t * qrow..(t + 1) * qrow];
        let s = s as usize;
        if s >= seqs {
            o.fill(0.0);
            continue;
        }
        let (ks, vs) = (&k[s * per..(s + 1) * per], &v[s * per..(s + 1) * per]);
        attention(&q[t * qrow..(t + 1) * qrow], &[p], &[u], ks, vs, nq, nkv, d, scale, window, o);
    }
}

/// Attention of `q[T, nq, d]` over caches `k, v[S, nkv, d]` holding absolute
/// positions at slot `j % S`. Query `t` sees `j <= max(pos[t], until[t])` and, with a
/// window, `j > pos[t] - window` (`until`: the last position of the query's image span).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    pos: &[u32],
    until: &[u32],
    k: &[f32],
    v: &[f32],
    nq: usize,
    nkv: usize,
    d: usize,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) {
    let slots = k.len() / (nkv * d);
    let group = nq / nkv;
    for (t, (&p, &hi)) in pos.iter().zip(until).enumerate() {
        let (p, hi) = (p as usize, (hi as usize).max(p as usize));
        let lo = match window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        };
        let n = hi + 1 - lo;
        let mut sc = vec![0f32; n];
        for h in 0..nq {
            let kh = h / group;
            let qv = &q[(t * nq + h) * d..(t * nq + h + 1) * d];
            let mut mx = f32::NEG_INFINITY;
            for (jj, s) in sc.iter_mut().enumerate() {
                let slot = (lo + jj) % slots;
                let kv = &k[(slot * nkv + kh) * d..(slot * nkv + kh + 1) * d];
                let dot: f32 = qv.iter().zip(kv).map(|(a, b)| a * b).sum();
                *s = dot * scale;
                mx = mx.max(*s);
            }
            let mut sum = 0f32;
            for s in sc.iter_mut() {
                *s = (*s - mx).exp();
                sum += *s;
            }
            let o = &mut out[(t * nq + h) * d..(t * nq + h + 1) * d];
            o.fill(0.0);
            for (jj, s) in sc.iter().enumerate() {
                let slot = (lo + jj) % slots;
                let vv = &v[(slot * nkv + kh) * d..(slot * nkv + kh + 1) * d];
                let wgt = s / sum;
                for (oo, &x) in o.iter_mut().zip(vv) {
                    *oo += wgt * x;
                }
            }
        }
    }
}

/// `gelu(gate) * up`.
pub fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu(g) * u;
    }
}

/// Dot product with 8 independent f32 accumulators (vectorizes; a fixed order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `x[rows, k] @ w[n, k]^T` with `w` already dequantized. Parallel over output
/// columns in blocks (each weight row is read once per block of input rows).
pub fn matmul(x: &[f32], w: &[f32], k: usize, n: usize, out: &mut [f32]) {
    use rayon::prelude::*;
    let rows = x.len() / k.max(1);
    if rows * n * k < 1 << 16 {
        for (xr, or) in x.chunks_exact(k).zip(out.chunks_exact_mut(n)) {
            for (j, o) in or.iter_mut().enumerate() {
                *o = dot(xr, &w[j * k..(j + 1) * k]);
            }
        }
        return;
    }
    const CB: usize = 64;
    let cols: Vec<Vec<f32>> = (0..n.div_ceil(CB))
        .into_par_iter()
        .map(|cb| {
            let j0 = cb * CB;
            let j1 = (j0 + CB).min(n);
            let mut part = vec![0f32; rows * (j1 - j0)];
            for r in 0..rows {
                let xr = &x[r * k..(r + 1) * k];
                for j in j0..j1 {
                    part[r * (j1 - j0) + (j - j0)] = dot(xr, &w[j * k..(j + 1) * k]);
                }
            }
            part
        })
        .collect();
    for (cb, part) in cols.iter().enumerate() {
        let j0 = cb * CB;
        let w_ = part.len() / rows.max(1);
        for r in 0..rows {
            out[r * n + j0..r * n + j0 + w_].copy_from_slice(&part[r * w_..(r + 1) * w_]);
        }
    }
}

/// Groups the (token, expert) pairs `p = t*S + s` of `ids` by expert (the layout of
/// `Op::MoeGroup`): `experts + 1` offsets, then the pair indices of each expert in
/// increasing order.
pub fn moe_group(ids: &[u32], experts: usize) -> Result<Vec<u32>, String> {
    let mut counts = vec![0u32; experts];
    for (p, &e) in ids.iter().enumerate() {
        let c = counts.get_mut(e as usize).ok_or_else(|| format!("pair {p}: expert id {e} out of range ({experts} experts)"))?;
        *c += 1;
    }
    let mut out = vec![0u32; experts + 1 + ids.len()];
    for e in 0..experts {
        out[e + 1] = out[e] + counts[e];
    }
    let mut next = out[..experts].to_vec();
    for (p, &e) in ids.iter().enumerate() {
        let slot = &mut next[e as usize];
        out[experts + 1 + *slot as usize] = p as u32;
        *slot += 1;
    }
    Ok(out)
}

/// `Op::GroupedMatMul`: for each expert `e` of `groups` (see [`moe_group`]), the x rows of
/// its pairs times `w[e]` (`[n, k]`, dequantized), written to the pairs' rows of `out`
/// (`[T*S, n]`). `s`: experts per token; `x_bcast`: x is `[T, k]` (pair `p` reads row
/// `p / s`), else `[T*S, k]`. Checks that `groups` lists every pair once, under the
/// expert `ids` gives it.
#[allow(clippy::too_many_arguments)]
pub fn grouped_matmul(
    x: &[f32],
    x_bcast: bool,
    ids: &[u32],
    s: usize,
    groups: &[u32],
    w: &[f32],
    n: usize,
    k: usize,
    out: &mut [f32],
) -> Result<(), String> {
    let np = ids.len();
    let experts = groups.len().checked_sub(np + 1).ok_or_else(|| format!("groups of {} words for {np} pairs", groups.len()))?;
    if w.len() != experts * n * k || out.len() != np * n || s == 0 || x.len() != if x_bcast { np / s * k } else { np * k } {
        return Err(format!("grouped matmul: {experts} experts, w {} x {} out {} for {np} pairs, n {n} k {k}", w.len(), x.len(), out.len()));
    }
    let (offsets, order) = groups.split_at(experts + 1);
    if offsets[experts] as usize != np {
        return Err(format!("groups cover {} of {np} pairs", offsets[experts]));
    }
    let mut seen = vec![false; np];
    for e in 0..experts {
        let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
        if a > b || b > np {
            return Err(format!("expert {e}: group offsets {a}..{b} of {np}"));
        }
        let pairs = &order[a..b];
        if pairs.is_empty() {
            continue;
        }
        let mut xe = Vec::with_capacity(pairs.len() * k);
        for &p in pairs {
            let p = p as usize;
            if p >= np || seen[p] || ids[p] as usize != e {
                return Err(format!("expert {e}: pair {p} does not belong to its group"));
            }
            seen[p] = true;
            let r = if x_bcast { p / s } else { p };
            xe.extend_from_slice(&x[r * k..(r + 1) * k]);
        }
        let mut ye = vec![0f32; pairs.len() * n];
        matmul(&xe, &w[e * n * k..(e + 1) * n * k], k, n, &mut ye);
        for (i, &p) in pairs.iter().enumerate() {
            let p = p as usize;
            out[p * n..(p + 1) * n].copy_from_slice(&ye[i * n..(i + 1) * n]);
        }
    }
    Ok(())
}

/// Indices of the `k` largest entries of each row (ties: lower index first).
pub fn top_k(logits: &[f32], e: usize, k: usize, out: &mut [u32]) {
    for (lr, or) in logits.chunks_exact(e).zip(out.chunks_exact_mut(k)) {
        let mut idx: Vec<u32> = (0..e as u32).collect();
        idx.sort_by(|&a, &b| lr[b as usize].total_cmp(&lr[a as usize]).then(a.cmp(&b)));
        or.copy_from_slice(&idx[..k]);
    }
}

/// Softmax over the selected logits, times `scale[id]` when given.
pub fn top_k_softmax(logits: &[f32], e: usize, ids: &[u32], k: usize, scale: Option<&[f32]>, out: &mut [f32]) {
    for ((lr, ir), or) in logits.chunks_exact(e).zip(ids.chunks_exact(k)).zip(out.chunks_exact_mut(k)) {
        let mx = ir.iter().map(|&i| lr[i as usize]).fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = ir.iter().map(|&i| (lr[i as usize] - mx).exp()).sum();
        for (o, &i) in or.iter_mut().zip(ir) {
            *o = (lr[i as usize] - mx).exp() / sum * scale.map_or(1.0, |s| s[i as usize]);
        }
    }
}

/// `out[t, :] = sum_s w[t, s] * x[t, s, :]`.
pub fn weighted_sum(x: &[f32], w: &[f32], s: usize, d: usize, out: &mut [f32]) {
    for (t, or) in out.chunks_exact_mut(d).enumerate() {
        or.fill(0.0);
        for j in 0..s {
            let wt = w[t * s + j];
            let xr = &x[(t * s + j) * d..(t * s + j + 1) * d];
            for (o, &v) in or.iter_mut().zip(xr) {
                *o += wt * v;
            }
        }
    }
}

/// Argmax of a row (ties: lowest index).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Copies a slice of `x` along `axis` (shape `shape`).
pub fn slice(x: &[f32], shape: &[usize], axis: usize, start: usize, len: usize, out: &mut [f32]) {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let n = shape[axis];
    for o in 0..outer {
        let src = &x[(o * n + start) * inner..(o * n + start + len) * inner];
        out[o * len * inner..(o + 1) * len * inner].copy_from_slice(src);
    }
}

/// 32-bit integer hash (PCG output permutation); the device uses the same one.
pub fn pcg_hash(x: u32) -> u32 {
    let state = x.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277_803_737);
    (word >> 22) ^ word
}

/// Uniform in `[0, 1)` for a (seed, step) pair; 24 random bits.
pub fn uniform(seed: u32, step: u32) -> f32 {
    let h = pcg_hash(seed ^ pcg_hash(step.wrapping_add(0x9e37_79b9)));
    (h >> 8) as f32 / (1u32 << 24) as f32
}

/// Sampling parameters as the device reads them (`Op::Sample`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: u32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off.
    pub repetition_penalty: f32,
    pub seed: u32,
}

impl Default for SampleParams {
    fn default() -> Self {
        SampleParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, seed: 0 }
    }
}

impl SampleParams {
    /// Checks every parameter's range: temperature finite and >= 0, top_p in (0, 1],
    /// min_p in [0, 1], repetition penalty finite and > 0 (top_k, unsigned, is always valid).
    pub fn validate(&self) -> Result<(), String> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(format!("temperature must be a finite number >= 0 (0 = greedy), got {t}"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p must be in (0, 1] (1 = off), got {}", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(format!("min-p must be in [0, 1] (0 = off), got {}", self.min_p));
        }
        let r = self.repetition_penalty;
        if !r.is_finite() || r <= 0.0 {
            return Err(format!("repetition penalty must be a finite number > 0 (1 = off), got {r}"));
        }
        Ok(())
    }

    /// Whether the pick is the plain argmax of the logits (temperature 0, no penalty).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.repetition_penalty == 1.0
    }

    /// The `u32[8]` parameter block for a step.
    pub fn words(&self, step: u32, n_recent: u32) -> [u32; 8] {
        [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.repetition_penalty.to_bits(),
            self.seed,
            step,
            n_recent,
        ]
    }
}

/// Samples from one row of logits, as `Op::Sample` defines it:
/// repetition penalty on the recent ids (once per distinct id: `l < 0 ? l*p : l/p`),
/// greedy at temperature 0, else `z = l/T` restricted to the tokens that pass
/// every enabled filter (top-k by value, ties kept; min-p: `z >= max + ln(min_p)`;
/// top-p: the smallest value threshold whose kept mass reaches `top_p`), then the
/// inverse-CDF pick at `uniform(seed, step)` in index order.
pub fn sample(logits: &[f32], params: &[u32; 8], recent: &[u32]) -> u32 {
    let d = match sample_distribution(logits, params, recent) {
        SampleDistribution::Greedy(t) => return t,
        SampleDistribution::Kept(d) => d,
    };
    let u = uniform(params[5], params[6]) as f64 * d.kept_mass();
    let mut acc = 0f64;
    let mut last = 0u32;
    for (i, &v) in d.z.iter().enumerate() {
        if v >= d.threshold {
            acc += d.weight(v);
            last = i as u32;
            if acc > u {
                return i as u32;
            }
        }
    }
    last
}

/// What `Op::Sample` draws from: the greedy token at temperature 0, else the
/// scaled logits and the value threshold of the enabled filters.
pub enum SampleDistribution {
    Greedy(u32),
    Kept(KeptTokens),
}

/// `z = l / T` (penalized logits), its max `m`, and the threshold a token's `z` must reach.
pub struct KeptTokens {
    pub z: Vec<f32>,
    pub m: f32,
    pub threshold: f32,
}

impl KeptTokens {
    /// Unnormalized probability of a kept value.
    pub fn weight(&self, v: f32) -> f64 {
        ((v - self.m) as f64).exp()
    }
    /// Total weight of the kept tokens.
    pub fn kept_mass(&self) -> f64 {
        self.z.iter().filter(|&&v| v >= self.threshold).map(|&v| self.weight(v)).sum()
    }
}

/// Repetition penalty, temperature and the top-k / min-p / top-p threshold of `Op::Sample`.
pub fn sample_distribution(logits: &[f32], params: &[u32; 8], recent: &[u32]) -> SampleDistribution {
    let f = f32::from_bits;
    let (temp, top_k, top_p, min_p, pen) = (f(params[0]), params[1], f(params[2]), f(params[3]), f(params[4]));
    let n_recent = params[7] as usize;
    let mut l = logits.to_vec();
    if pen != 1.0 && pen > 0.0 {
        let mut ids: Vec<u32> = recent[..n_recent.min(recent.len())].to_vec();
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            if let Some(v) = l.get_mut(id as usize) {
                *v = if *v < 0.0 { *v * pen } else { *v / pen };
            }
        }
    }
    if temp <= 0.0 {
        return SampleDistribution::Greedy(argmax(&l));
    }
    let z: Vec<f32> = l.iter().map(|v| v / temp).collect();
    let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut threshold = f32::NEG_INFINITY;
    let top_k_on = top_k > 0 && (top_k as usize) < z.len();
    if top_k_on || top_p < 1.0 {
        let mut sorted = z.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if top_k_on {
            threshold = threshold.max(sorted[top_k as usize - 1]);
        }
        if top_p < 1.0 {
            let total: f64 = sorted.iter().map(|&v| ((v - m) as f64).exp()).sum();
            let mut acc = 0f64;
            for &v in &sorted {
                acc += ((v - m) as f64).exp();
                if acc >= top_p as f64 * total {
                    threshold = threshold.max(v);
                    break;
                }
            }
        }
    }
    if min_p > 0.0 {
        threshold = threshold.max(m + min_p.ln());
    }
    SampleDistribution::Kept(KeptTokens { z, m, threshold })
}
