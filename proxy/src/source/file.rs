//! Routes from a YAML route file, reloaded when its content changes. The format is the
//! contracts crate's [`RouteFile`] (its docs show it); this file turns its entries into
//! routes.
//!
//! The file is polled rather than watched with inotify: a Kubernetes ConfigMap volume swaps
//! a symlink, which content polling sees and inode watches miss.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use shardgate_crds::{RouteFile, RouteFileError};
use tokio_util::sync::CancellationToken;

use super::{RoutePublisher, RouteSource};
use crate::model::{Route, Routes};

/// Why a route file was refused. The message names the file and the bad field.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not UTF-8: {source}")]
    NotUtf8 {
        path: PathBuf,
        source: std::str::Utf8Error,
    },
    #[error("{path}: {source}")]
    Invalid {
        path: PathBuf,
        source: RouteFileError,
    },
}

/// Parses and validates a route file's content. `rewrite` is the default for listeners the
/// file says nothing about.
pub fn parse(path: &Path, text: &str, rewrite: bool) -> Result<Routes, FileError> {
    let invalid = |source| FileError::Invalid {
        path: path.to_path_buf(),
        source,
    };
    let entries = RouteFile::from_yaml(text)
        .and_then(|f| f.entries())
        .map_err(invalid)?;
    Ok(entries
        .into_iter()
        .map(|e| {
            let route = Route {
                node: e.node,
                backend: e.backend,
                node_id: e.id,
                hostname: None,
                rewrite: e.rewrite.unwrap_or(rewrite),
                primary: e.primary,
                tls_backend: e.tls_backend,
                slots: Vec::new(),
            };
            (e.port, Arc::new(route))
        })
        .collect())
}

/// Reads and parses a route file.
pub fn load(path: &Path, rewrite: bool) -> Result<Routes, FileError> {
    let text = std::fs::read_to_string(path).map_err(|source| FileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &text, rewrite)
}

/// Polls a route file and publishes each valid new version.
pub struct FileSource {
    path: PathBuf,
    interval: Duration,
    rewrite: bool,
}

impl FileSource {
    pub fn new(path: PathBuf, interval: Duration, rewrite: bool) -> Self {
        FileSource {
            path,
            interval,
            rewrite,
        }
    }
}

impl RouteSource for FileSource {
    fn name(&self) -> &'static str {
        "file"
    }

    async fn run(self, publisher: RoutePublisher, shutdown: CancellationToken) {
        let name = self.name();
        // The content last seen, valid or not, so that a bad file is reported once.
        let mut seen: Option<Vec<u8>> = None;
        loop {
            match tokio::fs::read(&self.path).await {
                Ok(bytes) if seen.as_deref() != Some(&bytes[..]) => {
                    let result = std::str::from_utf8(&bytes)
                        .map_err(|source| FileError::NotUtf8 {
                            path: self.path.clone(),
                            source,
                        })
                        .and_then(|text| parse(&self.path, text, self.rewrite));
                    seen = Some(bytes);
                    match result {
                        Ok(routes) => match publisher.publish(name, routes) {
                            Ok(_) => publisher.report_ok(name),
                            Err(e) => publisher.report_error(name, &e),
                        },
                        Err(e) => publisher.report_error(name, &e),
                    }
                }
                Ok(_) => {}
                Err(source) => {
                    // Report a vanished file once, then again when it comes back changed.
                    if seen.is_some() {
                        let e = FileError::Read {
                            path: self.path.clone(),
                            source,
                        };
                        publisher.report_error(name, &e);
                        seen = None;
                    }
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardgate_crds::NodeRef;

    #[test]
    fn entries_become_routes_with_the_default_rewrite() {
        let text = "basePort: 30000\nshards:\n- nodes:\n  - 10.0.0.1:6379\n  - address: 10.0.0.2:6379\n    rewrite: false\n";
        let routes = parse(Path::new("routes.yaml"), text, true).unwrap();
        assert_eq!(routes[&30000].node, NodeRef::new(0, 0));
        assert!(routes[&30000].rewrite && routes[&30000].primary);
        assert!(!routes[&30001].rewrite && !routes[&30001].primary);
    }

    #[test]
    fn errors_name_the_file_and_the_field() {
        let err = parse(
            Path::new("routes.yaml"),
            "basePort: 70000\nshards:\n- nodes: [a:1]\n",
            false,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "routes.yaml: basePort: basePort must be between 1 and 65535, got 70000"
        );
    }
}
