//! The worker driven round by round, on this thread, with one engine on a
//! soft device whose peer is a bare queue pair the test posts on: chunks
//! handed in by another driver's engine (a fake origin whose answers the
//! test reads), a partner that panics or fails with chunks out, and a
//! receiving engine's grants held for late writes. No clock is read for
//! any decision the tests check, and no order is left to a sleep.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tokio::sync::mpsc;

use super::testkit::{attached, caps, fake_driver, worker};
use super::*;
use crate::pool::{Access, Pool, PoolBuf, PoolConfig};
use crate::rdma::control::{ControlHeader, ControlKind};
use crate::rdma::engine::{Engine, EngineConfig, PeerInfo, Role, StripeChunk, StripeConfig};
use crate::rdma::io::Partner;
use crate::verbs::soft::{SoftDevice, SoftFabric, SoftFaults};
use crate::verbs::{AsyncEvent, Device, QueuePair, SendOp, SendWr, Sge};

/// The origin's QP number, as the answers name it.
const ORIGIN_QPN: u32 = 5;

struct Rig {
    worker: Worker,
    /// The worker's own handle (its command queue stays open with it).
    handle: IoThread,
    /// A fake driver of the origin engine: what the worker answers it.
    origin: IoThread,
    answers: mpsc::UnboundedReceiver<Command>,
    /// Sockets the peer opened, as the application gets them.
    accepted: mpsc::Receiver<crate::Connection>,
    qpn: u32,
    alive: Arc<AtomicBool>,
    send_pool: Pool,
    recv_pool: Pool,
    remote_qp: Arc<dyn QueuePair>,
    remote_pool: Pool,
    /// Kept: their receives and registrations live with them.
    _remote_recvs: Vec<PoolBuf>,
    _devices: Vec<SoftDevice>,
    _fabric: SoftFabric,
}

/// A worker with one engine (`config`; its receive pool on two rails with
/// `two_rails`) connected to a bare queue pair with receives posted.
fn rig(faults: SoftFaults, config: &EngineConfig, two_rails: bool) -> Rig {
    let fabric = SoftFabric::new();
    let device = fabric.open("w", faults).unwrap();
    let remote = fabric.open("r", SoftFaults::default()).unwrap();
    let rail1 = fabric.open("w1", SoftFaults::default()).unwrap();
    let (send_pool, mut recv_pool) =
        crate::verbs::soft::test_pools_with(&device, "w", Access::RemoteWrite);
    if two_rails {
        recv_pool = Pool::on_rails(
            PoolConfig::named("w-recv-rails"),
            Access::RemoteWrite,
            vec![device.registration_hook(), rail1.registration_hook()],
        )
        .unwrap();
    }
    let (_, remote_pool) = crate::verbs::soft::test_pools_with(&remote, "r", Access::RemoteWrite);
    let cq = device.create_cq(1024).unwrap();
    let qp = device
        .create_qp(cq.clone(), cq.clone(), caps(64, 64))
        .unwrap();
    qp.init().unwrap();
    let remote_cq = remote.create_cq(1024).unwrap();
    let remote_qp = remote
        .create_qp(remote_cq.clone(), remote_cq, caps(64, 64))
        .unwrap();
    remote_qp.init().unwrap();
    let mut engine = Engine::new(
        config.clone(),
        send_pool.clone(),
        recv_pool.clone(),
        Role::Acceptor,
        Instant::now(),
    )
    .unwrap();
    qp.post_recv(&engine.poll_recv_post().unwrap()).unwrap();
    let mut remote_recvs = Vec::new();
    let mut wrs = Vec::new();
    for i in 0..32u64 {
        let mut buf = remote_pool.alloc(16 << 10).unwrap();
        buf.set_len(16 << 10);
        wrs.push(crate::rdma::engine::recv_wr(i, &buf, 0).unwrap());
        remote_recvs.push(buf);
    }
    remote_qp.post_recv(&wrs).unwrap();
    qp.connect(&remote_qp.endpoint()).unwrap();
    remote_qp.connect(&qp.endpoint()).unwrap();
    let (worker, handle) = worker(cq.clone());
    let (origin, answers) = fake_driver(cq);
    let (accepts, accepted) = mpsc::channel(4);
    let qpn = qp.qpn();
    let info = PeerInfo {
        recv_depth: 32,
        recv_buffer: 16 << 10,
        keepalive_slot: None,
        shared_receives: false,
    };
    // One message fills a socket's channel: an application that does not
    // read holds the engine (`holding`).
    let (attached, view) = attached(qp, engine, Some(accepts), config.max_message_size, 1);
    let alive = view.alive;
    handle.submit(Command::Attach(Box::new(attached)));
    handle.submit(Command::PeerReady { qpn, info });
    let mut rig = Rig {
        worker,
        handle,
        origin,
        answers,
        accepted,
        qpn,
        alive,
        send_pool,
        recv_pool,
        remote_qp,
        remote_pool,
        _remote_recvs: remote_recvs,
        _devices: vec![device, remote, rail1],
        _fabric: fabric,
    };
    rig.rounds(2);
    rig
}

