//! The prefill GEMM on f16 tiles (`gemm_coop.wgsl`), with its activations' pass
//! (`row_scale.wgsl`: per-token scales and x / s in f16): on cooperative matrices (tensor cores)
//! where the adapter has them ([`CoopMode::Tensor`]), or as their twin with a plain FMA loop
//! ([`CoopMode::Fma`], which runs everywhere f16 does: the tests' software rasterizer checks the
//! tiling, staging, scaling and epilogue there). [`CoopMode::Off`] keeps the f32 GEMM of
//! `gemm.wgsl`.
//!
//! A plain matmul of [`super::matmul::GEMM_MIN_T`] tokens or more runs as two dispatches: the
//! activations' pass into scratch buffers shared by the graph's GEMMs, then the GEMM. So does
//! the MoE's expert-grouped GEMM (`Op::GroupedMatMul`, `grouped` in [`KernelSpec::GemmF16`]):
//! the activations' pass over x's own rows (tokens, or pairs), then the GEMM over each expert's
//! pairs, which gathers their rows.

use crate::gpu::device::Gpu;
use crate::gpu::kernels::{all_formats, div_ceil, weight_source, COMMON, F16_SPLIT, KernelSpec, WEIGHTS};
use crate::gpu::shader::Source;
use crate::gpu::weights::GpuFormat;
use markbase_graph::quant::FloatType;
use super::Family;

const GEMM_COMMON: &str = include_str!("../../../wgsl/gemm_common.wgsl");
const GEMM_COOP: &str = include_str!("../../../wgsl/gemm_coop.wgsl");
const ROW_SCALE: &str = include_str!("../../../wgsl/row_scale.wgsl");

/// Which inputs of the f16 GEMM go as two f16 (hi = the value rounded to f16, lo = f16 of the
/// rest: about twice the bits, one more product each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hilo {
    /// One f16 per input (11 significant bits), one product.
    Off,
    /// The activations as hi + lo, the weights as one f16: two products.
    X,
    /// Both as hi + lo: three products (hi*hi, hi*lo, lo*hi).
    Both,
}

impl Hilo {
    pub fn x(self) -> bool {
        self != Hilo::Off
    }
    pub fn w(self) -> bool {
        self == Hilo::Both
    }
}

/// The split the f16 GEMM uses for weights of `fmt`: the activations always as hi + lo (one
/// f16 alone moves small models' logits by up to 7e-3 of their largest), the weights as one f16
/// where their values are f16's exactly (bf16 and f16 floats; MXFP4 and NVFP4: E2M1 codes times
/// an E8M0 or E4M3 scale, NVFP4's global scale applied after the sum; affine codes of up to 4
/// bits with bf16 scales over rows of `k` that allow it, centred: see [`center`]), else as hi + lo too (MXFP8's E8M0 scales
/// reach past f16's range; wider affine codes times a scale need more than 11 bits: as one f16,
/// a q8 fixture's logits move by 1.4e-3 of their largest). `MARKBASE_COOP_HILO` = `0` (none),
/// `x` (activations only) or `1` (both) overrides it.
pub fn hilo(fmt: GpuFormat, k: usize) -> Hilo {
    match std::env::var("MARKBASE_COOP_HILO").as_deref() {
        Ok("0") | Ok("off") => Hilo::Off,
        Ok("x") => Hilo::X,
        Ok("1") => Hilo::Both,
        _ if center(fmt, k) || values_in_f16(fmt) => Hilo::X,
        _ => Hilo::Both,
    }
}

/// Whether every decoded weight of `fmt` is an f16 value exactly, as stored (bf16 and f16
/// floats; MXFP4 and NVFP4: E2M1 codes times an E8M0 or E4M3 scale), without centring.
pub fn values_in_f16(fmt: GpuFormat) -> bool {
    matches!(fmt, GpuFormat::Float(FloatType::Bf16 | FloatType::F16) | GpuFormat::Mxfp4 | GpuFormat::Nvfp4 { .. })
}

