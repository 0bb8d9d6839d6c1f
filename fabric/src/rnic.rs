//! A simulated RNIC: RC queue pairs that turn the work requests an engine
//! posts into packets, one MTU at a time, onto the host's link; that
//! acknowledge, retransmit and complete them as a NIC does; and that
//! place each message in the receiver's registered memory when its last
//! packet arrives (the checks are `tessera_transport::verbs::sim`'s,
//! as strict as rxe's).
//!
//! # Call order
//!
//! [`Rnic::create_qp`] and [`Rnic::connect`] for each queue pair; then,
//! in any order, [`Rnic::post_send`] and [`Rnic::post_recv`] (the
//! engine's work requests), [`Rnic::handle_packet`] for each packet that
//! arrives from the link, [`Rnic::handle_pfc`] for the switch's XOFF and
//! XON, and [`Rnic::handle_timeout`] once [`Rnic::poll_timeout`]'s time
//! has come. After any of them, drain [`Rnic::poll_completion`] (to the
//! engines) and call [`Rnic::poll_transmit`], which puts at most one
//! packet on the wire and says when it arrives at the far end of the
//! link; call it again at [`Rnic::poll_timeout`].
//!
//! # What it models
//!
//! - **Scheduling**: the NIC sends acknowledgements and CNPs first, then
//!   takes its queue pairs with packets to send in turn, one packet each
//!   (round robin), each paced at its DCQCN rate when hardware congestion
//!   control is on.
//! - **RC requester**: packet sequence numbers; a work request completes
//!   (signalled ones with a completion) once the responder acknowledged
//!   its last packet, in posting order; a sequence NAK or a timeout goes
//!   back to the first unacknowledged packet (go-back-N, for losses when
//!   PFC is off); a receiver-not-ready NAK waits `rnr_delay_ns` and goes
//!   back, as many times as the queue pair's `rnr_retry` allows (7: no
//!   end), then fails the request; a request whose retries run out fails
//!   with `RetryExceeded`. A failed request puts the queue pair in error:
//!   everything outstanding completes flushed, as do the receives.
//! - **RC responder**: in-order packets only (a gap answers one sequence
//!   NAK and drops until the missing packet comes), a SEND consumes a
//!   posted receive at its first packet (none: an RNR NAK), a
//!   WRITE_WITH_IMM at its last; each message is placed when its last
//!   packet arrives; acknowledgements coalesced every `ack_every` packets
//!   and at each message's end; duplicates acknowledged again; a CNP per
//!   queue pair at most every `cnp_interval_ns` for packets that arrive
//!   ECN-marked (the notification point).
//! - **Local work requests** (memory window binds and invalidations) run
//!   when they reach the head of the send queue and complete in order.
//!
//! Packet sequence numbers are 24 bits on the wire; the model counts them
//! in 64 and never wraps. Headers are counted in each packet's wire size
//! ([`RnicParams::header_bytes`]); payloads are not carried: the bytes are
//! copied from the sender's registered memory when the last packet
//! arrives (the sender keeps them until the request completes, which is
//! after that).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use tessera_transport::verbs::sim::SimMemory;
use tessera_transport::verbs::{RecvWr, SendOp, SendWr, WcKind, WcStatus, WorkCompletion};

use crate::dcqcn::{Dcqcn, DcqcnParams};
use crate::params::{LinkParams, ParamsError};

/// A host's index in the fabric.
pub type HostId = u32;

/// The NIC's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RnicParams {
    /// Payload bytes per packet (the path MTU). Default 1,024: the HPCC
    /// simulator's and RoCE's most common setting; ConnectX also runs
    /// 4,096.
    pub mtu: u32,
    /// Header bytes of each packet on the wire: Ethernet (14 + 4 FCS),
    /// IPv4 (20), UDP (8), the base transport header (12) and ICRC (4).
    /// Default 62.
    pub header_bytes: u32,
    /// A packet acknowledged at most this many packets after the last
    /// acknowledgement (besides each message's last packet). Default 16:
    /// ConnectX coalesces acknowledgements at about this rate.
    pub ack_every: u32,
    /// Wait after a receiver-not-ready NAK before going back. Default
    /// 640,000 ns: the RNR timer Tessera's ibverbs provider asks for
    /// (`min_rnr_timer` 12, 0.64 ms in InfiniBand's table).
    pub rnr_delay_ns: u64,
    /// Wait for an acknowledgement before going back to the first packet
    /// not acknowledged. Default 67,108,864 ns: the local ACK timeout
    /// Tessera's ibverbs provider sets (`timeout` 14: 4.096 us x 2^14),
    /// long enough that PFC pauses of milliseconds do not set off
    /// spurious go-backs; a fabric without PFC wants it shorter.
    pub retransmit_timeout_ns: u64,
    /// Timeouts in a row before a request fails with `RetryExceeded`.
    /// Default 7: the verbs maximum, what the transport asks for.
    pub retry_count: u32,
    /// The notification point's CNP interval per queue pair, ns. Default
    /// 50,000: the DCQCN paper's N (50 us), which the HPCC simulator
    /// keeps.
    pub cnp_interval_ns: u64,
}

impl Default for RnicParams {
    fn default() -> Self {
        Self {
            mtu: 1024,
            header_bytes: 62,
            ack_every: 16,
            rnr_delay_ns: 640_000,
            retransmit_timeout_ns: 67_108_864,
            retry_count: 7,
            cnp_interval_ns: 50_000,
        }
    }
}

impl RnicParams {
    /// Checks the fields.
    pub fn validate(&self) -> Result<(), ParamsError> {
        if ![256, 512, 1024, 2048, 4096].contains(&self.mtu) {
            return Err(ParamsError::Range {
                field: "rnic.mtu",
                value: self.mtu.to_string(),
                range: "one of 256, 512, 1024, 2048, 4096",
            });
        }
        for (field, value) in [
            ("rnic.ack_every", u64::from(self.ack_every)),
            ("rnic.retransmit_timeout_ns", self.retransmit_timeout_ns),
        ] {
            if value == 0 {
                return Err(ParamsError::Zero { field });
            }
        }
        Ok(())
    }

    fn ack_bytes(&self) -> u64 {
        // The acknowledgement extended transport header (4 bytes).
        u64::from(self.header_bytes) + 4
    }
}

/// A work request on its way, as each of its packets carries it.
#[derive(Debug)]
pub struct WireWr {
    op: SendOp,
    /// The sender's bytes, checked against its registrations.
    gather: Vec<(usize, usize)>,
    total: u64,
    source: SimMemory,
}

