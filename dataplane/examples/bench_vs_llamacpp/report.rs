//! The machine, the versions and the report: the table and the SVG of tok/s against
//! concurrency, both from the run's own measurements.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use crate::{Kind, Run, Workload};

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The CPU's model, the flags that decide which kernels run (SIMD, VNNI, AMX), and the
/// whole flags line, from /proc/cpuinfo.
pub(crate) fn cpu_summary() -> (String, String, String) {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_default()
    };
    let flags = field("flags");
    let wanted: Vec<&str> = flags
        .split_whitespace()
        .filter(|f| {
            matches!(*f, "avx" | "avx2" | "fma" | "f16c" | "avx_vnni")
                || f.starts_with("avx512")
                || f.starts_with("amx")
                || f.contains("vnni")
        })
        .collect();
    let cpus = info.lines().filter(|l| l.starts_with("processor")).count();
    let model = format!("{} ({cpus} logical CPUs)", field("model name"));
    let simd = if wanted.is_empty() {
        "(none of avx/avx2/fma/f16c/avx512*/vnni/amx)".to_owned()
    } else {
        wanted.join(" ")
    };
    (model, simd, flags)
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

pub(crate) fn version_of(bin: &Path) -> String {
    match Command::new(bin).arg("--version").output() {
        Ok(o) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            text.lines()
                .filter(|l| l.contains("version") || l.starts_with("tandem"))
                .collect::<Vec<_>>()
                .join("; ")
        }
        Err(e) => format!("? ({e})"),
    }
}

/// llama-server's `system_info` line (the instruction sets its CPU backend uses).
pub(crate) fn llama_system_info(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text.lines().find(|l| l.contains("system_info"))?;
    Some(line.split_once("system_info:")?.1.trim().to_owned())
}

pub(crate) fn range(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    let m = median(&mut s);
    (m, s[0], s[s.len() - 1])
}

pub(crate) fn cell(v: &[f64], digits: usize) -> String {
    let (m, lo, hi) = range(v);
    if v.len() == 1 {
        format!("{m:.digits$}")
    } else {
        format!("{m:.digits$} ({lo:.digits$}–{hi:.digits$})")
    }
}

pub(crate) type Results = Vec<(Workload, Kind, Run)>;

pub(crate) fn table(res: &Results, workloads: &[Workload]) -> String {
    let pick = |w: Workload, k: Kind, f: &dyn Fn(&Run) -> Option<f64>| -> Vec<f64> {
        res.iter()
            .filter(|(rw, rk, _)| *rw == w && *rk == k)
            .filter_map(|(_, _, r)| f(r))
            .collect()
    };
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| workload | metric | Tandem | llama-server | Tandem vs llama-server |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|");
    type Metric<'a> = (&'a str, usize, bool, Box<dyn Fn(&Run) -> Option<f64>>);
    for &w in workloads {
        let metrics: Vec<Metric> = match w {
            Workload::Gen(_) => vec![
                ("output tok/s", 1, true, Box::new(|r: &Run| Some(r.tok_s))),
                (
                    "TTFT ms (median)",
                    1,
                    false,
                    Box::new(|r: &Run| Some(r.ttft_ms)),
                ),
                (
                    "tokens / request",
                    1,
                    true,
                    Box::new(|r: &Run| Some(r.tokens_per_req)),
                ),
                (
                    "prompt tokens",
                    0,
                    true,
                    Box::new(|r: &Run| Some(r.prompt_tokens)),
                ),
                (
                    "peak RSS MB",
                    0,
                    false,
                    Box::new(|r: &Run| Some(r.peak_rss_mb)),
                ),
            ],
            Workload::Prefix(1) => vec![
                (
                    "TTFT ms, first request",
                    1,
                    false,
                    Box::new(|r: &Run| r.cold_ttft_ms),
                ),
                (
                    "TTFT ms, next 8 (median)",
                    1,
                    false,
                    Box::new(|r: &Run| Some(r.ttft_ms)),
                ),
                (
                    "prompt tokens",
                    0,
                    true,
                    Box::new(|r: &Run| Some(r.prompt_tokens)),
                ),
            ],
            Workload::Prefix(_) => vec![(
                "TTFT ms, 2 waves (median)",
                1,
                false,
                Box::new(|r: &Run| Some(r.ttft_ms)),
            )],
        };
        for (name, digits, higher_better, f) in metrics {
            let a = pick(w, Kind::Tandem, &*f);
            let b = pick(w, Kind::Llama, &*f);
            if a.is_empty() || b.is_empty() {
                continue;
            }
            let (ma, mb) = (range(&a).0, range(&b).0);
            let ratio = if name.starts_with("tokens") || name.starts_with("prompt") {
                String::new()
            } else {
                // r > 1: Tandem is better by r× (more tok/s, or lower TTFT).
                let r = if higher_better { ma / mb } else { mb / ma };
                match (higher_better, r >= 1.0) {
                    (true, true) => format!("{r:.2}× faster"),
                    (true, false) => format!("{:.2}× slower", 1.0 / r),
                    (false, true) => format!("{r:.2}× lower"),
                    (false, false) => format!("{:.2}× higher", 1.0 / r),
                }
            };
            let _ = writeln!(
                t,
                "| {} | {name} | {} | {} | {ratio} |",
                w.label(),
                cell(&a, digits),
                cell(&b, digits)
            );
        }
    }
    t
}

