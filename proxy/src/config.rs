//! The proxy's resolved configuration, built from the contracts crate's [`ProxySettings`]
//! (the command line, whose defaults are the only ones): flags that need each other are
//! checked here, and limits are clamped here, once.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use shardgate_crds::settings::{defaults, TlsBackend, TlsMode};
use shardgate_crds::{Hostnames, ProxySettings};

use crate::model::Backend;

// The types of the configuration's fields, public here whatever else the crate keeps.
pub use crate::dial::tls::{BackendName, Identity};
pub use crate::dial::BackendTlsConfig;
pub use crate::rewrite::stream::Limits;
pub use crate::tls::certs::CertFiles;
pub use crate::tls::DetectLimits;

/// The TLS port: one port for every node, routed by SNI name.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    pub port: u16,
    /// The names routed: `<prefix>-<s>-<n>.<domain>`, `<prefix>-<s>.<domain>`,
    /// `<prefix>.<domain>`.
    pub names: Hostnames,
    pub mode: TlsModeConfig,
    /// The ClientHello's timeout and byte cap.
    pub detect: DetectLimits,
}

/// Passthrough or termination.
#[derive(Debug, Clone)]
pub enum TlsModeConfig {
    /// The TLS stream goes to the node untouched; the nodes speak TLS.
    Passthrough,
    /// The proxy terminates TLS with `files`, polled for changes every `reload`.
    Terminate { files: CertFiles, reload: Duration },
}

/// Where the route table comes from.
#[derive(Debug, Clone)]
pub enum SourceConfig {
    /// A YAML route file, polled for changes.
    File { path: PathBuf, poll: Duration },
    /// Seed nodes asked for `CLUSTER SHARDS`.
    Seed {
        seeds: Vec<Backend>,
        base_port: u16,
        ports_per_shard: Option<u32>,
        refresh: Duration,
    },
    /// The pods of a ValkeyCluster, watched on the Kubernetes API (feature `kubernetes`).
    Kubernetes {
        namespace: String,
        cluster: String,
        /// A label selector ANDed with the cluster's.
        selector: Option<String>,
        base_port: u16,
        ports_per_shard: Option<u32>,
        /// How often the nodes are asked again for their ids and roles.
        refresh: Duration,
        /// How often the API server ends the pod watch (`shardgate_crds::api_watch`).
        watch: Duration,
    },
}

/// Everything the proxy needs to run.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub source: SourceConfig,
    /// The address every node listener binds.
    pub listen_ip: IpAddr,
    /// `/metrics`, `/healthz`, `/readyz`, `/routes`; `None` to serve none.
    pub admin_addr: Option<SocketAddr>,
    /// Open client connections at most; more are closed at once and counted.
    pub max_connections: usize,
    /// A connection with no bytes either way for this long is closed; `None`: never.
    pub idle_timeout: Option<Duration>,
    /// Resolving and connecting to a backend, in all.
    pub connect_timeout: Duration,
    /// On shutdown, how long connections in flight may go on before they are closed.
    pub drain_timeout: Duration,
    /// Bytes buffered per direction per connection (the back-pressure bound).
    pub buffer_size: usize,
    /// Rewrite topology on listeners whose source does not say otherwise.
    pub rewrite: bool,
    /// The host (IP or DNS name) external clients reach the proxy at: the address that
    /// rewritten replies hand out. Needed by rewriting listeners.
    pub advertise_host: Option<String>,
    /// Also rewrite ROLE and INFO replication (on by default with rewriting).
    pub rewrite_info: bool,
    /// Limits of rewriting connections.
    pub limits: Limits,
    /// The TLS port, if any.
    pub tls: Option<TlsConfig>,
    /// The legs to the nodes: from the node ports, from a terminating TLS port, and
    /// discovery's.
    pub backend_tls: BackendTlsConfig,
    /// How often the backend TLS files are checked for changes.
    pub backend_tls_reload: Duration,
    /// TLS port connections still reading their hello or in the handshake, at most: a
    /// budget of their own, so that slow hellos cannot take the connections the node ports
    /// need. A connection takes one of `max_connections` once its handshake is done.
    pub tls_max_handshakes: usize,
    /// Of those, from one client IP address at most; 0: no limit per address.
    pub tls_max_handshakes_per_source: usize,
}

