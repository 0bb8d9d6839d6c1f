//! Striping (issue 36): a large message's bytes written through the queue
//! pairs of several rails at once, so that one busy socket uses every link
//! to its peer.
//!
//! **Who does what.** The engine a socket lives on (its *home*, on one
//! rail) owns the message: it asks for the destination (RTS/CTS, or an
//! offer), writes fragments itself, hands *chunks* of the rest to the
//! engines on other rails to the same peer (its *partners*, which its
//! owner names with [`Engine::set_stripe_rails`]), and writes the last
//! fragment, the WRITE_WITH_IMM that tells the receiver, only once every
//! chunk handed out has completed. A WRITE's completion on a reliable
//! connection means the peer's NIC placed it, and the home's own WRITEs
//! are placed before its WRITE_WITH_IMM on the same queue pair: the
//! receiver, which learns of the message from that completion alone,
//! finds every byte in place. Small messages, control messages and the
//! order of each socket stay on the home rail, as before.
//!
//! **Keys.** The receiver's CTS or `Offer` carries the destination's key
//! on each of its rails (`control.rs`, rail keys): a partner on rail r
//! writes with key r. A confined receiver sends none (its memory windows
//! are bound on the home queue pair only), and its messages are not
//! striped; nor are messages below `stripe.min_bytes`.
//!
//! **Balance.** Each partner rail has at most `stripe.depth` chunks of
//! `stripe.chunk_bytes` at once and gets the next as one completes, while
//! the home writes fragments of the same range in its scheduler's turns:
//! each rail takes bytes as fast as its link and window drain them, so
//! rails share a message in proportion to what they carry, and a slow or
//! loaded rail takes fewer chunks.
//!
//! **A rail failing.** A partner that fails (or panics) reports its
//! chunks not written (`ok = false`) once none of their writes can still
//! be carried out: as its queue pair's flushes come back, or when its
//! owner destroys the queue pair ([`Engine::settle_stripes`]), and the
//! home writes those ranges itself, or hands them to another partner: the message is not lost, and the caller never
//! learns of it. A rewrite of bytes already placed is harmless (the same
//! bytes, and the receiver is not told before the WRITE_WITH_IMM). If the
//! home fails, the message fails with its socket, as any other.
//!
//! **Partner side.** A chunk handed in ([`Engine::handle_stripe_writes`])
//! queues on the partner's own scheduler as one more turn-taker (one
//! fragment per turn, within its window), its last WRITE's completion
//! reported as [`EngineEvent::StripeDone`]; the owner routes it back.
//!
//! Call order, added to the engine's: after [`Engine::poll_transmit`],
//! drain [`Engine::poll_delegation`] and hand each chunk to the named
//! rail's engine; feed [`Engine::handle_stripe_done`] with each answer
//! (or at once with `ok = false` when that engine is gone).

#[allow(clippy::wildcard_imports)]
use super::*;

/// The scheduler's turn of the chunks handed in by other engines (not a
/// socket: `Open` of this id is refused, and no socket is given it).
pub(super) const STRIPES: SocketId = u32::MAX;

/// A chunk for another rail's engine to write: `len` bytes of `parts` to
/// `remote_addr` with `rkey` (the destination's key on that rail).
#[derive(Debug, Clone)]
pub struct StripeChunk {
    /// Where the bytes go.
    pub remote_addr: u64,
    /// The destination's key on the writing engine's rail.
    pub rkey: u32,
    /// The bytes, in order (slices of the message; they stay alive until
    /// written).
    pub parts: Vec<Bytes>,
    /// Their total length.
    pub len: usize,
}

/// A chunk handed out by [`Engine::poll_delegation`].
#[derive(Debug)]
pub struct Delegation {
    /// The rail whose engine writes it.
    pub rail: usize,
    /// This engine's token for it (for [`Engine::handle_stripe_done`]).
    pub token: u64,
    /// What to write.
    pub chunk: StripeChunk,
}

/// The striping of one large message on its way (its `LargeSend`).
#[derive(Debug)]
pub(super) struct Striping {
    /// Start of the last fragment, which the home writes itself (the
    /// WRITE_WITH_IMM); chunks are taken below it.
    end: usize,
    /// Bytes below `end` not yet taken by the home or a partner start here.
    next: usize,
    /// Ranges (offset, length) a failed partner did not write: the home
    /// writes them first.
    redo: Vec<(usize, usize)>,
    /// Chunks handed out and not answered.
    out: usize,
}

/// A chunk handed out, until its answer.
#[derive(Debug)]
pub(super) struct Delegated {
    socket: SocketId,
    msg_id: u32,
    offset: usize,
    len: usize,
    rail: usize,
}

