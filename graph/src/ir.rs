//! The op graph: a petgraph DAG of nodes producing typed values.
//!
//! Node ids are creation indices; builders create nodes in a deterministic
//! order, so ids are stable across runs. Edges carry the input slot.

use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use serde::Serialize;

use crate::ops::{Op, ShapeError, TensorType};
use crate::quant::WeightFormat;

/// A named weight parameter of the checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WeightParam {
    /// Checkpoint name: the module path for quantizable modules (tensors
    /// `<name>.weight`, `.scales`, ...), the full tensor name for plain tensors.
    pub name: String,
    /// Float shape (`[out, in]`, `[E, out, in]`, `[D]`, `[1]`).
    pub shape: Vec<usize>,
    /// Storage format as the config describes it.
    pub format: WeightFormat,
    /// True when stored as `<name>.weight` (+ quantization tensors); false for plain tensors.
    pub module: bool,
}

impl WeightParam {
    /// Bytes of the stored tensors (packed weight, scales, biases).
    pub fn stored_bytes(&self) -> usize {
        let numel: usize = self.shape.iter().product();
        match self.format {
            WeightFormat::Float { dtype } => numel * dtype.bytes(),
            WeightFormat::Quantized { spec, global_scale } => {
                let inn = *self.shape.last().unwrap_or(&1);
                let rows = numel / inn.max(1);
                let experts = if self.shape.len() == 3 { self.shape[0] } else { 1 };
                rows * spec.row_bytes(inn, 2) + if global_scale { experts * 4 } else { 0 }
            }
        }
    }
}

/// Graph inputs written by the host each step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InputKind {
    /// Token ids `u32[T]`.
    Tokens,
    /// Absolute positions `u32[T]`.
    Positions,
    /// Sampling parameters `u32[8]` (see `Op::Sample`).
    SamplingParams,
    /// Recent token ids `u32[R]` for the repetition penalty.
    RecentTokens,
    /// Image patches `f32[P, K]` (a vision tower's input).
    Pixels,
    /// Column and row of each patch `u32[P]` (a vision tower's positions).
    PatchX,
    PatchY,
    /// Soft-token rows `f32[N, D]` put into a prompt's embeddings, and for each token the
    /// row it takes, plus one (0: its own embedding) `u32[T]`.
    SoftRows,
    SoftIndex,
    /// Attention bounds `u32[2, T]`: the positions, then for each token the last position
    /// it attends to (the end of its image span, else its own position; see
    /// [`crate::ops::Op::Attention`]).
    AttnPositions,
    /// The sequence slot of each row `u32[T]` (graphs over a batch's slot caches; a slot
    /// past the last one marks an idle row).
    SlotIds,
    /// Sampling parameter words of each row `u32[T, 8]` and its recent ids `u32[T, R]`
    /// (batched decode graphs, [`crate::ops::Op::SampleRows`]).
    RowSampling,
    RowRecent,
    /// Log-mel features `f32[T, F]` and each frame's validity `u32[T]` (1: a real frame; an
    /// audio tower's input).
    AudioFeatures,
    AudioValid,
}

/// Persistent state owned by the runtime across steps.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum StateKind {
    /// K or V cache of one layer: `f32[slots, kv_heads, head_dim]`, or
    /// `f32[sequences, slots, kv_heads, head_dim]` for a batch of sequences.
    KvCache { layer: usize, value: bool },
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum NodeKind {
    Input { input: InputKind },
    Weight { weight: WeightParam },
    State { state: StateKind },
    Op { op: Op },
}

/// One node: a value and how it is produced.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Node {
    /// Stable id (creation index).
    pub id: u32,
    /// Readable name, e.g. `l3.attn.q_proj`.
    pub name: String,
    /// Decoder layer the node belongs to, if any.
    pub layer: Option<usize>,
    pub kind: NodeKind,
    /// Type of the produced value. Weights have their float shape and dtype f32.
    pub ty: TensorType,
    /// The fusion rule that produced this node (`None`: as the builder emitted it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<&'static str>,
}

impl Node {
    pub fn op(&self) -> Option<&Op> {
        match &self.kind {
            NodeKind::Op { op } => Some(op),
            _ => None,
        }
    }
    pub fn weight(&self) -> Option<&WeightParam> {
        match &self.kind {
            NodeKind::Weight { weight } => Some(weight),
            _ => None,
        }
    }
}

/// What a graph computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GraphKind {
    Prefill,
    Decode,
}

/// An op graph.
#[derive(Clone, Debug)]
pub struct Graph {
    pub g: DiGraph<Node, usize>,
    /// Output values by name (`logits`, `token`).
    pub outputs: Vec<(String, NodeIndex)>,
    /// Tokens processed per step.
    pub tokens: usize,
    pub kind: GraphKind,
}

