"""`megappo` command line: train, plan, export, plot, smoke.

  megappo train RECIPE.yaml [key.sub=value ...]   PPO/GRPO/... (launches its ranks itself unless
                                                  run under torchrun: a GPU recipe's hardware, else tp*pp)
  megappo train --config-path=DIR --config-name=ppo_megatron_trainer [key=value ...]
                                                  a verl script as written: verl 0.9.1's defaults
                                                  (recipes/verl/) instead of a recipe (train and plan)
  megappo export RUN_OR_CKPT HF_DIR [--role critic] a trainer checkpoint as an HF directory
  megappo export --init RECIPE.yaml HF_DIR          a recipe's initial model (from model.hf_config) as one
  megappo plot RUN_DIR [--metrics GLOBS]          curves.png from metrics.jsonl (chosen metrics: 'filter_groups/*')
  megappo plan RECIPE.yaml [--variant NAME]       layout checks and a per-GPU memory estimate on the
               [--world-size N] [--gpu-mem GiB]   recipe's hardware (no model is built; exit 1 if it
               [key.sub=value ...]                does not fit); docs/planner.md
  megappo hardware RECIPE.yaml [...]              the recipe's hardware as shell variables (launchers)
  megappo smoke                                   2 gloo ranks: tiny Llama from config, HF ->
                                                  Megatron TP=2 -> HF with verification, and
                                                  greedy decoding checked against transformers

This module parses arguments and dispatches; it holds no model or PPO logic.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings


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

    from megappo.trainer.convert import hf_to_megatron, megatron_to_hf
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


def _train_start_up(args):
    """The recipe, the world size, whether this is a Ray driver, and the checkpoint to resume:
    every check that can refuse the run before any rank starts."""
    from megappo.trainer.checkpointing import find_resume
    from megappo.errors import ConfigError
    from megappo.config import read_config
    from megappo.trainer.preflight import check_inputs

    _hydra_recipe(args)  # verl's --config-path / --config-name: the recipe they name
    cfg, verl = read_config(args.recipe, args.overrides, args.variant)  # every config error before any rank starts
    # under torchrun the world is torchrun's; otherwise --world-size, a GPU recipe's hardware, or one replica
    world = args.world_size or int(os.environ.get("WORLD_SIZE", 0))
    on_ray = args.launcher == "ray" and "WORLD_SIZE" not in os.environ  # this is the driver: the ranks are actors
    if args.ray_address and args.launcher != "ray":
        raise ConfigError(f"--ray-address {args.ray_address} is for the Ray launcher. Fix: add --launcher ray.")
    if not world and on_ray:  # a Ray cluster spans nodes: the recipe's whole hardware (one replica on CPU)
        world = cfg.hardware_world_size if cfg.hardware.nodes > 1 else cfg.launch_world_size
    sized_by = _sized_by(verl.set_by, args.recipe)  # the override that sized the run, else the recipe
    if not world and cfg.hardware.nodes > 1:
        raise ConfigError(f"{sized_by(['hardware.nodes'], cfg.hardware.describe(cfg.hardware_world_size))}; "
                          f"megappo train starts ranks on this machine only. Fix: launch it with "
                          f"tools/launch/slurm_multinode.sbatch or --launcher ray, or pass --world-size N for this "
                          f"machine.")
    world = world or cfg.launch_world_size
    mismatch = cfg.hardware_mismatch(world, args.recipe, sized_by(["hardware.nodes", "hardware.gpus_per_node"], ""))
    relaunching = "WORLD_SIZE" not in os.environ and world > 1  # ensure_ranks starts the ranks: rank 0 says it
    if mismatch and os.environ.get("RANK", "0") == "0" and not relaunching:
        print(f"megappo: warning: {mismatch}", file=sys.stderr, flush=True)
    check_inputs(cfg, world, launcher="ray" if on_ray else None)  # packages, world, layout vs model, data files,
    # rewards, tokenizer: no rank started yet
    if relaunching or on_ray:  # this process starts the ranks: every row is checked before any starts
        from megappo.trainer.preflight import check_prompts

        with _serial_tokenizers():  # no thread pool started here: the ranks may be forks of this process
            check_prompts(cfg)
    lock = _lock_run(cfg)  # another live run in these directories: refused before anything is written
    try:
        with warnings.catch_warnings(action="ignore"):  # rank 0 reports resume warnings once
            resume = find_resume(cfg)  # a checkpoint this recipe cannot resume from: refused before any rank starts
        if cfg.run.val_only and resume:  # validating a checkpoint: with its own settings
            cfg = _val_only_settings(cfg, resume, say=os.environ.get("RANK", "0") == "0" and not relaunching
                                     and not on_ray)
    except BaseException:
        lock.release()
        raise
    if os.environ.get("RANK", "0") == "0" and not cfg.run.val_only:  # the lock's holder: a branch from an earlier
        _set_aside_later(cfg, resume)                                  # checkpoint (a validation moves nothing)
    if lock.held and resume is None and not cfg.run.val_only:  # a fresh run: an earlier run's files moved aside
        _set_aside_earlier(cfg)                                 # by the process that holds the lock, before any rank
    if os.environ.get("RANK", "0") == "0" and not relaunching and not on_ray:  # the process that is rank 0
        _say_verl_lines([*args.recipe_lines, *verl.start_up_lines()], cfg.run.output_dir)  # once the run is not refused
    return cfg, world, on_ray, resume, lock


@contextlib.contextmanager
def _serial_tokenizers():
    """While entered, HF tokenizers encode on the calling thread (TOKENIZERS_PARALLELISM=false: the same
    tokens, no rayon thread pool); the variable is restored after, so the ranks' environment is unchanged."""
    key = "TOKENIZERS_PARALLELISM"
    old = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _val_only_settings(cfg, resume: dict, say: bool):
    """run.val_only on a checkpoint: the config it validates with (megappo.trainer.checkpointing.val_only_config: the
    checkpoint's own settings, this command line's validation keys); `say`: one start-up line naming the
    command line's settings it does not use."""
    from megappo.trainer.checkpointing import val_only_config

    cfg, ignored = val_only_config(resume["config"], cfg)
    if say:
        unused = f"; not used from this command line: {', '.join(ignored)}" if ignored else ""
        print(f"megappo: run.val_only: validating {resume['path']} with the checkpoint's own settings (its "
              f"trainer_state.json) and this command line's validation keys (data.val_files, rollout.val_*, "
              f"reward.metric_functions, logging, ...: docs/checkpoints.md){unused}", flush=True)
    return cfg


