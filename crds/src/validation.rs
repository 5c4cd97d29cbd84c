//! Validation of a `ValkeyCluster`, written twice: once as the API server enforces it (the
//! CEL rules below, put into the CRD by the derive in `valkey_cluster.rs`, next to the
//! schema's bounds and patterns), and once in Rust ([`ValkeyClusterSpec::validate`] and
//! [`ValkeyClusterSpec::validate_update`]) for objects that never passed an API server (the
//! operator's fixtures, a CRD applied without its rules). The port range has one Rust
//! implementation, [`PortLayout::new`], and one CEL implementation, [`port_range_rule`].
//! The crate's tests (`tests/crd.rs`) run the CEL rules in a CEL interpreter against the
//! Rust checks, and the kube harness's `crd_validation` test against a real API server.
//!
//! | rule | where |
//! | --- | --- |
//! | `shards` 1..=16384, `replicas` ≥ 0, ports 1..=65535, names' patterns | schema |
//! | `portsPerShard ≥ replicas + 1` | CEL on the spec |
//! | `basePort + shards * stride - 1 <= 65535`, for each base port set | CEL on the spec, one rule per field |
//! | the proxy's TLS port outside its node ports; `passthrough` needs `tls` | CEL on the spec |
//! | `domain` (or an `advertisedHost` that is a DNS name) for `preferredEndpointType: hostname`; `domain` for `proxy.tls`; `proxy` for `mode: proxy` | CEL on `externalAccess` |
//! | `secretName` for TLS `terminate` | CEL on `externalAccess.proxy.tls` |
//! | no key of [`RESERVED_CONFIG_KEYS`] in `config` | CEL on `config` |
//! | no `tls` with `externalAccess.mode: proxy` | CEL on the spec |
//! | `portsPerShard` and `persistence` immutable, `tls` present or not for good ([`immutable`]) | CEL transition rules |

use kube::core::{Message, Reason, Rule};

use crate::external_access::{self, ExternalAccess, ExternalAccessMode, ProxyTlsMode};
use crate::ports::{PortError, PortLayout, MAX_PORT};
use crate::valkey_cluster::ValkeyClusterSpec;

/// The most shards a cluster can have: each needs at least one of Valkey's 16384 slots.
pub const MAX_SHARDS: i32 = 16384;

/// `config` keys the operator writes itself (from the spec, the pod and `externalAccess`);
/// the API server rejects them in `config`.
pub const RESERVED_CONFIG_KEYS: &[&str] = &[
    "port",
    "tls-port",
    "dir",
    "bind",
    "cluster-enabled",
    "cluster-config-file",
    "cluster-port",
    "cluster-announce-ip",
    "cluster-announce-port",
    "cluster-announce-bus-port",
    "cluster-announce-tls-port",
    "cluster-announce-client-port",
    "cluster-announce-client-tls-port",
    "cluster-announce-client-ipv4",
    "cluster-announce-client-ipv6",
    "cluster-announce-hostname",
    "cluster-announce-human-nodename",
    "cluster-preferred-endpoint-type",
    "tls-cluster",
    "tls-replication",
    "tls-cert-file",
    "tls-key-file",
    "tls-ca-cert-file",
    // The files of `spec.tls`'s Secret are the only ones a node has: other files would
    // crash-loop the pod, and the operator reads no encrypted key.
    "tls-ca-cert-dir",
    "tls-client-cert-file",
    "tls-client-key-file",
    "tls-key-file-pass",
    "tls-client-key-file-pass",
];

/// The fields whose change the API server refuses, and why (the CEL messages, and the text of
/// [`SpecError::Immutable`]).
pub mod immutable {
    /// `portsPerShard`.
    pub const PORTS_PER_SHARD: &str = "portsPerShard cannot be changed or removed once set: it \
        numbers every external port (basePort + shard * portsPerShard + node), so clients and \
        DNS records would reach other nodes; it can only be added with the current stride, \
        replicas + 1";
    /// Adding or removing `persistence`.
    pub const PERSISTENCE_PRESENCE: &str = "persistence cannot be added or removed: the nodes' \
        StatefulSets' volumeClaimTemplates cannot change, and the data lives on those volumes";
    /// Adding or removing `tls`.
    pub const TLS_PRESENCE: &str = "tls cannot be added or removed: the nodes would have to \
        restart one at a time, and a node on TLS and one on plain RESP cannot talk on the \
        cluster bus; make a new cluster (a new Secret for the same cluster is fine)";
    /// Changing `persistence`.
    pub const PERSISTENCE: &str = "persistence is immutable: the nodes' StatefulSets' \
        volumeClaimTemplates (size, storageClassName) cannot change";
}

