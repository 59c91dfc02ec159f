"""``muon_dtensor.Muon``: torch.optim.Muon's contract on plain tensors and DTensors, plus AdamW groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import Optimizer, ParamsT

from ..base.names import param_names
from ..base.torch_ops import disable_torch_function
from ..checks import validation
from ..checks.group_identity import agree_step_group
from ..checks.step_checks import StepChecks
from ..checks.together import refuse_after_failure
from ..checks.wrong_matrix import WrongMatrixScan
from ..numerics.newton_schulz import (
    DEFAULT_COEFFICIENTS,
    NSAlgorithm,
    NSCoefficients,
    NSConfig,
    orthogonalize,
)
from ..numerics.normuon import DEFAULT_BETA2
from ..numerics.ns_config import NSSplit
from ..sharding.plan.build import DEFAULT_ROUND_BYTES, Mode, Owners
from ..sharding.plan.domains import ViewOptions
from ..sharding.plan.param_layout import local_grad, local_of
from ..sharding.runtime.comm import CommStats
from ..sharding.runtime.failures import releasing_peers
from . import report
from .docstrings import MUON_ARGS
from .functional import MuonHyper, Orthogonalize, adamw_group_step, muon_step
from .group_sharding import GroupSharding
from .plan_cache import PlanCache
from .state import (
    MOMENTUM,
    MOMENTUM_ABSMAX,
    SECOND_MOMENT,
    StateWalks,
    follow_replaced,
    init_state,
    load_keeping,
    row_states,
    warn_converted,
)

__all__ = ["ADAMW_DEFAULTS", "Muon"]

# torch.optim.AdamW's defaults, used by groups with "algorithm": "adamw" for keys they leave out.
ADAMW_DEFAULTS: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
_VIEW_DEFAULTS: dict[str, Any] = {"flatten": False, "experts": False, "split_sizes": None, "head_dim": None}
# NorMuon (arXiv 2510.05491), off by default; beta2 is the official implementation's default.
_NORMUON_DEFAULTS: dict[str, Any] = {"normuon": False, "beta2": DEFAULT_BETA2}


class Muon(report.Reports, Optimizer):
    r"""Muon (momentum orthogonalized by Newton-Schulz) for plain tensors and DTensors.

    The algorithm of torch.optim.Muon, per 2-D matrix :math:`\theta` with gradient :math:`g_t`::

        B_t   = mu B_{t-1} + (1 - mu) g_t                     (momentum buffer, "momentum_buffer")
        X_t   = (1 - mu) g_t + mu B_t  if nesterov else B_t
        O_t   = NS_(a,b,c)^k(X_t / max(||X_t||_F, eps))     (k Newton-Schulz steps, once per matrix)
        theta = theta (1 - lr wd) - AdjustLR(lr, global shape) O_t

    On DTensors each full matrix is assembled on one owner rank, orthogonalized there and sent back
    in pieces; the result equals the one-process step bit for bit. AdamW groups follow torch.optim.AdamW.
    (Args: ``muon_dtensor.optim.docstrings.MUON_ARGS``, appended below.)
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
        momentum_dtype: torch.dtype | str | None = None,
        ns_algorithm: NSAlgorithm = "standard",
        mode: Mode = "owner",
        process_group: ProcessGroup | None = None,
        step_group: ProcessGroup | DeviceMesh | None = None,
        max_round_bytes: int | None = DEFAULT_ROUND_BYTES,
        owners: Owners = "auto",
        ns_split: NSSplit = "off",
        capturable: bool = False,
        orthogonalize_fn: Orthogonalize = orthogonalize,
    ) -> None:
        given = {  # the arguments as a param group holds them (``_muon_defaults`` normalizes the dtypes)
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_algorithm": ns_algorithm,
            "mode": mode,
            "max_round_bytes": max_round_bytes,
            "owners": owners,
            "ns_split": ns_split,
            "capturable": capturable,
            "ns_dtype": ns_dtype,
            "momentum_dtype": momentum_dtype,
        }
        self._construct(params, given, process_group, step_group, orthogonalize_fn)

    def _construct(
        self,
        params: ParamsT,
        given: dict[str, Any],
        process_group: ProcessGroup | None,
        step_group: ProcessGroup | DeviceMesh | None,
        orthogonalize_fn: Orthogonalize,
    ) -> None:
        """``__init__``'s work: the defaults checked, the optimizer's parts, torch's constructor. With
        a ``step_group``, a failure on one rank is raised on every rank (``agree_step_group``)."""
        error: Exception | None = None
        self._wrong_matrices = WrongMatrixScan(params)  # before the generator is read (api.md)
        try:
            defaults = _muon_defaults(given)
            validation.check_process_group(process_group)
            validation.check_step_group(step_group)
            self._process_group = process_group
            self._orthogonalize = orthogonalize_fn
            self._checks = StepChecks(step_group)
            self._plans = PlanCache()
            self._walks = StateWalks()
            self._params: dict[int, list[Tensor]] = {}  # each group's parameters as last seen
            self._hypers: dict[int, tuple[Any, MuonHyper]] = {}  # per group: (its resolved settings, hyper)
            self.comm_stats = CommStats()
            super().__init__(params, defaults)
        except Exception as e:
            if step_group is None:
                self._wrong_matrices.close()
                raise
            error = e
        self._wrong_matrices.close()
        if step_group is not None:  # collective over the default group: every rank passes one
            agree_step_group(step_group, getattr(self, "param_groups", []), process_group, error)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if validation.precheck_group(param_group, len(self.param_groups)) == "adamw":
            param_group.update({k: v for k, v in ADAMW_DEFAULTS.items() if k not in param_group})
            # not the optimizer's default: AdamW's moments keep the parameter's dtype, and any
            # other value set later is refused at the step (``check_adamw_momentum_dtype``)
            param_group["momentum_dtype"] = None
        super().add_param_group(param_group)
        group, index = self.param_groups[-1], len(self.param_groups) - 1
        self._wrong_matrices.add(group, param_names(group, index))  # local; warns, never raises
        try:  # local checks only: collectives wait for the first step, once every rank agrees
            validation.admit_group(group, index, param_names(group, index))
        except Exception:
            self.param_groups.pop()
            raise
        for p in group["params"]:
            init_state(self.state, group, p)
        self._params[index] = list(group["params"])

    def state_dict(self) -> dict[str, Any]:
        follow_replaced(self.state, self.param_groups, self._params)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, keeping each group's ``param_names`` and ``momentum_dtype`` (a run grouped
        otherwise, e.g. pipeline stages merged, saved other names); a buffer saved in another dtype is
        converted with a warning, missing state created (``state.load_keeping``, docs/api.md)."""
        conversions = load_keeping(self, super().load_state_dict, state_dict)
        self._walks.invalidate()
        warn_converted(self.param_groups, conversions, "loaded")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        refuse_after_failure("Muon.step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.comm_stats.begin_step()
        configs, work = self._checks.run(self.param_groups, self._process_group)  # one sum per scope
        generation = self._checks.generation
        self._walks.run(self.state, self.param_groups, self._params, generation)  # warns of conversions
        for i, g in enumerate(self.param_groups):  # set-up: its errors are raised on every rank together
            if configs[i] is not None:
                self._sharding(i, g, generation)
        with releasing_peers():  # a rank that raises from here on tells its peers to stop waiting
            for index, (group, config, todo) in enumerate(zip(self.param_groups, configs, work)):
                if config is None:
                    adamw_group_step(self.state, group, [group["params"][i] for i in todo])
                elif todo:
                    self._muon_step(index, group, todo, config)
        report.log_once(self)
        return loss

    def _sharding(
        self, index: int, group: dict[str, Any], generation: int | None = None, local: bool = False
    ) -> GroupSharding:
        """A Muon group's plans (``plan_cache.py``), built collectively when its parameters or plan
        settings change; ``local`` (reports on one rank): built with no collective, not kept."""
        if generation is None:  # outside a step: the parameter set, locally
            generation = self._checks.param_set(self.param_groups, self._process_group)

        def build(options: ViewOptions, owners: str) -> GroupSharding:
            seconds = row_states(self.state, group)  # NorMuon switched on later: its state first
            names = param_names(group, index)
            return GroupSharding(group["params"], names, options, self._process_group, owners, seconds, local)

        return self._plans.sharding(index, group, generation, build, keep=not local)

    def _hyper(self, index: int, group: dict[str, Any]) -> MuonHyper:
        return _kept_hyper(self._hypers, index, group, self._checks.resolved[index])

    def _muon_step(self, index: int, group: dict[str, Any], todo: list[int], config: NSConfig) -> None:
        params = [group["params"][i] for i in todo]
        locals_ = [local_of(p) for p in params]
        muon_step(
            locals_,
            _local_grads(params, locals_),
            [local_of(self.state[p][MOMENTUM]) for p in params],
            self._plans.domains(index, group, todo),
            self._hyper(index, group),
            config,
            self.comm_stats,
            second_moments=[local_of(self.state[p][SECOND_MOMENT]) for p in params]
            if group.get("normuon")
            else None,
            absmaxes=[local_of(self.state[p][MOMENTUM_ABSMAX]) for p in params]
            if group.get("momentum_dtype") == "int8"
            else None,
            base=self._orthogonalize,
        )


def _local_grads(params: list[Tensor], locals_: list[Tensor]) -> list[Tensor]:
    """``local_grad`` of each parameter, given their local tensors: the gradients read without
    DTensor's torch-function check, and only an empty one compared by shape (a host cost per
    parameter, on a step of thousands of small matrices)."""
    with disable_torch_function():
        grads: list[Any] = [p.grad for p in params]  # the preflight stepped only those with one
    grads = [local_of(g) for g in grads]
    return [g if g.shape == q.shape else local_grad(p) for g, q, p in zip(grads, locals_, params)]


def _kept_hyper(
    hypers: dict[int, tuple[Any, MuonHyper]], index: int, group: dict[str, Any], resolved: Any
) -> MuonHyper:
    """Group ``index``'s ``MuonHyper``, kept while its resolved settings are the same object (the
    checks resolve them again only when a value changed). A tensor lr's is made every step: its
    device copy must be taken at each step (a CUDA graph captures the step that takes it)."""
    kept = hypers.get(index)
    if kept is not None and kept[0] is resolved:
        return kept[1]
    hyper = MuonHyper.of(group)
    if isinstance(hyper.lr, Tensor):
        hypers.pop(index, None)
    else:
        hypers[index] = (resolved, hyper)
    return hyper


def _muon_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """The constructor's defaults: its arguments, the options only a param group sets (views,
    NorMuon), the dtypes as names (``validation``'s one normalization); checked as a Muon group."""
    defaults = {**given, **_VIEW_DEFAULTS, **_NORMUON_DEFAULTS}
    defaults["ns_dtype"] = validation.ns_dtype_name(defaults["ns_dtype"])
    defaults["momentum_dtype"] = validation.momentum_dtype_name(defaults["momentum_dtype"])
    validation.check_muon_group(defaults)
    return defaults


assert Muon.__doc__ is not None
Muon.__doc__ += MUON_ARGS
