"""domainpar/ops/onednn.py: the CPU oneDNN kernel-selection workaround does what
its docstring claims on the installed torch (checked on 2.13.0+cpu).

Claims: torch's private ``torch._C._select_conv_backend`` exists; it picks
im2col (``slow_conv3d``) for a thin float32 3-D block and oneDNN for the block
with its spatial dims reordered; ``local_conv`` then really runs oneDNN (seen in
the profiler) where torch's default runs im2col; where no order helps, the block
goes through oneDNN's own layout; a 1x1x1 conv, float64 and 2-D convs are left
to torch. Every selected path gives torch's default numbers, forward and
backward (both float32 paths within float32 rounding of the float64 truth).
Serial: no MPI, one process.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from domainpar.ops import onednn

THIN = (1, 8, 14, 16, 170)  # N*C*D*H = 1792: torch's size rule picks im2col as it is
NO_ORDER = (1, 4, 10, 10, 18)  # no reordering passes the rule: oneDNN's own layout
CONV = dict(stride=(1, 1, 1), padding=(0, 1, 1), dilation=(1, 1, 1), groups=1)
CONV_T = dict(stride=(2, 2, 2), padding=(1, 1, 1), dilation=(1, 1, 1), groups=1,
              output_padding=(1, 1, 1))


def _kernels(fn) -> set[str]:
    """The aten conv kernels ``fn`` runs."""
    with profile() as prof:
        fn()
    return {e.name for e in prof.events() if "conv" in e.name}


def _on_onednn(kernels: set[str]) -> bool:
    return "aten::mkldnn_convolution" in kernels and not any("slow" in k for k in kernels)


def _order(shape, w_shape, o, dtype=torch.float32):
    return onednn.kernel_order(shape, dtype, "cpu", w_shape, o["stride"], o["padding"],
                               o["dilation"], o["groups"], tuple(o.get("output_padding", ())))


def _backend(shape, w_shape, o):
    x, w = torch.empty(1).expand(shape), torch.empty(1).expand(w_shape)
    return str(torch._C._select_conv_backend(x, w, None, list(o["stride"]), list(o["padding"]),
                                             list(o["dilation"]), False, [0, 0, 0], o["groups"]))


def _operands(shape, w_shape, seed, out_channels=None):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64),
            torch.randn(w_shape, generator=g, dtype=torch.float64),
            torch.randn(out_channels or w_shape[0], generator=g, dtype=torch.float64))


def _close_to_truth(got, truth):
    torch.testing.assert_close(got.double(), truth, rtol=1e-4, atol=1e-4)


def test_private_query_exists():
    """The workaround silently turns itself off without it: say so here."""
    assert hasattr(torch._C, "_select_conv_backend"), \
        f"torch {torch.__version__} lacks torch._C._select_conv_backend: onednn.py is inert"


def test_direct_kernel_exists_and_runs_the_thin_block_as_it_lies():
    """A conv's forward calls torch.mkldnn_convolution (undocumented) on the block as
    it lies: oneDNN's kernel, no reordered view, no copy of the block or of the
    output, a contiguous output; torch's default runs im2col there."""
    assert onednn._DIRECT is torch.mkldnn_convolution, \
        f"torch {torch.__version__} lacks torch.mkldnn_convolution: forwards reorder instead"
    x, w, b = (t.float() for t in _operands(THIN, (3, 8, 3, 3, 3), 6))
    opts = (CONV["stride"], CONV["padding"], CONV["dilation"], CONV["groups"])
    with profile() as prof:
        out = onednn.local_conv(F.conv3d, x, w, b, *opts)
    names = {e.name for e in prof.events()}
    assert "aten::mkldnn_convolution" in names and not any("slow" in n for n in names)
    assert not names & {"aten::permute", "aten::copy_", "aten::to_mkldnn"}
    assert out.is_contiguous()
    _close_to_truth(out, F.conv3d(x.double(), w.double(), b.double(), *opts))


