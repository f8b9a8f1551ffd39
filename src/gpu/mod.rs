//! wgpu device, kernels and graph runtime.
