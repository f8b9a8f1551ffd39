// Merges the per-split partial results of attention.wgsl (SPLIT) in a dispatch of its own (the
// path without MERGE): one workgroup per (head, token), split_merge.wgsl's arithmetic.
//
// Prelude consts: WG (>= the split count). Bindings: 0 params (attention's), 1 partials,
// 2 out [T, nq, D].

struct Params {
    T: u32,
    nq: u32,
    nkv: u32,
    D: u32,
    S: u32,
    window: u32,
    nsplit: u32,
    _spans: u32,   // (attention.wgsl's attention bounds)
    scale: f32,
    _k_head0: u32, // (attention.wgsl's APPEND)
    _v_head0: u32,
    _p3: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> out: array<vec4<f32>>;
var<workgroup> ps: array<f32, WG>;
var<workgroup> ov: array<vec4<f32>, WG>;

fn split_part(i: u32) -> vec4<f32> {
    return part[i];
}

fn split_out(i: u32, v: vec4<f32>) {
    out[i] = v;
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    init_ids(lid, 0u, 0u, 1u);
    let hc = wid.y * p.nq + wid.x;
    merge_splits(hc * p.nsplit * (p.D / 4u + 1u), hc * (p.D / 4u), p.D, p.nsplit, lid);
}
