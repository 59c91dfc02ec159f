"""QK-Clip (``qk_clip_``, Kimi K2's formula, arXiv 2507.20534), the logit recorders (``qk_logits``) and
the demo's ``--qk-clip``. Sharded calls equal the same call in one process bit for bit, the max logits
MAX-reduced over the mesh first: ms-swift's MuonClip applied each rank's own max and its replicas drifted
apart (modelscope/ms-swift#9901)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from muon_dtensor import Muon, QKClipFactors, qk_clip_, qk_clip_factors
from muon_dtensor.demo.logits import record_demo_logits
from muon_dtensor.features.qk_clip import local_rows
from muon_dtensor.features.qk_logits import record_llama_logits
from tests.conftest import DemoRun
from tests.harness.ranks import run_ranks
from tests.helpers.models import dt

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120.0
# name: (query heads, key heads, head_dim, hidden). "gqa" cuts heads across FSDP shards; "mqa" has
# uneven shards (15 rows on 4 ranks) and an empty one (3 key rows on 4 ranks); "tp" splits by heads.
SHAPES = {"gqa": (6, 2, 4, 10), "mqa": (5, 1, 3, 7), "tp": (8, 4, 4, 10)}
DTYPES = ("float32", "bfloat16")


class QK(nn.Module):
    def __init__(self, heads: int, kv_heads: int, head_dim: int, hidden: int) -> None:
        super().__init__()
        self.q = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=False)


def _weights(case: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    heads, kv, d, hidden = SHAPES[case]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(heads * d, hidden, generator=gen)
    return q.to(dtype), torch.randn(kv * d, hidden, generator=gen).to(dtype)


def _rank_logits(heads: int, rank: int) -> torch.Tensor:
    """This rank's max logits: 20 to 300 (around tau = 100), head 0 computed by no rank."""
    values = 20 + 280 * torch.rand(heads, generator=torch.Generator().manual_seed(100 + rank))
    values[0] = -math.inf
    return values


