//! The data planes compared: Valkey direct (the limit), shardgate (pass-through and
//! rewrite), HAProxy `mode tcp`, nginx `stream` and Traefik's TCP router, each a separate
//! process on loopback with one or two worker threads.
//!
//! Every configuration file and log lives in the run's harness directory
//! (`<tmp>/shardgate-harness-<pid>-load<n>/`) and every process runs with it as its working
//! directory and on its command line, so a process left by a killed run is reaped by the next
//! harness start and caught by `scripts/test`'s stray check. Dropping a [`Peer`] stops it.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rustix::process::{kill_process, Pid, Signal};
use shardgate_harness::addr::{free_port, free_port_range};

use crate::proc_stat::ProcTree;
use crate::tls::{TlsFiles, SNI_DOMAIN, SNI_PREFIX};

const LO: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// Which data plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Direct,
    Pass,
    Rewrite,
    Haproxy,
    /// HAProxy with TCP keepalive on both legs at shardgate's times: the same work per
    /// connection.
    HaproxyKeepalive,
    Nginx,
    Traefik,
}

impl Kind {
    /// A data plane by its `--peers` key.
    pub fn parse(key: &str) -> anyhow::Result<Kind> {
        Ok(match key.trim() {
            "direct" => Kind::Direct,
            "pass" => Kind::Pass,
            "rewrite" => Kind::Rewrite,
            "haproxy" => Kind::Haproxy,
            "haproxy-ka" => Kind::HaproxyKeepalive,
            "nginx" => Kind::Nginx,
            "traefik" => Kind::Traefik,
            other => anyhow::bail!(
                "unknown data plane {other:?}: direct, pass, rewrite, haproxy, haproxy-ka, \
                 nginx or traefik"
            ),
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            Kind::Direct => "Valkey direct",
            Kind::Pass => "shardgate pass-through",
            Kind::Rewrite => "shardgate rewrite",
            Kind::Haproxy => "HAProxy tcp",
            Kind::HaproxyKeepalive => "HAProxy tcp keepalive",
            Kind::Nginx => "nginx stream",
            Kind::Traefik => "Traefik TCP",
        }
    }

    /// The software alone, for where the configuration is not the label's (a TLS listener).
    pub fn product(self) -> &'static str {
        match self {
            Kind::Direct => "Valkey",
            Kind::Pass | Kind::Rewrite => "shardgate",
            Kind::Haproxy | Kind::HaproxyKeepalive => "HAProxy",
            Kind::Nginx => "nginx",
            Kind::Traefik => "Traefik",
        }
    }
}

/// One running data plane in front of a backend.
pub struct Peer {
    pub kind: Kind,
    /// Worker threads (shardgate's tokio workers, HAProxy's `nbthread`, nginx's workers,
    /// Traefik's `GOMAXPROCS`); 0 for direct.
    pub threads: u8,
    /// Where clients connect (a cluster: its first node).
    pub addr: SocketAddr,
    /// A cluster's every node as clients reach them (empty for a standalone backend).
    pub entries: Vec<SocketAddr>,
    /// Where TLS clients connect, the data plane terminating TLS (the run's certificate) in
    /// the same process; none where the harness does not set TLS up (direct, Traefik, the
    /// cluster).
    pub tls: Option<SocketAddr>,
    /// The process whose CPU and memory are the data plane's; none for direct.
    pub proc: Option<ProcTree>,
    child: Option<Child>,
    log: Option<PathBuf>,
}

impl Peer {
    /// "HAProxy tcp ×1".
    pub fn name(&self) -> String {
        if self.kind == Kind::Direct {
            self.kind.label().to_string()
        } else {
            format!("{} ×{}", self.kind.label(), self.threads)
        }
    }

    pub fn direct(addr: SocketAddr, entries: Vec<SocketAddr>) -> Peer {
        Peer {
            kind: Kind::Direct,
            threads: 0,
            addr,
            entries,
            tls: None,
            proc: None,
            child: None,
            log: None,
        }
    }

