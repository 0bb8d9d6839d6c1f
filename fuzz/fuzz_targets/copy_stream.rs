//! A shard copy's stream as a replica receives it, chunk by chunk, from
//! another server: whatever the bytes and however they are cut into
//! chunks, the decoder answers or refuses, and never panics or
//! over-allocates; what it hands out has the table's shape.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_ps_server::image::TableShape;
use tessera_ps_server::replication::{CopyDecoder, CopyItem};

fuzz_target!(|data: &[u8]| {
    let Some((&shape, rest)) = data.split_first() else {
        return;
    };
    let Some((&cut, bytes)) = rest.split_first() else {
        return;
    };
    let (dim, slots) = (u32::from(shape % 17) + 1, u32::from(shape / 17 % 3));
    let mut decoder = CopyDecoder::new(|name: &str| {
        (name == "t").then(|| TableShape {
            name: name.to_owned(),
            dim,
            slots,
        })
    });
    let mut items = Vec::new();
    let chunk = usize::from(cut).max(1);
    for piece in bytes.chunks(chunk) {
        if decoder.handle_bytes(piece, &mut items).is_err() {
            return;
        }
    }
    let _ = decoder.finish();
    for item in items {
        if let CopyItem::Row(row) = item {
            assert_eq!(row.values.len(), dim as usize);
            assert_eq!(row.state.len(), (dim * slots) as usize);
        }
    }
});
