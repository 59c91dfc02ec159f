"""Training stacks: the Hugging Face Trainer (``hf``), torchtitan's checkpointer (``torchtitan``),
pipeline stages with torch's ``PipelineStage`` (``pipeline``) and clipping across them (``clipping``). Lightning needs no code here
(docs/lightning.md). Row ``integrations/`` of docs/design.md's layer table."""
