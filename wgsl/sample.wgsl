// Token sampling from one row of logits (cpu::ops::sample), in one workgroup:
//  1. repetition penalty on the distinct recent ids (l < 0 ? l*p : l/p), held in a
//     two-choice hash table in workgroup memory (plus an overflow list);
//  2. temperature <= 0: argmax (ties: lowest index);
//  3. else z = l / T, m = max z; threshold = max of
//       min-p:  m + ln(min_p),
//       top-k:  the k-th largest z,
//       top-p:  the z where the mass of the sorted values first reaches top_p * total,
//     top-k and top-p by one radix descent over order-preserving keys (8 passes of
//     4-bit digits: counts for top-k, masses for top-p);
//  4. inverse CDF in index order over the kept values at uniform(seed, step) * kept
//     (contiguous per-invocation ranges plus a prefix sum).
// Masses e^(z-m) (computed to ~1 ulp by exp_acc) are summed exactly as 64-bit fixed-point
// integers (2^-40 units), so picks agree with the CPU's f64 sums except when the draw falls
// within ~1e-7 (relative) of a token boundary.
//
// Prelude consts: WG; uses common.wgsl. Bindings: 0 params (V, offset of the row), 1 logits, 2 sampling
// words u32[8] (temperature, top_k, top_p, min_p, repetition_penalty as f32 bits; seed,
// step, n_recent), 3 recent ids (at most MAX_RECENT used), 4 out u32[1].

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

const MAX_RECENT: u32 = 128u;
const EMPTY: u32 = 0xffffffffu;
const NBIN: u32 = 16u;
const BIN_N: u32 = NBIN * WG;

// the distinct penalized ids, sorted, padded with EMPTY, and their penalized logits
var<workgroup> r_id: array<u32, MAX_RECENT>;
var<workgroup> r_val: array<f32, MAX_RECENT>;
// per-invocation columns of 16 digit bins: counts (top-k) and fixed-point masses (top-p)
var<workgroup> bin_c: array<u32, BIN_N>;
var<workgroup> bin_m: array<vec2<u32>, BIN_N>;
var<workgroup> sx: array<vec2<u32>, WG>;
var<workgroup> su: array<u32, WG>;
var<workgroup> sf: array<f32, WG>;
var<workgroup> w_x: vec2<u32>;
var<workgroup> w_u: u32;
var<workgroup> w_f: f32;
var<workgroup> w_sp: array<u32, 8>;
// running state of the threshold search (see main)
var<workgroup> st: array<u32, 12>;
const S_M: u32 = 0u;
const S_PK: u32 = 1u;
const S_NEED: u32 = 2u;
const S_PP: u32 = 3u;
const S_AB0: u32 = 4u;
const S_AB1: u32 = 5u;
const S_G0: u32 = 6u;
const S_G1: u32 = 7u;
const S_THR: u32 = 8u;

var<private> g_pen: bool;

