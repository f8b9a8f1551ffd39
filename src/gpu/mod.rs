//! wgpu device, kernels and graph runtime.
//!
//! - [`device`]: the `Gpu` (instance, adapter, device, queue), backend choice, buffer helpers.
//! - [`weights`]: the GPU weight layout (stored bytes, row chunks) and its upload.
//! - [`kv`]: KV caches chunked across storage bindings (long contexts on small limits).
//! - [`kernels`]: the pipeline cache and what the kernel families share; re-exports the
//!   launchers and params structs.
//! - [`ops`]: the kernel families (`wgsl/`), one module each: specs, launchers, params and
//!   the lowering of their graph ops.
//! - [`shader`]: WGSL assembly (prelude consts, `//#if` preprocessor) and binding reflection.
//! - [`runtime`]: executes compiled graphs.
pub mod device;
pub mod kernels;
pub mod kv;
pub mod ops;
pub mod runtime;
pub mod shader;
pub mod weights;

pub use ops::sample;