def _sized_by(set_by: dict[str, str], recipe: str | None):
    """`sized_by(keys, hardware)`: who sized the run for `hardware`, for errors: the overrides (as written) that
    set `keys` ('trainer.nnodes=16 sizes this run for ...'), else the recipe ('R.yaml is sized for ... (its hardware
    section)'); with `hardware` empty, only the overrides, or None."""
    def sized_by(keys: list[str], hardware: str):
        given = [set_by[k] for k in keys if k in set_by]
        if given:
            return f"{' and '.join(given)} size{'s' if len(given) == 1 else ''} this run" + \
                (f" for {hardware}" if hardware else "")
        return f"{recipe} is sized for {hardware} (its hardware section)" if hardware else None
    return sized_by


def _set_aside_later(cfg, resume) -> None:
    """checkpoint.resume_from starting its branch: checkpoint.dir's later checkpoints moved aside, said in one line."""
    from megappo.trainer.checkpointing import set_aside_later

    aside = set_aside_later(cfg, resume)
    if aside:
        moved = sorted(n for n in os.listdir(aside) if n.startswith("step_"))
        print(f"megappo: going back to {resume['path']} (step {resume['step']}, checkpoint.resume_from): the later "
              f"checkpoints of {cfg.checkpoint_dir} ({', '.join(moved)}) and copies of metrics.jsonl / "
              f"samples.jsonl are in {aside}; nothing was deleted.", flush=True)


def _set_aside_earlier(cfg) -> None:
    """A fresh run that finds an earlier run's files: moved into superseded/, said in one line (megappo.trainer.earlier_runs)."""
    from megappo.trainer.earlier_runs import set_aside_earlier

    line = set_aside_earlier(cfg)
    if line:
        print(f"megappo: {line}", flush=True)


#: the run's record of its start-up lines about verl keys (rewritten at every start)
VERL_KEYS_LOG = "verl_keys.log"


def _say_verl_lines(lines: list[str], run_dir: str) -> None:
    """The start-up lines saying what the command line's verl keys were read as, and which megappo does
    not use (megappo.config.loading.VerlReading), on the console and in run_dir/verl_keys.log."""
    if not lines:
        return
    for line in lines:
        print(f"megappo: {line}", flush=True)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, VERL_KEYS_LOG), "w") as f:
        f.write("".join(line + "\n" for line in lines))


def _lock_run(cfg):
    """The run's lock on run.output_dir and checkpoint.dir (megappo.trainer.runlock), taken by the process
    that lives as long as the run: this one when it launches the ranks or is the only rank, global
    rank 0 under an outside launcher; the ranks a launcher started find its token and go on."""
    from megappo.trainer.runlock import RunLock, acquire

    if os.environ.get("RANK", "0") != "0":
        return RunLock([])
    out, ckpt = os.path.realpath(cfg.run.output_dir), os.path.realpath(cfg.checkpoint_dir)
    if ckpt == out or ckpt.startswith(out + os.sep):  # the output directory's lock covers its checkpoints
        return acquire([cfg.run.output_dir], what="run.output_dir")  # (and creates no checkpoint directory)
    return acquire([cfg.run.output_dir, cfg.checkpoint_dir], what="run.output_dir / checkpoint.dir")


