"""`megappo` with one fault injected, for tests/e2e/test_bad_inputs_cli.py:

    python tests/e2e/_faults.py FAULT train RECIPE.yaml key=value ...

  nan_reward    the reward function 'nan' scores every response NaN, so every loss is NaN
  corrupt_sync  the hf engine adds 1 to the first element of the first tensor it loads
  stall_rank0   global rank 0 sleeps 600 s at the start of the first generation, while the
                other ranks wait for the batch: a hung rank
  sigint_setup  every rank sends itself SIGINT when its setup (megappo.trainer.setup.create_run) is done,
                before the first step
  slow_step2    global rank 0 sleeps 600 s at the start of step 2's generation: a step that
                is still running when a signal comes (it first creates the file named by
                $FAULT_HELD_FILE, if set, so a test can signal once step 2 is held)
  no_tensorboard_rank0  global rank 0 cannot import torch.utils.tensorboard (as if tensorboard were
                missing there only, past the launcher's check): with logging.sinks=[...,tensorboard]
                rank 0 fails in its set-up with the metrics logger's ImportError, a bug's traceback

The rest is the real CLI (megappo.cli.main, ended as megappo.cli.entry ends it): its launcher
re-runs this script on every rank, so every rank injects the same fault.
"""

import os
import sys
import time

from megappo import cli, rewards


def main() -> int:
    fault, argv = sys.argv[1], sys.argv[2:]
    if fault == "nan_reward":
        rewards.REWARD_FUNCTIONS["nan"] = lambda response, ground_truth, extra: float("nan")
    elif fault == "corrupt_sync":
        from megappo.rollout.hf.engine import HFEngine

        load = HFEngine.update_weights

        def corrupting(self, buckets):
            def corrupt(buckets):
                for i, bucket in enumerate(buckets):
                    if i == 0:
                        name, t = bucket[0]
                        t = t.clone()
                        t.view(-1)[0] += 1.0
                        bucket = [(name, t)] + bucket[1:]
                    yield bucket

            load(self, corrupt(buckets))

        HFEngine.update_weights = corrupting
    elif fault == "stall_rank0":
        if os.environ.get("RANK") == "0":  # the ranks, not the launcher (generation runs on rank 0)
            from megappo.trainer import step as trainer_step

            generate = trainer_step.generate

            def stalled(run, step):
                time.sleep(600)
                return generate(run, step)

            trainer_step.generate = stalled
    elif fault == "sigint_setup":
        import signal

        from megappo.trainer import setup

        create_run = setup.create_run

        def interrupted(cfg):
            created = create_run(cfg)
            os.kill(os.getpid(), signal.SIGINT)
            return created

        setup.create_run = interrupted
    elif fault == "slow_step2":
        if os.environ.get("RANK", "0") == "0":  # rank 0 of a launched world, or a world of one
            from megappo.trainer import step as trainer_step

            generate = trainer_step.generate

            def slow(run, step):
                if step == 2:
                    if os.environ.get("FAULT_HELD_FILE"):
                        open(os.environ["FAULT_HELD_FILE"], "w").close()
                    time.sleep(600)
                return generate(run, step)

            trainer_step.generate = slow
    elif fault == "no_tensorboard_rank0":
        if os.environ.get("RANK") == "0":  # the ranks, not the launcher (which checks the package is installed)
            sys.modules["torch.utils.tensorboard"] = None  # `import` raises ImportError
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    return cli.main(argv)


if __name__ == "__main__":
    from megappo.parallel.launch import exit_rank

    exit_rank(main())  # as the megappo command ends (megappo.cli.entry)
