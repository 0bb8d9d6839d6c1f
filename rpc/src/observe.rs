//! The RPC layer's metric names, in one place so that they stay stable.
//!
//! They follow the OpenTelemetry RPC semantic conventions where those fit
//! (`rpc.client.duration`, `rpc.server.duration`, labelled with the method
//! path and the status code) in Prometheus spelling with a `tessera_`
//! prefix, and add what the conventions do not cover: attempts, retries,
//! the retry budget, quarantine and the transport ladder. Durations are
//! histograms in seconds; the binaries give them explicit buckets
//! ([`DURATION_BUCKETS`]).
//!
//! Labels: `method` (`/package.Service/Method`), `code` (status code in
//! snake case, `ok` for success), `transport` (`tcp` or `rdma`: what the
//! attempt actually went over, after any fallback).

/// Histogram: one whole client call, retries included (`method`, `code`).
pub const CLIENT_CALL_DURATION: &str = "tessera_rpc_client_duration_seconds";
/// Counter: client calls started (`method`).
pub const CLIENT_CALLS_STARTED: &str = "tessera_rpc_client_calls_started_total";
/// Counter: client calls finished (`method`, `code`).
pub const CLIENT_CALLS_FINISHED: &str = "tessera_rpc_client_calls_finished_total";
/// Histogram: one attempt of a call on one server (`method`, `code`,
/// `transport`).
pub const CLIENT_ATTEMPT_DURATION: &str = "tessera_rpc_client_attempt_duration_seconds";
/// Counter: retries started (`method`).
pub const CLIENT_RETRIES: &str = "tessera_rpc_client_retries_total";
/// Counter: attempts moved at once to a replica not tried yet because the
/// failed one did no work (refused or failed dial, listener gone, server
/// not ready or shutting down), outside the retry coin and budget
/// (`method`).
pub const CLIENT_REDIRECTS: &str = "tessera_rpc_client_unprocessed_redirects_total";
/// Counter: retries not made because the budget was empty.
pub const CLIENT_BUDGET_EXHAUSTED: &str = "tessera_rpc_client_retry_budget_exhausted_total";
/// Counter: connections that could not be made (refused or timed out).
pub const CLIENT_CONNECT_FAILURES: &str = "tessera_rpc_client_connect_failures_total";
/// Counter: responses that came after their caller gave up.
pub const CLIENT_LATE_RESPONSES: &str = "tessera_rpc_client_late_responses_total";
/// Counter: replicas put into quarantine.
pub const QUARANTINE_EJECTIONS: &str = "tessera_rpc_client_quarantine_ejections_total";
/// Counter: quarantined replicas readmitted (cooldown over, or cleared).
pub const QUARANTINE_READMISSIONS: &str = "tessera_rpc_client_quarantine_readmissions_total";
/// Counter: RDMA reconnects after a failed RDMA path (first ladder rung).
pub const CLIENT_RECONNECTS: &str = "tessera_rpc_client_rdma_reconnects_total";
/// Counter: destinations moved from RDMA to TCP.
pub const CLIENT_FALLBACKS: &str = "tessera_rpc_client_tcp_fallbacks_total";
/// Counter: destinations moved back from TCP to RDMA by a probe.
pub const CLIENT_FALLBACK_RETURNS: &str = "tessera_rpc_client_rdma_returns_total";
/// Counter: TCP links closed as silent (calls timing out for 2 s with
/// nothing heard, see `silence.rs`).
pub const CLIENT_SILENT_LINKS: &str = "tessera_rpc_client_silent_links_total";

