//! The wgpu device: instance, adapter, device and queue, chosen by backend, with
//! the adapter's own limits and optional features, plus buffer helpers.

use std::fmt;
use std::str::FromStr;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use wgpu::util::DeviceExt;

/// A graphics API wgpu can run compute on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    Vulkan,
    Metal,
    Dx12,
    Gl,
}

impl Backend {
    pub const ALL: [Backend; 4] = [Backend::Vulkan, Backend::Metal, Backend::Dx12, Backend::Gl];

    /// The platform's best backend: Metal on Apple platforms, Vulkan elsewhere.
    pub fn platform_default() -> Backend {
        if cfg!(any(target_os = "macos", target_os = "ios")) {
            Backend::Metal
        } else {
            Backend::Vulkan
        }
    }

    /// `MARKBASE_BACKEND`, else `WGPU_BACKEND` (a comma list; its first entry that names
    /// one of ours). `Ok(None)` when neither is set; an error for a value we cannot parse.
    pub fn from_env() -> Result<Option<Backend>, GpuError> {
        if let Ok(v) = std::env::var("MARKBASE_BACKEND") {
            if !v.trim().is_empty() {
                return v.parse().map(Some);
            }
        }
        if let Ok(v) = std::env::var("WGPU_BACKEND") {
            let found = v.split(',').find_map(|s| s.parse::<Backend>().ok());
            return match found {
                Some(b) => Ok(Some(b)),
                None if v.trim().is_empty() => Ok(None),
                None => Err(GpuError::BadBackend(v)),
            };
        }
        Ok(None)
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Vulkan => "vulkan",
            Backend::Metal => "metal",
            Backend::Dx12 => "dx12",
            Backend::Gl => "gl",
        }
    }

    pub fn to_wgpu(self) -> wgpu::Backends {
        match self {
            Backend::Vulkan => wgpu::Backends::VULKAN,
            Backend::Metal => wgpu::Backends::METAL,
            Backend::Dx12 => wgpu::Backends::DX12,
            Backend::Gl => wgpu::Backends::GL,
        }
    }
}

impl FromStr for Backend {
    type Err = GpuError;
    fn from_str(s: &str) -> Result<Self, GpuError> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "vulkan" | "vk" => Backend::Vulkan,
            "metal" | "mtl" => Backend::Metal,
            "dx12" | "d3d12" => Backend::Dx12,
            "gl" | "gles" | "opengl" | "webgl" | "webgl2" => Backend::Gl,
            _ => return Err(GpuError::BadBackend(s.to_string())),
        })
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("unknown GPU backend {0:?} (expected vulkan|metal|dx12|gl)")]
    BadBackend(String),
    #[error("no GPU adapter found; tried {tried}{hint}")]
    NoAdapter { tried: String, hint: String },
    #[error("requesting a device from {adapter} failed: {msg}")]
    RequestDevice { adapter: String, msg: String },
    #[error("kernel {name}: {msg}")]
    Kernel { name: String, msg: String },
    #[error("GPU readback failed: {0}")]
    Readback(String),
    /// A buffer that could not be created: over a limit, out of memory, or refused by the device.
    #[error("{0}")]
    Alloc(String),
    #[error("{0}")]
    Other(String),
}

/// `bytes` for messages: "512 MiB", "3.5 KiB", "12 bytes".
pub fn fmt_bytes(bytes: u64) -> String {
    let (v, unit) = match bytes {
        b if b >= 1 << 30 => (b as f64 / (1u64 << 30) as f64, "GiB"),
        b if b >= 1 << 20 => (b as f64 / (1u64 << 20) as f64, "MiB"),
        b if b >= 1 << 10 => (b as f64 / 1024.0, "KiB"),
        b => return format!("{b} bytes"),
    };
    if v.fract() == 0.0 { format!("{v:.0} {unit}") } else { format!("{v:.1} {unit}") }
}

/// How to pick the device.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// `None`: [`Backend::from_env`], else [`Backend::platform_default`].
    pub backend: Option<Backend>,
    /// Only adapters whose name contains this (case-insensitive); `None`: `MARKBASE_ADAPTER`.
    pub adapter_name: Option<String>,
    /// wgpu/driver validation layers (slow). `None`: off, unless wgpu's `WGPU_VALIDATION`/`WGPU_DEBUG` say so.
    pub validation: Option<bool>,
}

