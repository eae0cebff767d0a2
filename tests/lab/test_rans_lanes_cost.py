"""scripts/rans_lanes_cost.py: every decoder form gives back exactly the symbols encoded."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from codec.methods import conditional

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "rans_lanes_cost.py"


@pytest.fixture(scope="module")
def lab():
    spec = importlib.util.spec_from_file_location("rans_lanes_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("level", [5, 40, 120])
def test_every_form_round_trips_the_codec_mask_tables(lab, level):
    mfreq, mcum, mslot = conditional.mask_tables()
    freq, cum, slots = mfreq[level], mcum[level], mslot[level]
    p = freq / freq.sum()
    syms = np.random.default_rng(level).choice(len(freq), size=4096, p=p).astype(np.int64)
    words, xs = lab._encode_scalar4(syms, freq, cum)
    for decode in (lab._decode_scalar4, lab._decode_grouped4):  # one stream, two ways to read it
        out = np.zeros(syms.size, np.uint8)
        assert decode(syms.size, words, xs, freq, cum, slots, out) == words.size
        assert np.array_equal(out, syms)
    for lanes in (8, 16):
        words16, xs16 = lab._encode_lanes(syms, freq, cum, lanes)
        out = np.zeros(syms.size, np.uint8)
        assert lab._lane_decoder(lanes)(syms.size, words16, xs16, freq, cum, slots, out) == words16.size
        assert np.array_equal(out, syms)
        # the same information: within a few words of the production stream
        assert abs(words16.nbytes - words.nbytes) < 64 + 0.01 * words.nbytes


def test_the_script_reports_every_form():
    run = subprocess.run([sys.executable, str(SCRIPT), "--symbols", "8192", "--repeat", "1"], capture_output=True,
                         text=True, check=True)
    for form in ("scalar-4", "grouped-4", "lanes-8", "lanes-16"):
        assert f"  {form} " in run.stdout and "x scalar-4" in run.stdout
