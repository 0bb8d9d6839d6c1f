//! Arbitrary Fetch and Push requests against a small store: whatever a
//! client sends, the server answers or refuses, and never panics.
#![no_main]

use std::sync::OnceLock;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tessera_proto::v1::{FetchRequest, PushRequest};
use tessera_ps_server::config::{Initializer, NonFinite, OptimizerConfig};
use tessera_ps_server::{PushId, Store, StoreConfig, TableConfig};

fn store() -> &'static Store {
    static STORE: OnceLock<Store> = OnceLock::new();
    STORE.get_or_init(|| {
        Store::new(&StoreConfig {
            num_shards: 2,
            shards: vec![0, 1],
            max_keys_per_request: 4096,
            tables: vec![
                TableConfig {
                    optimizer: OptimizerConfig::adam(0.1),
                    initializer: Initializer::Normal { std: 0.1 },
                    max_rows: Some(256),
                    ..TableConfig::new("t", 4)
                },
                TableConfig {
                    optimizer: OptimizerConfig::adagrad(0.1),
                    non_finite: NonFinite::Clip,
                    ..TableConfig::new("c", 2)
                },
            ],
            ..StoreConfig::default()
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let body = Bytes::copy_from_slice(body);
    if which % 2 == 0 {
        if let Ok(request) = FetchRequest::decode(body)
            && let Ok((dim, values)) = store().fetch(&request.table, request.shard, &request.keys)
        {
            assert_eq!(values.len(), request.keys.len() * dim as usize * 4);
        }
    } else if let Ok(request) = PushRequest::decode(body) {
        let id = PushId {
            worker: request.worker_id,
            sequence: request.sequence,
        };
        let _ = store().push(
            &request.table,
            request.shard,
            &request.keys,
            &request.gradients,
            id,
        );
    }
});
