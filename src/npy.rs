//! Reading NumPy `.npy` arrays (format 1.x/2.x, little-endian, C order): f32, i32 and u8
//! (the references of the vision tests; `markbase encode` output read back). Writing is
//! [`crate::cli::write_npy`].

use std::path::Path;

/// An array: its shape and its values in C order.
#[derive(Clone, Debug, PartialEq)]
pub struct Array<T> {
    pub shape: Vec<usize>,
    pub data: Vec<T>,
}

fn parse<'a>(bytes: &'a [u8], descr: &str) -> Result<(Vec<usize>, &'a [u8]), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy file".into());
    }
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format!(".npy version {v} is not supported")),
    };
    let header = bytes.get(start..start + hlen).ok_or("truncated .npy header")?;
    let header = std::str::from_utf8(header).map_err(|_| "the .npy header is not text")?;
    let field = |key: &str| -> Option<&str> {
        let i = header.find(&format!("'{key}':"))? + key.len() + 3;
        Some(header[i..].trim_start())
    };
    let d = field("descr").ok_or("no descr in the .npy header")?;
    let want = format!("'{descr}'");
    let alt = format!("'|{}'", &descr[1..]);
    if !(d.starts_with(&want) || (descr.ends_with('1') && d.starts_with(&alt))) {
        return Err(format!("dtype {} where {descr} was expected", d.split(',').next().unwrap_or(d)));
    }
    if field("fortran_order").is_some_and(|f| f.starts_with("True")) {
        return Err("Fortran-ordered arrays are not supported".into());
    }
    let s = field("shape").ok_or("no shape in the .npy header")?;
    let s = &s[1..s.find(')').ok_or("bad shape in the .npy header")?];
    let shape: Vec<usize> = s
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().map_err(|_| format!("bad dimension {t:?} in the .npy header")))
        .collect::<Result<_, _>>()?;
    Ok((shape, &bytes[start + hlen..]))
}

fn read<T, const N: usize>(path: &Path, descr: &str, conv: fn([u8; N]) -> T) -> Result<Array<T>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (shape, body) = parse(&bytes, descr).map_err(|e| format!("{}: {e}", path.display()))?;
    let n: usize = shape.iter().product();
    if body.len() != n * N {
        return Err(format!("{}: {} data bytes for shape {shape:?}", path.display(), body.len()));
    }
    let data = body.chunks_exact(N).map(|c| conv(c.try_into().unwrap())).collect();
    Ok(Array { shape, data })
}

pub fn read_f32(path: &Path) -> Result<Array<f32>, String> {
    read(path, "<f4", f32::from_le_bytes)
}

pub fn read_i32(path: &Path) -> Result<Array<i32>, String> {
    read(path, "<i4", i32::from_le_bytes)
}

pub fn read_u8(path: &Path) -> Result<Array<u8>, String> {
    read(path, "<u1", |b: [u8; 1]| b[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_with_the_writer() {
        let p = std::env::temp_dir().join(format!("markbase-npy-{}.npy", std::process::id()));
        crate::cli::write_npy(&p, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, -6.5]).unwrap();
        let a = read_f32(&p).unwrap();
        assert_eq!(a.shape, vec![2, 3]);
        assert_eq!(a.data[5], -6.5);
        assert!(read_i32(&p).unwrap_err().contains("dtype"));
        std::fs::remove_file(&p).ok();
    }
}
