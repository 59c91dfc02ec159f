"""``muon_dtensor.Muon``: torch.optim.Muon's contract on plain tensors and DTensors, plus AdamW groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim.optimizer import Optimizer, ParamsT

from . import agreement, validation
from ._sharding.comm import CommStats
from ._sharding.domains import ViewOptions
from ._sharding.param_layout import local_grad, local_of, relayout, row_state_zeros
from ._sharding.plan import DEFAULT_ROUND_BYTES
from .functional import MuonHyper, adamw_step, muon_step
from .newton_schulz import DEFAULT_COEFFICIENTS, NSCoefficients, NSConfig
from .normuon import DEFAULT_BETA2
from .policy import SplitPolicy, node_size
from .sharding import GroupSharding

__all__ = ["ADAMW_DEFAULTS", "Muon"]

# torch.optim.AdamW's defaults, used by groups with "algorithm": "adamw" for keys they leave out.
ADAMW_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
# torch.optim.Muon's arguments, in its order; then ours.
_TORCH_KEYS = "lr weight_decay momentum nesterov ns_coefficients eps ns_steps adjust_lr_fn".split()  # noqa: SIM905
_VIEW_DEFAULTS: dict[str, Any] = {"flatten": False, "experts": False, "split_sizes": None, "head_dim": None}
# NorMuon (arXiv 2510.05491), off by default; beta2 is the official implementation's default.
_NORMUON_DEFAULTS: dict[str, Any] = {"normuon": False, "beta2": DEFAULT_BETA2}
_SECOND = "second_momentum_buffer"  # NorMuon's state key, the official implementation's name


class Muon(Optimizer):
    r"""Muon (momentum orthogonalized by Newton-Schulz) for plain tensors and DTensors.

    The algorithm of torch.optim.Muon, per 2-D matrix :math:`\theta` with gradient :math:`g_t`::

        B_t   = mu B_{t-1} + (1 - mu) g_t                     (momentum buffer, "momentum_buffer")
        X_t   = (1 - mu) g_t + mu B_t  if nesterov else B_t
        O_t   = NS_(a,b,c)^k(X_t / max(||X_t||_F, eps))     (k Newton-Schulz steps, once per matrix)
        theta = theta (1 - lr wd) - AdjustLR(lr, global shape) O_t

    On DTensors each full matrix is assembled on one owner rank, orthogonalized there and sent back
    in pieces; the result equals the one-process step bit for bit. AdamW groups follow torch.optim.AdamW.

    Args:
        params: parameters, named parameters or param groups. A group may set ``"algorithm"`` to
            ``"muon"`` (default) or ``"adamw"``; AdamW groups take ``lr, betas, eps, weight_decay``
            with torch.optim.AdamW's meaning and defaults (``ADAMW_DEFAULTS``).
        lr: learning rate (default: 1e-3).
        weight_decay: decoupled weight decay, tied to lr (default: 0.1).
        momentum: momentum factor (default: 0.95).
        nesterov: Nesterov momentum (default: True).
        ns_coefficients: (a, b, c) for every iteration, a list of per-iteration triples, or a preset
            name: "keller", "you", "polar_express" (default: (3.4445, -4.7750, 2.0315)).
        eps: floor of the norm the Newton-Schulz input is divided by (default: 1e-7).
        ns_steps: Newton-Schulz iterations (default: 5).
        adjust_lr_fn: None or "original" (sqrt(max(1, rows/cols))), "match_rms_adamw"
            (0.2 sqrt(max(rows, cols))), "spectral" (sqrt(rows/cols)), or a number r, the update
            RMS to match (r sqrt(max(rows, cols))); from the global shape (default: None).
        ns_dtype: Newton-Schulz and transfer dtype, torch.bfloat16 (default) or torch.float32.
        ns_algorithm: "standard" (torch's iteration; default) or "gram" (the same polynomial on the
            small Gram matrix, with restarts; it runs where it needs fewer flops, with 5 steps on
            matrices whose long side is over 1.5x the short one, the others run "standard").
        mode: "owner" (each matrix orthogonalized once, on a balanced owner rank; default) or
            "gather" (every rank gathers and orthogonalizes every matrix; for comparison).
        process_group: the ranks that hold replicated plain parameters (DDP); they split the
            Newton-Schulz work. Without it plain tensors are stepped locally.
        max_round_bytes: bytes of full matrices one pipelined exchange round carries, at least one
            matrix per rank; None: one round (default: 4 MiB, docs/benchmarks.md).
        owners: for parameters a mesh both shards and replicates (HSDP): "mesh" (each matrix
            orthogonalized once among all ranks of the mesh, results sent to every replica),
            "replica" (once in every replica group, no traffic between replicas) or "auto" (the
            cost model picks per mesh; default). Also a per-group key.
        ns_split: "off" (default), "auto" or a rank count k: run a matrix's Newton-Schulz over
            several ranks of its exchange group (``muon_dtensor.split_ns``), where the cost model
            says it pays ("auto") or for every matrix over min(k, group size) ranks. The one
            option under which a sharded step is not bitwise the one-process step: it equals
            ``split_orthogonalize`` bitwise and the unsplit iteration within bf16 rounding
            (docs/design.md). Standard iteration, owner mode, no NorMuon. Also a per-group key.

    Per-group options beyond torch's: ``"flatten": True`` treats a conv weight ``(out, in, *k)`` as
    one ``(out, in*prod(k))`` matrix; ``"experts": True`` treats a 3-D ``[E, m, n]`` parameter as E
    matrices; ``"split_sizes": [...]`` orthogonalizes row blocks separately (fused q, k, v);
    ``"head_dim": d`` orthogonalizes each head's block of d rows separately (within each split);
    ``"normuon": True`` normalizes each row of the orthogonalized update by a running second moment
    (NorMuon, arXiv 2510.05491; decay ``"beta2"``, default 0.95; state ``"second_momentum_buffer"``),
    computed exactly on the owner of the whole matrix (``muon_dtensor.normuon``).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: NSCoefficients = DEFAULT_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | float | None = None,
        *,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        ns_algorithm: str = "standard",
        mode: str = "owner",
        process_group: ProcessGroup | None = None,
        max_round_bytes: int | None = DEFAULT_ROUND_BYTES,
        owners: str = "auto",
        ns_split: str | int = "off",
    ) -> None:
        values = (lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)
        defaults = dict(
            zip(_TORCH_KEYS, values),
            **_VIEW_DEFAULTS,
            **_NORMUON_DEFAULTS,
            ns_algorithm=ns_algorithm,
            mode=mode,
            max_round_bytes=max_round_bytes,
            owners=owners,
            ns_split=ns_split,
        )
        defaults["ns_dtype"] = validation.ns_dtype_name(ns_dtype)
        validation.check_muon_group(defaults)
        self._process_group = process_group
        self._shardings: dict[int, tuple[tuple, GroupSharding]] = {}
        self._params: dict[int, list[Tensor]] = {}  # each group's parameters as last seen
        self.comm_stats = CommStats()
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if validation.check_algorithm(param_group) == "adamw":
            param_group.update({k: v for k, v in ADAMW_DEFAULTS.items() if k not in param_group})
        super().add_param_group(param_group)
        group, index = self.param_groups[-1], len(self.param_groups) - 1
        try:  # local checks only: collectives wait for the first step, once every rank agrees
            validation.check_flags(group, index)
            if validation.check_group(group) is not None:
                group["ns_dtype"] = validation.ns_dtype_name(group["ns_dtype"])
            validation.check_params(group, validation.param_names(group, index))
        except Exception:
            self.param_groups.pop()
            raise
        for p in group["params"]:
            self._init_state(group, p)
        self._params[index] = list(group["params"])

    def _follow_replaced_params(self) -> None:
        """Parameters replaced in place in ``param_groups`` (accelerate and HF Trainer swap in the
        DTensors ``fully_shard`` made) take over their predecessors' state, laid out like them."""
        for index, group in enumerate(self.param_groups):
            for old, new in zip(self._params.get(index, []), group["params"]):
                if old is not new and old in self.state and new not in self.state:
                    self.state[new] = {k: relayout(v, old, new) for k, v in self.state.pop(old).items()}
            self._params[index] = list(group["params"])

    def state_dict(self) -> dict[str, Any]:
        self._follow_replaced_params()
        return super().state_dict()

    def _init_state(self, group: dict[str, Any], p: Tensor) -> None:
        """Create state eagerly, so every rank has the same keys even before the first step and a
        checkpoint at step 0 (or of a parameter that never got a gradient) is complete."""
        keys = ("momentum_buffer",) if group["algorithm"] == "muon" else ("exp_avg", "exp_avg_sq")
        state = self.state[p]
        if group["algorithm"] == "adamw" and "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in keys:
            if key not in state:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["algorithm"] == "muon" and group.get("normuon", False) and _SECOND not in state:
            state[_SECOND] = row_state_zeros(p)  # one value per row, laid out with p

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then any state the checkpoint lacks is created again (eagerly, as in
        ``__init__``); layouts and plans stay, since the parameters are the same objects."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(group, p)
                if "step" in self.state[p]:  # a counter saved on a device comes back to the host
                    self.state[p]["step"] = self.state[p]["step"].detach().to("cpu", torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_replaced_params()
        configs = [validation.check_group(g) for g in self.param_groups]
        agreement.agree(self.param_groups, self._process_group)  # before any other collective
        shardings = [
            self._sharding(i, g) if c else None for i, (g, c) in enumerate(zip(self.param_groups, configs))
        ]
        work = validation.preflight(self.param_groups, self._process_group)
        for group, sharding, config, todo in zip(self.param_groups, shardings, configs, work):
            params = [group["params"][i] for i in todo]
            for p in params:
                self._init_state(group, p)
            if sharding is None:
                self._adamw_step(group, params)
            elif config is not None and todo:
                self._muon_step(group, sharding, todo, config)
        return loss

    def _sharding(self, index: int, group: dict[str, Any]) -> GroupSharding:
        """A Muon group's layouts, views and plans: built (collectively) on first use and again when
        its parameters or view options change."""
        owners = group.get("owners", "auto")  # a group loaded from an older state dict may lack it
        key = (tuple(map(id, group["params"])), ViewOptions.of(group), owners)
        if index not in self._shardings or self._shardings[index][0] != key:
            names = validation.param_names(group, index)
            for p in group["params"]:  # NorMuon switched on after construction: its state first
                self._init_state(group, p)
            seconds = [self.state[p].get(_SECOND) for p in group["params"]]
            sharding = GroupSharding(group["params"], names, key[1], self._process_group, owners, seconds)
            self._shardings[index] = key, sharding
        return self._shardings[index][1]

    def _muon_step(
        self, group: dict[str, Any], sharding: GroupSharding, todo: list[int], config: NSConfig
    ) -> None:
        params = [group["params"][i] for i in todo]
        muon_step(
            [local_of(p) for p in params],
            [local_grad(p) for p in params],
            [local_of(self.state[p]["momentum_buffer"]) for p in params],
            sharding.domains(todo, group["mode"], group["max_round_bytes"], self._split_policy(group)),
            MuonHyper.of(group),
            config,
            self.comm_stats,
            second_moments=[local_of(self.state[p][_SECOND]) for p in params]
            if group.get("normuon")
            else None,
        )

    def _split_policy(self, group: dict[str, Any]) -> SplitPolicy:
        """``ns_split`` of a Muon group, with this job's node size for ``"auto"``'s cost model."""
        if group.get("ns_split", "off") != "auto":
            return SplitPolicy.of(group, 1)
        device = group["params"][0].device.type if group["params"] else "cpu"
        return SplitPolicy.of(group, node_size(device))

    def _adamw_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        states = [self.state[p] for p in params]
        adamw_step(
            [local_of(p) for p in params],
            [local_grad(p) for p in params],
            [local_of(s["exp_avg"]) for s in states],
            [local_of(s["exp_avg_sq"]) for s in states],
            [s["step"] for s in states],
            **{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")},
        )
