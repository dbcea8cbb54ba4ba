#!/usr/bin/env python
"""megappo Megatron checkpoint -> HF model directory (config, tokenizer files, safetensors).

    python tools/convert_megatron_to_hf.py --ckpt CKPT --out HF --tp 2 --pp 2 [--ep 2] [--verify]

Loads the checkpoint at the given TP/PP (any layout: Megatron's distributed checkpoints
reshard on load), gathers TP shards and pipeline stages on rank 0 one tensor at a time, and
writes size-bounded safetensors shards. --verify checks the written files against the
loaded shards bit for bit and the logits against transformers loading the written directory.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models); ranks = tp*pp*ep")
    p.add_argument("--max-shard-gb", type=float, default=2.0)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args()

    from megappo.cli import run_reporting_errors

    # a user's mistake is one line naming the flag to fix and exit code 2, on every rank
    return run_reporting_errors(convert, args)


def convert(args) -> int:
    from megappo.trainer.checkpointing import STATE_FILE, check_model_dir
    from megappo.trainer.convert import check_output_dir
    from megappo.models.checkpoint import META_FILE, read_metadata
    from megappo.models.hf_config import ModelConfigError, ModelDims
    from megappo.parallel.launch import ensure_ranks

    if not os.path.isfile(os.path.join(args.ckpt, META_FILE)):
        trainer = any(os.path.isfile(os.path.join(d, STATE_FILE)) for d in (args.ckpt, os.path.dirname(args.ckpt)))
        hint = (f"it is a trainer checkpoint: pass --ckpt {os.path.join(args.ckpt, 'actor')} (or critic), or use "
                f"`megappo export {args.ckpt} OUT`" if trainer else
                "pass --ckpt a directory written by tools/convert_hf_to_megatron.py or a trainer checkpoint's "
                "actor/ or critic/ directory")
        raise ModelConfigError(f"--ckpt '{args.ckpt}' is not a megappo model checkpoint (no {META_FILE}). Fix: {hint}.")
    check_model_dir(args.ckpt)  # a trainer checkpoint's files against their digests, before anything reads them
    dims = ModelDims(**read_metadata(args.ckpt)["dims"])
    dims.check_layout(args.tp, args.pp, names=("--tp", "--pp"), ep=args.ep, ep_name="--ep")
    check_output_dir(args.out, args.overwrite)
    ensure_ranks(args.tp * args.pp * args.ep)

    from megappo.trainer.convert import megatron_to_hf
    from megappo.parallel.state import destroy_parallel, init_parallel

    from megappo.cli import adapter_base_of, peft_note

    base = adapter_base_of(args.ckpt)  # a LoRA actor's: where its peft adapter finds the base model
    ps = init_parallel(args.tp, args.pp, ep=args.ep)
    results = megatron_to_hf(args.ckpt, args.out, ps, verify=args.verify, overwrite=args.overwrite,
                             max_shard_bytes=int(args.max_shard_gb * (1 << 30)), base=base)
    if ps.rank == 0:
        print(f"wrote {args.out}")
        if base:
            print(peft_note(args.out, base.path))
        if args.verify:
            print("verify: " + json.dumps(results))
    destroy_parallel()
    return 0


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # a rank skips the interpreter's teardown (megappo.parallel.launch); elsewhere sys.exit