/// The stride in CEL: `portsPerShard`, else `replicas + 1`.
const CEL_STRIDE: &str = "(has(self.portsPerShard) ? self.portsPerShard : self.replicas + 1)";

/// The base-port fields the port-range rule applies to, as paths from the spec.
pub const BASE_PORT_FIELDS: [&str; 3] = [
    "externalAccess.basePort",
    "externalAccess.gateway.basePort",
    "externalAccess.proxy.basePort",
];

/// `!has(self.a) || !has(self.a.b) || ...` for every prefix of `path`: true when any part of
/// the path is absent.
fn cel_absent(path: &str) -> String {
    let parts: Vec<&str> = path.split('.').collect();
    (1..=parts.len())
        .map(|i| format!("!has(self.{})", parts[..i].join(".")))
        .collect::<Vec<_>>()
        .join(" || ")
}

/// The port-range rule for one base port (one of [`BASE_PORT_FIELDS`]):
/// `basePort + shards * stride - 1 <= 65535`, where it is set.
pub fn port_range_rule(field: &str) -> Rule {
    Rule::new(format!(
        "{} || self.{field} + self.shards * {CEL_STRIDE} - 1 <= {MAX_PORT}",
        cel_absent(field)
    ))
    .message(Message::Message(format!(
        "{field} + shards * (portsPerShard or replicas + 1) - 1 must be <= {MAX_PORT}"
    )))
    .field_path(format!(".{field}"))
}

/// The proxy's TLS port must not be one of its node ports.
pub(crate) fn proxy_tls_port_rule() -> Rule {
    let proxy = "self.externalAccess.proxy";
    Rule::new(format!(
        "{} || {proxy}.tls.port < {proxy}.basePort || \
         {proxy}.tls.port > {proxy}.basePort + self.shards * {CEL_STRIDE} - 1",
        cel_absent("externalAccess.proxy.tls")
    ))
    .message(
        "externalAccess.proxy.tls.port must be outside the proxy's node ports, \
         externalAccess.proxy.basePort to basePort + shards * (portsPerShard or replicas + 1) - 1",
    )
    .field_path(".externalAccess.proxy.tls.port")
}

/// The proxy's client certificate for the nodes is for nodes on TLS.
pub(crate) fn proxy_client_secret_rule() -> Rule {
    Rule::new(format!(
        "{} || has(self.tls)",
        cel_absent("externalAccess.proxy.clientSecretName")
    ))
    .message(PROXY_CLIENT_SECRET_NEEDS_TLS)
    .field_path(".externalAccess.proxy.clientSecretName")
    .reason(Reason::FieldValueForbidden)
}

/// Why `externalAccess.proxy.clientSecretName` is refused without `tls`.
pub const PROXY_CLIENT_SECRET_NEEDS_TLS: &str =
    "externalAccess.proxy.clientSecretName needs tls: it is the certificate the proxy shows nodes on TLS";

/// TLS passthrough hands the client's TLS stream to the node: the nodes must speak TLS.
pub(crate) fn passthrough_rule() -> Rule {
    Rule::new(format!(
        "{} || self.externalAccess.proxy.tls.mode != 'passthrough' || has(self.tls)",
        cel_absent("externalAccess.proxy.tls.mode")
    ))
    .message("externalAccess.proxy.tls.mode passthrough needs tls: the nodes must speak TLS")
    .field_path(".externalAccess.proxy.tls.mode")
    .reason(Reason::FieldValueForbidden)
}

