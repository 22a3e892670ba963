"""The kernels in C (`analysis.kernels.native`, built at install time) against the numpy
reference, their oracle, each in a process of its own: the same table for every statistic group,
dtype, odd size and non-finite input (every count exactly, the sums to the tolerances of
`tests/analysis/kernels/test_kernel.py`), the same eigenvalues (LAPACK's) and float16
conversions (numpy's ``astype``)."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvsnap.analysis.kernels import kernel, native
from tests.analysis.kernels.test_kernels_oracle import assert_close_to_reference

DEFAULT = os.environ.get("KVSNAP_KERNEL", "compiled") == "compiled"

# Prints, as JSON, every sum of accumulators over awkward inputs, plus eigenvalues and float16
# conversions, computed by whichever kernels KVSNAP_KERNEL selects.
SUMS = r"""
import json, sys
import ml_dtypes, numpy as np
from kvsnap.analysis.kernels import eigen, halves
from kvsnap.analysis.engine.accumulator import HeadAccumulator
from kvsnap.analysis.kernels import kernel
from kvsnap.analysis.stats.catalogue import ALL
from kvsnap.analysis.stats.rope import Rope

out = {"compiled": bool(kernel.AVAILABLE)}
rng = np.random.default_rng(7)
for dim in (2, 8, 40, 128):  # 2: fewer channels than a block of rows
    for pairing in ("half", "interleaved"):
        for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
            acc = HeadAccumulator(dim, Rope(10000.0, dim, pairing), ALL)
            start = 0
            for n in (1, 45, 700, 5000):  # a one-row piece, partial groups, float32 Gram pieces
                rows = (rng.standard_normal((n, dim)) * np.exp(rng.normal(0, 1.5, dim))).astype(dtype)
                rows[rng.integers(0, n), rng.integers(0, dim)] = 0
                if n == 700:
                    rows[3, 1] = np.nan  # a counted row, not a failed head
                    rows[9] *= 300  # a massive activation: a heavy row of the Gram
                acc.add(rows, np.arange(start, start + n))
                start += n + 17
            key = f"{dim}-{pairing}-{np.dtype(dtype).name}"
            row = acc.row()
            out[key] = {name: (None if value is None else np.asarray(value, dtype=np.float64).tolist())
                        for name, value in row.items()}
            for name in ("norm_hist", "peak_hist", "position_count"):
                out[key][name] = getattr(acc, name).tolist()
            out[key]["nonfinite"] = [acc.nonfinite_rows, acc.nonfinite_values]
