// Token sampling from one row of logits (cpu::ops::sample), as a sequence of dispatches:
// heavy passes over the logits on NW = ceil(V / CHUNK) workgroups (one per chunk of CHUNK
// logits), with one-workgroup passes between them that combine the per-chunk results.
// One stage per specialization (prelude flag), recorded in this order (src/gpu/sample.rs):
//  STAGE_CHUNK  (NW groups) per chunk: the max of the penalized logits and the lowest index
//               holding it (greedy), and the max of z = l / T;
//  STAGE_INIT   (1 group)   the global maxima; temperature <= 0: writes the argmax (ties:
//               lowest index) to out; else initialises the search state (m, the min-p
//               threshold m + ln(min_p), the radix prefixes, top-k's count still needed);
//  8 times:
//  STAGE_BINS   (NW groups) per chunk: the 16 digit counts (top-k) and fixed-point masses
//               (top-p) of digit d over the values whose higher digits match the prefixes;
//  STAGE_SELECT (1 group)   sums the chunks' bins, picks digit d of the k-th largest z (counts)
//               and of the z where the mass of the sorted values first reaches top_p * total
//               (masses), then d += 1; after the last digit, threshold = max of min-p, top-k
//               and top-p's values;
//  STAGE_MASS   (NW groups) per chunk: the kept mass (z >= threshold) and the last kept index;
//  STAGE_PICK   (1 group)   inverse CDF in index order at u = uniform(seed, step) * kept: the
//               first chunk whose running mass exceeds u, then inside it (contiguous
//               per-invocation ranges plus a prefix sum) the first such token; none: the
//               last kept token. Writes out.
// Stages after INIT return at once when they have nothing to do (greedy, or no top-k / top-p
// for BINS and SELECT): the dispatch sequence is fixed, the parameters are read on the device.
// The search runs over order-preserving keys of z (8 passes of 4-bit digits).
//
// Masses e^(z-m) (computed to ~1 ulp by exp_acc) are summed exactly as 64-bit fixed-point
// integers (2^-40 units): integer sums do not depend on the order, so the per-chunk partial
// sums give the same totals and running sums as a sequential pass, and picks agree with the
// CPU's f64 sums except when the draw falls within ~1e-7 (relative) of a token boundary.
//
// Each CHUNK workgroup builds the repetition penalty table in workgroup memory (the distinct
// recent ids, sorted, and their penalized logits l < 0 ? l*p : l/p; one id per invocation);
// the first also stores it in the state buffer, from which the later heavy passes load it.
//
// Prelude consts: WG (= MAX_RECENT = 128, a multiple of NBIN), CHUNK (a multiple of WG); one
// flag STAGE_*; uses common.wgsl. Bindings: 0 params (V, offset of the row), 1 logits,
// 2 sampling words u32[8] (temperature, top_k, top_p, min_p, repetition_penalty as f32 bits;
// seed, step, n_recent), 3 recent ids (at most MAX_RECENT used), 4 out u32[rows], 5 per-chunk
// results u32[NW * PART], 6 search state and penalty table u32[PEN_VAL + MAX_RECENT].

