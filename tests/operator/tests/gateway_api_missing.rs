//! The operator on an API server without Gateway API (its CRDs not installed): a cluster
//! that asks for a gateway still runs, and is told what is missing once, not on every
//! reconcile; deleted and made again under its name, it is told again. Its own control
//! plane (the other suites install Gateway API).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, ListParams};
use serde_json::json;
use shardgate_crds::names::labels;
use shardgate_crds::valkey_cluster::ValkeyCluster;
use shardgate_kube_harness::{Options, TestEnv};
use shardgate_operator_e2e::external::{external_cluster, slot_addresses, FORM};
use shardgate_operator_e2e::{
    condition, create, eventually, pod_addrs, reconcile_again, wait_ready, Operator,
};

fn main() -> ExitCode {
    let options = Options {
        without_gateway_api: true,
        ..Default::default()
    };
    let Some(suite) = shardgate_operator_e2e::suite_with(options) else {
        return ExitCode::FAILURE;
    };
    suite
        .timeout(Duration::from_secs(300))
        .test(
            "without_gateway_api_a_gateway_cluster_runs_and_is_warned_once",
            warned_once,
        )
        .run()
}

async fn warned_once(env: TestEnv) -> Result<()> {
    let TestEnv { client, ns, .. } = env;
    let operator = Operator::start(&client, &ns);
    let external = json!({
        "enabled": true,
        "mode": "announce",
        "gateway": { "gatewayRef": { "name": "gw" }, "basePort": 31000 },
    });
    create(
        &client,
        &ns,
        &external_cluster("vc", 1, 1, external.clone())?,
    )
    .await?;
    // The cluster itself does not need Gateway API.
    wait_ready(&client, &ns, "vc", FORM).await?;
    let api = Api::<ValkeyCluster>::namespaced(client.clone(), &ns);
    eventually("GatewayReady False", Duration::from_secs(60), || async {
        let vc = api.get("vc").await?;
        let gw = condition(&vc, "GatewayReady");
        ensure!(
            gw.as_ref().is_some_and(|(s, reason, message)| s == "False"
                && reason == "GatewayAPIUnavailable"
                && message.contains("gateway.networking.k8s.io")),
            "GatewayReady: {gw:?}"
        );
        let ext = condition(&vc, "ExternalAccessReady");
        ensure!(
            ext.as_ref().is_some_and(|(s, ..)| s == "False"),
            "ExternalAccessReady: {ext:?}"
        );
        Ok(())
    })
    .await?;
    // The Services a gateway would route to are there, ClusterIP (gateway's default).
    let services = Api::<Service>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(&format!(
            "{}=vc,{}={}",
            labels::INSTANCE,
            labels::COMPONENT,
            labels::COMPONENT_EXTERNAL
        )))
        .await?;
    ensure!(services.items.len() == 1, "{:?}", services.items);
    for s in &services {
        let t = s.spec.as_ref().and_then(|s| s.type_.clone());
        ensure!(t.as_deref() == Some("ClusterIP"), "{t:?}");
    }

    // More reconciles (each a change to the object), and still one warning.
    for i in 0..3 {
        reconcile_again(&api, &operator, "vc", i).await?;
    }
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), &ns);
    let all = events.list(&ListParams::default()).await?.items;
    let warnings: Vec<_> = all
        .iter()
        .filter(|e| e.reason.as_deref() == Some("GatewayAPIUnavailable"))
        .collect();
    ensure!(warnings.len() == 1, "{warnings:?}");
    // Not one event repeated as a series either.
    ensure!(
        warnings[0].series.as_ref().is_none_or(|s| s.count <= 1),
        "{:?}",
        warnings[0].series
    );
    ensure!(
        warnings[0].type_.as_deref() == Some("Warning")
            && warnings[0]
                .note
                .as_deref()
                .is_some_and(|n| n.contains("gateway.networking.k8s.io")),
        "{:?}",
        warnings[0]
    );
    // The nodes announce the Gateway's listener ports (31000 + node), which a Gateway with
    // those listeners would serve.
    let addrs = pod_addrs(&client, &ns, "vc").await?;
    let seed = addrs.values().next().context("a pod address")?;
    let mut conn = redis::Client::open(format!("redis://{seed}"))?
        .get_multiplexed_async_connection()
        .await?;
    let slots: redis::Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await?;
    let named = slot_addresses(&slots)?;
    ensure!(
        !named.is_empty()
            && named
                .iter()
                .all(|a| a.ends_with(":31000") || a.ends_with(":31001")),
        "CLUSTER SLOTS hands out {named:?}"
    );

    // Deleted and made again under its name, the cluster is a new one (another uid): it is
    // warned again, although the operator ran all along and warned the old one.
    let old_uid = api.get("vc").await?.metadata.uid;
    api.delete("vc", &Default::default()).await?;
    eventually("the old cluster gone", Duration::from_secs(60), || async {
        let left = api.get_opt("vc").await?;
        ensure!(left.is_none(), "still there");
        Ok(())
    })
    .await?;
    let remade = create(&client, &ns, &external_cluster("vc", 1, 1, external)?).await?;
    ensure!(remade.metadata.uid != old_uid, "{:?}", remade.metadata.uid);
    eventually(
        "the new cluster warned",
        Duration::from_secs(60),
        || async {
            let all = events.list(&ListParams::default()).await?.items;
            let new: Vec<_> = all
                .iter()
                .filter(|e| {
                    e.reason.as_deref() == Some("GatewayAPIUnavailable")
                        && e.regarding.as_ref().and_then(|r| r.uid.as_ref())
                            == remade.metadata.uid.as_ref()
                })
                .collect();
            ensure!(new.len() == 1, "{new:?}");
            Ok(())
        },
    )
    .await?;
    operator.stop().await;
    Ok(())
}