/// Whether the f16 GEMM centres the affine weights of `fmt`: W = s q + b is staged as
/// s (q - 2^(bits-1)), exact in f16 for codes of up to 4 bits and bf16 scales (at most 8 x 255
/// in 11 significant bits), and the rest, sum over groups of (b + 2^(bits-1) s) times the
/// group's sum of x, rides along as 2 K / group extra columns of K: the group sums on the
/// activations' side (written by `row_scale.wgsl`), b + 2^(bits-1) s as hi and lo on the
/// weights' side. All on the tensor cores, each weight one f16, about f32's error.
/// Rows of `k` need whole octets and at most 1,024 groups (what `row_scale.wgsl` holds).
/// `MARKBASE_COOP_CENTER=0` turns it off.
pub fn center(fmt: GpuFormat, k: usize) -> bool {
    matches!(fmt, GpuFormat::Affine { bits, group, scale: FloatType::Bf16 } if bits <= 4 && k % 8 == 0 && k % group as usize == 0 && k / group as usize <= 1024)
        && !std::env::var("MARKBASE_COOP_CENTER").is_ok_and(|v| v == "0")
}

/// The columns of the f16 activations of rows of `k` for the GEMM `spec`: `k`, plus two per
/// weight group where it centres its weights ([`center`]).
pub fn k_aug(spec: &KernelSpec, k: usize) -> usize {
    match *spec {
        KernelSpec::GemmF16 { fmt: GpuFormat::Affine { group, .. }, center: true, .. } => k + 2 * k / group as usize,
        _ => k,
    }
}

/// Workgroup memory (bytes) of the f16 GEMM with `mt` results per subgroup along the tokens and
/// `nt` along the rows, steps of `bk` (32 or 64) and with `db` two copies of each staging buffer.
pub fn smem_bytes(coop: bool, hilo: Hilo, mt: u8, nt: u8, bk: u8, db: bool) -> u32 {
    let lds = bk as u32 + if coop { 8 } else { 0 };
    let xs = 32 * mt as u32 * lds;
    let ws = tile_rows(nt) as u32 * lds;
    let f16s = xs * (1 + hilo.x() as u32) + ws * (1 + hilo.w() as u32);
    2 * f16s * (1 + db as u32) + if coop { 2048 * 4 } else { 0 }
}

/// Results per subgroup along the tokens for `rows` x `t` (`MARKBASE_COOP_MT` sets it): 4 (tiles
/// of 128 tokens) where the workgroup memory allows and the grid keeps at least 96 tiles, else 2.
/// H200, pp512, activations split: 128 tiles (N = 4096) 41.5 -> 47.6 TFLOP/s with 128 tokens,
/// 64 tiles (N = 2048) 40.9 -> 24.7.
pub fn tile_mt(coop: bool, hilo: Hilo, rows: usize, t: usize, smem_limit: u32) -> u8 {
    let fits = smem_bytes(coop, hilo, 4, 2, 32, false) <= smem_limit;
    match std::env::var("MARKBASE_COOP_MT").ok().and_then(|v| v.parse::<u8>().ok()) {
        Some(4) if fits => 4,
        Some(_) => 2,
        None if fits && div_ceil(rows, tile_rows(2)) * div_ceil(t, 128) >= 96 => 4,
        None => 2,
    }
}

