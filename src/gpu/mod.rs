//! wgpu device, kernels and graph runtime.
//!
//! - [`device`]: the `Gpu` (instance, adapter, device, queue), backend choice, buffer helpers.
//! - [`weights`]: the GPU weight layout (stored bytes, row chunks) and its upload.
//! - [`kernels`]: the WGSL kernels (`wgsl/`) and their launchers.
//! - [`shader`]: WGSL assembly (prelude consts, `//#if` preprocessor) and binding reflection.
//! - [`runtime`]: executes compiled graphs.
pub mod device;
pub mod kernels;
pub mod runtime;
pub mod sample;
pub mod shader;
pub mod weights;
