"""The 8-GPU projection's arithmetic (issue #7): the a + b/G fit, interpolation, no extrapolation."""

import json

import pytest

from experiments import project_k26 as P


def result(times, name="r", mesh=None, **config):
    return {"name": name, "config": dict(dict(size="full", prefix=1024, dtype="bfloat16"), mesh=mesh, **config),
            "rows": [{"M": m, "part": "layer", "us": t} for m, t in times.items()]
            + [{"M": 1, "part": "attention", "us": 1.0}]}


def pair(one_times, two_times):
    """A 1-GPU result and a 1x2-mesh one."""
    return result(one_times), result(two_times, mesh="1x2")


def test_fit_passes_through_both_measurements():
    coeffs = P.fit({1: 300.0, 65: 1900.0}, {1: 290.0, 65: 1100.0})
    for m, t1, t2 in [(1, 300.0, 290.0), (65, 1900.0, 1100.0)]:
        assert P.layer_time(coeffs, m, 1) == pytest.approx(t1)
        assert P.layer_time(coeffs, m, 2) == pytest.approx(t2)
    a, b = coeffs[65]
    assert P.layer_time(coeffs, 65, 8) == pytest.approx(a + b / 8) == pytest.approx(300.0 + 1600.0 / 8)


def test_interpolates_between_measured_m_and_refuses_outside():
    coeffs = P.fit({1: 100.0, 9: 180.0}, {1: 100.0, 9: 140.0})  # b = 0 at M=1, 80 at M=9
    assert P.layer_time(coeffs, 5, 2) == pytest.approx((100.0 + 140.0) / 2)
    with pytest.raises(ValueError, match="outside the measured range"):
        P.layer_time(coeffs, 10, 8)
    with pytest.raises(ValueError, match="no M measured on both"):
        P.fit({1: 1.0}, {2: 1.0})


def test_project_rows():
    one, two = pair({1: 300.0, 9: 500.0, 65: 1900.0}, {1: 290.0, 9: 400.0, 65: 1100.0})
    rows = P.project(one, two, {8: 2.5, 64: 3.0}, gpus=8, layers=61, streams=(1, 10))
    ar = rows[0]
    assert ar["mode"] == "AR" and ar["M"] == 1
    assert ar["tok_s"] == pytest.approx(1e6 / (61 * (280.0 + 20.0 / 8)))
    by_key = {(r["mode"], r["streams"], r["budget"]): r for r in rows}
    assert by_key[("DDTree", 1, 8)]["M"] == 9 and by_key[("DDTree", 1, 8)]["tokens_per_step"] == 2.5
    assert by_key[("DDTree", 1, 64)]["M"] == 65
    assert "outside" in by_key[("DDTree", 10, 64)]["note"]  # M = 650: not measured, not projected
    with pytest.raises(ValueError, match="no 'layer' rows"):
        P.project(dict(one, rows=[]), two, {}, gpus=8)


def test_refuses_inputs_of_different_commits_or_timing_unless_allowed():
    one, two = pair({1: 300.0}, {1: 290.0})
    traced = dict(two, config=dict(two["config"], traced=True))
    with pytest.raises(ValueError, match="1-GPU layer times are fori_loop, the 2-GPU ones traced"):
        P.project(one, traced, {}, gpus=8)
    with pytest.raises(ValueError, match="at M=1 the 1-GPU layer time comes from commit a, the 2-GPU one from b"):
        P.project(dict(one, commit="a"), dict(two, commit="b"), {}, gpus=8)
    assert P.project(dict(one, commit="a"), dict(two, commit="b"), {}, gpus=8, allow_mixed=True)[0]["mode"] == "AR"


