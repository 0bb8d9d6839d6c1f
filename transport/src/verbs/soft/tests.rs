use std::sync::Arc;

use super::*;
use crate::pool::{Access, Pool, PoolBuf, PoolConfig};
use crate::verbs::{
    CompletionQueue, Device, QpCaps, QpState, QueuePair, RecvWr, SendOp, SendWr, Sge, WcKind,
    WcStatus, WorkCompletion,
};

/// One side of a connection: a device, its pools, a connected QP and its CQs.
struct Side {
    device: SoftDevice,
    send_pool: Pool,
    recv_pool: Pool,
    qp: Arc<dyn QueuePair>,
    send_cq: Arc<dyn CompletionQueue>,
    recv_cq: Arc<dyn CompletionQueue>,
}

impl Side {
    fn new(fabric: &SoftFabric, name: &str, faults: SoftFaults, caps: QpCaps) -> Self {
        Self::with(fabric, name, faults, caps, SoftProfile::default())
    }

    fn with(
        fabric: &SoftFabric,
        name: &str,
        faults: SoftFaults,
        caps: QpCaps,
        profile: SoftProfile,
    ) -> Self {
        let device = fabric.open_with(name, faults, profile).unwrap();
        let (send_pool, recv_pool) = crate::verbs::soft::test_pools(&device, name);
        let send_cq = device.create_cq(64).unwrap();
        let recv_cq = device.create_cq(64).unwrap();
        let qp = device
            .create_qp(send_cq.clone(), recv_cq.clone(), caps)
            .unwrap();
        qp.init().unwrap();
        Self {
            device,
            send_pool,
            recv_pool,
            qp,
            send_cq,
            recv_cq,
        }
    }

    fn poll_send(&self) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        self.send_cq.poll(&mut out, 1024);
        out
    }

    /// Send completions, waiting (on the CQ's wake-up) for the first: the
    /// retry engine makes them on its own thread.
    fn wait_send(&self) -> Vec<WorkCompletion> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let got = self.poll_send();
            if !got.is_empty() {
                return got;
            }
            self.send_cq.arm();
            let got = self.poll_send();
            if !got.is_empty() {
                return got;
            }
            assert!(std::time::Instant::now() < deadline, "no send completion");
            self.send_cq.wait(std::time::Duration::from_millis(100));
        }
    }

    fn poll_recv(&self) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        self.recv_cq.poll(&mut out, 1024);
        out
    }
}

fn sge(buf: &PoolBuf) -> Sge {
    Sge {
        addr: buf.as_ptr() as usize,
        len: buf.len() as u32,
        lkey: buf.region().unwrap().lkey,
    }
}

fn pair_with(faults: SoftFaults, caps: QpCaps) -> (Side, Side) {
    let fabric = SoftFabric::new();
    let a = Side::new(&fabric, "a", faults, caps);
    let b = Side::new(&fabric, "b", SoftFaults::default(), caps);
    a.qp.connect(&b.qp.endpoint()).unwrap();
    b.qp.connect(&a.qp.endpoint()).unwrap();
    (a, b)
}

fn pair() -> (Side, Side) {
    pair_with(SoftFaults::default(), QpCaps::default())
}

fn send(wr_id: u64, buf: &PoolBuf) -> SendWr {
    SendWr {
        wr_id,
        op: SendOp::Send,
        sges: vec![sge(buf)],
        signaled: true,
    }
}

/// A WRITE of all of `data` to the start of `target`.
fn write_wr(wr_id: u64, target: &PoolBuf, data: &PoolBuf, signaled: bool) -> SendWr {
    SendWr {
        wr_id,
        op: SendOp::Write {
            remote_addr: target.as_ptr() as usize,
            rkey: target.region().unwrap().rkey,
        },
        sges: vec![sge(data)],
        signaled,
    }
}

fn filled(pool: &Pool, len: usize, byte: u8) -> PoolBuf {
    let mut buf = pool.alloc(len).unwrap();
    buf.fill(byte);
    buf
}

#[test]
fn send_lands_in_the_first_posted_receive() {
    let (a, b) = pair();
    let first = filled(&b.recv_pool, 64, 0);
    let second = filled(&b.recv_pool, 64, 0);
    b.qp.post_recv(&[
        RecvWr {
            wr_id: 1,
            sge: sge(&first),
        },
        RecvWr {
            wr_id: 2,
            sge: sge(&second),
        },
    ])
    .unwrap();
    let data = filled(&a.send_pool, 40, 7);
    a.qp.post_send(&[send(10, &data)]).unwrap();
    let sent = a.poll_send();
    assert_eq!(sent.len(), 1);
    assert_eq!(
        (sent[0].wr_id, sent[0].status, sent[0].kind),
        (10, WcStatus::Success, WcKind::Send)
    );
    let received = b.poll_recv();
    assert_eq!(received.len(), 1);
    assert_eq!(
        (received[0].wr_id, received[0].status, received[0].byte_len),
        (1, WcStatus::Success, 40)
    );
    assert!(first[..40].iter().all(|&x| x == 7) && first[40..].iter().all(|&x| x == 0));
    assert!(second.iter().all(|&x| x == 0));
}

/// The QP state machine of real providers: receives need INIT (rxe and
/// hns refuse them in RESET), sends need RTS, each transition happens
/// once, and a responder not yet in RTR drops what arrives, so the
/// sender's retries run out. Before: the soft NIC took receives and
/// connections in RESET, and the connection code posted its first
/// receives there.
#[test]
fn each_qp_state_allows_what_real_providers_allow() {
    let fabric = SoftFabric::new();
    let device = fabric.open("a", SoftFaults::default()).unwrap();
    let (send_pool, recv_pool) = crate::verbs::soft::test_pools(&device, "a");
    let cq = device.create_cq(64).unwrap();
    let qp = device
        .create_qp(cq.clone(), cq.clone(), QpCaps::default())
        .unwrap();
    assert_eq!(qp.state(), QpState::Reset);
    let inbox = filled(&recv_pool, 64, 0);
    let recv = [RecvWr {
        wr_id: 1,
        sge: sge(&inbox),
    }];
    let data = filled(&send_pool, 8, 1);
    let wrong = |result: Result<(), crate::verbs::VerbsError>, state: QpState| {
        assert_eq!(
            result,
            Err(crate::verbs::VerbsError::WrongState {
                qpn: qp.qpn(),
                state
            })
        );
    };
    // The peer is created and initialised, never connected.
    let peer = Side::new(&fabric, "b", SoftFaults::default(), QpCaps::default());
    assert_eq!(peer.qp.state(), QpState::Init);
    wrong(qp.post_recv(&recv), QpState::Reset);
    wrong(qp.post_send(&[send(2, &data)]), QpState::Reset);
    wrong(qp.connect(&peer.qp.endpoint()), QpState::Reset);
    qp.init().unwrap();
    wrong(qp.init(), QpState::Init);
    qp.post_recv(&recv).unwrap();
    wrong(qp.post_send(&[send(2, &data)]), QpState::Init);
    qp.connect(&peer.qp.endpoint()).unwrap();
    assert_eq!(qp.state(), QpState::ReadyToSend);
    wrong(qp.connect(&peer.qp.endpoint()), QpState::ReadyToSend);
    qp.post_send(&[send(3, &data)]).unwrap();
    let mut done = Vec::new();
    cq.poll(&mut done, 16);
    let sent = done.iter().find(|c| c.wr_id == 3).unwrap();
    assert_eq!(sent.status, WcStatus::RetryExceeded);
    assert_eq!(qp.state(), QpState::Error);
}

