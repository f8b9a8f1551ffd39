// Groups the (token, expert) pairs p = t*S + s of ids[P] by expert (Op::MoeGroup):
// out[0..=E] offsets (expert e owns entries out[E+1+offsets[e]] .. out[E+1+offsets[e+1]-1]),
// out[E+1..E+1+P] the pair indices, increasing inside each expert. Ids >= E join no group.
//
// One workgroup; deterministic. Invocation `lid` owns experts lid, lid + WG, ...; the ids
// are walked in order in tiles of CH held in workgroup memory:
//   1. each invocation counts its expert's pairs,
//   2. invocation 0 turns the counts into offsets (exclusive prefix sum),
//   3. each invocation walks the ids again and appends its expert's pairs at its offset.
//
// Prelude consts: WG. Bindings: 0 params, 1 ids (u32 [P]), 2 out (u32 [E + 1 + P]).

struct Params {
    P: u32,
    E: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

const CH: u32 = 1024u;
var<workgroup> tile: array<u32, CH>;

// Loads ids[c0 .. c0 + CH) into `tile` (past P: an id no expert has). Uniform control flow.
fn load_tile(lid: u32, c0: u32) {
    workgroupBarrier();
    for (var i = lid; i < CH; i += WG) {
        var v = 0xffffffffu;
        if c0 + i < p.P {
            v = ids[c0 + i];
        }
        tile[i] = v;
    }
    workgroupBarrier();
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let E = p.E;
    let P = p.P;
    // 1. counts
    for (var e0 = 0u; e0 < E; e0 += WG) {
        let e = e0 + lid;
        var n = 0u;
        for (var c0 = 0u; c0 < P; c0 += CH) {
            load_tile(lid, c0);
            let m = min(CH, P - c0);
            for (var j = 0u; j < m; j++) {
                n += select(0u, 1u, tile[j] == e);
            }
        }
        if e < E {
            out[e] = n;
        }
    }
    storageBarrier();
    // 2. offsets
    if lid == 0u {
        var sum = 0u;
        for (var e = 0u; e < E; e++) {
            let c = out[e];
            out[e] = sum;
            sum += c;
        }
        out[E] = sum;
    }
    storageBarrier();
    // 3. scatter, in pair order
    for (var e0 = 0u; e0 < E; e0 += WG) {
        let e = e0 + lid;
        let own = e < E;
        var at = 0u;
        if own {
            at = E + 1u + out[e];
        }
        for (var c0 = 0u; c0 < P; c0 += CH) {
            load_tile(lid, c0);
            let m = min(CH, P - c0);
            for (var j = 0u; j < m; j++) {
                if own && tile[j] == e {
                    out[at] = c0 + j;
                    at++;
                }
            }
        }
    }
}
