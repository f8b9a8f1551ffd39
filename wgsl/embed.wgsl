// Embedding gather: out[t, :] = decode(table[id_t, :]) * scale, for ids held by
// this chunk (rows row_start .. row_start + rows); other ids are left to the
// chunk that holds them. Ids >= clamp (when has_clamp) read row 0.
//
// Prelude consts: WG; weight consts (weights.wgsl).
// Bindings: 0 params, 1 ids (u32), 2 out (f32 [T, D]), 8.. weights.

struct Params {
    T: u32,
    D: u32,
    row_start: u32,
    rows: u32,
    clamp: u32,
    has_clamp: u32,
    scale: f32,
    _p0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let D = p.D;
    let noct = (D + 7u) / 8u;
    for (var t = wid.y; t < p.T; t += nwg.y) {
        var id = ids[t];
        if p.has_clamp != 0u && id >= p.clamp {
            id = 0u;
        }
        if id < p.row_start || id >= p.row_start + p.rows {
            continue;
        }
        let row = id - p.row_start;
        for (var o = wid.x * WG + lid; o < noct; o += nwg.x * WG) {
            let v = dq_oct(row, o, D);
            let b = t * D + o * 8u;
            for (var i = 0u; i < 4u; i++) {
                if o * 8u + i < D {
                    out[b + i] = v.a[i] * p.scale;
                }
                if o * 8u + 4u + i < D {
                    out[b + 4u + i] = v.b[i] * p.scale;
                }
            }
        }
    }
}
