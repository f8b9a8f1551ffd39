//! What a model's buffers need, checked against the device before anything is
//! allocated: each intermediate GPU buffer against the adapter's binding and buffer limits,
//! each KV cache's chunks ([`crate::gpu::kv`]) against what the attention merges, the caches
//! of the CPU and of software adapters (which allocate host memory) against the memory
//! available.

use markbase_graph::ir::{Graph, NodeKind};
use markbase_graph::passes::{compile, PhasePolicy};

/// Byte sizes of a model's buffers at one context length.
#[derive(Clone, Debug, Default)]
pub struct Needs {
    /// Every KV-cache buffer together (decode graph states).
    pub kv_bytes: u64,
    /// The largest KV cache (one layer's keys or values).
    pub largest_kv: u64,
    /// Each KV cache's slots and bytes per slot.
    pub kv_rows: Vec<(u64, u64)>,
    /// The largest intermediate (pool) buffer of a decode step or a prefill chunk.
    pub largest_pool: u64,
    /// All intermediate buffers of a prefill chunk together.
    pub pool_bytes: u64,
    /// The vision and audio towers (loaded on first use, checked with the text model).
    pub towers: Vec<TowerNeeds>,
}

/// What a vision or audio tower needs: its weights (tower and projector, as stored) and the
/// intermediate buffers of one run over its largest input (SigLIP's 4,096 patches, Gemma 4's
/// ViT at 1,120 soft tokens, the audio tower at its longest clip), attention's q/k/v and
/// output among them.
#[derive(Clone, Debug, Default)]
pub struct TowerNeeds {
    /// What it is, for messages ("the SigLIP vision tower at 4096 patches").
    pub name: String,
    pub weight_bytes: u64,
    /// The largest intermediate buffer of a run.
    pub largest_pool: u64,
    /// All intermediate buffers of a run together.
    pub pool_bytes: u64,
}

impl TowerNeeds {
    /// The needs of a tower graph (built over its largest input) whose weights store
    /// `weight_bytes`.
    pub fn of(name: impl Into<String>, graph: Graph, weight_bytes: u64) -> Result<TowerNeeds, String> {
        let c = compile(graph, PhasePolicy::EmbedLayersHead).map_err(|e| e.to_string())?;
        let sizes = c.alloc.pool_sizes.iter().map(|&s| s as u64);
        Ok(TowerNeeds { name: name.into(), weight_bytes, largest_pool: sizes.clone().max().unwrap_or(0), pool_bytes: sizes.sum() })
    }

    /// Weights and buffers together.
    pub fn bytes(&self) -> u64 {
        self.weight_bytes.saturating_add(self.pool_bytes)
    }
}

fn bytes(shape: &[usize]) -> u64 {
    let n: u128 = shape.iter().map(|&d| d as u128).product::<u128>() * 4;
    n.min(u64::MAX as u128) as u64
}

/// `1536 KiB`, `512 MiB`, `3.2 GiB`.
pub fn human(b: u64) -> String {
    const K: f64 = 1024.0;
    let f = b as f64;
    if f >= K * K * K {
        format!("{:.1} GiB", f / (K * K * K))
    } else if f >= K * K {
        format!("{:.0} MiB", f / (K * K))
    } else {
        format!("{:.0} KiB", f / K)
    }
}

impl Needs {
    /// The needs of a decode graph and a prefill-chunk graph (both at the model's context).
    pub fn of(decode: &Graph, prefill: &Graph) -> Result<Needs, String> {
        let mut n = Needs::default();
        for i in decode.g.node_indices() {
            let node = decode.node(i);
            if let NodeKind::State { .. } = node.kind {
                let b = bytes(&node.ty.shape);
                let slots = node.ty.shape.first().copied().unwrap_or(1) as u64;
                n.kv_rows.push((slots, bytes(node.ty.shape.get(1..).unwrap_or(&[]))));
                n.kv_bytes = n.kv_bytes.saturating_add(b);
                n.largest_kv = n.largest_kv.max(b);
            }
        }
        for (g, policy) in [(decode, PhasePolicy::Step), (prefill, PhasePolicy::EmbedLayersHead)] {
            let c = compile(g.clone(), policy).map_err(|e| e.to_string())?;
            let sizes = c.alloc.pool_sizes.iter().map(|&s| s as u64);
            n.largest_pool = n.largest_pool.max(sizes.clone().max().unwrap_or(0));
            n.pool_bytes = n.pool_bytes.max(sizes.sum());
        }
        Ok(n)
    }