    /// shardgate in front of `backends` (one node per shard, or a cluster's route file); with
    /// `tls`, its TLS port terminating TLS as well.
    pub fn shardgate(
        dir: &Path,
        routes: RouteSpec<'_>,
        rewrite: bool,
        threads: u8,
        tls: Option<&TlsFiles>,
    ) -> Result<Peer> {
        let kind = if rewrite { Kind::Rewrite } else { Kind::Pass };
        let mode = if rewrite { "rewrite" } else { "pass" };
        let backend = match routes {
            RouteSpec::Standalone(_) => "",
            RouteSpec::Cluster(_) => "-cluster",
        };
        // Unique per peer: each proxy polls its own route file.
        let name = format!("shardgate-{mode}{backend}-{threads}");
        let (port, count, yaml) = match routes {
            RouteSpec::Standalone(backend) => {
                let port = free_port(LO);
                let yaml = shardgate_harness::routes::one_node_per_shard(port, &[backend]);
                (port, 0, yaml)
            }
            RouteSpec::Cluster(cluster) => {
                let count = cluster.nodes().len() as u16;
                let port = free_port_range(LO, count);
                (
                    port,
                    count,
                    shardgate_harness::routes::routes_yaml(port, cluster),
                )
            }
        };
        let routes = dir.join(format!("{name}-routes.yaml"));
        std::fs::write(&routes, yaml).context("writing the route file")?;
        let bin = shardgate_harness::proxy_process::proxy_binary()?;
        let mut cmd = Command::new(bin);
        cmd.arg("--routes")
            .arg(&routes)
            .args(["--listen-ip", "127.0.0.1", "--admin-addr", "off"])
            .args(["--max-connections", "100000", "--drain-timeout", "1s"])
            .env("TOKIO_WORKER_THREADS", threads.to_string())
            .env("RUST_LOG", "warn");
        if rewrite {
            cmd.args(["--rewrite", "--advertise-host", "127.0.0.1"]);
        }
        let tls_port = tls.map(|files| {
            let p = free_port(LO);
            cmd.args(["--tls-port", &p.to_string(), "--tls-mode", "terminate"])
                .args(["--sni-prefix", SNI_PREFIX, "--sni-domain", SNI_DOMAIN])
                .arg("--tls-cert")
                .arg(&files.cert)
                .arg("--tls-key")
                .arg(&files.key);
            p
        });
        let mut peer = Peer::spawn(dir, &name, cmd, kind, threads, port)?;
        peer.serve_tls(tls_port, tls)?;
        peer.entries = (port..port + count)
            .map(|p| SocketAddr::from((LO, p)))
            .collect();
        Ok(peer)
    }

    /// HAProxy 2.x, `mode tcp`, `nbthread threads`, for up to `conns` client connections
    /// (it asks for about two descriptors each, and refuses to start past the hard limit).
    /// With `keepalive`, TCP keepalive on both legs after 60 s, then every 10 s, as
    /// shardgate sets it (`option tcpka`; HAProxy sets it on each socket it accepts or
    /// opens). With `tls`, a second frontend terminating TLS (OpenSSL, Debian's build).
    pub fn haproxy(
        dir: &Path,
        backend: SocketAddr,
        threads: u8,
        conns: usize,
        keepalive: bool,
        tls: Option<&TlsFiles>,
    ) -> Result<Peer> {
        let port = free_port(LO);
        let (kind, name) = if keepalive {
            (Kind::HaproxyKeepalive, format!("haproxy-ka-{threads}"))
        } else {
            (Kind::Haproxy, format!("haproxy-{threads}"))
        };
        let tcpka = if keepalive {
            "  option tcpka\n  clitcpka-idle 60s\n  clitcpka-intvl 10s\n\
             srvtcpka-idle 60s\n  srvtcpka-intvl 10s\n"
        } else {
            ""
        };
        let tls_port = tls.map(|files| (free_port(LO), files));
        let tls_frontend = tls_port.map_or(String::new(), |(p, files)| {
            format!(
                "frontend tls\n  bind 127.0.0.1:{p} ssl crt {}\n  default_backend be\n",
                files.pem.display()
            )
        });
        let cfg = dir.join(format!("{name}.cfg"));
        std::fs::write(
            &cfg,
            format!(
                "global\n  nbthread {threads}\n  maxconn {conns}\n\
                 defaults\n  mode tcp\n{tcpka}  timeout connect 5s\n  timeout client 1h\n  timeout server 1h\n\
                 frontend fe\n  bind 127.0.0.1:{port}\n  default_backend be\n{tls_frontend}\
                 backend be\n  server valkey {backend}\n"
            ),
        )?;
        let mut cmd = Command::new(tool("SHARDGATE_HAPROXY", "/usr/sbin/haproxy")?);
        cmd.arg("-db").arg("-f").arg(&cfg);
        let mut peer = Peer::spawn(dir, &name, cmd, kind, threads, port)?;
        peer.serve_tls(tls_port.map(|(p, _)| p), tls)?;
        Ok(peer)
    }

