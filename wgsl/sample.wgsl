// Token sampling from one row of logits (cpu::ops::sample), in one workgroup:
//  1. repetition penalty on the distinct recent ids (l < 0 ? l*p : l/p), held in a
//     small hash table in workgroup memory;
//  2. temperature <= 0: argmax (ties: lowest index);
//  3. else z = l / T, m = max z; threshold = max of
//       top-k:  the k-th largest z (radix select over 8 passes of 4-bit digits),
//       min-p:  m + ln(min_p),
//       top-p:  the z where the mass of the sorted values first reaches top_p * total
//               (radix descent over the same digits, per-bin masses);
//  4. inverse CDF in index order over the kept values at uniform(seed, step) * kept
//     (contiguous per-invocation ranges plus a prefix sum).
// Sums are f32 (the CPU uses f64): ties at a CDF or top-p boundary can resolve differently.
//
// Prelude consts: WG (256). Bindings: 0 params (V, offset of the row), 1 logits,
// 2 sampling words u32[8] (temperature, top_k, top_p, min_p, repetition_penalty
// as f32 bits; seed, step, n_recent), 3 recent ids, 4 out u32[1].

struct Params {
    V: u32,
    offset: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> sp: array<u32>;
@group(0) @binding(3) var<storage, read> recent: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;

const HSLOTS: u32 = 256u;
const EMPTY: u32 = 0xffffffffu;
const NBIN: u32 = 16u;

var<workgroup> h_id: array<u32, HSLOTS>;
var<workgroup> h_val: array<f32, HSLOTS>;
var<workgroup> bins: array<f32, 4096>;     // NBIN * WG
var<workgroup> su: array<u32, WG>;
var<workgroup> sf: array<f32, WG>;
var<workgroup> w_u: u32;
var<workgroup> w_f: f32;

fn pcg_hash(x: u32) -> u32 {
    let state = x * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

fn uniform01(seed: u32, step: u32) -> f32 {
    let h = pcg_hash(seed ^ pcg_hash(step + 0x9e3779b9u));
    return f32(h >> 8u) / 16777216.0;
}

fn hslot(id: u32) -> u32 {
    return (id * 2654435761u) >> 24u;
}

var<private> g_pen: bool;

// Logit i after the repetition penalty.
fn lval(i: u32) -> f32 {
    let raw = logits[p.offset + i];
    if g_pen {
        var s = hslot(i);
        loop {
            let h = h_id[s];
            if h == i {
                return h_val[s];
            }
            if h == EMPTY {
                break;
            }
            s = (s + 1u) % HSLOTS;
        }
    }
    return raw;
}

// Order-preserving u32 key of an f32 (Rust's total_cmp order).
fn fkey(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b ^ 0x80000000u, ~b, (b >> 31u) == 1u);
}

fn key_val(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k ^ 0x80000000u, (k >> 31u) == 1u));
}

fn sum_f(v: f32, lid: u32) -> f32 {
    sf[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            sf[lid] += sf[lid + s];
        }
        workgroupBarrier();
    }
    let r = sf[0];
    workgroupBarrier();
    return r;
}

fn max_f(v: f32, lid: u32) -> f32 {
    sf[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            sf[lid] = max(sf[lid], sf[lid + s]);
        }
        workgroupBarrier();
    }
    let r = sf[0];
    workgroupBarrier();
    return r;
}

fn min_u(v: u32, lid: u32) -> u32 {
    su[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            su[lid] = min(su[lid], su[lid + s]);
        }
        workgroupBarrier();
    }
    let r = su[0];
    workgroupBarrier();
    return r;
}

fn max_u(v: u32, lid: u32) -> u32 {
    su[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            su[lid] = max(su[lid], su[lid + s]);
        }
        workgroupBarrier();
    }
    let r = su[0];
    workgroupBarrier();
    return r;
}

