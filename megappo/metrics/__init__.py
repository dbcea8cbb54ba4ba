"""Metrics and logging: what a run reports, and where it goes.

  sinks       metric sinks (JSONL, TensorBoard, wandb, MLflow), the console and progress line,
              `megappo plot`
  perf        per-stage peak GPU memory, FLOP rates and MFU, the GPU peak table
  sample_log  decoded samples: a few per step (logging.samples), or all (rollout_dir)
  validation  validation statistics per data source (verl's mean@N, best@k, maj@k)

These modules compute and write numbers they are given; they do not know how a step makes them.
"""
