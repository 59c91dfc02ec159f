"""Predict the time of one Muon optimizer step from matrix shapes, the shard-group size and hardware.

Pure arithmetic over the plan (``plan.build_plan`` on ``Shard(0)`` blocks, as FSDP2 lays them out):
no process group, no device. A step is three phases, as ``optimizer.Muon._muon_step`` runs them:

1. **pre**: momentum, Nesterov input and the cast to the Newton-Schulz dtype on local fp32 shards
   (memory-bound), and packing the blocks for the first all-to-all;
2. **mid**: per round, the all-to-all to the owners, assembly of full matrices, Newton-Schulz on the
   busiest rank's share (compute-bound), packing and the all-to-all back;
3. **post**: weight decay and the update on local shards (memory-bound).

Each phase costs device time (bytes over memory bandwidth, flops over the matmul rate, link bytes over
link bandwidth plus a latency per collective) and host time (eager ops times a per-op overhead). On an
asynchronous device (CUDA) the host runs ahead: a phase takes the larger of the two and the host's
post-phase work hides behind the device's mid phase; on a CPU they add up.

Every rank holds a block of every matrix, so a rank's elementwise work is its local share; Newton-
Schulz work is the busiest rank's plan load (owner mode) or all of it (gather mode); link traffic is
counted per rank and per collective from the plan, split into intra-node and inter-node bytes, and a
collective ends when its busiest rank's busiest link is done. Its per-rank sum equals
``Plan.bytes_sent`` (``tests/test_costmodel.py`` checks it).

What is left out: overlap inside a collective's own algorithm, link contention beyond one link each way
per GPU, reduced clocks, and kernel-efficiency changes with matrix size (one matmul rate for all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from .layout import AxisShard, Block, block_numel, shard_blocks
from .newton_schulz import ns_flops
from .plan import EVERYONE, MatrixEntry, Plan, build_plan

__all__ = [
    "CURRENT",
    "CURRENT_CPU",
    "FUSED",
    "FUSED_OVERLAP",
    "LLAMA3_70B",
    "LLAMA3_8B",
    "Hardware",
    "Implementation",
    "Prediction",
    "fit_latency_bandwidth",
    "predict",
    "sharded_plan",
    "transformer_shapes",
]

Shape = tuple[int, int]


@dataclass(frozen=True)
class Hardware:
    """What one accelerator and its links do. Rates in FLOP/s and bytes/s, times in seconds.

    ``memory_bandwidth`` counts bytes read plus bytes written. Link bandwidths are per GPU and per
    direction (a send and a receive can run at once). ``op_overhead`` is the host time of one eager
    tensor op (dispatch and launch); ``async_host`` says whether the device runs while the host
    issues more work (CUDA streams) or not (CPU ops run on the calling thread).
    """

    matmul_flops: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    gpus_per_node: int
    collective_latency: float
    op_overhead: float = 0.0
    async_host: bool = True

    @classmethod
    def h200(cls, **overrides: float | int | bool) -> Hardware:
        """One H200 SXM in an 8-GPU HGX node with NVLink 4 and one 400 Gb/s InfiniBand NIC per GPU."""
        # bf16 matmul: the datasheet's dense peak is ~989 TFLOP/s; an 8192^3 bf16 torch.mm on random data
        # measured 769-798 TFLOP/s on this workplace's H200s (/work/.library/device/KINDS.md, 2026-10-28
        # and 2026-11-04; H200.md: "bf16 matrix work at about 790 TFLOP/s"). 666 TFLOP / 790 = 843 ms,
        # the redundant Newton-Schulz figure for Llama-3-8B.
        # Memory: HBM3e 4.8 TB/s by the datasheet; a device-to-device copy measured ~4.3 TB/s counting
        # bytes read plus written (KINDS.md, same dates).
        # NVLink 4: 18 links x 50 GB/s = 900 GB/s bidirectional per GPU, 450 GB/s each way (peak;
        # NVSwitch all-to-all reaches less, so this is optimistic).
        # InfiniBand NDR: 400 Gb/s = 50 GB/s each way per NIC, one NIC per GPU on HGX H200 (peak).
        # Latency: an assumption (tens of microseconds for a small NCCL collective), not a measurement.
        # Op overhead: an assumption (a few microseconds of host time per eager CUDA op in PyTorch).
        base = cls(
            matmul_flops=790e12,
            memory_bandwidth=4.3e12,
            intra_node_bandwidth=450e9,
            inter_node_bandwidth=50e9,
            gpus_per_node=8,
            collective_latency=50e-6,
            op_overhead=5e-6,
            async_host=True,
        )
        return replace(base, **overrides)

    @classmethod
    def from_measurements(
        cls,
        *,
        matmul: Sequence[tuple[float, float]],
        memory: Sequence[tuple[float, float]],
        link: Sequence[tuple[float, float]],
        gpus_per_node: int,
        inter_link: Sequence[tuple[float, float]] | None = None,
        op_overhead: float = 0.0,
        async_host: bool = False,
    ) -> Hardware:
        """Rates from measured ``(work, seconds)`` pairs: flops, bytes read + written, and link bytes
        sent per rank (each rank also receiving as many). Matmul and memory rates are total work over
        total time; a link's latency and bandwidth are a least-squares fit of ``t = latency + b / bw``
        (``inter_link`` defaults to ``link``, for a machine that is one node)."""
        latency, bandwidth = fit_latency_bandwidth(link)
        _, inter = fit_latency_bandwidth(inter_link) if inter_link else (latency, bandwidth)
        return cls(
            matmul_flops=_rate(matmul),
            memory_bandwidth=_rate(memory),
            intra_node_bandwidth=bandwidth,
            inter_node_bandwidth=inter,
            gpus_per_node=gpus_per_node,
            collective_latency=latency,
            op_overhead=op_overhead,
            async_host=async_host,
        )


def _rate(pairs: Sequence[tuple[float, float]]) -> float:
    work, seconds = sum(w for w, _ in pairs), sum(s for _, s in pairs)
    if work <= 0 or seconds <= 0:
        raise ValueError(f"need positive work and time to compute a rate but got {list(pairs)}")
    return work / seconds


def fit_latency_bandwidth(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``seconds = latency + bytes / bandwidth``; latency clamped at 0. One pair: no latency."""
    if not pairs:
        raise ValueError("need at least one (bytes, seconds) measurement of the link")
    if len({b for b, _ in pairs}) < 2:
        return 0.0, _rate(pairs)
    n = len(pairs)
    mean_b = sum(b for b, _ in pairs) / n
    mean_t = sum(t for _, t in pairs) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in pairs) / sum((b - mean_b) ** 2 for b, _ in pairs)
    if slope <= 0:
        raise ValueError(f"link time does not grow with bytes: {list(pairs)}")
    return max(mean_t - slope * mean_b, 0.0), 1.0 / slope


