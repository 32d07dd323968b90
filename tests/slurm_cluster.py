"""A throwaway one-node Slurm on this machine, for tests/test_slurm.py.

munged, slurmctld and slurmd run in the foreground as children of the test
process. Everything they read or write (munge key and socket, slurm.conf,
state, spool, logs, pid files) lies in one fresh directory, and the two Slurm
ports are picked free at start: nothing on the machine changes and two runs
never share anything. Clients (sbatch, scontrol) find this cluster through
SLURM_CONF in ``LocalSlurm.env``.

The configuration is the least a container allows: no cgroups
(proctrack/linuxproc, task/none), no accounting, every daemon as the user
running the tests.
"""
from __future__ import annotations

import ctypes
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel")
NODE = "localhost"
# GPUs the node claims (stand-in device files), enough for the GPU template's
# request.
GPUS = 4
# Where a job stops for good; slurmctld keeps the record for MinJobAge (300 s).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
# Set by a launcher around the test process (say, run_tests.sbatch running the
# serial tests): they would make sbatch think it is inside that other job.
FOREIGN_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMIX_", "PMI_")


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the daemon before exec: SIGTERM when the test process dies, even by
    SIGKILL, where no finalizer runs."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class SlurmError(RuntimeError):
    """The local cluster did not start, or a job did not end in time."""


# Daemons live in sbin, which a non-root PATH often lacks.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _which(program: str) -> str | None:
    return shutil.which(program, path=SEARCH_PATH)


def missing_programs() -> list[str]:
    """The Slurm and munge programs this machine lacks."""
    return [p for p in DAEMONS + CLIENTS if _which(p) is None]


def _free_ports(count: int) -> list[int]:
    """Ports nobody listens on now (held open together so they differ)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _client_env(conf: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(FOREIGN_ENV_PREFIXES)
           and not (k.startswith("OMPI_") and not k.startswith("OMPI_MCA_"))}
    env["SLURM_CONF"] = str(conf)
    return env


def parse_record(text: str) -> dict[str, str]:
    """``scontrol show -o`` output (``Key=value`` tokens) as a dict."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


