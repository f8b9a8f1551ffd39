//! The fusion pass: rewrites patterns of primitive ops, as the model builders emit them, into
//! the fused ops the kernels implement. Every rule has a switch ([`FuseOptions`]); with every
//! rule off the graph is left as built, which is the graph to bisect numerical bugs with.
//! Each fused node records the rule that produced it ([`crate::ir::Node::rule`]), and dumps
//! show it.
//!
//! The rules run in a fixed order, each over the whole graph:
//! 1. `norm_rope`: `rope(rms_norm(x))` → [`Op::NormRope`] (the q/k norms and their RoPE).
//! 2. `gelu_mul`: `gelu(a) * b` → [`Op::GeGlu`] (a GeGLU's activation and product).
//! 3. `norm_add`: `res + rms_norm(x)` (the norm the second operand, as builders add a
//!    block's output to the residual) → [`Op::RmsNormAdd`], and that sum times a scalar
//!    weight → the scaled variant (Gemma 4's layer scalar).
//! 4. `norm_matmul` (one-token graphs): a norm read only by matmuls → [`Op::NormMatMul`]; the
//!    q/k/v projections of one norm, each read as heads, become one `NormMatMul` over all
//!    their weights whose consumers take head ranges of it.
//! 5. `kv_write` (one-token graphs): a cache write of a normed (and rotated) value →
//!    [`Op::KvWriteNormRope`].
//! 6. `attention_rope` (one-token graphs): attention over a normed, rotated query →
//!    [`Op::NormRopeAttention`] (the query's norm and RoPE done by the attention pass).
//! 7. `geglu` (one-token graphs): `gelu(norm_matmul(x, wg)) * norm_matmul(x, wu)` with both
//!    weights stored alike → [`Op::NormGeGlu`].
//! 8. `kv_append` (one-token graphs): a `NormRopeAttention` whose caches are written, from
//!    the same fused projection, by a k write with the query's norm and RoPE and a plain v
//!    write, each cache read by that attention alone → the attention appending the step's
//!    key and value itself ([`KvAppend`]).
//!
//! Rules 4–8 are for one-token graphs: the fused kernels they target are GEMV-shaped.
//! Unused nodes are removed at the end; the order of the remaining ops is kept (a fused node
//! takes the place of the pattern's first or last op, whichever its inputs allow).

use crate::ir::{BuildError, Graph, InputKind, Node, NodeKind};
use crate::ops::{BinaryOp, HeadRange, KvAppend, NormScale, Op, UnaryOp};

/// The rules, in the order they run.
pub const RULES: [&str; 8] = ["norm_rope", "gelu_mul", "norm_add", "norm_matmul", "kv_write", "attention_rope", "geglu", "kv_append"];

/// Switches of the fusion rules (all on by default).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FuseOptions {
    pub norm_rope: bool,
    pub gelu_mul: bool,
    pub norm_add: bool,
    pub norm_matmul: bool,
    pub kv_write: bool,
    pub attention_rope: bool,
    pub geglu: bool,
    pub kv_append: bool,
}

impl Default for FuseOptions {
    fn default() -> Self {
        FuseOptions::all()
    }
}

impl FuseOptions {
    pub fn all() -> Self {
        FuseOptions {
            norm_rope: true,
            gelu_mul: true,
            norm_add: true,
            norm_matmul: true,
            kv_write: true,
            attention_rope: true,
            geglu: true,
            kv_append: true,
        }
    }

    /// Every rule off: the graph as the builder emits it.
    pub fn none() -> Self {
        FuseOptions {
            norm_rope: false,
            gelu_mul: false,
            norm_add: false,
            norm_matmul: false,
            kv_write: false,
            attention_rope: false,
            geglu: false,
            kv_append: false,
        }
    }

    fn flag(&mut self, rule: &str) -> Option<&mut bool> {
        Some(match rule {
            "norm_rope" => &mut self.norm_rope,
            "gelu_mul" => &mut self.gelu_mul,
            "norm_add" => &mut self.norm_add,
            "norm_matmul" => &mut self.norm_matmul,
            "kv_write" => &mut self.kv_write,
            "attention_rope" => &mut self.attention_rope,
            "geglu" => &mut self.geglu,
            "kv_append" => &mut self.kv_append,
            _ => return None,
        })
    }