@dataclass(frozen=True)
class Implementation:
    """What the step's code does per element and per matrix, apart from the machine.

    The defaults count the code as built (``update.py``, ``exchange.py``, ``comm.py``), in bytes read
    plus written per local fp32 element and in eager ops per local matrix:
    momentum ``buf.mul_`` 8, ``grad.mul`` 8, ``add_`` 12; Nesterov ``grad.mul`` 8, ``buf.mul`` 8,
    ``add_`` 12; cast to bf16 6: 62 bytes, 7 ops. Update ``param.mul_`` 8, ``.to(fp32)`` 6, ``mul_`` 8,
    ``sub_`` 12: 34 bytes, 4 ops. Every bf16 element packed for an all-to-all (``torch.cat``) or
    assembled into a full matrix costs a read and a write: 4 bytes.
    """

    pre_bytes: float = 62.0
    post_bytes: float = 34.0
    copy_bytes: float = 4.0
    pre_ops: int = 7
    post_ops: int = 4
    fixed_ops: int = 0  # per step, independent of the number of matrices (multi-tensor kernels)
    batched_ns: bool = True  # one Newton-Schulz call per shape per rank (CUDA) or per matrix (CPU)
    pipeline_rounds: int = 1  # > 1: the exchange overlaps Newton-Schulz in that many stages


CURRENT = Implementation()
# newton_schulz.orthogonalize runs one matrix at a time on CPU (oneDNN's batched bf16 GEMM was slower).
CURRENT_CPU = Implementation(batched_ns=False)
# Not built: one fused pass for momentum (read g, buf; write buf, bf16 input: 4+4+4+2) and one for the
# update (read param, bf16 output; write param: 4+2+4) as multi-tensor kernels, 11 of them per step.
FUSED = Implementation(pre_bytes=14.0, post_bytes=10.0, pre_ops=0, post_ops=0, fixed_ops=11)
# Not built: FUSED plus the exchange pipelined with Newton-Schulz in 4 stages.
FUSED_OVERLAP = replace(FUSED, pipeline_rounds=4)


@dataclass(frozen=True)
class Prediction:
    """One step, in seconds, on the slowest rank; bytes are per rank per step (sent, both directions)."""

    mode: str
    world_size: int
    total: float
    newton_schulz: float
    comm: float
    memory: float
    host: float
    collectives: int
    bytes_sent_mean: float
    bytes_sent_max: float
    imbalance: float