/// Tok/s against concurrency for both servers as an SVG (the medians joined by lines,
/// each repetition's range as a bar), from the `gen` runs of `res`; `None` with fewer
/// than two concurrency levels. Log₂ spacing on x (1, 2, 4 ... 32), linear y from 0.
pub(crate) fn svg(res: &Results, title: &str, subtitle: &str) -> Option<String> {
    let mut levels: Vec<usize> = res
        .iter()
        .filter_map(|(w, _, _)| match w {
            Workload::Gen(c) => Some(*c),
            _ => None,
        })
        .collect();
    levels.sort();
    levels.dedup();
    if levels.len() < 2 {
        return None;
    }
    let series = |k: Kind| -> Vec<(usize, f64, f64, f64)> {
        levels
            .iter()
            .filter_map(|&c| {
                let v: Vec<f64> = res
                    .iter()
                    .filter(|(w, rk, _)| *w == Workload::Gen(c) && *rk == k)
                    .map(|(_, _, r)| r.tok_s)
                    .collect();
                (!v.is_empty()).then(|| {
                    let (m, lo, hi) = range(&v);
                    (c, m, lo, hi)
                })
            })
            .collect()
    };
    let (tandem, llama) = (series(Kind::Tandem), series(Kind::Llama));
    let top = tandem
        .iter()
        .chain(&llama)
        .map(|p| p.3)
        .fold(0f64, f64::max)
        .max(1.0);
    // A round step giving 4..8 grid lines.
    let mag = 10f64.powf(top.log10().floor());
    let step = [0.5, 1.0, 2.0, 5.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| top / s <= 8.0)
        .unwrap_or(10.0 * mag);
    let ymax = (top / step).ceil() * step;
    let (w, h, l, r, t, b) = (720.0, 440.0, 80.0, 170.0, 64.0, 56.0);
    let (pw, ph) = (w - l - r, h - t - b);
    let (x0, x1) = (
        (levels[0] as f64).log2(),
        (levels[levels.len() - 1] as f64).log2(),
    );
    let x = |c: usize| l + ((c as f64).log2() - x0) / (x1 - x0).max(1e-9) * pw;
    let y = |v: f64| t + ph - v / ymax * ph;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="13">"#
    );
    let _ = writeln!(o, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{l}" y="24" font-size="16" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let _ = writeln!(
        o,
        r##"<text x="{l}" y="44" fill="#555" font-size="11">{}</text>"##,
        esc(subtitle)
    );
    let mut v = 0.0;
    while v <= ymax + step * 1e-6 {
        let yy = y(v);
        let _ = writeln!(
            o,
            r##"<line x1="{l}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{v}</text>"##,
            l + pw,
            l - 8.0,
            yy + 4.0
        );
        v += step;
    }
    for &c in &levels {
        let xx = x(c);
        let _ = writeln!(
            o,
            r##"<line x1="{xx:.1}" y1="{t}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{c}</text>"##,
            t + ph,
            t + ph + 20.0
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">concurrent clients (C)</text>"#,
        l + pw / 2.0,
        h - 12.0
    );
    let _ = writeln!(
        o,
        r#"<text transform="translate(20 {:.1}) rotate(-90)" text-anchor="middle">output tok/s (aggregate)</text>"#,
        t + ph / 2.0
    );
    for (i, (name, pts, color)) in [
        ("Tandem", &tandem, "#1f77b4"),
        ("llama-server", &llama, "#d62728"),
    ]
    .into_iter()
    .enumerate()
    {
        let line: Vec<String> = pts
            .iter()
            .map(|p| format!("{:.1},{:.1}", x(p.0), y(p.1)))
            .collect();
        let _ = writeln!(
            o,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2.5"/>"#,
            line.join(" ")
        );
        for &(c, m, lo, hi) in pts.iter() {
            let xx = x(c);
            let _ = writeln!(
                o,
                r#"<line x1="{xx:.1}" y1="{:.1}" x2="{xx:.1}" y2="{:.1}" stroke="{color}"/><circle cx="{xx:.1}" cy="{:.1}" r="4" fill="{color}"><title>{name} C={c}: {m:.1} tok/s ({lo:.1}–{hi:.1})</title></circle><text x="{:.1}" y="{:.1}" fill="{color}" font-size="11">{m:.0}</text>"#,
                y(lo),
                y(hi),
                y(m),
                xx + 6.0,
                y(m) - 6.0
            );
        }
        let ly = t + 10.0 + 22.0 * i as f64;
        let _ = writeln!(
            o,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2.5"/><text x="{:.1}" y="{:.1}">{name}</text>"#,
            l + pw + 16.0,
            l + pw + 40.0,
            l + pw + 46.0,
            ly + 4.0
        );
    }
    let _ = writeln!(
        o,
        r##"<text x="{:.1}" y="{:.1}" fill="#555" font-size="11">median of reps;</text><text x="{:.1}" y="{:.1}" fill="#555" font-size="11">bars: their range</text>"##,
        l + pw + 16.0,
        t + 64.0,
        l + pw + 16.0,
        t + 78.0
    );
    o.push_str("</svg>\n");
    Some(o)
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_cells() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
        assert_eq!(cell(&[7.0], 1), "7.0");
        assert_eq!(cell(&[3.0, 1.0, 2.0], 0), "2 (1–3)");
    }

    fn run(tok_s: f64) -> Run {
        Run {
            tok_s,
            ..Run::default()
        }
    }

    #[test]
    fn svg_plots_both_servers_at_every_level_from_the_runs() {
        let res: Results = vec![
            (Workload::Gen(1), Kind::Tandem, run(100.0)),
            (Workload::Gen(1), Kind::Tandem, run(110.0)),
            (Workload::Gen(1), Kind::Llama, run(80.0)),
            (Workload::Gen(32), Kind::Tandem, run(900.0)),
            (Workload::Gen(32), Kind::Llama, run(150.0)),
            (Workload::Prefix(1), Kind::Llama, run(5.0)),
        ];
        let s = svg(&res, "a <model>", "machine").unwrap();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert_eq!(s.matches("<polyline").count(), 2);
        // Medians: Tandem 105 at C=1, 900 at C=32; llama-server 80 and 150.
        for t in [
            "Tandem C=1: 105.0",
            "Tandem C=32: 900.0",
            "llama-server C=1: 80.0",
        ] {
            assert!(s.contains(t), "{t}");
        }
        assert!(s.contains("a &lt;model&gt;"), "titles are escaped");
        // One concurrency level is not a curve.
        assert!(svg(&res[..3].to_vec(), "t", "s").is_none());
    }
}
