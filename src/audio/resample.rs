//! Sample-rate conversion with rubato's synchronous FFT resampler (a windowed-sinc
//! anti-aliasing filter applied in the frequency domain), in f64.

use rubato::{FftFixedInOut, Resampler};

use super::{audio_err, check_rate};
use crate::Error;

/// Input frames per FFT block (rounded up to a whole number of rate periods by rubato).
/// Longer blocks give a sharper anti-aliasing filter.
const BLOCK: usize = 8192;

/// Resamples mono `samples` from `from` Hz to `to` Hz. The output has
/// `ceil(len · to / from)` samples and is aligned with the input (the resampler's delay is
/// removed). Equal rates return the samples unchanged.
pub fn resample(samples: &[f32], from: u32, to: u32) -> Result<Vec<f32>, Error> {
    check_rate(from, "the input rate")?;
    check_rate(to, "the target rate")?;
    if from == to || samples.is_empty() {
        return Ok(samples.to_vec());
    }
    let err = |e: &dyn std::fmt::Display| audio_err(format!("resampling {from} Hz to {to} Hz: {e}"));
    // The anti-aliasing filter is centred on input sample `block / 2`. Its delay is a whole
    // number of output samples only when `block` is an even number of rate periods (an odd
    // block would leave a fraction of a sample of shift in the output), so ask for one.
    let period = from as usize / gcd(from as usize, to as usize);
    let periods = BLOCK.div_ceil(period).next_multiple_of(2);
    let mut r = FftFixedInOut::<f64>::new(from as usize, to as usize, periods * period, 1).map_err(|e| err(&e))?;
    let block = r.input_frames_next();
    if block % 2 != 0 || !(block / 2 * to as usize).is_multiple_of(from as usize) {
        return Err(err(&format!("block of {block} samples has no whole-sample delay")));
    }
    let delay = block / 2 * to as usize / from as usize;
    let want = ((samples.len() as u128 * to as u128).div_ceil(from as u128)) as usize;
    let mut out: Vec<f64> = Vec::with_capacity(want + delay + r.output_frames_max());
    let mut chunk = vec![vec![0.0f64; block]];
    let mut wave_out = r.output_buffer_allocate(true);
    let mut pos = 0usize;
    while out.len() < want + delay {
        let c = &mut chunk[0];
        c.fill(0.0);
        if pos < samples.len() {
            let end = (pos + block).min(samples.len());
            for (d, &s) in c.iter_mut().zip(&samples[pos..end]) {
                *d = s as f64;
            }
        }
        pos += block;
        let (_, n) = r.process_into_buffer(&chunk, &mut wave_out, None).map_err(|e| err(&e))?;
        out.extend_from_slice(&wave_out[0][..n]);
    }
    Ok(out[delay..delay + want].iter().map(|&v| v as f32).collect())
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