/// The tile of the (ungrouped) f16 GEMM over `rows` x `t`: results per subgroup along the tokens
/// and the rows, (`mt`, `nt`). 64 tokens x 256 rows ((2, 4): a step's 16 x 16 products as many
/// as with 128 x 128, its activations' bytes half, its weights' twice) for weights of up to 8
/// bits ([`WIDE_DEFAULT`]; `MARKBASE_COOP_NT=4` for any, `=2` for none) where the workgroup
/// memory allows and the grid keeps at least 96 tiles, else (`tile_mt`, 2): tiles of 128 rows.
/// Per product, a step loads 4 / N bytes of activations (hi and lo) and w / T of weights (w bytes
/// each): fewer with the wide tile for weights under 2 bytes, the same for bf16 (whence
/// [`WIDE_DEFAULT`] only for formats of up to 8 bits).
pub fn tile_shape(fmt: GpuFormat, coop: bool, hilo: Hilo, rows: usize, t: usize, smem_limit: u32) -> (u8, u8) {
    let want = match std::env::var("MARKBASE_COOP_NT").as_deref() {
        Ok("4") => true,
        Ok("2") => false,
        _ => WIDE_DEFAULT && fmt.bits() <= 8,
    };
    let wide = want && smem_bytes(coop, hilo, 2, 4, 32, false) <= smem_limit && div_ceil(rows, tile_rows(4)) * div_ceil(t, 64) >= 96;
    // 128 tokens x 256 rows with `MARKBASE_COOP_MT=4` too (48 KiB with the activations split)
    let tall = std::env::var("MARKBASE_COOP_MT").is_ok_and(|v| v == "4")
        && smem_bytes(coop, hilo, 4, 4, 32, false) <= smem_limit
        && div_ceil(rows, tile_rows(4)) * div_ceil(t, 128) >= 96;
    if wide {
        (if tall { 4 } else { 2 }, 4)
    } else {
        (tile_mt(coop, hilo, rows, t, smem_limit), 2)
    }
}

/// Whether weights of up to 8 bits take tiles of 64 tokens x 256 rows by default
/// ([`tile_shape`]). On an H100 (one sitting, 4-bit g64): the 12B's 15360 x 3840 at 512 tokens
/// 1,007 -> 979 µs, 3840 x 15360 1,781 -> 1,697; gemma3-12b pp512 2,340 -> 2,424 tok/s, the 1B
/// unchanged (17,751 / 17,737). 128 x 256 (`MARKBASE_COOP_MT=4` with it) took the 12B to 2,522
/// but has not been checked against the CPU on tensor cores yet, so it stays an option.
const WIDE_DEFAULT: bool = true;

/// The staging of the f16 GEMM with `mt` ([`tile_mt`]): K per step and whether its buffers are
/// double ([`KernelSpec::GemmF16`]'s `bk`, `db`). 32 and single by default; `MARKBASE_COOP_BK=64`
/// and `MARKBASE_COOP_DB=1` take them where the workgroup memory allows (steps of 64 first), else
/// the default.
/// Tiles of 256 rows (`nt` = 4) take the default.
pub fn staging(coop: bool, hilo: Hilo, mt: u8, nt: u8, smem_limit: u32) -> (u8, bool) {
    if nt == 4 {
        return (32, false);
    }
    let fits = |bk, db| smem_bytes(coop, hilo, mt, nt, bk, db) <= smem_limit;
    let bk = if std::env::var("MARKBASE_COOP_BK").is_ok_and(|v| v == "64") && fits(64, false) { 64 } else { 32 };
    (bk, std::env::var("MARKBASE_COOP_DB").is_ok_and(|v| v == "1") && fits(bk, true))
}

/// Whether the f16 GEMM's workgroup buffers hold vec4<f16>: where only the activations are
/// split (H200, pp512, 12B shapes: 44-48 -> 56-62 TFLOP/s); `MARKBASE_COOP_VS` = `0` or `1`
/// overrides it.
pub fn vs(hilo: Hilo) -> bool {
    match std::env::var("MARKBASE_COOP_VS").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => vs_default(hilo),
    }
}

fn vs_default(hilo: Hilo) -> bool {
    hilo == Hilo::X
}

/// Workgroup memory (bytes) of the f16 GEMM `spec` ([`smem_bytes`], and the grouped one's
/// tile of the slot, or the split one's flag).
pub fn spec_smem_bytes(spec: &KernelSpec) -> u32 {
    match *spec {
        KernelSpec::GemmF16 { coop, hilo, mt, nt, bk, db, grouped, split, .. } => smem_bytes(coop, hilo, mt, nt, bk, db) + if grouped || split { 16 } else { 0 },
        _ => 0,
    }
}

