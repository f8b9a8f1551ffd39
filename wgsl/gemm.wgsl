// Tiled GEMM for prefill: y[t, row_start + r] = sum_k x[t, k] * W[r, k].
//
// A workgroup of 256 computes a 64-token x 64-row tile; each invocation a 4x4
// micro-tile. Per K step of 32 the weight tile is decoded (one octet per
// invocation) and the activation tile loaded into workgroup memory (f32).
// No subgroup operations: one path for every adapter.
//
// Flag GROUPED (Op::GroupedMatMul): the tokens are the T = P (token, expert) pairs,
// grouped by expert in `grp` (Op::MoeGroup's layout: E + 1 offsets, then pair indices).
// A tile holds up to 64 pairs of one expert of the bound chunk; the grid has a slot for
// each possible tile (ceil(P / 64) + e_count) and each workgroup finds the (expert,
// tile) of its slot by walking the chunk's experts; slots past the last tile exit.
// Pair `q` reads x row q (x_bcast: q / S) and writes y row q.
//
// Same Params and bindings as gemv.wgsl (a bind group serves both):
// 0 params, 1 x, 2 y, 3 grp (GROUPED), 8.. weights.

struct Params {
    T: u32,
    K: u32,
    rows: u32,
    row_start: u32,
    ldy: u32,
    e_start: u32,
    e_count: u32,
    S: u32,
    x_bcast: u32,
    E: u32,          // GROUPED: experts of the whole stack (offsets before the pair list)
    _norm_mode: u32, // (gemv.wgsl's fused norm)
    _norm_eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
//#if GROUPED
@group(0) @binding(3) var<storage, read> grp: array<u32>;
//#endif

const BT: u32 = 64u;   // tokens per tile
const BN: u32 = 64u;   // rows per tile
const BK: u32 = 32u;   // K per step

// [k][token / 4] and [k][row / 4]
var<workgroup> xs: array<vec4<f32>, 512>;
var<workgroup> ws: array<vec4<f32>, 512>;
//#if GROUPED
// The slot's tile: (expert, first position, end position, 1), or all 0 past the last tile.
var<workgroup> tile_sel: vec4<u32>;

// The tile of slot `slot`: the chunk's experts in order, ceil(count / BT) tiles each.
fn find_tile(slot: u32) -> vec4<u32> {
    var rem = slot;
    for (var e = p.e_start; e < p.e_start + p.e_count; e++) {
        let a = grp[e];
        let b = max(grp[e + 1u], a);
        let nt = (b - a + BT - 1u) / BT;
        if rem < nt {
            let o0 = a + rem * BT;
            return vec4<u32>(e, o0, min(b, o0 + BT), 1u);
        }
        rem -= nt;
    }
    return vec4<u32>(0u);
}

// Pair index of position `o` of the grouped list.
fn pair_at(o: u32) -> u32 {
    return grp[p.E + 1u + o];
}
//#endif

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let K = p.K;
    let tm = lid / 16u;   // tokens tm*4 .. tm*4+3
    let tn = lid % 16u;   // rows tn*4 .. tn*4+3
    let lr = lid / 4u;    // loader: row / token of the tile
    let lo = lid % 4u;    // loader: octet within the K step
//#if GROUPED
    let nslots = (p.T + BT - 1u) / BT + p.e_count;
//#else
    let nslots = (p.T + BT - 1u) / BT;
//#endif
    let nrt = (p.rows + BN - 1u) / BN;
    for (var ty = wid.y; ty < nslots; ty += nwg.y) {
//#if GROUPED
        workgroupBarrier();
        if lid == 0u {
            tile_sel = find_tile(ty);
        }
        let sel = workgroupUniformLoad(&tile_sel);
        if sel.w == 0u {
            break;
        }
        let e = sel.x;
        let wbase = (e - p.e_start) * p.rows;
        let gsc = w_global(e);
        // x row of this loader's token, y rows of this invocation's 4 tokens
        let lvalid = sel.y + lr < sel.z;
        var xr = 0u;
        if lvalid {
            let q = pair_at(sel.y + lr);
            xr = select(q, q / p.S, p.x_bcast != 0u);
        }
        var yr = vec4<u32>(0u);
        var yvalid = vec4<bool>(false);
        for (var i = 0u; i < 4u; i++) {
            let o = sel.y + tm * 4u + i;
            if o < sel.z {
                yr[i] = pair_at(o);
                yvalid[i] = true;
            }
        }
//#else
        let t0 = ty * BT;
        let wbase = 0u;
        let gsc = w_global(0u);
        let lvalid = t0 + lr < p.T;
        let xr = t0 + lr;
        let yr = vec4<u32>(t0 + tm * 4u) + vec4<u32>(0u, 1u, 2u, 3u);
        let yvalid = yr < vec4<u32>(p.T);
//#endif
        for (var rx = wid.x; rx < nrt; rx += nwg.x) {
            let r0 = rx * BN;
            var acc: array<vec4<f32>, 4>;
            for (var k0 = 0u; k0 < K; k0 += BK) {
                // Weight tile: row r0 + lr, octet k0/8 + lo.
                let row = r0 + lr;
                var oc: Oct;
                if row < p.rows {
                    oc = dq_oct(wbase + row, k0 / 8u + lo, K);
                }
                let wi = lo * 8u * 16u + lr / 4u;
                let wc = lr % 4u;
                for (var i = 0u; i < 4u; i++) {
                    ws[wi + i * 16u][wc] = oc.a[i];
                    ws[wi + (4u + i) * 16u][wc] = oc.b[i];
                }
                // Activation tile: x row xr (the tile's token lr), elements k0 + lo*8 .. +8.
                for (var i = 0u; i < 8u; i++) {
                    let k = k0 + lo * 8u + i;
                    var v = 0.0;
                    if lvalid && k < K {
                        v = x[xr * K + k];
                    }
                    xs[wi + i * 16u][wc] = v;
                }
                workgroupBarrier();
                for (var kk = 0u; kk < BK; kk++) {
                    let a = xs[kk * 16u + tm];
                    let b = ws[kk * 16u + tn];
                    acc[0] = fma(vec4<f32>(a.x), b, acc[0]);
                    acc[1] = fma(vec4<f32>(a.y), b, acc[1]);
                    acc[2] = fma(vec4<f32>(a.z), b, acc[2]);
                    acc[3] = fma(vec4<f32>(a.w), b, acc[3]);
                }
                workgroupBarrier();
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    let row = r0 + tn * 4u + j;
                    if yvalid[i] && row < p.rows {
                        y[yr[i] * p.ldy + p.row_start + row] = acc[i][j] * gsc;
                    }
                }
            }
        }
    }
}
