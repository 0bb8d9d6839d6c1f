//! The RPC server's limits on what one connection may ask for: requests in
//! flight per connection, and malformed requests (closed, never served).
//! Over TCP and over RDMA with the soft provider.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tessera_rpc::{Channel, Code, ServerConfig, TransportConfig};

#[macro_use]
mod common;
use common::*;

async fn requests_beyond_the_per_connection_cap_are_refused_unrun(t: TransportConfig) {
    let server = start(ServerConfig {
        max_requests_per_connection: 4,
        ..server_config(&t)
    })
    .await;
    let channel = Channel::connect(&server.addr, channel_config(&t))
        .await
        .unwrap();
    let echo = ECHO_DESCRIPTOR.methods[0].id;
    let call = |delay_ms| {
        let channel = channel.clone();
        async move {
            channel
                .call_raw(
                    echo,
                    echo_body(delay_ms),
                    Instant::now() + Duration::from_secs(10),
                    Duration::from_secs(10),
                )
                .await
        }
    };
    let slow: Vec<_> = (0..4).map(|_| tokio::spawn(call(1500))).collect();
    server.wait_echo_started(4).await;
    let err = call(0).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.to_string().contains("max_requests_per_connection"),
        "{err}"
    );
    assert_eq!(
        server.echo_started.load(Ordering::SeqCst),
        4,
        "the refused call never reached its handler"
    );
    for call in slow {
        call.await.unwrap().unwrap();
    }
    // Room again once answers went out.
    call(0).await.unwrap();
    server.shutdown().await;
}

over_both_transports!(requests_beyond_the_per_connection_cap_are_refused_unrun);
