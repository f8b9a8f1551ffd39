// The vision towers' bidirectional attention (Op::FullAttention) on f16 tiles: a flash
// attention whose two products, S = Q K^T and O += P V, run on cooperative matrices (COOP:
// 16 x 16 x 16, f16 inputs, f32 accumulators), with the scores' online softmax in f32.
//
// Without COOP, the twin: the same tiling, staging, scaling, softmax, rescaling and epilogue,
// with a plain FMA loop in place of coopMultiplyAdd (each invocation holds the elements of a
// 16 x 16 result that a subgroup of 32 would hand it through workgroup memory: row l / 2,
// columns 8 (l % 2) .. + 8), so that adapters without cooperative matrices (and CI's software
// rasterizer) run and check everything but the products themselves.
//
// q [T, H, D], k and v [S, KVH, D] (head h reads kv head h / (H / KVH)), out [T, H, D]; keys
// whose valid word is 0 (MASK) get no weight; a query without any valid key gets zeros.
//
// Tiling: a workgroup of 128 invocations (4 groups of 32, a subgroup each under COOP) takes
// QT = 64 queries of one head; group g owns queries 16 g .. + 16. The keys go by in tiles of KT
// (32, or 16 where workgroup memory is short), staged in workgroup memory as f16. The head dim
// is padded with zeros to DP = 16 D16. Per key tile, each group computes its 16 x KT scores
// (KB = KT / 16 results, D16 steps each), stores them to workgroup memory, runs the online
// softmax on them (two invocations per query, each taking half of the keys' weights; both find
// the row's maximum), writes the weights P as f16 and adds P V (D16 results of 16 x 16, kept in
// accumulators across the tiles). The queries are staged once per workgroup (their hi parts,
// then their lo parts, through the same rows) and held in registers (COOP: 2 D16 matrices).
//
// Lazy rescaling: a query's weights are exp2(s - m) for a running maximum m that moves only
// when a tile's maximum passes it by more than TAU (log2 units), so that the weights stay
// under 2^TAU. Only then does the workgroup rescale its O accumulators (through workgroup
// memory, one 16 x 16 at a time): after the first tiles of a row that is rare.
//
// Precision: scores carry about f32's accuracy at any magnitude: each query row and key row is
// scaled by a power of two that brings its largest |value| into [2^6, 2^7) (exact; the scale
// goes back on the f32 score), then split into hi (x rounded to f16's 11 significant bits by
// its bits: hi4, so that no compiler can fold the round trip through f16 away) and
// lo = f16(x - hi), and the three products hi hi, hi lo, lo hi are summed (about 22 significant bits). The weights P (at most
// 2^TAU) and V go as hi + lo pairs with HILO_P and HILO_V, else as one f16 each. V rows past
// 2^15 are scaled down by a power of two that rides on their weights (so |v| up to about 4e6).
// The softmax, its sums and the epilogue are f32.
//
// Workgroup memory: one f16 buffer holds K (hi, lo) while the scores are computed, then V (hi,
// lo), staged during the softmax; behind it each group's P (hi, lo). With the scores (f32) that
// is just under 32 KiB at DP = 80 and KT = 32 (38 KiB at DP = 128; 24 KiB with KT = 16).
//
// Barriers per key tile: four, and a fifth in the uniform load (the keys' maxima seen and the
// previous products done; K staged; scores stored; weights and V stored, then the rescaling
// decision read uniformly). The next tile's K and V are loaded into registers after the P V
// products (PF: before them, in flight during them: 2 D16 more vec4 registers) and reduced to
// per-key maxima before the next tile's first barrier; V is read again when it is staged.
//
// COOP_QK, COOP_PV (with COOP; both by default): which product runs on cooperative matrices; the
// other takes the twin's FMA loop in the same kernel (same staging, same workgroup memory), so
// that one run tells a wrong product from a wrong rest.
//
// Cooperative-matrix conventions (those of gemm_coop.wgsl): coopLoadT loads row-major,
// coopLoad column-major, coopStoreT stores row-major; on the arrays of vec4<f16> the pointer
// and the stride count vec4s. A is M x K (queries x d for S, queries x keys for P V), B is K x N
// (d x keys: K staged [key][d], column-major; keys x d: V staged [key][d], row-major), C is
// M x N. Every coop op runs in workgroup-uniform control flow (group g is subgroup g), and a
// barrier separates plain stores from coop loads of the same memory and coop stores from plain
// loads (the uniform load of the rescaling flag is one: it orders P's and V's stores before
// their coop loads).
//
// Prelude consts: QT, KT, KB, KH (KT / 2), D16, HS (the f16 buffer's length). Flags: COOP,
// COOP_QK, COOP_PV, MASK, HILO_P, HILO_V, V4 (D a multiple of 4: vec4 loads), PF.
// Bindings: 0 params (vision.wgsl's), 1 q, 2 out, 3 k, 4 v, 5 valid (MASK).
enable f16;
//#if COOP
enable wgpu_cooperative_matrix;
//#endif