class LocalSlurm:
    """munged + slurmctld + slurmd on this machine; ``start()``, then ``stop()``
    (safe to call twice, and after a failed start)."""

    def __init__(self):
        # Not pytest's tmp_path: munged wants every directory above its socket
        # searchable by all, and pytest's base directory is private.
        self.root = Path(tempfile.mkdtemp(prefix="domainpar-slurm-"))
        self.root.chmod(0o755)
        # More than the machine has, so the templates' default requests fit
        # (sbatch --test-only); the jobs the tests run are small.
        # SlurmdParameters=config_overrides lets the node claim these.
        self.cpus = max(64, os.cpu_count() or 1)
        self.conf = self.root / "slurm.conf"
        self.env = _client_env(self.conf)
        self.procs: dict[str, subprocess.Popen] = {}

    # -- start -----------------------------------------------------------------

    def _write_config(self) -> None:
        ctld_port, slurmd_port = _free_ports(2)
        r = self.root
        for d in ("state", "spool", "log", "munge", "dev"):
            (r / d).mkdir()
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # Slurm counts a GPU per device file and tells jobs their numbers in
        # CUDA_VISIBLE_DEVICES. It only checks that the files are devices (it
        # opens none: no cgroups here), so links to /dev/null stand in.
        for i in range(GPUS):
            (r / "dev" / f"nvidia{i}").symlink_to("/dev/null")
        (r / "gres.conf").write_text(f"NodeName={NODE} Name=gpu File={r}/dev/nvidia[0-{GPUS - 1}]\n")
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(f"""\
ClusterName=domainpar-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={getpass.getuser()}
SlurmdUser={getpass.getuser()}
AuthType=auth/munge
AuthInfo=socket={r}/munge/socket
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
MailProg=/bin/true
GresTypes=gpu
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        # Own session: a Ctrl-C meant for pytest does not hit the daemons
        # halfway; stop() ends them in order.
        self.procs[name] = subprocess.Popen([_which(name), *args], env=self.env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        log.close()

    def _wait(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {timeout:.0f} s"
                raise SlurmError(f"local Slurm: {what}: {why}\n{self.logs()}")
            time.sleep(0.2)

    def start(self, timeout: float = 30) -> None:
        """Start the three daemons and wait until the node takes jobs."""
        self._write_config()
        m = self.root / "munge"
        self._spawn("munged", "--foreground", f"--socket={m}/socket", f"--key-file={m}/munge.key",
                    f"--pid-file={m}/munged.pid", f"--seed-file={m}/seed",
                    f"--log-file={self.root}/log/munged.log")
        self._wait("munged", (m / "socket").exists, timeout)
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-N", NODE, "-f", str(self.conf))
        self._wait("node idle", self._node_idle, timeout)

    # -- use -------------------------------------------------------------------

    def run(self, *cmd: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        proc = subprocess.run(cmd, env=kwargs.pop("env", self.env), capture_output=True,
                              text=True, timeout=kwargs.pop("timeout", 30), **kwargs)
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def _node_idle(self) -> bool:
        proc = self.run("scontrol", "show", "node", "-o", NODE, check=False)
        node = parse_record(proc.stdout)
        state = node.get("State", "")
        if "DRAIN" in state or "INVAL" in state:  # a bad node description: waiting won't help
            raise SlurmError(f"local Slurm: node {state}: {node.get('Reason')}\n{self.logs()}")
        return state == "IDLE"

    def submit(self, *sbatch_args: str, cwd: Path, env: dict | None = None) -> str:
        """``sbatch --parsable ARGS`` from ``cwd``; the job id."""
        out = self.run("sbatch", "--parsable", *sbatch_args, cwd=cwd, env=env or self.env).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        return parse_record(self.run("scontrol", "show", "job", "-o", job_id).stdout)

    def wait_job(self, job_id: str, timeout: float,
                 states: frozenset[str] = FINAL_STATES) -> dict[str, str]:
        """Poll the job until it is in one of ``states`` (default: ended); its
        record then. On timeout it is cancelled and SlurmError says where it was."""
        deadline = time.monotonic() + timeout
        while (record := self.job(job_id)).get("JobState") not in states:
            if record.get("JobState") in FINAL_STATES:
                raise SlurmError(f"job {job_id} ended {record['JobState']}, "
                                 f"waited for {' or '.join(sorted(states))}")
            if time.monotonic() > deadline:
                self.run("scancel", job_id, check=False)
                raise SlurmError(f"job {job_id} still {record.get('JobState')} after "
                                 f"{timeout:.0f} s (cancelled): {record.get('Reason')}\n{self.logs()}")
            time.sleep(0.3)
        return record

    def logs(self, lines: int = 15) -> str:
        """The last lines each daemon wrote, for failure messages."""
        parts = []
        # What they printed: in the foreground they print all they log, and
        # also what comes before their log file is open (a bad config).
        for path in sorted((self.root / "log").glob("*.out")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            if tail:
                parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- stop ------------------------------------------------------------------

    def _ours(self) -> list[int]:
        """Processes started under this cluster: every daemon and job process
        carries this cluster's SLURM_CONF in its environment."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone already, or not ours to read
                pass
        return pids

    def stop(self) -> list[int]:
        """Cancel the jobs, stop the daemons (slurmd, slurmctld, munged: the
        reverse of start) and kill whatever still runs under this cluster.
        Returns the pids that had to be killed that way (none when all went down
        cleanly) and removes the directory."""
        if not self.root.exists():
            return []
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--user", str(os.getuid()), check=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self._jobs_running():
                time.sleep(0.3)
        for name in reversed(DAEMONS):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stragglers = self._ours()
        for pid in stragglers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
        return stragglers

    def _jobs_running(self) -> bool:
        proc = self.run("scontrol", "show", "job", "-o", check=False)
        return any(parse_record(line).get("JobState") not in FINAL_STATES
                   for line in proc.stdout.splitlines() if "JobId=" in line)
