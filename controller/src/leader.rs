//! Leader election on a `coordination.k8s.io/v1` Lease, so that two operator replicas can
//! run and only one reconciles. The holder renews the lease every third of its duration; a
//! standby takes it over once it has not been renewed for a whole duration. A holder that
//! cannot renew in time stops reconciling (the process exits, and its Deployment restarts it
//! as a standby).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use kube::Client;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// One contender for a lease.
pub struct LeaderElection {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl LeaderElection {
    pub fn new(
        client: Client,
        namespace: &str,
        name: &str,
        identity: &str,
        duration: Duration,
    ) -> Self {
        LeaderElection {
            api: Api::namespaced(client, namespace),
            name: name.into(),
            identity: identity.into(),
            duration: duration.max(Duration::from_secs(2)),
        }
    }

    /// Waits until this process holds the lease.
    pub async fn acquire(&self) {
        let mut said = false;
        loop {
            match self.try_hold().await {
                Ok(true) => {
                    info!(lease = %self.name, identity = %self.identity, "became the leader");
                    return;
                }
                Ok(false) if !said => {
                    info!(lease = %self.name, "another replica leads; standing by");
                    said = true;
                }
                Ok(false) => {}
                Err(e) => warn!(lease = %self.name, "cannot read the lease: {e}"),
            }
            tokio::time::sleep(self.duration / 3).await;
        }
    }

    /// Renews the lease; returns once it is lost (another holder, or no renewal for a whole
    /// duration).
    pub async fn hold(&self) {
        let mut renewed = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.duration / 3).await;
            match self.try_hold().await {
                Ok(true) => renewed = tokio::time::Instant::now(),
                Ok(false) => {
                    warn!(lease = %self.name, "lost the lease to another replica");
                    return;
                }
                Err(e) => {
                    warn!(lease = %self.name, "cannot renew the lease: {e}");
                    if renewed.elapsed() >= self.duration {
                        return;
                    }
                }
            }
        }
    }

    /// Takes or renews the lease if it is free, expired or ours. Concurrent writers are
    /// kept apart by the resourceVersion: the loser gets a conflict, which is `false`.
    async fn try_hold(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let seconds = i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX);
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease: Lease = serde_json::from_value(json!({
                "metadata": { "name": self.name },
                "spec": {
                    "holderIdentity": self.identity,
                    "leaseDurationSeconds": seconds,
                    "acquireTime": MicroTime(now),
                    "renewTime": MicroTime(now),
                    "leaseTransitions": 0,
                },
            }))
            .map_err(kube::Error::SerdeError)?;
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        let ours = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
            (Some(MicroTime(at)), Some(d)) => at
                .checked_add(SignedDuration::from_secs(i64::from(d)))
                .is_ok_and(|until| until < now),
            _ => true,
        };
        let free = spec.holder_identity.as_deref().is_none_or(str::is_empty);
        if !(ours || expired || free) {
            return Ok(false);
        }
        if !ours {
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            spec.holder_identity = Some(self.identity.clone());
        }
        spec.lease_duration_seconds = Some(seconds);
        spec.renew_time = Some(MicroTime(now));
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Gives the lease up (on a clean shutdown), so that a standby need not wait for it to
    /// expire.
    pub async fn release(&self) {
        if let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await {
            let spec = lease.spec.get_or_insert_with(Default::default);
            if spec.holder_identity.as_deref() == Some(self.identity.as_str()) {
                spec.holder_identity = None;
                let _ = self
                    .api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await;
            }
        }
    }
}

/// How a leader's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// `shutdown` resolved (before or after leading).
    Shutdown,
    /// The lease was lost while leading.
    LostLease,
    /// The controller could not start (logged).
    Failed,
}

/// Waits for the lease, then runs the controller while holding it, until `shutdown` or the
/// lease is lost. On shutdown the lease is given up for a standby to take at once.
pub async fn run_as_leader(
    election: Arc<LeaderElection>,
    ctx: Arc<crate::Context>,
    scope: crate::Scope,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Ended {
    let stop = CancellationToken::new();
    let on_shutdown = stop.clone();
    // Tied to this future: if it is dropped (the process dies), so is the watcher.
    let _watcher = AbortOnDrop(tokio::spawn(async move {
        shutdown.await;
        on_shutdown.cancel();
    }));
    tokio::select! {
        _ = election.acquire() => {}
        _ = stop.cancelled() => return Ended::Shutdown,
    }
    ctx.metrics.leader.set(1);
    // The controller and the renewals run in this one task, so that nothing renews the
    // lease once the controller is gone.
    let run = crate::run(ctx.clone(), scope, stop.clone().cancelled_owned());
    tokio::pin!(run);
    let ended = tokio::select! {
        r = &mut run => match r {
            Ok(()) => Ended::Shutdown,
            Err(e) => {
                tracing::error!("the controller stopped: {e}");
                Ended::Failed
            }
        },
        _ = election.hold() => {
            stop.cancel();
            let _ = run.await;
            Ended::LostLease
        }
    };
    ctx.metrics.leader.set(0);
    if ended != Ended::LostLease {
        election.release().await;
    }
    ended
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
