//! [`Client`]: one RESP2 connection to one node, one command at a time.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use redis_protocol::codec::Resp2;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_util::codec::Framed;
use tokio_util::either::Either;

use crate::depth::{BoundedCodec, FrameError};
use crate::tls::Tls;
use crate::{Error, Reply};

/// A connection, plain or TLS.
type Stream = Either<TcpStream, TlsStream<TcpStream>>;

/// How long the client waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// For the connection to be made (TCP, and the TLS handshake on TLS).
    pub connect: Duration,
    /// For one command: writing it and reading its whole reply.
    pub reply: Duration,
}

impl Default for Timeouts {
    /// 5 s each: far more than a healthy node on a busy machine needs, short enough that a
    /// reconcile loop or a discovery round does not hang on a dead one.
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(5),
            reply: Duration::from_secs(5),
        }
    }
}

/// How to reach a node: the timeouts, and TLS for nodes that speak only TLS.
#[derive(Debug, Clone, Default)]
pub struct Dial {
    pub timeouts: Timeouts,
    pub tls: Option<Tls>,
}

impl From<Timeouts> for Dial {
    /// Plain TCP with these timeouts.
    fn from(timeouts: Timeouts) -> Self {
        Dial {
            timeouts,
            tls: None,
        }
    }
}

/// One connection to one node.
///
/// Commands are sent one at a time (no pipelining), each as a RESP array of bulk strings,
/// and each reply is read whole, within [`Timeouts::reply`] and the bounds of
/// [`depth`](crate::depth), before the next command. The connection speaks RESP2 (it never
/// sends `HELLO 3`).
///
/// ```no_run
/// # async fn example() -> Result<(), shardgate_admin_client::Error> {
/// use shardgate_admin_client::{Client, Timeouts};
///
/// let mut node = Client::connect("127.0.0.1:6379".parse().unwrap(), Timeouts::default()).await?;
/// let me = node.cluster_myid().await?;
/// for shard in node.cluster_shards().await? {
///     println!("{} {:?}", shard.key(), shard.slots);
/// }
/// match node.command(["CLUSTER", "FORGET", me.as_str()]).await {
///     Err(e) if e.server_message().is_some_and(|m| m.starts_with("ERR")) => {}
///     other => println!("{other:?}"),
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Client {
    addr: SocketAddr,
    timeouts: Timeouts,
    framed: Framed<Stream, BoundedCodec<Resp2>>,
    /// Set when a command failed midway: the next reply on this connection could belong to
    /// the failed command, so no further command is sent.
    broken: bool,
}

impl Client {
    /// Connects to `addr` within `timeouts.connect`.
    ///
    /// # Errors
    ///
    /// [`Error::Connect`] if the connection is refused or fails, [`Error::Timeout`] (`what`
    /// is `"connect"`) if it is not made in time.
    pub async fn connect(addr: SocketAddr, timeouts: Timeouts) -> Result<Client, Error> {
        Client::dial(addr, &timeouts.into()).await
    }

    /// Connects to `addr` as `dial` says: over TLS when it has [`Tls`] settings, the
    /// handshake within `dial.timeouts.connect` too.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect), and [`Error::Tls`] if the handshake fails (the node's
    /// certificate is not signed by the CA, it wants a client certificate, it speaks plain
    /// RESP).
    pub async fn dial(addr: SocketAddr, dial: &Dial) -> Result<Client, Error> {
        let timeouts = dial.timeouts;
        let connect = async {
            let tcp = TcpStream::connect(addr)
                .await
                .map_err(|source| Error::Connect { addr, source })?;
            // Commands are small and each waits for its reply: send them at once.
            tcp.set_nodelay(true)
                .map_err(|source| Error::Connect { addr, source })?;
            match &dial.tls {
                None => Ok(Either::Left(tcp)),
                // Nodes are dialled by IP; the name is not checked (crate::tls) unless
                // one is given.
                Some(tls) => tls
                    .connector()
                    .connect(
                        tls.server_name()
                            .cloned()
                            .unwrap_or(ServerName::IpAddress(addr.ip().into())),
                        tcp,
                    )
                    .await
                    .map(Either::Right)
                    .map_err(|source| Error::Tls { addr, source }),
            }
        };
        let stream = tokio::time::timeout(timeouts.connect, connect)
            .await
            .map_err(|_| Error::Timeout {
                addr,
                what: "connect",
                after: timeouts.connect,
            })??;
        tracing::debug!(%addr, tls = dial.tls.is_some(), "connected");
        Ok(Client {
            addr,
            timeouts,
            framed: Framed::new(stream, BoundedCodec::new(Resp2::default())),
            broken: false,
        })
    }

