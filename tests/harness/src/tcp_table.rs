//! The kernel's table of TCP sockets (`/proc/net/tcp`), for what a socket option shows
//! only from outside the process that set it.

use std::net::SocketAddr;

/// The IPv4 TCP socket from `local` to `remote`: whether its keepalive timer runs (timer 2:
/// on an established socket, `sk_timer` is keepalive's), and in how many clock ticks
/// (1/100 s) it fires. `None` if there is no such socket.
pub fn keepalive_timer(local: SocketAddr, remote: SocketAddr) -> Option<(bool, u64)> {
    let (local, remote) = (hex(local), hex(remote));
    let table = std::fs::read_to_string("/proc/net/tcp").expect("reading /proc/net/tcp");
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[1] != local || f[2] != remote {
            return None;
        }
        let (timer, when) = f[5].split_once(':')?;
        Some((timer == "02", u64::from_str_radix(when, 16).ok()?))
    })
}

/// An address as the table writes it: the IPv4 address's four bytes as a word in the
/// machine's byte order, the port.
fn hex(a: SocketAddr) -> String {
    let SocketAddr::V4(v4) = a else {
        panic!("{a}: the table read here holds IPv4 sockets only")
    };
    format!(
        "{:08X}:{:04X}",
        u32::from_ne_bytes(v4.ip().octets()),
        v4.port()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 127.0.0.1:6379 as Linux writes it on a little-endian machine (`0100007F:18EB`, as
    /// in any `/proc/net/tcp` there).
    #[test]
    #[cfg(target_endian = "little")]
    fn addresses_as_the_table_writes_them() {
        assert_eq!(hex("127.0.0.1:6379".parse().unwrap()), "0100007F:18EB");
    }

    /// A socket with keepalive on, found in the table with its timer.
    #[test]
    fn a_socket_with_keepalive_shows_its_timer() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_accepted, _) = listener.accept().unwrap();
        let (local, remote) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        assert_eq!(keepalive_timer(local, remote).map(|t| t.0), Some(false));
        socket2::SockRef::from(&client)
            .set_tcp_keepalive(
                &socket2::TcpKeepalive::new().with_time(std::time::Duration::from_secs(30)),
            )
            .unwrap();
        let (on, ticks) = keepalive_timer(local, remote).unwrap();
        assert!(on);
        assert!((2_900..=3_000).contains(&ticks), "{ticks} ticks");
    }
}
