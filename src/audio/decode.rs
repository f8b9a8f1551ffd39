//! Compressed and other container formats through symphonia: FLAC, MP3, OGG/Vorbis (and
//! the WAV variants our own reader leaves alone).

use symphonia::core::audio::SampleBuffer;
use symphonia::core::codecs::{DecoderOptions, CODEC_TYPE_NULL};
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::FormatOptions;
use symphonia::core::io::{MediaSource, MediaSourceStream};
use symphonia::core::meta::MetadataOptions;
use symphonia::core::probe::Hint;

use super::{audio_err, check_rate, max_frames, too_long, Decoded};
use crate::Error;

fn describe(name: &str, e: SymError) -> Error {
    match e {
        SymError::Unsupported(what) => audio_err(format!(
            "{name}: unsupported audio format or codec ({what}); WAV, FLAC, MP3 and OGG/Vorbis are read"
        )),
        SymError::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            audio_err(format!("{name}: the file is truncated"))
        }
        SymError::IoError(io) => audio_err(format!("{name}: cannot read: {io}")),
        SymError::DecodeError(what) => audio_err(format!("{name}: corrupt audio data ({what})")),
        SymError::LimitError(what) => audio_err(format!("{name}: the stream exceeds a decoder limit ({what})")),
        SymError::SeekError(_) | SymError::ResetRequired => {
            audio_err(format!("{name}: the stream changes its parameters mid-way, which is not supported"))
        }
    }
}

/// Decodes the first audio track of `source` (a file or bytes; `ext`: the container's usual
/// file extension, a hint) to mono f32 at the stream's rate. A panic inside the decoder on a
/// malformed stream is turned into an error.
pub(crate) fn read(source: Box<dyn MediaSource>, ext: Option<&str>, name: &str, max_seconds: f64) -> Result<Decoded, Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read_stream(source, ext, name, max_seconds)))
        .unwrap_or_else(|_| Err(audio_err(format!("{name}: corrupt audio data (the decoder failed on it)"))))
}

fn read_stream(source: Box<dyn MediaSource>, ext: Option<&str>, name: &str, max_seconds: f64) -> Result<Decoded, Error> {
    let mut hint = Hint::new();
    if let Some(ext) = ext {
        hint.with_extension(ext);
    }
    let mss = MediaSourceStream::new(source, Default::default());
    let probed = symphonia::default::get_probe()
        .format(&hint, mss, &FormatOptions { enable_gapless: true, ..Default::default() }, &MetadataOptions::default())
        .map_err(|e| match e {
            SymError::Unsupported(_) => audio_err(format!(
                "{name}: not a recognised audio file (WAV, FLAC, MP3 and OGG/Vorbis are read)"
            )),
            e => describe(name, e),
        })?;
    let mut format = probed.format;
    let track = format
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or_else(|| audio_err(format!("{name}: the file holds no audio track")))?;
    let track_id = track.id;
    let params = track.codec_params.clone();
    let mut rate = params.sample_rate;
    if let Some(r) = rate {
        check_rate(r, name)?;
        if let Some(n) = params.n_frames {
            if n > max_frames(r, max_seconds) {
                return Err(too_long(name, n, r, max_frames(r, max_seconds)));
            }
        }
    }
    // `verify` checks the stream's own checksum (FLAC's MD5 of the samples) at the end.
    let mut decoder = symphonia::default::get_codecs()
        .make(&params, &DecoderOptions { verify: true })
        .map_err(|e| describe(name, e))?;
    let mut mono: Vec<f32> = Vec::new();
    let mut channels: u16 = params.channels.map(|c| c.count() as u16).unwrap_or(0);
    let mut buf: Option<SampleBuffer<f32>> = None;
    loop {
        let packet = match format.next_packet() {
            Ok(p) => p,
            Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(describe(name, e)),
        };
        if packet.track_id() != track_id {
            continue;
        }
        let decoded = decoder.decode(&packet).map_err(|e| describe(name, e))?;
        let spec = *decoded.spec();
        match rate {
            None => {
                check_rate(spec.rate, name)?;
                rate = Some(spec.rate);
            }
            Some(r) if r != spec.rate => {
                return Err(audio_err(format!("{name}: the sample rate changes mid-stream ({r} → {} Hz)", spec.rate)))
            }
            _ => {}
        }
        let ch = spec.channels.count().max(1);
        channels = ch as u16;
        let frames = decoded.frames();
        if buf.as_ref().is_none_or(|b| b.capacity() < decoded.capacity() * ch) {
            buf = Some(SampleBuffer::new(decoded.capacity() as u64, spec));
        }
        let b = buf.as_mut().expect("buffer allocated above");
        b.copy_interleaved_ref(decoded);
        let r = rate.expect("rate set above");
        let limit = max_frames(r, max_seconds);
        if (mono.len() + frames) as u64 > limit {
            return Err(too_long(name, (mono.len() + frames) as u64, r, limit));
        }
        for f in b.samples().chunks_exact(ch).take(frames) {
            let v = f.iter().map(|&s| s as f64).sum::<f64>() / ch as f64;
            if !v.is_finite() {
                return Err(audio_err(format!("{name}: the stream holds a non-finite sample at frame {}", mono.len())));
            }
            mono.push(v as f32);
        }
    }
    if let Some(n) = params.n_frames {
        if (mono.len() as u64) < n {
            return Err(audio_err(format!(
                "{name}: the file is truncated: its header declares {n} samples, {} could be decoded",
                mono.len()
            )));
        }
    }
    if decoder.finalize().verify_ok == Some(false) {
        return Err(audio_err(format!("{name}: corrupt audio data (the stream's checksum does not match its samples)")));
    }
    let rate = rate.ok_or_else(|| audio_err(format!("{name}: the clip holds no samples")))?;
    Ok(Decoded { samples: mono, rate, channels })
}
