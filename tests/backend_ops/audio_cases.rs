//! The audio towers' cases of the single-op harness.

use super::*;

/// The audio towers' ops at odd sizes: the subsampling conv (stride 2 with padding, stride 1
/// without, one input channel and several, Gemma 3n's rows padded only below), the cumulative
/// group norm (one row, rows of one channel, large offsets, many rows of 8192 values, 1499
/// rows), row masks of 2-D and 3-D values, strided rows of
/// f32 and u32 values, GLU, the causal depthwise conv (clips shorter than its kernel), and the
/// local attention (windows longer and shorter than the clip, masked keys, a query with no
/// key, relative-position weights float and quantized).
pub(super) fn audio(cs: &mut Cases) {
    let sym = |p: usize| [p, p];
    for (h, w, c, o, k, stride, pad, time_pad) in [
        (9usize, 13usize, 1usize, 5usize, 3usize, 2usize, 1usize, sym(1)),
        (7, 11, 6, 4, 3, 2, 1, sym(1)),
        (5, 6, 3, 3, 2, 1, 0, sym(0)),
        (1, 17, 2, 3, 3, 2, 1, sym(1)),
        (9, 13, 1, 5, 3, 2, 1, [0, 2]),
        (6, 10, 4, 3, 3, 2, 1, [0, 2]),
        (1, 7, 2, 3, 3, 2, 1, [0, 2]),
    ] {
        let desc = format!("x f32[{h}, {w}, {c}] w [{o}, {k}, {k}, {c}] stride {stride} pad {pad} time pad {time_pad:?}");
        cs.add("conv2d", desc, h, MATMUL, |cx| {
            let x = cx.b.act(&[h, w, c], 1.0);
            let wt = cx.b.weight("w", &[o, k, k, c], cx.vec, false);
            (cx.b.op(Op::Conv2d { stride, pad, time_pad }, &[x, wt]), x)
        });
    }
    for (t, f, c, scale) in [(9usize, 7usize, 5usize, 1.0f32), (1, 64, 3, 2.0), (13, 3, 1, 1.0), (40, 32, 8, 8.0), (300, 64, 128, 3.0), (1499, 8, 8, 3.0)] {
        cs.add("cumulative_group_norm", format!("x f32[{t}, {f}, {c}] scale {scale}"), t, NORM, |cx| {
            let x = cx.b.act(&[t, f, c], scale);
            let w = cx.b.weight("norm", &[c], cx.vec, false);
            (cx.b.op(Op::CumulativeGroupNorm { eps: 1e-3 }, &[x, w]), x)
        });
    }
    for shape in [vec![7usize, 45usize], vec![5, 3, 7], vec![1, 1031]] {
        let t = shape[0];
        cs.add("mask_rows", format!("x f32{shape:?} every third row masked"), t, EXACT, |cx| {
            let x = cx.b.act(&shape, 1.0);
            for i in (0..t).step_by(3) {
                cx.tokens[i] = 0;
            }
            (cx.b.op(Op::MaskRows, &[x, cx.b.tokens]), x)
        });
    }
    for (shape, stride) in [(vec![9usize, 13usize], 2usize), (vec![7, 3, 5], 3), (vec![1, 4], 2)] {
        let t = shape[0];
        cs.add("strided_rows", format!("x f32{shape:?} stride {stride}"), t, EXACT, |cx| {
            let x = cx.b.act(&shape, 1.0);
            (cx.b.op(Op::StridedRows { stride }, &[x]), x)
        });
    }
    for t in [11usize, 1] {
        cs.add("strided_rows", format!("ids u32[{t}] stride 2"), t, Check::Exact, |cx| {
            let x = cx.b.act(&[t, 3], 1.0);
            (cx.b.op(Op::StridedRows { stride: 2 }, &[cx.b.tokens]), x)
        });
    }
    for (t, c) in [(5usize, 45usize), (1, 1031), (3, 1)] {
        cs.add("glu", format!("x f32[{t}, {}]", 2 * c), t, TRANSCENDENTAL, |cx| {
            let x = cx.b.act(&[t, 2 * c], 3.0);
            (cx.b.op(Op::Glu, &[x]), x)
        });
    }
    for (t, c, k) in [(9usize, 45usize, 5usize), (3, 77, 5), (13, 1, 2), (1, 7, 1)] {
        cs.add("depthwise_conv1d", format!("x f32[{t}, {c}] w [{c}, {k}, 1]"), t, NORM, |cx| {
            let x = cx.b.act(&[t, c], 2.0);
            let w = cx.b.weight("w", &[c, k, 1], cx.vec, false);
            (cx.b.op(Op::DepthwiseConv1d, &[x, w]), x)
        });
    }
    // (T, heads, D, window, relative-position channels, its format, masked keys, key scale:
    // Gemma 4's, Gemma 3n's none)
    for (t, heads, d, window, ch, fmt, masked, key_scale) in [
        (17usize, 2usize, 24usize, 12usize, 32usize, BF16, true, 1.894_636_1f32),
        (5, 3, 40, 12, 45, F32, false, 1.894_636_1),
        (30, 1, 128, 13, 128, quant(QuantMode::Affine, 4, 64, false), true, 1.0),
        (9, 2, 16, 5, 24, F16, true, 1.894_636_1),
        (27, 2, 24, 13, 48, F32, true, 1.0),
    ] {
        let desc = format!("q f32[{t}, {heads}, {d}] window {window} rel {} [{}, {ch}] masked {masked} key scale {key_scale}", fmt_name(fmt), heads * d);
        cs.add("audio_attention", desc, t, ATTENTION, |cx| {
            let [q, k, v] = [0; 3].map(|_| cx.b.act(&[t, heads, d], 1.0));
            if masked {
                // key 0 masked: query 0 sees no key; every fourth key after it too
                for i in (0..t).step_by(4) {
                    cx.tokens[i] = 0;
                }
            }
            let pds = cx.b.weight("norm0", &[d], cx.vec, false);
            let rel = cx.b.weight("rel", &[heads * d, ch], fmt, true);
            cx.flops = (4 * t * window * heads * d) as f64;
            (cx.b.op(Op::AudioAttention { window, softcap: 3.0, key_scale }, &[q, k, v, cx.b.tokens, pds, rel]), q)
        });
    }
}

