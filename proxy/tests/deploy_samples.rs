//! The samples in deploy/ parse and agree with the code: a user copying them gets a proxy
//! that starts, with a Service that exposes exactly its listener ports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use shardgate_proxy::source::file;

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(path)
}

#[test]
fn the_sample_route_file_loads() {
    let routes = file::load(&deploy("proxy/routes.yaml"), false).unwrap();
    let ports: Vec<u16> = routes.keys().copied().collect();
    assert_eq!(ports, (30000..=30005).collect::<Vec<_>>());
}

#[test]
fn the_sample_manifests_agree_with_their_routes() {
    let path = deploy("proxy/shardgate-proxy.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let docs: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_json::Value::deserialize(d).unwrap())
        .collect();
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d["kind"] == k)
            .unwrap_or_else(|| panic!("no {k}"))
    };

    let routes_text = kind("ConfigMap")["data"]["routes.yaml"].as_str().unwrap();
    let routes = file::parse(Path::new("configmap:routes.yaml"), routes_text, false).unwrap();
    let listener_ports: BTreeSet<u16> = routes.keys().copied().collect();

    let service_ports: BTreeSet<u16> = kind("Service")["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            assert_eq!(p["port"], p["targetPort"]);
            p["port"].as_u64().unwrap() as u16
        })
        .collect();
    assert_eq!(service_ports, listener_ports);

    let pod = &kind("Deployment")["spec"]["template"]["spec"];
    let args: Vec<&str> = pod["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let at = args.iter().position(|a| *a == "--routes").unwrap();
    let mount = pod["containers"][0]["volumeMounts"][0]["mountPath"]
        .as_str()
        .unwrap();
    assert_eq!(args[at + 1], format!("{mount}/routes.yaml"));
    assert_eq!(
        pod["containers"][0]["readinessProbe"]["httpGet"]["path"],
        "/readyz"
    );
}
