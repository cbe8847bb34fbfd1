//! The latency-critical services: memcached, nginx and redis from Debian, each started on
//! loopback on a free port with its own configuration in the run directory.
//!
//! Each is started through a symbolic link with a name of its own (`rb-memcached`,
//! `rb-nginx`, `rb-redis`): the kernel names a process after the path it was started by,
//! so cohabit's `process_name` matcher finds exactly the benchmark's processes (and
//! nginx's workers, which keep the name), never a system instance; its `user` is the one
//! each runs as ([`Kind::runs_as`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::client::{self, Proto};
use crate::procs::{Lab, ProcId};
use crate::tools::{self, Tool};
use crate::Error;

/// A kind of latency-critical service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// memcached (text protocol).
    Memcached,
    /// nginx serving a 4 KiB static file.
    Nginx,
    /// redis.
    Redis,
}

impl std::str::FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "memcached" => Ok(Kind::Memcached),
            "nginx" => Ok(Kind::Nginx),
            "redis" => Ok(Kind::Redis),
            _ => Err(format!("unknown service {s:?}: memcached, nginx or redis")),
        }
    }
}

/// Size of the page nginx serves.
const PAGE_BYTES: usize = 4096;

/// The user memcached becomes when the benchmark runs as root (it refuses to run as root).
const MEMCACHED_USER_AS_ROOT: &str = "nobody";

/// Who a process the benchmark starts runs as: cohabit's `match.user` for it (cohabit
/// refuses a name matcher without one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunAs {
    /// A user by name (memcached started as root becomes `nobody`).
    Name(&'static str),
    /// A uid.
    Uid(u32),
}

impl RunAs {
    /// The benchmark's own user (its children keep it).
    pub fn benchmark() -> Self {
        RunAs::Uid(crate::sys::euid())
    }

    /// As a TOML value: a quoted name or a number.
    pub fn toml(self) -> String {
        match self {
            RunAs::Name(n) => format!("\"{n}\""),
            RunAs::Uid(u) => u.to_string(),
        }
    }
}

impl Kind {
    /// Its name in results and in cohabit's configuration.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Memcached => "memcached",
            Kind::Nginx => "nginx",
            Kind::Redis => "redis",
        }
    }

    /// The program and its package.
    pub fn tool(self) -> Tool {
        match self {
            Kind::Memcached => tools::MEMCACHED,
            Kind::Nginx => tools::NGINX,
            Kind::Redis => tools::REDIS,
        }
    }

    /// The process name it runs under (see the module documentation).
    pub fn comm(self) -> &'static str {
        match self {
            Kind::Memcached => "rb-memcached",
            Kind::Nginx => "rb-nginx",
            Kind::Redis => "rb-redis",
        }
    }

    /// The user its processes run as: memcached started as root becomes
    /// [`MEMCACHED_USER_AS_ROOT`]; the others (nginx's workers too, `user root;` as root)
    /// keep the benchmark's.
    pub fn runs_as(self) -> RunAs {
        match self {
            Kind::Memcached if crate::sys::is_root() => RunAs::Name(MEMCACHED_USER_AS_ROOT),
            _ => RunAs::benchmark(),
        }
    }

    /// The protocol the client speaks to it.
    pub fn proto(self) -> Proto {
        match self {
            Kind::Memcached => Proto::Memcached,
            Kind::Redis => Proto::Redis,
            Kind::Nginx => Proto::Http {
                path: "/index.html".into(),
            },
        }
    }

    /// The URL of cohabit's probe for it.
    pub fn probe_url(self, port: u16) -> String {
        match self {
            Kind::Memcached => format!("memcached://127.0.0.1:{port}"),
            Kind::Redis => format!("redis://127.0.0.1:{port}"),
            Kind::Nginx => format!("http://127.0.0.1:{port}/index.html"),
        }
    }

    fn args(self, dir: &Path, port: u16) -> Result<Vec<String>, Error> {
        let p = port.to_string();
        let d = dir.display().to_string();
        Ok(match self {
            Kind::Memcached => {
                let mut a: Vec<String> = ["-l", "127.0.0.1", "-p", &p, "-U", "0", "-m", "64"]
                    .map(String::from)
                    .to_vec();
                if crate::sys::is_root() {
                    // memcached refuses to run as root without naming a user to become.
                    a.extend(["-u".into(), MEMCACHED_USER_AS_ROOT.into()]);
                }
                a
            }
            Kind::Redis => [
                "--port",
                &p,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--dir",
                &d,
            ]
            .map(String::from)
            .to_vec(),
            Kind::Nginx => {
                std::fs::write(dir.join("index.html"), "x".repeat(PAGE_BYTES))
                    .map_err(crate::io_err("writing", &dir.join("index.html")))?;
                let conf = dir.join("nginx.conf");
                std::fs::write(&conf, nginx_conf(dir, port))
                    .map_err(crate::io_err("writing", &conf))?;
                [
                    "-p",
                    &d,
                    "-e",
                    &format!("{d}/error.log"),
                    "-c",
                    &conf.display().to_string(),
                ]
                .map(String::from)
                .to_vec()
            }
        })
    }
}