def transformer_shapes(
    layers: int,
    dim: int,
    *,
    kv_rows: int | None = None,
    ffn: int | None = None,
    gated: bool = False,
    fused_qkv: bool = False,
) -> list[Shape]:
    """Hidden matrices (rows x cols = out x in, as ``nn.Linear.weight``) of ``layers`` layers, in
    order q, k, v, o (or fused qkv, o), then MLP up (gate, up when ``gated``) and down."""
    kv = dim if kv_rows is None else kv_rows
    hidden = 4 * dim if ffn is None else ffn
    attn = [(dim + 2 * kv, dim), (dim, dim)] if fused_qkv else [(dim, dim), (kv, dim), (kv, dim), (dim, dim)]
    mlp = [(hidden, dim)] * (2 if gated else 1) + [(dim, hidden)]
    return (attn + mlp) * layers


# Meta's params.json: Llama-3-8B dim 4096, 8 kv heads x 128 = 1024 rows, ffn 14336, 32 layers;
# Llama-3-70B dim 8192, 8 kv heads x 128, ffn 28672, 80 layers.
LLAMA3_8B = transformer_shapes(32, 4096, kv_rows=1024, ffn=14336, gated=True)
LLAMA3_70B = transformer_shapes(80, 8192, kv_rows=1024, ffn=28672, gated=True)


@lru_cache(maxsize=4096)
def _blocks(shape: Shape, ranks: int) -> tuple[Block, ...]:
    return shard_blocks(shape, [AxisShard(0, 0, ranks)])


def sharded_plan(shapes: Sequence[Shape], world_size: int, mode: str = "owner") -> Plan:
    """The plan for ``shapes`` laid out as FSDP2 does (``Shard(0)`` over ``world_size`` ranks)."""
    entries = [MatrixEntry(tuple(s), _blocks(tuple(s), world_size)) for s in shapes]  # type: ignore[arg-type]
    return build_plan(entries, world_size, mode)


@dataclass
class _Links:
    """Bytes per rank in one all-to-all: sent and received, inside the node and across nodes."""

    send_intra: list[float]
    send_inter: list[float]
    recv_intra: list[float]
    recv_inter: list[float]

    def seconds(self, hw: Hardware) -> float:
        """The busiest rank's busiest link; each link carries one send and one receive at once."""
        worst = 0.0
        for si, se, ri, re in zip(
            self.send_intra, self.send_inter, self.recv_intra, self.recv_inter, strict=True
        ):
            worst = max(worst, max(si, ri) / hw.intra_node_bandwidth, max(se, re) / hw.inter_node_bandwidth)
        return hw.collective_latency + worst