/// The soft NIC reports its limits and refuses what they do not hold, at
/// every create call, as a real device does (before: any depth and count
/// went, where rxe refuses a CQ of 32,768 entries).
#[test]
fn create_calls_beyond_the_devices_limits_are_refused() {
    use crate::verbs::{DeviceLimits, VerbsError};
    let fabric = SoftFabric::new();
    let small = DeviceLimits {
        max_qp: 1,
        max_cq: 2,
        max_srq: 1,
        ..DeviceLimits::SOFT
    };
    let device = fabric
        .open_with(
            "small",
            SoftFaults::default(),
            SoftProfile {
                limits: small,
                ..SoftProfile::default()
            },
        )
        .unwrap();
    assert_eq!(device.limits(), small);
    let refused = |result: Result<(), VerbsError>, limit: &str| match result {
        Err(VerbsError::OverLimit { what, .. }) => assert!(what.contains(limit), "{what}"),
        other => panic!("{limit}: {other:?}"),
    };
    refused(device.create_cq(32_768).map(drop), "max_cqe");
    let cq = device.create_cq(64).unwrap();
    let _second = device.create_cq(64).unwrap();
    refused(device.create_cq(64).map(drop), "max_cq");
    let deep = QpCaps {
        max_recv_wr: 0x4001,
        ..QpCaps::default()
    };
    refused(
        device.create_qp(cq.clone(), cq.clone(), deep).map(drop),
        "max_qp_wr",
    );
    let wide = QpCaps {
        max_sge: 33,
        ..QpCaps::default()
    };
    refused(
        device.create_qp(cq.clone(), cq.clone(), wide).map(drop),
        "max_sge",
    );
    let qp = device
        .create_qp(cq.clone(), cq.clone(), QpCaps::default())
        .unwrap();
    refused(
        device
            .create_qp(cq.clone(), cq.clone(), QpCaps::default())
            .map(drop),
        "max_qp",
    );
    // A destroyed QP frees its place.
    drop(qp);
    device.create_qp(cq.clone(), cq, QpCaps::default()).unwrap();
    refused(device.create_srq(0x4001).map(drop), "max_srq_wr");
}

