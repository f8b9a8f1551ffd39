//! Random kernel inputs shared by the kernel suites: seeded generators, random weights in every
//! stored format, chunk limits, one-pass runs and the tolerance check.
#![allow(dead_code)]

use markbase::gpu::device::Gpu;
use markbase::gpu::weights::GpuFormat;
use markbase::graph::ir::WeightParam;
use markbase::graph::quant::{FloatType, QuantMode, QuantSpec, WeightFormat};
use markbase::weights::{RawDType, RawTensor, WeightData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Seed of the randomized kernel cases unless `MARKBASE_TEST_SEED` replays another.
pub const DEFAULT_SEED: u64 = 0x6d61_726b_6261_7365;

pub fn rng(test: &str) -> StdRng {
    let seed = match std::env::var("MARKBASE_TEST_SEED") {
        Ok(s) => s.parse().unwrap_or_else(|_| panic!("MARKBASE_TEST_SEED={s} is not a u64")),
        Err(_) => DEFAULT_SEED,
    };
    println!("{test}: seed {seed} (MARKBASE_TEST_SEED={seed} replays it)");
    StdRng::seed_from_u64(seed)
}

pub fn randn(r: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(-amp..amp)).collect()
}

/// Encodes `f` into one compute pass, submits, waits.
pub fn run(gpu: &Gpu, f: impl FnOnce(&mut wgpu::ComputePass<'_>)) {
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        f(&mut pass);
    }
    gpu.queue.submit([enc.finish()]);
    gpu.wait().unwrap();
}

pub fn check_tol(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut worst = (0usize, 0f32);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = (g - w).abs();
        if e.is_nan() || e > worst.1 {
            worst = (i, if e.is_nan() { f32::INFINITY } else { e });
        }
    }
    let tol = rel * scale + abs;
    assert!(
        worst.1 <= tol,
        "{what}: max err {} at {} (gpu {} cpu {}), tolerance {tol} (max|ref| {scale})",
        worst.1,
        worst.0,
        got[worst.0],
        want[worst.0]
    );
}

pub fn check(what: &str, got: &[f32], want: &[f32]) {
    check_tol(what, got, want, 1e-4, 1e-5);
}

pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| ((x.to_bits() + 0x8000) >> 16).to_le_bytes()[..2].to_vec()).collect()
}

