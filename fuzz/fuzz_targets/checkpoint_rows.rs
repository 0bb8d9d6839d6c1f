//! Row images as a replica receives them from its primary (the shard copy
//! of a sync) and as a server reads them from a checkpoint: whatever the
//! bytes, decoding answers or refuses, and never panics or over-allocates.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_ps_server::checkpoint::decode;

fuzz_target!(|data: &[u8]| {
    let Some((&shape, bytes)) = data.split_first() else {
        return;
    };
    let (dim, slots) = (u32::from(shape % 17) + 1, u32::from(shape / 17 % 3));
    if let Ok(image) = decode(bytes, dim, slots) {
        for (_, _, values, state) in &image.rows {
            assert_eq!(values.len(), dim as usize);
            assert_eq!(state.len(), (dim * slots) as usize);
        }
    }
});
