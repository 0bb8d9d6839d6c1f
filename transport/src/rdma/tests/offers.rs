//! Offers (`engine/offers.rs`) driven step by step: a socket's large
//! messages after the first go to the destination the peer offered, with
//! no request to send; one too large for its offer asks as before; a
//! forged length fails the engine; a closed socket's offer is freed.

use super::*;
use crate::rdma::control::{ControlHeader, ControlKind};
use crate::rdma::engine::{EngineError, Violation};
use crate::verbs::{SendOp, WcStatus};

/// `count` messages of `len` bytes (seeds 1, 2, ...) from `a` to `b` on
/// `socket`, each sent once the one before has arrived, as a caller
/// waiting for each answer sends them.
fn one_by_one(a: &mut Side, b: &mut Side, socket: SocketId, lens: &[usize]) {
    for (i, &len) in lens.iter().enumerate() {
        a.engine
            .send(socket, message(&a.send_pool, len, i as u8 + 1))
            .unwrap();
        pump(a, b);
    }
}

fn offers_case(confined: bool) {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), confined);
    let socket = open(&mut a, &mut b);
    let lens = [200_000, 200_000, 180_000, 220_000, 200_000];
    one_by_one(&mut a, &mut b, socket, &lens);
    assert!(a.failure.is_none() && b.failure.is_none());
    assert_eq!(b.received.len(), lens.len());
    for (i, (got, &len)) in b.received.iter().zip(&lens).enumerate() {
        check(got, len, i as u8 + 1);
    }
    let (sent, made) = (a.engine.stats(), b.engine.stats());
    // The first asked; each one after went to the offer the one before
    // left (180,000 bytes leave room for 225,000).
    assert_eq!(sent.large_sent, 5);
    assert_eq!(sent.offered_sends, 4, "{sent:?}");
    assert_eq!(made.offers_used, 4);
    assert_eq!(made.offers_made, 5, "one out for the next message");
    assert_eq!(sent.bytes_sent, lens.iter().sum::<usize>() as u64);
    assert_eq!(b.engine.offers_out().0, 1);
    // With windows, the key of a used offer died with its message.
    if confined {
        let grants = b.engine.grants();
        assert_eq!(grants.len(), 1);
        assert!(grants[0].0 & OFFER_BIT != 0);
    }
}

#[test]
fn a_sockets_next_large_messages_go_to_the_peers_offer_unasked() {
    offers_case(false);
    offers_case(true);
}

#[test]
fn a_message_larger_than_its_offer_asks_and_the_offer_serves_a_later_one() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), true);
    let socket = open(&mut a, &mut b);
    // The offer after 100,000 bytes holds 125,000 and more: the second
    // message asks, the third fits the same offer.
    let lens = [100_000, 400_000, 120_000];
    one_by_one(&mut a, &mut b, socket, &lens);
    assert!(a.failure.is_none() && b.failure.is_none());
    for (i, (got, &len)) in b.received.iter().zip(&lens).enumerate() {
        check(got, len, i as u8 + 1);
    }
    assert_eq!(b.received.len(), 3);
    assert_eq!(a.engine.stats().offered_sends, 1);
    assert_eq!(b.engine.stats().offers_made, 2);
}

#[test]
fn messages_queued_together_keep_their_order_across_offers_and_requests() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), true);
    let socket = open(&mut a, &mut b);
    one_by_one(&mut a, &mut b, socket, &[50_000]);
    // Queued at once: the first fits the offer, the second asks, small
    // ones between them go by SEND; all arrive in the order sent.
    let lens = [60_000, 500_000, 100, 30_000, 7];
    for (i, &len) in lens.iter().enumerate() {
        a.engine
            .send(socket, message(&a.send_pool, len, i as u8 + 10))
            .unwrap();
    }
    pump(&mut a, &mut b);
    assert!(a.failure.is_none() && b.failure.is_none());
    assert_eq!(b.received.len(), 1 + lens.len());
    for (i, (got, &len)) in b.received[1..].iter().zip(&lens).enumerate() {
        check(got, len, i as u8 + 10);
    }
    assert!(a.engine.stats().offered_sends >= 1);
}

#[test]
fn without_offers_every_large_message_asks() {
    let config = EngineConfig {
        offers: false,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), true);
    let socket = open(&mut a, &mut b);
    let lens = [200_000; 3];
    one_by_one(&mut a, &mut b, socket, &lens);
    assert_eq!(b.received.len(), 3);
    assert_eq!(a.engine.stats().offered_sends, 0);
    assert_eq!(b.engine.stats().offers_made, 0);
    assert_eq!(b.engine.granted(), (0, 0));
}

