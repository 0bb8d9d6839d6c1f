//! Remote-write confinement: each grant of an engine is exposed to the
//! peer through a type-2 memory window of its own (issue 16, item 6).
//!
//! Without it, the receive pool's blocks are registered remotely writable
//! in one protection domain and a CTS hands out the block's rkey: a peer
//! given one destination could write anywhere in that 4 MiB block (other
//! connections' receive buffers, other peers' keepalive slots), and into a
//! cached dedicated region after it was freed and handed to someone else.
//!
//! **Mechanism: type-2 memory windows bound per transfer.** The receive
//! pool is registered with [`crate::pool::Access::Windows`]: local writes
//! and window binding, no remote access of its own. Each engine holds a
//! few windows (`rdma.windows_per_connection`). A grant binds a free one,
//! on the engine's own queue pair, to exactly the destination's bytes,
//! under a fresh key ([`crate::verbs::MemoryWindow::next_rkey`]), and the
//! CTS carries that key; the bind is posted before the CTS on the same send
//! queue, so it has taken effect before the peer can learn the key. When
//! the message's WRITE_WITH_IMM arrives, the engine posts the window's
//! invalidation and hands the message on only once that has completed:
//! from then on the key is dead, so a peer can neither write outside its
//! grant nor change a message after the application has it. The keepalive
//! slot gets a window of its own, bound once, its key sent in a `Slot`
//! control message behind the bind (not in the handshake's hello, which
//! travels before the queue pair can post a bind).
//!
//! The alternatives were weaker or dearer: per-peer protection domains
//! still let a peer write into its own other buffers and need a pool per
//! peer; separate remotely writable blocks per connection cost a pool per
//! connection too; registering each destination on its own puts a memory
//! registration (pinning, milliseconds on real NICs) on every large
//! message, which the pool exists to avoid. A window costs a bind and an
//! invalidation per large message (two work requests that move no data;
//! the transport benchmark's confinement rows measure them).
//!
//! Type-2 windows are bound to a queue pair, so a key is useless on any
//! other connection; the soft NIC models exactly that (a write through a
//! window bound elsewhere, outside it, or after its invalidation is a
//! remote access error).

use std::collections::HashMap;
use std::sync::Arc;

use crate::pool::PoolBuf;
use crate::verbs::{MemoryWindow, SendOp};

/// Why a window could not be bound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WindowError {
    /// The buffer is not in registered memory.
    #[error("a grant's buffer is not registered memory")]
    Unregistered,
}

/// The memory windows of one engine: free ones, and those bound to a grant
/// (by message id) or to the keepalive slot.
#[derive(Debug, Default)]
pub struct Windows {
    free: Vec<Bound>,
    granted: HashMap<u32, Bound>,
    keepalive: Option<Bound>,
    /// The rail the windows' QP is on: binds name that rail's
    /// registration of the buffer.
    rail: usize,
}

/// A window and the key of its latest binding.
#[derive(Debug)]
struct Bound {
    window: Arc<dyn MemoryWindow>,
    rkey: u32,
}

impl Windows {
    /// The engine's windows (none: confinement off), on a QP of rail
    /// `rail`.
    pub fn new(windows: Vec<Arc<dyn MemoryWindow>>, rail: usize) -> Self {
        Self {
            free: windows
                .into_iter()
                .map(|window| Bound {
                    rkey: window.rkey(),
                    window,
                })
                .collect(),
            granted: HashMap::new(),
            keepalive: None,
            rail,
        }
    }

    /// Whether grants go through windows.
    pub fn enabled(&self) -> bool {
        !self.free.is_empty() || !self.granted.is_empty() || self.keepalive.is_some()
    }

    /// Windows free for another grant.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Windows for grants, free or bound.
    pub fn count(&self) -> usize {
        self.free.len() + self.granted.len()
    }

    /// Binds a free window to all of `buf` for message `msg_id`: the
    /// bind's operation (to post before anything that tells the peer its
    /// key) and the key. `None` when no window is free.
    pub fn bind_grant(
        &mut self,
        msg_id: u32,
        buf: &PoolBuf,
    ) -> Option<Result<(SendOp, u32), WindowError>> {
        self.bind_free(buf, |windows, bound| {
            windows.granted.insert(msg_id, bound);
        })
    }

    /// Binds a free window to the keepalive slot `slot` for good.
    pub fn bind_keepalive(&mut self, slot: &PoolBuf) -> Option<Result<(SendOp, u32), WindowError>> {
        self.bind_free(slot, |windows, bound| windows.keepalive = Some(bound))
    }

    /// Binds a free window to `buf` and hands it to `keep`.
    fn bind_free(
        &mut self,
        buf: &PoolBuf,
        keep: impl FnOnce(&mut Self, Bound),
    ) -> Option<Result<(SendOp, u32), WindowError>> {
        let mut bound = self.free.pop()?;
        match bind(&mut bound, buf, self.rail) {
            Ok(bind) => {
                let rkey = bound.rkey;
                keep(self, bound);
                Some(Ok((bind, rkey)))
            }
            Err(err) => {
                self.free.push(bound);
                Some(Err(err))
            }
        }
    }

    /// Message `msg_id` arrived: the invalidation of its window, to post
    /// before the message is handed on. The window is free again at once:
    /// its next bind is posted after the invalidation on the same queue.
    pub fn release_grant(&mut self, msg_id: u32) -> Option<SendOp> {
        let bound = self.granted.remove(&msg_id)?;
        let invalidate = SendOp::Invalidate { rkey: bound.rkey };
        self.free.push(bound);
        Some(invalidate)
    }
}

#[cfg(test)]
impl Windows {
    /// The key of message `msg_id`'s window.
    pub(crate) fn rkey_of(&self, msg_id: u32) -> Option<u32> {
        self.granted.get(&msg_id).map(|b| b.rkey)
    }
}

/// The operation binding `bound` to `buf` under its next key.
fn bind(bound: &mut Bound, buf: &PoolBuf, rail: usize) -> Result<SendOp, WindowError> {
    let region = buf.region_on(rail).ok_or(WindowError::Unregistered)?;
    let rkey = bound.window.next_rkey(bound.rkey);
    bound.rkey = rkey;
    Ok(SendOp::BindWindow {
        window: bound.window.handle(),
        rkey,
        addr: buf.as_ptr() as usize,
        len: buf.len(),
        lkey: region.lkey,
        region: region.handle,
    })
}
