//! The kernel's table of TCP sockets (`/proc/net/tcp` and `tcp6`), read so
//! that a test can wait on what the kernel knows about a connection
//! instead of sleeping and hoping it happened: bytes a stopped or idle
//! reader has not read yet (`rx_queue`), or a writer whose peer's window is
//! closed (the zero-window probe timer is armed: the socket is full).
//!
//! The fields are the ones `ss` reads from the same files (see
//! `Documentation/networking/proc_net_tcp.rst` in the kernel): addresses
//! and ports in hex, the state code, the queues and the active timer.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// `st` of an established connection.
const ESTABLISHED: u8 = 0x01;
/// `tr` while the zero-window probe timer runs: the socket has bytes to
/// send and its peer advertised no room for them.
const ZERO_WINDOW_PROBE: u8 = 4;

/// One row of the kernel's TCP socket table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSocket {
    /// Its own address.
    pub local: SocketAddr,
    /// Its peer's address (unspecified for a listener).
    pub remote: SocketAddr,
    /// The state code (`01` established, `0A` listening, ...).
    pub state: u8,
    /// Bytes written and not yet acknowledged by the peer.
    pub tx_queue: u64,
    /// Bytes received and not yet read by the owner.
    pub rx_queue: u64,
    /// Which timer is active (`0` none, `1` retransmit, `2` keepalive,
    /// `3` TIME_WAIT, `4` zero-window probe).
    pub timer: u8,
}

impl TcpSocket {
    /// Whether the connection is established.
    pub fn established(&self) -> bool {
        self.state == ESTABLISHED
    }

    /// Whether it is a writer whose peer's receive window is closed: it
    /// has bytes queued and the kernel probes the window.
    pub fn blocked_on_a_full_peer(&self) -> bool {
        self.established() && self.timer == ZERO_WINDOW_PROBE && self.tx_queue > 0
    }
}

/// Every TCP socket of this network namespace, IPv4 and IPv6.
pub fn tcp_sockets() -> Vec<TcpSocket> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(parse_row)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The established connections whose local address is `local` (a server's
/// side of its accepted connections).
pub fn accepted_at(local: SocketAddr) -> Vec<TcpSocket> {
    tcp_sockets()
        .into_iter()
        .filter(|s| s.established() && s.local == local)
        .collect()
}

/// The established connections whose peer is `remote` (the clients' side
/// of connections to a server at `remote`).
pub fn connected_to(remote: SocketAddr) -> Vec<TcpSocket> {
    tcp_sockets()
        .into_iter()
        .filter(|s| s.established() && s.remote == remote)
        .collect()
}

/// Waits (up to `within`) until a connection to `server` is a writer held
/// back by the server's closed window ([`TcpSocket::blocked_on_a_full_peer`]):
/// the server has stopped reading and everything it can take is taken.
pub async fn writer_blocked_by(server: SocketAddr, within: std::time::Duration) {
    crate::wait::eventually(
        within,
        "the reader's closed window holds the writer back",
        || async {
            let seen = connected_to(server);
            if seen.iter().any(TcpSocket::blocked_on_a_full_peer) {
                Ok(())
            } else {
                Err(seen)
            }
        },
    )
    .await;
}

fn parse_row(line: &str) -> Option<TcpSocket> {
    let mut fields = line.split_whitespace().skip(1);
    let local = parse_addr(fields.next()?)?;
    let remote = parse_addr(fields.next()?)?;
    let state = u8::from_str_radix(fields.next()?, 16).ok()?;
    let (tx, rx) = fields.next()?.split_once(':')?;
    let (timer, _) = fields.next()?.split_once(':')?;
    Some(TcpSocket {
        local,
        remote,
        state,
        tx_queue: u64::from_str_radix(tx, 16).ok()?,
        rx_queue: u64::from_str_radix(rx, 16).ok()?,
        timer: u8::from_str_radix(timer, 16).ok()?,
    })
}

/// `0100007F:1F90` (IPv4, the address as a host-order u32 in hex) or 32
/// hex digits for IPv6 (four host-order u32 words).
fn parse_addr(field: &str) -> Option<SocketAddr> {
    let (addr, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(
            u32::from_str_radix(addr, 16).ok()?.to_ne_bytes(),
        )),
        32 => {
            let mut octets = [0u8; 16];
            for (i, word) in octets.chunks_mut(4).enumerate() {
                let hex = addr.get(i * 8..i * 8 + 8)?;
                word.copy_from_slice(&u32::from_str_radix(hex, 16).ok()?.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_both_families_parse() {
        let v4 = "   1: 0100007F:1F90 0100007F:C350 01 00000010:00000200 04:00000042 00000000     0        0 123 2 0000000000000000 20 4 30 10 -1";
        let row = parse_row(v4).unwrap();
        assert_eq!(row.local, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(row.remote, "127.0.0.1:50000".parse().unwrap());
        assert_eq!((row.tx_queue, row.rx_queue), (0x10, 0x200));
        assert!(row.blocked_on_a_full_peer());
        let v6 = "   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 456 1 0000000000000000 100 0 0 10 0";
        let row = parse_row(v6).unwrap();
        assert_eq!(row.local, "[::1]:8080".parse().unwrap());
        assert!(!row.established());
        assert_eq!(parse_row("garbage"), None);
    }

    #[test]
    fn a_connection_shows_on_both_sides_with_what_is_unread() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = listener.local_addr().unwrap();
        let mut client = std::net::TcpStream::connect(server).unwrap();
        let (_accepted, _) = listener.accept().unwrap();
        client.write_all(&[7; 100]).unwrap();
        let unread = crate::wait::eventually_blocking(
            std::time::Duration::from_secs(5),
            "the kernel holds the 100 bytes for the reader",
            || match accepted_at(server).first() {
                Some(s) if s.rx_queue == 100 => Ok(s.clone()),
                other => Err(format!("{other:?}")),
            },
        );
        assert_eq!(unread.remote, client.local_addr().unwrap());
        assert_eq!(connected_to(server).len(), 1);
    }
}
