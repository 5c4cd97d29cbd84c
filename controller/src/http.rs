//! The operator's HTTP endpoints: `/metrics` (Prometheus), `/healthz` (the process runs),
//! `/readyz` (the process runs and, if it leads, its controller is started).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Serves the endpoints on `addr` until the process ends.
pub async fn serve(addr: SocketAddr, registry: Arc<Registry>) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ok\n" }))
        .with_state(registry);
    axum::serve(listener, app).await
}

async fn metrics(State(registry): State<Arc<Registry>>) -> Response {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
