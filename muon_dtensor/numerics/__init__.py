"""The math: Newton-Schulz (standard, Gram, over column blocks), Muon's and AdamW's elementwise rules,
NorMuon's row normalization. Pure and shard-agnostic: nothing here imports ``torch.distributed``.
Its modules, one by one: row ``numerics/`` of docs/design.md's layer table."""
