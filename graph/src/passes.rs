//! Compiler passes, each a separate function: shape validation, liveness +
//! buffer assignment, phase scheduling, and the invariant checker that
//! re-verifies all of them.

use std::collections::BTreeMap;

use petgraph::graph::NodeIndex;
use serde::Serialize;

use crate::ir::{Graph, NodeKind};
use crate::ops::{Op, TensorType};

/// Where a value lives at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(tag = "class", content = "index", rename_all = "snake_case")]
pub enum Storage {
    /// A weight tensor (by node id).
    Weight(u32),
    /// A host-written input buffer (by node id).
    Input(u32),
    /// A persistent state buffer (by node id of the state).
    State(u32),
    /// An intermediate buffer from the pool.
    Pool(u32),
}

/// Result of buffer assignment.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Allocation {
    /// Storage of every node's value (views: their root's storage), by node index.
    pub storage: Vec<Storage>,
    /// Size in bytes of each pool buffer.
    pub pool_sizes: Vec<usize>,
    /// Live interval `[def, last_use]` (positions in the execution order) of every
    /// value that owns pool storage, by node index; `None` otherwise.
    pub live: Vec<Option<(usize, usize)>>,
    /// Sum of intermediate value sizes without sharing.
    pub bytes_before: usize,
    /// Sum of pool buffer sizes.
    pub bytes_after: usize,
}

/// Phases: contiguous runs of the execution order, one compute pass and one submission each.
#[derive(Clone, Debug, Default)]
pub struct Schedule {
    /// Op nodes of each phase, in execution order.
    pub phases: Vec<Vec<NodeIndex>>,
    /// Name of each phase.
    pub names: Vec<String>,
    /// Phase of every node (ops only; `None` for inputs/weights/states).
    pub phase_of: Vec<Option<usize>>,
}

/// How to cut the graph into phases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PhasePolicy {
    /// Embedding + layers, then final norm + head + sampling.
    EmbedLayersHead,
    /// Embedding, each layer, then the head.
    PerLayer,
    /// The whole step in one phase (one pass, one submission): decode steps, where the
    /// next step is encoded while the GPU runs this one, so an early first submission
    /// gains nothing.
    Step,
}

/// A compiled graph: the graph plus the results of every pass.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub graph: Graph,
    pub alloc: Allocation,
    pub schedule: Schedule,
}

/// A violated invariant.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invariant violated: {0}")]
pub struct CheckError(pub String);

