//! `alloctramp serve`: this user's profiled processes over HTTP, for the
//! servers people already run: `/metrics` (OpenMetrics, or Prometheus
//! text for clients that do not ask for it) for Prometheus,
//! `/debug/pprof/heap?pid=PID` or `?command=NAME` (a pprof heap profile,
//! where Go servers expose theirs) for `go tool pprof`, Parca and Grafana Alloy, `/`,
//! an index of the processes, and `/process?pid=PID`, a page of charts of
//! a process (its script and data: `/page.js`, `/api/history?pid=PID`,
//! `/api/icicle?pid=PID`).
//!
//! The charts' history is sampled by a thread of the server every
//! `--sample-interval` (the last [`HISTORY`] samples of each running
//! process, [`alloctramp_report::history`]). Every other request reads
//! the counters directory afresh: the processes are
//! found as `alloctramp report` lists them, their files copied without
//! stopping them. A file that cannot be read is skipped (one log line the
//! first time, and a count in the metrics); a process exiting meanwhile
//! is simply gone from the answer.

use crate::control::counters_dir;
use crate::report::{Found, Source, discover};
use alloctramp_report::history::History;
use alloctramp_report::model::{Figures, GroupBy};
use alloctramp_report::openmetrics::{self, Scrape, Variant};
use anyhow::{Context, Result};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Serve metrics and heap profiles of this user's profiled processes.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp serve                                   # on 127.0.0.1:9747\n  \
    curl -s http://127.0.0.1:9747/metrics\n  \
    go tool pprof -top http://127.0.0.1:9747/debug/pprof/heap?pid=12345\n  \
    alloctramp serve --listen 0.0.0.0:9747 --group-by function   # for a Prometheus elsewhere\n\n\
No authentication: anyone who reaches the address reads function and file names. Listen on\n\
loopback (the default) unless the network is trusted; docs/fleet.md runs it across machines.")]
pub struct Args {
    /// The address to listen on (HOST:PORT; port 0: any free port, printed
    /// at start).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9747")]
    pub listen: String,
    /// /metrics series per site, or summed per function, file or module
    /// of each process (fewer series: see docs/fleet.md).
    #[arg(long, value_parser = ["site", "function", "file", "module"], default_value = "site")]
    pub group_by: String,
    /// Where process counters files are [default: $ALLOCTRAMP_DIR, else
    /// $XDG_RUNTIME_DIR/alloctramp, else /tmp/alloctramp-UID].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Requests answered at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub threads: u32,
    /// Seconds between the samples of live bytes that the pages chart.
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    pub sample_interval: f64,
}

/// Samples kept per process for the charts.
pub const HISTORY: usize = 600;

/// The page of a process, its script, and its stylesheet.
const PAGE_HTML: &str = include_str!("../assets/page.html");
const PAGE_JS: &str = include_str!("../assets/page.js");

struct State {
    dir: PathBuf,
    group_by: GroupBy,
    /// Files already reported as unreadable (one log line each).
    logged: Mutex<HashSet<(PathBuf, String)>>,
    history: Mutex<History>,
}

