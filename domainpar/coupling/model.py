"""Model: a domain-parallel torch model loaded from an entry point, run on fields.

Entry points:
- ``"package.module:factory"``: imported with the interpreter's ``sys.path``
  (the venv's site-packages, plus ``PYTHONPATH``);
- ``"/path/to/file.py:factory"``: a module loaded from that file, so a
  simulation can ship its surrogate next to its sources without packaging it.

The factory is called with the keyword arguments given as JSON and must return a
``torch.nn.Module`` that runs on DomainTensors. The seed is set before the call
and the parameters are broadcast from rank 0 (``DomainParallel``), so every rank
holds the same replicated model whatever the factory does.

- ``"/path/to/model.pt"`` (also .pth, .ts, .torchscript): a TorchScript file,
  run block by block with a halo (``scripted.Blockwise``: periodic grids only,
  and the option ``halo``, the model's receptive-field radius, is required),
  since scripted ops bypass the dispatch that runs DomainTensors.

Options (JSON): ``optimizer`` (a name, or ``{"name": ..., **kwargs}`` for
torch.optim: sgd, adam, adamw, rmsprop; none means inference only), ``loss``
(mse, l1, smooth_l1; default mse), ``dtype`` (float32/float64: the parameters
are converted), ``device`` (cpu or cuda), ``seed`` (default 0), ``halo``
(TorchScript models only).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..comm.grid import ProcessGrid
from .errors import ARGUMENT, IMPORT, IO, MODEL, STATE, CouplingError, Stage, agree_equal, describe
from .scripted import Blockwise

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
              "rmsprop": torch.optim.RMSprop}
LOSSES = {"mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
_OPTION_KEYS = {"optimizer", "loss", "dtype", "device", "seed", "halo"}
SCRIPT_SUFFIXES = (".pt", ".pth", ".ts", ".torchscript")


def parse_json(text: str | None, what: str) -> dict:
    """Local. A JSON object from a C string; empty or NULL means {}."""
    if not text or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CouplingError(ARGUMENT, f"{what} is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise CouplingError(ARGUMENT, f"{what} must be a JSON object, got {text!r}")
    return value


def resolve(entry: str):
    """Local. The callable an entry point names; IMPORT if there is none."""
    if entry and Path(entry).suffix in SCRIPT_SUFFIXES:
        return _script_loader(entry)
    module_name, sep, attr = (entry or "").rpartition(":")
    if not sep or not module_name or not attr:
        raise CouplingError(IMPORT, f"entry point {entry!r}: expected 'package.module:factory' "
                                    f"or '/path/to/file.py:factory'")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no file {module_name}")
            name = f"_domainpar_entry_{abs(hash(str(path.resolve())))}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"{module_name} cannot be loaded as a module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses and pickling look modules up here
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - ImportError, SyntaxError, errors at import
        # Where importlib gave up says nothing; where the module itself raised does.
        why = (f"{type(exc).__name__}: {exc}" if isinstance(exc, (ImportError, OSError))
               else describe(exc))
        raise CouplingError(IMPORT, f"entry point {entry!r} does not import: {why}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CouplingError(IMPORT, f"entry point {entry!r}: module {module_name!r} has "
                                        f"no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CouplingError(IMPORT, f"entry point {entry!r} names a {type(obj).__name__}, "
                                    f"not a callable")
    return obj


def _script_loader(path: str):
    """A factory loading the TorchScript file (checked here, so that a missing or
    broken file is an IMPORT error like a module that does not import)."""
    try:
        scripted = torch.jit.load(path, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - RuntimeError, ValueError, OSError from torch
        raise CouplingError(IMPORT, f"TorchScript file {path!r} does not load: "
                                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                            ) from None

    def factory(**kwargs):
        if kwargs:
            raise CouplingError(ARGUMENT, f"a TorchScript model takes no keyword arguments; "
                                          f"got {sorted(kwargs)}")
        return scripted
    return factory


class Model:
    """Collective to create (``Model.load``). A replicated model, its optimizer and
    loss, run on Fields of one grid."""

    # Set by ``load`` (and the helpers it runs), not by __init__.
    grid: ProcessGrid
    kwargs: dict[str, Any]
    options: dict[str, Any]
    loss_fn: Callable[..., torch.Tensor]
    dtype: torch.dtype | None
    device: torch.device
    seed: int
    module: torch.nn.Module  # the DomainParallel wrapper
    inner: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    steps: int
    broken: str | None

    @classmethod
    def load(cls, grid: ProcessGrid, entry: str, kwargs_json: str | None,
             options_json: str | None) -> Model:
        """Collective over ``grid``. The model from factory ``entry`` (``module:function``)
        called with ``kwargs_json``, wrapped in DomainParallel, with the optimizer and
        loss of ``options_json``; a problem on any rank raises on every rank."""
        from ..nn import DomainParallel
        stage = Stage(grid.comm)
        self = cls.__new__(cls)
        self.grid = grid
        stage.run(ARGUMENT, self._options, kwargs_json, options_json)
        stage.agree()
        # Different options or keyword arguments would make replicas diverge silently.
        agree_equal(grid.comm, json.dumps([self.kwargs, self.options], sort_keys=True,
                                          default=str),
                    "the model's keyword arguments and options")
        factory = stage.run(IMPORT, resolve, entry)
        stage.agree()
        module = stage.run(MODEL, self._build, factory)
        stage.agree()
        # Collective: the broadcast from rank 0 makes every rank's copy equal.
        self.module = stage.run(MODEL, DomainParallel, module, grid, overlap=False)
        stage.agree()
        self.inner = module
        self.optimizer = stage.run(ARGUMENT, self._optimizer)
        stage.agree()
        self.steps = 0
        self.broken = None
        return self

    def _options(self, kwargs_json, options_json):
        self.kwargs = parse_json(kwargs_json, "the factory's keyword arguments")
        options = parse_json(options_json, "the model options")
        unknown = set(options) - _OPTION_KEYS
        if unknown:
            raise CouplingError(ARGUMENT, f"unknown model options {sorted(unknown)}; known: "
                                          f"{sorted(_OPTION_KEYS)}")
        self.options = options
        loss = options.get("loss", "mse")
        if loss not in LOSSES:
            raise CouplingError(ARGUMENT, f"loss {loss!r}: use one of {sorted(LOSSES)}")
        self.loss_fn = LOSSES[loss]
        dtype = options.get("dtype")
        if dtype is not None and dtype not in DTYPES:
            raise CouplingError(ARGUMENT, f"dtype {dtype!r}: use one of {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype] if dtype is not None else None
        self.device = torch.device(options.get("device", "cpu"))
        self.seed = int(options.get("seed", 0))

    def _build(self, factory):
        torch.manual_seed(self.seed)
        module = factory(**self.kwargs)
        if not isinstance(module, torch.nn.Module):
            raise CouplingError(MODEL, f"the factory returned a {type(module).__name__}, not a "
                                       f"torch.nn.Module")
        if isinstance(module, torch.jit.ScriptModule):
            module = Blockwise(module, self.options.get("halo"), self.grid)
        elif "halo" in self.options:
            raise CouplingError(ARGUMENT, "the option \"halo\" is for TorchScript models; a "
                                          "Python model runs on DomainTensors, which need none")
        return module.to(device=self.device, dtype=self.dtype)

    def _optimizer(self):
        spec = self.options.get("optimizer")
        if spec in (None, "", "none"):
            return None
        spec = {"name": spec} if isinstance(spec, str) else dict(spec)
        name = str(spec.pop("name", "")).lower()
        if name not in OPTIMIZERS:
            raise CouplingError(ARGUMENT, f"optimizer {name!r}: use one of {sorted(OPTIMIZERS)}")
        try:
            return OPTIMIZERS[name](self.inner.parameters(), **spec)
        except (TypeError, ValueError) as exc:
            raise CouplingError(ARGUMENT, f"optimizer {name!r} with {spec}: {exc}") from None

    # -- running (collective: the model's ops communicate) ------------------------------
    def _check_input(self, *tensors) -> None:
        """Local. ARGUMENT for a field whose dtype or device is not the model's."""
        param = next(self.inner.parameters(), None)
        for t in tensors:
            if param is not None and (t.dtype != param.dtype or t.device != param.device):
                raise CouplingError(ARGUMENT, f"a field of {t.dtype} on {t.device} meets a "
                                              f"model of {param.dtype} on {param.device} "
                                              f"(the option \"dtype\" converts the model)")

    def _check_usable(self) -> None:
        """Local (the flag is set on every rank alike)."""
        if self.broken:
            raise CouplingError(STATE, self.broken)

    def infer(self, x, out_field) -> None:
        """Collective. ``out_field`` <- model(x), in eval mode without autograd."""
        stage = Stage(self.grid.comm)
        stage.run(ARGUMENT, self._check_usable)
        stage.run(ARGUMENT, self._check_input, x)
        stage.agree()

        def forward():
            self.module.eval()
            with torch.no_grad():
                return self.module(x)
        y = stage.run(MODEL, forward)
        stage.agree()
        stage.run(MODEL, out_field.write, y)
        stage.agree()

    def train_step(self, x, target) -> float:
        """Collective. One optimizer step on loss(model(x), target); returns the
        loss before the step (replicated, the same on every rank).

        The step is taken only once every rank's backward (and so the gradient
        reduction) completed: a failure before it leaves the parameters as they
        were on every rank (DomainParallel renews its reducer at the next
        forward). An optimizer step that failed on any rank may have changed
        some parameters: the model then refuses every call until
        dp_model_restore, rather than run on replicas that may differ."""
        stage = Stage(self.grid.comm)
        stage.run(ARGUMENT, self._check_usable)
        if self.optimizer is None:
            stage.fail(ARGUMENT, "this model was loaded without an optimizer (option "
                                 "\"optimizer\"): it can only infer")
        stage.run(ARGUMENT, self._check_input, x, target)
        stage.agree()
        optimizer = self.optimizer
        assert optimizer is not None  # else stage.agree raised, on every rank

        def forward():
            self.module.train()
            optimizer.zero_grad(set_to_none=True)
            return self.module(x)
        # Agreed between forward and the rest: the loss and backward communicate,
        # so a forward that failed on some ranks only must stop every rank here.
        y = stage.run(MODEL, forward)
        stage.agree()

        def backward():
            loss = self.loss_fn(y, target)
            loss.backward()
            return float(loss.detach())
        loss = stage.run(MODEL, backward)
        try:
            stage.agree()
        except CouplingError:
            optimizer.zero_grad(set_to_none=True)
            raise
        stage.run(MODEL, optimizer.step)
        try:
            stage.agree()
        except CouplingError as exc:
            self.broken = (f"the model's optimizer step failed ({exc}), so its replicas may "
                           f"differ between ranks: dp_model_restore a checkpoint first")
            raise
        self.steps += 1
        return loss
    # -- checkpoints --------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Collective. Rank 0 writes parameters, buffers, optimizer state and the step
        count (replicated: one copy is the whole model); written to a temporary
        name first, so a crash never leaves a torn checkpoint under ``path``."""
        stage = Stage(self.grid.comm)
        if self.grid.rank == 0:
            def write():
                state = {"model": self.inner.state_dict(), "steps": self.steps,
                         "optimizer": self.optimizer.state_dict() if self.optimizer else None}
                tmp = f"{path}.tmp{os.getpid()}"
                torch.save(state, tmp)
                os.replace(tmp, path)
            stage.run(IO, write)
        stage.agree()

    def load_checkpoint(self, path: str) -> None:
        """Collective. Rank 0 reads ``path`` and broadcasts it, so only rank 0 needs
        to see the file; every rank then loads the same state."""
        stage = Stage(self.grid.comm)
        state = None
        if self.grid.rank == 0:
            state = stage.run(IO, torch.load, path, map_location="cpu", weights_only=True)
        stage.agree()
        state = self.grid.comm.bcast(state, root=0)

        def apply():
            self.broken = None
            self.inner.load_state_dict(state["model"])
            if self.optimizer is not None and state.get("optimizer") is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            self.steps = int(state.get("steps", 0))
        stage.run(MODEL, apply)
        stage.agree()