/// Histogram: one request handled by a server (`method`, `code`).
pub const SERVER_DURATION: &str = "tessera_rpc_server_duration_seconds";
/// Counter: requests a server finished (`method`, `code`).
pub const SERVER_REQUESTS: &str = "tessera_rpc_server_requests_total";
/// Counter: requests dropped because their deadline had passed (`method`).
pub const SERVER_DEADLINE_DROPPED: &str = "tessera_rpc_server_deadline_dropped_total";
/// Counter: connections a server accepted.
pub const SERVER_CONNECTIONS: &str = "tessera_rpc_server_connections_total";
/// Counter: malformed frames a server received.
pub const SERVER_PROTOCOL_ERRORS: &str = "tessera_rpc_server_protocol_errors_total";
/// Requests a stopping server answered `Unavailable` instead of serving
/// (it was draining its connections).
pub const SERVER_REFUSED_DRAINING: &str = "tessera_rpc_server_refused_draining_total";
/// Requests refused because their connection had
/// `max_requests_per_connection` in flight (labels: `method`).
pub const SERVER_REFUSED_CONCURRENCY: &str = "tessera_rpc_server_refused_concurrency_total";
/// Requests refused because the caller's certificate lacked the role the
/// service requires (labels: `method`).
pub const SERVER_REFUSED_ROLE: &str = "tessera_rpc_server_refused_role_total";
/// Responses over `max_message_size`, answered `ResourceExhausted`
/// instead (labels: `method`).
pub const SERVER_OVERSIZED_RESPONSES: &str = "tessera_rpc_server_oversized_responses_total";

/// Bucket bounds (seconds) for every duration histogram: 25 µs to 10 s,
/// roughly ×2.5 apart, so that both RDMA's tens of microseconds and TCP
/// fallbacks' milliseconds resolve.
pub const DURATION_BUCKETS: &[f64] = &[
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 10.0,
];

/// Why the Prometheus endpoint could not be started.
#[derive(Debug, thiserror::Error)]
#[error("metrics endpoint on {addr}: {cause}")]
pub struct MetricsEndpointError {
    /// The address asked for.
    pub addr: String,
    /// Why.
    #[source]
    pub cause: MetricsEndpointCause,
}

/// What failed in [`install_prometheus`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsEndpointCause {
    /// The address is not `host:port`.
    #[error(transparent)]
    Address(#[from] std::net::AddrParseError),
    /// The port could not be bound (taken, or not allowed).
    #[error(transparent)]
    Bind(#[from] std::io::Error),
    /// The exporter refused its settings, or a recorder was installed
    /// already.
    #[error(transparent)]
    Exporter(#[from] metrics_exporter_prometheus::BuildError),
}

/// Installs the process's metrics recorder: a Prometheus endpoint on
/// `addr` (`GET /metrics` in the text format), with [`DURATION_BUCKETS`]
/// for every `*_seconds` histogram. Call once per process, inside a tokio
/// runtime (the binaries do; libraries never install a recorder).
///
/// metrics-exporter-prometheus is the exporter of the `metrics` facade
/// that the whole project records into; its push-gateway feature is off to
/// keep builds lean.
pub fn install_prometheus(addr: &str) -> Result<std::net::SocketAddr, MetricsEndpointError> {
    let error = |cause: MetricsEndpointCause| MetricsEndpointError {
        addr: addr.to_owned(),
        cause,
    };
    let socket: std::net::SocketAddr = addr
        .parse()
        .map_err(|err| error(MetricsEndpointCause::Address(err)))?;
    // Bind first so that a taken port is reported here, not in a
    // background task's log.
    let probe = std::net::TcpListener::bind(socket).map_err(|err| error(err.into()))?;
    let bound = probe.local_addr().map_err(|err| error(err.into()))?;
    drop(probe);
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(bound)
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            DURATION_BUCKETS,
        )
        .map_err(|err| error(err.into()))?
        .install()
        .map_err(|err| error(err.into()))?;
    Ok(bound)
}

/// The `transport` label of a connection kind.
pub(crate) fn transport_label(kind: tessera_transport::TransportKind) -> &'static str {
    kind.as_str()
}

