"""The combination matrix on real ``mlx_lm.server`` processes (see :mod:`matrix`).

Modes: batched (the default) and sequential (every request seeded: mlx-lm serves a seeded
request alone). Families: the tiny llama and every tiny family the installed mlx-lm has. A
bounded cell is compared with the same server reusing nothing (``--prompt-cache-size 0``).
"""

from __future__ import annotations

import harness
import matrix
import pytest

from kvplugin.tools.models.families import FAMILIES, available

pytestmark = pytest.mark.matrix

VERSION = harness.host_version("mlx-lm")
HOST = matrix.Host(cmd=harness.mlx_lm_server_cmd, mode_flags={"batched": (), "sequential": ()},
                   seeded_modes=frozenset({"sequential"}),
                   budget_flags=("--prompt-cache-bytes", "1"))
CELLS = matrix.cells(["batched", "sequential"],
                     ["llama", *(f for f in FAMILIES if available(f, VERSION))])


@pytest.fixture(scope="module")
def bench(tiny_model, tmp_path_factory, start_server):
    return matrix.Bench(HOST, matrix.model_dirs(tiny_model, tmp_path_factory), start_server,
                        no_reuse=("--prompt-cache-size", "0"))


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_cell(cell, bench, redis_server, tmp_path):
    bench.check(cell, redis_server, tmp_path)
