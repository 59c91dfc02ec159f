"""The floor under every layer: the torch shims (``compat.py``: the private torch.distributed, DCP
and optimizer names; ``torch_ops.py``: the multi-tensor ops, no ``torch.distributed``), through
which every private torch name the package uses is reached, what a parameter's name says
(``names.py``: FQNs in errors, heads) and warnings at the user's line (``warn.py``). It imports
nothing of the package. Row ``base/`` of docs/design.md's layer table."""
