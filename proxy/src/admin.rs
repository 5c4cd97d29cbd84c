//! The admin endpoints: `/metrics` (Prometheus text), `/healthz` (the process runs),
//! `/readyz` (a route table is loaded, all its ports are bound, and not draining; its body
//! also says when the route source is failing, which keeps the table in force and the proxy
//! ready), and `/routes` (the table in force, as JSON, for people debugging).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::source::{HealthRx, RouteRx, SourceHealth};

#[derive(Clone)]
pub struct AdminState {
    pub registry: Arc<Registry>,
    pub routes: RouteRx,
    pub ready: Arc<AtomicBool>,
    pub health: HealthRx,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/routes", get(routes))
        .with_state(state)
}

/// Serves the admin endpoints on `listener` until `shutdown`.
pub async fn serve(listener: TcpListener, state: AdminState, shutdown: CancellationToken) {
    let result = axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
    if let Err(e) = result {
        tracing::error!("admin server failed: {e}");
    }
}

async fn metrics(State(s): State<AdminState>) -> Response {
    let mut out = String::new();
    match prometheus_client::encoding::text::encode(&mut out, &s.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            out,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn readyz(State(s): State<AdminState>) -> Response {
    let failing = failing(&s.health.borrow());
    if s.ready.load(Ordering::Acquire) {
        let body = match failing {
            // Ready all the same: the last table still routes, and dropping every proxy
            // replica out of its Service because the API server is away would be worse.
            Some(why) => format!(
                "ready: serving route table version {} from the last good fetch (stale); {why}\n",
                s.routes.borrow().version
            ),
            None => "ready\n".to_string(),
        };
        (StatusCode::OK, body).into_response()
    } else {
        let mut why = if s.routes.borrow().is_loaded() {
            "not ready: listeners not all bound, or draining".to_string()
        } else {
            "not ready: no route table loaded yet".to_string()
        };
        if let Some(f) = failing {
            why = format!("{why}; {f}");
        }
        (StatusCode::SERVICE_UNAVAILABLE, why + "\n").into_response()
    }
}

/// "route source X failing for 3s: <error>", while it fails.
fn failing(h: &SourceHealth) -> Option<String> {
    let (error, since) = h.failing.as_ref()?;
    Some(format!(
        "route source {} failing for {}s: {error}",
        h.source,
        since.elapsed().as_secs()
    ))
}

async fn routes(State(s): State<AdminState>) -> Response {
    let table = s.routes.borrow().clone();
    match serde_json::to_string_pretty(&table.table) {
        Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