struct Params {
    V: u32,
    offset: u32,
    // the row of a batch: its words at sp[8 * row], its recent ids at recent[row * recent_len],
    // its token at out[row] (0 for one row)
    row: u32,
    // recent ids per row (0: the whole binding, one row)
    recent_len: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> sp: array<u32>;
@group(0) @binding(3) var<storage, read> recent: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;
@group(0) @binding(5) var<storage, read_write> part: array<u32>;
@group(0) @binding(6) var<storage, read_write> st: array<u32>;

const MAX_RECENT: u32 = 128u;

// The recent ids of this row.
fn recent_count() -> u32 {
    return select(arrayLength(&recent), p.recent_len, p.recent_len > 0u);
}
const EMPTY: u32 = 0xffffffffu;
const NBIN: u32 = 16u;
// words per chunk in `part`: CHUNK (max penalized logit, its lowest index, max z), BINS
// (NBIN counts, then NBIN fixed-point masses), MASS (kept mass, last kept index + 1 or 0)
const PART: u32 = 48u;

// the search state in `st`
const S_M: u32 = 0u;      // m = max z (f32 bits)
const S_PK: u32 = 1u;     // top-k: key prefix chosen so far
const S_NEED: u32 = 2u;   // top-k: values still needed below the prefix
const S_PP: u32 = 3u;     // top-p: key prefix chosen so far
const S_AB0: u32 = 4u;    // top-p: mass above the prefix (fixed point, lo, hi)
const S_AB1: u32 = 5u;
const S_G0: u32 = 6u;     // top-p: goal mass (fixed point, lo, hi)
const S_G1: u32 = 7u;
const S_THR: u32 = 8u;    // threshold (f32 bits)
const S_D: u32 = 9u;      // the next digit to select (0..8)
// the repetition penalty table (ids, penalized logits as f32 bits), from the CHUNK stage
const PEN_ID: u32 = 16u;
const PEN_VAL: u32 = PEN_ID + MAX_RECENT;

var<workgroup> sf: array<f32, WG>;
var<workgroup> su: array<u32, WG>;
var<workgroup> sx: array<vec2<u32>, WG>;
var<workgroup> w_sp: array<u32, 8>;

// The sampling words, provably uniform (they decide branches that hold barriers).
fn load_words(lid: u32) -> array<u32, 8> {
    if lid < 8u {
        w_sp[lid] = sp[p.row * 8u + lid];
    }
    return workgroupUniformLoad(&w_sp);
}

// Whether top-k / top-p filter under the sampling words `spu` (V tokens).
fn top_k_on(spu: array<u32, 8>, V: u32) -> bool {
    return spu[1] > 0u && spu[1] < V;
}

fn top_p_on(spu: array<u32, 8>) -> bool {
    return bitcast<f32>(spu[2]) < 1.0;
}

// Chunks of CHUNK logits in a row of V (workgroups of the passes over the logits).
fn n_chunks(V: u32) -> u32 {
    return (V + CHUNK - 1u) / CHUNK;
}

// Whether the radix search runs: sampling (temperature > 0) with top-k or top-p.
fn searching(spu: array<u32, 8>, V: u32) -> bool {
    return bitcast<f32>(spu[0]) > 0.0 && (top_k_on(spu, V) || top_p_on(spu));
}

fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u);
}

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

// Order-preserving u32 key of an f32 (Rust's total_cmp order).
fn fkey(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b ^ 0x80000000u, ~b, (b >> 31u) == 1u);
}

fn key_val(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k ^ 0x80000000u, (k >> 31u) == 1u));
}

// ---- workgroup reductions: tree folds (each starts with a barrier, so the previous result
// has been read by everyone before it is overwritten) ----

fn max_f(v: f32, lid: u32) -> f32 {
    workgroupBarrier();
    sf[lid] = v;
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        workgroupBarrier();
        if lid < s {
            sf[lid] = max(sf[lid], sf[lid + s]);
        }
    }
    workgroupBarrier();
    return sf[0];
}

// The min (take_max false) or max of all invocations' u32s.
fn fold_u(v: u32, lid: u32, take_max: bool) -> u32 {
    workgroupBarrier();
    su[lid] = v;
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        workgroupBarrier();
        if lid < s {
            let a = su[lid];
            let b = su[lid + s];
            su[lid] = select(min(a, b), max(a, b), take_max);
        }
    }
    workgroupBarrier();
    return su[0];
}

fn min_u(v: u32, lid: u32) -> u32 {
    return fold_u(v, lid, false);
}

fn max_u(v: u32, lid: u32) -> u32 {
    return fold_u(v, lid, true);
}

// Sum of the fixed-point values of all invocations (exact, so the order does not matter).
fn sum_x(v: vec2<u32>, lid: u32) -> vec2<u32> {
    workgroupBarrier();
    sx[lid] = v;
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        workgroupBarrier();
        if lid < s {
            sx[lid] = fx_add(sx[lid], sx[lid + s]);
        }
    }
    workgroupBarrier();
    return sx[0];
}

//#if STAGE_CHUNK || STAGE_BINS || STAGE_MASS || STAGE_PICK
// ---- repetition penalty table ----

