"""AFD configuration: ratio parsing, validation messages, flag merging (no vLLM engine)."""

import argparse
import logging
from types import SimpleNamespace

import pytest

from vllm_afd.config import (
    AFDConfig,
    add_afd_flags,
    check_supported,
    merge_afd_flags,
    moe_model_info,
    parse_ratio,
)
from vllm_afd.errors import AFDConfigError


@pytest.mark.parametrize("text", ["7", "a:b", "0:1", "7:0", "-1:1", "1:2:3", ""])
def test_malformed_ratios_name_the_flag(text):
    with pytest.raises(AFDConfigError, match="--afd-ratio"):
        parse_ratio(text)


def test_ratio_parsing():
    assert parse_ratio("7:1") == (7, 1)
    assert parse_ratio(" 2 : 1 ") == (2, 1)
    assert parse_ratio("auto") is None


def test_ffn_rank_count_must_be_whole():
    cfg = AFDConfig(ratio=(2, 1))
    assert cfg.num_ffn_ranks(2) == 1
    assert cfg.num_ffn_ranks(4) == 2
    with pytest.raises(AFDConfigError, match="does not divide the 1 attention"):
        cfg.num_ffn_ranks(1)
    assert AFDConfig(ratio=(1, 2)).num_ffn_ranks(1) == 2


def test_unknown_transport_lists_allowed():
    with pytest.raises(AFDConfigError, match="--afd-transport.*allowed: nixl, shm, slots or"):
        AFDConfig(ratio=(1, 1), transport="carrier-pigeon")


def test_transport_settings_are_checked_against_the_backends_declaration():
    """``--afd-transport-config``: each backend declares what it takes (``Backend.settings``)."""
    cfg = AFDConfig.from_dict(
        {"ratio": "1:1", "transport": "slots", "transport_config": '{"waits": "device"}'}
    )
    assert cfg.transport_config == {"waits": "device"}
    assert AFDConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(
        AFDConfigError,
        match=r"--afd-transport-config \(additional_config.afd.transport_config\): shm takes "
        r"no setting waits; its settings: none",
    ):
        AFDConfig(ratio=(1, 1), transport="shm", transport_config={"waits": "host"})
    with pytest.raises(AFDConfigError, match=r"no setting wait; its settings: waits \(str"):
        AFDConfig(ratio=(1, 1), transport="slots", transport_config={"wait": "host"})
    with pytest.raises(AFDConfigError, match="setting waits takes a str, got True"):
        AFDConfig(ratio=(1, 1), transport="slots", transport_config={"waits": True})
    with pytest.raises(AFDConfigError, match="waits takes one of host, device, got 'gpu'"):
        AFDConfig(ratio=(1, 1), transport="slots", transport_config={"waits": "gpu"})
    with pytest.raises(AFDConfigError, match="--afd-transport-config.*not JSON"):
        AFDConfig.from_dict({"ratio": "1:1", "transport_config": "{allow_mnnvl: true}"})
    with pytest.raises(AFDConfigError, match="--afd-transport-config.*a JSON object"):
        AFDConfig.from_dict({"ratio": "1:1", "transport_config": ["allow_mnnvl"]})


def test_config_keys_are_the_flag_names_and_old_keys_are_taken_with_a_warning(caplog):
    from vllm_afd.config import FLAG_KEYS

    assert all(
        key == flag.removeprefix("--afd-").replace("-", "_") for flag, key in FLAG_KEYS.items()
    )
    with caplog.at_level(logging.WARNING, logger="vllm.afd"):
        cfg = AFDConfig.from_dict({"ratio": "1:1", "timeout_s": "2", "failover_s": 0})
    assert (cfg.timeout, cfg.failover_timeout) == (2.0, 0.0)
    assert (
        "additional_config.afd.timeout_s is now timeout, the name of its flag --afd-timeout"
        in caplog.text
    )
    assert "failover_s is now failover_timeout" in caplog.text
    with pytest.raises(AFDConfigError, match=r"afd.timeout_s and --afd-timeout .* give one"):
        AFDConfig.from_dict({"ratio": "1:1", "timeout_s": 2, "timeout": 3})


def test_from_dict_roundtrip_and_coercion():
    cfg = AFDConfig.from_dict({"ratio": "3:1", "timeout": "2.5", "microbatches": "2"})
    assert cfg.ratio == (3, 1) and cfg.timeout == 2.5 and cfg.microbatches == 2
    assert AFDConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(AFDConfigError, match="unknown key"):
        AFDConfig.from_dict({"ratio": "1:1", "ration": "2"})
    with pytest.raises(AFDConfigError, match="--afd-timeout"):
        AFDConfig.from_dict({"ratio": "1:1", "timeout": "soon"})
    with pytest.raises(AFDConfigError, match="required"):
        AFDConfig.from_dict({"transport": "shm"})


def _hf(**kw):
    base = dict(
        architectures=["X"],
        num_hidden_layers=2,
        hidden_size=128,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    )
    return SimpleNamespace(**{**base, **kw})


def test_model_without_routed_experts_is_refused():
    with pytest.raises(AFDConfigError, match="no routed experts"):
        moe_model_info(_hf(architectures=["LlamaForCausalLM"], intermediate_size=256))


def test_expert_divisibility():
    info = moe_model_info(_hf(num_experts=8))
    assert info.num_experts == 8 and info.moe_layers == (0, 1)
    info.check_ffn_ranks(4)
    with pytest.raises(AFDConfigError, match="only 8 routed experts"):
        info.check_ffn_ranks(16)
    with pytest.raises(AFDConfigError, match="cannot be split evenly over 3"):
        info.check_ffn_ranks(3)
    mixtral = moe_model_info(
        _hf(num_local_experts=4, moe_intermediate_size=None, intermediate_size=64)
    )
    assert mixtral.num_experts == 4 and mixtral.moe_intermediate_size == 64