matrices = [rng.standard_normal((n + 3, n)) for n in (1, 2, 5, 64, 128)]
out["eigen"] = [eigen.eigenvalues(m.T @ m).tolist() for m in matrices]
bits = np.arange(1 << 16, dtype=np.uint16)
converted = np.empty(bits.size, np.float32)
halves.to_float32(bits.view(np.float16), converted)
out["halves"] = converted.view(np.uint32).tolist()
print(json.dumps(out))
"""


def _sums(mode: str) -> dict:
    env = {**os.environ, "KVSNAP_KERNEL": mode}
    done = subprocess.run([sys.executable, "-c", SUMS], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_the_c_kernels_are_built_and_in_use() -> None:
    """The install builds the library (CI's has a C compiler), and the default selects it."""
    assert native.AVAILABLE == DEFAULT
    if DEFAULT:
        assert kernel.accumulate is native.accumulate


EXACT = {"norm_hist", "peak_hist", "position_count", "nonfinite", "massive_positions", "n_tokens", "rank_90"}


def test_c_kernels_and_the_numpy_reference_compute_the_same_table() -> None:
    c, reference = _sums("compiled"), _sums("numpy")
    assert (c.pop("compiled"), reference.pop("compiled")) == (DEFAULT, False)
    assert c.pop("halves") == reference.pop("halves")  # all 65,536 halves, bit for bit
    for got, expected in zip(c.pop("eigen"), reference.pop("eigen"), strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12 * max(abs(expected[0]), 1.0))
    assert c.keys() == reference.keys()
    for key, sums in reference.items():
        assert sums.keys() == c[key].keys(), key
        for name, value in sums.items():
            got, message = c[key][name], f"{key} {name}"
            if value is None or name in EXACT:
                assert got == value, message
            else:
                assert_close_to_reference(name, got, value, message)


def test_a_library_built_from_another_source_is_not_loaded(tmp_path: Path) -> None:
    """In a source tree, a library built from another ``kernels.c`` than the one beside it (edited,
    or a branch checked out since) is left alone with a warning: stale kernels would compute old
    results. File times do not decide it (a copy or an unpacked wheel orders them at random)."""
    built = Path(native.__file__).parent
    (library,) = (path for path in built.iterdir() if path.name.startswith("_native"))
    shutil.copy(library, tmp_path / library.name)
    source = tmp_path / "kernels.c"
    source.write_bytes((built / "kernels.c").read_bytes() + b"/* edited */\n")
    with pytest.warns(UserWarning, match="not a build of this"):
        assert native._load(tmp_path) is None
    shutil.copy(built / "kernels.c", source)
    os.utime(tmp_path / library.name, (1_000_000_000, 1_000_000_000))  # older: no matter
    assert native._load(tmp_path) is not None
    source.unlink()  # an installed package without the source beside it
    assert native._load(tmp_path) is not None
    old = tmp_path / "old"
    old.mkdir()
    build = subprocess.run(  # a library of an older kvsnap: none of today's functions
        ["cc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(old / library.name)],
        input="int kvsnap_accumulate(void) { return 0; }\n",
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    with pytest.warns(UserWarning, match="not a build of this"):
        assert native._load(old) is None


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6, 11])
def test_eigenvalues_four_at_a_time_are_each_matrix_alone(count: int) -> None:
    """A stack's eigenvalues go through C four matrices at a time (their QL iterations
    interleaved), fewer for the last of a count that is not a multiple of four: each row bit for
    bit the matrix alone, within 1e-12 of LAPACK; a zero matrix and one of a wide spectrum among
    them."""
    from kvsnap.analysis.kernels import eigen

    rng = np.random.default_rng(count)
    stack = []
    for i in range(count):
        x = rng.standard_normal((200, 64)) * np.exp(rng.normal(0, 2, 64))
        stack.append(np.zeros((64, 64)) if i == 1 else x.T @ x)
    matrices = np.stack(stack)
    together = eigen.eigenvalues_of(matrices)
    np.testing.assert_array_equal(together, np.stack([eigen.eigenvalues(m) for m in matrices]))
    lapack = np.linalg.eigvalsh(matrices)[:, ::-1]
    for got, expected in zip(together, lapack, strict=True):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12 * max(expected[0], 1.0))
    if native.AVAILABLE:
        values, converged = native.eigenvalues_batch(matrices)
        assert converged.all() and values.shape == (count, 64)


def test_wrong_arrays_are_refused_before_c_sees_them() -> None:
    peaks = np.arange(10, dtype=np.int32)
    with pytest.raises(TypeError, match="C-contiguous int32"):
        native.top_rows(peaks.astype(np.int64), 3)
    with pytest.raises(TypeError, match="C-contiguous int32"):
        native.top_rows(peaks[::2], 3)
    gram = np.zeros((4, 4))
    with pytest.raises(TypeError, match="float32"):
        native.add_shift_terms(gram, np.zeros(4), np.zeros(4), 3)
    with pytest.raises(TypeError, match="as many values"):
        native.halves_to_float32(np.zeros(4, np.uint16), np.zeros(3, np.float32))
    assert sorted(native.top_rows(peaks, 3).tolist()) == [7, 8, 9]
    assert native.top_rows(peaks, 0).size == 0
    with pytest.raises(TypeError, match="one query position per row"):
        rows = np.zeros((2, 9))
        native.block_scores(
            np.zeros((2, 5), np.float32),
            rows,
            np.zeros(3, np.int64),
            np.arange(5),
            1,
            0,
            -1,
            0,
            0,
            False,
            4,
            64,
            256,
        )