// Per-bin totals of `acc` (NBIN values per invocation) over the workgroup, left in bins[b * WG].
fn reduce_bins(acc: array<f32, NBIN>, lid: u32) {
    for (var b = 0u; b < NBIN; b++) {
        bins[b * WG + lid] = acc[b];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if lid < s {
            for (var b = 0u; b < NBIN; b++) {
                bins[b * WG + lid] += bins[b * WG + lid + s];
            }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let V = p.V;
    let temp = bitcast<f32>(sp[0]);
    let top_k = sp[1];
    let top_p = bitcast<f32>(sp[2]);
    let min_p = bitcast<f32>(sp[3]);
    let pen = bitcast<f32>(sp[4]);
    let seed = sp[5];
    let step = sp[6];
    let n_recent = min(sp[7], min(arrayLength(&recent), HSLOTS / 2u));

    // 1. repetition penalty table
    for (var s = lid; s < HSLOTS; s += WG) {
        h_id[s] = EMPTY;
    }
    workgroupBarrier();
    let use_pen = pen != 1.0 && pen > 0.0 && n_recent > 0u;
    if use_pen && lid == 0u {
        for (var r = 0u; r < n_recent; r++) {
            let id = recent[r];
            if id >= V {
                continue;
            }
            var s = hslot(id);
            loop {
                let h = h_id[s];
                if h == id {
                    break;
                }
                if h == EMPTY {
                    let l = logits[p.offset + id];
                    h_id[s] = id;
                    h_val[s] = select(l / pen, l * pen, l < 0.0);
                    break;
                }
                s = (s + 1u) % HSLOTS;
            }
        }
    }
    workgroupBarrier();
    g_pen = use_pen;

    // 2. greedy
    if temp <= 0.0 {
        var bv = bitcast<f32>(0xff800000u);
        var bi = EMPTY;
        for (var i = lid; i < V; i += WG) {
            let v = lval(i);
            if bi == EMPTY || v > bv {
                bv = v;
                bi = i;
            }
        }
        // max value, then the lowest index holding it
        let m = max_f(select(bitcast<f32>(0xff800000u), bv, bi != EMPTY), lid);
        var cand = EMPTY;
        if bi != EMPTY && bv == m {
            cand = bi;
        }
        let best = min_u(cand, lid);
        if lid == 0u {
            out[0] = select(best, 0u, best == EMPTY);
        }
        return;
    }

    // 3. thresholds
    var mloc = bitcast<f32>(0xff800000u);
    for (var i = lid; i < V; i += WG) {
        mloc = max(mloc, lval(i) / temp);
    }
    let m = max_f(mloc, lid);
    var thr = bitcast<f32>(0xff800000u);

    if top_k > 0u && top_k < V {
        var prefix = 0u;
        var need = top_k;   // rank still to find inside the current prefix range
        for (var d = 0u; d < 8u; d++) {
            let shift = 28u - 4u * d;
            let hmask = select(0xffffffffu << (shift + 4u), 0u, d == 0u);
            var acc: array<f32, NBIN>;
            for (var i = lid; i < V; i += WG) {
                let k = fkey(lval(i) / temp);
                if (k & hmask) == prefix {
                    acc[(k >> shift) & 15u] += 1.0;
                }
            }
            reduce_bins(acc, lid);
            if lid == 0u {
                var b = NBIN;
                var nd = need;
                loop {
                    b -= 1u;
                    let c = u32(bins[b * WG]);
                    if c >= nd || b == 0u {
                        break;
                    }
                    nd -= c;
                }
                w_u = prefix | (b << shift);
                su[0] = nd;
            }
            workgroupBarrier();
            prefix = w_u;
            need = su[0];
            workgroupBarrier();
        }
        thr = max(thr, key_val(prefix));
    }
    if min_p > 0.0 {
        thr = max(thr, m + log(min_p));
    }
    if top_p < 1.0 {
        var tloc = 0.0;
        for (var i = lid; i < V; i += WG) {
            tloc += exp(lval(i) / temp - m);
        }
        let target = top_p * sum_f(tloc, lid);
        var prefix = 0u;
        var above = 0.0;   // mass of values above the current prefix range
        for (var d = 0u; d < 8u; d++) {
            let shift = 28u - 4u * d;
            let hmask = select(0xffffffffu << (shift + 4u), 0u, d == 0u);
            var acc: array<f32, NBIN>;
            for (var i = lid; i < V; i += WG) {
                let z = lval(i) / temp;
                let k = fkey(z);
                if (k & hmask) == prefix {
                    acc[(k >> shift) & 15u] += exp(z - m);
                }
            }
            reduce_bins(acc, lid);
            if lid == 0u {
                // highest bin whose cumulative mass (from the top) reaches the target;
                // if rounding leaves it short, the lowest non-empty bin
                var b = NBIN;
                var a = above;
                var chosen = EMPTY;
                var lowest = 0u;
                var lowest_above = above;
                var run = above;
                loop {
                    b -= 1u;
                    let mb = bins[b * WG];
                    if mb > 0.0 {
                        lowest = b;
                        lowest_above = run;
                    }
                    if mb > 0.0 && run + mb >= target {
                        chosen = b;
                        a = run;
                        break;
                    }
                    run += mb;
                    if b == 0u {
                        break;
                    }
                }
                if chosen == EMPTY {
                    chosen = lowest;
                    a = lowest_above;
                }
                w_u = prefix | (chosen << shift);
                w_f = a;
            }
            workgroupBarrier();
            prefix = w_u;
            above = w_f;
            workgroupBarrier();
        }
        thr = max(thr, key_val(prefix));
    }

    // 4. inverse CDF over contiguous ranges
    let chunk = (V + WG - 1u) / WG;
    let c0 = min(lid * chunk, V);
    let c1 = min(c0 + chunk, V);
    var kloc = 0.0;
    var last = 0u;
    var any = false;
    for (var i = c0; i < c1; i++) {
        let z = lval(i) / temp;
        if z >= thr {
            kloc += exp(z - m);
            last = i;
            any = true;
        }
    }
    // exclusive prefix of kloc
    sf[lid] = kloc;
    workgroupBarrier();
    if lid == 0u {
        var run = 0.0;
        for (var j = 0u; j < WG; j++) {
            let v = sf[j];
            sf[j] = run;
            run += v;
        }
        w_f = run;
    }
    workgroupBarrier();
    let before = sf[lid];
    let kept = w_f;
    workgroupBarrier();
    let u = uniform01(seed, step) * kept;
    var found = EMPTY;
    if any && before + kloc > u {
        var acc = before;
        for (var i = c0; i < c1; i++) {
            let z = lval(i) / temp;
            if z >= thr {
                acc += exp(z - m);
                if acc > u {
                    found = i;
                    break;
                }
            }
        }
    }
    let f = min_u(found, lid);
    let lastall = max_u(select(0u, last, any), lid);
    if lid == 0u {
        out[0] = select(f, lastall, f == EMPTY);
    }
}
