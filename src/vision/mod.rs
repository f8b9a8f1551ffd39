//! Images in: decoding ([`image`]), Pillow-compatible resizing ([`resample`]), the Gemma
//! image processors ([`processor`]) and the vision towers' soft tokens ([`encode`]).

pub mod encode;
pub mod image;
pub mod processor;
pub mod prompt;
pub mod resample;

pub use self::image::{decode_image, load_image, ImageError, RgbImage};
pub use encode::{ImageEncoder, Modality, Placeholders, SoftTokens};
pub use processor::{Gemma3Processor, Gemma4Processor, PatchedImage, SquashedImage};