def _c_struct_fields(source: str, name: str) -> list[tuple[str, str]]:
    """``(C type, field)`` of ``typedef struct { ... } name;`` in ``source``, one field a line."""
    match = re.search(r"typedef struct \{\n([^}]*)\n\} " + name + ";", source)
    assert match, f"no struct {name} in kernels.c"
    fields = []
    for line in match.group(1).splitlines():
        declaration = line.split("/*")[0].strip().rstrip(";")
        parsed = re.fullmatch(r"(?:const )?(\w+) ?(\*?)\s*(\w+)", declaration)
        assert parsed, f"{name}: unexpected field {line.strip()!r}"
        fields.append((parsed[1] + parsed[2], parsed[3]))
    return fields


@pytest.mark.parametrize("struct", [native.Piece, native.Settings, native.RunningSums])
def test_the_ctypes_structs_lay_out_the_c_ones_field_by_field(struct: type) -> None:
    """`accumulate`'s three structs: the same fields in the same order as `kernels.c` declares
    them, each pointer a pointer and each count an int64 (a field added on one side alone would
    shift every later one)."""
    source = (Path(native.__file__).parent / "kernels.c").read_text()
    c_fields = _c_struct_fields(source, struct.__name__)
    ctypes_fields = [(field, kind) for field, kind in struct._fields_]  # type: ignore[attr-defined]
    assert [field for _, field in c_fields] == [field for field, _ in ctypes_fields]
    for (c_kind, field), (_, kind) in zip(c_fields, ctypes_fields, strict=True):
        assert kind is (ctypes.c_void_p if c_kind.endswith("*") else {"int64_t": ctypes.c_int64}[c_kind]), (
            field
        )


def test_the_running_sums_struct_is_the_catalogues_declaration() -> None:
    """`kernels.c`'s ``RunningSums`` holds each of `native.KERNEL_SUMS` as a pointer to the C type
    of the dtype `catalogue.SUMS` declares for it, named as declared (and an array of
    `stats.sums.RunningSums`), after the two counts and the call's own scalars and channel
    maxima: a sum whose declaration and kernel slot disagree fails here, not in a table."""
    from kvsnap.analysis.stats.catalogue import SUMS
    from kvsnap.analysis.stats.sums import RunningSums

    source = (Path(native.__file__).parent / "kernels.c").read_text()
    c_fields = _c_struct_fields(source, "RunningSums")
    assert c_fields[:4] == [("int64_t", "dim"), ("int64_t", "position_bins"), ("double*", "scalars"),
                            ("int32_t*", "absmax_bits")]  # fmt: skip
    declared = {total.name: total for total in SUMS}
    c_types = {"float64": "double*", "int64": "int64_t*"}
    slots = c_fields[4:]
    assert [field for _, field in slots] == [total.name for total in native.KERNEL_SUMS]
    for c_kind, field in slots:
        assert c_kind == c_types[declared[field].dtype], field
        assert declared[field].shape, field  # an array sum
    own = {f.name for f in dataclasses.fields(RunningSums)}
    assert {field for _, field in slots} <= own


@pytest.mark.skipif(not native.AVAILABLE, reason="the C kernels are not built here")
def test_rows_of_another_width_than_the_sums_are_refused() -> None:
    """A piece whose channels are not the sums' is refused by the C code before anything is
    added (the sums unchanged), as are sums smaller than the settings ask for."""
    from kvsnap.analysis.kernels.compiled import _flags
    from kvsnap.analysis.stats.catalogue import ALL, LEVELS
    from kvsnap.analysis.stats.sums import RunningSums

    acc = RunningSums(8, groups=ALL)
    empty = np.empty(0, np.int64)
    settings = native.settings(
        empty, empty, LEVELS, _flags(ALL, False), kernel.hist_edges(), kernel.hist_guesses()
    )
    scalars, absmax = np.zeros(kernel.SCALARS), np.zeros(8, np.int32)
    sums = native.running_sums(acc, settings, scalars, absmax)
    x = np.ones((3, 4), np.float32)
    with pytest.raises(TypeError, match="4-channel rows for 8-channel sums"):
        native.accumulate(x, np.arange(3), np.empty(3, np.int32), np.empty(3), np.zeros(4), settings, sums)
    assert not acc.power.any() and not acc.norm_hist.any()
    with pytest.raises(TypeError, match="int32 array of >= 8"):
        native.running_sums(acc, settings, scalars, absmax[:4].copy())


