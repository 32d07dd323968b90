"""Checkpoints: one HDF5 file, written atomically, loadable on any rank count.

Layout of the file:
- ``state``: a uint8 dataset holding ``torch.save({'model', 'optimizer',
  'extra'})`` of the replicated state, written once (by rank 0), with its crc32
  in the attribute ``crc32``;
- ``tensors/<name>``: each DomainTensor as its global array (``io.write``:
  collective under mpio, part files plus a virtual dataset in serial mode), with
  the ``shard`` map it was saved with (JSON) in an attribute;
- root attributes ``format='domainpar-checkpoint'``, ``version``, ``ranks``.

Atomic: everything goes to ``<path>.tmp-<token>`` (and its part files
``<path>.tmp-<token>.rank<r>.h5``); after every rank is done, the files are
synced and rank 0 renames the temporary file to ``path`` (``os.replace``), the
one step that commits. A job killed before that leaves the previous checkpoint
and the part files it refers to untouched; the temporary files it leaves are
removed by the next successful save, and a save that fails with an error removes
its own. Before writing, the state is read back as ``load_checkpoint`` will
(``torch.load(weights_only=True)``): what could not be (a numpy array, a Path)
is refused, naming it. Loading re-cuts every tensor for the grid
it is given (``read``), so a checkpoint saved on 4 ranks restarts on 1, 2, 3...
"""
from __future__ import annotations

import glob
import io
import json
import os
import secrets
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import NamedTuple

import h5py
import numpy as np
import torch
from mpi4py import MPI

from ..comm.errors import DomainparError, LayoutError, signature_of
from ..comm.errors import agree as agree_args
from ..comm.grid import ProcessGrid
from ..tensor.domain_tensor import DomainTensor
from . import files, guard
from .errors import DataError, agree, bcast_outcome
from .read import read
from .write import part_path, write

FORMAT = "domainpar-checkpoint"
VERSION = 1


class Checkpoint(NamedTuple):
    """What ``load_checkpoint`` returns: the DomainTensors (cut for the new grid)
    and the ``extra`` object saved with them."""
    tensors: dict[str, DomainTensor]
    extra: object


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unpickled(blob: bytes):
    """What ``load_checkpoint`` makes of ``blob``: ``torch.load(weights_only=True)``,
    which runs no code from the file and reads back only tensors, numbers,
    strings, bytes and their containers (what exactly depends on torch's version)."""
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def _loads_back(obj) -> bool:
    try:
        _unpickled(_pickled(obj))
    except Exception:  # noqa: BLE001 -- whatever makes it fail, it cannot be loaded back
        return False
    return True


def _culprit(obj, where: str) -> str:
    """Where in ``obj`` (which does not load back) the first part that does not
    load back is, and its type: descends into dicts, lists and tuples."""
    if type(obj) in (dict, list, tuple) or isinstance(obj, OrderedDict):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if isinstance(obj, dict) and not _loads_back(key):
                return f"the key {key!r} of {where} is a {_type(key)}"
            if not _loads_back(value):
                return _culprit(value, f"{where}[{key!r}]")
    return f"{where} is a {_type(obj)}"


def _type(obj) -> str:
    kind = type(obj)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _state_blob(model, optimizer, extra) -> bytes:
    """The replicated state's bytes, after checking ``load_checkpoint`` can read
    them back (a DataError naming the first part that cannot be)."""
    state = {"model": None if model is None else model.state_dict(),
             "optimizer": None if optimizer is None else optimizer.state_dict(),
             "extra": extra}
    blob = _pickled(state)
    try:
        _unpickled(blob)
    except Exception:  # noqa: BLE001 -- find what in it cannot be loaded back
        names = {"model": "the model state", "optimizer": "the optimizer state", "extra": "extra"}
        for key, what in names.items():
            if not _loads_back(state[key]):
                raise DataError(f"save_checkpoint: {_culprit(state[key], what)}, which "
                                f"load_checkpoint cannot read back (it loads with torch.load("
                                f"weights_only=True)); store plain numbers, strings, lists, "
                                f"dicts or tensors instead (e.g. torch.from_numpy(a), "
                                f"a.tolist(), float(x), str(path))") from None
        raise
    return blob


def _check_tensors(tensors: Mapping[str, DomainTensor]) -> ProcessGrid | None:
    grid = None
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise DataError(f"checkpoint tensor names must be non-empty strings without '/', "
                            f"got {name!r}")
        if not isinstance(t, DomainTensor):
            raise DataError(f"checkpoint tensor {name!r} is a {type(t).__name__}, not a "
                            f"DomainTensor (replicated tensors belong in the model or extra)")
        if grid is None:
            grid = t.grid
        elif MPI.Comm.Compare(grid.comm, t.grid.comm) not in (MPI.IDENT, MPI.CONGRUENT):
            raise DataError(f"checkpoint tensor {name!r} lives on another communicator than "
                            f"the others")
    return grid


