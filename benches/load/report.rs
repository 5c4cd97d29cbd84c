//! The run's figures as markdown (`docs/performance.md`) and CSV: medians over rounds with
//! their spread, each as a ratio to Valkey direct and to HAProxy on as many threads, and the
//! machine and versions they were measured on.

use std::fmt::Write as _;
use std::process::Command;
use std::time::Duration;

use shardgate_harness::stats::spread as spread_of;
pub use shardgate_harness::stats::Stat;

use crate::peers::{Kind, Peer};
use crate::{Settings, Workload};

/// One workload through one data plane in one round.
#[derive(Clone, Debug)]
pub struct Sample {
    pub workload: String,
    pub peer: String,
    pub threads: u8,
    pub round: usize,
    pub rps: Option<f64>,
    pub cpu_us: Option<f64>,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub idle_bytes: Option<f64>,
}

impl Sample {
    pub fn new(workload: &str, peer: &Peer, round: usize) -> Sample {
        Sample {
            workload: workload.to_string(),
            peer: peer.name(),
            threads: peer.threads,
            round,
            rps: None,
            cpu_us: None,
            p50_us: None,
            p99_us: None,
            idle_bytes: None,
        }
    }

    /// One line for the progress log.
    pub fn brief(&self) -> String {
        let mut s = String::new();
        if let Some(v) = self.rps {
            let _ = write!(s, "{v:>10.0} rps");
        }
        if let Some(v) = self.cpu_us {
            let _ = write!(s, "  {v:>7.2} µs CPU/req");
        }
        if let (Some(a), Some(b)) = (self.p50_us, self.p99_us) {
            let _ = write!(s, "  p50 {a:.0} µs p99 {b:.0} µs");
        }
        if let Some(v) = self.idle_bytes {
            let _ = write!(s, "{v:>10.0} B/idle conn");
        }
        s
    }
}

pub fn stat(
    samples: &[Sample],
    workload: &str,
    peer: &str,
    metric: fn(&Sample) -> Option<f64>,
) -> Option<Stat> {
    spread_of(
        samples
            .iter()
            .filter(|s| s.workload == workload && s.peer == peer)
            .filter_map(metric)
            .collect(),
    )
}

/// `a`'s figure divided by the largest of `bs`' in the same round (the best, for requests/s;
/// pass one peer for CPU, where the smallest is best), over the rounds
/// where all of them have one. A round's runs follow one another within seconds, while the
/// machine's speed drifts between rounds (the same data plane's figures move by 20% and
/// more): within a round the drift cancels out, so the median of the rounds' ratios says
/// more than the ratio of the medians.
pub fn paired(
    samples: &[Sample],
    workload: &str,
    a: &str,
    bs: &[&str],
    metric: fn(&Sample) -> Option<f64>,
) -> Option<Stat> {
    let bs: Vec<(&str, &str)> = bs.iter().map(|b| (workload, *b)).collect();
    paired_runs(samples, (workload, a), &bs, metric)
}

/// [`paired`] for runs named by workload and data plane: one data plane's TLS workload over
/// its plain one, say.
pub fn paired_runs(
    samples: &[Sample],
    a: (&str, &str),
    bs: &[(&str, &str)],
    metric: fn(&Sample) -> Option<f64>,
) -> Option<Stat> {
    let of = |(workload, peer): (&str, &str), round: usize| {
        samples
            .iter()
            .find(|s| s.workload == workload && s.peer == peer && s.round == round)
            .and_then(metric)
            .filter(|v| *v > 0.0)
    };
    let rounds: std::collections::BTreeSet<usize> = samples.iter().map(|s| s.round).collect();
    spread_of(
        rounds
            .into_iter()
            .filter_map(|r| {
                let best = bs
                    .iter()
                    .map(|b| of(*b, r))
                    .collect::<Option<Vec<f64>>>()?
                    .into_iter()
                    .reduce(f64::max)?;
                Some(of(a, r)? / best)
            })
            .collect(),
    )
}

/// The peers' names in table order for one thread count: direct, then the proxies.
pub fn columns(threads: u8, cluster: bool) -> Vec<(Kind, String)> {
    let kinds: &[Kind] = if cluster {
        &[Kind::Rewrite]
    } else {
        &[
            Kind::Pass,
            Kind::Rewrite,
            Kind::Haproxy,
            Kind::HaproxyKeepalive,
            Kind::Nginx,
            Kind::Traefik,
        ]
    };
    let mut cols = vec![(Kind::Direct, Kind::Direct.label().to_string())];
    cols.extend(
        kinds
            .iter()
            .map(|k| (*k, format!("{} ×{threads}", k.label()))),
    );
    cols
}