/// Why a responder refused a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nak {
    /// A packet is missing: go back to `psn`.
    Sequence,
    /// No receive posted for the SEND or WRITE_WITH_IMM at `psn`.
    ReceiverNotReady,
    /// The request at `psn` failed at the responder (an access or length
    /// error): it completes with this status, and its queue pair fails.
    Fatal(WcStatus),
}

/// What a packet is.
#[derive(Debug, Clone)]
pub enum PacketKind {
    /// Payload of a work request.
    Data {
        /// Its sequence number.
        psn: u64,
        /// The request it belongs to.
        wr: Arc<WireWr>,
        /// Whether it is the request's first and last packet.
        first: bool,
        /// (See `first`.)
        last: bool,
    },
    /// Every packet up to `psn` arrived.
    Ack {
        /// The last packet acknowledged.
        psn: u64,
    },
    /// A refusal at `psn` (every packet before it arrived).
    Nak {
        /// Where the requester goes back to (or which request fails).
        psn: u64,
        /// Why.
        why: Nak,
    },
    /// A congestion notification for the queue pair it names.
    Cnp,
}

/// A packet between two NICs.
#[derive(Debug, Clone)]
pub struct Packet {
    /// Sending host.
    pub src: HostId,
    /// Receiving host.
    pub dst: HostId,
    /// Sending queue pair (on `src`).
    pub src_qp: u32,
    /// Receiving queue pair (on `dst`).
    pub dst_qp: u32,
    /// Bytes on the wire, headers included.
    pub wire_bytes: u64,
    /// Marked congestion experienced by a switch.
    pub ecn: bool,
    /// What it is.
    pub kind: PacketKind,
}

impl Packet {
    /// Whether it carries a work request's payload (ECN-capable; the
    /// rest is control traffic).
    pub fn is_data(&self) -> bool {
        matches!(self.kind, PacketKind::Data { .. })
    }
}

/// A packet put on the wire by the NIC.
#[derive(Debug, Clone)]
pub struct Sent {
    /// The packet.
    pub packet: Packet,
    /// When its last bit leaves the NIC, ns.
    pub leaves_at: u64,
    /// When its last bit reaches the switch, ns.
    pub arrives_at: u64,
}

/// Counters of one NIC.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RnicStats {
    /// Data packets sent, retransmissions included.
    pub data_packets: u64,
    /// Data packets sent again (go-back-N).
    pub retransmitted: u64,
    /// Payload bytes sent, retransmissions included.
    pub payload_bytes: u64,
    /// Acknowledgements and NAKs sent.
    pub acks: u64,
    /// Receiver-not-ready NAKs sent.
    pub rnr_naks: u64,
    /// Sequence NAKs sent.
    pub seq_naks: u64,
    /// CNPs sent (as a notification point).
    pub cnps_sent: u64,
    /// CNPs received (as a reaction point).
    pub cnps_received: u64,
    /// Retransmission timeouts.
    pub timeouts: u64,
}

/// A queue pair's number on its NIC.
pub type Qpn = u32;

#[derive(Debug)]
struct Entry {
    wr_id: u64,
    signaled: bool,
    /// `None`: a local request (bind or invalidate), run at the cursor.
    wire: Option<Arc<WireWr>>,
    op: SendOp,
    /// Payload bytes of it sent since it was (last) started.
    sent: u64,
    /// Its first packet's sequence number (once started); for a local
    /// request, the number of the packet after it.
    first_psn: u64,
    /// Its last packet's (once whole on the wire); a local request's is
    /// `first_psn`.
    last_psn: u64,
    /// A local request that ran (one that a go-back passes again does not
    /// run twice).
    ran: bool,
    /// Its first packet went (`first_psn` is known; a packet sent again
    /// keeps its number).
    started: bool,
    /// Its last packet went (`last_psn` is known).
    whole: bool,
    /// Its scatter/gather list is not registered memory.
    bad_gather: bool,
}

#[derive(Debug)]
struct Qp {
    remote: Option<(HostId, Qpn)>,
    error: bool,
    max_send_wr: u32,
    rnr_retry: u8,
    // Requester.
    /// Posted and not completed, in posting order; those before `cursor`
    /// are whole on the wire (or ran), the one at it may be partly sent.
    sq: VecDeque<Entry>,
    cursor: usize,
    next_psn: u64,
    /// One past the highest packet ever sent (to count retransmissions).
    high_psn: u64,
    /// Acknowledged up to, exclusive.
    acked_psn: u64,
    rate: Option<Dcqcn>,
    /// Paced: the next packet may start then.
    next_start: u64,
    /// After an RNR NAK: nothing is sent before then.
    hold_until: u64,
    rnr_left: u8,
    /// The retransmission timer (`None`: nothing unacknowledged).
    deadline: Option<u64>,
    /// The time of its entry in the NIC's timer heap (later ones are
    /// stale), if it has one.
    armed: Option<u64>,
    timeouts: u32,
    /// In the NIC's round robin (ready or waiting on its pace).
    scheduled: bool,
    // Responder.
    recvs: VecDeque<RecvWr>,
    expected_psn: u64,
    /// A SEND's receive, taken at its first packet.
    receiving: Option<RecvWr>,
    nak_sent: bool,
    since_ack: u32,
    last_cnp: Option<u64>,
}

impl Qp {
    /// Whether the entry at the cursor has packets to send.
    fn has_packets(&self) -> bool {
        self.sq.get(self.cursor).is_some_and(|e| e.wire.is_some())
    }
}

/// One host's NIC (module docs).
#[derive(Debug)]
pub struct Rnic {
    host: HostId,
    params: RnicParams,
    link: LinkParams,
    dcqcn: Option<DcqcnParams>,
    memory: SimMemory,
    qps: Vec<Qp>,
    /// Acknowledgements, NAKs and CNPs to send, first.
    control: VecDeque<Packet>,
    /// Queue pairs with packets to send, in turn.
    ready: VecDeque<Qpn>,
    /// Queue pairs paced or held: (when, qpn).
    waiting: BinaryHeap<Reverse<(u64, Qpn)>>,
    /// Retransmission and rate timers: (when, qpn), one live entry per
    /// queue pair (`Qp::armed`), others stale and skipped.
    timers: BinaryHeap<Reverse<(u64, Qpn)>>,
    completions: VecDeque<WorkCompletion>,
    busy_until: u64,
    paused: bool,
    stats: RnicStats,
}