/// A problem found while building a graph.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("node {name}: {source}")]
    Shape { name: String, source: ShapeError },
    #[error("{0}")]
    Config(String),
}

impl Graph {
    pub fn new(tokens: usize, kind: GraphKind) -> Self {
        Graph { g: DiGraph::new(), outputs: vec![], tokens, kind }
    }

    /// Whether this is a graph of a batch of sequences (it reads each row's sequence slot).
    pub fn batched(&self) -> bool {
        self.g.node_indices().any(|n| matches!(self.node(n).kind, NodeKind::Input { input: InputKind::SlotIds }))
    }

    /// Whether this is a batch's decode step: a row per sequence, whose arithmetic must not
    /// depend on how many rows the step has.
    pub fn row_batch(&self) -> bool {
        self.kind == GraphKind::Decode && self.batched()
    }

    fn push(&mut self, name: String, layer: Option<usize>, kind: NodeKind, ty: TensorType) -> NodeIndex {
        let id = self.g.node_count() as u32;
        self.g.add_node(Node { id, name, layer, kind, ty, rule: None })
    }

    pub fn input(&mut self, name: &str, input: InputKind, ty: TensorType) -> NodeIndex {
        self.push(name.to_string(), None, NodeKind::Input { input }, ty)
    }

    pub fn weight(&mut self, label: &str, layer: Option<usize>, weight: WeightParam) -> NodeIndex {
        let ty = TensorType::f32(&weight.shape);
        self.push(label.to_string(), layer, NodeKind::Weight { weight }, ty)
    }

    pub fn state(&mut self, name: &str, layer: Option<usize>, state: StateKind, ty: TensorType) -> NodeIndex {
        self.push(name.to_string(), layer, NodeKind::State { state }, ty)
    }

    /// Adds an op node, inferring (and so checking) its output type.
    pub fn op(&mut self, name: &str, layer: Option<usize>, op: Op, inputs: &[NodeIndex]) -> Result<NodeIndex, BuildError> {
        let tys: Vec<&TensorType> = inputs.iter().map(|&i| &self.g[i].ty).collect();
        let ty = op.infer(&tys).map_err(|source| BuildError::Shape { name: name.to_string(), source })?;
        let n = self.push(name.to_string(), layer, NodeKind::Op { op }, ty);
        for (slot, &i) in inputs.iter().enumerate() {
            self.g.add_edge(i, n, slot);
        }
        Ok(n)
    }

    pub fn set_output(&mut self, name: &str, n: NodeIndex) {
        self.outputs.push((name.to_string(), n));
    }

    pub fn output(&self, name: &str) -> Option<NodeIndex> {
        self.outputs.iter().find(|(n, _)| n == name).map(|(_, i)| *i)
    }

    /// Inputs of `n` in slot order.
    pub fn inputs(&self, n: NodeIndex) -> Vec<NodeIndex> {
        let mut e: Vec<(usize, NodeIndex)> =
            self.g.edges_directed(n, Direction::Incoming).map(|e| (*e.weight(), e.source())).collect();
        e.sort_unstable();
        e.into_iter().map(|(_, s)| s).collect()
    }

    /// Consumers of `n` (sorted by id, deduplicated).
    pub fn users(&self, n: NodeIndex) -> Vec<NodeIndex> {
        let mut u: Vec<NodeIndex> = self.g.neighbors_directed(n, Direction::Outgoing).collect();
        u.sort_unstable();
        u.dedup();
        u
    }

    /// Nodes in execution order: a topological order that is deterministic
    /// (creation order, which builders keep topological; checked).
    pub fn order(&self) -> Vec<NodeIndex> {
        self.g.node_indices().collect()
    }

    pub fn node(&self, n: NodeIndex) -> &Node {
        &self.g[n]
    }

    /// All weight parameters, in id order.
    pub fn weights(&self) -> impl Iterator<Item = (NodeIndex, &WeightParam)> {
        self.g.node_indices().filter_map(move |n| self.g[n].weight().map(|w| (n, w)))
    }

    /// Op nodes, in id order.
    pub fn op_nodes(&self) -> impl Iterator<Item = NodeIndex> + '_ {
        self.g.node_indices().filter(move |&n| self.g[n].op().is_some())
    }

    /// Resolves views: the node whose buffer holds `n`'s data.
    pub fn storage_root(&self, mut n: NodeIndex) -> NodeIndex {
        loop {
            match self.g[n].op() {
                Some(op) if op.is_view() => n = self.inputs(n)[0],
                Some(op) if op.writes_state() => n = *self.inputs(n).last().unwrap(),
                _ => return n,
            }
        }
    }
}
