"""Every kernel against the numpy reference, its oracle, through one test class: the same files
(every dtype, odd sizes, RoPE, a sink, massive activations, rows holding NaN and inf) and every
statistic group alone, each kernel held to its documented tolerance (the compiled kernel: float32
Gram pieces and quantization sums to 1e-5 relative, everything else to 1e-9; mlx:
`kernels.mlx.TOLERANCES`). A kernel not available here (mlx without mlx, C without a compiler)
is not in the class's parameters: `make test` runs the class under ``KVSNAP_KERNEL=numpy`` too,
where the compiled kernel steps aside."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import kvformat
from kvsnap.analysis import kernels
from kvsnap.analysis.engine.tables import stats_rows
from kvsnap.analysis.stats import GROUPS
from tests.factories import random_file

KERNELS = [name for name in ("cpu", "mlx") if name == kernels.of(name).NAME and kernels.of(name).available()]
LOOSE = set(GROUPS["spectrum"]) | set(GROUPS["quant"])
KEYS = (
    "file",
    "snapshot",
    "seq",
    "layer",
    "head",
    "tensor",
    "n_tokens",
    "nonfinite_rows",
    "nonfinite_values",
)


def assert_close_to_reference(name: str, got: Any, expected: Any, message: str) -> None:
    """One statistic of the compiled kernel against the reference's: float32 Gram pieces and
    quantization sums with reciprocals to 1e-5 relative, every other sum to 1e-9."""
    rtol = 1e-5 if name in LOOSE else 1e-9
    np.testing.assert_allclose(
        np.asarray(got, float), np.asarray(expected, float), rtol=rtol, atol=1e-12, err_msg=message
    )


def _agree(kernel: str, got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    if kernel == "mlx":
        from tests.analysis.kernels.test_mlx_backend import assert_close

        assert_close(got, expected)
        return
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        for name, value in b.items():
            where = f"{name} layer {b['layer']} head {b['head']} {b['tensor']}"
            if name in KEYS or name in ("massive_positions", "rank_90") or value is None:
                assert a[name] == value, where
            else:
                assert_close_to_reference(name, a[name], value, where)


@pytest.mark.parametrize("kernel", KERNELS)
class TestEveryKernelAgainstTheReference:
    @pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=str)
    @pytest.mark.parametrize("dim,tokens", [(16, 45), (64, 700), (80, 300)])
    def test_a_random_file(self, kernel: str, tmp_path: Path, dtype: Any, dim: int, tokens: int) -> None:
        made = random_file(
            tmp_path / "r.kv", dtype=dtype, dim=dim, tokens=tokens, heads=2, layers=2, seed=dim,
            sink=30.0, massive=300.0, rope=True,
        )  # fmt: skip
        _agree(kernel, stats_rows(made.path, backend=kernel), stats_rows(made.path, backend="numpy"))

    @pytest.mark.parametrize("group", sorted(GROUPS))
    def test_each_group_alone(self, kernel: str, tmp_path: Path, group: str) -> None:
        made = random_file(tmp_path / "r.kv", dim=32, tokens=200, seed=7, rope=True)
        got = stats_rows(made.path, backend=kernel, stats=group)
        _agree(kernel, got, stats_rows(made.path, backend="numpy", stats=group))

    def test_rows_holding_nan_and_inf_are_left_out_and_counted(self, kernel: str, tmp_path: Path) -> None:
        rng = np.random.default_rng(5)
        k = rng.standard_normal((2, 300, 32)).astype(np.float32)
        k[0, 7, 3], k[1, 200, 0], k[1, 201, 31] = np.nan, np.inf, -np.inf
        path = tmp_path / "nonfinite.kv"
        kvformat.save(path, [kvformat.Layer(k, k.copy())])
        got, expected = stats_rows(path, backend=kernel), stats_rows(path, backend="numpy")
        assert [row["nonfinite_rows"] for row in expected] == [1, 1, 2, 2]
        _agree(kernel, got, expected)
