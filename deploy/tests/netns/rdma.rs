//! Drill 3: the RDMA path to a server breaks while its TCP works.

use super::*;
use tessera_test_support::wait::eventually;

/// How often drill 3's clients probe RDMA while on TCP: 2 s, so that the
/// return is measured within the suite's time (the default is 5 s).
const PROBE_MS: u64 = 2000;

/// Issue 19's drill 3: the fleet over RDMA (soft provider) on hosts 1-4, a
/// client on host 5. The RDMA path to group 0's shard-0 server breaks
/// while its TCP works (its soft NIC's port goes down: every queue pair of
/// the server fails and none can be made, as with an RNIC whose cable is
/// pulled): calls to it move to TCP (target: under 1 s), and back to RDMA
/// once the port is up again (target: within the probe interval). A
/// worker client's Fetches over the whole fleet run meanwhile; what
/// failed is printed.
#[test]
fn a_broken_rdma_path_moves_calls_to_tcp_and_back() {
    let Some(cluster) = NetCluster::create_or_skip(5) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // Each server's NIC port is down while its file exists.
    let port_file = |g: u32, s: u32| dir.path().join(format!("rnic-down-g{g}-s{s}"));
    let rdma = |g, s| tessera_rpc::RdmaConfig {
        soft_port_file: Some(port_file(g, s)),
        ..tessera_rpc::TransportConfig::soft_rdma().rdma
    };
    let _servers = start_fleet(&cluster, 2, dir.path(), 5, &|g, s| PsServerConfig {
        transport: TransportKind::Rdma,
        rdma: rdma(g, s),
        ..inference()
    });
    let victim = fleet_address(&cluster, 2, 0, 0);
    cluster.run_on(5, || {
        runtime().block_on(async {
            let fallback = tessera_rpc::policy::FallbackConfig {
                probe_interval_ms: PROBE_MS,
                ..Default::default()
            };
            // The fleet's worker client over RDMA, Fetching all along.
            let worker = Arc::new(
                PsClient::new(&WorkerConfig {
                    transport: TransportKind::Rdma,
                    rdma: tessera_rpc::TransportConfig::soft_rdma().rdma,
                    fallback,
                    num_shards: 2,
                    servers: fleet(2)
                        .into_iter()
                        .map(|(g, s)| ServerEndpoint {
                            address: fleet_address(&cluster, 2, g, s),
                            shards: vec![s],
                            replica_group: g,
                        })
                        .collect(),
                    call_timeout_ms: 1000,
                    ..WorkerConfig::default()
                })
                .unwrap(),
            );
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            // Its Fetches answered so far.
            let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let load = tokio::spawn({
                let (worker, stop, answered) =
                    (Arc::clone(&worker), Arc::clone(&stop), Arc::clone(&answered));
                async move {
                    let keys: Vec<u64> = (0..64).collect();
                    let (mut ok, mut failed, mut first_error) = (0u64, 0u64, None);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match worker.fetch("emb", &keys).await {
                            Ok(_) => {
                                ok += 1;
                                answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Err(err) => {
                                failed += 1;
                                first_error.get_or_insert(err.to_string());
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    (ok, failed, first_error)
                }
            });
            // A channel of its own to the server whose path breaks: which
            // transport carries its calls.
            let channel = tessera_rpc::Channel::lazy(
                &victim,
                tessera_rpc::ChannelConfig {
                    connect_timeout_ms: 1000,
                    request_timeout_ms: 1000,
                    fallback,
                    transport: tessera_rpc::TransportConfig::soft_rdma(),
                    ..Default::default()
                },
            )
            .unwrap();
            let data = tessera_proto::v1::ParameterServerClient::new(channel.clone());
            let call = || {
                let data = data.clone();
                async move {
                    data.fetch(tessera_proto::v1::FetchRequest {
                        table: "emb".into(),
                        shard: 0,
                        keys: tessera_test_support::keys_of_shard(0, 2, 3),
                    })
                    .await
                }
            };
            call().await.unwrap();
            assert_eq!(channel.current_transport(), Some(TransportKind::Rdma));
            // The fleet's client is on RDMA to every server, its Fetches
            // answered.
            eventually(
                Duration::from_secs(10),
                "the fleet client's Fetches answered, over RDMA to every server",
                || async {
                    let n = answered.load(std::sync::atomic::Ordering::Relaxed);
                    let transports: Vec<(String, Option<TransportKind>)> = (0..2)
                        .filter_map(|shard| worker.replica_set(shard))
                        .flat_map(|set| set.transports())
                        .collect();
                    if n > 0
                        && transports.len() == 4
                        && transports
                            .iter()
                            .all(|(_, t)| *t == Some(TransportKind::Rdma))
                    {
                        Ok(())
                    } else {
                        Err((n, transports))
                    }
                },
            )
            .await;

            std::fs::write(port_file(0, 0), b"").unwrap();
            let broken = Instant::now();
            let mut failed = 0;
            let moved = loop {
                match call().await {
                    Ok(_) if channel.current_transport() == Some(TransportKind::Tcp) => {
                        break broken.elapsed();
                    }
                    Ok(_) => {}
                    Err(_) => failed += 1,
                }
                assert!(
                    broken.elapsed() < Duration::from_secs(10),
                    "calls never moved to TCP"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            // Stays on TCP while the port is down: the probes fail.
            let stay = Instant::now() + Duration::from_millis(PROBE_MS + 500);
            while Instant::now() < stay {
                call().await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(channel.current_transport(), Some(TransportKind::Tcp));

            std::fs::remove_file(port_file(0, 0)).unwrap();
            let repaired = Instant::now();
            let returned = loop {
                call().await.unwrap();
                if channel.current_transport() == Some(TransportKind::Rdma) {
                    break repaired.elapsed();
                }
                assert!(
                    repaired.elapsed() < Duration::from_millis(4 * PROBE_MS),
                    "calls never returned to RDMA"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            // The fleet client's channel to the server is back on RDMA too.
            eventually(
                Duration::from_secs(10),
                "the fleet client's channel to the repaired server back on RDMA",
                || async {
                    let transports = worker
                        .replica_set(0)
                        .map(|set| set.transports())
                        .unwrap_or_default();
                    if transports
                        .iter()
                        .any(|(addr, t)| *addr == victim && *t == Some(TransportKind::Rdma))
                    {
                        Ok(())
                    } else {
                        Err(transports)
                    }
                },
            )
            .await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let (fetched, fetch_failed, first_error) = load.await.unwrap();
            eprintln!(
                "drill netns rdma-path-breaks: 4 servers over RDMA (soft NIC) on hosts 1-4, a client on host 5; \
                 group 0's shard-0 server's NIC port down for {:.1} s, its TCP up: calls to it on TCP {:.0} ms after the break \
                 ({failed} failed on the way); back on RDMA {:.0} ms after the port came up (probe interval {PROBE_MS} ms); \
                 the worker client's Fetches over the fleet meanwhile: {fetched} ok, {fetch_failed} failed (first: {first_error:?})",
                (repaired - broken).as_secs_f64(),
                moved.as_secs_f64() * 1000.0,
                returned.as_secs_f64() * 1000.0,
            );
            assert!(moved < Duration::from_secs(1), "moved to TCP after {moved:?}");
            // A probe that began just before the port came back, and
            // failed, leaves the next one an interval later.
            assert!(
                returned <= Duration::from_millis(2 * PROBE_MS),
                "back on RDMA after {returned:?}"
            );
            // The fleet's client retries a failed attempt on the other
            // replica: its Fetches should not fail (0 in the runs here);
            // held to 1% on two loaded cores, as drill 2.
            assert!(
                fetch_failed * 100 <= fetched + fetch_failed,
                "{fetch_failed} Fetches failed: {first_error:?}"
            );
        });
    });
}
