//! The ggml tensor types a GGUF names by id: one table from id to name, block elements and block
//! bytes (ggml's `type_traits` in `ggml/src/ggml.c`; gguf-py's `GGML_QUANT_SIZES` in
//! `gguf/constants.py`, from which `tests/fixtures/gguf/types.txt` is written and checked against
//! this table).

/// A ggml tensor type (`enum ggml_type` in `ggml.h`), by its id in the file.
///
/// The names are ggml's, underscores included, so they can be searched for in llama.cpp's sources.
/// Ids 4, 5 (the removed Q4_2/Q4_3) and 31–33, 36–38 (removed repacked layouts) are not types.
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// 32 weights: f16 scale `d`, 16 bytes of 4-bit codes; `w = d·(q − 8)`.
    Q4_0,
    /// 32 weights: f16 `d`, f16 `m`, 16 bytes of 4-bit codes; `w = d·q + m`.
    Q4_1,
    /// 32 weights: f16 `d`, 32 high bits, 16 bytes of low nibbles; `w = d·(q − 16)`.
    Q5_0,
    /// 32 weights: f16 `d`, f16 `m`, 32 high bits, 16 bytes of low nibbles; `w = d·q + m`.
    Q5_1,
    /// 32 weights: f16 `d`, 32 signed bytes; `w = d·q`.
    Q8_0,
    /// 32 weights: f32 `d`, f32 `s`, 32 signed bytes (an activation type).
    Q8_1,
    /// 256 weights in 16 groups of 16, 2-bit codes, 4-bit scales and mins.
    Q2_K,
    /// 256 weights in 16 groups of 16, 3-bit codes, 6-bit scales.
    Q3_K,
    /// 256 weights in 8 groups of 32, 4-bit codes, 6-bit scales and mins.
    Q4_K,
    /// 256 weights in 8 groups of 32, 5-bit codes, 6-bit scales and mins.
    Q5_K,
    /// 256 weights in 16 groups of 16, 6-bit codes, 8-bit scales.
    Q6_K,
    /// 256 weights: f32 `d`, 256 signed bytes, 16 i16 group sums (an activation type).
    Q8_K,
    /// I-quant, 2.06 bits per weight.
    IQ2_XXS,
    /// I-quant, 2.31 bits per weight.
    IQ2_XS,
    /// I-quant, 3.06 bits per weight.
    IQ3_XXS,
    /// I-quant, 1.56 bits per weight.
    IQ1_S,
    /// I-quant, 4.5 bits per weight, non-linear 4-bit codes in blocks of 32.
    IQ4_NL,
    /// I-quant, 3.44 bits per weight.
    IQ3_S,
    /// I-quant, 2.5 bits per weight.
    IQ2_S,
    /// I-quant, 4.25 bits per weight.
    IQ4_XS,
    /// 8-bit integer.
    I8,
    /// 16-bit integer.
    I16,
    /// 32-bit integer.
    I32,
    /// 64-bit integer.
    I64,
    /// IEEE binary64.
    F64,
    /// I-quant, 1.75 bits per weight.
    IQ1_M,
    /// bfloat16.
    BF16,
    /// Ternary, 1.69 bits per weight.
    TQ1_0,
    /// Ternary, 2.06 bits per weight.
    TQ2_0,
    /// 32 weights: an E8M0 exponent byte, 16 bytes of E2M1 codes (OCP microscaling).
    MXFP4,
    /// 64 weights: four E4M3 scales, 32 bytes of E2M1 codes.
    NVFP4,
    /// 128 weights: f16 scale, 16 bytes of 1-bit codes.
    Q1_0,
}

/// One row of the table: what a type's id, name and block layout are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypeTraits {
    /// The type.
    pub ty: GgmlType,
    /// Its id in a GGUF tensor info (`ggml_type`).
    pub id: u32,
    /// ggml's name (`ggml_type_name`).
    pub name: &'static str,
    /// Elements per block (1 for plain scalar types).
    pub block_elems: u32,
    /// Bytes per block.
    pub block_bytes: u32,
}

const fn t(ty: GgmlType, id: u32, name: &'static str, block_elems: u32, block_bytes: u32) -> TypeTraits {
    TypeTraits { ty, id, name, block_elems, block_bytes }
}