/// A post the NIC refused (the verbs call's error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// More work requests than the queue holds.
    #[error("queue pair {0}: the send queue is full")]
    SendQueueFull(Qpn),
    /// The queue pair is not connected.
    #[error("queue pair {0} is not connected")]
    NotConnected(Qpn),
    /// No such queue pair.
    #[error("no queue pair {0}")]
    Unknown(Qpn),
}

impl Rnic {
    /// The NIC of `host` on `link`, its memory `memory`, with DCQCN at
    /// its queue pairs when `dcqcn` is set.
    pub fn new(
        host: HostId,
        params: RnicParams,
        link: LinkParams,
        dcqcn: Option<DcqcnParams>,
        memory: SimMemory,
    ) -> Self {
        Self {
            host,
            params,
            link,
            dcqcn,
            memory,
            qps: Vec::new(),
            control: VecDeque::new(),
            ready: VecDeque::new(),
            waiting: BinaryHeap::new(),
            timers: BinaryHeap::new(),
            completions: VecDeque::new(),
            busy_until: 0,
            paused: false,
            stats: RnicStats::default(),
        }
    }

    /// The host's memory.
    pub fn memory(&self) -> &SimMemory {
        &self.memory
    }

    /// Counters.
    pub fn stats(&self) -> RnicStats {
        self.stats
    }

    /// A new queue pair (not connected) holding up to `max_send_wr` send
    /// requests, retrying RNR NAKs `rnr_retry` times (7: without end).
    pub fn create_qp(&mut self, max_send_wr: u32, rnr_retry: u8, now: u64) -> Qpn {
        let qpn = Qpn::try_from(self.qps.len()).unwrap_or(Qpn::MAX);
        self.qps.push(Qp {
            remote: None,
            error: false,
            max_send_wr,
            rnr_retry,
            sq: VecDeque::new(),
            cursor: 0,
            next_psn: 0,
            high_psn: 0,
            acked_psn: 0,
            rate: self.dcqcn.map(|p| Dcqcn::new(p, now)),
            next_start: 0,
            hold_until: 0,
            rnr_left: rnr_retry,
            deadline: None,
            armed: None,
            timeouts: 0,
            scheduled: false,
            recvs: VecDeque::new(),
            expected_psn: 0,
            receiving: None,
            nak_sent: false,
            since_ack: 0,
            last_cnp: None,
        });
        qpn
    }

    /// Connects `qpn` to queue pair `remote_qp` of host `remote`.
    pub fn connect(&mut self, qpn: Qpn, remote: HostId, remote_qp: Qpn) {
        if let Some(qp) = self.qps.get_mut(qpn as usize) {
            qp.remote = Some((remote, remote_qp));
        }
    }

    /// Whether `qpn` is in error.
    pub fn in_error(&self, qpn: Qpn) -> bool {
        self.qps.get(qpn as usize).is_none_or(|qp| qp.error)
    }

    /// Receives posted on `qpn` (in error: each completes flushed).
    pub fn post_recv(&mut self, qpn: Qpn, wrs: &[RecvWr]) -> Result<(), PostError> {
        let qp = self
            .qps
            .get_mut(qpn as usize)
            .ok_or(PostError::Unknown(qpn))?;
        if qp.error {
            for wr in wrs {
                self.completions
                    .push_back(completion(qpn, wr.wr_id, WcStatus::Flushed, 0));
            }
            return Ok(());
        }
        qp.recvs.extend(wrs.iter().copied());
        Ok(())
    }

    /// Send work requests posted on `qpn` at `now` (in error: each
    /// completes flushed).
    pub fn post_send(&mut self, qpn: Qpn, wrs: &[SendWr], now: u64) -> Result<(), PostError> {
        let qp = self
            .qps
            .get_mut(qpn as usize)
            .ok_or(PostError::Unknown(qpn))?;
        if qp.remote.is_none() {
            return Err(PostError::NotConnected(qpn));
        }
        if qp.sq.len() + wrs.len() > qp.max_send_wr as usize {
            return Err(PostError::SendQueueFull(qpn));
        }
        if qp.error {
            for wr in wrs {
                self.completions
                    .push_back(completion(qpn, wr.wr_id, WcStatus::Flushed, 0));
            }
            return Ok(());
        }
        for wr in wrs {
            let local = matches!(wr.op, SendOp::BindWindow { .. } | SendOp::Invalidate { .. });
            let (wire, bad_gather) = if local {
                (None, false)
            } else {
                match self.memory.gather(&wr.sges) {
                    Ok(gather) => {
                        let total = gather.iter().map(|&(_, l)| l as u64).sum();
                        let wire = WireWr {
                            op: wr.op,
                            gather,
                            total,
                            source: self.memory.clone(),
                        };
                        (Some(Arc::new(wire)), false)
                    }
                    Err(_) => (None, true),
                }
            };
            qp.sq.push_back(Entry {
                wr_id: wr.wr_id,
                signaled: wr.signaled,
                wire,
                op: wr.op,
                sent: 0,
                first_psn: 0,
                last_psn: 0,
                ran: false,
                started: false,
                whole: false,
                bad_gather,
            });
        }
        self.run_cursor(qpn, now);
        Ok(())
    }

    /// Runs the requests at `qpn`'s cursor that need no wire (local
    /// requests; one that cannot gather fails the queue pair), then
    /// schedules the queue pair if it has packets to send.
    fn run_cursor(&mut self, qpn: Qpn, now: u64) {
        loop {
            let Some(qp) = self.qps.get_mut(qpn as usize) else {
                return;
            };
            if qp.error {
                return;
            }
            let cursor = qp.cursor;
            let next_psn = qp.next_psn;
            let Some(entry) = qp.sq.get_mut(cursor) else {
                break;
            };
            if entry.bad_gather {
                let wr_id = entry.wr_id;
                self.fail_qp(qpn, wr_id, WcStatus::LocalProtectionError);
                return;
            }
            if entry.wire.is_some() {
                break;
            }
            qp.cursor += 1;
            if entry.ran {
                continue;
            }
            entry.ran = true;
            entry.first_psn = next_psn;
            entry.last_psn = next_psn;
            let (op, wr_id) = (entry.op, entry.wr_id);
            let ran = match op {
                SendOp::BindWindow {
                    rkey,
                    addr,
                    len,
                    lkey,
                    ..
                } => self.memory.bind(rkey, addr, len, lkey, qpn),
                SendOp::Invalidate { rkey } => {
                    self.memory.invalidate(rkey);
                    Ok(())
                }
                _ => Ok(()),
            };
            if let Err(status) = ran {
                self.fail_qp(qpn, wr_id, status);
                return;
            }
            // It completes in order, once everything before it has.
            self.complete_acked(qpn);
        }
        self.schedule(qpn, now);
    }

