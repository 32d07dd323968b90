#!/usr/bin/env python3
"""Run the MPI-marked tests under mpiexec, one pytest process per rank.

    python tests/run_mpi.py -n 4 [runner options] [pytest args...]
    python tests/run_mpi.py -n 2 tests/test_halo.py -x
    python tests/run_mpi.py -n 2 --transport tcp tests/test_halo.py -k fill

Rank 0 prints to the console. Ranks 1..N-1 write their output to
build/test-logs/n<N>/rank<r>.log (n<N>-<transport>/ with --transport); when the
run fails, the logs of the failing ranks are printed after rank 0's output, each
under a header naming the rank.
Every rank also writes each test failure to its log as it happens (rank 0 to
rank0.log), so the cause survives when the job is killed before pytest's
end-of-run report. The last line printed is a one-line summary of the run.

Exit status follows pytest: 0 passed, 5 no MPI test was selected on any rank,
anything else a failure (a failed or erroring test on any rank, a rank killed
by a timeout or a crash, or the launcher failing).

Hangs are handled in two layers. pytest-timeout's *thread* method ends a rank
whose test runs longer than --per-test-timeout, even when that rank is stuck
inside an MPI call (a signal handler would never run there); Open MPI then
tears the whole job down. An outer `timeout -k 10 <total>` around the
launcher is the last resort.

How it works: the launcher starts this script on every rank in --rank-child
mode. Each child looks up its rank in the environment (no MPI call, so the
code under test stays in charge of initialising MPI), points fds 1 and 2 at its
log file unless it is rank 0, runs pytest in-process and leaves its exit code
and test counts in rank<r>.json. This process reads those files afterwards, so
a failure on rank 3 alone is caught even though only rank 0 is on the console.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
TIMEOUT_RCS = (124, 137)  # `timeout` fired (TERM, then KILL after -k)

# Where the usual launchers put the global rank (Open MPI, PMIx, MPICH/Hydra, srun).
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def _launch_module():
    """domainpar/launch.py, loaded from its file: the one definition of the MPI
    launch environment. Not through ``import domainpar``, which would bring in
    mpi4py (and start MPI) in this launching process."""
    spec = importlib.util.spec_from_file_location("_domainpar_launch",
                                                  REPO / "domainpar" / "launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAUNCH = _launch_module()

# Set for the launched job only, never in the caller's shell; the caller's
# values win, so a site can still choose its own. domainpar/launch.py's
# LAUNCH_ENV (root allowed, oversubscription, one thread per rank), plus:
CHILD_ENV = {
    **LAUNCH.LAUNCH_ENV,
    # Output must reach the logs even when pytest-timeout ends a rank with os._exit().
    "PYTHONUNBUFFERED": "1",
}

COUNT_KEYS = ("failed", "error", "passed", "skipped", "xfailed", "xpassed", "deselected")


class _RankReport:
    """pytest plugin: what this rank selected and how it went, plus every
    failure written to the rank's log the moment it happens. A failing rank
    often leaves the others stuck in a collective until the timeout kills the
    job, before pytest's own end-of-run report; the early copy keeps the cause.
    """

    def __init__(self, early_log) -> None:
        self.early_log = early_log
        self.selected = 0
        self.counts: dict[str, int] = {}

    def pytest_collection_finish(self, session) -> None:
        self.selected = len(session.items)

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self.early_log.write(
                f"\n--- {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n")
            self.early_log.flush()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        stats = terminalreporter.stats
        self.counts = {k: len(stats[k]) for k in COUNT_KEYS if stats.get(k)}


def _rank_from_env() -> int:
    for var in RANK_VARS:
        if var in os.environ:
            return int(os.environ[var])
    return 0


def rank_child(log_dir: Path, pytest_args: list[str]) -> int:
    rank = _rank_from_env()
    log = open(log_dir / f"rank{rank}.log", "w", buffering=1)
    if rank == 0:
        # Rank 0 stays on the console; its log only gets the early failure
        # reports, shown if rank 0 dies before printing its own summary.
        early_log = log
    else:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        # A descriptor of its own: pytest's capturing redirects fd 1 during tests.
        early_log = os.fdopen(os.dup(log.fileno()), "w", buffering=1)
        pytest_args = [*pytest_args, "--color=no"]  # last one wins in pytest
    # Behave like `python -m pytest`: the working directory, not tests/, first.
    sys.path[0] = os.getcwd()
    import pytest

    report = _RankReport(early_log)
    rc = int(pytest.main(pytest_args, plugins=[report]))
    result = {"rank": rank, "rc": rc, "selected": report.selected, **report.counts}
    (log_dir / f"rank{rank}.json").write_text(json.dumps(result))
    # Nothing selected is reported through the JSON; exiting 0 keeps Open MPI
    # from announcing an aborted job for it.
    return 0 if rc == NO_TESTS else rc


def _env_number(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Unrecognised arguments go to pytest.",
        allow_abbrev=False,  # never swallow a pytest option by its prefix
    )
    parser.add_argument("-n", "--np", type=int, required=True, help="number of ranks")
    parser.add_argument(
        "--per-test-timeout", type=float, metavar="S",
        default=_env_number("DOMAINPAR_TEST_TIMEOUT", 120),
        help="pytest-timeout per test, thread method (default %(default)s, "
        "env DOMAINPAR_TEST_TIMEOUT)")
    parser.add_argument(
        "--total-timeout", type=float, metavar="S",
        default=_env_number("DOMAINPAR_TEST_TOTAL_TIMEOUT", 1800),
        help="kill the whole job after this long (default %(default)s, "
        "env DOMAINPAR_TEST_TOTAL_TIMEOUT)")
    parser.add_argument(
        "--launcher", default=os.environ.get("MPIEXEC", "mpiexec"),
        help="launcher command, given `-n N` (default %(default)r, env MPIEXEC; "
        "e.g. 'srun --mpi=pmix')")
    parser.add_argument(
        "--transport", choices=sorted(LAUNCH.TRANSPORTS), default="default",
        help="Open MPI transport for the job (domainpar/launch.py, TRANSPORTS): "
        "'tcp' is TCP alone over the loopback interface, no shared memory, a "
        "stand-in for a network between nodes (default: Open MPI's choice)")
    parser.add_argument(
        "--log-dir", type=Path,
        help="where ranks 1..N-1 log (default build/test-logs/n<N>, "
        "n<N>-<transport> with --transport)")
    parser.add_argument(
        "--log-tail", type=int, default=200, metavar="LINES",
        help="lines of each failing rank's log to print (default %(default)s)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.np < 1:
        parser.error("-n must be at least 1")
    if args.log_dir is None:
        tail = "" if args.transport == "default" else f"-{args.transport}"
        args.log_dir = REPO / "build" / "test-logs" / f"n{args.np}{tail}"
    return args, pytest_args


def _mpi_only(pytest_args: list[str]) -> list[str]:
    """Select only `mpi`-marked tests, folding in a user's own -m expression.

    pytest-mpi 0.6 ignores --only-mpi when --with-mpi is also given, so the
    selection is done with -m. --with-mpi is still wanted: it applies the
    mpi_skip/mpi_xfail markers.
    """
    out, user_expr = [], None
    it = iter(pytest_args)
    for a in it:
        if a == "-m":
            user_expr = next(it, "")
        elif a.startswith("-m") and not a.startswith("--"):
            user_expr = a[2:]
        else:
            out.append(a)
    expr = f"mpi and ({user_expr})" if user_expr else "mpi"
    return ["-m", expr, *out]


def _describe(res: dict | None) -> str:
    if res is None:
        return "no result (killed by a timeout or the job's teardown, or crashed)"
    parts = [f"{res[k]} {k}" for k in COUNT_KEYS if res.get(k)]
    text = ", ".join(parts) if parts else "no tests ran"
    return text if res["rc"] in (0, NO_TESTS) else f"exit {res['rc']}: {text}"


def _show_log(path: Path, rank: int, res: dict | None, tail: int) -> None:
    print(f"\n{'=' * 20} rank {rank}: {_describe(res)} {'=' * 20}")
    print(f"(last {tail} lines of {_rel(path)})")
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        print("<no log file: the rank never got as far as redirecting its output>")
        return
    print("\n".join(lines[-tail:]) if lines else "<empty>")


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--rank-child"]:
        # Internal: `--rank-child LOG_DIR -- pytest args...`, set by the launch below.
        return rank_child(Path(argv[1]), argv[3:])

    args, user_args = _parse(argv)
    n, log_dir = args.np, args.log_dir.resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in [*log_dir.glob("rank*.log"), *log_dir.glob("rank*.json")]:
        old.unlink()  # stale results from an earlier run must never count

    pytest_args = [
        "-p", "no:cacheprovider",  # N ranks writing one .pytest_cache race
        "--with-mpi",
        f"--timeout={args.per_test_timeout:g}",
        "--timeout-method=thread",
        *_mpi_only(user_args),
    ]
    if not any(a.startswith("--color") for a in user_args):
        pytest_args.append("--color=" + ("yes" if sys.stdout.isatty() else "no"))
    cmd = [
        "timeout", "-k", "10", f"{args.total_timeout:g}",
        *shlex.split(args.launcher), "-n", str(n),
        sys.executable, str(Path(__file__).resolve()), "--rank-child", str(log_dir),
        "--", *pytest_args,
    ]
    env = dict(os.environ)
    for key, value in {**CHILD_ENV, **LAUNCH.TRANSPORTS[args.transport]}.items():
        env.setdefault(key, value)
    # For tests/conftest.py: the run's size and where the other ranks log.
    env["DOMAINPAR_TEST_NP"] = str(n)
    env["DOMAINPAR_TEST_LOG_DIR"] = str(log_dir)

    others = "rank 1 logs" if n == 2 else f"ranks 1..{n - 1} log"
    over = "" if args.transport == "default" else f" over {args.transport}"
    print(f"run_mpi: {n} ranks{over}; {others} to {_rel(log_dir)}/" if n > 1
          else f"run_mpi: 1 rank{over}", flush=True)
    t0 = time.monotonic()
    # `timeout` runs the job in a process group of its own and signals that
    # whole group, so no rank survives it. stdin: nothing for mpiexec to forward.
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C reaches only the terminal's foreground group, not timeout's:
        # pass it on, then wait for the teardown (timeout adds KILL after 10 s).
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        return 130
    elapsed = time.monotonic() - t0

    results: dict[int, dict | None] = {}
    for r in range(n):
        f = log_dir / f"rank{r}.json"
        results[r] = json.loads(f.read_text()) if f.exists() else None
    bad = [r for r, res in results.items() if res is None or res["rc"] not in (0, NO_TESTS)]
    empty = [r for r, res in results.items() if res is not None and res["rc"] == NO_TESTS]

    problems = []
    if rc in TIMEOUT_RCS:
        problems.append(f"outer timeout: killed after {args.total_timeout:g} s")
    elif rc != 0 and not bad:
        problems.append(f"{shlex.split(args.launcher)[0]} exited {rc} after every rank reported success")
    selected = {r: res["selected"] for r, res in results.items() if res is not None}
    if len(set(selected.values())) > 1:
        # Ranks that run different tests enter different collectives: any
        # pass is luck. Usually a test list built from unseeded randomness.
        problems.append(f"ranks selected different numbers of tests {selected}")

    if bad or problems:
        print()  # a killed rank 0 may have left its last line unfinished
    for r in bad:
        # Rank 0's output is on the console already; its log only matters when
        # it died before its summary (it then holds its failures so far).
        log = log_dir / f"rank{r}.log"
        if r != 0 or (results[0] is None and log.exists() and log.stat().st_size):
            _show_log(log, r, results[r], args.log_tail)

    if bad or problems:
        by_outcome: dict[str, list[int]] = {}
        for r in bad:
            by_outcome.setdefault(_describe(results[r]), []).append(r)
        details = [f"rank{'s' * (len(rs) > 1)} {','.join(map(str, rs))}: {d}"
                   for d, rs in by_outcome.items()] + problems
        print(f"run_mpi n={n}: FAILED in {elapsed:.1f}s ({'; '.join(details)}; logs in {_rel(log_dir)})")
        return rc if rc not in (0, NO_TESTS) else 1
    if len(empty) == n:
        print(f"run_mpi n={n}: no MPI tests selected ({elapsed:.1f}s)")
        return NO_TESTS
    print(f"run_mpi n={n}: passed in {elapsed:.1f}s (rank 0: {_describe(results[0])}; every rank exit 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
