"""The one patch mechanism: ``_wrap`` (sentinel, kinds, inherited targets, shape checks that
name the patch) and the version policy (warn once, still apply)."""

from __future__ import annotations

import pytest

from vllm_afd.patches import base


def _tag(original):
    def wrapper(*args, **kwargs):
        return ("wrapped", original(*args, **kwargs))

    return wrapper


class Base:
    def method(self, x, y=1):
        return x + y

    @staticmethod
    def static(parser):
        return parser

    @classmethod
    def klass(cls, args):
        return cls, args


class Child(Base):
    pass


def test_wrap_once_for_each_kind():
    class Owner(Base):
        pass

    for _ in range(2):  # the second call finds the sentinel
        base._wrap(Owner, "method", _tag, params=("x", "y"))
        base._wrap(Owner, "static", _tag, kind="static", params=("parser",))
        base._wrap(Owner, "klass", lambda orig: lambda cls, a: ("wrapped", orig(cls, a)), "class")
    assert Owner().method(2) == ("wrapped", 3)
    assert Owner.static("p") == ("wrapped", "p")
    assert Owner.klass("a") == ("wrapped", (Owner, "a"))
    assert getattr(Owner.__dict__["method"], base._SENTINEL)
    assert Owner.method.__wrapped__ is Base.method
    assert Base().method(2) == 3  # an inherited target is wrapped on the subclass only


def test_wrap_refuses_a_changed_target_naming_the_patch():
    class EngineArgs:  # named like P1's owner: the message names the ledger entry
        def add_cli_args(self, other):
            return other

    with pytest.raises(ImportError, match=r"P1 EngineArgs\.add_cli_args.*static"):
        base._wrap(EngineArgs, "add_cli_args", _tag, kind="static", params=("parser",))
    with pytest.raises(ImportError, match=r"P2 EngineArgs\.from_cli_args: target not found"):
        base._wrap(EngineArgs, "from_cli_args", _tag, kind="class")
    with pytest.raises(ImportError, match=r"Child\.method lacks \['z'\]"):
        base._wrap(Child, "method", _tag, params=("z",))
    with pytest.raises(ImportError, match="expected leading"):
        base._wrap(Child, "method", _tag, params=("y", "x"), ordered=True)
    assert "method" not in Child.__dict__


def test_check_names_the_patch():
    missing = base.Target("M9", "vllm_afd.patches.base", "", "no_such_thing")
    with pytest.raises(ImportError, match="M9 vllm_afd.patches.base.no_such_thing"):
        base.check(missing)
    changed = base.Target("M9", "vllm_afd.patches.base", "", "check", ("nope",))
    with pytest.raises(ImportError, match=r"M9 .*lacks \['nope'\]"):
        base.check(changed)


def test_unchecked_version_warns_once_and_still_applies(monkeypatch):
    import vllm

    warnings = []
    monkeypatch.setattr(vllm, "__version__", "9.9.0")
    monkeypatch.setattr(base.logger, "warning", lambda *args: warnings.append(args))
    base.check_vllm_version.cache_clear()
    try:
        assert base.check_vllm_version() == "9.9.0"
        assert base.check_vllm_version() == "9.9.0"
        assert len(warnings) == 1 and "applying its patches anyway" in warnings[0][0]
    finally:
        base.check_vllm_version.cache_clear()


def test_every_wrapped_target_is_wrapped_after_register():
    from vllm.platforms import current_platform

    import vllm_afd

    vllm_afd.register()
    for target in base.TARGETS:
        worker_cpu_only = target.patch[0] in "MS"  # CPU model runner and communicator
        gpu_only = target.patch[0] == "G"  # GPU model runner
        platform_ok = not gpu_only if current_platform.is_cpu() else not worker_cpu_only
        later = target.patch[0] == "R"  # R1: once a failover supervisor starts, with Ray up
        if target.kind in base.WRAPPED and platform_ok and not later:
            owner, _ = target.resolve()
            raw = owner.__dict__[target.name]
            raw = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            assert getattr(raw, base._SENTINEL, False), target.where
