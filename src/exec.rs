//! What runs compiled graphs for one sequence: the [`Executor`] trait, the types its steps
//! speak, and the CPU reference executor. The GPU executor (`gpu::runtime`) implements the
//! same trait; neither depends on the high-level API (`engine`, `model`).

use std::sync::Arc;

use petgraph::graph::NodeIndex;

use markbase_graph::passes::Compiled;

use crate::cpu::exec::{self, CpuState, CpuWeights, StepInputs};
use crate::weights::Weights;

/// What one step returns.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// Logits `[rows, V]` flattened, when asked for.
    pub logits: Option<Vec<f32>>,
    /// The sampled (or argmax) token of the last position.
    pub token: u32,
    /// Every token of the token output: one per row of a batch's decode step (else `[token]`).
    pub tokens: Vec<u32>,
}

/// Key of a compiled graph: tokens per step, outputs, device sampling, image rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub tokens: usize,
    pub all_logits: bool,
    pub sample: bool,
    /// A prefill step taking image soft-token rows (one per token, see
    /// `BuildOptions::soft_rows`; Gemma 3: with attention bounds).
    pub images: bool,
}

/// Timestamp profiling of steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Profile {
    #[default]
    Off,
    /// GPU time of each phase (timestamps at pass boundaries).
    Phases,
    /// GPU time of each dispatch (timestamps inside passes, where the adapter has them).
    Kernels,
}

/// GPU times of the last profiled step.
#[derive(Clone, Debug, Default)]
pub struct ProfileResult {
    /// Seconds per phase.
    pub phases: Vec<f64>,
    /// (node index, seconds) per dispatch, in execution order (Kernels level).
    pub dispatches: Vec<(NodeIndex, f64)>,
}

/// Counters of the last step (for tests and benchmarks).
#[derive(Clone, Copy, Debug, Default)]
pub struct StepStats {
    pub submits: usize,
    pub dispatches: usize,
    pub phases: usize,
    /// CPU time spent encoding and submitting, in seconds.
    pub encode_s: f64,
}

/// Runs compiled graphs for one sequence on one device, keeping its KV caches between steps.
pub trait Executor: Send {
    /// Runs graph `key` (compiled as `c`) for one step; `want_logits` asks for the
    /// logits to be read back.
    fn run(&mut self, key: GraphKey, c: &Compiled, step: &StepInputs, want_logits: bool) -> Result<StepOutput, String>;
    /// Forgets the sequence (the caches need not be zeroed: positions mask them).
    fn reset(&mut self);
    /// Short description of the device.
    fn describe(&self) -> String;
    /// Whether [`Executor::submit`]/[`Executor::take`] pipeline steps.
    fn pipelines(&self) -> bool {
        false
    }
    /// Submits a step without waiting; `feed_device`: its token is the previous
    /// step's output, copied on the device. Only where [`Executor::pipelines`].
    fn submit(&mut self, _key: GraphKey, _c: &Compiled, _step: &StepInputs, _feed_device: bool) -> Result<(), String> {
        Err("this executor does not pipeline steps".into())
    }
    /// Waits for the oldest submitted step and returns its token.
    fn take(&mut self) -> Result<u32, String> {
        Err("this executor does not pipeline steps".into())
    }
    /// Counters of the last step, where the executor keeps them (GPU).
    fn stats(&self) -> Option<StepStats> {
        None
    }
    /// The kernel of each dispatch of graph `key`, once a step has run it (GPU).
    fn kernels(&self, _key: GraphKey) -> Option<Vec<(NodeIndex, String)>> {
        None
    }
    /// Sets timestamp profiling of the following steps; false where there is none.
    fn set_profile(&mut self, _p: Profile) -> bool {
        false
    }
    /// Times of the last profiled step (GPU).
    fn profile(&self) -> Option<ProfileResult> {
        None
    }
}

/// The CPU reference executor behind [`Executor`].
pub struct CpuExecutor {
    weights: CpuWeights,
    state: CpuState,
}

impl CpuExecutor {
    pub fn new(weights: Arc<Weights>) -> Self {
        CpuExecutor { weights: CpuWeights::new(weights), state: CpuState::default() }
    }

    /// An executor sharing `weights`' cache of dequantized weights with the others made from it.
    pub fn with_weights(weights: CpuWeights) -> Self {
        CpuExecutor { weights, state: CpuState::default() }
    }
}

impl Executor for CpuExecutor {
    fn run(&mut self, _key: GraphKey, c: &Compiled, step: &StepInputs, want_logits: bool) -> Result<StepOutput, String> {
        let out = exec::run(c, &mut self.weights, &mut self.state, step)?;
        let tokens = out.get("token").map(|v| v.u().to_vec()).ok_or("graph has no token output")?;
        let token = *tokens.first().ok_or("the token output is empty")?;
        let logits = if want_logits { out.get("logits").map(|v| v.f().to_vec()) } else { None };
        Ok(StepOutput { logits, token, tokens })
    }
    fn reset(&mut self) {
        self.state.clear();
    }
    fn describe(&self) -> String {
        "cpu (reference, f32)".into()
    }
}
