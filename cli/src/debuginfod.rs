//! Debug files from debuginfod servers, with elfutils' protocol and client
//! cache: `GET <server>/buildid/<hex>/debuginfo`, kept as
//! `<cache>/<hex>/debuginfo` in the cache that gdb and elfutils' tools
//! share. Asked only when no local debug file is found (see
//! `sites::find_debug_in`) and `DEBUGINFOD_URLS` names a server.
//!
//! The decisions (servers, cache directory, timeout, request URL, whether
//! a "not found" entry still holds) are plain functions of their inputs;
//! the cache and the network are touched only by [`Config::find`] and what
//! it calls. Failures are warnings: without the debug file, sites are
//! listed and patched without `file:line`, as for any file without one.

use crate::util::Input;
use std::ffi::OsString;
use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

/// elfutils' default for `DEBUGINFOD_TIMEOUT`, in seconds.
pub const DEFAULT_TIMEOUT_S: u64 = 90;

/// How long an entry saying "not found" holds, in seconds, unless
/// `<cache>/cache_miss_s` says otherwise (elfutils' default).
pub const DEFAULT_CACHE_MISS_S: i64 = 600;

/// What a server must send in each timeout period to be waited for (as
/// elfutils asks of curl: 100 KiB per `DEBUGINFOD_TIMEOUT` seconds).
const MIN_BYTES_PER_PERIOD: u64 = 100 * 1024;

/// Build-ids of this many bytes or more are refused (elfutils' limit).
const MAX_BUILD_ID_BYTES: usize = 64;

/// The file name of a debug file in its build-id's cache directory.
const DEBUGINFO: &str = "debuginfo";

/// What the environment asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Server URLs in the order they are asked, without duplicates.
    pub servers: Vec<String>,
    /// The client cache directory.
    pub cache: PathBuf,
    /// How long to wait for a connection, an answer, or each next piece
    /// of one; `None`: as long as it takes.
    pub timeout: Option<Duration>,
}

impl Config {
    /// The configuration of this process's environment; `None` when
    /// `DEBUGINFOD_URLS` names no server. Warnings go to stderr.
    pub fn from_env() -> Option<Config> {
        Config::from_vars(|name| std::env::var_os(name), |p| p.exists(), &mut |w| warn(&w))
    }

    /// The configuration that the variables `var` gives, where `exists`
    /// tells whether a path exists and `warn` receives warnings.
    pub fn from_vars(
        var: impl Fn(&str) -> Option<OsString>,
        exists: impl Fn(&Path) -> bool,
        warn: &mut dyn FnMut(String),
    ) -> Option<Config> {
        let urls = var("DEBUGINFOD_URLS")?;
        let servers = servers(&urls.to_string_lossy());
        if servers.is_empty() {
            return None;
        }
        let timeout = match var("DEBUGINFOD_TIMEOUT") {
            None => Some(Duration::from_secs(DEFAULT_TIMEOUT_S)),
            Some(v) => timeout(&v.to_string_lossy()).unwrap_or_else(|| {
                warn(format!(
                    "DEBUGINFOD_TIMEOUT={}: not a whole number of seconds; waiting {DEFAULT_TIMEOUT_S} s",
                    v.to_string_lossy()
                ));
                Some(Duration::from_secs(DEFAULT_TIMEOUT_S))
            }),
        };
        Some(Config { servers, cache: cache_dir(&var, &exists), timeout })
    }

