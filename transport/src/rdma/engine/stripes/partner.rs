//! The partner side of striping: chunks of other engines' messages handed
//! in ([`Engine::handle_stripe_writes`]), written as one more turn-taker
//! of the scheduler, and answered ([`EngineEvent::StripeDone`]) once
//! placed, or, after a failure, once none of their writes can still be
//! carried out ([`Engine::settle_stripes`]).

#[allow(clippy::wildcard_imports)]
use super::super::*;
use super::{Foreign, STRIPES, StripeChunk, slices};

impl Engine {
    /// Chunk `token` of engine `origin` (the owner's name for it) to write
    /// on this engine's queue pair; answered with
    /// [`EngineEvent::StripeDone`] once its writes completed, or at once
    /// (`ok = false`) by a failed engine.
    pub fn handle_stripe_writes(&mut self, origin: u64, token: u64, chunk: StripeChunk) {
        if self.failed {
            self.events.push_back(EngineEvent::StripeDone {
                origin,
                token,
                ok: false,
            });
            return;
        }
        self.stripes.foreign.push_back(Foreign {
            origin,
            token,
            chunk,
            offset: 0,
        });
        if !self.stripes.scheduled {
            self.stripes.scheduled = true;
            self.active.push_back(STRIPES);
        }
    }

    /// Engine `origin` failed: its chunks not yet queued here are dropped
    /// (no one waits for them).
    pub fn cancel_stripes(&mut self, origin: u64) {
        self.stripes.foreign.retain(|f| f.origin != origin);
    }

    /// Once this engine's queue pair is destroyed (no write of it can be
    /// carried out any more): the chunks of other engines it had and did
    /// not answer yet, (origin, token) each, to be answered `ok = false`
    /// (their origins write them again). Also for an engine that panicked,
    /// whatever state the panic left.
    pub fn take_abandoned_stripes(&mut self) -> Vec<(u64, u64)> {
        let mut abandoned: Vec<(u64, u64)> = self
            .stripes
            .acks
            .drain(..)
            .map(|(_, origin, token)| (origin, token))
            .collect();
        abandoned.extend(self.stripes.foreign.drain(..).map(|f| (f.origin, f.token)));
        abandoned
    }

    /// A failed engine's answers for other engines' chunks (issue 57,
    /// hole 8). Answering one "not written" lets its origin write the
    /// range again and finish the message, after which the receiver hands
    /// the buffer on: so it goes only once no write of the chunk can still
    /// land. A work request's completion, success or flush, is the queue
    /// pair's word that the NIC is done with it (a QP in error flushes
    /// every request, signalled or not, and the ring signals the last of
    /// each batch), so:
    ///
    /// - a chunk with nothing posted is answered at once (`completed`
    ///   `None`, at the failure);
    /// - a chunk whose last write is retired by completion `completed`
    ///   `(id, placed)` is answered `placed` (a success after the failure
    ///   still placed every write up to it, in order);
    /// - once nothing posted is left in flight, the rest (a chunk partly
    ///   posted, its last write never posted) is answered not written.
    ///
    /// What is still unanswered when the owner destroys the queue pair
    /// goes with [`Engine::take_abandoned_stripes`]. Before, every chunk
    /// was answered as soon as the queue pair was moved to error, while
    /// the NIC could still be carrying out its writes.
    pub(in crate::rdma::engine) fn settle_stripes(&mut self, completed: Option<(u64, bool)>) {
        if let Some((wr_id, placed)) = completed {
            while let Some(&(id, origin, token)) = self.stripes.acks.front() {
                if id > wr_id {
                    break;
                }
                self.stripes.acks.pop_front();
                self.events.push_back(EngineEvent::StripeDone {
                    origin,
                    token,
                    ok: placed,
                });
            }
        }
        let idle = self.ring.in_flight() == 0;
        let mut kept = VecDeque::new();
        for chunk in self.stripes.foreign.drain(..) {
            if chunk.offset == 0 || idle {
                self.events.push_back(EngineEvent::StripeDone {
                    origin: chunk.origin,
                    token: chunk.token,
                    ok: false,
                });
            } else {
                kept.push_back(chunk);
            }
        }
        self.stripes.foreign = kept;
        if idle {
            for (_, origin, token) in self.stripes.acks.drain(..) {
                self.events.push_back(EngineEvent::StripeDone {
                    origin,
                    token,
                    ok: false,
                });
            }
        }
    }

    /// The foreign chunks' turn: one WRITE of the first chunk.
    pub(in crate::rdma::engine) fn stripe_turn(&mut self) -> Result<Turn, EngineError> {
        let max_sge = self.config.max_sge as usize;
        let rail = self.config.rail;
        let Some(front) = self.stripes.foreign.front() else {
            return Ok(Turn::Done);
        };
        let room = self.fragment_size.min(front.chunk.len - front.offset);
        let parts = slices(&front.chunk.parts, front.offset, room, max_sge);
        let sges: Option<Vec<Sge>> = parts.iter().map(|p| Self::sge(p, rail)).collect();
        let Some(sges) = sges else {
            // Not in memory this rail registered: its origin writes it.
            if let Some(front) = self.stripes.foreign.pop_front() {
                self.events.push_back(EngineEvent::StripeDone {
                    origin: front.origin,
                    token: front.token,
                    ok: false,
                });
            }
            return Ok(Turn::Fragment);
        };
        let length: usize = sges.iter().map(|s| s.len as usize).sum();
        if !self.window.admit(length) {
            return Ok(Turn::NoWindow);
        }
        let Some(front) = self.stripes.foreign.front_mut() else {
            return Ok(Turn::Done);
        };
        let op = SendOp::Write {
            remote_addr: front.chunk.remote_addr as usize + front.offset,
            rkey: front.chunk.rkey,
        };
        front.offset += length;
        let whole = front.offset >= front.chunk.len || length == 0;
        self.window.add(length);
        let id = self.ring.push(RingEntry {
            wr: SendWr {
                wr_id: 0,
                op,
                sges,
                signaled: false,
            },
            keep: parts,
            bytes: length,
        });
        self.stats.striped_bytes += length as u64;
        if whole && let Some(done) = self.stripes.foreign.pop_front() {
            self.stripes.acks.push_back((id, done.origin, done.token));
        }
        Ok(Turn::Fragment)
    }

    /// `socket`'s home writes wait for its writes in flight to complete.
    pub(in crate::rdma::engine) fn stripes_throttled(&mut self, socket: SocketId) {
        if !self.stripes.throttled.contains(&socket) {
            self.stripes.throttled.push(socket);
        }
    }

    /// The foreign chunks lost their turn (nothing left, or blocked).
    pub(in crate::rdma::engine) fn stripes_unscheduled(&mut self) {
        self.stripes.scheduled = false;
    }

    /// Send requests up to `wr_id` completed: the foreign chunks whose last
    /// WRITE was among them are placed.
    pub(in crate::rdma::engine) fn ack_stripes(&mut self, wr_id: u64) {
        for socket in std::mem::take(&mut self.stripes.throttled) {
            self.schedule(socket);
        }
        while let Some(&(id, origin, token)) = self.stripes.acks.front() {
            if id > wr_id {
                break;
            }
            self.stripes.acks.pop_front();
            self.events.push_back(EngineEvent::StripeDone {
                origin,
                token,
                ok: true,
            });
        }
    }

    /// Nothing of other engines' chunks queued or unacknowledged.
    pub(in crate::rdma::engine) fn stripes_idle(&self) -> bool {
        self.stripes.foreign.is_empty() && self.stripes.acks.is_empty()
    }
}
