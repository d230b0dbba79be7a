"""bench/census.py: what it counts equals a hand count (host syncs and kernels of a small function; the operations of
one decoder layer of a 1-layer and a 2-layer model); narrow widths map onto the real ones exactly (two different sets
of narrow widths give the same real bytes and FLOPs); a figure of L layers follows from 1 and 2 layers; the command
prints one JSON object with its headline figures; `python -m bench show` recomputes the committed census figures."""

import collections
import contextlib
import io
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import bench.__main__ as cli
import policy
import models
from bench import census, common, host_time

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def counted(fn, *device_tensors, mapping=None):
    """A Census of fn() with `device_tensors` on the device (the model's parameters, say)."""
    recorder = census.Census(mapping or {}, factories_on_device=True)
    for tensor in device_tensors:
        recorder.device.add(tensor)
    with census.host_boundary(recorder, CPU), recorder:
        fn()
    return recorder


def kernels(recorder):
    ops = collections.Counter()
    for (phase, op, dtype, nbytes, flops), count in recorder.ops.items():
        ops[op] += count
    return ops


def test_kernels_and_host_syncs_by_hand():
    weight = torch.randn(4, 3)

    def work():
        x = weight * 2                           # a kernel on the device
        total = x.sum()                          # a kernel
        float(total)                             # a sync: the host reads a device value
        x.view(-1)                               # a view: no kernel
        host = torch.ones(3)                     # host work: no kernel, no sync
        int(host.sum())
        moved = host.to(weight.device)           # a host-to-device copy, blocking: a sync
        host.to(weight.device, non_blocking=True)   # not blocking: no sync
        moved + 1                                # a kernel (the copy is on the device)
        x.to(weight.device)                      # where it is: nothing
        host.to(CPU)                             # a device made otherwise: where the tensor is, nothing
        x.cpu()                                  # a device-to-host copy: a sync
        x.to(host.device)                        # one too: the host's device
        x.tolist()                               # a sync
        torch.arange(3, device=weight.device)    # a factory given the device: a kernel
        x[x > 0]                                 # gt, index (kernels) and a sync (boolean index)
        torch.unique(x)                          # a kernel and a sync

    recorder = counted(work, weight)
    assert kernels(recorder) == {"mul": 1, "sum": 1, "add": 1, "arange": 1, "gt": 1, "index": 1, "_unique2": 1}
    assert dict(recorder.syncs) == {("other", "item"): 1, ("other", "host-to-device copy"): 1,
                                    ("other", "device-to-host copy"): 3, ("other", "boolean index"): 1,
                                    ("other", "unique"): 1}


