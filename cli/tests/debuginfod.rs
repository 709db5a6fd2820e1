//! Names for stripped programs from debuginfod servers: a real `debuginfod`
//! serving a split-off debug file, the elfutils client cache (found, kept,
//! "not found" entries and their expiry), a server that never answers, and
//! https with answers that are not the debug file.

use crate::util::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A program of testbins/ built with `-g`, its debug file split off.
struct Split {
    /// Without DWARF (`strip -g`), with its build-id.
    stripped: PathBuf,
    /// `objcopy --only-keep-debug` of the full build.
    debug: PathBuf,
    /// The build-id in lowercase hex.
    id: String,
}

fn sh(cmd: &str) {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(out.status.success(), "{cmd}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Builds testbins/basic.c into `dir` as NAME (with `ld_flags`), and
/// splits its debug file off into `dir/NAME.debug`.
fn split(dir: &Path, name: &str, ld_flags: &str) -> Split {
    let src = program("basic").src.clone();
    let full = dir.join(format!("{name}.full"));
    let stripped = dir.join(name);
    let debug = dir.join(format!("{name}.debug"));
    sh(&format!("gcc -g -O0 -Wall -Werror {ld_flags} {} -o {}", src.display(), full.display()));
    sh(&format!("objcopy --only-keep-debug {} {}", full.display(), debug.display()));
    sh(&format!("strip -g -o {} {}", stripped.display(), full.display()));
    let notes = Command::new("readelf").arg("-n").arg(&stripped).output().unwrap();
    let id = String::from_utf8(notes.stdout)
        .unwrap()
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: ").map(str::to_string))
        .expect("the stripped file keeps its build-id");
    Split { stripped, debug, id }
}

/// `alloctramp sites --json FILE` with `env` (and no proxy); the document,
/// stderr and how long it took.
fn sites_with(file: &Path, env: &[(&str, &str)]) -> (Value, String, Duration) {
    let start = Instant::now();
    let out = run_with(&["sites".as_ref(), "--json".as_ref(), file.as_os_str()], env);
    let took = start.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "alloctramp sites {}: {stderr}", file.display());
    (serde_json::from_slice(&out.stdout).unwrap(), stderr, took)
}

fn run_with(args: &[&std::ffi::OsStr], env: &[(&str, &str)]) -> Output {
    let mut cmd = alloctramp();
    for proxy in ["ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"] {
        cmd.env_remove(proxy);
    }
    cmd.args(args).envs(env.iter().copied()).output().unwrap()
}

/// (source file, line, entry) of every site, in address order.
fn locations(doc: &Value) -> Vec<(String, u64, String)> {
    doc["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["file"].as_str().unwrap_or("").to_string(),
                s["line"].as_u64().unwrap_or(0),
                s["entry"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The sites the markers of testbins/basic.c give, sorted.
fn marked() -> Vec<(String, u64, String)> {
    let p = program("basic");
    let mut v: Vec<_> =
        p.markers.iter().map(|m| (p.src.display().to_string(), m.line as u64, m.entry.clone())).collect();
    v.sort();
    v
}

fn sorted(mut v: Vec<(String, u64, String)>) -> Vec<(String, u64, String)> {
    v.sort();
    v
}

/// A loopback port nothing listens on (at the time of asking).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The HTTP status of `GET path` on the loopback port, if anything answers.
fn status_of(port: u16, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// A server process, killed when the test ends however it ends.
struct Server(Child);

impl Server {
    fn stop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts `debuginfod` serving the ELF files under `dir` on `port` (every
/// interface; the tests ask it on loopback), with its database in `db`,
/// and waits until it serves the debug file of `id`.
fn start_debuginfod(dir: &Path, db: &Path, port: u16, id: &str, log: &Path) -> Server {
    let log_file = std::fs::File::create(log).unwrap();
    let child = Command::new("debuginfod")
        .args(["-F", "-p", &port.to_string(), "-d"])
        .arg(db)
        .args(["-t", "0", "-g", "0", "-c", "1"])
        .arg(dir)
        // Not a federating server: it answers from its own files only.
        .env_remove("DEBUGINFOD_URLS")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .expect("start debuginfod");
    let mut server = Server(child);
    let path = format!("/buildid/{id}/debuginfo");
    let deadline = Instant::now() + Duration::from_secs(60);
    while status_of(port, &path) != Some(200) {
        if let Ok(Some(status)) = server.0.try_wait() {
            panic!("debuginfod exited ({status}): {}", std::fs::read_to_string(log).unwrap_or_default());
        }
        assert!(
            Instant::now() < deadline,
            "debuginfod did not serve {path} within 60 s: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    server
}

/// A real debuginfod server names the sites of a stripped program (`sites`
/// and `patch`); the file is kept in the elfutils cache layout, read-only,
/// and names them again once the server is gone. A build-id the server
/// does not have leaves a "not found" entry that keeps alloctramp from
/// asking again until it expires.
#[test]
fn a_debuginfod_server_names_a_stripped_program_then_the_cache_does() {
    if !have("debuginfod") {
        skip(test_name(), "debuginfod is not installed (Debian package debuginfod)");
        return;
    }
    let dir = scratch("debuginfod-server");
    let served = dir.join("served");
    std::fs::create_dir(&served).unwrap();
    let known = split(&dir, "basic", "");
    std::fs::rename(&known.debug, served.join("basic.debug")).unwrap();
    let unknown = split(&dir, "other", "-Wl,--build-id=0x0123456789abcdef0123456789abcdef01234567");
    let cache = dir.join("cache");
    let cache_s = cache.to_str().unwrap();

    // Without servers: no names.
    let (plain, _, _) = sites_with(&known.stripped, &[("DEBUGINFOD_CACHE_PATH", cache_s)]);
    assert_eq!(plain["debug_info"], "");
    assert!(locations(&plain).iter().all(|(f, l, _)| f.is_empty() && *l == 0));
    assert!(!cache.exists(), "no server, no cache");

    let port = free_port();
    let mut server = start_debuginfod(&served, &dir.join("db.sqlite"), port, &known.id, &dir.join("debuginfod.log"));
    let url = format!("http://127.0.0.1:{port}");
    let env = [("DEBUGINFOD_URLS", url.as_str()), ("DEBUGINFOD_CACHE_PATH", cache_s)];

    let cached = cache.join(&known.id).join("debuginfo");
    let (doc, stderr, _) = sites_with(&known.stripped, &env);
    assert_eq!(stderr, "");
    assert_eq!(doc["debug_info"], cached.to_str().unwrap());
    assert_eq!(sorted(locations(&doc)), marked(), "every site named exactly as its marker");
    let meta = std::fs::metadata(&cached).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o400, "cache files are read-only, as elfutils keeps them");
    assert_eq!(std::fs::read(&cached).unwrap(), std::fs::read(served.join("basic.debug")).unwrap());
    let leftovers: Vec<_> =
        std::fs::read_dir(cached.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers, ["debuginfo"], "no temporary file is left");

    // Not on the server: an empty "not found" entry, no warning.
    let missing = cache.join(&unknown.id).join("debuginfo");
    let (doc, stderr, _) = sites_with(&unknown.stripped, &env);
    assert_eq!(stderr, "");
    assert_eq!(doc["debug_info"], "");
    assert_eq!(std::fs::metadata(&missing).unwrap().len(), 0);

    server.stop();

    // From the cache alone: named, and nothing is asked of the server.
    let (doc, stderr, _) = sites_with(&known.stripped, &env);
    assert_eq!(stderr, "");
    assert_eq!(doc["debug_info"], cached.to_str().unwrap());
    assert_eq!(sorted(locations(&doc)), marked());

    // `patch` finds it the same way: the site table holds the source path.
    let patched = dir.join("basic.patched");
    let args = ["patch".as_ref(), known.stripped.as_os_str(), "-o".as_ref(), patched.as_os_str()];
    let out = run_with(&args, &env);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let src = program("basic").src.display().to_string();
    let bytes = std::fs::read(&patched).unwrap();
    assert!(bytes.windows(src.len()).any(|w| w == src.as_bytes()), "the patched file names {src}");

    // The "not found" entry holds: the server, gone, is not asked.
    let (_, stderr, _) = sites_with(&unknown.stripped, &env);
    assert_eq!(stderr, "");
    // Once it is older than cache_miss_s, it is asked again.
    std::fs::write(cache.join("cache_miss_s"), "0").unwrap();
    let old = std::time::SystemTime::now() - Duration::from_secs(5);
    std::fs::File::options().write(true).open(&missing).unwrap().set_modified(old).unwrap();
    let (doc, stderr, _) = sites_with(&unknown.stripped, &env);
    assert_eq!(doc["debug_info"], "");
    assert!(stderr.starts_with(&format!("alloctramp: warning: debuginfod {url}: ")), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(!missing.exists(), "an expired entry is removed; a failure is not \"not found\"");
}

/// A server that accepts connections and never answers: with
/// DEBUGINFOD_TIMEOUT=2, `sites` gives up after 2 seconds with one warning
/// and lists the sites without names. Nothing is cached.
#[test]
fn a_silent_server_is_given_up_after_the_timeout() {
    let dir = scratch("debuginfod-silent");
    let file = split(&dir, "basic", "");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Holds every connection open, unanswered, until the test binary ends.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            held.push(conn);
        }
    });
    let url = format!("http://127.0.0.1:{port}");
    let cache = dir.join("cache");
    let env = [
        ("DEBUGINFOD_URLS", url.as_str()),
        ("DEBUGINFOD_CACHE_PATH", cache.to_str().unwrap()),
        ("DEBUGINFOD_TIMEOUT", "2"),
    ];
    let (doc, stderr, took) = sites_with(&file.stripped, &env);
    assert!(took < Duration::from_secs(8), "sites took {took:?}");
    assert!(took >= Duration::from_secs(2), "sites took {took:?}: did it wait?");
    assert_eq!(stderr, format!("alloctramp: warning: debuginfod {url}: no answer within 2 s\n"));
    assert_eq!(doc["debug_info"], "");
    let sites = locations(&doc);
    assert_eq!(sites.len(), marked().len());
    assert!(sites.iter().all(|(f, l, _)| f.is_empty() && *l == 0), "no names: {sites:?}");
    assert!(!cache.join(&file.id).join("debuginfo").exists(), "a timeout is not \"not found\"");
}

/// Over https (a test CA in SSL_CERT_FILE, `openssl s_server -WWW` serving
/// a directory): the right file names the sites; an answer that is another
/// build's debug file, or not an ELF file, is a warning and is not cached;
/// a certificate from an unknown authority is a warning.
#[test]
fn https_and_answers_that_are_not_the_debug_file() {
    if !have("openssl") {
        skip(test_name(), "openssl is not installed");
        return;
    }
    let dir = scratch("debuginfod-https");
    let right = split(&dir, "basic", "");
    let wrong = split(&dir, "wrong", "-Wl,--build-id=0x00112233445566778899aabbccddeeff00112233");
    let text = split(&dir, "text", "-Wl,--build-id=0xffeeddccbbaa99887766554433221100ffeeddcc");
    let www = dir.join("www");
    let serve = |id: &str, from: &Path| {
        let d = www.join("buildid").join(id);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::copy(from, d.join("debuginfo")).unwrap();
    };
    serve(&right.id, &right.debug);
    serve(&wrong.id, &right.debug);
    let note = dir.join("note.txt");
    std::fs::write(&note, "not a debug file\n").unwrap();
    serve(&text.id, &note);

    let d = dir.display();
    sh(&format!(
        "cd {d} && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 \
         -subj '/CN=alloctramp test CA' -addext basicConstraints=critical,CA:TRUE \
         -addext keyUsage=critical,keyCertSign 2>/dev/null \
         && openssl req -newkey rsa:2048 -nodes -keyout srv.key -out srv.csr -subj /CN=127.0.0.1 2>/dev/null \
         && printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' >ext \
         && openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out srv.pem -days 2 \
         -extfile ext 2>/dev/null"
    ));
    let port = free_port();
    let child = Command::new("openssl")
        .args(["s_server", "-quiet", "-WWW", "-accept", &format!("127.0.0.1:{port}")])
        .arg("-cert")
        .arg(dir.join("srv.pem"))
        .arg("-key")
        .arg(dir.join("srv.key"))
        .current_dir(&www)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "openssl s_server did not listen");
        std::thread::sleep(Duration::from_millis(100));
    }

    let url = format!("https://127.0.0.1:{port}");
    let cache = dir.join("cache");
    let ca = dir.join("ca.pem");
    let env = [
        ("DEBUGINFOD_URLS", url.as_str()),
        ("DEBUGINFOD_CACHE_PATH", cache.to_str().unwrap()),
        ("SSL_CERT_FILE", ca.to_str().unwrap()),
        ("SSL_CERT_DIR", "/nonexistent"),
    ];
    let (doc, stderr, _) = sites_with(&right.stripped, &env);
    assert_eq!(stderr, "");
    assert_eq!(sorted(locations(&doc)), marked());
    assert!(cache.join(&right.id).join("debuginfo").exists());

    let request = |id: &str| format!("{url}/buildid/{id}/debuginfo");
    let (doc, stderr, _) = sites_with(&wrong.stripped, &env);
    assert_eq!(
        stderr,
        format!(
            "alloctramp: warning: debuginfod {url}: {}: the answer is not the debug file of build-id {}\n",
            request(&wrong.id),
            wrong.id
        )
    );
    assert_eq!(doc["debug_info"], "");
    assert!(!cache.join(&wrong.id).exists(), "a wrong answer is not cached");

    let (_, stderr, _) = sites_with(&text.stripped, &env);
    assert_eq!(
        stderr,
        format!("alloctramp: warning: debuginfod {url}: {}: the answer is not an ELF file\n", request(&text.id))
    );
    assert!(!cache.join(&text.id).exists(), "a wrong answer is not cached");

    // A server whose certificate no trusted authority signed.
    let cache2 = dir.join("cache2");
    let untrusted = [env[0], ("DEBUGINFOD_CACHE_PATH", cache2.to_str().unwrap()), env[3]];
    let (doc, stderr, _) = sites_with(&right.stripped, &untrusted);
    assert_eq!(doc["debug_info"], "");
    assert!(stderr.starts_with(&format!("alloctramp: warning: debuginfod {url}: ")), "{stderr}");
    assert!(stderr.contains("certificate"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}
