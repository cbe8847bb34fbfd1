//! The latency probes against real memcached, redis and nginx servers started on loopback
//! on free ports. A test whose server binary is absent skips through `cohabit_testkit`'s gate
//! (Debian: `apt-get install memcached redis-server nginx-light`; `.ci/run` installs them
//! and declares them, so there a missing one fails).

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cohabit_collectors::probe::{Probe, ProbeSettings, ProbeUrl};

/// A server in its own process group, all of which is killed when dropped (nginx's
/// workers outlive a killed master otherwise).
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let group = format!("-{}", self.0.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts a server and waits until it answers `hello` with a reply starting `expect` on a
/// fresh connection: a listening socket alone is not readiness (a server may accept before
/// it serves, and a connect to a free ephemeral port on loopback can even reach itself).
/// A server that exits while starting fails the test with its own words.
fn start(program: &Path, args: &[String], port: u16, hello: &[u8], expect: &[u8]) -> Server {
    let log = tempfile::NamedTempFile::new().unwrap();
    let child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
    let mut server = Server(child);
    let t = Instant::now();
    loop {
        if answers(port, hello, expect) {
            return server;
        }
        if let Ok(Some(status)) = server.0.try_wait() {
            let said = std::fs::read_to_string(log.path()).unwrap_or_default();
            panic!(
                "{} exited while starting ({status}): {said}",
                program.display()
            );
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} did not answer on {port} within 10 s",
            program.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One request on a fresh connection; true when the reply starts with `expect`.
fn answers(port: u16, hello: &[u8], expect: &[u8]) -> bool {
    use std::io::{Read, Write};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(hello).is_err() {
        return false;
    }
    let mut got = Vec::new();
    let mut chunk = [0u8; 256];
    while got.len() < expect.len() {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return false,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
    got.starts_with(expect)
}

/// Probes for about half a second and checks that requests were answered quickly.
fn probe_answers(url: &str) {
    let u: ProbeUrl = url.parse().unwrap();
    let settings = ProbeSettings {
        rate_hz: 200,
        timeout: Duration::from_secs(1),
    };
    let mut p = Probe::start(&u, &settings).unwrap_or_else(|e| panic!("{e}"));
    p.first_answer().unwrap_or_else(|e| panic!("{e}"));
    let _ = p.take();
    std::thread::sleep(Duration::from_millis(500));
    let w = p.take();
    assert!(w.count >= 50, "{url}: {w:?}");
    assert_eq!(w.timeouts + w.errors, 0, "{url}: {w:?}");
    let p99 = w.p99_ms.unwrap();
    assert!(p99 > 0.0 && p99 < 1000.0, "{url}: {w:?}");
    assert!(w.cpu_s > 0.0 && w.cpu_s < 0.5, "{url}: {w:?}");
}

#[test]
fn memcached_answers_gets_of_the_probe_key() {
    let Some(bin) = cohabit_testkit::program("memcached", &["memcached"], "memcached") else {
        return;
    };
    let port = free_port();
    let mut args: Vec<String> = [
        "-l",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-U",
        "0",
        "-t",
        "1",
    ]
    .map(String::from)
    .to_vec();
    if cohabit_testkit::is_root() {
        args.extend(["-u".to_string(), "nobody".to_string()]);
    }
    let server = start(&bin, &args, port, b"version\r\n", b"VERSION ");
    probe_answers(&format!("memcached://127.0.0.1:{port}"));
    drop(server);
    // The server is gone: a new probe starts all the same; its first request fails,
    // naming the URL, and its windows count errors.
    let u: ProbeUrl = format!("memcached://127.0.0.1:{port}").parse().unwrap();
    let mut p = Probe::start(
        &u,
        &ProbeSettings {
            rate_hz: 10,
            timeout: Duration::from_millis(200),
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let e = p.first_answer().unwrap_err().to_string();
    assert!(e.contains(&format!("memcached://127.0.0.1:{port}")), "{e}");
    std::thread::sleep(Duration::from_millis(300));
    let w = p.take();
    assert!(w.errors >= 1 && w.last_error.is_some(), "{w:?}");
}

#[test]
fn redis_answers_pings() {
    let Some(bin) = cohabit_testkit::program("redis-server", &["redis-server"], "redis-server")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let args: Vec<String> = [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--dir",
        dir.path().to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let _server = start(&bin, &args, port, b"PING\r\n", b"+PONG");
    probe_answers(&format!("redis://127.0.0.1:{port}"));
}

#[test]
fn nginx_answers_gets_on_a_keep_alive_connection() {
    let Some(bin) = cohabit_testkit::program("nginx", &["nginx"], "nginx-light") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("index.html"), "x".repeat(4096)).unwrap();
    let port = free_port();
    let user = if cohabit_testkit::is_root() {
        "user root;\n"
    } else {
        ""
    };
    let conf = format!(
        "{user}daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
         events {{ worker_connections 64; }}\n\
         http {{\n access_log off;\n client_body_temp_path {d}/body;\n proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\n uwsgi_temp_path {d}/uwsgi;\n scgi_temp_path {d}/scgi;\n\
         server {{ listen 127.0.0.1:{port}; root {d}; location / {{ }} }}\n}}\n",
        d = d.display()
    );
    std::fs::write(d.join("nginx.conf"), conf).unwrap();
    let args: Vec<String> = [
        "-p",
        d.to_str().unwrap(),
        "-e",
        d.join("error.log").to_str().unwrap(),
        "-c",
        d.join("nginx.conf").to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let _server = start(
        &bin,
        &args,
        port,
        b"HEAD /index.html HTTP/1.0\r\n\r\n",
        b"HTTP/1.1 200",
    );
    probe_answers(&format!("http://127.0.0.1:{port}/index.html"));
    // A missing page is an answer too (a 404 is the service working).
    probe_answers(&format!("http://localhost:{port}/missing"));
}
