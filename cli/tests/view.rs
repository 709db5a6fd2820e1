//! Looking rather than reading: `alloctramp top` driven in a real
//! terminal (tmux: keys sent, the screen captured), and `serve`'s page of
//! a process loaded by headless Chromium (its DOM and a screenshot). The
//! tools are installed (tmux, chromium) when missing.

use crate::runtime::{Server, report};
use crate::util::*;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A tmux server of its own (its socket named after the test), killed
/// when the test ends.
struct Tmux {
    socket: String,
}

impl Tmux {
    /// A detached session of `width` x `height` running bash without
    /// startup files, its prompt `ready$ `.
    fn start(name: &str, width: u32, height: u32) -> Tmux {
        let t = Tmux { socket: format!("alloctramp-{name}-{}", std::process::id()) };
        let o = t
            .cmd()
            .args(["new-session", "-d", "-s", "t", "-x", &width.to_string(), "-y", &height.to_string()])
            .args(["-e", "PS1=ready$ ", "bash", "--norc", "--noprofile"])
            .output()
            .unwrap();
        assert!(o.status.success(), "tmux new-session: {}", String::from_utf8_lossy(&o.stderr));
        t.wait_for("the prompt", |s| s.contains("ready$"));
        t
    }
    fn cmd(&self) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.socket]);
        c
    }
    /// Keys as tmux names them (`Enter`, `C-c`, `q`); `-l`: literal text.
    fn keys(&self, keys: &[&str]) {
        let o = self.cmd().args(["send-keys", "-t", "t"]).args(keys).output().unwrap();
        assert!(o.status.success(), "tmux send-keys {keys:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    fn type_line(&self, text: &str) {
        self.keys(&["-l", text]);
        self.keys(&["Enter"]);
    }
    /// The screen's text now.
    fn screen(&self) -> String {
        let o = self.cmd().args(["capture-pane", "-p", "-t", "t"]).output().unwrap();
        assert!(o.status.success(), "tmux capture-pane: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    /// Waits (up to 20 s) for a screen that `ok` accepts, and returns it.
    fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}; the screen:\n{s}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").output();
    }
}

/// The screen line of the site at `location` (`file:line`, the file's
/// path ending so), split into words.
fn site_line(screen: &str, location: &str) -> Option<Vec<String>> {
    screen
        .lines()
        .find(|l| l.split_whitespace().any(|w| w == location || w.ends_with(&format!("/{location}"))))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
}

/// The shell is back, clean: the last line on the screen is the prompt
/// and nothing of the view is left.
fn prompt_is_clean(screen: &str) -> bool {
    let last = screen.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    last.trim_end() == "ready$" && !screen.contains("server.c:") && !screen.contains("profiling ")
}

