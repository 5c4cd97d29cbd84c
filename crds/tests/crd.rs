//! The generated CRD: the checked-in YAML is current, and its CEL rules, run in a CEL
//! interpreter (kube-cel, the one kube's client-side validation uses), agree with the Rust
//! checks (`ValkeyClusterSpec::validate` / `validate_update`) on a grid of values, including
//! the exact port boundary. The kube harness's `crd_validation` test repeats the boundary on
//! a real API server.

use kube::CustomResourceExt;
use kube_cel::{compile_schema, CompiledSchema, Validator};
use serde_json::Value;
use shardgate_crds::external_access::{
    EndpointType, ExternalAccess, ExternalAccessMode, ProxyTlsMode,
};
use shardgate_crds::validation::BASE_PORT_FIELDS;
use shardgate_crds::valkey_cluster::{crd_yaml, CRD_FILE};
use shardgate_crds::{SpecError, ValkeyCluster};

#[test]
fn checked_in_crd_is_current() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(CRD_FILE);
    let command =
        format!("cargo run -p shardgate-crds --features resource --bin crdgen > {CRD_FILE}");
    let checked_in = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; generate it with `{command}`", path.display()));
    assert!(
        checked_in == crd_yaml(),
        "{CRD_FILE} is stale (the ValkeyCluster types changed): regenerate it with `{command}`"
    );
}

/// The CRD's schema, compiled once per test.
struct Cel {
    schema: CompiledSchema,
    validator: Validator,
}

impl Cel {
    fn new() -> Self {
        let crd = ValkeyCluster::crd();
        let schema = crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("the CRD has a schema");
        let schema = compile_schema(&serde_json::to_value(schema).unwrap());
        assert!(
            !schema.has_errors(),
            "CEL rules that do not compile: {:?}",
            schema.compilation_errors()
        );
        Cel {
            schema,
            validator: Validator::new(),
        }
    }

    /// The CEL rules' verdict: `Err` with `field: message` of every failed rule.
    fn check(&self, vc: &ValkeyCluster, old: Option<&ValkeyCluster>) -> Result<(), Vec<String>> {
        let value = serde_json::to_value(vc).unwrap();
        let old: Option<Value> = old.map(|o| serde_json::to_value(o).unwrap());
        self.validator
            .validate_compiled(&self.schema, &value, old.as_ref())
            .map_err(|errs| errs.iter().map(|e| e.to_string()).collect())
    }
}

/// Both verdicts on a create (or, with `old`, an update); they must agree. A refusal is
/// `Err` with both messages.
fn agree(cel: &Cel, vc: &ValkeyCluster, old: Option<&ValkeyCluster>) -> Result<(), Refusal> {
    let rust = match old {
        Some(old) => vc.spec.validate_update(&old.spec),
        None => vc.spec.validate(),
    };
    let by_cel = cel.check(vc, old);
    assert_eq!(
        rust.is_ok(),
        by_cel.is_ok(),
        "Rust and CEL disagree on {}\n(old: {})\nRust: {rust:?}\nCEL: {by_cel:?}",
        serde_json::to_string(&vc.spec).unwrap(),
        old.map(|o| serde_json::to_string(&o.spec).unwrap())
            .unwrap_or_default(),
    );
    match (rust, by_cel) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(rust), Err(cel)) => Err(Refusal {
            rust: rust.to_string(),
            cel: cel.join("; "),
        }),
        _ => unreachable!(),
    }
}

/// Why both refused.
#[derive(Debug)]
struct Refusal {
    rust: String,
    cel: String,
}

impl Refusal {
    /// Both messages contain `text`.
    fn says(&self, text: &str) -> bool {
        self.rust.contains(text) && self.cel.contains(text)
    }
}