struct Params {
    n: u32,     // rows of q: T * heads
    heads: u32,
    kv: u32,    // kv heads
    s: u32,     // keys
    d: u32,     // head dim
    cols: u32,
    k: u32,
    _p0: u32,
    f: f32,     // scale
    _p1: u32,
    _p2: u32,
    _p3: u32,
    ts: array<vec4<f32>, 64>,
}

@group(0) @binding(0) var<uniform> p: Params;
//#if V4
@group(0) @binding(1) var<storage, read> qq: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> kk: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> vv: array<vec4<f32>>;
//#else
@group(0) @binding(1) var<storage, read> qq: array<f32>;
@group(0) @binding(3) var<storage, read> kk: array<f32>;
@group(0) @binding(4) var<storage, read> vv: array<f32>;
//#endif
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
//#if MASK
@group(0) @binding(5) var<storage, read> valid: array<u32>;
//#endif

const WG: u32 = 128u;
const NL: u32 = 4u * KT;      // K and V loaders: four invocations per key, vec4 columns lq + 4 c
const DP: u32 = 16u * D16;    // head dim padded
const LD: u32 = DP + 8u;      // f16 per staged row of Q, K, V (padded by 8: no bank twice per load)
const LDP: u32 = KT + 8u;     // f16 per staged row of P
const LDS: u32 = 36u;         // f32 per row of scores (KT of them, or two 16 x 16 slots)
// the f16 buffer: K hi and lo rows, then V's in their place; behind them each group's P (hi rows,
// then lo rows); the queries' hi, then lo parts while they are staged
const KLO: u32 = KT * LD;
//#if VT
// VT: V staged transposed, [d][key] (rows of LDV f16; lo rows from VLO on), in K's place: the
// P V product loads it column-major, as the GEMM loads its weights
const LDV: u32 = KT + 8u;
const VLO: u32 = DP * LDV;
const PHI: u32 = max(2u * KT * LD, 2u * DP * LDV);
//#else
const PHI: u32 = 2u * KT * LD;
//#endif
//#if HILO_P
const PG: u32 = 32u * LDP;
//#else
const PG: u32 = 16u * LDP;
//#endif
const TAU: f32 = 8.0;
const NEG_BIG: f32 = -3.0e38;
const LOG2E: f32 = 1.4426950408889634;

var<workgroup> hs: array<vec4<f16>, HS / 4u>;
// each group's 16 rows of scores (and its 16 x 16 results on their way through, in two slots)
var<workgroup> ss: array<f32, 64u * LDS>;
// per-invocation maxima of the staged values (K's and Q's, V's), then the row sums' halves
var<workgroup> kpart: array<f32, WG>;
var<workgroup> vpart: array<f32, WG>;
// per key of the tile: the score factor (its scale; -1: no weight), the weight factor (V's scale)
var<workgroup> kf: array<f32, KT>;
var<workgroup> vf: array<f32, KT>;
// per query: its scale, its rescaling factor this tile
var<workgroup> sq: array<f32, QT>;
var<workgroup> cor: array<f32, QT>;
// set where some query of the tile rescales (x). A vec4, so that every workgroup variable is a
// multiple of 16 bytes: declared as a lone u32, an H100 stored the cooperative matrices one
// element early into the score rows (each score became the next key's).
var<workgroup> flag: vec4<u32>;

// 2^e (e within f32's normal exponents)
fn pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(clamp(e + 127, 1, 254)) << 23u);
}

// e with m in [2^e, 2^(e+1)) (-127 for 0)
fn expo(m: f32) -> i32 {
    return i32((bitcast<u32>(m) >> 23u) & 0xffu) - 127;
}

