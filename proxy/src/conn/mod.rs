//! Connections: where a client connection lives, from accept to close.
//!
//! - [`listener`]: one accept loop per node port and the TLS port (connection limit,
//!   backoff, stop), and the supervisor that keeps the bound ports equal to the table's.
//! - [`buffers`]: read buffers taken only while bytes are in flight.
//! - [`sink`]: the write side: a first write without a trip through the event loop, and
//!   whether closing a socket ends its stream as a shutdown would.
//! - [`join`]: a connection's two directions joined, each polled only when it was woken.
//! - [`watch`]: the copy watched by the idle timeout and the drain's end, which are polled
//!   only when one of them may have fired; its timer also says when a node socket gets
//!   keepalive.
//! - [`keepalive`]: keepalive on a node's socket, set once the connection has lasted a
//!   second (most that end sooner never need it).
//! - [`forward`]: one client connection on a node port: dial its node, then the copy loop
//!   both ways, with the rewriting observers on rewriting listeners; how it ended, counted.
//! - [`serve`]: a node-port connection's future, its forward then its end, written out so
//!   that it is stored once.
//! - [`tls_session`]: a TLS session (a client's on the TLS port, the proxy's to a TLS node)
//!   read and written by the copy loop itself.
//! - [`tls_port`]: one connection on the TLS port: read the ClientHello, route its SNI name,
//!   then pass the TLS stream through or terminate it and forward.

mod buffers;
pub mod forward;
mod join;
mod keepalive;
pub mod listener;
mod serve;
mod sink;
pub mod tls_port;
mod tls_session;
mod watch;

pub use forward::Forwarder;
pub use listener::Listeners;
pub use tls_port::TlsServer;
pub use watch::HardStop;
