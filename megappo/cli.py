"""`megappo` command line: train, plot, smoke.

  megappo train RECIPE.yaml [key.sub=value ...]   PPO/GRPO/... (launches tp*pp ranks itself
                                                  unless run under torchrun)
  megappo plot RUN_DIR                            curves.png from metrics.jsonl
  megappo smoke                                   2 gloo ranks: tiny Llama from config, HF ->
                                                  Megatron TP=2 -> HF with verification, and
                                                  greedy decoding checked against transformers

This module parses arguments and dispatches; it holds no model or PPO logic.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _greedy_megatron(model, prompt_ids, steps):
    """Greedy decoding by re-running the whole sequence (smoke test, not an engine)."""
    import torch

    from megappo.models.forward import gather_vocab_logits, run_micro_batches

    ids = prompt_ids.clone()
    for _ in range(steps):
        outs = run_micro_batches(model, [{"input_ids": ids}], lambda o, mb: (o.sum() * 0, o[:, -1].detach()),
                                 forward_only=True)
        logits = gather_vocab_logits(outs[0], model)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


def cmd_smoke(args) -> int:
    from megappo.parallel.launch import ensure_ranks

    ensure_ranks(2)
    import torch
    import torch.distributed as dist

    from megappo.convert import hf_to_megatron, megatron_to_hf
    from megappo.models.builders import build_model
    from megappo.models.checkpoint import load_model
    from megappo.models.hf_config import dims_from_hf
    from megappo.models.hf_reference import TINY_CONFIGS, build_hf_model, save_hf_dir
    from megappo.parallel.state import destroy_parallel, init_parallel

    start = time.time()
    ps = init_parallel(tp=2, pp=1)
    say = print if ps.rank == 0 else (lambda *a, **k: None)
    out = os.path.abspath(args.output_dir)
    hf_dir, ckpt, back = (os.path.join(out, n) for n in ("hf", "megatron_tp2", "hf_roundtrip"))
    cfg = TINY_CONFIGS["llama"]
    hf = build_hf_model(cfg, seed=0)
    if ps.rank == 0:
        save_hf_dir(hf_dir, hf.state_dict(), cfg)
    dist.barrier()
    say(f"[1/4] tiny Llama from config -> {hf_dir}")
    res = hf_to_megatron(hf_dir, ckpt, ps, verify=True, overwrite=True)
    say(f"[2/4] HF -> Megatron TP=2 checkpoint {ckpt}: {res}")
    res = megatron_to_hf(ckpt, back, ps, verify=True, overwrite=True)
    say(f"[3/4] Megatron -> HF {back}: {res}")
    model = build_model(dims_from_hf(cfg), ps)
    load_model(model, ckpt)
    prompt = torch.randint(0, cfg["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))
    got = _greedy_megatron(model, prompt, steps=8)
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    same = torch.equal(got, ref)
    say(f"[4/4] greedy decode at TP=2: {got[:, 6:].tolist()} == transformers.generate: {same}")
    say(f"demo finished in {time.time() - start:.1f}s")
    destroy_parallel()
    return 0 if same else 1


def cmd_train(args) -> int:
    from megappo.config import load_config
    from megappo.parallel.launch import ensure_ranks

    cfg = load_config(args.recipe, args.overrides)  # every config error before any rank starts
    ensure_ranks(args.world_size or cfg.parallel.tp * cfg.parallel.pp)
    from megappo.metrics import plot_run
    from megappo.orchestrator import train
    from megappo.parallel.state import destroy_parallel
    from megappo.run import create_run

    run = create_run(cfg)
    history = train(run)
    if run.ps.is_rank0:
        png = plot_run(cfg.run.output_dir)
        last = history[-1] if history else {}
        print(f"done: {len(history)} steps, final critic/score/mean={last.get('critic/score/mean', float('nan')):.3f}; "
              f"metrics in {cfg.run.output_dir}/metrics.jsonl, curves in {png}", flush=True)
    destroy_parallel()
    return 0


def cmd_plot(args) -> int:
    from megappo.metrics import plot_run

    print(plot_run(args.run_dir))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megappo", description="PPO for language models on Megatron-Core")
    sub = parser.add_subparsers(dest="command", required=True)
    smoke = sub.add_parser("smoke", help="CPU smoke job: tiny model, TP=2 conversion round trip, greedy decode")
    smoke.add_argument("--output-dir", default="runs/smoke")
    smoke.set_defaults(func=cmd_smoke)
    train = sub.add_parser("train", help="run PPO from a recipe: megappo train RECIPE.yaml [key.sub=value ...]")
    train.add_argument("recipe")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2 actor.optim.lr=1e-6")
    train.add_argument("--world-size", type=int, default=None,
                       help="ranks to launch when not under torchrun (default: parallel.tp * parallel.pp)")
    train.set_defaults(func=cmd_train)
    plot = sub.add_parser("plot", help="write RUN_DIR/curves.png from RUN_DIR/metrics.jsonl")
    plot.add_argument("run_dir")
    plot.set_defaults(func=cmd_plot)
    args = parser.parse_args(argv)
    from megappo.config import ConfigError
    from megappo.data import DataError
    from megappo.models.hf_config import ModelConfigError

    try:
        return args.func(args)
    except (ConfigError, DataError, ModelConfigError) as e:  # bad input: the message says the fix
        print(f"megappo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
