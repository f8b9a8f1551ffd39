//! The GPU runtime: executes compiled graphs phase by phase on a wgpu device.

use std::sync::Arc;

use markbase_graph::passes::Compiled;

use crate::cpu::exec::StepInputs;
use crate::gpu::device::Backend;
use crate::model::{Executor, GraphKey, StepOutput};
use crate::weights::Weights;

/// Runs compiled graphs on a GPU.
pub struct GpuExecutor {}

impl GpuExecutor {
    pub fn new(_backend: Option<Backend>, _weights: Arc<Weights>, _check_nan: bool) -> Result<Self, String> {
        Err("GPU runtime not available yet".into())
    }
}

impl Executor for GpuExecutor {
    fn run(&mut self, _key: GraphKey, _c: &Compiled, _step: &StepInputs, _want_logits: bool) -> Result<StepOutput, String> {
        Err("GPU runtime not available yet".into())
    }
    fn reset(&mut self) {}
    fn describe(&self) -> String {
        "gpu".into()
    }
}
