//! The sampler (`wgsl/sample.wgsl`, `Op::Sample`, semantics of `cpu::ops::sample`).
//!
//! A fixed sequence of [`DISPATCHES`] dispatches, one kernel per stage of [`STAGES`]: the
//! passes over the logits run on one workgroup per chunk of [`CHUNK`] logits (`ceil(V / CHUNK)`
//! workgroups), with one-workgroup passes between them that combine the per-chunk results:
//! `chunk` (maxima), `init` (global maxima; greedy pick; search state), 8 times `bins` (digit
//! counts and masses of the radix search for top-k / top-p) and `select` (the digit), `mass`
//! (kept mass per chunk), `pick` (inverse CDF). Stages with nothing to do for the given
//! parameters return at once, so the same dispatches serve every step.
//!
//! Bindings of every stage: 0 params ([`super::argmax::ArgmaxParams`]: V and the offset of
//! the row to sample, e.g. `ArgmaxParams::last_row`), 1 logits (f32), 2 sampling words u32[8]
//! (`SampleParams::words`), 3 recent ids u32[R] (the first `n_recent` are penalized; at most
//! 128 are used), 4 out u32[1], 5 per-chunk results and 6 search state and penalty table
//! (scratch buffers owned by the [`Sampler`]).

use std::sync::Arc;

use crate::gpu::device::{Gpu, GpuError};
use crate::gpu::kernels::{Kernel, KernelSpec, Kernels};

/// Logits per workgroup of the passes over the logits.
pub const CHUNK: u32 = 2048;
/// Invocations per workgroup (every stage).
pub const WG: u32 = 128;
/// The stages (the `stage` of `KernelSpec::Sample`), in the order of their first dispatch.
pub const STAGES: [&str; 6] = ["chunk", "init", "bins", "select", "mass", "pick"];
const CHUNK_STAGE: usize = 0;
const INIT: usize = 1;
const BINS: usize = 2;
const SELECT: usize = 3;
const MASS: usize = 4;
const PICK: usize = 5;
/// Radix passes (4-bit digits of 32-bit keys).
const DIGITS: usize = 8;
/// Dispatches per sample.
pub const DISPATCHES: usize = 2 + 2 * DIGITS + 2;
/// u32 words per chunk in the per-chunk results buffer (`PART` in the WGSL).
const PART_WORDS: u64 = 48;
/// u32 words of the search state (16) and the repetition penalty table (128 ids, 128 values).
const STATE_WORDS: u64 = 16 + 2 * 128;

/// One recorded dispatch: kernel, bind group, workgroups.
pub type Dispatch = (Arc<Kernel>, wgpu::BindGroup, [u32; 3]);

/// The sampler for rows of `V` logits: the stage kernels and the scratch buffers.
pub struct Sampler {
    kernels: Vec<Arc<Kernel>>,
    /// Per-chunk results (`ceil(V / CHUNK) * 48` words).
    part: wgpu::Buffer,
    /// The search state and the penalty table (`16 + 256` words).
    state: wgpu::Buffer,
    chunks: u32,
}

impl Sampler {
    /// The stage kernels (built once per [`Kernels`]) and fresh scratch buffers for rows of `v` logits.
    pub fn new(gpu: &Gpu, kernels: &Kernels, v: usize) -> Result<Sampler, GpuError> {
        let chunks = v.div_ceil(CHUNK as usize);
        if v == 0 || chunks > kernels.limits.max_compute_workgroups_per_dimension as usize {
            return Err(GpuError::Other(format!("sample: {v} logits out of range")));
        }
        let kernels = (0..STAGES.len()).map(|s| kernels.get(KernelSpec::Sample { stage: s as u32 })).collect::<Result<Vec<_>, _>>()?;
        let part = gpu.try_storage("sample.part", chunks as u64 * PART_WORDS * 4)?;
        let state = gpu.try_storage("sample.state", STATE_WORDS * 4)?;
        Ok(Sampler { kernels, part, state, chunks: chunks as u32 })
    }

    /// The scratch buffers (to keep alive as long as the dispatches).
    pub fn scratch(&self) -> [wgpu::Buffer; 2] {
        [self.part.clone(), self.state.clone()]
    }

    /// The dispatches of one sample, in order, for the given params (`ArgmaxParams`), logits,
    /// sampling words, recent ids and output buffers. Record them in order (one compute pass
    /// is enough: each reads what the previous ones wrote).
    pub fn dispatches(
        &self,
        device: &wgpu::Device,
        params: &wgpu::Buffer,
        logits: &wgpu::Buffer,
        words: &wgpu::Buffer,
        recent: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Vec<Dispatch> {
        let bufs = [(0, params), (1, logits), (2, words), (3, recent), (4, out), (5, &self.part), (6, &self.state)];
        let bgs: Vec<wgpu::BindGroup> = self.kernels.iter().map(|k| k.bind_buffers(device, &bufs)).collect();
        let wide = [self.chunks, 1, 1];
        let one = [1, 1, 1];
        let d = |s: usize, g: [u32; 3]| (self.kernels[s].clone(), bgs[s].clone(), g);
        let mut v = vec![d(CHUNK_STAGE, wide), d(INIT, one)];
        for _ in 0..DIGITS {
            v.push(d(BINS, wide));
            v.push(d(SELECT, one));
        }
        v.push(d(MASS, wide));
        v.push(d(PICK, one));
        debug_assert_eq!(v.len(), DISPATCHES);
        v
    }

    /// Records `dispatches` (from [`Sampler::dispatches`]) into `pass`.
    pub fn record(pass: &mut wgpu::ComputePass<'_>, dispatches: &[Dispatch]) {
        for (k, bg, g) in dispatches {
            k.dispatch(pass, bg, *g);
        }
    }
}