    pub fn enabled(&self, rule: &str) -> bool {
        self.clone().flag(rule).is_some_and(|f| *f)
    }

    /// Every rule on but those named: `all` (or an empty list) turns every rule off;
    /// otherwise a comma-separated list of rule names ([`RULES`]).
    pub fn without(list: &str) -> Result<Self, String> {
        let list = list.trim();
        if list.is_empty() || list == "all" {
            return Ok(FuseOptions::none());
        }
        let mut o = FuseOptions::all();
        for rule in list.split(',').map(str::trim) {
            *o.flag(rule).ok_or_else(|| format!("unknown fusion rule '{rule}' (rules: {}, or all)", RULES.join(", ")))? = false;
        }
        Ok(o)
    }
}

/// One node of the graph being rewritten.
struct W {
    node: Node,
    inputs: Vec<usize>,
    dead: bool,
}

struct Work {
    n: Vec<W>,
    outputs: Vec<(String, usize)>,
    /// Users of each node (live nodes only), recomputed after each rule.
    users: Vec<Vec<usize>>,
    pos: Option<usize>,
}

impl Work {
    fn new(g: &Graph) -> Self {
        let n: Vec<W> =
            g.g.node_indices().map(|i| W { node: g.node(i).clone(), inputs: g.inputs(i).iter().map(|x| x.index()).collect(), dead: false }).collect();
        let pos = n.iter().position(|w| matches!(w.node.kind, NodeKind::Input { input: InputKind::Positions }));
        let outputs = g.outputs.iter().map(|(s, i)| (s.clone(), i.index())).collect();
        let mut w = Work { n, outputs, users: vec![], pos };
        w.refresh();
        w
    }

    fn refresh(&mut self) {
        let mut users = vec![vec![]; self.n.len()];
        for (i, w) in self.n.iter().enumerate() {
            if !w.dead {
                for &x in &w.inputs {
                    if !users[x].contains(&i) {
                        users[x].push(i);
                    }
                }
            }
        }
        self.users = users;
    }

    fn op(&self, i: usize) -> Option<&Op> {
        match &self.n[i].node.kind {
            NodeKind::Op { op } if !self.n[i].dead => Some(op),
            _ => None,
        }
    }

    fn is_output(&self, i: usize) -> bool {
        self.outputs.iter().any(|&(_, o)| o == i)
    }

    /// Whether `i`'s only reader is `user` (and `i` is no graph output).
    fn only_user(&self, i: usize, user: usize) -> bool {
        self.users[i] == [user] && !self.is_output(i)
    }

    fn weight_format(&self, i: usize) -> Option<crate::quant::WeightFormat> {
        self.n[i].node.weight().map(|p| p.format)
    }

    /// Turns node `i` into `op` over `inputs`, produced by `rule`.
    fn set(&mut self, i: usize, op: Op, inputs: Vec<usize>, rule: &'static str) {
        let w = &mut self.n[i];
        w.node.kind = NodeKind::Op { op };
        w.inputs = inputs;
        w.node.rule = Some(rule);
    }

    fn kill(&mut self, i: usize) {
        self.n[i].dead = true;
    }

    fn rename(&mut self, i: usize, base: &str) {
        let w = &mut self.n[i];
        w.node.name = match w.node.layer {
            Some(l) => format!("l{l}.{base}"),
            None => base.to_string(),
        };
    }

    /// The name without its layer prefix.
    fn base_name(&self, i: usize) -> &str {
        let name = &self.n[i].node.name;
        match self.n[i].node.layer {
            Some(l) => name.strip_prefix(&format!("l{l}.")).unwrap_or(name),
            None => name,
        }
    }

    /// The x and optional weight of an `RmsNorm` node's inputs.
    fn norm_parts(&self, i: usize) -> (usize, Option<usize>) {
        (self.n[i].inputs[0], self.n[i].inputs.get(1).copied())
    }

