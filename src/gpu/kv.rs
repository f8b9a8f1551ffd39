//! KV caches chunked across storage bindings.
//!
//! A layer's K (or V) cache `f32[slots, kv_heads, head_dim]` is one buffer when it fits the
//! adapter's storage binding (and buffer) limit: the kernels, bind groups and dispatches are
//! then those of an unchunked cache. A cache over the limit is split by slot into chunks of
//! `chunk_slots` slots (the last one shorter), each its own buffer; slot `s` is row
//! `s - c0` of the chunk starting at slot `c0`. The ops that touch a chunked cache take one
//! dispatch per chunk, each with the chunk's [`KvChunkParams`] (binding of a `CHUNK` variant
//! of the kernel):
//!
//! - the cache writes (`kv_write.wgsl`, `rope.wgsl`'s `CACHE`) write only the rows whose slot
//!   falls in their chunk;
//! - attention (`attention.wgsl`) takes, per chunk, the keys of the query's range stored in
//!   that chunk, cut into the chunk's splits, and writes their partials (max, sum, unnormalized
//!   output) as a slice of the split partials; the combine dispatch (`attn_combine.wgsl`)
//!   merges all of them, as it merges the splits of an unchunked decode. A sliding layer's
//!   ring (`slot = position % slots`) is covered twice, once per ring lap a window can span;
//!   a full-attention cache (positions below its slots) once. With the step's key appended by
//!   the attention pass, the dispatch whose chunk holds the step's slot writes it.
//!
//! The combine weighs at most [`MAX_KV_PARTS`] partials, so a cache takes at most that many
//! chunks (laps counted). The limit is the adapter's, or lower: [`binding_limit`].

use crate::gpu::device::{Gpu, GpuError};
use crate::gpu::kernels::params_struct;

/// Most attention partials of a chunked cache (chunks times ring laps times splits): the
/// combine merges at most this many (`attn_combine.wgsl`, a partial per invocation).
pub const MAX_KV_PARTS: usize = 128;

/// The environment variable that lowers the binding limit KV caches are chunked at (bytes;
/// never raises it): tests of the chunked path on any adapter.
pub const MAX_KV_BINDING_ENV: &str = "MARKBASE_MAX_KV_BINDING";

params_struct! {
    /// Params of one chunk of a chunked cache (`common.wgsl`'s `KvChunk`): its slots
    /// `c0..c0 + cn` (attention: counted from the ring lap of the query's first key), and the
    /// attention partials it writes, `split0..split0 + nsplit`.
    #[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
    pub struct KvChunkParams {
        pub c0: u32,
        pub cn: u32,
        pub split0: u32,
        pub nsplit: u32,
    }
}

/// The byte limit of one KV-cache buffer: the adapter's binding (and buffer) limit, lowered by
/// `lower` and by [`MAX_KV_BINDING_ENV`] where they are smaller.
pub fn binding_limit(gpu: &Gpu, lower: Option<u64>) -> u64 {
    limit_of(gpu.max_binding_bytes(), lower)
}

/// [`binding_limit`] from the adapter's limit.
pub fn limit_of(adapter: u64, lower: Option<u64>) -> u64 {
    let env = std::env::var(MAX_KV_BINDING_ENV).ok().and_then(|v| v.trim().parse::<u64>().ok());
    [Some(adapter), lower, env].into_iter().flatten().min().unwrap_or(adapter)
}

/// Slots per chunk of a cache of `slots` rows of `row_bytes` within `limit` bytes a buffer
/// (`slots` itself when it fits one), or why it cannot be chunked.
pub fn chunk_slots(slots: u64, row_bytes: u64, limit: u64) -> Result<u64, String> {
    let per = limit / row_bytes.max(1);
    if per == 0 {
        return Err(format!("one position of a layer's KV cache needs {row_bytes} bytes, more than the {limit}-byte buffer limit"));
    }
    let chunks = slots.div_ceil(per);
    if chunks as usize > MAX_KV_PARTS {
        return Err(format!(
            "the KV cache of one layer needs {} chunks of {} (the largest buffer), more than the {MAX_KV_PARTS} attention merges: lower --max-context",
            chunks,
            crate::memory::human(per * row_bytes)
        ));
    }
    Ok(per.min(slots.max(1)))
}

/// One KV cache (a layer's keys or values): its buffers, a chunk of `chunk_slots` slots each
/// (one buffer: unchunked).
#[derive(Clone, Debug)]
pub struct KvChunks {
    pub bufs: Vec<wgpu::Buffer>,
    pub slots: usize,
    pub chunk_slots: usize,
}

impl KvChunks {
    /// Allocates a cache of `slots` rows of `row_bytes`, chunked at `limit` bytes a buffer;
    /// `purpose` names it in errors.
    pub fn alloc(gpu: &Gpu, purpose: &str, slots: usize, row_bytes: usize, limit: u64) -> Result<KvChunks, String> {
        let per = chunk_slots(slots as u64, row_bytes as u64, limit).map_err(|e| format!("{purpose}: {e}"))? as usize;
        let again = |e: GpuError| format!("{e}: lower --max-context");
        if per >= slots {
            let b = gpu.try_storage(purpose, (slots * row_bytes) as u64).map_err(again)?;
            return Ok(KvChunks { bufs: vec![b], slots, chunk_slots: slots });
        }
        let mut bufs = vec![];
        for c0 in (0..slots).step_by(per) {
            let c1 = (c0 + per).min(slots);
            bufs.push(gpu.try_storage(&format!("{purpose}, slots {c0}..{c1}"), ((c1 - c0) * row_bytes) as u64).map_err(again)?);
        }
        Ok(KvChunks { bufs, slots, chunk_slots: per })
    }

    /// Whether the cache is split over several buffers.
    pub fn chunked(&self) -> bool {
        self.bufs.len() > 1
    }

    /// The first slot and the slot count of chunk `c`.
    pub fn range(&self, c: usize) -> (usize, usize) {
        let c0 = c * self.chunk_slots;
        (c0, self.chunk_slots.min(self.slots - c0))
    }

    /// The params of chunk `c` (attention: on ring lap `lap`, its partials from `split0`).
    pub fn params(&self, c: usize, lap: usize, split0: usize, nsplit: usize) -> KvChunkParams {
        let (c0, cn) = self.range(c);
        KvChunkParams { c0: (c0 + lap * self.slots) as u32, cn: cn as u32, split0: split0 as u32, nsplit: nsplit as u32 }
    }

    /// Whether `other` is chunked as this cache is (keys and values of one layer).
    pub fn same_layout(&self, other: &KvChunks) -> bool {
        self.bufs.len() == other.bufs.len() && self.slots == other.slots && self.chunk_slots == other.chunk_slots
    }
}

#[cfg(test)]
mod tests {
    use super::chunk_slots;

    #[test]
    fn caches_split_into_chunks_within_the_limit() {
        assert_eq!(chunk_slots(64, 256, 1 << 20), Ok(64));
        assert_eq!(chunk_slots(64, 256, 3072), Ok(12));
        assert_eq!(chunk_slots(2_000_000, 1024, 128 << 20), Ok(131072));
        assert!(chunk_slots(64, 256, 100).unwrap_err().contains("one position"));
        assert!(chunk_slots(1 << 20, 256, 256).unwrap_err().contains("lower --max-context"));
    }
}
