"""bench/census.py: what it counts equals a hand count (host syncs and kernels of a small function; the operations of
one decoder layer of a 1-layer and a 2-layer model); narrow widths map onto the real ones exactly (two different sets
of narrow widths give the same real bytes and FLOPs); a figure of L layers follows from 1 and 2 layers; the command
prints one JSON object with its headline figures; `python -m bench show` recomputes the committed census figures."""

import collections
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import bench.__main__ as cli
import grpo_loss
import models
from bench import census, common

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
        moved = host.to(CPU)                     # a host-to-device copy, blocking: a sync
        host.to(CPU, non_blocking=True)          # not blocking: no sync
        moved + 1                                # a kernel (the copy is on the device)
        x.cpu()                                  # a device-to-host copy: a sync
        x.tolist()                               # a sync
        torch.arange(3, device=weight.device)    # a factory given the device: a kernel
        x[x > 0]                                 # gt, index (kernels) and a sync (boolean index)
        torch.unique(x)                          # a kernel and a sync

    recorder = counted(work, weight)
    assert kernels(recorder) == {"mul": 1, "sum": 1, "add": 1, "arange": 1, "gt": 1, "index": 1, "_unique2": 1}
    assert dict(recorder.syncs) == {("other", "item"): 1, ("other", "host-to-device copy"): 1,
                                    ("other", "device-to-host copy"): 2, ("other", "boolean index"): 1,
                                    ("other", "unique"): 1}


def forward_ops(layers):
    model = models.tiny_random_model("qwen2", vocab_size=97, num_hidden_layers=layers, hidden_size=64,
                                     intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return kernels(counted(lambda: grpo_loss.token_logprobs(model, ids.to(CPU), torch.ones_like(ids).to(CPU), 4),
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


def test_the_command_prints_its_headline_figures_as_one_json_object(tmp_path, capsys):
    out = tmp_path / "census.json"
    saved = cli.main(["census", "--json", "--rows", "4", "--prompt-tokens", "40", "--completion-tokens", "64",
                      "--micro-batch-size", "2", "--out", str(out)])
    printed = json.loads(capsys.readouterr().out)
    for key in ("update_kernels", "update_host_syncs", "update_roofline_s", "decode_kernels_per_step",
                "decode_kernels_per_layer"):
        assert printed[key] == saved[key]
    assert set(printed["update_roofline_s"]) == set(census.CARDS) and printed["update_kernels"] > 1000
    assert 0 < 36 * printed["decode_kernels_per_layer"] < printed["decode_kernels_per_step"]
    assert json.loads(out.read_text())["update_kernels"] == saved["update_kernels"]


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
