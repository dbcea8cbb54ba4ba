#!/usr/bin/env python
"""HF model directory -> megappo Megatron checkpoint at a chosen TP/PP.

    python tools/convert_hf_to_megatron.py --hf-dir HF --out CKPT --tp 2 --pp 2 [--ep 2] [--role critic] [--verify]

Starts tp*pp*ep local ranks itself (or run it under torchrun with that many). The checkpoint
is a Megatron-Core distributed checkpoint (loadable at any TP/PP) plus megappo_model.json
and the HF config/tokenizer files. --verify reloads what was written and checks the round
trip bit-exact and Megatron's logits against transformers'. Nothing is left at --out
unless every step succeeded.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models); ranks = tp*pp*ep")
    p.add_argument("--role", default="actor", choices=["actor", "ref", "critic", "reward"])
    p.add_argument("--arch", default=None, help="registry key override (default: config.json architectures)")
    p.add_argument("--verify", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args()

    from megappo.cli import run_reporting_errors

    # a user's mistake is one line naming the flag to fix and exit code 2, on every rank
    return run_reporting_errors(convert, args)


def convert(args) -> int:
    from megappo.trainer.convert import check_output_dir
    from megappo.models.hf_config import ModelConfigError, dims_from_hf, load_hf_config
    from megappo.models.weights import HFWeights
    from megappo.parallel.launch import ensure_ranks

    # every input check before any rank starts
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        raise ModelConfigError(f"--hf-dir '{args.hf_dir}' has no config.json: not an HF model directory. Fix: pass "
                               "--hf-dir a directory with config.json and *.safetensors (as save_pretrained writes).")
    dims = dims_from_hf(load_hf_config(args.hf_dir), args.arch)
    dims.check_layout(args.tp, args.pp, names=("--tp", "--pp"), ep=args.ep, ep_name="--ep")
    HFWeights(args.hf_dir)
    check_output_dir(args.out, args.overwrite)
    ensure_ranks(args.tp * args.pp * args.ep)

    from megappo.trainer.convert import hf_to_megatron
    from megappo.parallel.state import destroy_parallel, init_parallel

    ps = init_parallel(args.tp, args.pp, ep=args.ep)
    results = hf_to_megatron(args.hf_dir, args.out, ps, role=args.role, verify=args.verify,
                             overwrite=args.overwrite, arch=args.arch)
    if ps.rank == 0:
        print(f"wrote {args.out} (tp={args.tp} pp={args.pp} role={args.role})")
        if args.verify:
            print("verify: " + json.dumps(results))
    destroy_parallel()
    return 0


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # a rank skips the interpreter's teardown (megappo.parallel.launch); elsewhere sys.exit
