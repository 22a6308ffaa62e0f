"""The command line: what a user types and what they get back, exit codes included."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import remat
from remat.answers.cli import main
from remat.units import format_bytes


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "remat", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


def test_estimate_json_has_the_documented_fields(capsys):
    assert main(["estimate", "--model", "gpt2", "--batch", "2", "--seq", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "activation_bytes",
        "peak_bytes",
        "param_bytes",
        "by_module",
        "per_block_activation_bytes",
    ):
        assert key in out
    assert out["param_bytes"] == 124_439_808 * 4
    assert {"module", "activation_bytes"} <= set(out["by_module"][0])
    blocks = [b["activation_bytes"] for b in out["per_block_activation_bytes"]]
    assert len(blocks) == 12 and len(set(blocks[1:-1])) == 1
    assert out["peak_bytes"] > out["activation_bytes"] + out["param_bytes"]


def test_estimate_table_names_the_totals_and_the_peak(capsys):
    assert main(["estimate", "--model", "llama-3.2-1b", "--tiny", "--optimizer", "adamw"]) == 0
    text = capsys.readouterr().out
    assert "activations (saved for backward)" in text
    assert "peak of the step" in text
    assert "optimizer state" in text


def test_unknown_model_exits_2_and_lists_the_presets():
    result = run("estimate", "--model", "gpt3")
    assert result.returncode == 2
    assert "gpt2" in result.stderr and "llama-3.1-70b" in result.stderr


def test_malformed_factory_exits_2_and_says_what_is_wrong():
    result = run("estimate", "--model", "no_such_module_xyz:make")
    assert result.returncode == 2
    assert "no_such_module_xyz" in result.stderr


def test_bad_override_exits_2_naming_the_field():
    result = run("estimate", "--model", "gpt2", "--set", "n_layers=2")
    assert result.returncode == 2
    assert "n_layers" in result.stderr and "n_layer" in result.stderr


def test_data_dependent_model_exits_2_and_suggests_a_cpu_trace(tmp_path, monkeypatch):
    (tmp_path / "ddmodel.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        h = self.fc(x); return h[h > 0].sum()\n"
        "def make(batch=2):\n"
        "    return M(), (torch.randn(batch, 4),)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    result = run("estimate", "--model", "ddmodel:make")
    assert result.returncode == 2
    assert "depends on tensor data" in result.stderr and "--trace-device cpu" in result.stderr
    assert run("estimate", "--model", "ddmodel:make", "--trace-device", "cpu").returncode == 0


@pytest.mark.slow
def test_demo_runs(tmp_path):
    """Every step of the demo, on its own architecture; REMAT_QUICK=1: half as wide and long
    (its memory pass, five profiled steps, was most of its time), 2 timing rounds, not 5, and the
    auto row tuned on 1 round of first steps."""
    result = run("demo", "--out", str(tmp_path / "demo"), env={**os.environ, "REMAT_QUICK": "1"})
    assert result.returncode == 0, result.stderr
    assert "peak of the step" in result.stdout
    assert "round 2/2" in result.stderr  # the progress lines on a pipe: quick's 2 rounds


def test_plan_json_has_the_documented_fields(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt2", "--batch", "8", "--seq", "1024", "--set", "n_layer=4"]
    assert main([*args, "--budget", "80%", "--json", "--out", str(out_file)]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "strategy",
        "budget_bytes",
        "predicted_peak_bytes",
        "held_bytes",
        "recompute_flops",
        "recompute_seconds",
        "saved",
    ):
        assert key in out
    assert out["predicted_peak_bytes"] <= out["budget_bytes"]
    # what --json prints is a plan too: the same as --out wrote, less its details
    printed, written = (
        remat.Plan.from_json(json.dumps(out)),
        remat.Plan.from_json(out_file.read_text()),
    )
    assert printed.regions == written.regions and printed.held_bytes == written.held_bytes
    assert printed.predicted_peak_bytes == written.predicted_peak_bytes
    assert {"name", "op", "bytes"} <= set(out["saved"][0])
    assert {row["strategy"] for row in out["comparison"]} >= {"store_all", "full", "sqrt", "milp"}
    from remat.planning.plans import Plan

    assert Plan.from_json(out_file.read_text()).predicted_peak_bytes == out["predicted_peak_bytes"]


def test_infeasible_budget_exits_3_with_the_smallest_feasible_budget():
    result = run("plan", "--model", "gpt2", "--tiny", "--budget", "1KiB")
    assert result.returncode == 3
    assert "smallest feasible budget" in result.stderr


def test_plan_plots_the_frontier(tmp_path):
    png = tmp_path / "pareto.png"
    result = run(
        "plan",
        "--model",
        "mlp-chain-8",
        "--batch",
        "4096",
        "--set",
        "d_model=64",
        "--budget",
        "85%",
        "--plot",
        str(png),
    )
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"


def _bench_rows(tmp_path, strategies: str, *extra: str) -> dict[str, dict]:
    """`remat bench` on tiny gpt2 (b2 s32, budget 1TiB, one step): its JSON rows by strategy."""
    out = tmp_path / "bench.json"
    result = run(
        "bench",
        "--model",
        "gpt2",
        "--tiny",
        "--batch",
        "2",
        "--seq",
        "32",
        "--budget",
        "1TiB",
        "--strategies",
        strategies,
        "--steps",
        "1",
        *extra,
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    return {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}


def test_bench_measures_each_strategy_and_writes_the_documented_rows(tmp_path):
    rows = _bench_rows(
        tmp_path, "full,selective:torchtitan,torch:checkpoint-per-block,hf:gradient_checkpointing"
    )
    assert set(rows) == {
        "store_all",
        "full",
        "selective:torchtitan",
        "torch:checkpoint-per-block",
        "hf:gradient_checkpointing",
    }
    for name in ("store_all", "full", "selective:torchtitan", "torch:checkpoint-per-block"):
        row = rows[name]
        for key in (
            "held_bytes",
            "peak_bytes",
            "predicted_peak_bytes",
            "step_seconds",
            "time_ratio",
            "grad_max_abs_diff",
        ):
            assert key in row
        assert row["grad_max_abs_diff"] == 0.0
    assert rows["full"]["peak_bytes"] == pytest.approx(
        rows["full"]["predicted_peak_bytes"], rel=0.05
    )
    assert rows["hf:gradient_checkpointing"]["note"] == "not a Hugging Face model"


def test_bench_compile_adds_torch_and_remat_partitioner_rows(tmp_path):
    rows = _bench_rows(tmp_path, "store_all", "--compile", "--compiler", "aot_eager")
    assert set(rows) == {
        "store_all",
        "torch.compile@1",
        "torch.compile@0.5",
        "torch.compile@0",
        "compile:mincut",
        "compile:milp",
        "compile:auto",
    }
    # torch's activation_memory_budget 0 saves only the inputs: less is retained than at 1.0
    assert rows["torch.compile@0"]["held_bytes"] < rows["torch.compile@1"]["held_bytes"]
    for name, row in rows.items():
        assert row["grad_max_abs_diff"] <= 1e-5, name
        if name != "store_all":
            assert row["peak_bytes"] == pytest.approx(row["predicted_peak_bytes"], rel=0.01)


def test_version_is_printed(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"remat {remat.__version__}"


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (1536, "1.5 KiB"),
        (999.4 * 2**20, "999 MiB"),
        (1010 * 2**20, "1010 MiB"),
        (1023.9 * 2**20, "1024 MiB"),
        (2**30, "1 GiB"),
        (12, "12 B"),
        (-3 * 2**20, "-3 MiB"),
    ],
)
def test_format_bytes_never_prints_exponents(nbytes, text):
    assert format_bytes(nbytes) == text


# -- every error path exits 2 (bad input) or 3 (infeasible) with the thing and the remedy --------
def test_a_factory_that_raises_exits_2_naming_its_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_models.py").write_text("def make():\n    raise KeyError('vocab')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["estimate", "--model", "broken_models:make"]) == 2
    err = capsys.readouterr().err
    assert "the factory raised KeyError" in err and "broken_models.py:2" in err


@pytest.mark.parametrize("trace_device", ["meta", "cpu"])
def test_a_forward_autograd_refuses_exits_2_in_one_line_without_a_fallback(
    tmp_path, monkeypatch, capsys, trace_device
):
    """Issue 33: an in-place op on a parameter failed on fake tensors with advice to trace on
    real ones (--trace-device cpu), which then exited 1 with a raw traceback. Real tensors raise
    it too: one line, exit 2, naming the module and the line, and no fallback advice."""
    (tmp_path / "inplace_models.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Scale(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = nn.Parameter(torch.ones(8))\n\n"
        "    def forward(self, x):\n"
        "        self.w.mul_(2)\n"
        "        return x * self.w\n\n"
        "def make():\n    return nn.Sequential(nn.Linear(8, 8), Scale()), (torch.randn(4, 8),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["plan", "--model", "inplace_models:make", "--trace-device", trace_device]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "module '1'" in err and "inplace_models.py:10 `self.w.mul_(2)`" in err
    assert "not trainable as written" in err and "torch.no_grad()" in err
    assert "--trace-device" not in err and "device='cpu'" not in err


def test_a_factory_from_the_current_folder_imports_and_titles_what_it_built(tmp_path, capsys):
    (tmp_path / "own_models.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def make():\n    return nn.Linear(16, 4), (torch.randn(8, 16),)\n"
    )
    script = Path(sys.executable).with_name("remat")  # the console script, as a user runs it
    done = subprocess.run(
        [str(script), "estimate", "--model", "own_models:make"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    assert "inputs (8, 16)" in done.stdout and "batch 4" not in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_cpu_only_torch_exits_2(capsys):
    args = ["bench", "--model", "mlp-chain-8", "--tiny", "--device", "cuda"]
    assert main(args) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--model", "gpt2", "--tiny", "--plot", "/nonexistent/dir/p.png"],
        ["plan", "--model", "gpt2", "--tiny", "--out", "/nonexistent/dir/plan.json"],
        ["bench", "--model", "gpt2", "--tiny", "--json", "/nonexistent/dir/b.json"],
    ],
)
def test_an_output_in_a_missing_folder_exits_2_before_any_work(args, capsys, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the output folder was checked")

    monkeypatch.setattr(remat.models, "build", no_model)
    assert main(args) == 2
    assert "/nonexistent/dir does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["bench", "--steps", "0"], "is not at least 1"),
        (["plan", "--strategy", "magic"], "strategy 'magic' is unknown"),
        (["plan", "--budget", "lots"], "lots"),
        (["plan", "--budget", "+ten%"], "time overhead"),
        (["plan", "--budget", "0"], "give a positive size"),  # not an infeasible budget (exit 3)
        (["plan", "--budget", "-5"], "cannot read '-5' as a size"),
        (["plan", "--budget", "0.5"], "did you mean 50%?"),
        (["plan", "--budget", "50"], "did you mean 50%?"),  # a share without its %, not 50 bytes
        (["plan", "--profile", "tpu-v9"], "tpu-v9"),
        (["fit", "--model", "gpt2", "--gpu", "h100"], "--seq 1024"),  # fit's default seq is 4096
        (["plan", "--model", "mlp-chain-8", "--tiny", "--strategy", "full", "--budget", "1%"], ""),
    ],
)
def test_bad_input_exits_2_and_says_what(args, says, capsys):
    with pytest.raises(SystemExit) if args[1] == "--steps" else contextlib.nullcontext() as stop:
        code = main(args)
    if stop is not None:
        assert stop.value.code == 2
    elif args[-1] == "1%":
        assert code == 3  # infeasible, not bad input
        return
    else:
        assert code == 2
    assert says in capsys.readouterr().err


def test_a_block_strategy_on_a_model_without_blocks_exits_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "flat_models.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Flat(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)\n\n"
        "    def forward(self, x):\n"
        "        return self.down(torch.relu(self.up(x)))\n\n"
        "def make():\n    return Flat(), (torch.randn(4, 8),)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "flat_models:make", "--strategy", "sqrt"]) == 2
    assert "no numbered submodules" in capsys.readouterr().err


def test_report_with_a_gpu_adds_the_fit_table(tmp_path, capsys):
    path = tmp_path / "report.html"
    args = ["report", "--model", "gpt2", "--tiny", "--optimizer", "adamw", "--html", str(path)]
    assert main([*args, "--capacity", "2GiB"]) == 0
    with_fit = path.read_text()
    assert main(args) == 0
    without = path.read_text()
    assert "max batch" in with_fit and "max batch" not in without


def test_report_fit_table_refuses_a_dtype_fit_does_not_have(tmp_path, capsys):
    path = tmp_path / "report.html"
    args = ["report", "--model", "gpt2", "--tiny", "--dtype", "fp16", "--gpu", "h100"]
    assert main([*args, "--html", str(path)]) == 2
    assert "--dtype fp32 or bf16" in capsys.readouterr().err and not path.exists()


def test_messages_keep_bracketed_text_the_terminal_library_would_read_as_markup(
    capsys, monkeypatch
):
    """`pip install 'remat[hf]'` lost its `[hf]` to rich's markup."""
    import remat.models.hf as hf

    def no_transformers(*args, **kwargs):
        raise remat.errors.UnknownModelError("hf:llama needs it: pip install 'remat[hf]'")

    monkeypatch.setattr(hf, "build", no_transformers)
    assert main(["estimate", "--model", "hf:llama", "--tiny"]) == 2
    assert "pip install 'remat[hf]'" in capsys.readouterr().err


