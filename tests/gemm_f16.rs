//! The prefill GEMM on f16 tiles (`gemm_coop.wgsl` with its row scales) against the CPU: its FMA
//! twin on every adapter with f16 (CI's software rasterizer included), and the cooperative-matrix
//! kernel itself where the adapter has cooperative matrices (16 x 16 x 16, f16 -> f32). Every
//! weight format, shapes that leave partial tiles in every direction, weights in chunks, and
//! activations up to 1e6 (far past f16's 65504: the row scales keep them finite).
//!
//! Bound (one f16 per input): |gpu - cpu| <= 1.2e-3 x sum_k |x[t, k]| |W[r, k]| per element, with the CPU's products
//! in f32. Rounding x / s and W to f16 costs each product at most 2 x 2^-11 of its magnitude
//! (4.9e-4 each), so this is about the worst case (the FMA twin on lavapipe: 1.7e-4 at most); a
//! wrong element, tile or scale lands far above it. With each input as a hi + lo pair of f16
//! (the default), 4e-6 of the same sum (observed: 8.5e-7 at most).
//! The tests FAIL (never skip) when no adapter is found.

#[path = "common/kernel_data.rs"]
mod kernel_data;

use kernel_data::*;
use markbase::cpu::ops as cpu;
use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::{all_formats, KernelOptions, KernelSpec, Kernels, MatMulDims};
use markbase::gpu::ops::gemm_f16::{self, CoopMode};
use markbase::gpu::weights::{upload_weight, GpuFormat};
use markbase::graph::quant::FloatType;
use rand::rngs::StdRng;
use rand::Rng;

/// One f16 rounding per input (see the module doc).
const BOUND: f32 = 1.2e-3;
/// Inputs as hi + lo f16 pairs: about f32 precision (the FMA twin on lavapipe: 8.5e-7 at most).
const HILO_BOUND: f32 = 4e-6;

