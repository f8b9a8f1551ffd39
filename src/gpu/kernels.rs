//! Kernel pipelines: the cache and what every kernel family shares.
//!
//! [`Kernels`] builds (and caches) one compute pipeline per [`KernelSpec`]: a kernel
//! family specialized by generated `const`s and preprocessor flags (see
//! [`super::shader`]), in a subgroup or a non-subgroup variant chosen at creation.
//! Each family lives in a module of [`super::ops`] beside its WGSL file: its specs' names
//! and sources, its launchers (`MatMulKernel`, `RmsNormKernel`, ...), which
//! - compute the small uniform params struct for a shape (`params`),
//! - build a bind group from caller-owned buffers (`bind_group`; build once, reuse),
//! - record their dispatch(es) into a caller-provided compute pass (`dispatch`),
//!
//! and the lowering of its graph ops to dispatches.
//!
//! A runtime can therefore pre-build every bind group of a graph and encode a
//! whole phase in one compute pass; per step only params bytes may change.
//! Every params struct is `Pod`: write it with `queue.write_buffer` or create it
//! with [`Gpu::uniform`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use markbase_graph::ops::NormScale;
use markbase_graph::quant::FloatType;

use super::device::{Backend, Gpu, GpuError};
use super::ops::gemm_f16::{CoopMode, Hilo};
use super::ops::FAMILIES;
use super::shader::{reflect_bindings, BindKind, Source};
use super::weights::GpuFormat;

pub use super::ops::argmax::{ArgmaxKernel, ArgmaxParams};
pub use super::ops::audio::{AudioKernel, AudioParams, MAX_AUDIO_HEAD_DIM, MAX_AUDIO_WINDOW};
pub use super::ops::batched::BatchedParams;
pub use super::ops::attention::{attention_splits, AttentionKernel, AttentionParams, AttnScratch, MAX_HEAD_DIM};
pub use super::ops::copy::{CopyKernel, CopyParams};
pub use super::ops::elementwise::{ElementwiseKernel, ElementwiseParams};
pub use super::ops::embed::{EmbedKernel, EmbedParams};
pub use super::kv::KvChunkParams;
pub use super::ops::kv_write::{KvWriteKernel, KvWriteParams};
pub use super::ops::matmul::{
    gemm_ksplit, GatherDims, MatMulDims, MatMulKernel, MatMulParams, GEMM_MIN_T, GEMM_SPLIT_MIN_K, GEMM_SPLIT_WORKGROUPS,
    GEMM_WIDE_MIN_TILES, GEMV_BP2, GEMV_CAT_FEW_ROWS, GEMV_DUAL_NARROW_N, GEMV_DUAL_WIDE_N, GEMV_FEW_GROUPS, GEMV_FEW_MIN_K,
};
pub use super::ops::rmsnorm::{RmsNormKernel, RmsNormParams};
pub use super::ops::rope::{rope_turn_fraction, RopeKernel, RopeParams, MAX_ROPE_PAIRS};
pub use super::ops::routing::{MoeGroupKernel, MoeGroupParams, RoutingKernel, RoutingParams};
pub use super::ops::vision::{VisionKernel, VisionParams};

pub(crate) const COMMON: &str = include_str!("../../wgsl/common.wgsl");
pub(crate) const WEIGHTS: &str = include_str!("../../wgsl/weights.wgsl");
/// `hi4`, the f16 kernels' hi + lo split.
pub(crate) const F16_SPLIT: &str = include_str!("../../wgsl/f16_split.wgsl");

/// Invocations per workgroup of the elementwise-like kernels (elementwise, copy, kv write,
/// weighted sum).
pub(crate) const ELEM_WG: u32 = 256;

pub(crate) fn dt_code(t: FloatType) -> u32 {
    match t {
        FloatType::Bf16 => 0,
        FloatType::F16 => 1,
        FloatType::F32 => 2,
    }
}

/// Mode code of a norm's scale convention in the kernels' params.
pub(crate) fn norm_mode(s: NormScale) -> u32 {
    match s {
        NormScale::None => 0,
        NormScale::W => 1,
        NormScale::OnePlusW => 2,
    }
}