/// Pass 1: every op's output type equals its shape rule applied to its inputs,
/// and the creation order is topological.
pub fn validate_shapes(g: &Graph) -> Result<(), CheckError> {
    for n in g.g.node_indices() {
        let node = g.node(n);
        let ins = g.inputs(n);
        for &i in &ins {
            if i.index() >= n.index() {
                return Err(CheckError(format!("node {} ({}) uses a later node {}", node.id, node.name, g.node(i).id)));
            }
        }
        match &node.kind {
            NodeKind::Op { op } => {
                let tys: Vec<&TensorType> = ins.iter().map(|&i| &g.node(i).ty).collect();
                let t = op.infer(&tys).map_err(|e| CheckError(format!("node {} ({}): {e}", node.id, node.name)))?;
                if t != node.ty {
                    return Err(CheckError(format!(
                        "node {} ({}): type {} but the shape rule gives {}",
                        node.id,
                        node.name,
                        node.ty.describe(),
                        t.describe()
                    )));
                }
            }
            _ if !ins.is_empty() => {
                return Err(CheckError(format!("non-op node {} ({}) has inputs", node.id, node.name)));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Storage class of a value before pooling.
fn base_storage(g: &Graph, n: NodeIndex) -> Option<Storage> {
    let node = g.node(n);
    match &node.kind {
        NodeKind::Weight { .. } => Some(Storage::Weight(node.id)),
        NodeKind::Input { .. } => Some(Storage::Input(node.id)),
        NodeKind::State { .. } => Some(Storage::State(node.id)),
        NodeKind::Op { .. } => None,
    }
}

/// Execution position of each node (index in `g.order()`).
fn positions(g: &Graph) -> Vec<usize> {
    let mut p = vec![0; g.g.node_count()];
    for (i, n) in g.order().into_iter().enumerate() {
        p[n.index()] = i;
    }
    p
}

/// Pass 2: liveness + buffer assignment.
///
/// Each op output that owns storage (not a view, not a state write) gets a pool
/// buffer. A value's live range runs from its definition to its last use
/// (uses of views count as uses of their root; graph outputs live to the end).
/// A buffer is reused only by a value defined strictly after the previous
/// occupant's last use, so a node's output never shares a buffer with one of
/// its inputs (whose last use is that node at the earliest).
pub fn assign_buffers(g: &Graph) -> Allocation {
    let n_nodes = g.g.node_count();
    let pos = positions(g);
    let order = g.order();
    let end = order.len();
    let mut root = vec![NodeIndex::new(0); n_nodes];
    for n in g.g.node_indices() {
        root[n.index()] = g.storage_root(n);
    }
    // Last use of each root.
    let mut last = vec![0usize; n_nodes];
    for n in g.g.node_indices() {
        let r = root[n.index()];
        last[r.index()] = last[r.index()].max(pos[n.index()]);
        for u in g.users(n) {
            last[r.index()] = last[r.index()].max(pos[u.index()]);
        }
    }
    for (_, o) in &g.outputs {
        last[root[o.index()].index()] = end;
    }

    let mut storage = vec![Storage::Pool(u32::MAX); n_nodes];
    let mut live = vec![None; n_nodes];
    let mut pool_sizes: Vec<usize> = vec![];
    // Per buffer: last use of its current occupant.
    let mut busy_until: Vec<usize> = vec![];
    let mut before = 0usize;

    for &n in &order {
        if let Some(s) = base_storage(g, n) {
            storage[n.index()] = s;
            continue;
        }
        if root[n.index()] != n {
            continue; // view or state write: resolved below
        }
        let bytes = g.node(n).ty.bytes().max(4);
        before += bytes;
        let p = pos[n.index()];
        // Free buffers: occupant's last use strictly before this definition.
        let free = (0..pool_sizes.len()).filter(|&b| busy_until[b] < p);
        // Best fit: the smallest free buffer that is large enough, else the largest free one (grown).
        let mut fit: Option<usize> = None;
        let mut largest: Option<usize> = None;
        for b in free {
            if pool_sizes[b] >= bytes && fit.map_or(true, |f| pool_sizes[b] < pool_sizes[f]) {
                fit = Some(b);
            }
            if largest.map_or(true, |l| pool_sizes[b] > pool_sizes[l]) {
                largest = Some(b);
            }
        }
        let b = match (fit, largest) {
            (Some(b), _) => b,
            (None, Some(b)) => {
                pool_sizes[b] = bytes;
                b
            }
            (None, None) => {
                pool_sizes.push(bytes);
                busy_until.push(0);
                pool_sizes.len() - 1
            }
        };
        busy_until[b] = last[n.index()];
        storage[n.index()] = Storage::Pool(b as u32);
        live[n.index()] = Some((p, last[n.index()]));
    }
    for n in g.g.node_indices() {
        let r = root[n.index()];
        if r != n {
            storage[n.index()] = storage[r.index()];
        }
    }
    let after = pool_sizes.iter().sum();
    Allocation { storage, pool_sizes, live, bytes_before: before, bytes_after: after }
}

/// Pass 3: phase scheduling. Phases are contiguous runs of the execution order,
/// so every producer's phase precedes or equals its consumers'.
pub fn schedule(g: &Graph, policy: PhasePolicy) -> Schedule {
    let order = g.order();
    let first_layer = order.iter().position(|&n| g.node(n).layer.is_some());
    let last_layer = order.iter().rposition(|&n| g.node(n).layer.is_some());
    let stage = |i: usize, n: NodeIndex| -> (usize, String) {
        match (g.node(n).layer, first_layer, last_layer) {
            (Some(l), _, _) => (l + 1, format!("layer{l}")),
            (None, Some(f), _) if i < f => (0, "embed".into()),
            (None, _, Some(la)) if i > la => (usize::MAX, "head".into()),
            _ => (0, "embed".into()),
        }
    };
    let mut phases: Vec<Vec<NodeIndex>> = vec![];
    let mut names: Vec<String> = vec![];
    let mut phase_of = vec![None; g.g.node_count()];
    let mut cur_key: Option<usize> = None;
    for (i, &n) in order.iter().enumerate() {
        if g.node(n).op().is_none() {
            continue;
        }
        let (st, sname) = stage(i, n);
        let (key, name) = match policy {
            PhasePolicy::PerLayer => (st, sname),
            PhasePolicy::Step => (0, "step".to_string()),
            PhasePolicy::EmbedLayersHead => {
                if st == usize::MAX {
                    (1, "head".to_string())
                } else {
                    (0, "embed+layers".to_string())
                }
            }
        };
        if cur_key != Some(key) {
            phases.push(vec![]);
            names.push(name);
            cur_key = Some(key);
        }
        phase_of[n.index()] = Some(phases.len() - 1);
        phases.last_mut().unwrap().push(n);
    }
    Schedule { phases, names, phase_of }
}

/// Runs every pass and the checker.
pub fn compile(graph: Graph, policy: PhasePolicy) -> Result<Compiled, CheckError> {
    validate_shapes(&graph)?;
    let alloc = assign_buffers(&graph);
    let schedule = schedule(&graph, policy);
    let c = Compiled { graph, alloc, schedule };
    check(&c)?;
    Ok(c)
}

/// The invariant checker: re-verifies the result of every pass.
pub fn check(c: &Compiled) -> Result<(), CheckError> {
    let g = &c.graph;
    validate_shapes(g)?;
    let a = &c.alloc;
    let pos = positions(g);
    let nn = g.g.node_count();
    if a.storage.len() != nn || a.live.len() != nn || c.schedule.phase_of.len() != nn {
        return Err(CheckError("pass results do not cover every node".into()));
    }
    let name = |n: NodeIndex| format!("{} ({})", g.node(n).id, g.node(n).name);
    // Storage classes and sizes.
    for n in g.g.node_indices() {
        let r = g.storage_root(n);
        if a.storage[n.index()] != a.storage[r.index()] {
            return Err(CheckError(format!("node {} does not share its root's storage", name(n))));
        }
        match (base_storage(g, r), a.storage[r.index()]) {
            (Some(s), t) if s != t => return Err(CheckError(format!("node {} has storage {t:?}, expected {s:?}", name(n)))),
            (None, Storage::Pool(b)) => {
                let b = b as usize;
                if b >= a.pool_sizes.len() {
                    return Err(CheckError(format!("node {} uses missing buffer {b}", name(n))));
                }
                if a.pool_sizes[b] < g.node(n).ty.bytes() {
                    return Err(CheckError(format!(
                        "node {}: buffer {b} has {} bytes < {} needed",
                        name(n),
                        a.pool_sizes[b],
                        g.node(n).ty.bytes()
                    )));
                }
            }
            (None, s) => return Err(CheckError(format!("op node {} has non-pool storage {s:?}", name(n)))),
            _ => {}
        }
    }
    // Appended caches: the attention writing the step's rows into them is their only user
    // (nothing else binds them in its pass, nothing reads them before it).
    for n in g.op_nodes() {
        if let Some(Op::NormRopeAttention { append: Some(_), .. }) = g.node(n).op() {
            for &c in &g.inputs(n)[2..4] {
                if !matches!(g.node(c).kind, NodeKind::State { .. }) {
                    return Err(CheckError(format!("node {} appends to {}, not a state", name(n), name(c))));
                }
                if let Some(u) = g.users(c).into_iter().find(|&u| u != n) {
                    return Err(CheckError(format!("node {} appends to {}, which {} also uses", name(n), name(c), name(u))));
                }
            }
        }
    }
    // Isolation: no op's output buffer is one of its input buffers.
    for n in g.op_nodes() {
        let out = a.storage[n.index()];
        let op = g.node(n).op().unwrap();
        let ins = g.inputs(n);
        let read: &[NodeIndex] = if op.writes_state() { &ins[..ins.len() - 1] } else { &ins };
        if op.is_view() {
            continue;
        }
        for &i in read {
            if a.storage[i.index()] == out {
                return Err(CheckError(format!(
                    "node {} binds {:?} as input ({}) and output",
                    name(n),
                    out,
                    name(i)
                )));
            }
        }
    }
    // Liveness: recompute intervals and check that values sharing a buffer never overlap.
    let end = g.order().len();
    let mut last = vec![0usize; nn];
    for n in g.g.node_indices() {
        let r = g.storage_root(n).index();
        last[r] = last[r].max(pos[n.index()]);
        for u in g.users(n) {
            last[r] = last[r].max(pos[u.index()]);
        }
    }
    for (_, o) in &g.outputs {
        last[g.storage_root(*o).index()] = end;
    }
    let mut by_buf: BTreeMap<u32, Vec<(usize, usize, NodeIndex)>> = BTreeMap::new();
    for n in g.g.node_indices() {
        if g.storage_root(n) != n || base_storage(g, n).is_some() {
            continue;
        }
        let iv = (pos[n.index()], last[n.index()]);
        if a.live[n.index()] != Some(iv) {
            return Err(CheckError(format!("node {}: recorded live range {:?} != {:?}", name(n), a.live[n.index()], iv)));
        }
        if let Storage::Pool(b) = a.storage[n.index()] {
            by_buf.entry(b).or_default().push((iv.0, iv.1, n));
        }
    }
    for (b, mut v) in by_buf {
        v.sort();
        for w in v.windows(2) {
            if w[1].0 <= w[0].1 {
                return Err(CheckError(format!(
                    "buffer {b}: {} live [{}, {}] overlaps {} live [{}, {}]",
                    name(w[0].2),
                    w[0].0,
                    w[0].1,
                    name(w[1].2),
                    w[1].0,
                    w[1].1
                )));
            }
        }
    }
    // Phases: every op exactly once, in order, and dependencies never go backwards.
    let s = &c.schedule;
    let mut seen = vec![false; nn];
    let mut prev_pos = None;
    for (pi, ph) in s.phases.iter().enumerate() {
        if ph.is_empty() {
            return Err(CheckError(format!("phase {pi} is empty")));
        }
        for &n in ph {
            if seen[n.index()] || s.phase_of[n.index()] != Some(pi) {
                return Err(CheckError(format!("node {} scheduled inconsistently", name(n))));
            }
            seen[n.index()] = true;
            if let Some(p) = prev_pos {
                if pos[n.index()] <= p {
                    return Err(CheckError(format!("phase order is not the execution order at {}", name(n))));
                }
            }
            prev_pos = Some(pos[n.index()]);
        }
    }
    for n in g.g.node_indices() {
        let is_op = g.node(n).op().is_some();
        if is_op != seen[n.index()] {
            return Err(CheckError(format!("node {} is {}scheduled", name(n), if is_op { "not " } else { "wrongly " })));
        }
        if let Some(pn) = s.phase_of[n.index()] {
            for i in g.inputs(n) {
                if let Some(pi) = s.phase_of[i.index()] {
                    if pi > pn {
                        return Err(CheckError(format!("node {} in phase {pn} uses {} from phase {pi}", name(n), name(i))));
                    }
                }
            }
        }
    }
    Ok(())
}