def _to_owner_links(
    plan: Plan, members: Sequence[int], owners: Sequence[int], itemsize: int, per_node: int
) -> _Links:
    """Traffic of one round's all-to-all to the owners (gather mode: to everyone)."""
    n = plan.group_size
    node = [r // per_node for r in range(n)]
    node_size = [min(per_node, n - k * per_node) for k in node]
    links = _Links([0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n)
    for member, owner in zip(members, owners, strict=True):
        size = [block_numel(b) * itemsize for b in plan.entries[member].blocks]
        node_sum: dict[int, float] = {}
        for r in range(n):
            node_sum[node[r]] = node_sum.get(node[r], 0.0) + size[r]
        total = sum(size)
        for r in range(n) if owner == EVERYONE else (owner,):
            links.recv_intra[r] += node_sum[node[r]] - size[r]
            links.recv_inter[r] += total - node_sum[node[r]]
        for r in range(n):
            if owner == EVERYONE:
                links.send_intra[r] += size[r] * (node_size[r] - 1)
                links.send_inter[r] += size[r] * (n - node_size[r])
            elif r != owner:
                bucket = links.send_intra if node[r] == node[owner] else links.send_inter
                bucket[r] += size[r]
    return links


def _comm(plan: Plan, hw: Hardware, itemsize: int) -> tuple[float, int, list[float]]:
    """Seconds in all-to-alls, their number, and the bytes each rank sends over the step."""
    n = plan.group_size
    sent = [0.0] * n
    if n == 1:
        return 0.0, 0, sent
    seconds, count = 0.0, 0
    for rnd in plan.rounds:
        links = _to_owner_links(plan, rnd.members, rnd.owners, itemsize, hw.gpus_per_node)
        # Owner mode sends the results back: the same traffic with send and receive swapped.
        trips = 1 if plan.mode == "gather" else 2
        seconds += trips * links.seconds(hw)
        count += trips
        for r in range(n):
            sent[r] += links.send_intra[r] + links.send_inter[r]
            if trips == 2:
                sent[r] += links.recv_intra[r] + links.recv_inter[r]
    return seconds, count, sent


def _mid_device(ns: float, comm: float, rounds: int) -> float:
    """Exchange and Newton-Schulz; with pipelining the shorter hides behind the longer but one stage."""
    if rounds <= 1:
        return ns + comm
    return max(ns, comm) + min(ns, comm) / rounds


def _counts(plan: Plan, impl: Implementation, ns_steps: int) -> dict[str, float]:
    """Elements and op counts of the busiest rank (the same rank for all, a safe upper bound)."""
    n = plan.group_size
    local = max(sum(block_numel(e.blocks[r]) for e in plan.entries) for r in range(n))
    owned = [[i for rnd in plan.rounds for i in rnd.owned_by(r)] for r in range(n)]
    owned_elems = max(sum(math.prod(plan.entries[i].shape) for i in mine) for mine in owned)
    owned_count = max(len(mine) for mine in owned)
    shapes_owned = max(len({plan.entries[i].shape for i in mine}) for mine in owned)
    ns_calls = shapes_owned * len(plan.rounds) if impl.batched_ns else owned_count
    exchanged = n > 1
    return {
        "local": local,
        "pack": (n if plan.mode == "gather" else 1) * local if exchanged else 0,
        "assemble": owned_elems if exchanged else 0,
        "pack_back": owned_elems if exchanged and plan.mode == "owner" else 0,
        "ns_ops": ns_calls * (3 + 3 * ns_steps),
        "assemble_ops": owned_count * n if exchanged else 0,
    }


def _phases(plan: Plan, hw: Hardware, impl: Implementation, ns_steps: int, itemsize: int) -> dict[str, float]:
    """Device and host seconds of the pre, mid and post phases, and the exchange's parts."""
    ns = max(plan.loads) * ns_steps / hw.matmul_flops
    comm, collectives, sent = _comm(plan, hw, itemsize)
    if plan.group_size > 1:  # the preflight all-reduce
        comm += hw.collective_latency
        collectives += 1
    c = _counts(plan, impl, ns_steps)
    bw, op, matrices = hw.memory_bandwidth, hw.op_overhead, len(plan.entries)
    copies = (c["assemble"] + c["pack_back"]) * impl.copy_bytes / bw
    return {
        "ns": ns,
        "comm": comm,
        "collectives": collectives,
        "sent_mean": sum(sent) / plan.group_size,
        "sent_max": max(sent),
        "pre_dev": (c["local"] * impl.pre_bytes + c["pack"] * impl.copy_bytes) / bw,
        "mid_dev": _mid_device(ns, comm, impl.pipeline_rounds) + copies,
        "post_dev": c["local"] * impl.post_bytes / bw,
        "copies": copies,
        "pre_host": (matrices * impl.pre_ops + impl.fixed_ops / 2) * op,
        "mid_host": (c["ns_ops"] + c["assemble_ops"] + collectives) * op,
        "post_host": (matrices * impl.post_ops + impl.fixed_ops / 2) * op,
    }


def predict(
    shapes: Sequence[Shape],
    world_size: int,
    hw: Hardware | None = None,
    *,
    mode: str = "owner",
    impl: Implementation = CURRENT,
    ns_steps: int = 5,
    itemsize: int = 2,
) -> Prediction:
    """Predict one step. ``mode``: "owner", "gather", or "redundant" (Newton-Schulz of every matrix
    on one device and nothing else: the cost every rank pays when each orthogonalizes everything)."""
    hw = hw or Hardware.h200()
    if mode == "redundant":
        ns = sum(ns_flops(s, ns_steps) for s in shapes) / hw.matmul_flops
        return Prediction(mode, world_size, ns, ns, 0.0, 0.0, 0.0, 0, 0.0, 0.0, 1.0)
    plan = sharded_plan(shapes, world_size, mode)
    p = _phases(plan, hw, impl, ns_steps, itemsize)
    if hw.async_host:  # the host runs ahead of the device; its post work hides behind the exchange
        total = max(p["pre_dev"], p["pre_host"]) + max(
            p["mid_dev"] + p["post_dev"], p["mid_host"] + p["post_host"]
        )
    else:
        total = sum(p[k] for k in ("pre_dev", "mid_dev", "post_dev", "pre_host", "mid_host", "post_host"))
    return Prediction(
        mode=mode,
        world_size=world_size,
        total=total,
        newton_schulz=p["ns"],
        comm=p["comm"],
        memory=p["pre_dev"] + p["post_dev"] + p["copies"],
        host=p["pre_host"] + p["mid_host"] + p["post_host"],
        collectives=int(p["collectives"]),
        bytes_sent_mean=p["sent_mean"],
        bytes_sent_max=p["sent_max"],
        imbalance=plan.imbalance,
    )
