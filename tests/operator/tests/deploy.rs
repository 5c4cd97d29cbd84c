//! `deploy/` against a real API server (the Kubernetes harness): the plain manifests
//! (`deploy/operator/`), the sample, the Helm chart (`deploy/helm/shardgate`) and the
//! Dockerfile.
//!
//! - The manifests, the sample and the chart's output pass a server-side dry run (schema,
//!   CEL, strict field validation, and the "restricted" Pod Security Standard of the operator's
//!   namespace: any warning fails). The chart renders the same objects as the plain manifests,
//!   and its CRD is `deploy/crds/`, byte for byte.
//! - RBAC is least privilege, asked of the API server as the operator's service account itself
//!   (a token from the TokenRequest API, then SelfSubjectAccessReviews: what `kubectl auth
//!   can-i` asks): every call the operator makes is allowed, and calls it does not make are
//!   denied. The chart's namespace-scoped variant grants only its namespace.
//! - The operator runs under that service account: it takes the Lease in shardgate-system,
//!   reconciles a ValkeyCluster to Ready cluster-wide, publishes events, and gives the Lease
//!   back.
//! - The Dockerfile agrees with the workspace (there is no Docker here to build it).
//!
//! Helm comes from `scripts/setup` (`scripts/setup-helm`, `SHARDGATE_HELM`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, PostParams};
use kube::Client;
use prometheus_client::registry::Registry;
use serde::Deserialize as _;
use serde_json::{json, Value};
use shardgate_controller::leader::{run_as_leader, Ended, LeaderElection};
use shardgate_controller::metrics::Metrics;
use shardgate_controller::{Context, Scope};
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_harness::tools;
use shardgate_kube_harness::{yaml_files_in, ControlPlane, TestEnv};
use shardgate_operator_e2e::{create, eventually, valkey_cluster, wait_ready};

fn main() -> ExitCode {
    let Some(suite) = shardgate_operator_e2e::suite_with_crds() else {
        return ExitCode::FAILURE;
    };
    suite
        .timeout(Duration::from_secs(300))
        .test(
            "the_plain_manifests_and_the_sample_pass_a_server_side_dry_run",
            plain_manifests_apply,
        )
        .test(
            "the_chart_renders_the_plain_manifests_and_its_crd_is_deploy_crds",
            chart_renders_the_plain_manifests,
        )
        .test(
            "the_charts_output_passes_a_server_side_dry_run",
            chart_output_applies,
        )
        .test(
            "rbac_allows_what_the_operator_does_and_denies_the_rest",
            rbac_least_privilege,
        )
        .test(
            "the_namespace_scoped_chart_grants_only_its_namespace",
            scoped_chart_rbac,
        )
        .test(
            "the_operator_leads_and_reconciles_under_its_service_account",
            operator_runs_under_its_rbac,
        )
        .test(
            "the_dockerfile_builds_both_binaries_to_run_as_non_root",
            dockerfile_agrees_with_the_workspace,
        )
        .run()
}

/// The operator's namespace, service account and Lease, as deploy/operator/ names them.
const SYSTEM_NS: &str = "shardgate-system";
const OPERATOR: &str = "shardgate-operator";
/// The release name that makes the chart's names those of deploy/operator/.
const RELEASE: &str = "shardgate";
const CHART: &str = "deploy/helm/shardgate";
/// The field manager of what these tests apply.
const MANAGER: &str = "shardgate-deploy-test";
/// The workspace's version: the chart's, the image tag's.
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A path in the repository.
fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path)
}

fn read(path: &str) -> Result<String> {
    std::fs::read_to_string(repo(path)).with_context(|| format!("reading {path}"))
}

// --- YAML --------------------------------------------------------------------------------

/// The documents of a YAML stream, as JSON values (empty documents left out).
fn parse_docs(text: &str, what: &str) -> Result<Vec<Value>> {
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let value = Value::deserialize(doc).with_context(|| format!("parsing {what}"))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}

/// The documents of the files in `dir`.
fn docs_in(dir: &str) -> Result<Vec<Value>> {
    let mut docs = Vec::new();
    for file in yaml_files_in(&repo(dir))? {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        docs.extend(parse_docs(&text, &file.display().to_string())?);
    }
    Ok(docs)
}

/// An object's kind and name.
fn kind_name(obj: &Value) -> (String, String) {
    let s = |v: &Value| v.as_str().unwrap_or("?").to_string();
    (s(&obj["kind"]), s(&obj["metadata"]["name"]))
}

/// Objects by (kind, name); an error if two share one.
fn by_kind_name(docs: Vec<Value>, what: &str) -> Result<BTreeMap<(String, String), Value>> {
    let mut out = BTreeMap::new();
    for doc in docs {
        let key = kind_name(&doc);
        ensure!(
            out.insert(key.clone(), doc).is_none(),
            "{what}: two objects are {key:?}"
        );
    }
    Ok(out)
}

/// The one object of `kind` among `docs`.
fn the<'a>(docs: &'a BTreeMap<(String, String), Value>, kind: &str) -> Result<&'a Value> {
    let mut found = docs.iter().filter(|((k, _), _)| k == kind);
    let (_, obj) = found.next().with_context(|| format!("no {kind}"))?;
    ensure!(found.next().is_none(), "more than one {kind}");
    Ok(obj)
}

/// Removes what only Helm adds: its two labels.
fn without_helm_labels(mut obj: Value) -> Value {
    if let Some(labels) = obj
        .pointer_mut("/metadata/labels")
        .and_then(Value::as_object_mut)
    {
        labels.remove("helm.sh/chart");
        labels.remove("app.kubernetes.io/managed-by");
    }
    obj
}

/// `docs` as one YAML stream (a document each, in JSON, which is YAML). Not a `List`: kubectl
/// validates a List's items on the client, with an older schema than the API server's.
fn stream_of<'a>(docs: impl IntoIterator<Item = &'a Value>) -> String {
    docs.into_iter().map(|d| format!("---\n{d}\n")).collect()
}

// --- helm --------------------------------------------------------------------------------

/// `helm`: `SHARDGATE_HELM`, else the newest `helm-*/bin/helm` in the cache that
/// `scripts/setup` fills, else `helm` on PATH.
fn helm() -> Result<PathBuf> {
    static FOUND: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| find_helm().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

fn find_helm() -> Result<PathBuf> {
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let advice = "run `scripts/setup` (scripts/setup-helm builds helm from the Go module proxy \
                  and writes SHARDGATE_HELM to ~/.cache/shardgate/env.sh), then \
                  `. ~/.cache/shardgate/env.sh`";
    let found = if let Some(v) = std::env::var_os("SHARDGATE_HELM").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(v);
        ensure!(
            executable(&path),
            "SHARDGATE_HELM is {}, which is not an executable file; {advice}",
            path.display()
        );
        path
    } else {
        let cached = tools::cache_dir().and_then(|cache| {
            let mut found: Vec<(Vec<u64>, PathBuf)> = std::fs::read_dir(&cache)
                .ok()?
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    let version = name.strip_prefix("helm-")?;
                    let bin = e.path().join("bin/helm");
                    let key = version
                        .split('.')
                        .filter_map(|p| p.parse().ok())
                        .collect::<Vec<u64>>();
                    executable(&bin).then_some((key, bin))
                })
                .collect();
            found.sort();
            found.pop().map(|(_, bin)| bin)
        });
        let on_path = || {
            std::env::var_os("PATH").and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join("helm"))
                    .find(|p| executable(p))
            })
        };
        cached.or_else(on_path).with_context(|| {
            format!(
                "helm not found (SHARDGATE_HELM is not set, no helm-*/bin/helm in the cache, no \
                 helm on PATH): {advice}"
            )
        })?
    };
    let out = Command::new(&found)
        .args(["version", "--short"])
        .output()
        .with_context(|| format!("running {} version", found.display()))?;
    let version = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && version.starts_with("v3."),
        "{} is not Helm 3 ({}); {advice}",
        found.display(),
        version.trim()
    );
    Ok(found)
}

