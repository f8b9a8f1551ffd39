//! The several-token GEMV of a batch's decode steps (`Kernels::row_gemv`: what
//! `Kernels::matmul_rowwise` takes unless `--batch-f16` asks for the f16 GEMM) at real widths
//! (K up to 3,840: workgroups of 128 invocations walking 120 blocks, reduced across subgroups):
//! a row's outputs are the same bits at every row count of a batch's decode graphs (1, 2, 4, 8, 16
//! and 64 rows: token groups of 1, 2 and 4, one to sixteen of them), so a sequence's tokens do not
//! depend on what runs beside it; and they are the CPU's product within f32 rounding.
//! The test FAILS (never skips) when no adapter is found.

#[path = "common/kernel_data.rs"]
mod kernel_data;

use kernel_data::*;
use markbase::cpu::ops as cpu;
use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::{KernelOptions, KernelSpec, Kernels, MatMulDims};
use markbase::gpu::weights::{upload_weight, GpuFormat};
use markbase::graph::quant::FloatType;

/// Rows of a batch's decode graphs on a GPU.
const ROWS: [usize; 6] = [1, 2, 4, 8, 16, 64];

#[test]
fn rowwise_gemv_rows_do_not_depend_on_the_row_count() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    // whole blocks and half blocks (the default on GPUs that are not software rasterizers)
    for half_blocks in [false, true] {
        let ks = Kernels::new(&gpu, KernelOptions { half_blocks, ..KernelOptions::for_gpu(&gpu) }).unwrap();
        rows_identical(&gpu, &ks);
    }
}

fn rows_identical(gpu: &Gpu, ks: &Kernels) {
    let mut r = rng("gemv_rows");
    let affine = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    for (fmt, n, k, chunks) in [(affine, 37, 3840, 1), (GpuFormat::Mxfp4, 21, 2816, 1), (GpuFormat::Float(FloatType::Bf16), 19, 1152, 2), (GpuFormat::Float(FloatType::F32), 11, 200, 1)] {
        let wd = random_weight(&mut r, fmt, &[n, k]);
        let wref = markbase::quant::dequantize(&wd).unwrap();
        let gw = upload_weight(&gpu, &wd, Some(chunk_limit(fmt, &[n, k], chunks))).unwrap();
        let tmax = *ROWS.last().unwrap();
        let x = randn(&mut r, tmax * k, 2.0);
        let mut want = vec![0f32; tmax * n];
        cpu::matmul(&x, &wref, k, n, &mut want);
        let mut outs: Vec<Vec<f32>> = vec![];
        for t in ROWS {
            let mm = ks.row_gemv(fmt, k, t).unwrap();
            let KernelSpec::Gemv { tt, wg, .. } = mm.spec else { panic!("a batch's decode matmul takes the GEMV, not {:?}", mm.spec) };
            assert_eq!(tt, if t >= 4 { 4 } else { t as u32 }, "token group at {t} rows");
            assert_eq!(wg, ks.row_gemv(fmt, k, 2).map(|m| match m.spec { KernelSpec::Gemv { wg, .. } => wg, _ => 0 }).unwrap(), "one workgroup size at every row count");
            let xb = gpu.upload_f32("x", &x[..t * k]);
            let y = gpu.storage("y", (t * n * 4) as u64);
            gpu.queue.write_buffer(&y, 0, &vec![0xffu8; t * n * 4]);
            let dims: Vec<MatMulDims> = (0..gw.chunks.len()).map(|c| MatMulDims::plain(&gw, c, t)).collect();
            let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
            let bgs: Vec<wgpu::BindGroup> = (0..gw.chunks.len()).map(|c| mm.bind_group(&gpu.device, &params[c], &xb, &y, None, &gw, c)).collect();
            run(&gpu, |pass| {
                for (c, d) in dims.iter().enumerate() {
                    mm.dispatch(pass, &bgs[c], d);
                }
            });
            let got = gpu.read_f32(&y, t * n).unwrap();
            check_tol(&format!("gemv rows {} N={n} K={k} T={t}", fmt.describe()), &got, &want[..t * n], 1e-4, 1e-4);
            outs.push(got);
        }
        let all = outs.last().unwrap();
        for (t, out) in ROWS.iter().zip(&outs) {
            for (i, (a, b)) in out.iter().zip(all).enumerate() {
                assert!(a.to_bits() == b.to_bits(), "{} N={n} K={k}: row {} column {} at {t} rows is {a}, at {tmax} rows {b}", fmt.describe(), i / n, i % n);
            }
        }
        let half = matches!(ks.row_gemv(fmt, k, 2).unwrap().spec, KernelSpec::Gemv { half: true, .. });
        println!("{} N={n} K={k} chunks {} half blocks {half}: rows identical to the bit at {ROWS:?} rows", fmt.describe(), gw.chunks.len());
    }
}
