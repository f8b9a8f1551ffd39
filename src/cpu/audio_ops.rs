//! CPU lowering of the audio tower's ops: the subsampling conv, row masks and strides, GLU,
//! the causal depthwise conv and Gemma 4's local relative-position attention. f32 throughout.

/// Dense 2-D convolution of `x: [h, w, c]` by `wt: [o, kh, kw, c]`, `pad` zeros left and
/// right, `time_pad` zeros above and below, into `out: [ho, wo, o]`.
#[allow(clippy::too_many_arguments)]
pub fn conv2d(x: &[f32], (h, w, c): (usize, usize, usize), wt: &[f32], (o, kh, kw): (usize, usize, usize), stride: usize, pad: usize, time_pad: [usize; 2], out: &mut [f32]) {
    let ho = (h + time_pad[0] + time_pad[1] - kh) / stride + 1;
    let wo = (w + 2 * pad - kw) / stride + 1;
    for ty in 0..ho {
        for tx in 0..wo {
            let dst = &mut out[(ty * wo + tx) * o..(ty * wo + tx + 1) * o];
            dst.fill(0.0);
            for i in 0..kh {
                let Some(y) = (ty * stride + i).checked_sub(time_pad[0]).filter(|&y| y < h) else { continue };
                for j in 0..kw {
                    let Some(xx) = (tx * stride + j).checked_sub(pad).filter(|&xx| xx < w) else { continue };
                    let src = &x[(y * w + xx) * c..(y * w + xx + 1) * c];
                    for (oc, d) in dst.iter_mut().enumerate() {
                        let k = &wt[((oc * kh + i) * kw + j) * c..((oc * kh + i) * kw + j + 1) * c];
                        *d += k.iter().zip(src).map(|(a, b)| a * b).sum::<f32>();
                    }
                }
            }
        }
    }
}

/// Gemma 3n's cumulative group norm of `x: [t, row]` (`row` = F·C values, channel last) by
/// `w: [c]` (see `Op::CumulativeGroupNorm`). Sums in f64 over each row, then in f32 across
/// rows, as the reference's f32 running sums.
pub fn cumulative_group_norm(x: &[f32], row: usize, w: &[f32], eps: f32, out: &mut [f32]) {
    let c = w.len();
    let (mut sum, mut sq) = (0f32, 0f32);
    for (t, (xr, or)) in x.chunks(row).zip(out.chunks_mut(row)).enumerate() {
        let n = ((t + 1) * row) as f32;
        sum += xr.iter().map(|&v| v as f64).sum::<f64>() as f32;
        let mean = sum / n;
        sq += xr.iter().map(|&v| ((v - mean) as f64).powi(2)).sum::<f64>() as f32;
        let inv = 1.0 / (sq / n + eps).sqrt();
        for (i, (o, &v)) in or.iter_mut().zip(xr).enumerate() {
            *o = (v - mean) * inv * w[i % c];
        }
    }
}

/// Rows of `x` (`row` values each) whose `valid` word is 0 set to zero.
pub fn mask_rows(x: &[f32], valid: &[u32], row: usize, out: &mut [f32]) {
    for ((o, s), &v) in out.chunks_mut(row).zip(x.chunks(row)).zip(valid) {
        if v == 0 {
            o.fill(0.0);
        } else {
            o.copy_from_slice(s);
        }
    }
}

/// Rows `0, stride, ..` of `x` (`row` values each).
pub fn strided_rows<V: Copy>(x: &[V], row: usize, stride: usize) -> Vec<V> {
    x.chunks(row).step_by(stride).flatten().copied().collect()
}

/// `a · sigmoid(b)` of the halves of each row of `x` (`2c` values).
pub fn glu(x: &[f32], c: usize, out: &mut [f32]) {
    for (o, r) in out.chunks_mut(c).zip(x.chunks(2 * c)) {
        let (a, b) = r.split_at(c);
        for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
            *o = a / (1.0 + (-b).exp());
        }
    }
}

/// Causal depthwise conv of `x: [t, c]` by `w: [c, k]`.
pub fn depthwise_conv1d(x: &[f32], c: usize, w: &[f32], k: usize, out: &mut [f32]) {
    let t_n = x.len() / c;
    for t in 0..t_n {
        for ch in 0..c {
            let mut s = 0f32;
            for j in 0..k {
                if let Some(src) = (t + j).checked_sub(k - 1) {
                    s += w[ch * k + j] * x[src * c + ch];
                }
            }
            out[t * c + ch] = s;
        }
    }
}

