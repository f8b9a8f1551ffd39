//! Quantization descriptions of MLX weights (the formats, not the decoding).

use serde::Serialize;

/// MLX quantization mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum QuantMode {
    Affine,
    Mxfp4,
    Mxfp8,
    Nvfp4,
}

impl QuantMode {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "affine" => QuantMode::Affine,
            "mxfp4" => QuantMode::Mxfp4,
            "mxfp8" => QuantMode::Mxfp8,
            "nvfp4" => QuantMode::Nvfp4,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Mxfp8 => "mxfp8",
            QuantMode::Nvfp4 => "nvfp4",
        }
    }
    /// (group_size, bits) used when the config omits them.
    pub fn defaults(self) -> (usize, usize) {
        match self {
            QuantMode::Affine => (64, 4),
            QuantMode::Mxfp4 => (32, 4),
            QuantMode::Mxfp8 => (32, 8),
            QuantMode::Nvfp4 => (16, 4),
        }
    }
    /// Whether the format stores `.biases`.
    pub fn has_biases(self) -> bool {
        self == QuantMode::Affine
    }
}

/// Mode, bits and group size of one quantized module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct QuantSpec {
    pub mode: QuantMode,
    pub bits: usize,
    pub group_size: usize,
}

impl QuantSpec {
    pub const fn affine(bits: usize, group_size: usize) -> Self {
        QuantSpec { mode: QuantMode::Affine, bits, group_size }
    }

    /// Checks that MLX can produce this combination.
    pub fn validate(&self) -> Result<(), String> {
        let ok = match self.mode {
            QuantMode::Affine => {
                matches!(self.bits, 1 | 2 | 3 | 4 | 5 | 6 | 8) && matches!(self.group_size, 32 | 64 | 128)
            }
            QuantMode::Mxfp4 => self.bits == 4 && self.group_size == 32,
            QuantMode::Mxfp8 => self.bits == 8 && self.group_size == 32,
            QuantMode::Nvfp4 => self.bits == 4 && self.group_size == 16,
        };
        if ok {
            Ok(())
        } else {
            Err(format!("unsupported quantization {} bits={} group_size={}", self.mode.name(), self.bits, self.group_size))
        }
    }

    /// u32 words per row of `in_dim` elements.
    pub fn packed_cols(&self, in_dim: usize) -> usize {
        in_dim * self.bits / 32
    }

    /// Scale (and bias) entries per row.
    pub fn groups(&self, in_dim: usize) -> usize {
        in_dim / self.group_size
    }

    /// Whether a row of `in_dim` elements can use this format.
    pub fn fits(&self, in_dim: usize) -> bool {
        in_dim % self.group_size == 0 && (in_dim * self.bits) % 32 == 0
    }

    /// Bytes of one stored row: packed weights plus scales (and biases).
    /// `scale_bytes` is the byte size of one affine scale as stored (2 for bf16).
    pub fn row_bytes(&self, in_dim: usize, scale_bytes: usize) -> usize {
        let w = self.packed_cols(in_dim) * 4;
        let g = self.groups(in_dim);
        match self.mode {
            QuantMode::Affine => w + 2 * g * scale_bytes,
            _ => w + g,
        }
    }

    pub fn describe(&self) -> String {
        match self.mode {
            QuantMode::Affine => format!("affine {}-bit g{}", self.bits, self.group_size),
            m => format!("{} g{}", m.name(), self.group_size),
        }
    }
}

/// Storage dtype of an unquantized float tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FloatType {
    Bf16,
    F16,
    F32,
}

impl FloatType {
    pub fn bytes(self) -> usize {
        match self {
            FloatType::F32 => 4,
            _ => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            FloatType::Bf16 => "bf16",
            FloatType::F16 => "f16",
            FloatType::F32 => "f32",
        }
    }
}

/// How a weight is stored in the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum WeightFormat {
    /// Plain float tensor.
    Float { dtype: FloatType },
    /// MLX-quantized module: `.weight` (u32), `.scales`, `.biases` (affine), `.global_scale` (optional nvfp4).
    Quantized { spec: QuantSpec, global_scale: bool },
}

impl WeightFormat {
    pub fn describe(&self) -> String {
        match self {
            WeightFormat::Float { dtype } => dtype.name().to_string(),
            WeightFormat::Quantized { spec, global_scale } => {
                if *global_scale {
                    format!("{} +global_scale", spec.describe())
                } else {
                    spec.describe()
                }
            }
        }
    }
}
