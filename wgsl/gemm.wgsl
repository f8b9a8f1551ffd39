// Tiled GEMM for prefill: y[t, row_start + r] = sum_k x[t, k] * W[r, k].
//
// A workgroup of 256 computes a 64-token x 64-row tile; each invocation a 4x4
// micro-tile. Per K step of 32 the weight tile is decoded (one octet per
// invocation) and the activation tile loaded into workgroup memory (f32).
// No subgroup operations: one path for every adapter.
//
// Same Params and bindings as gemv.wgsl (a bind group serves both):
// 0 params, 1 x, 2 y, 8.. weights.

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
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

const BT: u32 = 64u;   // tokens per tile
const BN: u32 = 64u;   // rows per tile
const BK: u32 = 32u;   // K per step

// [k][token / 4] and [k][row / 4]
var<workgroup> xs: array<vec4<f32>, 512>;
var<workgroup> ws: array<vec4<f32>, 512>;

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
    let gsc = w_global(0u);
    let ntt = (p.T + BT - 1u) / BT;
    let nrt = (p.rows + BN - 1u) / BN;
    for (var ty = wid.y; ty < ntt; ty += nwg.y) {
        for (var rx = wid.x; rx < nrt; rx += nwg.x) {
            let t0 = ty * BT;
            let r0 = rx * BN;
            var acc: array<vec4<f32>, 4>;
            for (var k0 = 0u; k0 < K; k0 += BK) {
                // Weight tile: row r0 + lr, octet k0/8 + lo.
                let row = r0 + lr;
                var oc: Oct;
                if row < p.rows {
                    oc = dq_oct(row, k0 / 8u + lo, K);
                }
                let wi = lo * 8u * 16u + lr / 4u;
                let wc = lr % 4u;
                for (var i = 0u; i < 4u; i++) {
                    ws[wi + i * 16u][wc] = oc.a[i];
                    ws[wi + (4u + i) * 16u][wc] = oc.b[i];
                }
                // Activation tile: token t0 + lr, elements k0 + lo*8 .. +8.
                let tok = t0 + lr;
                for (var i = 0u; i < 8u; i++) {
                    let k = k0 + lo * 8u + i;
                    var v = 0.0;
                    if tok < p.T && k < K {
                        v = x[tok * K + k];
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
                let tok = t0 + tm * 4u + i;
                for (var j = 0u; j < 4u; j++) {
                    let row = r0 + tn * 4u + j;
                    if tok < p.T && row < p.rows {
                        y[tok * p.ldy + p.row_start + row] = acc[i][j] * gsc;
                    }
                }
            }
        }
    }
}
