//! `alloctramp top`: a full-screen live view of a running process's
//! sites, read from its counters file once per interval (the process does
//! nothing for it). The rows (grouping, rates, filter, order) are the
//! report library's [`watch`] model; here: the terminal, the keys, and
//! the drawing.

use crate::control::{SwitchArgs, counters_dir, pid_file, switch};
use crate::report::{Found, Source, discover};
use alloctramp_report::ProcessInfo;
use alloctramp_report::model::GroupBy;
use alloctramp_report::watch::{self, Options, Reading, ViewRow};
use alloctramp_trampolines::process::Request;
use anyhow::{Result, bail};
use ratatui::Terminal;
use ratatui::backend::CrosstermBackend;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::crossterm::{cursor, execute, terminal};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Cell, Clear, Paragraph, Row, Table, TableState};
use std::io::{self, IsTerminal};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A live view of a running process's sites.
#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    alloctramp top 12345              # refreshed every second\n  \
    alloctramp top                    # choose among this user's profiled processes\n  \
    alloctramp top 12345 --interval 0.5\n\n\
Keys: e profiling on/off, r reset, s sort (live bytes, growth, calls/s), g group (site, function, file,\n\
module), / filter, c callers of the selected site, p pause, arrows select, q quit.")]
pub struct Args {
    /// The process id [default: choose among this user's profiled
    /// processes].
    pub pid: Option<u32>,
    /// Seconds between readings.
    #[arg(long, default_value_t = 1.0, value_name = "SECONDS")]
    pub interval: f64,
    /// Where process counters files are [default: $ALLOCTRAMP_DIR, else
    /// $XDG_RUNTIME_DIR/alloctramp, else /tmp/alloctramp-UID].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// A signal asked to stop (SIGINT, SIGTERM, SIGHUP: the terminal is
/// restored before leaving).
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

pub fn run(args: Args) -> Result<()> {
    if !(args.interval >= 0.05 && args.interval <= 3600.0) {
        bail!("--interval {}: expected seconds from 0.05 to 3600", args.interval);
    }
    let dir = counters_dir(args.dir.as_deref());
    if let Some(pid) = args.pid {
        pid_file(pid, &dir)?;
    }
    if !io::stdout().is_terminal() || !io::stdin().is_terminal() {
        bail!("top draws on a terminal: for text, `alloctramp report`");
    }
    let chooser = match args.pid {
        Some(_) => Vec::new(),
        None => {
            let c = running(&dir);
            if c.is_empty() {
                bail!("no process of yours runs patched code (looked in {})", dir.display());
            }
            c
        }
    };
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    let mut screen = Screen::enter()?;
    let pid = match args.pid {
        Some(p) => p,
        None => match choose(&mut screen, &chooser)? {
            Some(p) => p,
            None => return Ok(()),
        },
    };
    let path = pid_file(pid, &dir)?;
    let mut app = App::new(pid, path, dir, args.interval);
    app.event_loop(&mut screen)
}

/// The terminal in raw mode on the alternate screen; restored when
/// dropped (quit, error) and by the panic hook.
struct Screen {
    term: Terminal<CrosstermBackend<io::Stdout>>,
}

fn restore() {
    let _ = terminal::disable_raw_mode();
    let _ = execute!(io::stdout(), terminal::LeaveAlternateScreen, cursor::Show);
}

impl Screen {
    fn enter() -> Result<Screen> {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore();
            previous(info);
        }));
        terminal::enable_raw_mode()?;
        let screen = Screen { term: Terminal::new(CrosstermBackend::new(io::stdout()))? };
        execute!(io::stdout(), terminal::EnterAlternateScreen, cursor::Hide)?;
        Ok(screen)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        restore();
    }
}

/// A key read within `wait` (None: none, or another event, such as a
/// resize, that only asks for drawing again).
fn key(wait: Duration) -> Result<Option<KeyEvent>> {
    if !event::poll(wait)? {
        return Ok(None);
    }
    Ok(match event::read()? {
        Event::Key(k) if k.kind != KeyEventKind::Release => Some(k),
        _ => None,
    })
}

fn is_interrupt(k: &KeyEvent) -> bool {
    k.modifiers.contains(KeyModifiers::CONTROL) && matches!(k.code, KeyCode::Char('c' | 'd'))
}

/// This user's running profiled processes: (pid, line to show).
fn running(dir: &Path) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out = Vec::new();
    for f in discover(entries) {
        let Found::Readable(src) = f else { continue };
        if !src.running {
            continue;
        }
        let Ok(figs) = src.figures() else { continue };
        let p = &figs.process;
        let live = figs.live_bytes().map_or("-".to_string(), |b| b.to_string());
        let command = p.command_line();
        out.push((p.pid, format!("{:>8}  {:<4} {live:>14}  {command}", p.pid, if p.on { "on" } else { "off" })));
    }
    out.sort();
    out
}

