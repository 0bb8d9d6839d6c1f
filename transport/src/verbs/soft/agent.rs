//! How soft NICs in different processes of one host reach each other's
//! shared memory: each process runs an agent on an abstract unix socket
//! named after its pid, which hands out memfds (SCM_RIGHTS) of its
//! devices' region tables, registered regions, QP segments and completion
//! rings. A peer maps them and from then on reads and writes them directly;
//! the agent takes no part in the data path.
//!
//! `nix` provides `sendmsg`/`recvmsg` with typed control messages, which
//! keeps the cmsg buffer arithmetic out of this crate.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

use super::device::FabricInner;

/// What a peer asks an agent for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request {
    /// A device's region table (and shared counters).
    Table,
    /// One registered region's memory.
    Region(u32),
    /// A QP's segment.
    Qp(u32),
    /// A completion queue's ring.
    Cq(u32),
    /// A shared receive queue's ring.
    Srq(u32),
    /// A completion queue's eventfd (to wake an owner sleeping on it).
    CqEvent(u32),
}

impl Request {
    fn encode(self, node: u64) -> [u8; 16] {
        let (op, id) = match self {
            Request::Table => (1u32, 0u32),
            Request::Region(key) => (2, key),
            Request::Qp(qpn) => (3, qpn),
            Request::Cq(id) => (4, id),
            Request::Srq(id) => (5, id),
            Request::CqEvent(id) => (6, id),
        };
        let mut out = [0u8; 16];
        out[0..4].copy_from_slice(&op.to_le_bytes());
        out[4..8].copy_from_slice(&id.to_le_bytes());
        out[8..16].copy_from_slice(&node.to_le_bytes());
        out
    }

    fn decode(raw: &[u8; 16]) -> Option<(Self, u64)> {
        let op = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
        let id = u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]);
        let mut node = [0u8; 8];
        node.copy_from_slice(&raw[8..16]);
        let request = match op {
            1 => Request::Table,
            2 => Request::Region(id),
            3 => Request::Qp(id),
            4 => Request::Cq(id),
            5 => Request::Srq(id),
            6 => Request::CqEvent(id),
            _ => return None,
        };
        Some((request, u64::from_le_bytes(node)))
    }
}

/// An agent's answer: the memfd, and for a region its base address (in the
/// owner's address space) and length.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) fd: OwnedFd,
    pub(crate) base: u64,
    pub(crate) len: u64,
}

/// The process that owns `node` (node ids carry the pid in their high half).
pub(crate) fn node_pid(node: u64) -> u32 {
    (node >> 32) as u32
}

fn socket_name(pid: u32) -> String {
    format!("tessera-soft-{pid}")
}

/// Starts this process's agent for `fabric` (once).
pub(crate) fn start(fabric: Arc<FabricInner>) -> io::Result<()> {
    let addr = SocketAddr::from_abstract_name(socket_name(std::process::id()))?;
    let listener = in_net_namespace("/proc/self/ns/net", || UnixListener::bind_addr(&addr))?;
    std::thread::Builder::new()
        .name("tessera-soft-agent".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let fabric = Arc::clone(&fabric);
                let spawned = std::thread::Builder::new()
                    .name("tessera-soft-agent-conn".into())
                    .spawn(move || serve(&fabric, stream));
                if let Err(err) = spawned {
                    tracing::warn!(%err, "soft NIC agent could not serve a peer");
                }
            }
        })?;
    Ok(())
}

fn serve(fabric: &FabricInner, mut stream: UnixStream) {
    let mut raw = [0u8; 16];
    while stream.read_exact(&mut raw).is_ok() {
        let answer = Request::decode(&raw).and_then(|(request, node)| {
            let device = fabric.device(node)?;
            device.answer(request)
        });
        if reply(&stream, answer.as_ref()).is_err() {
            return;
        }
    }
}

fn reply(stream: &UnixStream, answer: Option<&Answer>) -> io::Result<()> {
    let mut out = [0u8; 24];
    let Some(answer) = answer else {
        out[0..4].copy_from_slice(&1u32.to_le_bytes());
        return (&*stream).write_all(&out);
    };
    out[8..16].copy_from_slice(&answer.base.to_le_bytes());
    out[16..24].copy_from_slice(&answer.len.to_le_bytes());
    let fds = [answer.fd.as_raw_fd()];
    let control = [ControlMessage::ScmRights(&fds)];
    let iov = [IoSlice::new(&out)];
    let sent = sendmsg::<()>(stream.as_raw_fd(), &iov, &control, MsgFlags::empty(), None)
        .map_err(io::Error::from)?;
    if sent < out.len() {
        (&*stream).write_all(&out[sent..])?;
    }
    Ok(())
}