/// Runs helm with `args`; its stdout, or an error with its stderr.
fn run_helm(args: &[&str]) -> Result<String> {
    let out = Command::new(helm()?)
        .args(args)
        .current_dir(repo(""))
        .output()
        .context("running helm")?;
    if !out.status.success() {
        bail!(
            "helm {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `helm template <release> deploy/helm/shardgate --namespace <ns> [extra]`, parsed.
fn render(release: &str, namespace: &str, extra: &[&str]) -> Result<Vec<Value>> {
    let mut args = vec!["template", release, CHART, "--namespace", namespace];
    args.extend_from_slice(extra);
    let text = run_helm(&args)?;
    parse_docs(&text, &format!("helm {}", args.join(" ")))
}

// --- kubectl -----------------------------------------------------------------------------

/// Runs kubectl against the test control plane with `stdin`; (stdout, stderr), or an error
/// with its stderr.
fn kubectl(cp: &ControlPlane, args: &[&str], stdin: &str) -> Result<(String, String)> {
    let mut child = Command::new(tools::kubectl()?)
        .arg(format!("--kubeconfig={}", cp.kubeconfig().display()))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running kubectl")?;
    child
        .stdin
        .take()
        .context("kubectl's stdin")?
        .write_all(stdin.as_bytes())
        .context("writing to kubectl")?;
    let out = child.wait_with_output().context("waiting for kubectl")?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    ensure!(
        out.status.success(),
        "kubectl {} failed ({}): {stderr}",
        args.join(" "),
        out.status
    );
    Ok((stdout, stderr))
}

/// `kubectl apply --server-side --dry-run=server -f -` of `yaml` (into `namespace` where
/// the objects name none). Warnings fail it too: the API server warns, for instance, of a pod
/// template that breaks its namespace's Pod Security Standard.
fn dry_run(cp: &ControlPlane, yaml: &str, namespace: Option<&str>, what: &str) -> Result<()> {
    let mut args = vec![
        "apply",
        "--server-side",
        "--dry-run=server",
        "--field-manager",
        MANAGER,
        "-f",
        "-",
    ];
    if let Some(ns) = namespace {
        args.extend(["--namespace", ns]);
    }
    let (_, stderr) = kubectl(cp, &args, yaml).with_context(|| format!("dry run of {what}"))?;
    ensure!(
        !stderr.contains("Warning"),
        "the API server warns about {what}: {stderr}"
    );
    Ok(())
}

/// `kubectl apply --server-side -f -` for real.
fn apply(cp: &ControlPlane, yaml: &str, what: &str) -> Result<()> {
    kubectl(
        cp,
        &[
            "apply",
            "--server-side",
            "--field-manager",
            MANAGER,
            "-f",
            "-",
        ],
        yaml,
    )
    .with_context(|| format!("applying {what}"))
    .map(drop)
}

/// deploy/operator/namespace.yaml and rbac.yaml, applied for real once per control plane
/// (the tests that need them run concurrently).
async fn install_namespace_and_rbac(cp: &Arc<ControlPlane>) -> Result<()> {
    static INSTALLED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    let cp = cp.clone();
    tokio::task::spawn_blocking(move || {
        INSTALLED
            .get_or_init(|| {
                let install = || -> Result<()> {
                    let mut yaml = read("deploy/operator/namespace.yaml")?;
                    yaml.push_str("\n---\n");
                    yaml.push_str(&read("deploy/operator/rbac.yaml")?);
                    apply(&cp, &yaml, "deploy/operator/{namespace,rbac}.yaml")
                };
                install().map_err(|e| format!("{e:#}"))
            })
            .clone()
    })
    .await?
    .map_err(|e| anyhow!(e))
}

// --- the operator's command line ---------------------------------------------------------

/// The long flags of `shardgate-controller` (the fields of `Args` in controller/src/main.rs).
fn operator_flags() -> Result<BTreeSet<String>> {
    let src = read("controller/src/main.rs")?;
    let body = src
        .split_once("struct Args {")
        .and_then(|(_, rest)| rest.split_once("\n}"))
        .map(|(body, _)| body)
        .context("no `struct Args { ... }` in controller/src/main.rs")?;
    let flags: BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.trim().split_once(": ").map(|(name, _)| name))
        .map(|name| name.trim_start_matches("pub "))
        .filter(|name| name.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .map(|name| format!("--{}", name.replace('_', "-")))
        .collect();
    ensure!(
        flags.contains("--leader-election"),
        "controller/src/main.rs: no --leader-election among {flags:?}"
    );
    Ok(flags)
}

/// Checks the operator's Deployment against the operator: every flag exists, the metrics
/// address is the `metrics` port, the downward-API variables are those it reads, the
/// hardening is there. Returns its args.
fn check_deployment(deployment: &Value) -> Result<Vec<String>> {
    let pod = &deployment["spec"]["template"]["spec"];
    let containers = pod["containers"].as_array().context("no containers")?;
    ensure!(
        containers.len() == 1,
        "one container, not {}",
        containers.len()
    );
    let c = &containers[0];
    let args: Vec<String> = c["args"]
        .as_array()
        .context("no args")?
        .iter()
        .map(|a| {
            a.as_str()
                .map(str::to_string)
                .context("an arg that is not a string")
        })
        .collect::<Result<_>>()?;
    let flags = operator_flags()?;
    for arg in args.iter().filter(|a| a.starts_with("--")) {
        ensure!(
            flags.contains(arg.as_str()),
            "the Deployment passes {arg}, which shardgate-controller does not have ({flags:?})"
        );
    }
    let value_of = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let metrics: SocketAddr = value_of("--metrics-addr")
        .context("no --metrics-addr")?
        .parse()
        .context("--metrics-addr")?;
    let port = c["ports"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "metrics"))
        .context("no container port named metrics")?;
    ensure!(
        port["containerPort"] == metrics.port(),
        "the metrics port {} is not --metrics-addr's {metrics}",
        port["containerPort"]
    );
    let main = read("controller/src/main.rs")?;
    for (var, field) in [
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        ensure!(
            main.contains(&format!("env = \"{var}\"")),
            "shardgate-controller does not read {var}"
        );
        let env = c["env"]
            .as_array()
            .and_then(|es| es.iter().find(|e| e["name"] == var))
            .with_context(|| format!("no env {var}"))?;
        ensure!(
            env["valueFrom"]["fieldRef"]["fieldPath"] == field,
            "{var} is not the downward API's {field}"
        );
    }
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &c[probe]["httpGet"];
        ensure!(
            get["path"] == path && get["port"] == "metrics",
            "{probe} is not GET {path} on the metrics port: {get}"
        );
    }
    let sc = &c["securityContext"];
    ensure!(
        sc["readOnlyRootFilesystem"] == true
            && sc["allowPrivilegeEscalation"] == false
            && sc["runAsNonRoot"] == true
            && sc["runAsUser"] == 65532
            && sc["capabilities"]["drop"] == json!(["ALL"])
            && sc["seccompProfile"]["type"] == "RuntimeDefault",
        "the container's securityContext is not the hardened one: {sc}"
    );
    ensure!(
        pod["securityContext"]["runAsNonRoot"] == true,
        "the pod does not require a non-root user"
    );
    for kind in ["requests", "limits"] {
        let r = &c["resources"][kind];
        ensure!(
            r["cpu"].is_string() && r["memory"].is_string(),
            "resources.{kind} needs cpu and memory: {r}"
        );
    }
    Ok(args)
}

// --- access reviews ----------------------------------------------------------------------

/// One API call: `verb` on `resource[.group][/subresource]`, optionally one object `name`,
/// in `namespace` (`None`: every namespace, or a cluster-scoped resource).
#[derive(Clone, Debug)]
struct Access {
    verb: &'static str,
    resource: &'static str,
    name: Option<String>,
    namespace: Option<String>,
}

fn access(verb: &'static str, resource: &'static str, namespace: Option<&str>) -> Access {
    Access {
        verb,
        resource,
        name: None,
        namespace: namespace.map(str::to_string),
    }
}

fn named(verb: &'static str, resource: &'static str, name: &str, namespace: &str) -> Access {
    Access {
        name: Some(name.to_string()),
        ..access(verb, resource, Some(namespace))
    }
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.verb, self.resource)?;
        if let Some(name) = &self.name {
            write!(f, " {name}")?;
        }
        match &self.namespace {
            Some(ns) => write!(f, " in {ns}"),
            None => write!(f, " (all namespaces)"),
        }
    }
}

