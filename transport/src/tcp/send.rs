//! The sending side of a TCP connection: writes from the caller when the
//! socket is free, batches through a writer task only under contention.
//!
//! A message handed to [`TcpSender::send`] is written in the caller's own
//! task, with one non-blocking `writev`, when no other write is in
//! progress and nothing is queued: the common case of a request or a
//! response on a connection that is not busy then costs no thread hop (a
//! profile of a 64-byte call found the hop to the writer task, a wake-up
//! of a parked runtime worker, to be most of Tessera's overhead over a
//! bare TCP ping-pong). When another write holds the socket, or the socket
//! takes only part of the message, the message (or its rest) goes to the
//! connection's queue, and the writer task writes the queue in batches of
//! up to `write_batch_bytes` with one vectored write each, as before.
//!
//! Who may write is decided by [`Outbox`], a sans-IO state machine: at most
//! one writer (a caller or the task) holds the socket at a time, and frames
//! reach the socket in the order they entered the outbox, a partly written
//! frame first. Call order, for a caller: [`Outbox::claim_direct`]; if
//! claimed, write, then [`Outbox::release_direct`] (with the unwritten rest,
//! if any); if not, [`Outbox::push`]. For the writer task:
//! [`Outbox::claim_batch`], write the batch, [`Outbox::release_batch`].
//! Each returns whether the writer task must be woken.
//!
//! TLS streams have no non-blocking vectored write, so over TLS every
//! message goes through the writer task (each batch is flushed).

use crate::sync::LockExt;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{Notify, Semaphore};

use super::{FRAME_HEADER_LEN, MAX_IOVECS, WriteHalf, encode_frame_header};
use crate::{Message, TransportError};

/// One message with its length prefix, and how much of it is written.
#[derive(Debug)]
pub(crate) struct Frame {
    header: [u8; FRAME_HEADER_LEN],
    message: Message,
    /// Bytes of header and message on the wire already.
    written: usize,
    /// It holds a place of the send queue (given back when it leaves).
    queued: bool,
}

impl Frame {
    pub(crate) fn new(header: [u8; FRAME_HEADER_LEN], message: Message) -> Self {
        Self {
            header,
            message,
            written: 0,
            queued: false,
        }
    }

    fn len(&self) -> usize {
        FRAME_HEADER_LEN + self.message.len()
    }

    /// Bytes not yet written.
    pub(crate) fn remaining(&self) -> usize {
        self.len() - self.written
    }

    /// Appends the unwritten bytes to `out` as slices (no copy).
    pub(crate) fn slices<'a>(&'a self, out: &mut Vec<IoSlice<'a>>) {
        let mut skip = self.written;
        let header: &[u8] = &self.header;
        for part in std::iter::once(header).chain(self.message.parts().iter().map(|p| &p[..])) {
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            out.push(IoSlice::new(&part[skip..]));
            skip = 0;
        }
    }

    /// Counts `n` more bytes written; returns what is left of `n` past
    /// this frame's end.
    pub(crate) fn advance(&mut self, n: usize) -> usize {
        let taken = n.min(self.remaining());
        self.written += taken;
        n - taken
    }
}

/// What [`Outbox::claim_batch`] found.
#[derive(Debug)]
pub(crate) enum Claim {
    /// Frames to write, in order; the socket is the task's until
    /// [`Outbox::release_batch`].
    Batch(Vec<Frame>),
    /// Nothing to write now (or a caller is writing): wait to be woken.
    Wait,
    /// Every sender is gone and everything is written: finish the stream.
    Finish,
    /// A write failed: stop.
    Failed,
}

/// Who writes next, and what waits (module docs). No I/O, no clock.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    queue: VecDeque<Frame>,
    /// A caller or the writer task holds the socket.
    writing: bool,
    /// Every sender is gone.
    closing: bool,
    failed: bool,
}

impl Outbox {
    /// A caller asks to write its frame itself: granted when nothing is
    /// queued and nobody writes (and `direct` writes are possible at all).
    pub(crate) fn claim_direct(&mut self, direct: bool) -> bool {
        let free = direct && !self.writing && !self.failed && self.queue.is_empty();
        self.writing |= free;
        free
    }