#[test]
fn an_engine_on_the_servers_inbound_budget_makes_no_offer() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), true);
    b.engine
        .set_inbound_budget(crate::inbound::InboundBudget::new(64 << 20));
    let socket = open(&mut a, &mut b);
    one_by_one(&mut a, &mut b, socket, &[200_000, 200_000]);
    assert_eq!(b.received.len(), 2);
    assert_eq!(b.engine.stats().offers_made, 0);
    assert_eq!(b.engine.granted(), (0, 0));
}

/// A WRITE_WITH_IMM of `bytes` to (`addr`, `rkey`) carrying `imm`, from
/// `from`'s QP behind its engine's back; the status it completes with.
fn raw_write_imm(from: &Side, addr: u64, rkey: u32, bytes: &[u8], imm: u32) -> WcStatus {
    let op = SendOp::WriteWithImm {
        remote_addr: addr as usize,
        rkey,
        imm,
    };
    super::raw_post(from, op, bytes)
}

#[test]
fn an_offered_message_longer_than_its_offer_fails_the_engine() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), true);
    let socket = open(&mut a, &mut b);
    one_by_one(&mut a, &mut b, socket, &[100_000]);
    let [(id, addr, len, rkey, _)] = b.engine.grants()[..] else {
        panic!("one offer: {:?}", b.engine.grants());
    };
    assert!(id & OFFER_BIT != 0);
    let claimed = (len - PREFIX_LEN + 1) as u64;
    assert_eq!(
        raw_write_imm(&a, addr, rkey, &claimed.to_le_bytes(), id),
        WcStatus::Success
    );
    for _ in 0..4 {
        b.step(true);
    }
    assert_eq!(
        b.failure,
        Some(EngineError::Protocol(Violation::OfferOverrun {
            len: claimed,
            room: claimed - 1,
        }))
    );
    assert_eq!(b.received.len(), 1, "nothing delivered from the forgery");
    // The buffer stays with the failed engine, its window still bound:
    // the peer may write until the queue pair is in error. Before, it
    // went back to the pool at once.
    assert!(b.engine.grants().iter().any(|g| g.0 == id));
}

/// A message as large as the whole budget is granted beside an idle
/// offer of another message's socket. Before, the offer counted as a
/// grant outstanding, so the message waited for ever: the socket's own
/// offer was too small, and its queue stood behind the request.
#[test]
fn a_message_as_large_as_the_budget_is_granted_beside_an_idle_offer() {
    let config = EngineConfig {
        max_message_size: 1 << 20,
        max_granted_bytes: 1 << 20,
        ..EngineConfig::default()
    };
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), true);
    let socket = open(&mut a, &mut b);
    one_by_one(&mut a, &mut b, socket, &[300_000, 1 << 20, 200_000]);
    assert!(a.failure.is_none() && b.failure.is_none());
    assert_eq!(b.received.len(), 3);
    for (i, (got, len)) in b
        .received
        .iter()
        .zip([300_000, 1 << 20, 200_000])
        .enumerate()
    {
        check(got, len, i as u8 + 1);
    }
    assert_eq!(
        a.engine.stats().offered_sends,
        1,
        "the third took the offer"
    );
}

/// A socket refused after its peer sent on it anyway (before answering
/// the open: not the protocol) leaves no offer behind. Before, the offer
/// made for its next message stayed for the life of the engine.
#[test]
fn a_refused_socket_withdraws_the_offer_made_on_it() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected(&config, SoftFaults::default());
    let socket = a.engine.open_socket().unwrap();
    pump(&mut a, &mut b);
    assert!(b.opened.contains(&socket));
    // From b's queue pair behind its engine's back: a large message on
    // the socket, then the refusal.
    raw_rts(&b, socket, 5, 100_000);
    for _ in 0..4 {
        a.step(true);
    }
    let [(5, addr, _, rkey, _)] = a.engine.grants()[..] else {
        panic!("one grant: {:?}", a.engine.grants());
    };
    assert_eq!(
        raw_write_imm(&b, addr, rkey, &[7u8; 100_000], 5),
        WcStatus::Success
    );
    for _ in 0..4 {
        a.step(true);
    }
    assert_eq!(a.received.len(), 1);
    assert_eq!(a.engine.offers_out().0, 1);
    let refuse = ControlHeader {
        kind: ControlKind::Refuse,
        credits: 0,
        msg_id: 0,
        socket,
    }
    .encode();
    raw_send(&b, &refuse);
    for _ in 0..4 {
        a.step(true);
    }
    assert!(a.failure.is_none(), "{:?}", a.failure);
    assert_eq!(a.refused, vec![socket]);
    assert_eq!(a.engine.offers_out(), (0, 0));
    assert_eq!(a.engine.granted(), (0, 0));
}

