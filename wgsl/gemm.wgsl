// Tiled GEMM for prefill: y[t, row_start + r] = sum_k x[t, k] * W[r, k].
//
// A workgroup of 256 computes a 64-token x BN-row tile (BN = 64, or 128 with WIDE); each
// invocation 4 tokens x BN / 16 rows: rows 4j..4j+3 of each 64-row half, so that a subgroup's
// reads of the weight tile are consecutive vec4s. K advances 16 at a time through two
// workgroup-memory buffers: while the invocations multiply one step's tiles, the next step's
// weight words (oct_raw) and activations are already in flight; they are decoded and stored
// into the other buffer after the products, and one barrier per step separates the two.
// Loaders map consecutive invocations to consecutive rows / tokens, so their stores into
// workgroup memory hit distinct banks. No subgroup operations: one path for every adapter.
//
// Flag GROUPED (Op::GroupedMatMul): the tokens are the T = P (token, expert) pairs,
// grouped by expert in `grp` (Op::MoeGroup's layout: E + 1 offsets, then pair indices).
// A tile holds up to 64 pairs of one expert of the bound chunk; the grid has a slot for
// each possible tile (ceil(P / 64) + e_count) and each workgroup finds the (expert,
// tile) of its slot by walking the chunk's experts; slots past the last tile exit.
// Pair `q` reads x row q (x_bcast: q / S) and writes y row q.
//
// SPLIT (not GROUPED, not WIDE): K is cut into p.ksplit parts of whole steps, part wid.z per
// workgroup. With more than one part, each workgroup stores its tile's sums into `part`, fences
// them (storageBarrier) and counts itself in the tile's counter; the one that completes the count
// adds the parts in order, writes y and zeroes the counter for the next dispatch (as the split
// attention merges). For weights of few tiles and long rows, whose workgroups would otherwise
// leave most of the GPU idle.
//
// Flags: GROUPED, WIDE (BN = 128), XVEC (K % 4 == 0: x read in vec4s), SPLIT.
// Same Params and bindings as gemv.wgsl (a bind group serves both):
// 0 params, 1 x, 2 y, 3 grp (GROUPED), 5 part and 6 counters (SPLIT), 8.. weights.

// Params, x (binding 1) and load_x4; with GROUPED grp (binding 3), find_tile and pair_at:
// gemm_common.wgsl.
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
//#if SPLIT
// per (tile, part): the tile's sums, [token][row / 4]; a counter per tile
@group(0) @binding(5) var<storage, read_write> part: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> done: array<atomic<u32>>;
var<workgroup> wlast: u32;
//#endif

const BT: u32 = 64u;   // tokens per tile
const BK: u32 = 16u;   // K per step
//#if WIDE
const BN: u32 = 128u;  // rows per tile
//#else
const BN: u32 = 64u;
//#endif
const XS: u32 = BK * BT / 4u;  // vec4s of one activation buffer: [k][token / 4]
const WS: u32 = BK * BN / 4u;  // vec4s of one weight buffer: [k][row / 4]

var<workgroup> xs: array<vec4<f32>, 2u * XS>;
var<workgroup> ws: array<vec4<f32>, 2u * WS>;

// Rows row0..row0+3 of tokens yr (acc i: token i's four rows), times the global scale.
fn store_rows(yr: vec4<u32>, yvalid: vec4<bool>, row0: u32, a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>, gsc: f32) {
    var acc = array<vec4<f32>, 4>(a0, a1, a2, a3);
    for (var i = 0u; i < 4u; i++) {
        for (var j = 0u; j < 4u; j++) {
            let row = row0 + j;
            if yvalid[i] && row < p.rows {
                y[yr[i] * p.ldy + p.row_start + row] = acc[i][j] * gsc;
            }
        }
    }
}

@compute @workgroup_size(256)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let K = p.K;
    let tm = lid / 16u;   // tokens 4tm .. 4tm+3
    let tn = lid % 16u;   // rows 4tn .. 4tn+3 (and 64 + 4tn .. with WIDE)
    // activation loader: token lt of the tile, elements 4lq..4lq+3 of the step
    let lt = lid % 64u;
    let lq = lid / 64u;
    // weight loader: row lr + 64lh of the tile (lh = 1 only with WIDE), octet lo of the step;
    // consecutive invocations take consecutive rows, so their stores hit distinct banks
    let lr = lid % 64u;
    let lo = (lid / 64u) & 1u;
    let lh = lid / 128u;
//#if GROUPED
    let nslots = (p.T + BT - 1u) / BT + p.e_count;
//#else
    let nslots = (p.T + BT - 1u) / BT;
//#endif
    let nrt = (p.rows + BN - 1u) / BN;
//#if SPLIT
    // this workgroup's part of K: whole steps
    let kc = (K + p.ksplit * BK - 1u) / (p.ksplit * BK) * BK;
    let kbeg = min(wid.z * kc, K);
    let nsteps = (min(kbeg + kc, K) - kbeg + BK - 1u) / BK;
//#else
    let kbeg = 0u;
    let nsteps = (K + BK - 1u) / BK;