/// What the chosen adapter is and what the device was created with (for benchmark reports).
#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub name: String,
    pub backend: Backend,
    pub device_type: String,
    pub vendor: u32,
    pub device: u32,
    pub driver: String,
    pub driver_info: String,
    pub subgroup_min_size: u32,
    pub subgroup_max_size: u32,
    pub shader_f16: bool,
    pub subgroups: bool,
    pub timestamps: bool,
    pub timestamps_inside_passes: bool,
    /// Cooperative matrices of 16 x 16 x 16, f16 inputs and f32 accumulators (the device was
    /// opened with them).
    pub coop_f16_16: bool,
    /// Cooperative matrices of 8 x 8 x 8 only (Metal's simdgroup matrices), f16 inputs and f32
    /// accumulators (the device was opened with them).
    pub coop_f16_8: bool,
    /// Limits the device was created with (the adapter's own).
    pub limits: wgpu::Limits,
}

impl GpuInfo {
    /// One line for logs.
    pub fn summary(&self) -> String {
        format!(
            "{} ({}, {}, driver {} {}) subgroups {} [{}..{}] f16 {} coop16 {} timestamps {} max binding {} MiB, workgroup mem {} KiB",
            self.name,
            self.backend,
            self.device_type,
            self.driver,
            self.driver_info,
            self.subgroups,
            self.subgroup_min_size,
            self.subgroup_max_size,
            self.shader_f16,
            self.coop_f16_16,
            self.timestamps,
            self.limits.max_storage_buffer_binding_size >> 20,
            self.limits.max_compute_workgroup_storage_size >> 10,
        )
    }
}

/// An opened GPU: instance, adapter, device, queue.
pub struct Gpu {
    pub instance: wgpu::Instance,
    pub adapter: wgpu::Adapter,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: GpuInfo,
    faults: Arc<Faults>,
}

/// Errors no error scope caught (a validation error in a submission, a lost device),
/// recorded by the device's handlers instead of wgpu's default panic.
#[derive(Default)]
struct Faults {
    any: AtomicBool,
    first: Mutex<Option<String>>,
}

impl Faults {
    fn record(&self, msg: String) {
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert(msg);
        self.any.store(true, Ordering::Release);
    }
}

fn device_type_name(t: wgpu::DeviceType) -> &'static str {
    match t {
        wgpu::DeviceType::DiscreteGpu => "discrete",
        wgpu::DeviceType::IntegratedGpu => "integrated",
        wgpu::DeviceType::VirtualGpu => "virtual",
        wgpu::DeviceType::Cpu => "cpu",
        wgpu::DeviceType::Other => "other",
    }
}

fn device_rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

fn wgpu_backend_to_ours(b: wgpu::Backend) -> Option<Backend> {
    match b {
        wgpu::Backend::Vulkan => Some(Backend::Vulkan),
        wgpu::Backend::Metal => Some(Backend::Metal),
        wgpu::Backend::Dx12 => Some(Backend::Dx12),
        wgpu::Backend::Gl => Some(Backend::Gl),
        _ => None,
    }
}

impl Gpu {
    /// Opens the default device ([`GpuOptions::default`]).
    pub fn new() -> Result<Gpu, GpuError> {
        Gpu::with_options(&GpuOptions::default())
    }

    pub fn with_options(opts: &GpuOptions) -> Result<Gpu, GpuError> {
        pollster::block_on(Self::open(opts))
    }

