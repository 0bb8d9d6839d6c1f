//! Size classes: 16-byte steps up to 128 bytes, then four classes per
//! power of two (at most 25% internal waste) up to the largest class.

/// Smallest object, and the alignment of every object.
pub const MIN_SIZE: usize = 16;
const LINEAR_LIMIT: usize = 128;
const LINEAR_CLASSES: usize = LINEAR_LIMIT / MIN_SIZE; // 16..=128: 8 classes
const STEPS_PER_DOUBLING: usize = 4;

/// The class index of an allocation of `size` bytes (`size >= 1`).
#[inline]
pub fn class_of(size: usize) -> usize {
    let size = size.max(1);
    if size <= LINEAR_LIMIT {
        return size.div_ceil(MIN_SIZE) - 1;
    }
    // size in (2^k, 2^(k+1)], k >= 7; four steps of 2^(k-2) each.
    let k = usize::BITS as usize - 1 - (size - 1).leading_zeros() as usize;
    let step = 1usize << (k - 2);
    let within = (size - 1 - (1 << k)) / step; // 0..=3
    LINEAR_CLASSES + (k - 7) * STEPS_PER_DOUBLING + within
}

/// The object size of class `class`.
#[inline]
pub fn class_size(class: usize) -> usize {
    if class < LINEAR_CLASSES {
        return (class + 1) * MIN_SIZE;
    }
    let c = class - LINEAR_CLASSES;
    let k = 7 + c / STEPS_PER_DOUBLING;
    let within = c % STEPS_PER_DOUBLING;
    (1usize << k) + (within + 1) * (1usize << (k - 2))
}

/// Number of classes whose size is at most `max_size`.
pub fn class_count(max_size: usize) -> usize {
    class_of(max_size) + usize::from(class_size(class_of(max_size)) <= max_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn first_classes() {
        let sizes: Vec<usize> = (0..12).map(class_size).collect();
        assert_eq!(
            sizes,
            [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
        );
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(128), 7);
        assert_eq!(class_of(129), 8);
        assert_eq!(class_of(256), 11);
        assert_eq!(class_of(257), 12);
        assert_eq!(class_size(class_of(1 << 20)), 1 << 20);
        assert_eq!(class_count(1 << 20), class_of(1 << 20) + 1);
    }

    proptest! {
        #[test]
        fn class_fits_with_bounded_waste(size in 1usize..(64 << 20)) {
            let class = class_of(size);
            let object = class_size(class);
            prop_assert!(object >= size);
            prop_assert!(object.is_multiple_of(MIN_SIZE));
            prop_assert!(object <= size.max(MIN_SIZE) + size / 4 + MIN_SIZE);
            if class > 0 {
                prop_assert!(class_size(class - 1) < size, "the smallest class that fits");
            }
        }
    }
}