def cmd_train(args) -> int:
    from megappo.parallel import interrupts

    from megappo.parallel.fork import release_signals

    with interrupts.held_during_start_up():  # Ctrl-C while torch is imported: raised after it
        release_signals()  # a Ctrl-C while the command restarted itself (entry: make_environ_room) is handled here
        cfg, world, on_ray, resume, lock = _train_start_up(args)
    with lock:  # released at every end: return, exception, interrupt; by the OS at a crash
        return _train(args, cfg, world, on_ray, resume)


def _train(args, cfg, world, on_ray, resume) -> int:
    from megappo.parallel.launch import ensure_ranks

    if resume and cfg.run.total_steps and resume["step"] >= cfg.run.total_steps and not cfg.run.val_only:
        from megappo.trainer.checkpointing import find_resume

        with warnings.catch_warnings(action="ignore"):  # the ranks say which file is damaged, if they start
            resume = find_resume(cfg, verify="full")  # the digests too, before saying there is nothing to do
    if resume and cfg.run.total_steps and resume["step"] >= cfg.run.total_steps and not cfg.run.val_only:
        print(f"nothing to do: {resume['path']} is at step {resume['step']} and run.total_steps="
              f"{cfg.run.total_steps}. Raise run.total_steps to train longer, or export the models: "
              f"megappo export {cfg.run.output_dir} OUT_DIR", flush=True)
        return 0
    if on_ray:
        from megappo.parallel.ray_launch import launch

        variant = ["--variant", args.variant] if args.variant else []
        return launch(["train", args.recipe, *args.overrides, *variant, "--world-size", str(world)], world,
                      address=args.ray_address or os.environ.get("RAY_ADDRESS") or "auto",
                      gpu=cfg.hardware.device != "cpu")
    from megappo.parallel.fork import RankFork

    # a rank that dies or a collective that times out: every rank starts again, resuming (megappo.parallel.launch);
    # --launcher fork: the ranks are forks of this process once it has imported what they need
    model_type = _model_type(cfg.model.hf_config, cfg.model.path)
    fork = RankFork(preload=lambda: _import_rank_modules(model_type)) if args.launcher == "fork" else None
    ensure_ranks(world, max_restarts=cfg.run.max_restarts, restart_args=("checkpoint.resume=auto",),
                 on_restart=lambda restart: _record_restart(cfg.run.output_dir, restart), fork=fork)
    import torch.distributed

    from megappo.parallel import interrupts

    # Ctrl-C / SIGTERM: stop at a step boundary (torchrun's RANK and LOCAL_WORLD_SIZE, when it started this rank)
    interrupts.install(announce=int(os.environ.get("RANK", 0)) == 0,
                       local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    from megappo.metrics.sinks import plot_run
    from megappo.trainer.loop import train
    from megappo.parallel.stage import stage
    from megappo.parallel.state import destroy_parallel
    from megappo.trainer.setup import create_run, val_only_dir

    with stage("setup"):  # the stage a failed collective reports when no inner one is named
        run = create_run(cfg)
    with stage("train loop"):
        try:
            history = train(run)
        except interrupts.Interrupted as e:
            if run.ps.is_rank0:
                from megappo.metrics.sinks import end_live_line

                end_live_line()  # the line goes below the progress bar, not onto it
                print(f"megappo: {e}", flush=True)
            torch.distributed.barrier()  # no rank ends (and has the launcher stop the others) before that line
            interrupts.uninstall()
            destroy_parallel()
            return e.exit_code
    if run.ps.is_rank0 and cfg.run.val_only:
        val = history[0]
        print(f"done: validated at step {run.start_step}: val/score/mean={val.get('val/score/mean', float('nan')):.3f}"
              f" over {len(run.val_examples)} prompts x {cfg.rollout.val_n}; metrics in "
              f"{os.path.join(val_only_dir(cfg), 'metrics.jsonl')}", flush=True)
    elif run.ps.is_rank0:
        png = plot_run(cfg.run.output_dir)
        print(done_line(history, run.start_step, run.total_steps, cfg.run.output_dir, png), flush=True)
    destroy_parallel()
    return 0


def _model_type(hf_config: dict | None, path: str | None) -> str | None:
    """The model's HF model_type: from model.hf_config, else model.path's config.json (None when unread)."""
    import json

    if hf_config:
        return hf_config.get("model_type")
    try:
        with open(os.path.join(path or "", "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _import_rank_modules(model_type: str | None = None) -> None:
    """Import what every rank of `megappo train` imports before its first step (torch.distributed,
    Megatron-Core, transformers' model code for `model_type`, the run's modules), without their
    import-time warnings (a rank silences them: megappo.parallel.state)."""
    import importlib

    with warnings.catch_warnings(action="ignore"):
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
        import torch.distributed  # noqa: F401
        import transformers.models.auto.modeling_auto  # noqa: F401
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        import megappo.trainer.loop  # noqa: F401  (and the step, setup and roles it imports)
        import megappo.trainer.setup  # noqa: F401

        optional = ["torch.nn.attention.varlen"]  # megappo.models.attention_dispatch's kernels
        if model_type:
            name = model_type_to_module_name(model_type)
            optional.append(f"transformers.models.{name}.modeling_{name}")
        for module in optional:
            try:
                importlib.import_module(module)
            except ImportError:  # the rank finds it missing too, and says so where it matters
                pass


def done_line(history: list[dict], start_step: int, total_steps: int, run_dir: str, png: str) -> str:
    """The run's last line: `done: 100 steps, final critic/score/mean=0.980; metrics in ..., curves in ...`;
    after a resume `done: 69 steps this launch (100 of 100 in the run), ...`."""
    steps = f"{len(history)} steps"
    if start_step:
        steps += f" this launch ({start_step + len(history)} of {total_steps} in the run)"
    last = history[-1] if history else {}
    return (f"done: {steps}, final critic/score/mean={last.get('critic/score/mean', float('nan')):.3f}; "
            f"metrics in {run_dir}/metrics.jsonl, curves in {png}")


def _record_restart(run_dir: str, restart) -> None:
    """One line of `run_dir/restarts.jsonl` per restart (a megappo.parallel.launch.Restart)."""
    import dataclasses
    import json

    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "restarts.jsonl"), "a") as f:
        f.write(json.dumps({**dataclasses.asdict(restart), "time": time.time()}) + "\n")


def cmd_plan(args) -> int:
    from megappo.config import read_config
    from megappo.plan.planner import format_plan, make_plan

    _hydra_recipe(args)
    cfg, verl = read_config(args.recipe, args.overrides, args.variant)
    for line in [*args.recipe_lines, *verl.start_up_lines()]:
        print(f"megappo: {line}")
    plan = make_plan(cfg, args.world_size, gpu_mem_gib=args.gpu_mem, hf_config=args.hf_config, recipe=args.recipe,
                     variant=args.variant)
    print(format_plan(plan))
    fixes = None
    if not plan.fits:
        from megappo.plan.fixes import find_fixes, format_fixes

        fixes = find_fixes(cfg, plan, hf_config=args.hf_config, recipe=args.recipe, overrides=args.overrides,
                           variant=args.variant)
        print(format_fixes(fixes, plan))
    others = sorted(set(cfg.variants) - {args.variant})
    if others and not (fixes and fixes.variant):
        print(f"variants of this recipe (other hardware): {', '.join(others)}; plan one with "
              f"`megappo plan {args.recipe} --variant NAME`")
    return 0 if plan.fits else 1


def cmd_hardware(args) -> int:
    """The recipe's hardware as shell assignments, for tools/launch/ (`eval "$(megappo hardware ...)"`)."""
    from megappo.config import load_config

    cfg = load_config(args.recipe, args.overrides, args.variant)
    hw, world = cfg.hardware, cfg.hardware_world_size
    cfg.validate_world(world)
    print(f"MEGAPPO_DEVICE={hw.device}\nMEGAPPO_NODES={hw.nodes}\nMEGAPPO_GPUS_PER_NODE={world // hw.nodes}\n"
          f"MEGAPPO_WORLD_SIZE={world}\nMEGAPPO_GPU_MEMORY_GIB={hw.gpu_memory_gib:g}")
    return 0


def cmd_export(args) -> int:
    from megappo.errors import ConfigError

    if args.init:
        return export_initial_model(args)
    if args.overrides:
        raise ConfigError(f"megappo export takes key=value overrides with --init only (a recipe's initial model), got "
                          f"{' '.join(args.overrides)}. Fix: drop them, or write `megappo export --init RECIPE OUT "
                          "key=value ...`.")
    from megappo.trainer.checkpointing import check_model_dir, resolve_checkpoint
    from megappo.trainer.convert import check_output_dir
    from megappo.models.checkpoint import read_metadata
    from megappo.models.hf_config import ModelDims
    from megappo.parallel.launch import ensure_ranks

    ckpt = os.path.join(resolve_checkpoint(args.checkpoint), args.role)
    check_model_dir(ckpt)  # its files against the digests recorded at save, before anything reads them
    ModelDims(**read_metadata(ckpt)["dims"]).check_layout(args.tp, args.pp, names=("--tp", "--pp"))
    check_output_dir(args.out, args.overwrite)
    ensure_ranks(args.tp * args.pp)
    from megappo.trainer.convert import megatron_to_hf
    from megappo.parallel.state import destroy_parallel, init_parallel

    base = adapter_base_of(ckpt)
    ps = init_parallel(args.tp, args.pp)
    megatron_to_hf(ckpt, args.out, ps, overwrite=args.overwrite, base=base)
    if ps.rank == 0:
        print(f"exported {ckpt} to {args.out}")
        if base:
            print(peft_note(args.out, base.path))
    destroy_parallel()
    return 0


def export_initial_model(args) -> int:
    """`megappo export --init RECIPE OUT [key=value ...]`: the recipe's initial actor (built from model.hf_config)
    as an HF directory (megappo.trainer.setup.write_initial_model)."""
    from megappo.errors import ConfigError
    from megappo.config import load_config
    from megappo.trainer.setup import write_initial_model

    if args.role != "actor" or args.tp != 1 or args.pp != 1:
        raise ConfigError("megappo export --init writes the recipe's initial actor (the policy) from model.hf_config; "
                          "--role, --tp and --pp are for trainer checkpoints. Fix: drop them.")
    cfg = load_config(args.checkpoint, args.overrides)
    source = write_initial_model(cfg, args.out, args.overwrite)
    print(f"wrote {args.checkpoint}'s initial model ({source.dims.num_layers} layers, hidden {source.dims.hidden_size}, "
          f"vocab {source.dims.vocab_size}; model.seed_init={cfg.model.seed_init}) with its tokenizer to {args.out}; "
          f"a verl script reads it as actor_rollout_ref.model.path={args.out}, megappo as model.path={args.out} "
          "model.hf_config=null")
    return 0


def adapter_base_of(model_ckpt: str):
    """A LoRA actor checkpoint's AdapterBase (megappo.trainer.setup.adapter_base), from the trainer checkpoint's
    saved config beside it; None for anything else (a critic's export is merged only)."""
    import json

    from megappo.trainer.checkpointing import STATE_FILE
    from megappo.models.checkpoint import read_metadata

    meta, state = read_metadata(model_ckpt), os.path.join(os.path.dirname(model_ckpt), STATE_FILE)
    if not meta.get("lora") or meta["role"] != "actor" or not os.path.isfile(state):
        return None
    from megappo.trainer.setup import adapter_base

    with open(state) as f:
        return adapter_base(json.load(f)["config"]["model"])


def peft_note(out: str, base_path: str | None) -> str:
    """What a LoRA export wrote for peft, and how to load it (docs/lora.md)."""
    from megappo.trainer.convert import BASE_DIR, PEFT_DIR

    adapter = os.path.join(out, PEFT_DIR)
    if base_path is None:
        where = f"its base model in {os.path.join(out, BASE_DIR)}"
    elif os.path.isdir(base_path):
        where = f"its base model is {base_path}, the run's model.path"
    else:
        where = (f"adapter_config.json names the run's model.path '{base_path}' as its base, which is not a "
                 f"directory from here: pass the base model to PeftModel.from_pretrained yourself")
    return (f"peft adapter in {adapter}, {where}. Load it with peft (pip install peft): "
            f"AutoPeftModelForCausalLM.from_pretrained({adapter!r}); docs/lora.md")


def cmd_plot(args) -> int:
    from megappo.metrics.sinks import plot_run

    patterns = [p.strip() for given in args.metrics for p in given.split(",") if p.strip()]
    print(plot_run(args.run_dir, args.out, patterns))
    return 0


def _hydra_flags(parser) -> None:
    """verl's Hydra flags, which every verl script passes (megappo.config.loading.verl_config_recipe reads them)."""
    parser.add_argument("--config-path", default=None,
                        help="verl's: the directory of --config-name's YAML (a megappo recipe there is used)")
    parser.add_argument("--config-name", default=None,
                        help="verl's: ppo_megatron_trainer or ppo_trainer runs on verl 0.9.1's defaults "
                             "(recipes/verl/); replaces the recipe")


def _hydra_recipe(args) -> None:
    """args.recipe from verl's --config-path / --config-name, and args.recipe_lines saying what it is (a recipe
    and the flags both: refused)."""
    from megappo.errors import ConfigError
    from megappo.config.loading import verl_config_recipe

    args.recipe_lines = []
    if not getattr(args, "config_name", None):
        if getattr(args, "config_path", None):
            raise ConfigError(f"--config-path={args.config_path} names the directory of a --config-name. Fix: add "
                              f"--config-name=ppo_megatron_trainer (verl 0.9.1's defaults), or remove it.")
        return
    if args.recipe:
        raise ConfigError(f"both the recipe {args.recipe} and --config-name={args.config_name} name the defaults. "
                          f"Fix: give one of them.")
    args.recipe, line = verl_config_recipe(args.config_path, args.config_name)
    args.recipe_lines = [line]


#: where every recipe key is described (the help texts point there)
CONFIG_REFERENCE = "docs/config.md"


def main(argv=None) -> int:
    from megappo import __version__

    parser = argparse.ArgumentParser(prog="megappo", description="PPO for language models on Megatron-Core",
                                     epilog=f"Recipe keys, their defaults and meaning: {CONFIG_REFERENCE}. "
                                            "Help on a command: megappo COMMAND --help.")
    parser.add_argument("--version", action="version", version=f"megappo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    smoke = sub.add_parser("smoke", help="CPU smoke job: tiny model, TP=2 conversion round trip, greedy decode")
    smoke.add_argument("--output-dir", default="runs/smoke")
    smoke.set_defaults(func=cmd_smoke)
    train = sub.add_parser("train", help="run PPO from a recipe: megappo train RECIPE.yaml [key.sub=value ...]",
                           description="Run PPO (GRPO, ...) from a recipe, with dotted overrides; rerunning the same "
                                       "command resumes from the latest checkpoint.",
                           epilog=f"Every recipe key, its default and meaning: {CONFIG_REFERENCE}. "
                                  "Example: megappo train recipes/demo-cpu.yaml run.total_steps=20")
    train.add_argument("recipe", nargs="?", help="the recipe (optional with --config-name)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2 actor.optim.lr=1e-6")
    _hydra_flags(train)
    train.add_argument("--world-size", type=int, default=None,
                       help="ranks to launch when not under torchrun (default: a GPU recipe's hardware.gpus_per_node, "
                            "else tp * pp, the lcm over roles with their own)")
    train.add_argument("--variant", default=None, help="apply the recipe's variants.NAME overrides (other hardware)")
    train.add_argument("--launcher", choices=("fork", "torchrun", "ray"), default="fork",
                       help="how the ranks start when not under torchrun: fork (default): torchrun's agent on this "
                            "machine forks each rank from this process once it has imported what the ranks need; "
                            "torchrun: the same agent starts each rank as a fresh interpreter; ray: Ray actors in a "
                            "placement group on an existing Ray cluster (docs/launchers.md)")
    train.add_argument("--ray-address", default=None,
                       help="the Ray cluster for --launcher ray (default: $RAY_ADDRESS, else auto: the cluster "
                            "started on this machine with `ray start --head`)")
    train.set_defaults(func=cmd_train)
    plan = sub.add_parser("plan", help="check a recipe's layout and estimate per-GPU memory (no model is built)")
    plan.add_argument("recipe", nargs="?", help="the recipe (optional with --config-name)")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=8")
    _hydra_flags(plan)
    plan.add_argument("--world-size", type=int, default=None,
                      help="GPUs (default: the recipe's hardware.nodes x hardware.gpus_per_node)")
    plan.add_argument("--gpu-mem", type=float, default=None,
                      help="GiB per GPU (default: the recipe's hardware.gpu_memory_gib)")
    plan.add_argument("--variant", default=None, help="apply the recipe's variants.NAME overrides (other hardware)")
    plan.add_argument("--hf-config", default=None,
                      help="the model's config.json (or its directory) when model.path has none")
    plan.set_defaults(func=cmd_plan)
    hardware = sub.add_parser("hardware", help="print a recipe's hardware as shell variables (for tools/launch/)")
    hardware.add_argument("recipe")
    hardware.add_argument("overrides", nargs="*", help="dotted overrides, e.g. hardware.gpus_per_node=4")
    hardware.add_argument("--variant", default=None, help="apply the recipe's variants.NAME overrides")
    hardware.add_argument("--world-size", type=int, default=None, help=argparse.SUPPRESS)  # train's: ignored
    hardware.set_defaults(func=cmd_hardware)
    export = sub.add_parser("export", help="a trainer checkpoint's actor or critic as an HF directory")
    export.add_argument("checkpoint", help="a run directory, its checkpoints/ directory, or a step_NNNNNNNN directory "
                                           "(with --init: a recipe)")
    export.add_argument("out", help="the HF directory to write")
    export.add_argument("overrides", nargs="*", help="with --init: the recipe's dotted overrides, e.g. model.seed_init=3")
    export.add_argument("--init", action="store_true",
                        help="write the recipe's initial model (built from model.hf_config, seeded by model.seed_init) "
                             "with its tokenizer, e.g. for verl's actor_rollout_ref.model.path")
    export.add_argument("--role", choices=("actor", "critic"), default="actor")
    export.add_argument("--tp", type=int, default=1, help="load the checkpoint at this TP size (default 1)")
    export.add_argument("--pp", type=int, default=1, help="load the checkpoint at this PP size (default 1)")
    export.add_argument("--overwrite", action="store_true")
    export.set_defaults(func=cmd_export)
    plot = sub.add_parser("plot", help="write RUN_DIR/curves.png from RUN_DIR/metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--metrics", action="append", default=[], metavar="GLOBS",
                      help="plot these metrics, one panel each: names or shell globs, comma-separated or the option "
                           "repeated, e.g. --metrics 'filter_groups/*,actor/pg_loss' (default: the standard panels)")
    plot.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/curves.png)")
    plot.set_defaults(func=cmd_plot)
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(x.startswith("-") for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = getattr(args, "overrides", []) + extra  # overrides after an option: `R.yaml --world-size 8 k=v`
    if getattr(args, "config_name", None) and args.recipe and "=" in args.recipe:  # verl's script: no recipe
        args.recipe, args.overrides = None, [args.recipe, *args.overrides]
    if hasattr(args, "config_name") and not args.recipe and not args.config_name:
        parser.error(f"megappo {args.command} needs a recipe: megappo {args.command} RECIPE.yaml [key=value ...], or "
                     f"a verl script's --config-name={{ppo_megatron_trainer,ppo_trainer}} for verl 0.9.1's defaults")
    _one_line_warnings()
    try:
        return run_reporting_errors(args.func, args)
    except KeyboardInterrupt:  # Ctrl-C before the training loop handles it (megappo.parallel.interrupts)
        if int(os.environ.get("RANK", 0)) == 0:
            print("megappo: interrupted", file=sys.stderr, flush=True)
        return 130


def _one_line_warnings() -> None:
    """megappo.errors.CheckpointWarning as one `megappo: warning: ...` line (others as Python shows them)."""
    from megappo.errors import CheckpointWarning

    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, CheckpointWarning):
            print(f"megappo: warning: {message}", file=file or sys.stderr, flush=True)
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def run_reporting_errors(func, *args) -> int:
    """`func(*args)` with megappo's own errors as one `megappo: error: ...` line instead of a
    traceback: bad input (the message says the fix) exits 2; the user's own code that failed
    while the run called it (megappo.user_code.UserCodeError: a reward function, an environment)
    exits USER_CODE_EXIT after that code's own frames of the traceback, the message last; a run
    that failed on the way (non-finite losses past run.max_nan_skips, a weight-sync mismatch)
    exits 1; a collective that timed out or lost a rank (the message names this rank and the
    stage) exits 3, which the launcher reports only when no other rank failed. A rank that
    reported its error leaves a note for the others (megappo.parallel.stage.tell_peers); one whose
    collective then lost it exits with that rank's code and says nothing. Anything else is a bug
    and keeps its traceback; the rank leaves the note for the others too. Each error a rank ends on
    (not a lost peer's) is also recorded for the launcher (megappo.parallel.launch.record_error),
    whose last line names the rank that failed first and, where needed, repeats its error."""
    from megappo.parallel.launch import record_error

    try:
        return _reporting_errors(func, *args)
    except Exception as e:  # a bug: its traceback follows; the launcher repeats its last line
        record_error(f"{type(e).__name__}: {e}", 1, shown=False)
        _told_peers(1)
        raise


def _reporting_errors(func, *args) -> int:
    """run_reporting_errors's handling of the errors it reports."""
    from megappo.data.prompts import DataError
    from megappo.errors import ConfigError, ModelConfigError
    from megappo.parallel.launch import USER_CODE_EXIT, record_error
    from megappo.user_code import UserCodeError

    try:
        return func(*args)
    except UserCodeError as e:  # the user's code failed: its own frames, then the message
        _end_progress_line()
        print(_user_traceback(e), end="", file=sys.stderr, flush=True)
        print(f"megappo: error: {e}", file=sys.stderr, flush=True)
        record_error(str(e), USER_CODE_EXIT, shown=True)
        return _told_peers(USER_CODE_EXIT)
    except (ConfigError, DataError, ModelConfigError, FileExistsError) as e:  # bad input: the message says the fix
        _end_progress_line()
        if not getattr(e, "every_rank", False) or int(os.environ.get("RANK", 0)) == 0:  # a CheckpointError every
            print(f"megappo: error: {e}", file=sys.stderr, flush=True)              # rank raised: rank 0 says it
            record_error(str(e), 2, shown=True)
        return _told_peers(2)
    except RuntimeError as e:
        failure = _run_failure(e)
        _end_progress_line()
        if failure is None:
            raise
        from megappo.parallel.launch import GAVE_UP_EXIT

        peer = _peer_failure() if failure[1] == GAVE_UP_EXIT else None
        if peer is not None:  # the rank this one lost reported its own error: that is the one message
            return peer[1]
        lost = _lost_ranks() if failure[1] == GAVE_UP_EXIT else None
        if lost is not None:  # several nodes: one line, by one survivor, names the ranks that went without a word
            ranks, words_it, store_gone = lost
            if words_it:
                print(f"megappo: error: {_lost_line(ranks, failure[0], store_gone)}", file=sys.stderr, flush=True)
            else:
                time.sleep(2)  # the rank that words the line ends first: its launcher does not stop it before
            return GAVE_UP_EXIT
        print(f"megappo: error: {failure[0]}", file=sys.stderr, flush=True)
        if failure[1] == GAVE_UP_EXIT:  # a lost peer or a timeout: the launcher looks for the cause elsewhere
            return failure[1]
        record_error(str(failure[0]), failure[1], shown=True)
        return _told_peers(failure[1])


def _user_traceback(e) -> str:
    """The traceback of what the user's code raised, without megappo's and asyncio's frames
    (all frames when none is left); empty when it raised nothing (it returned something wrong)."""
    import asyncio
    import traceback

    cause = e.cause if isinstance(e.cause, BaseException) else None
    if cause is None:
        return ""
    ours = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(asyncio.__file__))
    remote = getattr(cause, "remote_frames", None)  # raised in a reward worker (megappo.rewards.workers)
    frames = traceback.StackSummary.from_list(remote) if remote else traceback.extract_tb(cause.__traceback__)
    theirs = [f for f in frames if not f.filename.startswith(ours)] or frames
    last = [f"{cause.remote_type}: {cause}\n"] if hasattr(cause, "remote_type") else \
        traceback.format_exception_only(cause)
    return "".join(["Traceback (most recent call last):\n", *traceback.format_list(theirs), *last])


