"""Convert several HF directories with verification in one process: a world of one (TP1), the
same `megappo.trainer.convert.hf_to_megatron` that tools/convert_hf_to_megatron.py runs per directory,
without a process start (imports, gloo) per directory. Prints one JSON line per directory.

    python tests/e2e/_convert_in_process.py HF_DIR OUT [HF_DIR OUT ...]
"""

import json
import sys

from megappo.trainer.convert import hf_to_megatron
from megappo.parallel.state import destroy_parallel, init_parallel


def main(argv: list[str]) -> int:
    ps = init_parallel(1, 1)
    for hf_dir, out in zip(argv[0::2], argv[1::2]):
        print("verify: " + json.dumps({"hf_dir": hf_dir, **hf_to_megatron(hf_dir, out, ps, verify=True)}), flush=True)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
