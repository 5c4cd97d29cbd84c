//! The ValkeyCluster CRD on a real API server: `deploy/crds/` as checked in is installed and
//! established, a valid resource is stored with the defaults the API server fills in, and
//! invalid ones (schema bounds, CEL rules, immutable fields) are rejected with a message that
//! names the field; on a grid of port ranges the API server and the Rust checks
//! (`ValkeyClusterSpec::validate`) agree, the exact boundary 65535 included.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, ensure, Context, Result};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::{json, Value};
use shardgate_crds::validation::BASE_PORT_FIELDS;
use shardgate_crds::{ValkeyCluster, ValkeyClusterSpec};
use shardgate_kube_harness::{yaml_files_in, Options, Suite, TestEnv};

fn main() -> ExitCode {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds");
    let yaml_files = match yaml_files_in(&dir) {
        Ok(files) if !files.is_empty() => files,
        Ok(_) => {
            eprintln!("no CRD YAML in {}", dir.display());
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("{e:#}");
            return ExitCode::FAILURE;
        }
    };
    Suite::new()
        .options(Options {
            yaml_files,
            without_gateway_api: true,
        })
        .test(
            "the_crd_is_established_with_its_names_and_columns",
            crd_established,
        )
        .test(
            "a_valid_cluster_is_stored_with_the_api_servers_defaults",
            valid_cluster_defaults,
        )
        .test(
            "invalid_clusters_are_rejected_naming_the_field",
            invalid_clusters_rejected,
        )
        .test("immutable_fields_cannot_change_on_update", immutable_fields)
        .test(
            "the_port_rule_agrees_with_the_rust_check_on_a_grid",
            port_rule_grid,
        )
        .run()
}

const CRD_NAME: &str = "valkeyclusters.shardgate.io";

/// ValkeyClusters as the API server stores them (raw JSON, so that the defaults seen are the
/// API server's, not serde's).
fn raw_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::erase::<ValkeyCluster>(&()),
    )
}

fn object(name: &str, spec: Value) -> Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "shardgate.io/v1alpha1",
        "kind": "ValkeyCluster",
        "metadata": { "name": name },
        "spec": spec,
    }))?)
}

/// Creates the resource (for real, or as a server-side dry run) and returns the API
/// server's verdict: `Err` with its message when it refuses.
async fn create(
    api: &Api<DynamicObject>,
    name: &str,
    spec: Value,
    dry_run: bool,
) -> Result<std::result::Result<DynamicObject, String>> {
    let params = PostParams {
        dry_run,
        ..Default::default()
    };
    match api.create(&params, &object(name, spec)?).await {
        Ok(obj) => Ok(Ok(obj)),
        Err(kube::Error::Api(status)) if status.code == 422 => Ok(Err(status.message)),
        Err(e) => Err(e).context("creating a ValkeyCluster"),
    }
}

async fn crd_established(env: TestEnv) -> Result<()> {
    let TestEnv { client, cp, ns } = env;
    let crd = Api::<CustomResourceDefinition>::all(client.clone())
        .get(CRD_NAME)
        .await?;
    let conditions = crd
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    for wanted in ["Established", "NamesAccepted"] {
        ensure!(
            conditions
                .iter()
                .any(|c| c.type_ == wanted && c.status == "True"),
            "{wanted} is not True: {conditions:?}"
        );
    }
    ensure!(
        !conditions
            .iter()
            .any(|c| c.type_ == "NonStructuralSchema" && c.status == "True"),
        "non-structural schema: {conditions:?}"
    );

    // The short name and the printer columns, as a user sees them.
    let api = raw_api(&client, &ns);
    create(&api, "vc", json!({ "shards": 2 }), false)
        .await?
        .map_err(anyhow::Error::msg)?;
    let status = json!({
        "apiVersion": "shardgate.io/v1alpha1", "kind": "ValkeyCluster",
        "status": {
            "phase": "Ready", "readyNodes": 4, "readyShards": 2, "ready": "4/4",
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "ClusterFormed",
                "message": "all 16384 slots served", "lastTransitionTime": "2025-01-01T00:00:00Z",
            }],
        },
    });
    Api::<ValkeyCluster>::namespaced(client.clone(), &ns)
        .patch_status(
            "vc",
            &PatchParams::apply("crd-validation").force(),
            &Patch::Apply(&status),
        )
        .await
        .context("patching the status subresource")?;
    let out = cp.kubectl(&["get", "vkc", "-n", &ns])?;
    let mut lines = out.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    ensure!(
        header == ["NAME", "SHARDS", "REPLICAS", "READY", "PHASE", "AGE"],
        "{out}"
    );
    let row: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    ensure!(row[..5] == ["vc", "2", "1", "4/4", "Ready"], "{out}");
    let vc = Api::<ValkeyCluster>::namespaced(client, &ns)
        .get("vc")
        .await?;
    let got = vc.status.context("no status")?;
    ensure!(got.ready_nodes == 4 && got.conditions.len() == 1, "{got:?}");
    Ok(())
}