def test_the_compiled_quantization_is_the_numpy_definition_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """simulate's min-max quantization (per token, per channel in groups of 32 with a shorter last
    group, 2 to 8 bits) through the C kernel and through numpy: the same bits, over random scales
    from 1e-30 to 1e30, constant rows, subnormals, and NaN and infinities (where the kernel hands
    the array to numpy)."""
    from kvsnap.analysis.attention import compression

    assert native.AVAILABLE
    rng = np.random.default_rng(5)
    compiled = native.quantize_levels
    ran = 0
    for trial in range(120):
        n, dim = int(rng.integers(1, 200)), int(rng.integers(1, 140))
        x = (rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
        if trial % 5 == 0:
            x[rng.integers(n), rng.integers(dim)] = (np.nan, np.inf, -np.inf)[trial % 3]
        if trial % 7 == 0:
            x[:] = x[0, 0]
        if trial % 9 == 0:
            x = (x * np.float32(1e-38)).astype(np.float32)
        for bits, axis, group in ((2, 1, None), (4, 1, None), (2, 0, 32), (4, 0, 32), (8, 0, None)):
            monkeypatch.setattr(native, "quantize_levels", compiled)
            with np.errstate(all="ignore"):
                got = compression.quantize(x, bits, axis=axis, group=group)
            monkeypatch.setattr(native, "quantize_levels", lambda *_: None)
            with np.errstate(all="ignore"):
                want = compression.quantize(x, bits, axis=axis, group=group)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (trial, bits, axis, group)
            ran += np.isfinite(x).all()
    assert ran > 400  # the kernel itself, not only its numpy hand-over, was compared


def test_lagkv_spread_is_numpys_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """LagKV's scores through the compiled spread equal numpy's definition bit for bit: spans of
    every length around the partitions (one whole partition and more, a remainder), channel
    counts below, at and above numpy's 128-value pairwise block, constant channels (a zero range:
    0 / 0), scales from 1e-30 to 1e30, and a NaN or an infinity (handed back to numpy)."""
    from kvsnap.analysis.attention import compression

    assert native.AVAILABLE
    rng = np.random.default_rng(11)
    compiled = native.lagkv_spread
    ran = 0
    for trial in range(80):
        lag, dim = int(rng.integers(2, 40)), int(rng.integers(2, 300))
        n = 4 + int(rng.integers(2, 6)) * lag + int(rng.integers(0, lag))
        k = rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-30, 30)
        v = rng.standard_normal((n, dim)) * rng.random(dim)
        if trial % 4 == 0:
            v[:, int(rng.integers(dim))] = 1.5
        if trial % 6 == 0:
            k[int(rng.integers(n)), int(rng.integers(dim))] = (np.nan, np.inf, -np.inf)[trial % 3]
        monkeypatch.setattr(native, "lagkv_spread", compiled)
        with np.errstate(all="ignore"):
            got = compression._lagkv(k, v, lag)
        monkeypatch.setattr(native, "lagkv_spread", lambda *_: None)
        with np.errstate(all="ignore"):
            want = compression._lagkv(k, v, lag)
        assert np.array_equal(got, want, equal_nan=True), (trial, n, lag, dim)
        ran += bool(np.isfinite(k).all())
    assert ran > 60  # the kernel itself, not only its numpy hand-over, was compared
