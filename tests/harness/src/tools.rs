//! Finding the external programs that the tests, the benchmarks and the demo run.
//!
//! Each program is looked up, in order, in
//! 1. its environment variable (`SHARDGATE_VALKEY_SERVER`, `SHARDGATE_REDIS_CLI`,
//!    `SHARDGATE_REDIS_BENCHMARK`, `SHARDGATE_KUBE_APISERVER`, `SHARDGATE_ETCD`, ...;
//!    `scripts/setup` writes them to `~/.cache/shardgate/env.sh`),
//! 2. the cache that `scripts/setup` fills (valkey-server and the control plane:
//!    `${SHARDGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shardgate}/valkey-*/bin/valkey-server`,
//!    `.../k8s-*/bin/kube-apiserver`, `.../etcd-*/bin/etcd`),
//! 3. `PATH`.
//!
//! A program that is not found is an error naming what is missing and saying to run
//! `scripts/setup`: tests never skip silently because a tool is absent.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// What to look for, and where.
struct Tool {
    /// The program's name, also its name on `PATH`.
    name: &'static str,
    /// The environment variable that overrides the search.
    env: &'static str,
    /// In the cache: directories starting with this prefix hold `bin/<name>`.
    cache_prefix: Option<&'static str>,
}

const VALKEY_SERVER: Tool = Tool {
    name: crate::valkey::server::SERVER_PROGRAM,
    env: "SHARDGATE_VALKEY_SERVER",
    cache_prefix: Some("valkey-"),
};
const REDIS_CLI: Tool = Tool {
    name: "redis-cli",
    env: "SHARDGATE_REDIS_CLI",
    cache_prefix: None,
};
const REDIS_BENCHMARK: Tool = Tool {
    name: "redis-benchmark",
    env: "SHARDGATE_REDIS_BENCHMARK",
    cache_prefix: None,
};
/// Python with redis-py, from its venv in the cache.
const PYTHON_REDIS: Tool = Tool {
    name: "python",
    env: "SHARDGATE_PYTHON",
    cache_prefix: Some("redis-py-"),
};

/// A Python that has redis-py (for its `RedisCluster` client), installed by `scripts/setup`.
pub fn python_with_redis() -> Result<PathBuf> {
    find(&PYTHON_REDIS)
}

const KUBE_APISERVER: Tool = Tool {
    name: "kube-apiserver",
    env: "SHARDGATE_KUBE_APISERVER",
    cache_prefix: Some("k8s-"),
};
const KUBE_CONTROLLER_MANAGER: Tool = Tool {
    name: "kube-controller-manager",
    env: "SHARDGATE_KUBE_CONTROLLER_MANAGER",
    cache_prefix: Some("k8s-"),
};
const KUBECTL: Tool = Tool {
    name: "kubectl",
    env: "SHARDGATE_KUBECTL",
    cache_prefix: Some("k8s-"),
};
const ETCD: Tool = Tool {
    name: "etcd",
    env: "SHARDGATE_ETCD",
    cache_prefix: Some("etcd-"),
};

/// `kube-apiserver`, built by `scripts/setup-k8s`.
pub fn kube_apiserver() -> Result<PathBuf> {
    find(&KUBE_APISERVER)
}

/// `kube-controller-manager`, built by `scripts/setup-k8s`.
pub fn kube_controller_manager() -> Result<PathBuf> {
    find(&KUBE_CONTROLLER_MANAGER)
}

/// `kubectl`, built by `scripts/setup-k8s`.
pub fn kubectl() -> Result<PathBuf> {
    find(&KUBECTL)
}

/// `etcd`, built by `scripts/setup-k8s`.
pub fn etcd() -> Result<PathBuf> {
    find(&ETCD)
}

/// The Valkey 9 `valkey-server` binary, built with TLS (`scripts/setup-valkey`).
pub fn valkey_server() -> Result<PathBuf> {
    find(&VALKEY_SERVER)
}

/// `redis-cli` (Debian's redis-tools), a cluster client nobody here wrote.
pub fn redis_cli() -> Result<PathBuf> {
    find(&REDIS_CLI)
}

/// `redis-benchmark` (Debian's redis-tools).
pub fn redis_benchmark() -> Result<PathBuf> {
    find(&REDIS_BENCHMARK)
}