impl Rig {
    fn rounds(&mut self, n: usize) {
        for _ in 0..n {
            assert!(self.worker.round().is_some());
        }
    }

    /// The answers the origin got so far: (token, ok).
    fn answers(&mut self) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        while let Ok(command) = self.answers.try_recv() {
            if let Command::StripeDone { qpn, token, ok } = command {
                assert_eq!(qpn, ORIGIN_QPN);
                out.push((token, ok));
            }
        }
        out
    }

    /// A chunk of `len` bytes for the engine to write into the remote's
    /// memory, handed in as origin 7's chunk `token`.
    fn hand_in(&mut self, token: u64, len: usize) -> PoolBuf {
        let mut dest = self.remote_pool.alloc(len).unwrap();
        dest.set_len(len);
        let data = self.send_pool.alloc_copy(&vec![7u8; len]).unwrap();
        let chunk = StripeChunk {
            remote_addr: dest.as_ptr() as u64,
            rkey: dest.region().unwrap().rkey,
            parts: vec![data.freeze()],
            len,
        };
        self.handle.submit(Command::StripeWrites {
            qpn: self.qpn,
            origin: 7,
            token,
            chunk,
            reply: (self.origin.clone(), ORIGIN_QPN),
        });
        dest
    }

    /// The remote sends control message `kind` (past any engine).
    fn remote_control(&self, kind: ControlKind, msg_id: u32, socket: u32, extra: &[u8]) {
        let mut bytes = ControlHeader {
            kind,
            credits: 0,
            msg_id,
            socket,
        }
        .encode()
        .to_vec();
        bytes.extend_from_slice(extra);
        let buf = self.remote_pool.alloc_copy(&bytes).unwrap();
        let sge = Sge {
            addr: buf.as_ptr() as usize,
            len: buf.len() as u32,
            lkey: buf.region().unwrap().lkey,
        };
        self.remote_qp
            .post_send(&[SendWr {
                wr_id: 1 << 40,
                op: SendOp::Send,
                sges: vec![sge],
                signaled: false,
            }])
            .unwrap();
    }

    /// The remote opens socket 1 and sends one small message on it, which
    /// the application never reads: the engine's slot is then held by its
    /// sockets' backlog once it fails.
    fn open_unread_socket(&mut self) -> crate::Connection {
        self.remote_control(ControlKind::Open, 0, 1, &[]);
        self.rounds(2);
        let connection = self.accepted.try_recv().expect("the socket was accepted");
        self.remote_control(ControlKind::Data, 0, 1, b"hello");
        self.rounds(2);
        connection
    }

    fn in_use(&self) -> u64 {
        self.recv_pool.flush_thread_cache();
        self.recv_pool.stats().in_use_bytes
    }
}

/// Issue 57, hole 10: a route for the answers of an origin's chunks goes
/// with its last answer. Before, every origin that ever striped through a
/// worker kept an entry there for the worker's life.
#[test]
fn the_route_of_an_origins_chunks_goes_with_its_last_answer() {
    let mut rig = rig(SoftFaults::default(), &EngineConfig::default(), false);
    let dest = rig.hand_in(1, 100_000);
    rig.rounds(4);
    assert_eq!(rig.answers(), vec![(1, true)]);
    assert!(dest.iter().all(|&b| b == 7), "the chunk was written");
    assert_eq!(rig.worker.origins.len(), 0, "the route outlived its chunks");
}

