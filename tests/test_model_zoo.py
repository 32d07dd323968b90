"""The model zoo (issue 18's acceptance): public models built by their
libraries' own constructors, unmodified, at small sizes, run sharded on every
layout of ``LAYOUTS`` and compared with one process by the demo's judge
(``domainpar.demo.check.check``): output, input gradient and every parameter
gradient, float64 to the oracle's 1e-10, float32 as close to the float64 truth
as one process is (judged per group, so a ReLU mask flipped by rounding is no
failure).

A (model, layout) that domainpar refuses today is listed in ``REFUSED`` and
tested to refuse cleanly: the same UnsupportedOpError on every rank, naming the
op. When an issue-18 item lands, its rows' tests fail ("now runs"): delete the
rows, and the pair is then checked against one process like the others. The
table only ever shrinks; nothing here is skipped or xfailed to hide a refusal.

Every run leaves a JSON record in build/model-zoo/n<P>/ (rank 0), which
``tests/zoo_table.py`` turns into README's "models that run" table.

Runs on 2 and 4 ranks (``make test``'s stages); skipped on 1 and 3 with a reason.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

import domainpar as dp
from domainpar.demo.check import check
from domainpar.tensor.dispatch import UnsupportedOpError
from domainpar.testing import shard_like

COMM = MPI.COMM_WORLD
SIZE = COMM.Get_size()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(
    SIZE not in (2, 4), reason=f"the model zoo's layouts need 2 or 4 ranks, not {SIZE}")]
RESULTS = Path(os.environ.get("DOMAINPAR_ZOO_RESULTS",
                              Path(__file__).resolve().parent.parent / "build" / "model-zoo"))
LIBRARIES = {"MONAI": "monai", "neuraloperator": "neuralop"}


# -- the models: (library, constructor call, input shape) ----------------------------------------
def _monai(name, *args, **kwargs):
    def build():
        from monai.networks import nets
        return getattr(nets, name)(*args, **kwargs)
    return build


def _neuralop(name, **kwargs):
    def build():
        from neuralop import models
        return getattr(models, name)(**kwargs)
    return build


_GROUPS2 = ("group", {"num_groups": 2})
# Sizes: the smallest that every model's down-sampling and norms accept in one
# process (BasicUNet halves 4 times, SwinUNETR 5 times; a norm needs more than
# one value per channel), cut over 4 ranks.
MODELS = {
    "UNet": ("MONAI", _monai("UNet", 3, 1, 1, channels=(4, 8, 16), strides=(2, 2),
                             num_res_units=1), (1, 1, 16, 16, 16)),
    "BasicUNet": ("MONAI", _monai("BasicUNet", 3, 1, 1, features=(2, 2, 4, 4, 4, 2)),
                  (1, 1, 32, 32, 32)),
    "SegResNet": ("MONAI", _monai("SegResNet", 3, init_filters=4, in_channels=1, out_channels=1,
                                  blocks_down=(1, 1, 1), blocks_up=(1, 1), norm=_GROUPS2),
                  (1, 1, 16, 16, 16)),
    "DynUNet": ("MONAI", _monai("DynUNet", 3, 1, 1, kernel_size=(3, 3, 3), strides=(1, 2, 2),
                                upsample_kernel_size=(2, 2), filters=(4, 8, 16)),
                (1, 1, 16, 16, 16)),
    "AttentionUnet": ("MONAI", _monai("AttentionUnet", 3, 1, 1, channels=(4, 8, 16),
                                      strides=(2, 2)), (1, 1, 16, 16, 16)),
    "UNETR": ("MONAI", _monai("UNETR", 1, 1, img_size=(32, 32, 32), feature_size=4,
                              hidden_size=24, mlp_dim=48, num_heads=2), (1, 1, 32, 32, 32)),
    "SwinUNETR": ("MONAI", _monai("SwinUNETR", 1, 1, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1),
                                  feature_size=12, window_size=4,
                                  norm_name=("group", {"num_groups": 3})), (1, 1, 32, 32, 32)),
    # neuraloperator 2.0 makes its spectral weights and SpectralConv's out_fft
    # buffer complex64 (torch.cfloat) whatever the input: the judge's float64 runs
    # cast complex weights to complex128 (model.to(float64) would make them real)
    # and make the model's single-precision factory calls double, in both runs
    # (domainpar.demo.check). out_fft = torch.zeros(...) takes its layout from the
    # DomainTensor written into it (DomainParallel's sharded_factories).
    "FNO 2-D": ("neuraloperator", _neuralop("FNO", n_modes=(4, 4), in_channels=1, out_channels=1,
                                            hidden_channels=4, n_layers=2), (1, 1, 16, 16)),
    "FNO 3-D": ("neuraloperator", _neuralop("FNO", n_modes=(4, 4, 4), in_channels=1,
                                            out_channels=1, hidden_channels=4, n_layers=2),
                (1, 1, 12, 12, 12)),
    "TFNO": ("neuraloperator", _neuralop("TFNO", n_modes=(4, 4), in_channels=1, out_channels=1,
                                         hidden_channels=4, n_layers=2, factorization="tucker",
                                         rank=0.5), (1, 1, 16, 16)),
}


# -- the layouts: name -> (ranks, grid dims, shard, block sizes of dim 2 as fractions) ----------
def _uneven(n: int, parts: int) -> list[int]:
    """``n`` cut into ``parts`` blocks, the first two larger than the rest."""
    q = n // parts
    return [q + 2, q - 2] if parts == 2 else [q + 2, q, q - 1, q - 1]


LAYOUTS = {
    "2 ranks": (2, (2,), {2: 0}, False),
    "2 ranks uneven": (2, (2,), {2: 0}, True),
    "4 ranks": (4, (4,), {2: 0}, False),
    "4 ranks uneven": (4, (4,), {2: 0}, True),
    "2x2 grid": (4, (2, 2), {2: 0, 3: 1}, False),
}

# What domainpar refuses today: (model, layout) -> (the first refused op, as the
# error message names it; the issue-18 item that makes it run). Every row is
# tested to refuse cleanly on every rank (test_refused_model_refuses_cleanly).
# Items: 1 a dim sharded over several grid axes (merging sharded dims); 5 writing
# a DomainTensor into a plain preallocated tensor; 6 a view that needs a
# repartition (window partition on blocks not a multiple of the window).
REFUSED = {
    # model         layout                 first refused op       issue 18 item
}


def _cases(refused: bool):
    return [pytest.param(m, lay, id=f"{m}-{lay}".replace(" ", "_"))
            for lay, spec in LAYOUTS.items() if spec[0] == SIZE
            for m in MODELS if ((m, lay) in REFUSED) == refused]


def _setup(model_name: str, layout: str):
    """Local. The model (float32, seeded alike on every rank), its input, the
    grid and the layout; skips when the model's library is missing."""
    library, build, shape = MODELS[model_name]
    module = LIBRARIES[library]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{library} is not installed (the model zoo needs it: `make setup`)")
    _, dims, shard, uneven = LAYOUTS[layout]
    sizes = {2: _uneven(shape[2], dims[0])} if uneven else None
    torch.manual_seed(0)
    model = build()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    return model, x, dp.ProcessGrid(dims), shard, sizes


