"""What the cost model (costmodel.py) knows about a machine: rates, bandwidths, latencies, host cost.

Defaults for an H200 with NVLink and 400 Gb/s InfiniBand, every figure sourced below; or rates
fitted from measurements (benchmarks/calibrate.py does that on this machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["Hardware", "fit_latency_bandwidth"]


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