async fn valid_cluster_defaults(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let api = raw_api(&client, &ns);
    let spec = json!({
        "externalAccess": {
            "enabled": true,
            "domain": "example.com",
            "proxy": { "basePort": 31000, "tls": { "port": 6380, "secretName": "proxy-tls" } },
        },
    });
    let stored = create(&api, "vc", spec, false)
        .await?
        .map_err(anyhow::Error::msg)?;
    let spec = &stored.data["spec"];
    let ea = &spec["externalAccess"];
    let proxy = &ea["proxy"];
    for (what, got, want) in [
        ("shards", &spec["shards"], json!(3)),
        ("replicas", &spec["replicas"], json!(1)),
        ("image", &spec["image"], json!("valkey/valkey:9.0")),
        ("externalAccess.mode", &ea["mode"], json!("announce")),
        (
            "externalAccess.serviceLayout",
            &ea["serviceLayout"],
            json!("shard"),
        ),
        (
            "externalAccess.preferredEndpointType",
            &ea["preferredEndpointType"],
            json!("ip"),
        ),
        (
            "externalAccess.proxy.replicas",
            &proxy["replicas"],
            json!(2),
        ),
        (
            "externalAccess.proxy.serviceType",
            &proxy["serviceType"],
            json!("LoadBalancer"),
        ),
        (
            "externalAccess.proxy.tls.mode",
            &proxy["tls"]["mode"],
            json!("terminate"),
        ),
    ] {
        ensure!(
            *got == want,
            "{what}: the API server stored {got}, not the default {want}; spec: {spec}"
        );
    }
    // Optional fields without a default stay unset (the operator decides by the gateway).
    ensure!(ea.get("serviceType").is_none(), "{ea}");
    ensure!(ea.get("externalTrafficPolicy").is_none(), "{ea}");

    // The typed view reads it back, and the Rust checks accept it.
    let vc = Api::<ValkeyCluster>::namespaced(client, &ns)
        .get("vc")
        .await?;
    vc.spec.validate()?;
    ensure!(vc.spec.shards == 3 && vc.spec.replicas == 1);
    ensure!(vc
        .hostnames()
        .is_some_and(|h| h.prefix == "vc" && h.domain == "example.com"));
    Ok(())
}

