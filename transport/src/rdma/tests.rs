//! The engine driven step by step over soft queue pairs.

use std::sync::Arc;

use bytes::Bytes;

use super::*;
use crate::Message;
use crate::pool::{Access, Pool, PoolConfig};
use crate::verbs::soft::{SoftDevice, SoftFabric, SoftFaults};
use crate::verbs::{CompletionQueue, Device, QpCaps, QueuePair, WorkCompletion};

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
    received: Vec<Bytes>,
    failure: Option<EngineError>,
    posts: usize,
    posted_wrs: usize,
    max_in_flight: usize,
}

impl Side {
    fn new(fabric: &SoftFabric, name: &str, config: &EngineConfig, faults: SoftFaults) -> Self {
        let device = fabric.open(name, faults).unwrap();
        let hook = device.registration_hook();
        let send_pool = Pool::new(
            PoolConfig::named(format!("{name}-send")),
            Access::LocalOnly,
            hook.clone(),
        )
        .unwrap();
        let recv_pool = Pool::new(
            PoolConfig::named(format!("{name}-recv")),
            Access::RemoteWrite,
            hook,
        )
        .unwrap();
        let send_cq = device.create_cq(256).unwrap();
        let recv_cq = device.create_cq(256).unwrap();
        let caps = QpCaps {
            max_send_wr: config.send_queue_depth,
            max_recv_wr: config.recv_queue_depth,
            max_sge: config.max_sge,
        };
        let qp = device
            .create_qp(send_cq.clone(), recv_cq.clone(), caps)
            .unwrap();
        let engine = Engine::new(
            config.clone(),
            send_pool.clone(),
            recv_pool.clone(),
            config.recv_queue_depth,
        );
        Self {
            qp,
            engine,
            device,
            send_cq,
            recv_cq,
            send_pool,
            recv_pool,
            received: Vec::new(),
            failure: None,
            posts: 0,
            posted_wrs: 0,
            max_in_flight: 0,
        }
    }

    /// One round of the driver loop; returns whether anything happened.
    fn step(&mut self, poll_recv: bool) -> bool {
        let mut progress = false;
        if let Some(wrs) = self.engine.poll_recv_post() {
            self.qp
                .post_recv(&wrs)
                .expect("receive queue never overflows");
            progress = true;
        }
        while let Some(batch) = self.engine.poll_transmit() {
            self.posts += 1;
            self.posted_wrs += batch.len();
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
            self.engine.handle_completion(completion);
            progress = true;
        }
        while let Some(event) = self.engine.poll_event() {
            match event {
                EngineEvent::Message(bytes) => self.received.push(bytes),
                EngineEvent::Failed(err) => self.failure = Some(err),
            }
            progress = true;
        }
        progress
    }
}

fn connected(config: &EngineConfig, faults: SoftFaults) -> (Side, Side) {
    let fabric = SoftFabric::new();
    let a = Side::new(&fabric, "a", config, faults);
    let b = Side::new(&fabric, "b", config, SoftFaults::default());
    a.qp.connect(&b.qp.endpoint()).unwrap();
    b.qp.connect(&a.qp.endpoint()).unwrap();
    // As at connection setup: both sides post their receives before either
    // learns the other's credits.
    let mut a = a;
    let mut b = b;
    for side in [&mut a, &mut b] {
        let wrs = side.engine.poll_recv_post().unwrap();
        side.qp.post_recv(&wrs).unwrap();
    }
    (a, b)
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
    let sizes: Vec<usize> = (0..=config.small_message_limit)
        .step_by(97)
        .chain([config.small_message_limit])
        .collect();
    for (i, &len) in sizes.iter().enumerate() {
        a.engine.send(message(&a.send_pool, len, i as u8)).unwrap();
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
        let region =
            crate::pool::lookup(got.as_ptr() as usize).expect("delivered from the receive pool");
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
    let config = EngineConfig::default();
    let (mut a, mut b) = connected(&config, SoftFaults::default());
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
        a.engine.send(message(&a.send_pool, len, i as u8)).unwrap();
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
            crate::pool::lookup(got.as_ptr() as usize).map(|r| r.pool_id),
            Some(b.recv_pool.id())
        );
    }
    assert_eq!(a.engine.stats().large_sent as usize, sizes.len());
    assert_eq!(b.device.stats().rnr_events, 0);
}

#[test]
fn interleaved_sizes_in_both_directions() {
    let config = EngineConfig {
        small_message_limit: 1024,
        fragment_size: 8 << 10,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let sizes: Vec<usize> = (0..200)
        .map(|i| [0usize, 10, 1024, 1025, 5000, 70_000, 300_000][i % 7] + i)
        .collect();
    for (i, &len) in sizes.iter().enumerate() {
        a.engine.send(message(&a.send_pool, len, i as u8)).unwrap();
        b.engine
            .send(message(&b.send_pool, len, (i + 100) as u8))
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
    for i in 0..500 {
        a.engine.send(message(&a.send_pool, 100, i as u8)).unwrap();
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
    for i in 0..2_000 {
        a.engine
            .send(message(&a.send_pool, 64 + i % 2000, i as u8))
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
    for i in 0..50 {
        a.engine
            .send(message(&a.send_pool, 200_000, i as u8))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert!(
        matches!(a.failure, Some(EngineError::Completion(_))),
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
    a.engine.send(Message::from(vec![7u8; 100])).unwrap();
    a.engine.send(Message::from(vec![8u8; 100_000])).unwrap();
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
    // Registered memory, but with another hook (as a TCP transport's pool
    // is): its keys mean nothing to this device.
    let foreign = Pool::new(
        PoolConfig::named("foreign"),
        Access::LocalOnly,
        Arc::new(crate::pool::CountingHook::new()),
    )
    .unwrap();
    a.engine.send(message(&foreign, 100, 3)).unwrap();
    a.engine.send(message(&foreign, 100_000, 4)).unwrap();
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