    /// Runs `f` over the nodes in order, refreshing users after each change.
    fn each(&mut self, mut f: impl FnMut(&mut Work, usize) -> bool) {
        for i in 0..self.n.len() {
            if self.op(i).is_some() && f(self, i) {
                self.refresh();
            }
        }
    }
}

/// Rule 1: `rope(rms_norm(x))`.
fn norm_rope(w: &mut Work, r: usize) -> bool {
    let Some(&Op::Rope { theta, factor, rotary_pairs }) = w.op(r) else { return false };
    let n = w.n[r].inputs[0];
    let Some(&Op::RmsNorm { eps, scale }) = w.op(n) else { return false };
    if !w.only_user(n, r) {
        return false;
    }
    let (x, nw) = w.norm_parts(n);
    let ins = [x, w.n[r].inputs[1]].into_iter().chain(nw).collect();
    w.set(r, Op::NormRope { eps, scale, theta, factor, rotary_pairs, heads: None }, ins, "norm_rope");
    w.kill(n);
    true
}

/// Rule 2: `gelu(a) * b`.
fn gelu_mul(w: &mut Work, m: usize) -> bool {
    let Some(Op::Binary { f: BinaryOp::Mul }) = w.op(m) else { return false };
    let (g, b) = (w.n[m].inputs[0], w.n[m].inputs[1]);
    let Some(Op::Unary { f: UnaryOp::Gelu }) = w.op(g) else { return false };
    let a = w.n[g].inputs[0];
    if !w.only_user(g, m) || w.n[a].node.ty != w.n[b].node.ty {
        return false;
    }
    w.set(m, Op::GeGlu, vec![a, b], "gelu_mul");
    w.kill(g);
    true
}

/// Rule 3: `res + rms_norm(x)`, and that sum times a scalar weight.
fn norm_add(w: &mut Work, a: usize) -> bool {
    match w.op(a) {
        Some(Op::Binary { f: BinaryOp::Add }) => {
            // a residual add: the builders add the norm second
            let (res, n) = (w.n[a].inputs[0], w.n[a].inputs[1]);
            let Some(&Op::RmsNorm { eps, scale }) = w.op(n) else { return false };
            if !w.only_user(n, a) || w.n[res].node.ty != w.n[n].node.ty || scale == NormScale::None {
                return false;
            }
            let (x, nw) = w.norm_parts(n);
            let ins = [x, res].into_iter().chain(nw).collect();
            w.set(a, Op::RmsNormAdd { eps, scale, scaled: false }, ins, "norm_add");
            w.kill(n);
            true
        }
        Some(Op::Binary { f: BinaryOp::Mul }) => {
            let (s, sc) = (w.n[a].inputs[0], w.n[a].inputs[1]);
            let Some(&Op::RmsNormAdd { eps, scale, scaled: false }) = w.op(s) else { return false };
            let scalar = w.n[sc].node.weight().is_some_and(|p| p.shape == [1]);
            if !scalar || !w.only_user(s, a) {
                return false;
            }
            let ins = w.n[s].inputs.iter().copied().chain([sc]).collect();
            w.set(a, Op::RmsNormAdd { eps, scale, scaled: true }, ins, "norm_add");
            let name = w.base_name(s).to_string();
            w.rename(a, &name);
            w.kill(s);
            true
        }
        _ => false,
    }
}

/// Whether a consumer of a projection's heads can take a head range of a wider value
/// (its heads input is slot 0 and it has no range yet).
fn takes_heads(w: &Work, u: usize, from: usize) -> bool {
    if w.n[u].inputs.iter().skip(1).any(|&x| x == from) {
        return false;
    }
    match w.op(u) {
        Some(Op::NormRope { heads: None, .. } | Op::KvWrite { heads: None } | Op::KvWriteNormRope { heads: None, .. }) => true,
        Some(Op::NormRopeAttention { heads: None, append: None, .. }) => true,
        // a norm over each head: a norm-rope without pairs takes the range
        Some(Op::RmsNorm { .. }) => w.pos.is_some() && w.n[u].node.ty.shape.len() == 3,
        _ => false,
    }
}

