//! The kube-proxy and LoadBalancer parts of the agent, in user space: a listener on the
//! node's IP at every nodePort, an ingress IP from the loopback range for every LoadBalancer
//! Service (as MetalLB would assign one) with a listener on each Service port, and each
//! accepted connection forwarded to a ready endpoint of the Service's EndpointSlices.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::Client;
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Where a listener sends its connections: a Service port.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Target {
    ns: String,
    service: String,
    /// The Service port's name ("" when unnamed), matched against EndpointSlice ports.
    port_name: String,
}

pub(super) struct Services {
    client: Client,
    node_ip: Ipv4Addr,
    listeners: HashMap<SocketAddr, (Target, JoinHandle<()>)>,
    /// LoadBalancer ingress IPs handed out, by Service UID.
    ingress: HashMap<String, Ipv4Addr>,
}

impl Services {
    pub(super) fn new(client: Client, node_ip: Ipv4Addr) -> Self {
        Services {
            client,
            node_ip,
            listeners: HashMap::new(),
            ingress: HashMap::new(),
        }
    }

    pub(super) async fn sync(&mut self) -> Result<()> {
        let api: Api<Service> = Api::all(self.client.clone());
        let services = api
            .list(&ListParams::default())
            .await
            .context("listing services")?;
        let mut want: HashMap<SocketAddr, Target> = HashMap::new();
        for svc in services.items {
            let (Some(ns), Some(name), Some(spec)) = (
                svc.metadata.namespace.clone(),
                svc.metadata.name.clone(),
                svc.spec.clone(),
            ) else {
                continue;
            };
            let kind = spec.type_.as_deref().unwrap_or("ClusterIP");
            if kind != "NodePort" && kind != "LoadBalancer" {
                continue;
            }
            let ports: Vec<_> = spec
                .ports
                .iter()
                .flatten()
                .filter(|p| p.protocol.as_deref().unwrap_or("TCP") == "TCP")
                .collect();
            for p in &ports {
                let target = Target {
                    ns: ns.clone(),
                    service: name.clone(),
                    port_name: p.name.clone().unwrap_or_default(),
                };
                if let Some(node_port) = p.node_port.and_then(|n| u16::try_from(n).ok()) {
                    want.insert(SocketAddr::from((self.node_ip, node_port)), target.clone());
                }
            }
            // A Service for another load balancer implementation is not ours to serve.
            if kind == "LoadBalancer" && spec.load_balancer_class.is_none() {
                let ip = match self.ingress_ip(&svc, &ports).await {
                    Ok(ip) => ip,
                    Err(e) => {
                        tracing::warn!("LoadBalancer {ns}/{name}: {e:#}");
                        continue;
                    }
                };
                for p in &ports {
                    if let Ok(port) = u16::try_from(p.port) {
                        let target = Target {
                            ns: ns.clone(),
                            service: name.clone(),
                            port_name: p.name.clone().unwrap_or_default(),
                        };
                        want.insert(SocketAddr::from((ip, port)), target);
                    }
                }
            }
        }

        self.listeners.retain(|addr, (target, task)| {
            let keep = want.get(addr) == Some(target) && !task.is_finished();
            if !keep {
                task.abort();
            }
            keep
        });
        for (addr, target) in want {
            if self.listeners.contains_key(&addr) {
                continue;
            }
            match TcpListener::bind(addr).await {
                Ok(listener) => {
                    tracing::info!("{}/{}: listening on {addr}", target.ns, target.service);
                    let task = tokio::spawn(serve(listener, self.client.clone(), target.clone()));
                    self.listeners.insert(addr, (target, task));
                }
                // Retried on the next pass.
                Err(e) => tracing::warn!(
                    "{}/{}: cannot listen on {addr}: {e}",
                    target.ns,
                    target.service
                ),
            }
        }
        Ok(())
    }

    /// The Service's ingress IP: the one in its status, else a fresh loopback address written
    /// to its status.
    async fn ingress_ip(
        &mut self,
        svc: &Service,
        ports: &[&k8s_openapi::api::core::v1::ServicePort],
    ) -> Result<Ipv4Addr> {
        let uid = svc.metadata.uid.clone().unwrap_or_default();
        let current = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .and_then(|i| i.first())
            .and_then(|i| i.ip.as_deref())
            .and_then(|ip| ip.parse::<Ipv4Addr>().ok());
        if let Some(ip) = current {
            self.ingress.insert(uid, ip);
            return Ok(ip);
        }
        let ip = match self.ingress.get(&uid) {
            Some(ip) => *ip,
            None => {
                let wanted: Vec<u16> = ports
                    .iter()
                    .filter_map(|p| u16::try_from(p.port).ok())
                    .collect();
                let ip = shardgate_harness::addr::node_ip(&wanted)?;
                self.ingress.insert(uid, ip);
                ip
            }
        };
        let ns = svc.metadata.namespace.as_deref().unwrap_or("default");
        let name = svc.metadata.name.as_deref().unwrap_or_default();
        let api: Api<Service> = Api::namespaced(self.client.clone(), ns);
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({
                "status": { "loadBalancer": { "ingress": [ { "ip": ip.to_string(), "ipMode": "VIP" } ] } }
            })),
        )
        .await
        .with_context(|| format!("writing the ingress IP of {ns}/{name}"))?;
        Ok(ip)
    }

    pub(super) fn stop(&mut self) {
        for (_, (_, task)) in self.listeners.drain() {
            task.abort();
        }
    }
}

async fn serve(listener: TcpListener, client: Client, target: Target) {
    let next = Arc::new(AtomicUsize::new(0));
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (client, target, next) = (client.clone(), target.clone(), next.clone());
        tokio::spawn(async move {
            let endpoints = match ready_endpoints(&client, &target).await {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!("{}/{}: {e:#}", target.ns, target.service);
                    return;
                }
            };
            // Round robin, skipping endpoints that refuse, as kube-proxy's userspace mode did.
            let start = next.fetch_add(1, Ordering::Relaxed);
            for i in 0..endpoints.len() {
                let addr = endpoints[(start + i) % endpoints.len()];
                let connect =
                    tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr));
                if let Ok(Ok(mut outbound)) = connect.await {
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    return;
                }
            }
            tracing::warn!(
                "{}/{}: no reachable ready endpoint among {endpoints:?}",
                target.ns,
                target.service
            );
        });
    }
}

/// The ready endpoints of the Service port, from its EndpointSlices.
async fn ready_endpoints(client: &Client, target: &Target) -> Result<Vec<SocketAddr>> {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), &target.ns);
    let slices = api
        .list(
            &ListParams::default()
                .labels(&format!("kubernetes.io/service-name={}", target.service)),
        )
        .await
        .context("listing EndpointSlices")?;
    let mut out = Vec::new();
    for slice in slices.items {
        let Some(port) = slice
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.clone().unwrap_or_default() == target.port_name)
            .and_then(|p| p.port)
            .and_then(|p| u16::try_from(p).ok())
        else {
            continue;
        };
        for ep in slice.endpoints {
            if ep.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                continue;
            }
            for addr in ep.addresses {
                if let Ok(ip) = addr.parse::<Ipv4Addr>() {
                    out.push(SocketAddr::from((ip, port)));
                }
            }
        }
    }
    Ok(out)
}
