//! `markbase inspect`.
