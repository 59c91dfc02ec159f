"""Docstring text shared by the classes that take ``Muon``'s arguments (as torch.optim shares
``_params_doc`` and its friends between optimizers)."""

from __future__ import annotations

__all__ = ["MUON_ARGS"]

MUON_ARGS = r"""
    Args:
        params: parameters, named parameters or param groups. A group may set ``"algorithm"`` to
            ``"muon"`` (default) or ``"adamw"``; AdamW groups take ``lr, betas, eps, weight_decay``
            with torch.optim.AdamW's meaning and defaults (``ADAMW_DEFAULTS``).
        lr: learning rate (default: 1e-3).
        weight_decay: decoupled weight decay, tied to lr (default: 0.1).
        momentum: momentum factor (default: 0.95).
        nesterov: Nesterov momentum (default: True).
        ns_coefficients: (a, b, c) for every iteration, a list of per-iteration triples, or a preset
            name: "keller", "you", "polar_express", "turbo_muon" (with ns_algorithm="aol") (default:
            (3.4445, -4.7750, 2.0315)).
        eps: floor of the norm the Newton-Schulz input is divided by (default: 1e-7).
        ns_steps: Newton-Schulz iterations (default: 5).
        adjust_lr_fn: None or "original" (sqrt(max(1, rows/cols))), "match_rms_adamw"
            (0.2 sqrt(max(rows, cols))), "spectral" (sqrt(rows/cols)), or a number r, the update
            RMS to match (r sqrt(max(rows, cols))); from the global shape (default: None).
        ns_dtype: Newton-Schulz and transfer dtype, torch.bfloat16 (default) or torch.float32.
        momentum_dtype: dtype of the momentum buffer: None (the parameter's, as torch.optim.Muon;
            default), torch.bfloat16, torch.float32, torch.float64, or torch.int8 (8-bit blocks of
            256 columns with a float32 maximum each, state "momentum_absmax"). A buffer in
            another dtype than its gradient is updated in the wider of the two and stored rounded
            once; this step's Newton-Schulz input is formed from the unrounded value. A load keeps
            this setting and converts a buffer saved in another dtype, with a warning. Muon groups
            only (AdamW and NorMuon's second moment keep the parameter's dtype). Also a per-group key.
        ns_algorithm: "standard" (torch's iteration; default) or "gram" (the same polynomial on the
            small Gram matrix, with restarts; it runs where it needs fewer flops, with 5 steps on
            matrices whose long side is over 1.5x the short one, the others run "standard") or
            "aol" (Turbo-Muon: AOL's row scaling instead of the Frobenius division, its Gram matrix
            reused by the first step; with ns_coefficients="turbo_muon", ns_steps=4).
        mode: "owner" (each matrix orthogonalized once, on a balanced owner rank; default) or
            "gather" (every rank gathers and orthogonalizes every matrix; for comparison).
        process_group: the ranks that hold replicated plain parameters (DDP); they split the
            Newton-Schulz work. Without it plain tensors are stepped locally.
        step_group: the ranks that call step() together (a ProcessGroup or a DeviceMesh). A step
            on sharded parameters first checks over it that every rank of each mesh steps on that
            mesh, so a rank lacking one is an error on every rank, not a hang. Default: the
            default group (every rank); under pipeline parallelism where stages step at different
            times, pass the stage's group. An optimizer of plain tensors only (no process_group)
            communicates nothing, as torch.optim's.
        max_round_bytes: bytes of full matrices one pipelined exchange round carries, at least one
            matrix per rank; None: one round (default: 4 MiB, docs/benchmarks.md).
        owners: for parameters a mesh both shards and replicates (HSDP): "mesh" (each matrix
            orthogonalized once among all ranks of the mesh, results sent to every replica),
            "replica" (once in every replica group, no traffic between replicas) or "auto" (the
            cost model picks per mesh; default). Also a per-group key.
        ns_split: "off" (default), "auto" or a rank count k: run a matrix's Newton-Schulz over
            several ranks of its exchange group (``muon_dtensor.numerics.split_ns``), where the cost model
            says it pays ("auto") or for every matrix over min(k, group size) ranks. The one
            option under which a sharded step is not bitwise the one-process step: it equals
            ``split_orthogonalize`` bitwise and the unsplit iteration within bf16 rounding
            (docs/design.md). Standard iteration, owner mode, no NorMuon. Also a per-group key.
        capturable: keep the step's scalars on the device for a CUDA graph (default: False): a
            0-dim tensor lr on the parameters' device is never read by the step, AdamW groups run
            torch's capturable AdamW. CUDA (torch's capturable devices) only. Also a per-group key.
        orthogonalize_fn: how an owner orthogonalizes a batch of same-shape full matrices,
            ``(matrices, config: NSConfig) -> list of results`` (default:
            ``newton_schulz.orthogonalize``); NorMuon groups run it inside their row
            normalization, split matrices (``ns_split``) run ``split_ns``. The same function on
            every rank; a sharded step equals the one-process step with the same function.

    Per-group options beyond torch's: ``"flatten": True`` treats a conv weight ``(out, in, *k)`` as
    one ``(out, in*prod(k))`` matrix; ``"experts": True`` treats a 3-D ``[E, m, n]`` parameter as E
    matrices; ``"split_sizes": [...]`` orthogonalizes row blocks separately (fused q, k, v);
    ``"head_dim": d`` orthogonalizes each head's block of d rows separately (within each split);
    ``"normuon": True`` normalizes each row of the orthogonalized update by a running second moment
    (NorMuon, arXiv 2510.05491; decay ``"beta2"``, default 0.95; state ``"second_momentum_buffer"``),
    computed exactly on the owner of the whole matrix (``muon_dtensor.numerics.normuon``).
"""
