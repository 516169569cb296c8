"""The profile store: sharing by signature, re-runs that measure nothing, force, device refusal, concurrent writers."""

import io
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from planner.analytic import estimate_ops, estimate_profile, profile_analytic
from planner.devices import load_device
from planner.files import PlannerError, load_model, save_model
from planner.onnx_import import import_onnx
from planner.profile import TIMING, Candidate, OpProfile, Profile
from planner.profile_report import print_summary, summary_json, tradeoff
from planner.store import BN_RELU, VIEWS, ProfileStore, behind, profile_graph, require_same_device

MODELS = Path(__file__).parent / "models"
PROFILES = Path(__file__).parent.parent / "profiles"
H100 = load_device("h100")
MEASURED = H100.model_copy(update={"cudnn_version": "91002", "driver_version": "580.1"})


@pytest.fixture(scope="module")
def resnet():
    return import_onnx(MODELS / "resnet50.op13.onnx", batch=1)


@pytest.fixture(scope="module")
def resnext():
    return import_onnx(MODELS / "resnext50.op13.onnx", batch=1)


def entry(signature, time_us=1.0, workspace=0, name="a"):
    return OpProfile(signature=signature, kind="relu",
                     candidates=[Candidate(name=name, time_us=time_us, workspace_bytes=workspace)])


class Counter:
    """A measure function that estimates and remembers what it was asked for."""

    def __init__(self, graph, device=H100):
        self.graph, self.device, self.seen = graph, device, []

    def __call__(self, nodes):
        self.seen += [n.signature for n in nodes]
        yield from estimate_ops(self.graph, self.device, nodes)


def test_put_get_round_trip(tmp_path):
    store = ProfileStore(tmp_path, MEASURED)
    assert store.get("s1") is None
    store.put(entry("s1", 2.0))
    store.put_many([entry("s2"), entry("s1", 3.0)])
    again = ProfileStore(tmp_path, MEASURED)
    assert again.get("s1").candidates[0].time_us == 3.0
    assert set(again.entries()) == {"s1", "s2"}
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_second_run_measures_nothing_and_force_measures_all(tmp_path, resnet):
    store = ProfileStore(tmp_path, H100, estimated=True)
    first = Counter(resnet)
    profile, done = profile_graph(resnet, store, first)
    distinct = {n.signature for n in resnet.nodes if n.kind != "reshape"}
    assert done == len(distinct) and sorted(first.seen) == sorted(distinct)
    assert profile.graph_sha256 == resnet.graph_sha256 and profile.estimated
    assert set(profile.ops) == {n.signature for n in resnet.nodes}
    assert store.missing(resnet) == []
    second = Counter(resnet)
    assert profile_graph(resnet, store, second)[1] == 0 and second.seen == []
    forced = Counter(resnet)
    assert profile_graph(resnet, store, forced, force=True)[1] == len(distinct)


def test_identical_layers_share_entries_across_models(tmp_path, resnet, resnext):
    store = ProfileStore(tmp_path, H100, estimated=True)
    profile_graph(resnet, store, Counter(resnet))
    todo = store.missing(resnext)
    all_resnext = {n.signature for n in resnext.nodes if n.kind != "reshape"}
    assert 0 < len(todo) < len(all_resnext)  # the stem, pooling and many 1x1 convs are already there
    counter = Counter(resnext)
    profile_graph(resnext, store, counter)
    assert sorted(counter.seen) == sorted(todo)


def test_a_measured_store_times_again_what_it_timed_the_older_way(tmp_path, resnet):
    """Entries timed as one graph's time over its launches (the fixed cost of the graph's launch included) are
    measured again, so that every op of a profile is timed alike; measured the current way, nothing is."""
    estimated = dict(profile_graph(resnet, ProfileStore(tmp_path / "e", H100, estimated=True), Counter(resnet))[0].ops)
    store = ProfileStore(tmp_path, MEASURED)
    store.put_many(op.model_copy(update={"estimated": False}) for op in estimated.values() if op.kind != "reshape")
    assert {store.get(s).timing for s in store.entries()} == {"graph"}
    assert store.assemble(resnet).ops  # all timed the older way: alike
    first = next(s for s in store.entries())
    store.put(store.get(first).model_copy(update={"timing": TIMING}))
    with pytest.raises(PlannerError, match="timed the older way"):
        store.assemble(resnet)
    counter = Counter(resnet)
    profile_graph(resnet, store, lambda nodes: (op.model_copy(update={"estimated": False, "timing": TIMING})
                                                for op in counter(nodes)))
    assert sorted(counter.seen) == sorted({n.signature for n in resnet.nodes if n.kind != "reshape"} - {first})
    assert store.missing(resnet) == []


def test_analytic_entry_point(tmp_path, resnet):
    profile, done = profile_analytic(resnet, H100, tmp_path)
    assert done > 0 and profile.estimated
    assert profile_analytic(resnet, H100, tmp_path)[1] == 0
    assert profile_analytic(resnet, H100, None)[0].ops.keys() == profile.ops.keys()
    assert (tmp_path / "NVIDIA_H100_80GB_HBM3-9.0-analytic-132.estimated.json").exists()