    /// A direct writer is done; `rest` is its frame's unwritten rest, which
    /// goes first. Returns whether the writer task must be woken.
    pub(crate) fn release_direct(&mut self, rest: Option<Frame>) -> bool {
        self.writing = false;
        if let Some(rest) = rest.filter(|f| f.remaining() > 0) {
            self.queue.push_front(rest);
        }
        !self.queue.is_empty() || self.closing
    }

    /// Queues `frame` (the caller holds a place of the queue). Returns
    /// whether the writer task must be woken.
    pub(crate) fn push(&mut self, mut frame: Frame) -> bool {
        frame.queued = true;
        self.queue.push_back(frame);
        !self.writing
    }

    /// The writer task asks for the next batch: at most `max_bytes` (but
    /// always at least one frame) and [`MAX_IOVECS`] slices.
    pub(crate) fn claim_batch(&mut self, max_bytes: usize) -> Claim {
        if self.failed {
            return Claim::Failed;
        }
        if self.writing {
            return Claim::Wait;
        }
        if self.queue.is_empty() {
            return match self.closing {
                true => Claim::Finish,
                false => Claim::Wait,
            };
        }
        let (mut bytes, mut iovecs) = (0, 0);
        let mut batch = Vec::new();
        while let Some(next) = self.queue.front() {
            let slices = 1 + next.message.parts().len();
            if !batch.is_empty() && (bytes >= max_bytes || iovecs + slices > MAX_IOVECS) {
                break;
            }
            bytes += next.remaining();
            iovecs += slices;
            batch.extend(self.queue.pop_front());
        }
        self.writing = true;
        Claim::Batch(batch)
    }

    /// The writer task wrote its batch.
    pub(crate) fn release_batch(&mut self) {
        self.writing = false;
    }

    /// Every sender is gone. Returns whether the writer task must be woken.
    pub(crate) fn close(&mut self) -> bool {
        self.closing = true;
        true
    }

    /// A write failed: queued frames are dropped; returns how many held a
    /// place of the queue.
    pub(crate) fn fail(&mut self) -> usize {
        self.failed = true;
        self.writing = false;
        let places = self.queue.iter().filter(|f| f.queued).count();
        self.queue.clear();
        places
    }

    pub(crate) fn failed(&self) -> bool {
        self.failed
    }
}

/// What the senders and the writer task share.
struct Shared {
    outbox: Mutex<Outbox>,
    /// Wakes the writer task.
    wake: Notify,
    /// Places of the send queue (`send_queue_depth`); closed on failure.
    places: Semaphore,
    /// The socket, for direct writes (`None` over TLS).
    direct: Option<OwnedWriteHalf>,
    max_message_size: u64,
    peer: SocketAddr,
    /// `tessera_transport_{messages,bytes}_sent_total`, resolved once per
    /// connection rather than looked up in the registry per write (with
    /// Prometheus installed, such per-message and per-call lookups cost
    /// the rpc benchmark 4-9% of its Health throughput).
    sent: SentCounters,
}

/// A connection's handles of the transport's send counters.
struct SentCounters {
    messages: metrics::Counter,
    bytes: metrics::Counter,
}

impl SentCounters {
    fn new() -> Self {
        Self {
            messages: metrics::counter!("tessera_transport_messages_sent_total", "transport" => "tcp"),
            bytes: metrics::counter!("tessera_transport_bytes_sent_total", "transport" => "tcp"),
        }
    }

    fn count(&self, messages: usize, bytes: usize) {
        self.messages.increment(messages as u64);
        self.bytes.increment(bytes as u64);
    }
}

impl Shared {
    fn outbox(&self) -> MutexGuard<'_, Outbox> {
        // Every change of the outbox is a few field writes that cannot
        // panic half-way, so a poisoned lock still holds a consistent one.
        self.outbox.locked()
    }

    /// A write failed: the queue is dropped, waiting and later senders get
    /// [`TransportError::Closed`]. The write half itself shuts down when
    /// the last sender is dropped (the connection's reader sees the error
    /// of a broken connection sooner).
    fn fail(&self, err: &std::io::Error) {
        tracing::debug!(peer = %self.peer, %err, "TCP write failed; closing the connection");
        self.outbox().fail();
        self.places.close();
        self.wake.notify_one();
    }
}

