//! The engine driven step by step over soft queue pairs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::*;
use crate::Message;
use crate::pool::{Access, Pool, PoolConfig};
use crate::rdma::engine::{KeepaliveConfig, OFFER_BIT, PREFIX_LEN, PeerInfo, Role, SocketId};
use crate::rdma::window::WindowConfig;
use crate::verbs::soft::{SoftDevice, SoftFabric, SoftFaults};
use crate::verbs::{CompletionQueue, Device, QpCaps, QueuePair, WorkCompletion};

mod data_plane;
mod offers;
mod stateful;

/// One side: engine, device, QP and completion queues.
// Field order is drop order: the QP before the engine that owns its buffers.
struct Side {
    qp: Arc<dyn QueuePair>,
    engine: Engine,
    device: SoftDevice,
    send_cq: Arc<dyn CompletionQueue>,
    recv_cq: Arc<dyn CompletionQueue>,
    send_pool: Pool,
    recv_pool: Pool,
    /// Messages as they arrived, with their socket.
    arrivals: Vec<(SocketId, Bytes)>,
    received: Vec<Bytes>,
    opened: Vec<SocketId>,
    accepted: Vec<SocketId>,
    refused: Vec<SocketId>,
    closed: Vec<SocketId>,
    failure: Option<EngineError>,
    posts: usize,
    posted_wrs: usize,
    max_in_flight: usize,
    max_window_use: usize,
    qp_caps_recv: u32,
}

/// A clock the tests move by hand.
#[derive(Clone, Copy)]
struct Clock {
    start: Instant,
    elapsed: Duration,
}

impl Clock {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            elapsed: Duration::ZERO,
        }
    }

    fn now(&self) -> Instant {
        self.start + self.elapsed
    }

    fn advance(&mut self, by: Duration) {
        self.elapsed += by;
    }
}

impl Side {
    /// A side whose peer may write only through memory windows bound for
    /// its grants (`confined`), as the transport runs by default.
    fn new_with(
        fabric: &SoftFabric,
        name: &str,
        config: &EngineConfig,
        faults: SoftFaults,
        role: Role,
        now: Instant,
        confined: bool,
    ) -> Self {
        let device = fabric.open(name, faults).unwrap();
        Self::on_device(device, name, config, role, now, confined)
    }

    /// A side on `device` (which other sides may share).
    fn on_device(
        device: SoftDevice,
        name: &str,
        config: &EngineConfig,
        role: Role,
        now: Instant,
        confined: bool,
    ) -> Self {
        let recv_access = if confined {
            Access::Windows
        } else {
            Access::RemoteWrite
        };
        let (send_pool, recv_pool) =
            crate::verbs::soft::test_pools_with(&device, name, recv_access);
        let send_cq = device.create_cq(256).unwrap();
        let recv_cq = device.create_cq(256).unwrap();
        let caps = QpCaps {
            max_send_wr: config.send_queue_depth,
            max_recv_wr: config.recv_queue_depth,
            max_sge: config.max_sge,
            rnr_retry: 0,
        };
        let qp = device
            .create_qp(send_cq.clone(), recv_cq.clone(), caps)
            .unwrap();
        qp.init().unwrap();
        let mut engine = Engine::new(
            config.clone(),
            send_pool.clone(),
            recv_pool.clone(),
            role,
            now,
        )
        .unwrap();
        if confined {
            engine.set_windows(
                (0..WINDOWS)
                    .map(|_| device.alloc_window().unwrap())
                    .collect(),
            );
        }
        Self {
            qp,
            engine,
            device,
            send_cq,
            recv_cq,
            send_pool,
            recv_pool,
            arrivals: Vec::new(),
            received: Vec::new(),
            opened: Vec::new(),
            accepted: Vec::new(),
            refused: Vec::new(),
            closed: Vec::new(),
            failure: None,
            posts: 0,
            posted_wrs: 0,
            max_in_flight: 0,
            max_window_use: 0,
            qp_caps_recv: config.recv_queue_depth,
        }
    }

    fn info(&self) -> PeerInfo {
        PeerInfo {
            recv_depth: self.qp_caps_recv,
            recv_buffer: self.engine.recv_buffer_size() as u32,
            keepalive_slot: self.engine.keepalive_slot(),
            shared_receives: false,
        }
    }

    /// One round of the driver loop at `now`; returns whether anything
    /// happened.
    fn step_at(&mut self, poll_recv: bool, now: Instant) -> bool {
        let mut progress = false;
        self.engine.handle_timeout(now);
        if let Some(wrs) = self.engine.poll_recv_post() {
            self.qp
                .post_recv(&wrs)
                .expect("receive queue never overflows");
            progress = true;
        }
        while let Some(batch) = self.engine.poll_transmit(now) {
            self.posts += 1;
            self.posted_wrs += batch.len();
            let (used, limit) = self.engine.window_usage();
            assert!(used <= limit, "window exceeded: {used} > {limit}");
            self.max_window_use = self.max_window_use.max(used);
            self.qp
                .post_send(&batch)
                .expect("the ring never overflows the send queue");
            self.max_in_flight = self.max_in_flight.max(self.engine.in_flight());
            progress = true;
        }
        let mut completions: Vec<WorkCompletion> = Vec::new();
        self.send_cq.poll(&mut completions, 64);
        if poll_recv {
            self.recv_cq.poll(&mut completions, 64);
        }
        for completion in &completions {
            self.engine.handle_completion(completion, now);
            progress = true;
        }
        while let Some(event) = self.engine.poll_event() {
            match event {
                EngineEvent::Message { socket, bytes } => {
                    self.received.push(bytes.clone());
                    self.arrivals.push((socket, bytes));
                }
                EngineEvent::Opened(socket) => self.opened.push(socket),
                EngineEvent::Accepted(socket) => self.accepted.push(socket),
                EngineEvent::Refused(socket) => self.refused.push(socket),
                EngineEvent::Closed(socket) => self.closed.push(socket),
                EngineEvent::Sent(_) => {}
                // No partners in these tests (`stripes.rs`'s own drive them).
                EngineEvent::StripeDone { .. } => {}
                EngineEvent::Failed(err) => self.failure = Some(err),
            }
            progress = true;
        }
        progress
    }