/// Issue 57, hole 7: a partner whose engine panics with a chunk handed in
/// answers it "not written" (once its queue pair is gone), so the origin
/// writes the range itself. Before, the chunk was never answered: the
/// origin's `take_own` waited for it for ever, and its socket with it.
#[test]
fn a_panicked_partner_answers_the_chunks_it_had() {
    let mut rig = rig(SoftFaults::default(), &EngineConfig::default(), false);
    let _dest = rig.hand_in(1, 100_000);
    // Handled (queued in the engine), not yet written: the engine panics.
    let command = rig.worker.queue.try_recv().unwrap();
    rig.worker.handle_command(command);
    rig.worker.with_engine(rig.qpn, |_| {
        if rig_panics() {
            panic!("injected: an engine bug");
        }
    });
    rig.rounds(3);
    assert_eq!(rig.answers(), vec![(1, false)]);
    assert_eq!(rig.worker.origins.len(), 0);
}

fn rig_panics() -> bool {
    true
}

/// Issue 57, hole 8: a partner that fails with a chunk's write posted
/// answers it only once that write's completion came back (here held
/// back a poll by the soft NIC), not when its queue pair was moved to
/// error: until then the NIC may still carry it out, and an origin told
/// "not written" rewrites the range and finishes the message, whose
/// buffer the receiver then hands on. Its application does not read, so
/// the engine's slot (and queue pair) stays while this plays out.
#[test]
fn a_failed_partner_answers_a_chunk_only_after_its_writes_completed() {
    let faults = SoftFaults {
        seed: 1,
        delay_per_million: 1_000_000,
        max_delay_polls: 1,
        ..SoftFaults::default()
    };
    let mut rig = rig(faults, &EngineConfig::default(), false);
    let _socket = rig.open_unread_socket();
    let _dest = rig.hand_in(1, 100_000);
    // Handled and written; its completion is a poll behind.
    rig.rounds(1);
    assert!(rig.answers().is_empty());
    rig.handle
        .submit(Command::Event(AsyncEvent::QpFailed { qpn: rig.qpn }));
    rig.rounds(1);
    assert!(
        rig.answers().is_empty(),
        "answered before its write's completion"
    );
    rig.rounds(3);
    assert_eq!(rig.answers(), vec![(1, true)], "written before the failure");
}

/// Issue 57, hole 6: a receiving engine that told its grants' keys on
/// other rails and then panicked keeps those buffers from the pool while
/// its partner (this side's engine on the other rail to the same peer,
/// through which the peer's partner writes chunks) lives, and lets them
/// go once the partner's queue pair is in error. Before, a panicked
/// engine's grants went back to the pool at once.
#[test]
fn a_panicked_engines_exposed_grants_are_held_while_its_partners_live() {
    let config = EngineConfig {
        rails: 2,
        stripe: Some(StripeConfig::default()),
        offers: false,
        ..EngineConfig::default()
    };
    let mut rig = rig(SoftFaults::default(), &config, true);
    let partner_alive = Arc::new(AtomicBool::new(true));
    rig.handle.submit(Command::Partners {
        qpn: rig.qpn,
        partners: vec![Partner {
            rail: 1,
            io: rig.origin.clone(),
            qpn: 99,
            alive: Arc::clone(&partner_alive),
        }],
    });
    rig.rounds(1);
    // The peer asks to send 1 MiB: granted, its keys on both rails told.
    // (The engine's receive buffers, which go with it, are less than that.)
    let grant = 1 << 20;
    rig.remote_control(ControlKind::Rts { size: grant }, 1, 1, &[]);
    rig.rounds(2);
    assert!(rig.in_use() >= grant, "granted");
    rig.worker.with_engine(rig.qpn, |_| {
        if rig_panics() {
            panic!("injected: an engine bug");
        }
    });
    rig.rounds(2);
    assert!(!rig.alive.load(Ordering::Acquire));
    assert!(
        rig.in_use() >= grant,
        "the grant went back to the pool while the partner's queue pair takes writes"
    );
    assert_eq!(rig.worker.late.buffers(), 1);
    partner_alive.store(false, Ordering::Release);
    rig.rounds(1);
    assert_eq!(rig.worker.late.buffers(), 0);
    assert!(rig.in_use() < grant, "held for ever");
}