/// Rule 4: a norm read only by matmuls.
fn norm_matmul(w: &mut Work, n: usize) -> bool {
    let Some(&Op::RmsNorm { eps, scale }) = w.op(n) else { return false };
    let users = w.users[n].clone();
    let all_matmuls = !users.is_empty()
        && !w.is_output(n)
        && users.iter().all(|&m| matches!(w.op(m), Some(Op::MatMul)) && w.n[m].inputs[0] == n && w.n[m].inputs[1] != n);
    if !all_matmuls {
        return false;
    }
    let (x, nw) = w.norm_parts(n);
    let head: Vec<usize> = [x].into_iter().chain(nw).collect();
    // The projections' heads: each matmul read by one reshape to [T, heads, d], one d for all.
    let heads: Option<Vec<(usize, usize)>> = users
        .iter()
        .map(|&m| {
            let &[r] = w.users[m].as_slice() else { return None };
            let shape = match w.op(r) {
                Some(Op::Reshape { shape }) if shape.len() == 3 && !w.is_output(m) && !w.is_output(r) => shape.clone(),
                _ => return None,
            };
            w.users[r].iter().all(|&u| takes_heads(w, u, r)).then_some((r, shape[1]))
        })
        .collect();
    let d_of = |w: &Work, r: usize| w.n[r].node.ty.shape[2];
    match heads {
        Some(hs) if hs.len() > 1 && hs.iter().all(|&(r, _)| d_of(w, r) == d_of(w, hs[0].0)) => {
            let first = users[0];
            let ins = head.iter().copied().chain(users.iter().map(|&m| w.n[m].inputs[1])).collect();
            w.set(first, Op::NormMatMul { eps, scale }, ins, "norm_matmul");
            let tag: String = users.iter().filter_map(|&m| w.base_name(m).chars().next()).collect();
            w.rename(first, &format!("{tag}_proj"));
            let (r0, d) = (hs[0].0, d_of(w, hs[0].0));
            let t = w.n[r0].node.ty.shape[0];
            let total = hs.iter().map(|h| h.1).sum();
            w.set(r0, Op::Reshape { shape: vec![t, total, d] }, vec![first], "norm_matmul");
            w.rename(r0, &format!("{tag}_heads"));
            let mut start = 0;
            for (j, &(r, count)) in hs.iter().enumerate() {
                let range = Some(HeadRange { start, count });
                start += count;
                for u in w.users[r].clone() {
                    w.n[u].inputs[0] = r0;
                    set_heads(w, u, range);
                }
                if j > 0 {
                    w.kill(r);
                    w.kill(users[j]);
                }
            }
        }
        _ => {
            for &m in &users {
                let ins = head.iter().copied().chain([w.n[m].inputs[1]]).collect();
                w.set(m, Op::NormMatMul { eps, scale }, ins, "norm_matmul");
            }
        }
    }
    w.kill(n);
    true
}

/// Gives consumer `u` (one that [`takes_heads`]) the head range `range` of its input.
fn set_heads(w: &mut Work, u: usize, range: Option<HeadRange>) {
    let NodeKind::Op { op } = &mut w.n[u].node.kind else { return };
    match op {
        Op::NormRope { heads, .. } | Op::KvWrite { heads } | Op::KvWriteNormRope { heads, .. } | Op::NormRopeAttention { heads, .. } => {
            *heads = range
        }
        &mut Op::RmsNorm { eps, scale } => {
            // the norm of each head, as a norm-rope without pairs (theta unused)
            let (x, nw) = (w.n[u].inputs[0], w.n[u].inputs.get(1).copied());
            let pos = w.pos.expect("takes_heads checked the positions input");
            let op = Op::NormRope { eps, scale, theta: 1.0, factor: 1.0, rotary_pairs: 0, heads: range };
            w.set(u, op, [x, pos].into_iter().chain(nw).collect(), "norm_matmul");
        }
        _ => {}
    }
}

