//! wgpu device, kernels and graph runtime.
pub mod device;
pub mod runtime;
