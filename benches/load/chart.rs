//! `docs/performance.png`: per thread count, each proxy's requests/s as a ratio to Valkey
//! direct (with the rounds' spread), its CPU per request as a ratio to HAProxy's, and its
//! memory per idle connection. Text is
//! drawn with DejaVu Sans embedded in the binary, so no system font is needed.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{register_font, FontStyle};

use crate::peers::Kind;
use crate::report::{columns, stat, Environment, Sample};
use crate::{Settings, Workload};

const PROXIES: [Kind; 6] = [
    Kind::Pass,
    Kind::Rewrite,
    Kind::Haproxy,
    Kind::HaproxyKeepalive,
    Kind::Nginx,
    Kind::Traefik,
];

fn color(k: Kind) -> RGBColor {
    match k {
        Kind::Pass => RGBColor(31, 119, 180),
        Kind::Rewrite => RGBColor(106, 174, 214),
        Kind::Haproxy => RGBColor(214, 39, 40),
        Kind::HaproxyKeepalive => RGBColor(255, 152, 150),
        Kind::Nginx => RGBColor(44, 160, 44),
        Kind::Traefik => RGBColor(148, 103, 189),
        Kind::Direct => RGBColor(0, 0, 0),
    }
}

pub fn draw(
    path: &Path,
    settings: &Settings,
    loads: &[Workload],
    samples: &[Sample],
    env: &Environment,
) -> Result<()> {
    // A second registration fails harmlessly.
    let _ = register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    let names: Vec<&str> = loads
        .iter()
        // TLS has no direct run to divide by: its rows are in the tables only.
        .filter(|w| !w.cluster && !w.is_idle() && !w.name.starts_with("TLS"))
        .map(|w| w.name.as_str())
        .collect();
    let groups = settings.threads.len();
    let (width, height) = (2000u32, 70 + 430 * groups as u32);
    let root = BitMapBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let date = env
        .lines
        .iter()
        .find(|(k, _)| k.starts_with("date"))
        .map_or(String::new(), |(_, v)| v.clone());
    let cpu = env
        .lines
        .iter()
        .find(|(k, _)| k == "CPU")
        .map_or(String::new(), |(_, v)| v.clone());
    root.draw(&Text::new(
        format!(
            "shardgate beside Valkey direct, HAProxy, nginx, Traefik: medians of {} round(s), {date} UTC, {cpu}",
            settings.rounds
        ),
        (20, 15),
        ("sans-serif", 20).into_font(),
    ))
    .map_err(|e| anyhow!("{e}"))?;
    let body = root.margin(50, 0, 0, 0);
    let rows = body.split_evenly((groups, 1));
    let idle_names: Vec<&str> = loads
        .iter()
        .filter(|w| !w.cluster && w.is_idle())
        .map(|w| w.name.as_str())
        .collect();
    for (g, &t) in settings.threads.iter().enumerate() {
        let cols = columns(t, false);
        let direct = Kind::Direct.label();
        let haproxy = format!("{} ×{t}", Kind::Haproxy.label());
        let (left, rest) = rows[g].split_horizontally(width * 43 / 100);
        let (middle, right) = rest.split_horizontally(width * 43 / 100);
        // Requests/s ÷ direct's median; CPU/request ÷ HAProxy's median; KiB per idle
        // connection as it is.
        for (panel, area, title) in [
            (
                0,
                &left,
                format!("requests/s ÷ Valkey direct — proxies on {t} thread(s)"),
            ),
            (
                1,
                &middle,
                format!("proxy CPU per request ÷ HAProxy's — {t} thread(s)"),
            ),
            (2, &right, format!("RSS KiB per idle conn., ×{t}")),
        ] {
            let cats: &[&str] = if panel == 2 { &idle_names } else { &names };
            let metric: fn(&Sample) -> Option<f64> = match panel {
                0 => |s| s.rps,
                1 => |s| s.cpu_us,
                _ => |s| s.idle_bytes,
            };
            let mut bars: Vec<(usize, usize, Kind, f64, f64, f64)> = Vec::new();
            for (i, w) in cats.iter().enumerate() {
                let base = match panel {
                    0 => stat(samples, w, direct, metric).map(|b| b.median),
                    1 => stat(samples, w, &haproxy, metric).map(|b| b.median),
                    _ => Some(1024.0),
                };
                let Some(base) = base.filter(|b| *b > 0.0) else {
                    continue;
                };
                for (j, (kind, name)) in cols.iter().skip(1).enumerate() {
                    if let Some(s) = stat(samples, w, name, metric) {
                        bars.push((i, j, *kind, s.median / base, s.min / base, s.max / base));
                    }
                }
            }
            let highest = bars.iter().map(|b| b.5).fold(0.0f64, f64::max);
            let top = if panel == 2 {
                highest.max(1.0) * 1.1
            } else {
                highest.clamp(1.2, 4.0) * 1.08
            };
            let mut chart = ChartBuilder::on(area)
                .caption(title, ("sans-serif", 17))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(45)
                .build_cartesian_2d(0f64..cats.len() as f64, 0f64..top)
                .map_err(|e| anyhow!("{e}"))?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(0)
                .y_labels(8)
                .y_label_style(("sans-serif", 13))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            if panel < 2 {
                // The reference: direct (requests/s) or HAProxy (CPU) is 1.0.
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        [(0.0, 1.0), (cats.len() as f64, 1.0)],
                        BLACK.stroke_width(1),
                    )))
                    .map_err(|e| anyhow!("{e}"))?;
            }
            let slot = 0.84 / PROXIES.len() as f64;
            for kind in PROXIES {
                let series: Vec<_> = bars.iter().filter(|b| b.2 == kind).collect();
                let c = color(kind);
                let drawn = chart
                    .draw_series(series.iter().map(|b| {
                        let x0 = b.0 as f64 + 0.08 + b.1 as f64 * slot;
                        Rectangle::new([(x0, 0.0), (x0 + slot * 0.9, b.3.min(top))], c.filled())
                    }))
                    .map_err(|e| anyhow!("{e}"))?;
                if panel == 0 {
                    drawn
                        .label(format!("{} ×{t}", kind.label()))
                        .legend(move |(x, y)| {
                            Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled())
                        });
                }
                chart
                    .draw_series(series.iter().map(|b| {
                        let x = b.0 as f64 + 0.08 + b.1 as f64 * slot + slot * 0.45;
                        PathElement::new(
                            [(x, b.4.min(top)), (x, b.5.min(top))],
                            BLACK.stroke_width(1),
                        )
                    }))
                    .map_err(|e| anyhow!("{e}"))?;
            }
            if panel == 0 {
                chart
                    .configure_series_labels()
                    .position(SeriesLabelPosition::UpperRight)
                    .label_font(("sans-serif", 12))
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| anyhow!("{e}"))?;
            }
            let style = TextStyle::from(("sans-serif", 13).into_font())
                .pos(Pos::new(HPos::Center, VPos::Top));
            for (i, n) in cats.iter().enumerate() {
                let (px, py) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
                root.draw(&Text::new(n.to_string(), (px, py + 8), style.clone()))
                    .map_err(|e| anyhow!("{e}"))?;
            }
        }
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