/// The chooser: a process of `list`, or None (quit).
fn choose(screen: &mut Screen, list: &[(u32, String)]) -> Result<Option<u32>> {
    let mut state = TableState::default().with_selected(Some(0));
    loop {
        if STOP.load(Ordering::Relaxed) {
            return Ok(None);
        }
        screen.term.draw(|f| {
            let rows = list.iter().map(|(_, l)| Row::new([Cell::from(l.as_str())]));
            let table = Table::new(rows, [Constraint::Percentage(100)])
                .header(Row::new(["     PID  STATE      LIVE-BYTES  COMMAND"]).style(bold()))
                .block(Block::default().borders(Borders::ALL).title(" alloctramp top: choose a process "))
                .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED));
            let [main, foot] = Layout::vertical([Constraint::Min(3), Constraint::Length(1)]).areas(f.area());
            f.render_stateful_widget(table, main, &mut state);
            f.render_widget(Paragraph::new("↑/↓ select   Enter watch   q quit"), foot);
        })?;
        let Some(k) = key(Duration::from_millis(200))? else { continue };
        let i = state.selected().unwrap_or(0);
        match k.code {
            _ if is_interrupt(&k) => return Ok(None),
            KeyCode::Char('q') | KeyCode::Esc => return Ok(None),
            KeyCode::Up => state.select(Some(i.saturating_sub(1))),
            KeyCode::Down => state.select(Some((i + 1).min(list.len() - 1))),
            KeyCode::Enter => return Ok(list.get(i).map(|x| x.0)),
            _ => {}
        }
    }
}

fn bold() -> Style {
    Style::default().add_modifier(Modifier::BOLD)
}

struct App {
    pid: u32,
    path: PathBuf,
    dir: PathBuf,
    interval: f64,
    start: Instant,
    opts: Options,
    before: Option<Reading>,
    now: Option<Reading>,
    process: ProcessInfo,
    running: bool,
    paused: bool,
    rows: Vec<ViewRow>,
    table: TableState,
    /// The filter being typed.
    editing: Option<String>,
    /// The callers of a site: its name and lines.
    callers: Option<(String, Vec<String>)>,
    message: String,
}

enum Next {
    Go,
    Quit,
}

impl App {
    fn new(pid: u32, path: PathBuf, dir: PathBuf, interval: f64) -> App {
        App {
            pid,
            path,
            dir,
            interval,
            start: Instant::now(),
            opts: Options::default(),
            before: None,
            now: None,
            process: ProcessInfo { pid, ..ProcessInfo::default() },
            running: true,
            paused: false,
            rows: Vec::new(),
            table: TableState::default().with_selected(Some(0)),
            editing: None,
            callers: None,
            message: String::new(),
        }
    }

    fn event_loop(&mut self, screen: &mut Screen) -> Result<()> {
        let every = Duration::from_secs_f64(self.interval);
        let mut next = Instant::now();
        loop {
            if STOP.load(Ordering::Relaxed) {
                return Ok(());
            }
            if Instant::now() >= next {
                if !self.paused {
                    self.read();
                }
                next = Instant::now() + every;
            }
            screen.term.draw(|f| self.draw(f))?;
            let wait = next.saturating_duration_since(Instant::now()).min(Duration::from_millis(200));
            if let Some(k) = key(wait)?
                && let Next::Quit = self.key(k)
            {
                return Ok(());
            }
        }
    }

    /// A new reading of the file (a process gone keeps its last figures).
    fn read(&mut self) {
        if !self.running {
            return;
        }
        let src = match Source::open(&self.path.to_string_lossy(), &self.dir) {
            Ok(s) => s,
            Err(_) => {
                self.running = false;
                return;
            }
        };
        match src.figures() {
            Ok(figs) => {
                let r = Reading::new(self.start.elapsed().as_secs_f64(), &figs);
                self.before = self.now.replace(r);
                self.process = figs.process.clone();
                self.running = src.running;
            }
            Err(e) => self.message = format!("{e:#}"),
        }
        self.refresh_rows();
    }

    fn refresh_rows(&mut self) {
        if let Some(now) = &self.now {
            self.rows = watch::rows(self.before.as_ref(), now, &self.opts);
        }
        let last = self.rows.len().saturating_sub(1);
        if self.table.selected().is_none_or(|i| i > last) {
            self.table.select(Some(last));
        }
    }

