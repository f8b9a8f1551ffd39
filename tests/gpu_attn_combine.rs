//! Decode attention with its split combine as a dispatch of its own, as Metal, D3D12 and GL
//! run it (Vulkan merges the splits inside the attention pass): fixtures against mlx-lm's
//! float32 logits and a long greedy decode against the CPU reference. A test binary of its
//! own: the switch is an environment variable read when the kernels are made. Without an
//! adapter these tests fail, never skip.

mod common;

use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::KernelOptions;
use markbase::model::DeviceKind;

#[test]
fn split_combine_dispatch_matches_mlx_lm_and_cpu() {
    std::env::set_var("MARKBASE_ATTN_MERGE", "0");
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU model tests need an adapter: {e}"));
    assert!(!KernelOptions::for_gpu(&gpu).merge_splits, "MARKBASE_ATTN_MERGE=0 leaves the splits merged in the pass");
    drop(gpu);
    common::check_fixtures(&["gemma3_text-q4", "gemma4_dense_ple-q4", "gemma4_moe-q4"], DeviceKind::Gpu(None));
    common::long_decode_matches_cpu("gemma4_dense_ple-q4", 300);
}