/// Bytes of the f16 activations of `t` tokens of `k` elements for the GEMM `spec` (hi, and lo
/// where it splits them; [`k_aug`] columns), padded as `row_scale.wgsl` writes them (tokens to
/// 128, columns to 64).
pub fn x16_bytes(spec: &KernelSpec, t: usize, k: usize) -> u64 {
    let lo = matches!(spec, KernelSpec::GemmF16 { hilo, .. } if hilo.x());
    (t.div_ceil(128).max(1) * 128 * k_aug(spec, k).div_ceil(64) * 64 * 2 * (1 + lo as usize)) as u64
}

/// Weights of fewer elements take the f32 GEMM even where the f16 one is on: on small weights
/// the activations' pass and the staging cost more than the tensor cores save. With 4M (H100,
/// pp512): gemma3-270m 41,100 -> 43,200-46,800 tok/s, gemma3-1b 13,600 -> 14,500, gemma4-e2b
/// 6,190 -> 6,330; the 12B's weights are all above it. `MARKBASE_COOP_MIN` sets it.
pub fn min_weight() -> usize {
    std::env::var("MARKBASE_COOP_MIN").ok().and_then(|v| v.parse().ok()).unwrap_or(MIN_WEIGHT)
}

/// Whether a GEMM of `t` tokens over a weight of `n` x `k` takes the f16 path (where it is on):
/// weights of [`min_weight`] elements or more at up to 512 tokens; past 512, weights smaller in
/// proportion (the same work: a tower's 4,096 patches through a 1,152 x 1,152 weight).
pub fn takes_f16(n: usize, k: usize, t: usize) -> bool {
    (n * k) as u128 * t.max(512) as u128 >= min_weight() as u128 * 512
}

const MIN_WEIGHT: usize = 4 << 20;

/// Rows of one workgroup's tile with `nt` 16 x 16 results per subgroup along the rows (its
/// tokens: 32 x `mt`): 64 `nt`.
pub fn tile_rows(nt: u8) -> usize {
    64 * nt as usize
}

/// Which GEMM prefill takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoopMode {
    /// The f32 GEMM (`gemm.wgsl`).
    Off,
    /// The f16 GEMM with an FMA loop in place of the cooperative matrices.
    Fma,
    /// The f16 GEMM on cooperative matrices (16 x 16 x 16, f16 in, f32 accumulators).
    Tensor,
    /// The same on 8 x 8 x 8 cooperative matrices (Metal's simdgroup matrices, which have no
    /// 16 x 16).
    Tensor8,
}

impl CoopMode {
    /// The mode for `gpu`: `Tensor` where the device was opened with cooperative matrices of
    /// 16 x 16 x 16 f16 -> f32 and subgroups of 32, else `Off`. `MARKBASE_COOP=0` (the CLI's
    /// `--no-coop`) forces `Off`, `MARKBASE_COOP=fma` the twin (on any adapter with f16).
    pub fn for_gpu(gpu: &Gpu) -> CoopMode {
        match std::env::var("MARKBASE_COOP").as_deref() {
            Ok("0") | Ok("off") => CoopMode::Off,
            Ok("fma") if gpu.info.shader_f16 => CoopMode::Fma,
            _ if gpu.info.coop_f16_16 && gpu.info.shader_f16 && gpu.info.subgroup_min_size == 32 && gpu.info.subgroup_max_size == 32 => {
                CoopMode::Tensor
            }
            _ if gpu.info.coop_f16_8 && gpu.info.shader_f16 && gpu.info.subgroup_min_size == 32 && gpu.info.subgroup_max_size == 32 => {
                CoopMode::Tensor8
            }
            _ => CoopMode::Off,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CoopMode::Off => "off",
            CoopMode::Fma => "fma",
            CoopMode::Tensor => "tensor",
            CoopMode::Tensor8 => "tensor8x8",
        }
    }