def _record(model_name: str, layout: str, result: dict) -> None:
    """Local. Rank 0 leaves the run's result for tests/zoo_table.py."""
    if COMM.Get_rank() != 0:
        return
    out = RESULTS / f"n{SIZE}"
    out.mkdir(parents=True, exist_ok=True)
    record = {"library": MODELS[model_name][0], "model": model_name, "layout": layout, **result}
    name = f"{model_name}-{layout}".replace(" ", "_")
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")


def test_rank_count_has_layouts():
    assert _cases(True) or _cases(False)
    assert set(REFUSED) <= {(m, lay) for m in MODELS for lay in LAYOUTS}, "a stale REFUSED row"


@pytest.mark.parametrize("model_name,layout", _cases(refused=False))
def test_model_matches_one_process(model_name, layout):
    model, x, grid, shard, sizes = _setup(model_name, layout)
    report = check(model, x, grid, shard, sizes=sizes)
    error = max(row["max_rel"] for row in report["float64"].values())
    _record(model_name, layout, {"runs": report["ok"], "float64_error": error,
                                 "report": report})
    assert report["ok"], json.dumps(report, indent=1)


@pytest.mark.parametrize("model_name,layout", _cases(refused=True))
def test_refused_model_refuses_cleanly(model_name, layout):
    op, item = REFUSED[model_name, layout]
    model, x, grid, shard, sizes = _setup(model_name, layout)
    # float32, the models' own precision: neuraloperator's spectral weights and
    # buffers are complex64 by construction (model.double() leaves them so).
    net = dp.DomainParallel(model, grid)
    xs = shard_like(x, grid, shard, sizes, requires_grad=True)
    try:
        net(xs).sum().backward()
        message = None
    except UnsupportedOpError as e:
        message = str(e)
    messages = COMM.allgather(message)
    assert message is not None, (
        f"{model_name} on {layout} now runs: delete its REFUSED row (issue 18 item {item})")
    assert all(m == message for m in messages), f"ranks disagree: {messages}"
    assert message.startswith(op), f"refused at another op than {op}: {message}"
    _record(model_name, layout, {"runs": False, "refused_op": op, "item": item,
                                 "message": message})