/// Asks the API server whether `client`'s own identity may make `call`.
async fn can(client: &Client, call: &Access) -> Result<bool> {
    let (resource, subresource) = match call.resource.split_once('/') {
        Some((r, s)) => (r, Some(s.to_string())),
        None => (call.resource, None),
    };
    let (resource, group) = resource.split_once('.').unwrap_or((resource, ""));
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(call.verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource,
                name: call.name.clone(),
                namespace: call.namespace.clone(),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .with_context(|| format!("SelfSubjectAccessReview of {call}"))?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// Checks every call: the allowed first (retried a while: the RBAC authorizer sees new
/// bindings a moment after they are made), then the denied. Lists every wrong answer.
async fn check_access(client: &Client, allowed: &[Access], denied: &[Access]) -> Result<()> {
    if let Some(first) = allowed.first() {
        eventually(
            &format!("the service account may {first}"),
            Duration::from_secs(30),
            || async {
                ensure!(can(client, first).await?, "denied");
                Ok(())
            },
        )
        .await?;
    }
    let mut wrong = Vec::new();
    for call in allowed {
        if !can(client, call).await? {
            wrong.push(format!("denied, but the operator needs it: {call}"));
        }
    }
    for call in denied {
        if can(client, call).await? {
            wrong.push(format!(
                "allowed, but the operator does not need it: {call}"
            ));
        }
    }
    ensure!(wrong.is_empty(), "RBAC:\n  {}", wrong.join("\n  "));
    Ok(())
}

/// A client that authenticates as service account `namespace/name`, with a token from the
/// TokenRequest API (what `kubectl create token` does).
async fn service_account_client(env: &TestEnv, namespace: &str, name: &str) -> Result<Client> {
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: Vec::new(),
            expiration_seconds: Some(3600),
            ..Default::default()
        },
        ..Default::default()
    };
    let token = Api::<ServiceAccount>::namespaced(env.client.clone(), namespace)
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("a token for service account {namespace}/{name}"))?
        .status
        .context("a TokenRequest without status")?
        .token;
    let mut config = env.cp.kube_config()?;
    config.auth_info.token = Some(token.into());
    Client::try_from(config).context("a client with the service account's token")
}

/// What the operator does (controller/src/): each rule of deploy/operator/rbac.yaml, for
/// clusters in `ns`.
fn operator_calls(ns: &str, lease_ns: &str, lease: &str, cluster_wide: bool) -> Vec<Access> {
    let watch_ns = (!cluster_wide).then_some(ns);
    vec![
        access("list", "valkeyclusters.shardgate.io", watch_ns),
        access("watch", "valkeyclusters.shardgate.io", watch_ns),
        access("patch", "valkeyclusters.shardgate.io/status", Some(ns)),
        access("update", "valkeyclusters.shardgate.io/finalizers", Some(ns)),
        access("list", "statefulsets.apps", watch_ns),
        access("watch", "statefulsets.apps", watch_ns),
        access("create", "statefulsets.apps", Some(ns)),
        access("patch", "statefulsets.apps", Some(ns)),
        access("delete", "statefulsets.apps", Some(ns)),
        access("list", "services", watch_ns),
        access("watch", "services", watch_ns),
        access("create", "services", Some(ns)),
        access("patch", "services", Some(ns)),
        access("delete", "services", Some(ns)),
        access("list", "configmaps", watch_ns),
        access("watch", "configmaps", watch_ns),
        access("create", "configmaps", Some(ns)),
        access("patch", "configmaps", Some(ns)),
        access("create", "poddisruptionbudgets.policy", Some(ns)),
        access("patch", "poddisruptionbudgets.policy", Some(ns)),
        access("delete", "poddisruptionbudgets.policy", Some(ns)),
        // Proxy mode: the proxy's Deployment, ServiceAccount, Role and RoleBinding.
        access("get", "deployments.apps", Some(ns)),
        access("list", "deployments.apps", watch_ns),
        access("watch", "deployments.apps", watch_ns),
        access("create", "deployments.apps", Some(ns)),
        access("patch", "deployments.apps", Some(ns)),
        access("delete", "deployments.apps", Some(ns)),
        access("create", "serviceaccounts", Some(ns)),
        access("patch", "serviceaccounts", Some(ns)),
        access("delete", "serviceaccounts", Some(ns)),
        access("create", "roles.rbac.authorization.k8s.io", Some(ns)),
        access("patch", "roles.rbac.authorization.k8s.io", Some(ns)),
        access("delete", "roles.rbac.authorization.k8s.io", Some(ns)),
        access("create", "rolebindings.rbac.authorization.k8s.io", Some(ns)),
        access("patch", "rolebindings.rbac.authorization.k8s.io", Some(ns)),
        access("delete", "rolebindings.rbac.authorization.k8s.io", Some(ns)),
        access("get", "pods", Some(ns)),
        access("list", "pods", watch_ns),
        access("watch", "pods", watch_ns),
        access("delete", "pods", Some(ns)),
        access("create", "events.events.k8s.io", Some(ns)),
        access("patch", "events.events.k8s.io", Some(ns)),
        // spec.tls: the cluster's Secret, read by name.
        access("get", "secrets", Some(ns)),
        // Gateway mode: TCPRoutes made and removed, Gateways read.
        access("list", "tcproutes.gateway.networking.k8s.io", watch_ns),
        access("watch", "tcproutes.gateway.networking.k8s.io", watch_ns),
        access("create", "tcproutes.gateway.networking.k8s.io", Some(ns)),
        access("patch", "tcproutes.gateway.networking.k8s.io", Some(ns)),
        access("delete", "tcproutes.gateway.networking.k8s.io", Some(ns)),
        access("get", "gateways.gateway.networking.k8s.io", Some(ns)),
        access("list", "gateways.gateway.networking.k8s.io", watch_ns),
        access("watch", "gateways.gateway.networking.k8s.io", watch_ns),
        // Nodes: the address of a pod's node, for NodePort endpoints (cluster-scoped).
        access("get", "nodes", None),
        access("create", "leases.coordination.k8s.io", Some(lease_ns)),
        named("get", "leases.coordination.k8s.io", lease, lease_ns),
        named("update", "leases.coordination.k8s.io", lease, lease_ns),
    ]
}

