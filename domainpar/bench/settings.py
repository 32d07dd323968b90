"""`--compare`: domainpar's run-time settings, applied around a second configuration.

Every benchmark can time a second configuration, B, beside the first, A (the
environment the command runs in): ``--compare KEY=VALUE [KEY=VALUE ...]``
names what B changes. The keys are the environment variables domainpar reads
(``KEYS``); an empty value unsets one (domainpar's default). B's settings are
applied by ``applied()`` around each of B's samples, in the environment and
in the modules that read it (some read it once, at import or on first use),
so a timing loop alternates A and B sample by sample. A benchmark that
launches its own jobs puts B's settings into its B jobs' environment (and the
job applies them again in-process, for the settings read at import) and
alternates A and B jobs.

Settings take effect where domainpar reads them: a halo way when an exchange
plans its messages (so B builds its own exchanges, under B's settings), io's
driver when a file is opened. torch is imported only for ``OMP_NUM_THREADS``,
and only where it is imported already (``bench halo`` runs without torch).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping


def _halo_way(value: str | None) -> None:
    from ..comm import halo
    halo.FORCED_WAY = value or None  # read when a plan is built


def _native(value: str | None) -> None:
    from ..comm import packing
    # The kernels load at import unless DOMAINPAR_NATIVE=0 was set then; these
    # flags switch between them and numpy or torch from call to call.
    packing.use_native = value != "0"
    rowwise = sys.modules.get("domainpar.ops.rowwise")
    if rowwise is not None:  # else it reads the environment when imported
        rowwise.set_native(value != "0")


def _cuda_aware(value: str | None) -> None:
    from ..comm import runtime
    runtime.cuda_aware_mpi.cache_clear()  # cached answer: ask again under this setting


def _plan_cache(value: str | None) -> None:
    layout = sys.modules.get("domainpar.tensor.layout")
    if layout is not None:  # else it reads the environment when imported
        layout.set_plan_cache(value != "0")


def _conv_tuning(value: str | None) -> None:
    onednn = sys.modules.get("domainpar.ops.onednn")
    if onednn is not None:  # else it reads the environment when imported
        onednn.set_conv_tuning(value != "0")


def _fft_bands(value: str | None) -> None:
    fftband = sys.modules.get("domainpar.ops.fftband")
    if fftband is not None:  # else it reads the environment when imported
        fftband.set_bands(value != "0")


def _threads(value: str | None) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and value:  # A's count is restored by applied() itself
        torch.set_num_threads(int(value))


def _positive_int(value: str) -> bool:
    return value.isdigit() and int(value) > 0


# glibc reads its malloc tunables once, when the process starts, and domainpar sets
# its thresholds once, on import (comm.runtime.malloc_thresholds): a job launched
# with them runs under them, nothing can switch them in a running process.
_MALLOC_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "DOMAINPAR_MALLOC")
_STARTED_WITH = {k: os.environ.get(k) for k in _MALLOC_KEYS}


def _at_start(key: str) -> Callable[[str | None], None]:
    def check(value: str | None) -> None:
        if value != _STARTED_WITH[key]:
            raise ValueError(f"--compare {key}: read once, when a process starts; only "
                             f"benchmarks that launch their own jobs (scaling, step) "
                             f"can compare it")
    return check


# key -> (what it sets, accepted values (a tuple, or a test), how it is applied in-process)
KEYS: dict[str, tuple[str, tuple[str, ...] | Callable[[str], bool],
                      Callable[[str | None], None]]] = {
    "DOMAINPAR_HALO_WAY": ("strided halo faces as derived datatypes or packed, untuned",
                           ("datatype", "pack"), _halo_way),
    "DOMAINPAR_NATIVE": ("C kernels (1: halo packing, the sharded group norm's passes) or "
                         "numpy and torch (0)", ("0", "1"), _native),
    "DOMAINPAR_CUDA_AWARE": ("device buffers straight to MPI (1) or staged (0)", ("0", "1"),
                             _cuda_aware),
    "DOMAINPAR_IO": ("HDF5 driver", ("auto", "mpio", "serial"), lambda value: None),
    "DOMAINPAR_PLAN_CACHE": ("per-op plan cache and dispatch fast paths on (1) or off (0)",
                             ("0", "1"), _plan_cache),
    "DOMAINPAR_CONV_TUNING": ("a large conv timed whole and in row pieces on first use, "
                              "the faster kept (1), or always whole (0)", ("0", "1"),
                              _conv_tuning),
    "DOMAINPAR_FFT_BANDS": ("an FFT's narrow slices along cut dims as bands, one allreduce, "
                            "and transforms of replicated inputs cut into blocks (1), or by "
                            "transposes (0)", ("0", "1"), _fft_bands),
    # read by DomainParallel when it is built (in the job's environment)
    "DOMAINPAR_FUSE_HALOS": ("halo fusion of conv chains in DomainParallel on (1) or off (0)",
                             ("0", "1"), lambda value: None),
    "OMP_NUM_THREADS": ("torch threads per rank", _positive_int, _threads),
    # docs/benchmarks.md, "The allocator": a fixed threshold keeps large blocks in
    # the heap, so a step reuses them instead of faulting in fresh pages
    "MALLOC_MMAP_THRESHOLD_": ("glibc malloc: bytes from which a block is mmap'd (fresh "
                               "pages, faulted in at first touch); a fixed value turns off "
                               "its dynamic threshold, which stops at 32 MiB",
                               _positive_int, _at_start("MALLOC_MMAP_THRESHOLD_")),
    "MALLOC_TRIM_THRESHOLD_": ("glibc malloc: free bytes at the heap's top kept before "
                               "returning them", _positive_int,
                               _at_start("MALLOC_TRIM_THRESHOLD_")),
    "DOMAINPAR_MALLOC": ("glibc malloc's mmap and trim thresholds fixed at 2 GiB by domainpar "
                         "on import (1, the default) or glibc's own (0)", ("0", "1"),
                         _at_start("DOMAINPAR_MALLOC")),
}


def help_text() -> str:
    """The --compare help: the keys and their values."""
    keys = "; ".join(f"{k}: {what} ({'|'.join(ok) if isinstance(ok, tuple) else 'N > 0'})"
                     for k, (what, ok, _) in KEYS.items())
    return ("time a second configuration B beside A (the current environment), interleaved "
            "in one run: KEY=VALUE changes B from A; an empty VALUE unsets KEY. Keys: "
            f"{keys}. JSON gets both and the B/A median ratios; the table and PNG show both.")


def parse(text: str) -> tuple[str, str]:
    """argparse type of one ``KEY=VALUE``: errors name the valid keys and values."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    if key not in KEYS:
        raise argparse.ArgumentTypeError(f"unknown key {key!r}; valid keys: {', '.join(KEYS)}")
    ok = KEYS[key][1]
    if not value and key == "OMP_NUM_THREADS":
        raise argparse.ArgumentTypeError("OMP_NUM_THREADS needs a value (a whole number > 0)")
    if value and not (value in ok if isinstance(ok, tuple) else ok(value)):
        valid = ", ".join(ok) if isinstance(ok, tuple) else "a whole number > 0"
        raise argparse.ArgumentTypeError(f"{key}={value!r}: use {valid} (or nothing to unset)")
    return key, value