    /// Completes the requests at the front of `qpn`'s queue that are done:
    /// whole on the wire and acknowledged, or local and run.
    fn complete_acked(&mut self, qpn: Qpn) {
        let qp = &mut self.qps[qpn as usize];
        while qp.cursor > 0
            && qp.sq.front().is_some_and(|e| match e.wire {
                Some(_) => e.last_psn < qp.acked_psn,
                None => e.ran && e.last_psn <= qp.acked_psn,
            })
        {
            let Some(entry) = qp.sq.pop_front() else {
                break;
            };
            qp.cursor -= 1;
            if entry.signaled {
                self.completions
                    .push_back(completion(qpn, entry.wr_id, WcStatus::Success, 0));
            }
        }
    }

    /// Puts `qpn` in the round robin if it has packets to send.
    fn schedule(&mut self, qpn: Qpn, now: u64) {
        let Some(qp) = self.qps.get_mut(qpn as usize) else {
            return;
        };
        if qp.scheduled || qp.error || !qp.has_packets() {
            return;
        }
        qp.scheduled = true;
        let at = qp.next_start.max(qp.hold_until);
        if at <= now {
            self.ready.push_back(qpn);
        } else {
            self.waiting.push(Reverse((at, qpn)));
        }
    }

    /// The switch paused (`true`) or resumed (`false`) the NIC's link.
    pub fn handle_pfc(&mut self, pause: bool) {
        self.paused = pause;
    }

    /// The next completion for the engines, in the order they happened.
    pub fn poll_completion(&mut self) -> Option<WorkCompletion> {
        self.completions.pop_front()
    }

