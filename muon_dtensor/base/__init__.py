"""The floor under every layer: the torch shims (``compat``: the version-tolerant lookups;
``torch_dist``: the private torch.distributed, DCP, optimizer and module names; ``torch_ops``: the
multi-tensor ops, no ``torch.distributed``), through which every private torch name the package
uses is reached, what a parameter's name says (``names``: FQNs in errors, heads), warnings at the
user's line (``warn``), the one table of old paths of moved modules (``moved``), the memo
pattern of caches keyed by an object (``weak_memo``) and the top-level ops of a profiled step
(``op_count``). It imports nothing of the
package above it. Row ``base/`` of docs/design.md's layer table."""