async fn invalid_clusters_rejected(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let api = raw_api(&client, &ns);
    let proxy_tls = |tls: Value| {
        json!({ "externalAccess": { "domain": "example.com",
            "proxy": { "basePort": 30000, "tls": tls } } })
    };
    // (what, spec, every text the API server's message must contain)
    let cases: Vec<(&str, Value, Vec<&str>)> = vec![
        ("shards 0", json!({ "shards": 0 }), vec!["spec.shards"]),
        (
            "replicas -1",
            json!({ "replicas": -1 }),
            vec!["spec.replicas"],
        ),
        (
            "proxy ports past 65535",
            json!({ "shards": 3, "replicas": 1,
                "externalAccess": { "mode": "proxy", "proxy": { "basePort": 65531 } } }),
            vec!["spec.externalAccess.proxy.basePort", "must be <= 65535"],
        ),
        (
            "gateway ports past 65535",
            json!({ "shards": 3, "replicas": 2,
                "externalAccess": { "gateway": { "gatewayRef": { "name": "gw" }, "basePort": 65530 } } }),
            vec!["spec.externalAccess.gateway.basePort", "must be <= 65535"],
        ),
        (
            "NodePorts past 65535 under portsPerShard",
            json!({ "shards": 2, "replicas": 1, "portsPerShard": 10,
                "externalAccess": { "basePort": 65520 } }),
            vec!["spec.externalAccess.basePort", "must be <= 65535"],
        ),
        (
            "a base port past 65535",
            json!({ "externalAccess": { "basePort": 65536 } }),
            vec!["spec.externalAccess.basePort"],
        ),
        (
            "hostname endpoints without a domain",
            json!({ "externalAccess": { "enabled": true, "preferredEndpointType": "hostname" } }),
            vec!["spec.externalAccess.domain", "required"],
        ),
        (
            "hostname endpoints with an advertisedHost IP and no domain",
            json!({ "externalAccess": { "enabled": true, "preferredEndpointType": "hostname",
                "advertisedHost": "203.0.113.7" } }),
            vec![
                "spec.externalAccess.domain",
                "advertisedHost that is a DNS name",
            ],
        ),
        (
            "a domain that is not a DNS name",
            json!({ "externalAccess": { "domain": "Example_com" } }),
            vec!["spec.externalAccess.domain"],
        ),
        (
            "portsPerShard below replicas + 1",
            json!({ "replicas": 2, "portsPerShard": 2 }),
            vec!["spec.portsPerShard", "at least replicas + 1"],
        ),
        (
            "proxy mode without a proxy",
            json!({ "externalAccess": { "mode": "proxy" } }),
            vec!["spec.externalAccess.proxy", "required when mode is proxy"],
        ),
        (
            "TLS termination without a certificate",
            proxy_tls(json!({ "port": 6380 })),
            vec!["spec.externalAccess.proxy.tls.secretName"],
        ),
        (
            "a TLS port among the node ports",
            proxy_tls(json!({ "port": 30001, "secretName": "s" })),
            vec!["spec.externalAccess.proxy.tls.port"],
        ),
        (
            "TLS passthrough to nodes without TLS",
            proxy_tls(json!({ "port": 6380, "mode": "passthrough" })),
            vec!["spec.externalAccess.proxy.tls.mode", "needs tls"],
        ),
        (
            "a config key the operator writes",
            json!({ "config": { "maxmemory": "1gb", "cluster-enabled": "no" } }),
            vec![
                "spec.config",
                "config may not set keys the operator writes: cluster-enabled",
            ],
        ),
        (
            "an unknown mode",
            json!({ "externalAccess": { "mode": "tunnel" } }),
            vec!["spec.externalAccess.mode"],
        ),
    ];
    let mut failures = Vec::new();
    for (i, (what, spec, texts)) in cases.into_iter().enumerate() {
        // The Rust checks refuse it too (the ones serde can read: an unknown enum value is
        // refused by serde itself).
        if let Ok(typed) = serde_json::from_value::<ValkeyClusterSpec>(spec.clone()) {
            ensure!(
                typed.validate().is_err(),
                "{what}: the Rust checks accept {spec}"
            );
        }
        match create(&api, &format!("bad-{i}"), spec.clone(), false).await? {
            Ok(_) => failures.push(format!("{what}: accepted {spec}")),
            Err(msg) => {
                if let Some(missing) = texts.iter().find(|t| !msg.contains(**t)) {
                    failures.push(format!("{what}: {missing:?} not in the message: {msg}"));
                } else {
                    eprintln!("{what}: {msg}");
                }
            }
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }

    // The boundary itself is valid: 65530 + 3 * 2 - 1 = 65535.
    let edge = json!({ "shards": 3, "replicas": 1,
        "externalAccess": { "mode": "proxy", "proxy": { "basePort": 65530 } } });
    create(&api, "edge", edge, false)
        .await?
        .map_err(|m| anyhow::anyhow!("the last valid port range was refused: {m}"))?;
    Ok(())
}

async fn immutable_fields(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let api = raw_api(&client, &ns);
    create(
        &api,
        "vc",
        json!({ "replicas": 1, "portsPerShard": 4, "persistence": { "size": "1Gi" } }),
        false,
    )
    .await?
    .map_err(anyhow::Error::msg)?;
    create(&api, "plain", json!({ "replicas": 1 }), false)
        .await?
        .map_err(anyhow::Error::msg)?;
    create(&api, "tls", json!({ "tls": { "secretName": "a" } }), false)
        .await?
        .map_err(anyhow::Error::msg)?;

    let update = |name: &'static str, patch: Value| {
        let api = api.clone();
        async move {
            match api
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({ "spec": patch })),
                )
                .await
            {
                Ok(_) => Ok(Ok(())),
                Err(kube::Error::Api(status)) if status.code == 422 => Ok(Err(status.message)),
                Err(e) => Err(anyhow::Error::from(e).context(format!("updating {name}"))),
            }
        }
    };
    // (what, object, patch, None: accepted | Some(texts the refusal must contain))
    let cases: Vec<(&str, &'static str, Value, Option<Vec<&str>>)> = vec![
        (
            "portsPerShard changed",
            "vc",
            json!({ "portsPerShard": 5 }),
            Some(vec!["spec.portsPerShard", "cannot be changed"]),
        ),
        (
            "portsPerShard removed",
            "vc",
            json!({ "portsPerShard": null }),
            Some(vec!["spec.portsPerShard", "cannot be changed"]),
        ),
        (
            "persistence resized",
            "vc",
            json!({ "persistence": { "size": "2Gi" } }),
            Some(vec!["spec.persistence", "immutable"]),
        ),
        (
            "persistence removed",
            "vc",
            json!({ "persistence": null }),
            Some(vec!["spec.persistence", "cannot be added or removed"]),
        ),
        (
            "persistence added",
            "plain",
            json!({ "persistence": { "size": "1Gi" } }),
            Some(vec!["spec.persistence", "cannot be added or removed"]),
        ),
        (
            "tls removed",
            "tls",
            json!({ "tls": null }),
            Some(vec!["spec.tls", "cannot be added or removed"]),
        ),
        (
            "tls added",
            "plain",
            json!({ "tls": { "secretName": "a" } }),
            Some(vec!["spec.tls", "cannot be added or removed"]),
        ),
        (
            "another tls Secret",
            "tls",
            json!({ "tls": { "secretName": "b" } }),
            None,
        ),
        (
            "portsPerShard added with another stride",
            "plain",
            json!({ "portsPerShard": 3 }),
            Some(vec!["spec.portsPerShard", "cannot be changed"]),
        ),
        (
            "replicas scaled under a fixed portsPerShard",
            "vc",
            json!({ "replicas": 3 }),
            None,
        ),
        (
            "portsPerShard pinned at the current stride",
            "plain",
            json!({ "portsPerShard": 2 }),
            None,
        ),
    ];
    let mut failures = Vec::new();
    for (what, name, patch, expected) in cases {
        match (update(name, patch.clone()).await?, expected) {
            (Ok(()), None) => {}
            (Err(msg), Some(texts)) => {
                if let Some(missing) = texts.iter().find(|t| !msg.contains(**t)) {
                    failures.push(format!("{what}: {missing:?} not in the message: {msg}"));
                } else {
                    eprintln!("{what}: {msg}");
                }
            }
            (Ok(()), Some(_)) => failures.push(format!("{what}: accepted {patch}")),
            (Err(msg), None) => failures.push(format!("{what}: refused: {msg}")),
        }
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    let vc = Api::<ValkeyCluster>::namespaced(client, &ns)
        .get("vc")
        .await?;
    ensure!(vc.spec.ports_per_shard == Some(4) && vc.spec.replicas == 3);
    Ok(())
}