fn pcg_hash(x: u32) -> u32 {
    let state = x * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

// 24 random bits of uniform(seed, step) = j / 2^24.
fn uniform_bits(seed: u32, step: u32) -> u32 {
    return pcg_hash(seed ^ pcg_hash(step + 0x9e3779b9u)) >> 8u;
}

// e^x for x <= 0 to ~1 ulp on every backend (Cody-Waite reduction, Cephes polynomial).
fn exp_acc(x: f32) -> f32 {
    if x < -87.0 {
        return 0.0;
    }
    let k = round(x * 1.4426950408889634);
    let r = (x - k * 0.693145751953125) - k * 1.428606765330187e-6;
    var q = 1.9875691500e-4;
    q = q * r + 1.3981999507e-3;
    q = q * r + 8.3334519073e-3;
    q = q * r + 4.1665795894e-2;
    q = q * r + 1.6666665459e-1;
    q = q * r + 5.0000001201e-1;
    let er = q * (r * r) + r + 1.0;
    return er * bitcast<f32>(u32(i32(k) + 127) << 23u);
}

// ---- 64-bit fixed point (lo, hi), unit 2^-40 ----

// A mass in [0, 1] (f32) to fixed point, exactly (bits below 2^-40 dropped).
fn fx_from(v: f32) -> vec2<u32> {
    let b = bitcast<u32>(v);
    let e = (b >> 23u) & 255u;
    if e == 0u || e > 127u {
        return vec2<u32>(0u, select(0u, 256u, e > 127u));   // 0, or 1.0 for anything >= 1
    }
    let mant = (b & 0x7fffffu) | 0x800000u;
    // value = mant * 2^(e - 150) = mant * 2^(e - 110) units
    if e >= 110u {
        let s = e - 110u;   // 0..17
        if s <= 8u {
            return vec2<u32>(mant << s, 0u);
        }
        return vec2<u32>(mant << s, mant >> (32u - s));
    }
    let r = 110u - e;
    if r >= 24u {
        return vec2<u32>(0u, 0u);
    }
    return vec2<u32>(mant >> r, 0u);
}

fn fx_add(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}

fn fx_gt(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.y > b.y || (a.y == b.y && a.x > b.x);
}

fn fx_ge(a: vec2<u32>, b: vec2<u32>) -> bool {
    return a.y > b.y || (a.y == b.y && a.x >= b.x);
}

// floor(a * j / 2^sh) for j < 2^32, 24 <= sh.
fn fx_mul_shr(a: vec2<u32>, j: u32, sh: u32) -> vec2<u32> {
    // 96-bit product in limbs l0, l1, l2
    let l0 = a.x * j;
    let h0 = mulhi(a.x, j);
    let p1 = a.y * j;
    let l1 = h0 + p1;
    let l2 = mulhi(a.y, j) + select(0u, 1u, l1 < h0);
    if sh >= 96u {
        return vec2<u32>(0u, 0u);
    }
    if sh >= 64u {
        return vec2<u32>(l2 >> (sh - 64u), 0u);
    }
    if sh >= 32u {
        let s = sh - 32u;
        if s == 0u {
            return vec2<u32>(l1, l2);
        }
        return vec2<u32>((l1 >> s) | (l2 << (32u - s)), l2 >> s);
    }
    // 24 <= sh < 32
    return vec2<u32>((l0 >> sh) | (l1 << (32u - sh)), (l1 >> sh) | (l2 << (32u - sh)));
}

// ---- repetition penalty lookup ----

// Logit i after the repetition penalty: a binary search over the sorted ids, unrolled
// (lavapipe, Mesa 22.3, mis-executes loops nested in the callers' loops here).
fn lval(i: u32) -> f32 {
    var v = logits[p.offset + i];
    if g_pen {
        var q = 0u;
        q += select(0u, 64u, r_id[q + 63u] < i);
        q += select(0u, 32u, r_id[q + 31u] < i);
        q += select(0u, 16u, r_id[q + 15u] < i);
        q += select(0u, 8u, r_id[q + 7u] < i);
        q += select(0u, 4u, r_id[q + 3u] < i);
        q += select(0u, 2u, r_id[q + 1u] < i);
        q += select(0u, 1u, r_id[q] < i);
        let qq = min(q, MAX_RECENT - 1u);
        v = select(v, r_val[qq], r_id[qq] == i);
    }
    return v;
}

// Order-preserving u32 key of an f32 (Rust's total_cmp order).
fn fkey(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b ^ 0x80000000u, ~b, (b >> 31u) == 1u);
}

fn key_val(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k ^ 0x80000000u, (k >> 31u) == 1u));
}

// ---- workgroup reductions: all write, one folds (two barriers each) ----

fn max_f(v: f32, lid: u32) -> f32 {
    sf[lid] = v;
    workgroupBarrier();
    if lid == 0u {
        var t = sf[0];
        for (var j = 1u; j < WG; j++) {
            t = max(t, sf[j]);
        }
        w_f = t;
    }
    workgroupBarrier();
    return w_f;
}

fn min_u(v: u32, lid: u32) -> u32 {
    su[lid] = v;
    workgroupBarrier();
    if lid == 0u {
        var t = su[0];
        for (var j = 1u; j < WG; j++) {
            t = min(t, su[j]);
        }
        w_u = t;
    }
    workgroupBarrier();
    return w_u;
}

fn max_u(v: u32, lid: u32) -> u32 {
    su[lid] = v;
    workgroupBarrier();
    if lid == 0u {
        var t = su[0];
        for (var j = 1u; j < WG; j++) {
            t = max(t, su[j]);
        }
        w_u = t;
    }
    workgroupBarrier();
    return w_u;
}

