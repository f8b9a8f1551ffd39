//! The kernel families, one module per WGSL file (or group of files): each holds its
//! [`KernelSpec`] names, sources and variants, its launchers and params structs, and the
//! lowering of its graph ops to dispatches ([`lower`] picks the family of an op).

use std::collections::HashMap;
use std::sync::Arc;

use petgraph::graph::NodeIndex;

use markbase_graph::ir::{Graph, Node};
use markbase_graph::ops::Op;
use markbase_graph::quant::FloatType;

use super::device::{Gpu, GpuError};
use super::kv::KvChunks;
use super::kernels::{Kernel, KernelSpec, Kernels};
use super::shader::Source;
use super::weights::GpuWeight;

pub mod argmax;
pub mod attention;
pub mod audio;
pub mod batched;
pub mod copy;
pub mod elementwise;
pub mod embed;
pub mod gemm_f16;
pub mod kv_write;
pub mod matmul;
pub mod matmul_launch;
pub mod rmsnorm;
pub mod rope;
pub mod routing;
pub mod sample;
pub mod vision;
pub mod vision_coop;

/// A kernel family's part of [`KernelSpec`]: each function answers `None` for the specs of
/// other families.
pub(crate) struct Family {
    pub name: fn(&KernelSpec) -> Option<String>,
    /// The source of a spec; the flag: subgroups on (for the specs that have a variant).
    pub source: fn(&KernelSpec, bool) -> Option<Source>,
    /// A representative set of the family's variants (for the naga target test).
    pub variants: fn() -> Vec<KernelSpec>,
}

pub(crate) const FAMILIES: &[Family] = &[
    matmul::FAMILY,
    gemm_f16::FAMILY,
    embed::FAMILY,
    rmsnorm::FAMILY,
    rope::FAMILY,
    kv_write::FAMILY,
    attention::FAMILY,
    elementwise::FAMILY,
    routing::FAMILY,
    copy::FAMILY,
    argmax::FAMILY,
    batched::FAMILY,
    vision::FAMILY,
    vision_coop::FAMILY,
    audio::FAMILY,
];

/// One recorded dispatch.
pub(crate) struct Dispatch {
    pub kernel: Arc<Kernel>,
    pub bind: wgpu::BindGroup,
    pub groups: [u32; 3],
    /// The node it computes.
    pub node: NodeIndex,
}

/// What lowering any node needs: the device, the kernels, the graph, the uploaded weights and
/// the value buffers.
#[derive(Clone, Copy)]
pub(crate) struct LowerEnv<'a> {
    pub gpu: &'a Gpu,
    pub kernels: &'a Kernels,
    pub graph: &'a Graph,
    pub mats: &'a HashMap<String, GpuWeight>,
    pub vecs: &'a HashMap<String, (wgpu::Buffer, FloatType)>,
    /// The buffer holding a node's value.
    pub values: &'a dyn Fn(NodeIndex) -> Result<wgpu::Buffer, String>,
    /// The chunks of a node's value, where it is a KV cache split across bindings
    /// ([`super::kv`]); `None` for every other value.
    pub chunks: &'a dyn Fn(NodeIndex) -> Option<KvChunks>,
    /// Whether the graph is a batch's decode step ([`Graph::row_batch`], found once per graph):
    /// its matmuls keep each row's sums independent of the other rows.
    pub row_batch: bool,
}

/// What lowering a graph produces besides its bind groups.
#[derive(Default)]
pub(crate) struct Lowered {
    /// Uniform params buffers of the dispatches.
    pub params: Vec<wgpu::Buffer>,
    /// Scratch buffers owned by the dispatches (kept alive with them).
    pub scratch: Vec<wgpu::Buffer>,
    /// The split GEMMs' partial sums and counters: one pair shared by all of them (their
    /// dispatches run one after the other and leave the counters zeroed), replaced by a
    /// larger one when a GEMM needs more.
    pub split_scratch: Option<(wgpu::Buffer, wgpu::Buffer)>,
    /// The f16 GEMMs' row scales: one buffer shared by all of them (each writes its scales
    /// right before it runs), replaced by a larger one when a GEMM has more tokens.
    pub row_scales: Option<wgpu::Buffer>,
    /// Their activations in f16 (x / s), shared the same way.
    pub x16: Option<wgpu::Buffer>,
    /// Whose activations those two hold, where they are a node's (its rows and columns, and the
    /// activations' pass that wrote them): the next f16 GEMM over the same rows with the same
    /// pass reuses them (the q, k and v projections of one norm, the gate and the up).
    pub x16_of: Option<(NodeIndex, usize, usize, String)>,
    /// Dispatches recorded since the last [`Lowered::take_dispatches`].
    dispatches: Vec<Dispatch>,
}

