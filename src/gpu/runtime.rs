//! The GPU runtime: executes compiled graphs phase by phase on a wgpu device.
//!
//! Preparing a graph creates, once, every pool buffer the liveness pass
//! assigned, the graph's input buffers, one uniform params buffer per dispatch
//! and every bind group. A step then writes the host inputs (token ids,
//! positions, sampling parameters: a few bytes), encodes each phase as one
//! compute pass in one command buffer, submits it, and reads back only the
//! token (and the logits when asked).

use std::collections::HashMap;
use std::sync::Arc;

use petgraph::graph::NodeIndex;

use markbase_graph::ir::{InputKind, NodeKind, StateKind};
use markbase_graph::ops::DType;
use markbase_graph::passes::{Compiled, Storage};
use markbase_graph::quant::FloatType;

use crate::cpu::exec::StepInputs;
use crate::gpu::device::{Backend, Gpu, GpuOptions};
use crate::gpu::kernels::Kernels;
use crate::gpu::kv::KvChunks;
use crate::gpu::ops::{self, Dispatch, LowerCtx, LowerEnv, Lowered};
use crate::gpu::weights::{upload_vector, upload_weight, GpuWeight};
use crate::exec::{Executor, GraphKey, StepOutput};
use crate::weights::Weights;

/// A graph made ready to run.
struct Prepared {
    pool: Vec<wgpu::Buffer>,
    inputs: HashMap<InputKind, wgpu::Buffer>,
    /// Dispatches of each phase.
    phases: Vec<Vec<Dispatch>>,
    /// Scratch buffers owned by single nodes (attention partials), kept alive.
    _scratch: Vec<wgpu::Buffer>,
    _params: Vec<wgpu::Buffer>,
    token: NodeIndex,
    /// Bytes of the token output (4, or 4 per row of a batch's decode step).
    token_bytes: u64,
    logits: NodeIndex,
    /// Staging ring of the token readbacks (steps in flight take turns).
    token_ring: Vec<wgpu::Buffer>,
    next_slot: usize,
    logits_staging: wgpu::Buffer,
    logits_bytes: u64,
    queries: Option<(Profile, Queries)>,
}

pub use crate::exec::{Profile, ProfileResult, StepStats};

struct Queries {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    staging: wgpu::Buffer,
    count: u32,
}

/// Token readback slots per prepared graph: more than the steps ever in flight.
const RING: usize = 4;

/// A submitted step whose token has not been read yet.
struct InFlight {
    key: GraphKey,
    slot: usize,
    want_logits: bool,
    profiled: Option<Profile>,
    /// The step's last submission: reading its token waits for it alone.
    submission: Option<wgpu::SubmissionIndex>,
}

/// What the sequences of one model share on a GPU: the device, the kernel cache and the
/// weights as stored. Cloning it clones handles.
#[derive(Clone)]
pub struct GpuShared {
    pub gpu: Arc<Gpu>,
    pub kernels: Arc<Kernels>,
    mats: Arc<HashMap<String, GpuWeight>>,
    vecs: Arc<HashMap<String, (wgpu::Buffer, FloatType)>>,
    check_nan: bool,
    /// The byte limit of one KV-cache buffer; larger caches are chunked ([`crate::gpu::kv`]).
    kv_binding: u64,
}

impl GpuShared {
    /// Opens the device and uploads every weight as stored.
    pub fn new(backend: Option<Backend>, weights: &Weights, check_nan: bool) -> Result<Self, String> {
        let gpu = Gpu::with_options(&GpuOptions { backend, ..Default::default() }).map_err(err)?;
        Self::with_gpu(gpu, weights, check_nan, None)
    }

    /// As [`GpuShared::new`] on an opened device; `max_chunk_bytes` forces
    /// small weight chunks (tests of the chunked path).
    pub fn with_gpu(gpu: Gpu, weights: &Weights, check_nan: bool, max_chunk_bytes: Option<u64>) -> Result<Self, String> {
        let kernels = Arc::new(Kernels::for_gpu(&gpu).map_err(err)?);
        Self::upload(Arc::new(gpu), kernels, weights, check_nan, max_chunk_bytes)
    }

