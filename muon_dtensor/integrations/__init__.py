"""Training stacks: the Hugging Face Trainer (``hf``), torchtitan's checkpointer (``torchtitan``),
pipeline stages with torch's ``PipelineStage`` (``pipeline``). Lightning needs no code here
(docs/lightning.md). Row ``integrations/`` of docs/design.md's layer table."""