def test_factors_are_kimis_formula_with_the_gqa_rule() -> None:
    s = torch.tensor([50.0, 100.0, 150.0, 400.0, -math.inf, 120.0])
    q, k = qk_clip_factors(s, 2, threshold=100.0, alpha=0.5)
    assert q.dtype == k.dtype == torch.float32
    expected = [1.0, 1.0, (100 / 150) ** 0.5, (100 / 400) ** 0.5, 1.0, (100 / 120) ** 0.5]
    assert torch.allclose(q.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-7, atol=0)
    assert q[[0, 1, 4]].tolist() == [1.0, 1.0, 1.0]  # at or below tau, and -inf: exactly untouched
    # key head 0 serves query heads 0-2, key head 1 serves 3-5: each takes its group's smallest factor
    assert torch.equal(k, torch.stack([q[0:3].min(), q[3:6].min()]))
    # alpha = 0 puts all the scaling on k, alpha = 1 all on q
    (q0, k0), (q1, k1) = (qk_clip_factors(s, 6, threshold=100.0, alpha=a) for a in (0.0, 1.0))
    assert set(q0.tolist()) == set(k1.tolist()) == {1.0} and torch.allclose(k0, torch.tensor(expected) ** 2)
    assert torch.equal(q1, k0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_scale_once_by_their_heads_factor_and_momentum_is_untouched(dtype: torch.dtype) -> None:
    model = QK(*SHAPES["gqa"]).to(dtype)
    opt = Muon(model.parameters(), lr=0.02)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    q, k = model.q.weight, model.k.weight
    q0, k0 = q.detach().clone(), k.detach().clone()
    momentum = {p: opt.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    logits = torch.tensor([50.0, 250.0, 100.0, 130.0, -math.inf, 400.0])
    out = qk_clip_(q, k, logits, head_dim=4)
    assert isinstance(out, QKClipFactors) and torch.equal(out.max_logits, logits)
    rows = torch.arange(24) // 4
    assert torch.equal(q, (q0.float() * out.q[rows, None]).to(dtype))  # the f32 product, in q's dtype
    assert torch.equal(k, (k0.float() * out.k[torch.arange(8) // 4, None]).to(dtype))
    kept = (rows == 0) | (rows == 2) | (rows == 4)  # at or below tau, and -inf: the same bits
    assert torch.equal(q[kept], q0[kept]) and not torch.equal(q[4:8], q0[4:8]) and q.requires_grad
    for p in model.parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], momentum[p])
        assert set(opt.state[p]) == {"momentum_buffer"}


def test_a_clipped_heads_logit_on_the_same_batch_becomes_tau() -> None:
    """The point of QK-Clip: q.k scales by (tau/s)^a (tau/s)^(1-a) = tau/s, so a clipped head's largest
    logit on the batch it was measured on becomes tau. Under GQA a shared key head takes the smallest
    factor, so the other query heads that read it end at or below tau."""
    heads, kv, d, hidden = SHAPES["gqa"]
    q, k = _weights("gqa", torch.float32)
    x = torch.randn(3, 9, hidden, generator=torch.Generator().manual_seed(1))

    def logits() -> torch.Tensor:
        qs = (x @ q.T).view(3, 9, heads, d).transpose(1, 2)
        ks = (x @ k.T).view(3, 9, kv, d).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
        return (qs @ ks.transpose(-2, -1) / math.sqrt(d)).amax(dim=(0, 2, 3))

    before = logits()
    tau = float(before.median())  # some heads above, some below
    out = qk_clip_(q, k, before, head_dim=d, threshold=tau)
    after = logits()
    clipped = before > tau
    assert clipped.any() and (~clipped).any()
    assert torch.all(after <= tau * (1 + 1e-5))
    for group in range(kv):
        mine = slice(group * 3, group * 3 + 3)
        top = int(before[mine].argmax()) + group * 3
        if clipped[mine].any():  # the group's largest logit lands on tau, the others at most there
            assert after[top] == pytest.approx(tau, rel=1e-5) and out.k[group] < 1
        else:  # nothing of this key head was touched: the same bits
            assert torch.equal(after[mine], before[mine]) and out.k[group] == 1


# ------------------------------------------------------------------------------------- sharded
def _shard(model: QK, layout: str, mesh_shape: tuple[int, ...]) -> None:
    if layout == "rowwise":  # TP rowwise: every rank holds every row, a slice of the columns
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("tp",))
        for lin in (model.q, model.k):
            lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(1)]))
        return
    if layout == "stages":  # two meshes (pipeline stages): each clips with its own ranks' logits
        stage = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("pp", "dp"))["dp"]
        fully_shard(model, mesh=stage)
        return
    names = {"fsdp": ("dp",), "hsdp": ("replicate", "shard"), "tp": ("tp",), "fsdp_tp": ("dp", "tp")}[layout]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if "tp" in names:
        parallelize_module(model, mesh["tp"], {"q": ColwiseParallel(), "k": ColwiseParallel()})
    if layout != "tp":
        fully_shard(model, mesh=mesh["dp"] if layout == "fsdp_tp" else mesh)


def sharded_clip(layout: str, mesh_shape: tuple[int, ...], case: str) -> dict[str, Any]:
    """On every rank: build the weights, shard them, clip with this rank's own max logits (under
    TP only its own heads, -inf elsewhere), and return the whole results."""
    heads, _, d, _ = SHAPES[case]
    out: dict[str, Any] = {}
    for name in DTYPES:
        model = QK(*SHAPES[case])
        q, k = _weights(case, getattr(torch, name))
        model.q.weight, model.k.weight = nn.Parameter(q), nn.Parameter(k)
        _shard(model, layout, mesh_shape)
        logits = _rank_logits(heads, dist.get_rank())
        if layout in ("tp", "fsdp_tp"):
            mine = local_rows(model.q.weight, "q") // d
            logits[[h for h in range(heads) if h not in mine.tolist()]] = -math.inf
        factors = qk_clip_(model.q.weight, model.k.weight, logits, head_dim=d)
        q, k = (w.full_tensor() if isinstance(w, DTensor) else w for w in (model.q.weight, model.k.weight))
        placements = str(getattr(model.q.weight, "placements", None))
        out[name] = {"logits": logits, "q": q, "k": k, "factors": factors, "placements": placements}
    return out