/// `alloctramp top PID` in tmux on a patched `server` (testbins/server.c):
/// - its marked malloc's `server.c:LINE` is on the screen with exactly the
///   live bytes of the rounds done (500, then 1000 after another round:
///   the screen follows the process), with its function and module, and
///   again after the terminal is resized;
/// - `e` switches profiling off and on again (as `report --format json`
///   says), `s` and `g` change the order and grouping, `/` filters, `p`
///   pauses, `c` shows that no chains were recorded, `r` resets the
///   counters (the report's `reset_time`);
/// - when the process exits, the view says so and keeps the final figures;
/// - `q` leaves the shell's prompt clean with the terminal's modes
///   restored, and so does Ctrl-C;
/// - a process that does not exist, and a bad interval: one line, status 2.
#[test]
fn top_in_tmux_follows_a_process_and_switches_it() {
    ensure_tool("tmux", "tmux");
    let mut s = Server::start("view-top", &[("ALLOCTRAMP", "on")]);
    assert_eq!(s.cmd("round"), "done");
    let malloc = program("server").markers.iter().find(|m| m.entry == "malloc").unwrap();
    let location = format!("server.c:{}", malloc.line);
    let t = Tmux::start("top", 200, 40);
    let top = format!("{} top --dir {} {}", env!("CARGO_BIN_EXE_alloctramp"), s.dir.display(), s.pid());
    t.type_line(&top);

    let screen = t.wait_for("the marked site", |sc| site_line(sc, &location).is_some());
    let row = site_line(&screen, &location).unwrap();
    assert_eq!(row[0], "500", "live bytes of one round: {row:?}\n{screen}");
    assert!(row.contains(&"do_round".to_string()) && row.contains(&"server".to_string()), "{row:?}");
    assert!(screen.contains("profiling ON"), "{screen}");
    assert!(screen.contains(&format!("pid {}", s.pid())), "{screen}");

    assert_eq!(s.cmd("round"), "done");
    let screen = t.wait_for("1000 live bytes", |sc| site_line(sc, &location).is_some_and(|r| r[0] == "1000"));
    assert!(screen.contains("live 1000 B"), "the header's total: {screen}");

    // A smaller terminal: drawn again to its size.
    let o = t.cmd().args(["resize-window", "-t", "t", "-x", "120", "-y", "20"]).output().unwrap();
    assert!(o.status.success(), "tmux resize-window: {}", String::from_utf8_lossy(&o.stderr));
    let screen = t.wait_for("the view at 120 columns", |sc| {
        site_line(sc, &location).is_some() && sc.contains("q quit") && sc.lines().all(|l| l.chars().count() <= 120)
    });
    assert!(screen.lines().count() <= 20, "{screen}");
    let o = t.cmd().args(["resize-window", "-t", "t", "-x", "200", "-y", "40"]).output().unwrap();
    assert!(o.status.success());
    t.wait_for("the view at 200 columns", |sc| {
        sc.lines().any(|l| l.starts_with(" sites by") && l.chars().count() > 190)
    });

    // Profiling off and on again from the keyboard.
    t.keys(&["e"]);
    t.wait_for("profiling OFF", |sc| sc.contains("profiling OFF"));
    assert!(!report(&s.pid(), &s.dir)["on"].as_bool().unwrap(), "e switched profiling off");
    t.keys(&["e"]);
    t.wait_for("profiling ON", |sc| sc.contains("profiling ON"));
    assert!(report(&s.pid(), &s.dir)["on"].as_bool().unwrap(), "e switched profiling on");

    // Order, grouping, filter, callers.
    t.keys(&["s"]);
    t.wait_for("sort by growth", |sc| sc.contains("sort: growth"));
    t.keys(&["g"]);
    let screen = t.wait_for("group by function", |sc| sc.contains("group: function"));
    assert!(site_line(&screen, &location).is_none(), "grouped by function, no site row:\n{screen}");
    let func = screen.lines().find(|l| l.contains("do_round")).unwrap_or_else(|| panic!("do_round's row:\n{screen}"));
    assert_eq!(func.split_whitespace().next(), Some("1000"), "do_round's sites sum to 1000 live bytes:\n{screen}");
    t.keys(&["g", "g", "g", "s", "s"]);
    t.wait_for("by site, by live bytes", |sc| sc.contains("group: site") && sc.contains("sort: live bytes"));
    t.keys(&["/"]);
    t.keys(&["-l", "no-such-name"]);
    t.keys(&["Enter"]);
    let screen = t.wait_for("the filter", |sc| sc.contains("filter: no-such-name") && !sc.contains("▏"));
    assert!(site_line(&screen, &location).is_none(), "filtered out:\n{screen}");
    t.keys(&["Escape"]);
    t.wait_for("no filter", |sc| site_line(sc, &location).is_some() && !sc.contains("filter:"));
    t.keys(&["p"]);
    t.wait_for("paused", |sc| sc.contains("PAUSED"));
    t.keys(&["p"]);
    t.wait_for("going on", |sc| !sc.contains("PAUSED"));
    t.keys(&["c"]);
    t.wait_for("no chains", |sc| sc.contains("No call chains recorded"));
    t.keys(&["x"]);
    t.wait_for("the popup closed", |sc| !sc.contains("No call chains recorded"));

    // The process exits: said, the figures kept.
    s.quit();
    let screen = t.wait_for("the exit", |sc| sc.contains("EXITED"));
    assert_eq!(site_line(&screen, &location).unwrap()[0], "1000", "the final figures stay:\n{screen}");

    t.keys(&["q"]);
    let screen = t.wait_for("the prompt", prompt_is_clean);
    assert!(screen.contains(&top), "the command line stays above the prompt:\n{screen}");
    t.type_line("stty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\\n' ,; echo");
    t.wait_for("the terminal's modes", |sc| sc.contains("icanon,echo,"));

    // The chooser, a reset, and Ctrl-C.
    let mut other = Server::start("view-top-2", &[("ALLOCTRAMP", "on")]);
    assert_eq!(other.cmd("round"), "done");
    t.type_line("clear");
    t.wait_for("a clear screen", |sc| sc.trim() == "ready$");
    t.type_line(&format!("{} top --dir {}", env!("CARGO_BIN_EXE_alloctramp"), other.dir.display()));
    t.wait_for("the chooser", |sc| sc.contains("choose a process") && sc.contains(&other.pid()));
    t.keys(&["Enter"]);
    t.wait_for("the process's view", |sc| site_line(sc, &location).is_some_and(|r| r[0] == "500"));
    assert_eq!(report(&other.pid(), &other.dir)["reset_time"].as_u64(), Some(0), "never reset");
    t.keys(&["r"]);
    t.wait_for("the reset", |sc| sc.contains("counters reset (profiling on)"));
    assert!(report(&other.pid(), &other.dir)["reset_time"].as_u64().unwrap() > 0, "r reset the counters");
    t.keys(&["C-c"]);
    t.wait_for("the prompt after Ctrl-C", prompt_is_clean);
    other.quit();

    for (args, says) in
        [(vec!["top", "999999"], "no process 999999"), (vec!["top", "--interval", "0", "1"], "--interval 0")]
    {
        let o = alloctramp().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// Headless Chromium (as root: without its sandbox).
fn chromium() -> Command {
    let mut c = Command::new("chromium");
    c.args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"])
        .arg("--disable-dev-shm-usage");
    c
}

/// Pixels of exactly `rgb` in a PNG file.
fn pixels_of(png: &Path, rgb: [u8; 3]) -> usize {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let step = match info.color_type {
        png::ColorType::Rgba => 4,
        png::ColorType::Rgb => 3,
        other => panic!("a colour PNG, not {other:?}"),
    };
    assert_eq!(info.bit_depth, png::BitDepth::Eight);
    buf[..info.buffer_size()].chunks(step).filter(|p| p[..3] == rgb).count()
}

/// `serve`'s page of a patched `server` (testbins/server.c) in headless
/// Chromium, after the server sampled it a few times while it allocated,
/// with callers capture on:
/// - the page's DOM, once its script ran, says the charts were drawn
///   (`data-drawn`), names the marked malloc's `server.c:LINE` among the
///   top sites with its live bytes, and has the icicle's boxes with the
///   site at the bottom;
/// - a screenshot has the total chart's fill colour and the first site
///   line's colour (the charts are drawn, not blank); the screenshot is
///   docs/page.png (ALLOCTRAMP_BLESS=1 writes it).
#[test]
fn served_page_draws_charts_and_an_icicle_in_chromium() {
    ensure_tool("chromium", "chromium");
    let mut s = Server::start("view-page", &[("ALLOCTRAMP", "on"), ("ALLOCTRAMP_CALLERS", "on")]);
    let malloc = program("server").markers.iter().find(|m| m.entry == "malloc").unwrap();
    let location = format!("server.c:{}", malloc.line);
    let (_serve, port, _log) = crate::export::start_serve(&s.dir, &["--sample-interval", "0.2"]);
    // Live bytes that grow, sampled by the server.
    for _ in 0..6 {
        assert_eq!(s.cmd("round"), "done");
        std::thread::sleep(Duration::from_millis(400));
    }
    let page = format!("http://127.0.0.1:{port}/process?pid={}", s.pid());
    let (status, _, body) = http_get(port, &format!("/process?pid={}", s.pid()), None);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (status, _, body) = http_get(port, &format!("/api/history?pid={}", s.pid()), None);
    assert_eq!(status, 200);
    let h: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(h["times"].as_array().unwrap().len() >= 5, "sampled: {h}");
    assert_eq!(h["total"].as_array().unwrap().last().unwrap().as_i64(), Some(3000), "6 rounds of 500 bytes: {h}");
    assert!(h["sites"][0]["location"].as_str().unwrap().ends_with(&format!("/{location}")), "{h}");
    assert_eq!(h["sites"][0]["values"].as_array().unwrap().last().unwrap().as_i64(), Some(3000));
    let (status, _, body) = http_get(port, "/process?pid=999999", None);
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&body));

    let dir = scratch("view-page");
    let out = chromium()
        .args(["--virtual-time-budget=5000", "--window-size=1200,1000", "--dump-dom"])
        .arg(&page)
        .env("HOME", &dir)
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        dom.contains("data-drawn=\"yes\""),
        "the charts were drawn: {}\n{dom}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dom.contains(&format!("/{location} do_round (server) 3000 B")), "the legend names the site:\n{dom}");
    assert!(dom.contains("class=\"box\"") && dom.contains(&format!("/{location}): 3000 bytes")), "the icicle:\n{dom}");

    let shot = dir.join("page.png");
    let out = chromium()
        .args(["--virtual-time-budget=5000", "--window-size=1200,1000"])
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&page)
        .env("HOME", &dir)
        .output()
        .unwrap();
    assert!(shot.exists(), "a screenshot: {}", String::from_utf8_lossy(&out.stderr));
    // The colours page.js fills the total's area and draws the first site
    // with (opaque: exact in the picture).
    let fill = pixels_of(&shot, [0xc6, 0xdb, 0xef]);
    let first = pixels_of(&shot, [0xd6, 0x27, 0x28]);
    assert!(fill > 2000, "the total's area is filled: {fill} pixels");
    assert!(first > 100, "the top site's line is drawn: {first} pixels");
    if std::env::var_os("ALLOCTRAMP_BLESS").is_some() {
        std::fs::copy(&shot, workspace().join("docs/page.png")).unwrap();
    }
    s.quit();
}
