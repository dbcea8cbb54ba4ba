"""megappo.models.recompute: the settings record, its TransformerConfig fields, its checks against a
model and layout, and the config section that feeds it (no processes, no torch model)."""

import pytest

from megappo.config import ConfigError, config_from_dict, load_config
from megappo.models.hf_config import ModelConfigError, dims_from_hf
from megappo.models.hf_reference import TINY_CONFIGS
from megappo.models.recompute import NO_RECOMPUTE, Recompute
from megappo.trainer.setup import recompute_of

LLAMA = dims_from_hf(TINY_CONFIGS["llama"])  # 4 layers
MOE = dims_from_hf(TINY_CONFIGS["qwen3_moe"])
DEMO = "recipes/demo-cpu.yaml"


def test_megatron_fields_with_defaults_filled_in():
    assert NO_RECOMPUTE.transformer_config_kwargs() == {} and not NO_RECOMPUTE.enabled
    assert Recompute("full").transformer_config_kwargs() == dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)  # verl's switch
    assert Recompute("full", method="block", num_layers=3).transformer_config_kwargs()["recompute_num_layers"] == 3
    assert Recompute("selective").transformer_config_kwargs() == dict(recompute_granularity="selective",
                                                                      recompute_modules=["core_attn"])


def test_megatron_accepts_the_fields():
    from megappo.models.hf_config import transformer_config

    for rc in (Recompute("full"), Recompute("full", method="block", num_layers=2),
               Recompute("selective", modules=("core_attn", "mlp"))):
        cfg = transformer_config(LLAMA, pp=2, **rc.transformer_config_kwargs())
        assert cfg.recompute_granularity == rc.granularity


@pytest.mark.parametrize("kwargs,match", [
    (dict(granularity="selective", modules=("layernorm",)), r"x.modules: 'layernorm' is not supported: .*Transformer "
                                                             r"Engine.*Fix: choose from \['core_attn', 'mlp', 'moe'\]"),
    (dict(granularity="selective", method="block"), r"x.method / x.num_layers apply to granularity=full"),
    (dict(granularity="full", modules=("mlp",)), r"Fix: remove x.modules, or set x.granularity=selective"),
    (dict(granularity="full", num_layers=0), r"x.num_layers=0 must be >= 1"),
    (dict(granularity="sometimes"), r"Fix: set x.granularity=full"),
])
def test_bad_settings_name_the_fix(kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        Recompute(key="x", **kwargs)


def test_checks_against_the_layers_of_a_pipeline_chunk():
    Recompute("full", num_layers=2).check(LLAMA, pp=2)  # 2 layers per stage
    with pytest.raises(ModelConfigError, match=r"actor.recompute.num_layers=3 does not divide the 4 layers of one "
                                               r"pipeline chunk .*Fix: set actor.recompute.num_layers to a divisor"):
        Recompute("full", num_layers=3, key="actor.recompute").check(LLAMA, pp=1)
    with pytest.raises(ModelConfigError, match=r"num_layers=2 is more than the 1 layers of one pipeline chunk \(4 "
                                               r"layers / pp=2 / vpp=2\). Fix: set x.num_layers <= 1"):
        Recompute("full", method="block", num_layers=2, key="x").check(LLAMA, pp=2, vpp=2)
    with pytest.raises(ModelConfigError, match="'moe' recomputes mixture-of-experts layers; LlamaForCausalLM is dense"):
        Recompute("selective", modules=("moe",)).check(LLAMA, pp=1)


def test_moe_layers_are_not_recomputed_on_cpu():
    Recompute("full").check(MOE, pp=1, cpu=False)
    Recompute("selective", modules=("core_attn", "mlp")).check(MOE, pp=1, cpu=True)
    for rc in (Recompute("full"), Recompute("selective", modules=("moe",))):
        with pytest.raises(ModelConfigError, match="does not run on CPU: Megatron-Core's token dispatcher"):
            rc.check(MOE, pp=1, cpu=True)


def test_what_full_recomputation_keeps():
    assert Recompute("full").kept_per_chunk(10) == (10, 0) and Recompute("full").rebuilt_at_once == 1
    assert Recompute("full", num_layers=5).kept_per_chunk(10) == (2, 0)
    assert Recompute("full", method="block", num_layers=3).kept_per_chunk(10) == (3, 7)
    assert Recompute("selective").kept_per_chunk(10) == (0, 10) and NO_RECOMPUTE.kept_per_chunk(10) == (0, 10)


def test_config_section_and_roles():
    cfg = load_config(DEMO, ["actor.recompute.granularity=full", "critic.recompute.granularity=selective"])
    assert recompute_of(cfg, "actor") == Recompute("full", key="actor.recompute")
    assert recompute_of(cfg, "critic").modules == ("core_attn",) and recompute_of(cfg, "ref") is NO_RECOMPUTE
    with pytest.raises(ConfigError, match=r"^ref.recompute: the reference model only runs forward passes.*Fix: remove"):
        load_config(DEMO, ["ref.recompute.granularity=full"])
    with pytest.raises(ConfigError, match=r"^reward.recompute: the reward model only runs forward passes"):
        config_from_dict({"model": {"path": "/m"}, "reward": {"recompute": {"granularity": "full"}}})
    with pytest.raises(ConfigError, match=r"actor.recompute.modules: 'layernorm' is not supported"):
        load_config(DEMO, ["actor.recompute.granularity=selective", "actor.recompute.modules=[layernorm]"])
    with pytest.raises(ConfigError, match=r"critic.recompute.method / critic.recompute.num_layers apply to "
                                          r"critic.recompute.granularity=full \(now none\)"):
        load_config(DEMO, ["critic.recompute.num_layers=2"])


def test_preflight_checks_layers_before_training():
    from megappo.trainer.preflight import check_models

    cfg = config_from_dict({"model": {"hf_config": TINY_CONFIGS["llama"]}, "parallel": {"pp": 2},
                            "actor": {"recompute": {"granularity": "full", "num_layers": 3}}})
    with pytest.raises(ModelConfigError, match=r"actor.recompute.num_layers=3 is more than the 2 layers"):
        check_models(cfg)
