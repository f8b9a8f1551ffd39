//! Audio input for Gemma's audio towers: everything before the tower.
//!
//! * [`load`] reads a clip (WAV through our own reader; FLAC, MP3, OGG/Vorbis through
//!   symphonia), downmixes it to mono and resamples it to the extractor's rate (16 kHz) with
//!   rubato's FFT resampler.
//! * [`FeatureExtractor`] computes the log-mel features, the frame mask and the number of
//!   audio soft tokens exactly as the Gemma 4 and Gemma 3n feature extractors of HF
//!   transformers do, with the settings of the checkpoint's processor config when present.
//! * [`split_clip`] applies the [`LongClips`] policy to clips longer than the model takes.
//! * [`AudioEncoder`] runs Gemma 4's audio tower over the features: the clip's soft tokens.
//!
//! Every failure (unreadable, truncated or corrupt file, unsupported codec, empty clip, NaN
//! samples, a clip beyond the duration limit) is an [`Error::Audio`] naming the file.

mod decode;
pub mod encode;
mod features;
mod resample;
mod wav;

pub use encode::AudioEncoder;
pub use features::{mel_filter_bank, FeatureConfig, FeatureExtractor, Features, Family};
pub use resample::resample;

use crate::Error;

/// A decoded clip before resampling: mono samples at `rate` Hz.
#[derive(Debug, Clone)]
pub struct Decoded {
    /// Mono samples (channels averaged), nominally in [-1, 1].
    pub samples: Vec<f32>,
    /// The file's sample rate in Hz.
    pub rate: u32,
    /// The file's channel count before the downmix.
    pub channels: u16,
}

/// What to do with a clip longer than the extractor's `max_length` samples (30 s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LongClips {
    /// Refuse it with an error saying how long it is and what the limit is.
    #[default]
    Refuse,
    /// Cut it into consecutive pieces of at most `max_length` samples.
    Split,
    /// Keep the first `max_length` samples, as HF's extractors do.
    Truncate,
}

/// How [`load`] reads a file.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// The sample rate to deliver (the extractor's `sampling_rate`).
    pub rate: u32,
    /// Files longer than this many seconds are refused before their samples are read, which
    /// bounds the memory a file can make us take.
    pub max_seconds: f64,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { rate: 16_000, max_seconds: 600.0 }
    }
}

/// Lowest and highest sample rates accepted in a file.
pub const RATE_RANGE: (u32, u32) = (1_000, 768_000);

pub(crate) fn audio_err(msg: String) -> Error {
    Error::Audio(msg)
}

pub(crate) fn check_rate(rate: u32, name: &str) -> Result<(), Error> {
    if rate < RATE_RANGE.0 || rate > RATE_RANGE.1 {
        return Err(audio_err(format!(
            "{name}: unsupported sample rate {rate} Hz (from {} to {} Hz are read)",
            RATE_RANGE.0, RATE_RANGE.1
        )));
    }
    Ok(())
}

pub(crate) fn too_long(name: &str, frames: u64, rate: u32, max_frames: u64) -> Error {
    audio_err(format!(
        "{name}: the clip lasts {:.1} s, longer than the {:.1} s this reader accepts",
        frames as f64 / rate as f64,
        max_frames as f64 / rate as f64
    ))
}

pub(crate) fn max_frames(rate: u32, max_seconds: f64) -> u64 {
    (max_seconds.max(0.0) * rate as f64).floor() as u64
}

/// Decodes a file to mono at its own rate. WAV goes through our reader, everything else
/// through symphonia (FLAC, MP3, OGG/Vorbis).
pub fn decode_file(path: &std::path::Path, max_seconds: f64) -> Result<Decoded, Error> {
    let name = path.display().to_string();
    let mut file = std::fs::File::open(path).map_err(|e| audio_err(format!("{name}: cannot open: {e}")))?;
    let len = file.metadata().map_err(|e| audio_err(format!("{name}: cannot read: {e}")))?.len();
    let mut head = [0u8; 12];
    let n = read_head(&mut file, &mut head).map_err(|e| audio_err(format!("{name}: cannot read: {e}")))?;
    if n == 0 {
        return Err(audio_err(format!("{name}: the file is empty")));
    }
    use std::io::Seek;
    file.rewind().map_err(|e| audio_err(format!("{name}: cannot read: {e}")))?;
    let d = if wav::is_wav(&head[..n]) {
        wav::read(&mut std::io::BufReader::new(file), len, &name, max_seconds)?
    } else {
        decode::read(Box::new(file), path.extension().and_then(|e| e.to_str()), &name, max_seconds)?
    };
    not_empty(d, &name)
}

