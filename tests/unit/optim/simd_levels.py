"""The SIMD levels the kernel tests of this folder run at; a level this CPU lacks is skipped (shown
as skipped, never left out). The fixture that restores the level is in conftest.py."""

import pytest

from ft_framework.optim import cpu as cpu_kernel

SIMD_LEVELS = ["scalar", "avx2", "avx512"]


def level_or_skip(level: str) -> None:
    if not cpu_kernel.kernel_available():
        pytest.skip("C++ kernel not built")
    if level not in cpu_kernel.supported_simd_levels():
        pytest.skip(f"this CPU does not run {level} (it runs {cpu_kernel.supported_simd_levels()})")