    /// The debug file of the file whose build-id is `id`: from the cache,
    /// else from the first server that has it (then kept in the cache).
    /// `matches` tells whether bytes are that debug file; an answer that is
    /// not is a warning, and is not kept.
    pub fn find(&self, id: &[u8], matches: &dyn Fn(&[u8]) -> bool) -> Option<(PathBuf, Input)> {
        if id.is_empty() || id.len() >= MAX_BUILD_ID_BYTES {
            return None;
        }
        let hex = hex(id);
        let dir = self.cache.join(&hex);
        let target = dir.join(DEBUGINFO);
        match cached(&self.cache, &target, &hex, matches) {
            Cached::Found(input) => return Some((target, input)),
            Cached::Missing => return None,
            Cached::Absent => {}
        }
        let agent = self.agent();
        let mut not_found = true;
        for server in &self.servers {
            match self.fetch(&agent, server, &hex, &dir, matches) {
                Ok(input) => return Some((target, input)),
                Err(Failure::NotFound) => {}
                Err(Failure::Other(what)) => {
                    not_found = false;
                    warn(&format!("debuginfod {server}: {what}"));
                }
            }
        }
        // Every server said it does not have the file: not asked again
        // until the entry expires. A failure to record it changes nothing.
        if not_found && make_dirs(&self.cache, &dir).is_ok() {
            let _ = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o666).open(&target);
        } else {
            // Nothing kept: the build-id's directory goes, if empty.
            let _ = std::fs::remove_dir(&dir);
        }
        None
    }

    /// An HTTP client that gives up after the timeout at every step, reads
    /// proxies from the environment, and trusts the system's certificates.
    fn agent(&self) -> ureq::Agent {
        let t = self.timeout;
        let tls = ureq::tls::TlsConfig::builder().root_certs(ureq::tls::RootCerts::PlatformVerifier).build();
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .user_agent(concat!("alloctramp/", env!("CARGO_PKG_VERSION")))
            .tls_config(tls)
            .timeout_resolve(t)
            .timeout_connect(t)
            .timeout_send_request(t)
            .timeout_recv_response(t)
            .timeout_per_read(t)
            .build();
        ureq::Agent::new_with_config(config)
    }

    /// Asks `server` for the debug file of `hex` and, if it sends the right
    /// one, renames it into `dir` (created as needed).
    fn fetch(
        &self,
        agent: &ureq::Agent,
        server: &str,
        hex: &str,
        dir: &Path,
        matches: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Input, Failure> {
        if !is_http(server) {
            return Err(Failure::Other("only http:// and https:// servers are supported".into()));
        }
        let url = request_url(server, hex);
        let response = agent.get(&url).call().map_err(|e| self.network(e))?;
        match response.status().as_u16() {
            200 => {}
            404 => return Err(Failure::NotFound),
            _ => return Err(Failure::Other(format!("{url}: HTTP {}", response.status()))),
        }
        make_dirs(&self.cache, dir).map_err(|e| Failure::Other(format!("cannot create {}: {e}", dir.display())))?;
        let temp = Temp::create(dir).map_err(|e| Failure::Other(format!("cannot write in {}: {e}", dir.display())))?;
        let written = |e: io::Error| Failure::Other(format!("cannot write {}: {e}", temp.path.display()));
        let mut out = io::BufWriter::with_capacity(1 << 20, temp.file.try_clone().map_err(written)?);
        let mut body = response.into_body().into_reader();
        self.copy(&mut body, &mut out)?;
        out.into_inner().map_err(|e| written(e.into_error()))?;
        let input = Input::open(&temp.path).map_err(|e| Failure::Other(format!("{e:#}")))?;
        if !input.map.starts_with(b"\x7fELF") {
            return Err(Failure::Other(format!("{url}: the answer is not an ELF file")));
        }
        if !matches(&input.map) {
            return Err(Failure::Other(format!("{url}: the answer is not the debug file of build-id {hex}")));
        }
        temp.keep(&dir.join(DEBUGINFO)).map_err(|e| Failure::Other(format!("cannot keep it in the cache: {e}")))?;
        Ok(input)
    }

    /// Copies a response body, giving up on a server that sends less than
    /// 100 KiB in a timeout period.
    fn copy(&self, body: &mut impl Read, out: &mut impl Write) -> Result<(), Failure> {
        let mut buf = vec![0u8; 64 * 1024];
        let (mut since, mut got) = (Instant::now(), 0u64);
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.network(ureq::Error::from(e))),
            };
            out.write_all(&buf[..n]).map_err(|e| Failure::Other(format!("cannot write the cache: {e}")))?;
            got += n as u64;
            if let Some(t) = self.timeout
                && since.elapsed() >= t
            {
                if got < MIN_BYTES_PER_PERIOD {
                    return Err(Failure::Other(format!("sent less than 100 KiB in {} s", t.as_secs())));
                }
                (since, got) = (Instant::now(), 0);
            }
        }
    }

    /// A network failure in words.
    fn network(&self, e: ureq::Error) -> Failure {
        use ureq::Timeout as T;
        let secs = self.timeout.map_or(0, |t| t.as_secs());
        Failure::Other(match e {
            ureq::Error::Timeout(T::Resolve | T::Connect) => format!("cannot connect within {secs} s"),
            ureq::Error::Timeout(T::RecvResponse) => format!("no answer within {secs} s"),
            ureq::Error::Timeout(T::PerRead | T::RecvBody) => format!("nothing received for {secs} s"),
            ureq::Error::Timeout(t) => format!("timed out after {secs} s ({t})"),
            ureq::Error::Io(e) if is_refusal(e.kind()) => format!("cannot connect: {e}"),
            ureq::Error::Io(e) => e.to_string(),
            ureq::Error::HostNotFound => "host not found".into(),
            ureq::Error::ConnectionFailed => "cannot connect".into(),
            e => e.to_string(),
        })
    }
}

