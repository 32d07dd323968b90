"""The time model: a training step's time at P ranks on a grid,

    step = oversubscription x (compute(block) + attention + sum over events of comm(event))

- ``compute(block) = a + b * cells (+ c * faces)``: the step's time on one
  rank's block, fitted (``model.fit``) to steps measured in one process on
  scaled-down blocks over a one-rank grid (the memory plan's blocks and
  method; one torch thread, as a rank of ``mpiexec`` gets); ``a`` is what does
  not shrink with the block (op dispatch, parameter work), scaled by the
  host's rate, the rest by ``rate``, the compute-rate factor of other
  hardware (0.05: twenty times this core);
- the events are one step's halo exchanges and collectives recorded by
  ``comms.record`` on a traced run, re-counted for the target grid by
  ``comms.traffic`` (busiest rank: the middle coordinate on every axis); a
  ring shift stands for as many shifts as its pass makes at P ranks
  (``ring_hops``);
- attention (``timeattn``): the work of the trace's attention kernels
  (queries x keys, so N^2 / P per rank under ring attention), priced at the
  trace's own seconds per unit of work, times ``rate``; the compute fit's
  points exclude their kernels' time;
- a network is a latency ``alpha`` (s per message) and bandwidth ``beta``
  (bytes/s): a halo round, transpose, ring shift or gather costs
  ``messages x alpha + bytes / beta``; an allreduce of n bytes over P ranks
  ``ceil(log2 P) x small + 2 (P - 1) / P x n / beta`` (``small``: the time of
  one small allreduce step, measured or ``2 alpha``);
- ``oversubscription = max(1, ranks per node / cores per node)``: ranks that
  share cores share their time (this 2-core machine at 3 and 4 ranks).

No overlap of communication with compute is assumed (DomainParallel's bucketed
reduction may overlap backward; the model is then pessimistic by that much).
Pure Python: the arithmetic is tested without MPI or torch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from .comms import Event, Where, scale_of, traffic
from .timeattn import attention_seconds

# Calls whose local work (packing, plans, copies) a one-rank grid never runs, so
# the compute fit misses it: transposes, gathers and ring shifts. A halo fill
# and an allreduce run there too (with nothing to send), so their software cost
# is in the compute already; their recorded times would add only waiting.
# DomainParallel's per-step agreement (``agree``: a nonblocking allreduce waited
# on in ``completes_within``; polled with sleeps only when a fault sets a time
# limit) runs only past one rank too.
SOFTWARE_KINDS = ("repartition", "rooted", "ring", "agree")
CATEGORIES = ("compute", "attention", "halo", "gradient allreduce", "small allreduces", "transposes",
              "ring shifts", "gathers")


@dataclass(frozen=True)
class Network:
    """A network: ``latency_s`` per message, ``bandwidth_Bps`` per rank, the time
    of one step of a small allreduce (default ``2 x latency``)."""
    name: str
    latency_s: float
    bandwidth_Bps: float
    allreduce_small_s: float | None = None

    @property
    def small(self) -> float:
        """Local. Seconds of one step of a small allreduce."""
        return self.allreduce_small_s if self.allreduce_small_s else 2 * self.latency_s

    def as_dict(self) -> dict:
        """Local. The network as a plain dict (for JSON)."""
        return asdict(self)


@dataclass(frozen=True)
class Machine:
    """Compute ``rate`` (times this machine's measured core) for the work that
    grows with the block, ``host_rate`` for the fixed per-step part (Python on
    the host CPU: a GPU does not speed it up), ranks sharing ``cores`` per node
    (``ranks_per_node`` None: all on one node), a network."""
    name: str
    network: Network
    rate: float = 1.0
    cores: int = 1_000_000
    ranks_per_node: int | None = None
    host_rate: float = 1.0

    def oversubscription(self, ranks: int) -> float:
        """Local. How many ranks share each core when ``ranks`` run (at least 1)."""
        per_node = min(ranks, self.ranks_per_node or ranks)
        return max(1.0, per_node / self.cores)

    def as_dict(self) -> dict:
        """Local. The machine, its network included, as a plain dict (for JSON)."""
        return {**asdict(self), "network": self.network.as_dict()}


# Entered cluster profiles (assumptions, not measurements; see docs/scaling.md).
PROFILES = {
    # One rank per NUMA domain of 16 cores: torch's CPU convs run about 10x one
    # core there; HDR InfiniBand, 2 us and 25 GB/s per node port.
    "cpu-cluster": Machine("cpu-cluster", Network("infiniband", 2e-6, 25e9), rate=0.1),
    # One rank per GPU: a datacenter GPU runs these fp32 3-D convs some 200x
    # one CPU core (rate 0.005); between nodes InfiniBand as above, with
    # 25 GB/s per GPU (NVLink's 300 GB/s inside a node is not modelled:
    # at scale most halo neighbours and every allreduce cross nodes).
    "gpu-cluster": Machine("gpu-cluster", Network("infiniband-gpu", 2e-6, 25e9), rate=0.005),
}


@dataclass
class Compute:
    """The fitted compute time of one step on a block (seconds)."""
    coef: tuple[float, ...]
    dims: tuple[int, ...]

    def seconds(self, block: Sequence[int], rate: float = 1.0, host_rate: float = 1.0) -> float:
        """The step on ``block``: the parts that grow with it times ``rate``, the
        fixed part (the fit's intercept: op dispatch in Python, parameter
        updates) times ``host_rate``."""
        cells = math.prod(block)
        value = self.coef[1] * cells
        if len(self.coef) > 2:
            value += self.coef[2] * sum(cells // max(block[d], 1) for d in self.dims)
        return max(value * rate + self.coef[0] * host_rate, 0.0)


def category(e: Event) -> str:
    """Local. Which line of the breakdown an event goes on."""
    if e.kind == "agree":
        return "small allreduces"
    if e.kind == "allreduce":
        return "gradient allreduce" if e.name == "iallreduce" or e.nbytes > 65536 \
            else "small allreduces"
    return {"halo": "halo", "repartition": "transposes", "ring": "ring shifts",
            "attention": "attention"}.get(e.kind, "gathers")


def ring_hops(e: Event, ranks: int) -> float:
    """Local. How many shifts ring shift ``e`` (traced over ``e.ranks``) stands for
    over ``ranks``: its pass makes ``P + e.hops`` of them (``e.hops`` -1: ring
    attention's k/v blocks visit the other ranks; 0: their gradient accumulators
    go round back to their owner); other events 1."""
    if e.kind != "ring" or e.name != "ring_shift" or e.ranks + e.hops <= 0:
        return 1.0
    return max(0, ranks + e.hops) / (e.ranks + e.hops)


def event_seconds(e: Event, where: Where, net: Network, traced: Where | None = None,
                  traced_net: Network | None = None) -> float:
    """Local. One event's time on rank ``where`` over ``net``, plus, for the
    kinds in ``SOFTWARE_KINDS`` (given the grid it was ``traced`` on and the
    network it ran over there), its software cost: the recorded time (the
    least of the traced steps') less what the network accounts for there."""
    own = _network_seconds(e, where, net)
    if traced is None or traced_net is None or own == 0.0 or e.kind not in SOFTWARE_KINDS:
        return own * ring_hops(e, where.size)
    software = max(0.0, e.seconds - _network_seconds(e, traced, traced_net))
    return (own + software) * ring_hops(e, where.size)


def _network_seconds(e: Event, where: Where, net: Network) -> float:
    nbytes, messages = traffic(e, where)
    if e.kind == "agree":  # a small allreduce
        return math.ceil(math.log2(where.size)) * net.small if where.size > 1 else 0.0
    if e.kind == "allreduce":
        p = where.size
        if p <= 1 or nbytes == 0:
            return 0.0
        return math.ceil(math.log2(p)) * net.small + 2 * (p - 1) / p * nbytes / net.bandwidth_Bps
    return messages * net.latency_s + nbytes / net.bandwidth_Bps


def busiest(dims: Sequence[int]) -> tuple[int, ...]:
    """Local. The middle coordinate on every axis: a rank with neighbours on both
    sides wherever there are three or more ranks."""
    return tuple(p // 2 for p in dims)


def predict(events: Sequence[Event], trace_shape: Sequence[int], shape: Sequence[int],
            grid_dims: Sequence[int], dims: Sequence[int], compute: Compute,
            machine: Machine, traced: tuple | None = None) -> dict:
    """Local. The predicted step time of the model whose step ``events`` were
    traced on ``trace_shape``, on a field of ``shape`` over a grid of
    ``grid_dims`` ranks (axis ``i`` splits dim ``dims[i]``): a dict of seconds
    per category, ``step`` and ``block``. ``traced``: ``(grid dims, network)``
    of the trace, to add each call's recorded software cost (``event_seconds``)."""
    trace_where = Where(tuple(traced[0]), (0,) * len(traced[0])) if traced else None
    trace_net = traced[1] if traced else None
    where = Where(tuple(grid_dims), busiest(grid_dims), scale_of(trace_shape, shape))
    block = list(shape)
    for axis, d in enumerate(dims):
        block[d] = -(-shape[d] // grid_dims[axis])
    parts = dict.fromkeys(CATEGORIES, 0.0)
    parts["compute"] = compute.seconds(block, machine.rate, machine.host_rate)
    for e in events:
        if e.kind == "attention":
            parts["attention"] += attention_seconds(e, where, machine.rate)
        else:
            parts[category(e)] += event_seconds(e, where, machine.network, trace_where,
                                                trace_net)
    factor = machine.oversubscription(where.size)
    parts = {k: v * factor for k, v in parts.items()}
    return {**parts, "step": sum(parts.values()), "block": block,
            "fixed": compute.coef[0] * machine.host_rate * factor,
            "grid": list(grid_dims), "ranks": where.size}


def best_grid(events, trace_shape, shape, dims, ranks: int, compute: Compute,
              machine: Machine, traced: tuple | None = None) -> dict:
    """Local. The prediction of the fastest grid of ``ranks`` ranks over ``dims``."""
    from .grids import grids
    options = [predict(events, trace_shape, shape, g.ranks, dims, compute, machine, traced)
               for g in grids(shape, dims, ranks)]
    if not options:
        raise ValueError(f"no grid of {ranks} ranks over dims {list(dims)} of {list(shape)}")
    return min(options, key=lambda r: r["step"])


def limiting(rows: Sequence[dict]) -> dict:
    """Local. Where a strong-scaling series stops scaling: the first row whose
    parallel efficiency falls under 50%, and its largest part other than the
    compute that shrinks with the block (``None`` where it never does)."""
    base = rows[0]["step"] * rows[0]["ranks"]
    for r in rows:
        efficiency = base / (r["step"] * r["ranks"])
        if efficiency < 0.5:
            parts = {k: r[k] for k in CATEGORIES if k != "compute"}
            parts["fixed compute (per-step overhead)"] = r.get("fixed", 0.0)
            name = max(parts, key=lambda k: parts[k])
            return {"ranks": r["ranks"], "efficiency": efficiency, "op": name,
                    "seconds": parts[name], "step": r["step"]}
    return {"ranks": None, "op": None}


def with_rate(machine: Machine, rate: float | None) -> Machine:
    """Local. ``machine`` with another compute rate (None: unchanged)."""
    return machine if rate is None else replace(machine, rate=rate)