/// A client's (a channel's or a replica set's) handles of its per-method
/// call metrics: the started counter, and the finished counter and
/// duration histogram of calls that end OK, resolved on a method's first
/// call (and a channel's attempt histogram per method and transport). A
/// lookup in a Prometheus registry hashes the name and labels; with three
/// per call and as many on the server, the rpc benchmark with Prometheus
/// installed lost 4-9% of its Health throughput to them. Calls that
/// fail are rare and look theirs up. Handles come from the recorder
/// installed when they are resolved: install it (`install_prometheus`)
/// before the first call, as the binaries do first thing.
#[derive(Default)]
pub(crate) struct CallMetrics {
    methods: dashmap::DashMap<u32, std::sync::Arc<MethodHandles>>,
    /// The attempt histogram of attempts that end OK, by method id and
    /// transport label.
    attempts_ok: dashmap::DashMap<(u32, &'static str), metrics::Histogram>,
}

impl std::fmt::Debug for CallMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallMetrics")
            .field("methods", &self.methods.len())
            .finish()
    }
}

/// One method's handles ([`CallMetrics`]).
pub(crate) struct MethodHandles {
    path: &'static str,
    started: metrics::Counter,
    finished_ok: metrics::Counter,
    duration_ok: metrics::Histogram,
}

impl CallMetrics {
    /// Records an attempt of method `id` (`path`) over `transport` that
    /// ended with `code`, which took `took` seconds.
    pub(crate) fn attempt(
        &self,
        id: u32,
        path: &'static str,
        transport: &'static str,
        code: crate::Code,
        took: f64,
    ) {
        if code != crate::Code::Ok {
            metrics::histogram!(
                CLIENT_ATTEMPT_DURATION,
                "method" => path,
                "code" => code.label(),
                "transport" => transport
            )
            .record(took);
            return;
        }
        if let Some(histogram) = self.attempts_ok.get(&(id, transport)) {
            histogram.record(took);
            return;
        }
        let ok = crate::Code::Ok.label();
        let histogram = metrics::histogram!(
            CLIENT_ATTEMPT_DURATION,
            "method" => path,
            "code" => ok,
            "transport" => transport
        );
        histogram.record(took);
        self.attempts_ok.insert((id, transport), histogram);
    }

    fn handles(&self, method: &'static crate::MethodDescriptor) -> std::sync::Arc<MethodHandles> {
        if let Some(handles) = self.methods.get(&method.id) {
            return std::sync::Arc::clone(&handles);
        }
        let path = method.path;
        let ok = crate::Code::Ok.label();
        let handles = std::sync::Arc::new(MethodHandles {
            path,
            started: metrics::counter!(CLIENT_CALLS_STARTED, "method" => path),
            finished_ok: metrics::counter!(CLIENT_CALLS_FINISHED, "method" => path, "code" => ok),
            duration_ok: metrics::histogram!(CLIENT_CALL_DURATION, "method" => path, "code" => ok),
        });
        self.methods
            .entry(method.id)
            .or_insert(handles)
            .value()
            .clone()
    }
}

/// Runs one whole client call of `method` in `span`, decodes its answer,
/// and records it: started and finished counters, the call duration.
pub(crate) async fn measured_call<Resp>(
    resolved: &CallMetrics,
    method: &'static crate::MethodDescriptor,
    span: tracing::Span,
    call: impl std::future::Future<Output = Result<bytes::Bytes, crate::RpcError>>,
) -> Result<Resp, crate::RpcError>
where
    Resp: prost::Message + Default,
{
    use tracing::Instrument;
    let handles = resolved.handles(method);
    let started = std::time::Instant::now();
    handles.started.increment(1);
    let result = call
        .instrument(span)
        .await
        .and_then(|body| Resp::decode(body).map_err(crate::RpcError::from));
    let took = started.elapsed().as_secs_f64();
    match &result {
        Ok(_) => {
            handles.finished_ok.increment(1);
            handles.duration_ok.record(took);
        }
        Err(err) => {
            let (method, code) = (handles.path, err.code().label());
            metrics::counter!(CLIENT_CALLS_FINISHED, "method" => method, "code" => code)
                .increment(1);
            metrics::histogram!(CLIENT_CALL_DURATION, "method" => method, "code" => code)
                .record(took);
        }
    }
    result
}