/// Why a server did not give the file.
#[derive(Debug)]
enum Failure {
    /// It says it does not have it (HTTP 404).
    NotFound,
    /// Anything else, in words.
    Other(String),
}

/// What the cache holds for a build-id.
enum Cached {
    Found(Input),
    /// A "not found" entry that still holds.
    Missing,
    Absent,
}

/// Looks `target` up in the cache: a non-empty file is the debug file
/// (checked with `matches`); an empty one records that no server had it,
/// and holds for `cache_miss_s` seconds after it was written (elfutils
/// 0.187 and later write it with the default mode, older versions with
/// mode 000: both are read alike). An expired entry is removed.
fn cached(cache: &Path, target: &Path, hex: &str, matches: &dyn Fn(&[u8]) -> bool) -> Cached {
    let Ok(meta) = std::fs::metadata(target) else {
        return Cached::Absent;
    };
    if !meta.is_file() {
        return Cached::Absent;
    }
    if meta.len() == 0 {
        let age = meta.modified().ok().and_then(|m| SystemTime::now().duration_since(m).ok());
        if still_missing(age.unwrap_or_default(), cache_miss_s(cache)) {
            return Cached::Missing;
        }
        let _ = std::fs::remove_file(target);
        return Cached::Absent;
    }
    match Input::open(target) {
        Ok(input) if matches(&input.map) => Cached::Found(input),
        Ok(_) => {
            warn(&format!("debuginfod cache {}: not the debug file of build-id {hex}; ignored", target.display()));
            Cached::Absent
        }
        Err(e) => {
            warn(&format!("debuginfod cache {e:#}; ignored"));
            Cached::Absent
        }
    }
}

/// How long "not found" entries hold: the number in `<cache>/cache_miss_s`,
/// else elfutils' default.
fn cache_miss_s(cache: &Path) -> i64 {
    std::fs::read_to_string(cache.join("cache_miss_s"))
        .ok()
        .and_then(|s| leading_integer(&s))
        .unwrap_or(DEFAULT_CACHE_MISS_S)
}

/// Whether a "not found" entry written `age` ago still holds.
pub fn still_missing(age: Duration, cache_miss_s: i64) -> bool {
    i64::try_from(age.as_secs()).unwrap_or(i64::MAX) <= cache_miss_s
}

/// The servers of `DEBUGINFOD_URLS`: separated by spaces, each once.
pub fn servers(urls: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for url in urls.split_ascii_whitespace() {
        if !out.iter().any(|u| request_url(u, "") == request_url(url, "")) {
            out.push(url.to_string());
        }
    }
    out
}

/// `DEBUGINFOD_TIMEOUT` read as elfutils reads it: whole seconds, 0 or
/// less for no timeout. `None` when it is not a number.
pub fn timeout(value: &str) -> Option<Option<Duration>> {
    let secs = leading_integer(value)?;
    Some((secs > 0).then(|| Duration::from_secs(secs as u64)))
}

