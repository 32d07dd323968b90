"""HDF5 I/O for domain-parallel data: every rank reads and writes only its block.

- ``read(path, dataset, grid, shard, halo=..., index=...)``: this rank's block
  (a DomainTensor), or with a halo a HaloBlock (the block padded by ghost cells
  read from the file, wrapped on periodic axes, filled at outer edges).
- ``write(path, dataset, x)``: a DomainTensor into one dataset (collective under
  mpio; the serial fallback writes part files stitched by a virtual dataset).
- ``ShardedDataset``: samples of (N, C, *spatial) datasets as DomainTensors, with
  rank-agreed shuffling and background prefetch.
- ``save_checkpoint`` / ``load_checkpoint``: replicated model and optimizer state
  written once, DomainTensors as global arrays, atomic, restartable on any grid.

Driver: mpio when h5py has MPI, else serial; ``DOMAINPAR_IO=serial`` or
``set_mode('serial')`` forces the fallback. Errors: DataError (files) and
LayoutError (shapes), raised on every rank alike. Every rank checks the path
itself before a file is opened (a file some ranks do not see, on a filesystem
not every rank shares, is an error, not a hang); a dataset reads only its own
file (and the serial fallback's part files): external storage, external links
and other virtual sources are refused (``guard``).
"""
from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .dataset import ShardedDataset
from .errors import DataError
from .files import forced_mode, parallel, set_mode
from .read import HaloBlock, read
from .write import write

__all__ = ["Checkpoint", "DataError", "HaloBlock", "ShardedDataset", "forced_mode",
           "load_checkpoint", "parallel", "read", "save_checkpoint", "set_mode", "write"]
