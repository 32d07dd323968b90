"""What io checks before it touches a file.

- ``visible``: every rank sees the path alike. On a filesystem that is not
  shared (a node-local /tmp, a directory made on one node only) one rank finds a
  file another does not; a collective ``h5py.File(driver='mpio')`` then blocks on
  every rank, and the serial fallback writes part files where rank 0 never looks.
  Each rank looks at the path itself, and a difference is a DataError on every
  rank before anything is opened. (A stale copy of a file under the same name on
  a node-local filesystem looks like the real one: that is not detected.)
- ``check_dataset``: a dataset reads nothing but its own file. HDF5 can store a
  dataset's bytes in any local file (external storage), link to a dataset of
  another file (an external link), or stitch a virtual dataset from other files;
  a crafted data file or checkpoint would make ``read``/``load_checkpoint`` copy
  any file the process can read into a tensor. Refused, except the part files
  ``write`` makes in serial mode: ``<file>.rank<r>.h5`` beside the file (for a
  checkpoint ``<file>.tmp-<token>.rank<r>.h5``), each a plain dataset.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable

import h5py
from mpi4py import MPI

from .errors import DataError, agree


# -- every rank sees the path alike ----------------------------------------------------------
def _file_problem(path: str, how: str) -> str | None:
    """Local. What is wrong with the existing ``path`` for opening it ``how``."""
    if not os.path.isfile(path):
        return f"{path} is not a file"
    if not os.access(path, os.R_OK if how == "r" else os.R_OK | os.W_OK):
        return f"{path} is not {'readable' if how == 'r' else 'readable and writable'}"
    return None


def directory_problem(path: str) -> str | None:
    """Local. What keeps this process from making files beside ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{path}: no such directory {folder}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{path}: the directory {folder} is not writable"
    return None


def _unshared(path: str, here: bool) -> str:
    return (f"{path}: {'there is such a file' if here else 'no such file'} here, but "
            f"{'none' if here else 'there is one'} on rank 0 (is it on a filesystem that "
            f"not every rank shares?)")


def visible(comm: MPI.Comm, path: str, how: str, also: Iterable[str] = ()) -> None:
    """Collective. Every rank looks at ``path`` itself (one broadcast and one
    ``agree``): a DataError on every rank when any rank cannot open it ``how``
    ('r': an existing readable file; 'a'/'w': a file it may write, or a writable
    directory to make it in), or finds it where rank 0 does not (or the other way
    round). ``also``: files that must be readable too (a virtual dataset's parts)."""
    here = os.path.exists(path)
    first = comm.bcast(here, root=0) if comm.Get_size() > 1 else here
    problem: str | None
    if here != first:
        problem = _unshared(path, here)
    elif not here:
        problem = f"{path}: no such file" if how == "r" else directory_problem(path)
    else:
        problem = _file_problem(path, how)
    for part in also:
        if problem is None and not os.path.isfile(part):
            problem = f"{part}: no such file (a part of {path})"
        elif problem is None and not os.access(part, os.R_OK):
            problem = f"{part} is not readable (a part of {path})"
    agree(comm, problem)


def writable_directory(comm: MPI.Comm, path: str) -> None:
    """Collective. Every rank may make files beside ``path``, else the same
    DataError on every rank."""
    agree(comm, directory_problem(path))


# -- a dataset reads nothing but its own file --------------------------------------------------
def part_pattern(path: str) -> re.Pattern:
    """Local. The names of the part files of ``path`` (as written by ``write``, and
    by ``save_checkpoint`` under a temporary name that was then renamed)."""
    return re.compile(re.escape(os.path.basename(path)) + r"(\.tmp-[0-9a-f]+)?\.rank[0-9]+\.h5")


def no_links(path: str, f: h5py.File, name: str) -> None:
    """Local. A DataError when ``name`` or a group on its way is an external link."""
    parts = [p for p in name.split("/") if p]
    for k in range(1, len(parts) + 1):
        link = f.get("/".join(parts[:k]), getlink=True)
        if isinstance(link, h5py.ExternalLink):
            raise DataError(f"{path}: {'/'.join(parts[:k])!r} is an external link to "
                            f"{link.filename}:{link.path}; io reads only what is in the file")


def _plain(path: str, dset: h5py.Dataset, what: str) -> None:
    if dset.external:
        raise DataError(f"{path}: {what} {dset.name!r} has external storage (its bytes live "
                        f"in {', '.join(sorted({str(e[0]) for e in dset.external}))}); io "
                        f"reads only what is in the file")


def part_files(path: str, dset: h5py.Dataset) -> list[str]:
    """Local. The part files of the virtual dataset ``dset`` of ``path``, after
    checking they are the file's own; a DataError for any other source."""
    pattern, here, parts = part_pattern(path), os.path.dirname(os.path.abspath(path)), []
    for source in dset.virtual_sources():
        name = source.file_name
        if not pattern.fullmatch(name) or source.dset_name.lstrip("/") != dset.name.lstrip("/"):
            raise DataError(f"{path}: dataset {dset.name!r} is virtual, with a source "
                            f"{name}:{source.dset_name} that is not one of this file's part "
                            f"files ({os.path.basename(path)}.rank<r>.h5:{dset.name}); io "
                            f"reads only what is in the file and its own parts")
        parts.append(os.path.join(here, name))
    return sorted(set(parts))


def check_dataset(path: str, f: h5py.File, name: str) -> list[str]:
    """Local. Refuse a dataset ``name`` of the open file ``f`` that reads from
    anywhere but ``f`` and its own part files (see the module notes); returns the
    part files of a virtual dataset (each checked the same way), else []."""
    no_links(path, f, name)
    dset = f[name]
    if not isinstance(dset, h5py.Dataset):
        raise DataError(f"{path}: {name!r} is a group, not a dataset")
    _plain(path, dset, "dataset")
    if not dset.is_virtual:
        return []
    parts = part_files(path, dset)
    for part in parts:
        if not os.path.isfile(part):
            raise DataError(f"{part}: no such file (a part of {path}:{name})")
        try:
            with h5py.File(part, "r") as g:
                if name not in g:
                    raise DataError(f"{path}: dataset {dset.name!r} is virtual, and its part "
                                    f"{part} has no dataset {name!r}")
                no_links(part, g, name)
                inner = g[name]
                if not isinstance(inner, h5py.Dataset) or inner.is_virtual:
                    raise DataError(f"{part}: {name!r} is not a plain dataset")
                _plain(part, inner, "dataset")
        except OSError as exc:
            raise DataError(f"{part} is not a readable HDF5 file (truncated or corrupt?): "
                            f"{exc}") from None
    return parts
