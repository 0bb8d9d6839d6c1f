//! The engine's configuration, its peer's settings, and what it reports:
//! errors, events and counters.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Settings of an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Send queue depth (the ring's size). Default 32 (the paper's).
    pub send_queue_depth: u32,
    /// Receive queue depth d; credits are returned in batches of d/2.
    /// Default 64.
    pub recv_queue_depth: u32,
    /// Largest message sent by SEND; larger ones use RTS/CTS and WRITEs.
    /// Default 8 KiB.
    pub small_message_limit: usize,
    /// Largest WRITE fragment S. Default 64 KiB.
    pub fragment_size: usize,
    /// Scatter/gather entries per work request. Default 4.
    pub max_sge: u32,
    /// Largest message accepted from the peer. Default 64 MiB.
    pub max_message_size: u64,
    /// The send window. Default off.
    pub window: WindowConfig,
    /// Keepalive; `None` turns it off. Default off (the transport turns it
    /// on from its config).
    pub keepalive: Option<KeepaliveConfig>,
    /// Large messages per socket whose destination is asked for ahead of
    /// writing. Default 4.
    pub rts_ahead: usize,
    /// Receives come from a shared receive queue the owner runs (handed in
    /// with [`Engine::handle_shared_receive`]); the engine posts none and
    /// returns no credits. Default false.
    pub shared_receives: bool,
    /// Bytes of large messages the peer may have been granted (CTS sent,
    /// last WRITE not yet completed) at once. An RTS beyond waits, ungranted
    /// and unallocated, until earlier ones complete (the peer's socket
    /// waits for its CTS: backpressure, as TCP's flow control is); the
    /// waiting RTS are bounded by [`MAX_WAITING_RTS`], past which the
    /// engine fails. Default 256 MiB (`inbound.max_connection_bytes`); at
    /// least `max_message_size`, so every message can be granted alone.
    pub max_granted_bytes: u64,
    /// Offers (`engine/offers.rs`): after a large message of a socket, give
    /// the peer a destination for the next one, and use the peer's offers,
    /// so that large messages after the first on a socket go without the
    /// RTS/CTS round trip. Default on; off in tests of the RTS path.
    pub offers: bool,
    /// The rail (device) the engine's queue pair is on: its buffers' keys
    /// are that rail's registrations (`PoolBuf::region_on`). Default 0,
    /// the primary.
    pub rail: usize,
    /// Rails of the transport (devices the pools are registered on). With
    /// more than one, striping on and no confinement, grants and offers
    /// tell the destination's key on each (`control.rs`, rail keys).
    /// Default 1.
    pub rails: usize,
    /// Striping of large messages over the queue pairs of other rails to
    /// the same peer (`stripes.rs`); `None`: off. Default off.
    pub stripe: Option<StripeConfig>,
    /// How long grants may stand unwritten: while a destination granted by
    /// CTS is out and no large message has arrived for this long, the
    /// engine fails with [`EngineError::GrantTimeout`] (`grants.rs`).
    /// `None`: never. Default `None` (the transport sets it from
    /// `rdma.grant_timeout_ms`).
    pub grant_timeout: Option<Duration>,
}

/// How large messages are striped over rails (`stripes.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripeConfig {
    /// Smallest message striped: below it, the hop to another rail's I/O
    /// driver and back costs more than the bytes it moves. Default 256 KiB.
    pub min_bytes: usize,
    /// Bytes of each chunk handed to another rail. Default 128 KiB: a
    /// 1 MiB message gives each of 4 rails about two.
    pub chunk_bytes: usize,
    /// Chunks each other rail has at once: 2, so that a rail always has
    /// the next while the last completes, and a slow rail takes fewer.
    pub depth: usize,
}

impl Default for StripeConfig {
    fn default() -> Self {
        Self {
            min_bytes: 256 << 10,
            chunk_bytes: 128 << 10,
            depth: 2,
        }
    }
}

/// Requests to send an engine keeps waiting for budget before it fails:
/// more than any well-behaved peer has outstanding (each socket asks at
/// most `rts_ahead` ahead), few enough that a hostile one costs little
/// memory (16 bytes each).
pub const MAX_WAITING_RTS: usize = 16_384;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            send_queue_depth: 32,
            recv_queue_depth: 64,
            small_message_limit: 8 << 10,
            fragment_size: 64 << 10,
            max_sge: 4,
            max_message_size: 64 << 20,
            window: WindowConfig::default(),
            keepalive: None,
            rts_ahead: 4,
            shared_receives: false,
            max_granted_bytes: 256 << 20,
            offers: true,
            rail: 0,
            rails: 1,
            stripe: None,
            grant_timeout: None,
        }
    }
}

