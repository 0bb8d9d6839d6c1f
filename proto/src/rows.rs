//! Encoding of embedding rows in `bytes` fields: contiguous little-endian
//! f32, row after row.

/// Bytes of one f32 on the wire.
pub const F32_BYTES: usize = 4;

/// Appends `values` to `out` as little-endian f32.
pub fn put_f32s(out: &mut Vec<u8>, values: &[f32]) {
    out.reserve(values.len() * F32_BYTES);
    for value in values {
        out.extend_from_slice(&value.to_le_bytes());
    }
}

/// Writes `values` as little-endian f32 into `out`, which must hold exactly
/// `values.len() * 4` bytes; returns `false` (writing nothing) otherwise.
pub fn write_f32s(out: &mut [u8], values: &[f32]) -> bool {
    if out.len() != values.len() * F32_BYTES {
        return false;
    }
    for (chunk, value) in out.chunks_exact_mut(F32_BYTES).zip(values) {
        chunk.copy_from_slice(&value.to_le_bytes());
    }
    true
}

/// Decodes little-endian f32 from `bytes` into `out` (which must hold
/// exactly `bytes.len() / 4` values).
///
/// Returns `false`, leaving `out` untouched, when the lengths disagree.
pub fn get_f32s(bytes: &[u8], out: &mut [f32]) -> bool {
    if bytes.len() != out.len() * F32_BYTES {
        return false;
    }
    for (value, chunk) in out.iter_mut().zip(bytes.chunks_exact(F32_BYTES)) {
        *value = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
    }
    true
}

/// The number of f32 in `bytes`, if it is a whole number of them.
pub fn f32_count(bytes: &[u8]) -> Option<usize> {
    bytes
        .len()
        .is_multiple_of(F32_BYTES)
        .then_some(bytes.len() / F32_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip(values in proptest::collection::vec(any::<f32>(), 0..64)) {
            let mut wire = Vec::new();
            put_f32s(&mut wire, &values);
            prop_assert_eq!(f32_count(&wire), Some(values.len()));
            let mut written = vec![0u8; wire.len()];
            prop_assert!(write_f32s(&mut written, &values));
            prop_assert_eq!(&written, &wire);
            let mut back = vec![0f32; values.len()];
            prop_assert!(get_f32s(&wire, &mut back));
            for (a, b) in values.iter().zip(&back) {
                prop_assert_eq!(a.to_bits(), b.to_bits());
            }
        }
    }

    #[test]
    fn length_mismatch_is_refused() {
        let mut out = [0f32; 2];
        assert!(!get_f32s(&[0u8; 7], &mut out));
        assert!(!write_f32s(&mut [0u8; 7], &out));
        assert_eq!(f32_count(&[0u8; 7]), None);
    }
}