/// [`decode_file`] of a clip held in memory: `name` stands for it in errors, `ext` (the
/// container's usual file extension: `flac`, `mp3`, `ogg`, `wav`) is a hint to the decoder.
pub fn decode_bytes(bytes: Vec<u8>, ext: &str, name: &str, max_seconds: f64) -> Result<Decoded, Error> {
    if bytes.is_empty() {
        return Err(audio_err(format!("{name}: the clip is empty")));
    }
    let d = if wav::is_wav(&bytes[..bytes.len().min(12)]) {
        let len = bytes.len() as u64;
        wav::read(&mut std::io::Cursor::new(bytes), len, name, max_seconds)?
    } else {
        decode::read(Box::new(std::io::Cursor::new(bytes)), Some(ext), name, max_seconds)?
    };
    not_empty(d, name)
}

fn not_empty(d: Decoded, name: &str) -> Result<Decoded, Error> {
    if d.samples.is_empty() {
        return Err(audio_err(format!("{name}: the clip holds no samples")));
    }
    Ok(d)
}

/// [`load`] of a clip held in memory (see [`decode_bytes`]).
pub fn load_bytes(bytes: Vec<u8>, ext: &str, name: &str, opts: &LoadOptions) -> Result<Vec<f32>, Error> {
    at_rate(decode_bytes(bytes, ext, name, opts.max_seconds)?, opts)
}

fn read_head(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Reads a clip as mono f32 samples at `opts.rate` Hz: decode, downmix, resample.
pub fn load(path: &std::path::Path, opts: &LoadOptions) -> Result<Vec<f32>, Error> {
    at_rate(decode_file(path, opts.max_seconds)?, opts)
}

fn at_rate(d: Decoded, opts: &LoadOptions) -> Result<Vec<f32>, Error> {
    check_rate(opts.rate, "the target rate")?;
    resample(&d.samples, d.rate, opts.rate)
}

/// Applies `policy` to a clip of `samples` for an extractor taking at most `max_length`
/// samples: one piece when it fits, else refused, cut into pieces, or truncated.
pub fn split_clip(samples: &[f32], max_length: usize, rate: u32, policy: LongClips) -> Result<Vec<&[f32]>, Error> {
    if samples.is_empty() {
        return Err(audio_err("the clip holds no samples".into()));
    }
    if max_length == 0 || samples.len() <= max_length {
        return Ok(vec![samples]);
    }
    match policy {
        LongClips::Refuse => Err(audio_err(format!(
            "the clip lasts {:.2} s ({} samples at {rate} Hz); the model takes at most {:.2} s ({max_length} samples): \
             split it or truncate it",
            samples.len() as f64 / rate as f64,
            samples.len(),
            max_length as f64 / rate as f64
        ))),
        LongClips::Split => Ok(samples.chunks(max_length).collect()),
        LongClips::Truncate => Ok(vec![&samples[..max_length]]),
    }
}

/// The `features` command: reads `audio`, extracts its features with the settings of
/// `model` (or `family`'s defaults) and writes them to `out` as `[frames, bins]` f32 .npy
/// (pieces of a split clip to `out` with `.1`, `.2`, ... before the extension). Returns one
/// summary line per piece.
pub fn features_command(
    audio: &std::path::Path,
    out: &std::path::Path,
    model: Option<&std::path::Path>,
    family: &str,
    long: &str,
) -> Result<String, String> {
    let policy = match long {
        "refuse" => LongClips::Refuse,
        "split" => LongClips::Split,
        "truncate" => LongClips::Truncate,
        o => return Err(format!("--long: `{o}` is not refuse, split or truncate")),
    };
    let cfg = match model {
        Some(dir) => FeatureConfig::from_checkpoint(dir)?,
        None => match family {
            "gemma4" => FeatureConfig::defaults(Family::Gemma4),
            "gemma3n" => FeatureConfig::defaults(Family::Gemma3n),
            o => return Err(format!("--family: `{o}` is not gemma4 or gemma3n")),
        },
    };
    let opts = LoadOptions { rate: cfg.sampling_rate, ..LoadOptions::default() };
    let fx = FeatureExtractor::new(cfg)?;
    let samples = load(audio, &opts)?;
    let pieces = fx.extract_clip(&samples, policy)?;
    let mut report = String::new();
    for (i, f) in pieces.iter().enumerate() {
        let path = if i == 0 { out.to_path_buf() } else { out.with_extension(format!("{i}.npy")) };
        crate::cli::write_npy(&path, &[f.frames, f.bins], &f.data)?;
        report += &format!(
            "{}: {} samples, {} frames ({} valid), {} audio soft tokens\n",
            path.display(),
            f.samples,
            f.frames,
            f.mask.iter().filter(|&&v| v).count(),
            f.soft_tokens
        );
    }
    Ok(report)
}
