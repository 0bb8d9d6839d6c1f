//! A host's link down and up: what the cluster sees, and what a client's
//! connection through a link that went silent does.

use super::*;

/// The link to the host of shard 0's primary goes down and comes back: a
/// client on a third host sees that server unreachable while the replica
/// on the second host keeps serving, and both serving again once the link
/// is back.
#[test]
fn a_hosts_link_going_down_isolates_it_and_it_returns_with_the_link() {
    let Some(cluster) = NetCluster::create_or_skip(3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // Shard 0 of 1: group 0's server on host 1, group 1's on host 2.
    let (_servers, addresses) = start_fleet(&cluster, 1, dir.path(), 3, &|_, _| inference());
    cluster.set_link(1, false);
    let isolated = until(&cluster, 3, &addresses, Duration::from_secs(30), |s| {
        s == [(false, false), (true, true)]
    });
    cluster.set_link(1, true);
    let back = until(&cluster, 3, &addresses, Duration::from_secs(30), |s| {
        s == [(true, true), (true, true)]
    });
    eprintln!(
        "drill netns link-down: 3 hosts (namespaces), servers on 2; \
         link of host 1 down: unreachable from host 3 within {:.2} s while host 2 serves; \
         link up: both serving again within {:.2} s",
        isolated.as_secs_f64(),
        back.as_secs_f64()
    );
}

/// A TCP link that goes silent for 7 s, with a call left unanswered on
/// it, is closed by the channel at the next timed-out attempt (calls
/// timing out for 2 s with nothing heard: `rpc/src/silence.rs`), so calls
/// reconnect as soon as the link is back. Before, the stale connection
/// stayed: calls after the link's return waited for TCP's next
/// retransmission, which after a 7 s outage is 5-6 s later (and 20 s or
/// more after 30 s: drill 2's full profile found it).
#[test]
fn a_connection_through_a_silent_link_is_dropped_and_calls_reconnect_when_it_returns() {
    let Some(cluster) = NetCluster::create_or_skip(2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("{}:7000", cluster.addr(1));
    let _server = PsProcess::spawn_under(
        cluster.prefix(1),
        &ps_server_bin(),
        &PsServerConfig {
            listen: addr.clone(),
            ..inference()
        },
        dir.path(),
        "server",
        &[],
    );
    until(
        &cluster,
        2,
        std::slice::from_ref(&addr),
        Duration::from_secs(30),
        |s| s == [(true, true)],
    );
    cluster.run_on(2, || {
        runtime().block_on(async {
            let config = tessera_rpc::ChannelConfig {
                connect_timeout_ms: 200,
                ..Default::default()
            };
            let channel = tessera_rpc::Channel::lazy(&addr, config).unwrap();
            let data = tessera_proto::v1::ParameterServerClient::new(channel);
            let call = |ms| {
                let data = data.clone();
                async move {
                    data.fetch_with_options(
                        tessera_proto::v1::FetchRequest {
                            table: "emb".into(),
                            shard: 0,
                            keys: vec![1, 2, 3],
                        },
                        &tessera_rpc::CallOptions::with_timeout(Duration::from_millis(ms)),
                    )
                    .await
                }
            };
            call(5000).await.unwrap();
            cluster.set_link(1, false);
            // A call goes out on the connection and is not answered.
            assert!(call(300).await.is_err());
            tokio::time::sleep(Duration::from_secs(7)).await;
            cluster.set_link(1, true);
            let up = Instant::now();
            let mut failed = 0;
            while call(300).await.is_err() {
                failed += 1;
                assert!(
                    up.elapsed() < Duration::from_secs(3),
                    "no call answered within 3 s of the link's return ({failed} failed)"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            eprintln!(
                "silent link 7 s: calls answered again {:.0} ms after its return ({failed} failed first)",
                up.elapsed().as_secs_f64() * 1000.0
            );
        });
    });
}