def _parser():
    parser = argparse.ArgumentParser()
    add_afd_flags(parser)
    add_afd_flags(parser)  # idempotent
    return parser


def test_flags_merge_into_additional_config():
    args = _parser().parse_args(["--afd-ratio", "2:1", "--afd-transport", "nixl"])
    engine_args = SimpleNamespace(additional_config={"other": 1})
    merge_afd_flags(args, engine_args)
    assert engine_args.additional_config == {
        "other": 1,
        "afd": {"ratio": "2:1", "transport": "nixl"},
    }


def test_no_flag_means_stock_vllm():
    engine_args = SimpleNamespace(additional_config=None)
    merge_afd_flags(_parser().parse_args([]), engine_args)
    assert engine_args.additional_config is None


def test_bad_flag_values_exit_with_the_flag_named(capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--afd-ratio", "0:1"])
    assert exc.value.code == 2
    assert "--afd-ratio" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--afd-ratio", "1:1", "--afd-transport", "smoke-signals"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _parser().parse_args(["--afd-ratio", "1:1", "--afd-transport-config", "[1]"])
    assert "--afd-transport-config: expected a JSON object" in capsys.readouterr().err


def test_options_without_ratio_and_duplicates_are_errors():
    engine_args = SimpleNamespace(additional_config=None)
    with pytest.raises(
        AFDConfigError, match=r"--afd-ratio \(or --afd-join\) is required with --afd-transport"
    ):
        merge_afd_flags(_parser().parse_args(["--afd-transport", "nixl"]), engine_args)
    engine_args = SimpleNamespace(additional_config={"afd": {"ratio": "1:1"}})
    with pytest.raises(AFDConfigError, match="both as flags"):
        merge_afd_flags(_parser().parse_args(["--afd-ratio", "2:1"]), engine_args)


def _vllm_config(afd: dict | None, pp: int = 1, eplb: bool = False, **model):
    """The parts of a ``VllmConfig`` that ``check_supported`` reads (microbatching off)."""
    hf = SimpleNamespace(hidden_act=model.pop("hidden_act", "silu"))
    return SimpleNamespace(
        additional_config={"afd": {**afd, "microbatches": 1}} if afd else {},
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, enable_eplb=eplb),
        model_config=SimpleNamespace(**{"hf_text_config": hf, "quantization": None, **model}),
    )


@pytest.mark.parametrize("quantization", ["fp8", "compressed-tensors", "awq", "mxfp4"])
def test_quantized_checkpoints_and_any_activation_are_not_refused(quantization):
    """vLLM refused what its platform cannot serve before this check; the FFN ranks run the
    model's own MoE layers (its activation, its quant method, or dequantized FP8 experts)."""
    check_supported(_vllm_config({"ratio": "1:1"}, quantization=quantization))
    check_supported(_vllm_config({"ratio": "1:1"}, hidden_act="gelu_pytorch_tanh"))


def test_pipeline_parallelism_and_eplb_are_refused_with_afd_only():
    with pytest.raises(AFDConfigError, match="pipeline parallelism"):
        check_supported(_vllm_config({"ratio": "1:1"}, pp=2))
    with pytest.raises(AFDConfigError, match="--enable-eplb"):
        check_supported(_vllm_config({"ratio": "1:1"}, eplb=True))
    check_supported(_vllm_config(None, pp=2, eplb=True))  # AFD off: stock vLLM decides


@pytest.mark.parametrize("timeout", ["inf", "-inf", "nan", "0", "-1"])
def test_timeout_must_be_finite_and_positive(timeout):
    with pytest.raises(AFDConfigError, match=r"--afd-timeout .*finite number of seconds > 0"):
        AFDConfig.from_dict({"ratio": "1:1", "timeout": timeout})


@pytest.mark.parametrize("section", [{}, "1:1", ["1:1"]])
def test_an_empty_or_malformed_afd_section_is_an_error_not_afd_off(section):
    config = SimpleNamespace(additional_config={"afd": section})
    with pytest.raises(AFDConfigError, match="additional_config.afd"):
        AFDConfig.of(config)
    if section == {}:
        with pytest.raises(AFDConfigError, match=r"--afd-ratio \(additional_config.afd.ratio\)"):
            AFDConfig.of(config)
    assert AFDConfig.of(SimpleNamespace(additional_config={"afd": None})) is None
    assert AFDConfig.of(SimpleNamespace(additional_config={})) is None


def test_the_retired_tcp_transport_and_its_host_key_are_refused_with_what_to_use():
    with pytest.raises(AFDConfigError, match="'tcp' is retired; across hosts use nixl"):
        AFDConfig(ratio=(1, 1), transport="tcp")
    with pytest.raises(
        AFDConfigError, match=r"additional_config.afd.ffn_host: --afd-ffn-host went with .*nixl"
    ):
        AFDConfig.from_dict({"ratio": "1:1", "ffn_host": "10.0.0.2"})


@pytest.mark.parametrize("seconds", ["inf", "nan", "-1", "soon"])
def test_failover_timeout_must_be_finite_and_not_negative(seconds):
    with pytest.raises(AFDConfigError, match=r"--afd-failover-timeout"):
        AFDConfig.from_dict({"ratio": "1:1", "failover_timeout": seconds})


def test_failover_is_on_by_default_and_zero_turns_it_off():
    assert AFDConfig.from_dict({"ratio": "1:1"}).failover_timeout == 60.0
    assert AFDConfig.from_dict({"ratio": "1:1", "failover_timeout": "0"}).failover_timeout == 0.0