/// A chunk handed in by another engine, being written.
#[derive(Debug)]
pub(super) struct Foreign {
    origin: u64,
    token: u64,
    chunk: StripeChunk,
    /// Bytes of it queued so far.
    offset: usize,
}

/// The engine's striping state, both roles.
#[derive(Debug, Default)]
pub(super) struct Stripes {
    /// Rails with a partner engine to the same peer (the owner's word).
    rails: Vec<usize>,
    /// Chunks out per rail.
    out: HashMap<usize, usize>,
    /// Chunks out, by token.
    delegated: HashMap<u64, Delegated>,
    next_token: u64,
    /// Sockets whose first large message is striped with bytes left to
    /// hand out.
    work: VecDeque<SocketId>,
    /// Chunks handed out and not yet polled by the owner.
    ready: VecDeque<Delegation>,
    /// Partner side: chunks to write, in arrival order.
    foreign: VecDeque<Foreign>,
    /// Partner side: chunks wholly queued, by the send id of their last
    /// WRITE (a completion at or past it means they are placed).
    acks: VecDeque<(u64, u64, u64)>,
    /// The foreign chunks have a turn in the scheduler.
    scheduled: bool,
    /// Sockets whose home writes wait for its own in flight to drain
    /// (scheduled again at the next send completion).
    throttled: Vec<SocketId>,
}

impl Striping {
    /// The striping of a message of `len` bytes whose last fragment is
    /// `fragment_size` at most.
    pub(super) fn new(len: usize, fragment_size: usize) -> Self {
        let end = len.saturating_sub(fragment_size.max(1));
        Self {
            end,
            next: 0,
            redo: Vec::new(),
            out: 0,
        }
    }

    /// The next range the home writes, at most `most` bytes: a redo first,
    /// then bytes below `end`, then (nothing out any more) the rest up to
    /// `len`. `None`: wait for chunks out.
    pub(super) fn take_own(&mut self, offset: usize, len: usize, most: usize) -> Option<Range> {
        if let Some((start, left)) = self.redo.pop() {
            let take = left.min(most);
            if take < left {
                self.redo.push((start + take, left - take));
            }
            return Some(Range { start, len: take });
        }
        if self.next < self.end {
            let take = (self.end - self.next).min(most);
            let start = self.next;
            self.next += take;
            return Some(Range { start, len: take });
        }
        if self.out > 0 {
            return None;
        }
        // The tail, from where the home's own tail writes got to.
        let start = offset.max(self.end);
        let take = (len - start).min(most);
        Some(Range { start, len: take })
    }

    /// The next chunk for a partner, at most `most` bytes: (offset,
    /// length) below `end`, counted out until its answer.
    pub(super) fn take_chunk(&mut self, most: usize) -> Option<(usize, usize)> {
        if self.next >= self.end {
            return None;
        }
        let offset = self.next;
        let len = (self.end - offset).min(most.max(1));
        self.next += len;
        self.out += 1;
        Some((offset, len))
    }

    /// A chunk's answer: written, or its range to write again.
    pub(super) fn chunk_done(&mut self, offset: usize, len: usize, ok: bool) {
        self.out = self.out.saturating_sub(1);
        if !ok {
            self.redo.push((offset, len));
        }
    }

    /// Whether bytes below `end` are left for the home or a partner to
    /// take (a redo included).
    pub(super) fn has_body_left(&self) -> bool {
        !self.redo.is_empty() || self.next < self.end
    }

    /// Start of the last fragment's range (written by the home alone).
    pub(super) fn end(&self) -> usize {
        self.end
    }

    /// A range taken and not written after all (no room or credit): taken
    /// again first.
    pub(super) fn give_back(&mut self, start: usize, len: usize) {
        if len > 0 {
            self.redo.push((start, len));
        }
    }
}

/// A range of a message for the home to write.
#[derive(Debug, Clone, Copy)]
pub(super) struct Range {
    pub(super) start: usize,
    pub(super) len: usize,
}

/// `len` bytes of `parts` from `offset`, as slices; at most `max_parts`.
pub(super) fn slices(parts: &[Bytes], offset: usize, len: usize, max_parts: usize) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut skip = offset;
    let mut room = len;
    for part in parts {
        if room == 0 || out.len() == max_parts {
            break;
        }
        if skip >= part.len() {
            skip -= part.len();
            continue;
        }
        let take = (part.len() - skip).min(room);
        out.push(part.slice(skip..skip + take));
        room -= take;
        skip = 0;
    }
    out
}

