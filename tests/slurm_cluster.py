"""A real single-node Slurm cluster in a folder, with accounting: what the Slurm tests run against.

    python tests/slurm_cluster.py start DIR   # prints the line that points Slurm's commands at it
    python tests/slurm_cluster.py stop DIR

Debian's packages: slurmctld, slurmd, slurm-client, munge, and slurmdbd with mariadb-server for accounting (`sacct`,
which submitit asks for a job's state: a job that ended without a result, e.g. killed at its time limit, is known
only through it). `start` writes every config file into DIR, starts munged, MariaDB, slurmdbd, slurmctld and slurmd
in the foreground of processes of its own (no systemd, no cgroups: proctrack/linuxproc, task/none), keeps their PIDs
in DIR/pids.json and returns once `sinfo` says the node is idle and `sacct` answers (3 to 8 s on 2 cores). `stop`
cancels the jobs left and ends those PIDs (about 5 s). The daemons run as the current user, who submits every job:
root, as on CI (as another user it has not been tried). A requeued job waits REQUEUE_DELAY_S, not Slurm's 120 s, so
the tests need no `scontrol update StartTime=now`.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

PARTITION = "debug"  # the one partition, the default
NODE_CPUS = 8  # declared, not real (SlurmdParameters=config_overrides): the tests' jobs run side by side on 2 cores
KILL_WAIT_S = 5  # a job's processes get SIGTERM, then SIGKILL this much later (real clusters: 30 s, the default)
# A requeued job may start again this many seconds after its requeue (AuthInfo's cred_expire: default 120, min 5)
REQUEUE_DELAY_S = 5
PACKAGES = "slurmctld slurmd slurm-client munge slurmdbd mariadb-server"
PROGRAMS = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "munged", "mariadbd", "mariadb-install-db")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin")  # daemons live in sbin, not on a plain user's PATH
Pids = dict[str, list[float]]  # daemon -> [pid, start time]


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here: the line says what is missing and how to install it."""


def _which(program: str) -> str | None:
    return shutil.which(program) or shutil.which(program, path=os.pathsep.join(SBIN))


