//! The f16 GEMM of a batch's decode steps (`Kernels::row_f16`: what `Kernels::matmul_rowwise`
//! takes with `--batch-f16`, `MARKBASE_ROW_GEMM=f16`): K cut into parts whose sums the last
//! workgroup of a tile adds in part order. At real widths (K up to 15,360) and awkward row counts,
//! in every split of the inputs the formats take, with its FMA twin on every adapter with f16 (CI's
//! software rasterizer included) and on cooperative matrices where the adapter has them:
//! - a row's outputs are the same bits at every row count of a batch's decode graphs (1 to 64),
//!   so a sequence's tokens do not depend on what runs beside it;
//! - they are the CPU's product within the f16 GEMM's bound for the split (of sum |x| |w|);
//! - the same dispatch run again gives the same bits (the tiles' counters are left at zero);
//! - huge activations (1e5 to 1e6, past f16's range) stay within the bound.
//!
//! The test FAILS (never skips) when no adapter is found.

#[path = "common/f16_gemm.rs"]
mod f16_gemm;
#[path = "common/kernel_data.rs"]
mod kernel_data;

use f16_gemm::{bound, kernels, worst};
use kernel_data::*;
use markbase::gpu::device::Gpu;
use markbase::gpu::kernels::{KernelSpec, MatMulDims};
use markbase::gpu::ops::gemm_f16;
use markbase::gpu::weights::{upload_weight, GpuFormat};
use markbase::graph::quant::FloatType;

/// Rows of a batch's decode graphs on a GPU.
const ROWS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];

/// x W^T for `t` tokens over W `[n, k]`, and sum |x| |w| per element, in f64.
fn exact(x: &[f32], w: &[f32], t: usize, n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut want, mut mag) = (vec![0f32; t * n], vec![0f32; t * n]);
    for ti in 0..t {
        for j in 0..n {
            let (mut s, mut m) = (0f64, 0f64);
            for i in 0..k {
                let p = x[ti * k + i] as f64 * w[j * k + i] as f64;
                s += p;
                m += p.abs();
            }
            want[ti * n + j] = s as f32;
            mag[ti * n + j] = m as f32;
        }
    }
    (want, mag)
}

#[test]
fn row_gemm_rows_do_not_depend_on_the_row_count() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    let mut r = rng("row_gemm");
    let affine = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let affine8 = GpuFormat::Affine { bits: 8, group: 32, scale: FloatType::Bf16 };
    // (format, rows, K, chunks, activations' amplitude)
    let cases = [
        (affine, 37, 3840, 1, 2.0),
        (affine, 130, 15360, 1, 2.0),
        (affine, 300, 1152, 2, 3e5),
        (affine8, 45, 2048, 1, 2.0),
        (GpuFormat::Mxfp4, 21, 2816, 1, 2.0),
        (GpuFormat::Float(FloatType::Bf16), 19, 1152, 2, 1e6),
    ];
    for (label, kk, coop) in kernels(&gpu) {
        for &(fmt, n, k, chunks, amp) in &cases {
            let wd = random_weight(&mut r, fmt, &[n, k]);
            let wref = markbase::quant::dequantize(&wd).unwrap();
            let gw = upload_weight(&gpu, &wd, Some(chunk_limit(fmt, &[n, k], chunks))).unwrap();
            let tmax = *ROWS.last().unwrap();
            let x = randn(&mut r, tmax * k, amp);
            let (want, mag) = exact(&x, &wref, tmax, n, k);
            let mm = kk.row_f16(fmt, k).unwrap();
            let KernelSpec::GemmF16 { hilo, split, center, .. } = mm.spec else { panic!("{label}: not the f16 GEMM: {:?}", mm.spec) };
            assert!(split || !kk.opts.merge_splits, "{label}: K is cut where the backend merges in a kernel");
            let exact_w = center || gemm_f16::values_in_f16(fmt);
            let tol = bound(hilo, exact_w);
            let mut outs: Vec<Vec<f32>> = vec![];
            let mut parts = vec![];
            for t in ROWS {
                let dims: Vec<MatMulDims> = (0..gw.chunks.len()).map(|c| MatMulDims::plain(&gw, c, t)).collect();
                parts.push(dims.iter().map(|d| mm.ksplit(d)).collect::<Vec<_>>());
                let xb = gpu.upload_f32("x", &x[..t * k]);
                let y = gpu.storage("y", (t * n * 4) as u64);
                gpu.queue.write_buffer(&y, 0, &vec![0xffu8; t * n * 4]);
                let scales = gpu.storage("scales", (t * 4) as u64);
                let x16 = gpu.storage("x16", gemm_f16::x16_bytes(&mm.spec, t, k));
                let (pbytes, cbytes) = dims.iter().map(|d| mm.split_scratch_bytes(d)).fold((4, 4), |a, b| (a.0.max(b.0), a.1.max(b.1)));
                let (part, done) = (gpu.storage("part", pbytes), gpu.storage("done", cbytes));
                let rk = kk.row_scale(&mm, k).unwrap();
                let params: Vec<wgpu::Buffer> = dims.iter().map(|d| gpu.uniform("p", &mm.params(d))).collect();
                let rbg = rk.bind_buffers(&gpu.device, &[(0, &params[0]), (1, &xb), (5, &x16), (7, &scales)]);
                let scratch = split.then_some((&part, &done));
                let bgs: Vec<wgpu::BindGroup> = (0..gw.chunks.len()).map(|c| mm.bind_group_f16(&gpu.device, &params[c], &x16, &y, &scales, None, scratch, &gw, c)).collect();
                let mut runs = vec![];
                for _ in 0..2 {
                    run(&gpu, |pass| {
                        rk.dispatch(pass, &rbg, gemm_f16::row_scale_groups(t, 65535));
                        for (c, d) in dims.iter().enumerate() {
                            mm.dispatch(pass, &bgs[c], d);
                        }
                    });
                    runs.push(gpu.read_f32(&y, t * n).unwrap());
                }
                let got = runs.pop().unwrap();
                assert!(got.iter().zip(&runs[0]).all(|(a, b)| a.to_bits() == b.to_bits()), "{label} {}: a second run differs", mm.kernel.name);
                let (i, e) = worst(&got, &want[..t * n], &mag[..t * n]);
                assert!(e <= tol, "{label} {} N={n} K={k} T={t}: error {e:.3e} of sum|x||w| at row {} column {} (got {}, want {}), bound {tol:.1e}", mm.kernel.name, i / n, i % n, got[i], want[i]);
                outs.push(got);
            }
            let all = outs.last().unwrap();
            for (t, out) in ROWS.iter().zip(&outs) {
                for (i, (a, b)) in out.iter().zip(all).enumerate() {
                    assert!(a.to_bits() == b.to_bits(), "{label} {} N={n} K={k}: row {} column {} at {t} rows is {a}, at {tmax} rows {b}", mm.kernel.name, i / n, i % n);
                }
            }
            assert!(parts.windows(2).all(|w| w[0] == w[1]), "{label}: the parts of K change with the row count: {parts:?}");
            println!("{label} {} N={n} K={k} chunks {} parts {:?} (coop {coop}): rows identical to the bit at {ROWS:?} rows, within {tol:.1e}", mm.kernel.name, gw.chunks.len(), parts[0]);
        }
    }
}

