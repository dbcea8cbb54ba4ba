"""`megappo plan`: will a recipe fit, before anything is built.

  planner  layout checks and a per-GPU memory estimate (weights, optimizer, activations, the
           engine's KV cache) from the recipe and the model's HF config; KNOWN_MODELS
  fixes    what to change when a plan does not fit: changes, variants and GPU counts, each
           planned again by the planner

The planner builds no model and starts no process; the trainer does not import it.
"""