def test_assemble_refuses_an_incomplete_store(tmp_path, resnet):
    store = ProfileStore(tmp_path, H100, estimated=True)
    with pytest.raises(PlannerError, match="not in the profile store"):
        store.assemble(resnet)


def test_other_device_or_cudnn_is_refused(tmp_path):
    store = ProfileStore(tmp_path, MEASURED)
    store.put(entry("s1"))
    other_cudnn = MEASURED.model_copy(update={"cudnn_version": "90100"})
    require_same_device(MEASURED.model_copy(update={"driver_version": "999"}), MEASURED)
    with pytest.raises(PlannerError, match="cuDNN 91002"):
        require_same_device(MEASURED, other_cudnn)
    # a store file renamed or copied to another device's name is not used
    ProfileStore(tmp_path, other_cudnn).path.write_text(store.path.read_text())
    with pytest.raises(PlannerError, match="made for device"):
        ProfileStore(tmp_path, other_cudnn).get("s1")
    profile = Profile(device=other_cudnn, dtype="fp32", ops={"s9": entry("s9")})
    with pytest.raises(PlannerError, match="made for device"):
        store.import_profile(profile)
    assert store.import_profile(profile.model_copy(update={"device": MEASURED})) == 1


def test_estimated_and_measured_never_mix(tmp_path):
    device = MEASURED
    measured, estimated = ProfileStore(tmp_path, device), ProfileStore(tmp_path, device, estimated=True)
    measured.put(entry("m"))
    estimated.put(entry("e"))
    assert measured.path != estimated.path
    assert set(measured.entries()) == {"m"} and set(estimated.entries()) == {"e"}
    estimated.path.write_text(measured.path.read_text())
    with pytest.raises(PlannerError, match="holds measured entries"):
        estimated.entries()
    with pytest.raises(PlannerError, match="cannot mix"):
        measured.import_profile(Profile(device=device, dtype="fp32", estimated=True))


def test_broken_store_files_are_clear_errors(tmp_path):
    store = ProfileStore(tmp_path, MEASURED)
    store.directory.mkdir(exist_ok=True)
    store.path.write_text("{not json")
    with pytest.raises(PlannerError, match="not a readable profile store"):
        store.entries()
    store.path.write_text(json.dumps({"kind": "profile_store", "format_version": 99}))
    with pytest.raises(PlannerError, match="format version 99"):
        store.entries()


def _writer(directory, worker, count):
    store = ProfileStore(directory, MEASURED)
    for i in range(count):
        store.put(entry(f"w{worker}-{i}"))