    fn step(&mut self, poll_recv: bool) -> bool {
        self.step_at(poll_recv, Instant::now())
    }
}

fn connected(config: &EngineConfig, faults: SoftFaults) -> (Side, Side) {
    connected_at(config, faults, Instant::now())
}

fn connected_at(config: &EngineConfig, faults: SoftFaults, now: Instant) -> (Side, Side) {
    connected_with(config, faults, now, false)
}

/// Memory windows of each confined side: few, so that grants wait for
/// them in the tests.
const WINDOWS: usize = 4;

/// Two connected sides, each confining the other's writes to its grants
/// (`confined`) or not.
fn connected_with(
    config: &EngineConfig,
    faults: SoftFaults,
    now: Instant,
    confined: bool,
) -> (Side, Side) {
    let fabric = SoftFabric::new();
    let mut a = Side::new_with(&fabric, "a", config, faults, Role::Dialer, now, confined);
    let mut b = Side::new_with(
        &fabric,
        "b",
        config,
        SoftFaults::default(),
        Role::Acceptor,
        now,
        confined,
    );
    connect_sides(&mut a, &mut b, now);
    (a, b)
}

/// Connects two sides' QPs and engines, as the handshake does.
fn connect_sides(a: &mut Side, b: &mut Side, now: Instant) {
    link_qps(a, b);
    let (info_a, info_b) = (a.info(), b.info());
    a.engine.peer_ready(info_b, now);
    b.engine.peer_ready(info_a, now);
}

/// Connects two sides' QPs, each with its receives posted (as at
/// connection setup: before either learns the other's credits); neither
/// engine is told the peer is ready.
fn link_qps(a: &mut Side, b: &mut Side) {
    a.qp.connect(&b.qp.endpoint()).unwrap();
    b.qp.connect(&a.qp.endpoint()).unwrap();
    for side in [&mut *a, &mut *b] {
        let wrs = side.engine.poll_recv_post().unwrap();
        side.qp.post_recv(&wrs).unwrap();
    }
}

/// Runs both sides until neither makes progress.
fn pump(a: &mut Side, b: &mut Side) {
    for _ in 0..1_000_000 {
        let pa = a.step(true);
        let pb = b.step(true);
        if !pa && !pb {
            return;
        }
    }
    panic!("no quiescence");
}

/// `a` opens a socket, `b` accepts it, `a` learns of that.
fn open(a: &mut Side, b: &mut Side) -> SocketId {
    let socket = a.engine.open_socket().unwrap();
    pump(a, b);
    assert!(b.opened.contains(&socket));
    b.engine.accept_socket(socket);
    pump(a, b);
    assert!(a.accepted.contains(&socket));
    socket
}

fn message(pool: &Pool, len: usize, seed: u8) -> Message {
    let mut buf = pool.alloc(len).unwrap();
    for (i, byte) in buf.iter_mut().enumerate() {
        *byte = seed.wrapping_add((i % 251) as u8);
    }
    Message::from(buf.freeze())
}

fn check(received: &Bytes, len: usize, seed: u8) {
    assert_eq!(received.len(), len);
    assert!(
        received
            .iter()
            .enumerate()
            .all(|(i, &b)| b == seed.wrapping_add((i % 251) as u8)),
        "{len}-byte message corrupted"
    );
}

#[test]
fn small_messages_of_every_size_arrive_intact_and_in_order() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    let sizes: Vec<usize> = (0..=config.small_message_limit)
        .step_by(97)
        .chain([config.small_message_limit])
        .collect();
    for (i, &len) in sizes.iter().enumerate() {
        a.engine
            .send(socket, message(&a.send_pool, len, i as u8))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert!(
        a.failure.is_none() && b.failure.is_none(),
        "{:?} {:?}",
        a.failure,
        b.failure
    );
    assert_eq!(b.received.len(), sizes.len());
    for (i, (&len, got)) in sizes.iter().zip(&b.received).enumerate() {
        check(got, len, i as u8);
        let region = crate::pool::lookup(&got[..]).expect("delivered from the receive pool");
        assert_eq!(
            region.pool_id,
            b.recv_pool.id(),
            "no copy out of the receive buffer"
        );
    }
    assert_eq!(a.engine.stats().small_sent as usize, sizes.len());
    assert!(a.engine.is_idle());
}

#[test]
fn large_messages_up_to_64_mib_arrive_intact_in_their_own_buffer() {
    for confined in [false, true] {
        large_messages_case(confined);
    }
}

fn large_messages_case(confined: bool) {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), confined);
    let socket = open(&mut a, &mut b);
    let sizes = [
        config.small_message_limit + 1,
        config.fragment_size - 1,
        config.fragment_size,
        config.fragment_size + 1,
        3 * config.fragment_size + 17,
        1 << 20,
        64 << 20,
    ];
    for (i, &len) in sizes.iter().enumerate() {
        a.engine
            .send(socket, message(&a.send_pool, len, i as u8))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert!(
        a.failure.is_none() && b.failure.is_none(),
        "{:?} {:?}",
        a.failure,
        b.failure
    );
    assert_eq!(b.received.len(), sizes.len());
    // Large messages complete in order among themselves.
    for (i, (&len, got)) in sizes.iter().zip(&b.received).enumerate() {
        check(got, len, i as u8);
        assert_eq!(
            crate::pool::lookup(&got[..]).map(|r| r.pool_id),
            Some(b.recv_pool.id())
        );
    }
    assert_eq!(a.engine.stats().large_sent as usize, sizes.len());
    assert_eq!(b.device.stats().rnr_events, 0);
}

