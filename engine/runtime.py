"""The hook runtime: the one way the engine attaches code to a model's hook points.

Extraction, generation capture and (next) interventions all run a model with a
:class:`HookRuntime`. It owns what they share:

* **Registration and removal.** :meth:`HookRuntime.attached` hooks each site's module (a
  forward pre-hook for sites that read the module's input, a forward hook otherwise) and
  removes every hook on the way out, also when the forward pass raises.
* **One vector per token.** Each visit checks that the value is ``[batch, tokens, ...]`` with
  the shape the pass declared (:meth:`HookRuntime.begin_pass`), so a module whose output is
  not per-token is refused with ``INVALID_HOOK`` rather than stored wrongly.
* **First call counts.** A module called twice in one pass is visited once.
* **Stop after the deepest hook.** With ``stop_when_complete``, the forward pass is aborted
  (a private exception, swallowed by :meth:`HookRuntime.run`) as soon as every hook point has
  been visited, so blocks after the deepest one never run.
* **Reading or editing.** The visitor gets ``(name, tensor)``; returning ``None`` leaves the
  model's value alone, returning a tensor of the same shape replaces it (add, replace,
  ablate) for the rest of the forward pass: the module's output, or the input it receives.

Also the helpers every run needs: the pad id, the grad-free mode and the smallest module to
call. Importable without torch (imported inside the functions) and without Django.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from engine.hooks import READ_INPUT, HookError, HookSite, base_model_path

__all__ = ["HookRuntime", "Visitor", "first_tensor", "grad_free_mode", "pad_token_id", "smallest_runner"]

# (hook point name, [batch, tokens, ...] tensor) -> None to leave it, or a replacement tensor.
Visitor = Callable[[str, Any], Any]


class _StopForward(Exception):
    """Raised from a hook once every hook point of the pass is visited, to skip the rest."""


class HookRuntime:
    """Hooks on ``sites`` that call ``visit`` once per hook point per forward pass.

    ``purpose`` ("extracted", "captured", ...) completes the ``INVALID_HOOK`` message.
    """

    def __init__(
        self, model: Any, sites: dict[str, HookSite], visit: Visitor, *, purpose: str, widens: bool = False
    ) -> None:
        self.model = model
        self.sites = sites
        self.visit = visit
        self.purpose = purpose
        # A replacement may stack several versions of the batch (rows a multiple of the batch's):
        # the rest of the pass then runs them all, their shared prefix computed once.
        self.widens = widens
        self.visited: set[str] = set()
        self._shape: tuple[int, int] | None = None
        self._stop_when_complete = False

    def begin_pass(self, batch: int, tokens: int, *, stop_when_complete: bool = False) -> None:
        """Declare the next forward pass: its ``[batch, tokens]`` input, and whether to stop it
        as soon as every hook point is visited (its later outputs are then not needed)."""
        self._shape = (batch, tokens)
        self._stop_when_complete = stop_when_complete
        self.visited = set()

    def missing(self) -> list[str]:
        """The hook points the last pass did not reach, in site order."""
        return [name for name in self.sites if name not in self.visited]

    @contextlib.contextmanager
    def attached(self) -> Iterator[HookRuntime]:
        """The hooks are on the model inside the block, and removed when it ends (however)."""
        modules = dict(self.model.named_modules())
        handles = []
        try:
            for name, site in self.sites.items():
                handles.append(self._register(modules[site.module_path], name, site))
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _fits(self, replacement: Any, tensor: Any) -> bool:
        if tuple(replacement.shape) == tuple(tensor.shape):
            return True
        return (
            self.widens
            and tuple(replacement.shape[1:]) == tuple(tensor.shape[1:])
            and replacement.shape[0] % tensor.shape[0] == 0
        )

    def run(self, forward: Callable[..., Any], /, **arguments: Any) -> Any:
        """``forward(**arguments)``; None when the pass was stopped after its last hook point."""
        try:
            return forward(**arguments)
        except _StopForward:
            return None

    def _register(self, module: Any, name: str, site: HookSite) -> Any:
        if site.reads == READ_INPUT:

            def pre_hook(module: Any, args: tuple, kwargs: dict) -> Any:
                replacement = self._take(name, _forward_input(args, kwargs))
                return None if replacement is None else _with_input(args, kwargs, replacement)

            return module.register_forward_pre_hook(pre_hook, with_kwargs=True)

        def hook(module: Any, args: tuple, output: Any) -> Any:
            replacement = self._take(name, first_tensor(output))
            return None if replacement is None else _with_first_tensor(output, replacement)

        return module.register_forward_hook(hook)

    def _take(self, name: str, tensor: Any) -> Any:
        if name in self.visited:  # a module called twice in one pass: the first call counts
            return None
        if tensor is None or tensor.dim() < 2 or tuple(tensor.shape[:2]) != self._shape:
            raise HookError(
                "INVALID_HOOK",
                f"Hook point {name} does not give one vector per token, so it cannot be {self.purpose}.",
                {"invalid": [name]},
            )
        replacement = self.visit(name, tensor)
        if replacement is not None and not self._fits(replacement, tensor):
            raise HookError(
                "INVALID_HOOK",
                f"A replacement for {name} must keep its shape {tuple(tensor.shape)}.",
                {"invalid": [name]},
            )
        self.visited.add(name)
        if self._stop_when_complete and len(self.visited) == len(self.sites):
            raise _StopForward
        return replacement


def first_tensor(value: Any) -> Any:
    """The tensor a module's output (or input) stands for: itself, or the first tensor of a tuple."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "to_tuple"):  # a transformers ModelOutput
        value = value.to_tuple()
    if isinstance(value, (tuple, list)):
        return next((item for item in value if isinstance(item, torch.Tensor)), None)
    return None