    /// Other weights on the same device and kernel cache (tests holding one model's weights
    /// whole and another's in small chunks, without building the kernels twice).
    pub fn with_weights(&self, weights: &Weights, max_chunk_bytes: Option<u64>) -> Result<Self, String> {
        Self::upload(self.gpu.clone(), self.kernels.clone(), weights, self.check_nan, max_chunk_bytes)
    }

    fn upload(gpu: Arc<Gpu>, kernels: Arc<Kernels>, weights: &Weights, check_nan: bool, max_chunk_bytes: Option<u64>) -> Result<Self, String> {
        let mut mats = HashMap::new();
        let mut vecs = HashMap::new();
        for (name, w) in &weights.map {
            if w.param.module {
                mats.insert(name.clone(), upload_weight(&gpu, w, max_chunk_bytes).map_err(err)?);
            } else {
                vecs.insert(name.clone(), upload_vector(&gpu, &w.weight, name).map_err(err)?);
            }
        }
        let kv_binding = crate::gpu::kv::binding_limit(&gpu, None);
        Ok(GpuShared { gpu, kernels, mats: Arc::new(mats), vecs: Arc::new(vecs), check_nan, kv_binding })
    }

    /// Lowers the byte limit of the sessions' KV-cache buffers below the adapter's binding
    /// limit (tests of the chunked caches); never raises it.
    pub fn lower_kv_binding(&mut self, bytes: Option<u64>) {
        self.kv_binding = crate::gpu::kv::binding_limit(&self.gpu, bytes);
    }
}

/// Runs compiled graphs for one sequence on a GPU: its KV caches, its prepared graphs (pool
/// buffers, bind groups) and its steps in flight, over the shared device and weights.
pub struct GpuExecutor {
    pub gpu: Arc<Gpu>,
    pub kernels: Arc<Kernels>,
    mats: Arc<HashMap<String, GpuWeight>>,
    vecs: Arc<HashMap<String, (wgpu::Buffer, FloatType)>>,
    states: HashMap<StateKind, KvChunks>,
    prepared: HashMap<GraphKey, Prepared>,
    check_nan: bool,
    kv_binding: u64,
    /// Profiling of the following steps.
    pub profile: Profile,
    /// GPU times of the last profiled step.
    pub profiled: ProfileResult,
    /// Counters of the last step.
    pub last: StepStats,
    /// Submissions since creation.
    pub total_submits: usize,
    in_flight: std::collections::VecDeque<InFlight>,
}