#[test]
fn interleaved_sizes_in_both_directions() {
    for confined in [false, true] {
        interleaved_case(confined);
    }
}

fn interleaved_case(confined: bool) {
    let config = EngineConfig {
        small_message_limit: 1024,
        fragment_size: 8 << 10,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), confined);
    let socket = open(&mut a, &mut b);
    let sizes: Vec<usize> = (0..200)
        .map(|i| [0usize, 10, 1024, 1025, 5000, 70_000, 300_000][i % 7] + i)
        .collect();
    for (i, &len) in sizes.iter().enumerate() {
        a.engine
            .send(socket, message(&a.send_pool, len, i as u8))
            .unwrap();
        b.engine
            .send(socket, message(&b.send_pool, len, (i + 100) as u8))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert!(a.failure.is_none() && b.failure.is_none());
    for (side, offset) in [(&b, 0usize), (&a, 100)] {
        assert_eq!(side.received.len(), sizes.len());
        // Every message arrives exactly once and intact, whatever the order:
        // a message is known by its length and first byte (its seed).
        let mut seen = vec![false; sizes.len()];
        for got in &side.received {
            let i = (0..sizes.len())
                .find(|&j| {
                    !seen[j]
                        && sizes[j] == got.len()
                        && got.first().is_none_or(|&b| b == (j + offset) as u8)
                })
                .expect("a message that was not sent, or one delivered twice");
            seen[i] = true;
            check(got, sizes[i], (i + offset) as u8);
        }
    }
}

