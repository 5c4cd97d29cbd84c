//! A real Gateway API data plane for the tests: Traefik's Kubernetes Gateway provider
//! (`scripts/setup-traefik` builds it), run out of cluster against the control plane's API
//! server.
//!
//! Traefik serves a Gateway listener on the static entry point whose address ends with the
//! listener's port, so [`Traefik::start`] takes one `(name, port)` per listener port, all on
//! one loopback IP, which it also writes into every Gateway's `status.addresses` (or, with
//! [`StatusAddress::Service`], the ingress of a LoadBalancer Service in front of it). Routes reach
//! pod IPs through EndpointSlices, which the harness's node agent keeps pointing at its
//! loopback pods.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use shardgate_harness::addr::{free_port, node_ip};
use shardgate_harness::tools;

use super::process::Daemon;
use super::ControlPlane;

/// The GatewayClass `spec.controllerName` that Traefik serves.
pub const TRAEFIK_CONTROLLER_NAME: &str = "traefik.io/gateway-controller";
/// Generous: on two busy cores a 245 MB Go binary takes a few seconds to load and start.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// The entry point of Traefik's `/ping`, the readiness signal.
const PING_ENTRY_POINT: &str = "harnessping";

/// The Traefik binary that `scripts/setup` caches: `$SHARDGATE_TRAEFIK`, else the newest
/// `<cache>/traefik-*/bin/traefik`.
pub fn traefik_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("SHARDGATE_TRAEFIK").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(path);
        if is_executable(&path) {
            return Ok(path);
        }
        bail!(
            "SHARDGATE_TRAEFIK is set to {}, which is not an executable file; run \
             `scripts/setup` and then `. ~/.cache/shardgate/env.sh`",
            path.display()
        );
    }
    let cache = tools::cache_dir().context("the cache directory is unknown (HOME is not set)")?;
    let mut found: Vec<(Vec<u64>, PathBuf)> = std::fs::read_dir(&cache)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    let version = name.strip_prefix("traefik-")?;
                    // `traefik-<ver>.partial` is a build in progress or one that failed.
                    if version.ends_with(".partial") {
                        return None;
                    }
                    let bin = e.path().join("bin").join("traefik");
                    is_executable(&bin).then(|| (version_key(version), bin))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.pop().map(|(_, bin)| bin).with_context(|| {
        format!(
            "traefik is not found: SHARDGATE_TRAEFIK is not set and there is no \
             {}/traefik-*/bin/traefik. Run `scripts/setup`",
            cache.display()
        )
    })
}

/// A fresh loopback IP (in `127.0.0.0/8`) on which every port in `ports` is free now, from
/// the allocator that gives pods and LoadBalancer Services their IPs, so it collides with
/// none of them nor with another test binary's.
pub fn free_loopback_ip(ports: &[u16]) -> Result<IpAddr> {
    Ok(IpAddr::V4(node_ip(ports)?))
}

/// What Traefik writes into every Gateway's `status.addresses`.
#[derive(Clone, Debug)]
pub enum StatusAddress {
    /// Its own IP, where its entry points listen: clients reach it directly.
    Own,
    /// The ingress of the LoadBalancer Service `namespace/name` in front of it, as Traefik
    /// is deployed in a cluster (`statusAddress.service`): clients reach it through that
    /// Service, and so through the harness's LoadBalancer relay.
    Service { namespace: String, name: String },
}

/// A running Traefik; killed on drop.
pub struct Traefik {
    ip: IpAddr,
    entry_points: Vec<(String, u16)>,
    ping: SocketAddr,
    daemon: Daemon,
}

impl Traefik {
    /// Starts Traefik with the Kubernetes Gateway provider (experimental channel: TCPRoute,
    /// TLSRoute) watching every namespace, and waits until it serves. See
    /// [`Traefik::start_in`].
    pub async fn start(
        cp: &ControlPlane,
        ip: IpAddr,
        entry_points: &[(String, u16)],
    ) -> Result<Traefik> {
        Self::start_in(cp, &[], ip, entry_points).await
    }

