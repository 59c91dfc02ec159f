"""Opt-in features on top of the step: QK-Clip (``qk_clip``) and the logit recorders that feed it
(``qk_logits``). Row ``features/`` of docs/design.md's layer table."""
