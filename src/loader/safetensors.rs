//! A defensive safetensors header parser.
//!
//! Layout: `u64 LE n`, `n` bytes of JSON, then the data section. The JSON maps
//! tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}` with offsets
//! relative to the data section; `__metadata__` is a string map. MLX writes no
//! padding and no alignment, so nothing here assumes any.
//!
//! Problems that make the whole file unusable (short file, absurd header length,
//! bad JSON) are returned as `Err`. Problems of single tensors (unknown dtype,
//! sizes inconsistent with dtype×shape, offsets past the end, overlaps, missing
//! data of a truncated file) are recorded on the entry as a [`Defect`] so that all
//! of them can be reported together.

use serde_json::Value;

use crate::weights::RawDType;

/// Largest header we accept (the reference implementation uses the same bound).
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Why a tensor cannot be read.
#[derive(Clone, Debug, PartialEq)]
pub struct Defect {
    pub message: String,
    /// The data is missing because the file is truncated (reported once per
    /// file rather than once per tensor).
    pub truncated: bool,
}

/// One header entry.
#[derive(Clone, Debug)]
pub struct Entry {
    pub name: String,
    /// dtype as written in the header.
    pub dtype_name: String,
    /// The dtype, if markbase can use it.
    pub dtype: Option<RawDType>,
    pub shape: Vec<usize>,
    /// Byte range in the data section (relative; `begin..end`).
    pub begin: usize,
    pub end: usize,
    pub defect: Option<Defect>,
}

/// A parsed header.
#[derive(Clone, Debug)]
pub struct Header {
    /// Absolute file offset of the data section (`8 + n`).
    pub data_start: usize,
    /// Bytes of the data section present in the file.
    pub data_len: usize,
    pub entries: Vec<Entry>,
    /// File-level problem that does not stop the other tensors from loading
    /// (a truncated data section).
    pub truncation: Option<String>,
    pub metadata: Vec<(String, String)>,
}

/// Byte size of one element of every dtype the safetensors format defines (sub-byte
/// types are left out: they are not used by MLX checkpoints).
pub fn dtype_size(name: &str) -> Option<usize> {
    Some(match name {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" | "C64" => 8,
        _ => return None,
    })
}

