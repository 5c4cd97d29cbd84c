//! One StatefulSet (one replica) per Valkey node, named `<cluster>-<s>-<n>`: a node keeps
//! its name, its index labels and (with persistence) its volume whatever happens to its pod.
//! The pod template carries the config hash, so a new `valkey.conf` rolls the pods (the
//! operator decides when: see [`crate::rolling`]).

use k8s_openapi::api::apps::v1::StatefulSet;
use kube::api::Api;
use kube::ResourceExt;
use serde_json::{json, Value};
use shardgate_crds::names::objects;
use shardgate_crds::valkey_cluster::{defaults, ValkeyCluster};
use shardgate_crds::NodeRef;

use crate::configmap::{self, BUS_PORT, CLIENT_PORT};
use crate::context::Context;
use crate::error::Result;
use crate::objects::{apply, build, namespace, node_labels, owner};
use crate::tls;

/// The pod annotation holding the config hash.
pub const CONFIG_HASH: &str = "shardgate.io/config-hash";

/// Where `valkey.conf` and the data live in the pod.
const CONFIG_DIR: &str = "/config";
const DATA_DIR: &str = "/data";

/// The hash a node's pods carry ([`CONFIG_HASH`]): of everything a running pod cannot take
/// on without a restart, so that a change of any of it rolls the pods ([`crate::rolling`];
/// the StatefulSets use `OnDelete`). That is the config (`config_hash`), the node's own
/// flags (`args`: announce mode), the TLS Secret, the image and the resources. A part at
/// its default (no flags, no TLS, the default image, no resources) adds nothing, so that a
/// cluster without it keeps the hash it had before the part was added: an operator upgrade
/// does not roll it.
pub fn pod_hash(vc: &ValkeyCluster, config_hash: &str, args: &[String]) -> Result<String> {
    let parts: Vec<String> = pieces(vc, args)?.into_iter().flat_map(|(_, p)| p).collect();
    Ok(if parts.is_empty() {
        config_hash.to_string()
    } else {
        configmap::hash(&format!("{config_hash}\n{}", parts.join("\n")))
    })
}

/// The parts of [`pod_hash`] beyond the config, in its order, each named; a part at its
/// default is left out.
fn pieces(vc: &ValkeyCluster, args: &[String]) -> Result<Vec<(&'static str, Vec<String>)>> {
    let mut pieces = Vec::new();
    if !args.is_empty() {
        pieces.push(("flags", args.to_vec()));
    }
    // Valkey reads its certificate at start: a pod on another Secret is a new pod.
    if let Some(tls) = &vc.spec.tls {
        pieces.push(("tls", vec![format!("tls={}", tls.secret_name)]));
    }
    if vc.spec.image != defaults::IMAGE {
        pieces.push(("image", vec![format!("image={}", vc.spec.image)]));
    }
    if let Some(resources) = &vc.spec.resources {
        let json =
            serde_json::to_string(resources).map_err(|source| crate::error::Error::Build {
                what: "resources".into(),
                source,
            })?;
        pieces.push(("resources", vec![format!("resources={json}")]));
    }
    Ok(pieces)
}

/// The pod annotation with a hash of each part of [`CONFIG_HASH`] (`config=<h>,image=<h>`),
/// so that a roll can say what it restarts the pods for. Not in the hash itself, and the
/// StatefulSets use `OnDelete`: pods made before it existed are not rolled for it.
pub const CONFIG_PARTS: &str = "shardgate.io/config-parts";

/// The [`CONFIG_PARTS`] of pods that run with `config_hash` and `args`.
pub fn pod_parts(vc: &ValkeyCluster, config_hash: &str, args: &[String]) -> Result<String> {
    let mut parts = vec![format!("config={config_hash}")];
    for (name, piece) in pieces(vc, args)? {
        parts.push(format!("{name}={}", configmap::hash(&piece.join("\n"))));
    }
    Ok(parts.join(","))
}