/// A params struct bound to a kernel as a uniform: its fields' names and byte offsets, in
/// declaration order (checked against the WGSL structs by the params layout test).
pub trait ParamsLayout: bytemuck::Pod {
    const NAME: &'static str;
    fn fields() -> Vec<(&'static str, usize)>;
}

/// Declares a `#[repr(C)]` params struct and its [`ParamsLayout`].
macro_rules! params_struct {
    ($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident: $t:ty,)* }) => {
        $(#[$m])*
        #[repr(C)]
        pub struct $name { $($(#[$fm])* pub $f: $t,)* }
        impl $crate::gpu::kernels::ParamsLayout for $name {
            const NAME: &'static str = stringify!($name);
            fn fields() -> Vec<(&'static str, usize)> {
                vec![$((stringify!($f), std::mem::offset_of!($name, $f)),)*]
            }
        }
    };
}
pub(crate) use params_struct;


/// One specialization of a kernel family (its prelude consts and flags): the cache key of a
/// pipeline. Each variant's name, WGSL source and representative set live in its family's
/// module of [`super::ops`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelSpec {
    /// `wg` invocations, `rows` rows and `tt` tokens per workgroup; `xvec`: K % 32 == 0;
    /// `bp2`: two 32-element blocks per invocation and step (`tt == 1` only); `half`: half
    /// blocks where the kernel allows them (see `gemv_half`);
    /// `norm`: an RMSNorm of x fused in front (`tt == 1`, not gathered), with its
    /// weight's dtype (`Some(None)`: no weight).
    /// `dual`: two weights (gate and up) whose rows combine as `gelu(gate) * up` (`tt == 1`,
    /// not gathered, not `bp2`).
    /// `several`: the several-token path even with `tt == 1` (a batch's decode step of one row:
    /// each row's sums as at every other row count; no `bp2`, `norm` or `dual`).
    Gemv { fmt: GpuFormat, wg: u32, rows: u32, tt: u32, gather: bool, xvec: bool, bp2: bool, norm: Option<Option<FloatType>>, dual: bool, half: bool, several: bool },
    /// One token, a fused norm (weight dtype `norm`) and `n` (2 or 3) weights of one format
    /// whose outputs lie side by side (`Op::NormMatMul` over q, k and v).
    GemvCat { fmt: GpuFormat, wg: u32, rows: u32, xvec: bool, norm: Option<FloatType>, n: u32, half: bool },
    /// `wide`: 128 rows per workgroup tile instead of 64; `split`: K cut into parts merged by
    /// the last workgroup of each tile (not `wide`; see [`gemm_ksplit`]); `xvec`: K % 4 == 0
    /// (vec4 activation loads).
    Gemm { fmt: GpuFormat, wide: bool, split: bool, xvec: bool },
    /// The GEMM over the pairs of each expert (`Op::GroupedMatMul`).
    GroupedGemm { fmt: GpuFormat },
    /// The prefill GEMM on f16 tiles (`gemm_coop.wgsl`): `coop` on cooperative matrices, else its
    /// FMA twin; `hilo`: which inputs go as two f16 (hi and lo); `mt`: 16 x 16 results per
    /// subgroup along the tokens (2 or 4: tiles of 64 or 128 tokens), `nt` along the rows (2 or 4,
    /// with `mt` 2 and `bk` 32: tiles of 128 or 256 rows); `vs`: workgroup buffers of
    /// vec4<f16>; `center`: affine weights centred, their biases as extra columns of K (see
    /// [`super::ops::gemm_f16::center`]). See [`super::ops::gemm_f16`].
    /// `m8`: on 8 x 8 cooperative matrices (Metal's) instead of 16 x 16. `bk`: K per step (32 or
    /// 64); `db`: two copies of each workgroup buffer, one barrier per step. `grouped`: over the
    /// pairs of each expert (`Op::GroupedMatMul`, binding 3 the `Op::MoeGroup` value).
    GemmF16 { fmt: GpuFormat, coop: bool, m8: bool, hilo: Hilo, mt: u8, nt: u8, vs: bool, center: bool, bk: u8, db: bool, grouped: bool, split: bool },
    /// The f16 GEMM's activations: per-token scales and x / s in f16 (`row_scale.wgsl`);
    /// `xvec`: K % 4 == 0; `lo`: with the lo parts (`Hilo::X`, `Hilo::Both`); `aug`: the weight
    /// group whose sums follow each row (a centring GEMM's), or 0.
    RowScale { xvec: bool, lo: bool, aug: u32 },
    Embed { fmt: GpuFormat },
    /// `res`: adds a residual (`Op::RmsNormAdd`); `scalar`: then multiplies by a scalar weight
    /// of that dtype.
    /// `steps`: rows of at most `8 * steps * NORM_WG` values held in registers (1 or 2; 0: any
    /// length, walked in steps).
    RmsNorm { w: Option<FloatType>, res: bool, scalar: Option<FloatType>, steps: u32 },
    /// `norm`: an RMSNorm per head in front (`Op::NormRope`), with its weight's dtype; `cache`:
    /// rows written to KV cache slots (`Op::KvWriteNormRope`); `chunk` (with `cache`): to one
    /// chunk of a chunked cache ([`super::kv`]).
    Rope { norm: Option<Option<FloatType>>, cache: bool, chunk: bool },
    /// `chunk`: rows written to one chunk of a chunked cache ([`super::kv`]).
    KvWrite { chunk: bool },
    /// `dpt` output dims per invocation (`ceil(D / 128)`), `split`: partial outputs; `qrope`:
    /// q's RMSNorm (weight dtype) and RoPE in front (`Op::NormRopeAttention`); `merge` (with
    /// `split`): the last workgroup of each query head to finish merges the partials itself;
    /// `chunk` (with `split`, not `merge`): the keys of one chunk of chunked caches
    /// ([`super::kv`]).
    Attention { dpt: u32, split: bool, qrope: Option<Option<FloatType>>, merge: bool, append: bool, chunk: bool },
    AttnCombine,
    GeGlu,
    Binary { b: FloatType },
    Unary,
    TopK,
    TopKSoftmax { scale: Option<FloatType> },
    WeightedSum,
    /// `Op::MoeGroup` (one workgroup).
    MoeGroup,
    Copy,
    Argmax { wg: u32 },
    /// A batch's cache write (`Op::KvWriteBatched`) or attention (`Op::AttentionBatched`)
    /// (`batched.wgsl`).
    Batched { attention: bool },
    /// `Op::Sample`: stage `stage` of [`super::sample::STAGES`] (see [`super::sample`]).
    Sample { stage: u32 },
    /// The vision towers' ops (`vision.wgsl`).
    Vision(super::ops::vision::VisionKernel),
    /// The vision towers' attention on f16 tiles (`vision_attn_coop.wgsl`): `coop` on
    /// cooperative matrices, else its FMA twin; heads padded to `16 d16`; `kt` keys per tile (16
    /// or 32); `hilo_p`, `hilo_v`: the weights and V as hi + lo f16 pairs; `mask`: a key-validity
    /// input; `v4`: vec4 loads (the head dim a multiple of 4); `pf`: the next key tile's loads
    /// in flight during the P V products. See [`super::ops::vision_coop`].
    VisionAttnF16 { coop: bool, mask: bool, d16: u8, kt: u8, hilo_p: bool, hilo_v: bool, v4: bool, pf: bool },
    /// The audio tower's ops (`audio.wgsl`).
    Audio(super::ops::audio::AudioKernel),
}


/// weights.wgsl's consts and flags for `fmt`; `vec2`: the packed words bound as `vec2<u32>` (the
/// GEMV's half blocks, 4-bit affine), else as `vec4<u32>` on the fast paths.
pub(crate) fn weight_source(src: Source, fmt: GpuFormat, fast: bool, k_mult32: bool, vec2: bool) -> Source {
    let (wfmt, fdt) = match fmt {
        GpuFormat::Affine { .. } => (0, 2),
        GpuFormat::Mxfp4 => (1, 2),
        GpuFormat::Mxfp8 => (2, 2),
        GpuFormat::Nvfp4 { .. } => (3, 2),
        GpuFormat::Float(t) => (4, dt_code(t)),
    };
    let sdt = match fmt {
        GpuFormat::Affine { scale, .. } => dt_code(scale),
        _ => 2,
    };
    let bits = if fmt.is_quantized() { fmt.bits() } else { 16 };
    let fast4 = fast && k_mult32 && fmt.is_quantized() && bits == 4;
    let fast8 = fast && k_mult32 && fmt.is_quantized() && bits == 8;
    let fast_bf16 = fast && k_mult32 && fmt == GpuFormat::Float(FloatType::Bf16);
    let fast_f32 = fast && k_mult32 && fmt == GpuFormat::Float(FloatType::F32);
    src.c("WFMT", wfmt)
        .c("WBITS", bits)
        .c("WGROUP", fmt.group())
        .c("SDT", sdt)
        .c("FDT", fdt)
        .flag("W_FLOAT", !fmt.is_quantized())
        .flag("W_QUANT", fmt.is_quantized())
        .flag("W_AFFINE", fmt.has_biases())
        .flag("W_GLOBAL", fmt.has_global())
        .flag("W_FAST4", fast4)
        .flag("W_FAST8", fast8)
        .flag("W_FASTBF16", fast_bf16)
        .flag("W_FASTF32", fast_f32)
        .flag("W_VEC4", !vec2 && (fast4 || fast8 || fast_bf16 || fast_f32))
        .flag("W_VEC2", vec2)
}

impl KernelSpec {
    /// Whether the spec has a subgroup variant (the others ignore the choice).
    pub fn uses_subgroups(&self) -> bool {
        matches!(self, KernelSpec::Gemv { .. } | KernelSpec::GemvCat { .. } | KernelSpec::RmsNorm { .. } | KernelSpec::Attention { .. })
    }

    pub fn name(&self) -> String {
        FAMILIES.iter().find_map(|f| (f.name)(self)).expect("every spec belongs to a family")
    }

    /// The WGSL source of this spec.
    pub fn source(&self, subgroups: bool) -> Source {
        let sg = subgroups && self.uses_subgroups();
        FAMILIES.iter().find_map(|f| (f.source)(self, sg)).expect("every spec belongs to a family")
    }

    /// A representative set of every family and variant (for the naga target test).
    pub fn all_variants() -> Vec<KernelSpec> {
        FAMILIES.iter().flat_map(|f| (f.variants)()).collect()
    }
}

/// Every weight format the kernels decode.
pub fn all_formats() -> Vec<GpuFormat> {
    let mut v = vec![GpuFormat::Float(FloatType::Bf16), GpuFormat::Float(FloatType::F16), GpuFormat::Float(FloatType::F32)];
    for bits in [1, 2, 3, 4, 5, 6, 8] {
        v.push(GpuFormat::Affine { bits, group: 64, scale: FloatType::Bf16 });
    }
    v.push(GpuFormat::Affine { bits: 4, group: 32, scale: FloatType::F16 });
    v.push(GpuFormat::Affine { bits: 8, group: 128, scale: FloatType::F32 });
    v.extend([GpuFormat::Mxfp4, GpuFormat::Mxfp8, GpuFormat::Nvfp4 { global: false }, GpuFormat::Nvfp4 { global: true }]);
    v
}

/// Runtime checks wgpu/naga inject into the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShaderChecks {
    /// wgpu's default: bounds checks, loop bounding, integer-division guards.
    All,
    /// Bounds checks only (no loop bounding, no division guards): every kernel's loops
    /// have bounds from its params, and the divisors are shapes (never zero).
    BoundsOnly,
    /// No injected checks (`ShaderRuntimeChecks::unchecked`).
    None,
}

impl ShaderChecks {
    /// `MARKBASE_SHADER_CHECKS=all|bounds|none`, or `MARKBASE_UNCHECKED=1` for `none`; default `all`.
    pub fn from_env() -> ShaderChecks {
        if std::env::var("MARKBASE_UNCHECKED").is_ok_and(|v| v == "1") {
            return ShaderChecks::None;
        }
        match std::env::var("MARKBASE_SHADER_CHECKS").as_deref() {
            Ok("none") => ShaderChecks::None,
            Ok("bounds") => ShaderChecks::BoundsOnly,
            _ => ShaderChecks::All,
        }
    }
}

/// How pipelines are built.
#[derive(Clone, Copy, Debug)]
pub struct KernelOptions {
    /// Use the subgroup variants (requires the device's SUBGROUP feature and subgroups of at
    /// least 8 invocations: attention's scores shuffle within groups of eight).
    pub subgroups: bool,
    /// Injected runtime checks; anything but `All` goes through `create_shader_module_trusted`.
    pub checks: ShaderChecks,
    /// One-token affine 4-bit GEMVs over half blocks (two invocations per block: coalesced
    /// activation loads on a GPU); whole blocks cost less on a CPU adapter, where there is
    /// nothing to coalesce and twice the invocations cost twice the scale loads and sums.
    pub half_blocks: bool,
    /// Split decode attention merges its partials in the workgroup of each head that finishes
    /// last (a device-scope fence and an atomic counter per head) instead of a second
    /// dispatch. Vulkan only: its storage barriers are device-scope fences (SPIR-V), which
    /// the Metal, D3D12 and GL translations do not promise (nor MoltenVK, a Vulkan over Metal).
    pub merge_splits: bool,
    /// Which GEMM prefill takes: f32, or f16 tiles on cooperative matrices or their FMA twin.
    pub coop: CoopMode,
}

impl KernelOptions {
    /// Subgroups when the device has them (of 8 invocations or more); checks from
    /// [`ShaderChecks::from_env`]; half blocks unless the adapter is a CPU.
    pub fn for_gpu(gpu: &Gpu) -> Self {
        KernelOptions {
            subgroups: gpu.info.subgroups && gpu.info.subgroup_min_size >= 8,
            checks: ShaderChecks::from_env(),
            half_blocks: gpu.info.device_type != "cpu",
            merge_splits: gpu.info.backend == Backend::Vulkan && !gpu.info.driver.contains("MoltenVK") && env_on("MARKBASE_ATTN_MERGE"),
            coop: CoopMode::for_gpu(gpu),
        }
    }
}

/// A compiled kernel: pipeline plus the layout of its bind group (group 0).
pub struct Kernel {
    pub name: String,
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
    /// Binding numbers and kinds, sorted.
    pub bindings: Vec<(u32, BindKind)>,
}

impl Kernel {
    /// A bind group from `(binding, resource)` pairs; every binding of the kernel exactly once.
    pub fn bind_group(&self, device: &wgpu::Device, res: &[(u32, wgpu::BindingResource<'_>)]) -> wgpu::BindGroup {
        let mut want: Vec<u32> = self.bindings.iter().map(|b| b.0).collect();
        let mut have: Vec<u32> = res.iter().map(|r| r.0).collect();
        want.sort_unstable();
        have.sort_unstable();
        assert_eq!(want, have, "{}: bindings given {have:?}, kernel has {want:?}", self.name);
        let entries: Vec<wgpu::BindGroupEntry> =
            res.iter().map(|(b, r)| wgpu::BindGroupEntry { binding: *b, resource: r.clone() }).collect();
        device.create_bind_group(&wgpu::BindGroupDescriptor { label: Some(&self.name), layout: &self.layout, entries: &entries })
    }

    /// Like [`Kernel::bind_group`] with whole buffers.
    pub fn bind_buffers(&self, device: &wgpu::Device, bufs: &[(u32, &wgpu::Buffer)]) -> wgpu::BindGroup {
        let res: Vec<(u32, wgpu::BindingResource)> = bufs.iter().map(|(b, buf)| (*b, buf.as_entire_binding())).collect();
        self.bind_group(device, &res)
    }

    /// Records one dispatch.
    pub fn dispatch(&self, pass: &mut wgpu::ComputePass<'_>, bg: &wgpu::BindGroup, groups: [u32; 3]) {
        if groups.contains(&0) {
            return;
        }
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, bg, &[]);
        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
    }
}

/// Pipeline factory and cache.
pub struct Kernels {
    device: wgpu::Device,
    pub opts: KernelOptions,
    pub limits: wgpu::Limits,
    cache: Mutex<HashMap<KernelSpec, Arc<Kernel>>>,
}

/// Splits `n` workgroups over x (and y when above the per-dimension limit); the
/// kernels walk `gid.x + gid.y * stride` so any coverage works.
pub(crate) fn grid(n: u64, max: u32) -> [u32; 3] {
    let n = n.max(1);
    if n <= max as u64 {
        [n as u32, 1, 1]
    } else {
        let y = n.div_ceil(max as u64).min(max as u64);
        [max, y as u32, 1]
    }
}

/// A switch read from the environment: on unless set to `0`.
pub(crate) fn env_on(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
}

/// A tuning override from the environment.
pub(crate) fn env_u32(name: &str) -> Option<u32> {
    std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok())
}


pub(crate) fn div_ceil(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl Kernels {
    pub fn new(gpu: &Gpu, opts: KernelOptions) -> Result<Kernels, GpuError> {
        if opts.subgroups && !gpu.info.subgroups {
            return Err(GpuError::Other("subgroup kernels requested but the device has no SUBGROUP feature".into()));
        }
        Ok(Kernels { device: gpu.device.clone(), opts, limits: gpu.info.limits.clone(), cache: Mutex::new(HashMap::new()) })
    }

    /// With [`KernelOptions::for_gpu`].
    pub fn for_gpu(gpu: &Gpu) -> Result<Kernels, GpuError> {
        Kernels::new(gpu, KernelOptions::for_gpu(gpu))
    }

    pub(crate) fn maxg(&self) -> u32 {
        self.limits.max_compute_workgroups_per_dimension
    }

    /// The pipeline of `spec`, built on first use.
    pub fn get(&self, spec: KernelSpec) -> Result<Arc<Kernel>, GpuError> {
        if let Some(k) = self.cache.lock().unwrap().get(&spec) {
            return Ok(k.clone());
        }
        let k = Arc::new(self.build(spec)?);
        self.cache.lock().unwrap().insert(spec, k.clone());
        Ok(k)
    }

    fn build(&self, spec: KernelSpec) -> Result<Kernel, GpuError> {
        let name = format!("{}{}", spec.name(), if self.opts.subgroups && spec.uses_subgroups() { "+sg" } else { "" });
        let text = spec.source(self.opts.subgroups).text();
        let kerr = |msg: String| GpuError::Kernel { name: name.clone(), msg };
        let bindings = reflect_bindings(&text).map_err(kerr)?;
        let dev = &self.device;
        let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor { label: Some(&name), source: wgpu::ShaderSource::Wgsl(text.as_str().into()) };
        let module = match self.opts.checks {
            ShaderChecks::All => dev.create_shader_module(desc),
            checks => {
                let mut rc = wgpu::ShaderRuntimeChecks::unchecked();
                rc.bounds_checks = checks == ShaderChecks::BoundsOnly;
                // SAFETY: every kernel loop is bounded by its params, integer divisors are
                // shapes the launchers check to be non-zero, and (for `None`) every index is
                // guarded by the shape in the params. Opt-in (MARKBASE_SHADER_CHECKS /
                // MARKBASE_UNCHECKED); CI runs the default, fully checked modules.
                unsafe { dev.create_shader_module_trusted(desc, rc) }
            }
        };
        let entries: Vec<wgpu::BindGroupLayoutEntry> = bindings
            .iter()
            .map(|&(binding, kind)| wgpu::BindGroupLayoutEntry {
                binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: match kind {
                        BindKind::Uniform => wgpu::BufferBindingType::Uniform,
                        BindKind::Read => wgpu::BufferBindingType::Storage { read_only: true },
                        BindKind::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
            .collect();
        let layout = dev.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(&name), entries: &entries });
        let pl = dev.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(&name),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&name),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions { constants: &[], zero_initialize_workgroup_memory: false },
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(kerr(e.to_string()));
        }
        Ok(Kernel { name, pipeline, layout, bindings })
    }

}