def test_the_first_readme_command_installs_what_the_hugging_face_lines_need():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    first = next(line for line in readme.splitlines() if line.endswith("remat demo"))
    assert "'.[hf]'" in first


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--model", "gpt2", "--tiny"],
        ["estimate", "--model", "gpt2", "--tiny"],
        ["fit", "--model", "gpt2", "--tiny", "--seq", "64", "--gpu", "h100"],
    ],
)
def test_piped_output_honours_columns_and_cuts_no_name(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "…" not in out
    if argv[0] == "plan":
        assert "selective:save-matmuls" in out and "vs budget" in out


def test_estimate_and_fit_answer_for_one_rank_of_a_layout(capsys, tmp_path):
    """`estimate --tp 2` is one tensor-parallel rank's step (less than the whole step's);
    `fit --tp 2 --pp 2` answers per stage, with the layout in its JSON."""
    args = ["estimate", "--model", "llama-2-7b", "--tiny", "--seq", "64", "--json"]
    one, rank = [], []
    for tp, out in ((1, one), (2, rank)):
        assert main([*args, "--tp", str(tp)]) == 0
        out.append(json.loads(capsys.readouterr().out))
    assert rank[0]["activation_bytes"] < one[0]["activation_bytes"]
    assert rank[0]["param_count"] < one[0]["param_count"]  # this rank's shards
    fit_args = ["fit", "--model", "llama-2-7b", "--tiny", "--set", "n_layers=4", "--seq", "64"]
    layout = ["--tp", "2", "--pp", "2", "--microbatches", "4", "--json"]
    assert main([*fit_args, *layout]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["layout"] == "tp 2 + sp (torchtitan's plan of Llama), pp 2 (1f1b, 4 micro-batches)"
    )
    stages = report["extra"]["stages"]["auto"]
    assert [s["in flight"] for s in stages] == ["2", "1"]  # 1F1B: p - i
    page = tmp_path / "fit.html"
    assert main([*fit_args, *layout[:-1], "--html", str(page)]) == 0
    assert "per rank: tp 2 + sp (torchtitan&#x27;s plan of Llama), pp 2" in page.read_text()


@pytest.mark.slow
def test_a_hugging_face_model_answers_per_rank_and_per_stage_under_tp_and_pp(capsys):
    """`fit --model hf:... --tp 2 --pp 2` (issue 39's acceptance, tiny): laid out by
    transformers' own plan, cut by its pipeline plan, a row per stage; `--sp` is refused with
    what to do, as transformers' plan has none; `plan --tp 2` plans one rank."""
    pytest.importorskip("transformers")
    model = ["--model", "hf:meta-llama/Llama-3.2-1B", "--tiny", "--seq", "64"]
    layout = ["--tp", "2", "--pp", "2", "--precision", "bf16", "--optimizer", "adamw"]
    assert main(["fit", *model, *layout, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"].startswith("tp 2 (transformers' plan of LlamaForCausalLM: ")
    assert "rowwise o_proj, down_proj" in report["layout"]
    assert report["batch"] == 2 and report["extra"]["microbatch"] == 1
    stages = report["extra"]["stages"]["auto"]
    assert [(s["stage"], s["rank"], s["blocks"]) for s in stages] == [
        ("0", "0", "0..0"),
        ("1", "1", "1..1"),
    ]
    assert main(["fit", *model, *layout, "--sp"]) == 2
    assert "sequence parallelism is not in transformers' plan" in capsys.readouterr().err
    assert main(["plan", *model, "--tp", "2", "--budget", "70%"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "one rank of tp 2 (transformers' plan of LlamaForCausalLM" in said


def test_ctrl_c_ends_in_one_line_and_exit_130(monkeypatch, capsys):
    """A Ctrl-C in `fit` printed a 38-line traceback from wherever it landed."""
    import remat.answers.cli as cli

    def interrupted(args, console):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_fit", interrupted)
    assert main(["fit", "--model", "gpt2", "--seq", "1024", "--gpu", "h100"]) == 130
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["interrupted: remat fit stopped before it finished"]


def test_plan_says_how_to_apply_it_and_that_line_runs(capsys, tmp_path):
    """`remat plan` never said how to use its plan; the line it prints now applies it."""
    out_file = tmp_path / "plan.json"
    assert (
        main(["plan", "--model", "gpt2", "--tiny", "--budget", "70%", "--out", str(out_file)]) == 0
    )
    said = capsys.readouterr().out.splitlines()
    (line,) = [s.strip() for s in said if s.strip().startswith("remat.apply(")]
    assert line == f'remat.apply(model, remat.Plan.from_json(open("{out_file}").read()))'
    from remat import models

    model, inputs = models.build("gpt2", tiny=True)
    exec(line, {"remat": remat, "model": model})
    assert remat.installed_plan(model).regions == remat.Plan.from_json(out_file.read_text()).regions
