// Strided copy of 32-bit elements, for Slice:
// dst[(o * dst_axis + dst_off + a) * inner + i] = src[(o * src_axis + src_off + a) * inner + i]
// for o < outer, a < len, i < inner: src_axis = n, src_off = start, dst_axis = len, dst_off = 0.
//
// Prelude consts: WG. Bindings: 0 params, 1 src, 2 dst.

struct Params {
    outer: u32,
    len: u32,
    inner: u32,
    src_axis: u32,
    src_off: u32,
    dst_axis: u32,
    dst_off: u32,
    _p0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let stride = nwg.x * WG;
    let per = p.len * p.inner;
    let total = p.outer * per;
    for (var idx = gid.x + gid.y * stride; idx < total; idx += stride * nwg.y) {
        let o = idx / per;
        let r = idx % per;
        let a = r / p.inner;
        let i = r % p.inner;
        dst[((o * p.dst_axis + p.dst_off + a) * p.inner) + i] = src[((o * p.src_axis + p.src_off + a) * p.inner) + i];
    }
}
