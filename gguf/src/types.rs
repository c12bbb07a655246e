//! ggml tensor types: ids, block geometry and names (ggml.h `enum ggml_type`,
//! gguf-py `GGML_QUANT_SIZES`). The one table every other module consults.

/// A ggml tensor element type as stored in a GGUF tensor info.
#[allow(non_camel_case_types)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// (type, id, name, elements per block, bytes per block)
const TABLE: &[(GgmlType, u32, &str, u64, u64)] = {
    use GgmlType::*;
    &[
        (F32, 0, "F32", 1, 4),
        (F16, 1, "F16", 1, 2),
        (Q4_0, 2, "Q4_0", 32, 18),
        (Q4_1, 3, "Q4_1", 32, 20),
        (Q5_0, 6, "Q5_0", 32, 22),
        (Q5_1, 7, "Q5_1", 32, 24),
        (Q8_0, 8, "Q8_0", 32, 34),
        (Q8_1, 9, "Q8_1", 32, 40),
        (Q2_K, 10, "Q2_K", 256, 84),
        (Q3_K, 11, "Q3_K", 256, 110),
        (Q4_K, 12, "Q4_K", 256, 144),
        (Q5_K, 13, "Q5_K", 256, 176),
        (Q6_K, 14, "Q6_K", 256, 210),
        (Q8_K, 15, "Q8_K", 256, 292),
        (IQ2_XXS, 16, "IQ2_XXS", 256, 66),
        (IQ2_XS, 17, "IQ2_XS", 256, 74),
        (IQ3_XXS, 18, "IQ3_XXS", 256, 98),
        (IQ1_S, 19, "IQ1_S", 256, 50),
        (IQ4_NL, 20, "IQ4_NL", 32, 18),
        (IQ3_S, 21, "IQ3_S", 256, 110),
        (IQ2_S, 22, "IQ2_S", 256, 82),
        (IQ4_XS, 23, "IQ4_XS", 256, 136),
        (I8, 24, "I8", 1, 1),
        (I16, 25, "I16", 1, 2),
        (I32, 26, "I32", 1, 4),
        (I64, 27, "I64", 1, 8),
        (F64, 28, "F64", 1, 8),
        (IQ1_M, 29, "IQ1_M", 256, 56),
        (BF16, 30, "BF16", 1, 2),
        (TQ1_0, 34, "TQ1_0", 256, 54),
        (TQ2_0, 35, "TQ2_0", 256, 66),
        (MXFP4, 39, "MXFP4", 32, 17),
    ]
};

impl GgmlType {
    fn row(self) -> &'static (GgmlType, u32, &'static str, u64, u64) {
        TABLE.iter().find(|r| r.0 == self).expect("every variant is in TABLE")
    }

    /// Every known type, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|r| r.0)
    }

    /// The type with this GGUF/ggml id, or `None` for removed or unknown ids.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|r| r.1 == id).map(|r| r.0)
    }

    /// The type with this name as ggml spells it (`"Q4_K"`), case-insensitive.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        TABLE.iter().find(|r| r.2.eq_ignore_ascii_case(name)).map(|r| r.0)
    }

    pub fn id(self) -> u32 {
        self.row().1
    }

    /// ggml's spelling, e.g. `"Q4_K"`.
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Elements per quantization block (1 for plain types).
    pub fn block_size(self) -> u64 {
        self.row().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.row().4
    }

    /// Bytes of one row of `ne0` elements, or `None` if `ne0` is not a whole number of
    /// blocks or the size overflows.
    pub fn row_bytes(self, ne0: u64) -> Option<u64> {
        if !ne0.is_multiple_of(self.block_size()) {
            return None;
        }
        (ne0 / self.block_size()).checked_mul(self.type_size())
    }

    /// Whether `memra_gguf::quant` can dequantize this type on the CPU.
    pub fn is_supported(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4_K | Q5_K | Q6_K | IQ4_NL | IQ4_XS
        )
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
    fn ids_and_names_round_trip() {
        for t in GgmlType::all() {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None, "Q4_2 was removed from ggml");
    }

    #[test]
    fn row_bytes_checks_block_divisibility() {
        assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4_K.row_bytes(640), None);
        assert_eq!(GgmlType::Q8_0.row_bytes(640), Some(680));
    }
}
