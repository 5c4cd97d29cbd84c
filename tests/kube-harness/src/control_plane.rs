//! etcd, kube-apiserver and kube-controller-manager on loopback, plus the node agent.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use kube::api::{Api, ObjectMeta, PostParams};
use kube::Client;

use super::agent::{AgentConfig, NodeAgent};
use super::crds;
use super::pki::Pki;
use super::process::{self, Daemon};
use shardgate_harness::addr::free_port;
use shardgate_harness::tools;

const LOCALHOST: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// Generous: on two busy cores the API server takes 10-20 s to become ready.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// What to start besides the control plane itself.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// YAML files applied after start-up (CRDs first), in addition to the Gateway API CRDs:
    /// e.g. [`yaml_files_in`]`("deploy/crds")`.
    pub yaml_files: Vec<PathBuf>,
    /// Skip the Gateway API CRDs (to test the operator without them).
    pub without_gateway_api: bool,
}

/// A running control plane with one node. Everything stops, and its directory is removed,
/// on [`ControlPlane::shutdown`] or drop (also when a test panics); set
/// `SHARDGATE_KEEP_KUBE=1` to keep the directory (logs, etcd data) for a post-mortem.
pub struct ControlPlane {
    root: PathBuf,
    pki: Pki,
    api: SocketAddr,
    kubeconfig: PathBuf,
    agent: Option<NodeAgent>,
    controller_manager: Option<Daemon>,
    apiserver: Option<Daemon>,
    etcd: Option<Daemon>,
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver, kube-controller-manager and the node agent, and installs
    /// the Gateway API CRDs. Must be called inside a Tokio runtime; the agent runs on its own.
    pub async fn start() -> Result<ControlPlane> {
        Self::start_with(Options::default()).await
    }

    /// [`ControlPlane::start`] with more YAML to install.
    pub async fn start_with(options: Options) -> Result<ControlPlane> {
        let started = Instant::now();
        let etcd_bin = tools::etcd()?;
        let apiserver_bin = tools::kube_apiserver()?;
        let kcm_bin = tools::kube_controller_manager()?;
        let mut yaml = Vec::new();
        if !options.without_gateway_api {
            yaml.extend(yaml_files_in(&gateway_api_crds_dir()?)?);
        }
        yaml.extend(options.yaml_files.iter().cloned());

        process::reap_strays_once();
        let root = process::new_root_dir("k")?;
        let pki_dir = mkdir(&root.join("pki"))?;
        let pki = Pki::generate(&pki_dir)?;
        let mut cp = ControlPlane {
            api: SocketAddr::from((LOCALHOST, free_port(LOCALHOST))),
            kubeconfig: root.join("kubeconfig"),
            root,
            pki,
            agent: None,
            controller_manager: None,
            apiserver: None,
            etcd: None,
        };
        cp.write_kubeconfig()?;

        // --- etcd
        let etcd_client = SocketAddr::from((LOCALHOST, free_port(LOCALHOST)));
        let etcd_peer = SocketAddr::from((LOCALHOST, free_port(LOCALHOST)));
        let mut cmd = Command::new(&etcd_bin);
        cmd.arg("--name=default")
            .arg(format!("--data-dir={}", cp.root.join("etcd").display()))
            .arg(format!("--listen-client-urls=http://{etcd_client}"))
            .arg(format!("--advertise-client-urls=http://{etcd_client}"))
            .arg(format!("--listen-peer-urls=http://{etcd_peer}"))
            .arg(format!("--initial-advertise-peer-urls=http://{etcd_peer}"))
            .arg(format!("--initial-cluster=default=http://{etcd_peer}"))
            // Test data: durability is not wanted, speed is.
            .arg("--unsafe-no-fsync")
            .arg("--log-level=warn");
        cp.etcd = Some(Daemon::spawn("etcd", cmd, &cp.root.join("etcd.log"))?);
        cp.wait_async("etcd", || async {
            let (status, body) = shardgate_harness::http::get(etcd_client, "/health")?;
            Ok(status == 200 && body.contains("true"))
        })
        .await?;

        // --- kube-apiserver
        let mut cmd = Command::new(&apiserver_bin);
        let p = &cp.pki;
        cmd.arg(format!("--etcd-servers=http://{etcd_client}"))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg(format!("--secure-port={}", cp.api.port()))
            .arg(format!(
                "--cert-dir={}",
                cp.root.join("apiserver").display()
            ))
            .arg(format!("--tls-cert-file={}", p.server_cert.display()))
            .arg(format!("--tls-private-key-file={}", p.server_key.display()))
            .arg(format!("--client-ca-file={}", p.ca_cert.display()))
            .arg(format!("--token-auth-file={}", p.token_file.display()))
            .arg("--authorization-mode=Node,RBAC")
            .arg(format!("--service-account-issuer=https://{}", cp.api))
            .arg(format!("--service-account-key-file={}", p.sa_pub.display()))
            .arg(format!(
                "--service-account-signing-key-file={}",
                p.sa_key.display()
            ))
            // ClusterIPs are bookkeeping only: nothing here routes them.
            .arg("--service-cluster-ip-range=10.96.0.0/16")
            .arg("--service-node-port-range=30000-32767")
            .arg("--allow-privileged=true")
            .arg("--profiling=false");
        cp.apiserver = Some(Daemon::spawn(
            "kube-apiserver",
            cmd,
            &cp.root.join("kube-apiserver.log"),
        )?);
        let client = cp.client()?;
        cp.wait_async("kube-apiserver /readyz", || async {
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .context("request")?;
            Ok(client
                .request_text(req)
                .await
                .is_ok_and(|body| body == "ok"))
        })
        .await?;

        // --- kube-controller-manager
        let mut cmd = Command::new(&kcm_bin);
        cmd.arg(format!("--kubeconfig={}", cp.kubeconfig.display()))
            .arg(format!(
                "--authentication-kubeconfig={}",
                cp.kubeconfig.display()
            ))
            .arg(format!(
                "--authorization-kubeconfig={}",
                cp.kubeconfig.display()
            ))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--secure-port={}", free_port(LOCALHOST)))
            .arg(format!("--cert-dir={}", cp.root.join("kcm").display()))
            .arg("--leader-elect=false")
            .arg(format!(
                "--service-account-private-key-file={}",
                p.sa_key.display()
            ))
            .arg(format!("--root-ca-file={}", p.ca_cert.display()))
            .arg(format!(
                "--cluster-signing-cert-file={}",
                p.ca_cert.display()
            ))
            .arg(format!("--cluster-signing-key-file={}", p.ca_key.display()))
            // Faster than the defaults, for tests that wait on these controllers.
            .arg("--concurrent-statefulset-syncs=5")
            .arg("--concurrent-gc-syncs=5");
        cp.controller_manager = Some(Daemon::spawn(
            "kube-controller-manager",
            cmd,
            &cp.root.join("kube-controller-manager.log"),
        )?);
        // The service-account controller creating `default/default` shows it is up.
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
        cp.wait_async(
            "kube-controller-manager (ServiceAccount default/default)",
            || {
                let sas = sas.clone();
                async move { Ok(sas.get_opt("default").await?.is_some()) }
            },
        )
        .await?;

        // --- the node agent
        let agent = NodeAgent::start(AgentConfig {
            root: cp.root.join("node"),
            client_config: cp.kube_config()?,
            api: cp.api,
        })?;
        cp.agent = Some(agent);
        let node_name = cp.node_name().to_string();
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
        cp.wait_async("the node agent's Node", || {
            let (nodes, node_name) = (nodes.clone(), node_name.clone());
            async move { Ok(nodes.get_opt(&node_name).await?.is_some()) }
        })
        .await?;

        crds::apply_files(&client, &yaml).await?;
        tracing::info!(
            "control plane up in {:.1?}: kubeconfig {}",
            started.elapsed(),
            cp.kubeconfig.display()
        );
        Ok(cp)
    }

