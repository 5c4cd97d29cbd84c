//! The one error type of the crate, and its metric labels.

use std::net::SocketAddr;
use std::time::Duration;

/// Why a command to a node failed.
///
/// Every variant that comes from talking to a node names the node's address in its message,
/// so a log line says which node misbehaved. [`Error::label`] is the metric label.
///
/// After a [`Timeout`](Error::Timeout) during a command, an [`Io`](Error::Io),
/// [`Closed`](Error::Closed) or [`Protocol`](Error::Protocol) error, the connection's state is
/// unknown (a late reply would be read as the next command's reply), so the
/// [`Client`](crate::Client) refuses further commands with [`Broken`](Error::Broken). A
/// [`Server`](Error::Server) error reply leaves the connection usable.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The TCP connection could not be made.
    #[error("{addr}: connect: {source}")]
    Connect {
        addr: SocketAddr,
        source: std::io::Error,
    },

    /// The TLS handshake failed.
    #[error("{addr}: TLS handshake: {source}")]
    Tls {
        addr: SocketAddr,
        source: std::io::Error,
    },

    /// The node did not answer in time; `what` is `"connect"` or `"reply"`.
    #[error("{addr}: {what} timed out after {after:?}")]
    Timeout {
        addr: SocketAddr,
        what: &'static str,
        after: Duration,
    },

    /// Reading from or writing to the connection failed.
    #[error("{addr}: {source}")]
    Io {
        addr: SocketAddr,
        source: std::io::Error,
    },

    /// The node closed the connection before its reply was complete.
    #[error("{addr}: closed the connection before replying")]
    Closed { addr: SocketAddr },

    /// The reply is not valid RESP, is nested too deeply or is too large.
    #[error("{addr}: {message}")]
    Protocol { addr: SocketAddr, message: String },

    /// The node answered with an error reply (`-ERR ...`, `-MOVED ...`); `message` is the
    /// reply without the leading `-`, e.g. `ERR Unknown node 1234`.
    #[error("{addr}: error reply: {message}")]
    Server { addr: SocketAddr, message: String },

    /// The reply is valid RESP but not the shape its command documents. `addr` is `None`
    /// when a reply was parsed away from its connection (e.g. by [`parse_shards`]).
    ///
    /// [`parse_shards`]: crate::parse_shards
    #[error("{}unexpected reply: {message}", node_prefix(*.addr))]
    Shape {
        addr: Option<SocketAddr>,
        message: String,
    },

    /// An earlier command failed in a way that leaves the connection's state unknown.
    #[error("{addr}: connection unusable after an earlier failure; reconnect")]
    Broken { addr: SocketAddr },

    /// A command needs at least its name.
    #[error("{addr}: empty command")]
    EmptyCommand { addr: SocketAddr },
}

fn node_prefix(addr: Option<SocketAddr>) -> String {
    addr.map(|a| format!("{a}: ")).unwrap_or_default()
}

impl Error {
    /// A short snake_case label for metrics, one per variant.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Connect { .. } => "connect",
            Error::Tls { .. } => "tls",
            Error::Timeout { .. } => "timeout",
            Error::Io { .. } => "io",
            Error::Closed { .. } => "closed",
            Error::Protocol { .. } => "protocol",
            Error::Server { .. } => "server",
            Error::Shape { .. } => "shape",
            Error::Broken { .. } => "broken",
            Error::EmptyCommand { .. } => "empty_command",
        }
    }

    /// The message of an error reply (`ERR ...`, `MOVED ...`), if this is one.
    pub fn server_message(&self) -> Option<&str> {
        match self {
            Error::Server { message, .. } => Some(message),
            _ => None,
        }
    }

    /// A [`Shape`](Error::Shape) error not yet tied to a node.
    pub(crate) fn shape(message: impl Into<String>) -> Self {
        Error::Shape {
            addr: None,
            message: message.into(),
        }
    }

    /// Names the node of a [`Shape`](Error::Shape) error that has none yet.
    pub(crate) fn at(self, node: SocketAddr) -> Self {
        match self {
            Error::Shape {
                addr: None,
                message,
            } => Error::Shape {
                addr: Some(node),
                message,
            },
            other => other,
        }
    }

    /// Whether the connection must not be used again after this error.
    pub(crate) fn breaks_connection(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. }
                | Error::Io { .. }
                | Error::Closed { .. }
                | Error::Protocol { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_exact_and_messages_name_the_node() {
        let addr: SocketAddr = "127.0.0.1:6379".parse().unwrap();
        let io = || std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let cases = [
            (Error::Connect { addr, source: io() }, "connect"),
            (
                Error::Timeout {
                    addr,
                    what: "reply",
                    after: Duration::from_millis(250),
                },
                "timeout",
            ),
            (Error::Io { addr, source: io() }, "io"),
            (Error::Closed { addr }, "closed"),
            (
                Error::Protocol {
                    addr,
                    message: "reply nested deeper than 64 levels".into(),
                },
                "protocol",
            ),
            (
                Error::Server {
                    addr,
                    message: "ERR Unknown node x".into(),
                },
                "server",
            ),
            (Error::shape("slots is not an array").at(addr), "shape"),
            (Error::Broken { addr }, "broken"),
            (Error::EmptyCommand { addr }, "empty_command"),
        ];
        for (error, label) in cases {
            assert_eq!(error.label(), label);
            assert!(error.to_string().starts_with("127.0.0.1:6379: "), "{error}");
        }
    }

    #[test]
    fn displays() {
        let addr: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let timeout = Error::Timeout {
            addr,
            what: "reply",
            after: Duration::from_millis(250),
        };
        assert_eq!(
            timeout.to_string(),
            "127.0.0.1:7000: reply timed out after 250ms"
        );
        assert_eq!(
            Error::shape("a node without id").to_string(),
            "unexpected reply: a node without id"
        );
        let server = Error::Server {
            addr,
            message: "MOVED 1 127.0.0.2:6379".into(),
        };
        assert_eq!(server.server_message(), Some("MOVED 1 127.0.0.2:6379"));
        assert_eq!(timeout.server_message(), None);
    }
}
