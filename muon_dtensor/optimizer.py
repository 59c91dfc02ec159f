"""``muon_dtensor.Muon``: torch.optim.Muon's contract on plain tensors and DTensors, plus AdamW groups.

The class is a thin shell: validation lives in ``validation``, the update rules in ``update`` and
``newton_schulz``, who-does-what in ``plan``, data movement in ``exchange`` and ``comm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer, ParamsT

from ._sharding.comm import CommStats, sum_over_mesh
from .functional import Domain, MuonHyper, build_domains, muon_step
from .newton_schulz import DEFAULT_COEFFICIENTS, NSConfig, resolve_ns_config
from ._sharding.param_layout import ParamLayout, describe, local_grad, local_of
from ._sharding.plan import DEFAULT_ROUND_BYTES
from .elementwise import adamw_update
from .validation import (
    PreflightItem,
    check_adamw_group,
    check_muon_group,
    check_muon_param,
    check_param,
    preflight,
)
from ._sharding.views import View, matrix_views

__all__ = ["ADAMW_DEFAULTS", "Muon"]

# torch.optim.Muon's defaults (KellerJordan/Muon); kept identical so Muon is a drop-in.
EPS = 1e-7
DEFAULT_NS_STEPS = 5
# torch.optim.AdamW's defaults, used by groups with "algorithm": "adamw" for keys they leave out.
ADAMW_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"ns_dtype must be torch.bfloat16 or torch.float32 but is: {dtype}")
    return name


class Muon(Optimizer):
    """Muon (momentum orthogonalized by Newton-Schulz) for plain tensors and DTensors.

    Args:
        params: parameters, named parameters or param groups. A group may set ``"algorithm"`` to
            ``"muon"`` (default) or ``"adamw"``; AdamW groups take ``lr, betas, eps, weight_decay``
            with torch.optim.AdamW's meaning and defaults (betas (0.9, 0.999), eps 1e-8, wd 0.01).
        lr: learning rate (default: 1e-3).
        weight_decay: decoupled weight decay, tied to lr (default: 0.1).
        momentum: momentum factor (default: 0.95).
        nesterov: Nesterov momentum (default: True).
        ns_coefficients: (a, b, c) for every iteration, a list of per-iteration triples, or a preset
            name: "keller", "you", "polar_express" (default: (3.4445, -4.7750, 2.0315)).
        eps: floor of the norm the Newton-Schulz input is divided by (default: 1e-7).
        ns_steps: Newton-Schulz iterations (default: 5).
        adjust_lr_fn: None or "original" (sqrt(max(1, rows/cols))), or "match_rms_adamw"
            (0.2 sqrt(max(rows, cols))), from the global shape (default: None).
        ns_dtype: Newton-Schulz and transfer dtype, torch.bfloat16 (default) or torch.float32.
        mode: "owner" (each matrix orthogonalized once, on a balanced owner rank; default) or
            "gather" (every rank gathers and orthogonalizes every matrix; for comparison).
        process_group: for plain (non-DTensor) parameters replicated across ranks, as under DDP:
            the ranks that hold them. Newton-Schulz work is then split over these ranks and the
            results all-gathered. Without it plain tensors are stepped locally.
        max_round_bytes: bytes of full matrices one exchange round carries (at least one matrix per
            rank; None: one round). Rounds are pipelined, so this bounds the exchange buffers and
            sets the overlap grain (default 4 MiB: fastest of 1 to 16 MiB and one round, measured
            on the 8 x 512 set at 2 CPU ranks, docs/benchmarks.md).

    Per-group options beyond torch's: ``"flatten": True`` treats a conv weight ``(out, in, *k)`` as
    one ``(out, in*prod(k))`` matrix; ``"experts": True`` treats a 3-D ``[E, m, n]`` parameter as E
    matrices; ``"split_sizes": [...]`` orthogonalizes row blocks separately (fused q, k, v).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = DEFAULT_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        mode: str = "owner",
        process_group: Any = None,
        max_round_bytes: int | None = DEFAULT_ROUND_BYTES,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": _dtype_name(ns_dtype),
            "mode": mode,
            "flatten": False,
            "experts": False,
            "split_sizes": None,
            "max_round_bytes": max_round_bytes,
        }
        check_muon_group(defaults)
        resolve_ns_config(ns_coefficients, ns_steps, eps)
        self._layouts: dict[Tensor, ParamLayout] = {}
        self._views: dict[Tensor, list[View]] = {}
        self._plans: dict[tuple, list[Domain]] = {}
        self._process_group = process_group
        self.comm_stats = CommStats()
        super().__init__(params, defaults)

    # ----------------------------------------------------------------- groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        algorithm = param_group.setdefault("algorithm", "muon")
        if algorithm not in ("muon", "adamw"):
            raise ValueError(f"algorithm should be 'muon' or 'adamw' but is: {algorithm!r}")
        if algorithm == "adamw":
            for key, value in ADAMW_DEFAULTS.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._init_group_state(group, len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()
            raise

    def _init_group_state(self, group: dict[str, Any], index: int) -> None:
        if group["algorithm"] == "muon":
            check_muon_group(group)
            group["ns_dtype"] = _dtype_name(group["ns_dtype"])
            resolve_ns_config(group["ns_coefficients"], group["ns_steps"], group["eps"])
        else:
            check_adamw_group(group)
        names = self._names(group, index)
        meshes = {}
        for p, name in zip(group["params"], names):
            meshes.setdefault(p.device_mesh if isinstance(p, DTensor) else None, name)
            if group["algorithm"] == "adamw":
                check_param(p, name)
                continue
            check_muon_param(p, name, flatten=group["flatten"], experts=group["experts"])
        if len(meshes) > 1:
            found = ", ".join(f"'{n}' on {m or 'no mesh (a plain tensor)'}" for m, n in meshes.items())
            raise ValueError(
                f"one param group holds parameters on different meshes ({found}); "
                "put the parameters of each mesh in a param group of their own"
            )
        self._describe_all(group, names)
        for p in group["params"]:
            self._ensure_state(group, p)

    def _describe_all(self, group: dict[str, Any], names: list[str]) -> None:
        """Layouts and views of a Muon group's parameters. The one check that can differ between
        ranks (a local shape) is agreed on over each mesh, so every rank raises together."""
        if group["algorithm"] != "muon":
            return
        error: Exception | None = None
        for p, name in zip(group["params"], names):
            try:
                layout = describe(p, name, self._process_group)
                self._layouts[p] = layout
                self._views[p] = matrix_views(
                    p.shape,
                    layout.blocks,
                    layout.rank,
                    name=name,
                    flatten=group["flatten"],
                    experts=group["experts"],
                    split_sizes=group["split_sizes"],
                )
            except ValueError as e:
                error = error or e
        meshes = {p.device_mesh: None for p in group["params"] if isinstance(p, DTensor)}
        failed = sum(int(sum_over_mesh(torch.tensor([int(error is not None)]), m)) for m in meshes)
        if error is not None:
            raise error
        if failed:
            raise ValueError(
                f"building the optimizer failed on {failed} other rank(s) for a parameter of this "
                "group; their error names it (a local shard that does not match its placements)"
            )

    def _ensure_state(self, group: dict[str, Any], p: Tensor) -> None:
        """Create state eagerly, so every rank has the same keys even before the first step and a
        checkpoint at step 0 (or of a parameter that never got a gradient) is complete."""
        state = self.state[p]
        if group["algorithm"] == "muon":
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _names(self, group: dict[str, Any], index: int) -> list[str]:
        if "param_names" in group:
            return list(group["param_names"])
        return [f"param_groups[{index}]['params'][{i}]" for i in range(len(group["params"]))]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._plans.clear()
        for group in self.param_groups:
            for p in group["params"]:
                self._ensure_state(group, p)

    # ----------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        configs = [self._check_group(g) for g in self.param_groups]
        items, where = [], []
        for gi, group in enumerate(self.param_groups):
            for pi, (p, name) in enumerate(zip(group["params"], self._names(group, gi))):
                items.append(PreflightItem(name, p, p.grad, self._scope(group, p)))
                where.append((gi, pi))
        present = preflight(items)
        for gi, group in enumerate(self.param_groups):
            todo = [pi for (g, pi), ok in zip(where, present) if g == gi and ok]
            if not todo:
                continue
            for pi in todo:
                self._ensure_state(group, group["params"][pi])
            if group["algorithm"] == "adamw":
                self._adamw_step(group, todo)
            else:
                self._muon_step(group, gi, todo, configs[gi])
        return loss

    def _scope(self, group: dict[str, Any], p: Tensor) -> Any:
        """Who must agree about this parameter's gradient: its mesh, the DDP group, or nobody."""
        if isinstance(p, DTensor):
            return p.device_mesh
        return self._process_group if group["algorithm"] == "muon" else None

    def _check_group(self, group: dict[str, Any]) -> NSConfig | None:
        """Local checks of hyperparameters a user or scheduler may have changed since __init__."""
        if group["algorithm"] == "adamw":
            check_adamw_group(group)
            return None
        check_muon_group(group)
        dtype = _DTYPES[_dtype_name(group["ns_dtype"])]
        return resolve_ns_config(group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)

    def _domains(self, group: dict[str, Any], gi: int, todo: list[int]) -> list[Domain]:
        key = (gi, tuple(todo), group["mode"], group["max_round_bytes"])
        if key not in self._plans:
            params = [group["params"][pi] for pi in todo]
            self._plans[key] = build_domains(
                [self._layouts[p] for p in params],
                [self._views[p] for p in params],
                group["mode"],
                group["max_round_bytes"],
            )
        return self._plans[key]

    def _muon_step(self, group: dict[str, Any], gi: int, todo: list[int], config: NSConfig) -> None:
        params = [group["params"][pi] for pi in todo]
        hyper = MuonHyper(
            float(group["lr"]),
            group["weight_decay"],
            group["momentum"],
            group["nesterov"],
            group["adjust_lr_fn"],
        )
        muon_step(
            [local_of(p) for p in params],
            [local_grad(p) for p in params],
            [local_of(self.state[p]["momentum_buffer"]) for p in params],
            [self._views[p] for p in params],
            self._domains(group, gi, todo),
            hyper,
            config,
            self.comm_stats,
        )

    def _adamw_step(self, group: dict[str, Any], todo: list[int]) -> None:
        for pi in todo:
            p = group["params"][pi]
            state = self.state[p]
            state["step"] += 1
            adamw_update(
                local_of(p),
                local_grad(p),
                local_of(state["exp_avg"]),
                local_of(state["exp_avg_sq"]),
                step=int(state["step"].item()),
                lr=float(group["lr"]),
                betas=tuple(group["betas"]),
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )
