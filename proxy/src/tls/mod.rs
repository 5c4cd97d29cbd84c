//! The TLS port: one port for the whole cluster, routed by the ClientHello's SNI name.
//!
//! - [`sni`]: the pure ClientHello parser (found / not TLS / need more bytes).
//! - [`detect`]: the I/O shell that reads a hello under a timeout and a byte cap.
//! - [`prefixed`]: replays the bytes detection read, for the TLS acceptor.
//! - [`select`]: SNI name → node(s), with the naming helpers of `shardgate-crds`.
//! - [`certs`]: termination's certificate, key and client CA, loaded and reloaded on change.
//!
//! The parts that use these: the TLS client of the backend leg is [`crate::dial::tls`], and
//! one connection on the TLS port (detect, route, then pass through or terminate and
//! forward) is [`crate::conn::tls_port`].

pub mod certs;
pub mod detect;
pub mod prefixed;
pub mod select;
pub mod sni;

pub use detect::DetectLimits;
pub use prefixed::PrefixedIo;
pub use sni::NotTls;

/// TLS alert descriptions the proxy sends when it refuses a ClientHello (RFC 8446 §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Alert {
    HandshakeFailure = 40,
    DecodeError = 50,
    MissingExtension = 109,
    UnrecognizedName = 112,
}

impl Alert {
    /// A fatal alert record, as the first (and only) thing the proxy sends. The record
    /// version is TLS 1.2's, which every TLS 1.2 and 1.3 client accepts here.
    pub fn record(self) -> [u8; 7] {
        [21, 3, 3, 0, 2, 2, self as u8]
    }
}
