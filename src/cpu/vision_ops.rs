//! CPU lowering of the vision towers' ops: clamp, 2-D RoPE, bidirectional attention,
//! average pooling over a patch grid, LayerNorm. f32 throughout.

/// `min(max(x, lo), hi)`.
pub fn clamp(x: &[f32], lo: f32, hi: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v.max(lo).min(hi);
    }
}

/// The timescales of 2-D RoPE for head dim `d`: `theta^(4i/d)`, `i < d/4` (as mlx-vlm and HF
/// compute them, in f32: the angle is `pos / timescale`).
pub fn rope_2d_timescales(theta: f32, d: usize) -> Vec<f32> {
    let c = d / 2; // channels per axis
    (0..c / 2).map(|i| theta.powf((2.0 / c as f32) * i as f32)).collect()
}

/// 2-D RoPE of `x: [T, H, D]`: the first half of each head rotates with `px[t]`, the second
/// with `py[t]`, rotate-half pairs inside each half.
pub fn rope_2d(x: &[f32], px: &[u32], py: &[u32], heads: usize, d: usize, theta: f32, out: &mut [f32]) {
    let ts = rope_2d_timescales(theta, d);
    let (c, q) = (d / 2, d / 4);
    for (t, (&ax, &ay)) in px.iter().zip(py).enumerate() {
        for (axis, p) in [ax, ay].into_iter().enumerate() {
            let sc: Vec<(f32, f32)> = ts.iter().map(|&s| (p as f32 / s).sin_cos()).collect();
            for h in 0..heads {
                let b = (t * heads + h) * d + axis * c;
                for (i, &(sn, cs)) in sc.iter().enumerate() {
                    let (a0, a1) = (x[b + i], x[b + i + q]);
                    out[b + i] = a0 * cs - a1 * sn;
                    out[b + i + q] = a1 * cs + a0 * sn;
                }
            }
        }
    }
}

/// Bidirectional attention: every query over every key (`valid[s] == 0` masks key s out).
#[allow(clippy::too_many_arguments)]
pub fn full_attention(q: &[f32], k: &[f32], v: &[f32], valid: Option<&[u32]>, nq: usize, nkv: usize, d: usize, scale: f32, out: &mut [f32]) {
    let t_n = q.len() / (nq * d);
    let s_n = k.len() / (nkv * d);
    let group = nq / nkv;
    let mut sc = vec![0f32; s_n];
    for t in 0..t_n {
        for h in 0..nq {
            let kh = h / group;
            let qv = &q[(t * nq + h) * d..(t * nq + h + 1) * d];
            let mut mx = f32::NEG_INFINITY;
            for (s, sv) in sc.iter_mut().enumerate() {
                if valid.is_some_and(|m| m[s] == 0) {
                    *sv = f32::NEG_INFINITY;
                    continue;
                }
                let kv = &k[(s * nkv + kh) * d..(s * nkv + kh + 1) * d];
                *sv = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
                mx = mx.max(*sv);
            }
            let o = &mut out[(t * nq + h) * d..(t * nq + h + 1) * d];
            o.fill(0.0);
            if mx == f32::NEG_INFINITY {
                continue;
            }
            let mut sum = 0f32;
            for sv in sc.iter_mut() {
                *sv = (*sv - mx).exp();
                sum += *sv;
            }
            for (s, &p) in sc.iter().enumerate() {
                if p == 0.0 {
                    continue;
                }
                let vv = &v[(s * nkv + kh) * d..(s * nkv + kh + 1) * d];
                for (oo, &x) in o.iter_mut().zip(vv) {
                    *oo += p * x;
                }
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// Mean of each `k x k` block of the row-major `rows x cols` grid of `d`-wide rows.
pub fn avg_pool(x: &[f32], rows: usize, cols: usize, k: usize, d: usize, out: &mut [f32]) {
    debug_assert_eq!(x.len(), rows * cols * d);
    let oc = cols / k;
    let inv = 1.0 / (k * k) as f32;
    for (o, orow) in out.chunks_exact_mut(d).enumerate() {
        let (r0, c0) = ((o / oc) * k, (o % oc) * k);
        orow.fill(0.0);
        for r in r0..r0 + k {
            for c in c0..c0 + k {
                let src = &x[(r * cols + c) * d..(r * cols + c + 1) * d];
                orow.iter_mut().zip(src).for_each(|(a, &b)| *a += b);
            }
        }
        orow.iter_mut().for_each(|a| *a *= inv);
    }
}

/// LayerNorm of each `d`-wide row, with weight `w` and optional bias `b`.
pub fn layer_norm(x: &[f32], w: &[f32], b: Option<&[f32]>, d: usize, eps: f32, out: &mut [f32]) {
    for (row, orow) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let r = 1.0 / (var + eps).sqrt();
        for (i, (o, &v)) in orow.iter_mut().zip(row).enumerate() {
            *o = (v - mean) * r * w[i] + b.map_or(0.0, |b| b[i]);
        }
    }
}

/// Rows of `x` (`d` wide) replaced by `rows[src[t] - 1]` where `src[t] > 0`.
pub fn scatter(x: &[f32], rows: &[f32], src: &[u32], d: usize, out: &mut [f32]) -> Result<(), String> {
    let n = rows.len() / d;
    for (t, (o, xr)) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)).enumerate() {
        match src[t] as usize {
            0 => o.copy_from_slice(xr),
            s if s <= n => o.copy_from_slice(&rows[(s - 1) * d..s * d]),
            s => return Err(format!("token {t} takes soft row {} of {n}", s - 1)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_averages_blocks() {
        // 2x4 grid of 1-wide rows, k = 2 -> 1x2
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let mut o = [0.0; 2];
        avg_pool(&x, 2, 4, 2, 1, &mut o);
        assert_eq!(o, [3.5, 5.5]);
    }

    #[test]
    fn masked_keys_are_ignored() {
        let q = [1.0, 0.0];
        let k = [1.0, 0.0, 5.0, 0.0];
        let v = [1.0, 2.0, 100.0, 100.0];
        let mut o = [0.0; 2];
        full_attention(&q, &k, &v, Some(&[1, 0]), 1, 1, 2, 1.0, &mut o);
        assert_eq!(o, [1.0, 2.0]);
        full_attention(&q, &k, &v, Some(&[0, 0]), 1, 1, 2, 1.0, &mut o);
        assert_eq!(o, [0.0, 0.0]);
    }
}