    /// When to call [`Rnic::handle_timeout`] or [`Rnic::poll_transmit`]
    /// next (`None`: nothing to do before another input).
    pub fn poll_timeout(&self) -> Option<u64> {
        let wire = if self.paused {
            None
        } else if !self.control.is_empty() || !self.ready.is_empty() {
            Some(self.busy_until)
        } else {
            self.waiting
                .peek()
                .map(|Reverse((at, _))| (*at).max(self.busy_until))
        };
        let timer = self.timers.peek().map(|Reverse((at, _))| *at);
        match (wire, timer) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Timers due at `now`: retransmission timeouts and DCQCN's rate
    /// increases.
    pub fn handle_timeout(&mut self, now: u64) {
        while let Some(&Reverse((at, qpn))) = self.timers.peek() {
            if at > now {
                break;
            }
            self.timers.pop();
            let Some(qp) = self.qps.get_mut(qpn as usize) else {
                continue;
            };
            if qp.armed != Some(at) {
                continue;
            }
            qp.armed = None;
            if let Some(rate) = qp.rate.as_mut()
                && rate.poll_timeout().is_some_and(|t| t <= now)
            {
                rate.handle_timeout(now);
            }
            if qp.deadline.is_some_and(|d| d <= now) && !qp.error {
                qp.deadline = None;
                self.stats.timeouts += 1;
                qp.timeouts += 1;
                if qp.timeouts > self.params.retry_count {
                    let wr_id = qp.sq.front().map_or(0, |e| e.wr_id);
                    self.fail_qp(qpn, wr_id, WcStatus::RetryExceeded);
                } else {
                    let psn = qp.acked_psn;
                    self.go_back(qpn, psn, now);
                    self.restart_timer(qpn, now);
                }
            }
            self.arm(qpn, now);
        }
    }

    /// Puts `qpn`'s next timer (its retransmission deadline or its rate's
    /// next increase) in the heap, unless an earlier entry stands.
    fn arm(&mut self, qpn: Qpn, now: u64) {
        let qp = &mut self.qps[qpn as usize];
        let rate = qp.rate.as_ref().and_then(Dcqcn::poll_timeout);
        let wanted = match (qp.deadline, rate) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(at) = wanted.map(|t| t.max(now + 1))
            && qp.armed.is_none_or(|armed| at < armed)
        {
            qp.armed = Some(at);
            self.timers.push(Reverse((at, qpn)));
        }
    }

    /// Starts `qpn`'s retransmission timer over, if anything it sent is
    /// unacknowledged.
    fn restart_timer(&mut self, qpn: Qpn, now: u64) {
        let qp = &mut self.qps[qpn as usize];
        qp.deadline = (qp.next_psn > qp.acked_psn && !qp.error)
            .then(|| now + self.params.retransmit_timeout_ns);
        self.arm(qpn, now);
    }

    /// The next packet on the wire at `now`, if the link is free and not
    /// paused and there is one to send.
    pub fn poll_transmit(&mut self, now: u64) -> Option<Sent> {
        if self.paused || now < self.busy_until {
            return None;
        }
        while let Some(&Reverse((at, qpn))) = self.waiting.peek() {
            if at > now {
                break;
            }
            self.waiting.pop();
            self.ready.push_back(qpn);
        }
        let packet = match self.control.pop_front() {
            Some(p) => p,
            None => self.next_data(now)?,
        };
        let leaves_at = now.saturating_add(self.link.serialize_ns(packet.wire_bytes));
        self.busy_until = leaves_at;
        Some(Sent {
            arrives_at: leaves_at.saturating_add(self.link.delay_ns),
            leaves_at,
            packet,
        })
    }

    /// One packet of the next queue pair in turn.
    fn next_data(&mut self, now: u64) -> Option<Packet> {
        let mtu = u64::from(self.params.mtu);
        while let Some(qpn) = self.ready.pop_front() {
            let host = self.host;
            let header = u64::from(self.params.header_bytes);
            let qp = &mut self.qps[qpn as usize];
            qp.scheduled = false;
            if qp.error {
                continue;
            }
            // Held by an RNR NAK, or paced, since it was scheduled.
            let at = qp.next_start.max(qp.hold_until);
            if at > now {
                qp.scheduled = true;
                self.waiting.push(Reverse((at, qpn)));
                continue;
            }
            let Some((dst, dst_qp)) = qp.remote else {
                continue;
            };
            let cursor = qp.cursor;
            let psn = qp.next_psn;
            let Some(entry) = qp.sq.get_mut(cursor) else {
                continue;
            };
            let Some(wire) = entry.wire.clone() else {
                continue;
            };
            let first = entry.sent == 0;
            if first {
                entry.first_psn = psn;
                entry.started = true;
            }
            let payload = (wire.total - entry.sent).min(mtu);
            entry.sent += payload;
            let last = entry.sent >= wire.total;
            if last {
                entry.last_psn = psn;
                entry.whole = true;
                qp.cursor += 1;
            }
            qp.next_psn += 1;
            if psn < qp.high_psn {
                self.stats.retransmitted += 1;
            }
            qp.high_psn = qp.high_psn.max(qp.next_psn);
            let timer_off = qp.deadline.is_none();
            // Paced at the queue pair's rate.
            let wire_bytes = payload + header;
            if let Some(rate) = qp.rate.as_mut() {
                rate.handle_sent(wire_bytes, now);
                let gap = LinkParams {
                    rate_bps: rate.rate_bps().max(1),
                    ..self.link
                }
                .serialize_ns(wire_bytes);
                qp.next_start = now + gap;
            }
            self.stats.data_packets += 1;
            self.stats.payload_bytes += payload;
            if timer_off {
                self.restart_timer(qpn, now);
            }
            let packet = Packet {
                src: host,
                dst,
                src_qp: qpn,
                dst_qp,
                wire_bytes,
                ecn: false,
                kind: PacketKind::Data {
                    psn,
                    wr: wire,
                    first,
                    last,
                },
            };
            if last {
                self.run_cursor(qpn, now);
            } else {
                self.schedule(qpn, now);
            }
            return Some(packet);
        }
        None
    }

    /// A packet for this host arrived at `now`.
    pub fn handle_packet(&mut self, packet: Packet, now: u64) {
        let qpn = packet.dst_qp;
        if self.qps.get(qpn as usize).is_none_or(|qp| qp.error) {
            return;
        }
        match packet.kind {
            PacketKind::Data {
                psn,
                ref wr,
                first,
                last,
            } => {
                let wr = Arc::clone(wr);
                self.handle_data(&packet, psn, &wr, first, last, now);
            }
            PacketKind::Ack { psn } => self.handle_ack(qpn, psn + 1, now),
            PacketKind::Nak { psn, why } => self.handle_nak(qpn, psn, why, now),
            PacketKind::Cnp => {
                self.stats.cnps_received += 1;
                let qp = &mut self.qps[qpn as usize];
                if let Some(rate) = qp.rate.as_mut() {
                    rate.handle_cnp(now);
                    self.arm(qpn, now);
                }
            }
        }
    }

    fn reply(&mut self, to: &Packet, kind: PacketKind) {
        let bytes = self.params.ack_bytes();
        self.control.push_back(Packet {
            src: self.host,
            dst: to.src,
            src_qp: to.dst_qp,
            dst_qp: to.src_qp,
            wire_bytes: bytes,
            ecn: false,
            kind,
        });
    }

    /// The notification point: a CNP for a marked packet, one per queue
    /// pair per `cnp_interval_ns`.
    fn notify_congestion(&mut self, packet: &Packet, now: u64) {
        let qp = &mut self.qps[packet.dst_qp as usize];
        let interval = self.params.cnp_interval_ns;
        if qp
            .last_cnp
            .is_none_or(|at| now.saturating_sub(at) >= interval)
        {
            qp.last_cnp = Some(now);
            self.stats.cnps_sent += 1;
            self.reply(packet, PacketKind::Cnp);
        }
    }

    /// A data packet at the responder: in order it is taken (a receive
    /// consumed where its operation needs one, its bytes placed at its
    /// last packet, acknowledged every `ack_every` packets and at the
    /// last); a duplicate is acknowledged again, a gap NAKed once.
    fn handle_data(
        &mut self,
        packet: &Packet,
        psn: u64,
        wr: &Arc<WireWr>,
        first: bool,
        last: bool,
        now: u64,
    ) {
        let qpn = packet.dst_qp;
        if packet.ecn {
            self.notify_congestion(packet, now);
        }
        let qp = &mut self.qps[qpn as usize];
        if psn < qp.expected_psn {
            // A duplicate (the requester went back): acknowledged again.
            let ack = qp.expected_psn - 1;
            self.stats.acks += 1;
            self.reply(packet, PacketKind::Ack { psn: ack });
            return;
        }
        if psn > qp.expected_psn {
            if !qp.nak_sent {
                qp.nak_sent = true;
                let expected = qp.expected_psn;
                self.stats.seq_naks += 1;
                self.reply(
                    packet,
                    PacketKind::Nak {
                        psn: expected,
                        why: Nak::Sequence,
                    },
                );
            }
            return;
        }
        qp.nak_sent = false;
        let needs_recv = match wr.op {
            SendOp::Send => first,
            SendOp::WriteWithImm { .. } => last,
            _ => false,
        };
        if needs_recv && qp.receiving.is_none() {
            match qp.recvs.pop_front() {
                Some(recv) => qp.receiving = Some(recv),
                None => {
                    self.stats.rnr_naks += 1;
                    self.reply(
                        packet,
                        PacketKind::Nak {
                            psn,
                            why: Nak::ReceiverNotReady,
                        },
                    );
                    return;
                }
            }
        }
        qp.expected_psn += 1;
        qp.since_ack += 1;
        if last {
            let placed = match wr.op {
                SendOp::Send => {
                    let recv = qp.receiving.take();
                    recv.map(|recv| {
                        let outcome = self.memory.place_receive(&wr.source, &wr.gather, recv.sge);
                        (recv.wr_id, outcome.map(|n| (WcKind::Recv, n)))
                    })
                }
                SendOp::Write { remote_addr, rkey } => {
                    if let Err(status) =
                        self.memory
                            .place_write(&wr.source, &wr.gather, remote_addr, rkey, qpn)
                    {
                        // The requester's request fails; this side goes on.
                        self.qps[qpn as usize].expected_psn -= 1;
                        self.reply(
                            packet,
                            PacketKind::Nak {
                                psn,
                                why: Nak::Fatal(status),
                            },
                        );
                        return;
                    }
                    None
                }
                SendOp::WriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                } => {
                    let recv = qp.receiving.take();
                    recv.map(|recv| {
                        let outcome = self
                            .memory
                            .place_write(&wr.source, &wr.gather, remote_addr, rkey, qpn)
                            .map(|()| (WcKind::RecvWithImm(imm), wr.total as u32));
                        (recv.wr_id, outcome)
                    })
                }
                SendOp::BindWindow { .. } | SendOp::Invalidate { .. } => None,
            };
            match placed {
                Some((wr_id, Ok((kind, len)))) => {
                    self.completions.push_back(WorkCompletion {
                        wr_id,
                        status: WcStatus::Success,
                        kind,
                        byte_len: len,
                        qpn,
                        vendor_err: 0,
                    });
                }
                Some((wr_id, Err(status))) => {
                    // The receive fails, and so does this queue pair (as
                    // rxe's responder does); the requester is told.
                    self.completions
                        .push_back(completion(qpn, wr_id, status, 0));
                    let remote_status = match status {
                        WcStatus::LocalLengthError => WcStatus::RemoteOperationError,
                        other => other,
                    };
                    self.reply(
                        packet,
                        PacketKind::Nak {
                            psn,
                            why: Nak::Fatal(remote_status),
                        },
                    );
                    self.fail_qp(qpn, u64::MAX, WcStatus::Flushed);
                    return;
                }
                None => {}
            }
        }
        let qp = &mut self.qps[qpn as usize];
        if last || qp.since_ack >= self.params.ack_every {
            qp.since_ack = 0;
            self.stats.acks += 1;
            self.reply(packet, PacketKind::Ack { psn });
        }
    }