def test_busy_figure_fits_the_kernels_time_and_needs_it_recorded():
    one = {"name": "one", "config": {"traced": True, "mesh": None},
           "rows": [{"M": 1, "part": "layer", "us": 220.0, "busy_us": 225.0}]}
    two = {"name": "two", "config": {"traced": True, "mesh": "1x2"},
           "rows": [{"M": 1, "part": "layer", "us": 1800.0, "busy_us": 221.0}]}
    assert P.layer_times(two, "busy") == {1: 221.0} and P.layer_times(two) == {1: 1800.0}
    ar = P.project(one, two, {}, gpus=8, layers=61, figure="busy")[0]
    assert ar["layer_us"] == pytest.approx(217.0 + 8.0 / 8)  # a = 2 * 221 - 225, b = 2 * (225 - 221)
    with pytest.raises(ValueError, match="has no 'busy_us'"):
        P.layer_times(result({1: 300.0}), "busy")
    with pytest.raises(ValueError, match="figure must be"):
        P.layer_times(one, "wall")


def test_results_of_several_calls_combine_by_m():
    a = dict(result({1: 300.0, 9: 500.0}, "a"), commit="c1")
    b = dict(result({90: 1800.0}, "b"), commit="c2")
    both = P.combine_results([a, b], ["a.json", "b.json"])
    assert P.layer_times(both) == {1: 300.0, 9: 500.0, 90: 1800.0} and both["commit"] == "c1+c2"
    assert {r["commit"] for r in both["rows"] if r["M"] == 90} == {"c2"}
    assert P.combine_results([a], ["a.json"]) is a
    with pytest.raises(ValueError, match="M=1 is in both a.json and c.json"):
        P.combine_results([a, dict(result({1: 1.0}), commit="c3")], ["a.json", "c.json"])
    with pytest.raises(ValueError, match="time the layer differently"):
        P.combine_results([a, dict(b, config={"traced": True})], ["a.json", "b.json"])


def test_crossed_commits_in_combined_inputs_are_refused_per_m():
    # --one = [M=1 @c1, M=9 @c2], --two = [M=1 @c2, M=9 @c1]: both read "c1+c2", yet every M mixes commits
    one = P.combine_results([dict(result({1: 300.0}), commit="c1"), dict(result({9: 500.0}), commit="c2")],
                            ["o1.json", "o9.json"])
    two = P.combine_results([dict(result({1: 290.0}, mesh="1x2"), commit="c2"),
                             dict(result({9: 400.0}, mesh="1x2"), commit="c1")], ["t1.json", "t9.json"])
    assert one["commit"] == two["commit"] == "c1+c2"
    with pytest.raises(ValueError, match="at M=1 the 1-GPU layer time comes from commit c1, the 2-GPU one from c2"):
        P.project(one, two, {}, gpus=8)
    assert P.project(one, two, {}, gpus=8, allow_mixed=True)[0]["mode"] == "AR"
    # the same commit per M passes, even though the files' commits differ
    two = P.combine_results([dict(result({1: 290.0}, mesh="1x2"), commit="c1"),
                             dict(result({9: 400.0}, mesh="1x2"), commit="c2")], ["t1.json", "t9.json"])
    assert P.project(one, two, {}, gpus=8)[0]["mode"] == "AR"


