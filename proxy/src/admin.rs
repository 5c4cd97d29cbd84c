//! The admin endpoints: `/metrics` (Prometheus text), `/healthz` (the process runs),
//! `/readyz` (a route table is loaded, all its ports are bound, and not draining), and
//! `/routes` (the table in force, as JSON, for people debugging).

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

use crate::source::RouteRx;

#[derive(Clone)]
pub struct AdminState {
    pub registry: Arc<Registry>,
    pub routes: RouteRx,
    pub ready: Arc<AtomicBool>,
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
    if s.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        let why = if s.routes.borrow().is_loaded() {
            "not ready: listeners not all bound, or draining\n"
        } else {
            "not ready: no route table loaded yet\n"
        };
        (StatusCode::SERVICE_UNAVAILABLE, why).into_response()
    }
}

async fn routes(State(s): State<AdminState>) -> Response {
    let table = s.routes.borrow().clone();
    match serde_json::to_string_pretty(&table.table) {
        Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
