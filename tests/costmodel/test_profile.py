"""Hardware profiles (flashcp.costmodel.profile): the default cites every parameter, bad files get one sentence,
round trips, the attention curve."""


import json

import numpy as np
import pytest

from flashcp.bench.calibrate import save_profile
from flashcp.costmodel.profile import load_profile
from flashcp.errors import FlashcpError


def test_default_profile_cites_every_parameter(profile):
    assert not profile.calibrated and profile.peak_tflops == 989.0
    for name in ("peak_tflops", "attention_tflops", "query_tile", "link_gbps", "hbm_gbps",
                 "kernel_overhead_us", "sequence_overhead_us", "collective_latency_us"):
        assert profile.sources[name], f"{name} has no source"
    assert "ASSUMPTION" in profile.sources["kernel_overhead_us"]


@pytest.mark.parametrize("text, words", [
    ("{not json", "is not valid JSON"),
    ('{"format": "something-else"}', "is not a flashcp hardware profile"),
    ('{"format": "flashcp-hardware-profile"}', "needs 'attention_tflops'"),
])
def test_bad_profile_gets_one_sentence(tmp_path, text, words):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(FlashcpError, match=words) as info:
        load_profile(path)
    assert "\n" not in str(info.value)


def test_bad_profile_values_are_refused(tmp_path, profile):
    good = profile.to_json()
    changes = ((lambda o: o["link_gbps"].update(value="fast"), "needs 'link_gbps'"),
               (lambda o: o["attention_tflops"].update(lengths=[4, 2, 8, 16, 32, 64]), "increasing"),
               (lambda o: o["hbm_gbps"].update(value=-1), "must be a positive finite number"))
    for change, words in changes:
        obj = json.loads(json.dumps(good))
        change(obj)
        path = tmp_path / "p.json"
        path.write_text(json.dumps(obj))
        with pytest.raises(FlashcpError, match=words):
            load_profile(path)
    with pytest.raises(FlashcpError, match="cannot be read"):
        load_profile(tmp_path / "missing.json")


def test_profile_round_trip(tmp_path, profile):
    save_profile(profile, tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again == profile


def test_curve_hits_its_points_and_is_capped(profile):
    lengths = np.array(profile.lengths)
    np.testing.assert_allclose(profile.attention_tflops(lengths), profile.forward_tflops)
    np.testing.assert_allclose(profile.attention_tflops(lengths, backward=True), profile.backward_tflops)
    grid = np.geomspace(1, 1 << 20, 200)
    values = profile.attention_tflops(grid)
    assert (np.diff(values) >= -1e-9).all() and values.max() <= profile.peak_tflops
    assert values[-1] == pytest.approx(profile.forward_tflops[-1])