    /// nginx with the `stream` module: a master and `threads` workers, each allowed `conns`
    /// client connections (a proxied one counts twice in `worker_connections`). With `tls`,
    /// a second server terminating TLS (`ssl`, OpenSSL).
    pub fn nginx(
        dir: &Path,
        backend: SocketAddr,
        threads: u8,
        conns: usize,
        tls: Option<&TlsFiles>,
    ) -> Result<Peer> {
        let port = free_port(LO);
        let name = format!("nginx-{threads}");
        let prefix = dir.join(&name);
        std::fs::create_dir_all(&prefix)?;
        let module = tool(
            "SHARDGATE_NGINX_STREAM_MODULE",
            "/usr/lib/nginx/modules/ngx_stream_module.so",
        )?;
        let tls_port = tls.map(|files| (free_port(LO), files));
        let tls_server = tls_port.map_or(String::new(), |(p, files)| {
            format!(
                "  server {{\n    listen 127.0.0.1:{p} ssl;\n    ssl_certificate {};\n    \
                 ssl_certificate_key {};\n    proxy_pass {backend};\n    proxy_timeout 1h;\n  }}\n",
                files.cert.display(),
                files.key.display()
            )
        });
        let conf = prefix.join("nginx.conf");
        std::fs::write(
            &conf,
            format!(
                "load_module {module};\ndaemon off;\nmaster_process on;\nworker_processes {threads};\n\
                 worker_rlimit_nofile {nofile};\npid {pid};\nerror_log {err} warn;\n\
                 events {{ worker_connections {wc}; }}\n\
                 stream {{\n  server {{\n    listen 127.0.0.1:{port};\n    proxy_pass {backend};\n    \
                 proxy_timeout 1h;\n  }}\n{tls_server}}}\n",
                module = module.display(),
                nofile = conns * 2 + 200,
                wc = conns * 2 + 100,
                pid = prefix.join("nginx.pid").display(),
                err = prefix.join("error.log").display(),
            ),
        )?;
        let mut cmd = Command::new(tool("SHARDGATE_NGINX", "/usr/sbin/nginx")?);
        cmd.arg("-p")
            .arg(&prefix)
            .arg("-c")
            .arg(&conf)
            .arg("-e")
            .arg(prefix.join("error.log"));
        let mut peer = Peer::spawn(dir, &name, cmd, Kind::Nginx, threads, port)?;
        peer.serve_tls(tls_port.map(|(p, _)| p), tls)?;
        Ok(peer)
    }

    /// Traefik v3, file provider, one TCP router `HostSNI(`*`)` (what a Gateway API TCPRoute
    /// becomes), `GOMAXPROCS=threads`.
    pub fn traefik(dir: &Path, backend: SocketAddr, threads: u8) -> Result<Peer> {
        let port = free_port(LO);
        let name = format!("traefik-{threads}");
        let dynamic = dir.join(format!("{name}-dynamic.yml"));
        std::fs::write(
            &dynamic,
            format!(
                "tcp:\n  routers:\n    valkey:\n      entryPoints: [valkey]\n      rule: \"HostSNI(`*`)\"\n      \
                 service: valkey\n  services:\n    valkey:\n      loadBalancer:\n        servers:\n          \
                 - address: \"{backend}\"\n"
            ),
        )?;
        let stat = dir.join(format!("{name}.yml"));
        // No version check or usage report: the run sends nothing off loopback.
        std::fs::write(
            &stat,
            format!(
                "global:\n  checkNewVersion: false\n  sendAnonymousUsage: false\n\
                 log:\n  level: ERROR\n\
                 entryPoints:\n  valkey:\n    address: \"127.0.0.1:{port}\"\n    transport:\n      \
                 respondingTimeouts:\n        readTimeout: 0\n        idleTimeout: 0\n\
                 providers:\n  file:\n    filename: \"{}\"\n",
                dynamic.display()
            ),
        )?;
        let mut cmd = Command::new(tool("SHARDGATE_TRAEFIK", "traefik")?);
        cmd.arg(format!("--configFile={}", stat.display()))
            .env("GOMAXPROCS", threads.to_string());
        Peer::spawn(dir, &name, cmd, Kind::Traefik, threads, port)
    }