fn num(v: f64) -> String {
    if v >= 100_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 10_000.0 {
        format!("{:.1}k", v / 1000.0)
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn spread(s: Stat, rounds: usize) -> String {
    if rounds > 1 {
        format!("{} ({}–{})", num(s.median), num(s.min), num(s.max))
    } else {
        num(s.median)
    }
}

/// A ratio `a / b`, if both are there.
fn ratio(a: Option<Stat>, b: Option<Stat>) -> Option<f64> {
    Some(a?.median / b?.median)
}

/// The machine and versions, for the report's header.
pub struct Environment {
    pub lines: Vec<(String, String)>,
}

impl Environment {
    pub fn collect(settings: &Settings, date: &str, took: Duration) -> Environment {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| {
                c.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|k| k.trim().to_string())
            .unwrap_or_default();
        let tool = |env: &str, default: &str| -> String {
            crate::peers::tool(env, default)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_else(|_| default.to_string())
        };
        let valkey = shardgate_harness::tools::valkey_server()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let bench = shardgate_harness::tools::redis_benchmark()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let git = first_line(&[
            "git",
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "rev-parse",
            "--short",
            "HEAD",
        ]);
        let dirty = !first_line(&[
            "git",
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "status",
            "--porcelain",
        ])
        .is_empty();
        let lines = vec![
            ("date (UTC)".into(), date.to_string()),
            (
                "run".into(),
                format!(
                    "{} round(s){}, {:.0} s; proxies on {} worker thread(s)",
                    settings.rounds,
                    if settings.quick { " (--quick)" } else { "" },
                    took.as_secs_f64(),
                    settings
                        .threads
                        .iter()
                        .map(u8::to_string)
                        .collect::<Vec<_>>()
                        .join(" and ")
                ),
            ),
            ("CPU".into(), format!("{cores} cores, {cpu}")),
            ("kernel".into(), kernel),
            (
                "shardgate".into(),
                format!(
                    "{git}{} (release build)",
                    if dirty { " + uncommitted changes" } else { "" }
                ),
            ),
            ("Valkey".into(), first_line(&[&valkey, "--version"])),
            ("redis-benchmark".into(), first_line(&[&bench, "--version"])),
            (
                "HAProxy".into(),
                first_line(&[&tool("SHARDGATE_HAPROXY", "/usr/sbin/haproxy"), "-v"]),
            ),
            (
                "nginx".into(),
                first_line(&[&tool("SHARDGATE_NGINX", "/usr/sbin/nginx"), "-v"]),
            ),
            (
                "Traefik".into(),
                first_line(&[&tool("SHARDGATE_TRAEFIK", "traefik"), "version"])
                    .replace("Version:", "")
                    .trim()
                    .to_string(),
            ),
            ("rustc".into(), first_line(&["rustc", "-V"])),
        ];
        Environment { lines }
    }
}

/// The first line a command prints (stdout, else stderr: `nginx -v` writes there).
fn first_line(cmd: &[&str]) -> String {
    let Some((bin, args)) = cmd.split_first() else {
        return String::new();
    };
    let Ok(out) = Command::new(bin).args(args).output() else {
        return "unknown".into();
    };
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Now, as `2026-11-30 23:50`.
pub fn utc_now() -> String {
    first_line(&["date", "-u", "+%Y-%m-%d %H:%M"])
}

/// One table: a row per (label, workload, metric), a column per peer; `cell` formats a
/// peer's figure given direct's and HAProxy's.
fn table(
    out: &mut String,
    samples: &[Sample],
    cols: &[(Kind, String)],
    rows: &[Row<'_>],
    cell: &dyn Fn(Stat, Option<Stat>, Option<Stat>) -> String,
) {
    let _ = write!(out, "| |");
    for (_, name) in cols {
        let _ = write!(out, " {name} |");
    }
    let _ = write!(out, "\n|---|");
    for _ in cols {
        let _ = write!(out, "---|");
    }
    out.push('\n');
    let haproxy = cols
        .iter()
        .find(|(k, _)| *k == Kind::Haproxy)
        .map(|(_, n)| n.clone());
    for (label, workload, metric) in rows {
        let direct = stat(samples, workload, Kind::Direct.label(), *metric);
        let hap = haproxy
            .as_ref()
            .and_then(|h| stat(samples, workload, h, *metric));
        let _ = write!(out, "| {label} |");
        for (_, name) in cols {
            match stat(samples, workload, name, *metric) {
                Some(s) => {
                    let _ = write!(out, " {} |", cell(s, direct, hap));
                }
                None => out.push_str(" — |"),
            }
        }
        out.push('\n');
    }
    out.push('\n');
}

fn rps(s: &Sample) -> Option<f64> {
    s.rps
}
fn cpu(s: &Sample) -> Option<f64> {
    s.cpu_us
}
fn p50(s: &Sample) -> Option<f64> {
    s.p50_us
}
fn p99(s: &Sample) -> Option<f64> {
    s.p99_us
}
fn idle(s: &Sample) -> Option<f64> {
    s.idle_bytes
}

pub fn markdown(
    env: &Environment,
    settings: &Settings,
    loads: &[Workload],
    samples: &[Sample],
) -> String {
    let rounds = settings.rounds;
    let mut out = String::new();
    out.push_str(
        "# Performance: shardgate beside Valkey direct, HAProxy, nginx and Traefik\n\n\
         Written by `scripts/bench-load` (the harness is `benches/load/`; the README's \
         Performance section says how to run it). Every data plane is a separate process on \
         loopback in front of the same standalone Valkey (a 3-shard cluster for the cluster \
         rows); the workloads run interleaved, data plane after data plane, round after round. \
         Cells are the median over rounds with the spread (min–max) in brackets. Quote the \
         ratios, not the absolute numbers.\n\n",
    );
    if let Some(note) = &settings.note {
        let _ = writeln!(out, "> **{note}**\n");
    }
    out.push_str("| | |\n|---|---|\n");
    for (k, v) in &env.lines {
        let _ = writeln!(out, "| {k} | {v} |");
    }
    out.push_str(
        "\nWorkloads: redis-benchmark with 50 clients, one test per run (`-t set` or `-t get`), \
         3-byte values unless a size is given, pipeline 1 unless P16; \"GET 1 client\" is the \
         harness's own client, one connection at pipeline 1 to each data plane, a GET to each \
         in turn so that every data plane meets the same machine (its requests/s is its \
         requests over the sum of its own round trips), each round trip in an HDR \
         histogram; \"GET churn\" opens a connection per GET (4 clients); \"idle\" starts a \
         fresh instance of the data plane, holds N connections open through it, each answered \
         one PING, and divides its RSS growth by N; the TLS rows are the same through the \
         data plane's TLS listener, which terminates TLS (a `*.example.test` certificate, \
         redis-benchmark `--tls --sni vc-0-0.example.test`; the harness's own rustls client \
         for \"TLS idle\"; shardgate's TLS port, HAProxy `bind ... ssl`, nginx `listen ... \
         ssl`; not set up for direct and Traefik); the cluster rows are redis-benchmark `--cluster` through the proxy's ports (the \
         topology rewritten) and a client that sends each key to the next node round robin and \
         follows `-MOVED` (about two thirds of the GETs are redirected). \"HAProxy tcp \
         keepalive\" is HAProxy with TCP keepalive on both legs at shardgate's times (`option \
         tcpka`, 60 s then every 10 s): the same socket options per connection as shardgate, \
         which HAProxy's defaults leave out. Proxy CPU per request \
         is the data plane's CPU time (user + system, from its threads' `schedstat`, which \
         counts nanoseconds where `/proc/<pid>/stat`'s utime + stime count 10 ms ticks) over \
         the run divided by its requests.\n\n",
    );
    let _ = writeln!(
        out,
        "Idle connections per data plane: {}{}; requests per redis-benchmark run: {} at P1, {} \
         at P16, {} with 64 KiB values, {} with `--cluster` (whose runs come out in steps of \
         about 250 ms, so a short run reads as 80k, 40k or 27k requests/s).\n",
        settings.idle,
        settings
            .idle_note
            .as_ref()
            .map_or(String::new(), |n| format!(" ({n})")),
        settings.requests_p1,
        settings.requests_p16,
        settings.requests_64k,
        settings.requests_cluster
    );

    let standalone: Vec<&Workload> = loads.iter().filter(|w| !w.cluster).collect();
    let clustered: Vec<&Workload> = loads.iter().filter(|w| w.cluster).collect();
    for &t in &settings.threads {
        let cols = columns(t, false);
        let _ = writeln!(out, "## Proxies on {t} worker thread(s)\n");
        let _ = writeln!(out, "### Requests/s\n");
        table(
            &mut out,
            samples,
            &cols,
            &rows_of(&standalone, rps),
            &|s, _, _| spread(s, rounds),
        );
        let _ = writeln!(out, "### Requests/s as a ratio: × direct / × HAProxy\n");
        table(
            &mut out,
            samples,
            &cols,
            &rows_of(&standalone, rps),
            &|s, d, h| {
                let f = |r: Option<f64>| r.map_or("—".into(), |r| format!("{r:.2}"));
                format!("{} / {}", f(ratio(Some(s), d)), f(ratio(Some(s), h)))
            },
        );
        let _ = writeln!(out, "### Proxy CPU per request (µs), and × HAProxy\n");
        table(
            &mut out,
            samples,
            &cols[1..],
            &rows_of(&standalone, cpu),
            &|s, _, h| {
                let r = ratio(Some(s), h).map_or(String::new(), |r| format!(" · {r:.2}×"));
                format!("{}{r}", spread(s, rounds))
            },
        );
        let _ = writeln!(
            out,
            "### One client at pipeline 1: latency (µs), and × direct\n"
        );
        let lat_rows: Vec<Row<'_>> =
            vec![("p50", "GET 1 client", p50), ("p99", "GET 1 client", p99)];
        table(&mut out, samples, &cols, &lat_rows, &|s, d, _| {
            let r = ratio(Some(s), d).map_or(String::new(), |r| format!(" · {r:.2}×"));
            format!("{}{r}", spread(s, rounds))
        });
        let _ = writeln!(
            out,
            "### Memory: RSS per idle connection (bytes), and × HAProxy\n"
        );
        let idle_rows: Vec<Row<'_>> = standalone
            .iter()
            .filter(|w| w.is_idle())
            .map(|w| {
                (
                    w.name.as_str(),
                    w.name.as_str(),
                    idle as fn(&Sample) -> Option<f64>,
                )
            })
            .collect();
        table(&mut out, samples, &cols[1..], &idle_rows, &|s, _, h| {
            let r = ratio(Some(s), h).map_or(String::new(), |r| format!(" · {r:.2}×"));
            format!("{}{r}", spread(s, rounds))
        });
    }
    if !clustered.is_empty() {
        let _ = writeln!(out, "## Cluster (3 shards) through the rewrite path\n");
        let mut cols = vec![(Kind::Direct, Kind::Direct.label().to_string())];
        for &t in &settings.threads {
            cols.extend(columns(t, true).into_iter().skip(1));
        }
        let _ = writeln!(out, "### Requests/s, and × direct\n");
        table(
            &mut out,
            samples,
            &cols,
            &rows_of(&clustered, rps),
            &|s, d, _| {
                let r = ratio(Some(s), d).map_or(String::new(), |r| format!(" · {r:.2}×"));
                format!("{}{r}", spread(s, rounds))
            },
        );
        let _ = writeln!(out, "### Proxy CPU per request (µs)\n");
        table(
            &mut out,
            samples,
            &cols[1..],
            &rows_of(&clustered, cpu),
            &|s, _, _| spread(s, rounds),
        );
    }
    targets(&mut out, settings, samples);
    out.push_str("![requests/s and CPU per request, as ratios](performance.png)\n\n");
    out.push_str(
        "Raw samples (one line per workload, data plane and round): \
         [performance.csv](performance.csv).\n",
    );
    out
}

type Row<'a> = (&'a str, &'a str, fn(&Sample) -> Option<f64>);

/// A row per workload (but the idle ones, which have their own table) for `metric`.
fn rows_of<'a>(ws: &[&'a Workload], metric: fn(&Sample) -> Option<f64>) -> Vec<Row<'a>> {
    ws.iter()
        .filter(|w| !w.is_idle())
        .map(|w| (w.name.as_str(), w.name.as_str(), metric))
        .collect()
}

/// Issue 13's targets, checked on the first thread count: ratios between data planes as the
/// median of each round's ratio ([`paired`]), idle memory as medians.
fn targets(out: &mut String, settings: &Settings, samples: &[Sample]) {
    let Some(&t) = settings.threads.first() else {
        return;
    };
    let name = |k: Kind| format!("{} ×{t}", k.label());
    let ratio = |w: &str, a: Kind, bs: &[Kind], m: fn(&Sample) -> Option<f64>| {
        let bs: Vec<String> = bs.iter().map(|&b| name(b)).collect();
        let bs: Vec<&str> = bs.iter().map(String::as_str).collect();
        paired(samples, w, &name(a), &bs, m)
    };
    let shown = |s: Stat| {
        if settings.rounds > 1 {
            format!("{:.2}× ({:.2}–{:.2})", s.median, s.min, s.max)
        } else {
            format!("{:.2}×", s.median)
        }
    };
    let mut rows: Vec<(String, String, Option<bool>)> = Vec::new();
    let rb = [
        "SET P1",
        "GET P1",
        "SET P16",
        "GET P16",
        "SET 1 KiB",
        "GET 1 KiB",
        "SET 64 KiB",
        "GET 64 KiB",
        "GET 1 client",
        "GET churn",
    ];
    let mut worst: Option<(Stat, &str)> = None;
    for w in rb {
        let Some(r) = ratio(w, Kind::Pass, &[Kind::Haproxy, Kind::Nginx], rps) else {
            continue;
        };
        if worst.is_none_or(|(x, _)| r.median < x.median) {
            worst = Some((r, w));
        }
    }
    if let Some((r, w)) = worst {
        rows.push((
            "pass-through ≥ HAProxy and nginx requests/s on every workload".into(),
            format!("worst: {} the better of the two ({w})", shown(r)),
            Some(r.median >= 1.0),
        ));
    }
    for w in ["GET P1", "GET P16"] {
        if let Some(r) = ratio(w, Kind::Pass, &[Kind::Haproxy], cpu) {
            rows.push((
                format!("pass-through CPU/request ≤ 0.85× HAProxy ({w})"),
                shown(r),
                Some(r.median <= 0.85),
            ));
        }
    }
    for w in ["GET P1", "SET P1", "GET P16", "SET P16"] {
        if let (Some(r), Some(c)) = (
            ratio(w, Kind::Rewrite, &[Kind::Pass], rps),
            ratio(w, Kind::Rewrite, &[Kind::Pass], cpu),
        ) {
            rows.push((
                format!("rewrite ≥ 0.95× pass-through requests/s, ≤ 1.10× its CPU ({w})"),
                format!("{} requests/s, {} CPU", shown(r), shown(c)),
                Some(r.median >= 0.95 && c.median <= 1.10),
            ));
        }
    }
    for (tls, plain) in [("TLS GET P1", "GET P1"), ("TLS GET P16", "GET P16")] {
        let over_plain = |k: Kind| {
            let n = name(k);
            paired_runs(samples, (tls, &n), &[(plain, &n)], rps)
        };
        let Some(r) = over_plain(Kind::Pass) else {
            continue;
        };
        // The others' own TLS over plain: what terminating costs a data plane on this machine
        // with this load generator, whose OpenSSL shares the cores.
        let others: Vec<String> = [Kind::Haproxy, Kind::Nginx]
            .into_iter()
            .filter_map(|k| over_plain(k).map(|o| format!("{} {:.2}×", k.product(), o.median)))
            .collect();
        let others = if others.is_empty() {
            String::new()
        } else {
            format!("; {}", others.join(", "))
        };
        rows.push((
            format!("TLS termination ≥ 0.85× plain requests/s, kept alive ({plain})"),
            format!("{}{others}", shown(r)),
            Some(r.median >= 0.85),
        ));
    }
    let med = |w: &str, k: Kind| stat(samples, w, &name(k), idle).map(|s| s.median);
    if let (Some(p), Some(h)) = (med("idle", Kind::Pass), med("idle", Kind::Haproxy)) {
        rows.push((
            "≤ 4 KiB RSS per idle connection, at or below HAProxy".into(),
            format!("{p:.0} B ({:.2}× HAProxy)", p / h),
            Some(p <= 4096.0 && p <= h),
        ));
    }
    let _ = writeln!(
        out,
        "## Issue 13's targets (proxies on {t} thread(s))\n\n\
         Ratios are the median over rounds of each round's ratio, the two data planes' runs of \
         a round being seconds apart (the spread over rounds in brackets); memory is the \
         median.\n"
    );
    out.push_str("| target | measured | met |\n|---|---|---|\n");
    for (target, measured, met) in rows {
        let met = match met {
            Some(true) => "yes",
            Some(false) => "no",
            None => "—",
        };
        let _ = writeln!(out, "| {target} | {measured} | {met} |");
    }
    out.push('\n');
}

pub fn csv(samples: &[Sample]) -> String {
    let mut out = String::from(
        "workload,peer,threads,round,rps,cpu_us_per_req,p50_us,p99_us,idle_bytes_per_conn\n",
    );
    let f = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
    for s in samples {
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{},{}",
            s.workload,
            s.peer,
            s.threads,
            s.round,
            f(s.rps),
            f(s.cpu_us),
            f(s.p50_us),
            f(s.p99_us),
            f(s.idle_bytes)
        );
    }
    out
}
