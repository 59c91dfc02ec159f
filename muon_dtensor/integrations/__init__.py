"""Training stacks: the Hugging Face Trainer (``hf``). Lightning and torchtitan need no code here
(docs/lightning.md, docs/torchtitan.md). Row ``integrations/`` of
docs/design.md's layer table."""