@pytest.mark.parametrize("one,two,message", [
    (result({1: 300.0}), result({1: 290.0}, mesh="1x2", prefix=65536), "different settings {'prefix': (1024, 65536)}"),
    (result({1: 300.0}), result({1: 290.0}, mesh="1x2", size="tiny"), "different settings {'size'"),
    (result({1: 300.0}), result({1: 290.0}, mesh="1x2", dtype="float32"), "different settings {'dtype'"),
    (result({1: 300.0}), result({1: 290.0}), "1x2-mesh times; got mesh None and None"),  # a 1-GPU file as --two
    (result({1: 300.0}, mesh="1x2"), result({1: 290.0}, mesh="1x2"), "got mesh 1x2 and 1x2"),
    (result({1: 300.0}), result({1: 290.0}, mesh="1x4"), "got mesh None and 1x4"),
])
def test_inputs_of_other_settings_are_refused_unless_allowed(one, two, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        P.project(one, two, {}, gpus=8)
    assert P.project(one, two, {}, gpus=8, allow_mixed=True)[0]["mode"] == "AR"


def test_combined_files_must_share_their_settings():
    a, b = result({1: 300.0}), result({90: 1800.0}, prefix=65536)
    with pytest.raises(ValueError, match="different settings"):
        P.combine_results([a, b], ["a.json", "b.json"])
    assert P.layer_times(P.combine_results([a, b], ["a.json", "b.json"], allow_mixed=True)) == {1: 300.0, 90: 1800.0}



def local_result(times, devices=8, hidden=1000, **kw):
    return dict(result(times, local_of=devices, hidden_size=hidden), **kw)


def test_all_reduces_cost_their_latencies_and_the_ring_bytes():
    # 8 GPUs, M = 10, D = 1000: the layer's rows of f32 per token, each device sends and receives 2 * 7/8 of them
    nbytes = P.ALLREDUCED_ROWS_PER_TOKEN * 10 * 1000 * 4 * 2 * 7 / 8
    assert P.allreduce_time(10, 1000, 8, 5.0, 100.0) == pytest.approx(2 * 5.0 + nbytes / 100e3)
    assert P.allreduce_time(10, 1000, 1, 5.0, 100.0) == 10.0  # nothing crosses a single device


def test_local_projection_adds_the_all_reduces_to_one_devices_share():
    local = local_result({1: 100.0, 9: 140.0})
    rows = P.project_local(local, 10.0, 1e9, {8: 2.5}, layers=61, streams=(1,))  # the bytes cost ~nothing
    ar, tree = rows
    assert ar["layer_us"] == pytest.approx(100.0 + P.ALLREDUCES_PER_LAYER * 10.0)
    assert ar["tok_s"] == pytest.approx(1e6 / (61 * 120.0))
    assert tree["M"] == 9 and tree["tok_s"] == pytest.approx(2.5 * 1e6 / (61 * 160.0))
    slow = P.project_local(local, 0.0, 100.0, {}, streams=(1,))[0]["layer_us"]
    assert slow == pytest.approx(100.0 + P.allreduce_time(1, 1000, 8, 0.0, 100.0)) and slow > 100.0
    with pytest.raises(ValueError, match="not a bench_layer --local-of result"):
        P.project_local(result({1: 100.0}), 10.0, 100.0, {})
    with pytest.raises(ValueError, match="latency must be >= 0 and its bandwidth > 0"):
        P.project_local(local, -1.0, 100.0, {})
    with pytest.raises(ValueError, match="latency must be >= 0 and its bandwidth > 0"):
        P.project_local(local, 1.0, 0.0, {})


def test_local_main_projects_each_assumed_latency(tmp_path, capsys):
    path = tmp_path / "local.json"
    path.write_text(json.dumps(local_result({1: 100.0, 9: 140.0}, commit="abc")))
    assert P.main(["--local", str(path), "--allreduce-us", "0,10", "--allreduce-gbps", "1e9",
                   "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "project_k26_8gpu_local.json").read_text())
    assert out["gpus"] == 8 and out["inputs"]["commit"] == "abc" and out["inputs"]["allreduce_bus_gbps"] == 1e9
    assert [(r["allreduce_us"], round(r["layer_us"], 3)) for r in out["rows"]] == [(0.0, 100.0), (10.0, 120.0)]
    assert "busiest device" in out["assumptions"] and "a(M) + b(M) / G" not in out["assumptions"]
    bad = [["--local", str(path)], ["--local", str(path), "--allreduce-us", "1"],
           ["--local", str(path), "--one", str(path), "--allreduce-us", "1", "--allreduce-gbps", "1"],
           ["--local", str(path), "--allreduce-us", "x", "--allreduce-gbps", "1"],
           ["--one", str(path), "--two", str(path), "--allreduce-gbps", "1"], ["--one", str(path)]]
    for argv in bad:
        with pytest.raises(SystemExit):
            P.main(argv)
    assert "--allreduce-us must be a comma list of numbers" in capsys.readouterr().err


def test_local_results_of_other_device_counts_do_not_combine():
    four, eight = local_result({1: 90.0}, devices=4), local_result({9: 140.0}, devices=8)
    with pytest.raises(ValueError, match="different settings"):
        P.combine_results([four, eight], ["four", "eight"])
    both = P.combine_results([local_result({1: 90.0}), eight], ["a", "b"])
    assert P.layer_times(both) == {1: 90.0, 9: 140.0}