/// An injected post failure behaves as `ibv_post_send`'s `bad_wr`: the
/// work requests before the one it stopped at are posted (and complete),
/// the rest are not, and the QP's state is untouched until its owner
/// fails it; then everything outstanding is flushed.
#[test]
fn a_failed_post_posts_a_prefix_and_fail_flushes_the_qp() {
    let faults = SoftFaults {
        seed: 3,
        post_error_per_million: 1_000_000,
        ..SoftFaults::default()
    };
    let (a, b) = pair_with(faults, QpCaps::default());
    let inbox: Vec<PoolBuf> = (0..4).map(|_| filled(&b.recv_pool, 64, 0)).collect();
    b.qp.post_recv(
        &inbox
            .iter()
            .enumerate()
            .map(|(i, buf)| RecvWr {
                wr_id: i as u64,
                sge: sge(buf),
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let data = filled(&a.send_pool, 8, 1);
    let wrs: Vec<SendWr> = (10..14).map(|id| send(id, &data)).collect();
    let posted = match a.qp.post_send(&wrs) {
        Err(crate::verbs::VerbsError::PostFailed {
            queue: "send",
            posted,
            ..
        }) => posted as usize,
        other => panic!("{other:?}"),
    };
    assert!(
        posted > 0 && posted < wrs.len(),
        "this seed stops part way: {posted}"
    );
    let sent = a.poll_send();
    assert_eq!(
        sent.iter().map(|c| c.wr_id).collect::<Vec<_>>(),
        (10..10 + posted as u64).collect::<Vec<_>>()
    );
    assert!(sent.iter().all(|c| c.status == WcStatus::Success));
    assert_eq!(b.poll_recv().len(), posted);
    assert_eq!(a.qp.state(), QpState::ReadyToSend);
    a.qp.fail().unwrap();
    assert_eq!(a.qp.state(), QpState::Error);
}

/// Two ports of different MTUs connect on the smaller, so every message
/// size crosses both ways (before: each side used its own port's MTU, and
/// the larger side's messages above the smaller MTU were lost, its
/// retries running out); ports that cannot talk are refused at connect,
/// naming what differs.
#[test]
fn connecting_ports_agree_on_the_smaller_mtu_and_refuse_mismatches() {
    use crate::verbs::{GidType, LinkLayer, VerbsError};
    let fabric = SoftFabric::new();
    let port = |mtu, link_layer, gid_type| SoftProfile {
        port: SoftPort {
            link_layer,
            gid_type,
            mtu,
            rate_mbps: 0,
        },
        ..SoftProfile::default()
    };
    let caps = QpCaps::default();
    let faults = SoftFaults::default();
    let big = port(4096, LinkLayer::Ethernet, GidType::RoceV2);
    let small = port(1024, LinkLayer::Ethernet, GidType::RoceV2);
    let a = Side::with(&fabric, "a", faults, caps, big);
    let b = Side::with(&fabric, "b", faults, caps, small);
    a.qp.connect(&b.qp.endpoint()).unwrap();
    b.qp.connect(&a.qp.endpoint()).unwrap();
    for (from, to) in [(&a, &b), (&b, &a)] {
        for len in [100, 1024, 1025, 4000, 8192] {
            let inbox = filled(&to.recv_pool, 8192, 0);
            to.qp
                .post_recv(&[RecvWr {
                    wr_id: len as u64,
                    sge: sge(&inbox),
                }])
                .unwrap();
            let data = filled(&from.send_pool, len, 5);
            from.qp.post_send(&[send(len as u64, &data)]).unwrap();
            assert_eq!(from.poll_send()[0].status, WcStatus::Success, "{len}");
            assert_eq!(to.poll_recv()[0].byte_len, len as u32);
        }
    }
    let refused = |local: SoftProfile, remote: SoftProfile| {
        let x = Side::with(&fabric, "x", faults, caps, local);
        let y = Side::with(&fabric, "y", faults, caps, remote);
        match x.qp.connect(&y.qp.endpoint()) {
            Err(VerbsError::PathMismatch { what, .. }) => what,
            other => panic!("{other:?}"),
        }
    };
    let ib = port(4096, LinkLayer::InfiniBand, GidType::IbRoceV1);
    let v1 = port(4096, LinkLayer::Ethernet, GidType::IbRoceV1);
    assert_eq!(refused(big, ib), "link layer");
    assert_eq!(refused(big, v1), "RoCE version");
}

/// A completion queue that overruns is reported as a device event (as a
/// real device raises `IBV_EVENT_CQ_ERR`) to whoever watches the device's
/// events, once the owner next polls; nothing after the watch is dropped.
#[test]
fn a_cq_overrun_is_reported_as_a_device_event() {
    use crate::verbs::AsyncEvent;
    let caps = QpCaps {
        max_send_wr: 128,
        max_recv_wr: 128,
        ..QpCaps::default()
    };
    let (a, b) = pair_with(SoftFaults::default(), caps);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let watch = b
        .device
        .watch_events(Arc::new({
            let seen = Arc::clone(&seen);
            move |event| seen.lock().unwrap().push(event)
        }))
        .unwrap();
    let inbox: Vec<PoolBuf> = (0..100).map(|_| filled(&b.recv_pool, 16, 0)).collect();
    let wrs: Vec<RecvWr> = inbox
        .iter()
        .enumerate()
        .map(|(i, buf)| RecvWr {
            wr_id: i as u64,
            sge: sge(buf),
        })
        .collect();
    b.qp.post_recv(&wrs).unwrap();
    let data = filled(&a.send_pool, 8, 1);
    // 100 receive completions into a CQ of 64, nobody polling.
    let sends: Vec<SendWr> = (0..100).map(|i| send(i, &data)).collect();
    a.qp.post_send(&sends).unwrap();
    assert!(
        seen.lock().unwrap().is_empty(),
        "reported when the owner polls"
    );
    b.poll_recv();
    assert_eq!(*seen.lock().unwrap(), vec![AsyncEvent::CqFailed]);
    assert_eq!(b.qp.state(), QpState::Error);
    drop(watch);
    a.qp.post_send(&[send(200, &data)]).unwrap();
    b.poll_recv();
    assert_eq!(seen.lock().unwrap().len(), 1);
}

#[test]
fn send_without_a_receive_is_receiver_not_ready_and_fails_the_qp() {
    let (a, b) = pair();
    let data = filled(&a.send_pool, 8, 1);
    a.qp.post_send(&[send(1, &data), send(2, &data)]).unwrap();
    let sent = a.poll_send();
    assert_eq!(
        sent.iter().map(|c| c.status).collect::<Vec<_>>(),
        [WcStatus::ReceiverNotReady, WcStatus::Flushed]
    );
    assert_eq!(b.device.stats().rnr_events, 1);
    assert_eq!(a.qp.state(), QpState::Error);
    // Later work is flushed, receives too.
    a.qp.post_send(&[send(3, &data)]).unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::Flushed);
    let mine = filled(&a.recv_pool, 8, 0);
    a.qp.post_recv(&[RecvWr {
        wr_id: 4,
        sge: sge(&mine),
    }])
    .unwrap();
    assert_eq!(a.poll_recv()[0].status, WcStatus::Flushed);
}

#[test]
fn write_lands_in_remote_memory_without_consuming_a_receive() {
    let (a, b) = pair();
    let target = filled(&b.recv_pool, 4096, 0);
    let region = target.region().unwrap();
    let posted = filled(&b.recv_pool, 16, 0);
    b.qp.post_recv(&[RecvWr {
        wr_id: 9,
        sge: sge(&posted),
    }])
    .unwrap();
    let data = filled(&a.send_pool, 1000, 5);
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        op: SendOp::Write {
            remote_addr: target.as_ptr() as usize + 100,
            rkey: region.rkey,
        },
        sges: vec![sge(&data)],
        signaled: true,
    }])
    .unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::Success);
    assert!(target[100..1100].iter().all(|&x| x == 5));
    assert!(target[..100].iter().chain(&target[1100..]).all(|&x| x == 0));
    assert!(
        b.poll_recv().is_empty(),
        "a plain WRITE is invisible to the receiver"
    );
}

#[test]
fn write_with_immediate_consumes_a_receive_and_delivers_the_immediate() {
    let (a, b) = pair();
    let target = filled(&b.recv_pool, 300_000, 0);
    let rkey = target.region().unwrap().rkey;
    let posted = filled(&b.recv_pool, 16, 0);
    b.qp.post_recv(&[RecvWr {
        wr_id: 77,
        sge: sge(&posted),
    }])
    .unwrap();
    let first = filled(&a.send_pool, 200_000, 1);
    let second = filled(&a.send_pool, 100_000, 2);
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        op: SendOp::WriteWithImm {
            remote_addr: target.as_ptr() as usize,
            rkey,
            imm: 0xfeed,
        },
        sges: vec![sge(&first), sge(&second)],
        signaled: true,
    }])
    .unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::Success);
    let received = b.poll_recv();
    assert_eq!(received.len(), 1);
    assert_eq!(
        (received[0].wr_id, received[0].kind, received[0].byte_len),
        (77, WcKind::RecvWithImm(0xfeed), 300_000)
    );
    assert!(target[..200_000].iter().all(|&x| x == 1) && target[200_000..].iter().all(|&x| x == 2));
    assert!(
        posted.iter().all(|&x| x == 0),
        "the data went to the WRITE's address, not the receive buffer"
    );
}

#[test]
fn one_sided_access_checks_rkey_rights_and_bounds() {
    let data_len = 64;
    for case in ["local-only memory", "out of bounds", "unknown rkey"] {
        let (a, b) = pair();
        let writable = filled(&b.recv_pool, 128, 0);
        let local_only = filled(&b.send_pool, 128, 0);
        let (addr, rkey) = match case {
            "local-only memory" => (
                local_only.as_ptr() as usize,
                local_only.region().unwrap().rkey,
            ),
            "out of bounds" => {
                let region = writable.region().unwrap();
                (region.base + region.len - data_len / 2, region.rkey)
            }
            _ => (writable.as_ptr() as usize, 0xdead),
        };
        let data = filled(&a.send_pool, data_len, 9);
        a.qp.post_send(&[SendWr {
            wr_id: 1,
            op: SendOp::Write {
                remote_addr: addr,
                rkey,
            },
            sges: vec![sge(&data)],
            signaled: true,
        }])
        .unwrap();
        assert_eq!(
            a.poll_send()[0].status,
            WcStatus::RemoteAccessError,
            "{case}"
        );
        assert_eq!(a.qp.state(), QpState::Error, "{case}");
        assert_eq!(b.device.stats().remote_access_errors, 1, "{case}");
        assert!(
            local_only.iter().chain(writable.iter()).all(|&x| x == 0),
            "{case}: nothing written"
        );
    }
}