/// The integer a text starts with (after blanks), as C's `strtol` reads it.
fn leading_integer(s: &str) -> Option<i64> {
    let s = s.trim_start();
    let sign = usize::from(s.starts_with(['-', '+']));
    let digits = s[sign..].bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return None;
    }
    Some(s[..sign + digits].parse().unwrap_or(if s.starts_with('-') { i64::MIN } else { i64::MAX }))
}

/// The client cache directory, as elfutils chooses it:
/// `$DEBUGINFOD_CACHE_PATH`; else `$HOME/.debuginfod_client_cache` if it
/// exists (the old default); else `$XDG_CACHE_HOME/debuginfod_client`;
/// else `$HOME/.cache/debuginfod_client`.
pub fn cache_dir(var: impl Fn(&str) -> Option<OsString>, exists: impl Fn(&Path) -> bool) -> PathBuf {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = set("DEBUGINFOD_CACHE_PATH") {
        return p;
    }
    let home = set("HOME").unwrap_or_else(|| PathBuf::from("/"));
    let old = home.join(".debuginfod_client_cache");
    if exists(&old) {
        return old;
    }
    set("XDG_CACHE_HOME").unwrap_or_else(|| home.join(".cache")).join("debuginfod_client")
}

/// Lowercase hexadecimal.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The URL of a build-id's debug file on `server` (one trailing slash of
/// the server's URL is dropped, as elfutils does).
pub fn request_url(server: &str, hex: &str) -> String {
    let base = server.strip_suffix('/').unwrap_or(server);
    format!("{base}/buildid/{hex}/{DEBUGINFO}")
}

/// Whether an I/O error means the server could not be reached.
fn is_refusal(kind: io::ErrorKind) -> bool {
    use io::ErrorKind as K;
    matches!(kind, K::ConnectionRefused | K::HostUnreachable | K::NetworkUnreachable | K::AddrNotAvailable)
}

fn is_http(url: &str) -> bool {
    let lower = url.to_ascii_lowercase();
    lower.starts_with("http://") || lower.starts_with("https://")
}

/// Creates the cache directory and a build-id's directory in it (mode
/// 0700, as elfutils does for the latter).
fn make_dirs(cache: &Path, dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(cache)?;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        r => r,
    }
}

/// A download under a temporary name in its final directory; removed
/// unless renamed into place.
struct Temp {
    path: PathBuf,
    file: std::fs::File,
    kept: bool,
}