def _forward_input(args: tuple, kwargs: dict) -> Any:
    if args:
        return first_tensor(args[0])
    if "hidden_states" in kwargs:
        return first_tensor(kwargs["hidden_states"])
    return first_tensor(tuple(kwargs.values()))


def _with_first_tensor(value: Any, replacement: Any) -> Any:
    """``value`` with the tensor :func:`first_tensor` found in it replaced."""
    import torch

    if isinstance(value, torch.Tensor):
        return replacement
    if isinstance(value, (tuple, list)):
        items = list(value)
        index = next(index for index, item in enumerate(items) if isinstance(item, torch.Tensor))
        items[index] = replacement
        return type(value)(items) if isinstance(value, list) else tuple(items)
    # A transformers ModelOutput: its first set field is the tensor first_tensor returned.
    key = next(key for key, item in value.items() if isinstance(item, torch.Tensor))
    value[key] = replacement
    return value


def _with_input(args: tuple, kwargs: dict, replacement: Any) -> tuple[tuple, dict]:
    if args:
        return (_with_first_tensor(args[0], replacement), *args[1:]), kwargs
    key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
    return args, {**kwargs, key: _with_first_tensor(kwargs[key], replacement)}


def pad_token_id(model: Any, override: int | None = None) -> int:
    """The id to put in padded positions: ``override``, else the model's pad or EOS id, else 0.

    Pad ids only fill masked positions, so any valid id does; the model's own is tidiest.
    """
    if override is not None:
        return int(override)
    config = model.config
    for candidate in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(candidate, int) and not isinstance(candidate, bool):
            return candidate
    return 0


def smallest_runner(model: Any, sites: Any) -> Any:
    """The smallest module to call: the base model when every hooked module lies inside it
    (so the LM head never runs), else the whole model."""
    base = base_model_path(model)
    if base and all(site.module_path.startswith(base + ".") for site in sites):
        return model.get_submodule(base)
    return model


def grad_free_mode(model: Any) -> Callable[[], Any]:
    """``torch.inference_mode``, or ``torch.no_grad`` for bitsandbytes models.

    bitsandbytes repacks 4-bit weights into its CPU layout on their first forward; under
    inference_mode they would become inference tensors, which later gradient-based analyses of
    the same loaded model cannot use (see :func:`engine.loading.warm_up`).
    """
    import torch

    if any(type(module).__module__.startswith("bitsandbytes") for module in model.modules()):
        return torch.no_grad
    return torch.inference_mode