//#endif
    let o0 = kbeg / 8u;  // the part's first octet
    for (var ty = wid.y; ty < nslots; ty += nwg.y) {
//#if GROUPED
        let sel = slot_tile(lid, ty);
        if sel.w == 0u {
            break;
        }
        let e = sel.x;
        let wbase = (e - p.e_start) * p.rows;
        let gsc = w_global(e);
        // x row of this loader's token, y rows of this invocation's 4 tokens
        let lvalid = sel.y + lt < sel.z;
        var xr = 0u;
        if lvalid {
            let q = pair_at(sel.y + lt);
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
        let lvalid = t0 + lt < p.T;
        let xr = t0 + lt;
        let yr = vec4<u32>(t0 + tm * 4u) + vec4<u32>(0u, 1u, 2u, 3u);
        let yvalid = yr < vec4<u32>(p.T);
//#endif
        for (var rx = wid.x; rx < nrt; rx += nwg.x) {
            let r0 = rx * BN;
            let wr = r0 + lr + 64u * lh;
//#if WIDE
            let wst = true;
//#else
            let wst = lh == 0u;
//#endif
            let wload = wst && wr < p.rows;
            // step 0's words
            var rw = ROct(vec4<u32>(0u), vec4<u32>(0u));
            if wload {
                rw = oct_raw(wbase + wr, o0 + lo, K);
            }
            var rx4 = load_x4(xr, kbeg, lq, K, lvalid);
            var acc0 = vec4<f32>(0.0);
            var acc1 = vec4<f32>(0.0);
            var acc2 = vec4<f32>(0.0);
            var acc3 = vec4<f32>(0.0);
//#if WIDE
            var acc4 = vec4<f32>(0.0);
            var acc5 = vec4<f32>(0.0);
            var acc6 = vec4<f32>(0.0);
            var acc7 = vec4<f32>(0.0);
//#endif
            // the previous tile's last reads of the buffers are done
            workgroupBarrier();
            for (var s = 0u; s < nsteps; s++) {
                let cur = s & 1u;
                // store step s (its words loaded during step s - 1's products)
                {
                    let xb = cur * XS;
                    for (var j = 0u; j < 4u; j++) {
                        xs[xb + (4u * lq + j) * (BT / 4u) + lt / 4u][lt % 4u] = rx4[j];
                    }
                    if wst {
                        let d = oct_dec(rw, wbase + wr, o0 + s * 2u + lo, K);
                        let wb = cur * WS;
                        let wc = (lr + 64u * lh) / 4u;
                        let wj = lr % 4u;
                        for (var j = 0u; j < 4u; j++) {
                            ws[wb + (8u * lo + j) * (BN / 4u) + wc][wj] = d.a[j];
                            ws[wb + (8u * lo + 4u + j) * (BN / 4u) + wc][wj] = d.b[j];
                        }
                    }
                }
                workgroupBarrier();
                // issue step s + 1's loads, then multiply step s
                if s + 1u < nsteps {
                    if wload {
                        rw = oct_raw(wbase + wr, o0 + (s + 1u) * 2u + lo, K);
                    }
                    rx4 = load_x4(xr, kbeg + (s + 1u) * BK, lq, K, lvalid);
                }
                let xb = cur * XS;
                let wb = cur * WS;
                for (var kk = 0u; kk < BK; kk++) {
                    let a = xs[xb + kk * (BT / 4u) + tm];
                    let b0 = ws[wb + kk * (BN / 4u) + tn];
                    acc0 = fma(vec4<f32>(a.x), b0, acc0);
                    acc1 = fma(vec4<f32>(a.y), b0, acc1);
                    acc2 = fma(vec4<f32>(a.z), b0, acc2);
                    acc3 = fma(vec4<f32>(a.w), b0, acc3);
//#if WIDE
                    let b1 = ws[wb + kk * (BN / 4u) + 16u + tn];
                    acc4 = fma(vec4<f32>(a.x), b1, acc4);
                    acc5 = fma(vec4<f32>(a.y), b1, acc5);
                    acc6 = fma(vec4<f32>(a.z), b1, acc6);
                    acc7 = fma(vec4<f32>(a.w), b1, acc7);
//#endif
                }
            }
//#if SPLIT
            if p.ksplit > 1u {
                let tile = ty * nrt + rx;
                let pb = tile * p.ksplit * (BT * BN / 4u);
                let pi = (4u * tm) * (BN / 4u) + tn;
                let pz = pb + wid.z * (BT * BN / 4u) + pi;
                part[pz] = acc0;
                part[pz + BN / 4u] = acc1;
                part[pz + 2u * (BN / 4u)] = acc2;
                part[pz + 3u * (BN / 4u)] = acc3;
                storageBarrier();
                if lid == 0u {
                    wlast = u32(atomicAdd(&done[tile], 1u) + 1u == p.ksplit);
                }
                if workgroupUniformLoad(&wlast) == 1u {
                    storageBarrier();
                    var s0 = vec4<f32>(0.0);
                    var s1 = vec4<f32>(0.0);
                    var s2 = vec4<f32>(0.0);
                    var s3 = vec4<f32>(0.0);
                    for (var z = 0u; z < p.ksplit; z++) {
                        let q = pb + z * (BT * BN / 4u) + pi;
                        s0 += part[q];
                        s1 += part[q + BN / 4u];
                        s2 += part[q + 2u * (BN / 4u)];
                        s3 += part[q + 3u * (BN / 4u)];
                    }
                    store_rows(yr, yvalid, r0 + tn * 4u, s0, s1, s2, s3, gsc);
                    if lid == 0u {
                        atomicStore(&done[tile], 0u);
                    }
                }
                continue;
            }
//#endif
            store_rows(yr, yvalid, r0 + tn * 4u, acc0, acc1, acc2, acc3, gsc);
//#if WIDE
            store_rows(yr, yvalid, r0 + 64u + tn * 4u, acc4, acc5, acc6, acc7, gsc);
//#endif
        }
    }
}
