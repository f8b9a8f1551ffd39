//! What the f16 GEMM suites share (`tests/gemm_f16.rs`, `tests/gemm_f16_grouped.rs`): the kernel
//! sets they run, their error bounds and the worst error of a result.
#![allow(dead_code)]

use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::{KernelOptions, Kernels};
use markbase::gpu::ops::gemm_f16::{CoopMode, Hilo};

/// One f16 rounding per input (see `tests/gemm_f16.rs`).
pub const BOUND: f32 = 1.2e-3;
/// Inputs as hi + lo f16 pairs: about f32 precision (the FMA twin on lavapipe: 8.5e-7 at most).
pub const HILO_BOUND: f32 = 4e-6;
/// Activations as hi + lo, weights as one f16: half of [`BOUND`]'s rounding.
pub const HILO_X_BOUND: f32 = 6e-4;

/// The bound (of sum|x||w|) for the split `hilo`; `exact_w`: every staged weight is its value
/// exactly (centred, or values f16 holds), so that the activations' split alone bounds it.
pub fn bound(hilo: Hilo, exact_w: bool) -> f32 {
    match hilo {
        Hilo::Both => HILO_BOUND,
        Hilo::X if exact_w => HILO_BOUND,
        Hilo::X => HILO_X_BOUND,
        Hilo::Off => BOUND,
    }
}

/// The FMA twin's kernels, and the cooperative-matrix ones where the adapter has 16 x 16 x 16
/// f16 -> f32: (label, kernels, coop).
pub fn kernels(gpu: &Gpu) -> Vec<(&'static str, Kernels, bool)> {
    let opts = |coop| KernelOptions { coop, ..KernelOptions::for_gpu(gpu) };
    assert!(gpu.info.shader_f16, "the f16 GEMM needs SHADER_F16: {}", gpu.info.summary());
    let mut v = vec![("fma", Kernels::new(gpu, opts(CoopMode::Fma)).unwrap(), false)];
    if gpu.info.coop_f16_16 {
        v.push(("coop", Kernels::new(gpu, opts(CoopMode::Tensor)).unwrap(), true));
    } else {
        println!("adapter has no 16x16x16 f16 cooperative matrices: the FMA twin only");
    }
    v
}

/// The element of `got` farthest from `want` relative to `mag` (sum|x||w|: non-finite errors
/// count as infinite): (index, error).
pub fn worst(got: &[f32], want: &[f32], mag: &[f32]) -> (usize, f32) {
    let mut w = (0usize, 0f32);
    for i in 0..want.len() {
        let e = (got[i] - want[i]).abs();
        let e = if e.is_finite() { e / mag[i].max(1e-30) } else { f32::INFINITY };
        if e > w.1 {
            w = (i, e);
        }
    }
    w
}
