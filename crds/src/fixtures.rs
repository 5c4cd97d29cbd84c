//! Fixtures that read like sentences, as controller-rs's:
//! `ValkeyCluster::test("vc").shards(3).replicas(1).external(ExternalAccess::announce())`.
//! For this crate's tests and, with the `test-util` feature, other crates'.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::external_access::{
    EndpointType, ExternalAccess, ExternalAccessMode, GatewayRef, GatewaySpec, ProxySpec, ProxyTls,
    ProxyTlsMode, ServiceType,
};
use crate::valkey_cluster::{
    PersistenceSpec, TlsSpec, ValkeyCluster, ValkeyClusterSpec, ValkeyClusterStatus,
};

impl ValkeyCluster {
    /// A cluster `name` in namespace `default` with the API server's defaults (3 shards × 1
    /// replica), a uid (for owner references) and generation 1.
    pub fn test(name: &str) -> Self {
        let mut vc = ValkeyCluster::new(name, ValkeyClusterSpec::default());
        vc.metadata.namespace = Some("default".into());
        vc.metadata.uid = Some("5e7b0d7c-1c1a-4c1e-9a47-2f1c1f3b9d01".into());
        vc.metadata.generation = Some(1);
        vc
    }

    pub fn namespace(mut self, ns: &str) -> Self {
        self.metadata.namespace = Some(ns.into());
        self
    }

    pub fn shards(mut self, n: i32) -> Self {
        self.spec.shards = n;
        self
    }

    pub fn replicas(mut self, n: i32) -> Self {
        self.spec.replicas = n;
        self
    }

    pub fn ports_per_shard(mut self, n: i32) -> Self {
        self.spec.ports_per_shard = Some(n);
        self
    }

    pub fn image(mut self, image: &str) -> Self {
        self.spec.image = image.into();
        self
    }

    /// One valkey.conf setting.
    pub fn config(mut self, key: &str, value: &str) -> Self {
        self.spec.config.insert(key.into(), value.into());
        self
    }

    /// Nodes speak TLS with this Secret's certificate.
    pub fn tls(mut self, secret_name: &str) -> Self {
        self.spec.tls = Some(TlsSpec {
            secret_name: secret_name.into(),
        });
        self
    }

    /// A claim of `size` per node, in the default StorageClass.
    pub fn persistence(mut self, size: &str) -> Self {
        self.spec.persistence = Some(PersistenceSpec {
            size: Quantity(size.into()),
            storage_class_name: None,
        });
        self
    }

    pub fn external(mut self, external_access: ExternalAccess) -> Self {
        self.spec.external_access = Some(external_access);
        self
    }

    pub fn with_status(mut self, status: ValkeyClusterStatus) -> Self {
        self.status = Some(status);
        self
    }
}

impl ExternalAccess {
    /// Enabled, announce mode, NodePort Services (all defaults).
    pub fn announce() -> Self {
        ExternalAccess {
            enabled: true,
            ..Default::default()
        }
    }

    /// Enabled, with one TCPRoute per node on Gateway `name` from `base_port`.
    pub fn gateway(name: &str, base_port: i32) -> Self {
        ExternalAccess {
            gateway: Some(GatewaySpec {
                gateway_ref: GatewayRef {
                    name: name.into(),
                    section_name: None,
                },
                base_port,
            }),
            ..Self::announce()
        }
    }

    /// Enabled, proxy mode, the proxy listening from `base_port`.
    pub fn proxy(base_port: i32) -> Self {
        ExternalAccess {
            mode: ExternalAccessMode::Proxy,
            proxy: Some(ProxySpec::new(base_port)),
            ..Self::announce()
        }
    }

    pub fn disabled(mut self) -> Self {
        self.enabled = false;
        self
    }

    pub fn base_port(mut self, port: i32) -> Self {
        self.base_port = Some(port);
        self
    }

    pub fn service_type(mut self, service_type: ServiceType) -> Self {
        self.service_type = Some(service_type);
        self
    }

    pub fn domain(mut self, domain: &str) -> Self {
        self.domain = Some(domain.into());
        self
    }

    pub fn advertised_host(mut self, host: &str) -> Self {
        self.advertised_host = Some(host.into());
        self
    }

    pub fn hostname_prefix(mut self, prefix: &str) -> Self {
        self.hostname_prefix = Some(prefix.into());
        self
    }

    pub fn endpoint_type(mut self, endpoint_type: EndpointType) -> Self {
        self.preferred_endpoint_type = endpoint_type;
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.service_annotations.insert(key.into(), value.into());
        self
    }

    /// Gives the proxy (made with the defaults from `base_port` if there is none) a TLS port.
    pub fn proxy_tls(mut self, port: i32, mode: ProxyTlsMode, secret_name: Option<&str>) -> Self {
        let proxy = self.proxy.get_or_insert_with(|| ProxySpec::new(port + 1));
        proxy.tls = Some(ProxyTls {
            port,
            secret_name: secret_name.map(Into::into),
            mode,
            verify_clients: false,
        });
        self
    }

    /// `proxy.tls.verifyClients` on (after [`Self::proxy_tls`]).
    pub fn verify_clients(mut self) -> Self {
        if let Some(tls) = self.proxy.as_mut().and_then(|p| p.tls.as_mut()) {
            tls.verify_clients = true;
        }
        self
    }
}