impl Lowered {
    /// The dispatches recorded so far, handed over.
    pub fn take_dispatches(&mut self) -> Vec<Dispatch> {
        std::mem::take(&mut self.dispatches)
    }
}

/// The lowering of one node: its op and inputs, what every node needs, and where its params
/// buffers, scratch buffers and dispatches go.
pub(crate) struct LowerCtx<'a> {
    pub gpu: &'a Gpu,
    pub kernels: &'a Kernels,
    pub graph: &'a Graph,
    mats: &'a HashMap<String, GpuWeight>,
    vecs: &'a HashMap<String, (wgpu::Buffer, FloatType)>,
    values: &'a dyn Fn(NodeIndex) -> Result<wgpu::Buffer, String>,
    chunks: &'a dyn Fn(NodeIndex) -> Option<KvChunks>,
    pub acc: &'a mut Lowered,
    pub n: NodeIndex,
    pub node: &'a Node,
    pub op: &'a Op,
    pub ins: Vec<NodeIndex>,
    /// [`LowerEnv::row_batch`].
    pub row_batch: bool,
}

impl<'a> LowerCtx<'a> {
    /// The lowering of node `n` (an op) into `acc`.
    pub fn new(env: LowerEnv<'a>, acc: &'a mut Lowered, n: NodeIndex) -> Result<Self, String> {
        let node = env.graph.node(n);
        let op = node.op().ok_or_else(|| format!("node %{} {} is not an op", node.id, node.name))?;
        Ok(LowerCtx {
            gpu: env.gpu,
            kernels: env.kernels,
            graph: env.graph,
            mats: env.mats,
            vecs: env.vecs,
            values: env.values,
            chunks: env.chunks,
            acc,
            n,
            node,
            op,
            ins: env.graph.inputs(n),
            row_batch: env.row_batch,
        })
    }

    pub fn dev(&self) -> &'a wgpu::Device {
        &self.gpu.device
    }

    /// The buffer of node `n`'s value.
    pub fn buf(&self, n: NodeIndex) -> Result<wgpu::Buffer, String> {
        (self.values)(n)
    }

    /// The chunks of node `n`'s value where it is a chunked KV cache ([`super::kv`]).
    pub fn kv_chunks(&self, n: NodeIndex) -> Option<KvChunks> {
        (self.chunks)(n)
    }

    /// The buffer of input `i`'s value.
    pub fn input(&self, i: usize) -> Result<wgpu::Buffer, String> {
        self.buf(self.ins[i])
    }

    /// The buffer of the node's value.
    pub fn out(&self) -> Result<wgpu::Buffer, String> {
        self.buf(self.n)
    }

    /// The shape of input `i`.
    pub fn shape_of(&self, i: usize) -> Vec<usize> {
        self.graph.node(self.ins[i]).ty.shape.clone()
    }

    /// A kernel error, named by the node.
    pub fn kerr(&self) -> impl Fn(GpuError) -> String + 'a {
        let node = self.node;
        move |e| format!("node %{} {}: {e}", node.id, node.name)
    }

    /// An error of the node.
    pub fn fail(&self, msg: impl std::fmt::Display) -> String {
        format!("node %{} {}: {msg}", self.node.id, self.node.name)
    }

    fn wname(&self, i: usize) -> Option<String> {
        self.graph.node(self.ins[i]).weight().map(|p| p.name.clone())
    }

    /// The matrix weight at input `i`.
    pub fn mat(&self, i: usize) -> Result<&'a GpuWeight, String> {
        let name = self.wname(i).ok_or_else(|| format!("node {}: input {i} is not a weight", self.node.name))?;
        self.mats.get(&name).ok_or_else(|| format!("weight {name} not uploaded"))
    }

    /// The vector weight at input `i` (`None`: not a vector weight).
    pub fn vecw(&self, i: usize) -> Option<&'a (wgpu::Buffer, FloatType)> {
        let vecs = self.vecs;
        self.wname(i).and_then(|nm| vecs.get(&nm))
    }

    /// The vector weight at input `i` and its dtype, or an error saying it is not one.
    pub fn vec_weight(&self, i: usize) -> Result<(wgpu::Buffer, FloatType), String> {
        match self.vecw(i) {
            Some((b, t)) => Ok((b.clone(), *t)),
            None => Err(self.fail(format!("input {i} must be a vector weight"))),
        }
    }

    /// Records the node's one dispatch of `spec`: `params` at binding 0, input 0 at 1, the
    /// output at 2, then `binds`.
    pub fn push_one(&mut self, spec: KernelSpec, params: &[u8], binds: &[(u32, wgpu::Buffer)], groups: [u32; 3]) -> Result<(), String> {
        let kernel = self.kernels.get(spec).map_err(self.kerr())?;
        let pb = self.uni(params)?;
        let (x, out) = (self.input(0)?, self.out()?);
        let mut all: Vec<(u32, &wgpu::Buffer)> = vec![(0, &pb), (1, &x), (2, &out)];
        all.extend(binds.iter().map(|(i, b)| (*i, b)));
        let bg = kernel.bind_buffers(self.dev(), &all);
        self.push(kernel, bg, groups);
        Ok(())
    }

    /// The norm weight of a norm or fused-norm op (at the slot the op defines).
    pub fn norm_w(&self) -> Result<Option<&'a (wgpu::Buffer, FloatType)>, String> {
        self.op.norm_weight_input().map(|i| self.vecw(i).ok_or_else(|| format!("node {}: norm weight missing", self.node.name))).transpose()
    }

    /// A uniform params buffer holding `bytes`.
    pub fn uni(&mut self, bytes: &[u8]) -> Result<wgpu::Buffer, String> {
        let b = self
            .gpu
            .try_buffer(
                &format!("params of {}", self.node.name),
                (bytes.len() as u64 + 15) / 16 * 16,
                wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                None,
            )
            .map_err(|e| e.to_string())?;
        self.gpu.queue.write_buffer(&b, 0, bytes);
        self.acc.params.push(b.clone());
        Ok(b)
    }

    /// Records a dispatch of the node.
    pub fn push(&mut self, kernel: Arc<Kernel>, bind: wgpu::BindGroup, groups: [u32; 3]) {
        self.acc.dispatches.push(Dispatch { kernel, bind, groups, node: self.n });
    }

    /// The error of a family asked to lower an op of another.
    fn not_ours(&self, family: &str) -> String {
        self.fail(format!("{} is not an op of the {family} kernels", self.op.name()))
    }
}

