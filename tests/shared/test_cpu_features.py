"""CPU feature flags from /proc/cpuinfo's text, and which of them mean native bf16 dot products."""

from shared.cpu_features import cpu_flags, describe, native_bf16_dot, parse_cpu_flags

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx fma avx2 bmi2
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse2 avx fma avx2 bmi2
"""

EPYC_AVX512_BF16 = "flags\t: avx2 fma avx512f avx512bw avx512_vnni avx512_bf16\n"
XEON_AMX = "flags\t: avx2 avx512f amx_bf16 amx_tile amx_int8\n"


def test_flags_of_the_first_processor():
    assert parse_cpu_flags(EPYC_AVX2) == {"fpu", "sse2", "avx", "fma", "avx2", "bmi2"}
    assert parse_cpu_flags("model name: something\n") == frozenset()


def test_native_bf16_dot_products():
    assert not native_bf16_dot(parse_cpu_flags(EPYC_AVX2))
    assert native_bf16_dot(parse_cpu_flags(EPYC_AVX512_BF16))
    assert native_bf16_dot(parse_cpu_flags(XEON_AMX))
    # AVX-512 alone is not enough: bf16 products would still be widened to float32.
    assert not native_bf16_dot(frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"}))


def test_describe_names_the_flags_that_matter():
    assert describe(parse_cpu_flags(EPYC_AVX2)) == "avx2 fma"
    assert describe(parse_cpu_flags(XEON_AMX)) == "avx2 avx512f amx_bf16 amx_int8"
    assert describe(frozenset({"sse2"})) == "none of avx2/avx512/amx"


def test_unreadable_cpuinfo_means_no_flags(tmp_path):
    assert cpu_flags(tmp_path / "missing") == frozenset()
    (tmp_path / "cpuinfo").write_text(EPYC_AVX512_BF16)
    assert "avx512_bf16" in cpu_flags(tmp_path / "cpuinfo")