/// What the operator never does, wherever it runs.
fn never(ns: &str, lease_ns: &str, lease: &str) -> Vec<Access> {
    vec![
        // Secrets: spec.tls's is read by name; none is listed or watched, nor written.
        access("list", "secrets", None),
        access("watch", "secrets", None),
        access("list", "secrets", Some(ns)),
        access("watch", "secrets", Some(ns)),
        access("create", "secrets", Some(ns)),
        access("patch", "secrets", Some(ns)),
        // The user's Gateways and their listeners are the user's.
        access("patch", "gateways.gateway.networking.k8s.io", Some(ns)),
        access("update", "gateways.gateway.networking.k8s.io", Some(ns)),
        access("delete", "gateways.gateway.networking.k8s.io", Some(ns)),
        // Cluster administration and privilege escalation.
        access("delete", "namespaces", None),
        access("create", "namespaces", None),
        access("create", "clusterroles.rbac.authorization.k8s.io", None),
        access("escalate", "clusterroles.rbac.authorization.k8s.io", None),
        access("bind", "clusterroles.rbac.authorization.k8s.io", None),
        access(
            "create",
            "clusterrolebindings.rbac.authorization.k8s.io",
            None,
        ),
        // The proxy's Role is granted from what the operator holds: it may not escalate or
        // bind beyond it.
        access("escalate", "roles.rbac.authorization.k8s.io", Some(ns)),
        access("bind", "roles.rbac.authorization.k8s.io", Some(ns)),
        access("impersonate", "users", None),
        access("impersonate", "serviceaccounts", Some(ns)),
        access(
            "list",
            "customresourcedefinitions.apiextensions.k8s.io",
            None,
        ),
        access(
            "update",
            "customresourcedefinitions.apiextensions.k8s.io",
            None,
        ),
        // Nodes are read one by one, never listed, watched or written.
        access("list", "nodes", None),
        access("watch", "nodes", None),
        access("patch", "nodes", None),
        access("update", "nodes/status", None),
        // The user's spec is the user's: only status is written.
        access("create", "valkeyclusters.shardgate.io", Some(ns)),
        access("update", "valkeyclusters.shardgate.io", Some(ns)),
        access("patch", "valkeyclusters.shardgate.io", Some(ns)),
        access("delete", "valkeyclusters.shardgate.io", Some(ns)),
        // Children are applied, and collected by the garbage collector, not deleted (but for
        // the StatefulSet of a node that scale-in removes, external Services and routes no
        // longer needed, and the proxy's objects when proxy mode is turned off).
        access("get", "statefulsets.apps", Some(ns)),
        access("update", "statefulsets.apps", Some(ns)),
        access("update", "services", Some(ns)),
        access("delete", "configmaps", Some(ns)),
        access("list", "poddisruptionbudgets.policy", Some(ns)),
        // Pods are the StatefulSets' to make; no exec, no logs.
        access("create", "pods", Some(ns)),
        access("update", "pods", Some(ns)),
        access("create", "pods/exec", Some(ns)),
        access("get", "pods/log", Some(ns)),
        access("create", "pods/eviction", Some(ns)),
        access("create", "persistentvolumeclaims", Some(ns)),
        access("delete", "persistentvolumeclaims", Some(ns)),
        // Events through events.k8s.io only; not deleted.
        access("create", "events", Some(ns)),
        access("delete", "events.events.k8s.io", Some(ns)),
        // Leases: its own, in its own namespace, only.
        named("update", "leases.coordination.k8s.io", lease, ns),
        access("create", "leases.coordination.k8s.io", Some(ns)),
        named(
            "get",
            "leases.coordination.k8s.io",
            "another-lease",
            lease_ns,
        ),
        named(
            "update",
            "leases.coordination.k8s.io",
            "another-lease",
            lease_ns,
        ),
        named(
            "update",
            "leases.coordination.k8s.io",
            "kube-controller-manager",
            "kube-system",
        ),
        access("list", "leases.coordination.k8s.io", Some(lease_ns)),
        named("delete", "leases.coordination.k8s.io", lease, lease_ns),
    ]
}

// --- the tests ---------------------------------------------------------------------------