def _start(tmp: str, ranks: int, model, optimizer, extra) -> None:
    """Rank 0: the temporary main file with the replicated state."""
    blob = np.frombuffer(_state_blob(model, optimizer, extra), dtype=np.uint8)
    with h5py.File(tmp, "w") as f:
        f.attrs.update({"format": FORMAT, "version": VERSION, "ranks": ranks})
        state = f.create_dataset("state", data=blob)
        state.attrs["crc32"] = zlib.crc32(blob.tobytes())
        f.create_group("tensors")


def _write_tmp(comm: MPI.Comm, tmp: str, model, optimizer, extra,
               tensors: Mapping[str, DomainTensor]) -> None:
    """Collective. The whole checkpoint into ``tmp`` (and its parts), synced."""
    rank = comm.Get_rank()
    bcast_outcome(comm, lambda: _start(tmp, comm.Get_size(), model, optimizer, extra))
    for name, t in sorted(tensors.items()):
        write(tmp, f"tensors/{name}", t,
              attrs={"shard": json.dumps({str(d): a for d, a in t._dec.shard.items()})})
    problem = None
    try:  # each rank syncs what it wrote alone; rank 0 the main file
        for mine in ([tmp] if rank == 0 else []) + [part_path(tmp, rank)]:
            if os.path.exists(mine):
                _fsync(mine)
    except OSError as exc:
        problem = f"syncing the checkpoint: {exc}"
    agree(comm, problem)


def save_checkpoint(path, model=None, optimizer=None, tensors: Mapping | None = None,
                    extra=None, *, grid: ProcessGrid | None = None) -> None:
    """Collective over the tensors' grid (else ``grid``, else COMM_WORLD). Save a
    checkpoint to ``path``, atomically (see the module notes).

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint file.
    model : torch.nn.Module, optional
        Replicated; its ``state_dict()`` is written once, by rank 0.
    optimizer : torch.optim.Optimizer, optional
        Likewise.
    tensors : mapping, optional
        ``{name: DomainTensor}``, stored as global arrays.
    extra : optional
        Anything ``torch.load(weights_only=True)`` reads back (numbers, strings,
        lists, dicts, tensors: an epoch, a step, an RNG state); anything else is
        refused before writing, naming the first such value.
    grid : ProcessGrid, optional
        The ranks that save, when ``tensors`` names none.
    """
    path = str(path)
    tensors = dict(tensors or {})
    grid = _check_tensors(tensors) or grid  # the same tensors on every rank: the same error
    comm = grid.comm if grid is not None else MPI.COMM_WORLD
    rank = comm.Get_rank()
    agree_args(comm, None, signature=signature_of(path, sorted(tensors), files.parallel()),
               what="save_checkpoint paths and tensor names", described=f"{path} {sorted(tensors)}")
    guard.writable_directory(comm, path)  # every rank writes beside it (mpio or parts)
    tmp = f"{path}.tmp-{comm.bcast(secrets.token_hex(6) if rank == 0 else None, root=0)}"
    try:
        _write_tmp(comm, tmp, model, optimizer, extra, tensors)
    except DomainparError:  # raised on every rank alike: each removes what it wrote
        for mine in ([tmp] if rank == 0 else []) + [part_path(tmp, rank)]:
            if os.path.exists(mine):
                os.remove(mine)
        raise

    def commit():
        os.replace(tmp, path)
        _fsync(os.path.dirname(os.path.abspath(path)))
        # Earlier checkpoints' parts and what killed saves left behind.
        for stale in glob.glob(glob.escape(path) + ".tmp-*"):
            if not stale.startswith(tmp + "."):
                os.remove(stale)
    bcast_outcome(comm, commit)


def _shard_map(path: str, name: str, dset) -> dict[int, int]:
    try:
        return {int(d): int(a) for d, a in json.loads(dset.attrs["shard"]).items()}
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise DataError(f"{path}: checkpoint tensor {name!r} has no valid shard map "
                        f"({type(exc).__name__}: {exc})") from None


