// A batch of sequences over one KV cache of N sequence slots `[N, S, nkv, D]` (each sequence its
// own ring of S position slots): the cache write and the attention of rows that each belong to
// a sequence slot (`slot[t]`; a slot >= N marks an idle row). Each row's arithmetic depends on
// its own inputs only, whatever the other rows hold or how many there are.
//
// KV_WRITE: cache[slot[t], pos[t] % S] = x[t] (rows of nkv * D floats). One invocation per
// element. Bindings: 0 params, 1 x, 2 pos, 3 slot, 4 cache.
//
// ATTENTION: one workgroup per (query head, row); query t attends to the positions
// max(0, pos[t] + 1 - window) ..= hi of its sequence slot, in blocks of WG / L keys with an
// online softmax (a key's score by L invocations, each over every L-th dim, so that a key's
// row is read in whole sectors; the block's maximum and sum by every invocation in key order): hi = pos[t], or max(pos[t], pos[T + t]) with attention bounds (spans: an
// image span's tokens see the whole span). Idle rows get zeros. Bindings: 0 params, 1 q,
// 2 pos, 3 slot, 4 k, 5 v, 6 out.
//
// Prelude consts: WG (a power of two, at most 256), MAXD (dims per invocation: D <= WG * MAXD).
// Flags: KV_WRITE, ATTENTION.

struct Params {
    T: u32,
    nq: u32,
    nkv: u32,
    D: u32,
    S: u32,
    N: u32,
    // positions a query sees back to its own, itself included (0: all)
    window: u32,
    scale: f32,
    // 1: pos holds attention bounds [2, T]
    spans: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(3) var<storage, read> slot: array<u32>;

//#if KV_WRITE
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(4) var<storage, read_write> cache: array<f32>;

@compute @workgroup_size(WG)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let row = p.nkv * p.D;
    let total = p.T * row;
    let stride = nwg.x * WG;
    for (var idx = gid.x + gid.y * stride; idx < total; idx += stride * nwg.y) {
        let t = idx / row;
        let j = idx % row;
        let s = slot[t];
        if s < p.N {
            cache[(s * p.S + pos[t] % p.S) * row + j] = x[idx];
        }
    }
}
//#endif

//#if ATTENTION
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(4) var<storage, read> kc: array<f32>;
@group(0) @binding(5) var<storage, read> vc: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

// invocations per key (its scores' dims split among them: each reads L consecutive floats of
// the key's row per step, a whole 32-byte sector), keys per block
const L: u32 = 8u;
const KB: u32 = WG / L;

var<workgroup> qs: array<f32, WG * MAXD>;
// per invocation, its share of its key's score; per key of the block, its score, then weight
var<workgroup> part: array<f32, WG>;
var<workgroup> sc: array<f32, KB>;
var<workgroup> pe: array<f32, KB>;
var<workgroup> wu: array<u32, 2>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    let D = p.D;
    let obase = (t * p.nq + h) * D;
    // the row's slot and last position, uniform across the workgroup
    if lid == 0u {
        wu[0] = slot[t];
        wu[1] = pos[t];
    }
    let s = workgroupUniformLoad(&wu[0]);
    let pp = workgroupUniformLoad(&wu[1]);
    // the last key: the query's own position, or its image span's last (attention bounds)
    if lid == 0u && p.spans != 0u {
        wu[1] = max(pos[p.T + t], pp);
    }
    let last = workgroupUniformLoad(&wu[1]);
    if s >= p.N {
        for (var d = lid; d < D; d += WG) {
            out[obase + d] = 0.0;
        }
        return;
    }
    for (var d = lid; d < D; d += WG) {
        qs[d] = q[obase + d];
    }
    workgroupBarrier();
    let kh = h / (p.nq / p.nkv);
    var lo = 0u;
    if p.window > 0u && pp + 1u > p.window {
        lo = pp + 1u - p.window;
    }
    let neg = bitcast<f32>(0xff800000u);
    var m = neg;
    var l = 0.0;
    var acc: array<f32, MAXD>;
    for (var i = 0u; i < MAXD; i++) {
        acc[i] = 0.0;
    }
    // the invocation's key in a block, and its share of the key's dims: pl, pl + L, ..
    let kk = lid / L;
    let pl = lid % L;
    for (var base = lo; base <= last; base += KB) {
        let cnt = min(KB, last + 1u - base);
        let j = base + kk;
        var dot = 0.0;
        if kk < cnt {
            let kb = ((s * p.S + j % p.S) * p.nkv + kh) * D;
            for (var d = pl; d < D; d += L) {
                dot = fma(qs[d], kc[kb + d], dot);
            }
        }
        part[lid] = dot;
        workgroupBarrier();
        // each key's score: its L shares added in order
        if pl == 0u && kk < cnt {
            var a = 0.0;
            for (var i = 0u; i < L; i++) {
                a += part[kk * L + i];
            }
            sc[kk] = a * p.scale;
        }
        workgroupBarrier();
        // the block's maximum (every invocation, in the same order), the keys' weights
        var bm = neg;
        for (var jj = 0u; jj < cnt; jj++) {
            bm = max(bm, sc[jj]);
        }
        let nm = max(m, bm);
        let corr = select(exp(m - nm), 0.0, m == neg);
        if lid < cnt {
            pe[lid] = exp(sc[lid] - nm);
        }
        workgroupBarrier();
        var bs = 0.0;
        for (var jj = 0u; jj < cnt; jj++) {
            bs += pe[jj];
        }
        l = l * corr + bs;
        for (var i = 0u; i < MAXD; i++) {
            let d = lid + i * WG;
            if d < D {
                var a = acc[i] * corr;
                for (var jj = 0u; jj < cnt; jj++) {
                    a += pe[jj] * vc[((s * p.S + (base + jj) % p.S) * p.nkv + kh) * D + d];
                }
                acc[i] = a;
            }
        }
        m = nm;
        // the block's shares, scores and weights are read before the next block writes them
        workgroupBarrier();
    }
    for (var i = 0u; i < MAXD; i++) {
        let d = lid + i * WG;
        if d < D {
            out[obase + d] = acc[i] / l;
        }
    }
}
//#endif