/// An op the CPU reference executor runs but no WGSL kernel lowers yet.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("node %{node} {name}: op `{op}` has no GPU lowering (only the CPU executor runs it)")]
pub struct UnsupportedOp {
    pub node: u32,
    pub name: String,
    pub op: &'static str,
}

/// Names of the ops (`Op::name`) that no WGSL kernel lowers yet (none at present): the GPU
/// executor refuses graphs holding them with an [`UnsupportedOp`].
pub const CPU_ONLY_OPS: &[&str] = &[];

/// Whether the GPU executor lowers `op`.
pub fn gpu_lowers(op: &Op) -> bool {
    !CPU_ONLY_OPS.contains(&op.name())
}

/// The first node of `g` the GPU executor cannot lower, in graph order.
pub fn unsupported_op(g: &Graph) -> Option<UnsupportedOp> {
    g.order().into_iter().find_map(|n| {
        let node = g.node(n);
        match &node.kind {
            markbase_graph::NodeKind::Op { op } if !gpu_lowers(op) => Some(UnsupportedOp { node: node.id, name: node.name.clone(), op: op.name() }),
            _ => None,
        }
    })
}

/// Lowers the node of `cx` to its dispatches: the op's family does it.
pub(crate) fn lower(cx: &mut LowerCtx) -> Result<(), String> {
    if !gpu_lowers(cx.op) {
        return Err(UnsupportedOp { node: cx.node.id, name: cx.node.name.clone(), op: cx.op.name() }.to_string());
    }
    match cx.op {
        Op::Reshape { .. } => Ok(()),
        Op::Embed { .. } => embed::lower(cx),
        Op::MatMul | Op::GatherMatMul | Op::GroupedMatMul | Op::NormGeGlu { .. } | Op::NormMatMul { .. } => matmul::lower(cx),
        Op::RmsNorm { .. } | Op::RmsNormAdd { .. } => rmsnorm::lower(cx),
        Op::Rope { .. } | Op::NormRope { .. } | Op::KvWriteNormRope { .. } => rope::lower(cx),
        Op::KvWrite { .. } => kv_write::lower(cx),
        Op::Attention { .. } | Op::NormRopeAttention { .. } => attention::lower(cx),
        Op::Binary { .. } | Op::Unary { .. } | Op::GeGlu => elementwise::lower(cx),
        Op::MoeGroup { .. } | Op::TopK { .. } | Op::TopKSoftmax | Op::WeightedSum => routing::lower(cx),
        Op::Slice { .. } => copy::lower(cx),
        Op::Argmax | Op::Sample | Op::ArgmaxRows | Op::SampleRows => argmax::lower(cx),
        Op::KvWriteBatched | Op::AttentionBatched { .. } => batched::lower(cx),
        Op::Clamp | Op::Rope2d { .. } | Op::FullAttention { .. } | Op::AvgPool { .. } | Op::LayerNorm { .. } | Op::Scatter => vision::lower(cx),
        Op::Conv2d { .. } | Op::CumulativeGroupNorm { .. } | Op::MaskRows | Op::StridedRows { .. } | Op::Glu | Op::DepthwiseConv1d | Op::AudioAttention { .. } => audio::lower(cx),
    }
}