SHARDED = [  # (layout, mesh shape, SHAPES case)
    ("fsdp", (2,), "gqa"), ("fsdp", (4,), "gqa"), ("fsdp", (4,), "mqa"), ("hsdp", (2, 2), "gqa"),
    ("tp", (2,), "tp"), ("tp", (4,), "tp"), ("fsdp_tp", (2, 2), "tp"), ("rowwise", (2,), "gqa"),
    ("stages", (2, 2), "gqa"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "mesh_shape", "case"), SHARDED, ids=[f"{a}{b}-{c}" for a, b, c in SHARDED]
)
def test_sharded_clip_equals_one_process_bitwise(layout: str, mesh_shape: tuple[int, ...], case: str) -> None:
    results = run_ranks(sharded_clip, math.prod(mesh_shape), layout, mesh_shape, case, timeout=TIMEOUT)
    if layout == "fsdp_tp":
        assert "_StridedShard" in results[0]["float32"]["placements"]
    # the ranks of the weights' mesh: all of them, or this rank's pipeline stage (ranks 0-1, 2-3)
    meshes = [[0, 1], [2, 3]] if layout == "stages" else [list(range(len(results)))]
    for name, ranks in ((name, ranks) for name in DTYPES for ranks in meshes):
        per_rank = {rank: results[rank][name] for rank in ranks}
        logits = torch.stack([r["logits"] for r in per_rank.values()]).amax(dim=0)
        q, k = _weights(case, getattr(torch, name))
        assert not dist.is_initialized()  # the same call in one process, on whole weights
        qf, kf, _ = qk_clip_(q, k, logits, head_dim=SHAPES[case][2])
        assert (qf < 1).any() and (qf == 1).any(), "some heads clipped, some not"
        for rank, r in per_rank.items():
            assert torch.equal(r["q"], q) and torch.equal(r["k"], k), f"{name} rank {rank}"
            assert torch.equal(r["factors"].q, qf) and torch.equal(r["factors"].k, kf)
            assert torch.equal(r["factors"].max_logits, logits)


BAD = {  # case: what every rank's error says
    "rows": "q_weight has 24 rows, not a multiple of head_dim=5; pass the projection's nn.Linear weight",
    "head_dim": "head_dim should be a positive int but is 0",
    "threshold": "threshold should be a finite number > 0 but is -1.0; Kimi K2 uses 100.0",
    "alpha": "alpha should be between 0 and 1 but is 1.5",
    "gqa": "q_weight has 6 heads and k_weight 4 (head_dim=4): the query heads should be a multiple",
    "mesh": "q_weight and k_weight should be on the same device mesh (or both plain tensors)",
    "shape_on_rank_1": "of shape (6,), one value per query head (-inf for heads a rank did not compute), but rank 1",
    "int_on_rank_1": "but rank 1 passed torch.int64 of shape (6,)",
    "none_on_rank_0": "but rank 0 passed NoneType",
    "nan_on_rank_0": "max_logits holds NaN or +inf on rank 0",
    "inf_on_rank_1": "max_logits holds NaN or +inf on rank 1",
}


def _error(call: Any) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return "no error"


def bad_calls() -> dict[str, str]:
    """Every bad call on every rank of a 2-rank FSDP layout; some are bad on one rank only. Then a
    good call: no rank was left behind in a collective."""
    rank = dist.get_rank()
    model = QK(*SHAPES["gqa"])
    fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
    q, k = model.q.weight, model.k.weight
    good = torch.full((6,), 50.0)

    def on(bad_rank: int, bad: Any) -> Any:
        return bad if rank == bad_rank else good

    calls = {
        "rows": lambda: qk_clip_(q, k, good, head_dim=5),
        "head_dim": lambda: qk_clip_(q, k, good, head_dim=0),
        "threshold": lambda: qk_clip_(q, k, good, head_dim=4, threshold=-1.0),
        "alpha": lambda: qk_clip_(q, k, good, head_dim=4, alpha=1.5),
        "gqa": lambda: qk_clip_(q, torch.randn(16, 10), good, head_dim=4),
        "mesh": lambda: qk_clip_(q, torch.randn(8, 10), good, head_dim=4),
        "shape_on_rank_1": lambda: qk_clip_(q, k, on(1, torch.zeros(5)), head_dim=4),
        "int_on_rank_1": lambda: qk_clip_(q, k, on(1, torch.zeros(6, dtype=torch.int64)), head_dim=4),
        "none_on_rank_0": lambda: qk_clip_(q, k, on(0, None), head_dim=4),
        "nan_on_rank_0": lambda: qk_clip_(q, k, on(0, torch.tensor([math.nan] * 6)), head_dim=4),
        "inf_on_rank_1": lambda: qk_clip_(q, k, on(1, torch.tensor([math.inf] * 6)), head_dim=4),
    }
    before = [dt(w).to_local().clone() for w in (q, k)]
    out = {case: _error(call) for case, call in calls.items()}
    out["unchanged"] = str(all(torch.equal(dt(w).to_local(), b) for w, b in zip((q, k), before)))
    out["then"] = str(float(qk_clip_(q, k, good + 100 * rank, head_dim=4).max_logits.max()))
    return out