async fn port_rule_grid(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let api = raw_api(&client, &ns);
    let (mut accepted, mut refused) = (0, 0);
    for field in BASE_PORT_FIELDS {
        for base in [65525, 65529, 65530, 65531, 65535] {
            for shards in [1, 3] {
                for replicas in [0, 1] {
                    for pps in [None, Some(replicas + 2)] {
                        let external = match field {
                            "externalAccess.basePort" => json!({ "basePort": base }),
                            "externalAccess.gateway.basePort" => json!({
                                "gateway": { "gatewayRef": { "name": "gw" }, "basePort": base } }),
                            _ => json!({ "mode": "proxy", "proxy": { "basePort": base } }),
                        };
                        let mut spec = json!({ "shards": shards, "replicas": replicas,
                            "externalAccess": external });
                        if let Some(pps) = pps {
                            spec["portsPerShard"] = json!(pps);
                        }
                        let typed: ValkeyClusterSpec = serde_json::from_value(spec.clone())?;
                        let rust = typed.validate();
                        let server = create(&api, "grid", spec.clone(), true).await?;
                        ensure!(
                            rust.is_ok() == server.is_ok(),
                            "the API server and the Rust check disagree on {spec}: \
                             Rust {rust:?}, API server {:?}",
                            server.map(|_| ())
                        );
                        match server {
                            Ok(_) => accepted += 1,
                            Err(msg) => {
                                ensure!(msg.contains(&format!("spec.{field}")), "{msg}");
                                refused += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    ensure!(
        accepted > 10 && refused > 10,
        "{accepted} accepted, {refused} refused"
    );
    Ok(())
}