/// deploy/operator/*.yaml and deploy/samples/ pass a server-side dry run; the Deployment is
/// hardened and matches the operator's command line and the RBAC's Lease.
async fn plain_manifests_apply(env: TestEnv) -> Result<()> {
    install_namespace_and_rbac(&env.cp).await?;
    let plain = by_kind_name(docs_in("deploy/operator")?, "deploy/operator")?;
    let kinds: BTreeSet<&str> = plain.keys().map(|(k, _)| k.as_str()).collect();
    let want: BTreeSet<&str> = [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
    ]
    .into();
    ensure!(
        kinds == want,
        "deploy/operator/ has {kinds:?}, not {want:?}"
    );

    // The namespace enforces the restricted Pod Security Standard; a Deployment whose pods
    // break it draws a warning, which fails the dry run.
    let ns = the(&plain, "Namespace")?;
    ensure!(
        ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted",
        "{SYSTEM_NS} does not enforce the restricted Pod Security Standard"
    );
    // In the README's order: the CRD, then the operator.
    for file in yaml_files_in(&repo("deploy/crds"))? {
        let text = std::fs::read_to_string(&file)?;
        dry_run(&env.cp, &text, None, &file.display().to_string())?;
    }
    for file in ["namespace.yaml", "rbac.yaml", "deployment.yaml"] {
        let path = format!("deploy/operator/{file}");
        dry_run(&env.cp, &read(&path)?, None, &path)?;
    }

    let deployment = the(&plain, "Deployment")?;
    let args = check_deployment(deployment)?;
    ensure!(
        deployment["spec"]["replicas"] == 2,
        "the operator runs 2 replicas"
    );
    let value_of = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
    };
    ensure!(
        args.iter().any(|a| a == "--leader-election")
            && value_of("--lease-namespace") == Some(SYSTEM_NS)
            && value_of("--lease-name") == Some(OPERATOR),
        "two replicas need --leader-election --lease-namespace {SYSTEM_NS} --lease-name \
         {OPERATOR}: {args:?}"
    );
    let image = deployment["spec"]["template"]["spec"]["containers"][0]["image"].clone();
    ensure!(
        image == format!("ghcr.io/shardgate/shardgate-controller:{VERSION}"),
        "the image {image} is not the workspace version {VERSION}"
    );
    ensure!(
        deployment["spec"]["template"]["spec"]["serviceAccountName"] == OPERATOR,
        "the Deployment does not run as {OPERATOR}"
    );
    // The Lease that --lease-name names is the one the Role lets it renew.
    let role = &plain[&("Role".to_string(), format!("{OPERATOR}-leader-election"))];
    let names = role["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["resourceNames"].as_array())
        .flatten()
        .collect::<Vec<_>>();
    ensure!(
        names == [OPERATOR],
        "the leader-election Role names {names:?}, not the lease {OPERATOR}"
    );

    // The sample: valid for the CRD on the API server (schema, CEL) and for the operator.
    let sample = read("deploy/samples/valkeycluster.yaml")?;
    dry_run(
        &env.cp,
        &sample,
        Some(env.ns.as_str()),
        "deploy/samples/valkeycluster.yaml",
    )?;
    // The TLS sample: its ValkeyCluster (cert-manager's kinds are not served here).
    let tls_sample = read("deploy/samples/valkeycluster-tls.yaml")?;
    let mut tls_vc = None;
    for doc in serde_yaml::Deserializer::from_str(&tls_sample) {
        let v = serde_json::Value::deserialize(doc).context("the TLS sample")?;
        match v["kind"].as_str() {
            Some("Issuer" | "Certificate") => {}
            Some("ValkeyCluster") => {
                dry_run(
                    &env.cp,
                    &serde_yaml::to_string(&v)?,
                    Some(env.ns.as_str()),
                    "deploy/samples/valkeycluster-tls.yaml's ValkeyCluster",
                )?;
                tls_vc = Some(serde_json::from_value::<ValkeyCluster>(v)?);
            }
            other => bail!("the TLS sample has a {other:?}"),
        }
    }
    let tls_vc = tls_vc.context("no ValkeyCluster in the TLS sample")?;
    tls_vc
        .spec
        .validate()
        .context("the TLS sample's ValkeyCluster")?;
    ensure!(
        tls_vc.spec.tls.as_ref().map(|t| t.secret_name.as_str()) == Some("demo-tls"),
        "the TLS sample's cluster: {:?}",
        tls_vc.spec.tls
    );
    // The gateway sample: the user's Gateway and a cluster routed through it.
    let gateway_sample = read("deploy/samples/valkeycluster-gateway.yaml")?;
    dry_run(
        &env.cp,
        &gateway_sample,
        Some(env.ns.as_str()),
        "deploy/samples/valkeycluster-gateway.yaml",
    )?;
    let mut gateway_listeners = Vec::new();
    let mut gateway_vc = None;
    for doc in serde_yaml::Deserializer::from_str(&gateway_sample) {
        let v = serde_json::Value::deserialize(doc).context("the gateway sample")?;
        match v["kind"].as_str() {
            Some("Gateway") => {
                gateway_listeners = v["spec"]["listeners"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            }
            Some("ValkeyCluster") => gateway_vc = Some(serde_json::from_value::<ValkeyCluster>(v)?),
            other => bail!("the gateway sample has a {other:?}"),
        }
    }
    let gateway_vc = gateway_vc.context("no ValkeyCluster in the gateway sample")?;
    gateway_vc
        .spec
        .validate()
        .map_err(|e| anyhow!("the gateway sample: {e}"))?;
    // The Gateway declares exactly the listeners the cluster's routes expect.
    let g = gateway_vc
        .spec
        .external_access()
        .and_then(|ea| ea.gateway.clone())
        .context("the gateway sample has no gateway")?;
    let layout = gateway_vc.spec.layout(g.base_port)?;
    let expected: Vec<(String, i64)> = gateway_vc
        .spec
        .node_refs()
        .map(|n| {
            let flat = layout.flat_index(n)?;
            let port = i64::from(layout.port(n)?);
            Ok((g.gateway_ref.section_for(flat).unwrap_or_default(), port))
        })
        .collect::<Result<_, shardgate_crds::PortError>>()?;
    let declared: Vec<(String, i64)> = gateway_listeners
        .iter()
        .map(|l| {
            (
                l["name"].as_str().unwrap_or_default().to_string(),
                l["port"].as_i64().unwrap_or_default(),
            )
        })
        .collect();
    ensure!(
        declared == expected,
        "the sample Gateway's listeners {declared:?}, the routes' {expected:?}"
    );

    let vc: ValkeyCluster = serde_yaml::from_str(&sample).context("the sample")?;
    vc.spec.validate().map_err(|e| anyhow!("the sample: {e}"))?;
    ensure!(
        (vc.spec.shards, vc.spec.replicas) == (3, 1) && !vc.spec.config.is_empty(),
        "the sample is a 3x1 cluster with some config"
    );
    Ok(())
}

/// `helm template` renders deploy/operator/ (but the Namespace, unless asked), with
/// deploy/crds/ as the chart's CRD; the values switch what they say.
async fn chart_renders_the_plain_manifests(_env: TestEnv) -> Result<()> {
    run_helm(&["lint", "--strict", CHART])?;
    run_helm(&["lint", "--strict", CHART, "--set", "watchNamespace=apps"])?;

    // The chart's version and appVersion are the workspace's.
    let chart: Value = serde_yaml::from_str(&read(&format!("{CHART}/Chart.yaml"))?)?;
    ensure!(
        chart["version"] == VERSION && chart["appVersion"] == VERSION,
        "Chart.yaml: version {} and appVersion {} are not the workspace version {VERSION}",
        chart["version"],
        chart["appVersion"]
    );

    // The CRD: the same files, byte for byte (crdgen writes deploy/crds/; copy them over).
    let files = |dir: &str| -> Result<BTreeMap<String, Vec<u8>>> {
        yaml_files_in(&repo(dir))?
            .into_iter()
            .map(|p| {
                let name = p
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                let bytes =
                    std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
                Ok((name, bytes))
            })
            .collect()
    };
    let (ours, theirs) = (files("deploy/crds")?, files(&format!("{CHART}/crds"))?);
    ensure!(
        ours.keys().eq(theirs.keys()),
        "{CHART}/crds has {:?}, deploy/crds has {:?}",
        theirs.keys(),
        ours.keys()
    );
    for (name, bytes) in &ours {
        ensure!(
            theirs[name] == *bytes,
            "{CHART}/crds/{name} differs from deploy/crds/{name}: \
             cp deploy/crds/*.yaml {CHART}/crds/"
        );
    }

    // The same objects as the plain manifests: Helm's labels aside, equal field for field.
    let plain = by_kind_name(docs_in("deploy/operator")?, "deploy/operator")?;
    let crds = by_kind_name(docs_in("deploy/crds")?, "deploy/crds")?;
    let rendered = |extra: &[&str]| -> Result<BTreeMap<(String, String), Value>> {
        let docs = render(RELEASE, SYSTEM_NS, extra)?;
        by_kind_name(
            docs.into_iter().map(without_helm_labels).collect(),
            "the chart",
        )
    };
    let compare = |what: &str,
                   got: &BTreeMap<(String, String), Value>,
                   want: &BTreeMap<(String, String), Value>|
     -> Result<()> {
        ensure!(
            got.keys().eq(want.keys()),
            "{what} renders {:?}, the plain manifests are {:?}",
            got.keys(),
            want.keys()
        );
        for (key, obj) in want {
            ensure!(
                got[key] == *obj,
                "{what}: {key:?} differs from the plain manifest\n chart: {}\n plain: {obj}",
                got[key]
            );
        }
        Ok(())
    };
    let mut without_ns = plain.clone();
    without_ns.retain(|(kind, _), _| kind != "Namespace");
    compare("the chart", &rendered(&[])?, &without_ns)?;
    compare(
        "the chart with createNamespace",
        &rendered(&["--set", "createNamespace=true"])?,
        &plain,
    )?;
    let mut with_crds = without_ns.clone();
    with_crds.extend(crds);
    compare(
        "the chart with --include-crds",
        &rendered(&["--include-crds"])?,
        &with_crds,
    )?;

    // watchNamespace: the same namespaced rules in a Role there instead of the ClusterRole,
    // the cluster-scoped one (Nodes) in a ClusterRole of its own, and --namespace.
    let scoped = rendered(&["--set", "watchNamespace=apps"])?;
    let kinds: BTreeSet<(String, String)> = scoped.keys().cloned().collect();
    let role = &scoped[&("Role".to_string(), OPERATOR.to_string())];
    let nodes_role = format!("{OPERATOR}-nodes");
    let all_rules = plain[&("ClusterRole".to_string(), OPERATOR.to_string())]["rules"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let (node_rules, ns_rules): (Vec<Value>, Vec<Value>) = all_rules
        .into_iter()
        .partition(|r| r["resources"] == json!(["nodes"]));
    let cluster_kinds: BTreeSet<(String, String)> = kinds
        .iter()
        .filter(|(k, _)| k.starts_with("Cluster"))
        .cloned()
        .collect();
    ensure!(
        cluster_kinds
            == BTreeSet::from([
                ("ClusterRole".to_string(), nodes_role.clone()),
                ("ClusterRoleBinding".to_string(), nodes_role.clone()),
            ])
            && scoped[&("ClusterRole".to_string(), nodes_role.clone())]["rules"]
                == Value::Array(node_rules)
            && role["metadata"]["namespace"] == "apps"
            && role["rules"] == Value::Array(ns_rules)
            && scoped[&("RoleBinding".to_string(), OPERATOR.to_string())]["metadata"]["namespace"]
                == "apps",
        "watchNamespace=apps: not a Role and RoleBinding in apps with the ClusterRole's \
         namespaced rules and a Nodes ClusterRole: {kinds:?}"
    );
    let args = check_deployment(the(&scoped, "Deployment")?)?;
    ensure!(
        args[..2] == ["--namespace", "apps"],
        "watchNamespace=apps: the args are {args:?}"
    );

    // Values that change the operator's command line.
    let custom = rendered(&[
        "--set",
        "replicas=1,leaderElection.enabled=false,metrics.port=9100,logFormat=text",
        "--set",
        "image.tag=dev,fullnameOverride=vk-operator",
    ])?;
    let deployment = the(&custom, "Deployment")?;
    let args = check_deployment(deployment)?;
    ensure!(
        args == ["--metrics-addr", "0.0.0.0:9100", "--log-format", "text"]
            && deployment["spec"]["replicas"] == 1
            && deployment["spec"]["template"]["spec"]["containers"][0]["image"]
                == "ghcr.io/shardgate/shardgate-controller:dev"
            && deployment["metadata"]["name"] == "vk-operator"
            && !custom.keys().any(|(k, _)| k == "Role"),
        "custom values: {args:?}, {:?}",
        custom.keys()
    );
    let lease = rendered(&["--set", "leaderElection.leaseDuration=30s,apiTimeout=10s"])?;
    let args = check_deployment(the(&lease, "Deployment")?)?;
    ensure!(
        args.windows(2).any(|w| w == ["--lease-duration", "30s"])
            && args.windows(2).any(|w| w == ["--api-timeout", "10s"]),
        "leaderElection.leaseDuration, apiTimeout: {args:?}"
    );
    let err = render(
        RELEASE,
        SYSTEM_NS,
        &["--set", "leaderElection.enabled=false"],
    )
    .err()
    .context("two replicas without leader election rendered")?;
    ensure!(
        format!("{err:#}").contains("needs leaderElection"),
        "two replicas without leader election: {err:#}"
    );
    Ok(())
}

/// The chart's output, cluster-wide and namespace-scoped, passes a server-side dry run.
async fn chart_output_applies(env: TestEnv) -> Result<()> {
    install_namespace_and_rbac(&env.cp).await?;
    let docs = render(RELEASE, SYSTEM_NS, &["--include-crds"])?;
    dry_run(&env.cp, &stream_of(&docs), None, "the chart's output")?;
    let scoped = render(
        "scoped",
        &env.ns,
        &["--set", &format!("watchNamespace={}", env.ns)],
    )?;
    dry_run(
        &env.cp,
        &stream_of(&scoped),
        None,
        "the chart's output with watchNamespace",
    )?;
    Ok(())
}

/// deploy/operator/rbac.yaml allows each call the operator makes and denies the rest, as
/// the API server answers the service account itself.
async fn rbac_least_privilege(env: TestEnv) -> Result<()> {
    install_namespace_and_rbac(&env.cp).await?;
    let sa = service_account_client(&env, SYSTEM_NS, OPERATOR).await?;
    // Cluster-wide: the watches are of every namespace, the writes in the clusters' own.
    let mut allowed = operator_calls(&env.ns, SYSTEM_NS, OPERATOR, true);
    let mut seen: BTreeSet<String> = allowed.iter().map(Access::to_string).collect();
    allowed.extend(
        operator_calls(&env.ns, SYSTEM_NS, OPERATOR, false)
            .into_iter()
            .filter(|call| seen.insert(call.to_string())),
    );
    check_access(&sa, &allowed, &never(&env.ns, SYSTEM_NS, OPERATOR)).await
}

/// With watchNamespace, the operator may act in that namespace only.
async fn scoped_chart_rbac(env: TestEnv) -> Result<()> {
    let watched = env.cp.namespace("deploy-watched").await?;
    let release = "scoped";
    let name = "scoped-shardgate-operator";
    let docs = render(
        release,
        &env.ns,
        &["--set", &format!("watchNamespace={watched}")],
    )?;
    let rbac: Vec<&Value> = docs
        .iter()
        .filter(|d| {
            [
                "ServiceAccount",
                "Role",
                "RoleBinding",
                "ClusterRole",
                "ClusterRoleBinding",
            ]
            .contains(&d["kind"].as_str().unwrap_or(""))
        })
        .collect();
    ensure!(
        rbac.len() == 7,
        "watchNamespace: a ServiceAccount, two Roles with their bindings and the Nodes' \
         ClusterRole with its binding, not {:?}",
        rbac.iter().map(|d| kind_name(d)).collect::<Vec<_>>()
    );
    let yaml = stream_of(rbac);
    let cp = env.cp.clone();
    tokio::task::spawn_blocking(move || apply(&cp, &yaml, "the scoped chart's RBAC")).await??;

    let sa = service_account_client(&env, &env.ns, name).await?;
    let allowed = operator_calls(&watched, &env.ns, name, false);
    let mut denied = never(&watched, &env.ns, name);
    denied.extend([
        // Not cluster-wide, and not in another namespace (its own included).
        access("list", "valkeyclusters.shardgate.io", None),
        access("list", "pods", None),
        access("list", "statefulsets.apps", None),
        access("list", "valkeyclusters.shardgate.io", Some(env.ns.as_str())),
        access("patch", "statefulsets.apps", Some(env.ns.as_str())),
        access("delete", "pods", Some(env.ns.as_str())),
        access("list", "valkeyclusters.shardgate.io", Some(SYSTEM_NS)),
    ]);
    check_access(&sa, &allowed, &denied).await
}

/// The operator, with the service account's token and nothing else: it takes the Lease,
/// reconciles a 1x0 ValkeyCluster to Ready while watching every namespace, publishes
/// events, and gives the Lease back.
async fn operator_runs_under_its_rbac(env: TestEnv) -> Result<()> {
    install_namespace_and_rbac(&env.cp).await?;
    let sa = service_account_client(&env, SYSTEM_NS, OPERATOR).await?;
    check_access(
        &sa,
        &[access("list", "valkeyclusters.shardgate.io", None)],
        &[],
    )
    .await?;

    // As the binary runs with --leader-election (controller/src/main.rs): wait for the
    // Lease, run the controller while renewing it, give it back on shutdown. A short lease
    // so that it is renewed (updated) several times during the test.
    let identity = format!("{OPERATOR}-{}", env.ns);
    let election = Arc::new(LeaderElection::new(
        sa.clone(),
        SYSTEM_NS,
        OPERATOR,
        &identity,
        Duration::from_secs(3),
    ));
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::default().register(&mut registry));
    let ctx = Arc::new(Context::new(sa.clone(), metrics, Some(identity.clone())));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let operator = tokio::spawn(run_as_leader(election, ctx, Scope::default(), async move {
        let _ = stopped.await;
    }));
    let leases: Api<Lease> = Api::namespaced(env.client.clone(), SYSTEM_NS);
    let holder = |lease: Lease| lease.spec.and_then(|s| s.holder_identity);
    eventually(
        "the operator holds the Lease",
        Duration::from_secs(60),
        || async {
            let held = holder(leases.get(OPERATOR).await?);
            ensure!(
                held.as_deref() == Some(identity.as_str()),
                "held by {held:?}"
            );
            Ok(())
        },
    )
    .await?;

    let name = "under-rbac";
    let vc = valkey_cluster(json!({
        "apiVersion": "shardgate.io/v1alpha1",
        "kind": "ValkeyCluster",
        "metadata": { "name": name },
        "spec": { "shards": 1, "replicas": 0, "config": { "maxmemory": "16mb" } },
    }))?;
    create(&env.client, &env.ns, &vc).await?;
    let result = async {
        let vc = wait_ready(&env.client, &env.ns, name, Duration::from_secs(180))
            .await
            .context("a ValkeyCluster reconciled by the operator under its own RBAC")?;
        let conditions = vc.status.map(|s| s.conditions.len()).unwrap_or(0);
        ensure!(conditions > 0, "Ready without conditions");
        let events: Api<Event> = Api::namespaced(env.client.clone(), &env.ns);
        eventually(
            "an event from the operator",
            Duration::from_secs(30),
            || async {
                let list = events.list(&Default::default()).await?;
                ensure!(
                    list.items.iter().any(|e| {
                        e.reporting_controller.as_deref() == Some(OPERATOR)
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                    }),
                    "no event about {name} from {OPERATOR} among {}",
                    list.items.len()
                );
                Ok(())
            },
        )
        .await
    }
    .await;

    let stopped_early = operator.is_finished();
    let _ = stop.send(());
    let ended = tokio::time::timeout(Duration::from_secs(30), operator).await;
    if let Err(e) = result {
        // A call the RBAC denies shows as the operator's warnings (ReconcileFailed ...).
        let warnings = Api::<Event>::namespaced(env.client.clone(), &env.ns)
            .list(&Default::default())
            .await
            .map(|l| {
                l.items
                    .into_iter()
                    .filter(|e| e.type_.as_deref() == Some("Warning"))
                    .map(|e| {
                        format!(
                            "{}: {}",
                            e.reason.unwrap_or_default(),
                            e.note.unwrap_or_default()
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        let early = match (stopped_early, &ended) {
            (true, Ok(Ok(how))) => format!("the operator had stopped by itself ({how:?}); "),
            _ => String::new(),
        };
        return Err(e.context(format!("{early}the operator's warnings: {warnings:#?}")));
    }
    // Shutdown, not a lost lease: every renewal went through.
    let ended = ended
        .context("the operator did not stop within 30s")?
        .context("the operator's task")?;
    ensure!(
        ended == Ended::Shutdown,
        "the operator ended with {ended:?}"
    );
    let transitions = leases
        .get(OPERATOR)
        .await?
        .spec
        .and_then(|s| s.lease_transitions);
    ensure!(
        holder(leases.get(OPERATOR).await?).is_none(),
        "the Lease was not given back on shutdown"
    );
    ensure!(
        transitions == Some(0),
        "the Lease changed hands {transitions:?} times: a renewal failed"
    );
    Ok(())
}

// --- the Dockerfile ----------------------------------------------------------------------

/// One stage of a Dockerfile: its base, its name and its instructions (continuations
/// joined, comments dropped).
#[derive(Debug)]
struct Stage {
    base: String,
    name: Option<String>,
    instructions: Vec<Instruction>,
}

/// An instruction (upper case) and its arguments.
type Instruction = (String, String);

/// The instructions before the first FROM, and the stages.
fn parse_dockerfile(text: &str) -> Result<(Vec<Instruction>, Vec<Stage>)> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                lines.push(std::mem::take(&mut current));
            }
        }
    }
    let mut globals = Vec::new();
    let mut stages: Vec<Stage> = Vec::new();
    for line in lines {
        let (op, rest) = line
            .split_once(char::is_whitespace)
            .unwrap_or((line.as_str(), ""));
        let (op, rest) = (op.to_ascii_uppercase(), rest.trim().to_string());
        if op == "FROM" {
            let words: Vec<&str> = rest.split_whitespace().collect();
            let base = words.first().context("FROM without an image")?.to_string();
            let name = match words.as_slice() {
                [_, as_, name] if as_.eq_ignore_ascii_case("as") => Some(name.to_string()),
                [_] => None,
                _ => bail!("FROM {rest}: not `FROM image [AS name]`"),
            };
            stages.push(Stage {
                base,
                name,
                instructions: Vec::new(),
            });
        } else if let Some(stage) = stages.last_mut() {
            stage.instructions.push((op, rest));
        } else {
            globals.push((op, rest));
        }
    }
    Ok((globals, stages))
}

/// The workspace's binaries, by package (`cargo metadata`), and its rust-version.
fn workspace_binaries() -> Result<(BTreeMap<String, String>, String)> {
    let out = Command::new(option_env!("CARGO").unwrap_or("cargo"))
        .args([
            "metadata",
            "--no-deps",
            "--offline",
            "--format-version",
            "1",
        ])
        .current_dir(repo(""))
        .output()
        .context("running cargo metadata")?;
    ensure!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).context("cargo metadata's JSON")?;
    let mut bins = BTreeMap::new();
    let mut rust_version = None;
    for package in meta["packages"].as_array().into_iter().flatten() {
        let pkg = package["name"].as_str().unwrap_or_default();
        for target in package["targets"].as_array().into_iter().flatten() {
            if target["kind"]
                .as_array()
                .is_some_and(|k| k.contains(&json!("bin")))
            {
                bins.insert(
                    target["name"].as_str().unwrap_or_default().to_string(),
                    pkg.to_string(),
                );
            }
        }
        if pkg == "shardgate-controller" {
            rust_version = package["rust_version"].as_str().map(str::to_string);
        }
    }
    Ok((
        bins,
        rust_version.context("no rust-version for shardgate-controller")?,
    ))
}

fn version_key(v: &str) -> Vec<u64> {
    v.split('.').filter_map(|p| p.parse().ok()).collect()
}

/// deploy/Dockerfile (there is no Docker here): multi-stage, builds both binaries of the
/// workspace with --locked, one final stage per binary that runs it as a non-root user; the
/// default stage is the operator, whose image the manifests name.
async fn dockerfile_agrees_with_the_workspace(_env: TestEnv) -> Result<()> {
    let text = read("deploy/Dockerfile")?;
    let (globals, stages) = parse_dockerfile(&text)?;
    let (bins, rust_version) = workspace_binaries()?;
    let wanted = ["shardgate-controller", "shardgate-proxy"];
    for bin in wanted {
        ensure!(
            bins.get(bin).map(String::as_str) == Some(bin),
            "the workspace has no binary {bin} in package {bin}: {bins:?}"
        );
    }

    let stage = |name: &str| stages.iter().find(|s| s.name.as_deref() == Some(name));
    let build = stages
        .iter()
        .find(|s| {
            s.instructions
                .iter()
                .any(|(op, rest)| op == "RUN" && rest.contains("cargo build"))
        })
        .context("no stage runs cargo build")?;
    let build_name = build.name.clone().context("the build stage has no name")?;
    ensure!(
        build.base.starts_with("rust:"),
        "the build stage is FROM {}, not the rust image",
        build.base
    );
    let cargo = build
        .instructions
        .iter()
        .find(|(op, rest)| op == "RUN" && rest.contains("cargo build"))
        .map(|(_, rest)| rest.split_whitespace().collect::<Vec<_>>())
        .unwrap_or_default();
    for flag in ["--release", "--locked"] {
        ensure!(
            cargo.contains(&flag),
            "cargo build without {flag}: {cargo:?}"
        );
    }
    // The toolchain: the workspace's rust-version at least.
    let rust_arg = globals
        .iter()
        .find_map(|(op, rest)| {
            (op == "ARG")
                .then(|| rest.strip_prefix("RUST_VERSION="))
                .flatten()
        })
        .context("no ARG RUST_VERSION=... before the first FROM")?;
    ensure!(
        build.base.contains("${RUST_VERSION}")
            && version_key(rust_arg) >= version_key(&rust_version),
        "RUST_VERSION {rust_arg} is older than the workspace's rust-version {rust_version}, or \
         the build stage ({}) does not use it",
        build.base
    );

    // The user a stage runs as: its last USER, else its base stage's.
    fn user_of<'a>(stages: &'a [Stage], stage: &'a Stage) -> Option<&'a str> {
        stage
            .instructions
            .iter()
            .rev()
            .find(|(op, _)| op == "USER")
            .map(|(_, u)| u.as_str())
            .or_else(|| {
                let base = stages
                    .iter()
                    .find(|s| s.name.as_deref() == Some(stage.base.as_str()))?;
                user_of(stages, base)
            })
    }
    for bin in wanted {
        ensure!(
            cargo.windows(2).any(|w| w == ["--bin", bin]),
            "cargo build does not build --bin {bin}: {cargo:?}"
        );
        let s = stage(bin)
            .with_context(|| format!("no stage `{bin}` (docker build --target {bin})"))?;
        let path = format!("/usr/local/bin/{bin}");
        ensure!(
            s.instructions.iter().any(|(op, rest)| op == "COPY"
                && rest.starts_with(&format!("--from={build_name} "))
                && rest.contains(&format!("/{bin} "))
                && rest.ends_with(&path)),
            "stage {bin} does not copy {bin} from the build stage to {path}"
        );
        let entrypoint = s
            .instructions
            .iter()
            .rev()
            .find(|(op, _)| op == "ENTRYPOINT")
            .map(|(_, e)| serde_json::from_str::<Vec<String>>(e))
            .with_context(|| format!("stage {bin} has no ENTRYPOINT"))?
            .with_context(|| format!("stage {bin}: ENTRYPOINT is not in exec form"))?;
        ensure!(
            entrypoint == [path.clone()],
            "stage {bin}'s ENTRYPOINT is {entrypoint:?}"
        );
        let user = user_of(&stages, s).with_context(|| format!("stage {bin} has no USER"))?;
        let uid = user.split(':').next().unwrap_or_default();
        ensure!(
            uid.parse::<u32>().is_ok_and(|uid| uid != 0),
            "stage {bin} runs as {user}: not a numeric non-root user (runAsNonRoot needs one)"
        );
        ensure!(
            s.base != build_name && !s.base.starts_with("rust:"),
            "stage {bin} ships the build toolchain ({})",
            s.base
        );
    }
    let last = stages.last().and_then(|s| s.name.as_deref());
    ensure!(
        last == Some("shardgate-controller"),
        "the default (last) stage is {last:?}, not the operator"
    );
    // The manifests' image is this Dockerfile's operator stage.
    let plain = by_kind_name(docs_in("deploy/operator")?, "deploy/operator")?;
    let image = the(&plain, "Deployment")?["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    ensure!(
        image
            .rsplit_once(':')
            .and_then(|(repo, _)| repo.rsplit('/').next())
            == Some("shardgate-controller"),
        "the Deployment's image {image} is not the Dockerfile's shardgate-controller"
    );
    Ok(())
}