def _told_peers(code: int) -> int:
    """Leave the note that this rank ends on the error it reported (when it is a rank of a
    process group); returns `code`."""
    stage = sys.modules.get("megappo.parallel.stage")  # never imported: there is no process group
    if stage is not None:
        stage.tell_peers(code)
    return code


def _peer_failure() -> tuple[int, int] | None:
    stage = sys.modules.get("megappo.parallel.stage")
    return stage.peer_failure() if stage is not None else None


def _lost_ranks():
    stage = sys.modules.get("megappo.parallel.stage")
    return stage.roll_call() if stage is not None else None


def _lost_line(ranks, error, store_gone: bool) -> str:
    from megappo.parallel.stage import lost_line

    return lost_line(ranks, getattr(error, "stage_name", "?"), store_gone)


def _end_progress_line() -> None:
    """An error message starts on its own line, not after the live progress bar."""
    metrics = sys.modules.get("megappo.metrics.sinks")  # not imported: no bar was drawn
    if metrics:
        metrics.end_live_line()


def _run_failure(e: RuntimeError) -> tuple[RuntimeError, int] | None:
    """(the error to report, the exit code) when `e` is a way a run fails that the message
    explains, else None."""
    from megappo.parallel.launch import GAVE_UP_EXIT
    from megappo.parallel.stage import as_collective_error  # imported only now: these pull in torch
    from megappo.rollout.engine import EngineCrashed, WeightSyncError

    loop = sys.modules.get("megappo.trainer.loop")  # never imported: `e` cannot be its error
    if isinstance(e, (WeightSyncError, EngineCrashed)) or (loop and isinstance(e, loop.NonFiniteLossError)):
        return e, 1
    collective = as_collective_error(e)
    return (collective, GAVE_UP_EXIT) if collective else None