const STUNNEL: Tool = Tool {
    name: "stunnel",
    env: "SHARDGATE_STUNNEL",
    cache_prefix: None,
};

/// `stunnel` (Debian's stunnel4): the TLS terminator in front of the TLS port tests'
/// TLS-speaking nodes (a TLS leg that is not Valkey's own, on plain clusters).
pub fn stunnel() -> Result<PathBuf> {
    find(&STUNNEL)
}

/// `${SHARDGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shardgate}`, as `scripts/setup` computes
/// it; `None` if neither those variables nor `HOME` are set.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(
        non_empty_env("SHARDGATE_CACHE"),
        non_empty_env("XDG_CACHE_HOME"),
        non_empty_env("HOME"),
    )
}

fn non_empty_env(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|v| !v.is_empty())
}

fn cache_dir_from(
    shardgate_cache: Option<OsString>,
    xdg_cache_home: Option<OsString>,
    home: Option<OsString>,
) -> Option<PathBuf> {
    if let Some(dir) = shardgate_cache {
        return Some(dir.into());
    }
    let cache_home = match xdg_cache_home {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(home?).join(".cache"),
    };
    Some(cache_home.join("shardgate"))
}

fn find(tool: &Tool) -> Result<PathBuf> {
    lookup(
        tool,
        std::env::var_os(tool.env),
        cache_dir().as_deref(),
        std::env::var_os("PATH"),
    )
}

/// The search itself, with the environment passed in so that it can be tested.
fn lookup(
    tool: &Tool,
    env_value: Option<OsString>,
    cache: Option<&Path>,
    path_var: Option<OsString>,
) -> Result<PathBuf> {
    // An explicit setting that is wrong is reported as such rather than silently replaced by
    // whatever else is around: the user asked for that file.
    if let Some(value) = env_value.filter(|v| !v.is_empty()) {
        let path = PathBuf::from(&value);
        if is_executable(&path) {
            return Ok(path);
        }
        bail!(
            "{} is set to {}, which is not an executable file; run `scripts/setup` and then \
             `. ~/.cache/shardgate/env.sh` (or unset {})",
            tool.env,
            path.display(),
            tool.env
        );
    }

    let mut looked = vec![format!("{} is not set", tool.env)];
    if let Some(prefix) = tool.cache_prefix {
        match cache {
            Some(cache) => {
                if let Some(found) = in_cache(cache, prefix, tool.name) {
                    return Ok(found);
                }
                looked.push(format!(
                    "there is no {}/{prefix}*/bin/{}",
                    cache.display(),
                    tool.name
                ));
            }
            None => looked.push("the cache directory is unknown (HOME is not set)".to_string()),
        }
    }
    if let Some(path_var) = path_var {
        for dir in std::env::split_paths(&path_var) {
            let candidate = dir.join(tool.name);
            if is_executable(&candidate) {
                return Ok(candidate);
            }
        }
    }
    looked.push(format!("there is no {} on PATH", tool.name));
    bail!(
        "{} not found: {}. Run `scripts/setup` (it installs it and writes \
         ~/.cache/shardgate/env.sh), then `. ~/.cache/shardgate/env.sh`",
        tool.name,
        looked.join(", ")
    )
}