/// The sending half of a TCP connection. Cheap to clone; when the last
/// clone is dropped the writer task finishes the stream (the peer sees a
/// clean end once everything queued is written).
#[derive(Clone)]
pub(crate) struct TcpSender {
    handle: Arc<Handle>,
}

/// Dropped with the last sender.
struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        if self.shared.outbox().close() {
            self.shared.wake.notify_one();
        }
    }
}

impl std::fmt::Debug for TcpSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpSender")
            .field("peer", &self.handle.shared.peer)
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl TcpSender {
    /// Starts the writer task of a connection to `peer` writing to
    /// `write`; with `plain`, callers write directly to that socket.
    pub(crate) fn start(
        plain: Option<OwnedWriteHalf>,
        secured: Option<WriteHalf>,
        queue_depth: usize,
        batch_bytes: usize,
        max_message_size: u64,
        peer: SocketAddr,
    ) -> Self {
        let shared = Arc::new(Shared {
            outbox: Mutex::new(Outbox::default()),
            wake: Notify::new(),
            places: Semaphore::new(queue_depth),
            direct: plain,
            max_message_size,
            peer,
            sent: SentCounters::new(),
        });
        tokio::spawn(writer_task(Arc::clone(&shared), secured, batch_bytes));
        Self {
            handle: Arc::new(Handle { shared }),
        }
    }

    /// Ends the connection now, for a peer presumed dead: queued and later
    /// sends fail, and the socket is shut down both ways, so a write
    /// blocked on a peer that acknowledges nothing returns at once instead
    /// of after the kernel's retransmissions (about 15 minutes), and the
    /// socket and its queued buffers are freed. Over TLS (no direct socket
    /// here) only the queue fails, and the writer ends at its next error.
    pub(crate) fn abort(&self) {
        let shared = &self.handle.shared;
        if let Some(socket) = &shared.direct {
            use std::os::fd::AsRawFd;
            let _ = nix::sys::socket::shutdown(
                socket.as_ref().as_raw_fd(),
                nix::sys::socket::Shutdown::Both,
            );
        }
        shared.fail(&std::io::Error::other("aborted: the peer went silent"));
    }

    /// Writes `message` now if the socket is free, or queues it (waiting
    /// while the queue is full). Returns once it is written or queued.
    pub(crate) async fn send(&self, message: Message) -> Result<(), TransportError> {
        let shared = &self.handle.shared;
        let header = encode_frame_header(message.len(), shared.max_message_size)?;
        let frame = Frame::new(header, message);
        if let Some(socket) = &shared.direct
            && shared.outbox().claim_direct(true)
        {
            return self.write_direct(socket.as_ref(), frame);
        }
        let place = shared
            .places
            .acquire()
            .await
            .map_err(|_| TransportError::Closed)?;
        let mut outbox = shared.outbox();
        if outbox.failed() {
            return Err(TransportError::Closed);
        }
        place.forget();
        if outbox.push(frame) {
            drop(outbox);
            shared.wake.notify_one();
        }
        Ok(())
    }

    /// Writes what the socket takes of `frame` now, with one `writev` (the
    /// caller holds the socket); the rest goes to the writer task, which
    /// waits for room, so that a caller never loops on a large message.
    fn write_direct(
        &self,
        socket: &tokio::net::TcpStream,
        mut frame: Frame,
    ) -> Result<(), TransportError> {
        let shared = &self.handle.shared;
        let written = loop {
            let attempt = {
                let mut slices = Vec::with_capacity(1 + frame.message.parts().len());
                frame.slices(&mut slices);
                socket.try_write_vectored(&slices)
            };
            match attempt {
                Ok(0) => break Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => break Ok(n),
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => break Ok(0),
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
                Err(err) => break Err(err),
            }
        };
        let written = match written {
            Ok(n) => n,
            Err(err) => {
                shared.fail(&err);
                return Err(TransportError::Io(err));
            }
        };
        frame.advance(written);
        let done = frame.remaining() == 0;
        if shared.outbox().release_direct(Some(frame)) {
            shared.wake.notify_one();
        }
        if written > 0 {
            shared.sent.count(usize::from(done), written);
        }
        Ok(())
    }

    /// Whether the connection's writing has stopped (a write failed).
    pub(crate) fn is_closed(&self) -> bool {
        self.handle.shared.outbox().failed()
    }
}