#[test]
fn unregistered_local_memory_is_a_local_protection_error() {
    let (a, b) = pair();
    let posted = filled(&b.recv_pool, 64, 0);
    b.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sge: sge(&posted),
    }])
    .unwrap();
    let stack = [0u8; 16];
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sges: vec![Sge {
            addr: stack.as_ptr() as usize,
            len: 16,
            lkey: 0x100,
        }],
        signaled: true,
    }])
    .unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::LocalProtectionError);
}

#[test]
fn a_receive_too_small_fails_both_sides() {
    let (a, b) = pair();
    let small = filled(&b.recv_pool, 8, 0);
    b.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sge: sge(&small),
    }])
    .unwrap();
    let data = filled(&a.send_pool, 64, 3);
    a.qp.post_send(&[send(1, &data)]).unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::RemoteOperationError);
    let failed = b.poll_recv()[0];
    assert_eq!(failed.status, WcStatus::LocalLengthError);
    // As on real providers, an error completion's opcode and length are
    // undefined: the soft NIC says so, and only the id tells the request.
    assert_eq!(
        (failed.wr_id, failed.kind, failed.byte_len),
        (1, WcKind::Unknown, 0)
    );
    assert_eq!(b.qp.state(), QpState::Error);
}

#[test]
fn unsignalled_requests_complete_silently_and_the_queue_depth_holds() {
    let caps = QpCaps {
        max_send_wr: 8,
        ..QpCaps::default()
    };
    let (a, b) = pair_with(SoftFaults::default(), caps);
    let target = filled(&b.recv_pool, 64, 0);
    let rkey = target.region().unwrap().rkey;
    let data = filled(&a.send_pool, 8, 1);
    let write = |wr_id: u64, signaled: bool| SendWr {
        wr_id,
        op: SendOp::Write {
            remote_addr: target.as_ptr() as usize,
            rkey,
        },
        sges: vec![sge(&data)],
        signaled,
    };
    // A batch of 8 with only the last signalled: one completion.
    let batch: Vec<SendWr> = (0..8).map(|i| write(i, i == 7)).collect();
    a.qp.post_send(&batch).unwrap();
    let err = a.qp.post_send(&[write(8, true)]).unwrap_err();
    assert!(
        matches!(err, crate::verbs::VerbsError::QueueFull { depth: 8, .. }),
        "{err}"
    );
    let completions = a.poll_send();
    assert_eq!(completions.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [7]);
    // Polling that completion freed all eight slots.
    a.qp.post_send(&(8..16).map(|i| write(i, i == 15)).collect::<Vec<_>>())
        .unwrap();
    assert_eq!(a.poll_send().len(), 1);
}

#[test]
fn completions_arrive_in_posting_order_even_when_delayed() {
    let faults = SoftFaults {
        seed: 42,
        delay_per_million: 500_000,
        max_delay_polls: 3,
        ..SoftFaults::default()
    };
    let (a, b) = pair_with(faults, QpCaps::default());
    let target = filled(&b.recv_pool, 64, 0);
    let data = filled(&a.send_pool, 8, 1);
    let wrs: Vec<SendWr> = (0..20).map(|i| write_wr(i, &target, &data, true)).collect();
    a.qp.post_send(&wrs).unwrap();
    let mut seen = Vec::new();
    let mut empty_polls = 0;
    while seen.len() < 20 {
        let got = a.poll_send();
        if got.is_empty() {
            empty_polls += 1;
        }
        seen.extend(got.iter().map(|c| c.wr_id));
        assert!(empty_polls < 100, "completions never arrived");
    }
    assert_eq!(seen, (0..20).collect::<Vec<_>>());
    assert!(empty_polls > 0, "the seed delayed some completions");
}

#[test]
fn a_dead_peer_fails_sends_and_flushes_its_receives() {
    let (a, b) = pair();
    let posted: Vec<PoolBuf> = (0..3).map(|_| filled(&b.recv_pool, 16, 0)).collect();
    let wrs: Vec<RecvWr> = posted
        .iter()
        .enumerate()
        .map(|(i, p)| RecvWr {
            wr_id: i as u64,
            sge: sge(p),
        })
        .collect();
    b.qp.post_recv(&wrs).unwrap();
    b.device.kill();
    let flushed = b.poll_recv();
    assert_eq!(flushed.len(), 3);
    assert!(flushed.iter().all(|c| c.status == WcStatus::Flushed));
    let data = filled(&a.send_pool, 8, 1);
    a.qp.post_send(&[send(1, &data)]).unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::RetryExceeded);
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn injected_faults_replay_from_the_seed() {
    let run = |seed: u64| {
        let faults = SoftFaults {
            seed,
            qp_error_per_million: 100_000,
            ..SoftFaults::default()
        };
        let (a, b) = pair_with(
            faults,
            QpCaps {
                max_send_wr: 1024,
                ..QpCaps::default()
            },
        );
        let target = filled(&b.recv_pool, 64, 0);
        let data = filled(&a.send_pool, 8, 1);
        let wrs: Vec<SendWr> = (0..200)
            .map(|i| write_wr(i, &target, &data, true))
            .collect();
        a.qp.post_send(&wrs).unwrap();
        let first_failure = a
            .poll_send()
            .iter()
            .position(|c| c.status != WcStatus::Success);
        (first_failure, a.device.stats().injected_qp_errors)
    };
    let (failure, injected) = run(7);
    assert!(failure.is_some() && injected == 1, "{failure:?} {injected}");
    assert_eq!(run(7), (failure, injected), "same seed, same fault");
}