/// Which end of the connection an engine is (socket ids of the acceptor
/// have the high bit set, so both ends may open sockets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Dialed the connection.
    Dialer,
    /// Accepted it.
    Acceptor,
}

/// What the peer told at connection setup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// Receives it has posted (the initial credits).
    pub recv_depth: u32,
    /// Bytes of each of its receive buffers.
    pub recv_buffer: u32,
    /// Its keepalive slot (address, rkey), if it runs keepalive.
    pub keepalive_slot: Option<(u64, u32)>,
    /// Its receives come from a shared receive queue (no credits).
    pub shared_receives: bool,
}

/// Why an engine stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A work request failed; the queue pair is in error.
    #[error("work request failed: {status:?} (vendor error {vendor_err:#x})")]
    Completion {
        /// How it ended.
        status: WcStatus,
        /// The provider's code for it.
        vendor_err: u32,
    },
    /// The peer broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(#[source] Violation),
    /// No pool memory.
    #[error("no buffer memory: {0}")]
    Memory(#[from] crate::pool::PoolError),
    /// A buffer the NIC must reach is not registered memory (`what`).
    #[error("{0} is not in registered memory")]
    Unregistered(&'static str),
    /// The engine has failed already (an operation after its failure).
    #[error("the engine has failed")]
    Failed,
    /// A message to send is larger than the limit.
    #[error("message of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Its size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The socket is not open (never opened, or closed by either end).
    #[error("socket {0:#x} is not open")]
    SocketClosed(SocketId),
    /// The peer's keepalive stopped.
    #[error("peer dead: no keepalive for {0:?}")]
    PeerDead(Duration),
    /// The peer closed its handshake connection (it went away).
    #[error("peer closed the connection")]
    PeerClosed,
    /// The device reported an event that ends this engine's QP
    /// ([`Engine::handle_device_event`]).
    #[error("the device reported {0:?}")]
    Device(crate::verbs::AsyncEvent),
    /// Closed by its owner: no socket is left on it, and it is not shared
    /// ([`Engine::handle_unused`]). Not a failure.
    #[error("closed: no socket left on it")]
    Unused,
    /// Posting work requests failed ([`Engine::handle_post_error`]).
    #[error("posting to the queue pair failed: {0}")]
    Post(crate::verbs::VerbsError),
    /// The peer left its grants unwritten for the grant timeout: it took
    /// destinations and wrote none of them (`grants.rs`).
    #[error("the peer wrote none of its {grants} grants for {waited:?}")]
    GrantTimeout {
        /// How long no grant was written.
        waited: Duration,
        /// Grants it held.
        grants: usize,
    },
    /// The engine's code panicked (a bug); the I/O thread failed it alone.
    #[error("the engine panicked (a bug); this connection is failed, the others are not")]
    Panicked,
}

/// What the engine has for its owner.
#[derive(Debug)]
pub enum EngineEvent {
    /// The peer opened a socket: answer with [`Engine::accept_socket`] or
    /// [`Engine::refuse_socket`].
    Opened(SocketId),
    /// The peer accepted a socket this end opened: it may carry messages.
    Accepted(SocketId),
    /// The peer refused a socket this end opened (nobody listens).
    Refused(SocketId),
    /// A whole message arrived on a socket (in receive-pool memory).
    Message {
        /// The socket.
        socket: SocketId,
        /// The message.
        bytes: Bytes,
    },
    /// The peer closed its half of a socket (after its last message).
    Closed(SocketId),
    /// A message of the socket is wholly on its way (its last fragment
    /// queued for posting): room for one more in the socket's send queue.
    Sent(SocketId),
    /// A chunk another engine handed this one to write
    /// ([`Engine::handle_stripe_writes`]) is written (`ok`: its writes
    /// completed) or abandoned: tell its origin
    /// ([`Engine::handle_stripe_done`] there).
    StripeDone {
        /// The origin engine, as the owner named it.
        origin: u64,
        /// The origin's token for the chunk.
        token: u64,
        /// Written and completed (else the origin writes it itself).
        ok: bool,
    },
    /// The engine failed; nothing more will happen on it.
    Failed(EngineError),
}

/// Counters of an engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Messages sent by SEND.
    pub small_sent: u64,
    /// Messages sent by WRITEs.
    pub large_sent: u64,
    /// Messages received.
    pub received: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Times sending waited for credits.
    pub credit_stalls: u64,
    /// Times sending waited for room in the send window.
    pub window_stalls: u64,
    /// Most bytes posted and not yet completed at once.
    pub peak_in_flight_bytes: u64,
    /// Message parts copied into the send pool because they were not in
    /// memory registered with this engine's device.
    pub fallback_copies: u64,
    /// Explicit credit-return messages sent.
    pub credit_messages: u64,
    /// Keepalive writes sent.
    pub keepalives_sent: u64,
    /// Messages dropped because their socket was closed.
    pub orphan_messages: u64,
    /// Destinations offered to the peer (`engine/offers.rs`).
    pub offers_made: u64,
    /// Messages that arrived in a destination offered.
    pub offers_used: u64,
    /// Messages sent to a destination the peer offered (no RTS).
    pub offered_sends: u64,
    /// Chunks of this engine's messages handed to other rails.
    pub stripe_chunks: u64,
    /// Of those, chunks the other rail did not write (it failed), which
    /// this engine wrote itself.
    pub stripe_redone: u64,
    /// Bytes this engine wrote for other engines' messages (chunks handed
    /// to it).
    pub striped_bytes: u64,
}