// The exponent of the power of two that brings a largest |value| m into [2^6, 2^7).
fn up_exp(m: f32) -> i32 {
    return clamp(6 - expo(m), -126, 126);
}

fn vmax4(m: f32, v: vec4<f32>) -> f32 {
    let a = abs(v);
    return max(m, max(max(a.x, a.y), max(a.z, a.w)));
}

// The inputs load_in reads.
const IN_Q: u32 = 0u;
const IN_K: u32 = 1u;
const IN_V: u32 = 2u;

// Elements 4 c .. 4 c + 3 of row `row` of the [rows, D] input `which` (IN_Q, IN_K or IN_V; zeros
// past D).
fn load_in(which: u32, row: u32, c: u32) -> vec4<f32> {
//#if V4
    if 4u * c >= p.d {
        return vec4<f32>(0.0);
    }
    let i = row * (p.d / 4u) + c;
    switch which {
        case IN_Q: {
            return qq[i];
        }
        case IN_K: {
            return kk[i];
        }
        default: {
            return vv[i];
        }
    }
//#else
    var r = vec4<f32>(0.0);
    for (var e = 0u; e < 4u; e++) {
        if 4u * c + e < p.d {
            let i = row * p.d + 4u * c + e;
            switch which {
                case IN_Q: {
                    r[e] = qq[i];
                }
                case IN_K: {
                    r[e] = kk[i];
                }
                default: {
                    r[e] = vv[i];
                }
            }
        }
    }
    return r;
//#endif
}

// x as hi + lo f16 parts: hi from hi4 (exact in f16's normal range), lo = f16(x - hi) with hi
// as converted, so that where hi is an f16 subnormal (|x| < 2^-14) lo takes what its
// conversion dropped, and past f16's range hi is infinite as f16(x) would be.
struct HiLo {
    h: vec4<f16>,
    l: vec4<f16>,
}

fn split(x: vec4<f32>) -> HiLo {
    let h = vec4<f16>(hi4(x));
    return HiLo(h, vec4<f16>(x - vec4<f32>(h)));
}

// Stores x as hi (at f16 index i) and lo (at i + lo_off) parts.
fn put_hilo(i: u32, lo_off: u32, x: vec4<f32>) {
    let hl = split(x);
    hs[i / 4u] = hl.h;
    hs[(i + lo_off) / 4u] = hl.l;
}

// Stages the query row qi's vec4 columns hh, hh + 2, .. (row `row` of q, times `mul`; zeros where
// !ok): their hi parts, or with `lo` their lo parts.
fn stage_q(qi: u32, hh: u32, ok: bool, row: u32, mul: f32, lo: bool) {
    for (var c = hh; c < DP / 4u; c += 2u) {
        var x = vec4<f32>(0.0);
        if ok {
            x = load_in(IN_Q, row, c) * mul;
        }
        let hl = split(x);
        hs[(qi * LD + 4u * c) / 4u] = select(hl.h, hl.l, lo);
    }
}

// A key tile's K and V on their way from memory (a loader's vec4 columns lq + 4 c of its key):
// K until it is staged, V until its maxima are taken (it is read again when it is staged).
struct Keys {
    k: array<vec4<f32>, D16>,
    v: array<vec4<f32>, D16>,
}

// Loads key s of kv head kh (zeros past the keys, or where !loader).
fn load_keys(s: u32, kh: u32, lq: u32, loader: bool) -> Keys {
    var r: Keys;
    let ok = loader && s < p.s;
    let row = s * p.kv + kh;
//#repeat D16 c
    r.k[$cu] = vec4<f32>(0.0);
    r.v[$cu] = vec4<f32>(0.0);
    if ok {
        r.k[$cu] = load_in(IN_K, row, lq + 4u * $cu);
        r.v[$cu] = load_in(IN_V, row, lq + 4u * $cu);
    }
//#endrepeat
    return r;
}

// The loader's largest |K| and |V| of `keys`, to kpart and vpart.
fn put_maxima(keys: Keys, lid: u32) {
    var km = 0.0;
    var vm = 0.0;
//#repeat D16 c
    km = vmax4(km, keys.k[$cu]);
    vm = vmax4(vm, keys.v[$cu]);
//#endrepeat
    kpart[lid] = km;
    vpart[lid] = vm;
}