#[test]
fn queue_pairs_work_across_threads() {
    let (a, b) = pair();
    let rounds = 1000u64;
    // Receives are posted before anything can arrive (the engine's credits
    // guarantee this; here the echo side reposts before it replies).
    let bufs: Vec<PoolBuf> = (0..8).map(|_| filled(&b.recv_pool, 64, 0)).collect();
    let wrs: Vec<RecvWr> = bufs
        .iter()
        .enumerate()
        .map(|(i, buf)| RecvWr {
            wr_id: i as u64,
            sge: sge(buf),
        })
        .collect();
    b.qp.post_recv(&wrs).unwrap();
    let b_thread = std::thread::spawn(move || {
        let mut echoed = 0;
        while echoed < rounds {
            for completion in b.poll_recv() {
                assert_eq!(completion.status, WcStatus::Success);
                let buf = &bufs[completion.wr_id as usize];
                let reply = b
                    .send_pool
                    .alloc_copy(&buf[..completion.byte_len as usize])
                    .unwrap();
                b.qp.post_recv(&[wrs[completion.wr_id as usize]]).unwrap();
                b.qp.post_send(&[send(echoed, &reply)]).unwrap();
                assert_eq!(
                    b.poll_send().pop().map(|c| c.status),
                    Some(WcStatus::Success)
                );
                echoed += 1;
            }
            std::thread::yield_now();
        }
        b
    });
    let inbox = filled(&a.recv_pool, 64, 0);
    for round in 0..rounds {
        a.qp.post_recv(&[RecvWr {
            wr_id: round,
            sge: sge(&inbox),
        }])
        .unwrap();
        let message = filled(&a.send_pool, 32, (round % 251) as u8);
        a.qp.post_send(&[send(round, &message)]).unwrap();
        assert_eq!(
            a.poll_send().pop().map(|c| c.status),
            Some(WcStatus::Success),
            "round {round}"
        );
        let reply = loop {
            if let Some(c) = a.poll_recv().pop() {
                break c;
            }
            std::thread::yield_now();
        };
        assert_eq!((reply.status, reply.byte_len), (WcStatus::Success, 32));
        assert!(inbox[..32].iter().all(|&x| x == (round % 251) as u8));
    }
    let b = b_thread.join().unwrap();
    assert_eq!(b.device.stats().rnr_events, 0);
    assert_eq!(a.device.stats().rnr_events, 0);
}

#[test]
fn a_destroyed_queue_pair_accepts_no_more_writes() {
    let (a, b) = pair();
    let target = filled(&b.recv_pool, 64, 0);
    let rkey = target.region().unwrap().rkey;
    let Side { qp: b_qp, .. } = b;
    drop(b_qp);
    let data = filled(&a.send_pool, 8, 1);
    a.qp.post_send(&[SendWr {
        wr_id: 1,
        op: SendOp::Write {
            remote_addr: target.as_ptr() as usize,
            rkey,
        },
        sges: vec![sge(&data)],
        signaled: true,
    }])
    .unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::RetryExceeded);
    assert!(
        target.iter().all(|&x| x == 0),
        "nothing landed after the QP was destroyed"
    );
}

#[test]
fn qps_on_a_shared_receive_queue_take_from_it_and_misses_are_counted() {
    let fabric = SoftFabric::new();
    let server = fabric.open("srq-server", SoftFaults::default()).unwrap();
    let pool = Pool::new(
        PoolConfig::named("srq-recv"),
        Access::RemoteWrite,
        server.registration_hook(),
    )
    .unwrap();
    let srq = server.create_srq(4).unwrap();
    let cq = server.create_cq(64).unwrap();
    let on_srq = |_: usize| {
        let qp = server
            .create_qp_on_srq(cq.clone(), cq.clone(), srq.clone(), QpCaps::default())
            .unwrap();
        qp.init().unwrap();
        qp
    };
    let (s1, s2) = (on_srq(1), on_srq(2));
    let c1 = Side::new(&fabric, "c1", SoftFaults::default(), QpCaps::default());
    let c2 = Side::new(
        &fabric,
        "c2",
        SoftFaults::default(),
        QpCaps {
            rnr_retry: 3,
            ..QpCaps::default()
        },
    );
    for (client, qp) in [(&c1, &s1), (&c2, &s2)] {
        client.qp.connect(&qp.endpoint()).unwrap();
        qp.connect(&client.qp.endpoint()).unwrap();
    }
    assert!(
        s1.post_recv(&[RecvWr {
            wr_id: 0,
            sge: Sge {
                addr: 0,
                len: 0,
                lkey: 0
            }
        }])
        .is_err(),
        "a QP on an SRQ has no receive queue of its own"
    );
    let buffers: Vec<PoolBuf> = (0..4).map(|_| filled(&pool, 64, 0)).collect();
    let wrs: Vec<RecvWr> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| RecvWr {
            wr_id: i as u64,
            sge: sge(b),
        })
        .collect();
    srq.post_recv(&wrs).unwrap();
    // Both clients' SENDs land in the one queue, completing on their QPs.
    let data = filled(&c1.send_pool, 16, 7);
    c1.qp.post_send(&[send(1, &data), send(2, &data)]).unwrap();
    let data2 = filled(&c2.send_pool, 16, 8);
    c2.qp
        .post_send(&[send(1, &data2), send(2, &data2)])
        .unwrap();
    assert!(c1.poll_send().iter().all(|c| c.status == WcStatus::Success));
    assert!(c2.poll_send().iter().all(|c| c.status == WcStatus::Success));
    let mut got = Vec::new();
    cq.poll(&mut got, 64);
    let mut qpns: Vec<u32> = got.iter().map(|c| c.qpn).collect();
    qpns.sort_unstable();
    let mut want = vec![s1.qpn(), s1.qpn(), s2.qpn(), s2.qpn()];
    want.sort_unstable();
    assert_eq!(qpns, want);
    assert_eq!(server.rnr_events(), Some(0));
    // The queue is empty now: with no retry the SEND fails at once; with
    // three retries it fails after four counted misses.
    c1.qp.post_send(&[send(3, &data)]).unwrap();
    assert_eq!(c1.poll_send()[0].status, WcStatus::ReceiverNotReady);
    assert_eq!(server.rnr_events(), Some(1));
    c2.qp.post_send(&[send(3, &data2)]).unwrap();
    assert_eq!(c2.wait_send()[0].status, WcStatus::ReceiverNotReady);
    assert_eq!(server.rnr_events(), Some(5));
}

#[test]
fn a_send_retried_after_receiver_not_ready_lands_once_a_receive_is_posted() {
    let fabric = SoftFabric::new();
    let caps = QpCaps {
        rnr_retry: 7,
        ..QpCaps::default()
    };
    let (a, b) = {
        let a = Side::new(&fabric, "a", SoftFaults::default(), caps);
        let b = Side::new(&fabric, "b", SoftFaults::default(), caps);
        a.qp.connect(&b.qp.endpoint()).unwrap();
        b.qp.connect(&a.qp.endpoint()).unwrap();
        (a, b)
    };
    let target = filled(&b.recv_pool, 64, 0);
    let posted = sge(&target);
    let b_qp = Arc::clone(&b.qp);
    let b_device = b.device.clone();
    let poster = std::thread::spawn(move || {
        // The receive goes up only once the SEND has missed at least once.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while b_device.stats().rnr_events < 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the SEND never missed a receive (no RNR event within 5 s)"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        b_qp.post_recv(&[RecvWr {
            wr_id: 9,
            sge: posted,
        }])
        .unwrap();
    });
    let data = filled(&a.send_pool, 8, 3);
    a.qp.post_send(&[send(1, &data)]).unwrap();
    poster.join().unwrap();
    assert_eq!(a.wait_send()[0].status, WcStatus::Success);
    assert_eq!(b.poll_recv()[0].wr_id, 9);
    assert!(b.device.stats().rnr_events >= 1, "the misses were counted");
}