    /// Whether the GEMM runs on cooperative matrices, and whether on 8 x 8 ones.
    pub fn coop(self) -> (bool, bool) {
        (matches!(self, CoopMode::Tensor | CoopMode::Tensor8), self == CoopMode::Tensor8)
    }
}

/// Whether `props` (an adapter's cooperative-matrix configurations) hold `n` x `n` x `n` with
/// f16 inputs and f32 accumulators, the one the f16 GEMM uses (16, or Metal's 8).
pub fn has_f16(props: &[wgpu::CooperativeMatrixProperties], n: u32) -> bool {
    props.iter().any(|p| {
        p.m_size == n && p.n_size == n && p.k_size == n && p.ab_type == wgpu::CooperativeScalarType::F16 && p.cr_type == wgpu::CooperativeScalarType::F32
    })
}

pub(crate) const FAMILY: Family = Family { name, source, variants };

fn name(spec: &KernelSpec) -> Option<String> {
    Some(match spec {
        KernelSpec::GemmF16 { fmt, coop, m8, hilo, mt, nt, vs, center, bk, db, grouped, split } => format!(
            "gemm_f16{}[{}{}{}{}{}{}{}{}{}{}{}]",
            if *grouped { "_grouped" } else { "" },
            fmt.describe(),
            match (*coop, *m8) {
                (true, true) => " coop8x8",
                (true, false) => " coop",
                _ => " fma",
            },
            match hilo {
                Hilo::Off => "",
                Hilo::X => " hilo_x",
                Hilo::Both => " hilo",
            },
            match *mt {
                4 => " t128",
                1 => " t32",
                _ => " t64",
            },
            if *nt == 4 { " n256" } else { "" },
            if *vs { " vs" } else { "" },
            if *center { " centred" } else { "" },
            if *bk == 64 { " k64" } else { "" },
            if *db { " db" } else { "" },
            if *split { " split" } else { "" },
            LoadOptions::of(*fmt, *mt, *bk, *db).suffix()
        ),
        KernelSpec::RowScale { xvec, lo, aug } => format!(
            "row_scale[{}{}{}]",
            if *xvec { "xvec" } else { "scalar" },
            if *lo { " lo" } else { "" },
            if *aug > 0 { format!(" sums{aug}") } else { String::new() }
        ),
        _ => return None,
    })
}

fn source(spec: &KernelSpec, _sg: bool) -> Option<Source> {
    Some(match *spec {
        KernelSpec::GemmF16 { fmt, coop, m8, hilo, mt, nt, vs, center, bk, db, grouped, split } => {
            let s = Source::new(&[COMMON, WEIGHTS, GEMM_COMMON, F16_SPLIT, GEMM_COOP])
                .flag("GROUPED", grouped)
                .flag("SPLIT", split && !grouped)
                .c("WG", 256)
                .c("PAD", if coop { 8 } else { 0 })
                .c("MT", mt as u32)
                .c("NT", nt as u32)
                .c("BK", bk as u32)
                .flag("DB", db)
                .flag("X16", true)
                .flag("COOP", coop)
                .flag("M8", coop && m8)
                .flag("HILO_X", hilo.x())
                .flag("HILO_W", hilo.w())
                .flag("VS", vs)
                .flag("CENTER", center)
                .flag("ABL_NOSTAGE", ablate("nostage"))
                .flag("ABL_NOW", ablate("now"))
                .flag("ABL_NOX", ablate("nox"))
                .flag("ABL_NOWLOAD", ablate("nowload"))
                .flag("ABL_NOXLOAD", ablate("noxload"))
                .c("ABL_SPLIT", if ablate("half") { 2 } else { 1 });
            let o = LoadOptions::of(fmt, mt, bk, db);
            weight_source(s, fmt, false, false, false)
                .flag("PD", o.depth > 1)
                .c("SU", o.depth)
                .flag("WV", o.wv)
                .flag("W_VEC4", o.wv)
                .flag("XW", o.xw)
        }
        KernelSpec::RowScale { xvec, lo, aug } => {
            Source::new(&[GEMM_COMMON, F16_SPLIT, ROW_SCALE]).flag("XVEC", xvec).flag("HILO_X", lo).flag("AUG", aug > 0).c("GS", aug.max(1))
        }
        _ => return None,
    })
}