def _saved(path: str):
    """Rank 0: the state bytes and the tensors' names and shard maps."""
    with files._open_serial(path) as f:
        if f.attrs.get("format") != FORMAT or "state" not in f:
            raise DataError(f"{path} is an HDF5 file but not a domainpar checkpoint")
        if guard.check_dataset(path, f, "state") or f["state"].dtype != np.uint8:
            raise DataError(f"{path}: the model/optimizer state is not a plain byte dataset")
        blob = f["state"][()].tobytes()
        if zlib.crc32(blob) != f["state"].attrs.get("crc32"):
            raise DataError(f"{path}: the model/optimizer state is corrupt (crc32 mismatch)")
        if "tensors" not in f:
            return blob, {}
        guard.no_links(path, f, "tensors")
        if not isinstance(f["tensors"], h5py.Group):
            raise DataError(f"{path}: 'tensors' is not a group")
        shards = {name: _shard_map(path, name, dset) for name, dset in f["tensors"].items()}
    return blob, shards


def _state(path: str, blob: bytes) -> dict:
    """Local (the same bytes on every rank: the same outcome). The saved state, or
    a DataError for bytes that do not unpickle to what save_checkpoint wrote."""
    try:
        state = _unpickled(blob)
    except Exception as exc:  # noqa: BLE001 -- hostile or broken bytes can fail any way
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise DataError(f"{path}: cannot unpickle the model/optimizer state "
                        f"({type(exc).__name__}: {first})") from None
    if not isinstance(state, dict) or set(state) != {"model", "optimizer", "extra"}:
        raise DataError(f"{path}: the saved state is not the {{model, optimizer, extra}} "
                        f"that save_checkpoint writes")
    return state


def _load_into(path: str, model, optimizer, state: dict, strict: bool) -> str | None:
    """Local. Load the state into ``model`` and ``optimizer``; what went wrong, if anything."""
    for what, obj in (("model", model), ("optimizer", optimizer)):
        if obj is None:
            continue
        if state[what] is None:
            return f"{path} holds no {what} state"
        try:
            if what == "model":
                obj.load_state_dict(state[what], strict=strict)
            else:
                obj.load_state_dict(state[what])
        except (RuntimeError, KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
            return f"{path}: the saved {what} state does not fit this {what}: {exc}"
    return None


def _for(name: str, option):
    """A per-tensor option: ``{name: value}`` when keyed by tensor names."""
    if isinstance(option, Mapping) and option and all(isinstance(k, str) for k in option):
        return option.get(name)
    return option


def load_checkpoint(path, model=None, optimizer=None, *, grid: ProcessGrid | None = None,
                    shard: Mapping | None = None, sizes: Mapping | None = None,
                    strict: bool = True) -> Checkpoint:
    """Collective over ``grid`` (default: a grid over COMM_WORLD with as many axes
    as the saved tensors' shard maps name, dims chosen by MPI). Load a
    checkpoint saved by ``save_checkpoint``, on any number of ranks.

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint file.
    model, optimizer : optional
        Their state is loaded (``load_state_dict``).
    grid : ProcessGrid, optional
        The grid the tensors are re-cut for.
    shard, sizes : mapping, optional
        The tensors' new layout: one for all tensors, or ``{name: ...}`` per
        tensor; by default the shard map each was saved with, balanced.
    strict : bool, default True
        Passed to the model's ``load_state_dict``.

    Returns
    -------
    Checkpoint
        ``Checkpoint(tensors, extra)``: the DomainTensors and the ``extra``
        object saved with them.

    Raises
    ------
    DataError
        On every rank, for a file that is missing (on any rank), truncated,
        corrupt, not a checkpoint, or whose state does not unpickle or fit the
        model and optimizer; the model and optimizer are untouched when a
        tensor fails.
    """
    path = str(path)
    comm = grid.comm if grid is not None else MPI.COMM_WORLD
    guard.visible(comm, path, "r")  # every rank reads the tensors
    blob, shards = bcast_outcome(comm, lambda: _saved(path))
    state = _state(path, blob)
    if grid is None and shards:
        axes = 1 + max((a for s in shards.values() for a in s.values()), default=0)
        grid = ProcessGrid((0,) * axes, comm=comm)
    tensors = {}
    for name, saved in sorted(shards.items()):
        assert grid is not None  # made above whenever there are shards
        wanted = _for(name, shard)
        try:
            tensors[name] = read(path, f"tensors/{name}", grid,
                                 saved if wanted is None else wanted, sizes=_for(name, sizes))
        except LayoutError as exc:
            raise LayoutError(f"checkpoint tensor {name!r}: {exc}") from None
    agree(comm, _load_into(path, model, optimizer, state, strict))  # tensors first: all or none
    return Checkpoint(tensors, state["extra"])