/// A cluster whose only external setting is `field` (one of `BASE_PORT_FIELDS`) at `base`.
fn with_base_port(field: &str, base: i32) -> ExternalAccess {
    match field {
        "externalAccess.basePort" => ExternalAccess::announce().base_port(base),
        "externalAccess.gateway.basePort" => ExternalAccess::gateway("gw", base),
        "externalAccess.proxy.basePort" => ExternalAccess::proxy(base),
        other => panic!("unknown base port field {other}"),
    }
}

#[test]
fn port_rule_agrees_with_port_layout_on_a_grid() {
    let cel = Cel::new();
    let (mut accepted, mut rejected) = (0, 0);
    for field in BASE_PORT_FIELDS {
        for base in [1, 1024, 30000, 65000, 65529, 65530, 65531, 65534, 65535] {
            for shards in [1, 2, 3, 7, 100] {
                for replicas in [0, 1, 2, 5] {
                    let strides = [None, Some(replicas + 1), Some(replicas + 3)]
                        .into_iter()
                        .chain((replicas >= 1).then_some(Some(replicas))); // too small
                    for pps in strides {
                        let mut vc = ValkeyCluster::test("vc")
                            .shards(shards)
                            .replicas(replicas)
                            .external(with_base_port(field, base));
                        vc.spec.ports_per_shard = pps;
                        match agree(&cel, &vc, None) {
                            Ok(()) => accepted += 1,
                            Err(refusal) => {
                                rejected += 1;
                                let stride = pps.unwrap_or(replicas + 1);
                                let field_named = if stride < replicas + 1 {
                                    "portsPerShard"
                                } else {
                                    field
                                };
                                assert!(refusal.says(field_named), "{field_named}: {refusal:?}");
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(accepted > 100 && rejected > 100, "{accepted} {rejected}");

    // The exact boundary: 65530 + 3 * 2 - 1 = 65535 is the last port; one more is past it.
    for field in BASE_PORT_FIELDS {
        let vc = |base| {
            ValkeyCluster::test("vc")
                .shards(3)
                .replicas(1)
                .external(with_base_port(field, base))
        };
        assert!(agree(&cel, &vc(65530), None).is_ok());
        let refusal = agree(&cel, &vc(65531), None).unwrap_err();
        assert!(
            refusal.rust.contains("= 65536, is past 65535"),
            "{refusal:?}"
        );
        assert!(
            refusal.cel.contains(&format!(
                "{field} + shards * (portsPerShard or replicas + 1) - 1 must be <= 65535"
            )),
            "{refusal:?}"
        );
        let one = ValkeyCluster::test("vc")
            .shards(1)
            .replicas(0)
            .external(with_base_port(field, 65535));
        assert!(agree(&cel, &one, None).is_ok());
    }
}

#[test]
fn proxy_tls_port_rule_agrees_on_a_grid() {
    let cel = Cel::new();
    // Node ports 30000..=30005 (3 shards x 2).
    for (port, ok) in [
        (29999, true),
        (30000, false),
        (30003, false),
        (30005, false),
        (30006, true),
        (6380, true),
    ] {
        let vc = ValkeyCluster::test("vc").external(
            ExternalAccess::proxy(30000)
                .domain("example.com")
                .proxy_tls(port, ProxyTlsMode::Terminate, Some("proxy-tls")),
        );
        let verdict = agree(&cel, &vc, None);
        assert_eq!(verdict.is_ok(), ok, "port {port}: {verdict:?}");
        if let Err(refusal) = verdict {
            assert!(refusal.says("externalAccess.proxy.tls.port"), "{refusal:?}");
        }
    }
}

/// Proxy mode with `proxy.clientSecretName`.
fn client_secret(name: &str) -> ExternalAccess {
    let mut ea = ExternalAccess::proxy(31000);
    if let Some(p) = ea.proxy.as_mut() {
        p.client_secret_name = Some(name.into());
    }
    ea
}

#[test]
fn other_create_rules_agree() {
    let cel = Cel::new();
    let base = || ValkeyCluster::test("vc");
    let cases: Vec<(&str, ValkeyCluster, Option<&str>)> = vec![
        ("defaults", base(), None),
        (
            "passthrough without tls",
            base().external(
                ExternalAccess::proxy(31000)
                    .base_port(30000)
                    .domain("example.com")
                    .endpoint_type(EndpointType::Hostname)
                    .proxy_tls(6380, ProxyTlsMode::Passthrough, None),
            ),
            Some("tls"), // passthrough without spec.tls
        ),
        (
            "passthrough with tls (nodes on TLS behind the proxy)",
            base().tls("vc-tls").external(
                ExternalAccess::proxy(31000)
                    .domain("example.com")
                    .proxy_tls(6380, ProxyTlsMode::Passthrough, None),
            ),
            None,
        ),
        (
            "tls with proxy mode",
            base().tls("vc-tls").external(ExternalAccess::proxy(31000)),
            None,
        ),
        (
            "the proxy's own client certificate for nodes on TLS",
            base()
                .tls("vc-tls")
                .external(client_secret("vc-proxy-client")),
            None,
        ),
        (
            "the proxy's client certificate without nodes on TLS",
            base().external(client_secret("vc-proxy-client")),
            Some("clientSecretName needs tls"),
        ),
        (
            "tls with announce mode",
            base().tls("vc-tls").external(ExternalAccess::announce()),
            None,
        ),
        (
            "verifyClients with passthrough (a proxy block announce mode ignores)",
            base().tls("vc-tls").external({
                let mut ea = ExternalAccess::proxy(31000)
                    .domain("example.com")
                    .proxy_tls(6380, ProxyTlsMode::Passthrough, None)
                    .verify_clients();
                ea.mode = ExternalAccessMode::Announce;
                ea
            }),
            Some("verifyClients needs mode terminate"),
        ),
        (
            "verifyClients with terminate",
            base().external(
                ExternalAccess::proxy(31000)
                    .domain("example.com")
                    .proxy_tls(6380, ProxyTlsMode::Terminate, Some("vc-tls"))
                    .verify_clients(),
            ),
            None,
        ),
        (
            "bind in config (the pods must listen at their IP)",
            base().config("bind", "127.0.0.1"),
            Some("config may not set keys the operator writes: bind"),
        ),
        (
            "hostname without domain",
            base().external(ExternalAccess::announce().endpoint_type(EndpointType::Hostname)),
            Some("domain"),
        ),
        (
            "hostname with an advertisedHost name",
            base().external(
                ExternalAccess::announce()
                    .endpoint_type(EndpointType::Hostname)
                    .advertised_host("valkey.example.com"),
            ),
            None,
        ),
        (
            "hostname with an advertisedHost IPv4",
            base().external(
                ExternalAccess::announce()
                    .endpoint_type(EndpointType::Hostname)
                    .advertised_host("203.0.113.7"),
            ),
            Some("domain"),
        ),
        (
            "hostname with an advertisedHost IPv6",
            base().external(
                ExternalAccess::announce()
                    .endpoint_type(EndpointType::Hostname)
                    .advertised_host("2001:db8::7"),
            ),
            Some("domain"),
        ),
        (
            "hostname with domain",
            base().external(
                ExternalAccess::announce()
                    .endpoint_type(EndpointType::Hostname)
                    .domain("example.com"),
            ),
            None,
        ),
        (
            "hostname in a disabled block is still checked",
            base().external(
                ExternalAccess::announce()
                    .endpoint_type(EndpointType::Hostname)
                    .disabled(),
            ),
            Some("domain"),
        ),
        (
            "proxy tls without domain",
            base().external(ExternalAccess::proxy(31000).proxy_tls(
                6380,
                ProxyTlsMode::Terminate,
                Some("s"),
            )),
            Some("domain"),
        ),
        (
            "terminate without secret",
            base().external(
                ExternalAccess::proxy(31000)
                    .domain("example.com")
                    .proxy_tls(6380, ProxyTlsMode::Terminate, None),
            ),
            Some("secretName"),
        ),
        (
            "proxy mode without proxy",
            base().external(ExternalAccess {
                proxy: None,
                ..ExternalAccess::proxy(31000)
            }),
            Some("proxy"),
        ),
        (
            "a reserved config key",
            base()
                .config("maxmemory", "1gb")
                .config("cluster-enabled", "no")
                .config("port", "7000"),
            Some("config may not set keys the operator writes: port cluster-enabled"),
        ),
        (
            "ordinary config",
            base()
                .config("maxmemory", "1gb")
                .config("appendonly", "yes"),
            None,
        ),
        (
            "portsPerShard below replicas + 1",
            base().replicas(2).ports_per_shard(2),
            Some("portsPerShard"),
        ),
    ];
    for (name, vc, expected) in cases {
        let verdict = agree(&cel, &vc, None);
        match (expected, verdict) {
            (None, Ok(())) => {}
            (Some(text), Err(refusal)) => {
                assert!(refusal.says(text), "{name}: {text:?} not in {refusal:?}")
            }
            (expected, verdict) => panic!("{name}: expected {expected:?}, got {verdict:?}"),
        }
    }
}

#[test]
fn transition_rules_agree() {
    let cel = Cel::new();
    let base = || ValkeyCluster::test("vc").replicas(1);
    let cases: Vec<(&str, ValkeyCluster, ValkeyCluster, Option<&str>)> = vec![
        ("nothing changed", base(), base(), None),
        ("replicas scale", base(), base().replicas(2), None),
        (
            "portsPerShard changed",
            base().ports_per_shard(4),
            base().ports_per_shard(5),
            Some("portsPerShard cannot be changed"),
        ),
        (
            "portsPerShard removed",
            base().ports_per_shard(4),
            base(),
            Some("portsPerShard cannot be changed"),
        ),
        (
            "portsPerShard pinned at the current stride",
            base(),
            base().ports_per_shard(2),
            None,
        ),
        (
            "portsPerShard added with another stride",
            base(),
            base().ports_per_shard(4),
            Some("portsPerShard cannot be changed"),
        ),
        (
            "replicas scale under a fixed portsPerShard",
            base().ports_per_shard(4),
            base().ports_per_shard(4).replicas(3),
            None,
        ),
        (
            "persistence added",
            base(),
            base().persistence("1Gi"),
            Some("persistence cannot be added or removed"),
        ),
        (
            "persistence removed",
            base().persistence("1Gi"),
            base(),
            Some("persistence cannot be added or removed"),
        ),
        (
            "persistence resized",
            base().persistence("1Gi"),
            base().persistence("2Gi"),
            Some("persistence is immutable"),
        ),
        (
            "persistence kept",
            base().persistence("1Gi"),
            base().persistence("1Gi").shards(4),
            None,
        ),
        (
            "tls added",
            base(),
            base().tls("vc-tls"),
            Some("tls cannot be added or removed"),
        ),
        (
            "tls removed",
            base().tls("vc-tls"),
            base(),
            Some("tls cannot be added or removed"),
        ),
        (
            "another tls Secret",
            base().tls("vc-tls"),
            base().tls("vc-tls-2"),
            None,
        ),
    ];
    for (name, old, new, expected) in cases {
        let verdict = agree(&cel, &new, Some(&old));
        match (expected, verdict) {
            (None, Ok(())) => {}
            (Some(text), Err(refusal)) => {
                assert!(refusal.says(text), "{name}: {text:?} not in {refusal:?}")
            }
            (expected, verdict) => panic!("{name}: expected {expected:?}, got {verdict:?}"),
        }
    }
    // Transition rules do not run on create.
    assert_eq!(cel.check(&base().ports_per_shard(7), None), Ok(()));
    assert!(matches!(
        base()
            .ports_per_shard(5)
            .spec
            .validate_update(&base().ports_per_shard(4).spec),
        Err(SpecError::Immutable {
            field: "portsPerShard",
            ..
        })
    ));
}
