//! The soft provider's shared receive queue ([`SoftSrq`]): one receive
//! ring in shared memory that the peers of every QP created on it take
//! receives from.

use crate::sync::LockExt;
use std::sync::{Arc, Mutex};

use super::rings::QpSegment;
use crate::verbs::{RecvWr, SharedReceiveQueue, VerbsError};

/// A soft shared receive queue: a receive ring in shared memory that the
/// peers of every QP created on it take receives from.
#[derive(Debug)]
pub struct SoftSrq {
    pub(crate) id: u32,
    pub(crate) segment: Arc<QpSegment>,
    depth: u32,
    /// One poster at a time (the ring has one producer).
    poster: Mutex<()>,
}

impl SoftSrq {
    pub(crate) fn new(id: u32, depth: u32) -> Result<Self, VerbsError> {
        let segment = QpSegment::create(depth, 0, 0)
            .map_err(|e| VerbsError::NoDevice(format!("soft NIC shared memory: {e}")))?;
        Ok(Self {
            id,
            segment: Arc::new(segment),
            depth,
            poster: Mutex::new(()),
        })
    }

    /// Receives posted and not yet consumed.
    pub fn posted(&self) -> usize {
        self.segment.posted()
    }
}

impl SharedReceiveQueue for SoftSrq {
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), VerbsError> {
        let _one = self.poster.locked();
        let posted = self.segment.posted();
        let full = |posted: usize| VerbsError::QueueFull {
            queue: "srq",
            posted: u32::try_from(posted).unwrap_or(u32::MAX),
            depth: self.depth,
        };
        if posted + wrs.len() > self.depth as usize {
            return Err(full(posted + wrs.len()));
        }
        for wr in wrs {
            if !self.segment.push_recv(wr) {
                return Err(full(posted + wrs.len()));
            }
        }
        Ok(())
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}