def test_concurrent_writers_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(tmp_path, w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert set(ProfileStore(tmp_path, MEASURED).entries()) == {f"w{w}-{i}" for w in range(4) for i in range(25)}


def test_interrupted_run_keeps_finished_entries(tmp_path, resnet):
    store = ProfileStore(tmp_path, H100, estimated=True)

    def flaky(nodes):
        yield from estimate_ops(resnet, H100, nodes[:3])
        raise RuntimeError("GPU fell off the bus")

    with pytest.raises(RuntimeError):
        profile_graph(resnet, store, flaky)
    assert len(store.entries()) == 3


def test_report_rows_json_and_table(tmp_path, resnet):
    profile, _ = profile_analytic(resnet, load_device("k40"), tmp_path)
    save_model(profile, tmp_path / "p.json")
    profile = load_model(Profile, tmp_path / "p.json")
    data = summary_json(profile)
    assert data["estimated"] is True and data["ops"] == len(profile.ops)
    conv = next(r for r in data["kinds"] if r["kind"] == "conv_fused")
    assert conv["candidates_min"] >= 3 and conv["spread_max"] >= conv["spread_median"] >= 1
    assert conv["workspace_min_bytes"] == 0 < conv["workspace_max_bytes"]
    assert len(data["fastest_not_leanest"]) == sum(r["fastest_not_leanest"] for r in data["kinds"]) > 0
    out = io.StringIO()
    print_summary(profile, Console(file=out, width=200))
    text = out.getvalue()
    assert "ESTIMATED" in text and "conv" in text and "fastest candidate is not the leanest" in text
    assert "not calibrated" in text and data["calibration"]["keys"] == []
    out = io.StringIO()
    print_summary(profile, Console(file=out, width=40), as_json=True)
    assert json.loads(out.getvalue()) == json.loads(json.dumps(data))
    profile.device.calibrate("inference", 0.98, {"d2h": 1.1}, 0.04, 0.61, 1.32)
    profile.device.calibrate("inference.b1", 0.0, {}, None, None, 1.17)
    rows = {r["key"]: r for r in summary_json(profile)["calibration"]["keys"]}
    assert rows["inference.b1"] == {"key": "inference.b1", "dispatch_us": 0.0, "one_stream_dispatch_us": None,
                                    "co_running": 1.17}
    out = io.StringIO()
    print_summary(profile, Console(file=out, width=200))
    assert "inference.b1" in out.getvalue() and "d2h x1.100" in out.getvalue()


def test_tradeoff_picks_fastest_and_leanest():
    op = OpProfile(signature="s", kind="conv", candidates=[
        Candidate(name="fast", time_us=1.0, workspace_bytes=100),
        Candidate(name="lean", time_us=3.0, workspace_bytes=0),
        Candidate(name="mid", time_us=2.0, workspace_bytes=0),
    ])
    t = tradeoff(op)
    assert (t.fastest, t.leanest, t.leanest_us) == ("fast", "mid", 2.0)
    op.candidates[0].workspace_bytes = 0
    assert tradeoff(op) is None


def test_prune_keeps_pareto_front_and_fastest():
    from planner.profile import Candidate, prune_candidates

    c = lambda n, t, ws, sm: Candidate(name=n, time_us=t, workspace_bytes=ws, sm_fraction=sm)  # noqa: E731
    cands = [c("fast_big", 10, 1000, 1.0), c("lean", 20, 0, 1.0), c("narrow", 30, 0, 0.2),
             c("dominated", 40, 1000, 1.0), c("slow_dominated", 50, 500, 1.0), c("second", 11, 2000, 1.0)]
    kept = [k.name for k in prune_candidates(cands, keep_fastest=2)]
    assert kept == ["fast_big", "second", "lean", "narrow"]


def test_an_entry_measured_before_an_implementation_existed_is_measured_again(tmp_path):
    """The stem kernels (runner/ops/stem.py) take GoogLeNet's first conv and its weight gradient in fp16, the 2x2
    blocks its max-pool gradients: entries stored without them are measured again, once; the rest of the store
    stays as it is."""
    from planner.cli import DType, load_graph
    from runner.ops import implementations

    graph = load_graph(MODELS / "googlenet.train.onnx", 2, DType("fp16"), True)
    offered = lambda node: implementations(graph, node)  # noqa: E731
    newer = {n.signature: offered(n) for n in graph.nodes if offered(n)}
    assert {n.kind for n in graph.nodes if n.signature in newer} == {"conv", "conv_bwd_filter", "maxpool_bwd"}
    store = ProfileStore(tmp_path, H100, estimated=True)
    profile_graph(graph, store, Counter(graph))
    measured = ProfileStore(tmp_path / "m", MEASURED)
    measured.put_many(op.model_copy(update={"estimated": False, "timing": TIMING})
                      for op in store.assemble(graph).ops.values() if op.kind != "reshape")
    assert measured.missing(graph) == [] and set(measured.missing(graph, offered)) == set(newer)
    counter = Counter(graph)
    profile_graph(graph, measured, lambda nodes: (op.model_copy(update={
        "estimated": False, "timing": TIMING, "implementations": newer[op.signature]}) for op in counter(nodes)),
        offered=offered)
    assert set(counter.seen) == set(newer) and measured.missing(graph, offered) == []


def test_behind_names_what_a_measured_profile_lacks_and_what_measures_it(tmp_path):
    """The shipped H100 profile of GoogLeNet training at batch 1 predates the fused BatchNormalization + ReLU
    kernels, the stem and 2x2 pooling-gradient kernels and the marginal timing: solve says so and names the command
    that measures them; the batch-32 profiles (H100 and H200) lack nothing, and an analytic profile is never
    behind."""
    from planner.cli import DType, load_graph
    from runner.ops import implementations

    graph = load_graph(MODELS / "googlenet.train.onnx", 1, DType("fp16"), True)
    offered = lambda node: implementations(graph, node)  # noqa: E731
    old = behind(graph, load_model(Profile, PROFILES / "googlenet.train.b1.fp16.json"), offered)
    assert old.unmeasured[BN_RELU] == 66 and old.unmeasured[VIEWS] == 52  # 33 forward + 33 backward; 26 + 26
    assert {"stem", "stem_wgmma", "pool_2x2"} <= set(old.without) and old.older_timing > 400
    assert "118 fused ops never measured" in old.describe() and "stem (2)" in old.describe()
    assert not behind(graph, estimate_profile(graph, H100), offered)
    b32 = load_graph(MODELS / "googlenet.train.onnx", 32, DType("fp16"), True)
    for shipped in ("googlenet.train.b32.fp16.json", "h200/googlenet.train.b32.fp16.json"):
        assert not behind(b32, load_model(Profile, PROFILES / shipped), lambda node: implementations(b32, node))
    out = subprocess.run([sys.executable, "-m", "planner.cli", "solve", str(MODELS / "googlenet.train.onnx"), "--train",
                          "-b", "1", "--dtype", "fp16", "--profile", str(PROFILES / "googlenet.train.b1.fp16.json"),
                          "--time-limit", "0", "--out", str(tmp_path / "plan.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ("`planner profile " + str(MODELS / "googlenet.train.onnx") + " -b 1 --dtype fp16 --train` on the NVIDIA "
            "H100 80GB HBM3 measures them") in " ".join(out.stdout.split())