/// What a peer may write through a memory window (issue 16, item 6): the
/// window's bytes, from the QP it is bound to, until it is invalidated or
/// bound again — and nothing through the region's own key. Every other
/// write is a remote access error that fails the writer's QP and writes
/// nothing.
#[test]
fn a_window_confines_writes_to_its_bytes_its_connection_and_its_binding() {
    for case in [
        "inside the grant",
        "past the grant",
        "with the region's own key",
        "from another connection",
        "after invalidation",
        "with an earlier binding's key",
        "through the new binding",
    ] {
        let fabric = SoftFabric::new();
        let caps = QpCaps::default();
        let a = Side::new(&fabric, "a", SoftFaults::default(), caps);
        let c = Side::new(&fabric, "c", SoftFaults::default(), caps);
        // b's receive memory has no remote access of its own.
        let device = fabric.open("b", SoftFaults::default()).unwrap();
        let (_, recv_pool) = crate::verbs::soft::test_pools_with(&device, "b", Access::Windows);
        let cq = device.create_cq(64).unwrap();
        let qp_ab = device.create_qp(cq.clone(), cq.clone(), caps).unwrap();
        let qp_cb = device.create_qp(cq.clone(), cq.clone(), caps).unwrap();
        for qp in [&qp_ab, &qp_cb] {
            qp.init().unwrap();
        }
        qp_ab.connect(&a.qp.endpoint()).unwrap();
        a.qp.connect(&qp_ab.endpoint()).unwrap();
        qp_cb.connect(&c.qp.endpoint()).unwrap();
        c.qp.connect(&qp_cb.endpoint()).unwrap();
        let grant = filled(&recv_pool, 256, 0);
        let neighbour = filled(&recv_pool, 256, 0);
        let window = device.alloc_window().unwrap();
        let bind = |rkey: u32, buf: &PoolBuf| {
            let region = buf.region().unwrap();
            qp_ab
                .post_send(&[SendWr {
                    wr_id: 50,
                    op: SendOp::BindWindow {
                        window: window.handle(),
                        rkey,
                        addr: buf.as_ptr() as usize,
                        len: buf.len(),
                        lkey: region.lkey,
                        region: region.handle,
                    },
                    sges: Vec::new(),
                    signaled: true,
                }])
                .unwrap();
            let mut done = Vec::new();
            cq.poll(&mut done, 8);
            assert_eq!(done[0].status, WcStatus::Success, "{case}: bind");
        };
        let invalidate = |rkey: u32| {
            qp_ab
                .post_send(&[SendWr {
                    wr_id: 51,
                    op: SendOp::Invalidate { rkey },
                    sges: Vec::new(),
                    signaled: true,
                }])
                .unwrap();
            let mut done = Vec::new();
            cq.poll(&mut done, 8);
            assert_eq!(done[0].status, WcStatus::Success, "{case}: invalidate");
        };
        let first = window.next_rkey(window.rkey());
        bind(first, &grant);
        let (writer, addr, rkey, len) = match case {
            "inside the grant" => (&a, grant.as_ptr() as usize + 64, first, 64),
            "past the grant" => (&a, grant.as_ptr() as usize + 224, first, 64),
            "with the region's own key" => (
                &a,
                grant.as_ptr() as usize,
                grant.region().unwrap().rkey,
                64,
            ),
            "from another connection" => (&c, grant.as_ptr() as usize, first, 64),
            "after invalidation" => {
                invalidate(first);
                (&a, grant.as_ptr() as usize, first, 64)
            }
            "with an earlier binding's key" => {
                let second = window.next_rkey(first);
                assert_ne!(second, first);
                invalidate(first);
                bind(second, &neighbour);
                (&a, neighbour.as_ptr() as usize, first, 64)
            }
            _ => {
                let second = window.next_rkey(first);
                invalidate(first);
                bind(second, &neighbour);
                (&a, neighbour.as_ptr() as usize, second, 64)
            }
        };
        let data = filled(&writer.send_pool, len, 7);
        writer
            .qp
            .post_send(&[SendWr {
                wr_id: 1,
                op: SendOp::Write {
                    remote_addr: addr,
                    rkey,
                },
                sges: vec![sge(&data)],
                signaled: true,
            }])
            .unwrap();
        let status = writer.poll_send()[0].status;
        let allowed = matches!(case, "inside the grant" | "through the new binding");
        if allowed {
            assert_eq!(status, WcStatus::Success, "{case}");
            let written = if case == "inside the grant" {
                &grant[64..128]
            } else {
                &neighbour[..64]
            };
            assert!(written.iter().all(|&x| x == 7), "{case}: the data landed");
        } else {
            assert_eq!(status, WcStatus::RemoteAccessError, "{case}");
            assert_eq!(writer.qp.state(), QpState::Error, "{case}");
            assert_eq!(device.stats().remote_access_errors, 1, "{case}");
            assert!(
                grant.iter().chain(neighbour.iter()).all(|&x| x == 0),
                "{case}: nothing written"
            );
        }
    }
}

/// A bind the NIC must refuse: a key that is not the window's, memory
/// registered without window binding, a range past the region.
#[test]
fn binds_outside_the_rules_are_local_protection_errors() {
    for case in [
        "another window's key",
        "remote-write memory",
        "past the region",
        "a window still bound",
    ] {
        let (a, b) = pair();
        let _ = &a;
        let window = b.device.alloc_window().unwrap();
        let other = b.device.alloc_window().unwrap();
        let (_, windows_pool) =
            crate::verbs::soft::test_pools_with(&b.device, "b-windows", Access::Windows);
        let buf = filled(&windows_pool, 128, 0);
        let plain = filled(&b.recv_pool, 128, 0);
        let region = buf.region().unwrap();
        let (rkey, target, len) = match case {
            "another window's key" => (other.next_rkey(other.rkey()), &buf, 128),
            "a window still bound" => {
                let first = window.next_rkey(window.rkey());
                b.qp.post_send(&[SendWr {
                    wr_id: 8,
                    op: SendOp::BindWindow {
                        window: window.handle(),
                        rkey: first,
                        addr: buf.as_ptr() as usize,
                        len: 64,
                        lkey: region.lkey,
                        region: region.handle,
                    },
                    sges: Vec::new(),
                    signaled: true,
                }])
                .unwrap();
                assert_eq!(b.poll_send()[0].status, WcStatus::Success);
                (window.next_rkey(first), &buf, 128)
            }
            "remote-write memory" => (window.next_rkey(window.rkey()), &plain, 128),
            _ => (
                window.next_rkey(window.rkey()),
                &buf,
                region.base + region.len - buf.as_ptr() as usize + 1,
            ),
        };
        let target_region = target.region().unwrap();
        b.qp.post_send(&[SendWr {
            wr_id: 9,
            op: SendOp::BindWindow {
                window: window.handle(),
                rkey,
                addr: target.as_ptr() as usize,
                len,
                lkey: target_region.lkey,
                region: target_region.handle,
            },
            sges: Vec::new(),
            signaled: true,
        }])
        .unwrap();
        assert_eq!(
            b.poll_send()[0].status,
            WcStatus::LocalProtectionError,
            "{case}"
        );
    }
}

