//! The data-plane holes of issue 57, each placed exactly: a hostile
//! address that wraps, offered messages past `max_message_size`, grants a
//! peer never writes, and chunks of a failed partner answered before its
//! writes are flushed.

use super::super::control::{ControlHeader, ControlKind};
use super::*;

/// Runs both sides at `now` until neither makes progress.
fn pump_at(a: &mut Side, b: &mut Side, now: Instant) {
    for _ in 0..200_000 {
        let pa = a.step_at(true, now);
        let pb = b.step_at(true, now);
        if !pa && !pb {
            return;
        }
    }
    panic!("no quiescence");
}

/// `from` sends control message `kind` for message `msg_id` on `socket`,
/// behind its engine's back, with `extra` bytes after the header.
fn raw_control(from: &Side, kind: ControlKind, msg_id: u32, socket: SocketId, extra: &[u8]) {
    let mut bytes = ControlHeader {
        kind,
        credits: 0,
        msg_id,
        socket,
    }
    .encode()
    .to_vec();
    bytes.extend_from_slice(extra);
    raw_send(from, &bytes);
}

/// A clear to send whose address wraps past the end of the address space
/// (a hostile peer's) fails the engine as a protocol violation. Before:
/// `addr + offset` overflowed in `push_fragment` and panicked the I/O
/// thread's engine (debug) or wrote to a wrapped address (release).
#[test]
fn a_clear_to_send_whose_address_wraps_fails_the_engine_without_panicking() {
    let config = EngineConfig {
        offers: false,
        ..EngineConfig::default()
    };
    let (mut a, b) = connected(&config, SoftFaults::default());
    let mut b = b;
    let socket = open(&mut a, &mut b);
    a.engine
        .send(socket, message(&a.send_pool, 100_000, 1))
        .unwrap();
    // The RTS goes out; b's engine never answers it, a hostile CTS does.
    a.step(true);
    raw_control(
        &b,
        ControlKind::Cts {
            addr: u64::MAX - 1000,
            rkey: 1,
        },
        1,
        socket,
        &[],
    );
    steps_to_overflow(&mut a);
}

/// Steps `a` a few times and checks that its engine failed on a
/// destination whose address wraps.
fn steps_to_overflow(a: &mut Side) {
    for _ in 0..4 {
        a.step(true);
    }
    assert!(
        matches!(
            &a.failure,
            Some(EngineError::Protocol(Violation::AddressOverflow { .. }))
        ),
        "{:?}",
        a.failure
    );
}

/// The same through an offer: an `Offer` whose buffer would wrap fails
/// the engine when it arrives, before any message is written to it.
#[test]
fn an_offer_whose_address_wraps_fails_the_engine_without_panicking() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = open(&mut a, &mut b);
    raw_control(
        &b,
        ControlKind::Offer {
            addr: u64::MAX - 1000,
            rkey: 1,
        },
        OFFER_BIT | 9,
        socket,
        &(1u64 << 20).to_le_bytes(),
    );
    a.engine
        .send(socket, message(&a.send_pool, 100_000, 1))
        .unwrap();
    steps_to_overflow(&mut a);
}

/// A message larger than the receiver's `max_message_size` never arrives
/// through an offer: offers made after a message near the limit have room
/// for more than it (a quarter more), and a sender whose own limit is
/// higher used that room. Before: b delivered a message past its limit.
#[test]
fn an_offered_message_past_max_message_size_is_refused() {
    let max = 1 << 20;
    let fabric = SoftFabric::new();
    let now = Instant::now();
    let sender = EngineConfig {
        max_message_size: 2 * max,
        ..EngineConfig::default()
    };
    let receiver = EngineConfig {
        max_message_size: max,
        ..EngineConfig::default()
    };
    let mut a = Side::new_with(
        &fabric,
        "a",
        &sender,
        SoftFaults::default(),
        Role::Dialer,
        now,
        false,
    );
    let mut b = Side::new_with(
        &fabric,
        "b",
        &receiver,
        SoftFaults::default(),
        Role::Acceptor,
        now,
        false,
    );
    connect_sides(&mut a, &mut b, now);
    let socket = open(&mut a, &mut b);
    a.engine
        .send(socket, message(&a.send_pool, max as usize, 1))
        .unwrap();
    pump(&mut a, &mut b);
    assert_eq!(b.received.len(), 1);
    a.engine
        .send(
            socket,
            message(&a.send_pool, max as usize + max as usize / 8, 2),
        )
        .unwrap();
    pump(&mut a, &mut b);
    assert!(
        b.received.iter().all(|m| m.len() as u64 <= max),
        "a message past the receiver's limit arrived: {:?}",
        b.received.iter().map(Bytes::len).collect::<Vec<_>>()
    );
    assert!(
        matches!(
            &b.failure,
            Some(EngineError::Protocol(Violation::TooLarge { .. }))
        ),
        "{:?}",
        b.failure
    );
}

/// Issue 57, hole 9: a peer that takes its CTS and never writes (here an
/// honest engine that stops being driven: a frozen peer) fails the engine
/// once `grant_timeout` has passed with no grant written; a grant written
/// in time stops the clock, and the next grant starts it afresh. Before,
/// an unwritten grant (its bytes, and on a server its share of the inbound
/// budget) was held for the engine's life.
#[test]
fn a_grant_the_peer_never_writes_fails_the_engine_after_the_grant_timeout() {
    let timeout = Duration::from_secs(30);
    let config = EngineConfig {
        grant_timeout: Some(timeout),
        offers: false,
        ..EngineConfig::default()
    };
    let mut clock = Clock::new();
    let (mut a, mut b) = connected_at(&config, SoftFaults::default(), clock.now());
    let socket = open(&mut a, &mut b);
    // A grant written in time: its clock runs from the grant...
    a.engine
        .send(socket, message(&a.send_pool, 100_000, 1))
        .unwrap();
    a.step_at(true, clock.now());
    b.step_at(true, clock.now());
    assert_eq!(b.engine.granted().0, 100_000);
    assert_eq!(b.engine.poll_timeout(), Some(clock.now() + timeout));
    // ... and stops once the message is in.
    clock.advance(timeout / 2);
    pump_at(&mut a, &mut b, clock.now());
    assert_eq!(b.received.len(), 1);
    assert_eq!(b.engine.poll_timeout(), None);
    // The next grant starts it afresh; the peer then freezes.
    a.engine
        .send(socket, message(&a.send_pool, 200_000, 2))
        .unwrap();
    a.step_at(true, clock.now());
    b.step_at(true, clock.now());
    assert_eq!(b.engine.granted().0, 200_000);
    clock.advance(timeout - Duration::from_millis(1));
    b.step_at(true, clock.now());
    assert!(b.failure.is_none(), "{:?}", b.failure);
    clock.advance(Duration::from_millis(1));
    b.step_at(true, clock.now());
    assert!(
        matches!(
            &b.failure,
            Some(EngineError::GrantTimeout { grants: 1, .. })
        ),
        "{:?}",
        b.failure
    );
}