/// The sinusoidal timing signal of relative distance `d` over `channels` (`[sin(d·τ),
/// cos(d·τ)]`, `channels / 2` timescales from 1 to 10⁴, as f32 like the reference).
pub fn timing_signal(d: usize, channels: usize) -> Vec<f32> {
    let n = channels / 2;
    let inc = (10000f32).ln() / (n.max(2) - 1) as f32;
    let scaled: Vec<f32> = (0..n).map(|i| d as f32 * (i as f32 * -inc).exp()).collect();
    scaled.iter().map(|s| s.sin()).chain(scaled.iter().map(|s| s.cos())).collect()
}

/// The local audio attention (see `Op::AudioAttention`). `rel`: `[heads·d, channels]`.
#[allow(clippy::too_many_arguments)]
pub fn audio_attention(q: &[f32], k: &[f32], v: &[f32], valid: &[u32], per_dim_scale: &[f32], rel: &[f32], heads: usize, d: usize, window: usize, softcap: f32, ks: f32, out: &mut [f32]) {
    let t_n = valid.len();
    let hd = heads * d;
    let channels = rel.len() / hd;
    let ln2 = std::f32::consts::LN_2;
    let qs: Vec<f32> = per_dim_scale.iter().map(|&p| (d as f32).powf(-0.5) / ln2 * softplus(p)).collect();
    // R[dist] = rel · sinus(dist), [window, heads·d]
    let r: Vec<f32> = (0..window)
        .flat_map(|dist| {
            let s = timing_signal(dist, channels);
            (0..hd).map(move |o| rel[o * channels..(o + 1) * channels].iter().zip(&s).map(|(a, b)| a * b).sum::<f32>()).collect::<Vec<_>>()
        })
        .collect();
    let mut logits = vec![0f32; window];
    for t in 0..t_n {
        for h in 0..heads {
            let qv: Vec<f32> = q[(t * heads + h) * d..(t * heads + h + 1) * d].iter().zip(&qs).map(|(a, b)| a * b).collect();
            let o = &mut out[(t * heads + h) * d..(t * heads + h + 1) * d];
            o.fill(0.0);
            let mut mx = f32::NEG_INFINITY;
            for (dist, l) in logits.iter_mut().enumerate() {
                *l = f32::NEG_INFINITY;
                let Some(s) = t.checked_sub(dist) else { continue };
                if valid[s] == 0 {
                    continue;
                }
                let kv = &k[(s * heads + h) * d..(s * heads + h + 1) * d];
                let rv = &r[dist * hd + h * d..dist * hd + (h + 1) * d];
                let x: f32 = qv.iter().zip(kv.iter().zip(rv)).map(|(a, (b, c))| a * (b * ks + c)).sum();
                *l = (x / softcap).tanh() * softcap;
                mx = mx.max(*l);
            }
            if mx == f32::NEG_INFINITY {
                continue;
            }
            let mut sum = 0f32;
            for (dist, l) in logits.iter_mut().enumerate() {
                if *l == f32::NEG_INFINITY {
                    continue;
                }
                *l = (*l - mx).exp();
                sum += *l;
                let s = t - dist;
                let vv = &v[(s * heads + h) * d..(s * heads + h + 1) * d];
                for (oo, &x) in o.iter_mut().zip(vv) {
                    *oo += *l * x;
                }
            }
            o.iter_mut().for_each(|x| *x /= sum);
        }
    }
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_rows_keep_every_other_row_and_the_last_odd_one() {
        assert_eq!(strided_rows(&[1u32, 2, 3, 4, 5], 1, 2), vec![1, 3, 5]);
        assert_eq!(strided_rows(&[1.0f32, 2.0, 3.0, 4.0], 2, 2), vec![1.0, 2.0]);
    }

    #[test]
    fn depthwise_conv1d_is_causal() {
        // one channel, kernel [1, 2]: y_t = x_{t-1} + 2 x_t
        let mut out = vec![0.0; 3];
        depthwise_conv1d(&[1.0, 10.0, 100.0], 1, &[1.0, 2.0], 2, &mut out);
        assert_eq!(out, vec![2.0, 21.0, 210.0]);
    }
}