class _Collect(argparse.Action):
    """``--compare``'s parsed KEY=VALUE pairs as a dict; a key given twice is an error."""

    def __call__(self, parser, namespace, values, option_string=None):
        settings: dict[str, str] = {}
        for key, value in values:
            if key in settings:
                parser.error(f"argument --compare: {key} given twice")
            settings[key] = value
        setattr(namespace, self.dest, settings)


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--compare KEY=VALUE ...`` to a benchmark's parser (a dict, or None
    when not given)."""
    parser.add_argument("--compare", nargs="+", type=parse, action=_Collect, metavar="KEY=VALUE",
                        help=help_text())


def as_args(settings: Mapping[str, str] | None) -> list[str]:
    """``settings`` as command-line words for a job (``--compare K=V ...`` or nothing)."""
    return ["--compare", *(f"{k}={v}" for k, v in settings.items())] if settings else []


def current(keys, base: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Local. A's values of ``keys``: those of ``base`` (default: this process's
    environment; None: unset)."""
    base = os.environ if base is None else base
    return {k: base.get(k) for k in keys}


def configurations(settings: Mapping[str, str] | None,
                   base: Mapping[str, str] | None = None) -> dict:
    """What the JSON says about A (the values in ``base``, default this
    environment, of the keys B sets) and B; ``{"A": {}}`` when not comparing."""
    if not settings:
        return {"A": {}}
    return {"A": current(settings, base), "B": dict(settings)}


def describe(settings: Mapping[str, str] | None, base: Mapping[str, str] | None = None) -> str:
    """One line naming both configurations (A's values from ``base``, default
    this environment), for headers."""
    if not settings:
        return ""
    a = ", ".join(f"{k}={v if v is not None else '(unset)'}"
                  for k, v in current(settings, base).items())
    b = ", ".join(f"{k}={v or '(unset)'}" for k, v in settings.items())
    return f"A: {a}; B: {b}"


def parts(report: Mapping) -> list[tuple[str, Mapping]]:
    """A report's configurations as (name, figures): A's figures sit at the top
    level of a report (or case), B's, when compared, under "B" in the same layout."""
    return [("A", report)] + ([("B", report["B"])] if "B" in report else [])


def ratio_line(what: str, ratios: Mapping[str, float]) -> str:
    """A table's closing line of B/A median ratios."""
    return f"B/A {what}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())


def environment(settings: Mapping[str, str] | None,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Local. The environment of a job of configuration ``settings`` (None: A's):
    ``base`` (default os.environ) with ``settings`` set and the empty ones removed."""
    env = dict(os.environ if base is None else base)
    for key, value in (settings or {}).items():
        _put(env, key, value)
    return env


def _put(env, key: str, value: str | None) -> None:
    """``env[key] = value``; an empty or None value removes ``key``."""
    if value:
        env[key] = value
    else:
        env.pop(key, None)


@contextlib.contextmanager
def applied(settings: Mapping[str, str] | None) -> Iterator[None]:
    """Local (enter it alike on every rank). ``settings`` in the environment and
    in the modules that read them, inside the block; the previous values after
    it. ``None`` or ``{}``: nothing changes (configuration A)."""
    if not settings:
        yield
        return
    saved = current(settings)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    try:
        _set(settings)  # inside: a setting refused half-way is undone too
        yield
    finally:
        _set(saved)
        if torch is not None and threads is not None:
            torch.set_num_threads(threads)


def _set(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        _put(os.environ, key, value)
        KEYS[key][2](value or None)


def context_for(settings: Mapping[str, str] | None
                ) -> Callable[[str], contextlib.AbstractContextManager]:
    """For ``timing.interleaved``: a path named ``B:...`` runs under ``settings``,
    any other under A's."""
    def context(name: str):
        return applied(settings) if name.startswith("B:") else contextlib.nullcontext()
    return context
