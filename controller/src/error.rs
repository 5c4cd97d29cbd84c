//! The operator's one error type; each variant has a metric label.

use crate::formation::FormationError;

/// Why a reconcile failed. It is retried with backoff (see [`crate::reconcile::error_policy`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("building {what}: {source}")]
    Build {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("the ValkeyCluster has no {0} (it must come from the API server)")]
    Metadata(&'static str),
    #[error("invalid ValkeyCluster: {0}")]
    Invalid(String),
    #[error("talking to the nodes: {0}")]
    Formation(#[from] FormationError),
    #[error("spec.tls: Secret {secret} {why}")]
    TlsSecret { secret: String, why: String },
}

impl Error {
    /// A metric label (`reconcile_errors_total{error}`), snake_case.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Build { .. } => "build",
            Error::Metadata(_) => "metadata",
            Error::Invalid(_) => "invalid",
            Error::Formation(_) => "formation",
            Error::TlsSecret { .. } => "tls_secret",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_snake_case_names() {
        assert_eq!(Error::Metadata("uid").label(), "metadata");
        assert_eq!(Error::Invalid("x".into()).label(), "invalid");
    }
}