/// Writes the queue in batches until every sender is gone (then finishes
/// the stream) or a write fails.
async fn writer_task(shared: Arc<Shared>, mut secured: Option<WriteHalf>, batch_bytes: usize) {
    loop {
        let claim = shared.outbox().claim_batch(batch_bytes);
        let mut batch = match claim {
            Claim::Batch(batch) => batch,
            Claim::Wait => {
                shared.wake.notified().await;
                continue;
            }
            Claim::Finish => break,
            Claim::Failed => return,
        };
        let places = batch.iter().filter(|f| f.queued).count();
        shared.places.add_permits(places);
        let bytes: usize = batch.iter().map(Frame::remaining).sum();
        let written = match (&shared.direct, &mut secured) {
            (Some(socket), _) => write_plain(socket.as_ref(), &mut batch).await,
            (None, Some(stream)) => write_secured(stream, &mut batch).await,
            (None, None) => Err(std::io::ErrorKind::NotConnected.into()),
        };
        if let Err(err) = written {
            shared.fail(&err);
            return;
        }
        shared.sent.count(batch.len(), bytes);
        shared.outbox().release_batch();
    }
    // Every sender is gone and everything is written: a clean end of the
    // stream (a plain socket's write half shuts down when the last owner
    // of the shared state drops it).
    if let Some(stream) = &mut secured {
        let _ = stream.shutdown().await;
    }
}

