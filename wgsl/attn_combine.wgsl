// Merges the per-split partial results of attention.wgsl (SPLIT):
// out[t, h, d] = sum_s o_s[d] e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s.
//
// Prelude consts: WG. Bindings: 0 params (attention's), 1 partials, 2 out [T, nq, D].

struct Params {
    T: u32,
    nq: u32,
    nkv: u32,
    D: u32,
    S: u32,
    window: u32,
    nsplit: u32,
    _p0: u32,
    scale: f32,
    _p1: u32,
    _p2: u32,
    _p3: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let h = wid.x;
    let t = wid.y;
    let D = p.D;
    let st = D + 2u;
    let b = (t * p.nq + h) * p.nsplit * st;
    var mx = NEG_BIG;
    for (var s = 0u; s < p.nsplit; s++) {
        mx = max(mx, part[b + s * st + D]);
    }
    var l = 0.0;
    for (var s = 0u; s < p.nsplit; s++) {
        l += part[b + s * st + D + 1u] * exp(part[b + s * st + D] - mx);
    }
    for (var d = lid; d < D; d += WG) {
        var a = 0.0;
        for (var s = 0u; s < p.nsplit; s++) {
            a += part[b + s * st + d] * exp(part[b + s * st + D] - mx);
        }
        out[(t * p.nq + h) * D + d] = a / l;
    }
}
