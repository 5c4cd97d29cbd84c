//! Which local program runs a container image, and how it is made to stay on its pod's IP.
//!
//! There is no container runtime here: a pod's containers run as local processes that share
//! the machine's network, so a program that binds `0.0.0.0` (as it may in its own network
//! namespace) would take the port from every other pod. Each image kind therefore gets the
//! flags that bind it to its pod's IP, and `0.0.0.0` in a container's arguments means the
//! pod IP.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::{bail, Result};
use shardgate_harness::proxy_process::{proxy_binary, PROXY_PROGRAM};
use shardgate_harness::tools::valkey_server;
use shardgate_harness::valkey::server::{
    image_name, is_server_image, local_settings, SERVER_COMMANDS, SERVER_PROGRAM,
};

/// The kinds of image the agent can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    /// A Valkey server image (the Valkey harness's rule,
    /// [`is_server_image`]: the repository name contains `valkey` or `redis`): `valkey-server`.
    Valkey,
    /// The project's proxy image (repository name contains `shardgate-proxy`).
    Proxy,
}

/// The kind of `image`, by its repository name ([`image_name`]); the proxy's name wins
/// (`shardgate-proxy` is no Valkey image, whatever organisation it is under).
pub fn kind(image: &str) -> Option<ImageKind> {
    if image_name(image).contains(PROXY_PROGRAM) {
        Some(ImageKind::Proxy)
    } else if is_server_image(image) {
        Some(ImageKind::Valkey)
    } else {
        None
    }
}

/// A container image resolved to a local program.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub kind: ImageKind,
    pub program: PathBuf,
    /// The program's name inside the image (a container `command[0]` that names it is
    /// replaced by `program`).
    pub name: &'static str,
}

/// The image → executable table.
pub fn resolve(image: &str) -> Result<Resolved> {
    match kind(image) {
        Some(ImageKind::Proxy) => Ok(Resolved {
            kind: ImageKind::Proxy,
            program: proxy_binary()?,
            name: PROXY_PROGRAM,
        }),
        Some(ImageKind::Valkey) => Ok(Resolved {
            kind: ImageKind::Valkey,
            program: valkey_server()?,
            name: SERVER_PROGRAM,
        }),
        None => bail!(
            "image {image:?} has no local program: the node agent runs images whose name \
             contains valkey or redis ({SERVER_PROGRAM}) or {PROXY_PROGRAM}"
        ),
    }
}

/// The argument vector for `program`: the container's command (whose first word must be the
/// image's program) and args, then the flags that keep the process on `ip`.
pub fn argv(
    resolved: &Resolved,
    command: &[String],
    args: &[String],
    ip: Ipv4Addr,
) -> Result<Vec<String>> {
    let mut argv = Vec::new();
    if let Some((first, rest)) = command.split_first() {
        let base = first.rsplit('/').next().unwrap_or(first);
        let aliases: &[&str] = match resolved.kind {
            ImageKind::Valkey => SERVER_COMMANDS,
            ImageKind::Proxy => &[PROXY_PROGRAM],
        };
        if !aliases.contains(&base) {
            bail!(
                "command {first:?} is not supported for a {} image (expected {})",
                resolved.name,
                aliases.join(" or ")
            );
        }
        argv.extend(rest.iter().cloned());
    }
    argv.extend(args.iter().cloned());
    let pod_ip = ip.to_string();
    for arg in &mut argv {
        if arg.contains("0.0.0.0") {
            *arg = arg.replace("0.0.0.0", &pod_ip);
        }
    }
    match resolved.kind {
        ImageKind::Valkey => {
            // Later options win over the config file and earlier ones: the pod's IP, and
            // the harness marker kept visible on the command line for the stray check.
            for (key, value) in local_settings(ip) {
                argv.push(format!("--{key}"));
                argv.push(value);
            }
        }
        ImageKind::Proxy => {
            // clap refuses a flag given twice: add them only where the pod left them out.
            let has = |flag: &str| {
                argv.iter()
                    .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
            };
            let (listen, admin) = (has("--listen-ip"), has("--admin-addr"));
            if !listen {
                argv.push(format!("--listen-ip={pod_ip}"));
            }
            if !admin {
                argv.push(format!("--admin-addr={pod_ip}:9090"));
            }
        }
    }
    Ok(argv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valkey() -> Resolved {
        Resolved {
            kind: ImageKind::Valkey,
            program: "/x/valkey-server".into(),
            name: "valkey-server",
        }
    }

    #[test]
    fn valkey_is_bound_to_the_pod_ip() {
        let ip = Ipv4Addr::new(127, 20, 0, 1);
        let argv = argv(
            &valkey(),
            &["valkey-server".into(), "/config/valkey.conf".into()],
            &["--port".into(), "6379".into()],
            ip,
        )
        .unwrap();
        assert_eq!(
            argv,
            [
                "/config/valkey.conf",
                "--port",
                "6379",
                "--bind",
                "127.20.0.1",
                "--bind-source-addr",
                "127.20.0.1",
                "--set-proc-title",
                "no"
            ]
        );
        let err = super::argv(&valkey(), &["sh".into()], &[], ip).unwrap_err();
        assert!(err.to_string().contains("not supported"), "{err}");
    }

    #[test]
    fn proxy_flags_are_added_only_when_missing() {
        let proxy = Resolved {
            kind: ImageKind::Proxy,
            program: "/x/shardgate-proxy".into(),
            name: "shardgate-proxy",
        };
        let ip = Ipv4Addr::new(127, 20, 0, 2);
        let argv = argv(&proxy, &[], &["--admin-addr=0.0.0.0:9191".into()], ip).unwrap();
        assert_eq!(
            argv,
            ["--admin-addr=127.20.0.2:9191", "--listen-ip=127.20.0.2"]
        );
    }

    #[test]
    fn image_kinds_go_by_repository_name() {
        assert_eq!(kind("valkey/valkey:9.0"), Some(ImageKind::Valkey));
        assert_eq!(kind("bitnami/redis-cluster:7.2"), Some(ImageKind::Valkey));
        assert_eq!(
            kind("ghcr.io/valkey-io/shardgate-proxy:0.1"),
            Some(ImageKind::Proxy)
        );
        assert_eq!(kind("registry.redis.example/nginx:1.27"), None);
    }

    #[test]
    fn unknown_images_are_refused_by_name() {
        let err = resolve("nginx:1.27").unwrap_err().to_string();
        assert!(err.contains("nginx:1.27"), "{err}");
    }
}
