//! WAV files for the tests: any format tag, channel count, rate and bit depth, and a data
//! chunk of any declared size.

/// A WAV file: format tag, channels, rate, bits, the data chunk's declared size, the data.
pub fn wav_bytes(tag: u16, channels: u16, rate: u32, bits: u16, declared: u32, data: &[u8]) -> Vec<u8> {
    let align = channels * bits / 8;
    let mut fmt = Vec::new();
    fmt.extend_from_slice(&tag.to_le_bytes());
    fmt.extend_from_slice(&channels.to_le_bytes());
    fmt.extend_from_slice(&rate.to_le_bytes());
    fmt.extend_from_slice(&(rate * align as u32).to_le_bytes());
    fmt.extend_from_slice(&align.to_le_bytes());
    fmt.extend_from_slice(&bits.to_le_bytes());
    let mut b = b"RIFF\0\0\0\0WAVEfmt ".to_vec();
    b.extend_from_slice(&(fmt.len() as u32).to_le_bytes());
    b.extend_from_slice(&fmt);
    b.extend_from_slice(b"data");
    b.extend_from_slice(&declared.to_le_bytes());
    b.extend_from_slice(data);
    let riff = (b.len() - 8) as u32;
    b[4..8].copy_from_slice(&riff.to_le_bytes());
    b
}
