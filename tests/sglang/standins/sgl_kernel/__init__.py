"""Stand-in for `sgl_kernel` (SGLang's CUDA kernel package) in the CPU SGLang test lane.

The `sglang-kernel` package ships CUDA wheels only. On CPU (SGLANG_USE_CPU_ENGINE=1) SGLang
0.5.23 imports the names below at module level but calls none of them on the paths megappo
uses (torch_native attention, pytorch sampler, no speculative decoding, no AMX). Each name is
a function that records the call in the file named by MEGAPPO_STANDIN_LOG (the lane checks
that this file stays empty, scheduler subprocesses included) and raises. A name SGLang
imports that is not listed here fails the import, loudly.

This module knows nothing of megappo; it is installed only into the lane's virtualenv.
"""

import os
import traceback

__version__ = "0.0.0+megappo-standin"

NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "verify_tree_greedy_cpu",
    "build_tree_kernel_efficient_cpu",
)


def _standin(name):
    def called(*args, **kwargs):
        log = os.environ.get("MEGAPPO_STANDIN_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"sgl_kernel.{name} called (pid {os.getpid()}):\n{''.join(traceback.format_stack())}\n")
        raise RuntimeError(f"sgl_kernel.{name} is a CPU-lane stand-in (tests/sglang/standins) and was called: "
                           "the CPU SGLang lane assumed SGLang never calls it on CPU")

    called.__name__ = name
    return called


for _name in NAMES:
    globals()[_name] = _standin(_name)