/// `fail` returns at once even while a peer is in the middle of a copy
/// into the QP (a frozen peer process); `quiesce` is what waits for it.
/// Before, `fail` waited out the drain bound (1 s), so a SIGSTOPped peer
/// caught mid-write delayed its connection's error by that much.
#[test]
fn fail_does_not_wait_for_a_peer_in_the_middle_of_a_copy_and_quiesce_does() {
    let (_a, b) = pair();
    let segment = Arc::clone(&b.device.inner.qp(b.qp.qpn()).unwrap().segment);
    assert!(segment.begin_dma(), "a peer starts copying in");
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let qp = Arc::clone(&b.qp);
    let failer = std::thread::spawn(move || {
        qp.fail().unwrap();
        done_tx.send("failed").unwrap();
        qp.quiesce();
        done_tx.send("quiet").unwrap();
    });
    // `fail` comes back while the copy is still under way, well within
    // the drain bound it used to wait out...
    assert_eq!(
        done_rx
            .recv_timeout(std::time::Duration::from_millis(500))
            .unwrap(),
        "failed"
    );
    assert_eq!(b.qp.state(), QpState::Error);
    assert!(!segment.begin_dma(), "no new copy starts on a failed QP");
    // ...and `quiesce` only once it is over.
    assert!(done_rx.try_recv().is_err(), "quiesce waits for the copy");
    segment.end_dma();
    assert_eq!(done_rx.recv().unwrap(), "quiet");
    failer.join().unwrap();
}

/// A SEND that meets receiver-not-ready is retried off the posting thread,
/// as an RNIC's hardware retries it: the post returns at once, a WRITE
/// posted after it waits behind it (RC order), and both complete, in
/// order, once the receiver posts. Before, the posting thread slept and
/// retried for up to 500 ms, which under `polling = "runtime"` blocked a
/// runtime worker.
#[test]
fn a_stalled_send_is_retried_off_the_posting_thread_and_later_requests_wait_behind_it() {
    let caps = QpCaps {
        rnr_retry: 7,
        ..QpCaps::default()
    };
    let (a, b) = pair_with(SoftFaults::default(), caps);
    let data = filled(&a.send_pool, 8, 3);
    let target = filled(&b.recv_pool, 8, 0);
    a.qp.post_send(&[send(1, &data), write_wr(2, &target, &data, true)])
        .unwrap();
    // Nothing completed, nothing written: the WRITE waits behind the SEND.
    assert!(a.poll_send().is_empty());
    assert!(target.iter().all(|&byte| byte == 0), "written out of order");
    let inbox = filled(&b.recv_pool, 64, 0);
    b.qp.post_recv(&[RecvWr {
        wr_id: 9,
        sge: sge(&inbox),
    }])
    .unwrap();
    let mut done = Vec::new();
    while done.len() < 2 {
        done.extend(a.wait_send());
    }
    assert_eq!(done.iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![1, 2]);
    assert!(done.iter().all(|c| c.status == WcStatus::Success));
    assert_eq!(b.poll_recv()[0].wr_id, 9);
    assert!(target.iter().all(|&byte| byte == 3), "the WRITE landed");
}

/// New QPs of `a` and `b`'s devices, connected (on the sides' CQs).
fn reconnect(a: &Side, b: &Side) -> (Arc<dyn QueuePair>, Arc<dyn QueuePair>) {
    let qp = |side: &Side| {
        let qp = side
            .device
            .create_qp(
                side.send_cq.clone(),
                side.recv_cq.clone(),
                QpCaps::default(),
            )
            .unwrap();
        qp.init().unwrap();
        qp
    };
    let (qa, qb) = (qp(a), qp(b));
    qa.connect(&qb.endpoint()).unwrap();
    qb.connect(&qa.endpoint()).unwrap();
    (qa, qb)
}

#[test]
fn a_port_down_fails_its_qps_both_ways_until_it_comes_back() {
    use crate::verbs::AsyncEvent;
    let (a, b) = pair();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let _watch = b
        .device
        .watch_events(Arc::new({
            let seen = Arc::clone(&seen);
            move |event| seen.lock().unwrap().push(event)
        }))
        .unwrap();
    let target = filled(&b.recv_pool, 64, 0);
    let back = filled(&a.recv_pool, 64, 0);
    let data = filled(&a.send_pool, 8, 1);
    let reply = filled(&b.send_pool, 8, 2);

    b.device.set_port_active(false);
    assert!(!b.device.port_active());
    assert_eq!(b.qp.state(), QpState::Error, "its QPs fail");
    assert_eq!(
        *seen.lock().unwrap(),
        vec![AsyncEvent::PortDown { port: 1 }]
    );
    // Towards it: the peer's retries run out.
    a.qp.post_send(&[write_wr(1, &target, &data, true)])
        .unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::RetryExceeded);
    // A QP made while it is down connects (as on real verbs) but moves
    // nothing, either way.
    let (qa, qb) = reconnect(&a, &b);
    qa.post_send(&[write_wr(2, &target, &data, true)]).unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::RetryExceeded);
    qb.post_send(&[write_wr(3, &back, &reply, true)]).unwrap();
    assert_eq!(b.poll_send()[0].status, WcStatus::RetryExceeded);
    assert_eq!(back[0], 0);

    // Back up: the failed QPs stay failed, new ones work.
    b.device.set_port_active(true);
    assert!(b.device.port_active());
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            AsyncEvent::PortDown { port: 1 },
            AsyncEvent::PortUp { port: 1 }
        ]
    );
    assert_eq!(qb.state(), QpState::Error);
    let (qa, qb) = reconnect(&a, &b);
    qa.post_send(&[write_wr(4, &target, &data, true)]).unwrap();
    assert_eq!(a.poll_send()[0].status, WcStatus::Success);
    assert_eq!(target[0], 1);
    qb.post_send(&[write_wr(5, &back, &reply, true)]).unwrap();
    assert_eq!(b.poll_send()[0].status, WcStatus::Success);
    assert_eq!(back[0], 2);
    // A dead device's port does not come back.
    b.device.kill();
    b.device.set_port_active(true);
    assert!(!b.device.port_active());
}