def forward_ops(layers):
    model = models.tiny_random_model("qwen2", vocab_size=97, num_hidden_layers=layers, hidden_size=64,
                                     intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return kernels(counted(lambda: policy.token_logprobs(model, ids.to(CPU), torch.ones_like(ids).to(CPU), 4),
                               *model.parameters(), *model.buffers()))


def test_the_kernels_of_one_decoder_layer_by_hand():
    """A Qwen2 decoder layer in float32 (no LoRA): RMSNorm x 2 (pow, mean, add eps, rsqrt, 2 mul), q/k/v with bias
    (addmm x 3), rotary on q and k (mul, neg, cat, mul, add each), attention (one SDPA kernel), o_proj and the MLP's
    gate, up, down (mm x 4), SiLU, SiLU x up (mul), 2 residual adds: 34 kernels. A figure of 3 layers is that of 1
    plus 2 x (2 - 1)."""
    one, two, three = forward_ops(1), forward_ops(2), forward_ops(3)
    layer = {op: two[op] - one[op] for op in two if two[op] != one[op]}
    attention = next(op for op in layer if "attention" in op)
    assert layer == {"pow": 2, "mean": 2, "add": 2 + 2 + 2, "rsqrt": 2, "mul": 4 + 4 + 1, "addmm": 3, "neg": 2,
                     "cat": 2, attention: 1, "mm": 4, "silu": 1}
    assert sum(layer.values()) == 34
    assert three == {op: one[op] + 2 * layer.get(op, 0) for op in one}
    assert census.extrapolated({"a": 3, "b": {"c": 1.0}}, {"a": 5, "b": {"c": 1.5}, "d": 2}, 36) == \
        {"a": 3 + 35 * 2, "b": {"c": 1.0 + 35 * 0.5}, "d": 70}


def test_narrow_widths_stand_for_the_real_ones():
    real = common.real_config("qwen2.5-3b")
    mapping = census.width_map(real, census.Narrow(), 64, 200, 512, 16, 64, 1024)
    narrow = census.Narrow()
    assert mapping[16 * narrow.half_head_dim * 2] == 2048 and mapping[narrow.vocab] == 151936
    assert mapping[4 * (narrow.completion - 1)] == 4 * 511 and mapping[narrow.prefix] == 199
    recorder = census.Census(mapping, every_tensor_on_device=True)
    x = torch.randn(4 * (narrow.completion - 1), 16 * narrow.half_head_dim * 2, dtype=torch.bfloat16)
    head = torch.randn(16 * narrow.half_head_dim * 2, narrow.vocab, dtype=torch.bfloat16)
    with recorder:
        x @ head
    [(key, count)] = recorder.ops.items()
    # [2044, 2048] @ [2048, 151936] in bf16: reads both, writes [2044, 151936]
    assert key == ("other", "mm", "bfloat16", 2 * (2044 * 2048 + 2048 * 151936 + 2044 * 151936),
                   2 * 2044 * 2048 * 151936)
    with pytest.raises(ValueError, match="narrow width"):
        census.width_map(real, replace(narrow, rank=narrow.vocab), 64, 200, 512, 16, 64, 1024)


def small_update(narrow):
    """One update's records of a 1-layer narrow model: 4 rows of 40 + 64 tokens, micro-batches of 2."""
    args = census.trainer_args("a", ["--micro-batch-size", "2"])
    args.census_model = "qwen2.5-3b"
    real = common.real_config("qwen2.5-3b")
    real.vocab_size = 49152
    mapping = census.width_map(real, narrow, 64, 40, 64, 4, 64, 1024)
    return census.update_run(args, 1, narrow, mapping, 4)


def test_two_sets_of_narrow_widths_give_the_same_real_bytes_and_flops():
    first = small_update(census.Narrow())
    second = small_update(census.Narrow(half_head_dim=19, rank=17, intermediate=29, vocab=103, prefix=21,
                                        completion=51))
    assert first["optimizer_steps"] == second["optimizer_steps"] == 1
    for records in (first, second):
        assert records["model_calls"] == 1 + 2   # the step's prefix, then one call per micro-batch

    def by_phase(records):
        table = collections.defaultdict(lambda: [0, 0, 0])
        for phase, op, dtype, nbytes, flops, count in records["ops"]:
            entry = table[phase.split(" [")[0]]
            entry[0] += count
            entry[1] += nbytes * count
            entry[2] += flops * count
        return dict(table)

    assert by_phase(first) == by_phase(second)
    assert first["syncs"] == second["syncs"]


COMMITTED = ROOT / "results" / "census" / "census_after.json"   # BENCHMARKS.md's figures, from its command


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """`python -m bench census --json` run now, as BENCHMARKS.md names it (preset (a): 1- and 2-layer narrow
    models): (what it printed, what it saved)."""
    out = tmp_path_factory.mktemp("census") / "census.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        saved = cli.main(["census", "--json", "--host-repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["update_kernels"] == saved["update_kernels"]
    return json.loads(printed.getvalue()), saved


def kernels_by_kind(raw):
    """{replay kind: {"1": kernels of the 1-layer update, "2": of the 2-layer one}} of a census's update records."""
    return {kind: {n: sum(row[-1] for row in run["ops"]) for n, run in runs.items()}
            for kind, runs in raw["update"]["runs"].items()}


def test_a_fresh_census_gives_the_committed_figures(fresh):
    """The census is recomputed, not read: BENCHMARKS.md's figures (results/census/census_after.json) are what the
    command counts today, headline by headline and layer by layer, replay kind by replay kind (a change to what the
    update or a decode step runs fails here until the record is made again with the command)."""
    printed, saved = fresh
    committed = json.loads(COMMITTED.read_text())
    assert printed == {**{key: saved[key] for key in census.HEADLINES},
                       **{key: saved["host"][key] for key in census.HOST_FIGURES}}
    for key in census.HEADLINES:
        assert saved[key] == committed[key], key
    assert kernels_by_kind(saved["raw"]) == kernels_by_kind(committed["raw"])


def test_the_census_counts_the_replay_plan_and_the_decode_launches(fresh):
    """Each replay kind runs what it says on the census's CPU (the GPU paths taken there: engine/gpu_paths.py): an
    MLP replayed costs kernels, a whole layer more; the card's plan decides the update's figure. A decode step
    counts the launches a GPU makes: the attention split over the columns and combined (2 kernels a layer)."""
    _, saved = fresh
    per_layer = {kind: runs["2"] - runs["1"] for kind, runs in kernels_by_kind(saved["raw"]).items()}
    assert per_layer["plain"] < per_layer["mlp"] < per_layer["checkpointed"]
    assert saved["update_checkpointed_layers"]["H200"]["mlps"] > 0 and saved["update_kernels"] <= 13_900
    assert saved["update_host_syncs_per_optimizer_step"] == 1
    ops = collections.Counter()
    for phase, op, dtype, nbytes, flops, count in saved["raw"]["decode"]["2"]["ops"]:
        ops[op] += count
    assert ops["decode_attention_combine"] == ops["decode_attention"] == 2
    assert saved["decode_kernels_per_layer"] == 10 and saved["decode_kernels_per_step"] == 36 * 10 + 14


def test_the_census_times_the_hosts_work_beside_its_counts(fresh, monkeypatch):
    """`--json` adds the host's time of setting (a)'s update and of a decode step (one thread, narrowest widths, the
    load average beside them): positive wall times of whole updates (the sampler check passes, the optimizer
    steps), which a planted 0.5 s of host work in the update shows in full (a lower bound, whatever the load)."""
    import update

    printed, saved = fresh
    assert printed["update_host_s"] > 0 and printed["decode_host_ms_per_step"] > 0
    assert saved["host"]["repeats"] == 1 and len(saved["host"]["load_average"]) == 2
    args = census.trainer_args("a", [])
    args.census_model = saved["model"]
    real, results = update.update_policy, []
    monkeypatch.setattr(update, "update_policy", lambda *a, **k: results.append(real(*a, **k)) or results[-1])
    quick = host_time.host_times(args, 2, (0, 1), repeats=1)
    # every timed update is a whole one: the sampler check passes and the optimizer steps
    assert len(results) == 2 and all(r.optimizer_steps == 1 and not r.sampler_rejected for r in results)
    monkeypatch.setattr(update, "update_policy", lambda *a, **k: time.sleep(0.5) or real(*a, **k))
    slowed = host_time.host_times(args, 2, (0, 1), repeats=1)
    assert slowed["update_host_s"] >= 0.5 > quick["update_host_s"]


def test_benchmarks_quotes_the_committed_host_times():
    """BENCHMARKS.md's host times are the committed records': the census record's update and decode step, and the
    before/after of the update (results/host/host_before_after.json: each run's median of its updates after the
    first, the median of the runs)."""
    import statistics

    host = json.loads(COMMITTED.read_text())["host"]
    benchmarks = " ".join((ROOT / "BENCHMARKS.md").read_text().split())
    assert f"update_host_s {host['update_host_s']}" in benchmarks
    assert f"decode_host_ms_per_step {host['decode_host_ms_per_step']}" in benchmarks
    record = json.loads((ROOT / "results" / "host" / "host_before_after.json").read_text())
    for arm in ("before", "after"):
        medians = [round(statistics.median(run[1:]), 3) for run in record[f"{arm}_runs_s"]]
        assert medians == record[f"{arm}_medians_s"] and statistics.median(medians) == record[f"{arm}_s"]
        assert f"{record[f'{arm}_s']:.3f} s ({', '.join(f'{m:.3f}' for m in medians)})" in benchmarks, arm


def test_a_census_that_does_not_enter_the_plan_differs_from_the_record(monkeypatch):
    """The regression the census once had, planted: the update's GPU paths not taken on its CPU (update.on_gpu
    false), so no replay kind is entered and every layer replays whole. The 1-layer update it counts then differs from
    the committed record's (what test_a_fresh_census_gives_the_committed_figures compares)."""
    import update

    committed = kernels_by_kind(json.loads(COMMITTED.read_text())["raw"])
    args = census.trainer_args("a")
    args.census_model = "qwen2.5-3b"
    real = common.real_config("qwen2.5-3b")
    real.vocab_size = 49152
    mapping = census.width_map(real, census.Narrow(), 64, 200, 512, 16, 64, 1024)
    monkeypatch.setattr(update, "on_gpu", lambda device: False)
    planted = sum(row[-1] for row in census.update_run(args, 1, census.Narrow(), mapping, 16, "plain")["ops"])
    assert planted == committed["checkpointed"]["1"] != committed["plain"]["1"]


def one_update_syncs(flags):
    """(host syncs, optimizer steps) of one update of a 1-layer narrow model (4 rows, micro-batches of 2) with
    train.py's `flags` over preset (a)'s, as `python -m bench census FLAGS` counts them."""
    args = census.trainer_args("a", ["--micro-batch-size", "2", *flags])
    args.census_model = "qwen2.5-3b"
    real = common.real_config("qwen2.5-3b")
    real.vocab_size = 49152
    mapping = census.width_map(real, census.Narrow(), 64, 40, 64, 4, 64, 1024)
    run = census.update_run(args, 1, census.Narrow(), mapping, 4)
    return sum(count for *_, count in run["syncs"]), run["optimizer_steps"]


@pytest.mark.parametrize("flags", [
    [], ["--top-entropy-quantile", "0.2"], ["--importance-sampling-level", "sequence", "--updates-per-batch", "2"],
    ["--policy-loss", "cispo", "--clip-eps", "1", "--clip-eps-high", "4", "--loss-aggregation", "token"],
    ["--importance-sampling-correction", "token_reject", "--loss-aggregation", "token"],
    ["--importance-sampling-correction", "tis"], ["--importance-sampling-correction", "token_mask"]],
    ids=lambda flags: " ".join(flags) or "paper")
def test_every_loss_option_reads_the_device_once_per_optimizer_step(flags):
    syncs, steps = one_update_syncs(flags)
    assert steps == (2 if "--updates-per-batch" in flags else 1) and syncs == steps


def test_the_command_passes_train_flags_to_the_census(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(census, "census_of", lambda preset, flags, **options: seen.update(flags=flags) or
                        {key: 0 for key in census.HEADLINES})
    cli.main(["census", "--json", "--top-entropy-quantile", "0.2", "--micro-batch-size", "4", "--host-repeats", "0",
              "--out", "/dev/null"])
    assert seen["flags"] == ["--top-entropy-quantile", "0.2", "--micro-batch-size", "4"]
    assert json.loads(capsys.readouterr().out)["update_kernels"] == 0


@pytest.mark.parametrize("path", sorted((ROOT / "results" / "census").glob("*.json")), ids=lambda p: p.name)
def test_bench_show_recomputes_the_committed_census(path, capsys):
    saved = json.loads(path.read_text())
    shown = cli.main(["show", str(path)])[str(path)]
    for key in census.HEADLINES:
        assert shown[key] == saved.get(key, shown[key]), key   # (a census of an older version has fewer)
    assert "update_phases" in capsys.readouterr().out


def test_the_gpu_check_times_every_change_on_cpu_and_bench_show_reads_it(tmp_path, capsys):
    """`python -m bench update --tiny` (the GPU check's smoke run): a row with every change off, one per change
    switched on, the first and last profiled; its JSON as `python -m bench show` prints it."""
    from bench import update_speed

    saved = cli.main(["update", "--tiny", "--device", "cpu", "--repeats", "1", "--out-dir", str(tmp_path)])
    rows = saved["rows"]
    assert [row["change"] for row in rows] == ["every change off"] + [f"+ {name}" for name in update_speed.CHANGES]
    assert all(row["update_s"] > 0 and row["speedup"] > 0 for row in rows) and rows[0]["speedup"] == 1.0
    assert rows[0]["kernels"] > 0 and rows[-1]["kernels"] > 0 and "kernels" not in rows[1]
    printed = capsys.readouterr().out
    shown = cli.main(["show", str(tmp_path / "bench_update.json")])[str(tmp_path / "bench_update.json")]
    assert shown["rows"] == json.loads(json.dumps(rows)) and "+ fused kernels" in printed