fn kernels(gpu: &Gpu) -> Vec<(&'static str, Kernels, bool)> {
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

/// One case: W `[n, k]` of `fmt` in about `nchunks` chunks, `t` tokens whose rows have their
/// largest |x| at `amps[t % amps.len()]`.
fn case(gpu: &Gpu, ks: &[(&str, Kernels, bool)], r: &mut StdRng, fmt: GpuFormat, n: usize, k: usize, t: usize, nchunks: usize, amps: &[f32]) {
    let wd = random_weight(r, fmt, &[n, k]);
    let wref = markbase::quant::dequantize(&wd).unwrap();
    let gw = upload_weight(gpu, &wd, Some(chunk_limit(fmt, &[n, k], nchunks))).unwrap();
    let mut x = vec![0f32; t * k];
    for (i, row) in x.chunks_mut(k).enumerate() {
        let amp = amps[i % amps.len()];
        for v in row.iter_mut() {
            *v = r.gen_range(-amp..amp);
        }
        row[r.gen_range(0..k)] = amp;
    }
    let mut want = vec![0f32; t * n];
    cpu::matmul(&x, &wref, k, n, &mut want);
    let ax: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    let aw: Vec<f32> = wref.iter().map(|v| v.abs()).collect();
    let mut mag = vec![0f32; t * n];
    cpu::matmul(&ax, &aw, k, n, &mut mag);
    let xb = gpu.upload_f32("x", &x);
    for ((label, kk, coop), hilo) in ks.iter().flat_map(|k| [(k, true), (k, false)]) {
        let chosen = kk.matmul_rows(fmt, k, n, t, false).unwrap();
        if n * k >= markbase::gpu::ops::gemm_f16::min_weight() {
            assert_eq!(chosen.spec, KernelSpec::GemmF16 { fmt, coop: *coop, xvec: k % 4 == 0, hilo: true }, "{label}: the f16 GEMM is chosen");
        } else {
            assert!(matches!(chosen.spec, KernelSpec::Gemm { .. }), "{label}: a small weight takes the f32 GEMM, not {:?}", chosen.spec);
        }
        let mm = kk.matmul_spec(KernelSpec::GemmF16 { fmt, coop: *coop, xvec: k % 4 == 0, hilo }).unwrap();
        let bound = if hilo { HILO_BOUND } else { BOUND };
        let y = gpu.storage("y", (t * n * 4) as u64);
        gpu.queue.write_buffer(&y, 0, &vec![0xffu8; t * n * 4]);
        let scales = gpu.storage("scales", (t * 4) as u64);
        let rk = kk.row_scale().unwrap();
        let dims: Vec<MatMulDims> = (0..gw.chunks.len()).map(|c| MatMulDims::plain(&gw, c, t)).collect();
        let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
        let rbg = rk.bind_buffers(&gpu.device, &[(0, &params[0]), (1, &xb), (7, &scales)]);
        let bgs: Vec<wgpu::BindGroup> = (0..gw.chunks.len()).map(|c| mm.bind_group_f16(&gpu.device, &params[c], &xb, &y, &scales, &gw, c)).collect();
        run(gpu, |pass| {
            rk.dispatch(pass, &rbg, gemm_f16::row_scale_groups(t, 65535));
            for (c, d) in dims.iter().enumerate() {
                mm.dispatch(pass, &bgs[c], d);
            }
        });
        let got = gpu.read_f32(&y, t * n).unwrap();
        let what = format!("gemm_f16 {} [{label} hilo={hilo}] N={n} K={k} T={t} chunks={} max|x| {amps:?}", fmt.describe(), gw.chunks.len());
        let mut worst = (0usize, 0f32);
        for i in 0..t * n {
            let e = (got[i] - want[i]).abs();
            let e = if e.is_finite() { e / mag[i].max(1e-30) } else { f32::INFINITY };
            if e > worst.1 {
                worst = (i, e);
            }
        }
        let i = worst.0;
        println!("{what}: worst error {:.2e} of sum|x||w|", worst.1);
        assert!(worst.1 <= bound, "{what}: at token {} row {}: gpu {} cpu {} (sum|x||w| {}), {:.2e} of it", i / n, i % n, got[i], want[i], mag[i], worst.1);
    }
}

#[test]
fn gemm_f16_every_format_partial_tiles_chunked() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    println!("adapter: {}", gpu.info.summary());
    let ks = kernels(&gpu);
    let mut r = rng("gemm_f16");
    for fmt in all_formats() {
        let k = match fmt {
            GpuFormat::Float(_) => 45,
            GpuFormat::Affine { group: 128, .. } => 384,
            GpuFormat::Nvfp4 { .. } => 336,
            _ => 320,
        };
        case(&gpu, &ks, &mut r, fmt, 37, k, 17, 3, &[1.0]);
    }
}

#[test]
fn gemm_f16_several_tiles_and_huge_activations() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    let ks = kernels(&gpu);
    let mut r = rng("gemm_f16_tiles");
    let q4 = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    // two row tiles and three token tiles, the last ones partial; vec4 and scalar activations
    case(&gpu, &ks, &mut r, q4, 200, 256, 130, 1, &[1.0, 3.0]);
    case(&gpu, &ks, &mut r, GpuFormat::Float(FloatType::Bf16), 131, 98, 70, 1, &[0.5]);
    // Gemma's activations: rows at 1e5 and 1e6 beside ordinary ones (an unscaled f16 tile
    // would hold Inf)
    case(&gpu, &ks, &mut r, q4, 130, 512, 40, 2, &[2.0, 1e5, 7e5, 1e6]);
    case(&gpu, &ks, &mut r, GpuFormat::Mxfp4, 64, 256, 9, 1, &[1e6, 40000.0, 65504.0]);
    // a weight as large as the f16 GEMM's threshold: chosen where it is on
    case(&gpu, &ks, &mut r, q4, 2048, 2048, 9, 1, &[1.0]);
}
