"""Building and loading the C kernels: one build per source and CPU, reused from the
cache folder; without a compiler, or with the kernels turned off, no library (the
callers then run their PyTorch paths)."""

import logging
import os

import pytest

from kernels import cpu_build


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and no library loaded yet in this process."""
    monkeypatch.setenv("NATSLLM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("NATSLLM_NATIVE_KERNELS", raising=False)
    cpu_build.load_library.cache_clear()
    yield tmp_path
    cpu_build.load_library.cache_clear()


def test_builds_once_then_loads_from_the_cache(fresh, monkeypatch):
    if cpu_build._find_compiler() is None:
        pytest.skip("no C compiler here")
    lib = cpu_build.load_library("paged_decode_attention")
    assert lib is not None and hasattr(lib, "decode_attention_bf16")
    built = list(fresh.glob("paged_decode_attention-*.so"))
    assert len(built) == 1 and not list(fresh.glob("*.tmp"))

    def no_build(*args):
        raise AssertionError("built again")

    monkeypatch.setattr(cpu_build, "_build", no_build)
    cpu_build.load_library.cache_clear()
    assert cpu_build.load_library("paged_decode_attention") is not None


def test_turned_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("NATSLLM_NATIVE_KERNELS", "0")
    assert cpu_build.load_library("paged_decode_attention") is None
    assert not list(fresh.iterdir())


def test_no_compiler_means_no_library(fresh, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "_find_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert cpu_build.load_library("paged_decode_attention") is None
    assert "no C compiler" in caplog.text


def test_a_failing_build_means_no_library(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert cpu_build.load_library("paged_decode_attention") is None
    assert "failed" in caplog.text
    assert not list(fresh.iterdir()) or not list(fresh.glob("*.so"))


def test_cache_folder_is_private_and_a_foreign_library_is_rebuilt(fresh, monkeypatch):
    if cpu_build._find_compiler() is None:
        pytest.skip("no C compiler here")
    cache = fresh / "kernels"
    monkeypatch.setenv("NATSLLM_KERNEL_CACHE", str(cache))
    assert cpu_build.load_library("rms_norm") is not None
    assert cache.stat().st_mode & 0o777 == 0o700
    [built] = cache.glob("rms_norm-*.so")
    planted = b"not a library"
    tampers = [lambda p: p.chmod(0o666)]
    if os.getuid() == 0:  # only root can hand a file to another user
        tampers.append(lambda p: os.chown(p, 12345, -1))
    for tamper in tampers:
        # A new file at the path: writing into the loaded one would pull pages from under
        # its mapping (SIGBUS later in this process).
        built.unlink()
        built.write_bytes(planted)
        tamper(built)
        cpu_build.load_library.cache_clear()
        lib = cpu_build.load_library("rms_norm")
        assert lib is not None, "an untrusted cached library must be rebuilt, not loaded or given up"
        assert built.read_bytes() != planted and built.stat().st_uid == os.getuid()


KERNELS = ("paged_decode_attention", "rms_norm", "rotary", "silu_and_mul", "write_kv")


def test_each_build_reports_its_instruction_set(cpu_isa):
    if cpu_build._find_compiler() is None:
        pytest.skip("no C compiler here")
    from shared.cpu_features import cpu_flags

    flags = cpu_flags()
    if cpu_isa == "avx2":
        expected = "avx2"
    elif "avx512_bf16" in flags:
        expected = "avx512_bf16"
    else:
        expected = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "generic"
    assert {name: cpu_build.library_isa(name) for name in KERNELS} == dict.fromkeys(KERNELS, expected)


def test_an_unknown_instruction_set_is_refused(fresh, monkeypatch):
    monkeypatch.setenv("NATSLLM_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="NATSLLM_CPU_ISA"):
        cpu_build.load_library("rms_norm")
