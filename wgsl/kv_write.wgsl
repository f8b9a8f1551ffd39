// KV cache write: cache[pos[t] % S, :] = x[t, x_off..x_off + row] (rows of nkv * D floats; x
// rows of x_ld floats).
//
// CHUNK: cache is one chunk of a cache split across bindings (common.wgsl's KvChunk at binding
// 4): only the rows of its slots are written.
//
// Prelude consts: WG. Flags: CHUNK. Bindings: 0 params, 1 x, 2 pos, 3 cache, 4 chunk (CHUNK).

struct Params {
    T: u32,
    row: u32,
    S: u32,
    x_ld: u32,
    x_off: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(3) var<storage, read_write> cache: array<f32>;
//#if CHUNK
@group(0) @binding(4) var<uniform> kvc: KvChunk;
//#endif

@compute @workgroup_size(WG)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let total = p.T * p.row;
    let stride = nwg.x * WG;
    for (var idx = gid.x + gid.y * stride; idx < total; idx += stride * nwg.y) {
        let t = idx / p.row;
        let j = idx % p.row;
        let slot = pos[t] % p.S;
//#if CHUNK
        if slot >= kvc.c0 && slot < kvc.c0 + kvc.cn {
            cache[(slot - kvc.c0) * p.row + j] = x[t * p.x_ld + p.x_off + j];
        }
//#else
        cache[slot * p.row + j] = x[t * p.x_ld + p.x_off + j];
//#endif
    }
}
