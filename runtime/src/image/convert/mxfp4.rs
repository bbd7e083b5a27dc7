//! MXFP4 (OCP Microscaling FP4) dequantization of openai's GPT-OSS expert tensors, exactly as
//! transformers 5 `integrations/mxfp4.py` (`convert_moe_packed_tensors`) unpacks them.
//!
//! A matrix `[rows, cols]` is stored output-major as two U8 tensors:
//!
//! ```text
//! blocks [rows, cols/32, 16]   byte j of a block holds elements 2j (low nibble) and 2j+1 (high nibble)
//! scales [rows, cols/32]       one E8M0 exponent per 32 consecutive inputs: 2^(scale - 127)
//! value = E2M1[nibble] * 2^(scale - 127)
//! E2M1  = [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]
//! ```
//!
//! Every E2M1 value has at most two significant bits, so the product is exact in f32 whenever it is
//! a normal f32 (it is rounded to nearest like `torch.ldexp` below that). The OCP MX specification
//! (v1.0, section 5.4) reserves the E8M0 byte 0xFF for NaN: it is refused here with an error naming
//! the tensor and the element, and so is a scale that overflows f32 (a checkpoint's weights must be
//! finite).

use std::path::PathBuf;

use crate::error::Result;
use crate::model::safetensors::TensorRef;

/// An MXFP4 matrix that cannot be dequantized, naming the tensor (`what`: its file and name, and
/// the expert) and the position; [`crate::Error::Mxfp4`] carries it.
#[derive(Debug, thiserror::Error)]
pub enum Mxfp4Error {
    /// The input dimension is not a whole number of 32-input blocks.
    #[error("{what}: {cols} inputs are not whole MXFP4 blocks of {MXFP4_BLOCK}")]
    NotWholeBlocks {
        /// The tensor.
        what: String,
        /// Inputs per row.
        cols: usize,
    },
    /// Block and scale byte counts other than `[rows, cols]` needs.
    #[error(
        "{what}: {blocks} block bytes and {scales} scales for a [{rows}, {cols}] MXFP4 matrix (need {} and {})",
        rows * cols / 2,
        rows * cols.div_ceil(MXFP4_BLOCK)
    )]
    Bytes {
        /// The tensor.
        what: String,
        /// Block bytes given.
        blocks: usize,
        /// Scale bytes given.
        scales: usize,
        /// Rows of the matrix.
        rows: usize,
        /// Inputs per row.
        cols: usize,
    },
    /// An E8M0 scale of 0xFF, NaN in the OCP MX specification.
    #[error("{what}: E8M0 scale 0xFF (NaN in the OCP MX specification) at row {row}, inputs {}..{}", inputs.start, inputs.end)]
    NanScale {
        /// The tensor.
        what: String,
        /// The row.
        row: usize,
        /// The 32 inputs the scale covers.
        inputs: std::ops::Range<usize>,
    },
    /// A scale that makes a value overflow f32.
    #[error("{what}: E8M0 scale {scale} overflows f32 at row {row}, input {input}")]
    ScaleOverflow {
        /// The tensor.
        what: String,
        /// The E8M0 byte.
        scale: u8,
        /// The row.
        row: usize,
        /// The input.
        input: usize,
    },
    /// A scales tensor whose shape is not its blocks' without the last dimension.
    #[error(
        "{}: tensor `{name}` {shape:?} does not match its blocks `{blocks}` {blocks_shape:?} (one scale per 16-byte \
         block)",
        path.display()
    )]
    ScalesShape {
        /// The file of the scales.
        path: PathBuf,
        /// The scales tensor.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The blocks tensor.
        blocks: String,
        /// Its shape.
        blocks_shape: Vec<usize>,
    },
}

/// The FP4 E2M1 values of the 16 nibbles (OCP MX v1.0, table 5; transformers' `FP4_VALUES`).
pub const FP4_E2M1: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Inputs per E8M0 scale (and per 16-byte block).
pub const MXFP4_BLOCK: usize = 32;

/// The E8M0 byte that means NaN.
pub const E8M0_NAN: u8 = 0xFF;

/// Dequantizes `rows × cols` MXFP4 values (`blocks` `[rows, cols/32, 16]`, `scales`
/// `[rows, cols/32]`, both raw bytes) into f32 `[rows, cols]`, row-major. `what` names the tensor
/// in errors.
///
/// # Errors
/// [`crate::Error::Mxfp4`]: [`Mxfp4Error::NotWholeBlocks`] when `cols` is not a multiple of 32,
/// [`Mxfp4Error::Bytes`] when a buffer has the wrong length, [`Mxfp4Error::NanScale`] for a scale of
/// 0xFF (NaN), [`Mxfp4Error::ScaleOverflow`] when a value overflows f32; each names `what` and the
/// row and column.
pub fn dequantize(blocks: &[u8], scales: &[u8], rows: usize, cols: usize, what: &str) -> Result<Vec<f32>> {
    if !cols.is_multiple_of(MXFP4_BLOCK) {
        return Err(Mxfp4Error::NotWholeBlocks { what: what.into(), cols }.into());
    }
    let groups = cols / MXFP4_BLOCK;
    if blocks.len() != rows * cols / 2 || scales.len() != rows * groups {
        return Err(
            Mxfp4Error::Bytes { what: what.into(), blocks: blocks.len(), scales: scales.len(), rows, cols }.into()
        );
    }
    let mut out = Vec::with_capacity(rows * cols);
    for (g, (&s, block)) in scales.iter().zip(blocks.chunks_exact(MXFP4_BLOCK / 2)).enumerate() {
        if s == E8M0_NAN {
            return Err(Mxfp4Error::NanScale {
                what: what.into(),
                row: g / groups,
                inputs: (g % groups) * MXFP4_BLOCK..(g % groups + 1) * MXFP4_BLOCK,
            }
            .into());
        }
        let scale = 2f64.powi(i32::from(s) - 127);
        for (j, &b) in block.iter().enumerate() {
            for (k, nibble) in [b & 0x0F, b >> 4].into_iter().enumerate() {
                let v = (f64::from(FP4_E2M1[nibble as usize]) * scale) as f32;
                if !v.is_finite() {
                    return Err(Mxfp4Error::ScaleOverflow {
                        what: what.into(),
                        scale: s,
                        row: g / groups,
                        input: (g % groups) * MXFP4_BLOCK + 2 * j + k,
                    }
                    .into());
                }
                out.push(v);
            }
        }
    }
    Ok(out)
}