    /// Starts Traefik with the Kubernetes Gateway provider watching `namespaces` (every
    /// namespace if empty), one TCP entry point `<name>` at `ip:<port>` per `entry_points`
    /// element, and `ip` as every Gateway's status address; waits until it serves.
    ///
    /// Tests sharing a control plane should name their namespace: Traefik takes every
    /// Gateway whose GatewayClass has [`TRAEFIK_CONTROLLER_NAME`], so two instances watching
    /// everything would overwrite each other's Gateway status. GatewayClasses are
    /// cluster-scoped and seen by all instances.
    pub async fn start_in(
        cp: &ControlPlane,
        namespaces: &[&str],
        ip: IpAddr,
        entry_points: &[(String, u16)],
    ) -> Result<Traefik> {
        Self::start_with(cp, namespaces, ip, entry_points, &StatusAddress::Own).await
    }

    /// As [`Traefik::start_in`], with `status` as the Gateways' status address.
    pub async fn start_with(
        cp: &ControlPlane,
        namespaces: &[&str],
        ip: IpAddr,
        entry_points: &[(String, u16)],
        status: &StatusAddress,
    ) -> Result<Traefik> {
        let bin = traefik_binary()?;
        // Traefik looks the Service up among what it watches: one elsewhere would leave it
        // with no Gateway address, and so with no configuration at all.
        if let StatusAddress::Service { namespace, .. } = status {
            ensure!(
                namespaces.is_empty() || namespaces.contains(&namespace.as_str()),
                "the status Service's namespace {namespace} is not among those Traefik \
                 watches ({namespaces:?})"
            );
        }
        let IpAddr::V4(ip4) = ip else {
            bail!("Traefik's IP {ip} is not IPv4: tests listen in 127.0.0.0/8 only");
        };
        ensure!(
            ip4.is_loopback(),
            "Traefik's IP {ip} is not in 127.0.0.0/8: tests listen on loopback only"
        );
        ensure!(!entry_points.is_empty(), "Traefik needs an entry point");
        for (name, port) in entry_points {
            ensure!(
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric()),
                "entry point name {name:?}: use ASCII letters and digits (it is a flag key)"
            );
            ensure!(
                !name.eq_ignore_ascii_case(PING_ENTRY_POINT),
                "entry point name {name:?} is the harness's ping entry point"
            );
            ensure!(
                entry_points.iter().filter(|(_, p)| p == port).count() == 1,
                "port {port} is given twice: Traefik matches a Gateway listener to the entry \
                 point with its port"
            );
        }
        let ping = SocketAddr::from((ip4, ping_port(ip4, entry_points)));

        // Its files next to the control plane's, named by its IP (unique per instance); the
        // log path on the command line carries the harness marker.
        let dir = cp.root().join(format!("traefik-{ip}"));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let log = cp.root().join(format!("traefik-{ip}.log"));