impl Engine {
    /// The rails whose engines to the same peer may write chunks of this
    /// engine's messages (its owner's word, as partners come and go); an
    /// empty list stops striping of new chunks.
    pub fn set_stripe_rails(&mut self, rails: Vec<usize>) {
        let own = self.config.rail;
        self.stripes.rails = rails.into_iter().filter(|&r| r != own).collect();
        self.stripes.rails.sort_unstable();
        self.stripes.rails.dedup();
        let sockets: Vec<SocketId> = self.sockets.keys().copied().collect();
        for socket in sockets {
            self.plan_stripes(socket);
        }
    }

    /// Plans the striping of `socket`'s large messages whose destination
    /// is known and of which nothing is written yet: those large enough
    /// (`stripe.min_bytes`) with the peer's rail keys, while a partner rail
    /// takes chunks. Not only the first: partners write chunks of the next
    /// messages while the home waits for the last ones of the first, so
    /// the links do not idle between messages (the home still finishes
    /// them in order).
    pub(super) fn plan_stripes(&mut self, socket: SocketId) {
        let Some(config) = self.config.stripe else {
            return;
        };
        if self.stripes.rails.is_empty() {
            return;
        }
        let fragment_size = self.fragment_size;
        let Some(tx) = self.sockets.get_mut(&socket) else {
            return;
        };
        let rails = &self.stripes.rails;
        let mut planned = false;
        for transfer in tx.large.iter_mut() {
            if transfer.dest.is_none()
                || transfer.stripe.is_some()
                || transfer.offset > 0
                || transfer.message.len < config.min_bytes.max(1)
                || !rails.iter().any(|&r| r < transfer.rail_keys.len())
            {
                continue;
            }
            transfer.stripe = Some(Striping::new(transfer.message.len, fragment_size));
            planned = true;
        }
        if planned && !self.stripes.work.contains(&socket) {
            self.stripes.work.push_back(socket);
        }
    }

    /// Hands out chunks to partner rails with room (up to `depth` each),
    /// from the striped messages' ranges not yet taken, a socket's first
    /// message first.
    pub(super) fn fill_delegations(&mut self) {
        let Some(config) = self.config.stripe else {
            return;
        };
        let chunk_bytes = config.chunk_bytes.max(1);
        let depth = config.depth.max(1);
        let mut k = 0;
        while let Some(&socket) = self.stripes.work.get(k) {
            if self
                .stripes
                .rails
                .iter()
                .all(|r| self.stripes.out.get(r).is_some_and(|&o| o >= depth))
            {
                return;
            }
            let mut left = false;
            if let Some(tx) = self.sockets.get_mut(&socket) {
                for transfer in tx.large.iter_mut() {
                    let (Some((addr, _)), Some(stripe)) = (transfer.dest, transfer.stripe.as_mut())
                    else {
                        continue;
                    };
                    for &rail in &self.stripes.rails {
                        let Some(&rkey) = transfer.rail_keys.get(rail) else {
                            continue;
                        };
                        let out = self.stripes.out.entry(rail).or_default();
                        while *out < depth {
                            let Some((offset, len)) = stripe.take_chunk(chunk_bytes) else {
                                break;
                            };
                            *out += 1;
                            let token = self.stripes.next_token;
                            self.stripes.next_token += 1;
                            self.stripes.delegated.insert(
                                token,
                                Delegated {
                                    socket,
                                    msg_id: transfer.msg_id,
                                    offset,
                                    len,
                                    rail,
                                },
                            );
                            self.stats.stripe_chunks += 1;
                            self.stripes.ready.push_back(Delegation {
                                rail,
                                token,
                                chunk: StripeChunk {
                                    // Within the destination, whose end
                                    // was checked not to wrap (`receive.rs`).
                                    remote_addr: addr + offset as u64,
                                    rkey,
                                    parts: slices(&transfer.message.parts, offset, len, usize::MAX),
                                    len,
                                },
                            });
                        }
                    }
                    left |= stripe.next < stripe.end;
                }
            }
            if left {
                k += 1;
            } else {
                self.stripes.work.remove(k);
            }
        }
    }

    /// The next chunk to hand to another rail's engine (see the module
    /// docs for the call order).
    pub fn poll_delegation(&mut self) -> Option<Delegation> {
        if self.failed {
            return None;
        }
        self.stripes.ready.pop_front()
    }