    /// A new client for the admin user (`system:masters`). Each test should make its own:
    /// a client's connections belong to the Tokio runtime that made them.
    pub fn client(&self) -> Result<Client> {
        tokio::runtime::Handle::try_current()
            .map_err(|_| anyhow!("ControlPlane::client must be called inside a Tokio runtime"))?;
        Client::try_from(self.kube_config()?).context("building a kube client")
    }

    /// The `kube::Config` behind [`ControlPlane::client`].
    pub fn kube_config(&self) -> Result<kube::Config> {
        let url = format!("https://{}", self.api)
            .parse()
            .context("API server URL")?;
        let mut config = kube::Config::new(url);
        config.root_cert = Some(vec![self.pki.ca_der.clone()]);
        config.auth_info.token = Some(self.pki.admin_token.clone().into());
        config.default_namespace = "default".into();
        Ok(config)
    }

    /// A kubeconfig file for `kubectl --kubeconfig` (printed in logs for debugging).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The API server's address.
    pub fn api_addr(&self) -> SocketAddr {
        self.api
    }

    /// The harness directory: logs of every daemon and pod.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The node the agent registered.
    pub fn node_name(&self) -> &str {
        super::agent::NODE_NAME
    }

    /// The node agent: pod processes, fault injection, Service listeners.
    pub fn agent(&self) -> &NodeAgent {
        self.agent
            .as_ref()
            .expect("the agent runs for as long as the control plane")
    }

    /// Creates a namespace `<prefix>-<random>` and waits until pods can be created in it (its
    /// `default` ServiceAccount and `kube-root-ca.crt` ConfigMap exist).
    pub async fn namespace(&self, prefix: &str) -> Result<String> {
        let client = self.client()?;
        // Namespace names are DNS labels: at most 63 characters.
        let prefix: String = prefix.chars().take(48).collect();
        let name = format!(
            "{}-{}",
            prefix.trim_end_matches('-'),
            super::pki::random_hex(3)?
        );
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
        let cms: Api<ConfigMap> = Api::namespaced(client, &name);
        self.wait_async(&format!("namespace {name} ready for pods"), || {
            let (sas, cms) = (sas.clone(), cms.clone());
            async move {
                Ok(sas.get_opt("default").await?.is_some()
                    && cms.get_opt("kube-root-ca.crt").await?.is_some())
            }
        })
        .await?;
        Ok(name)
    }

