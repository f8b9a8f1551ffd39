//! Images in: decoding ([`image`]), Pillow-compatible resizing ([`resample`]) and the Gemma
//! image processors ([`processor`]).

pub mod image;
pub mod processor;
pub mod resample;

pub use self::image::{decode_image, load_image, ImageError, RgbImage};
pub use processor::{Gemma3Processor, Gemma4Processor, PatchedImage, SquashedImage};
