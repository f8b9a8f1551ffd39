//! The sampling kernel (`wgsl/sample.wgsl`, `Op::Sample`, semantics of `cpu::ops::sample`).
//!
//! One workgroup. Bindings: 0 params ([`super::kernels::ArgmaxParams`]: V and the offset of the row
//! to sample, e.g. `ArgmaxParams::last_row`), 1 logits (f32), 2 sampling words u32[8]
//! (`SampleParams::words`), 3 recent ids u32[R] (the first `n_recent` are penalized;
//! at most 128 are used), 4 out u32[1]. Dispatch `[1, 1, 1]`.

use std::sync::Arc;

use super::device::{Gpu, GpuError};
use super::kernels::{Kernel, KernelSpec, Kernels};

/// The sampling pipeline (built once per [`Kernels`]).
pub fn kernel(_gpu: &Gpu, kernels: &Kernels) -> Result<Arc<Kernel>, GpuError> {
    kernels.get(KernelSpec::Sample)
}