/// Parses the header of a safetensors file held in `bytes` (the whole file).
/// `file` names the file in messages.
pub fn parse(bytes: &[u8], file: &str) -> Result<Header, String> {
    let len = bytes.len();
    if len < 8 {
        return Err(format!("{file}: file is too short ({len} bytes) to be a safetensors file"));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > (len as u64 - 8) {
        return Err(format!("{file}: header length {n} exceeds file size {len} (corrupt or not a safetensors file)"));
    }
    if n > MAX_HEADER_BYTES {
        return Err(format!("{file}: header length {n} is absurd (more than {MAX_HEADER_BYTES} bytes)"));
    }
    let n = n as usize;
    let json = &bytes[8..8 + n];
    let v: Value = serde_json::from_slice(json).map_err(|e| {
        let at = byte_offset(json, e.line(), e.column());
        format!("{file}: invalid safetensors header JSON (parse error at byte {at}: {e})")
    })?;
    let obj = v.as_object().ok_or_else(|| format!("{file}: safetensors header is not a JSON object"))?;
    let data_start = 8 + n;
    let data_len = len - data_start;

    let mut entries = Vec::with_capacity(obj.len());
    let mut metadata = vec![];
    for (name, t) in obj {
        if name == "__metadata__" {
            if let Some(m) = t.as_object() {
                metadata = m.iter().map(|(k, v)| (k.clone(), v.as_str().map_or_else(|| v.to_string(), str::to_string))).collect();
            }
            continue;
        }
        entries.push(parse_entry(name, t));
    }

    // Bounds: a truncated file (tensors laid out back to back from 0, the tail
    // missing) is one problem; any other out-of-range tensor is its own.
    let mut spans: Vec<usize> = (0..entries.len()).filter(|&i| entries[i].defect.is_none()).collect();
    spans.sort_by_key(|&i| (entries[i].begin, entries[i].end));
    let contiguous = spans.first().is_none_or(|&i| entries[i].begin == 0)
        && spans.windows(2).all(|w| entries[w[1]].begin == entries[w[0]].end);
    let mut truncation = None;
    let past_end: Vec<usize> = spans.iter().copied().filter(|&i| entries[i].end > data_len).collect();
    if !past_end.is_empty() {
        if contiguous {
            let first = &entries[past_end[0]];
            truncation = Some(format!(
                "{file} is truncated: tensor `{}` data ends at byte {} but the file has only {len} bytes ({} of {} tensors affected)",
                first.name,
                data_start + first.end,
                past_end.len(),
                spans.len()
            ));
            for &i in &past_end {
                let e = &mut entries[i];
                e.defect = Some(Defect {
                    message: format!("data missing: {file} is truncated (tensor ends at byte {}, file has {len} bytes)", data_start + e.end),
                    truncated: true,
                });
            }
        } else {
            for &i in &past_end {
                let e = &mut entries[i];
                e.defect = Some(Defect {
                    message: format!("data_offsets [{}, {}] exceed the data section (size {data_len}) of {file}", e.begin, e.end),
                    truncated: false,
                });
            }
        }
    }
    // Overlaps among the remaining well-formed tensors.
    let inb: Vec<usize> = spans.iter().copied().filter(|&i| entries[i].end <= data_len).collect();
    let mut reach: Option<usize> = None; // entry with the largest end so far
    for &i in &inb {
        if let Some(p) = reach {
            if entries[i].begin < entries[p].end && entries[i].end > entries[i].begin {
                let msg = format!(
                    "data [{}, {}) overlaps tensor `{}` [{}, {}) in {file}",
                    entries[i].begin, entries[i].end, entries[p].name, entries[p].begin, entries[p].end
                );
                entries[i].defect = Some(Defect { message: msg, truncated: false });
            }
        }
        if reach.is_none_or(|p| entries[i].end > entries[p].end) {
            reach = Some(i);
        }
    }
    Ok(Header { data_start, data_len, entries, truncation, metadata })
}

fn parse_entry(name: &str, t: &Value) -> Entry {
    let mut e = Entry { name: name.to_string(), dtype_name: String::new(), dtype: None, shape: vec![], begin: 0, end: 0, defect: None };
    let bad = |m: String| Some(Defect { message: m, truncated: false });
    let Some(o) = t.as_object() else {
        e.defect = bad("header entry is not an object".into());
        return e;
    };
    match o.get("dtype").and_then(Value::as_str) {
        Some(s) => e.dtype_name = s.to_string(),
        None => {
            e.defect = bad("header entry has no dtype".into());
            return e;
        }
    }
    let shape: Option<Vec<usize>> = o
        .get("shape")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|d| d.as_u64().and_then(|x| usize::try_from(x).ok())).collect());
    match shape {
        Some(s) => e.shape = s,
        None => {
            e.defect = bad("header entry has no valid shape (a list of non-negative integers)".into());
            return e;
        }
    }
    let offs: Option<Vec<usize>> = o
        .get("data_offsets")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|d| d.as_u64().and_then(|x| usize::try_from(x).ok())).collect());
    match offs.as_deref() {
        Some(&[b, en]) if b <= en => {
            e.begin = b;
            e.end = en;
        }
        _ => {
            e.defect = bad(format!("invalid data_offsets {}", o.get("data_offsets").map_or("(missing)".into(), |v| v.to_string())));
            return e;
        }
    }
    let Some(elem) = dtype_size(&e.dtype_name) else {
        e.defect = bad(format!("unknown dtype {:?}", e.dtype_name));
        return e;
    };
    e.dtype = RawDType::parse(&e.dtype_name);
    let need = e.shape.iter().try_fold(elem, |a, &d| a.checked_mul(d));
    match need {
        Some(need) if need == e.end - e.begin => {}
        _ => {
            e.defect = bad(format!(
                "{} {:?} needs {} bytes but data_offsets [{}, {}] span {}",
                e.dtype_name,
                e.shape,
                need.map_or("an absurd number of".to_string(), |n| n.to_string()),
                e.begin,
                e.end,
                e.end - e.begin
            ));
        }
    }
    e
}

/// Byte offset of serde_json's 1-based (line, column) position.
fn byte_offset(text: &[u8], line: usize, column: usize) -> usize {
    let mut l = 1;
    let mut start = 0;
    for (i, &b) in text.iter().enumerate() {
        if l == line {
            break;
        }
        if b == b'\n' {
            l += 1;
            start = i + 1;
        }
    }
    (start + column.saturating_sub(1)).min(text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data));
        v
    }

    #[test]
    fn good_and_unaligned() {
        let h = r#"{"__metadata__":{"format":"mlx"},"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},"b":{"dtype":"U32","shape":[1],"data_offsets":[6,10]}}"#;
        let p = parse(&file(h, 10), "x").unwrap();
        assert!(p.entries.iter().all(|e| e.defect.is_none()));
        assert_eq!(p.metadata, vec![("format".to_string(), "mlx".to_string())]);
    }

    #[test]
    fn overlap_and_size() {
        let h = r#"{"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},"b":{"dtype":"U32","shape":[1],"data_offsets":[4,8]},"c":{"dtype":"F32","shape":[2],"data_offsets":[8,10]}}"#;
        let p = parse(&file(h, 10), "x").unwrap();
        let d = |n: &str| p.entries.iter().find(|e| e.name == n).unwrap().defect.clone();
        assert!(d("a").is_none());
        assert!(d("b").unwrap().message.contains("overlaps tensor `a`"));
        assert!(d("c").unwrap().message.contains("needs 8 bytes"));
    }

    #[test]
    fn file_level_errors() {
        assert!(parse(&[1, 2, 3], "x").unwrap_err().contains("too short"));
        let mut v = (1u64 << 40).to_le_bytes().to_vec();
        v.extend_from_slice(b"{}");
        assert!(parse(&v, "x").unwrap_err().contains("header length 1099511627776 exceeds file size 10"));
        assert!(parse(&file("{\"a\";1}", 0), "x").unwrap_err().contains("parse error at byte 4"));
    }
}
