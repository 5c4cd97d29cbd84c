//! Kubernetes' `$(VAR)` expansion and the mapping of a container's absolute paths to its
//! directory on this machine.

use std::collections::HashMap;
use std::path::Path;

/// Expands `$(NAME)` from `vars` as the kubelet does: `$$` is a literal `$`, and a reference
/// to an unknown name (or an unterminated one) is left as it is.
pub fn expand(input: &str, vars: &HashMap<String, String>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(') {
            match inner.find(')') {
                Some(end) => {
                    let name = &inner[..end];
                    match vars.get(name) {
                        Some(value) => out.push_str(value),
                        None => {
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &inner[end + 1..];
                }
                None => {
                    out.push_str("$(");
                    rest = inner;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Rewrites an argument that names a path under one of `mounts` (absolute mount paths) to
/// the same path under `root`, where the agent links each mount: `/config/valkey.conf` ->
/// `<root>/config/valkey.conf`; also after `=` (`--dir=/data`).
pub fn rewrite_paths(arg: &str, mounts: &[String], root: &Path) -> String {
    let rewrite_one = |s: &str| -> Option<String> {
        mounts
            .iter()
            .filter(|m| s == m.as_str() || s.starts_with(&format!("{}/", m.trim_end_matches('/'))))
            .max_by_key(|m| m.len())
            .map(|_| format!("{}{s}", root.display()))
    };
    if let Some(done) = rewrite_one(arg) {
        return done;
    }
    if let Some((flag, value)) = arg.split_once('=') {
        if let Some(done) = rewrite_one(value) {
            return format!("{flag}={done}");
        }
    }
    arg.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion_follows_the_kubelet() {
        let vars: HashMap<String, String> = [("POD_IP", "127.16.0.9"), ("A", "x")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(expand("--ip $(POD_IP)", &vars), "--ip 127.16.0.9");
        assert_eq!(expand("$(A)$(A)-$(B)", &vars), "xx-$(B)");
        assert_eq!(expand("$$(A) $$ $", &vars), "$(A) $ $");
        assert_eq!(expand("$(A", &vars), "$(A");
        assert_eq!(expand("cost: $5", &vars), "cost: $5");
    }

    #[test]
    fn paths_under_mounts_move_under_the_root() {
        let mounts = vec!["/config".to_string(), "/data".to_string()];
        let root = Path::new("/tmp/pod/root");
        assert_eq!(
            rewrite_paths("/config/valkey.conf", &mounts, root),
            "/tmp/pod/root/config/valkey.conf"
        );
        assert_eq!(
            rewrite_paths("--dir=/data", &mounts, root),
            "--dir=/tmp/pod/root/data"
        );
        assert_eq!(rewrite_paths("/configx", &mounts, root), "/configx");
        assert_eq!(rewrite_paths("6379", &mounts, root), "6379");
    }
}