/// Rule 5: a cache write of a normed (and rotated) value.
fn kv_write(w: &mut Work, k: usize) -> bool {
    let Some(&Op::KvWrite { heads: None }) = w.op(k) else { return false };
    let (v, pos, cache) = (w.n[k].inputs[0], w.n[k].inputs[1], w.n[k].inputs[2]);
    if !w.only_user(v, k) {
        return false;
    }
    let (op, x, nw) = match w.op(v) {
        Some(&Op::NormRope { eps, scale, theta, factor, rotary_pairs, heads }) => {
            let i = &w.n[v].inputs;
            (Op::KvWriteNormRope { eps, scale, theta, factor, rotary_pairs, heads }, i[0], i.get(2).copied())
        }
        Some(&Op::RmsNorm { eps, scale }) => {
            let (x, nw) = w.norm_parts(v);
            (Op::KvWriteNormRope { eps, scale, theta: 1.0, factor: 1.0, rotary_pairs: 0, heads: None }, x, nw)
        }
        _ => return false,
    };
    w.set(k, op, [x, pos].into_iter().chain(nw).chain([cache]).collect(), "kv_write");
    w.kill(v);
    true
}

/// Rule 6: attention over a normed, rotated query.
fn attention_rope(w: &mut Work, a: usize) -> bool {
    let Some(&Op::Attention { scale, window }) = w.op(a) else { return false };
    let q = w.n[a].inputs[0];
    let Some(&Op::NormRope { eps, scale: norm, theta, factor, rotary_pairs, heads }) = w.op(q) else { return false };
    if !w.only_user(q, a) {
        return false;
    }
    let qi = &w.n[q].inputs;
    let ins = [qi[0]].into_iter().chain(w.n[a].inputs[1..4].iter().copied()).chain(qi.get(2).copied()).collect();
    let op = Op::NormRopeAttention { scale, window, eps, norm, theta, factor, rotary_pairs, heads, append: None };
    w.set(a, op, ins, "attention_rope");
    w.kill(q);
    true
}

/// Rule 7: a GeGLU of two one-weight norm-matmuls of one norm, weights stored alike.
fn geglu(w: &mut Work, g: usize) -> bool {
    let Some(Op::GeGlu) = w.op(g) else { return false };
    let (a, b) = (w.n[g].inputs[0], w.n[g].inputs[1]);
    let (Some(&Op::NormMatMul { eps, scale }), Some(&Op::NormMatMul { eps: eb, scale: sb })) = (w.op(a), w.op(b)) else {
        return false;
    };
    let (ia, ib) = (&w.n[a].inputs, &w.n[b].inputs);
    let one_weight = |ins: &[usize]| ins.len() == if scale == NormScale::None { 2 } else { 3 };
    let same_norm = a != b && (eps, scale) == (eb, sb) && ia[..ia.len() - 1] == ib[..ib.len() - 1];
    let (wg, wu) = (*ia.last().unwrap(), *ib.last().unwrap());
    if !same_norm || !one_weight(ia) || !one_weight(ib) || !w.only_user(a, g) || !w.only_user(b, g) || w.weight_format(wg) != w.weight_format(wu) {
        return false;
    }
    let ins = ia.iter().copied().chain([wu]).collect();
    w.set(g, Op::NormGeGlu { eps, scale }, ins, "geglu");
    w.rename(g, "gate_up_geglu");
    w.kill(a);
    w.kill(b);
    true
}