// Invocation 0: picks the digit of pass d for top-k (counts) and top-p (masses) from the
// bin totals in column 0, updating the state in `st`.
fn select_digit(d: u32, shift: u32, do_k: bool, do_p: bool, top_p: f32) {
    if do_k {
        var need = st[S_NEED];
        var chosen = 0u;
        var found = false;
        for (var j = 0u; j < NBIN; j++) {
            let b = NBIN - 1u - j;
            let c = bin_c[b * WG];
            if !found {
                if c >= need {
                    chosen = b;
                    found = true;
                } else {
                    need -= c;
                }
            }
        }
        st[S_PK] = st[S_PK] | (chosen << shift);
        st[S_NEED] = need;
    }
    if do_p {
        var goal = vec2<u32>(st[S_G0], st[S_G1]);
        if d == 0u {
            var tot = vec2<u32>(0u);
            for (var b = 0u; b < NBIN; b++) {
                tot = fx_add(tot, bin_m[b * WG]);
            }
            // goal = total * top_p (top_p = mantissa * 2^-(150 - e), e <= 126)
            let tb = bitcast<u32>(top_p);
            let te = (tb >> 23u) & 255u;
            if te > 0u {
                goal = fx_mul_shr(tot, (tb & 0x7fffffu) | 0x800000u, 150u - te);
            }
            st[S_G0] = goal.x;
            st[S_G1] = goal.y;
        }
        // the highest bin whose cumulative mass (from the top) reaches the goal; if the goal
        // exceeds every sum, the lowest non-empty bin
        let above = vec2<u32>(st[S_AB0], st[S_AB1]);
        var run = above;
        var chosen = 0u;
        var chosen_above = above;
        var found = false;
        var lowest = 0u;
        var lowest_above = above;
        for (var j = 0u; j < NBIN; j++) {
            let b = NBIN - 1u - j;
            let mb = bin_m[b * WG];
            let nonempty = mb.x > 0u || mb.y > 0u;
            let with_b = fx_add(run, mb);
            if !found {
                if nonempty {
                    lowest = b;
                    lowest_above = run;
                }
                if nonempty && fx_ge(with_b, goal) {
                    chosen = b;
                    chosen_above = run;
                    found = true;
                }
                run = with_b;
            }
        }
        if !found {
            chosen = lowest;
            chosen_above = lowest_above;
        }
        st[S_PP] = st[S_PP] | (chosen << shift);
        st[S_AB0] = chosen_above.x;
        st[S_AB1] = chosen_above.y;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let V = p.V;
    // the sampling words, provably uniform (they decide branches that hold barriers)
    if lid < 8u {
        w_sp[lid] = sp[lid];
    }
    let spu = workgroupUniformLoad(&w_sp);
    let temp = bitcast<f32>(spu[0]);
    let top_k = spu[1];
    let top_p = bitcast<f32>(spu[2]);
    let min_p = bitcast<f32>(spu[3]);
    let pen = bitcast<f32>(spu[4]);
    let seed = spu[5];
    let step = spu[6];
    let n_recent = min(spu[7], min(arrayLength(&recent), MAX_RECENT));

    // 1. repetition penalty: the distinct ids, sorted (insertion sort by invocation 0)
    let use_pen = pen != 1.0 && pen > 0.0 && n_recent > 0u;
    if lid == 0u {
        var n = 0u;
        if use_pen {
            for (var r = 0u; r < n_recent; r++) {
                let id = recent[r];
                var dup = id >= V;
                for (var j = 0u; j < n; j++) {
                    dup = dup || r_id[j] == id;
                }
                if !dup {
                    let l = logits[p.offset + id];
                    let v = select(l / pen, l * pen, l < 0.0);
                    var j = n;
                    while j > 0u && r_id[j - 1u] > id {
                        r_id[j] = r_id[j - 1u];
                        r_val[j] = r_val[j - 1u];
                        j--;
                    }
                    r_id[j] = id;
                    r_val[j] = v;
                    n++;
                }
            }
        }
        for (var j = n; j < MAX_RECENT; j++) {
            r_id[j] = EMPTY;
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
        let mx = max_f(select(bitcast<f32>(0xff800000u), bv, bi != EMPTY), lid);
        var cand = EMPTY;
        if bi != EMPTY && bv == mx {
            cand = bi;
        }
        let best = min_u(cand, lid);
        if lid == 0u {
            out[0] = select(best, 0u, best == EMPTY);
        }
        return;
    }

    // 3. thresholds. The running state lives in workgroup memory, updated by invocation 0
    // and re-read by everyone after each barrier: few values stay live across barriers
    // (lavapipe, Mesa 22.3, corrupts some that do in a kernel this long).
    var mloc = bitcast<f32>(0xff800000u);
    for (var i = lid; i < V; i += WG) {
        mloc = max(mloc, lval(i) / temp);
    }
    let m0 = max_f(mloc, lid);
    if lid == 0u {
        st[S_M] = bitcast<u32>(m0);
        st[S_PK] = 0u;
        st[S_NEED] = top_k;
        st[S_PP] = 0u;
        st[S_AB0] = 0u;
        st[S_AB1] = 0u;
        st[S_G0] = 0u;
        st[S_G1] = 0u;
        var t = bitcast<f32>(0xff800000u);
        if min_p > 0.0 {
            t = max(t, m0 + log(min_p));
        }
        st[S_THR] = bitcast<u32>(t);
    }
    let do_k = top_k > 0u && top_k < V;
    let do_p = top_p < 1.0;
    if do_k || do_p {
        for (var d = 0u; d < 8u; d++) {
            workgroupBarrier();
            let shift = 28u - 4u * d;
            let hmask = 0xfffffff0u << shift;   // bits above this digit (none for d = 0)
            let pk = st[S_PK];
            let pp = st[S_PP];
            let m = bitcast<f32>(st[S_M]);
            let tp = bitcast<f32>(w_sp[0]);
            for (var b = 0u; b < NBIN; b++) {
                bin_c[b * WG + lid] = 0u;
                bin_m[b * WG + lid] = vec2<u32>(0u);
            }
            for (var i = lid; i < V; i += WG) {
                let z = lval(i) / tp;
                let k = fkey(z);
                let bi = ((k >> shift) & 15u) * WG + lid;
                if do_k && (k & hmask) == pk {
                    bin_c[bi] += 1u;
                }
                if do_p && (k & hmask) == pp {
                    bin_m[bi] = fx_add(bin_m[bi], fx_from(exp_acc(z - m)));
                }
            }
            workgroupBarrier();
            if lid < NBIN {
                var c = 0u;
                var t = vec2<u32>(0u);
                for (var j = 0u; j < WG; j++) {
                    c += bin_c[lid * WG + j];
                    t = fx_add(t, bin_m[lid * WG + j]);
                }
                bin_c[lid * WG] = c;
                bin_m[lid * WG] = t;
            }
            workgroupBarrier();
            if lid == 0u {
                select_digit(d, shift, do_k, do_p, bitcast<f32>(w_sp[2]));
            }
        }
        workgroupBarrier();
        if lid == 0u {
            var t = bitcast<f32>(st[S_THR]);
            if do_k {
                t = max(t, key_val(st[S_PK]));
            }
            if do_p {
                t = max(t, key_val(st[S_PP]));
            }
            st[S_THR] = bitcast<u32>(t);
        }
    }
    workgroupBarrier();

    // 4. inverse CDF over contiguous ranges
    let thr = bitcast<f32>(st[S_THR]);
    let m = bitcast<f32>(st[S_M]);
    let tz = bitcast<f32>(w_sp[0]);
    let chunk = (V + WG - 1u) / WG;
    let c0 = min(lid * chunk, V);
    let c1 = min(c0 + chunk, V);
    var kloc = vec2<u32>(0u);
    var last = 0u;
    var has_kept = false;
    for (var i = c0; i < c1; i++) {
        let z = lval(i) / tz;
        if z >= thr {
            kloc = fx_add(kloc, fx_from(exp_acc(z - m)));
            last = i;
            has_kept = true;
        }
    }
    // exclusive prefix of kloc
    sx[lid] = kloc;
    workgroupBarrier();
    if lid == 0u {
        var run = vec2<u32>(0u);
        for (var j = 0u; j < WG; j++) {
            let v = sx[j];
            sx[j] = run;
            run = fx_add(run, v);
        }
        w_x = run;
    }
    workgroupBarrier();
    let before = sx[lid];
    let kept = w_x;
    let u = fx_mul_shr(kept, uniform_bits(seed, step), 24u);
    var found = EMPTY;
    // every range starting at or below u rescans (the first token whose running mass exceeds u)
    // Every range starting at or below u rescans (the first token whose running mass
    // exceeds u). Written without `break` or a loop under a divergent branch: lavapipe
    // (Mesa 22.3) mis-executes those here.
    let rescan = has_kept && !fx_gt(before, u);
    var acc = before;
    for (var i = c0; i < c1; i++) {
        let z = lval(i) / tz;
        let take = rescan && z >= thr && found == EMPTY;
        acc = select(acc, fx_add(acc, fx_from(exp_acc(z - m))), take);
        found = select(found, i, take && fx_gt(acc, u));
    }
    let f = min_u(found, lid);
    let lastall = max_u(select(0u, last, has_kept), lid);
    if lid == 0u {
        out[0] = select(f, lastall, f == EMPTY);
    }
}