    /// The answer for chunk `token`: written (`ok`), or not (the partner
    /// failed or is gone), in which case this engine writes its range
    /// itself and stops handing chunks to that rail until its owner names
    /// it again.
    pub fn handle_stripe_done(&mut self, token: u64, ok: bool) {
        let Some(done) = self.stripes.delegated.remove(&token) else {
            return;
        };
        if let Some(out) = self.stripes.out.get_mut(&done.rail) {
            *out = out.saturating_sub(1);
        }
        if !ok {
            self.stripes.rails.retain(|&r| r != done.rail);
        }
        if self.failed {
            return;
        }
        let Some(transfer) = self
            .sockets
            .get_mut(&done.socket)
            .and_then(|tx| tx.large.iter_mut().find(|t| t.msg_id == done.msg_id))
        else {
            return;
        };
        let Some(stripe) = transfer.stripe.as_mut() else {
            return;
        };
        stripe.chunk_done(done.offset, done.len, ok);
        if !ok {
            self.stats.stripe_redone += 1;
        }
        // The home may finish it now (or write the range again); a
        // partner with room takes the next chunk.
        self.schedule(done.socket);
        if !self.stripes.work.contains(&done.socket) {
            self.stripes.work.push_back(done.socket);
        }
    }
}

mod partner;

impl Engine {
    /// Striping's bookkeeping, for tests that check it drains: chunks
    /// handed out and not answered (by token, and as the rails' counts
    /// sum them), chunks not yet polled by the owner, and other engines'
    /// chunks held here (queued, or written and waiting for completion).
    #[cfg(test)]
    pub(crate) fn stripe_counts(&self) -> [usize; 4] {
        [
            self.stripes.delegated.len(),
            self.stripes.out.values().sum(),
            self.stripes.ready.len(),
            self.stripes.foreign.len() + self.stripes.acks.len(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        /// The home takes a range of at most this many bytes.
        Home(usize),
        /// A partner takes a chunk of at most this many bytes.
        Chunk(usize),
        /// The chunk out at this index (modulo) is answered.
        Answer(usize, bool),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1usize..200_000).prop_map(Step::Home),
            (1usize..300_000).prop_map(Step::Chunk),
            (any::<usize>(), prop::bool::weighted(0.8)).prop_map(|(i, ok)| Step::Answer(i, ok)),
        ]
    }

    /// One turn of the home: takes a range of at most `most` bytes and
    /// writes it; whether that was the last fragment (`None`: it waits).
    fn home(
        stripe: &mut Striping,
        len: usize,
        offset: &mut usize,
        out: &[(usize, usize)],
        written: &mut [bool],
        most: usize,
    ) -> Option<bool> {
        let range = stripe.take_own(*offset, len, most)?;
        let tail = range.start >= stripe.end();
        if tail {
            assert!(out.is_empty(), "the tail went with chunks out");
            *offset = range.start + range.len;
        }
        for b in &mut written[range.start..range.start + range.len] {
            *b = true;
        }
        let last = tail && range.start + range.len == len;
        if last {
            assert!(
                written.iter().all(|&w| w),
                "the last fragment before every byte was written"
            );
        }
        Some(last)
    }

    proptest! {
        /// Whatever the order of the home's takes, the partners' chunks and
        /// their answers (failures included): every byte is written by
        /// someone whose write stood (a chunk answered ok, or the home),
        /// the last fragment goes only with no chunk out and after every
        /// other byte, and it is the only write reaching the end.
        #[test]
        fn every_byte_is_written_and_the_last_fragment_goes_last(
            len in 1usize..3_000_000,
            fragment in 1024usize..200_000,
            steps in proptest::collection::vec(step(), 0..200),
        ) {
            let mut stripe = Striping::new(len, fragment);
            let mut offset = 0usize;
            let mut written = vec![false; len];
            let mut out: Vec<(usize, usize)> = Vec::new();
            let mut finished = false;
            for step in steps {
                if finished {
                    break;
                }
                match step {
                    Step::Home(most) => {
                        finished = home(&mut stripe, len, &mut offset, &out, &mut written, most) == Some(true);
                    }
                    Step::Chunk(most) => {
                        if let Some(chunk) = stripe.take_chunk(most) {
                            prop_assert!(chunk.0 + chunk.1 <= stripe.end());
                            out.push(chunk);
                        }
                    }
                    Step::Answer(i, ok) => {
                        if !out.is_empty() {
                            let (start, n) = out.remove(i % out.len());
                            if ok {
                                for b in &mut written[start..start + n] {
                                    *b = true;
                                }
                            }
                            stripe.chunk_done(start, n, ok);
                        }
                    }
                }
            }
            // Then every chunk is answered and the home runs to the end.
            for (start, n) in std::mem::take(&mut out) {
                for b in &mut written[start..start + n] {
                    *b = true;
                }
                stripe.chunk_done(start, n, true);
            }
            let mut turns = 0;
            while !finished {
                finished = home(&mut stripe, len, &mut offset, &out, &mut written, fragment) == Some(true);
                turns += 1;
                prop_assert!(turns < 10_000, "the home never finished");
            }
            prop_assert!(written.iter().all(|&w| w));
        }
    }
}