#[test]
fn a_followed_port_file_takes_the_port_down_while_it_exists() {
    let (_a, b) = pair();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("port-down");
    b.device.follow_port_file(path.clone()).unwrap();
    let until = |want: bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while b.device.port_active() != want {
            assert!(std::time::Instant::now() < deadline, "port never {want}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    until(true);
    std::fs::write(&path, b"").unwrap();
    until(false);
    assert_eq!(b.qp.state(), QpState::Error);
    std::fs::remove_file(&path).unwrap();
    until(true);
}

#[test]
fn a_rate_limited_port_holds_writes_in_order_until_its_link_frees() {
    // 80 Mbit/s into b: 10,000 bytes take 1 ms on its link.
    let fabric = SoftFabric::new();
    let caps = QpCaps {
        max_send_wr: 64,
        ..QpCaps::default()
    };
    let a = Side::new(&fabric, "a", SoftFaults::default(), caps);
    let b = Side::with(
        &fabric,
        "b",
        SoftFaults::default(),
        caps,
        SoftProfile {
            port: SoftPort {
                rate_mbps: 80,
                ..SoftPort::default()
            },
            ..SoftProfile::default()
        },
    );
    a.qp.connect(&b.qp.endpoint()).unwrap();
    b.qp.connect(&a.qp.endpoint()).unwrap();
    let target = filled(&b.recv_pool, 10_000, 0);
    let data: Vec<PoolBuf> = (0..20)
        .map(|i| filled(&a.send_pool, 10_000, i + 1))
        .collect();
    let started = std::time::Instant::now();
    let wrs: Vec<SendWr> = data
        .iter()
        .enumerate()
        .map(|(i, d)| write_wr(i as u64, &target, d, true))
        .collect();
    a.qp.post_send(&wrs).unwrap();
    let mut done = Vec::new();
    while done.len() < 20 {
        done.extend(a.wait_send());
    }
    // The link cannot have carried 20 x 10,000 bytes in less than the 19
    // slots after the first (a lower bound: a loaded machine only adds).
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(19),
        "{:?}",
        started.elapsed()
    );
    assert!(done.iter().all(|c| c.status == WcStatus::Success));
    let order: Vec<u64> = done.iter().map(|c| c.wr_id).collect();
    assert_eq!(order, (0..20).collect::<Vec<u64>>(), "in posting order");
    assert_eq!(target[0], 20, "the last WRITE landed last");
    // The other way, b's egress is idle and a's port unlimited: b's
    // answer goes at once.
    let back = filled(&a.recv_pool, 8, 0);
    let reply = filled(&b.send_pool, 8, 7);
    b.qp.post_send(&[write_wr(99, &back, &reply, true)])
        .unwrap();
    assert_eq!(b.poll_send()[0].status, WcStatus::Success);
}

#[test]
fn a_pool_on_two_rails_is_reachable_on_each_with_that_rails_keys() {
    let fabric = SoftFabric::new();
    let open = |name: &str| fabric.open(name, SoftFaults::default()).unwrap();
    let (a0, a1, b0, b1) = (open("a0"), open("a1"), open("b0"), open("b1"));
    // A registration on each second rail first, so that the rails' keys
    // for the pools below differ (each device numbers its own).
    let (_a_spare, _) = crate::verbs::soft::test_pools(&a1, "a1-spare");
    let (_b_spare, b_spare_recv) = crate::verbs::soft::test_pools(&b1, "b1-spare");
    let _held = b_spare_recv.alloc(64).unwrap();
    let _held_a = _a_spare.alloc(64).unwrap();
    let pool = |name: &str, access, devices: [&SoftDevice; 2]| {
        Pool::on_rails(
            PoolConfig::named(name),
            access,
            devices.iter().map(|d| d.registration_hook()).collect(),
        )
        .unwrap()
    };
    let send_pool = pool("rails-send", Access::LocalOnly, [&a0, &a1]);
    let recv_pool = pool("rails-recv", Access::RemoteWrite, [&b0, &b1]);
    let connect = |a: &SoftDevice, b: &SoftDevice| {
        let cq = |d: &SoftDevice| d.create_cq(64).unwrap();
        let (a_cq, b_cq) = (cq(a), cq(b));
        let qa = a
            .create_qp(a_cq.clone(), a_cq.clone(), QpCaps::default())
            .unwrap();
        let qb = b.create_qp(b_cq.clone(), b_cq, QpCaps::default()).unwrap();
        qa.init().unwrap();
        qb.init().unwrap();
        qa.connect(&qb.endpoint()).unwrap();
        qb.connect(&qa.endpoint()).unwrap();
        (qa, a_cq, qb)
    };
    let data = filled(&send_pool, 1000, 7);
    let target = filled(&recv_pool, 4096, 0);
    let (keys0, keys1) = (target.region_on(0).unwrap(), target.region_on(1).unwrap());
    assert_ne!(keys0.rkey, keys1.rkey, "each device's own key");
    assert_eq!(target.region(), Some(keys0), "rail 0 is the primary");
    assert_eq!(target.region_on(2), None, "two rails only");
    let write = |rail: usize, rkey_rail: usize, offset: usize| SendWr {
        wr_id: rail as u64,
        op: SendOp::Write {
            remote_addr: target.as_ptr() as usize + offset,
            rkey: target.region_on(rkey_rail).unwrap().rkey,
        },
        sges: vec![Sge {
            addr: data.as_ptr() as usize,
            len: 1000,
            lkey: data.region_on(rail).unwrap().lkey,
        }],
        signaled: true,
    };
    let poll = |cq: &Arc<dyn CompletionQueue>| {
        let mut out = Vec::new();
        cq.poll(&mut out, 8);
        out
    };
    // Each rail writes with its own keys.
    for (rail, (a, b)) in [(&a0, &b0), (&a1, &b1)].into_iter().enumerate() {
        let (qp, cq, _peer) = connect(a, b);
        qp.post_send(&[write(rail, rail, rail * 2000)]).unwrap();
        assert_eq!(poll(&cq)[0].status, WcStatus::Success, "rail {rail}");
        let at = rail * 2000;
        assert!(target[at..at + 1000].iter().all(|&x| x == 7), "rail {rail}");
    }
    // Rail 0's key means nothing to rail 1's device.
    let (qp, cq, _peer) = connect(&a1, &b1);
    qp.post_send(&[write(1, 0, 1000)]).unwrap();
    assert_eq!(poll(&cq)[0].status, WcStatus::RemoteAccessError);
    assert!(
        target[1000..2000].iter().all(|&x| x == 0),
        "nothing written"
    );
}