    /// Everything before `upto` (exclusive) was acknowledged.
    fn handle_ack(&mut self, qpn: Qpn, upto: u64, now: u64) {
        let qp = &mut self.qps[qpn as usize];
        if upto <= qp.acked_psn {
            return;
        }
        qp.acked_psn = upto;
        // Acknowledged past where a go-back left the sender (packets of
        // the first pass arrived after all): go on from there.
        if upto > qp.next_psn {
            self.reposition(qpn, upto);
        }
        let qp = &mut self.qps[qpn as usize];
        qp.timeouts = 0;
        qp.rnr_left = qp.rnr_retry;
        self.restart_timer(qpn, now);
        self.complete_acked(qpn);
    }

    fn handle_nak(&mut self, qpn: Qpn, psn: u64, why: Nak, now: u64) {
        self.handle_ack(qpn, psn, now);
        match why {
            Nak::Sequence => self.go_back(qpn, psn, now),
            Nak::ReceiverNotReady => {
                let qp = &mut self.qps[qpn as usize];
                if qp.rnr_retry < 7 && qp.rnr_left == 0 {
                    let wr_id = qp.sq.front().map_or(0, |e| e.wr_id);
                    self.fail_qp(qpn, wr_id, WcStatus::ReceiverNotReady);
                    return;
                }
                if qp.rnr_retry < 7 {
                    qp.rnr_left -= 1;
                }
                qp.hold_until = now + self.params.rnr_delay_ns;
                self.go_back(qpn, psn, now);
            }
            Nak::Fatal(status) => {
                let wr_id = self.qps[qpn as usize].sq.front().map_or(0, |e| e.wr_id);
                self.fail_qp(qpn, wr_id, status);
            }
        }
    }

    /// Go-back-N: every packet from `psn` on (never before what was
    /// acknowledged) is sent again; local requests that ran do not run
    /// again.
    fn go_back(&mut self, qpn: Qpn, psn: u64, now: u64) {
        let qp = &self.qps[qpn as usize];
        if qp.error || psn >= qp.next_psn {
            return;
        }
        let psn = psn.max(qp.acked_psn);
        self.reposition(qpn, psn);
        let qp = &mut self.qps[qpn as usize];
        qp.deadline = None;
        if !qp.scheduled {
            self.schedule(qpn, now);
        }
    }

    /// Puts `qpn`'s send point at packet `psn` (at most one past the
    /// highest sent): the request holding it becomes the cursor, sent up
    /// to it; those after it start over. A packet keeps its number
    /// whenever it goes, so the numbers of requests sent before stand.
    fn reposition(&mut self, qpn: Qpn, psn: u64) {
        let mtu = u64::from(self.params.mtu);
        let qp = &mut self.qps[qpn as usize];
        let mut cursor = None;
        for (i, entry) in qp.sq.iter_mut().enumerate() {
            if entry.wire.is_none() {
                continue;
            }
            if cursor.is_none() {
                if entry.whole && entry.last_psn < psn {
                    continue;
                }
                cursor = Some(i);
                entry.sent = if entry.started {
                    psn.saturating_sub(entry.first_psn) * mtu
                } else {
                    0
                };
            } else {
                entry.sent = 0;
            }
        }
        qp.cursor = cursor.unwrap_or(qp.sq.len());
        qp.next_psn = psn;
    }

    /// Fails `qpn`: `wr_id` completes with `status` (unless `u64::MAX`),
    /// and everything else outstanding, sends and receives, flushed.
    fn fail_qp(&mut self, qpn: Qpn, wr_id: u64, status: WcStatus) {
        let Some(qp) = self.qps.get_mut(qpn as usize) else {
            return;
        };
        if qp.error {
            return;
        }
        qp.error = true;
        qp.deadline = None;
        if wr_id != u64::MAX {
            self.completions
                .push_back(completion(qpn, wr_id, status, 0));
        }
        qp.cursor = 0;
        for entry in qp.sq.drain(..) {
            if entry.wr_id != wr_id {
                self.completions
                    .push_back(completion(qpn, entry.wr_id, WcStatus::Flushed, 0));
            }
        }
        let recvs = qp.receiving.take().into_iter().chain(qp.recvs.drain(..));
        for recv in recvs {
            self.completions
                .push_back(completion(qpn, recv.wr_id, WcStatus::Flushed, 0));
        }
    }
}