/// Runs `f` in the network namespace that `ns` names (a
/// `/proc/PID/ns/net` file): in the caller's thread when that is where it
/// is, else on a short-lived thread of its own that enters it (the socket
/// `f` makes stays in that namespace, and works from any thread).
///
/// Why: abstract sockets belong to a network namespace, while processes of
/// one machine in different ones, as the hosts of a multi-host test
/// cluster are, still share its memory and so form one soft fabric. Each
/// agent listens in the namespace of its process (its main thread's, which
/// `/proc/PID/ns/net` names, whatever thread opened the first device), and
/// a peer not found in the caller's namespace is looked for in its
/// process's. Entering a namespace takes `CAP_SYS_ADMIN`, which whoever
/// made the namespaces has.
fn in_net_namespace<T: Send>(ns: &str, f: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
    use std::os::unix::fs::MetadataExt;
    let namespaces = std::fs::File::open(ns).and_then(|target| {
        let theirs = target.metadata()?;
        let ours = std::fs::metadata("/proc/thread-self/ns/net")?;
        Ok((
            target,
            (theirs.dev(), theirs.ino()) == (ours.dev(), ours.ino()),
        ))
    });
    let target = match namespaces {
        Ok((target, false)) => target,
        // The same namespace; or no /proc to tell (then there is one to
        // use: ours).
        Ok((_, true)) | Err(_) => return f(),
    };
    std::thread::scope(|scope| {
        let entered = std::thread::Builder::new()
            .name("tessera-soft-netns".into())
            .spawn_scoped(scope, || {
                nix::sched::setns(&target, nix::sched::CloneFlags::CLONE_NEWNET).map_err(
                    |err| io::Error::other(format!("entering the network namespace {ns}: {err}")),
                )?;
                f()
            })?;
        entered
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("a soft NIC agent socket call panicked")))
    })
}

/// A connection to another process's agent.
#[derive(Debug)]
pub(crate) struct AgentClient {
    stream: UnixStream,
}

impl AgentClient {
    /// Connects to the agent of the process that owns `node`.
    pub(crate) fn connect(node: u64) -> io::Result<Self> {
        let pid = node_pid(node);
        let addr = SocketAddr::from_abstract_name(socket_name(pid))?;
        let stream = match UnixStream::connect_addr(&addr) {
            Ok(stream) => stream,
            Err(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
                ) =>
            {
                in_net_namespace(&format!("/proc/{pid}/ns/net"), || {
                    UnixStream::connect_addr(&addr)
                })?
            }
            Err(err) => return Err(err),
        };
        Ok(Self { stream })
    }

    /// Asks for `request` on `node`.
    pub(crate) fn ask(&mut self, node: u64, request: Request) -> io::Result<Answer> {
        self.stream.write_all(&request.encode(node))?;
        let mut raw = [0u8; 24];
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let mut iov = [IoSliceMut::new(&mut raw)];
        let (got, fd) = {
            let message = recvmsg::<()>(
                self.stream.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .map_err(io::Error::from)?;
            let mut fd = None;
            for control in message.cmsgs().map_err(io::Error::from)? {
                if let ControlMessageOwned::ScmRights(fds) = control {
                    for raw_fd in fds {
                        // SAFETY: the kernel installed this descriptor in
                        // our table for this message; nothing else owns it.
                        let owned = unsafe { OwnedFd::from_raw_fd(raw_fd) };
                        fd.get_or_insert(owned);
                    }
                }
            }
            (message.bytes, fd)
        };
        if got == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer's soft NIC agent went away",
            ));
        }
        if got < raw.len() {
            self.stream.read_exact(&mut raw[got..])?;
        }
        let status = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[i..i + 8]);
            u64::from_le_bytes(b)
        };
        match (status, fd) {
            (0, Some(fd)) => Ok(Answer {
                fd,
                base: u64_at(8),
                len: u64_at(16),
            }),
            _ => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("node {node:#x} has no {request:?}"),
            )),
        }
    }
}

/// A duplicate of `fd` to hand out.
pub(crate) fn dup(fd: BorrowedFd<'_>) -> Option<OwnedFd> {
    fd.try_clone_to_owned().ok()
}