/// Every ggml type a GGUF may name, by id (ggml's `type_traits`; `QK_K` = 256).
pub const GGML_TYPES: [TypeTraits; 34] = {
    use GgmlType::*;
    [
        t(F32, 0, "F32", 1, 4),
        t(F16, 1, "F16", 1, 2),
        t(Q4_0, 2, "Q4_0", 32, 2 + 16),
        t(Q4_1, 3, "Q4_1", 32, 2 + 2 + 16),
        t(Q5_0, 6, "Q5_0", 32, 2 + 4 + 16),
        t(Q5_1, 7, "Q5_1", 32, 2 + 2 + 4 + 16),
        t(Q8_0, 8, "Q8_0", 32, 2 + 32),
        // ggml's block_q8_1 (f16 d, f16 s, 32 × i8): 36 bytes. gguf-py 0.19.0 still says 40 (f32 d and s).
        t(Q8_1, 9, "Q8_1", 32, 2 + 2 + 32),
        t(Q2_K, 10, "Q2_K", 256, 2 + 2 + 16 + 64),
        t(Q3_K, 11, "Q3_K", 256, 2 + 64 + 32 + 12),
        t(Q4_K, 12, "Q4_K", 256, 2 + 2 + 128 + 12),
        t(Q5_K, 13, "Q5_K", 256, 2 + 2 + 128 + 32 + 12),
        t(Q6_K, 14, "Q6_K", 256, 2 + 128 + 64 + 16),
        t(Q8_K, 15, "Q8_K", 256, 4 + 256 + 32),
        t(IQ2_XXS, 16, "IQ2_XXS", 256, 2 + 64),
        t(IQ2_XS, 17, "IQ2_XS", 256, 2 + 64 + 8),
        t(IQ3_XXS, 18, "IQ3_XXS", 256, 2 + 64 + 32),
        t(IQ1_S, 19, "IQ1_S", 256, 2 + 32 + 16),
        t(IQ4_NL, 20, "IQ4_NL", 32, 2 + 16),
        t(IQ3_S, 21, "IQ3_S", 256, 2 + 64 + 32 + 8 + 4),
        t(IQ2_S, 22, "IQ2_S", 256, 2 + 64 + 16),
        t(IQ4_XS, 23, "IQ4_XS", 256, 2 + 2 + 128 + 4),
        t(I8, 24, "I8", 1, 1),
        t(I16, 25, "I16", 1, 2),
        t(I32, 26, "I32", 1, 4),
        t(I64, 27, "I64", 1, 8),
        t(F64, 28, "F64", 1, 8),
        t(IQ1_M, 29, "IQ1_M", 256, 32 + 16 + 8),
        t(BF16, 30, "BF16", 1, 2),
        t(TQ1_0, 34, "TQ1_0", 256, 2 + 52),
        t(TQ2_0, 35, "TQ2_0", 256, 2 + 64),
        t(MXFP4, 39, "MXFP4", 32, 1 + 16),
        t(NVFP4, 40, "NVFP4", 64, 4 + 32),
        t(Q1_0, 41, "Q1_0", 128, 2 + 16),
    ]
};

impl GgmlType {
    /// The type with id `id`, or `None` for an id no ggml type has.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GGML_TYPES.iter().find(|r| r.id == id).map(|r| r.ty)
    }

    /// This type's row of [`GGML_TYPES`].
    pub fn traits(self) -> &'static TypeTraits {
        GGML_TYPES.iter().find(|r| r.ty == self).expect("every GgmlType has a row in GGML_TYPES")
    }

    /// ggml's name ("Q4_K").
    pub fn name(self) -> &'static str {
        self.traits().name
    }

    /// Elements per block.
    pub fn block_elems(self) -> u32 {
        self.traits().block_elems
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u32 {
        self.traits().block_bytes
    }

    /// The bytes of `n_elems` elements, or `None` when `n_elems` is not a whole number of blocks or
    /// the size overflows a `u64`.
    pub fn bytes_for(self, n_elems: u64) -> Option<u64> {
        let tr = self.traits();
        if !n_elems.is_multiple_of(u64::from(tr.block_elems)) {
            return None;
        }
        (n_elems / u64::from(tr.block_elems)).checked_mul(u64::from(tr.block_bytes))
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names_are_unique_and_round_trip() {
        for (i, r) in GGML_TYPES.iter().enumerate() {
            assert_eq!(GgmlType::from_id(r.id), Some(r.ty));
            assert_eq!(r.ty.traits(), r);
            assert_eq!(format!("{:?}", r.ty), r.name, "the variant is spelled as ggml names it");
            for other in &GGML_TYPES[i + 1..] {
                assert_ne!(r.id, other.id);
                assert_ne!(r.name, other.name);
            }
        }
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(removed), None, "id {removed}");
        }
    }

    #[test]
    fn the_table_equals_gguf_py_constants() {
        // tests/fixtures/gguf/types.txt is gguf-py 0.19.0's GGML_QUANT_SIZES, written by
        // make_fixtures.py: "<id> <name> <block elements> <block bytes>" per line.
        let text = include_str!("../../../../tests/fixtures/gguf/types.txt");
        let mut n = 0;
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            let id: u32 = f[0].parse().unwrap();
            let ty = GgmlType::from_id(id).unwrap_or_else(|| panic!("gguf-py has id {id} ({})", f[1]));
            let tr = ty.traits();
            // The one place this table follows ggml over gguf-py: Q8_1's block is 36 bytes in ggml.
            let want_bytes = if ty == GgmlType::Q8_1 { "36" } else { f[3] };
            assert_eq!(
                (tr.name, tr.block_elems.to_string().as_str(), tr.block_bytes.to_string().as_str()),
                (f[1], f[2], want_bytes)
            );
            n += 1;
        }
        assert_eq!(n, GGML_TYPES.len(), "gguf-py and this table list the same types");
    }

    #[test]
    fn bytes_for_counts_whole_blocks() {
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4_K.bytes_for(100), None);
        assert_eq!(GgmlType::F32.bytes_for(3), Some(12));
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
        assert_eq!(GgmlType::MXFP4.bytes_for(64), Some(34));
    }
}