/// The f16 GEMM's load options for `fmt` with tiles of `mt` and steps of `bk` (`db`: double
/// buffers), read from the environment when a kernel is built (and named). All on by default:
/// on an H100 (12B synthetic, 4-bit g64) they took the f16 GEMM of 15360 x 3840 at 512 tokens
/// from 1,143 to 1,002 µs and pp512 from 2,128 to 2,355 tok/s (docs/PERF.md).
struct LoadOptions {
    /// Steps ahead each step's weights are loaded (`PD` in `gemm_coop.wgsl`, its step loop
    /// unrolled as many times; single buffers only): `MARKBASE_COOP_PD` (1 to 8, default
    /// [`DEPTH`]; 1: one step ahead, with the activations).
    depth: u32,
    /// 4-bit affine weights (groups of 32 or more) a 16-byte word at a time (`WV`: rows of
    /// K % 32 == 0; one load of codes and one of scale words per loader and step, where the
    /// generic decoder makes one of each per octet); `MARKBASE_COOP_WV=0` turns it off.
    wv: bool,
    /// The f16 activations 16 bytes at a time, a loader's words interleaved with its token's
    /// other loaders' (`XW`, where each loader takes an even number of vec4<f16>: tiles of 64 or
    /// 128 tokens, or steps of 64), so that a subgroup's load reads whole 32-byte sectors;
    /// `MARKBASE_COOP_XW=0` turns it off.
    xw: bool,
}

/// Default steps ahead of the weights' loads ([`LoadOptions`]).
const DEPTH: u32 = 4;

impl LoadOptions {
    fn of(fmt: GpuFormat, mt: u8, bk: u8, db: bool) -> LoadOptions {
        let off = |v: &str| std::env::var(v).is_ok_and(|v| v == "0");
        let depth = match std::env::var("MARKBASE_COOP_PD").ok().and_then(|v| v.parse::<u32>().ok()) {
            _ if db => 1,
            Some(d) => d.clamp(1, 8),
            None => DEPTH,
        };
        LoadOptions {
            depth,
            wv: matches!(fmt, GpuFormat::Affine { bits: 4, group, .. } if group >= 32) && !off("MARKBASE_COOP_WV"),
            xw: !off("MARKBASE_COOP_XW") && (bk as u32 * mt as u32) % 64 == 0,
        }
    }

    /// The kernel name's part: ` pdN`, ` wv`, ` xw`.
    fn suffix(&self) -> String {
        let mut n = if self.depth > 1 { format!(" pd{}", self.depth) } else { String::new() };
        n += if self.wv { " wv" } else { "" };
        n += if self.xw { " xw" } else { "" };
        n
    }
}

/// Whether `MARKBASE_COOP_ABLATE` (comma-separated) names the ablation `what` of
/// `gemm_coop.wgsl` (`nostage`: no staging; `now`: no weight staging; `nox`: no activations'
/// staging; `nowload`: weights made up, decoded and stored but never read; `noxload`: zeros
/// staged for the activations, never read; `half`: half the products): for timing its parts; the
/// results are wrong.
fn ablate(what: &str) -> bool {
    std::env::var("MARKBASE_COOP_ABLATE").is_ok_and(|v| v.split(',').any(|a| a == what))
}

