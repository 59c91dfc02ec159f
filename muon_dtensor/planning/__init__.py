"""Capacity planning: the cost model of one optimizer step and the hardware it runs on
(``python -m muon_dtensor plan``). Pure arithmetic; the optimizer never imports it."""