// Multiplies the 16 x 16 in slot `slot` of group g's rows by the queries' rescaling factors:
// lane l takes row l / 2, columns 8 (l % 2) .. + 8.
fn rescale_slot(g: u32, l: u32, slot: u32) {
    let r = 16u * g + l / 2u;
    let b = r * LDS + 16u * slot + 8u * (l % 2u);
    let c = cor[r];
    for (var e = 0u; e < 8u; e++) {
        ss[b + e] *= c;
    }
}

// DUMP_S (a diagnostic, for heads of at least KT dims): see the scores' section; DUMP_G (with
// COOP_QK): the products' scores stored into the output rows directly.
//
// SGB (a diagnostic, with COOP): a subgroup barrier before each run of cooperative-matrix
// operations, so that a subgroup's invocations enter them together after divergent code.
fn converge() {
//#if SGB
    subgroupBarrier();
//#endif
}

//#if !COOP_QK || !COOP_PV
// The twin's staged f16 elements, by index.
fn h16(i: u32) -> f32 {
    return f32(hs[i >> 2u][i & 3u]);
}
//#endif

@compute @workgroup_size(128)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let group = p.heads / p.kv;
    let nt = p.n / p.heads;                // queries
    let nqt = (nt + QT - 1u) / QT;         // query tiles per head
    let ntiles = nqt * p.heads;
    let nkt = (p.s + KT - 1u) / KT;        // key tiles
    let g = lid / 32u;      // group: a subgroup under COOP
    let l = lid % 32u;      // lane in the group
    let r = l / 2u;         // the lane's row in the group's 16 (softmax, twin results, epilogue)
    let ti = 16u * g + r;   // ... in the tile
    let hh = l % 2u;        // which half of the row's keys and columns
    // K and V loader (lid < NL): key lj of the tile, vec4 columns lq + 4 c
    let loader = lid < NL;
    let lj = lid / 4u;
    let lq = lid % 4u;
    // workgroup tiles head by head (a head's keys stay in cache for its query tiles)
    for (var wt = wid.y * nwg.x + wid.x; wt < ntiles; wt += nwg.x * nwg.y) {
        let h = wt / nqt;
        let t0 = (wt % nqt) * QT;
        let kh = h / group;

        // ---- the queries: row lid / 2 takes vec4 columns lid % 2, + 2, ..; scaled, then split
        let qi = lid / 2u;
        let qok = t0 + qi < nt;
        let qrow = (t0 + qi) * p.heads + h;
        var qm = 0.0;
        if qok {
            for (var c = hh; c < DP / 4u; c += 2u) {
                qm = vmax4(qm, load_in(IN_Q, qrow, c));
            }
        }
        kpart[lid] = qm;
        workgroupBarrier();
        let qe = up_exp(max(kpart[2u * qi], kpart[2u * qi + 1u]));
        if hh == 0u {
            sq[qi] = pow2(-qe);
        }
        stage_q(qi, hh, qok, qrow, pow2(qe), false);
        workgroupBarrier();
        // each group's queries, held across the key tiles: hi parts, then lo parts
        converge();
//#if COOP_QK
//#repeat D16 s
        let qh$s = coopLoadT<coop_mat16x16<f16, A>>(&hs[(16u * g * LD + 16u * $su) / 4u], LD / 4u);
//#endrepeat
//#else
        var qh: array<f32, DP>;
        var ql: array<f32, DP>;
        for (var d = 0u; d < DP; d++) {
            qh[d] = h16(ti * LD + d);
        }
//#endif
        workgroupBarrier();
        stage_q(qi, hh, qok, qrow, pow2(qe), true);
        workgroupBarrier();
        converge();
//#if COOP_QK
//#repeat D16 s
        let ql$s = coopLoadT<coop_mat16x16<f16, A>>(&hs[(16u * g * LD + 16u * $su) / 4u], LD / 4u);
//#endrepeat
//#else
        for (var d = 0u; d < DP; d++) {
            ql[d] = h16(ti * LD + d);
        }
//#endif
//#if COOP_PV
//#repeat D16 n
        var o$n = coop_mat16x16<f32, C>();
//#endrepeat
//#else
        // results n: row r, columns 16 n + 8 hh + j at 8 n + j
        var o: array<f32, 8u * D16>;
        for (var j = 0u; j < 8u * D16; j++) {
            o[j] = 0.0;
        }
//#endif
        let qf = sq[ti] * p.f * LOG2E;  // the row's score factor (log2 units)
        var m_run = NEG_BIG;            // the row's running maximum
        var l_run = 0.0;                // this invocation's half of the row's sum

        // ---- the first key tile into registers, its maxima (the queries' are read)
        var keys = load_keys(lj, kh, lq, loader);
        if loader {
            put_maxima(keys, lid);
        }

        for (var t = 0u; t < nkt; t++) {
            let s0 = t * KT;
            let ks = s0 + lj;   // the loader's key
            // the tile's maxima are seen; the previous tile's products are done with the buffers
            // (and every group holds its queries)
            workgroupBarrier();
            // ---- stage K: key lj scaled and split; the keys' factors
            if loader {
                let b4 = 4u * lj;
                let kmax = max(max(kpart[b4], kpart[b4 + 1u]), max(kpart[b4 + 2u], kpart[b4 + 3u]));
                let vmax = max(max(vpart[b4], vpart[b4 + 1u]), max(vpart[b4 + 2u], vpart[b4 + 3u]));
                let ke = up_exp(kmax);
                if lq == 0u {
                    var ok = ks < p.s;
//#if MASK
                    if ok {
                        ok = valid[ks] != 0u;
                    }
//#endif
                    kf[lj] = select(-1.0, pow2(-ke), ok);
                    vf[lj] = pow2(max(expo(vmax) - 14, 0));
                }
                let kmul = pow2(ke);
//#repeat D16 c
                put_hilo(lj * LD + 4u * (lq + 4u * $cu), KLO, keys.k[$cu] * kmul);
//#endrepeat
            }
            if lid == 0u {
                flag.x = 0u;
            }
            workgroupBarrier();

            // ---- scores: the group's 16 queries x KT keys, to ss
            converge();
//#if COOP_QK
//#repeat KB b
            var sc$b = coop_mat16x16<f32, C>();
//#endrepeat
//#repeat D16 s
//#repeat KB b
            {
                let kb = coopLoad<coop_mat16x16<f16, B>>(&hs[(16u * $bu * LD + 16u * $su) / 4u], LD / 4u);
                let kl = coopLoad<coop_mat16x16<f16, B>>(&hs[(KLO + 16u * $bu * LD + 16u * $su) / 4u], LD / 4u);
                sc$b = coopMultiplyAdd(qh$s, kb, sc$b);
                sc$b = coopMultiplyAdd(qh$s, kl, sc$b);
                sc$b = coopMultiplyAdd(ql$s, kb, sc$b);
            }
//#endrepeat
//#endrepeat
//#if DUMP_G
            // a diagnostic: the scores straight into the output rows (whole query tiles only;
            // the indices bound first: naga 30's SPIR-V writer needs them emitted)
            let gs = p.heads * p.d;
            let gb = ((t0 + 16u * g) * p.heads + h) * p.d;
//#repeat KB b
            let gi$b = gb + 16u * $bu;
            coopStoreT(sc$b, &out[gi$b], gs);
//#endrepeat
            return;
//#else
//#repeat KB b
            coopStoreT(sc$b, &ss[16u * g * LDS + 16u * $bu], LDS);
//#endrepeat
//#endif
//#else
            for (var b = 0u; b < KB; b++) {
                for (var j = 0u; j < 8u; j++) {
                    let key = 16u * b + 8u * hh + j;
                    var acc = 0.0;
                    for (var d = 0u; d < DP; d++) {
                        let kb = h16(key * LD + d);
                        acc = fma(qh[d], kb, acc);
                        acc = fma(qh[d], h16(KLO + key * LD + d), acc);
                        acc = fma(ql[d], kb, acc);
                    }
                    ss[ti * LDS + key] = acc;
                }
            }
//#endif
            workgroupBarrier();
//#if DUMP_S
            // a diagnostic: the first key tile's scores (the scaled queries' rows times the scaled
            // keys': before the score factors) over the first KT columns of each query's output
            // row, and nothing else
            if hh == 0u && t0 + ti < nt {
                for (var j = 0u; j < KT; j++) {
                    out[((t0 + ti) * p.heads + h) * p.d + j] = ss[ti * LDS + j];
                }
            }
            return;
//#endif

            // ---- V's loads (staged after the softmax, in K's place)
            let vrow = ks * p.kv + kh;
            let vok = loader && ks < p.s;
//#repeat D16 c
            var v$c = vec4<f32>(0.0);
            if vok {
                v$c = load_in(IN_V, vrow, lq + 4u * $cu);
            }
//#endrepeat

            // ---- online softmax of row ti: both invocations of the row find its maximum, each
            // writes the weights of half of the keys
            {
                let rb = ti * LDS;
                var mt = NEG_BIG;
                for (var j = 0u; j < KT; j++) {
                    let f = kf[j];
                    if f > 0.0 {
                        mt = max(mt, ss[rb + j] * qf * f);
                    }
                }
                var corr = 1.0;
                if mt > NEG_BIG {
                    if m_run == NEG_BIG {
                        // nothing weighed yet: O is zero
                        m_run = mt;
                    } else if mt > m_run + TAU {
                        corr = exp2(m_run - mt);
                        m_run = mt;
                        l_run *= corr;
                        flag.x = 1u;
                    }
                }
                if hh == 0u {
                    cor[ti] = corr;
                }
                let pb = PHI + g * PG + r * LDP + KH * hh;
                for (var j4 = 0u; j4 < KH / 4u; j4++) {
                    var pv = vec4<f32>(0.0);
                    for (var e = 0u; e < 4u; e++) {
                        let j = KH * hh + 4u * j4 + e;
                        let f = kf[j];
                        if f > 0.0 && m_run > NEG_BIG {
                            let w = exp2(ss[rb + j] * qf * f - m_run);
                            l_run += w;
                            pv[e] = w * vf[j];
                        }
                    }
//#if HILO_P
                    put_hilo(pb + 4u * j4, 16u * LDP, pv);
//#else
                    hs[(pb + 4u * j4) / 4u] = vec4<f16>(pv);
//#endif
                }
            }
            // ---- stage V: key lj scaled down past 2^15 (by its weights' factor)
            if loader {
                let vmul = 1.0 / vf[lj];
//#repeat D16 c
//#if VT
                {
                    // key lj's four dims of this column, each in its dim's row
                    let hl = split(v$c * vmul);
                    let i0 = 4u * (lq + 4u * $cu) * LDV + lj;
                    for (var e = 0u; e < 4u; e++) {
                        let i = i0 + e * LDV;
                        hs[i / 4u][i % 4u] = hl.h[e];
//#if HILO_V
                        hs[(VLO + i) / 4u][i % 4u] = hl.l[e];
//#endif
                    }
                }
//#elif HILO_V
                put_hilo(lj * LD + 4u * (lq + 4u * $cu), KLO, v$c * vmul);
//#else
                hs[(lj * LD + 4u * (lq + 4u * $cu)) / 4u] = vec4<f16>(v$c * vmul);
//#endif
//#endrepeat
            }
            // the weights and V are stored; whether any row rescales
            let need = workgroupUniformLoad(&flag).x;
            if need != 0u {
                // O's rows times their factors, one 16 x 16 at a time through slot n % 2
                converge();
//#if COOP_PV
//#repeat D16 n
                coopStoreT(o$n, &ss[16u * g * LDS + 16u * ($nu % 2u)], LDS);
                workgroupBarrier();
                rescale_slot(g, l, $nu % 2u);
                workgroupBarrier();
                o$n = coopLoadT<coop_mat16x16<f32, C>>(&ss[16u * g * LDS + 16u * ($nu % 2u)], LDS);
//#endrepeat
//#else
                for (var n = 0u; n < D16; n++) {
                    let sb = ti * LDS + 16u * (n % 2u) + 8u * hh;
                    for (var j = 0u; j < 8u; j++) {
                        ss[sb + j] = o[8u * n + j];
                    }
                    workgroupBarrier();
                    rescale_slot(g, l, n % 2u);
                    workgroupBarrier();
                    for (var j = 0u; j < 8u; j++) {
                        o[8u * n + j] = ss[sb + j];
                    }
                }
//#endif
            }

            // ---- (PF: the next tile's loads in flight during the products)
            let more = t + 1u < nkt;
//#if PF
            if more {
                keys = load_keys(s0 + KT + lj, kh, lq, loader);
            }
//#endif
            // ---- O += P V
            let pg = PHI + g * PG;
            converge();
//#if COOP_PV
//#repeat KB j
            let ph$j = coopLoadT<coop_mat16x16<f16, A>>(&hs[(pg + 16u * $ju) / 4u], LDP / 4u);
//#if HILO_P
            let pl$j = coopLoadT<coop_mat16x16<f16, A>>(&hs[(pg + 16u * LDP + 16u * $ju) / 4u], LDP / 4u);
//#endif
//#endrepeat
//#repeat D16 n
//#repeat KB j
            {
//#if VT
                let vb = coopLoad<coop_mat16x16<f16, B>>(&hs[(16u * $nu * LDV + 16u * $ju) / 4u], LDV / 4u);
//#else
                let vb = coopLoadT<coop_mat16x16<f16, B>>(&hs[(16u * $ju * LD + 16u * $nu) / 4u], LD / 4u);
//#endif
                o$n = coopMultiplyAdd(ph$j, vb, o$n);
//#if HILO_V
//#if VT
                let vl = coopLoad<coop_mat16x16<f16, B>>(&hs[(VLO + 16u * $nu * LDV + 16u * $ju) / 4u], LDV / 4u);
//#else
                let vl = coopLoadT<coop_mat16x16<f16, B>>(&hs[(KLO + 16u * $ju * LD + 16u * $nu) / 4u], LD / 4u);
//#endif
                o$n = coopMultiplyAdd(ph$j, vl, o$n);
//#endif
//#if HILO_P
                o$n = coopMultiplyAdd(pl$j, vb, o$n);
//#endif
            }
//#endrepeat
//#endrepeat
//#else
            for (var key = 0u; key < KT; key++) {
                let ph = h16(pg + r * LDP + key);
//#if HILO_P
                let pl = h16(pg + 16u * LDP + r * LDP + key);
//#endif
                for (var n = 0u; n < D16; n++) {
                    for (var j = 0u; j < 8u; j++) {
                        let col = 16u * n + 8u * hh + j;
//#if VT
                        let vi = col * LDV + key;
                        let vlo = VLO;
//#else
                        let vi = key * LD + col;
                        let vlo = KLO;
//#endif
                        let vb = h16(vi);
                        var a = o[8u * n + j];
                        a = fma(ph, vb, a);
//#if HILO_V
                        a = fma(ph, h16(vlo + vi), a);
//#endif
//#if HILO_P
                        a = fma(pl, vb, a);
//#endif
                        o[8u * n + j] = a;
                    }
                }
            }
//#endif

            // ---- the next tile into registers, its maxima
//#if !PF
            if more {
                keys = load_keys(s0 + KT + lj, kh, lq, loader);
            }
//#endif
            if more && loader {
                put_maxima(keys, lid);
            }
        }

        // ---- epilogue: O / (the row's sum), one 16 x 16 at a time through slot n % 2
        kpart[lid] = l_run;
        workgroupBarrier();
        let lsum = kpart[lid] + kpart[lid ^ 1u];
        let inv = select(0.0, 1.0 / lsum, lsum > 0.0);
        let sb = ti * LDS + 8u * hh;
        let ob = (t0 + ti) * p.heads + h;
        converge();
//#if COOP_PV
//#repeat D16 n
        coopStoreT(o$n, &ss[16u * g * LDS + 16u * ($nu % 2u)], LDS);
        workgroupBarrier();
        if t0 + ti < nt {
            for (var j = 0u; j < 8u; j++) {
                let col = 16u * $nu + 8u * hh + j;
                if col < p.d {
                    out[ob * p.d + col] = ss[sb + 16u * ($nu % 2u) + j] * inv;
                }
            }
        }
        workgroupBarrier();
//#endrepeat
//#else
        for (var n = 0u; n < D16; n++) {
            for (var j = 0u; j < 8u; j++) {
                ss[sb + 16u * (n % 2u) + j] = o[8u * n + j];
            }
            workgroupBarrier();
            if t0 + ti < nt {
                for (var j = 0u; j < 8u; j++) {
                    let col = 16u * n + 8u * hh + j;
                    if col < p.d {
                        out[ob * p.d + col] = ss[sb + 16u * (n % 2u) + j] * inv;
                    }
                }
            }
            workgroupBarrier();
        }
//#endif
    }
}