def test_thin_block_is_reordered_onto_onednn():
    w_shape = (3, 8, 3, 3, 3)
    assert "Slow" in _backend(THIN, w_shape, CONV)
    order = _order(THIN, w_shape, CONV)
    assert order == (2, 1, 0)
    reordered = tuple(THIN[:2]) + tuple(THIN[2 + o] for o in order)
    assert "Mkldnn" in _backend(reordered, w_shape, {**CONV, "padding": (1, 1, 0)})

    x, w, b = _operands(THIN, w_shape, 1)
    x32, w32, b32 = x.float(), w.float(), b.float()
    opts = (CONV["stride"], CONV["padding"], CONV["dilation"], CONV["groups"])
    default = lambda: F.conv3d(x32, w32, b32, *opts)  # noqa: E731
    ours = lambda: onednn.local_conv(F.conv3d, x32, w32, b32, *opts)  # noqa: E731
    assert any("slow_conv3d" in k for k in _kernels(default))
    assert _on_onednn(_kernels(ours))
    truth = F.conv3d(x, w, b, *opts)
    _close_to_truth(default(), truth)
    _close_to_truth(ours(), truth)


def test_transposed_thin_block_is_reordered():
    x, w, b = _operands((1, 8, 12, 16, 170), (8, 2, 3, 3, 3), 2, out_channels=2)
    o = CONV_T
    assert _order(tuple(x.shape), tuple(w.shape), o) == (2, 1, 0)
    args = (o["stride"], o["padding"], o["dilation"], o["groups"], o["output_padding"])
    x32, w32, b32 = x.float(), w.float(), b.float()
    default = _kernels(lambda: F.conv_transpose3d(x32, w32, b32, o["stride"], o["padding"],
                                                  o["output_padding"], o["groups"]))
    assert "aten::slow_conv_transpose3d" in default
    # torch records no aten op for its oneDNN transposed kernel: im2col's is gone
    assert not any("slow" in k for k in _kernels(
        lambda: onednn.local_conv(F.conv_transpose3d, x32, w32, b32, *args)))
    ours = onednn.local_conv(F.conv_transpose3d, x32, w32, b32, *args)
    truth = F.conv_transpose3d(x, w, b, o["stride"], o["padding"], o["output_padding"],
                               o["groups"], o["dilation"])
    _close_to_truth(ours, truth)


@pytest.mark.parametrize("shape,padding,path", [
    (THIN, (0, 1, 1), (2, 1, 0)),
    (NO_ORDER, (0, 0, 1), onednn.LAYOUT),
])
def test_selected_paths_match_torch_forward_and_backward(shape, padding, path):
    w_shape = (4, shape[1], 3, 3, 3)
    o = {**CONV, "padding": padding}
    assert _order(shape, w_shape, o) == path
    x, w, b = _operands(shape, w_shape, 3)
    opts = (o["stride"], o["padding"], o["dilation"], o["groups"])
    if path == onednn.LAYOUT:
        assert _on_onednn(_kernels(lambda: onednn.local_conv(F.conv3d, x.float(), w.float(),
                                                             b.float(), *opts)))
    truth_leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    truth = F.conv3d(*truth_leaves, *opts)
    grad = torch.randn(truth.shape, generator=torch.Generator().manual_seed(4),
                       dtype=torch.float64)
    truth.backward(grad)
    _close_to_truth(onednn.local_conv(F.conv3d, x.float(), w.float(), b.float(), *opts), truth)
    spec = SimpleNamespace(**o)
    got = onednn.local_conv_backward(grad.float(), x.float(), w.float(), spec,
                                     (True, True, True))
    for g, t in zip(got, truth_leaves):
        assert g.layout == torch.strided
        _close_to_truth(g, t.grad)


