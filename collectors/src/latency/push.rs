//! The push socket: a loopback UDP or an authenticated Unix datagram socket on which a
//! service sends its latencies, recorded by a thread into one HDR histogram per tick.

use std::collections::{BTreeSet, HashSet};
use std::io::{self, IoSliceMut};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use nix::errno::Errno;
use nix::sys::socket::{
    recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags, UnixCredentials,
};

use super::LatencyError;

/// Where a push listener receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushAddr {
    /// A UDP address; only loopback is accepted, and no sender is authenticated.
    Udp(SocketAddr),
    /// A Unix datagram socket path; senders are authenticated ([`UnixAccess`]).
    Unix(PathBuf),
}

/// The default permission bits of a Unix push socket: owner and group may send.
pub const DEFAULT_MODE: u32 = 0o660;

/// Who may reach a Unix push socket and whose datagrams count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnixAccess {
    /// Owner of the socket file (`None`: the daemon's uid).
    pub owner: Option<u32>,
    /// Group of the socket file (`None`: the daemon's gid).
    pub group: Option<u32>,
    /// Permission bits of the socket file; sending needs write permission.
    pub mode: u32,
    /// Senders accepted whatever their pid, by uid (a sidecar, a load generator).
    pub allowed_uids: BTreeSet<u32>,
    /// Senders accepted whatever their pid, by gid.
    pub allowed_gids: BTreeSet<u32>,
}

impl Default for UnixAccess {
    fn default() -> Self {
        Self {
            owner: None,
            group: None,
            mode: DEFAULT_MODE,
            allowed_uids: BTreeSet::new(),
            allowed_gids: BTreeSet::new(),
        }
    }
}

/// Most samples one window keeps; later ones are refused as over the cap.
pub const MAX_SAMPLES_PER_WINDOW: u64 = 100_000;
/// Most datagrams read per second; later ones wait in the socket buffer.
pub const MAX_DATAGRAMS_PER_S: u32 = 20_000;
/// Receive buffer: a datagram longer than this is cut by the kernel and dropped.
const BUF_BYTES: usize = 64 * 1024;

/// Pushed latencies refused in one window, by reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PushRejections {
    /// Datagrams whose sender is neither one of the service's processes nor an allowed uid
    /// or gid (Unix sockets only).
    pub credentials: u64,
    /// Lines that were not a latency.
    pub malformed: u64,
    /// Datagrams longer than the receive buffer, dropped whole.
    pub truncated: u64,
    /// Samples beyond [`MAX_SAMPLES_PER_WINDOW`].
    pub over_cap: u64,
}

impl PushRejections {
    /// All refusals together.
    pub fn total(&self) -> u64 {
        self.credentials + self.malformed + self.truncated + self.over_cap
    }
}

impl std::ops::AddAssign for PushRejections {
    fn add_assign(&mut self, o: Self) {
        self.credentials += o.credentials;
        self.malformed += o.malformed;
        self.truncated += o.truncated;
        self.over_cap += o.over_cap;
    }
}

/// One tick of pushed latencies.
#[derive(Debug, Clone, PartialEq)]
pub struct PushWindow {
    /// p99 in milliseconds, if any sample arrived.
    pub p99_ms: Option<f64>,
    /// Samples received.
    pub count: u64,
    /// The samples themselves, in µs, sized to the slowest ([`crate::window::compact`]):
    /// what a [`crate::window::HdrWindow`] merges with other ticks'.
    pub hist: Histogram<u64>,
    /// What was refused, by reason.
    pub rejected: PushRejections,
}

/// The sender of a Unix datagram as the kernel reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sender {
    pid: u32,
    uid: u32,
    gid: u32,
}

/// Whom a listener believes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Auth {
    /// UDP: anyone who can reach the port (the configuration said so).
    Unauthenticated,
    /// Unix: the service's processes and these uids and gids.
    Credentials {
        uids: BTreeSet<u32>,
        gids: BTreeSet<u32>,
    },
}

impl Auth {
    /// Whether a datagram from `sender` (`None`: the kernel attached no credentials) is
    /// accepted while the service's processes are `pids`.
    fn admits(&self, sender: Option<Sender>, pids: &HashSet<u32>) -> bool {
        match self {
            Auth::Unauthenticated => true,
            Auth::Credentials { uids, gids } => sender.is_some_and(|s| {
                pids.contains(&s.pid) || uids.contains(&s.uid) || gids.contains(&s.gid)
            }),
        }
    }
}