// the distinct penalized ids, sorted, padded with EMPTY, and their penalized logits
var<workgroup> r_id: array<u32, MAX_RECENT>;
var<workgroup> r_val: array<f32, MAX_RECENT>;
// the recent ids (EMPTY where unused or out of range) and whether each is a first occurrence
var<workgroup> q_id: array<u32, MAX_RECENT>;
var<workgroup> q_keep: array<u32, MAX_RECENT>;

var<private> g_pen: bool;

// Builds r_id / r_val from the first n_recent recent ids, one per invocation (WG ==
// MAX_RECENT): an id is kept at its first occurrence, at the rank among the kept ids below
// it. Loops run over all ids with predicates (no loop under a divergent branch).
fn build_pen(lid: u32, n_recent: u32, pen: f32, V: u32) {
    var id = EMPTY;
    if lid < n_recent {
        id = recent[p.row * p.recent_len + lid];
    }
    q_id[lid] = select(id, EMPTY, id >= V);
    r_id[lid] = EMPTY;
    workgroupBarrier();
    let me = q_id[lid];
    var first = me != EMPTY;
    for (var j = 0u; j < MAX_RECENT; j++) {
        first = first && !(j < lid && q_id[j] == me);
    }
    q_keep[lid] = select(0u, 1u, first);
    workgroupBarrier();
    let me2 = q_id[lid];
    var rank = 0u;
    for (var j = 0u; j < MAX_RECENT; j++) {
        rank += select(0u, 1u, q_keep[j] == 1u && q_id[j] < me2);
    }
    if q_keep[lid] == 1u {
        let l = logits[p.offset + me2];
        r_id[rank] = me2;
        r_val[rank] = select(l / pen, l * pen, l < 0.0);
    }
    workgroupBarrier();
}

// Loads the table that the CHUNK stage left in `st`.
fn load_pen(lid: u32) {
    r_id[lid] = st[PEN_ID + lid];
    r_val[lid] = bitcast<f32>(st[PEN_VAL + lid]);
    workgroupBarrier();
}

// Whether the repetition penalty applies under the sampling words `spu`.
fn pen_on(spu: array<u32, 8>) -> bool {
    let pen = bitcast<f32>(spu[4]);
    let n_recent = min(spu[7], min(recent_count(), MAX_RECENT));
    return pen != 1.0 && pen > 0.0 && n_recent > 0u;
}

// The later stages' start: the penalty table from `st` when the penalty applies.
fn use_pen_table(lid: u32, spu: array<u32, 8>) {
    let on = pen_on(spu);
    if on {
        load_pen(lid);
    }
    g_pen = on;
}

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
//#endif

//#if STAGE_CHUNK
@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let V = p.V;
    let spu = load_words(lid);
    let use_pen = pen_on(spu);
    if use_pen {
        build_pen(lid, min(spu[7], min(recent_count(), MAX_RECENT)), bitcast<f32>(spu[4]), V);
        // the table for the later stages
        if wid.x == 0u {
            st[PEN_ID + lid] = r_id[lid];
            st[PEN_VAL + lid] = bitcast<u32>(r_val[lid]);
        }
    }
    g_pen = use_pen;

    let temp = bitcast<f32>(w_sp[0]);
    let c0 = wid.x * CHUNK;
    let c1 = min(c0 + CHUNK, V);
    var bv = neg_inf();
    var bi = EMPTY;
    var mz = neg_inf();
    for (var i = c0 + lid; i < c1; i += WG) {
        let v = lval(i);
        if bi == EMPTY || v > bv {
            bv = v;
            bi = i;
        }
        mz = max(mz, v / temp);
    }
    // max value, then the lowest index holding it; max z
    let mx = max_f(select(neg_inf(), bv, bi != EMPTY), lid);
    var cand = EMPTY;
    if bi != EMPTY && bv == mx {
        cand = bi;
    }
    let best = min_u(cand, lid);
    let mzw = max_f(mz, lid);
    if lid == 0u {
        let o = wid.x * PART;
        part[o] = bitcast<u32>(mx);
        part[o + 1u] = best;
        part[o + 2u] = bitcast<u32>(mzw);
    }
}
//#endif