impl Temp {
    fn create(dir: &Path) -> io::Result<Temp> {
        let mut n = 0u32;
        loop {
            let path = dir.join(format!("{DEBUGINFO}.alloctramp-{}-{n}", std::process::id()));
            let opened = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path);
            match opened {
                Ok(file) => return Ok(Temp { path, file, kept: false }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && n < 100 => n += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// Renames the file to `target`, read-only (elfutils keeps cache files
    /// at mode 0400).
    fn keep(mut self, target: &Path) -> io::Result<()> {
        self.file.set_permissions(std::fs::Permissions::from_mode(0o400))?;
        std::fs::rename(&self.path, target)?;
        self.kept = true;
        Ok(())
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// `alloctramp: warning: <what>` on stderr.
fn warn(what: &dyn fmt::Display) {
    eprintln!("alloctramp: warning: {what}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
        move |name| map.get(name).cloned()
    }

    fn config(pairs: &[(&str, &str)]) -> (Option<Config>, Vec<String>) {
        let mut warnings = Vec::new();
        let c = Config::from_vars(vars(pairs), |_| false, &mut |w| warnings.push(w));
        (c, warnings)
    }

    #[test]
    fn no_servers_no_debuginfod() {
        assert_eq!(config(&[]).0, None);
        assert_eq!(config(&[("DEBUGINFOD_URLS", "")]).0, None);
        assert_eq!(config(&[("DEBUGINFOD_URLS", "   ")]).0, None);
    }

    #[test]
    fn servers_in_order_each_once() {
        assert_eq!(
            servers(" http://a:8002  https://b/ http://a:8002/ http://c"),
            ["http://a:8002", "https://b/", "http://c"]
        );
    }

    #[test]
    fn request_urls_as_elfutils_builds_them() {
        assert_eq!(request_url("http://a:8002", "ab12"), "http://a:8002/buildid/ab12/debuginfo");
        assert_eq!(request_url("https://d.example/", "ab12"), "https://d.example/buildid/ab12/debuginfo");
        assert_eq!(request_url("http://a/srv", "ab12"), "http://a/srv/buildid/ab12/debuginfo");
        assert_eq!(hex(&[0x0a, 0xbc, 0xff]), "0abcff");
    }

    #[test]
    fn timeouts_in_whole_seconds_zero_for_none() {
        let secs = |s: &str| config(&[("DEBUGINFOD_URLS", "http://a"), ("DEBUGINFOD_TIMEOUT", s)]);
        assert_eq!(config(&[("DEBUGINFOD_URLS", "http://a")]).0.unwrap().timeout, Some(Duration::from_secs(90)));
        assert_eq!(secs("2").0.unwrap().timeout, Some(Duration::from_secs(2)));
        assert_eq!(secs(" 30s").0.unwrap().timeout, Some(Duration::from_secs(30)));
        assert_eq!(secs("0").0.unwrap().timeout, None);
        assert_eq!(secs("-5").0.unwrap().timeout, None);
        let (c, warnings) = secs("soon");
        assert_eq!(c.unwrap().timeout, Some(Duration::from_secs(90)));
        assert_eq!(warnings, ["DEBUGINFOD_TIMEOUT=soon: not a whole number of seconds; waiting 90 s"]);
    }

    #[test]
    fn the_cache_directory_as_elfutils_chooses_it() {
        let dir = |pairs: &[(&str, &str)], old: bool| cache_dir(vars(pairs), |_| old);
        let all = [("DEBUGINFOD_CACHE_PATH", "/c"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(dir(&all, true), Path::new("/c"));
        assert_eq!(dir(&all[1..], true), Path::new("/h/.debuginfod_client_cache"));
        assert_eq!(dir(&all[1..], false), Path::new("/x/debuginfod_client"));
        assert_eq!(
            dir(&[("DEBUGINFOD_CACHE_PATH", ""), ("XDG_CACHE_HOME", ""), ("HOME", "/h")], false),
            Path::new("/h/.cache/debuginfod_client")
        );
        assert_eq!(dir(&[], false), Path::new("/.cache/debuginfod_client"));
    }

    #[test]
    fn not_found_entries_hold_for_cache_miss_s() {
        assert!(still_missing(Duration::from_secs(0), 600));
        assert!(still_missing(Duration::from_secs(600), 600));
        assert!(!still_missing(Duration::from_secs(601), 600));
        assert!(!still_missing(Duration::from_secs(1), 0));
        assert_eq!(leading_integer(" 60\n"), Some(60));
        assert_eq!(leading_integer("x"), None);
    }

    /// An expired "not found" entry is removed, a fresh one holds; a cached
    /// file that is not the debug file is not used.
    #[test]
    fn cache_entries() {
        let cache = std::env::temp_dir().join(format!("alloctramp-debuginfod-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let target = cache.join("ab").join(DEBUGINFO);
        make_dirs(&cache, target.parent().unwrap()).unwrap();
        std::fs::write(&target, b"").unwrap();
        assert!(matches!(cached(&cache, &target, "ab", &|_| true), Cached::Missing));
        std::fs::write(cache.join("cache_miss_s"), "0").unwrap();
        let old = SystemTime::now() - Duration::from_secs(5);
        std::fs::File::options().write(true).open(&target).unwrap().set_modified(old).unwrap();
        assert!(matches!(cached(&cache, &target, "ab", &|_| true), Cached::Absent));
        assert!(!target.exists(), "an expired entry is removed");
        std::fs::write(&target, b"\x7fELF...").unwrap();
        assert!(matches!(cached(&cache, &target, "ab", &|_| true), Cached::Found(_)));
        assert!(matches!(cached(&cache, &target, "ab", &|_| false), Cached::Absent));
        std::fs::remove_dir_all(&cache).unwrap();
    }
}