/// Checks that `blocks` is U8 `[E, rows, cols/32, 16]` and `scales` is U8 `[E, rows, cols/32]`.
///
/// # Errors
/// [`crate::Error::TensorDtype`] or [`crate::Error::TensorShape`] naming the tensor and its file;
/// [`Mxfp4Error::NotWholeBlocks`] when `cols` is not a multiple of 32, [`Mxfp4Error::ScalesShape`] when
/// the two shapes disagree (naming both).
pub fn check_pair(
    blocks: &TensorRef<'_>,
    scales: &TensorRef<'_>,
    experts: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    use safetensors::Dtype;
    for t in [blocks, scales] {
        if t.dtype != Dtype::U8 {
            return Err(t.dtype_error("U8 (MXFP4 blocks / E8M0 scales)"));
        }
    }
    if !cols.is_multiple_of(MXFP4_BLOCK) {
        return Err(Mxfp4Error::NotWholeBlocks {
            what: format!("{}: tensor `{}`", blocks.path.display(), blocks.name),
            cols,
        }
        .into());
    }
    if scales.shape.len() == 3 && blocks.shape.len() == 4 && scales.shape != &blocks.shape[..3] {
        return Err(Mxfp4Error::ScalesShape {
            path: scales.path.into(),
            name: scales.name.into(),
            shape: scales.shape.to_vec(),
            blocks: blocks.name.into(),
            blocks_shape: blocks.shape.to_vec(),
        }
        .into());
    }
    blocks.expect_shape(&[experts, rows, cols / MXFP4_BLOCK, MXFP4_BLOCK / 2])?;
    scales.expect_shape(&[experts, rows, cols / MXFP4_BLOCK])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_values() {
        // One row of 32 inputs: bytes 0x10, 0x32, ... so element 2j = nibble 2j, element 2j+1 =
        // nibble 2j+1 (low nibble first), scale 2^(128-127) = 2.
        let blocks: Vec<u8> = (0..16u8).map(|j| (((2 * j + 1) % 16) << 4) | ((2 * j) % 16)).collect();
        let out = dequantize(&blocks, &[128], 1, 32, "t").unwrap();
        let want: Vec<f32> = (0..32).map(|k| FP4_E2M1[k % 16] * 2.0).collect();
        assert_eq!(out, want);
        assert_eq!(&out[..8], &[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]);
        assert!(out[8] == 0.0 && out[8].is_sign_negative());
        assert_eq!(out[15], -12.0);
        // scale 127 is 1, 125 is 1/4, 0 is 2^-127 (a subnormal f32, still exact for 0.5..6)
        let b = [0x71u8; 16]; // low nibble 1 (0.5), high nibble 7 (6.0)
        assert_eq!(&dequantize(&b, &[127], 1, 32, "t").unwrap()[..2], &[0.5, 6.0]);
        assert_eq!(&dequantize(&b, &[125], 1, 32, "t").unwrap()[..2], &[0.125, 1.5]);
        let tiny = dequantize(&b, &[0], 1, 32, "t").unwrap();
        assert_eq!(tiny[0], f32::from_bits(1 << 21)); // 0.5 * 2^-127 = 2^-128
        assert_eq!(tiny[1], 6.0 * 2f32.powi(-127));
        // two rows, two groups each: the scales are per (row, group) in order
        let b2 = [0x22u8; 64]; // every value 1.0
        let out = dequantize(&b2, &[127, 128, 129, 130], 2, 64, "t").unwrap();
        assert_eq!((out[0], out[32], out[64], out[127]), (1.0, 2.0, 4.0, 8.0));
    }

    #[test]
    fn nan_scale_overflow_and_bad_lengths_are_errors() {
        let b = [0x11u8; 32];
        let e = dequantize(&b, &[127, E8M0_NAN], 1, 64, "layers.0.gate_up_proj_scales[3]").unwrap_err().to_string();
        assert!(
            e.contains("layers.0.gate_up_proj_scales[3]") && e.contains("0xFF") && e.contains("inputs 32..64"),
            "{e}"
        );
        let e = dequantize(&[0x70u8; 16], &[254], 1, 32, "t").unwrap_err().to_string();
        assert!(e.contains("overflows f32") && e.contains("input 1"), "{e}");
        assert_eq!(dequantize(&[0x10u8; 16], &[254], 1, 32, "t").unwrap()[1], 0.5 * 2f32.powi(127));
        let e = dequantize(&b[..31], &[127, 127], 1, 64, "t").unwrap_err().to_string();
        assert!(e.contains("31 block bytes"), "{e}");
        let e = dequantize(&b, &[127], 1, 48, "t").unwrap_err().to_string();
        assert!(e.contains("not whole MXFP4 blocks"), "{e}");
    }
}