    /// Runs `kubectl --kubeconfig <ours> <args>` and returns its stdout; an error with its
    /// stderr if it fails.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        let out = Command::new(tools::kubectl()?)
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .args(args)
            .output()
            .context("running kubectl")?;
        if !out.status.success() {
            bail!(
                "kubectl {} failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Installs YAML files (every document, CRDs first) with server-side apply, and waits
    /// for the CRDs among them to be established.
    pub async fn apply_yaml_files(&self, files: &[PathBuf]) -> Result<()> {
        crds::apply_files(&self.client()?, files).await
    }

    /// Stops the agent (and every pod process), the controller manager, the API server and
    /// etcd, in that order, and removes the directory. Drop does the same.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        if let Some(agent) = self.agent.take() {
            agent.shutdown();
        }
        for daemon in [
            self.controller_manager.take(),
            self.apiserver.take(),
            self.etcd.take(),
        ]
        .into_iter()
        .flatten()
        {
            drop(daemon);
        }
        if std::env::var_os("SHARDGATE_KEEP_KUBE").is_none() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    fn write_kubeconfig(&self) -> Result<()> {
        let ca = self.pki.ca_pem.as_bytes();
        let yaml = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: shardgate-test\n  cluster:\n    \
             server: https://{api}\n    certificate-authority-data: {ca}\nusers:\n- name: \
             admin\n  user:\n    token: {token}\ncontexts:\n- name: shardgate-test\n  \
             context:\n    cluster: shardgate-test\n    user: admin\n    namespace: \
             default\ncurrent-context: shardgate-test\n",
            api = self.api,
            ca = base64(ca),
            token = self.pki.admin_token,
        );
        std::fs::write(&self.kubeconfig, yaml)
            .with_context(|| format!("writing {}", self.kubeconfig.display()))
    }

    /// Polls `ready` until it says yes; fails at once if a daemon exited, with the logs.
    async fn wait_async<F, Fut>(&self, what: &str, mut ready: F) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool>>,
    {
        let deadline = Instant::now() + START_TIMEOUT;
        let mut last_err = None;
        loop {
            for daemon in [&self.etcd, &self.apiserver, &self.controller_manager]
                .into_iter()
                .flatten()
            {
                daemon
                    .check_running()
                    .with_context(|| format!("waiting for {what}"))?;
            }
            match ready().await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => last_err = Some(e),
            }
            if Instant::now() > deadline {
                bail!(
                    "{what} not ready after {START_TIMEOUT:?} (last error: {last_err:?}){}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The tails of the daemons' logs, for error messages.
    fn logs(&self) -> String {
        let mut out = String::new();
        for (name, daemon) in [
            ("etcd", &self.etcd),
            ("kube-apiserver", &self.apiserver),
            ("kube-controller-manager", &self.controller_manager),
        ] {
            if let Some(d) = daemon {
                out.push_str(&format!(
                    "\n--- {name} ({}):\n{}",
                    d.log_path().display(),
                    d.log_tail(20)
                ));
            }
        }
        out
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// The directory of Gateway API CRDs that `scripts/setup` caches: `$SHARDGATE_GATEWAY_API_CRDS`,
/// else the newest `<cache>/gateway-api-*/crds`.
pub fn gateway_api_crds_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("SHARDGATE_GATEWAY_API_CRDS").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        if dir.is_dir() {
            return Ok(dir);
        }
        bail!(
            "SHARDGATE_GATEWAY_API_CRDS is set to {}, which is not a directory; run \
             `scripts/setup` and then `. ~/.cache/shardgate/env.sh`",
            dir.display()
        );
    }
    let cache = tools::cache_dir().context("the cache directory is unknown (HOME is not set)")?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(&cache)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("gateway-api-"))
                .map(|e| e.path().join("crds"))
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.pop().with_context(|| {
        format!(
            "the Gateway API CRDs are not found: SHARDGATE_GATEWAY_API_CRDS is not set and there \
             is no {}/gateway-api-*/crds. Run `scripts/setup`",
            cache.display()
        )
    })
}

/// The `*.yaml` and `*.yml` files in `dir`, sorted; an error if `dir` cannot be read.
pub fn yaml_files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.extension()
                .is_some_and(|ext| ext == "yaml" || ext == "yml")
        })
        .collect();
    files.sort();
    Ok(files)
}

fn mkdir(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir.to_path_buf())
}

/// Standard base64 (kubeconfig `*-data` fields), without pulling in a crate for it.
pub(crate) fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_the_rfc_vectors() {
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(super::base64(input.as_bytes()), want);
        }
    }
}