fn completion(qpn: Qpn, wr_id: u64, status: WcStatus, byte_len: u32) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        kind: if status == WcStatus::Success {
            WcKind::Send
        } else {
            WcKind::Unknown
        },
        byte_len,
        qpn,
        vendor_err: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use tessera_transport::pool::{Access, Pool, PoolBuf, PoolConfig};
    use tessera_transport::verbs::Sge;

    /// Two NICs on one link each way (no switch), packets dropped where
    /// `lose` says.
    struct Pair {
        nics: [Rnic; 2],
        pools: Vec<[Pool; 2]>,
        now: u64,
        wire: BinaryHeap<Reverse<(u64, u64)>>,
        packets: HashMap<u64, Packet>,
        seq: u64,
        lose: Box<dyn FnMut(&Packet) -> bool>,
        done: [Vec<WorkCompletion>; 2],
        /// When each side's last completion came.
        last_done: [u64; 2],
    }

    impl Pair {
        fn new(rnr_retry: u8) -> Self {
            Self::with(rnr_retry, RnicParams::default())
        }

        fn with(rnr_retry: u8, params: RnicParams) -> Self {
            let mut nics =
                [0, 1].map(|h| Rnic::new(h, params, LinkParams::default(), None, SimMemory::new()));
            for (h, nic) in nics.iter_mut().enumerate() {
                let qpn = nic.create_qp(32, rnr_retry, 0);
                nic.connect(qpn, 1 - h as u32, 0);
            }
            let pools = nics
                .iter()
                .map(|nic| {
                    let pool = |access| {
                        Pool::new(PoolConfig::named("rnic-test"), access, nic.memory().hook())
                            .unwrap()
                    };
                    [pool(Access::LocalOnly), pool(Access::RemoteWrite)]
                })
                .collect();
            Self {
                nics,
                pools,
                now: 0,
                wire: BinaryHeap::new(),
                packets: HashMap::new(),
                seq: 0,
                lose: Box::new(|_| false),
                done: [Vec::new(), Vec::new()],
                last_done: [0; 2],
            }
        }

        fn buf(&self, host: usize, pool: usize, len: usize, fill: u8) -> PoolBuf {
            let mut buf = self.pools[host][pool].alloc(len).unwrap();
            buf.fill(fill);
            buf
        }

        /// Runs until nothing is left to do (or 100 ms).
        fn run(&mut self) {
            while self.now < 100_000_000 {
                for h in 0..2 {
                    self.nics[h].handle_timeout(self.now);
                    while let Some(sent) = self.nics[h].poll_transmit(self.now) {
                        self.seq += 1;
                        self.packets.insert(self.seq, sent.packet);
                        self.wire.push(Reverse((sent.arrives_at, self.seq)));
                    }
                    while let Some(c) = self.nics[h].poll_completion() {
                        self.done[h].push(c);
                        self.last_done[h] = self.now;
                    }
                }
                let next = [
                    self.wire.peek().map(|Reverse((t, _))| *t),
                    self.nics[0].poll_timeout(),
                    self.nics[1].poll_timeout(),
                ]
                .into_iter()
                .flatten()
                .min();
                let Some(next) = next else {
                    return;
                };
                self.now = next.max(self.now);
                while let Some(&Reverse((t, seq))) = self.wire.peek() {
                    if t > self.now {
                        break;
                    }
                    self.wire.pop();
                    let packet = self.packets.remove(&seq).unwrap();
                    if (self.lose)(&packet) {
                        continue;
                    }
                    let dst = packet.dst as usize;
                    self.nics[dst].handle_packet(packet, self.now);
                }
            }
        }
    }

    fn sge(buf: &PoolBuf, len: usize) -> Sge {
        Sge {
            addr: buf.as_ptr() as usize,
            len: len as u32,
            lkey: buf.region().unwrap().lkey,
        }
    }

    fn send(wr_id: u64, op: SendOp, sges: Vec<Sge>) -> SendWr {
        SendWr {
            wr_id,
            op,
            sges,
            signaled: true,
        }
    }

    #[test]
    fn a_send_takes_a_posted_receive_and_completes_once_acknowledged() {
        let mut pair = Pair::new(0);
        let out = pair.buf(0, 0, 3000, 5);
        let into = pair.buf(1, 1, 4096, 0);
        pair.nics[1]
            .post_recv(
                0,
                &[RecvWr {
                    wr_id: 7,
                    sge: sge(&into, 4096),
                }],
            )
            .unwrap();
        pair.nics[0]
            .post_send(0, &[send(1, SendOp::Send, vec![sge(&out, 3000)])], 0)
            .unwrap();
        pair.run();
        assert_eq!(pair.done[1].len(), 1);
        let recv = pair.done[1][0];
        assert_eq!(
            (recv.wr_id, recv.status, recv.kind, recv.byte_len),
            (7, WcStatus::Success, WcKind::Recv, 3000)
        );
        assert!(into[..3000].iter().all(|&b| b == 5));
        assert_eq!(pair.done[0].len(), 1);
        assert_eq!(
            (pair.done[0][0].wr_id, pair.done[0][0].status),
            (1, WcStatus::Success)
        );
        let stats = pair.nics[0].stats();
        assert_eq!((stats.data_packets, stats.retransmitted), (3, 0));
        // Three packets and an acknowledgement: a round trip and three
        // serializations, give or take a few ns.
        let done = pair.last_done[0];
        assert!((2_000..3_500).contains(&done), "{done}");
    }

    #[test]
    fn a_send_with_no_receive_posted_fails_the_queue_pair_when_rnr_retries_are_off() {
        let mut pair = Pair::new(0);
        let out = pair.buf(0, 0, 100, 1);
        pair.nics[0]
            .post_send(
                0,
                &[
                    send(1, SendOp::Send, vec![sge(&out, 100)]),
                    send(2, SendOp::Send, vec![sge(&out, 100)]),
                ],
                0,
            )
            .unwrap();
        pair.run();
        let statuses: Vec<_> = pair.done[0].iter().map(|c| (c.wr_id, c.status)).collect();
        assert_eq!(
            statuses,
            [(1, WcStatus::ReceiverNotReady), (2, WcStatus::Flushed)]
        );
        assert!(pair.nics[0].in_error(0));
        // Anything posted now is flushed.
        pair.nics[0]
            .post_send(0, &[send(3, SendOp::Send, vec![sge(&out, 100)])], pair.now)
            .unwrap();
        assert_eq!(
            pair.nics[0].poll_completion().map(|c| c.status),
            Some(WcStatus::Flushed)
        );
    }

    #[test]
    fn a_receiver_not_ready_is_retried_until_a_receive_is_posted_when_rnr_retry_is_without_end() {
        let mut pair = Pair::new(7);
        let out = pair.buf(0, 0, 100, 9);
        let into = pair.buf(1, 1, 256, 0);
        pair.nics[0]
            .post_send(0, &[send(1, SendOp::Send, vec![sge(&out, 100)])], 0)
            .unwrap();
        // Run a while with nothing posted, then post.
        for _ in 0..50 {
            pair.nics[0].handle_timeout(pair.now);
            pair.now += 1_000;
            pair.run_until_quiet_for_a_step();
        }
        assert!(pair.nics[1].stats().rnr_naks > 0);
        pair.nics[1]
            .post_recv(
                0,
                &[RecvWr {
                    wr_id: 3,
                    sge: sge(&into, 256),
                }],
            )
            .unwrap();
        pair.run();
        assert_eq!(
            pair.done[0].iter().map(|c| c.status).collect::<Vec<_>>(),
            [WcStatus::Success]
        );
        assert_eq!(pair.done[1][0].byte_len, 100);
    }

    impl Pair {
        /// One pass of the loop at the current time, moving packets due.
        fn run_until_quiet_for_a_step(&mut self) {
            let end = self.now;
            for h in 0..2 {
                while let Some(sent) = self.nics[h].poll_transmit(self.now) {
                    self.seq += 1;
                    self.packets.insert(self.seq, sent.packet);
                    self.wire.push(Reverse((sent.arrives_at, self.seq)));
                }
            }
            while let Some(&Reverse((t, seq))) = self.wire.peek() {
                if t > end {
                    break;
                }
                self.wire.pop();
                let packet = self.packets.remove(&seq).unwrap();
                let dst = packet.dst as usize;
                self.nics[dst].handle_packet(packet, t);
            }
        }
    }

    #[test]
    fn a_write_to_a_key_the_receiver_never_registered_fails_with_a_remote_access_error() {
        let mut pair = Pair::new(0);
        let out = pair.buf(0, 0, 64, 1);
        let into = pair.buf(1, 1, 64, 0);
        pair.nics[1]
            .post_recv(
                0,
                &[RecvWr {
                    wr_id: 4,
                    sge: sge(&into, 64),
                }],
            )
            .unwrap();
        let op = SendOp::WriteWithImm {
            remote_addr: into.as_ptr() as usize,
            rkey: 0xbad,
            imm: 1,
        };
        pair.nics[0]
            .post_send(0, &[send(1, op, vec![sge(&out, 64)])], 0)
            .unwrap();
        pair.run();
        assert_eq!(pair.done[0][0].status, WcStatus::RemoteAccessError);
        assert_eq!(pair.done[1][0].status, WcStatus::RemoteAccessError);
        assert!(pair.nics[0].in_error(0) && pair.nics[1].in_error(0));
        assert!(into.iter().all(|&b| b == 0), "nothing landed");
    }

    #[test]
    fn a_lost_packet_is_sent_again_from_where_it_was_lost_and_the_message_lands_whole() {
        let mut pair = Pair::new(0);
        let len = 20 * 1024;
        let mut out = pair.buf(0, 0, len, 0);
        for (i, b) in out.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let into = pair.buf(1, 1, len, 0);
        let mut lost = false;
        pair.lose = Box::new(move |p| {
            let hit = !lost && matches!(p.kind, PacketKind::Data { psn: 7, .. });
            lost |= hit;
            hit
        });
        let op = SendOp::WriteWithImm {
            remote_addr: into.as_ptr() as usize,
            rkey: into.region().unwrap().rkey,
            imm: 42,
        };
        pair.nics[1]
            .post_recv(
                0,
                &[RecvWr {
                    wr_id: 4,
                    sge: sge(&into, 0),
                }],
            )
            .unwrap();
        pair.nics[0]
            .post_send(0, &[send(1, op, vec![sge(&out, len)])], 0)
            .unwrap();
        pair.run();
        assert_eq!(
            pair.done[0].iter().map(|c| c.status).collect::<Vec<_>>(),
            [WcStatus::Success]
        );
        assert_eq!(pair.done[1][0].kind, WcKind::RecvWithImm(42));
        assert!(into.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        let (sent, naks) = (pair.nics[0].stats(), pair.nics[1].stats().seq_naks);
        assert_eq!(naks, 1);
        // Packets 7..20 went twice (those after the loss were dropped by
        // the responder until 7 came again).
        assert_eq!(sent.data_packets, 20 + sent.retransmitted);
        assert!(
            sent.retransmitted >= 1 && sent.retransmitted <= 13,
            "{sent:?}"
        );
    }

    #[test]
    fn a_lost_last_packet_is_recovered_by_the_retransmission_timeout() {
        let mut pair = Pair::new(0);
        let out = pair.buf(0, 0, 2048, 3);
        let into = pair.buf(1, 1, 2048, 0);
        let mut lost = false;
        pair.lose = Box::new(move |p| {
            let hit = !lost && matches!(p.kind, PacketKind::Data { last: true, .. });
            lost |= hit;
            hit
        });
        let op = SendOp::Write {
            remote_addr: into.as_ptr() as usize,
            rkey: into.region().unwrap().rkey,
        };
        pair.nics[0]
            .post_send(0, &[send(1, op, vec![sge(&out, 2048)])], 0)
            .unwrap();
        pair.run();
        assert_eq!(
            pair.done[0].iter().map(|c| c.status).collect::<Vec<_>>(),
            [WcStatus::Success]
        );
        assert_eq!(pair.nics[0].stats().timeouts, 1);
        assert!(pair.last_done[0] >= RnicParams::default().retransmit_timeout_ns);
        assert!(into.iter().all(|&b| b == 3));
    }

    #[test]
    fn an_acknowledgement_that_comes_after_a_timeouts_go_back_completes_the_request() {
        // The timer (3 us) fires before the acknowledgement of a 4-packet
        // WRITE comes back (about 3.5 us): the NIC goes back to packet 0,
        // then learns that all four arrived. It goes on from there and
        // the request completes (it once stayed in the queue for good:
        // the go-back had put it back before the acknowledgement, and the
        // duplicates' acknowledgements added nothing).
        let params = RnicParams {
            retransmit_timeout_ns: 3_000,
            ..RnicParams::default()
        };
        let mut pair = Pair::with(0, params);
        let out = pair.buf(0, 0, 4096, 6);
        let into = pair.buf(1, 1, 4096, 0);
        let op = SendOp::Write {
            remote_addr: into.as_ptr() as usize,
            rkey: into.region().unwrap().rkey,
        };
        pair.nics[0]
            .post_send(0, &[send(1, op, vec![sge(&out, 4096)])], 0)
            .unwrap();
        pair.run();
        assert_eq!(pair.nics[0].stats().timeouts, 1);
        assert_eq!(
            pair.done[0].iter().map(|c| c.status).collect::<Vec<_>>(),
            [WcStatus::Success]
        );
        assert!(into.iter().all(|&b| b == 6));
    }

    #[test]
    fn completions_come_in_posting_order_and_unsignalled_requests_are_silent() {
        let mut pair = Pair::new(0);
        let out = pair.buf(0, 0, 5000, 1);
        let into = pair.buf(1, 1, 5000, 0);
        let op = SendOp::Write {
            remote_addr: into.as_ptr() as usize,
            rkey: into.region().unwrap().rkey,
        };
        let wrs: Vec<SendWr> = (0..6)
            .map(|i| SendWr {
                signaled: i % 2 == 1,
                ..send(i, op, vec![sge(&out, 5000)])
            })
            .collect();
        pair.nics[0].post_send(0, &wrs, 0).unwrap();
        assert_eq!(
            pair.nics[0].post_send(0, &vec![wrs[0].clone(); 27], 0),
            Err(PostError::SendQueueFull(0))
        );
        pair.run();
        let ids: Vec<u64> = pair.done[0].iter().map(|c| c.wr_id).collect();
        assert_eq!(ids, [1, 3, 5]);
    }
}
