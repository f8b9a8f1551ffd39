//! Weights as loaded from a checkpoint: the stored bytes of each tensor,
//! copied out of the (unaligned) safetensors data, plus the graph's description.

use std::collections::BTreeMap;

use markbase_graph::ir::WeightParam;

/// Stored element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RawDType {
    Bf16,
    F16,
    F32,
    U32,
    U8,
    I32,
}

impl RawDType {
    pub fn bytes(self) -> usize {
        match self {
            RawDType::Bf16 | RawDType::F16 => 2,
            RawDType::F32 | RawDType::U32 | RawDType::I32 => 4,
            RawDType::U8 => 1,
        }
    }
    /// safetensors' name of the dtype.
    pub fn name(self) -> &'static str {
        match self {
            RawDType::Bf16 => "BF16",
            RawDType::F16 => "F16",
            RawDType::F32 => "F32",
            RawDType::U32 => "U32",
            RawDType::U8 => "U8",
            RawDType::I32 => "I32",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "BF16" => RawDType::Bf16,
            "F16" => RawDType::F16,
            "F32" => RawDType::F32,
            "U32" => RawDType::U32,
            "U8" => RawDType::U8,
            "I32" => RawDType::I32,
            _ => return None,
        })
    }
}

/// One tensor's stored bytes (little-endian, as in the file).
#[derive(Clone, Debug, PartialEq)]
pub struct RawTensor {
    pub dtype: RawDType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl RawTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Elements converted to f32 (floats only).
    pub fn to_f32(&self) -> Vec<f32> {
        let b = &self.bytes;
        match self.dtype {
            RawDType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            RawDType::Bf16 => b.chunks_exact(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)).collect(),
            RawDType::F16 => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            RawDType::U32 | RawDType::I32 | RawDType::U8 => panic!("to_f32 on an integer tensor"),
        }
    }

    /// Elements as u32 words (U32 tensors).
    pub fn to_u32(&self) -> Vec<u32> {
        self.bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    pub fn from_f32(shape: &[usize], v: &[f32]) -> Self {
        RawTensor { dtype: RawDType::F32, shape: shape.to_vec(), bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
    }

    pub fn from_u32(shape: &[usize], v: &[u32]) -> Self {
        RawTensor { dtype: RawDType::U32, shape: shape.to_vec(), bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
    }
}

/// The tensors behind one graph weight parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightData {
    /// The graph's description (name, float shape, format as found in the checkpoint).
    pub param: WeightParam,
    /// `<name>.weight` (packed u32 when quantized) or the plain tensor.
    pub weight: RawTensor,
    pub scales: Option<RawTensor>,
    pub biases: Option<RawTensor>,
    pub global_scale: Option<RawTensor>,
}

/// All weights a graph needs, by [`WeightParam::name`].
#[derive(Clone, Debug, Default)]
pub struct Weights {
    pub map: BTreeMap<String, WeightData>,
}

impl Weights {
    pub fn get(&self, name: &str) -> Option<&WeightData> {
        self.map.get(name)
    }
    pub fn insert(&mut self, w: WeightData) {
        self.map.insert(w.param.name.clone(), w);
    }
    pub fn stored_bytes(&self) -> usize {
        self.map
            .values()
            .map(|w| {
                w.weight.bytes.len()
                    + w.scales.as_ref().map_or(0, |t| t.bytes.len())
                    + w.biases.as_ref().map_or(0, |t| t.bytes.len())
                    + w.global_scale.as_ref().map_or(0, |t| t.bytes.len())
            })
            .sum()
    }
}