/// Settings that contradict each other. The message names the flags.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("one of --routes, --seed or --kubernetes is required")]
    NoSource,
    #[error("--routes, --seed and --kubernetes exclude each other: give one")]
    SeveralSources,
    #[error("--seed needs --base-port")]
    SeedWithoutBasePort,
    #[error("--kubernetes needs --base-port")]
    KubernetesWithoutBasePort,
    #[error("--kubernetes: {0}")]
    BadKubernetesTarget(String),
    #[error(
        "--kubernetes: this shardgate-proxy was built without its `kubernetes` feature \
         (build it with default features, or give the routes with --routes or --seed)"
    )]
    KubernetesNotBuilt,
    #[error("{0} needs --tls-port")]
    NeedsTlsPort(&'static str),
    #[error(
        "{0} is for --tls-mode terminate; in passthrough mode the nodes hold the certificates"
    )]
    TerminateOnly(&'static str),
    #[error("--tls-mode terminate needs --tls-cert and --tls-key (or use --tls-mode passthrough)")]
    NoCertificate,
    #[error("--tls-backend tls needs --tls-backend-ca")]
    NoBackendCa,
    #[error("{0} is for --tls-backend tls")]
    BackendTlsOnly(&'static str),
    #[error(
        "--tls-backend tls needs a name to check on the nodes' certificates: \
         --tls-backend-name, --tls-backend-chain-only, or --tls-port with its SNI names"
    )]
    NoBackendName,
    #[error("--tls-backend-cert and --tls-backend-key go together")]
    HalfAnIdentity,
    #[error("--tls-backend-name {0:?}: not a DNS name or an IP address")]
    BadBackendName(String),
}

impl ProxyConfig {
    /// The configuration `settings` describe.
    pub fn from_settings(settings: &ProxySettings) -> Result<Self, ConfigError> {
        // The command line refuses this too; settings built in code are checked here.
        let given = [
            settings.routes.is_some(),
            !settings.seed.is_empty(),
            settings.kubernetes.is_some(),
        ];
        if given.iter().filter(|g| **g).count() > 1 {
            return Err(ConfigError::SeveralSources);
        }
        let source = if let Some(target) = &settings.kubernetes {
            if !cfg!(feature = "kubernetes") {
                return Err(ConfigError::KubernetesNotBuilt);
            }
            let (namespace, cluster) = shardgate_crds::settings::namespace_and_cluster(target)
                .map_err(ConfigError::BadKubernetesTarget)?;
            SourceConfig::Kubernetes {
                namespace: namespace.to_string(),
                cluster: cluster.to_string(),
                selector: settings.kube_selector.clone(),
                base_port: settings
                    .base_port
                    .ok_or(ConfigError::KubernetesWithoutBasePort)?,
                ports_per_shard: settings.ports_per_shard,
                refresh: *settings.refresh,
                watch: *settings.kube_watch_timeout,
            }
        } else {
            match (
                &settings.routes,
                settings.seed.is_empty(),
                settings.base_port,
            ) {
                (Some(path), _, _) => SourceConfig::File {
                    path: path.clone(),
                    poll: *settings.routes_poll,
                },
                (None, false, Some(base_port)) => SourceConfig::Seed {
                    seeds: settings.seed.clone(),
                    base_port,
                    ports_per_shard: settings.ports_per_shard,
                    refresh: *settings.refresh,
                },
                (None, false, None) => return Err(ConfigError::SeedWithoutBasePort),
                (None, true, _) => return Err(ConfigError::NoSource),
            }
        };
        let idle = *settings.idle_timeout;
        Ok(ProxyConfig {
            source,
            listen_ip: settings.listen_ip,
            admin_addr: settings.admin_addr.0,
            max_connections: settings.max_connections,
            idle_timeout: (!idle.is_zero()).then_some(idle),
            connect_timeout: *settings.connect_timeout,
            drain_timeout: *settings.drain_timeout,
            buffer_size: settings.buffer_size,
            rewrite: settings.rewrite,
            advertise_host: settings.advertise_host.clone(),
            rewrite_info: !settings.no_rewrite_info,
            limits: Limits {
                max_frame: settings.max_frame,
                ..Limits::default()
            },
            tls: tls_config(settings)?,
            backend_tls: backend_tls_config(settings)?,
            backend_tls_reload: *settings.tls_reload,
            tls_max_handshakes: settings.tls_max_handshakes,
            tls_max_handshakes_per_source: settings.tls_max_handshakes_per_source,
        })
    }