/// How a peer (or its NIC) broke the engine's protocol
/// ([`EngineError::Protocol`]): each fails the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// A WRITE with immediate named a message that was never granted.
    #[error("write with immediate for unknown message {0}")]
    UnknownMessage(u32),
    /// A completion claimed more bytes than its receive buffer holds.
    #[error("a receive of {len} bytes into a buffer of {buffer}")]
    ReceiveTooLong {
        /// Bytes the completion claimed.
        len: usize,
        /// The buffer's size.
        buffer: usize,
    },
    /// A control header did not parse.
    #[error(transparent)]
    Header(#[from] crate::rdma::control::ControlError),
    /// A request to send more than `max_message_size`.
    #[error("peer wants to send {size} bytes, above the limit of {max}")]
    TooLarge {
        /// The size asked for.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A request to send a message already granted or waiting.
    #[error("request to send message {0} again while it is granted")]
    RequestAgain(u32),
    /// More requests to send than may wait for budget.
    #[error("{0} requests to send wait for budget; the peer sends more")]
    TooManyRequests(usize),
    /// Clear to send for a message this side never asked about.
    #[error("clear to send for unknown message {0}")]
    UnknownClearToSend(u32),
    /// The peer opened a socket number that is this side's to open, or
    /// one already open.
    #[error("peer opened socket {0:#x}, which is not its to open")]
    NotItsSocket(u32),
    /// A shared receive completed with no buffer posted for it.
    #[error("a shared receive came without its buffer")]
    SharedReceiveWithoutBuffer,
    /// A receive of the engine's own on an engine that uses shared
    /// receives.
    #[error("a receive of its own on an engine with shared receives")]
    OwnReceiveWithSharedReceives,
    /// A completion for a receive slot with nothing posted.
    #[error("completion for unknown receive {0}")]
    UnknownReceive(usize),
    /// An offered message's length prefix claims more than the offer.
    #[error("an offered message of {len} bytes in an offer of {room}")]
    OfferOverrun {
        /// Bytes the prefix claims.
        len: u64,
        /// Bytes the offer holds after the prefix.
        room: u64,
    },
    /// An `Offer` whose id lies outside the offers' range.
    #[error("offer with id {0:#x}, outside the offers' range")]
    NotAnOffer(u32),
    /// A request to send whose id lies in the offers' range.
    #[error("request to send with id {0:#x}, in the offers' range")]
    MessageIdInOfferRange(u32),
    /// A second offer for a socket whose first one is unused.
    #[error("a second offer for socket {0:#x} while one is unused")]
    OfferAgain(u32),
    /// An `Offer` too short to carry its size.
    #[error("an offer of {0} bytes, too short for its size")]
    ShortOffer(usize),
    /// A destination (a CTS's or an `Offer`'s) whose last byte lies past
    /// the end of the address space: `addr + len` wraps.
    #[error("a destination of {len} bytes at {addr:#x} wraps past the address space")]
    AddressOverflow {
        /// The address the peer told.
        addr: u64,
        /// The bytes to be written there.
        len: u64,
    },
}