    fn spawn(
        dir: &Path,
        name: &str,
        mut cmd: Command,
        kind: Kind,
        threads: u8,
        port: u16,
    ) -> Result<Peer> {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log)?;
        let child = cmd
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let mut peer = Peer {
            kind,
            threads,
            addr: SocketAddr::from((LO, port)),
            entries: Vec::new(),
            tls: None,
            proc: Some(ProcTree { root: child.id() }),
            child: Some(child),
            log: Some(log),
        };
        peer.wait_serving(Duration::from_secs(60))?;
        Ok(peer)
    }

    /// Waits until a PING through the peer is answered (listener bound, route loaded).
    fn wait_serving(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if ping(self.addr).is_ok() {
                return Ok(());
            }
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                bail!(
                    "{} exited ({status}); log:\n{}",
                    self.name(),
                    self.log_text()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "{} does not answer PING on {} after {timeout:?}; log:\n{}",
                    self.name(),
                    self.addr,
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Notes the TLS listener on `port`, once a PING over TLS through it is answered.
    fn serve_tls(&mut self, port: Option<u16>, files: Option<&TlsFiles>) -> Result<()> {
        let (Some(port), Some(files)) = (port, files) else {
            return Ok(());
        };
        let addr = SocketAddr::from((LO, port));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match files
                .connect(addr)
                .and_then(|mut s| crate::tls::ping(&mut s))
            {
                Ok(()) => break,
                Err(e) if Instant::now() > deadline => {
                    bail!(
                        "{} does not answer PING over TLS on {addr}: {e:#}; log:\n{}",
                        self.name(),
                        self.log_text()
                    )
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        self.tls = Some(addr);
        Ok(())
    }

    fn log_text(&self) -> String {
        self.log
            .as_ref()
            .and_then(|l| std::fs::read_to_string(l).ok())
            .unwrap_or_default()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let Some(child) = self.child.as_mut() else {
            return;
        };
        // SIGTERM first: nginx's master then stops its workers, which SIGKILL would orphan.
        if let Some(pid) = Pid::from_raw(child.id() as i32) {
            let _ = kill_process(pid, Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Where shardgate's routes point.
pub enum RouteSpec<'a> {
    Standalone(SocketAddr),
    Cluster(&'a shardgate_harness::valkey::ValkeyCluster),
}

/// PING → +PONG on a fresh connection.
pub fn ping(addr: SocketAddr) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(b"PING\r\n")?;
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf)?;
    if &buf != b"+PONG\r\n" {
        bail!(
            "unexpected answer to PING: {:?}",
            String::from_utf8_lossy(&buf)
        );
    }
    Ok(())
}

/// A program that `scripts/setup` installs: `$env`, else `default` (an absolute path or a
/// name on PATH).
pub fn tool(env: &str, default: &str) -> Result<PathBuf> {
    if let Some(v) = std::env::var_os(env).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        if !p.is_file() {
            bail!(
                "{env} is set to {}, which does not exist: run `scripts/setup`, then \
                 `. ~/.cache/shardgate/env.sh`",
                p.display()
            );
        }
        return Ok(p);
    }
    let found = if default.contains('/') {
        Some(PathBuf::from(default)).filter(|p| p.is_file())
    } else {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join(default))
                .find(|p| p.is_file())
        })
    };
    found.with_context(|| {
        format!(
            "{default} not found and {env} is not set: run `scripts/setup` (it installs it and \
             writes ~/.cache/shardgate/env.sh), then `. ~/.cache/shardgate/env.sh`"
        )
    })
}