//#if STAGE_INIT
@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let V = p.V;
    let nw = n_chunks(V);
    var mx = neg_inf();
    var mz = neg_inf();
    for (var w = lid; w < nw; w += WG) {
        mx = max(mx, bitcast<f32>(part[w * PART]));
        mz = max(mz, bitcast<f32>(part[w * PART + 2u]));
    }
    let gmx = max_f(mx, lid);
    // the lowest index among the chunks holding the max (each chunk's is its lowest)
    var cand = EMPTY;
    for (var w = lid; w < nw; w += WG) {
        let b = part[w * PART + 1u];
        if b != EMPTY && bitcast<f32>(part[w * PART]) == gmx {
            cand = min(cand, b);
        }
    }
    let best = min_u(cand, lid);
    let m = max_f(mz, lid);
    if lid == 0u {
        let temp = bitcast<f32>(sp[p.row * 8u]);
        let min_p = bitcast<f32>(sp[p.row * 8u + 3u]);
        if temp <= 0.0 {
            out[p.row] = select(best, 0u, best == EMPTY);
        }
        st[S_M] = bitcast<u32>(m);
        st[S_PK] = 0u;
        st[S_NEED] = sp[p.row * 8u + 1u];
        st[S_PP] = 0u;
        st[S_AB0] = 0u;
        st[S_AB1] = 0u;
        st[S_G0] = 0u;
        st[S_G1] = 0u;
        var t = neg_inf();
        if min_p > 0.0 {
            t = max(t, m + log(min_p));
        }
        st[S_THR] = bitcast<u32>(t);
        st[S_D] = 0u;
    }
}
//#endif

//#if STAGE_BINS
const BIN_N: u32 = NBIN * WG;
const SPLIT: u32 = WG / NBIN;
// per-invocation columns of 16 digit bins: counts (top-k) and fixed-point masses (top-p)
var<workgroup> bin_c: array<u32, BIN_N>;
var<workgroup> bin_m: array<vec2<u32>, BIN_N>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let V = p.V;
    let spu = load_words(lid);
    if !searching(spu, V) {
        return;
    }
    let do_k = top_k_on(spu, V);
    let do_p = top_p_on(spu);
    use_pen_table(lid, spu);

    let d = min(st[S_D], 7u);
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
    let c0 = wid.x * CHUNK;
    let c1 = min(c0 + CHUNK, V);
    for (var i = c0 + lid; i < c1; i += WG) {
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
    // fold the columns: SPLIT invocations per bin, each over the columns s, s + SPLIT, ...
    // into column s; then one invocation per bin over those
    {
        let b = lid / SPLIT;
        let s = lid % SPLIT;
        var c = 0u;
        var t = vec2<u32>(0u);
        for (var j = s; j < WG; j += SPLIT) {
            c += bin_c[b * WG + j];
            t = fx_add(t, bin_m[b * WG + j]);
        }
        bin_c[b * WG + s] = c;
        bin_m[b * WG + s] = t;
    }
    workgroupBarrier();
    if lid < NBIN {
        var c = 0u;
        var t = vec2<u32>(0u);
        for (var s = 0u; s < SPLIT; s++) {
            c += bin_c[lid * WG + s];
            t = fx_add(t, bin_m[lid * WG + s]);
        }
        let o = wid.x * PART;
        part[o + lid] = c;
        part[o + NBIN + 2u * lid] = t.x;
        part[o + NBIN + 2u * lid + 1u] = t.y;
    }
}
//#endif

//#if STAGE_SELECT
const SPLIT: u32 = WG / NBIN;
// partial totals (bin lid % NBIN, chunks lid / NBIN + SPLIT * j), then the bin totals
var<workgroup> tb_c: array<u32, WG>;
var<workgroup> tb_m: array<vec2<u32>, WG>;
var<workgroup> bin_c: array<u32, NBIN>;
var<workgroup> bin_m: array<vec2<u32>, NBIN>;

