//! Stateful property tests of the sans-IO engine: random interleavings of
//! sends (small and large, both directions, several sockets), I/O rounds
//! of either side (with or without polling receives), the passing of time,
//! completions the soft NIC holds back, and control messages from a
//! hostile peer injected on the wire. Checked after every step: no panic, the send window and the
//! send queue never exceeded (the helpers assert both at each post), the
//! bytes granted to the peer within the budget; at the end, an honest run
//! delivers every message exactly once, intact and in per-socket order,
//! leaves nothing granted but the offers for the sockets' next messages,
//! and nothing at all once the sockets are closed.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::super::control::{ControlHeader, ControlKind};
use super::*;

#[derive(Debug, Clone)]
enum Op {
    /// `from_b` sends a message of `len` bytes on socket `socket`.
    Send {
        from_b: bool,
        socket: usize,
        len: usize,
    },
    /// One I/O round of one side.
    Step { b: bool, poll_recv: bool },
    /// Time passes.
    Advance { ms: u16 },
}

#[derive(Debug, Clone)]
enum Hostile {
    Rts {
        msg_id: u32,
        size: u64,
    },
    Cts {
        msg_id: u32,
        addr: u64,
        rkey: u32,
    },
    Data {
        socket_bits: u32,
    },
    Credit {
        credits: u16,
    },
    Open {
        socket_bits: u32,
    },
    Close {
        socket_bits: u32,
    },
    Offer {
        msg_id: u32,
        addr: u64,
        rkey: u32,
        size: Option<u64>,
        socket: Result<usize, u32>,
    },
    Garbage {
        bytes: Vec<u8>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<bool>(), 0usize..3, prop_oneof![0usize..2048, 2048usize..300_000])
            .prop_map(|(from_b, socket, len)| Op::Send { from_b, socket, len }),
        6 => (any::<bool>(), any::<bool>()).prop_map(|(b, poll_recv)| Op::Step { b, poll_recv }),
        1 => (0u16..200).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// Hostile control messages, weighted towards those a live engine takes
/// without failing (fresh requests to send of allowed sizes, which pile up
/// grants; credits; closes), so that the checks run on live engines and
/// not only on one failed by the first bad message.
fn hostile() -> impl Strategy<Value = Hostile> {
    prop_oneof![
        6 => (1000u32..100_000, 1025u64..=(1 << 20))
            .prop_map(|(msg_id, size)| Hostile::Rts { msg_id, size }),
        1 => (0u32..8, 0u64..(2 << 20)).prop_map(|(msg_id, size)| Hostile::Rts { msg_id, size }),
        1 => (0u32..8, any::<u64>(), any::<u32>())
            .prop_map(|(msg_id, addr, rkey)| Hostile::Cts { msg_id, addr, rkey }),
        1 => any::<u32>().prop_map(|socket_bits| Hostile::Data { socket_bits }),
        2 => (0u16..16).prop_map(|credits| Hostile::Credit { credits }),
        1 => any::<u32>().prop_map(|socket_bits| Hostile::Open { socket_bits }),
        2 => any::<u32>().prop_map(|socket_bits| Hostile::Close { socket_bits }),
        2 => (
            prop_oneof![Just(OFFER_BIT | 7), any::<u32>()],
            any::<u64>(),
            any::<u32>(),
            proptest::option::of(0u64..(2 << 20)),
            prop_oneof![(0usize..3).prop_map(Ok), any::<u32>().prop_map(Err)],
        )
            .prop_map(|(msg_id, addr, rkey, size, socket)| Hostile::Offer { msg_id, addr, rkey, size, socket }),
        1 => proptest::collection::vec(any::<u8>(), 0..64)
            .prop_map(|bytes| Hostile::Garbage { bytes }),
    ]
}

fn config() -> EngineConfig {
    EngineConfig {
        // Keepalive on, so that the passing of time drives something (a
        // write every 50 ms); its timeout is beyond any run's time, so an
        // honest run never declares its peer dead.
        keepalive: Some(KeepaliveConfig {
            interval: Duration::from_millis(50),
            timeout: Duration::from_secs(3600),
        }),
        small_message_limit: 1024,
        fragment_size: 16 << 10,
        max_message_size: 1 << 20,
        max_granted_bytes: 1 << 20,
        window: crate::rdma::window::WindowConfig {
            max_bytes: 96 << 10,
            ..Default::default()
        },
        ..EngineConfig::default()
    }
}

/// Applies `op` at `now`; the sent messages are recorded per (receiver,
/// socket) as (length, seed).
fn apply(
    a: &mut Side,
    b: &mut Side,
    sockets: &[SocketId],
    sent: &mut [Vec<Vec<(usize, u8)>>; 2],
    op: &Op,
    now: &mut Instant,
    seed: &mut u8,
) {
    match *op {
        Op::Send {
            from_b,
            socket,
            len,
        } => {
            let (from, to) = if from_b { (&mut *b, 0) } else { (&mut *a, 1) };
            *seed = seed.wrapping_add(1);
            if from
                .engine
                .send(sockets[socket], message(&from.send_pool, len, *seed))
                .is_ok()
            {
                sent[to][socket].push((len, *seed));
            }
        }
        Op::Step { b: true, poll_recv } => {
            b.step_at(poll_recv, *now);
        }
        Op::Step {
            b: false,
            poll_recv,
        } => {
            a.step_at(poll_recv, *now);
        }
        Op::Advance { ms } => *now += Duration::from_millis(u64::from(ms)),
    }
    let (granted, _) = b.engine.granted();
    let (_, offered) = b.engine.offers_out();
    assert!(
        within_budget(granted, offered),
        "{granted} granted, {offered} of it offered"
    );
}

/// The grant budget as `offers.rs` documents it: offers hold at most half
/// of `max_granted_bytes`, and the grants besides them at most all of it
/// (a request alone but for offers is granted whatever the offers hold, so
/// the total may pass the budget by the offers' bytes). Before, this
/// checked the total alone, and a hostile request beside an offer (found
/// by a random run) broke it while the engine did what it documents.
fn within_budget(granted: u64, offered: u64) -> bool {
    let max = config().max_granted_bytes;
    offered <= max / 2 && granted.saturating_sub(offered) <= max
}

/// Runs both sides until neither makes progress for a few rounds in a row
/// (delayed completions come back within `max_delay_polls` polls).
fn pump_at(a: &mut Side, b: &mut Side, now: Instant) {
    let mut quiet = 0;
    for _ in 0..200_000 {
        let pa = a.step_at(true, now);
        let pb = b.step_at(true, now);
        quiet = if pa || pb { 0 } else { quiet + 1 };
        if quiet >= 8 {
            return;
        }
    }
    panic!("no quiescence");
}

/// `a` opens a socket and `b` accepts it, however long the faults make it.
fn open_at(a: &mut Side, b: &mut Side, now: Instant) -> SocketId {
    let socket = a.engine.open_socket().unwrap();
    pump_at(a, b, now);
    assert!(
        b.opened.contains(&socket),
        "open {socket:#x}: opened {:?}, failures {:?} {:?}, stats {:?} {:?}",
        b.opened,
        a.failure,
        b.failure,
        a.engine.stats(),
        b.engine.stats()
    );
    b.engine.accept_socket(socket);
    pump_at(a, b, now);
    assert!(a.accepted.contains(&socket));
    socket
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn honest_interleavings_deliver_every_message_once_in_order(
        ops in proptest::collection::vec(op(), 1..80),
        delays in any::<bool>(),
        confined in any::<bool>(),
    ) {
        let faults = SoftFaults {
            seed: 7,
            delay_per_million: if delays { 200_000 } else { 0 },
            max_delay_polls: 3,
            ..SoftFaults::default()
        };
        let mut now = Instant::now();
        let (mut a, mut b) = connected_with(&config(), faults, now, confined);
        let sockets: Vec<SocketId> = (0..3).map(|_| open_at(&mut a, &mut b, now)).collect();
        let mut sent: [Vec<Vec<(usize, u8)>>; 2] = [vec![Vec::new(); 3], vec![Vec::new(); 3]];
        let mut seed = 0u8;
        for op in &ops {
            apply(&mut a, &mut b, &sockets, &mut sent, op, &mut now, &mut seed);
        }
        pump_at(&mut a, &mut b, now);
        prop_assert!(a.failure.is_none() && b.failure.is_none(), "{:?} {:?}", a.failure, b.failure);
        for (side, to) in [(&a, 0usize), (&b, 1)] {
            for (i, &socket) in sockets.iter().enumerate() {
                let got: Vec<&Bytes> = side
                    .arrivals
                    .iter()
                    .filter(|(s, _)| *s == socket)
                    .map(|(_, m)| m)
                    .collect();
                prop_assert_eq!(got.len(), sent[to][i].len(), "socket {} to side {}", i, to);
                for (message, &(len, seed)) in got.iter().zip(&sent[to][i]) {
                    check(message, len, seed);
                }
            }
        }
        // Granted now: the offers for the sockets' next messages only.
        prop_assert_eq!(a.engine.granted(), (a.engine.offers_out().1, 0));
        prop_assert_eq!(b.engine.granted(), (b.engine.offers_out().1, 0));
        prop_assert!(a.engine.is_idle() && b.engine.is_idle());
        // Closed both ways, the sockets leave nothing granted.
        for &socket in &sockets {
            a.engine.close_socket(socket);
            b.engine.close_socket(socket);
        }
        pump_at(&mut a, &mut b, now);
        prop_assert!(a.failure.is_none() && b.failure.is_none(), "{:?} {:?}", a.failure, b.failure);
        prop_assert_eq!(a.engine.granted(), (0, 0));
        prop_assert_eq!(b.engine.granted(), (0, 0));
        prop_assert_eq!(a.engine.offers_out(), (0, 0));
        prop_assert_eq!(b.engine.offers_out(), (0, 0));
    }

    #[test]
    fn hostile_control_messages_never_panic_and_never_exceed_the_grant_budget(
        ops in proptest::collection::vec(
            prop_oneof![4 => op().prop_map(Ok), 1 => hostile().prop_map(Err)],
            1..80,
        ),
        confined in any::<bool>(),
    ) {
        let mut now = Instant::now();
        let (mut a, mut b) = connected_with(&config(), SoftFaults::default(), now, confined);
        let sockets: Vec<SocketId> = (0..3).map(|_| open_at(&mut a, &mut b, now)).collect();
        let mut sent: [Vec<Vec<(usize, u8)>>; 2] = [vec![Vec::new(); 3], vec![Vec::new(); 3]];
        let mut seed = 0u8;
        let mut on_live = 0usize;
        for op in &ops {
            match op {
                Ok(op) => apply(&mut a, &mut b, &sockets, &mut sent, op, &mut now, &mut seed),
                // Injected on a's queue pair behind its engine's back, as a
                // peer that does not follow the protocol would send them.
                Err(hostile) => {
                    let header = |kind, msg_id, socket| {
                        ControlHeader { kind, credits: 0, msg_id, socket }.encode().to_vec()
                    };
                    let bytes = match hostile.clone() {
                        Hostile::Rts { msg_id, size } => header(ControlKind::Rts { size }, msg_id, sockets[0]),
                        Hostile::Cts { msg_id, addr, rkey } => header(ControlKind::Cts { addr, rkey }, msg_id, 0),
                        Hostile::Data { socket_bits } => header(ControlKind::Data, 0, socket_bits),
                        Hostile::Credit { credits } => ControlHeader {
                            kind: ControlKind::Credit,
                            credits,
                            msg_id: 0,
                            socket: 0,
                        }
                        .encode()
                        .to_vec(),
                        Hostile::Open { socket_bits } => header(ControlKind::Open, 0, socket_bits),
                        Hostile::Close { socket_bits } => header(ControlKind::Close, 0, socket_bits),
                        Hostile::Offer { msg_id, addr, rkey, size, socket } => {
                            let socket = socket.map_or_else(|bits| bits, |i| sockets[i]);
                            let mut bytes = header(ControlKind::Offer { addr, rkey }, msg_id, socket);
                            if let Some(size) = size {
                                bytes.extend_from_slice(&size.to_le_bytes());
                            }
                            bytes
                        }
                        Hostile::Garbage { bytes } => bytes,
                    };
                    if a.engine.is_failed() || b.engine.is_failed() {
                        continue;
                    }
                    on_live += 1;
                    raw_send(&a, &bytes);
                }
            }
        }
        // However it ends, it ends: both sides reach quiescence (a failed
        // engine is quiet) without a panic.
        pump_at(&mut a, &mut b, now);
        let hostile_ops = ops.iter().filter(|op| op.is_err()).count();
        prop_assert!(
            on_live > 0 || hostile_ops == 0,
            "the first hostile message reaches a live engine"
        );
        let (granted, waiting) = b.engine.granted();
        let (_, offered) = b.engine.offers_out();
        prop_assert!(within_budget(granted, offered), "{} granted, {} of it offered", granted, offered);
        prop_assert!(waiting <= crate::rdma::engine::MAX_WAITING_RTS);
    }
}