/// What pods are restarted for, in words (`config`, `image and resources`): the parts
/// whose hashes differ between each pod's [`CONFIG_PARTS`] and the desired ones, over
/// `pods` (a pod's, the desired). A pod without the annotation (made by an older operator)
/// counts as a config change.
pub fn changed<'a>(pods: impl IntoIterator<Item = (Option<&'a str>, &'a str)>) -> String {
    const WORDS: [(&str, &str); 5] = [
        ("config", "config"),
        ("flags", "announce flags"),
        ("tls", "TLS Secret"),
        ("image", "image"),
        ("resources", "resources"),
    ];
    let split = |parts: &'a str| -> Vec<(&'a str, &'a str)> {
        parts.split(',').filter_map(|p| p.split_once('=')).collect()
    };
    let mut differ = [false; WORDS.len()];
    for (pod, desired) in pods {
        let Some(pod) = pod else {
            differ[0] = true;
            continue;
        };
        let (pod, desired) = (split(pod), split(desired));
        let value = |parts: &[(&str, &'a str)], name: &str| {
            parts.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
        };
        for (i, (name, _)) in WORDS.iter().enumerate() {
            differ[i] |= value(&pod, name) != value(&desired, name);
        }
    }
    let words: Vec<&str> = WORDS
        .iter()
        .zip(differ)
        .filter_map(|((_, word), d)| d.then_some(*word))
        .collect();
    match words.as_slice() {
        [] => "config".into(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

/// The StatefulSet of `node`, whose pods run with the hash `config_hash` (see [`pod_hash`])
/// and announce their external endpoint with
/// `announce` (none without external access in announce mode).
pub fn build_node(
    vc: &ValkeyCluster,
    node: NodeRef,
    config_hash: &str,
    parts: &str,
    announce: &[String],
) -> Result<StatefulSet> {
    let cluster = vc.name_any();
    let name = objects::node(&cluster, node);
    let labels = node_labels(vc, node);
    let mut command = vec![
        "valkey-server".to_string(),
        format!("{CONFIG_DIR}/valkey.conf"),
        // On the command line, not in the file: paths in the file would not follow a
        // relocated mount, and the announced address is the pod's own.
        "--dir".into(),
        DATA_DIR.into(),
        "--cluster-announce-ip".into(),
        "$(POD_IP)".into(),
        "--cluster-announce-human-nodename".into(),
        name.clone(),
    ];
    if vc.spec.tls.is_some() {
        command.extend(tls::args());
    }
    command.extend(announce.iter().cloned());
    // The external Services of announce mode target each node by a name only its container
    // port has (a port can have one name: server-side apply keys container ports by number).
    let client_port_name = if crate::external::announce_mode(vc).is_some() {
        objects::container_port(node)
    } else {
        "client".to_string()
    };
    let mut mounts = vec![
        json!({ "name": "config", "mountPath": CONFIG_DIR, "readOnly": true }),
        json!({ "name": "data", "mountPath": DATA_DIR }),
    ];
    let mut volumes = vec![json!({
        "name": "config",
        "configMap": { "name": objects::config_map(&cluster) },
    })];
    if let Some(tls) = &vc.spec.tls {
        mounts.push(json!({ "name": tls::VOLUME, "mountPath": tls::DIR, "readOnly": true }));
        // Readable by the group the pod runs as (fsGroup), not by others.
        volumes.push(json!({
            "name": tls::VOLUME,
            "secret": { "secretName": tls.secret_name, "defaultMode": 0o440 },
        }));
    }
    let mut container = json!({
        "name": "valkey",
        "image": vc.spec.image,
        "command": command,
        "env": [{ "name": "POD_IP", "valueFrom": { "fieldRef": { "fieldPath": "status.podIP" } } }],
        "ports": [
            { "name": client_port_name, "containerPort": CLIENT_PORT, "protocol": "TCP" },
            { "name": "bus", "containerPort": BUS_PORT, "protocol": "TCP" },
        ],
        "readinessProbe": readiness(vc),
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": false,
            "readOnlyRootFilesystem": true,
            "capabilities": { "drop": ["ALL"] },
        },
    });
    if let Some(resources) = &vc.spec.resources {
        container["resources"] =
            serde_json::to_value(resources).map_err(|source| crate::error::Error::Build {
                what: "resources".into(),
                source,
            })?;
    }
    let mut claims: Vec<Value> = Vec::new();
    match &vc.spec.persistence {
        Some(p) => {
            let mut spec = json!({
                "accessModes": ["ReadWriteOnce"],
                "resources": { "requests": { "storage": p.size } },
            });
            if let Some(class) = &p.storage_class_name {
                spec["storageClassName"] = json!(class);
            }
            claims.push(json!({ "metadata": { "name": "data" }, "spec": spec }));
        }
        None => volumes.push(json!({ "name": "data", "emptyDir": {} })),
    }
    let mut sts = json!({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {
                "name": name,
                "labels": labels,
                "ownerReferences": [owner(vc)?],
            },
            "spec": {
                "replicas": 1,
                "serviceName": objects::headless_service(&cluster),
                "podManagementPolicy": "Parallel",
                // The operator replaces pods itself, one at a time and after a failover
                // (crate::rolling); the StatefulSet controller must not.
                "updateStrategy": { "type": "OnDelete" },
                "selector": { "matchLabels": labels },
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": { CONFIG_HASH: config_hash, CONFIG_PARTS: parts },
                    },
                    "spec": {
                        "containers": [container],
                        "volumes": volumes,
                        "terminationGracePeriodSeconds": 30,
                        "securityContext": { "runAsNonRoot": true, "runAsUser": 999, "runAsGroup": 999, "fsGroup": 999 },
                    },
                },
            },
    });
    if !claims.is_empty() {
        sts["spec"]["volumeClaimTemplates"] = Value::Array(claims);
    }
    build("StatefulSet", sts)
}