/// What a state buffer is, for messages: "KV cache of layer 3 (keys)".
fn state_purpose(kind: &StateKind) -> String {
    match kind {
        StateKind::KvCache { layer, value } => format!("KV cache of layer {layer} ({})", if *value { "values" } else { "keys" }),
    }
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

impl GpuExecutor {
    /// Opens the device and uploads every weight as stored (a sequence of its own).
    pub fn new(backend: Option<Backend>, weights: Arc<Weights>, check_nan: bool) -> Result<Self, String> {
        Ok(Self::for_session(&GpuShared::new(backend, &weights, check_nan)?))
    }

    /// A new sequence on shared device state.
    pub fn for_session(s: &GpuShared) -> Self {
        GpuExecutor {
            gpu: s.gpu.clone(),
            kernels: s.kernels.clone(),
            mats: s.mats.clone(),
            vecs: s.vecs.clone(),
            states: HashMap::new(),
            prepared: HashMap::new(),
            check_nan: s.check_nan,
            kv_binding: s.kv_binding,
            profile: Profile::Off,
            profiled: ProfileResult::default(),
            last: StepStats::default(),
            total_submits: 0,
            in_flight: Default::default(),
        }
    }

    pub fn adapter_summary(&self) -> String {
        self.gpu.info.summary()
    }

    /// The buffers of state `kind` of `shape` (`[slots, kv_heads, head_dim]`), allocated on
    /// first use: chunked where one buffer would exceed the KV binding limit.
    fn state_buffer(&mut self, kind: &StateKind, shape: &[usize]) -> Result<KvChunks, String> {
        if let Some(b) = self.states.get(kind) {
            return Ok(b.clone());
        }
        let slots = shape.first().copied().unwrap_or(1);
        let row = shape.iter().skip(1).product::<usize>() * 4;
        let b = KvChunks::alloc(&self.gpu, &state_purpose(kind), slots, row, self.kv_binding)?;
        self.states.insert(kind.clone(), b.clone());
        Ok(b)
    }

    /// Lowers the byte limit of this sequence's KV-cache buffers (before its first step; see
    /// [`GpuShared::lower_kv_binding`]).
    pub fn lower_kv_binding(&mut self, bytes: Option<u64>) {
        self.kv_binding = crate::gpu::kv::binding_limit(&self.gpu, bytes).min(self.kv_binding);
    }

    fn prepare(&mut self, c: &Compiled) -> Result<Prepared, String> {
        let g = &c.graph;
        let pool: Vec<wgpu::Buffer> = c
            .alloc
            .pool_sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| self.gpu.try_storage(&format!("pool buffer {i}"), s as u64))
            .collect::<Result<_, _>>()
            .map_err(err)?;
        let mut inputs = HashMap::new();
        let mut input_bufs: HashMap<u32, wgpu::Buffer> = HashMap::new();
        let mut state_bufs: HashMap<u32, KvChunks> = HashMap::new();
        for n in g.g.node_indices() {
            let node = g.node(n);
            match &node.kind {
                NodeKind::Input { input } => {
                    let b = self.gpu.try_storage(&format!("input {}", node.name), node.ty.bytes() as u64).map_err(err)?;
                    inputs.insert(*input, b.clone());
                    input_bufs.insert(node.id, b);
                }
                NodeKind::State { state } => {
                    let b = self.state_buffer(state, &node.ty.shape)?;
                    state_bufs.insert(node.id, b);
                }
                _ => {}
            }
        }
        // The buffer holding a node's value.
        let buf = |n: NodeIndex| -> Result<wgpu::Buffer, String> {
            match c.alloc.storage[n.index()] {
                Storage::Pool(b) => Ok(pool[b as usize].clone()),
                Storage::Input(id) => input_bufs.get(&id).cloned().ok_or_else(|| format!("input {id} has no buffer")),
                Storage::State(id) => match state_bufs.get(&id) {
                    Some(c) if c.chunked() => Err(format!("state {id} is split across {} buffers", c.bufs.len())),
                    Some(c) => Ok(c.bufs[0].clone()),
                    None => Err(format!("state {id} has no buffer")),
                },
                Storage::Weight(_) => Err(format!("node {} is a weight, not a value", g.node(n).name)),
            }
        };
        // The chunks of a chunked KV cache.
        let chunks = |n: NodeIndex| -> Option<KvChunks> {
            match c.alloc.storage[n.index()] {
                Storage::State(id) => state_bufs.get(&id).filter(|c| c.chunked()).cloned(),
                _ => None,
            }
        };
        let env = LowerEnv { gpu: &self.gpu, kernels: &self.kernels, graph: g, mats: &self.mats, vecs: &self.vecs, values: &buf, chunks: &chunks, row_batch: g.row_batch() };
        let mut acc = Lowered::default();
        let mut phases: Vec<Vec<Dispatch>> = vec![];
        for ph in &c.schedule.phases {
            for &n in ph {
                ops::lower(&mut LowerCtx::new(env, &mut acc, n)?)?;
            }
            phases.push(acc.take_dispatches());
        }
        let token = g.output("token").ok_or("graph has no token output")?;
        let logits = g.output("logits").ok_or("graph has no logits output")?;
        if g.node(token).ty.dtype != DType::U32 {
            return Err("token output is not u32".into());
        }
        let logits_bytes = g.node(logits).ty.bytes() as u64;
        let token_bytes = g.node(token).ty.bytes() as u64;
        let token_ring = (0..RING).map(|_| self.gpu.try_staging("token staging", token_bytes)).collect::<Result<_, _>>().map_err(err)?;
        let logits_staging = self.gpu.try_staging("logits staging", logits_bytes).map_err(err)?;
        Ok(Prepared {
            pool,
            inputs,
            phases,
            _scratch: acc.scratch,
            _params: acc.params,
            token,
            token_bytes,
            logits,
            token_ring,
            next_slot: 0,
            logits_staging,
            logits_bytes,
            queries: None,
        })
    }

    /// The kernel of each dispatch of graph `key` (prepared by a step), in execution order.
    pub fn dispatch_kernels(&self, key: GraphKey) -> Option<Vec<(NodeIndex, String)>> {
        let p = self.prepared.get(&key)?;
        Some(p.phases.iter().flatten().map(|d| (d.node, d.kernel.name.clone())).collect())
    }

    /// The value of output `name` of graph `key` (compiled as `c`) after its last step, as
    /// raw 32-bit words (f32 values as their bits). Waits for the steps in flight.
    pub fn read_output(&mut self, key: GraphKey, c: &Compiled, name: &str) -> Result<Vec<u32>, String> {
        self.drain()?;
        let n = c.graph.output(name).ok_or_else(|| format!("graph has no output {name}"))?;
        let p = self.prepared.get(&key).ok_or("graph not run yet")?;
        let b = match c.alloc.storage[c.graph.storage_root(n).index()] {
            Storage::Pool(b) => p.pool[b as usize].clone(),
            s => return Err(format!("output {name} is not an intermediate value ({s:?})")),
        };
        self.gpu.read_u32(&b, c.graph.node(n).ty.numel()).map_err(err)
    }

    /// The contents of state `kind` (a KV cache) as f32 values, after the steps in flight.
    pub fn read_state(&mut self, kind: &StateKind) -> Result<Vec<f32>, String> {
        self.drain()?;
        let s = self.states.get(kind).ok_or_else(|| format!("no state {kind:?}"))?.clone();
        let mut v = vec![];
        for b in &s.bufs {
            v.extend(self.gpu.read_f32(b, (b.size() / 4) as usize).map_err(err)?);
        }
        Ok(v)
    }

    fn make_queries(&self, p: &Prepared, level: Profile) -> Result<Option<Queries>, String> {
        let count = match level {
            Profile::Off => return Ok(None),
            Profile::Phases if self.gpu.info.timestamps => 2 * p.phases.len(),
            Profile::Kernels if self.gpu.info.timestamps_inside_passes => p.phases.iter().map(|ph| ph.len() + 1).sum(),
            _ => return Ok(None),
        }
        .min(4096) as u32;
        let scope = self.gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let set = self.gpu.device.create_query_set(&wgpu::QuerySetDescriptor { label: Some("timestamps"), ty: wgpu::QueryType::Timestamp, count });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(format!("timestamp query set of {count} queries: {e}"));
        }
        let bytes = count as u64 * 8;
        let resolve = self
            .gpu
            .try_buffer("timestamps", bytes, wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC, None)
            .map_err(err)?;
        let staging = self.gpu.try_staging("timestamps staging", bytes).map_err(err)?;
        Ok(Some(Queries { set, resolve, staging, count }))
    }

    /// An error if the device reported one outside any error scope (checked once per
    /// step: an atomic load).
    fn check_device(&self) -> Result<(), String> {
        match self.gpu.fault() {
            Some(e) => Err(format!("device error during a step: {e}")),
            None => Ok(()),
        }
    }

    /// Destroys every KV-cache buffer while prepared steps still bind them, so that the
    /// next step's submission fails validation (tests of the device-error path).
    #[doc(hidden)]
    pub fn destroy_states(&self) {
        for b in self.states.values().flat_map(|s| &s.bufs) {
            b.destroy();
        }
    }

    /// Maps a staging buffer after the queue drained and copies its bytes out.
    fn read_staging(&self, b: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>, String> {
        self.read_staging_after(b, bytes, None)
    }

    /// Like `read_staging`, waiting only for submission `idx` (later ones keep running).
    fn read_staging_after(&self, b: &wgpu::Buffer, bytes: u64, idx: Option<wgpu::SubmissionIndex>) -> Result<Vec<u8>, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        b.map_async(wgpu::MapMode::Read, ..bytes.max(4), move |r| {
            let _ = tx.send(r);
        });
        self.gpu.device.poll(wgpu::PollType::Wait { submission_index: idx, timeout: None }).map_err(err)?;
        rx.recv().map_err(err)?.map_err(err)?;
        let v = b.get_mapped_range(..bytes.max(4)).map_err(err)?[..bytes as usize].to_vec();
        b.unmap();
        Ok(v)
    }

    fn value_buffer(p: &Prepared, c: &Compiled, n: NodeIndex) -> wgpu::Buffer {
        match c.alloc.storage[n.index()] {
            Storage::Pool(b) => p.pool[b as usize].clone(),
            _ => unreachable!("outputs live in the pool"),
        }
    }

    /// Debug path: one submission per node, each output read back and checked.
    fn run_checked(&self, p: &Prepared, c: &Compiled) -> Result<(), String> {
        let g = &c.graph;
        for ph in &p.phases {
            let mut i = 0;
            while i < ph.len() {
                let node = ph[i].node;
                let mut enc = self.gpu.device.create_command_encoder(&Default::default());
                {
                    let mut pass = enc.begin_compute_pass(&Default::default());
                    while i < ph.len() && ph[i].node == node {
                        let d = &ph[i];
                        d.kernel.dispatch(&mut pass, &d.bind, d.groups);
                        i += 1;
                    }
                }
                self.gpu.queue.submit([enc.finish()]);
                let nd = g.node(node);
                if nd.ty.dtype != DType::F32 || nd.op().is_some_and(|o| o.writes_state()) {
                    continue;
                }
                let b = Self::value_buffer(p, c, g.storage_root(node));
                let v = self.gpu.read_f32(&b, nd.ty.numel()).map_err(err)?;
                if let Some(j) = v.iter().position(|x| !x.is_finite()) {
                    let weights: Vec<String> =
                        g.inputs(node).iter().filter_map(|&w| g.node(w).weight().map(|p| p.name.clone())).collect();
                    return Err(format!(
                        "NaN/Inf at node %{} {} ({}), element {j} = {}; weights: [{}]",
                        nd.id,
                        nd.name,
                        nd.op().map(|o| o.name()).unwrap_or("?"),
                        v[j],
                        weights.join(", ")
                    ));
                }
            }
        }
        Ok(())
    }
}

