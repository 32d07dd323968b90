"""`domainpar plan`: per-rank peak memory of a model on a sharded field, and the
process grid to run it on.

- ``measure``: peaks of two training steps and of an inference pass, measured
  on scaled-down blocks in one process (a rank's pattern, on a one-rank grid),
  and of a real sharded run under mpiexec (verification).
- ``model``: the least-squares fit ``peak = a + b * cells + c * faces``.
- ``grids``: candidate rank counts, their splits over the shardable dims, blocks.
- ``report``: estimates per grid, the best grid per count, the table.
- ``units``: memory sizes in and out.
- ``cli`` / ``run``: the command.

The package imports neither torch nor MPI until a command runs.
"""