@pytest.mark.parametrize("shape,w_shape,dtype", [
    (NO_ORDER, (2, 4, 1, 1, 1), torch.float32),   # 1x1x1: im2col builds no columns
    (THIN, (3, 8, 3, 3, 3), torch.float64),       # only float32 is steered
    ((1, 8, 14, 170), (3, 8, 3, 3), torch.float32),  # only 3-D
])
def test_left_to_torch(shape, w_shape, dtype):
    nsp = len(shape) - 2
    o = dict(stride=(1,) * nsp, padding=(0,) * nsp, dilation=(1,) * nsp, groups=1)
    assert _order(shape, w_shape, o, dtype) is None
    x, w, b = (t.to(dtype) for t in _operands(shape, w_shape, 5))
    func = F.conv3d if nsp == 3 else F.conv2d
    args = (o["stride"], o["padding"], o["dilation"], 1)
    assert torch.equal(onednn.local_conv(func, x, w, b, *args), func(x, w, b, *args))


# -- whole or in pieces of output rows ------------------------------------------------------------
TUNED = (1, 4, 18, 10, 12)


@pytest.mark.parametrize("favour", ["pieces", "whole"])
def test_tuned_conv_keeps_the_faster_way(conv_tuning, favour):
    """The first call runs each way once, then times each twice, alternating, and
    keeps the faster; later calls run that way only, once."""
    state, ran = conv_tuning
    state["favour"] = favour
    x, w, b = (t.float() for t in _operands(TUNED, (3, 4, 3, 3, 3), 7))
    opts = (CONV["stride"], CONV["padding"], CONV["dilation"], CONV["groups"])
    truth = F.conv3d(x.double(), w.double(), b.double(), *opts)
    _close_to_truth(onednn.local_conv(F.conv3d, x, w, b, *opts), truth)
    assert len(ran) == 6 and ran[0::2] == [None] * 3
    assert state["alive"] == [0] * 6  # the timing holds one output at a time
    plan = ran[1]
    assert plan is not None and plan[0] == 2 and len(plan[1]) == 8
    assert plan[1][0][0] == 0 and plan[1][-1][1] == 16 and ran[3] == ran[5] == plan
    chosen = plan if favour == "pieces" else None
    assert list(onednn._CHOICES.values()) == [chosen]
    del ran[:]
    _close_to_truth(onednn.local_conv(F.conv3d, x, w, b, *opts), truth)
    assert ran == [chosen]


@pytest.mark.parametrize("w_shape,stride,padding,dilation,groups", [
    ((3, 4, 3, 3, 3), (1, 1, 1), (0, 1, 1), (1, 1, 1), 1),
    ((4, 2, 3, 2, 3), (2, 1, 2), (0, 0, 1), (1, 1, 1), 2),
    ((3, 4, 3, 3, 1), (1, 2, 1), (1, 0, 0), (2, 1, 1), 1),   # pieces along H
    ((2, 4, 2, 3, 3), (3, 1, 1), (0, 1, 1), (2, 2, 1), 1),
])
def test_conv_in_pieces_matches_torch(conv_tuning, w_shape, stride, padding, dilation, groups):
    """Pieces along the outermost spatial dim torch does not pad, under stride,
    dilation, groups and kernels of other sizes: torch's numbers (float32
    rounding of the float64 truth), every output row computed once."""
    state, ran = conv_tuning
    x, w, b = (t.float() for t in _operands(TUNED, w_shape, 8))
    opts = (stride, padding, dilation, groups)
    truth = F.conv3d(x.double(), w.double(), b.double(), *opts)
    _close_to_truth(onednn.local_conv(F.conv3d, x, w, b, *opts), truth)
    dim, rows = ran[1]
    assert dim == 2 + next(i for i, p in enumerate(padding) if p == 0)
    assert rows[0][0] == 0 and rows[-1][1] == truth.shape[dim]
    assert all(a[1] == c[0] for a, c in zip(rows, rows[1:]))
    _close_to_truth(onednn._in_pieces(F.conv3d, x, w, b, *opts, ran[1]), truth)