#[test]
fn the_ring_never_overflows_and_batches_doorbells() {
    let config = EngineConfig {
        send_queue_depth: 8,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    for i in 0..500 {
        a.engine
            .send(socket, message(&a.send_pool, 100, i as u8))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert_eq!(b.received.len(), 500);
    assert!(a.max_in_flight <= 8, "{} in flight", a.max_in_flight);
    assert!(
        a.posted_wrs > a.posts,
        "several requests per post_send: {} WRs in {} posts",
        a.posted_wrs,
        a.posts
    );
}

#[test]
fn a_flood_from_one_side_never_hits_receiver_not_ready() {
    // The receiver only polls its receive queue every fifth round, so the
    // sender runs out of credits again and again.
    let config = EngineConfig {
        recv_queue_depth: 8,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    for i in 0..2_000 {
        a.engine
            .send(socket, message(&a.send_pool, 64 + i % 2000, i as u8))
            .unwrap();
    }
    for round in 0..1_000_000 {
        let pa = a.step(true);
        let pb = b.step(round % 5 == 0);
        if !pa && !pb && round % 5 == 0 {
            break;
        }
    }
    assert!(
        a.failure.is_none() && b.failure.is_none(),
        "{:?} {:?}",
        a.failure,
        b.failure
    );
    assert_eq!(b.received.len(), 2_000);
    assert_eq!(
        b.device.stats().rnr_events,
        0,
        "credits keep the receive queue from running dry"
    );
    assert!(
        a.engine.stats().credit_stalls > 0,
        "the sender did wait for credits"
    );
}

#[test]
fn a_qp_error_mid_transfer_fails_both_engines_without_hanging_or_leaking() {
    let faults = SoftFaults {
        seed: 3,
        qp_error_per_million: 20_000,
        ..SoftFaults::default()
    };
    let config = EngineConfig {
        fragment_size: 8 << 10,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, faults);
    let socket = open(&mut a, &mut b);
    for i in 0..50 {
        a.engine
            .send(socket, message(&a.send_pool, 200_000, i as u8))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert!(
        matches!(a.failure, Some(EngineError::Completion { .. })),
        "{:?}",
        a.failure
    );
    assert!(b.received.len() < 50);
    assert!(a.device.stats().injected_qp_errors >= 1);
    // The peer learns of it when it next uses the QP (its receives are
    // flushed once the QP pair is torn down).
    b.device.kill();
    pump(&mut a, &mut b);
    assert!(b.failure.is_some(), "the peer's engine fails too");
    // Nothing is held: every buffer went back to its pool.
    let (a_send, a_recv, b_recv) = (
        a.send_pool.clone(),
        a.recv_pool.clone(),
        b.recv_pool.clone(),
    );
    let received = std::mem::take(&mut b.received);
    drop(received);
    drop(a);
    drop(b);
    for pool in [a_send, a_recv, b_recv] {
        pool.flush_thread_cache();
        assert_eq!(
            pool.stats().in_use_bytes,
            0,
            "{} leaked",
            pool.config().name
        );
    }
}

#[test]
fn unregistered_parts_are_copied_once_into_the_send_pool() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    a.engine
        .send(socket, Message::from(vec![7u8; 100]))
        .unwrap();
    a.engine
        .send(socket, Message::from(vec![8u8; 100_000]))
        .unwrap();
    pump(&mut a, &mut b);
    assert_eq!(a.engine.stats().fallback_copies, 2);
    assert_eq!(b.received.len(), 2);
    assert!(b.received[0].iter().all(|&x| x == 7));
    assert!(b.received[1].iter().all(|&x| x == 8));
}

#[test]
fn buffers_of_another_devices_pool_are_copied_not_posted_with_a_foreign_key() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    // Registered memory, but with another hook (as a TCP transport's pool
    // is): its keys mean nothing to this device.
    let foreign = Pool::new(
        PoolConfig::named("foreign"),
        Access::LocalOnly,
        Arc::new(crate::pool::CountingHook::new()),
    )
    .unwrap();
    a.engine.send(socket, message(&foreign, 100, 3)).unwrap();
    a.engine
        .send(socket, message(&foreign, 100_000, 4))
        .unwrap();
    pump(&mut a, &mut b);
    assert!(
        a.failure.is_none() && b.failure.is_none(),
        "{:?} {:?}",
        a.failure,
        b.failure
    );
    assert_eq!(a.engine.stats().fallback_copies, 2);
    check(&b.received[0], 100, 3);
    check(&b.received[1], 100_000, 4);
}

/// Runs both sides on a clock moved by hand, `rounds` rounds of `tick`.
fn run_for(
    a: &mut Side,
    b: &mut Side,
    clock: &mut Clock,
    rounds: usize,
    tick: Duration,
    b_runs: bool,
) {
    for _ in 0..rounds {
        clock.advance(tick);
        a.step_at(true, clock.now());
        if b_runs {
            b.step_at(true, clock.now());
        }
    }
}

#[test]
fn a_hundred_sockets_with_interleaved_sizes_arrive_intact_and_in_per_socket_order() {
    let config = EngineConfig {
        small_message_limit: 2048,
        fragment_size: 16 << 10,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let sockets: Vec<SocketId> = (0..100).map(|_| open(&mut a, &mut b)).collect();
    let sizes = [0usize, 7, 2048, 2049, 30_000, 100, 200_000, 5000];
    // Message j of socket i: size sizes[(i + j) % 8], seed from (i, j).
    let per_socket = 6;
    for j in 0..per_socket {
        for (i, &socket) in sockets.iter().enumerate() {
            let len = sizes[(i + j) % sizes.len()] + i;
            a.engine
                .send(socket, message(&a.send_pool, len, (i * 7 + j) as u8))
                .unwrap();
        }
    }
    pump(&mut a, &mut b);
    assert!(
        a.failure.is_none() && b.failure.is_none(),
        "{:?} {:?}",
        a.failure,
        b.failure
    );
    assert_eq!(b.arrivals.len(), 100 * per_socket);
    for (i, &socket) in sockets.iter().enumerate() {
        let got: Vec<&Bytes> = b
            .arrivals
            .iter()
            .filter(|(s, _)| *s == socket)
            .map(|(_, m)| m)
            .collect();
        assert_eq!(got.len(), per_socket, "socket {i}");
        for (j, message) in got.iter().enumerate() {
            check(message, sizes[(i + j) % sizes.len()] + i, (i * 7 + j) as u8);
        }
    }
    assert_eq!(b.device.stats().rnr_events, 0);
}

#[test]
fn the_scheduler_gives_each_socket_a_turn_per_fragment_of_the_others() {
    let fragment = 8 << 10;
    let config = EngineConfig {
        fragment_size: fragment,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let large: Vec<SocketId> = (0..4).map(|_| open(&mut a, &mut b)).collect();
    let small = open(&mut a, &mut b);
    a.engine.fragment_log.clear();
    for &socket in &large {
        a.engine
            .send(socket, message(&a.send_pool, 1 << 20, 1))
            .unwrap();
    }
    for i in 0..40 {
        a.engine
            .send(small, message(&a.send_pool, 512, i as u8))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert_eq!(b.arrivals.len(), 44);
    let log = &a.engine.fragment_log;
    let n = 5;
    // Between two turns of the small socket, each other socket sends at
    // most one fragment: at most (n - 1) * S bytes (plus their headers).
    let bound = (n - 1) * (fragment + super::control::HEADER_LEN);
    let turns: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, (s, _))| *s == small)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(turns.len(), 40);
    for pair in turns.windows(2) {
        let between: usize = log[pair[0] + 1..pair[1]].iter().map(|(_, b)| b).sum();
        assert!(
            between <= bound,
            "{between} bytes of other sockets between two turns (bound {bound})"
        );
    }
    // The small messages did not wait for the large ones to finish: the
    // last one went while large fragments were still being sent.
    let last_small = *turns.last().unwrap();
    let large_after = log[last_small..]
        .iter()
        .filter(|(s, _)| *s != small)
        .count();
    assert!(
        large_after > 100,
        "small messages interleaved, {large_after} large fragments after the last"
    );
    // No fragment is larger than S.
    assert!(
        log.iter()
            .all(|(_, bytes)| *bytes <= fragment + super::control::HEADER_LEN)
    );
}

#[test]
fn the_send_window_is_never_exceeded_and_makes_senders_wait() {
    let window = 16 << 10;
    let config = EngineConfig {
        window: WindowConfig {
            max_bytes: window,
            ..WindowConfig::default()
        },
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let sockets: Vec<SocketId> = (0..3).map(|_| open(&mut a, &mut b)).collect();
    for i in 0..60 {
        let len = [100usize, 20_000, 50_000, 16_000, 300_000][i % 5];
        a.engine
            .send(sockets[i % 3], message(&a.send_pool, len, i as u8))
            .unwrap();
    }
    // `step` asserts the bound after every post.
    pump(&mut a, &mut b);
    assert_eq!(b.arrivals.len(), 60);
    assert!(a.max_window_use <= window);
    assert!(
        a.max_window_use > window / 2,
        "the window was used: {}",
        a.max_window_use
    );
    assert!(
        a.engine.stats().window_stalls > 0,
        "senders waited for the window"
    );
    // Fragments were capped to the window.
    assert!(
        a.engine
            .fragment_log
            .iter()
            .all(|(_, bytes)| *bytes <= window)
    );
}

#[test]
fn an_adaptive_window_stays_within_its_maximum() {
    let config = EngineConfig {
        window: WindowConfig {
            max_bytes: 32 << 10,
            adaptive: true,
            target_delay: Duration::from_nanos(1),
        },
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    for i in 0..40 {
        a.engine
            .send(socket, message(&a.send_pool, 70_000, i as u8))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert_eq!(b.arrivals.len(), 40);
    let (_, limit) = a.engine.window_usage();
    assert!(limit <= 32 << 10);
    assert!(a.max_window_use <= 32 << 10);
}

/// Keepalive every 10 ms, a peer dead after 100 ms of silence.
fn fast_keepalive() -> (KeepaliveConfig, EngineConfig) {
    let keepalive = KeepaliveConfig {
        interval: Duration::from_millis(10),
        timeout: Duration::from_millis(100),
    };
    let config = EngineConfig {
        keepalive: Some(keepalive),
        ..EngineConfig::default()
    };
    (keepalive, config)
}

#[test]
fn keepalive_tolerates_a_pause_shorter_than_the_timeout_and_catches_a_dead_peer() {
    let (keepalive, config) = fast_keepalive();
    for confined in [false, true] {
        keepalive_case(&config, keepalive, confined);
    }
}

fn keepalive_case(config: &EngineConfig, keepalive: KeepaliveConfig, confined: bool) {
    let mut clock = Clock::new();
    let (mut a, mut b) = connected_with(config, SoftFaults::default(), clock.now(), confined);
    let tick = Duration::from_millis(1);
    // Both run for a second: no failure.
    run_for(&mut a, &mut b, &mut clock, 1000, tick, true);
    assert!(a.failure.is_none() && b.failure.is_none());
    assert!(a.engine.stats().keepalives_sent >= 90);
    // b pauses for 80 ms (less than the timeout), then resumes.
    run_for(&mut a, &mut b, &mut clock, 80, tick, false);
    run_for(&mut a, &mut b, &mut clock, 200, tick, true);
    assert!(
        a.failure.is_none(),
        "a pause shorter than the timeout is not death: {:?}",
        a.failure
    );
    // b dies: a notices within the timeout plus one interval.
    let mut waited = Duration::ZERO;
    while a.failure.is_none() && waited < Duration::from_secs(1) {
        run_for(&mut a, &mut b, &mut clock, 1, tick, false);
        waited += tick;
    }
    assert!(
        matches!(a.failure, Some(EngineError::PeerDead(_))),
        "{:?}",
        a.failure
    );
    assert!(
        waited <= keepalive.timeout + keepalive.interval + tick,
        "noticed after {waited:?}"
    );
}

/// The acceptor learns the dialer's keepalive slot (confined: from a
/// `Slot` message) before it is told the dialer is ready: it keeps the
/// slot and writes keepalives. Before, `peer_ready` replaced the slot
/// with the hello's (none), the acceptor never wrote one, and the dialer
/// declared it dead one timeout after connecting (a process test failed
/// about 1 run in 8 under CPU hogs).
#[test]
fn a_keepalive_slot_told_before_the_peer_is_ready_is_kept() {
    let (_, config) = fast_keepalive();
    let mut clock = Clock::new();
    let now = clock.now();
    let fabric = SoftFabric::new();
    let mut a = Side::new_with(
        &fabric,
        "a",
        &config,
        SoftFaults::default(),
        Role::Dialer,
        now,
        true,
    );
    let mut b = Side::new_with(
        &fabric,
        "b",
        &config,
        SoftFaults::default(),
        Role::Acceptor,
        now,
        true,
    );
    link_qps(&mut a, &mut b);
    let (info_a, info_b) = (a.info(), b.info());
    assert_eq!(
        info_a.keepalive_slot, None,
        "confined: no slot in the hello"
    );
    // The dialer is ready first and tells its slot; the acceptor handles
    // that before its own readiness.
    a.engine.peer_ready(info_b, now);
    pump(&mut a, &mut b);
    assert!(b.engine.peer_keepalive_slot().is_some());
    b.engine.peer_ready(info_a, now);
    assert!(
        b.engine.peer_keepalive_slot().is_some(),
        "the slot told before readiness is kept"
    );
    // Both run past several timeouts: neither is declared dead.
    run_for(
        &mut a,
        &mut b,
        &mut clock,
        500,
        Duration::from_millis(1),
        true,
    );
    assert!(
        a.failure.is_none() && b.failure.is_none(),
        "{:?} {:?}",
        a.failure,
        b.failure
    );
    assert!(b.engine.stats().keepalives_sent >= 40);
}

#[test]
fn a_refused_or_closed_socket_leaves_the_others_alone() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let keep = open(&mut a, &mut b);
    let refused = a.engine.open_socket().unwrap();
    pump(&mut a, &mut b);
    b.engine.refuse_socket(refused);
    pump(&mut a, &mut b);
    assert_eq!(a.refused, [refused]);
    assert!(
        a.engine
            .send(refused, message(&a.send_pool, 10, 1))
            .is_err()
    );
    let closing = open(&mut a, &mut b);
    a.engine
        .send(closing, message(&a.send_pool, 100_000, 2))
        .unwrap();
    a.engine.close_socket(closing);
    a.engine.send(keep, message(&a.send_pool, 10, 3)).unwrap();
    pump(&mut a, &mut b);
    assert_eq!(b.closed, [closing]);
    // The closing socket's last message still arrived, before its close.
    let got: Vec<SocketId> = b.arrivals.iter().map(|(s, _)| *s).collect();
    assert!(got.contains(&closing) && got.contains(&keep));
    // The other socket still works both ways.
    b.engine.send(keep, message(&b.send_pool, 20, 4)).unwrap();
    pump(&mut a, &mut b);
    assert_eq!(a.arrivals.len(), 1);
    check(&a.arrivals[0].1, 20, 4);
    assert!(a.failure.is_none() && b.failure.is_none());
}

/// SENDs `bytes` straight from `from`'s QP, past its engine (a hostile
/// peer's control message).
fn raw_send(from: &Side, bytes: &[u8]) {
    let buf = from.send_pool.alloc_copy(bytes).unwrap();
    let sge = crate::verbs::Sge {
        addr: buf.as_ptr() as usize,
        len: buf.len() as u32,
        lkey: buf.region().unwrap().lkey,
    };
    // Unsignalled: its engine never hears of it. The soft NIC copies at
    // the post, so the buffer may go after it.
    from.qp
        .post_send(&[crate::verbs::SendWr {
            wr_id: 1 << 40,
            op: crate::verbs::SendOp::Send,
            sges: vec![sge],
            signaled: false,
        }])
        .unwrap();
}

/// `from` sends a request to send `size` bytes as message `msg_id` on
/// `socket`, behind its engine's back.
fn raw_rts(from: &Side, socket: SocketId, msg_id: u32, size: u64) {
    use super::control::{ControlHeader, ControlKind};
    let rts = ControlHeader {
        kind: ControlKind::Rts { size },
        credits: 0,
        msg_id,
        socket,
    }
    .encode();
    raw_send(from, &rts);
}

/// A request to send a message id already granted fails the receiving
/// engine, and the granted buffer stays the engine's (the peer holds its
/// address and key). Before: the second RTS replaced the first grant,
/// freeing a buffer the peer could still write into.
#[test]
fn a_duplicate_request_to_send_fails_the_engine_and_frees_no_grant() {
    use super::control::{ControlHeader, ControlKind};
    let config = EngineConfig::default();
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    let rts = ControlHeader {
        kind: ControlKind::Rts { size: 100_000 },
        credits: 0,
        msg_id: 7,
        socket,
    }
    .encode();
    raw_send(&a, &rts);
    for _ in 0..4 {
        b.step(true);
    }
    assert!(b.failure.is_none(), "one request is fine: {:?}", b.failure);
    let in_use = b.recv_pool.stats();
    raw_send(&a, &rts);
    for _ in 0..4 {
        b.step(true);
    }
    assert!(
        matches!(
            &b.failure,
            Some(EngineError::Protocol(Violation::RequestAgain(_)))
        ),
        "{:?}",
        b.failure
    );
    b.recv_pool.flush_thread_cache();
    assert!(
        b.recv_pool.stats().in_use_bytes >= in_use.in_use_bytes,
        "the granted buffer was not freed"
    );
}

/// A receive completion whose length runs past its buffer fails the
/// engine instead of panicking (which took the I/O thread, and every
/// engine it served, down).
#[test]
fn a_receive_length_past_its_buffer_fails_the_engine_without_panicking() {
    use super::control::{ControlHeader, ControlKind};
    let config = EngineConfig::default();
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    let data = ControlHeader {
        kind: ControlKind::Data,
        credits: 0,
        msg_id: 0,
        socket,
    }
    .encode();
    raw_send(&a, &data);
    let mut got = Vec::new();
    b.recv_cq.poll(&mut got, 16);
    let mut corrupt = got
        .into_iter()
        .find(|c| c.status == crate::verbs::WcStatus::Success)
        .expect("the raw SEND's receive");
    corrupt.byte_len = 1 << 30;
    b.engine.handle_completion(&corrupt, Instant::now());
    b.step(false);
    assert!(
        matches!(
            &b.failure,
            Some(EngineError::Protocol(Violation::ReceiveTooLong { .. }))
        ),
        "{:?}",
        b.failure
    );
}

/// Requests to send beyond the per-peer budget wait, ungranted and
/// unallocated: a hostile peer announcing five 1 MiB messages against a
/// 3 MiB budget gets three destinations. Before: every RTS was granted at
/// once, so the peer alone decided how much of the pool it held.
#[test]
fn requests_to_send_beyond_the_peer_budget_wait_unallocated() {
    let config = EngineConfig {
        max_message_size: 1 << 20,
        max_granted_bytes: 3 << 20,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    b.recv_pool.flush_thread_cache();
    let before = b.recv_pool.stats().in_use_bytes;
    for msg_id in 1..=5 {
        raw_rts(&a, socket, msg_id, 1 << 20);
    }
    for _ in 0..8 {
        b.step(true);
    }
    assert!(b.failure.is_none(), "{:?}", b.failure);
    assert_eq!(b.engine.granted(), (3 << 20, 2), "three granted, two wait");
    b.recv_pool.flush_thread_cache();
    let grown = b.recv_pool.stats().in_use_bytes - before;
    assert!(
        grown <= (3 << 20) + (256 << 10),
        "{grown} bytes allocated for the grants"
    );
}

/// A well-behaved sender whose messages exceed the peer's budget many
/// times over still gets them all through, whole and in order: the
/// waiting requests are granted as earlier messages complete.
#[test]
fn large_messages_beyond_the_budget_arrive_whole_as_grants_free() {
    let config = EngineConfig {
        max_message_size: 1 << 20,
        max_granted_bytes: 1 << 20,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let sockets = [open(&mut a, &mut b), open(&mut a, &mut b)];
    let sizes = [1 << 20, 300_000, 700_000, 1 << 20, 65_537, 900_000];
    for (i, &len) in sizes.iter().enumerate() {
        a.engine
            .send(sockets[i % 2], message(&a.send_pool, len, i as u8))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert!(
        a.failure.is_none() && b.failure.is_none(),
        "{:?} {:?}",
        a.failure,
        b.failure
    );
    for (s, &socket) in sockets.iter().enumerate() {
        let got: Vec<&Bytes> = b
            .arrivals
            .iter()
            .filter(|(id, _)| *id == socket)
            .map(|(_, m)| m)
            .collect();
        let expected: Vec<usize> = (s..sizes.len()).step_by(2).collect();
        assert_eq!(got.len(), expected.len());
        for (message, &i) in got.iter().zip(&expected) {
            check(message, sizes[i], i as u8);
        }
    }
    // What stays granted is the offers for the sockets' next messages.
    assert_eq!(b.engine.granted(), (b.engine.offers_out().1, 0));
    // Closed both ways, nothing.
    for socket in sockets {
        a.engine.close_socket(socket);
        b.engine.close_socket(socket);
    }
    pump(&mut a, &mut b);
    assert_eq!(b.engine.granted(), (0, 0));
    assert_eq!(b.engine.offers_out(), (0, 0));
}

/// An accepted engine's grants draw on the server's budget too (shared
/// with TCP peers): what does not fit waits, and is granted once budget
/// frees elsewhere. Before, RDMA peers were outside the server's budget.
#[test]
fn grants_of_an_accepted_engine_wait_for_the_servers_budget() {
    let config = EngineConfig {
        max_message_size: 1 << 20,
        max_granted_bytes: 4 << 20,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    let server = crate::inbound::InboundBudget::new(2 << 20);
    let elsewhere = server.try_acquire(1 << 20).unwrap();
    b.engine.set_inbound_budget(server.clone());
    for msg_id in 1..=3 {
        raw_rts(&a, socket, msg_id, 512 << 10);
    }
    for _ in 0..8 {
        b.step(true);
    }
    assert!(b.failure.is_none(), "{:?}", b.failure);
    assert_eq!(
        b.engine.granted(),
        (1 << 20, 1),
        "two fit the server's budget"
    );
    assert_eq!(server.available(), 0);
    drop(elsewhere);
    for _ in 0..4 {
        b.step(true);
    }
    assert_eq!(
        b.engine.granted(),
        ((3 << 20) / 2, 0),
        "granted once budget freed"
    );
    assert_eq!(server.available(), 512 << 10);
}

/// A raw one-sided WRITE of `len` bytes of 0xee from `from`'s QP, behind
/// its engine's back; the status it completes with.
fn raw_write(from: &Side, addr: u64, rkey: u32, len: usize) -> crate::verbs::WcStatus {
    let op = crate::verbs::SendOp::Write {
        remote_addr: addr as usize,
        rkey,
    };
    raw_post(from, op, &vec![0xee; len])
}

/// `op` with `bytes` posted signalled on `from`'s QP behind its engine's
/// back; the status it completes with.
fn raw_post(from: &Side, op: crate::verbs::SendOp, bytes: &[u8]) -> crate::verbs::WcStatus {
    let mut buf = from.send_pool.alloc(bytes.len()).unwrap();
    buf.set_len(bytes.len());
    buf.copy_from_slice(bytes);
    let sge = crate::verbs::Sge {
        addr: buf.as_ptr() as usize,
        len: bytes.len() as u32,
        lkey: buf.region().unwrap().lkey,
    };
    from.qp
        .post_send(&[crate::verbs::SendWr {
            wr_id: 1 << 41,
            op,
            sges: vec![sge],
            signaled: true,
        }])
        .unwrap();
    let mut completions = Vec::new();
    from.send_cq.poll(&mut completions, 64);
    completions
        .iter()
        .find(|c| c.wr_id == 1 << 41)
        .map(|c| c.status)
        .expect("the work request completed")
}

/// A confined peer `name` of `server` (a side of its own on `server`'s
/// device, `side`), connected and idle: (the peer, the server's side).
fn server_peer(
    fabric: &SoftFabric,
    server: &SoftDevice,
    name: &str,
    side: &str,
    config: &EngineConfig,
    now: Instant,
) -> (Side, Side) {
    let mut peer = Side::new_with(
        fabric,
        name,
        config,
        SoftFaults::default(),
        Role::Dialer,
        now,
        true,
    );
    let mut served = Side::on_device(server.clone(), side, config, Role::Acceptor, now, true);
    connect_sides(&mut peer, &mut served, now);
    pump(&mut peer, &mut served);
    (peer, served)
}

/// Remote-write confinement end to end (issue 16, item 6): a server (two
/// engines on one device) grants a hostile peer and an honest one a
/// destination each. The hostile peer can write into its own grant and
/// nowhere else: not past it, not into the honest peer's grant with that
/// grant's key, not into the server's keepalive slot with its own key; and
/// once a message has arrived its key is dead. The honest peer's message
/// arrives intact. Before (the pool's blocks remotely writable under one
/// key per block) the stray writes landed.
#[test]
fn a_peer_writes_only_into_its_own_grant_while_it_lasts() {
    let keepalive = KeepaliveConfig {
        interval: Duration::from_millis(50),
        timeout: Duration::from_secs(30),
    };
    let config = EngineConfig {
        keepalive: Some(keepalive),
        ..EngineConfig::default()
    };
    let now = Instant::now();
    let fabric = SoftFabric::new();
    let server = fabric.open("server", SoftFaults::default()).unwrap();
    let mut hostile = Side::new_with(
        &fabric,
        "hostile",
        &config,
        SoftFaults::default(),
        Role::Dialer,
        now,
        true,
    );
    let mut for_hostile = Side::on_device(server.clone(), "s1", &config, Role::Acceptor, now, true);
    let mut honest = Side::new_with(
        &fabric,
        "honest",
        &config,
        SoftFaults::default(),
        Role::Dialer,
        now,
        true,
    );
    let mut for_honest = Side::on_device(server.clone(), "s2", &config, Role::Acceptor, now, true);
    connect_sides(&mut hostile, &mut for_hostile, now);
    connect_sides(&mut honest, &mut for_honest, now);
    let bad = open(&mut hostile, &mut for_hostile);
    let good = open(&mut honest, &mut for_honest);
    pump(&mut hostile, &mut for_hostile);
    pump(&mut honest, &mut for_honest);
    // The keepalive slots went through windows: no key in the hello.
    assert_eq!(for_hostile.engine.keepalive_slot(), None);

    // The hostile peer asks for a destination behind its engine's back.
    raw_rts(&hostile, bad, 7, 100_000);
    for _ in 0..4 {
        for_hostile.step(true);
    }
    let [(_, own_addr, own_len, own_key, _)] = for_hostile.engine.grants()[..] else {
        panic!("one grant: {:?}", for_hostile.engine.grants());
    };
    // The honest peer's message: granted, not yet written.
    let len = 1 << 20;
    honest
        .engine
        .send(good, message(&honest.send_pool, len, 3))
        .unwrap();
    honest.step(true);
    for _ in 0..4 {
        for_honest.step(true);
    }
    let [(_, its_addr, _, its_key, its_block_key)] = for_honest.engine.grants()[..] else {
        panic!("one grant: {:?}", for_honest.engine.grants());
    };
    assert_ne!(its_key, own_key);

    use crate::verbs::WcStatus::{RemoteAccessError, Success};
    assert_eq!(
        raw_write(&hostile, own_addr, own_key, 4096),
        Success,
        "its own grant"
    );
    assert_eq!(
        raw_write(&hostile, own_addr + own_len as u64 - 8, own_key, 64),
        RemoteAccessError,
        "past its grant"
    );
    // Its QP failed (as a NIC fails it): a second hostile connection tries
    // the honest peer's grant and the server's keepalive slot.
    let (hostile2, for_hostile2) = server_peer(&fabric, &server, "hostile2", "s3", &config, now);
    assert_eq!(
        raw_write(&hostile2, its_addr, its_key, 64),
        RemoteAccessError,
        "another connection's grant, with its key"
    );
    let (hostile3, _for_hostile3) = server_peer(&fabric, &server, "hostile3", "s4", &config, now);
    assert_eq!(
        raw_write(&hostile3, its_addr, its_block_key, 64),
        RemoteAccessError,
        "the key of the region the grant lies in"
    );
    // The server's keepalive slot of the first connection: with the
    // region's key, and with the key of the window bound to it (which
    // works only on that connection).
    let (slot_addr, slot_region_key) = for_hostile.engine.own_keepalive_slot().unwrap();
    let (hostile4, _for_hostile4) = server_peer(&fabric, &server, "hostile4", "s5", &config, now);
    assert_eq!(
        raw_write(&hostile4, slot_addr, slot_region_key, 8),
        RemoteAccessError,
        "another connection's keepalive slot, with its region's key"
    );
    let (hostile5, _for_hostile5) = server_peer(&fabric, &server, "hostile5", "s6", &config, now);
    let slot_window_key = hostile
        .engine
        .peer_keepalive_slot()
        .map(|(_, rkey)| rkey)
        .unwrap();
    assert_eq!(
        raw_write(&hostile5, slot_addr, slot_window_key, 8),
        RemoteAccessError,
        "another connection's keepalive slot, with its window's key"
    );
    assert!(server.stats().remote_access_errors >= 5);

    // The honest message arrives whole, untouched by any of it.
    pump(&mut honest, &mut for_honest);
    assert_eq!(for_honest.received.len(), 1);
    check(&for_honest.received[0], len, 3);
    // Only the offer for the socket's next message is left.
    let grants = for_honest.engine.grants();
    assert!(
        grants.len() == 1 && grants[0].0 & OFFER_BIT != 0,
        "{grants:?}"
    );
    // Its key died with the message (the honest side's QP tries it).
    assert_eq!(
        raw_write(&honest, its_addr, its_key, 64),
        RemoteAccessError,
        "a key after its message arrived"
    );
    assert!(for_honest.failure.is_none() && for_hostile2.failure.is_none());
}

/// A message that arrived whole while its window's invalidation is still
/// outstanding is not lost when the engine fails meanwhile: once the QP
/// is in error its owner takes it (and any close behind it) before the
/// failure. Before, the failure dropped it.
#[test]
fn a_held_message_survives_the_engines_failure() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), true);
    let socket = open(&mut a, &mut b);
    a.engine
        .send(socket, message(&a.send_pool, 200_000, 9))
        .unwrap();
    a.engine.close_socket(socket);
    for _ in 0..1000 {
        a.step(true);
        b.step(true);
        if b.engine.held_len() > 0 {
            break;
        }
    }
    assert!(
        b.engine.held_len() > 0,
        "the message waits for its invalidation"
    );
    assert!(b.received.is_empty());
    b.engine.handle_peer_closed();
    b.qp.fail().unwrap();
    b.qp.quiesce();
    let held = b.engine.take_held();
    let Some(EngineEvent::Message { bytes, .. }) = held.first() else {
        panic!("the held message: {held:?}");
    };
    check(bytes, 200_000, 9);
}
