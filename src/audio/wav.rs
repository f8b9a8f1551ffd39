//! A RIFF/WAVE reader: PCM 8/16/24/32-bit integers and 32/64-bit floats, plain or
//! `WAVE_FORMAT_EXTENSIBLE`, any channel count (downmixed to mono by the mean).
//!
//! The reader walks the chunk list by seeking, so a header that declares absurd sizes costs
//! nothing: the sample data is sized from the `data` chunk, checked against the file's real
//! length and against the caller's duration limit before anything is allocated for it.

use std::io::{Read, Seek, SeekFrom};

use super::{audio_err, Decoded};
use crate::Error;

const FORMAT_PCM: u16 = 1;
const FORMAT_FLOAT: u16 = 3;
const FORMAT_EXTENSIBLE: u16 = 0xFFFE;
/// Channels accepted; more than this is taken as a corrupt header.
pub(crate) const MAX_CHANNELS: u16 = 64;

/// True when the first bytes are a RIFF/WAVE (or RF64) header.
pub(crate) fn is_wav(head: &[u8]) -> bool {
    head.len() >= 12 && (&head[0..4] == b"RIFF" || &head[0..4] == b"RF64") && &head[8..12] == b"WAVE"
}

#[derive(Debug, Clone, Copy)]
struct Format {
    float: bool,
    channels: u16,
    rate: u32,
    bits: u16,
    block_align: u16,
}

fn read_exact<R: Read>(r: &mut R, buf: &mut [u8], name: &str, what: &str) -> Result<(), Error> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            audio_err(format!("{name}: the file is truncated (it ends inside {what})"))
        } else {
            audio_err(format!("{name}: cannot read {what}: {e}"))
        }
    })
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn parse_fmt(b: &[u8], name: &str) -> Result<Format, Error> {
    if b.len() < 16 {
        return Err(audio_err(format!("{name}: the WAV fmt chunk is {} bytes, at least 16 are needed", b.len())));
    }
    let mut tag = u16_at(b, 0);
    let channels = u16_at(b, 2);
    let rate = u32_at(b, 4);
    let block_align = u16_at(b, 12);
    let bits = u16_at(b, 14);
    if tag == FORMAT_EXTENSIBLE {
        // cbSize(2) validBits(2) channelMask(4) then the sub-format GUID, whose first two
        // bytes are the plain format tag.
        if b.len() < 26 {
            return Err(audio_err(format!("{name}: the WAV extensible fmt chunk is too short ({} bytes)", b.len())));
        }
        tag = u16_at(b, 24);
    }
    let float = match (tag, bits) {
        (FORMAT_PCM, 8 | 16 | 24 | 32) => false,
        (FORMAT_FLOAT, 32 | 64) => true,
        (FORMAT_PCM, _) | (FORMAT_FLOAT, _) => {
            return Err(audio_err(format!("{name}: unsupported WAV sample size: {bits} bits (format tag {tag})")))
        }
        _ => {
            return Err(audio_err(format!(
                "{name}: unsupported WAV encoding (format tag {tag:#06x}); PCM integers and IEEE floats are read"
            )))
        }
    };
    if channels == 0 || channels > MAX_CHANNELS {
        return Err(audio_err(format!("{name}: the WAV header declares {channels} channels (1 to {MAX_CHANNELS} are read)")));
    }
    super::check_rate(rate, name)?;
    let want_align = channels as u32 * (bits as u32 / 8);
    if block_align as u32 != want_align {
        return Err(audio_err(format!(
            "{name}: inconsistent WAV header: block align {block_align}, but {channels} channels of {bits} bits take {want_align} bytes"
        )));
    }
    Ok(Format { float, channels, rate, bits, block_align })
}