    fn switch(&mut self, request: Request) {
        if !self.running {
            self.message = format!("process {} has exited", self.pid);
            return;
        }
        let args = SwitchArgs { pid: self.pid, dir: Some(self.dir.clone()), timeout: 5.0 };
        self.message = match switch(&args, request) {
            Ok(m) => m,
            Err(e) => format!("{e:#}"),
        };
        self.read();
    }

    fn key(&mut self, k: KeyEvent) -> Next {
        if is_interrupt(&k) {
            return Next::Quit;
        }
        if let Some(text) = &mut self.editing {
            match k.code {
                KeyCode::Enter => {
                    self.opts.filter = std::mem::take(text);
                    self.editing = None;
                }
                KeyCode::Esc => self.editing = None,
                KeyCode::Backspace => {
                    text.pop();
                }
                KeyCode::Char(c) => text.push(c),
                _ => {}
            }
            self.refresh_rows();
            return Next::Go;
        }
        if self.callers.is_some() {
            match k.code {
                KeyCode::Char('q') => return Next::Quit,
                _ => self.callers = None,
            }
            return Next::Go;
        }
        let i = self.table.selected().unwrap_or(0);
        match k.code {
            KeyCode::Char('q') => return Next::Quit,
            KeyCode::Esc if !self.opts.filter.is_empty() => self.opts.filter.clear(),
            KeyCode::Esc => return Next::Quit,
            KeyCode::Char('e') => {
                // Draining is off: `e` switches it on again.
                self.switch(if self.process.on { Request::Off } else { Request::On });
            }
            KeyCode::Char('r') => self.switch(Request::Reset),
            KeyCode::Char('s') => self.opts.sort = self.opts.sort.next(),
            KeyCode::Char('g') => self.opts.group = watch::next_group(self.opts.group),
            KeyCode::Char('/') => self.editing = Some(self.opts.filter.clone()),
            KeyCode::Char('p') | KeyCode::Char(' ') => {
                self.paused = !self.paused;
                self.message = if self.paused { "paused: p to go on" } else { "" }.to_string();
            }
            KeyCode::Char('c') | KeyCode::Enter => self.show_callers(),
            KeyCode::Up => self.table.select(Some(i.saturating_sub(1))),
            KeyCode::Down => self.table.select(Some(i + 1)),
            KeyCode::PageUp => self.table.select(Some(i.saturating_sub(20))),
            KeyCode::PageDown => self.table.select(Some(i + 20)),
            KeyCode::Home => self.table.select(Some(0)),
            KeyCode::End => self.table.select(Some(usize::MAX)),
            _ => {}
        }
        self.refresh_rows();
        Next::Go
    }

    /// The recorded call chains of the selected site.
    fn show_callers(&mut self) {
        let Some(row) = self.table.selected().and_then(|i| self.rows.get(i)) else { return };
        let Some(site) = row.site.clone() else {
            self.message = "callers are per site: g to group by site".to_string();
            return;
        };
        let title = format!("{} {}", row.location, row.function);
        let chains = Source::open(&self.path.to_string_lossy(), &self.dir)
            .ok()
            .and_then(|src| {
                let pf = src.parse().ok()?;
                Some(crate::callers::chains(&pf, &alloctramp_patcher::plumbing::Plumbing::with(&[])))
            })
            .unwrap_or_default();
        let mut lines: Vec<String> = chains
            .iter()
            .filter(|c| c.site == site)
            .map(|c| {
                let frames: Vec<String> = c.frames.iter().map(|f| f.describe()).collect();
                format!("{:>10} calls {:>12} bytes  {}", c.calls, c.bytes, frames.join(" ← "))
            })
            .collect();
        if lines.is_empty() {
            lines.push(format!(
                "No call chains recorded for this site: `alloctramp callers {} on` records them.",
                self.pid
            ));
        }
        self.callers = Some((title, lines));
    }

