// Argmax of one row of V logits starting at `offset` (ties: lowest index; like
// cpu::ops::argmax, an element replaces the best only when strictly greater).
// One workgroup; each invocation scans a strided slice, then a shared-memory tree
// reduction over (value, index) pairs.
//
// Prelude consts: WG. Bindings: 0 params, 1 logits, 2 out (u32 [rows]).

struct Params {
    V: u32,
    offset: u32,
    // where the index goes: out[row] (a batch's rows, one dispatch each)
    row: u32,
    recent_len: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

var<workgroup> bv: array<f32, WG>;
var<workgroup> bi: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    var best_v = bitcast<f32>(0xff800000u);
    var best_i = 0xffffffffu;
    if lid < p.V {
        best_v = logits[p.offset + lid];
        best_i = lid;
    }
    for (var i = lid + WG; i < p.V; i += WG) {
        let v = logits[p.offset + i];
        if v > best_v {
            best_v = v;
            best_i = i;
        }
    }
    bv[lid] = best_v;
    bi[lid] = best_i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            let v2 = bv[lid + s];
            let i2 = bi[lid + s];
            let v1 = bv[lid];
            let i1 = bi[lid];
            if i2 != 0xffffffffu && (i1 == 0xffffffffu || v2 > v1 || (v2 == v1 && i2 < i1)) {
                bv[lid] = v2;
                bi[lid] = i2;
            }
        }
        workgroupBarrier();
    }
    if lid == 0u {
        out[p.row] = bi[0];
    }
}