#[test]
fn offers_out_of_range_twice_or_short_fail_the_engine() {
    let header = |msg_id, socket| {
        ControlHeader {
            kind: ControlKind::Offer { addr: 64, rkey: 1 },
            credits: 0,
            msg_id,
            socket,
        }
        .encode()
        .to_vec()
    };
    let with_size = |mut bytes: Vec<u8>| {
        bytes.extend_from_slice(&(1u64 << 20).to_le_bytes());
        bytes
    };
    type Forge<'a> = &'a dyn Fn(SocketId) -> Vec<Vec<u8>>;
    let cases: [(Forge, Violation); 3] = [
        (&|s| vec![with_size(header(7, s))], Violation::NotAnOffer(7)),
        (
            &|s| vec![header(OFFER_BIT | 7, s)],
            Violation::ShortOffer(24),
        ),
        (
            &|s| {
                vec![
                    with_size(header(OFFER_BIT | 7, s)),
                    with_size(header(OFFER_BIT | 8, s)),
                ]
            },
            Violation::OfferAgain(0),
        ),
    ];
    for (forge, violation) in cases {
        let config = EngineConfig::default();
        let (mut a, mut b) = connected(&config, SoftFaults::default());
        // b's socket, so that b (the sender) takes offers for it.
        let socket = open(&mut b, &mut a);
        for bytes in forge(socket) {
            raw_send(&a, &bytes);
        }
        for _ in 0..4 {
            b.step(true);
        }
        let expected = match violation {
            Violation::OfferAgain(_) => Violation::OfferAgain(socket),
            other => other,
        };
        assert_eq!(b.failure, Some(EngineError::Protocol(expected)));
    }
}

#[test]
fn a_request_to_send_in_the_offers_range_fails_the_engine() {
    let (a, mut b) = connected(&EngineConfig::default(), SoftFaults::default());
    raw_rts(&a, 1, OFFER_BIT | 3, 100_000);
    for _ in 0..4 {
        b.step(true);
    }
    assert_eq!(
        b.failure,
        Some(EngineError::Protocol(Violation::MessageIdInOfferRange(
            OFFER_BIT | 3
        )))
    );
}

#[test]
fn the_peers_close_frees_its_unused_offer_after_the_windows_invalidation() {
    let config = EngineConfig::default();
    let (mut a, mut b) = connected_with(&config, SoftFaults::default(), Instant::now(), true);
    let socket = open(&mut a, &mut b);
    b.recv_pool.flush_thread_cache();
    let before = b.recv_pool.stats().in_use_bytes;
    one_by_one(&mut a, &mut b, socket, &[1 << 20]);
    let offered = b.engine.offers_out().1;
    assert!(offered > 1 << 20);
    let [(_, addr, _, rkey, _)] = b.engine.grants()[..] else {
        panic!("one offer: {:?}", b.engine.grants());
    };
    a.engine.close_socket(socket);
    // Step by step: the buffer is kept while the invalidation is out.
    let mut kept = false;
    for _ in 0..100 {
        a.step(true);
        b.step(true);
        if !b.closed.is_empty() {
            kept |= b.engine.retiring_len() == 1;
        }
    }
    pump(&mut a, &mut b);
    assert_eq!(b.closed, vec![socket]);
    assert!(
        kept,
        "the withdrawn offer's buffer waited for its invalidation"
    );
    assert_eq!(b.engine.retiring_len(), 0);
    assert_eq!(b.engine.offers_out(), (0, 0));
    assert_eq!(b.engine.granted(), (0, 0));
    // The message (held by the test) and no offer remain in use.
    drop(std::mem::take(&mut b.received));
    drop(std::mem::take(&mut b.arrivals));
    b.recv_pool.flush_thread_cache();
    let after = b.recv_pool.stats().in_use_bytes;
    assert!(after <= before + (64 << 10), "{before} -> {after}");
    // The offer's key died before its buffer went back.
    assert_eq!(
        super::raw_write(&a, addr, rkey, 64),
        WcStatus::RemoteAccessError
    );
}
