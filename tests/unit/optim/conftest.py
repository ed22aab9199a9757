import pytest

from ft_framework.optim import cpu as cpu_kernel


@pytest.fixture
def restore_level():
    """Puts the kernel's SIMD level back after a test that switches it."""
    level = cpu_kernel.simd_level() if cpu_kernel.kernel_available() else None
    yield
    if level is not None:
        cpu_kernel.set_simd_level(level)