/// No key of [`RESERVED_CONFIG_KEYS`] in `config`. Map lookups only, so that the API
/// server's cost estimate stays constant (a `filter(...).join(...)` over the keys is
/// estimated far past the budget), and a flat message expression listing the keys that are
/// set (nested conditionals overflow a CEL parser's stack).
pub(crate) fn reserved_config_rule() -> Rule {
    let rule = RESERVED_CONFIG_KEYS
        .iter()
        .map(|k| format!("!('{k}' in self)"))
        .collect::<Vec<_>>()
        .join(" && ");
    let keys_set = RESERVED_CONFIG_KEYS
        .iter()
        .map(|k| format!(" + ('{k}' in self ? ' {k}' : '')"))
        .collect::<String>();
    Rule::new(rule)
        .message(Message::Expression(format!(
            "'{RESERVED_CONFIG_MESSAGE}:'{keys_set}"
        )))
        .reason(Reason::FieldValueForbidden)
}

/// Why `verifyClients` is refused with `passthrough` (the CEL message and [`SpecError`]'s).
pub const VERIFY_CLIENTS_NEEDS_TERMINATE: &str = "externalAccess.proxy.tls.verifyClients needs \
    mode terminate: a passed-through stream is the node's to verify";

/// The start of the message when `config` sets reserved keys; the keys follow, each after
/// a space.
pub const RESERVED_CONFIG_MESSAGE: &str = "config may not set keys the operator writes";

/// Why a spec is not valid, naming the field as the resource spells it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("shards must be between 1 and {MAX_SHARDS}, got {0}")]
    Shards(i32),
    #[error("replicas must be at least 0, got {0}")]
    Replicas(i32),
    #[error("{field} must be between 1 and 65535, got {value}")]
    OutOfRange { field: &'static str, value: i32 },
    #[error("portsPerShard ({ports_per_shard}) must be at least replicas + 1 ({needed})")]
    StrideTooSmall { ports_per_shard: i32, needed: i64 },
    #[error("{field}: {source}")]
    Port {
        field: &'static str,
        source: PortError,
    },
    #[error(
        "externalAccess.proxy.tls.port {port} must be outside the proxy's node ports {first} to {last}"
    )]
    TlsPortInRange { port: i32, first: u16, last: u16 },
    #[error("{field} is required when {when}")]
    Required {
        field: &'static str,
        when: &'static str,
    },
    #[error("{field} must not be empty")]
    Empty { field: &'static str },
    #[error("{field}: {value:?} is not a valid {what}")]
    Invalid {
        field: &'static str,
        value: String,
        what: &'static str,
    },
    #[error("externalAccess.proxy.tls.mode passthrough needs tls: the nodes must speak TLS")]
    PassthroughWithoutTls,
    #[error("{VERIFY_CLIENTS_NEEDS_TERMINATE}")]
    VerifyClientsNeedsTerminate,
    #[error("{PROXY_CLIENT_SECRET_NEEDS_TLS}")]
    ProxyClientSecretNeedsTls,
    /// The reserved keys `config` sets, in [`RESERVED_CONFIG_KEYS`]' order.
    #[error("{RESERVED_CONFIG_MESSAGE}: {}", .0.join(" "))]
    ReservedConfigKeys(Vec<String>),
    /// A change the API server refuses; the message says why.
    #[error("{message}")]
    Immutable {
        field: &'static str,
        message: &'static str,
    },
}

impl ValkeyClusterSpec {
    /// `shards` and `replicas` as counts.
    fn counts(&self) -> Result<(u32, u32), SpecError> {
        if !(1..=MAX_SHARDS).contains(&self.shards) {
            return Err(SpecError::Shards(self.shards));
        }
        let replicas =
            u32::try_from(self.replicas).map_err(|_| SpecError::Replicas(self.replicas))?;
        Ok((self.shards as u32, replicas))
    }