/// Sends the process's `tracing` events to stderr, filtered by `RUST_LOG`
/// (else `default`, for example `"info"`), coloured only when stderr is a
/// terminal (a log file stays plain text). For binaries: call it once,
/// first thing.
pub fn init_logging(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };

    use super::*;
    use crate::sync::LockExt;

    /// Counts registrations and what each series received.
    #[derive(Default)]
    struct Tally {
        registrations: Mutex<HashMap<String, u64>>,
        counters: Mutex<HashMap<String, Arc<AtomicU64>>>,
        records: Mutex<HashMap<String, Arc<Samples>>>,
    }

    #[derive(Default)]
    struct Samples(Mutex<Vec<f64>>);

    impl metrics::HistogramFn for Samples {
        fn record(&self, value: f64) {
            self.0.locked().push(value);
        }
    }

    fn series(key: &Key) -> String {
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        format!("{}{{{}}}", key.name(), labels.join(","))
    }

    impl Recorder for Tally {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            let name = series(key);
            *self.registrations.locked().entry(name.clone()).or_default() += 1;
            Counter::from_arc(Arc::clone(self.counters.locked().entry(name).or_default()))
        }

        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }

        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            let name = series(key);
            *self.registrations.locked().entry(name.clone()).or_default() += 1;
            Histogram::from_arc(Arc::clone(self.records.locked().entry(name).or_default()))
        }
    }

    impl Tally {
        fn count(&self, series: &str) -> u64 {
            self.counters
                .locked()
                .get(series)
                .map_or(0, |c| c.load(Ordering::SeqCst))
        }

        fn samples(&self, series: &str) -> usize {
            self.records
                .locked()
                .get(series)
                .map_or(0, |s| s.0.locked().len())
        }

        fn registered(&self, series: &str) -> u64 {
            self.registrations
                .locked()
                .get(series)
                .copied()
                .unwrap_or(0)
        }
    }

    static METHOD: crate::MethodDescriptor = crate::MethodDescriptor {
        name: "Call",
        path: "/test.Svc/Call",
        id: 7,
        service: 1,
        idempotent: true,
    };

    /// Calls that end OK use the handles resolved on the first call (one
    /// registration, every call counted); a failure is counted under its
    /// own code.
    #[test]
    fn call_metrics_resolve_once_and_count_every_call() {
        let tally = Tally::default();
        metrics::with_local_recorder(&tally, || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let call_metrics = CallMetrics::default();
            for _ in 0..3 {
                let answer: Result<(), crate::RpcError> = runtime.block_on(measured_call(
                    &call_metrics,
                    &METHOD,
                    tracing::Span::none(),
                    async { Ok(bytes::Bytes::new()) },
                ));
                answer.unwrap();
                call_metrics.attempt(METHOD.id, METHOD.path, "tcp", crate::Code::Ok, 0.001);
            }
            let failed: Result<(), crate::RpcError> = runtime.block_on(measured_call(
                &call_metrics,
                &METHOD,
                tracing::Span::none(),
                async { Err(crate::RpcError::Status(crate::Status::unavailable("gone"))) },
            ));
            assert!(failed.is_err());
            call_metrics.attempt(
                METHOD.id,
                METHOD.path,
                "tcp",
                crate::Code::Unavailable,
                0.002,
            );
        });
        let m = "method=/test.Svc/Call";
        let started = format!("{CLIENT_CALLS_STARTED}{{{m}}}");
        let ok = format!("{CLIENT_CALLS_FINISHED}{{code=ok,{m}}}");
        let failed = format!("{CLIENT_CALLS_FINISHED}{{code=unavailable,{m}}}");
        let attempts_ok = format!("{CLIENT_ATTEMPT_DURATION}{{code=ok,{m},transport=tcp}}");
        let attempts_failed =
            format!("{CLIENT_ATTEMPT_DURATION}{{code=unavailable,{m},transport=tcp}}");
        assert_eq!(tally.count(&started), 4);
        assert_eq!(tally.registered(&started), 1);
        assert_eq!(tally.count(&ok), 3);
        assert_eq!(tally.registered(&ok), 1);
        assert_eq!(tally.count(&failed), 1);
        assert_eq!(tally.samples(&attempts_ok), 3);
        assert_eq!(tally.registered(&attempts_ok), 1);
        assert_eq!(tally.samples(&attempts_failed), 1);
    }
}