#[derive(Debug)]
struct Shared {
    hist: Histogram<u64>,
    rejected: PushRejections,
    /// The service's processes, as the daemon last found them.
    pids: HashSet<u32>,
}

/// Largest latency recorded: one hour in microseconds.
const MAX_US: u64 = 3_600_000_000;

/// Records the latencies of one accepted datagram, up to the window's cap.
fn record(s: &mut Shared, datagram: &[u8]) {
    let lines = datagram
        .split(|b| *b == b'\n')
        .map(<[u8]>::trim_ascii)
        .filter(|l| !l.is_empty());
    for line in lines {
        if s.hist.len() >= MAX_SAMPLES_PER_WINDOW {
            s.rejected.over_cap += 1;
            continue;
        }
        let us = std::str::from_utf8(line)
            .ok()
            .and_then(|l| l.parse::<f64>().ok());
        match us {
            Some(us) if us.is_finite() && us >= 0.0 => {
                let v = cohabit_core::whole(us).clamp(1, MAX_US);
                if s.hist.record(v).is_err() {
                    s.rejected.malformed += 1;
                }
            }
            _ => s.rejected.malformed += 1,
        }
    }
}

/// Paces the receive loop: at most `per_s` datagrams in each one-second window.
#[derive(Debug)]
struct Pacer {
    per_s: u32,
    window_start: Instant,
    seen: u32,
}

impl Pacer {
    fn new(per_s: u32, now: Instant) -> Self {
        Self {
            per_s,
            window_start: now,
            seen: 0,
        }
    }

    /// Counts one datagram about to be read at `now`; `Some(wait)` instead when this
    /// second's budget is spent.
    fn admit(&mut self, now: Instant) -> Option<Duration> {
        let second = Duration::from_secs(1);
        if now.duration_since(self.window_start) >= second {
            self.window_start = now;
            self.seen = 0;
        }
        if self.seen >= self.per_s {
            return Some((self.window_start + second).saturating_duration_since(now));
        }
        self.seen += 1;
        None
    }
}

/// The bound socket the thread reads (shared with the listener, which shuts it down to wake
/// the thread).
#[derive(Debug)]
enum Socket {
    Udp(UdpSocket),
    Unix(UnixDatagram),
}

impl Socket {
    fn raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            Socket::Udp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        }
    }

    /// Shuts both directions down: a thread blocked receiving returns at once (Linux wakes
    /// the readers of a datagram socket shut down, connected or not), and every later
    /// receive returns at once.
    fn shut_down(&self) {
        let _ = nix::sys::socket::shutdown(self.raw_fd(), nix::sys::socket::Shutdown::Both);
    }
}

/// One datagram as received: its length, whether the kernel cut it, and its sender.
fn receive(
    sock: &Socket,
    buf: &mut [u8],
    cmsg: &mut Vec<u8>,
) -> nix::Result<(usize, bool, Option<Sender>)> {
    let mut iov = [IoSliceMut::new(buf)];
    let want_creds = matches!(sock, Socket::Unix(_));
    let msg = recvmsg::<()>(
        sock.raw_fd(),
        &mut iov,
        want_creds.then_some(cmsg.as_mut_slice()),
        MsgFlags::empty(),
    )?;
    let truncated = msg.flags.contains(MsgFlags::MSG_TRUNC);
    let sender = msg.cmsgs().ok().and_then(|mut c| {
        c.find_map(|m| match m {
            ControlMessageOwned::ScmCredentials(cred) => Some(cred),
            _ => None,
        })
    });
    let sender = sender.and_then(|c: UnixCredentials| {
        Some(Sender {
            pid: u32::try_from(c.pid()).ok()?,
            uid: c.uid(),
            gid: c.gid(),
        })
    });
    Ok((msg.bytes, truncated, sender))
}

