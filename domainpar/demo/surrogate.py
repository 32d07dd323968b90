"""The demo's surrogate: a 3-D UNet that jumps ``every`` Gray-Scott steps at
once, trained domain-parallel on samples streamed from the HDF5 file.

The model is plain PyTorch (``domainpar.testing.models.UNet3d``) with two
changes for this problem: its padded convs wrap around (``padding_mode=
'circular'``), because the box is periodic, and it predicts the change of the
state (``x + unet(x)``, with the last layer zeroed so that training starts
from "nothing changes", the persistence baseline).
"""
from __future__ import annotations

import math
import resource
import time
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

import domainpar as dp

from ..progress import Progress
from ..testing.models import UNet3d
from . import budget

SHARD = {2: 0}  # (N, C, D, H, W): D cut over a 1-D grid of all ranks


class Surrogate(nn.Module):
    """x -> x + UNet3d(x) on (N, 2, D, H, W) fields (u, v) of a periodic box."""

    def __init__(self, width: int = 8, levels: int = 4):
        super().__init__()
        self.unet = UNet3d(in_channels=2, out_channels=2, width=width, levels=levels)
        for m in self.unet.modules():
            # Wrap instead of zero-padding: the fields are periodic. torch pads
            # with F.pad(mode='circular'), which domainpar fills by halo exchange.
            if isinstance(m, nn.Conv3d) and any(m.padding):
                m.padding_mode = "circular"
        nn.init.zeros_(self.unet.head.weight)
        assert self.unet.head.bias is not None  # the head conv has a bias
        nn.init.zeros_(self.unet.head.bias)

    def forward(self, x):
        """Collective when ``x`` is a DomainTensor (the UNet's halos). The next state:
        ``x`` plus the UNet's increment."""
        return x + self.unet(x)


def peak_rss_mib() -> float:
    """Local. This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batches(data: dp.io.ShardedDataset, batch: int) -> Iterator[tuple]:
    """Collective. Endless batches of ``batch`` samples, epoch after epoch (a new
    shuffle each), cat along N: blocks of one layout, so the cat is local."""
    pending = []
    while True:
        for sample in data:
            pending.append(sample)
            if len(pending) == batch:
                xs, ys = zip(*pending)
                pending = []
                yield torch.cat(xs), torch.cat(ys)


def _learning_rate(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first 5% of steps, then a cosine down to lr / 20."""
    warm = max(1, steps // 20)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def train(path, grid: dp.ProcessGrid, *, steps: int, batch: int, width: int, lr: float,
          seed: int, quiet: bool = False) -> tuple[Surrogate, dict]:
    """Collective. ``steps`` Adam steps of MSE on ``train/inputs`` -> ``train/targets``
    of ``path``, sharded by ``SHARD`` over ``grid``, with a progress line (loss,
    step time of the slowest rank, peak RSS per rank). Returns the model (its
    parameters the same on every rank) and the history: per-step loss, step
    time, data-read time, and peak RSS per rank. ``quiet``: no progress line."""
    comm = grid.comm
    torch.manual_seed(seed)  # DomainParallel broadcasts rank 0's parameters anyway
    model = Surrogate(width)
    net = dp.DomainParallel(model, grid)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    history: dict[str, list[float]] = {"loss": [], "step_s": [], "read_s": [], "peak_rss_mib": []}
    bar = Progress(steps, "train", comm=comm)
    bar.enabled = bar.enabled and not quiet
    with dp.io.ShardedDataset(path, "train/inputs", "train/targets", grid=grid, shard=SHARD,
                              shuffle=True, seed=seed) as data:
        try:
            _loop(net, opt, _batches(data, batch), steps, lr, history, bar)
        except (RuntimeError, MemoryError) as exc:
            # Before the dataset's collective close, which the others never reach.
            budget.abort_if_out_of_memory(comm, exc)
            raise
        bar.close()
    return model, history


def _loop(net, opt, batches, steps: int, lr: float, history: dict, bar: Progress) -> None:
    """Collective. The training steps, each recorded in ``history`` and ``bar``."""
    comm = net.grid.comm
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = next(batches)
        t1 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = _learning_rate(step, steps, lr)
        loss = _step(net, opt, x, y)
        t2 = time.perf_counter()
        # One small allgather per step: what the progress line shows.
        stats = comm.allgather((t2 - t0, t1 - t0, peak_rss_mib()))
        history["loss"].append(float(loss.detach()))
        history["step_s"].append(max(s[0] for s in stats))
        history["read_s"].append(max(s[1] for s in stats))
        history["peak_rss_mib"] = [s[2] for s in stats]
        bar.update(1, loss=f"{history['loss'][-1]:.3e}",
                   step=f"{history['step_s'][-1] * 1e3:.0f} ms",
                   **{"peak RSS": _per_rank_mib(history["peak_rss_mib"])})


def _step(net, opt, x, y) -> torch.Tensor:
    """Collective. One Adam step of MSE; returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(net(x), y)  # a global mean: the same value on every rank
    loss.backward()
    opt.step()
    return loss


def _per_rank_mib(values) -> str:
    """Peak RSS for the progress line: every rank's for up to 4 ranks, else the largest."""
    if len(values) <= 4:
        return "/".join(f"{v:.0f}" for v in values) + " MiB" + (" per rank" if len(values) > 1
                                                                 else "")
    return f"max {max(values):.0f} MiB"


@torch.no_grad()
def evaluate(model: Surrogate, path, grid: dp.ProcessGrid, show: int) -> dict:
    """Collective. The model (in eval mode) on every held-out pair of ``path``:
    mean MSE of its prediction and of persistence (predicting no change), and
    for sample ``show`` the (u, v) plane through the middle of H, whole on
    every rank, of input, prediction and truth, each (2, D, W)."""
    # Inference needs no wrapper: parameters are replicated and nothing is reduced.
    model.eval()
    mse, still, planes = [], [], None
    with dp.io.ShardedDataset(path, "test/inputs", "test/targets", grid=grid,
                              shard=SHARD) as data:
        for i, (x, y) in enumerate(data):
            pred = model(x)
            mse.append(float(F.mse_loss(pred, y)))
            still.append(float(F.mse_loss(x, y)))
            if i == show:
                h = x.shape[3] // 2
                # A 2-D plane of the prediction, gathered for the picture only.
                planes = {name: t[0, :, :, h, :].full_tensor().numpy()
                          for name, t in (("input", x), ("prediction", pred), ("truth", y))}
    model.train()
    return {"mse": sum(mse) / len(mse), "persistence_mse": sum(still) / len(still),
            "per_sample_mse": mse, "per_sample_persistence_mse": still, "planes": planes}
