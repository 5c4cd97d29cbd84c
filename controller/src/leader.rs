//! Leader election on a `coordination.k8s.io/v1` Lease, so that two operator replicas can
//! run and only one reconciles. The holder renews the lease every third of its duration; a
//! standby takes it over once it has not been renewed for a whole duration. A holder that
//! has not renewed within two thirds of the duration stops reconciling at once, a call the
//! API server does not answer included: the last third is the margin for the two
//! replicas' clocks to differ (the holder's writes renewTime, the standby's reads it). Its
//! reconciles still going are dropped, not waited for (as a crash would), and the process
//! exits; its Deployment restarts it as a standby.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use kube::Client;
use serde_json::json;
use tokio::time::Instant;
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
            // Whole seconds, as the lease says to the standbys.
            duration: Duration::from_secs(duration.as_secs().max(2)),
        }
    }

    /// Waits until this process holds the lease: returns when the try that took it began
    /// (no later than the lease's renewTime).
    pub async fn acquire(&self) -> Instant {
        let mut said = false;
        loop {
            let began = Instant::now();
            // A call with no answer is given up, and tried again, like one that failed.
            match tokio::time::timeout(self.duration / 3, self.try_hold()).await {
                Ok(Ok(true)) => {
                    info!(lease = %self.name, identity = %self.identity, "became the leader");
                    return began;
                }
                Ok(Ok(false)) if !said => {
                    info!(lease = %self.name, "another replica leads; standing by");
                    said = true;
                }
                Ok(Ok(false)) => {}
                Ok(Err(e)) => warn!(lease = %self.name, "cannot read the lease: {e}"),
                Err(_) => warn!(
                    lease = %self.name,
                    "no answer from the API server within {:?}",
                    self.duration / 3
                ),
            }
            tokio::time::sleep(self.duration / 3).await;
        }
    }

    /// How long after a renewal began the holder may go on without another.
    pub fn renew_deadline(&self) -> Duration {
        self.duration * 2 / 3
    }

    /// Renews the lease every third of its duration, `renewed` being when the renewal (or
    /// the acquisition) that holds it now began; returns once it is lost: another replica
    /// holds it, or no renewal got through within [`Self::renew_deadline`] of the last one,
    /// however long the API server takes to answer.
    pub async fn hold(&self, mut renewed: Instant) {
        let mut next = renewed + self.duration / 3;
        loop {
            let deadline = renewed + self.renew_deadline();
            tokio::time::sleep_until(next.min(deadline)).await;
            let began = Instant::now();
            // One try does not take the whole window (a call stuck on a connection gone
            // silent): a sixth of the lease, at least a second.
            let give_up = deadline.min(began + (self.duration / 6).max(Duration::from_secs(1)));
            match tokio::time::timeout_at(give_up, self.try_hold()).await {
                Ok(Ok(true)) => {
                    renewed = began;
                    next = began + self.duration / 3;
                    continue;
                }
                Ok(Ok(false)) => {
                    warn!(lease = %self.name, "lost the lease to another replica");
                    return;
                }
                Ok(Err(e)) => warn!(lease = %self.name, "cannot renew the lease: {e}"),
                Err(_) => {}
            }
            if Instant::now() >= deadline {
                warn!(
                    lease = %self.name,
                    "the lease was not renewed within {:?}: stepping down before a standby may \
                     take it",
                    self.renew_deadline()
                );
                return;
            }
            // A few more tries before the deadline.
            next = Instant::now() + self.duration / 15;
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
    /// expire. Not for longer than a third of the lease: then it expires anyway.
    pub async fn release(&self) {
        let give_up = async {
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
        };
        let _ = tokio::time::timeout(self.duration / 3, give_up).await;
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
    let acquired = tokio::select! {
        at = election.acquire() => at,
        _ = stop.cancelled() => return Ended::Shutdown,
    };
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
        // The controller is dropped here, not stopped gracefully: a reconcile still going
        // (a call, a failover) must not act on once a standby may lead.
        _ = election.hold(acquired) => Ended::LostLease,
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