/// The receive loop: until `stop`, one datagram at a time, paced.
fn serve(sock: &Socket, auth: &Auth, shared: &Mutex<Shared>, stop: &AtomicBool) {
    let mut buf = vec![0u8; BUF_BYTES];
    let mut cmsg = nix::cmsg_space!(UnixCredentials);
    let mut pacer = Pacer::new(MAX_DATAGRAMS_PER_S, Instant::now());
    while !stop.load(Ordering::Relaxed) {
        if let Some(wait) = pacer.admit(Instant::now()) {
            std::thread::sleep(wait.min(Duration::from_millis(100)));
            continue;
        }
        match receive(sock, &mut buf, &mut cmsg) {
            // Shut down by the listener's drop.
            Ok((0, ..)) if stop.load(Ordering::Relaxed) => break,
            Ok((n, truncated, sender)) => {
                let mut s = shared
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if !auth.admits(sender, &s.pids) {
                    s.rejected.credentials += 1;
                } else if truncated {
                    s.rejected.truncated += 1;
                } else {
                    record(&mut s, &buf[..n.min(buf.len())]);
                }
            }
            // The read time-out (so that `stop` is seen) or a signal.
            Err(Errno::EAGAIN | Errno::EINTR) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Receives latency samples (µs, one per line) pushed by a service.
#[derive(Debug)]
pub struct PushListener {
    shared: Arc<Mutex<Shared>>,
    stop: Arc<AtomicBool>,
    /// The socket the thread reads, shut down on drop to wake it.
    sock: Arc<Socket>,
    thread: Option<JoinHandle<()>>,
    /// The socket file and its identity (device, inode), for Unix sockets.
    file: Option<(PathBuf, (u64, u64))>,
    /// Where it listens (the bound port for `127.0.0.1:0`).
    pub local: PushAddr,
}

fn bind_error(addr: &PushAddr) -> impl Fn(io::Error) -> LatencyError + '_ {
    move |source| LatencyError::Bind {
        addr: match addr {
            PushAddr::Udp(a) => a.to_string(),
            PushAddr::Unix(p) => p.display().to_string(),
        },
        source,
    }
}

/// Refuses a socket directory another user could write: they could swap the socket for a
/// symbolic link between bind and chmod, and have root change the mode of any file. A
/// directory with the sticky bit (such as `/tmp`) is safe: only the owner of an entry may
/// rename or remove it.
fn check_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let meta = std::fs::metadata(dir)?;
    let me = nix::unistd::geteuid().as_raw();
    let writable_by_others = meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0;
    if (meta.uid() != 0 && meta.uid() != me) || writable_by_others {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the directory {} can be written by users other than root (owner uid {}, mode {:o}); use a directory only root can write, such as /run/cohabit",
                dir.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Makes way for binding `path`: nothing there is fine, and a stale socket (one that
/// refuses a connection: its listener is gone) is removed. A live socket (another
/// listener, perhaps another cohabit) or anything that is not a socket is left alone and
/// is an error.
fn clear_stale(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket; not removing it",
        ));
    }
    match UnixDatagram::unbound()?.connect(path) {
        Ok(()) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "the socket is in use by a live listener",
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => std::fs::remove_file(path),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("a socket is there and cannot be probed ({e}); not removing it"),
        )),
    }
}

/// The identity (device, inode) of the socket file at `path`, if a socket is there.
fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.file_type().is_socket())
        .map(|m| (m.dev(), m.ino()))
}

/// Binds a Unix datagram socket at `path` with the owner, group and mode of `access`,
/// receiving its senders' credentials. Returns it with the file's identity.
fn bind_unix(path: &Path, access: &UnixAccess) -> io::Result<(UnixDatagram, (u64, u64))> {
    if access.mode > 0o777 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("mode {:o} has bits beyond 0777", access.mode),
        ));
    }
    check_dir(path)?;
    clear_stale(path)?;
    let sock = UnixDatagram::bind(path)?;
    let ours = socket_identity(path);
    let set_up = || -> io::Result<(u64, u64)> {
        let id = ours.ok_or_else(|| io::Error::other("the socket file vanished after bind"))?;
        std::os::unix::fs::lchown(path, access.owner, access.group)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(access.mode))?;
        if socket_identity(path) != Some(id) {
            return Err(io::Error::other("the socket file was replaced after bind"));
        }
        setsockopt(&sock, sockopt::PassCred, &true).map_err(io::Error::from)?;
        sock.set_read_timeout(Some(Duration::from_millis(100)))?;
        Ok(id)
    };
    match set_up() {
        Ok(id) => Ok((sock, id)),
        Err(e) => {
            if ours.is_some() && socket_identity(path) == ours {
                let _ = std::fs::remove_file(path);
            }
            Err(e)
        }
    }
}