/// Prefill's split (few tiles of many tokens): several tiles of tokens, 64 and 128 tokens each
/// (and 64 tokens x 256 rows), against the CPU within the bound.
#[test]
fn split_gemm_over_several_token_tiles() {
    let gpu = Gpu::new().unwrap_or_else(|e| panic!("GPU kernel tests need an adapter: {e}"));
    let mut r = rng("split_gemm");
    let fmt = GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
    let (n, k) = (130, 1152);
    let wd = random_weight(&mut r, fmt, &[n, k]);
    let wref = markbase::quant::dequantize(&wd).unwrap();
    let gw = upload_weight(&gpu, &wd, None).unwrap();
    for (label, kk, _) in kernels(&gpu) {
        let KernelSpec::GemmF16 { coop, m8, hilo, vs, center, bk, db, .. } = kk.row_f16(fmt, k).unwrap().spec else { unreachable!() };
        for (t, mt, nt) in [(150, 2u8, 2u8), (300, 4, 2), (300, 2, 4)] {
            let mm = kk.matmul_spec(KernelSpec::GemmF16 { fmt, coop, m8, hilo, mt, nt, vs, center, bk, db, grouped: false, split: true }).unwrap();
            let x = randn(&mut r, t * k, 3.0);
            let d = MatMulDims::plain(&gw, 0, t);
            assert!(mm.ksplit(&d) > 1, "{label}: K is cut");
            let (want, mag) = exact(&x, &wref, t, n, k);
            let xb = gpu.upload_f32("x", &x);
            let y = gpu.storage("y", (t * n * 4) as u64);
            let scales = gpu.storage("scales", (t * 4) as u64);
            let x16 = gpu.storage("x16", gemm_f16::x16_bytes(&mm.spec, t, k));
            let (pbytes, cbytes) = mm.split_scratch_bytes(&d);
            let (part, done) = (gpu.storage("part", pbytes), gpu.storage("done", cbytes));
            let rk = kk.row_scale(&mm, k).unwrap();
            let params = gpu.uniform("p", &mm.params(&d));
            let rbg = rk.bind_buffers(&gpu.device, &[(0, &params), (1, &xb), (5, &x16), (7, &scales)]);
            let bg = mm.bind_group_f16(&gpu.device, &params, &x16, &y, &scales, None, Some((&part, &done)), &gw, 0);
            run(&gpu, |pass| {
                rk.dispatch(pass, &rbg, gemm_f16::row_scale_groups(t, 65535));
                mm.dispatch(pass, &bg, &d);
            });
            let got = gpu.read_f32(&y, t * n).unwrap();
            let tol = bound(hilo, center);
            let (i, e) = worst(&got, &want, &mag);
            println!("{label} {} T={t} parts {}: worst {e:.2e} of sum|x||w|", mm.kernel.name, mm.ksplit(&d));
            assert!(e <= tol, "{label} {} T={t}: error {e:.3e} at token {} row {} (got {}, want {}), bound {tol:.1e}", mm.kernel.name, i / n, i % n, got[i], want[i]);
        }
    }
}