/// Reads a WAV stream of `file_len` bytes; clips over `max_seconds` are refused unread.
pub(crate) fn read<R: Read + Seek>(r: &mut R, file_len: u64, name: &str, max_seconds: f64) -> Result<Decoded, Error> {
    let mut head = [0u8; 12];
    read_exact(r, &mut head, name, "the RIFF header")?;
    if !is_wav(&head) {
        return Err(audio_err(format!("{name}: not a RIFF/WAVE file")));
    }
    let mut pos: u64 = 12;
    let mut fmt: Option<Format> = None;
    loop {
        if pos + 8 > file_len {
            return Err(audio_err(match fmt {
                None => format!("{name}: the WAV file has no fmt chunk (truncated or corrupt)"),
                Some(_) => format!("{name}: the WAV file has no data chunk (truncated or corrupt)"),
            }));
        }
        let mut ch = [0u8; 8];
        read_exact(r, &mut ch, name, "a chunk header")?;
        pos += 8;
        let id = [ch[0], ch[1], ch[2], ch[3]];
        let size = u32_at(&ch, 4) as u64;
        let remaining = file_len - pos;
        match &id {
            b"fmt " => {
                if size > remaining {
                    return Err(audio_err(format!("{name}: the file is truncated (fmt chunk of {size} bytes, {remaining} left)")));
                }
                // Only the first 40 bytes matter; the rest is skipped, never buffered.
                let mut b = vec![0u8; size.min(40) as usize];
                read_exact(r, &mut b, name, "the fmt chunk")?;
                fmt = Some(parse_fmt(&b, name)?);
            }
            b"data" => {
                let f = fmt.ok_or_else(|| audio_err(format!("{name}: the WAV data chunk comes before any fmt chunk")))?;
                // 0xFFFFFFFF (streamed writers, RF64) means "up to the end of the file".
                let bytes = if size == u32::MAX as u64 || (&head[0..4] == b"RF64") { remaining } else { size };
                if bytes > remaining {
                    return Err(audio_err(format!(
                        "{name}: the file is truncated: its data chunk declares {bytes} bytes, only {remaining} follow"
                    )));
                }
                let frames = bytes / f.block_align as u64;
                let max_frames = super::max_frames(f.rate, max_seconds);
                if frames > max_frames {
                    return Err(super::too_long(name, frames, f.rate, max_frames));
                }
                return read_samples(r, f, frames, name);
            }
            _ => {}
        }
        let skip = size + (size & 1);
        let consumed = if &id == b"fmt " { size.min(40) } else { 0 };
        // A chunk running past the end of the file leaves `pos` beyond it, and the check at
        // the top of the loop reports the missing data chunk.
        r.seek(SeekFrom::Current((skip - consumed) as i64))
            .map_err(|e| audio_err(format!("{name}: cannot seek in the WAV file: {e}")))?;
        pos += skip;
    }
}

fn read_samples<R: Read>(r: &mut R, f: Format, frames: u64, name: &str) -> Result<Decoded, Error> {
    let ch = f.channels as usize;
    let width = f.bits as usize / 8;
    let mut mono = Vec::with_capacity(frames as usize);
    // Read in blocks so that the raw bytes never take more than a few MB.
    let block_frames = (1 << 20) / f.block_align as usize;
    let mut buf = vec![0u8; block_frames.max(1) * f.block_align as usize];
    let mut left = frames as usize;
    let scale = 1.0 / ch as f64;
    while left > 0 {
        let n = left.min(block_frames.max(1));
        let b = &mut buf[..n * f.block_align as usize];
        read_exact(r, b, name, "the sample data")?;
        for frame in b.chunks_exact(f.block_align as usize) {
            let mut acc = 0.0f64;
            for s in frame.chunks_exact(width) {
                acc += sample(s, f);
            }
            let v = if ch == 1 { acc } else { acc * scale };
            if !v.is_finite() {
                return Err(audio_err(format!(
                    "{name}: the WAV file holds a non-finite sample (NaN or infinity) at frame {}",
                    mono.len()
                )));
            }
            mono.push(v as f32);
        }
        left -= n;
    }
    Ok(Decoded { samples: mono, rate: f.rate, channels: f.channels })
}

/// One sample as f64 in [-1, 1] (integers divided by 2^(bits−1), 8-bit offset by 128).
fn sample(s: &[u8], f: Format) -> f64 {
    match (f.float, f.bits) {
        (true, 32) => f32::from_le_bytes([s[0], s[1], s[2], s[3]]) as f64,
        (true, _) => f64::from_le_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]]),
        (false, 8) => (s[0] as f64 - 128.0) / 128.0,
        (false, 16) => i16::from_le_bytes([s[0], s[1]]) as f64 / 32768.0,
        (false, 24) => (i32::from_le_bytes([0, s[0], s[1], s[2]]) >> 8) as f64 / 8_388_608.0,
        (false, _) => i32::from_le_bytes([s[0], s[1], s[2], s[3]]) as f64 / 2_147_483_648.0,
    }
}