/// Writes every frame of `batch`, waiting for the socket to take them.
async fn write_plain(socket: &tokio::net::TcpStream, batch: &mut [Frame]) -> std::io::Result<()> {
    let mut first = 0;
    while first < batch.len() {
        socket.writable().await?;
        let written = {
            let mut slices = Vec::new();
            for frame in &batch[first..] {
                frame.slices(&mut slices);
            }
            socket.try_write_vectored(&slices)
        };
        let mut n = match written {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(err)
                if matches!(
                    err.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(err) => return Err(err),
        };
        while n > 0 && first < batch.len() {
            n = batch[first].advance(n);
            if batch[first].remaining() == 0 {
                first += 1;
            }
        }
    }
    Ok(())
}

/// Writes every frame of `batch` to a TLS stream, and flushes it: a TLS
/// stream takes bytes into its own buffer when the socket is full and sends
/// them only on a flush (or the next write), so without it a message's
/// tail could wait for the next message.
async fn write_secured(stream: &mut WriteHalf, batch: &mut [Frame]) -> std::io::Result<()> {
    let mut first = 0;
    while first < batch.len() {
        let mut n = {
            let mut slices = Vec::new();
            for frame in &batch[first..] {
                frame.slices(&mut slices);
            }
            stream.write_vectored(&slices).await?
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 && first < batch.len() {
            n = batch[first].advance(n);
            if batch[first].remaining() == 0 {
                first += 1;
            }
        }
    }
    stream.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use proptest::prelude::*;

    fn frame(parts: &[&[u8]]) -> Frame {
        let message = Message::from_parts(parts.iter().map(|p| Bytes::copy_from_slice(p)));
        let header = encode_frame_header(message.len(), u64::MAX).unwrap_or_default();
        Frame::new(header, message)
    }

    fn wire_bytes(frame: &Frame) -> Vec<u8> {
        let mut slices = Vec::new();
        frame.slices(&mut slices);
        slices.iter().flat_map(|s| s.iter().copied()).collect()
    }

    proptest! {
        /// However a write is cut, the bytes that reach the socket are the
        /// frame's, once each, in order.
        #[test]
        fn partial_writes_put_every_byte_on_the_wire_once(
            parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..6),
            cuts in proptest::collection::vec(1usize..30, 1..40),
        ) {
            let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            let mut frame = frame(&parts);
            let expected = wire_bytes(&frame);
            let mut wire = Vec::new();
            for cut in cuts.iter().cycle() {
                if frame.remaining() == 0 {
                    break;
                }
                let next = wire_bytes(&frame);
                let n = (*cut).min(next.len());
                wire.extend_from_slice(&next[..n]);
                prop_assert_eq!(frame.advance(n), 0);
            }
            prop_assert_eq!(wire, expected);
        }
    }

    /// What a model run does next: callers and the writer task run on
    /// different threads, so a caller may queue while another caller, or
    /// the task, holds the socket.
    #[derive(Debug, Clone)]
    enum Op {
        /// A caller sends a message of this many bytes (it gets the socket
        /// or queues).
        Send { len: usize },
        /// The caller holding the socket, if any, finishes: the socket took
        /// `taken` per mille of its frame.
        DirectDone { taken: u16 },
        /// The writer task, if awake, takes its next step (claim a batch,
        /// or write the one it holds) with this batch bound.
        Task { batch: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0usize..64).prop_map(|len| Op::Send { len }),
            (0u16..=1000).prop_map(|taken| Op::DirectDone { taken }),
            (1usize..200).prop_map(|batch| Op::Task { batch }),
        ]
    }

    /// The writer task of the model, driven like the real one: a woken
    /// task claims; with nothing to claim it sleeps unless a wake-up
    /// (a `Notify` permit) is stored.
    #[derive(Debug, Default)]
    struct ModelTask {
        batch: Option<Vec<Frame>>,
        asleep: bool,
        permit: bool,
        finished: bool,
    }

    impl ModelTask {
        fn step(&mut self, outbox: &mut Outbox, batch_bytes: usize, wire: &mut Vec<u8>) {
            if self.finished || (self.asleep && !self.permit) {
                return;
            }
            if self.asleep {
                (self.asleep, self.permit) = (false, false);
            }
            if let Some(frames) = self.batch.take() {
                for frame in &frames {
                    wire.extend(wire_bytes(frame));
                }
                outbox.release_batch();
                return;
            }
            match outbox.claim_batch(batch_bytes) {
                Claim::Batch(frames) => self.batch = Some(frames),
                Claim::Wait if self.permit => self.permit = false,
                Claim::Wait => self.asleep = true,
                Claim::Finish | Claim::Failed => self.finished = true,
            }
        }
    }

    proptest! {
        /// Any interleaving of callers and the writer task (over plain TCP,
        /// or TLS where every frame queues): frames reach the
        /// socket whole and in the order they entered, the task is never
        /// asleep without a wake-up while frames wait for it, and once
        /// every sender is gone it finishes after writing everything.
        #[test]
        fn callers_and_the_task_keep_frames_in_order_and_never_lose_a_wake(
            ops in proptest::collection::vec(op(), 0..80),
            tls in any::<bool>(),
        ) {
            let mut outbox = Outbox::default();
            let mut task = ModelTask::default();
            let mut direct: Option<Frame> = None;
            let (mut expected, mut wire) = (Vec::new(), Vec::new());
            let finish_direct = |outbox: &mut Outbox, task: &mut ModelTask, direct: &mut Option<Frame>, wire: &mut Vec<u8>, taken: u16| {
                if let Some(mut frame) = direct.take() {
                    let n = frame.remaining() * usize::from(taken) / 1000;
                    wire.extend(&wire_bytes(&frame)[..n]);
                    frame.advance(n);
                    task.permit |= outbox.release_direct(Some(frame));
                }
            };
            for (id, op) in ops.iter().enumerate() {
                match *op {
                    Op::Send { len } => {
                        let frame = frame(&[&vec![id as u8; len]]);
                        expected.extend(wire_bytes(&frame));
                        if outbox.claim_direct(!tls) {
                            direct = Some(frame);
                        } else {
                            task.permit |= outbox.push(frame);
                        }
                    }
                    Op::DirectDone { taken } => {
                        finish_direct(&mut outbox, &mut task, &mut direct, &mut wire, taken);
                    }
                    Op::Task { batch } => task.step(&mut outbox, batch, &mut wire),
                }
                let stranded = !outbox.queue.is_empty() && !outbox.writing;
                prop_assert!(
                    !(task.asleep && !task.permit && stranded),
                    "frames wait and the task sleeps without a wake-up"
                );
            }
            // The last caller finishes, every sender goes.
            finish_direct(&mut outbox, &mut task, &mut direct, &mut wire, 1000);
            task.permit |= outbox.close();
            for _ in 0..10_000 {
                if task.finished {
                    break;
                }
                prop_assert!(!task.asleep || task.permit, "the task sleeps after the close");
                task.step(&mut outbox, 64, &mut wire);
            }
            prop_assert!(task.finished);
            prop_assert_eq!(wire, expected);
        }
    }

    #[test]
    fn a_free_socket_goes_to_the_caller_and_a_busy_one_queues() {
        let mut outbox = Outbox::default();
        assert!(outbox.claim_direct(true));
        // A second caller while the first writes: queued, the task not woken
        // (the direct writer wakes it when it releases).
        assert!(!outbox.claim_direct(true));
        assert!(!outbox.push(frame(&[b"second"])));
        assert!(matches!(outbox.claim_batch(1 << 20), Claim::Wait));
        assert!(outbox.release_direct(None));
        // Something is queued: the next caller queues behind it.
        assert!(!outbox.claim_direct(true));
        match outbox.claim_batch(1 << 20) {
            Claim::Batch(batch) => assert_eq!(batch.len(), 1),
            other => panic!("{other:?}"),
        }
        assert!(!outbox.claim_direct(true), "the task holds the socket");
        outbox.release_batch();
        assert!(outbox.claim_direct(true));
    }

    #[test]
    fn a_partly_written_frame_goes_before_everything_queued_after_it() {
        let mut outbox = Outbox::default();
        assert!(outbox.claim_direct(true));
        assert!(!outbox.push(frame(&[b"later"])));
        let mut first = frame(&[b"first message"]);
        first.advance(6);
        assert!(outbox.release_direct(Some(first)));
        let Claim::Batch(batch) = outbox.claim_batch(1 << 20) else {
            panic!("a batch");
        };
        assert_eq!(batch.len(), 2);
        assert_eq!(batch[0].remaining(), FRAME_HEADER_LEN + 13 - 6);
        assert!(!batch[0].queued, "the direct writer's frame held no place");
        assert!(batch[1].queued);
    }

    #[test]
    fn over_tls_every_frame_goes_through_the_task() {
        let mut outbox = Outbox::default();
        assert!(!outbox.claim_direct(false));
        assert!(outbox.push(frame(&[b"x"])));
    }

    #[test]
    fn batches_respect_their_byte_bound_but_always_take_one_frame() {
        let mut outbox = Outbox::default();
        for _ in 0..3 {
            outbox.push(frame(&[&[0u8; 100]]));
        }
        let Claim::Batch(batch) = outbox.claim_batch(150) else {
            panic!("a batch");
        };
        assert_eq!(batch.len(), 2, "the second frame starts below the bound");
        outbox.release_batch();
        let Claim::Batch(batch) = outbox.claim_batch(1) else {
            panic!("a batch");
        };
        assert_eq!(batch.len(), 1);
    }

    #[test]
    fn the_task_finishes_once_closed_and_drained_and_stops_on_failure() {
        let mut outbox = Outbox::default();
        outbox.push(frame(&[b"last"]));
        outbox.close();
        assert!(matches!(outbox.claim_batch(1 << 20), Claim::Batch(_)));
        outbox.release_batch();
        assert!(matches!(outbox.claim_batch(1 << 20), Claim::Finish));

        let mut outbox = Outbox::default();
        outbox.push(frame(&[b"a"]));
        outbox.push(frame(&[b"b"]));
        assert_eq!(outbox.fail(), 2);
        assert!(matches!(outbox.claim_batch(1 << 20), Claim::Failed));
        assert!(!outbox.claim_direct(true));
    }
}
