//! A driver's shared receive queue (§6.2.2) and the buffers posted on it.

use std::sync::Arc;

use crate::TransportError;
use crate::pool::{Pool, PoolBuf};
use crate::rdma::engine::recv_wr;
use crate::verbs::SharedReceiveQueue;

/// An I/O thread's shared receive queue and the buffers posted on it.
pub(crate) struct SharedReceives {
    pub(super) srq: Arc<dyn SharedReceiveQueue>,
    pool: Pool,
    buffer: usize,
    /// Buffer of each posted receive, by `wr_id`.
    slots: Vec<Option<PoolBuf>>,
    /// Slots whose receive was consumed, to post again.
    free: Vec<usize>,
    /// The rail (device) of the queue: its buffers' keys are that rail's.
    rail: usize,
}

impl SharedReceives {
    /// A queue of `depth` receives of `buffer` bytes from `pool`, posted,
    /// on a device of rail `rail`.
    pub(crate) fn new(
        srq: Arc<dyn SharedReceiveQueue>,
        pool: Pool,
        buffer: usize,
        depth: u32,
        rail: usize,
    ) -> Result<Self, TransportError> {
        let mut this = Self {
            srq,
            pool,
            buffer,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth as usize).collect(),
            rail,
        };
        this.repost()?;
        Ok(this)
    }

    /// Posts a fresh buffer in every free slot, with one doorbell.
    pub(super) fn repost(&mut self) -> Result<(), TransportError> {
        if self.free.is_empty() {
            return Ok(());
        }
        let mut wrs = Vec::with_capacity(self.free.len());
        while let Some(slot) = self.free.pop() {
            let mut buf = match self.pool.alloc(self.buffer) {
                Ok(buf) => buf,
                Err(err) => {
                    // Try again next time; post what was allocated.
                    self.free.push(slot);
                    tracing::warn!(%err, "no memory for shared receives");
                    break;
                }
            };
            buf.set_len(self.buffer);
            let wr = recv_wr(crate::rdma::wr_id::shared_recv(slot), &buf, self.rail).ok_or(
                TransportError::rdma_error(crate::RdmaError::BufferOutsidePool),
            )?;
            wrs.push(wr);
            self.slots[slot] = Some(buf);
        }
        if wrs.is_empty() {
            return Ok(());
        }
        match self.srq.post_recv(&wrs) {
            Ok(()) => Ok(()),
            Err(err) => {
                // What did not go up is not the NIC's: its slots are free
                // again (the next round tries them anew), its buffers go
                // back to the pool.
                // A post that says how far it got frees the rest; any other
                // error posted nothing (it was refused before the list).
                let posted = match err {
                    crate::verbs::VerbsError::PostFailed { posted, .. } => posted as usize,
                    _ => 0,
                };
                for wr in &wrs[posted.min(wrs.len())..] {
                    let crate::rdma::wr_id::WrKind::SharedRecv(slot) =
                        crate::rdma::wr_id::classify(wr.wr_id)
                    else {
                        continue;
                    };
                    if let Some(buf) = self.slots.get_mut(slot) {
                        drop(buf.take());
                        self.free.push(slot);
                    }
                }
                Err(TransportError::rdma_error(err))
            }
        }
    }

    /// The buffer the receive in `slot` landed in, or failed with (the
    /// slot is reposted).
    pub(super) fn take(&mut self, slot: usize) -> Option<PoolBuf> {
        let buf = self.slots.get_mut(slot)?.take()?;
        self.free.push(slot);
        Some(buf)
    }

    /// Receives posted on the queue now.
    pub(super) fn posted(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}