impl PushListener {
    /// Binds and starts receiving. `access` applies to Unix sockets: the file's owner,
    /// group and mode, and whose datagrams count besides the service's processes.
    pub fn bind(addr: &PushAddr, access: &UnixAccess) -> Result<Self, LatencyError> {
        let bind_err = bind_error(addr);
        let hist = Histogram::new_with_bounds(1, MAX_US, 3)
            .map_err(|e| bind_err(io::Error::other(e.to_string())))?;
        let (sock, auth, file, local) = match addr {
            PushAddr::Udp(a) => {
                if !a.ip().is_loopback() {
                    return Err(bind_err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "only loopback addresses are allowed",
                    )));
                }
                let sock = UdpSocket::bind(a).map_err(&bind_err)?;
                sock.set_read_timeout(Some(Duration::from_millis(100)))
                    .map_err(&bind_err)?;
                let local = PushAddr::Udp(sock.local_addr().map_err(&bind_err)?);
                (Socket::Udp(sock), Auth::Unauthenticated, None, local)
            }
            PushAddr::Unix(p) => {
                let (sock, id) = bind_unix(p, access).map_err(&bind_err)?;
                let auth = Auth::Credentials {
                    uids: access.allowed_uids.clone(),
                    gids: access.allowed_gids.clone(),
                };
                (
                    Socket::Unix(sock),
                    auth,
                    Some((p.clone(), id)),
                    addr.clone(),
                )
            }
        };
        let shared = Arc::new(Mutex::new(Shared {
            hist,
            rejected: PushRejections::default(),
            pids: HashSet::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let sock = Arc::new(sock);
        let (sh, st, so) = (Arc::clone(&shared), Arc::clone(&stop), Arc::clone(&sock));
        let spawned = std::thread::Builder::new()
            .name("cohabit-latency".into())
            .spawn(move || serve(&so, &auth, &sh, &st));
        let mut listener = Self {
            shared,
            stop,
            sock,
            thread: None,
            file,
            local,
        };
        // On failure, dropping `listener` removes the socket file.
        listener.thread = Some(spawned.map_err(&bind_err)?);
        Ok(listener)
    }

    /// Sets the service's processes, whose datagrams a Unix socket accepts (the daemon
    /// passes them each tick).
    pub fn set_pids(&self, pids: impl IntoIterator<Item = u32>) {
        let mut s = self
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.pids.clear();
        s.pids.extend(pids);
    }

    /// The samples since the last call; starts a new window.
    pub fn take(&self) -> PushWindow {
        let mut s = self
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let count = s.hist.len();
        let p99_ms = (count > 0).then(|| s.hist.value_at_quantile(0.99) as f64 / 1000.0);
        let w = PushWindow {
            p99_ms,
            count,
            hist: crate::histogram::compact(&s.hist),
            rejected: s.rejected,
        };
        s.hist.reset();
        s.rejected = PushRejections::default();
        w
    }
}

impl Drop for PushListener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the thread now rather than at its read time-out; the join is then short,
        // and a UDP port is free again when the drop returns.
        self.sock.shut_down();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Only the socket this listener bound: a file put there since is not ours.
        if let Some((path, id)) = &self.file {
            if socket_identity(path) == Some(*id) {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;

    use super::*;

    /// Takes windows until `enough` says so (the listener's thread is asynchronous), for
    /// at most about a second; returns them summed.
    fn collect(l: &PushListener, enough: impl Fn(&PushWindow) -> bool) -> PushWindow {
        let mut w = l.take();
        for _ in 0..50 {
            if enough(&w) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            let more = l.take();
            w.rejected += more.rejected;
            w.count += more.count;
            w.p99_ms = more.p99_ms.or(w.p99_ms);
        }
        w
    }

    #[test]
    fn pushed_samples_give_a_p99_per_window() {
        let any = UnixAccess::default();
        let l = PushListener::bind(&PushAddr::Udp("127.0.0.1:0".parse().unwrap()), &any).unwrap();
        let PushAddr::Udp(addr) = l.local.clone() else {
            unreachable!()
        };
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let lines: String = (1..=100).map(|i| format!("{}\n", i * 100)).collect();
        tx.send_to(lines.as_bytes(), addr).unwrap();
        tx.send_to(b"not-a-number\n", addr).unwrap();
        let w = collect(&l, |w| w.count >= 100 && w.rejected.malformed >= 1);
        assert_eq!(w.count, 100);
        assert_eq!(w.rejected.malformed, 1);
        let p99 = w.p99_ms.unwrap();
        assert!((9.8..=10.0).contains(&p99), "{p99}");
        assert_eq!(l.take().count, 0, "a new window starts empty");
        assert!(
            PushListener::bind(&PushAddr::Udp("8.8.8.8:9".parse().unwrap()), &any).is_err(),
            "loopback only"
        );
    }

    fn unix_listener(dir: &Path) -> (PushListener, PathBuf) {
        let path = dir.join("lat.sock");
        let l = PushListener::bind(&PushAddr::Unix(path.clone()), &UnixAccess::default()).unwrap();
        (l, path)
    }

    #[test]
    fn a_unix_socket_counts_only_the_services_processes() {
        let dir = tempfile::tempdir().unwrap();
        let (l, path) = unix_listener(dir.path());
        let tx = UnixDatagram::unbound().unwrap();
        // Not (yet) one of the service's processes: refused.
        tx.send_to(b"1500\n2500\n", &path).unwrap();
        let w = collect(&l, |w| w.rejected.credentials >= 1);
        assert_eq!((w.count, w.rejected.credentials), (0, 1));
        l.set_pids([std::process::id()]);
        tx.send_to(b"1500\n2500\n", &path).unwrap();
        let w = collect(&l, |w| w.count >= 2);
        assert_eq!((w.count, w.rejected.total()), (2, 0));
        let mode = std::fs::metadata(&path).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o660, "{mode:o}");
    }

    #[test]
    fn a_datagram_cut_by_the_kernel_is_dropped_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (l, path) = unix_listener(dir.path());
        l.set_pids([std::process::id()]);
        let tx = UnixDatagram::unbound().unwrap();
        let big: Vec<u8> = b"1\n".iter().copied().cycle().take(100 * 1024).collect();
        tx.send_to(&big, &path).unwrap();
        let w = collect(&l, |w| w.rejected.truncated >= 1);
        assert_eq!((w.count, w.rejected.truncated), (0, 1));
        assert_eq!(w.rejected.total(), 1);
    }

    #[test]
    fn a_live_socket_is_in_use_and_keeps_receiving() {
        let dir = tempfile::tempdir().unwrap();
        let (first, path) = unix_listener(dir.path());
        first.set_pids([std::process::id()]);
        let e = PushListener::bind(&PushAddr::Unix(path.clone()), &UnixAccess::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("in use"), "{e}");
        UnixDatagram::unbound()
            .unwrap()
            .send_to(b"700\n", &path)
            .unwrap();
        assert_eq!(collect(&first, |w| w.count >= 1).count, 1);
    }

    #[test]
    fn a_stale_socket_is_replaced_and_a_regular_file_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join("stale.sock");
        drop(UnixDatagram::bind(&stale).unwrap());
        let l = PushListener::bind(&PushAddr::Unix(stale.clone()), &UnixAccess::default());
        assert!(l.is_ok(), "{:?}", l.err());
        drop(l);
        assert!(!stale.exists(), "its socket is removed on drop");

        let file = dir.path().join("file.sock");
        std::fs::write(&file, "precious").unwrap();
        let e = PushListener::bind(&PushAddr::Unix(file.clone()), &UnixAccess::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a socket"), "{e}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "precious");
    }

    #[test]
    fn dropping_a_listener_wakes_its_thread_at_once_and_frees_its_address() {
        // Each drop used to wait for the thread's 100 ms read time-out (50 ms on average).
        let dir = tempfile::tempdir().unwrap();
        let any = UnixAccess::default();
        // A loopback address of its own: another test binding 127.0.0.1:0 could be given the
        // port between a drop and the next bind.
        let udp =
            PushListener::bind(&PushAddr::Udp("127.80.85.83:0".parse().unwrap()), &any).unwrap();
        let port = udp.local.clone();
        drop(udp);
        let t = Instant::now();
        for i in 0..20 {
            // The same UDP port at once: the old socket is closed when the drop returns.
            let l = PushListener::bind(&port, &any).unwrap_or_else(|e| panic!("{i}: {e}"));
            std::thread::sleep(Duration::from_millis(2));
            drop(l);
            let l = PushListener::bind(&PushAddr::Unix(dir.path().join("s.sock")), &any).unwrap();
            std::thread::sleep(Duration::from_millis(2));
            drop(l);
        }
        // 40 drops: about 2 s before; well under a second now, even on a loaded machine.
        assert!(
            t.elapsed() < Duration::from_millis(1200),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn drop_removes_the_socket_only_if_it_is_still_ours() {
        let dir = tempfile::tempdir().unwrap();
        let (l, path) = unix_listener(dir.path());
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, "someone else's").unwrap();
        drop(l);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "someone else's");
    }

    #[test]
    fn a_directory_others_can_write_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = PushListener::bind(
            &PushAddr::Unix(dir.path().join("lat.sock")),
            &UnixAccess::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("only root can write"), "{e}");
        // The sticky bit (as on /tmp) keeps others from replacing the entry.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(PushListener::bind(
            &PushAddr::Unix(dir.path().join("lat.sock")),
            &UnixAccess::default()
        )
        .is_ok());
    }

    #[test]
    fn a_window_keeps_at_most_the_cap() {
        let mut s = Shared {
            hist: Histogram::new_with_bounds(1, MAX_US, 3).unwrap(),
            rejected: PushRejections::default(),
            pids: HashSet::new(),
        };
        let lines = "5\n".repeat(60_000);
        record(&mut s, lines.as_bytes());
        record(&mut s, lines.as_bytes());
        assert_eq!(s.hist.len(), MAX_SAMPLES_PER_WINDOW);
        assert_eq!(s.rejected.over_cap, 120_000 - MAX_SAMPLES_PER_WINDOW);
        record(&mut s, b"x\n-1\nNaN\ninf\n\n  \n");
        assert_eq!(
            s.rejected.malformed, 0,
            "over the cap, lines are not even read"
        );
        s.hist.reset();
        record(&mut s, b"x\n-1\nNaN\ninf\n\n  \n7\n");
        assert_eq!((s.rejected.malformed, s.hist.len()), (4, 1));
    }

    #[test]
    fn the_pacer_allows_so_many_datagrams_a_second() {
        let t0 = Instant::now();
        let mut p = Pacer::new(3, t0);
        assert_eq!(p.admit(t0), None);
        assert_eq!(p.admit(t0), None);
        assert_eq!(p.admit(t0 + Duration::from_millis(100)), None);
        assert_eq!(
            p.admit(t0 + Duration::from_millis(400)),
            Some(Duration::from_millis(600))
        );
        assert_eq!(
            p.admit(t0 + Duration::from_millis(1000)),
            None,
            "a new second"
        );
    }

    #[test]
    fn credentials_admit_the_services_pids_and_allowed_ids() {
        let auth = Auth::Credentials {
            uids: BTreeSet::from([1000]),
            gids: BTreeSet::from([50]),
        };
        let pids = HashSet::from([42]);
        let from = |pid, uid, gid| Some(Sender { pid, uid, gid });
        assert!(auth.admits(from(42, 7, 7), &pids));
        assert!(auth.admits(from(9, 1000, 7), &pids));
        assert!(auth.admits(from(9, 7, 50), &pids));
        assert!(!auth.admits(from(9, 7, 7), &pids));
        assert!(!auth.admits(None, &pids), "no credentials, no entry");
        assert!(Auth::Unauthenticated.admits(None, &pids));
    }

    /// Not a check on its own: the body of the child that
    /// `only_allowed_users_are_counted_as_root` starts under another uid. Without its
    /// environment variable it does nothing.
    #[test]
    fn push_sender_child() {
        if let Some(path) = std::env::var_os("COHABIT_TEST_PUSH_TO") {
            UnixDatagram::unbound()
                .unwrap()
                .send_to(b"1\n", path)
                .unwrap();
        }
    }

    /// Runs `push_sender_child` as `uid`:`gid`, sending `1\n` to `path`.
    fn send_as(uid: u32, gid: u32, path: &Path) {
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "latency::push::tests::push_sender_child",
                "--test-threads=1",
            ])
            .env("COHABIT_TEST_PUSH_TO", path)
            .uid(uid)
            .gid(gid)
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "sender as uid {uid}: {status}");
    }

    #[test]
    fn only_allowed_users_are_counted_as_root() {
        if !nix::unistd::geteuid().is_root() {
            cohabit_testkit::skip(
                cohabit_testkit::Need::Root,
                "needs root to start senders under other uids",
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join("lat.sock");
        // uid 1000 owns the socket and may send; gid 65534 (nogroup) can reach it too.
        let access = UnixAccess {
            owner: Some(1000),
            group: Some(65534),
            allowed_uids: BTreeSet::from([1000]),
            ..UnixAccess::default()
        };
        let l = PushListener::bind(&PushAddr::Unix(path.clone()), &access).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(
            (meta.mode() & 0o7777, meta.uid(), meta.gid()),
            (0o660, 1000, 65534)
        );
        send_as(65534, 65534, &path);
        let w = collect(&l, |w| w.rejected.credentials >= 1);
        assert_eq!((w.count, w.rejected.credentials), (0, 1));
        send_as(1000, 1000, &path);
        let w = collect(&l, |w| w.count >= 1);
        assert_eq!((w.count, w.rejected.total()), (1, 0));
    }
}
