"""gpu_check's printed table: one line per part, with the figure that settles it."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def summary_a(result: dict[str, Any]) -> str:
    return (
        f"{result['shapes_batch_independent']}/{result['shapes_checked']} shapes bitwise equal alone and "
        f"in every batch {result['batches']}; torch.optim.Muon's path equal on "
        f"{result['torch_equal_shapes']}/{result['shapes_checked']}"
    )


def summary_b(result: dict[str, Any]) -> str:
    parts = [f"peak {result['peak']['tflops']:.4g} TFLOP/s"]
    for r in result["rows"]:
        if "tflops" in r and tuple(r["shape"]) in {(4096, 4096), (4096, 14336), (8192, 28672), (64, 64)}:
            shape = "x".join(map(str, r["shape"]))
            tag = f"{shape} {r['algorithm']}{' compiled' if r['compiled'] else ''}"
            parts.append(f"{tag} {r['fraction_of_peak']:.2f} of peak")
    errors = sum("error" in r for r in result["rows"])
    return "; ".join(parts) + (f"; {errors} case(s) failed" if errors else "")


def summary_c(result: dict[str, Any]) -> str:
    parts = []
    for label, row in result["contenders"].items():
        if "error" in row:
            parts.append(f"{label}: error")
            continue
        parts.append(
            f"{label}: {row['ops']} ops, host {_fmt(row['host_ms'])} ms "
            f"({_fmt(row['host_us_per_op'])} us/op), device {_fmt(row['device_ms'])} ms, "
            f"kernels {_fmt(row.get('kernel_ms'))} ms"
        )
    return "; ".join(parts) + f" (model: {result['host_model_us_per_op']:.0f} us/op)"


def summary_d(result: dict[str, Any]) -> str:
    parts = []
    for name, row in result.get("variants", {}).items():
        if "capture" in row and not row["capture"]:
            parts.append(f"{name}: capture failed")
        elif "replay_equals_eager_per_step" in row:
            same = all(row["replay_equals_eager_per_step"])
            parts.append(f"{name}: replay {'==' if same else '!='} eager")
        else:
            parts.append(f"{name}: {row.get('skipped') or 'error'}")
    return "; ".join(parts)


def summary_e(result: dict[str, Any]) -> str:
    parts = [f"{result['world']} ranks"]
    for name, row in result["runs"].items():
        parts.append(
            f"{name}: {'error' if 'error' in row else 'bitwise' if row['bitwise_equal'] else 'differs'}"
        )
    syncs = [s for rows in result["sync_check_per_rank"].values() for s in rows if s]
    parts.append("steady step syncs" if any(s.get("syncs") for s in syncs) else "no host sync")
    return "; ".join(parts)


SUMMARIES = {"a": summary_a, "b": summary_b, "c": summary_c, "d": summary_d, "e": summary_e}


def line(key: str, entry: dict[str, Any]) -> str:
    """What the part found, or why it did not run."""
    if entry["status"] == "error":
        return entry["error"].strip().splitlines()[-1][:160]
    if entry["status"] == "skipped":
        return entry["reason"]
    try:
        return SUMMARIES[key](entry["result"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"(no summary: {exc!r})"


def table(parts: dict[str, dict[str, Any]], names: dict[str, str]) -> str:
    rows = ["| part | status | s | result |", "|---|---|---:|---|"]
    for key, entry in parts.items():
        rows.append(
            f"| {key} {names[key]} | {entry['status']} | {entry['seconds']:.1f} | {line(key, entry)} |"
        )
    return "\n".join(rows)
