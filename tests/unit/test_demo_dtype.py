"""The real-model demo's vLLM dtype: bf16 only where the CPU computes it natively (emulated bf16 was ~10x slower)."""

from __future__ import annotations

from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.demo import run


def cpuinfo(tmp_path: Path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\n")
    return str(path)


@pytest.mark.parametrize(("flags", "native"), [("", False), ("avx512f avx512bw", False), ("avx512_bf16", True),
                                                ("amx_tile amx_bf16", True)])
def test_native_bf16_reads_the_cpu_flags(tmp_path: Path, flags: str, native: bool) -> None:
    assert run.native_bf16(cpuinfo(tmp_path, flags)) is native


def test_no_cpuinfo_means_float32(tmp_path: Path) -> None:
    assert run.native_bf16(str(tmp_path / "missing")) is False


def test_calculator_dtype_auto_follows_the_cpu_and_an_explicit_one_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(run, "native_bf16", lambda native=native: native)
        assert run.parse_args(["--family", "calculator"]).dtype == expected
    assert run.parse_args(["--family", "calculator", "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert run.parse_args([]).dtype == "float32"  # the default family is calculator: auto, native_bf16 stubbed False
    monkeypatch.setattr(run, "native_bf16", lambda: True)
    assert run.parse_args(["--family", "words"]).dtype == "float32"  # the tiny model: always float32