    /// Every intermediate buffer within the adapter's largest storage binding and largest
    /// buffer; the KV caches in chunks of at most `kv_binding` bytes (see
    /// [`crate::gpu::kv::binding_limit`]); with `host_memory` (a software adapter), the caches
    /// and a prefill chunk's buffers within the memory available.
    pub fn fit_gpu(&self, adapter: &str, limits: &wgpu::Limits, kv_binding: u64, host_memory: bool) -> Result<(), String> {
        let binding = limits.max_storage_buffer_binding_size as u64;
        let buffer = limits.max_buffer_size;
        for (limit, name) in [(binding, "storage binding"), (buffer, "buffer")] {
            if let Some(t) = self.towers.iter().find(|t| t.largest_pool > limit) {
                return Err(format!(
                    "{}: an intermediate buffer needs {}, more than {adapter}'s {} {name} limit: this adapter cannot run the tower",
                    t.name,
                    human(t.largest_pool),
                    human(limit)
                ));
            }
            if self.largest_pool > limit {
                return Err(format!(
                    "an intermediate buffer needs {}, more than {adapter}'s {} {name} limit: lower --max-context (KV cache in all: {})",
                    human(self.largest_pool),
                    human(limit),
                    human(self.kv_bytes)
                ));
            }
        }
        if host_memory {
            self.fit_host()?;
        }
        for &(slots, row) in &self.kv_rows {
            crate::gpu::kv::chunk_slots(slots, row, kv_binding.min(binding).min(buffer)).map_err(|e| format!("{e} (KV cache in all: {})", human(self.kv_bytes)))?;
        }
        Ok(())
    }

    /// The CPU executor's caches, one prefill chunk's values and the towers' weights and
    /// buffers within the memory available.
    pub fn fit_host(&self) -> Result<(), String> {
        self.fit_memory(available_memory())
    }

    /// [`Needs::fit_host`] against `avail` bytes (`None`: unknown, probed by reserving).
    pub fn fit_memory(&self, avail: Option<u64>) -> Result<(), String> {
        let towers: u64 = self.towers.iter().map(TowerNeeds::bytes).fold(0, u64::saturating_add);
        let need = self.kv_bytes.saturating_add(self.pool_bytes).saturating_add(towers);
        let refuse = |have: String| {
            let mut parts = vec![format!("the KV cache ({})", human(self.kv_bytes)), format!("a prefill chunk's buffers ({})", human(self.pool_bytes))];
            parts.extend(self.towers.iter().map(|t| format!("{} (weights {}, buffers {})", t.name, human(t.weight_bytes), human(t.pool_bytes))));
            let last = parts.pop().unwrap_or_default();
            let fix = match avail {
                Some(a) if towers > a => format!("the towers alone need {}", human(towers)),
                _ if towers > 0 => format!("lower --max-context (the towers need {} of it)", human(towers)),
                _ => "lower --max-context".to_string(),
            };
            Err(format!("{} and {last} need more than {have}: {fix}", parts.join(", ")))
        };
        match avail {
            Some(avail) if need > avail => refuse(format!("the {} of memory available", human(avail))),
            Some(_) => Ok(()),
            None => {
                let mut probe: Vec<u8> = vec![];
                match usize::try_from(need).ok().map(|n| probe.try_reserve_exact(n)) {
                    Some(Ok(())) => Ok(()),
                    _ => refuse("what can be allocated".into()),
                }
            }
        }
    }
}

/// `MemAvailable` of `/proc/meminfo`, where there is one.
fn available_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
