"""What the cost model (costmodel.py) knows about a machine: rates, bandwidths, latencies, host cost.

Defaults for an H200 with NVLink and 400 Gb/s InfiniBand, every figure sourced at ``Hardware.h200``;
or rates fitted from measurements (``benchmarks/calibrate.py`` fits them on the machine it runs on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..sharding.plan.grid import butterfly_steps, ring_hops

__all__ = [
    "GLOO_HOP_SECONDS",
    "GLOO_PAIR_STEP_SECONDS",
    "Hardware",
    "check_collectives",
    "check_seconds",
    "fit_latency_bandwidth",
]


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
    check_backend: str = "nccl"  # where the step's check all-reduce runs: "nccl", or "gloo" (a CPU group)

    @classmethod
    def h200(cls, **overrides: Any) -> Hardware:
        """One H200 SXM in an 8-GPU HGX node with NVLink 4 and one 400 Gb/s InfiniBand NIC per GPU.

        Keyword arguments replace single fields, e.g. ``Hardware.h200(matmul_flops=600e12)``.
        """
        # Matmul: real bf16 GEMMs stay below the datasheet's dense peak (989 TFLOP/s, NVIDIA H200
        # product page, https://www.nvidia.com/en-us/data-center/h200/); 790 is what a large bf16
        # torch.mm reached on H200s (docs/benchmarks.md, "Where the H200 figures come from").
        # Memory: elementwise passes count bytes read plus written; the datasheet's 4.8 TB/s HBM3e is
        # a peak, a device-to-device copy reached about 4.3 TB/s (same section).
        # NVLink 4: 900 GB/s per GPU counting both directions, so 450 GB/s each way (same product
        # page; NVIDIA H100 architecture whitepaper, https://resources.nvidia.com/en-us-tensor-core).
        # InfiniBand NDR: 400 Gb/s = 50 GB/s each way per NIC, one NIC per GPU on HGX H200 (NVIDIA
        # ConnectX-7 product brief). Link peaks are optimistic: an all-to-all reaches less.
        # Latency per collective and host time per eager op are assumptions, not measurements: tens
        # of microseconds for a small NCCL collective, a few microseconds of PyTorch dispatch per op.
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


# gloo's allreduce (gloo/allreduce.cc, ``ring``) sends even a few integers twice around the ring: a
# reduce-scatter then an allgather over at least 2 P segments, 2 (2 P - 2) sequential hops for P ranks.
# A hop's time: the best 2-rank all-reduce over loopback (4 hops) in
# benchmarks/results/check_allreduce.json, a quarter of 81 us; across nodes a TCP hop is no faster.
GLOO_HOP_SECONDS = 20e-6
# A step of the check's butterfly (``grid.py``: the library's two-rank all-gather and add) took 0.79 of
# the two-rank all-reduce, best against best, side by side in each of two runs
# (benchmarks/results/check_pairs_2ranks_cached*.json): 0.79 of the all-reduce's 4 hops, 63 us.
GLOO_PAIR_STEP_SECONDS = 0.79 * 4 * GLOO_HOP_SECONDS


def check_seconds(hw: Hardware, ranks: int) -> float:
    """The step's check, a small sum over ``ranks`` ranks: on gloo a ring of ``grid.ring_hops``
    hops of ``GLOO_HOP_SECONDS`` up to ``grid.GRID_ABOVE`` ranks, then ``GLOO_PAIR_STEP_SECONDS`` per
    step of a butterfly of two-rank all-gathers (log2 P steps: 0.82 ms at 8,192 ranks, where one
    ring would be 0.66 s); on NCCL one ``collective_latency`` (an assumption, not measured here)."""
    if ranks <= 1:
        return 0.0
    if hw.check_backend == "gloo":
        steps = len(butterfly_steps(ranks, 0))
        return steps * GLOO_PAIR_STEP_SECONDS if steps else ring_hops(ranks) * GLOO_HOP_SECONDS
    return hw.collective_latency


def check_collectives(hw: Hardware, ranks: int) -> int:
    """Collectives of the step's check: one all-reduce, or on gloo one all-gather per step of the
    butterfly (``grid.py``)."""
    return max(1, len(butterfly_steps(ranks, 0))) if hw.check_backend == "gloo" else 1


# ``plan``'s command-line flag -> (Hardware field, factor from the flag's unit to the field's).
HW_FLAGS = {
    "matmul_tflops": ("matmul_flops", 1e12),
    "memory_tbps": ("memory_bandwidth", 1e12),
    "intra_node_gbps": ("intra_node_bandwidth", 1e9),
    "inter_node_gbps": ("inter_node_bandwidth", 1e9),
    "gpus_per_node": ("gpus_per_node", 1),
    "latency_us": ("collective_latency", 1e-6),
    "op_overhead_us": ("op_overhead", 1e-6),
}
