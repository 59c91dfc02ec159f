"""The warning where Muon gets the wrong matrix: an embedding, a weight tied to one, or the output head
in a Muon group. Muon is for hidden matrices (Keller Jordan's Muon, torch.optim.Muon's docs,
Moonlight); ``split_params`` routes the others to AdamW, so this catches groups built by hand.

How a parameter is recognized, best first:
1. a model is known: by module type (an ``nn.Embedding``'s weight, a weight with several names one of
   which is an embedding's: tied, the model's ``get_output_embeddings()`` or a Linear whose name is a
   head name). The model is the one whose ``parameters()`` or ``named_parameters()`` generator was
   passed (read before it starts). A search of the live modules for a list's owner was measured
   and dropped: one ``gc.get_objects()`` pass took 0.65 s in a process with torch and transformers
   imported (266,636 objects, load 37 on 2 cores), per constructor;
2. names are known (``param_names``: torchtitan's container, ``named_parameters()``): by FQN, as
   ``split_params`` decides (``embed``, ``wte``, ``wpe`` in the name; a head's module name);
3. neither: by shape, a 2-D matrix with vocabulary rows (at least ``VOCAB_ROWS`` rows, four times its
   columns).

Local and read-only: no collective, rank 0 warns, the step is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor, nn

from ..base.names import DEFAULT_HEAD_NAMES, module_of, strip_wrappers
from ..base.warn import warn

__all__ = ["VOCAB_ROWS", "WrongMatrixScan", "WrongMatrixWarning", "model_of"]

# The smallest common vocabulary (Llama 2's 32000): rows at least this many, and four times the
# columns, read as vocabulary rows when nothing else names a matrix.
VOCAB_ROWS = 32000
_EMBED_KEYS = ("embed", "wte", "wpe")  # split_params' rule (base.names.refusal)


class WrongMatrixWarning(UserWarning):
    """A Muon group holds an embedding, a weight tied to one, or the output head (docs/api.md)."""


def model_of(params: Any) -> nn.Module | None:
    """The module whose ``parameters()`` or ``named_parameters()`` generator ``params`` is (not yet
    started: its frame still holds ``self``), else None."""
    code = getattr(params, "gi_code", None)
    frame = getattr(params, "gi_frame", None)
    if frame is None or code not in (nn.Module.parameters.__code__, nn.Module.named_parameters.__code__):
        return None
    model = frame.f_locals.get("self")
    return model if isinstance(model, nn.Module) else None


def _roles(root: nn.Module) -> dict[int, tuple[str, str]]:
    """id(parameter) -> (its FQNs joined, what it is) for the embeddings, tied weights and heads."""
    names: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(strip_wrappers(name))
    heads = {id(m) for m in _heads(root)}
    roles: dict[int, tuple[str, str]] = {}
    for mname, module in root.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor) or id(weight) in roles:
            continue
        embedding = isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        head = id(module) in heads or (
            isinstance(module, nn.Linear) and mname.rsplit(".", 1)[-1] in DEFAULT_HEAD_NAMES
        )
        if embedding or head:
            fqns = names.get(id(weight), [strip_wrappers(f"{mname}.weight")])
            what = "an nn.Embedding weight" if embedding else "the output head"
            if len(fqns) > 1:
                what += ", tied to " + ("the output head" if embedding else "an embedding")
            roles[id(weight)] = (" = ".join(fqns), what)
    return roles


def _heads(root: nn.Module) -> list[nn.Module]:
    get = getattr(root, "get_output_embeddings", None)  # Hugging Face models name their head
    head = get() if callable(get) else None
    return [head] if isinstance(head, nn.Module) else []


def _by_name(name: str) -> str | None:
    if module_of(name) in DEFAULT_HEAD_NAMES:
        return "the output head (by its name)"
    if any(key in strip_wrappers(name).lower() for key in _EMBED_KEYS):
        return "an embedding (by its name)"
    return None


def _by_shape(p: Tensor) -> str | None:
    rows, cols = p.shape
    if rows >= VOCAB_ROWS and rows >= 4 * cols:
        return f"an embedding or output head (by its shape: {rows} vocabulary rows x {cols})"
    return None


class WrongMatrixScan:
    """Collects, group by group, the Muon groups' parameters that are embeddings or heads; ``warn``
    says it once."""

    def __init__(self, params: Any) -> None:
        self._roles: dict[int, tuple[str, str]] = {}
        self._known: set[int] | None = None  # the ids of the known model's parameters
        model = model_of(params)
        if model is not None:
            self._learn(model)
        self.found: list[str] = []
        self.deferred = True  # inside the constructor: one warning at its end

    def _learn(self, model: nn.Module) -> None:
        self._known = {id(p) for p in model.parameters()}
        self._roles.update(_roles(model))

    def add(self, group: Mapping[str, Any], names: list[str]) -> None:
        """Group ``group``'s Muon matrices that are not Muon's (``names``: its ``param_names`` or
        positions); warned at once after the constructor, at its end inside it."""
        if group.get("algorithm", "muon") != "muon":
            return
        matrices = [(p, n) for p, n in zip(group["params"], names) if p.ndim == 2]
        named = "param_names" in group
        for p, name in matrices:
            self.found.extend(self._describe(p, name, named))
        if not self.deferred:
            self.warn()

    def _describe(self, p: Tensor, name: str, named: bool) -> Iterable[str]:
        if id(p) in self._roles:
            fqns, what = self._roles[id(p)]
            return [f"{fqns} ({what})"]
        if self._known is not None and id(p) in self._known:  # the model says it is a hidden matrix
            return []
        found = _by_name(name) if named else _by_shape(p)
        return [f"{name} ({found})"] if found else []

    def warn(self) -> None:
        if self.found:
            warn(message(self.found), WrongMatrixWarning)
            self.found = []

    def close(self) -> None:
        """The constructor ended (raising or not): its one warning; later groups warn as added."""
        self.deferred = False
        self.warn()
        self._roles, self._known = {}, None  # ids may be reused by tensors made later


def message(found: list[str]) -> str:
    return (
        f"Muon groups hold {len(found)} parameter(s) that Muon should not orthogonalize: "
        f"{', '.join(found)}. Muon is for hidden matrices; embeddings and output heads train with "
        "AdamW (Keller Jordan's Muon, torch.optim.Muon's docs, Moonlight). Fix: "
        "Muon(muon_dtensor.split_params(model)) routes them to AdamW, or put them in a group of "
        'their own with "algorithm": "adamw". If you mean it: '
        'warnings.filterwarnings("ignore", category=muon_dtensor.WrongMatrixWarning)'
    )