/// Rule 8: the attention appends the step's key and value to its caches.
fn kv_append(w: &mut Work, a: usize) -> bool {
    let Some(&Op::NormRopeAttention { scale, window, eps, norm, theta, factor, rotary_pairs, heads: Some(qh), append: None }) = w.op(a) else {
        return false;
    };
    let ai = w.n[a].inputs.clone();
    let [x, pos, kc, vc, wq] = ai[..] else { return false };
    let Some(&Op::KvWriteNormRope { eps: ke, scale: ks, theta: kt, factor: kf, rotary_pairs: kp, heads: Some(kh) }) = w.op(kc) else {
        return false;
    };
    let Some(&Op::KvWrite { heads: Some(vh) }) = w.op(vc) else { return false };
    let (ki, vi) = (&w.n[kc].inputs, &w.n[vc].inputs);
    let same_rope = (ke, ks, kt, kf, kp) == (eps, norm, theta, factor, rotary_pairs);
    if norm == NormScale::None || !same_rope || ki.len() != 4 || ki[0] != x || vi[0] != x || kh.count != vh.count {
        return false;
    }
    let (wk, kstate, vstate) = (ki[2], ki[3], vi[2]);
    if !w.only_user(kc, a) || !w.only_user(vc, a) || w.weight_format(wk) != w.weight_format(wq) {
        return false;
    }
    let op = Op::NormRopeAttention { scale, window, eps, norm, theta, factor, rotary_pairs, heads: Some(qh), append: Some(KvAppend { k: kh, v: vh }) };
    w.set(a, op, vec![x, pos, kstate, vstate, wq, wk], "kv_append");
    w.rename(a, "kv_append_attention");
    w.kill(kc);
    w.kill(vc);
    true
}

/// Runs the enabled rules over `g` and removes what they left unused.
pub fn fuse(g: Graph, o: &FuseOptions) -> Result<Graph, BuildError> {
    let mut w = Work::new(&g);
    // one token of one sequence (a batch's graphs keep their rows' arithmetic whatever the
    // number of rows: no one-token fusions)
    let one = g.tokens == 1 && !g.batched();
    let rules: [(bool, fn(&mut Work, usize) -> bool); 8] = [
        (o.norm_rope, norm_rope),
        (o.gelu_mul, gelu_mul),
        (o.norm_add, norm_add),
        (o.norm_matmul && one, norm_matmul),
        (o.kv_write && one, kv_write),
        (o.attention_rope && one, attention_rope),
        (o.geglu && one, geglu),
        (o.kv_append && one, kv_append),
    ];
    let mut changed = false;
    for (on, rule) in rules {
        if on {
            w.each(|w, i| {
                let c = rule(w, i);
                changed |= c;
                c
            });
        }
    }
    if !changed {
        return Ok(g);
    }
    rebuild(&w, &g)
}

/// The rewritten graph: the live ops in their order, each non-op node placed just before
/// its first reader, unreachable nodes dropped.
fn rebuild(w: &Work, old: &Graph) -> Result<Graph, BuildError> {
    let len = w.n.len();
    let mut live = vec![false; len];
    let mut stack: Vec<usize> = w.outputs.iter().map(|o| o.1).collect();
    while let Some(i) = stack.pop() {
        if !live[i] {
            live[i] = true;
            stack.extend(&w.n[i].inputs);
        }
    }
    let mut g = Graph::new(old.tokens, old.kind);
    let mut map: Vec<Option<petgraph::graph::NodeIndex>> = vec![None; len];
    for i in 0..len {
        if !live[i] || w.op(i).is_none() {
            continue;
        }
        for &x in &w.n[i].inputs {
            if map[x].is_none() {
                let n = &w.n[x].node;
                map[x] = Some(match &n.kind {
                    NodeKind::Input { input } => g.input(&n.name, *input, n.ty.clone()),
                    NodeKind::Weight { weight } => g.weight(&n.name, n.layer, weight.clone()),
                    NodeKind::State { state } => g.state(&n.name, n.layer, state.clone(), n.ty.clone()),
                    NodeKind::Op { .. } => return Err(BuildError::Config(format!("fuse: {} is read before it is computed", n.name))),
                });
            }
        }
        let n = &w.n[i].node;
        let ins: Vec<_> = w.n[i].inputs.iter().map(|&x| map[x].unwrap()).collect();
        let op = w.op(i).unwrap().clone();
        let id = g.op(&n.name, n.layer, op, &ins)?;
        g.g[id].rule = n.rule;
        map[i] = Some(id);
    }
    for (name, o) in &w.outputs {
        let n = map[*o].ok_or_else(|| BuildError::Config(format!("fuse: output {name} was removed")))?;
        g.set_output(name, n);
    }
    Ok(g)
}