    /// Every setting at its default, routes from `source`.
    pub fn new(source: SourceConfig) -> Self {
        let settings = match &source {
            SourceConfig::File { path, .. } => ProxySettings::with_routes(path),
            SourceConfig::Seed {
                seeds, base_port, ..
            } => ProxySettings::with_seeds(seeds.clone(), *base_port),
            // The settings only pick the defaults of the other fields: a file source's will
            // do, and hold without the `kubernetes` feature too.
            SourceConfig::Kubernetes { .. } => ProxySettings::with_routes("-"),
        };
        match Self::from_settings(&settings) {
            Ok(config) => ProxyConfig { source, ..config },
            Err(e) => unreachable!("the default settings with a source are valid: {e}"),
        }
    }

    /// The limits the proxy runs with: whatever was asked, within what works. The one place
    /// limits are clamped.
    pub fn clamped(mut self) -> Self {
        self.buffer_size = self.buffer_size.max(defaults::MIN_BUFFER_SIZE);
        // Semaphore::new panics past MAX_PERMITS; no machine holds that many sockets anyway.
        self.max_connections = self
            .max_connections
            .min(tokio::sync::Semaphore::MAX_PERMITS);
        self.tls_max_handshakes = self
            .tls_max_handshakes
            .clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        if let Some(tls) = &mut self.tls {
            tls.detect.max_bytes = tls.detect.max_bytes.max(defaults::MIN_TLS_MAX_HELLO);
        }
        self
    }
}

/// The TLS port's settings, checked for flags that need each other.
fn tls_config(s: &ProxySettings) -> Result<Option<TlsConfig>, ConfigError> {
    let Some(port) = s.tls_port else {
        for (set, flag) in [
            (s.tls_cert.is_some(), "--tls-cert"),
            (s.tls_key.is_some(), "--tls-key"),
            (s.tls_client_ca.is_some(), "--tls-client-ca"),
        ] {
            if set {
                return Err(ConfigError::NeedsTlsPort(flag));
            }
        }
        return Ok(None);
    };
    let names = Hostnames {
        prefix: s.sni_prefix.clone().unwrap_or_default(),
        domain: s.sni_domain.clone().unwrap_or_default(),
    };
    let mode = match s.tls_mode {
        TlsMode::Passthrough => {
            for (set, flag) in [
                (s.tls_cert.is_some(), "--tls-cert"),
                (s.tls_key.is_some(), "--tls-key"),
                (s.tls_client_ca.is_some(), "--tls-client-ca"),
            ] {
                if set {
                    return Err(ConfigError::TerminateOnly(flag));
                }
            }
            TlsModeConfig::Passthrough
        }
        TlsMode::Terminate => {
            let (Some(cert), Some(key)) = (s.tls_cert.clone(), s.tls_key.clone()) else {
                return Err(ConfigError::NoCertificate);
            };
            TlsModeConfig::Terminate {
                files: CertFiles {
                    cert,
                    key,
                    client_ca: s.tls_client_ca.clone(),
                },
                reload: *s.tls_reload,
            }
        }
    };
    Ok(Some(TlsConfig {
        port,
        names,
        mode,
        detect: DetectLimits {
            timeout: *s.tls_hello_timeout,
            max_bytes: s.tls_max_hello,
        },
    }))
}