def test_bad_input_raises_on_every_rank_naming_argument_and_value() -> None:
    results = run_ranks(bad_calls, 2, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        for case, text in BAD.items():
            assert r[case].startswith("qk_clip_: ") and text in r[case], f"rank {rank}, {case}: {r[case]}"
        assert r["unchanged"] == "True" and r["then"] == "150.0"
    # every rank raises the failing rank's own error, which names that rank and what it passed
    assert results[0]["shape_on_rank_1"] == results[1]["shape_on_rank_1"]
    assert "but rank 1 passed torch.float32 of shape (5,)" in results[0]["shape_on_rank_1"]


# ------------------------------------------------------------------------------------- recorders
def _llama(attn_implementation: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(  # type: ignore[call-arg]
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn_implementation,
        )
    )  # fmt: skip


@pytest.mark.integration
def test_llama_recorder_sees_what_eager_softmax_sees_and_clipping_lands_on_tau() -> None:
    """GQA (4 query heads, 2 key heads) and rotary embeddings: the recorder's values are the max of the
    tensor eager attention hands to softmax, bit for bit. Clipping the first layer with them at their
    median brings each clipped key-head group's largest logit on the same batch to tau (RoPE rotates
    each head, so scaling a head's q and k rows scales its logits)."""
    llama = _llama("eager")
    seen: list[torch.Tensor] = []
    softmax = torch.nn.functional.softmax

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(x.detach().amax(dim=(0, 2, 3)).float())
        return softmax(x, *args, **kwargs)

    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    with record_llama_logits(llama) as rec, mock.patch.object(torch.nn.functional, "softmax", spy):
        llama(ids)
        assert list(rec.values) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        assert len(seen) == 2 and all(torch.equal(v, s) for v, s in zip(rec.values.values(), seen))
        before = rec.values["model.layers.0.self_attn"].clone()  # the first layer: its input stays
        tau = float(before.median())
        assert (before > tau).any()
        attn = dict(llama.named_modules())["model.layers.0.self_attn"]
        qk_clip_(attn.q_proj.weight, attn.k_proj.weight, before, head_dim=8, threshold=tau)
        rec.reset()
        llama(ids)
    after = rec.values["model.layers.0.self_attn"]
    assert torch.all(after <= tau * (1 + 1e-5)), (after, tau)
    for group in (slice(0, 2), slice(2, 4)):  # query heads 0-1 read key head 0, 2-3 key head 1
        top = int(before[group].argmax()) + group.start
        if before[top] > tau:
            assert after[top] == pytest.approx(tau, rel=1e-5)
        else:
            assert torch.equal(after[group], before[group])
    assert not attn._forward_hooks  # removed on exit
    with pytest.raises(ValueError, match='attn_implementation="eager"'):
        record_llama_logits(_llama("sdpa"))


# ------------------------------------------------------------------------------------- the demo
def demo_run(layout: str, threshold: float | None, steps: int) -> Any:
    from muon_dtensor.demo.train import RunSpec, train

    spec = RunSpec("muon_dtensor", layout, steps, micro_batches=2, micro_size=4, folder="", qk_clip=threshold)
    return train(spec)


def tp_recording(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The demo model under FSDP x TP (2x2), every rank on the same batch: each records its heads."""
    from muon_dtensor.demo.model import ModelConfig, TinyLM
    from muon_dtensor.demo.parallel import MeshShape, build_mesh, shard_model

    torch.manual_seed(0)
    model = TinyLM(ModelConfig())
    shard_model(model, build_mesh(MeshShape(dp=2, tp=2)))
    with record_demo_logits(model) as rec, torch.no_grad():
        model(tokens)
    return rec.values


def test_demo_recorder_sees_what_sdpa_gets_and_under_tp_each_ranks_own_heads() -> None:
    """One process: the recorder's values are the max of SDPA's scores (its q and k, scale 1/sqrt(d),
    causal mask), a running max over forwards. FSDP x TP 2x2 on the same batch: each rank records its
    own two heads (the same values, up to TP's float rounding) and -inf for the others."""
    from muon_dtensor.demo.model import ModelConfig, TinyLM

    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    model, inputs = TinyLM(ModelConfig()), []
    hidden = torch.ones(32, 32).triu(1) > 0  # the causal mask: keys after the query
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        inputs.append((q.detach(), k.detach()))
        return sdpa(q, k, *args, **kwargs)

    with (
        record_demo_logits(model) as rec,
        mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy),
    ):
        model(tokens)
        model(tokens[:1])  # a second forward over a subset changes no running max
    for (q, k), values in zip(inputs, rec.values.values()):
        scores = (q @ k.transpose(-2, -1) / math.sqrt(16)).masked_fill(hidden, -math.inf)
        assert torch.allclose(values, scores.amax(dim=(0, 2, 3)), rtol=1e-6, atol=0)
    for rank, values in enumerate(run_ranks(tp_recording, 4, tokens, timeout=TIMEOUT)):
        mine = [0, 1] if rank % 2 == 0 else [2, 3]  # tp coordinate = rank % 2; 4 heads over tp = 2
        for name, ref in rec.values.items():
            assert torch.allclose(values[name][mine], ref[mine], rtol=1e-5, atol=0), (rank, name)
            assert values[name][[h for h in range(4) if h not in mine]].tolist() == [-math.inf] * 2
    rec.reset()
    assert rec.largest() == -math.inf


def test_demo_training_with_qk_clip_on_fsdp_x_tp() -> None:
    """The demo's loop with --qk-clip on a 2x2 (dp, tp) mesh: weights laid out (Shard(1), Shard(0)),
    each TP rank recording its own heads. Heads get clipped, clipping lowers the logit the updated
    weights give, and a step that clipped nothing leaves them exactly as they were."""
    records = run_ranks(demo_run, 4, "fsdp-tp", 1.2, 4, timeout=TIMEOUT)[0]["qk_clip"]
    assert sorted(records) == [1, 2, 3, 4]
    assert sum(r[3] for r in records.values()) > 0, "the threshold clips some heads"
    for read, before, after, clipped in records.values():
        assert read > 1.2 if clipped else read <= 1.2
        assert after < before if clipped else after == before


@pytest.mark.slow
def test_demo_option_prints_logits_before_and_after(
    demo_emulated_qk_clip: DemoRun, capsys: pytest.CaptureFixture[str]
) -> None:
    """The session's demo run with --qk-clip 1.2 (forced float32 Newton-Schulz, which test_cpu_probe
    reads from the same run; the clipping claims hold for either dtype)."""
    from muon_dtensor.demo.run import _parser, main

    assert _parser().parse_args(["--qk-clip"]).qk_clip == 5.0 and _parser().parse_args([]).qk_clip is None
    assert main(["--qk-clip", "0"]) == 2
    assert "--qk-clip should be a finite number > 0 but is 0.0" in capsys.readouterr().err
    done = demo_emulated_qk_clip
    out = done.stdout
    assert done.returncode == 0, done.failure()
    assert "QK-Clip at threshold 1.2 after every step of every run" in out
    assert "| step | largest logit, step's forward | heads clipped (of 8) |" in out
    assert "The resumed run (1 rank) clipped exactly as its twin at every step after the resume" in out
    assert "verdict: PASS" in out
    saved = done.results()
    assert saved["args"]["qk_clip"] == 1.2 and len(saved["muon_dtensor"]["qk_clip"]) == 4