fn variants() -> Vec<KernelSpec> {
    let mut v: Vec<KernelSpec> = [(false, false), (true, false), (true, true)].map(|(xvec, lo)| KernelSpec::RowScale { xvec, lo, aug: 0 }).to_vec();
    for aug in [32, 64, 128] {
        v.push(KernelSpec::RowScale { xvec: true, lo: true, aug });
    }
    for fmt in all_formats() {
        for (coop, m8) in [(false, false), (true, false), (true, true)] {
            let spec = |hilo, mt, vs, center, bk, db| KernelSpec::GemmF16 { fmt, coop, m8, hilo, mt, nt: 2, vs, center, bk, db, grouped: false, split: false };
            for (hilo, mt, vs) in [(Hilo::Both, 2, false), (Hilo::X, 4, false), (Hilo::Off, 4, true)] {
                v.push(spec(hilo, mt, vs, false, 32, false));
            }
            let centred = matches!(fmt, GpuFormat::Affine { bits, scale: FloatType::Bf16, .. } if bits <= 4);
            if matches!(fmt, GpuFormat::Affine { .. }) {
                for mt in [2, 4] {
                    v.push(spec(Hilo::X, mt, true, true, 32, false));
                }
            }
            // the staging options ([`staging`]) where they fit 48 KiB: for the format's split with
            // tiles of 64 tokens ([`hilo`], [`vs`]); without a split (the same staging for every
            // format) for 4-bit affine weights only
            let split = if centred || values_in_f16(fmt) { Hilo::X } else { Hilo::Both };
            let q4 = fmt == GpuFormat::Affine { bits: 4, group: 64, scale: FloatType::Bf16 };
            // a batch's decode step: the format's split, tiles of 64 tokens, K in parts
            v.push(KernelSpec::GemmF16 { fmt, coop, m8, hilo: split, mt: 2, nt: 2, vs: vs_default(split), center: centred, bk: 32, db: false, grouped: false, split: true });
            // tiles of 256 rows: the format's split, none (4-bit affine); both inputs split
            // would need 50 KiB
            for (hilo, center) in [(split, centred), (Hilo::Off, false)] {
                if hilo != Hilo::Off || q4 {
                    v.push(KernelSpec::GemmF16 { fmt, coop, m8, hilo, mt: 2, nt: 4, vs: vs_default(hilo) || hilo == Hilo::Off, center, bk: 32, db: false, grouped: false, split: false });
                }
            }
            // and 128 tokens x 256 rows (the format's split, where it fits 48 KiB)
            if smem_bytes(coop, split, 4, 4, 32, false) <= 48 << 10 {
                v.push(KernelSpec::GemmF16 { fmt, coop, m8, hilo: split, mt: 4, nt: 4, vs: vs_default(split), center: centred, bk: 32, db: false, grouped: false, split: false });
            }
            for (hilo, mt, center) in [(split, 2, centred), (Hilo::Off, 2, false), (Hilo::Off, 4, false)] {
                for (bk, db) in [(64, false), (32, true), (64, true)] {
                    if (hilo != Hilo::Off || q4) && smem_bytes(coop, hilo, mt, 2, bk, db) <= 48 << 10 {
                        v.push(spec(hilo, mt, hilo == Hilo::X || hilo == Hilo::Off, center, bk, db));
                    }
                }
            }
            // the grouped GEMM (default staging): the format's split with both tiles, both inputs
            // split, none
            for (hilo, mt, center) in [(split, 2, centred), (split, 4, centred), (Hilo::Both, 2, false), (Hilo::Off, 4, false)] {
                v.push(KernelSpec::GemmF16 { fmt, coop, m8, hilo, mt, nt: 2, vs: vs_default(hilo), center, bk: 32, db: false, grouped: true, split: false });
            }
        }
    }
    v
}