    pub(crate) fn layout_for(
        &self,
        field: &'static str,
        base_port: i32,
    ) -> Result<PortLayout, SpecError> {
        let (shards, replicas) = self.counts()?;
        let ports_per_shard = self
            .ports_per_shard
            .map(|p| {
                u32::try_from(p).map_err(|_| SpecError::OutOfRange {
                    field: "portsPerShard",
                    value: p,
                })
            })
            .transpose()?;
        let base = u32::try_from(base_port).map_err(|_| SpecError::OutOfRange {
            field,
            value: base_port,
        })?;
        PortLayout::new(base, shards, replicas, ports_per_shard).map_err(|source| match source {
            PortError::StrideTooSmall { .. } => SpecError::StrideTooSmall {
                ports_per_shard: self.ports_per_shard.unwrap_or_default(),
                needed: i64::from(self.replicas) + 1,
            },
            source => SpecError::Port { field, source },
        })
    }

    /// Checks everything the API server checks on create (schema bounds, patterns and CEL
    /// rules), and returns the first failure.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.counts()?;
        if self.image.is_empty() {
            return Err(SpecError::Empty { field: "image" });
        }
        if let Some(p) = self.ports_per_shard {
            if !(1..=MAX_PORT as i32).contains(&p) {
                return Err(SpecError::OutOfRange {
                    field: "portsPerShard",
                    value: p,
                });
            }
            if i64::from(p) < i64::from(self.replicas) + 1 {
                return Err(SpecError::StrideTooSmall {
                    ports_per_shard: p,
                    needed: i64::from(self.replicas) + 1,
                });
            }
        }
        let reserved: Vec<String> = RESERVED_CONFIG_KEYS
            .iter()
            .filter(|k| self.config.contains_key(**k))
            .map(|k| k.to_string())
            .collect();
        if !reserved.is_empty() {
            return Err(SpecError::ReservedConfigKeys(reserved));
        }
        if let Some(tls) = &self.tls {
            if tls.secret_name.is_empty() {
                return Err(SpecError::Empty {
                    field: "tls.secretName",
                });
            }
        }
        if let Some(ea) = &self.external_access {
            self.validate_external_access(ea)?;
        }
        Ok(())
    }

    fn validate_external_access(&self, ea: &ExternalAccess) -> Result<(), SpecError> {
        for (field, base) in ea.base_ports() {
            if !(1..=MAX_PORT as i32).contains(&base) {
                return Err(SpecError::OutOfRange { field, value: base });
            }
            self.layout_for(field, base)?;
        }
        if let Some(domain) = &ea.domain {
            if !external_access::is_domain(domain) {
                return Err(SpecError::Invalid {
                    field: "externalAccess.domain",
                    value: domain.clone(),
                    what: "DNS domain (lower-case RFC 1123 subdomain of at most 190 characters)",
                });
            }
        }
        if let Some(prefix) = &ea.hostname_prefix {
            if !external_access::is_hostname_prefix(prefix) {
                return Err(SpecError::Invalid {
                    field: "externalAccess.hostnamePrefix",
                    value: prefix.clone(),
                    what: "hostname prefix (lower-case RFC 1123 label of at most 52 characters)",
                });
            }
        }
        for (field, host) in [
            ("externalAccess.advertisedHost", &ea.advertised_host),
            (
                "externalAccess.proxy.advertisedHost",
                &ea.proxy.as_ref().and_then(|p| p.advertised_host.clone()),
            ),
        ] {
            if host.as_deref() == Some("") {
                return Err(SpecError::Empty { field });
            }
        }
        let has_domain = ea.domain.as_deref().is_some_and(|d| !d.is_empty());
        if ea.preferred_endpoint_type == external_access::EndpointType::Hostname
            && !has_domain
            && ea.advertised_name().is_none()
        {
            return Err(SpecError::Required {
                field: "externalAccess.domain",
                when: "preferredEndpointType is hostname and advertisedHost is not a DNS name",
            });
        }
        if ea.mode == ExternalAccessMode::Proxy && ea.proxy.is_none() {
            return Err(SpecError::Required {
                field: "externalAccess.proxy",
                when: "mode is proxy",
            });
        }
        if let Some(g) = &ea.gateway {
            if g.gateway_ref.name.is_empty() {
                return Err(SpecError::Empty {
                    field: "externalAccess.gateway.gatewayRef.name",
                });
            }
            if g.gateway_ref.section_name.as_deref() == Some("") {
                return Err(SpecError::Empty {
                    field: "externalAccess.gateway.gatewayRef.sectionName",
                });
            }
        }
        if let Some(proxy) = &ea.proxy {
            if proxy.replicas < 0 {
                return Err(SpecError::Invalid {
                    field: "externalAccess.proxy.replicas",
                    value: proxy.replicas.to_string(),
                    what: "replica count (at least 0)",
                });
            }
            if let Some(tls) = &proxy.tls {
                if !has_domain {
                    return Err(SpecError::Required {
                        field: "externalAccess.domain",
                        when: "proxy.tls is set",
                    });
                }
                if !(1..=MAX_PORT as i32).contains(&tls.port) {
                    return Err(SpecError::OutOfRange {
                        field: "externalAccess.proxy.tls.port",
                        value: tls.port,
                    });
                }
                let layout = self.layout_for("externalAccess.proxy.basePort", proxy.base_port)?;
                let port = tls.port as u32;
                if (u32::from(layout.base_port())..=u32::from(layout.last_port())).contains(&port) {
                    return Err(SpecError::TlsPortInRange {
                        port: tls.port,
                        first: layout.base_port(),
                        last: layout.last_port(),
                    });
                }
                match (tls.mode, tls.secret_name.as_deref()) {
                    (ProxyTlsMode::Terminate, None | Some("")) => {
                        return Err(SpecError::Required {
                            field: "externalAccess.proxy.tls.secretName",
                            when: "mode is terminate",
                        })
                    }
                    (ProxyTlsMode::Passthrough, _) if self.tls.is_none() => {
                        return Err(SpecError::PassthroughWithoutTls)
                    }
                    _ => {}
                }
                if tls.verify_clients && tls.mode != ProxyTlsMode::Terminate {
                    return Err(SpecError::VerifyClientsNeedsTerminate);
                }
            }
            match proxy.client_secret_name.as_deref() {
                Some("") => {
                    return Err(SpecError::Empty {
                        field: "externalAccess.proxy.clientSecretName",
                    })
                }
                Some(_) if self.tls.is_none() => return Err(SpecError::ProxyClientSecretNeedsTls),
                _ => {}
            }
        }
        Ok(())
    }

    /// [`Self::validate`], then the checks the API server makes on an update from `old`
    /// (the immutable fields).
    pub fn validate_update(&self, old: &ValkeyClusterSpec) -> Result<(), SpecError> {
        self.validate()?;
        let pps_ok = match (old.ports_per_shard, self.ports_per_shard) {
            (Some(old), new) => new == Some(old),
            (None, None) => true,
            (None, Some(new)) => i64::from(new) == i64::from(old.replicas) + 1,
        };
        if !pps_ok {
            return Err(SpecError::Immutable {
                field: "portsPerShard",
                message: immutable::PORTS_PER_SHARD,
            });
        }
        match (&old.persistence, &self.persistence) {
            (None, None) => {}
            (Some(old), Some(new)) if old == new => {}
            (Some(_), Some(_)) => {
                return Err(SpecError::Immutable {
                    field: "persistence",
                    message: immutable::PERSISTENCE,
                })
            }
            _ => {
                return Err(SpecError::Immutable {
                    field: "persistence",
                    message: immutable::PERSISTENCE_PRESENCE,
                })
            }
        }
        if old.tls.is_some() != self.tls.is_some() {
            return Err(SpecError::Immutable {
                field: "tls",
                message: immutable::TLS_PRESENCE,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::external_access::EndpointType;
    use crate::valkey_cluster::ValkeyCluster;

    fn vc() -> ValkeyCluster {
        ValkeyCluster::test("vc")
    }

    #[test]
    fn counts() {
        assert_eq!(vc().spec.validate(), Ok(()));
        assert_eq!(vc().shards(0).spec.validate(), Err(SpecError::Shards(0)));
        assert_eq!(
            vc().shards(16385).spec.validate(),
            Err(SpecError::Shards(16385))
        );
        assert_eq!(
            vc().replicas(-1).spec.validate(),
            Err(SpecError::Replicas(-1))
        );
        assert_eq!(vc().replicas(0).spec.validate(), Ok(()));
        let err = vc().shards(0).spec.validate().unwrap_err().to_string();
        assert!(err.starts_with("shards "), "{err}");
    }

    #[test]
    fn ports_name_their_field() {
        let spec = vc()
            .shards(3)
            .replicas(1)
            .external(ExternalAccess::proxy(65531))
            .spec;
        let err = spec.validate().unwrap_err();
        assert_eq!(
            err,
            SpecError::Port {
                field: "externalAccess.proxy.basePort",
                source: PortError::PastMaxPort {
                    base_port: 65531,
                    shards: 3,
                    stride: 2,
                    last: 65536
                }
            }
        );
        assert!(
            err.to_string()
                .starts_with("externalAccess.proxy.basePort: the last port"),
            "{err}"
        );
        let spec = vc().external(ExternalAccess::gateway("gw", 0)).spec;
        assert_eq!(
            spec.validate(),
            Err(SpecError::OutOfRange {
                field: "externalAccess.gateway.basePort",
                value: 0
            })
        );
        assert_eq!(
            vc().replicas(2).ports_per_shard(2).spec.validate(),
            Err(SpecError::StrideTooSmall {
                ports_per_shard: 2,
                needed: 3
            })
        );
        assert_eq!(
            vc().ports_per_shard(0).spec.validate(),
            Err(SpecError::OutOfRange {
                field: "portsPerShard",
                value: 0
            })
        );
    }

    #[test]
    fn external_access_rules() {
        let hostname = ExternalAccess::announce().endpoint_type(EndpointType::Hostname);
        let no_name = Err(SpecError::Required {
            field: "externalAccess.domain",
            when: "preferredEndpointType is hostname and advertisedHost is not a DNS name",
        });
        assert_eq!(vc().external(hostname.clone()).spec.validate(), no_name);
        // A DNS name in advertisedHost is every node's hostname; an IP is not a name.
        for (host, ok) in [
            ("valkey.example.com", true),
            ("lb-1", true),
            ("203.0.113.7", false),
            ("2001:db8::7", false),
        ] {
            let ea = hostname.clone().advertised_host(host);
            let want = if ok { Ok(()) } else { no_name.clone() };
            assert_eq!(vc().external(ea).spec.validate(), want, "{host}");
        }
        assert_eq!(
            vc().external(hostname.clone().domain("example.com"))
                .spec
                .validate(),
            Ok(())
        );
        assert!(matches!(
            vc().external(hostname.clone().domain("Example.com"))
                .spec
                .validate(),
            Err(SpecError::Invalid {
                field: "externalAccess.domain",
                ..
            })
        ));
        assert!(matches!(
            vc().external(ExternalAccess::announce().hostname_prefix("vc_1"))
                .spec
                .validate(),
            Err(SpecError::Invalid {
                field: "externalAccess.hostnamePrefix",
                ..
            })
        ));
        let tls = ExternalAccess::proxy(30000).domain("example.com");
        assert_eq!(
            vc().external(
                tls.clone()
                    .proxy_tls(30003, ProxyTlsMode::Terminate, Some("s"))
            )
            .spec
            .validate(),
            Err(SpecError::TlsPortInRange {
                port: 30003,
                first: 30000,
                last: 30005
            })
        );
        assert_eq!(
            vc().external(tls.clone().proxy_tls(6380, ProxyTlsMode::Terminate, None))
                .spec
                .validate(),
            Err(SpecError::Required {
                field: "externalAccess.proxy.tls.secretName",
                when: "mode is terminate"
            })
        );
        assert_eq!(
            vc().external(tls.clone().proxy_tls(6380, ProxyTlsMode::Passthrough, None))
                .spec
                .validate(),
            Err(SpecError::PassthroughWithoutTls)
        );
        // The proxy's own client certificate is for nodes on TLS.
        let mut with_client = ExternalAccess::proxy(30000);
        if let Some(p) = with_client.proxy.as_mut() {
            p.client_secret_name = Some("c".into());
        }
        assert_eq!(
            vc().external(with_client.clone()).spec.validate(),
            Err(SpecError::ProxyClientSecretNeedsTls)
        );
        assert_eq!(
            vc().tls("t").external(with_client.clone()).spec.validate(),
            Ok(())
        );
        if let Some(p) = with_client.proxy.as_mut() {
            p.client_secret_name = Some(String::new());
        }
        assert_eq!(
            vc().tls("t").external(with_client).spec.validate(),
            Err(SpecError::Empty {
                field: "externalAccess.proxy.clientSecretName"
            })
        );
        // Nodes on TLS sit behind the proxy, passthrough or terminating, and any mode.
        assert_eq!(
            vc().tls("t")
                .external(tls.clone().proxy_tls(6380, ProxyTlsMode::Passthrough, None))
                .spec
                .validate(),
            Ok(())
        );
        assert_eq!(
            vc().tls("t")
                .external(tls.proxy_tls(6380, ProxyTlsMode::Terminate, Some("s")))
                .spec
                .validate(),
            Ok(())
        );
        assert_eq!(
            vc().tls("t")
                .external(ExternalAccess::announce())
                .spec
                .validate(),
            Ok(())
        );
    }

    #[test]
    fn tls_is_there_or_not_for_good() {
        let plain = vc().spec;
        let tls = vc().tls("a").spec;
        assert_eq!(tls.validate_update(&tls), Ok(()));
        assert_eq!(
            vc().tls("b").spec.validate_update(&tls),
            Ok(()),
            "another Secret"
        );
        for (new, old) in [(&tls, &plain), (&plain, &tls)] {
            let err = new.validate_update(old).unwrap_err();
            assert!(
                matches!(err, SpecError::Immutable { field: "tls", .. }),
                "{err}"
            );
        }
    }

    #[test]
    fn reserved_config_keys() {
        assert_eq!(
            vc().config("port", "7000").spec.validate(),
            Err(SpecError::ReservedConfigKeys(vec!["port".into()]))
        );
        let err = vc()
            .config("cluster-enabled", "no")
            .config("dir", "/tmp")
            .spec
            .validate()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "config may not set keys the operator writes: dir cluster-enabled"
        );
        assert_eq!(vc().config("maxmemory", "1gb").spec.validate(), Ok(()));
    }

    #[test]
    fn immutable_fields() {
        let old = vc().ports_per_shard(4).persistence("1Gi");
        assert_eq!(old.spec.validate_update(&old.spec), Ok(()));
        let err = vc()
            .ports_per_shard(5)
            .persistence("1Gi")
            .spec
            .validate_update(&old.spec)
            .unwrap_err();
        assert_eq!(
            err,
            SpecError::Immutable {
                field: "portsPerShard",
                message: immutable::PORTS_PER_SHARD
            }
        );
        let err = vc()
            .ports_per_shard(4)
            .spec
            .validate_update(&old.spec)
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("persistence cannot be added or removed"),
            "{err}"
        );
        let err = vc()
            .ports_per_shard(4)
            .persistence("2Gi")
            .spec
            .validate_update(&old.spec)
            .unwrap_err();
        assert!(
            err.to_string().starts_with("persistence is immutable"),
            "{err}"
        );
        // Pinning the current stride is allowed; another one is not.
        let unpinned = vc().replicas(2);
        assert_eq!(
            vc().replicas(2)
                .ports_per_shard(3)
                .spec
                .validate_update(&unpinned.spec),
            Ok(())
        );
        assert!(vc()
            .replicas(2)
            .ports_per_shard(4)
            .spec
            .validate_update(&unpinned.spec)
            .is_err());
    }

    #[test]
    fn cel_rules_name_their_fields() {
        let rule = port_range_rule("externalAccess.proxy.basePort");
        assert_eq!(
            rule.rule,
            "!has(self.externalAccess) || !has(self.externalAccess.proxy) || \
             !has(self.externalAccess.proxy.basePort) || self.externalAccess.proxy.basePort \
             + self.shards * (has(self.portsPerShard) ? self.portsPerShard : self.replicas + 1) \
             - 1 <= 65535"
        );
        assert_eq!(
            rule.field_path.as_deref(),
            Some(".externalAccess.proxy.basePort")
        );
    }
}