impl GpuExecutor {
    /// Encodes and submits one step. `feed_device`: the token input is the token the
    /// previous step of this (single-token) graph produced, already copied on the device.
    fn submit_step(&mut self, key: GraphKey, c: &Compiled, step: &StepInputs, want_logits: bool, feed_device: bool) -> Result<(), String> {
        if !self.prepared.contains_key(&key) {
            let p = self.prepare(c)?;
            self.prepared.insert(key, p);
        }
        let level = if self.check_nan { Profile::Off } else { self.profile };
        if self.prepared[&key].queries.as_ref().map(|q| q.0) != Some(level) && level != Profile::Off {
            let q = self.make_queries(&self.prepared[&key], level)?;
            self.prepared.get_mut(&key).unwrap().queries = q.map(|q| (level, q));
        }
        let t0 = std::time::Instant::now();
        let p = &self.prepared[&key];
        let queries = if level == Profile::Off { None } else { p.queries.as_ref().map(|q| &q.1) };
        let q = &self.gpu.queue;
        for (kind, b) in &p.inputs {
            match kind {
                InputKind::Tokens if feed_device => {}
                InputKind::Tokens => q.write_buffer(b, 0, bytemuck::cast_slice(step.tokens)),
                InputKind::Positions => q.write_buffer(b, 0, bytemuck::cast_slice(step.positions)),
                InputKind::AttnPositions => {
                    let v = crate::cpu::exec::attn_positions(step, (b.size() / 4) as usize)?;
                    q.write_buffer(b, 0, bytemuck::cast_slice(&v));
                }
                InputKind::SamplingParams => q.write_buffer(b, 0, bytemuck::cast_slice(&step.sampling)),
                InputKind::RecentTokens => {
                    let n = (b.size() / 4) as usize;
                    let mut r = step.recent[step.recent.len().saturating_sub(n)..].to_vec();
                    r.resize(n, 0);
                    q.write_buffer(b, 0, bytemuck::cast_slice(&r));
                }
                // the inputs taken as a step gives them
                _ => {
                    let bytes: &[u8] = match kind {
                        InputKind::SlotIds => bytemuck::cast_slice(step.slot_ids),
                        InputKind::RowSampling => bytemuck::cast_slice(step.row_sampling),
                        InputKind::RowRecent => bytemuck::cast_slice(step.row_recent),
                        InputKind::AudioFeatures => bytemuck::cast_slice(step.features),
                        InputKind::AudioValid => bytemuck::cast_slice(step.audio_valid),
                        InputKind::Pixels => bytemuck::cast_slice(step.pixels),
                        InputKind::PatchX => bytemuck::cast_slice(step.patch_x),
                        InputKind::PatchY => bytemuck::cast_slice(step.patch_y),
                        InputKind::SoftRows => bytemuck::cast_slice(step.soft_rows),
                        _ => bytemuck::cast_slice(step.soft_index),
                    };
                    if bytes.len() as u64 != b.size() {
                        return Err(format!("input {kind:?}: {} bytes given, the graph takes {}", bytes.len(), b.size()));
                    }
                    q.write_buffer(b, 0, bytes);
                }
            }
        }
        let slot = p.next_slot;
        let token_staging = &p.token_ring[slot];
        // Single-token graphs feed their token back to their own input on the device.
        let feedback = p.inputs.get(&InputKind::Tokens).filter(|b| b.size() == 4);
        let token_buf = Self::value_buffer(p, c, p.token);
        let logits_buf = Self::value_buffer(p, c, p.logits);
        let mut stats = StepStats { phases: p.phases.len(), ..Default::default() };
        let mut submitted: Option<wgpu::SubmissionIndex> = None;
        // The end of a step: the token to its readback slot (and to the graph's own
        // input, for the next pipelined step), the logits when asked for.
        let outputs = |enc: &mut wgpu::CommandEncoder| {
            enc.copy_buffer_to_buffer(&token_buf, 0, token_staging, 0, p.token_bytes);
            if let Some(f) = feedback.filter(|_| p.token_bytes == 4) {
                enc.copy_buffer_to_buffer(&token_buf, 0, f, 0, 4);
            }
            if want_logits {
                enc.copy_buffer_to_buffer(&logits_buf, 0, &p.logits_staging, 0, p.logits_bytes);
            }
        };
        if self.check_nan {
            self.run_checked(p, c)?;
            stats.submits = p.phases.iter().map(|ph| ph.len()).sum();
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            outputs(&mut enc);
            submitted = Some(q.submit([enc.finish()]));
        } else {
            let last = p.phases.len() - 1;
            let mut qi = 0u32;
            for (pi, ph) in p.phases.iter().enumerate() {
                let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("phase") });
                {
                    let tw = match (level, queries) {
                        (Profile::Phases, Some(q)) => Some(wgpu::ComputePassTimestampWrites {
                            query_set: &q.set,
                            beginning_of_pass_write_index: Some(2 * pi as u32),
                            end_of_pass_write_index: Some(2 * pi as u32 + 1),
                        }),
                        _ => None,
                    };
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("phase"), timestamp_writes: tw });
                    let per_kernel = level == Profile::Kernels && queries.is_some();
                    if per_kernel && qi < queries.unwrap().count {
                        pass.write_timestamp(&queries.unwrap().set, qi);
                        qi += 1;
                    }
                    for d in ph {
                        d.kernel.dispatch(&mut pass, &d.bind, d.groups);
                        if per_kernel && qi < queries.unwrap().count {
                            pass.write_timestamp(&queries.unwrap().set, qi);
                            qi += 1;
                        }
                    }
                }
                stats.dispatches += ph.len();
                if pi == last {
                    if let Some(q) = queries {
                        enc.resolve_query_set(&q.set, 0..q.count, &q.resolve, 0);
                        enc.copy_buffer_to_buffer(&q.resolve, 0, &q.staging, 0, q.count as u64 * 8);
                    }
                    outputs(&mut enc);
                }
                submitted = Some(q.submit([enc.finish()]));
                stats.submits += 1;
            }
        }
        stats.encode_s = t0.elapsed().as_secs_f64();
        self.total_submits += stats.submits;
        self.last = stats;
        let profiled = queries.map(|_| level);
        self.prepared.get_mut(&key).unwrap().next_slot = (slot + 1) % RING;
        self.in_flight.push_back(InFlight { key, slot, want_logits, profiled, submission: submitted });
        self.check_device()?;
        if self.in_flight.len() >= RING {
            return Err("too many steps in flight".into());
        }
        Ok(())
    }

    /// Waits for the oldest step in flight and reads its token (and logits, profile).
    fn take_step(&mut self) -> Result<StepOutput, String> {
        let out = self.take_step_unchecked();
        // a failed map or poll after a device error reports the device error
        self.check_device()?;
        out
    }

    fn take_step_unchecked(&mut self) -> Result<StepOutput, String> {
        let f = self.in_flight.pop_front().ok_or("no step in flight")?;
        let p = &self.prepared[&f.key];
        let want_logits = f.want_logits;
        let tok = self.read_staging_after(&p.token_ring[f.slot], p.token_bytes, f.submission.clone())?;
        let tokens: Vec<u32> = tok.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let token = *tokens.first().ok_or("the token output is empty")?;
        let logits = if want_logits {
            let b = self.read_staging(&p.logits_staging, p.logits_bytes)?;
            Some(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        } else {
            None
        };
        let level = f.profiled.unwrap_or(Profile::Off);
        let queries = if f.profiled.is_some() { p.queries.as_ref().map(|q| &q.1) } else { None };
        if let Some(q) = queries {
            let b = self.read_staging(&q.staging, q.count as u64 * 8)?;
            let ts: Vec<u64> = b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
            let period = self.gpu.queue.get_timestamp_period() as f64 * 1e-9;
            let dt = |a: u64, b: u64| b.saturating_sub(a) as f64 * period;
            let mut r = ProfileResult::default();
            match level {
                Profile::Phases => r.phases = (0..p.phases.len()).map(|i| dt(ts[2 * i], ts[2 * i + 1])).collect(),
                Profile::Kernels => {
                    let mut i = 0;
                    for ph in &p.phases {
                        let start = i;
                        for d in ph {
                            if i + 1 < ts.len() {
                                r.dispatches.push((d.node, dt(ts[i], ts[i + 1])));
                            }
                            i += 1;
                        }
                        r.phases.push(if i < ts.len() { dt(ts[start], ts[i]) } else { 0.0 });
                        i += 1;
                    }
                }
                Profile::Off => {}
            }
            self.profiled = r;
        }
        Ok(StepOutput { logits, token, tokens })
    }

    /// Reads back and drops every step still in flight.
    fn drain(&mut self) -> Result<(), String> {
        while !self.in_flight.is_empty() {
            self.take_step()?;
        }
        Ok(())
    }
}

impl Executor for GpuExecutor {
    fn run(&mut self, key: GraphKey, c: &Compiled, step: &StepInputs, want_logits: bool) -> Result<StepOutput, String> {
        self.drain()?;
        self.submit_step(key, c, step, want_logits, false)?;
        self.take_step()
    }

    fn pipelines(&self) -> bool {
        !self.check_nan
    }

    fn submit(&mut self, key: GraphKey, c: &Compiled, step: &StepInputs, feed_device: bool) -> Result<(), String> {
        self.submit_step(key, c, step, false, feed_device)
    }

    fn take(&mut self) -> Result<u32, String> {
        self.take_step().map(|o| o.token)
    }


    fn reset(&mut self) {
        let _ = self.drain();
    }

    fn describe(&self) -> String {
        format!("gpu: {}", self.gpu.info.summary())
    }

    fn stats(&self) -> Option<StepStats> {
        Some(self.last)
    }

    fn kernels(&self, key: GraphKey) -> Option<Vec<(NodeIndex, String)>> {
        self.dispatch_kernels(key)
    }

    fn set_profile(&mut self, p: Profile) -> bool {
        self.profile = p;
        true
    }

    fn profile(&self) -> Option<ProfileResult> {
        Some(self.profiled.clone())
    }
}