def entry() -> None:
    """The `megappo` command (setup.py's console script) and `python -m megappo.cli`: `main()`, then a rank,
    or the launcher whose ranks ended, skips the interpreter's teardown (seconds of it:
    megappo.parallel.launch.exit_rank); elsewhere sys.exit."""
    from megappo.parallel.launch import exit_rank

    if _forks_ranks(sys.argv[1:]):  # first of all: room in /proc/PID/environ for the forked ranks' variables
        from megappo.parallel.fork import make_environ_room

        make_environ_room(sys.orig_argv)
    try:
        code = main()
    except SystemExit as e:  # the launcher's end (ensure_ranks) too: without the interpreter's teardown
        code = e.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr, flush=True)
            code = 1
    exit_rank(code)


def _forks_ranks(argv: list[str]) -> bool:
    """Whether this command may fork ranks: `megappo train` with the fork launcher, not started by torchrun."""
    if argv[:1] != ["train"] or "WORLD_SIZE" in os.environ:
        return False
    for i, arg in enumerate(argv):
        if arg == "--launcher" and i + 1 < len(argv):
            return argv[i + 1] == "fork"
        if arg.startswith("--launcher="):
            return arg.split("=", 1)[1] == "fork"
    return True


if __name__ == "__main__":
    entry()
