//! Row files as a replica receives them from another server (a shard
//! copy) and as a server reads them from a checkpoint: whatever the bytes,
//! decoding answers or refuses, and never panics or over-allocates; what
//! it accepts encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_ps_server::rowfile::{decode, encode};

fuzz_target!(|data: &[u8]| {
    let Some((&shape, bytes)) = data.split_first() else {
        return;
    };
    let (dim, slots) = (u32::from(shape % 17) + 1, u32::from(shape / 17 % 3));
    if let Ok(image) = decode(bytes, dim, slots) {
        for row in &image.rows {
            assert_eq!(row.values.len(), dim as usize);
            assert_eq!(row.state.len(), (dim * slots) as usize);
        }
        assert_eq!(encode(&image, dim, slots), bytes);
    }
});