def missing_programs() -> list[str]:
    return [program for program in PROGRAMS if _which(program) is None]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Cluster:
    folder: Path

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """os.environ with SLURM_CONF pointing Slurm's commands (and submitit's) at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def command(self, *args: str, timeout: float = 30, check: bool = True) -> str:
        """Run a Slurm command (`squeue`, `scontrol`, ...) against this cluster; its stdout."""
        done = subprocess.run(args, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def stop(self) -> None:
        stop(self.folder)


def _write_configs(folder: Path, ports: dict[str, int]) -> None:
    user, munge = getpass.getuser(), folder / "munge"
    (folder / "state").mkdir()
    (folder / "spool").mkdir()
    auth = f"AuthType=auth/munge\nAuthInfo=socket={munge}/munge.socket,cred_expire={REQUEUE_DELAY_S}\n"
    (folder / "slurm.conf").write_text(
        f"ClusterName=imgtrain\nSlurmctldHost=localhost\nSlurmUser={user}\nSlurmdUser={user}\n"
        f"{auth}CredType=cred/munge\nSlurmctldPort={ports['slurmctld']}\nSlurmdPort={ports['slurmd']}\n"
        f"StateSaveLocation={folder}/state\nSlurmdSpoolDir={folder}/spool\n"
        f"SlurmctldPidFile={folder}/slurmctld.pid\nSlurmdPidFile={folder}/slurmd.pid\n"
        f"SlurmctldLogFile={folder}/slurmctld.log\nSlurmdLogFile={folder}/slurmd.log\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
        "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
        f"AccountingStoragePort={ports['slurmdbd']}\n"
        f"AccountingStoragePass={munge}/munge.socket\n"  # the munged that slurmdbd's connections use
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nSchedulerType=sched/builtin\n"
        "SchedulerParameters=sched_interval=1\n"  # a requeued job starts within a second of its begin time
        "MpiDefault=none\nReturnToService=2\nSlurmdParameters=config_overrides\nMailProg=/bin/true\n"
        f"KillWait={KILL_WAIT_S}\nMinJobAge=600\n"
        f"NodeName=localhost CPUs={NODE_CPUS} RealMemory=16000 State=UNKNOWN\n"
        f"PartitionName={PARTITION} Nodes=localhost Default=YES MaxTime=INFINITE State=UP\n"
    )
    dbd = folder / "slurmdbd.conf"
    dbd.write_text(
        f"{auth}DbdHost=localhost\nDbdPort={ports['slurmdbd']}\nSlurmUser={user}\n"
        f"PidFile={folder}/slurmdbd.pid\nLogFile={folder}/slurmdbd.log\n"
        f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={ports['mariadb']}\n"
        f"StorageUser={user}\nStorageLoc=slurm_acct_db\n"
    )
    dbd.chmod(0o600)  # slurmdbd refuses a config others can read (it may hold the database password)


def _spawn(folder: Path, name: str, args: list[str], pids: Pids) -> None:
    """Start a daemon in the foreground of a process of its own; its PID and start time go to pids.json."""
    with open(folder / f"{name}.out", "ab") as log:
        proc = subprocess.Popen(
            [_which(args[0]) or args[0], *args[1:]],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # out of the tests' process group: a Ctrl-C of pytest leaves them to `stop`
            env={**os.environ, "SLURM_CONF": str(folder / "slurm.conf")},
        )
    pids[name] = [proc.pid, psutil.Process(proc.pid).create_time()]
    (folder / "pids.json").write_text(json.dumps(pids))


def _wait(what: str, ready: Callable[[], bool], folder: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            logs = sorted(folder.glob("*.log")) + sorted(folder.glob("*.out"))
            tail = "; ".join(f"{p.name}: {p.read_text(errors='replace')[-400:]!r}" for p in logs)
            raise RuntimeError(f"the Slurm cluster in {folder}: {what} not ready after {timeout:.0f} s ({tail})")
        time.sleep(0.1)


def _succeeds(*args: str, env: dict[str, str] | None = None) -> bool:
    return subprocess.run(args, capture_output=True, env=env, timeout=30).returncode == 0


def _start_munge(folder: Path, pids: Pids) -> None:
    munge = folder / "munge"
    munge.mkdir(mode=0o700)
    key = munge / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    args = ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={munge}/munge.socket"]
    args += [f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/seed"]
    _spawn(folder, "munged", args, pids)
    _wait("munged", (munge / "munge.socket").exists, folder, 10)


def _start_mariadb(folder: Path, port: int, pids: Pids) -> None:
    data, user = folder / "mariadb", getpass.getuser()
    small = ["--innodb-log-file-size=8M", "--innodb-buffer-pool-size=16M", "--skip-log-bin"]
    install = [_which("mariadb-install-db") or "", "--no-defaults", f"--datadir={data}", f"--user={user}", *small]
    install += ["--auth-root-authentication-method=normal", "--skip-test-db"]
    done = subprocess.run(install, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"mariadb-install-db failed: {done.stderr.strip()[-600:]}")
    args = ["mariadbd", "--no-defaults", f"--datadir={data}", f"--user={user}", f"--port={port}", *small]
    args += ["--bind-address=127.0.0.1", f"--socket={folder}/mariadb.sock", f"--pid-file={folder}/mariadb.pid"]
    _spawn(folder, "mariadbd", args, pids)
    client = [_which("mariadb") or "mariadb", "--no-defaults", f"--socket={folder}/mariadb.sock", f"--user={user}"]
    _wait("MariaDB", lambda: _succeeds(*client, "-e", "select 1"), folder, 60)


def start(folder: Path) -> Cluster:
    """Start the cluster in `folder` (new or empty); SlurmUnavailable where it cannot run here."""
    missing = missing_programs()
    if missing:
        raise SlurmUnavailable(f"{', '.join(missing)} not found: apt-get install {PACKAGES} (Debian, as root)")
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    ports = {name: _free_port() for name in ("slurmctld", "slurmd", "slurmdbd", "mariadb")}
    _write_configs(folder, ports)
    pids: Pids = {}
    cluster = Cluster(folder)
    env = cluster.env()
    try:
        _start_munge(folder, pids)
        _start_mariadb(folder, ports["mariadb"], pids)
        _spawn(folder, "slurmdbd", ["slurmdbd", "-D"], pids)
        _wait("slurmdbd", lambda: _succeeds("sacctmgr", "-n", "list", "cluster", env=env), folder, 60)
        _succeeds("sacctmgr", "-i", "add", "cluster", "imgtrain", env=env)
        _spawn(folder, "slurmctld", ["slurmctld", "-D", "-i"], pids)
        _spawn(folder, "slurmd", ["slurmd", "-D", "-N", "localhost"], pids)
        _wait("the node", lambda: "idle" in cluster.command("sinfo", "-h", "-o", "%T", check=False), folder, 60)
        _wait("accounting", lambda: _succeeds("sacct", "-n", "-X", env=env), folder, 60)
    except BaseException:
        stop(folder)
        raise
    return cluster


def _process(pid: int, started: float) -> psutil.Process | None:
    """The daemon `start` started as `pid` at `started`, if it still runs (not a later process given its PID)."""
    try:
        proc = psutil.Process(int(pid))
        if abs(proc.create_time() - started) > 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    return proc


def _end(procs: list[psutil.Process], timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after `timeout` s, to these processes (started here: their PIDs and start times)."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def stop(folder: Path) -> None:
    """Cancel the cluster's jobs, then end its daemons by the PIDs `start` kept (slurmd and slurmctld first)."""
    pids_file = folder.resolve() / "pids.json"
    if not pids_file.exists():
        return
    pids: Pids = json.loads(pids_file.read_text())
    env = {**os.environ, "SLURM_CONF": str(pids_file.parent / "slurm.conf")}
    if "slurmctld" in pids and _process(*pids["slurmctld"]) is not None:
        subprocess.run(["scancel", f"--user={getpass.getuser()}"], env=env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 2 * KILL_WAIT_S + 5  # their processes: SIGTERM, SIGKILL after KillWait
        while time.monotonic() < deadline:
            queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30)
            if queue.returncode != 0 or not queue.stdout.strip():
                break
            time.sleep(0.2)
    for names in (("slurmd", "slurmctld"), ("slurmdbd", "mariadbd", "munged")):  # the controller before its database
        procs = [_process(*pids[name]) for name in names if name in pids]
        _end([proc for proc in procs if proc is not None])
    pids_file.unlink()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: python tests/slurm_cluster.py start|stop DIR", file=sys.stderr)
        return 2
    folder = Path(argv[1])
    if argv[0] == "stop":
        stop(folder)
        return 0
    try:
        cluster = start(folder)
    except SlurmUnavailable as error:
        print(f"error: no Slurm here: {error}", file=sys.stderr)
        return 3
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