/// The legs to the nodes, checked for flags that need each other.
fn backend_tls_config(s: &ProxySettings) -> Result<BackendTlsConfig, ConfigError> {
    if s.tls_backend == TlsBackend::Plain {
        for (set, flag) in [
            (s.tls_backend_ca.is_some(), "--tls-backend-ca"),
            (s.tls_backend_name.is_some(), "--tls-backend-name"),
            (s.tls_backend_chain_only, "--tls-backend-chain-only"),
            (s.tls_backend_cert.is_some(), "--tls-backend-cert"),
            (s.tls_backend_key.is_some(), "--tls-backend-key"),
        ] {
            if set {
                return Err(ConfigError::BackendTlsOnly(flag));
            }
        }
        return Ok(BackendTlsConfig::Plain);
    }
    let ca = s.tls_backend_ca.clone().ok_or(ConfigError::NoBackendCa)?;
    // clap refuses a name with --tls-backend-chain-only; settings built in code are checked
    // here in the same order: a name given is checked.
    let name = match (&s.tls_backend_name, s.tls_backend_chain_only, s.tls_port) {
        (Some(n), _, _) => {
            rustls_pki_types::ServerName::try_from(n.as_str())
                .map_err(|_| ConfigError::BadBackendName(n.clone()))?;
            BackendName::Fixed(n.clone())
        }
        (None, true, _) => BackendName::ChainOnly,
        (None, false, Some(_)) => BackendName::Sni(Hostnames {
            prefix: s.sni_prefix.clone().unwrap_or_default(),
            domain: s.sni_domain.clone().unwrap_or_default(),
        }),
        (None, false, None) => return Err(ConfigError::NoBackendName),
    };
    let identity = match (&s.tls_backend_cert, &s.tls_backend_key) {
        (Some(cert), Some(key)) => Some(Identity {
            cert: cert.clone(),
            key: key.clone(),
        }),
        (None, None) => None,
        _ => return Err(ConfigError::HalfAnIdentity),
    };
    Ok(BackendTlsConfig::Tls { ca, name, identity })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn config(args: &[&str]) -> Result<ProxyConfig, ConfigError> {
        let settings = ProxySettings::try_parse_from(
            std::iter::once("shardgate-proxy").chain(args.iter().copied()),
        )
        .unwrap();
        ProxyConfig::from_settings(&settings)
    }

    #[test]
    fn flags_that_need_each_other_are_named() {
        for (args, want) in [
            (
                &["--routes", "r", "--tls-cert", "c"][..],
                "--tls-cert needs --tls-port",
            ),
            (
                &[
                    "--routes",
                    "r",
                    "--tls-port",
                    "6380",
                    "--sni-prefix",
                    "vc",
                    "--sni-domain",
                    "d",
                    "--tls-mode",
                    "passthrough",
                    "--tls-key",
                    "k",
                ][..],
                "--tls-key is for --tls-mode terminate",
            ),
            (
                &[
                    "--routes",
                    "r",
                    "--tls-port",
                    "6380",
                    "--sni-prefix",
                    "vc",
                    "--sni-domain",
                    "d",
                ][..],
                "--tls-mode terminate needs --tls-cert and --tls-key",
            ),
            (
                &["--routes", "r", "--tls-backend-ca", "ca"][..],
                "--tls-backend-ca is for --tls-backend tls",
            ),
            (
                &["--routes", "r", "--tls-backend-chain-only"][..],
                "--tls-backend-chain-only is for --tls-backend tls",
            ),
            (
                &[
                    "--routes",
                    "r",
                    "--tls-backend",
                    "tls",
                    "--tls-backend-chain-only",
                ][..],
                "--tls-backend tls needs --tls-backend-ca",
            ),
            (
                // Without a TLS port there are no SNI names to check.
                &[
                    "--routes",
                    "r",
                    "--tls-backend",
                    "tls",
                    "--tls-backend-ca",
                    "ca",
                ][..],
                "--tls-backend tls needs a name to check",
            ),
        ] {
            let err = config(args).unwrap_err().to_string();
            assert!(err.contains(want), "{args:?}: {err}");
        }
    }

    #[test]
    fn the_legs_to_the_nodes_check_the_name_asked_for() {
        let tls = [
            "--routes",
            "r",
            "--tls-backend",
            "tls",
            "--tls-backend-ca",
            "ca",
        ];
        let backend = |extra: &[&str]| {
            let args: Vec<&str> = tls.iter().chain(extra).copied().collect();
            config(&args).map(|c| c.backend_tls)
        };
        let name = |c: BackendTlsConfig| match c {
            BackendTlsConfig::Tls { name, .. } => name,
            BackendTlsConfig::Plain => panic!("plain"),
        };
        assert_eq!(
            name(backend(&["--tls-backend-chain-only"]).unwrap()),
            BackendName::ChainOnly
        );
        assert_eq!(
            name(backend(&["--tls-backend-name", "valkey.internal"]).unwrap()),
            BackendName::Fixed("valkey.internal".into())
        );
        assert_eq!(
            backend(&["--tls-backend-name", "not a name"]).unwrap_err(),
            ConfigError::BadBackendName("not a name".into())
        );
        let sni = [
            "--tls-port",
            "6380",
            "--sni-prefix",
            "vc",
            "--sni-domain",
            "d.test",
            "--tls-mode",
            "passthrough",
        ];
        assert_eq!(
            name(backend(&sni).unwrap()),
            BackendName::Sni(Hostnames {
                prefix: "vc".into(),
                domain: "d.test".into()
            })
        );
        // Both: clap refuses them together.
        let both = ["--tls-backend-chain-only", "--tls-backend-name", "n"];
        let args: Vec<&str> = tls.iter().chain(&both).copied().collect();
        assert!(
            ProxySettings::try_parse_from(std::iter::once("shardgate-proxy").chain(args)).is_err()
        );
        // A client certificate: both files, or neither.
        let with_cert = [
            "--tls-backend-chain-only",
            "--tls-backend-cert",
            "c",
            "--tls-backend-key",
            "k",
        ];
        match backend(&with_cert).unwrap() {
            BackendTlsConfig::Tls { identity, .. } => assert_eq!(
                identity,
                Some(Identity {
                    cert: "c".into(),
                    key: "k".into()
                })
            ),
            BackendTlsConfig::Plain => panic!("plain"),
        }
        let half = ["--tls-backend-chain-only", "--tls-backend-cert", "c"];
        let args: Vec<&str> = tls.iter().chain(&half).copied().collect();
        assert!(
            ProxySettings::try_parse_from(std::iter::once("shardgate-proxy").chain(args)).is_err()
        );
        let mut settings = ProxySettings::try_parse_from(
            std::iter::once("shardgate-proxy")
                .chain(tls)
                .chain(["--tls-backend-chain-only"]),
        )
        .unwrap();
        settings.tls_backend_key = Some("k".into());
        assert_eq!(
            ProxyConfig::from_settings(&settings).unwrap_err(),
            ConfigError::HalfAnIdentity
        );
    }

    #[test]
    fn the_kubernetes_source_takes_the_seed_flags_it_shares() {
        let c = config(&[
            "--kubernetes",
            "valkey/vc",
            "--kube-selector",
            "zone=a",
            "--base-port",
            "31000",
            "--ports-per-shard",
            "2",
            "--refresh",
            "3s",
            "--kube-watch-timeout",
            "4s",
        ]);
        let both = ProxySettings {
            routes: Some("r".into()),
            ..ProxySettings::with_kubernetes("valkey", "vc", 31000)
        };
        assert_eq!(
            ProxyConfig::from_settings(&both).unwrap_err(),
            ConfigError::SeveralSources
        );
        if cfg!(feature = "kubernetes") {
            let SourceConfig::Kubernetes {
                namespace,
                cluster,
                selector,
                base_port,
                ports_per_shard,
                refresh,
                watch,
            } = c.unwrap().source
            else {
                panic!("not the Kubernetes source");
            };
            assert_eq!((namespace.as_str(), cluster.as_str()), ("valkey", "vc"));
            assert_eq!(selector.as_deref(), Some("zone=a"));
            assert_eq!((base_port, ports_per_shard), (31000, Some(2)));
            assert_eq!(refresh, Duration::from_secs(3));
            assert_eq!(watch, Duration::from_secs(4));
        } else {
            let err = c.unwrap_err().to_string();
            assert!(err.contains("without its `kubernetes` feature"), "{err}");
        }
    }

    #[test]
    fn an_idle_timeout_of_zero_is_never_and_limits_are_clamped() {
        let c = config(&[
            "--routes",
            "r",
            "--idle-timeout",
            "0s",
            "--buffer-size",
            "3",
        ])
        .unwrap();
        assert_eq!(c.idle_timeout, None);
        assert_eq!(c.buffer_size, 3);
        assert_eq!(c.clamped().buffer_size, 512);
    }

    #[test]
    fn new_takes_the_settings_defaults() {
        let c = ProxyConfig::new(SourceConfig::File {
            path: "r".into(),
            poll: Duration::from_millis(7),
        });
        assert_eq!(c.connect_timeout, Duration::from_secs(5));
        assert_eq!(c.admin_addr, Some("0.0.0.0:9090".parse().unwrap()));
        assert!(
            matches!(c.source, SourceConfig::File { poll, .. } if poll == Duration::from_millis(7))
        );
    }
}