pub fn float_tensor(t: FloatType, shape: &[usize], v: &[f32]) -> RawTensor {
    let (dtype, bytes) = match t {
        FloatType::F32 => (RawDType::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        FloatType::Bf16 => (RawDType::Bf16, bf16_bytes(v)),
        FloatType::F16 => (RawDType::F16, v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect()),
    };
    RawTensor { dtype, shape: shape.to_vec(), bytes }
}

/// A random weight of float shape `shape` in format `fmt`.
pub fn random_weight(r: &mut StdRng, fmt: GpuFormat, shape: &[usize]) -> WeightData {
    let k = *shape.last().unwrap();
    let rows: usize = shape[..shape.len() - 1].iter().product();
    let lead = &shape[..shape.len() - 1];
    let with_last = |n: usize| {
        let mut s = lead.to_vec();
        s.push(n);
        s
    };
    let (format, weight, scales, biases, global_scale) = match fmt {
        GpuFormat::Float(t) => {
            let v = randn(r, rows * k, 1.0);
            (WeightFormat::Float { dtype: t }, float_tensor(t, shape, &v), None, None, None)
        }
        _ => {
            let (mode, bits, group) = match fmt {
                GpuFormat::Affine { bits, group, .. } => (QuantMode::Affine, bits as usize, group as usize),
                GpuFormat::Mxfp4 => (QuantMode::Mxfp4, 4, 32),
                GpuFormat::Mxfp8 => (QuantMode::Mxfp8, 8, 32),
                GpuFormat::Nvfp4 { .. } => (QuantMode::Nvfp4, 4, 16),
                GpuFormat::Float(_) => unreachable!(),
            };
            let spec = QuantSpec { mode, bits, group_size: group };
            let wcols = k * bits / 32;
            let mut words: Vec<u32> = (0..rows * wcols).map(|_| r.gen()).collect();
            if mode == QuantMode::Mxfp8 {
                // no NaN codes (0x7f / 0xff)
                for w in words.iter_mut() {
                    let mut b = w.to_le_bytes();
                    for x in b.iter_mut() {
                        if *x & 0x7f == 0x7f {
                            *x &= 0xfe;
                        }
                    }
                    *w = u32::from_le_bytes(b);
                }
            }
            let g = k / group;
            let weight = RawTensor::from_u32(&with_last(wcols), &words);
            let (scales, biases) = match fmt {
                GpuFormat::Affine { scale, .. } => {
                    let s: Vec<f32> = (0..rows * g).map(|_| r.gen_range(0.005..0.1) * if r.gen() { 1.0 } else { -1.0 }).collect();
                    let b = randn(r, rows * g, 0.5);
                    (float_tensor(scale, &with_last(g), &s), Some(float_tensor(scale, &with_last(g), &b)))
                }
                GpuFormat::Nvfp4 { .. } => {
                    // positive e4m3 scales from 2^-4 to ~2^1
                    let s: Vec<u8> = (0..rows * g).map(|_| r.gen_range(0x18u8..0x48)).collect();
                    (RawTensor { dtype: RawDType::U8, shape: with_last(g), bytes: s }, None)
                }
                _ => {
                    let s: Vec<u8> = (0..rows * g).map(|_| r.gen_range(118u8..132)).collect();
                    (RawTensor { dtype: RawDType::U8, shape: with_last(g), bytes: s }, None)
                }
            };
            let global = fmt.has_global();
            let gs = if global {
                let e = if shape.len() == 3 { shape[0] } else { 1 };
                let v: Vec<f32> = (0..e).map(|_| r.gen_range(0.5..3.0)).collect();
                Some(RawTensor::from_f32(&[e], &v))
            } else {
                None
            };
            (WeightFormat::Quantized { spec, global_scale: global }, weight, Some(scales), biases, gs)
        }
    };
    WeightData {
        param: WeightParam { name: format!("w.{}", fmt.describe()), shape: shape.to_vec(), format, module: true },
        weight,
        scales,
        biases,
        global_scale,
    }
}

/// Max chunk bytes giving about `n` chunks of `w` (unit: rows, or experts for 3-D).
pub fn chunk_limit(fmt: GpuFormat, shape: &[usize], n: usize) -> u64 {
    let k = *shape.last().unwrap();
    let (a, b, c) = fmt.row_bytes(k);
    let per_row = a.max(b + c);
    let unit = if shape.len() == 3 { shape[1] } else { 1 };
    let units: usize = shape[..shape.len() - 1].iter().product::<usize>() / unit;
    (per_row * unit * units.div_ceil(n)) as u64
}

/// Two timestamp queries (start and end of a pass) and the buffer they resolve to.
pub fn pass_timer(gpu: &Gpu) -> (wgpu::QuerySet, wgpu::Buffer) {
    let qs = gpu.device.create_query_set(&wgpu::QuerySetDescriptor { label: None, ty: wgpu::QueryType::Timestamp, count: 2 });
    let qbuf = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 16,
        usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    (qs, qbuf)
}

/// Seconds between the two resolved timestamps of [`pass_timer`].
pub fn pass_seconds(gpu: &Gpu, qbuf: &wgpu::Buffer) -> f64 {
    let ts = gpu.read_u32(qbuf, 4).unwrap();
    let (t0, t1) = (ts[0] as u64 | (ts[1] as u64) << 32, ts[2] as u64 | (ts[3] as u64) << 32);
    t1.saturating_sub(t0) as f64 * gpu.queue.get_timestamp_period() as f64 * 1e-9
}

/// Median seconds of `runs` passes recorded by `record` (after two warm-up passes): between
/// timestamps at the pass's start and end where the adapter has them, else wall-clock time of
/// the submission.
pub fn median_pass_seconds(gpu: &Gpu, runs: usize, mut record: impl FnMut(&mut wgpu::ComputePass<'_>)) -> f64 {
    let (qs, qbuf) = pass_timer(gpu);
    let qs = gpu.info.timestamps.then_some(qs);
    let mut times = Vec::new();
    for it in 0..runs + 2 {
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let tw = qs.as_ref().map(|q| wgpu::ComputePassTimestampWrites {
                query_set: q,
                beginning_of_pass_write_index: Some(0),
                end_of_pass_write_index: Some(1),
            });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: tw });
            record(&mut pass);
        }
        if let Some(q) = &qs {
            enc.resolve_query_set(q, 0..2, &qbuf, 0);
        }
        let t0 = std::time::Instant::now();
        gpu.queue.submit([enc.finish()]);
        gpu.wait().unwrap();
        let wall = t0.elapsed().as_secs_f64();
        if it >= 2 {
            times.push(if qs.is_some() { pass_seconds(gpu, &qbuf) } else { wall });
        }
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    times[times.len() / 2]
}