pub fn run(args: Args) -> Result<()> {
    let group_by: GroupBy = args.group_by.parse().map_err(|e| anyhow::anyhow!("--group-by {e}"))?;
    if !(args.sample_interval >= 0.05 && args.sample_interval <= 3600.0) {
        anyhow::bail!("--sample-interval {}: expected seconds from 0.05 to 3600", args.sample_interval);
    }
    let dir = counters_dir(args.dir.as_deref());
    let server = tiny_http::Server::http(&args.listen)
        .map_err(|e| anyhow::anyhow!("--listen {}: cannot listen: {e}", args.listen))?;
    let addr = server.server_addr().to_ip().context("a TCP address")?;
    if !addr.ip().is_loopback() {
        eprintln!(
            "alloctramp: listening on {addr}, beyond loopback: anyone who reaches it reads this user's \
             processes' figures and names"
        );
    }
    eprintln!("alloctramp: serving http://{addr}/ (/metrics, /debug/pprof/heap?pid=PID) for {}", dir.display());
    let server = Arc::new(server);
    let state = Arc::new(State { dir, group_by, logged: Mutex::default(), history: Mutex::new(History::new(HISTORY)) });
    {
        let state = state.clone();
        let every = std::time::Duration::from_secs_f64(args.sample_interval);
        std::thread::spawn(move || {
            loop {
                sample(&state);
                std::thread::sleep(every);
            }
        });
    }
    let workers: Vec<_> = (0..args.threads)
        .map(|_| {
            let (server, state) = (server.clone(), state.clone());
            std::thread::spawn(move || {
                while let Ok(req) = server.recv() {
                    handle(&state, req);
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    Ok(())
}

/// A response: status, content type, body.
type Reply = (u16, &'static str, Vec<u8>);

fn text(status: u16, body: String) -> Reply {
    (status, "text/plain; charset=utf-8", body.into_bytes())
}

fn handle(state: &State, req: tiny_http::Request) {
    let url = req.url().to_string();
    let (path, query) = url.split_once('?').unwrap_or((&url, ""));
    let header = |name: &'static str| {
        req.headers().iter().find(|h| h.field.equiv(name)).map(|h| h.value.as_str().to_string()).unwrap_or_default()
    };
    let (accept, encoding) = (header("Accept"), header("Accept-Encoding"));
    let (status, content_type, body) = match (req.method(), path) {
        (tiny_http::Method::Get | tiny_http::Method::Head, "/metrics") => metrics(state, &accept),
        (tiny_http::Method::Get | tiny_http::Method::Head, "/debug/pprof/heap") => heap(state, query),
        (tiny_http::Method::Get | tiny_http::Method::Head, "/") => index(state),
        (tiny_http::Method::Get | tiny_http::Method::Head, "/process") => page(state, query),
        (tiny_http::Method::Get | tiny_http::Method::Head, "/page.js") => {
            (200, "text/javascript; charset=utf-8", PAGE_JS.as_bytes().to_vec())
        }
        (tiny_http::Method::Get | tiny_http::Method::Head, "/api/history") => history(state, query),
        (tiny_http::Method::Get | tiny_http::Method::Head, "/api/icicle") => icicle(state, query),
        (tiny_http::Method::Get | tiny_http::Method::Head, _) => text(404, format!("no page {path}: try /\n")),
        _ => text(405, "only GET and HEAD\n".to_string()),
    };
    // Metrics compress about tenfold: gzip them for a client that takes it
    // (Prometheus does).
    let gzip = path == "/metrics" && status == 200 && encoding.split(',').any(|e| e.trim().starts_with("gzip"));
    let body = if gzip { gzipped(&body) } else { body };
    let mut resp = tiny_http::Response::from_data(body).with_status_code(status);
    if gzip && let Ok(h) = tiny_http::Header::from_bytes("Content-Encoding", "gzip") {
        resp = resp.with_header(h);
    }
    if let Ok(h) = tiny_http::Header::from_bytes("Content-Type", content_type) {
        resp = resp.with_header(h);
    }
    if path == "/debug/pprof/heap"
        && status == 200
        && let Ok(h) = tiny_http::Header::from_bytes("Content-Disposition", "attachment; filename=\"profile\"")
    {
        resp = resp.with_header(h);
    }
    // A client that went away is not an error of the server.
    let _ = req.respond(resp);
}

fn gzipped(data: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    // Writing to a Vec cannot fail.
    let _ = gz.write_all(data);
    gz.finish().unwrap_or_default()
}

/// The running processes' files, read now (their headers parsed; their
/// modules are read by [`figures`]); the unreadable ones logged once and
/// counted.
fn processes(state: &State) -> (Vec<Source>, u64) {
    let entries = match std::fs::read_dir(&state.dir) {
        Ok(e) => e,
        Err(e) => {
            log_once(state, &state.dir, &e.to_string());
            return (Vec::new(), 0);
        }
    };
    let mut out = Vec::new();
    let mut bad = 0;
    for f in discover(entries) {
        match f {
            Found::Readable(src) if src.running => out.push(src),
            Found::Readable(_) => {}
            Found::Unreadable(path, why) => {
                bad += 1;
                log_once(state, &path, &why);
            }
        }
    }
    out.sort_by_key(|s| s.parse().map_or(0, |p| p.pid));
    (out, bad)
}

/// The figures of a process's file; a file whose modules cannot be read
/// is logged once and counted in `bad`.
fn figures<'a>(state: &State, src: &'a Source, bad: &mut u64) -> Option<Figures<'a>> {
    match src.figures() {
        Ok(f) => Some(f),
        Err(e) => {
            *bad += 1;
            log_once(state, &src.path, &format!("{e:#}"));
            None
        }
    }
}

fn log_once(state: &State, path: &Path, why: &str) {
    let mut logged = state.logged.lock().unwrap_or_else(|e| e.into_inner());
    if logged.insert((path.to_path_buf(), why.to_string())) {
        let why = why.strip_prefix(&format!("{}: ", path.display())).unwrap_or(why);
        eprintln!("alloctramp: {}: {why} (skipped)", path.display());
    }
}

fn metrics(state: &State, accept: &str) -> Reply {
    let (srcs, mut unreadable) = processes(state);
    let processes: Vec<Figures> = srcs.iter().filter_map(|s| figures(state, s, &mut unreadable)).collect();
    let scrape = Scrape { processes, unreadable };
    let (variant, content_type) = if accept.contains("application/openmetrics-text") {
        (Variant::OpenMetrics, openmetrics::OPENMETRICS_CONTENT_TYPE)
    } else {
        (Variant::Text, openmetrics::TEXT_CONTENT_TYPE)
    };
    let mut body = Vec::new();
    match openmetrics::write(&mut body, &scrape, state.group_by, variant) {
        Ok(()) => (200, content_type, body),
        Err(e) => text(500, format!("{e}\n")),
    }
}

/// `/debug/pprof/heap?pid=PID`, or `?command=NAME` (the one process
/// whose command, or its file name, is NAME: a URL that stays the same
/// across restarts, for scrapers), or no parameter when one process runs.
fn heap(state: &State, query: &str) -> Reply {
    let param = |name: &str| query.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='));
    let (srcs, _) = processes(state);
    let running: Vec<(u32, String)> =
        srcs.iter().filter_map(|s| s.parse().ok().map(|p| (p.pid, p.command.clone()))).collect();
    let list = |of: &[&(u32, String)]| of.iter().map(|(p, c)| format!("{p} {c}")).collect::<Vec<_>>().join(", ");
    let chosen = match (param("pid"), param("command")) {
        (Some(p), _) => match p.parse::<u32>() {
            Ok(p) => p,
            Err(_) => return text(400, format!("pid={p}: not a process id\n")),
        },
        (None, Some(c)) => {
            let c = percent_decode(c);
            let of: Vec<&(u32, String)> =
                running.iter().filter(|(_, cmd)| *cmd == c || cmd.rsplit('/').next() == Some(c.as_str())).collect();
            match of.as_slice() {
                [one] => one.0,
                [] => return text(404, format!("no process of this user's runs {c} with patched code\n")),
                _ => return text(400, format!("several processes run {c}: name one with ?pid= ({})\n", list(&of))),
            }
        }
        (None, None) if running.len() == 1 => running[0].0,
        (None, None) => {
            let all: Vec<&(u32, String)> = running.iter().collect();
            return text(400, format!("name a process: ?pid=PID or ?command=NAME (running: {})\n", list(&all)));
        }
    };
    let Some(src) = srcs.iter().find(|s| s.parse().is_ok_and(|p| p.pid == chosen)) else {
        return text(404, format!("process {chosen} runs no patched code of this user's\n"));
    };
    match figures(state, src, &mut 0) {
        Some(figs) => (200, "application/octet-stream", crate::report::pprof(src, &figs, &[])),
        None => text(500, format!("{}: cannot be read (see the server's log)\n", src.path.display())),
    }
}

/// A URL query value with `%XX` and `+` decoded.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                match std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn html(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn index(state: &State) -> Reply {
    let (srcs, mut unreadable) = processes(state);
    let mut b = Vec::new();
    let _ = writeln!(
        b,
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>alloctramp</title></head><body>\n\
         <h1>alloctramp: profiled processes</h1>\n<p>Counters files in {}. <a href=\"/metrics\">/metrics</a></p>",
        html(&state.dir.display().to_string())
    );
    let _ = writeln!(
        b,
        "<table>\n<tr><th>pid</th><th>command</th><th>state</th><th>live bytes</th><th>sites</th>\
         <th>heap profile</th><th>page</th></tr>"
    );
    for s in &srcs {
        let Some(f) = figures(state, s, &mut unreadable) else { continue };
        let p = &f.process;
        let state = if p.on {
            "on"
        } else if p.draining {
            "draining"
        } else {
            "off"
        };
        let live = f.live_bytes().map_or("-".to_string(), |b| b.to_string());
        let sites: u64 = f.modules.iter().map(|m| u64::from(m.sites)).sum();
        let _ = writeln!(
            b,
            "<tr><td>{pid}</td><td>{}</td><td>{state}</td><td>{live}</td><td>{sites}</td>\
             <td><a href=\"/debug/pprof/heap?pid={pid}\">/debug/pprof/heap?pid={pid}</a></td>\
             <td><a href=\"/process?pid={pid}\">charts</a></td></tr>",
            html(&p.command_line()),
            pid = p.pid
        );
    }
    let _ = writeln!(b, "</table>");
    if srcs.is_empty() {
        let _ = writeln!(b, "<p>No process of this user runs patched code.</p>");
    }
    if unreadable > 0 {
        let _ = writeln!(b, "<p>{unreadable} counters files could not be read (see the server's log).</p>");
    }
    let _ = writeln!(b, "</body></html>");
    (200, "text/html; charset=utf-8", b)
}

/// A sample of every running process's live bytes for the charts.
fn sample(state: &State) {
    let (srcs, _) = processes(state);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let mut pids = Vec::new();
    let mut history = state.history.lock().unwrap_or_else(|e| e.into_inner());
    for src in &srcs {
        if let Some(figs) = figures(state, src, &mut 0) {
            history.record(now, &figs);
            pids.push(figs.process.pid);
        }
    }
    history.retain(&pids);
}

/// The `pid=` of a query, as a running process's source.
fn chosen(state: &State, query: &str) -> Result<Source, Reply> {
    let p = query.split('&').find_map(|kv| kv.strip_prefix("pid=")).unwrap_or("");
    let Ok(pid) = p.parse::<u32>() else {
        return Err(text(400, format!("pid={p}: not a process id\n")));
    };
    let (srcs, _) = processes(state);
    srcs.into_iter()
        .find(|s| s.parse().is_ok_and(|p| p.pid == pid))
        .ok_or_else(|| text(404, format!("process {pid} runs no patched code of this user's\n")))
}

fn json(value: &impl serde::Serialize) -> Reply {
    match serde_json::to_vec(value) {
        Ok(b) => (200, "application/json", b),
        Err(e) => text(500, format!("{e}\n")),
    }
}

/// `/process?pid=PID`: the page (its script draws it).
fn page(state: &State, query: &str) -> Reply {
    match chosen(state, query) {
        Ok(src) => {
            let title = src.parse().map_or(String::new(), |p| format!("{} {}", p.pid, p.command_line()));
            (200, "text/html; charset=utf-8", PAGE_HTML.replace("{title}", &html(&title)).into_bytes())
        }
        Err(r) => r,
    }
}

/// `/api/history?pid=PID[&top=N]`: the samples of a process (see
/// docs/formats.md).
fn history(state: &State, query: &str) -> Reply {
    let src = match chosen(state, query) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let top = query.split('&').find_map(|kv| kv.strip_prefix("top=")?.parse().ok()).unwrap_or(5usize).min(20);
    let pid = src.parse().map_or(0, |p| p.pid);
    // A process found before the sampler saw it: sampled now.
    let mut h = state.history.lock().unwrap_or_else(|e| e.into_inner());
    if h.series(pid, top).is_none()
        && let Some(figs) = figures(state, &src, &mut 0)
    {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        h.record(now, &figs);
    }
    match h.series(pid, top) {
        Some(s) => json(&s),
        None => text(500, format!("{}: cannot be read (see the server's log)\n", src.path.display())),
    }
}

/// `/api/icicle?pid=PID`: bytes allocated by recorded call chain, as a
/// tree (see docs/formats.md).
fn icicle(state: &State, query: &str) -> Reply {
    let src = match chosen(state, query) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let Some(figs) = figures(state, &src, &mut 0) else {
        return text(500, format!("{}: cannot be read (see the server's log)\n", src.path.display()));
    };
    let chains = match src.parse() {
        Ok(pf) => crate::callers::chains(&pf, &alloctramp_patcher::plumbing::Plumbing::with(&[])),
        Err(_) => Vec::new(),
    };
    let names: std::collections::HashMap<(&str, u64), String> = figs
        .sites
        .iter()
        .map(|(s, _)| ((s.module, s.address), format!("{} ({})", s.function.unwrap_or("?"), s.location())))
        .collect();
    let root = alloctramp_report::chains::icicle("all chains", &chains, |site| {
        names.get(&(site.0.as_str(), site.1)).cloned().unwrap_or_else(|| format!("{:#x} ({})", site.1, site.0))
    });
    json(&serde_json::json!({ "pid": figs.process.pid, "chains": chains.len(), "root": root }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_decoded() {
        assert_eq!(percent_decode("redis-server"), "redis-server");
        assert_eq!(percent_decode("%2Fusr%2Fbin%2Fx+y"), "/usr/bin/x y");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }
}
