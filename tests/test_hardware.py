"""specc.hardware reads the CPU's kernel-relevant flags; doctor and bench report them."""
from specc.hardware import cpu, describe

SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC_ZEN3 = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse avx avx2 fma vaes
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd asimddp sve i8mm bf16
"""


def _cpu(tmp_path, text):
    (tmp_path / "cpuinfo").write_text(text)
    return cpu(tmp_path / "cpuinfo")


def test_cpu_flags_decide_native_bfloat16_and_int8(tmp_path):
    spr = _cpu(tmp_path, SAPPHIRE_RAPIDS)
    assert spr["model"].startswith("Intel(R) Xeon(R)") and spr["native_bfloat16"] and spr["int8_dot_product"]
    assert spr["flags"] == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]
    epyc = _cpu(tmp_path, EPYC_ZEN3)
    assert epyc["flags"] == ["avx2"] and not epyc["native_bfloat16"] and not epyc["int8_dot_product"]
    text = "\n".join(describe(epyc))
    assert "emulated" in text and "--dtype bfloat16 is slower than float32" in text
    assert "each verify row" in text and "specc tune" in text  # the int8 advice: short chains
    arm = _cpu(tmp_path, GRAVITON3)
    assert arm["native_bfloat16"] and arm["int8_dot_product"] and "sve" in arm["flags"]
    assert "native" in describe(spr)[1] and describe(spr)[2].startswith("  int8 dot products: native")


def test_cpu_without_cpuinfo_still_reports(tmp_path):
    info = cpu(tmp_path / "absent")
    assert info["model"] and info["cores"] >= 1 and info["flags"] == [] and not info["native_bfloat16"]
    assert describe(info)[0].startswith("cpu: ")