/// nginx with keep-alive connections that last the whole run (its default closes one after
/// 1000 requests, which a pipelining client sees as failures).
fn nginx_conf(dir: &Path, port: u16) -> String {
    let d = dir.display();
    let user = if crate::sys::is_root() {
        "user root;\n"
    } else {
        ""
    };
    format!(
        "{user}daemon off;
worker_processes auto;
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    keepalive_requests 100000000;
    keepalive_timeout 600s;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {d};
        location / {{ }}
    }}
}}
"
    )
}

/// A free loopback TCP port (the kernel's choice; released just before the service binds
/// it).
pub fn free_port() -> Result<u16, Error> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Error::Host(format!("a free loopback port ({e})")))
}

/// A service started by the benchmark.
#[derive(Debug, Clone)]
pub struct Running {
    /// Which.
    pub kind: Kind,
    /// Its address.
    pub addr: SocketAddr,
    /// Its process (group leader).
    pub proc: ProcId,
    /// The cgroup it started in.
    pub group: String,
}

/// Starts `kind` in cgroup `svc-<name>` with its files in `dir`, and waits until it answers.
pub fn start(lab: &mut Lab, kind: Kind, program: &Path, dir: &Path) -> Result<Running, Error> {
    std::fs::create_dir_all(dir).map_err(crate::io_err("creating", dir))?;
    let link: PathBuf = dir.join(kind.comm());
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(program, &link).map_err(crate::io_err("linking", &link))?;
    let port = free_port()?;
    let args = kind.args(dir, port)?;
    let group = format!("svc-{}", kind.name());
    let log = dir.join(format!("{}.log", kind.name()));
    let proc = lab.spawn(kind.name(), &group, &link, &args, &[], &log)?;
    let addr: SocketAddr = SocketAddr::from(([127, 0, 0, 1], port));
    let t = Instant::now();
    loop {
        crate::interrupt::check()?;
        match client::check(&kind.proto(), &addr, Duration::from_millis(500)) {
            Ok(()) => break,
            Err(e) if t.elapsed() > Duration::from_secs(10) => {
                return Err(Error::Start {
                    what: kind.name().into(),
                    detail: format!(
                        "did not answer on {addr} within 10 s ({e}); its log says:\n{}",
                        lab.get(proc).log_tail(10)
                    ),
                })
            }
            Err(_) => {
                if !lab.get(proc).running() {
                    return Err(Error::Start {
                        what: kind.name().into(),
                        detail: format!(
                            "exited at start; its log says:\n{}",
                            lab.get(proc).log_tail(10)
                        ),
                    });
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    Ok(Running {
        kind,
        addr,
        proc,
        group,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_urls() {
        assert_eq!("nginx".parse::<Kind>().unwrap(), Kind::Nginx);
        assert!("apache".parse::<Kind>().is_err());
        assert_eq!(
            Kind::Nginx.probe_url(8080),
            "http://127.0.0.1:8080/index.html"
        );
        for k in [Kind::Memcached, Kind::Nginx, Kind::Redis] {
            assert!(k.comm().len() <= 15, "comm is 15 characters at most");
        }
        let conf = nginx_conf(Path::new("/tmp/x"), 1234);
        assert!(conf.contains("listen 127.0.0.1:1234;"));
    }

    #[test]
    fn nginx_keeps_one_connection_open_for_every_request_of_the_longest_full_run() {
        let conf = nginx_conf(Path::new("/tmp/x"), 1234);
        let limit = conf
            .lines()
            .find_map(|l| l.trim().strip_prefix("keepalive_requests "))
            .and_then(|v| v.strip_suffix(';'))
            .and_then(|v| v.parse::<u32>().ok())
            .expect("the configuration sets keepalive_requests to a number");
        let full = crate::bench::Options::full("/tmp/x".into());
        let nginx = full
            .services
            .iter()
            .find(|s| s.kind == Kind::Nginx)
            .expect("the full benchmark loads nginx");
        // The client sends from the start of the warm-up to the end of the run (an explore
        // run lasts `explore_s`); a single connection may carry all of it.
        let seconds = full.warmup_s + full.duration_s.max(full.explore_s);
        let sent = nginx.rate_rps * f64::from(seconds);
        assert!(
            f64::from(limit) >= sent,
            "keepalive_requests {limit} would close a connection before the {sent} requests of a run"
        );
    }
}