// Invocation 0: picks digit d for top-k (counts) and top-p (masses) from the bin totals,
// updating the state in `st`.
fn select_digit(d: u32, shift: u32, do_k: bool, do_p: bool, top_p: f32) {
    if do_k {
        var need = st[S_NEED];
        var chosen = 0u;
        var found = false;
        for (var j = 0u; j < NBIN; j++) {
            let b = NBIN - 1u - j;
            let c = bin_c[b];
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
                tot = fx_add(tot, bin_m[b]);
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
            let mb = bin_m[b];
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
    let spu = load_words(lid);
    if !searching(spu, V) {
        return;
    }
    let nw = n_chunks(V);
    {
        let b = lid % NBIN;
        var c = 0u;
        var t = vec2<u32>(0u);
        for (var w = lid / NBIN; w < nw; w += SPLIT) {
            let o = w * PART;
            c += part[o + b];
            t = fx_add(t, vec2<u32>(part[o + NBIN + 2u * b], part[o + NBIN + 2u * b + 1u]));
        }
        tb_c[lid] = c;
        tb_m[lid] = t;
    }
    workgroupBarrier();
    if lid < NBIN {
        var c = 0u;
        var t = vec2<u32>(0u);
        for (var s = 0u; s < SPLIT; s++) {
            c += tb_c[s * NBIN + lid];
            t = fx_add(t, tb_m[s * NBIN + lid]);
        }
        bin_c[lid] = c;
        bin_m[lid] = t;
    }
    workgroupBarrier();
    if lid == 0u {
        // the words re-read after the barriers (few values stay live across them)
        let w = w_sp;
        let d = min(st[S_D], 7u);
        let dk = top_k_on(w, p.V);
        let dp = top_p_on(w);
        select_digit(d, 28u - 4u * d, dk, dp, bitcast<f32>(w[2]));
        st[S_D] = d + 1u;
        if d == 7u {
            var t = bitcast<f32>(st[S_THR]);
            if dk {
                t = max(t, key_val(st[S_PK]));
            }
            if dp {
                t = max(t, key_val(st[S_PP]));
            }
            st[S_THR] = bitcast<u32>(t);
        }
    }
}
//#endif

//#if STAGE_MASS
@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let V = p.V;
    let spu = load_words(lid);
    if bitcast<f32>(spu[0]) <= 0.0 {
        return;
    }
    use_pen_table(lid, spu);

    let thr = bitcast<f32>(st[S_THR]);
    let m = bitcast<f32>(st[S_M]);
    let tz = bitcast<f32>(w_sp[0]);
    let c0 = wid.x * CHUNK;
    let c1 = min(c0 + CHUNK, V);
    var kloc = vec2<u32>(0u);
    var last1 = 0u;   // last kept index + 1, 0 for none
    for (var i = c0 + lid; i < c1; i += WG) {
        let z = lval(i) / tz;
        if z >= thr {
            kloc = fx_add(kloc, fx_from(exp_acc(z - m)));
            last1 = i + 1u;
        }
    }
    let kept = sum_x(kloc, lid);
    let l1 = max_u(last1, lid);
    if lid == 0u {
        let o = wid.x * PART;
        part[o] = kept.x;
        part[o + 1u] = kept.y;
        part[o + 2u] = l1;
    }
}
//#endif

//#if STAGE_PICK
const SUB: u32 = CHUNK / WG;
// the chosen chunk, its starting mass (lo, hi), u (lo, hi), the last kept index + 1, the
// kept mass (lo, hi)
var<workgroup> w_pick: array<u32, 8>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let V = p.V;
    let spu = load_words(lid);
    if bitcast<f32>(spu[0]) <= 0.0 {
        return;
    }
    use_pen_table(lid, spu);

    // the chunks in contiguous per-invocation ranges: their masses and last kept indices
    let nw = n_chunks(V);
    let cpi = (nw + WG - 1u) / WG;
    let w0 = min(lid * cpi, nw);
    let w1 = min(w0 + cpi, nw);
    var msum = vec2<u32>(0u);
    var l1 = 0u;
    for (var w = w0; w < w1; w++) {
        msum = fx_add(msum, vec2<u32>(part[w * PART], part[w * PART + 1u]));
        l1 = max(l1, part[w * PART + 2u]);
    }
    let lastall = max_u(l1, lid);
    sx[lid] = msum;
    workgroupBarrier();
    // exclusive prefix of the ranges, the kept mass, u
    if lid == 0u {
        var run = vec2<u32>(0u);
        for (var j = 0u; j < WG; j++) {
            let v = sx[j];
            sx[j] = run;
            run = fx_add(run, v);
        }
        let u = fx_mul_shr(run, uniform_bits(w_sp[5], w_sp[6]), 24u);
        w_pick[0] = EMPTY;
        w_pick[3] = u.x;
        w_pick[4] = u.y;
        w_pick[5] = lastall;
        w_pick[6] = run.x;
        w_pick[7] = run.y;
    }
    workgroupBarrier();
    // the one range holding the first chunk whose running mass exceeds u finds it
    {
        let u = vec2<u32>(w_pick[3], w_pick[4]);
        let before = sx[lid];
        let after = select(vec2<u32>(w_pick[6], w_pick[7]), sx[min(lid + 1u, WG - 1u)], lid + 1u < WG);
        let crosses = !fx_gt(before, u) && fx_gt(after, u);
        var run = before;
        var fc = EMPTY;
        var fb = vec2<u32>(0u);
        for (var w = w0; w < w1; w++) {
            let a = fx_add(run, vec2<u32>(part[w * PART], part[w * PART + 1u]));
            let take = crosses && fc == EMPTY && fx_gt(a, u);
            fc = select(fc, w, take);
            fb = select(fb, run, take);
            run = a;
        }
        if fc != EMPTY {
            w_pick[0] = fc;
            w_pick[1] = fb.x;
            w_pick[2] = fb.y;
        }
    }
    workgroupBarrier();

    // that chunk over contiguous per-invocation ranges: masses, exclusive prefix from the
    // chunk's starting mass, then the ranges starting at or below u rescan (the first token
    // whose running mass exceeds u). Written without `break` or a loop under a divergent
    // branch: lavapipe (Mesa 22.3) mis-executes those here.
    let fc = w_pick[0];
    let c0 = select(min(fc, V / CHUNK) * CHUNK, V, fc == EMPTY);
    let c1 = min(c0 + CHUNK, V);
    let r0 = min(c0 + lid * SUB, c1);
    let r1 = min(r0 + SUB, c1);
    let thr = bitcast<f32>(st[S_THR]);
    let m = bitcast<f32>(st[S_M]);
    let tz = bitcast<f32>(w_sp[0]);
    var kloc = vec2<u32>(0u);
    var has_kept = false;
    for (var i = r0; i < r1; i++) {
        let z = lval(i) / tz;
        if z >= thr {
            kloc = fx_add(kloc, fx_from(exp_acc(z - m)));
            has_kept = true;
        }
    }
    sx[lid] = kloc;
    workgroupBarrier();
    if lid == 0u {
        var run = vec2<u32>(w_pick[1], w_pick[2]);
        for (var j = 0u; j < WG; j++) {
            let v = sx[j];
            sx[j] = run;
            run = fx_add(run, v);
        }
    }
    workgroupBarrier();
    let start = sx[lid];
    let u = vec2<u32>(w_pick[3], w_pick[4]);
    let thr2 = bitcast<f32>(st[S_THR]);
    let m2 = bitcast<f32>(st[S_M]);
    let tz2 = bitcast<f32>(w_sp[0]);
    let rescan = has_kept && !fx_gt(start, u);
    var acc = start;
    var found = EMPTY;
    for (var i = r0; i < r1; i++) {
        let z = lval(i) / tz2;
        let take = rescan && z >= thr2 && found == EMPTY;
        acc = select(acc, fx_add(acc, fx_from(exp_acc(z - m2))), take);
        found = select(found, i, take && fx_gt(acc, u));
    }
    let f = min_u(found, lid);
    if lid == 0u {
        let l1 = w_pick[5];
        out[p.row] = select(f, select(l1 - 1u, 0u, l1 == 0u), f == EMPTY);
    }
}
//#endif