def test_conv_padded_on_every_dim_runs_whole(conv_tuning):
    """No dim torch leaves unpadded: no pieces, nothing timed."""
    state, ran = conv_tuning
    x, w, b = (t.float() for t in _operands(TUNED, (3, 4, 3, 3, 3), 9))
    opts = ((1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    _close_to_truth(onednn.local_conv(F.conv3d, x, w, b, *opts),
                    F.conv3d(x.double(), w.double(), b.double(), *opts))
    assert ran == [] and list(onednn._CHOICES.values()) == [None]


def test_small_convs_are_not_timed(monkeypatch):
    """Below ``_TUNE_CELLS`` input cells a conv runs whole with no timing."""
    monkeypatch.setattr(onednn, "_CHOICES", {})
    x, w, b = (t.float() for t in _operands(TUNED, (3, 4, 3, 3, 3), 10))
    assert x.numel() < onednn._TUNE_CELLS
    onednn.local_conv(F.conv3d, x, w, b, *(CONV[k] for k in ("stride", "padding", "dilation",
                                                           "groups")))
    assert onednn._CHOICES == {}


def test_tuning_switched_off_runs_whole(conv_tuning):
    """``set_conv_tuning(False)`` (DOMAINPAR_CONV_TUNING=0, or ``--compare``): a large
    conv runs whole, untimed; turned back on, it is timed."""
    state, ran = conv_tuning
    x, w, b = (t.float() for t in _operands(TUNED, (3, 4, 3, 3, 3), 11))
    opts = (CONV["stride"], CONV["padding"], CONV["dilation"], CONV["groups"])
    onednn.set_conv_tuning(False)
    try:
        onednn.local_conv(F.conv3d, x, w, b, *opts)
        assert ran == [] and onednn._CHOICES == {}
    finally:
        onednn.set_conv_tuning(True)
    onednn.local_conv(F.conv3d, x, w, b, *opts)
    assert len(ran) == 6


@pytest.mark.parametrize("value,ok", [("0", True), ("1", True), ("", True), ("yes", False)])
def test_tuning_setting_read_at_import(value, ok):
    """DOMAINPAR_CONV_TUNING: 0 off, 1 or unset on, anything else an error that
    names the variable and its values."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, DOMAINPAR_CONV_TUNING=value)
    run = subprocess.run([sys.executable, "-c", "import domainpar.ops.onednn as o; "
                          "print(o.TUNING)"], env=env, capture_output=True, text=True)
    if ok:
        assert run.returncode == 0 and run.stdout.strip() == str(value != "0")
    else:
        assert run.returncode != 0
        assert "DOMAINPAR_CONV_TUNING='yes': use 1, 0 or leave it unset" in run.stderr


def test_compare_switches_tuning_in_process(monkeypatch):
    """``bench ... --compare DOMAINPAR_CONV_TUNING=0`` turns it off in B's block
    and back on after it."""
    from domainpar.bench import settings
    monkeypatch.delenv("DOMAINPAR_CONV_TUNING", raising=False)
    assert onednn.TUNING
    with settings.applied({"DOMAINPAR_CONV_TUNING": "0"}):
        assert not onednn.TUNING
    assert onednn.TUNING


def test_choices_are_bounded(conv_tuning, monkeypatch):
    """A program whose shapes never repeat does not grow the choices without end."""
    monkeypatch.setattr(onednn, "_MAX_CHOICES", 2)
    opts = (CONV["stride"], CONV["padding"], CONV["dilation"], CONV["groups"])
    for rows in (18, 19, 20):
        x, w, b = (t.float() for t in _operands((1, 4, rows, 10, 12), (3, 4, 3, 3, 3), rows))
        onednn.local_conv(F.conv3d, x, w, b, *opts)
    assert len(onednn._CHOICES) == 1
