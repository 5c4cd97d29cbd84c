//! The proxy's modules layer one way: no top-level module of `proxy/src` may import, through
//! any chain, a module that imports it back, and `model` imports no other module. Checked by
//! reading every `crate::` path in the sources (comments aside), so that a new cycle fails
//! CI with the files and lines that make it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One import: from module → to module, at a file and line.
type Edges = BTreeMap<String, BTreeMap<String, String>>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level modules a line names through `crate::`, including grouped imports
/// (`use crate::{a::B, c};`).
fn crate_paths(line: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        // `shardgate_crate::x` or `my_crate::x` are not this crate.
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        found.push(std::mem::take(&mut item));
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 {
                    item.push(c);
                }
            }
            found.push(item);
        } else {
            found.push(rest.to_string());
        }
    }
    found
        .into_iter()
        .filter_map(|p| {
            let name: String = p
                .trim()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

fn imports() -> Edges {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut edges = Edges::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for target in crate_paths(line) {
                if target != module {
                    edges
                        .entry(module.clone())
                        .or_default()
                        .entry(target)
                        .or_insert_with(|| format!("{}:{}", rel.display(), n + 1));
                }
            }
        }
    }
    edges
}

/// A chain of imports from `from` back to `from`, if there is one.
fn cycle(edges: &Edges, from: &str) -> Option<Vec<String>> {
    fn walk(
        edges: &Edges,
        at: &str,
        goal: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in edges.get(at).into_iter().flat_map(|m| m.keys()) {
            path.push(next.clone());
            if next == goal || (seen.insert(next.clone()) && walk(edges, next, goal, path, seen)) {
                return true;
            }
            path.pop();
        }
        false
    }
    let mut path = vec![from.to_string()];
    walk(edges, from, from, &mut path, &mut BTreeSet::new()).then_some(path)
}

#[test]
fn no_module_imports_a_module_that_imports_it_back() {
    let edges = imports();
    assert!(
        edges.len() >= 8,
        "the check found too few modules to mean anything: {edges:?}"
    );
    for module in edges.keys() {
        if let Some(chain) = cycle(&edges, module) {
            let steps: Vec<String> = chain
                .windows(2)
                .map(|w| format!("{} -> {} ({})", w[0], w[1], edges[&w[0]][&w[1]]))
                .collect();
            panic!("import cycle:\n  {}", steps.join("\n  "));
        }
    }
}

#[test]
fn the_model_imports_nothing_else() {
    let edges = imports();
    assert_eq!(edges.get("model"), None, "model must stand alone");
}

#[test]
fn the_check_sees_grouped_and_nested_imports() {
    assert_eq!(
        crate_paths("use crate::{conn::Forwarder, dial::{Dialer, tune}};"),
        ["conn", "dial"]
    );
    assert_eq!(
        crate_paths("let x = crate::rewrite::AddressMap::default();"),
        ["rewrite"]
    );
    assert!(crate_paths("use shardgate_crate::x;").is_empty());
}