    /// The node's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The certificate the node presented (DER), on a TLS connection.
    pub fn peer_certificate(&self) -> Option<&[u8]> {
        match self.framed.get_ref() {
            Either::Left(_) => None,
            Either::Right(tls) => tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|leaf| leaf.as_ref()),
        }
    }

    /// The timeouts this client was made with.
    pub fn timeouts(&self) -> Timeouts {
        self.timeouts
    }

    /// Sends one command and reads its reply; an error reply is an [`Error::Server`].
    ///
    /// `args` is the command's name and arguments, e.g. `["CLUSTER", "FORGET", id]`.
    ///
    /// # Errors
    ///
    /// [`Error::Server`] with the reply's message (`ERR Unknown node ...`, `MOVED ...`) for
    /// an error reply; the connection stays usable. Otherwise as [`command_raw`](Self::command_raw).
    pub async fn command<I, A>(&mut self, args: I) -> Result<Reply, Error>
    where
        I: IntoIterator<Item = A>,
        A: AsRef<[u8]>,
    {
        match self.command_raw(args).await? {
            Reply::Error(message) => Err(Error::Server {
                addr: self.addr,
                message: message.to_string(),
            }),
            reply => Ok(reply),
        }
    }

    /// Sends one command and returns its reply as it is, error replies included.
    ///
    /// # Errors
    ///
    /// [`Error::EmptyCommand`] without a command name; [`Error::Broken`] if an earlier
    /// command on this connection failed midway; [`Error::Timeout`] (`what` is `"reply"`)
    /// if writing the command and reading its reply takes longer than [`Timeouts::reply`];
    /// [`Error::Io`], [`Error::Closed`] or [`Error::Protocol`] (malformed, nested deeper
    /// than [`MAX_DEPTH`](crate::depth::MAX_DEPTH), larger than
    /// [`MAX_REPLY`](crate::depth::MAX_REPLY)) as the connection fails. All but the first
    /// leave the connection broken.
    pub async fn command_raw<I, A>(&mut self, args: I) -> Result<Reply, Error>
    where
        I: IntoIterator<Item = A>,
        A: AsRef<[u8]>,
    {
        let addr = self.addr;
        if self.broken {
            return Err(Error::Broken { addr });
        }
        let args: Vec<Reply> = args
            .into_iter()
            .map(|a| Reply::BulkString(Bytes::copy_from_slice(a.as_ref())))
            .collect();
        // Only the name is logged: arguments can be secrets (AUTH, CONFIG SET requirepass).
        let name = match args.first() {
            Some(Reply::BulkString(name)) => String::from_utf8_lossy(name).into_owned(),
            _ => return Err(Error::EmptyCommand { addr }),
        };
        let after = self.timeouts.reply;
        let result = match tokio::time::timeout(after, self.exchange(Reply::Array(args))).await {
            Ok(result) => result,
            Err(_) => Err(Error::Timeout {
                addr,
                what: "reply",
                after,
            }),
        };
        match &result {
            Ok(reply) => tracing::trace!(%addr, command = %name, ?reply, "reply"),
            Err(e) => {
                if e.breaks_connection() {
                    self.broken = true;
                }
                tracing::debug!(%addr, command = %name, error = %e, "command failed");
            }
        }
        result
    }

    /// Writes one command and reads one reply.
    async fn exchange(&mut self, command: Reply) -> Result<Reply, Error> {
        let addr = self.addr;
        let fail = |e: FrameError| match e {
            FrameError::Io(source) => Error::Io { addr, source },
            FrameError::Truncated { .. } => Error::Closed { addr },
            other => Error::Protocol {
                addr,
                message: other.to_string(),
            },
        };
        self.framed.send(command).await.map_err(fail)?;
        match self.framed.next().await {
            Some(reply) => reply.map_err(fail),
            None => Err(Error::Closed { addr }),
        }
    }
}