/// Gemma 3n's audio tower over a 30 s clip (2997 frames), for the perf mode: the first
/// subsampling conv, its cumulative group norm, and a block's attention (750 rows, 8 heads of
/// 192, window 13).
pub(super) fn audio_perf(cs: &mut Cases) {
    cs.add("conv2d", "perf x f32[2997, 128, 1] w [128, 3, 3, 1] stride 2 time pad [0, 2]".into(), 2997, MATMUL, |cx| {
        let x = cx.b.act(&[2997, 128, 1], 3.0);
        let wt = cx.b.weight("w", &[128, 3, 3, 1], BF16, false);
        cx.flops = 2.0 * (1499 * 64 * 128 * 9) as f64;
        (cx.b.op(Op::Conv2d { stride: 2, pad: 1, time_pad: [0, 2] }, &[x, wt]), x)
    });
    cs.add("cumulative_group_norm", "perf x f32[1499, 64, 128]".into(), 1499, NORM, |cx| {
        let x = cx.b.act(&[1499, 64, 128], 3.0);
        let w = cx.b.weight("norm", &[128], BF16, false);
        (cx.b.op(Op::CumulativeGroupNorm { eps: 1e-3 }, &[x, w]), x)
    });
    cs.add("audio_attention", "perf q f32[750, 8, 192] window 13 rel bf16 [1536, 1536]".into(), 750, ATTENTION, |cx| {
        let [q, k, v] = [0; 3].map(|_| cx.b.act(&[750, 8, 192], 1.0));
        let pds = cx.b.weight("norm0", &[192], BF16, false);
        let rel = cx.b.weight("rel", &[1536, 1536], BF16, true);
        cx.flops = (4 * 750 * 13 * 1536) as f64;
        (cx.b.op(Op::AudioAttention { window: 13, softcap: 50.0, key_scale: 1.0 }, &[q, k, v, cx.b.tokens, pds, rel]), q)
    });
}
