"""Joining an FFN group (``placement.join_ffn_group``): what must agree, and attention-rank
leases (taken exclusively, given back, taken over from a front-end that died)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from vllm_afd import envs, placement
from vllm_afd.config import AFDConfig, MoEModelInfo
from vllm_afd.errors import AFDConfigError
from vllm_afd.host import process_start_time
from vllm_afd.transport import TransportSpec

MODEL = MoEModelInfo("Qwen3MoeForCausalLM", 2, 8, 2, 16, 32, (0, 1))


@pytest.fixture
def group(tmp_path, monkeypatch):
    """A group file as `vllm-afd ffn-server` writes it, for a model directory of ours."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen3_moe"}')
    leases = tmp_path / "leases"
    leases.mkdir(mode=0o700)
    spec = TransportSpec("shm", 2, 1, 8, 16, 2, 64, torch.float32, moe_layers=(0, 1))
    content = {
        "format": placement.GROUP_FILE_FORMAT,
        "vllm_afd": placement.shared._version(),
        "spec": json.loads(spec.to_json()),
        "model": str(model_dir),
        "model_sha256": placement.model_identity(str(model_dir)),
        "leases": str(leases),
        "auth_file": "",
    }
    path = tmp_path / "group.json"
    path.write_text(json.dumps(content))
    path.chmod(0o600)
    monkeypatch.delenv(envs.RUNTIME, raising=False)
    yield path, str(model_dir), leases
    placement.stop_ffn_group()  # gives the leases back, drops VLLM_AFD_RUNTIME


def _join(path, model_dir, ranks=1, model=MODEL, max_tokens=64, dtype=torch.float32, **afd):
    config = AFDConfig.from_dict({"join": str(path), **afd})
    request = placement.GroupRequest(config, model, model_dir, ranks, max_tokens, dtype)
    return placement.join_ffn_group(request)


def test_a_front_end_takes_free_ranks_and_gives_them_back(group):
    path, model_dir, leases = group
    spec = _join(path, model_dir)
    assert spec.attention_rank_offset == 0 and spec.num_attention_ranks == 2
    assert TransportSpec.from_json(os.environ[envs.RUNTIME]).attention_rank_offset == 0
    assert sorted(os.listdir(leases)) == ["rank0"]
    placement.stop_ffn_group()
    assert os.listdir(leases) == [] and envs.RUNTIME not in os.environ


def test_ranks_held_by_a_live_front_end_are_skipped_and_a_dead_ones_taken_over(group):
    path, model_dir, leases = group
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        holder = {"host": os.uname().nodename, "pid": other.pid}
        holder["start"] = process_start_time(other.pid)
        (leases / "rank0").write_text(json.dumps(holder))
        assert _join(path, model_dir).attention_rank_offset == 1  # rank 0 is in use
        placement.stop_ffn_group()
        with pytest.raises(AFDConfigError, match=r"has no 2 free attention rank\(s\) in a row"):
            _join(path, model_dir, ranks=2)
    finally:
        other.kill()
        other.wait()
    assert _join(path, model_dir, ranks=2).attention_rank_offset == 0  # its holder died


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": torch.bfloat16}, "dtype 'float32', this front-end 'bfloat16'"),
        ({"model": dataclasses.replace(MODEL, num_experts=16)}, "experts, top_k, hidden size"),
        ({"transport": "nixl"}, "transport (--afd-transport) 'shm', this front-end 'nixl'"),
        ({"max_tokens": 65}, "--max-num-batched-tokens 65 is more than the FFN group takes"),
        ({"microbatches": 3}, "--afd-microbatches 3 is more than the FFN group's 2 slots"),
    ],
)
def test_a_front_end_that_disagrees_is_refused_before_taking_a_rank(group, change, message):
    path, model_dir, leases = group
    afd = {k: change.pop(k) for k in ("transport", "microbatches") if k in change}
    with pytest.raises(AFDConfigError, match="--afd-join") as refused:
        _join(path, model_dir, **change, **afd)
    assert message in str(refused.value)
    assert os.listdir(leases) == []


def test_another_model_and_a_missing_file_are_refused(group, tmp_path):
    path, model_dir, _ = group
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "mixtral"}')
    with pytest.raises(AFDConfigError, match=r"model \(sha256 of config.json\)"):
        _join(path, str(other))
    with pytest.raises(AFDConfigError, match="no such file"):
        _join(tmp_path / "absent.json", model_dir)


def test_join_and_ratio_are_exclusive():
    with pytest.raises(AFDConfigError, match="give one"):
        AFDConfig.from_dict({"join": "/g.json", "ratio": "1:1"})
    config = AFDConfig.from_dict({"join": "/g.json"})
    assert config.ratio is None and "ratio" not in config.to_dict()
    assert AFDConfig.from_dict(config.to_dict()) == config


def test_a_front_end_joining_after_a_scale_joins_the_live_pool(group, tmp_path):
    """The group file names the group; once ``vllm-afd scale`` published a new pool
    (``pool.json``) a front-end joins that one, and its workers start on its epoch."""
    from vllm_afd.transport import directory

    path, model_dir, leases = group
    first, second = tmp_path / "ffn", tmp_path / "ffn2"
    first.mkdir()
    second.mkdir()
    content = json.loads(path.read_text())
    content["spec"]["directory"] = str(first)
    path.write_text(json.dumps(content))
    assert _join(path, model_dir).num_ffn_ranks == 1 and directory.epoch_of(str(first)) == 1
    placement.stop_ffn_group()
    spec = TransportSpec.from_json(json.dumps(content["spec"]))
    live = dataclasses.replace(spec, num_ffn_ranks=2, directory=str(second))
    directory.publish_pool(str(first), directory.Pool(2, live.to_json()))
    joined = _join(path, model_dir)
    assert (joined.num_ffn_ranks, joined.directory, joined.attention_rank_offset) == (
        2,
        str(second),
        0,
    )
    assert directory.epoch_of(joined.directory) == 2 and directory.epoch_of(str(first)) == 1