    fn draw(&mut self, f: &mut ratatui::Frame) {
        let [head, main, foot] =
            Layout::vertical([Constraint::Length(2), Constraint::Min(3), Constraint::Length(1)]).areas(f.area());
        let p = &self.process;
        let state = if p.on {
            "profiling ON"
        } else if p.draining {
            "profiling OFF (draining)"
        } else {
            "profiling OFF"
        };
        let gone = match (self.running, p.exited) {
            (true, _) => String::new(),
            (false, true) => "   EXITED: its final figures".to_string(),
            (false, false) => "   GONE: the last figures read".to_string(),
        };
        let paused = if self.paused { "   PAUSED" } else { "" };
        let command = p.command_line();
        let line1 = format!("alloctramp top   pid {}  {command}   {state}{gone}{paused}", self.pid);
        let (size, count, calls) =
            self.now.as_ref().map_or((0, 0, 0), |n| (n.total_size(), n.total_count(), n.total_calls()));
        let live = self.now.as_ref().is_none_or(|n| n.live);
        let growth = self.now.as_ref().map_or(0.0, |n| watch::rate(self.before.as_ref(), n, Reading::total_size));
        let rate = self.now.as_ref().map_or(0.0, |n| watch::rate(self.before.as_ref(), n, Reading::total_calls));
        let (what, objects) = if live { ("live", "tracked objects") } else { ("requested", "successful calls") };
        let filter = match (&self.editing, self.opts.filter.as_str()) {
            (Some(t), _) => format!("   filter: {t}▏"),
            (None, "") => String::new(),
            (None, t) => format!("   filter: {t}"),
        };
        let line2 = format!(
            "{what} {size} B ({growth:+.0} B/s)   {objects} {count}   calls {calls} ({rate:.0}/s)   sort: {}   group: {}{filter}",
            self.opts.sort.as_str(),
            self.opts.group.as_str()
        );
        f.render_widget(Paragraph::new(vec![Line::from(line1).style(bold()), Line::from(line2)]), head);

        let size_title = if live { "LIVE BYTES" } else { "BYTES" };
        let header = Row::new([size_title, "Δ B/s", "CALLS/s", "OBJECTS", "SITE", "FUNCTION", "MODULE"]).style(bold());
        // The fixed columns, their gaps, then the site (3/5 of the rest:
        // a path cut from the left, keeping `file:line`) and the function.
        let rest = f.area().width.saturating_sub(14 + 12 + 10 + 10 + 20 + 6);
        let site_width = (rest * 3 / 5).max(12);
        let rows = self.rows.iter().map(|r| {
            let location = match self.opts.group {
                GroupBy::Site | GroupBy::File => fit_left(&r.location, site_width as usize),
                _ => format!("({} sites)", r.sites),
            };
            Row::new([
                Cell::from(r.size.to_string()),
                Cell::from(format!("{:+.0}", r.growth)),
                Cell::from(format!("{:.0}", r.calls_per_s)),
                Cell::from(r.count.to_string()),
                Cell::from(location),
                Cell::from(r.function.clone()),
                Cell::from(r.module.clone()),
            ])
        });
        let widths = [
            Constraint::Length(14),
            Constraint::Length(12),
            Constraint::Length(10),
            Constraint::Length(10),
            Constraint::Length(site_width),
            Constraint::Min(8),
            Constraint::Length(20),
        ];
        let sort = self.opts.sort.as_str();
        let table = Table::new(rows, widths)
            .header(header)
            .block(Block::default().borders(Borders::TOP).title(format!(" sites by {sort} ")))
            .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED));
        f.render_stateful_widget(table, main, &mut self.table);

        let keys = "e on/off  r reset  s sort  g group  / filter  c callers  p pause  q quit";
        let foot_text = if self.message.is_empty() { keys.to_string() } else { format!("{}   {keys}", self.message) };
        f.render_widget(Paragraph::new(foot_text), foot);

        if let Some((title, lines)) = &self.callers {
            let area = centered(main, 90, 70);
            f.render_widget(Clear, area);
            let text: Vec<Line> = lines.iter().map(|l| Line::from(l.as_str())).collect();
            let block = Block::default().borders(Borders::ALL).title(format!(" callers of {title} (any key closes) "));
            f.render_widget(Paragraph::new(text).block(block), area);
        }
    }
}

/// `s`, or its end after `…` when it is longer than `width` characters.
fn fit_left(s: &str, width: usize) -> String {
    let n = s.chars().count();
    if n <= width || width == 0 {
        return s.to_string();
    }
    let tail: String = s.chars().skip(n - (width - 1)).collect();
    format!("…{tail}")
}

/// A rectangle of `w`% by `h`% in the middle of `r`.
fn centered(r: Rect, w: u16, h: u16) -> Rect {
    let [_, mid, _] = Layout::vertical([
        Constraint::Percentage((100 - h) / 2),
        Constraint::Percentage(h),
        Constraint::Percentage((100 - h) / 2),
    ])
    .areas(r);
    let [_, c, _] = Layout::horizontal([
        Constraint::Percentage((100 - w) / 2),
        Constraint::Percentage(w),
        Constraint::Percentage((100 - w) / 2),
    ])
    .areas(mid);
    c
}

#[cfg(test)]
mod tests {
    #[test]
    fn long_paths_keep_their_end() {
        assert_eq!(super::fit_left("/src/a.c:12", 20), "/src/a.c:12");
        assert_eq!(super::fit_left("/work/src/server.c:101", 15), "…c/server.c:101");
    }
}