/// The newest `<cache>/<prefix>*/bin/<name>` (by version-aware name order).
fn in_cache(cache: &Path, prefix: &str, name: &str) -> Option<PathBuf> {
    let mut found: Vec<(Vec<u64>, PathBuf)> = std::fs::read_dir(cache)
        .ok()?
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let dir_name = entry.file_name().into_string().ok()?;
            let version = dir_name.strip_prefix(prefix)?;
            let bin = entry.path().join("bin").join(name);
            is_executable(&bin).then(|| (version_key(version), bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin)
}

/// `9.1.2.post2` -> `[9, 1, 2, 2]`: enough to order the versions `scripts/setup` installs.
fn version_key(version: &str) -> Vec<u64> {
    version
        .split(|c: char| !c.is_ascii_digit())
        .filter(|part| !part.is_empty())
        .filter_map(|part| part.parse().ok())
        .collect()
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "shardgate-tools-test-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn make_executable(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn cache_dir_follows_the_setup_script() {
        assert_eq!(
            cache_dir_from(Some("/c".into()), Some("/x".into()), Some("/h".into())),
            Some(PathBuf::from("/c"))
        );
        assert_eq!(
            cache_dir_from(None, Some("/x".into()), Some("/h".into())),
            Some(PathBuf::from("/x/shardgate"))
        );
        assert_eq!(
            cache_dir_from(None, None, Some("/h".into())),
            Some(PathBuf::from("/h/.cache/shardgate"))
        );
        assert_eq!(cache_dir_from(None, None, None), None);
    }

    #[test]
    fn env_then_newest_cache_entry_then_path() {
        let dir = scratch("order");
        let cache = dir.join("cache");
        let old = cache.join("valkey-9.0.10/bin/valkey-server");
        let new = cache.join("valkey-9.1.2.post2/bin/valkey-server");
        let on_path = dir.join("bin/valkey-server");
        let explicit = dir.join("explicit/valkey-server");
        for p in [&old, &new, &on_path, &explicit] {
            make_executable(p);
        }
        let path_var = Some(dir.join("bin").into_os_string());

        let found = lookup(
            &VALKEY_SERVER,
            Some(explicit.clone().into()),
            Some(&cache),
            path_var.clone(),
        );
        assert_eq!(found.unwrap(), explicit);
        let found = lookup(&VALKEY_SERVER, None, Some(&cache), path_var.clone());
        assert_eq!(found.unwrap(), new);
        let found = lookup(&VALKEY_SERVER, None, Some(&dir.join("none")), path_var);
        assert_eq!(found.unwrap(), on_path);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_tool_says_what_and_how_to_fix() {
        let dir = scratch("missing");
        let err = lookup(&VALKEY_SERVER, None, Some(&dir), Some("".into()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("valkey-server not found"), "{err}");
        assert!(err.contains("SHARDGATE_VALKEY_SERVER is not set"), "{err}");
        assert!(err.contains("valkey-*/bin/valkey-server"), "{err}");
        assert!(err.contains("scripts/setup"), "{err}");

        let err = lookup(&REDIS_CLI, Some(dir.join("nope").into()), None, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("SHARDGATE_REDIS_CLI is set to"), "{err}");
        assert!(err.contains("scripts/setup"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// What one redis-benchmark run reported (its `--csv` output).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BenchmarkReport {
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// The first data row of redis-benchmark's `--csv` output, by its header's column names:
/// what the load harnesses (`benches/load`, `bench-gateway`) read.
pub fn parse_benchmark_csv(text: &str) -> Result<BenchmarkReport> {
    let mut lines = text.lines().map(|l| {
        l.split(',')
            .map(|c| c.trim_matches('"'))
            .collect::<Vec<_>>()
    });
    let header = lines
        .find(|cols| cols.first() == Some(&"test"))
        .context("no header")?;
    let row = lines.next().context("no data row")?;
    let col = |name: &str| -> Result<f64> {
        let i = header
            .iter()
            .position(|h| *h == name)
            .with_context(|| format!("no column {name}"))?;
        let v = row
            .get(i)
            .with_context(|| format!("short row for {name}"))?;
        v.parse().with_context(|| format!("{name} = {v:?}"))
    };
    Ok(BenchmarkReport {
        rps: col("rps")?,
        p50_ms: col("p50_latency_ms")?,
        p99_ms: col("p99_latency_ms")?,
    })
}

#[cfg(test)]
mod benchmark_csv_tests {
    use super::*;

    /// The shape of redis-benchmark 7.0's `--csv` output (as it prints it here).
    #[test]
    fn reads_the_first_row_by_column_name() {
        let text = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\
                    \"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
                    \"SET\",\"41234.56\",\"1.1\",\"0.2\",\"1.063\",\"1.5\",\"2.335\",\"9.1\"\n";
        let r = parse_benchmark_csv(text).expect("parses");
        assert!((r.rps - 41234.56).abs() < 1e-6);
        assert!((r.p50_ms - 1.063).abs() < 1e-9);
        assert!((r.p99_ms - 2.335).abs() < 1e-9);
        assert!(parse_benchmark_csv("no csv here").is_err());
    }
}