        let mut cmd = Command::new(&bin);
        cmd.current_dir(&dir)
            .env("KUBECONFIG", cp.kubeconfig())
            // In-cluster detection wins over KUBECONFIG in Traefik: make sure it is off.
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("KUBERNETES_SERVICE_PORT")
            // Two cores: keep it from spreading over more threads than that.
            .env("GOMAXPROCS", "2")
            .arg(format!("--log.filePath={}", log.display()))
            .arg("--log.level=INFO")
            // No internet here: no version check, no usage reports.
            .arg("--global.checkNewVersion=false")
            .arg("--global.sendAnonymousUsage=false")
            .arg("--providers.kubernetesgateway=true")
            .arg("--providers.kubernetesgateway.experimentalchannel=true")
            .arg("--ping=true")
            .arg(format!("--ping.entryPoint={PING_ENTRY_POINT}"))
            .arg(format!("--entryPoints.{PING_ENTRY_POINT}.address={ping}"));
        match status {
            StatusAddress::Own => {
                cmd.arg(format!(
                    "--providers.kubernetesgateway.statusaddress.ip={ip}"
                ));
            }
            StatusAddress::Service { namespace, name } => {
                cmd.arg(format!(
                    "--providers.kubernetesgateway.statusaddress.service.namespace={namespace}"
                ))
                .arg(format!(
                    "--providers.kubernetesgateway.statusaddress.service.name={name}"
                ));
            }
        }
        if !namespaces.is_empty() {
            cmd.arg(format!(
                "--providers.kubernetesgateway.namespaces={}",
                namespaces.join(",")
            ));
        }
        for (name, port) in entry_points {
            cmd.arg(format!("--entryPoints.{name}.address={ip}:{port}"));
        }
        // stdout and stderr (a panic, a fatal error before its logger is set up) go to the
        // same file as its log; both append.
        let daemon = Daemon::spawn("traefik", cmd, &log)?;
        let traefik = Traefik {
            ip,
            entry_points: entry_points.to_vec(),
            ping,
            daemon,
        };
        traefik.wait_ready().await?;
        tracing::info!(
            "traefik up at {ip} (entry points {:?}), log {}",
            traefik.entry_points,
            log.display()
        );
        Ok(traefik)
    }

    /// `/ping` answering `OK`: the entry points are bound (Traefik binds them all before it
    /// serves any) and its providers started. The Gateway provider may still be syncing: wait
    /// for the Gateway's status.
    async fn wait_ready(&self) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        let ping = self.ping;
        loop {
            self.daemon
                .check_running()
                .context("traefik exited while starting")?;
            // A blocking GET with short timeouts, off the runtime's workers.
            let got =
                tokio::task::spawn_blocking(move || shardgate_harness::http::get(ping, "/ping"))
                    .await
                    .context("the ping task")?;
            let last = match got {
                Ok((200, body)) if body.trim() == "OK" => return Ok(()),
                Ok((status, body)) => format!("HTTP {status}: {body:?}"),
                Err(e) => format!("{e:#}"),
            };
            if Instant::now() > deadline {
                bail!(
                    "traefik not serving /ping at {ping} after {START_TIMEOUT:?} (last: {last}); \
                     last lines of {}:\n{}",
                    self.daemon.log_path().display(),
                    self.daemon.log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The IP of its entry points; the Gateways' status address too, unless it was started
    /// behind a Service ([`StatusAddress::Service`]).
    pub fn ip(&self) -> IpAddr {
        self.ip
    }

    /// The address of the entry point serving Gateway listeners on `port`.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip, port)
    }

    /// The entry points it was started with.
    pub fn entry_points(&self) -> &[(String, u16)] {
        &self.entry_points
    }

    /// Its log file (stdout, stderr and Traefik's own log).
    pub fn log_path(&self) -> &Path {
        self.daemon.log_path()
    }

    /// The last `n` lines of its log, for error messages.
    pub fn log_tail(&self, n: usize) -> String {
        self.daemon.log_tail(n)
    }

    /// An error with the tail of its log if it has exited.
    pub fn check_running(&self) -> Result<()> {
        self.daemon.check_running()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }
}

/// A port for `/ping` that is free on `ip` and is none of the entry points' (Traefik matches
/// listener ports by address suffix, so a Gateway listener on it would land on ping).
fn ping_port(ip: Ipv4Addr, entry_points: &[(String, u16)]) -> u16 {
    loop {
        let port = free_port(ip);
        if entry_points.iter().all(|(_, p)| *p != port) {
            return port;
        }
    }
}

/// `3.6.12` -> `[3, 6, 12]`: orders the versions `scripts/setup-traefik` caches.
fn version_key(version: &str) -> Vec<u64> {
    version
        .split(|c: char| !c.is_ascii_digit())
        .filter(|part| !part.is_empty())
        .filter_map(|part| part.parse().ok())
        .collect()
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_order_numerically() {
        let mut v = vec![
            version_key("3.10.0"),
            version_key("3.6.12"),
            version_key("3.6.2"),
        ];
        v.sort();
        assert_eq!(v, vec![vec![3, 6, 2], vec![3, 6, 12], vec![3, 10, 0]]);
    }
}