/// Parts of K of a split GEMM ([`KernelSpec::GemmF16`] with `split`) of `tiles` tiles whose
/// activations' rows take `steps` steps: enough parts for about [`SPLIT_WORKGROUPS`] workgroups,
/// of at least [`SPLIT_MIN_STEPS`] steps each (and none empty). A batch's decode steps (up to 64
/// tokens: one tile of tokens) get the same parts at every row count for a given weight, so that
/// a row's sums do not change with the row count. `MARKBASE_COOP_KSPLIT` sets it (1: none),
/// `MARKBASE_COOP_SPLIT_WG` the workgroups aimed at.
pub fn ksplit(tiles: usize, steps: usize) -> usize {
    let target = std::env::var("MARKBASE_COOP_SPLIT_WG").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(SPLIT_WORKGROUPS);
    let want = std::env::var("MARKBASE_COOP_KSPLIT")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or_else(|| target.div_ceil(tiles.max(1)).min(steps / SPLIT_MIN_STEPS));
    let steps = steps.max(1);
    // every part holds steps.div_ceil(want) steps but the last
    steps.div_ceil(steps.div_ceil(want.clamp(1, steps)))
}

/// Parts of K ([`ksplit`]) the f16 GEMM `spec` (its tiles and steps) would take over `rows` rows
/// of `k` columns and `t` tokens, were it split; 1 for other kernels.
pub fn ksplit_for(spec: &KernelSpec, rows: usize, k: usize, t: usize) -> usize {
    match *spec {
        KernelSpec::GemmF16 { mt, nt, bk, .. } => ksplit(tiles(rows, t, mt, nt), k_aug(spec, k).div_ceil(bk as usize)),
        _ => 1,
    }
}

/// Tiles of the (ungrouped) f16 GEMM over `rows` rows and `t` tokens with `mt` and `nt`:
/// [`tile_rows`] rows by 32 `mt` tokens.
pub fn tiles(rows: usize, t: usize, mt: u8, nt: u8) -> usize {
    div_ceil(rows, tile_rows(nt)) * div_ceil(t, 32 * mt as usize)
}

/// Whether prefill's f16 GEMM over `rows` x `k` and `t` tokens cuts K ([`ksplit`]): with
/// `MARKBASE_COOP_SPLIT=1`, where the backend merges in a kernel and the tiles would leave the GPU
/// short of [`SPLIT_WORKGROUPS`]. Off by default: on an H100 (pp512) it took the 12B from 2,124 to
/// 1,972 tok/s and the 1B from 17,702 to 14,553.
pub fn prefill_split(spec: &KernelSpec, rows: usize, k: usize, t: usize, merge: bool) -> bool {
    let KernelSpec::GemmF16 { grouped: false, .. } = *spec else { return false };
    // (rows unknown: usize::MAX)
    merge && rows < usize::MAX && std::env::var("MARKBASE_COOP_SPLIT").is_ok_and(|v| v == "1") && ksplit_for(spec, rows, k, t) > 1
}

/// Workgroups a split GEMM aims at ([`ksplit`]): two per multiprocessor of an H100 or H200.
pub const SPLIT_WORKGROUPS: usize = 264;
/// Fewest steps per part of a split GEMM.
pub const SPLIT_MIN_STEPS: usize = 8;

/// Workgroups of the GEMM over `rows` rows and `t` tokens with `mt` and `nt` (each dimension
/// capped at `maxg`; the kernel walks the rest); grouped over the pairs of `experts` experts: a
/// slot for each possible tile (each expert's last may be partial).
pub fn gemm_groups(rows: usize, t: usize, mt: u8, nt: u8, experts: Option<usize>, maxg: u32) -> [u32; 3] {
    let tiles = div_ceil(t, 32 * mt as usize) + experts.unwrap_or(0);
    [div_ceil(rows, tile_rows(nt)).min(maxg as usize) as u32, tiles.min(maxg as usize) as u32, 1]
}

/// Workgroups of the activations' pass over `t` tokens (padded to 128).
pub fn row_scale_groups(t: usize, maxg: u32) -> [u32; 3] {
    [(t.div_ceil(128).max(1) * 128).min(maxg as usize) as u32, 1, 1]
}
