//! Clusters whose nodes speak only TLS (`spec.tls`): their Secret, made as cert-manager
//! would make it, and clients outside that speak TLS (a TLS admin client, redis-cli).

use std::collections::BTreeSet;
use std::net::SocketAddr;

use anyhow::{ensure, Result};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;
use shardgate_admin_client::{Client as Admin, Dial, Timeouts, Tls};
use shardgate_harness::tls::{CertPair, TestPki};

use crate::external::{redis_cli_read_back, redis_cli_set_get_with};

/// A CA, the nodes' certificate (server and client use; it names none of the addresses
/// clients dial) and an application's client certificate.
pub struct ClusterTls {
    pub pki: TestPki,
    pub node: CertPair,
    pub app: CertPair,
}

impl ClusterTls {
    pub fn new() -> Result<ClusterTls> {
        let pki = TestPki::new("vc.test")?;
        let node = pki.node_cert("node", &["*.vc.test".to_string()])?;
        let app = pki.client_cert("app", "app")?;
        Ok(ClusterTls { pki, node, app })
    }

    /// The Secret `spec.tls` names: `ca.crt`, `tls.crt`, `tls.key`.
    pub async fn create_secret(&self, client: &Client, ns: &str, name: &str) -> Result<()> {
        self.create_secret_with(client, ns, name, &self.node).await
    }

    /// A Secret of the same CA with the nodes' certificate `node`.
    pub async fn create_secret_with(
        &self,
        client: &Client,
        ns: &str,
        name: &str,
        node: &CertPair,
    ) -> Result<()> {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": { "name": name },
            "type": "kubernetes.io/tls",
            "stringData": {
                "ca.crt": self.pki.ca_pem,
                "tls.crt": node.cert_pem,
                "tls.key": node.key_pem,
            },
        }))?;
        Api::<Secret>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &secret)
            .await?;
        Ok(())
    }

    /// Rewrites the Secret's certificate and key in place with `renewed`'s (as cert-manager
    /// renews a certificate: same name, same CA).
    pub async fn renew_secret(
        &self,
        client: &Client,
        ns: &str,
        name: &str,
        renewed: &CertPair,
    ) -> Result<()> {
        let patch =
            json!({ "stringData": { "tls.crt": renewed.cert_pem, "tls.key": renewed.key_pem } });
        Api::<Secret>::namespaced(client.clone(), ns)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// How an application dials the nodes: the CA, and its client certificate.
    pub fn dial(&self) -> Result<Dial> {
        let identity = (self.app.cert_pem.as_bytes(), self.app.key_pem.as_bytes());
        Ok(Dial {
            timeouts: Timeouts::default(),
            tls: Some(Tls::from_pem(self.pki.ca_pem.as_bytes(), Some(identity))?),
        })
    }

    /// `redis-cli --tls -c` at `seed`: `n` SET/GET over every slot, following MOVED
    /// ([`redis_cli_set_get_with`]).
    pub async fn redis_cli_set_get(&self, seed: SocketAddr, n: usize) -> Result<()> {
        let cli = self.redis_cli_args();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = cli.iter().map(String::as_str).collect();
            redis_cli_set_get_with(seed, n, &args)
        })
        .await?
    }

    /// `redis-cli --tls -c` at `seed` reads back the keys [`Self::redis_cli_set_get`] wrote.
    pub async fn redis_cli_read_back(&self, seed: SocketAddr, n: usize) -> Result<()> {
        let cli = self.redis_cli_args();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = cli.iter().map(String::as_str).collect();
            redis_cli_read_back(seed, n, &args)
        })
        .await?
    }

    /// redis-cli's TLS arguments, with the application's certificate.
    pub fn redis_cli_args(&self) -> Vec<String> {
        let path = |p: &std::path::Path| p.display().to_string();
        vec![
            "--tls".into(),
            "--cacert".into(),
            path(&self.pki.ca),
            "--cert".into(),
            path(&self.app.cert),
            "--key".into(),
            path(&self.app.key),
        ]
    }
}

/// CLUSTER NODES and CLUSTER SHARDS asked over TLS at `seed` name exactly the addresses of
/// `allowed` (`host:port`), as TLS ports: CLUSTER SHARDS has a `tls-port` and no `port` (the
/// plain port is off).
pub async fn topology_over_tls(
    seed: SocketAddr,
    dial: &Dial,
    allowed: &BTreeSet<String>,
) -> Result<()> {
    let mut admin = Admin::dial(seed, dial).await?;
    let named: BTreeSet<String> = admin
        .cluster_nodes()
        .await?
        .iter()
        .map(|l| format!("{}:{}", l.ip, l.port))
        .collect();
    ensure!(
        named == *allowed,
        "CLUSTER NODES names {named:?}, not {allowed:?}"
    );
    for shard in admin.cluster_shards().await? {
        for n in &shard.nodes {
            let a = format!("{}:{}", n.ip, n.tls_port.unwrap_or(0));
            ensure!(
                allowed.contains(&a) && n.port.is_none(),
                "CLUSTER SHARDS: {n:?}"
            );
        }
    }
    Ok(())
}

/// A plain client and a TLS client without a certificate are both refused at `seed`.
pub async fn refuses_plain_and_anonymous(seed: SocketAddr, pki: &TestPki) -> Result<()> {
    let mut plain = Admin::connect(seed, Timeouts::default()).await?;
    ensure!(plain.ping().await.is_err(), "plain RESP answered at {seed}");
    let anonymous = Dial {
        timeouts: Timeouts::default(),
        tls: Some(Tls::from_pem(pki.ca_pem.as_bytes(), None)?),
    };
    let refused = match Admin::dial(seed, &anonymous).await {
        Ok(mut c) => c.ping().await.is_err(),
        Err(_) => true,
    };
    ensure!(
        refused,
        "a client without a certificate was served at {seed}"
    );
    Ok(())
}