/// A node is ready once it accepts connections on its client port. On TLS, a connection
/// that never makes its handshake is a warning in Valkey's log, so that probe pings over
/// TLS (an error reply, NOAUTH say, still means it answers: valkey-cli exits 0).
fn readiness(vc: &ValkeyCluster) -> Value {
    let mut probe = json!({ "periodSeconds": 2, "failureThreshold": 3 });
    if vc.spec.tls.is_some() {
        let mut command = vec!["valkey-cli".to_string(), "--tls".to_string()];
        for (flag, file) in [
            ("--cacert", tls::CA),
            ("--cert", tls::CERT),
            ("--key", tls::KEY),
        ] {
            command.extend([flag.to_string(), tls::path(file)]);
        }
        command.extend(["-p".into(), CLIENT_PORT.to_string(), "ping".into()]);
        probe["exec"] = json!({ "command": command });
        // valkey-cli starts and makes a handshake: more than a TCP connect.
        probe["timeoutSeconds"] = json!(2);
    } else {
        probe["tcpSocket"] = json!({ "port": CLIENT_PORT });
    }
    probe
}

/// Applies the StatefulSet of `node`.
pub async fn apply_node(
    vc: &ValkeyCluster,
    ctx: &Context,
    node: NodeRef,
    config_hash: &str,
    parts: &str,
    announce: &[String],
) -> Result<StatefulSet> {
    let sts = build_node(vc, node, config_hash, parts, announce)?;
    apply(&Api::namespaced(ctx.client.clone(), &namespace(vc)?), &sts).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    /// Each part of what a pod runs with changes the hash; parts at their defaults leave
    /// it as it was before they counted (the config's, or the config's and the flags').
    #[test]
    fn the_pod_hash_covers_what_a_running_pod_cannot_take_on() {
        let mut vc = ValkeyCluster::test("vc");
        let flags = ["--x".to_string(), "1".to_string()];
        let hash = |vc: &ValkeyCluster, args: &[String]| pod_hash(vc, "abc", args).unwrap();
        assert_eq!(hash(&vc, &[]), "abc");
        // The hash announce flags gave before image and resources counted.
        assert_eq!(hash(&vc, &flags), configmap::hash("abc\n--x\n1"));

        vc.spec.image = "valkey/valkey:9.1".into();
        let image = hash(&vc, &[]);
        assert_ne!(image, "abc");
        assert_ne!(hash(&vc, &flags), image);
        assert_ne!(hash(&vc, &flags), configmap::hash("abc\n--x\n1"));
        vc.spec.image = defaults::IMAGE.into();
        assert_eq!(hash(&vc, &[]), "abc", "back to the default image");

        let tls = |secret: &str| hash(&ValkeyCluster::test("vc").tls(secret), &[]);
        assert!(
            tls("a") != "abc" && tls("a") != tls("b"),
            "{} {}",
            tls("a"),
            tls("b")
        );

        let memory = |q: &str| ResourceRequirements {
            limits: Some([("memory".to_string(), Quantity(q.into()))].into()),
            ..ResourceRequirements::default()
        };
        vc.spec.resources = Some(memory("1Gi"));
        let one = hash(&vc, &[]);
        vc.spec.resources = Some(memory("2Gi"));
        let two = hash(&vc, &[]);
        assert!(one != "abc" && two != "abc" && one != two, "{one} {two}");
    }

    /// A roll says what it restarts the pods for: the parts whose hashes differ, in words;
    /// a pod made before the parts were recorded counts as a config change.
    #[test]
    fn a_roll_names_the_parts_that_changed() {
        let vc = ValkeyCluster::test("vc");
        let flags = ["--x".to_string(), "1".to_string()];
        let parts = |vc: &ValkeyCluster, config: &str, args: &[String]| {
            pod_parts(vc, config, args).unwrap()
        };
        let before = parts(&vc, "abc", &[]);
        assert_eq!(before, "config=abc");
        let changed_from = |after: &str| changed([(Some(before.as_str()), after)]);
        assert_eq!(changed_from(&parts(&vc, "def", &[])), "config");
        assert_eq!(changed_from(&parts(&vc, "abc", &flags)), "announce flags");
        let mut image = vc.clone();
        image.spec.image = "valkey/valkey:9.1".into();
        assert_eq!(changed_from(&parts(&image, "abc", &[])), "image");
        let mut both = image.clone();
        both.spec.resources = Some(Default::default());
        assert_eq!(
            changed_from(&parts(&both, "abc", &[])),
            "image and resources"
        );
        let all = parts(&both.clone().tls("s"), "def", &flags);
        assert_eq!(
            changed_from(&all),
            "config, announce flags, TLS Secret, image and resources"
        );
        // Over several pods, each part once; back to a default counts as a change.
        let on_image = parts(&image, "abc", &[]);
        assert_eq!(
            changed([
                (Some(on_image.as_str()), before.as_str()),
                (None, before.as_str())
            ]),
            "config and image"
        );
        assert_eq!(changed([]), "config", "no pod to compare");
        // The parts agree with the hash: a part the hash leaves out, the parts leave out.
        assert_eq!(pod_hash(&vc, "abc", &[]).unwrap(), "abc");
        assert!(!parts(&image, "abc", &[]).contains("resources"));
    }

    /// With `spec.tls`, the Secret is mounted read-only where valkey.conf looks for it,
    /// readable by the pod's group only; without, there is no such volume.
    #[test]
    fn a_tls_cluster_mounts_its_secret() {
        let node = NodeRef::new(0, 0);
        let json = |vc: &ValkeyCluster| {
            serde_json::to_value(build_node(vc, node, "h", "config=h", &[]).unwrap()).unwrap()
        };
        let sts = json(&ValkeyCluster::test("vc").tls("vc-certs"));
        let pod = &sts["spec"]["template"]["spec"];
        let volume = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "tls")
            .unwrap();
        assert_eq!(volume["secret"]["secretName"], "vc-certs");
        assert_eq!(volume["secret"]["defaultMode"], 0o440);
        let command = pod["containers"][0]["command"].to_string();
        assert!(
            command.contains(r#""--tls-cert-file","/tls/tls.crt","--tls-key-file","/tls/tls.key","--tls-ca-cert-file","/tls/ca.crt""#),
            "{command}"
        );
        let mounts = pod["containers"][0]["volumeMounts"].as_array().unwrap();
        assert!(
            mounts.contains(&json!({ "name": "tls", "mountPath": "/tls", "readOnly": true })),
            "{mounts:?}"
        );
        // Its readiness is a ping over TLS (a bare TCP connect is a warning in Valkey's log).
        let probe = &pod["containers"][0]["readinessProbe"];
        assert_eq!(
            probe["exec"]["command"].to_string(),
            r#"["valkey-cli","--tls","--cacert","/tls/ca.crt","--cert","/tls/tls.crt","--key","/tls/tls.key","-p","6379","ping"]"#
        );
        let plain = json(&ValkeyCluster::test("vc"));
        let text = plain.to_string();
        assert!(!text.contains("\"tls\""), "{text}");
        let probe = &plain["spec"]["template"]["spec"]["containers"][0]["readinessProbe"];
        assert_eq!(probe["tcpSocket"]["port"], 6379, "{probe}");
    }
}
