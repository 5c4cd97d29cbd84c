//! A relay in front of the API server that the test can cut (the API server unreachable:
//! connections closed, new ones closed at once) or make fall silent, as connections do when
//! the API server's node goes away without a reset (nothing is closed, no byte comes back).
//! Clients under test are pointed at it ([`ApiRelay::kube_config`], [`ApiRelay::addr`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{Context as _, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::ControlPlane;

/// A relay to one API server; stops relaying when dropped.
pub struct ApiRelay {
    addr: SocketAddr,
    state: Arc<State>,
    /// Whether it relays at all ([`ApiRelay::cut`], [`ApiRelay::restore`]).
    open: watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct State {
    /// Connections are numbered as accepted.
    accepted: AtomicU64,
    /// Connections numbered below this relay nothing more.
    silent_below: AtomicU64,
    /// No connection relays anything more, new ones included.
    all_silent: AtomicBool,
    /// Bytes read on silent connections and dropped, both ways.
    swallowed: AtomicU64,
}

impl State {
    fn silent(&self, id: u64) -> bool {
        self.all_silent.load(Ordering::SeqCst) || id < self.silent_below.load(Ordering::SeqCst)
    }
}

impl ApiRelay {
    /// A relay to `api`, on a port of the same loopback address (which the API server's
    /// certificate names).
    pub async fn start(api: SocketAddr) -> Result<ApiRelay> {
        let listener = TcpListener::bind((api.ip(), 0))
            .await
            .context("binding the API relay")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State::default());
        let shared = state.clone();
        let (open, is_open) = watch::channel(true);
        let accept = tokio::spawn(async move {
            // Dropped with the accept task: every connection ends with the relay.
            let mut connections = JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                let id = shared.accepted.fetch_add(1, Ordering::SeqCst);
                if !*is_open.borrow() {
                    // Cut: closed at once.
                    continue;
                }
                let mut cut = is_open.clone();
                let relayed = relay(inbound, api, id, shared.clone());
                connections.spawn(async move {
                    tokio::select! {
                        _ = relayed => {}
                        _ = cut.wait_for(|open| !*open) => {}
                    }
                });
                // Finished connections are not kept.
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(ApiRelay {
            addr,
            state,
            open,
            accept,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every relayed connection, and closes new ones at once, until
    /// [`ApiRelay::restore`]: the API server unreachable.
    pub fn cut(&self) {
        self.open.send_replace(false);
    }

    /// Relays new connections again after [`ApiRelay::cut`].
    pub fn restore(&self) {
        self.open.send_replace(true);
    }

    /// `cp`'s admin configuration, through this relay.
    pub fn kube_config(&self, cp: &ControlPlane) -> Result<kube::Config> {
        let mut config = cp.kube_config()?;
        config.cluster_url = format!("https://{}", self.addr)
            .parse()
            .context("relay URL")?;
        Ok(config)
    }

    /// The connections open now relay nothing more; new ones relay as before (a client
    /// that gives up on a silent connection and opens another gets through).
    pub fn silence_open_connections(&self) {
        let open = self.state.accepted.load(Ordering::SeqCst);
        self.state.silent_below.store(open, Ordering::SeqCst);
    }

    /// No connection relays anything more, new ones included: the API server is gone.
    pub fn go_silent(&self) {
        self.state.all_silent.store(true, Ordering::SeqCst);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Bytes that came on silent connections, either way, and were dropped: that a silence
    /// was met, not only set.
    pub fn swallowed(&self) -> u64 {
        self.state.swallowed.load(Ordering::SeqCst)
    }
}

impl Drop for ApiRelay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn relay(inbound: TcpStream, api: SocketAddr, id: u64, state: Arc<State>) {
    if state.silent(id) {
        // Accepted (as a gone host's address would not be), then never answered.
        return swallow(inbound, &state).await;
    }
    let Ok(outbound) = TcpStream::connect(api).await else {
        return;
    };
    let (ir, iw) = inbound.into_split();
    let (or, ow) = outbound.into_split();
    tokio::join!(copy(ir, ow, id, &state), copy(or, iw, id, &state));
}

/// Copies `from` to `to` until the end of stream, dropping what comes once `id` is silent.
async fn copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    id: u64,
    state: &State,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if state.silent(id) {
            state.swallowed.fetch_add(n as u64, Ordering::SeqCst);
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    if !state.silent(id) {
        let _ = to.shutdown().await;
    } else {
        // Silent to the end: no FIN either, until the relay is dropped.
        std::future::pending::<()>().await;
    }
}

async fn swallow(mut inbound: TcpStream, state: &State) {
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = inbound.read(&mut buf).await {
        if n == 0 {
            break;
        }
        state.swallowed.fetch_add(n as u64, Ordering::SeqCst);
    }
    // Not closed: a gone host sends no FIN.
    std::future::pending::<()>().await;
}
