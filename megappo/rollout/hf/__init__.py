"""The hf engine: transformers with a KV cache, megappo's rollout engine on CPU (and on a GPU
without SGLang).

  engine          HFEngine: generation, weight updates, fingerprints
  sampling        per-row sampling: top-k / top-p, inverse-CDF draws, seeded [R, N] uniforms
  decode_paths    which decode path it runs (rollout.hf_decode) and why; no torch
  static_decode   the fixed-shape decode: fixed-capacity cache, batch buckets, sampling in the
                  step, CUDA-graph capture
  decode_kernels  the fixed-shape step's kernels in place of transformers' eager pieces
  remote          the engine in a child process of rank 0 (rollout.placement=separate)

The engine interface it implements is `megappo.rollout.engine`'s; it does not know the trainer.
"""