    async fn open(opts: &GpuOptions) -> Result<Gpu, GpuError> {
        let backend = match opts.backend {
            Some(b) => b,
            None => Backend::from_env()?.unwrap_or_else(Backend::platform_default),
        };
        let name_filter = opts
            .adapter_name
            .clone()
            .or_else(|| std::env::var("MARKBASE_ADAPTER").ok().filter(|s| !s.is_empty()))
            .map(|s| s.to_lowercase());
        let mut flags = wgpu::InstanceFlags::empty();
        if let Some(v) = opts.validation {
            flags.set(wgpu::InstanceFlags::VALIDATION, v);
            flags.set(wgpu::InstanceFlags::DEBUG, v);
        } else {
            flags = flags.with_env();
        }
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = backend.to_wgpu();
        desc.flags = flags;
        let instance = wgpu::Instance::new(desc);
        let adapters = instance.enumerate_adapters(backend.to_wgpu()).await;
        let mut seen: Vec<String> = Vec::new();
        let mut best: Option<wgpu::Adapter> = None;
        for a in adapters {
            let info = a.get_info();
            seen.push(format!("{} ({})", info.name, device_type_name(info.device_type)));
            if let Some(f) = &name_filter {
                if !info.name.to_lowercase().contains(f) {
                    continue;
                }
            }
            let better = match &best {
                None => true,
                Some(b) => device_rank(info.device_type) < device_rank(b.get_info().device_type),
            };
            if better {
                best = Some(a);
            }
        }
        let Some(adapter) = best else {
            let mut hint = String::new();
            if seen.is_empty() {
                hint.push_str(": no adapters at all");
                if backend == Backend::Vulkan {
                    hint.push_str(
                        " (is a Vulkan driver installed? for CPU-only CI: apt-get install mesa-vulkan-drivers libvulkan1, \
                         and set VK_DRIVER_FILES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json)",
                    );
                }
            } else {
                hint = format!(": found {} but none matched the name filter {:?}", seen.join(", "), name_filter.unwrap_or_default());
            }
            return Err(GpuError::NoAdapter { tried: format!("backend {backend}"), hint });
        };
        let ainfo = adapter.get_info();
        let have = adapter.features();
        let want = wgpu::Features::SHADER_F16
            | wgpu::Features::SUBGROUP
            | wgpu::Features::SUBGROUP_BARRIER
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_ENCODERS
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        // cooperative matrices (experimental in wgpu): only where the f16 GEMM's configuration
        // is offered
        let props = adapter.cooperative_matrix_properties();
        let (has16, has8) = (crate::gpu::ops::gemm_f16::has_f16(&props, 16), crate::gpu::ops::gemm_f16::has_f16(&props, 8));
        let coop = have.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
            && (has16 || has8)
            && std::env::var("MARKBASE_COOP").map_or(true, |v| v != "0" && v != "off");
        let want = if coop { want | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX } else { want };
        let features = have & want;
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("markbase"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: if coop {
                    // SAFETY: the only experimental feature requested is cooperative matrices,
                    // used by the f16 GEMM alone; its kernels are checked against the CPU
                    // reference on such adapters, and MARKBASE_COOP=0 keeps the feature off.
                    unsafe { wgpu::ExperimentalFeatures::enabled() }
                } else {
                    wgpu::ExperimentalFeatures::disabled()
                },
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| GpuError::RequestDevice { adapter: ainfo.name.clone(), msg: e.to_string() })?;
        let info = GpuInfo {
            name: ainfo.name.clone(),
            backend: wgpu_backend_to_ours(ainfo.backend).unwrap_or(backend),
            device_type: device_type_name(ainfo.device_type).to_string(),
            vendor: ainfo.vendor,
            device: ainfo.device,
            driver: ainfo.driver.clone(),
            driver_info: ainfo.driver_info.clone(),
            subgroup_min_size: ainfo.subgroup_min_size,
            subgroup_max_size: ainfo.subgroup_max_size,
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            timestamps_inside_passes: features.contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES),
            coop_f16_16: features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) && has16,
            coop_f16_8: features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) && has8 && !has16,
            limits,
        };
        let faults = Arc::new(Faults::default());
        let f = faults.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| f.record(e.to_string())));
        let f = faults.clone();
        device.set_device_lost_callback(move |reason, msg| f.record(format!("device lost ({reason:?}): {msg}")));
        Ok(Gpu { instance, adapter, device, queue, info, faults })
    }

    /// The first error no error scope caught since the device opened (a failed
    /// submission, a lost device): once one happened the device's results cannot be trusted.
    pub fn fault(&self) -> Option<String> {
        if !self.faults.any.load(Ordering::Acquire) {
            return None;
        }
        self.faults.first.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn limits(&self) -> &wgpu::Limits {
        &self.info.limits
    }

    /// Largest byte size one storage binding may have (and one buffer may have).
    pub fn max_binding_bytes(&self) -> u64 {
        self.info.limits.max_storage_buffer_binding_size.min(self.info.limits.max_buffer_size)
    }

    /// Creates the buffer `purpose` of `size` bytes (holding `contents` when given, which
    /// must be `size` bytes). Sizes over the adapter's limits are refused before wgpu sees
    /// them; what the limits cannot predict (out of memory, a refusal by the driver) is
    /// caught by an error scope. The error names the buffer, its size and the limit.
    pub fn try_buffer(&self, purpose: &str, size: u64, usage: wgpu::BufferUsages, contents: Option<&[u8]>) -> Result<wgpu::Buffer, GpuError> {
        let l = &self.info.limits;
        let over = |limit: u64, what: &str| {
            GpuError::Alloc(format!("{purpose}: {} exceeds this adapter's {} {what} limit", fmt_bytes(size), fmt_bytes(limit)))
        };
        if usage.contains(wgpu::BufferUsages::STORAGE) && size > l.max_storage_buffer_binding_size {
            return Err(over(l.max_storage_buffer_binding_size, "storage binding"));
        }
        if usage.contains(wgpu::BufferUsages::UNIFORM) && size > l.max_uniform_buffer_binding_size {
            return Err(over(l.max_uniform_buffer_binding_size, "uniform binding"));
        }
        if size > l.max_buffer_size {
            return Err(over(l.max_buffer_size, "buffer size"));
        }
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let invalid = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let buf = match contents {
            Some(contents) => {
                self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: Some(purpose), contents, usage })
            }
            None => self.device.create_buffer(&wgpu::BufferDescriptor { label: Some(purpose), size, usage, mapped_at_creation: false }),
        };
        let failed = pollster::block_on(invalid.pop()).or(pollster::block_on(oom.pop()));
        match failed {
            None => Ok(buf),
            Some(e @ wgpu::Error::OutOfMemory { .. }) => {
                Err(GpuError::Alloc(format!("{purpose}: out of device memory allocating {}: {e}", fmt_bytes(size))))
            }
            Some(e) => Err(GpuError::Alloc(format!("{purpose}: creating a buffer of {} failed: {e}", fmt_bytes(size)))),
        }
    }

    /// A buffer holding `bytes` (zero-padded to a multiple of 4), usable as a read-only
    /// or read-write storage buffer and as a copy source/destination.
    pub fn try_upload(&self, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer, GpuError> {
        self.try_upload_with(label, bytes, storage_usage())
    }

    /// Like [`Gpu::try_upload`] with explicit usages.
    pub fn try_upload_with(&self, label: &str, bytes: &[u8], usage: wgpu::BufferUsages) -> Result<wgpu::Buffer, GpuError> {
        let padded;
        let contents = if bytes.len() % 4 != 0 || bytes.is_empty() {
            let mut v = bytes.to_vec();
            v.resize((bytes.len().max(1) + 3) / 4 * 4, 0);
            padded = v;
            &padded[..]
        } else {
            bytes
        };
        self.try_buffer(label, contents.len() as u64, usage, Some(contents))
    }

    /// A zeroed storage buffer of `bytes` (rounded up to 4, at least 4).
    pub fn try_storage(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        self.try_buffer(label, (bytes.max(4) + 3) / 4 * 4, storage_usage(), None)
    }

    /// A host-readable buffer of `bytes` (at least 4) to copy results into.
    pub fn try_staging(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer, GpuError> {
        self.try_buffer(label, bytes.max(4), wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST, None)
    }

    /// [`Gpu::try_upload`] for tests and tools, where a failed allocation may end the program.
    pub fn upload(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        self.try_upload(label, bytes).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Gpu::try_upload_with`] for tests and tools.
    pub fn upload_with(&self, label: &str, bytes: &[u8], usage: wgpu::BufferUsages) -> wgpu::Buffer {
        self.try_upload_with(label, bytes, usage).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn upload_f32(&self, label: &str, v: &[f32]) -> wgpu::Buffer {
        self.upload(label, bytemuck::cast_slice(v))
    }

    pub fn upload_u32(&self, label: &str, v: &[u32]) -> wgpu::Buffer {
        self.upload(label, bytemuck::cast_slice(v))
    }

    /// [`Gpu::try_storage`] for tests and tools.
    pub fn storage(&self, label: &str, bytes: u64) -> wgpu::Buffer {
        self.try_storage(label, bytes).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A uniform buffer holding `params` (a kernel's params struct); writable with `queue.write_buffer`.
    pub fn uniform<T: bytemuck::Pod>(&self, label: &str, params: &T) -> wgpu::Buffer {
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytemuck::bytes_of(params),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        })
    }

    /// Copies `bytes` bytes from the start of `buf` back to the host (waits for the GPU).
    pub fn readback(&self, buf: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>, GpuError> {
        let size = (bytes + 3) / 4 * 4;
        let staging = self.try_staging("readback staging", size)?;
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("readback") });
        enc.copy_buffer_to_buffer(buf, 0, &staging, 0, size);
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Readback(e.to_string()))?;
        rx.recv()
            .map_err(|e| GpuError::Readback(e.to_string()))?
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let view = staging.get_mapped_range(..).map_err(|e| GpuError::Readback(e.to_string()))?;
        let out = view[..bytes as usize].to_vec();
        drop(view);
        staging.unmap();
        Ok(out)
    }

    pub fn read_f32(&self, buf: &wgpu::Buffer, n: usize) -> Result<Vec<f32>, GpuError> {
        let b = self.readback(buf, (n * 4) as u64)?;
        Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    pub fn read_u32(&self, buf: &wgpu::Buffer, n: usize) -> Result<Vec<u32>, GpuError> {
        let b = self.readback(buf, (n * 4) as u64)?;
        Ok(b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Waits until all submitted work has finished.
    pub fn wait(&self) -> Result<(), GpuError> {
        self.device.poll(wgpu::PollType::wait_indefinitely()).map(|_| ()).map_err(|e| GpuError::Other(e.to_string()))
    }
}

/// Usages of every data buffer: storage plus both copy directions.
pub fn storage_usage() -> wgpu::BufferUsages {
    wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC
}
