"""Pipeline stages: the cut keeps the model, the in-flight counts are torch's schedules', and each
rank's predicted peak is what a real 2-rank pipeline measures (torchrun, gloo, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining.schedules import _get_warmup_ops
from torchrun import torchrun

from remat import models
from remat.errors import InfeasibleBudget, RematError
from remat.layouts import pipeline as pp

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline.py"


def tiny(name: str, layers: int, device: str = "meta", batch: int = 2, seq: int = 32):
    torch.manual_seed(0)
    overrides = {"n_layers": layers} if name.startswith("llama") else {"n_layer": layers}
    return models.build(name, batch=batch, seq=seq, device=device, tiny=True, **overrides)


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_single_stage_schedules_hold_what_their_loops_hold(stages, microbatches):
    # GPipe runs every forward first; 1F1B's warmup runs min(n, p - i) forwards before its first
    # backward (Schedule1F1B._step_microbatches), and its order says the same
    assert pp.in_flight("gpipe", stages, microbatches) == (microbatches,) * stages
    assert pp.in_flight("1f1b", stages, microbatches) == tuple(
        min(microbatches, stages - i) for i in range(stages)
    )


@pytest.mark.parametrize("ranks, local, microbatches", [(2, 2, 4), (4, 2, 8), (4, 2, 12)])
def test_interleaved_ranks_hold_torchs_warmup_plus_one(ranks, local, microbatches):
    """Each rank of ScheduleInterleaved1F1B runs its warmup forwards, then one more forward
    before its first backward: the most chunks it holds at once, summed over its stages."""
    order = pp.pipeline_order("interleaved-1f1b", ranks * local, microbatches, ranks)
    per_round = microbatches // max(1, microbatches // ranks)
    for rank, actions in order.items():
        now = most = 0
        for a in actions:
            assert a.stage % ranks == rank
            now += 1 if a.kind == "F" else -1
            most = max(most, now)
        warmup = _get_warmup_ops(rank, local, per_round, ranks, microbatches)
        assert most == min(warmup + 1, local * microbatches)
    assert max(pp.in_flight("interleaved-1f1b", ranks * local, microbatches, ranks)) <= (
        microbatches
    )


def test_unknown_schedule_and_misplaced_stages_are_refused():
    with pytest.raises(RematError, match="unknown pipeline schedule"):
        pp.in_flight("zb", 2, 4)
    with pytest.raises(RematError, match="per rank"):
        pp.in_flight("1f1b", 4, 4, ranks=2)
    with pytest.raises(RematError, match="greater than"):  # torch's: 1F1B needs n >= p
        pp.in_flight("1f1b", 4, 2)


@pytest.mark.parametrize("name", ["llama-2-7b", "gpt2"])
def test_split_keeps_every_parameter_once_under_the_models_names(name):
    model, _ = tiny(name, layers=5)
    stages = pp.split(model, 3)
    assert [list(s.layer_indices) for s in stages] == [[0, 1], [2, 3], [4]]  # first ones get more
    whole = dict(model.named_parameters(remove_duplicate=False))
    seen: dict[str, int] = {}
    for stage in stages:
        for n, p in stage.named_parameters(remove_duplicate=False):
            assert whole[n] is p
            seen[n] = seen.get(n, 0) + 1
    assert set(seen) == set(whole)
    assert all(count == 1 for count in seen.values())


@pytest.mark.parametrize("name", ["llama-2-7b", "gpt2"])
def test_stage_chain_computes_the_whole_models_loss(name):
    model, (ids, labels) = tiny(name, layers=3, device="cpu")
    x = ids
    stages = pp.split(model, 3)
    for stage in stages:
        x = stage(x)
    assert torch.equal(stages[-1].loss_fn(x, labels), model(ids, labels))


def test_first_stage_holds_the_most_and_is_planned_to_recompute_more():
    def build(batch, seq):
        return tiny("llama-2-7b", layers=4, batch=batch, seq=seq)

    report = pp.predict(build, 8, 64, stages=2, microbatches=4, schedule="1f1b")
    first, last = report.stages
    assert (first.in_flight, last.in_flight) == (2, 1)
    assert report.tightest_rank == 0 and report.tightest_stages == (0,)
    assert "stage 0 on rank 0" in repr(report)
    # a budget between the two ranks' store-all peaks: only the first stage recomputes
    budget = (first.peak_bytes + last.peak_bytes) // 2
    planned = pp.plan(build, 8, 64, budget, stages=2, microbatches=4, schedule="1f1b")
    assert planned.stages[0].plan.recompute_seconds > 0
    assert planned.stages[1].plan.recompute_seconds == 0
    assert planned.peak_bytes <= budget
    with pytest.raises(InfeasibleBudget, match="rank 0 \\(stage 0"):
        pp.plan(build, 8, 64, 1000, stages=2, microbatches=4, schedule="1f1b")


def test_a_rank_of_two_interleaved_stages_gets_the_cheapest_pair_of_plans_that_fits():
    """Interleaved 1F1B runs two stages a rank: they are planned together, the pair of plans of
    least summed recompute whose rank peak fits; no single fixed strategy on every stage that
    fits recomputes less, and brute force over every pair of candidates finds none cheaper."""
    from remat.planning import strategies

    def build(batch, seq):
        return tiny("llama-2-7b", layers=8, batch=batch, seq=seq)

    shape = {"stages": 4, "microbatches": 4, "schedule": "interleaved-1f1b", "ranks": 2}
    traced = pp.TracedPipeline.of(build, 8, 64, **shape)
    store_all = traced.report()
    full = {
        t.stage.index: (p := traced.planner(t.stage.index)).solve(
            strategies.get("full"), p.estimate.peak_bytes
        )
        for t in traced.traced
    }
    budget = (store_all.peak_bytes + traced.report(full).peak_bytes) // 2
    planned = traced.plan(budget)
    assert planned.peak_bytes <= budget < store_all.peak_bytes
    cost = {r: sum(s.plan.recompute_seconds for s in planned.stages if s.rank == r) for r in (0, 1)}
    for name in ("full", "selective:torchtitan", "selective:megatron"):
        fixed = {
            t.stage.index: (p := traced.planner(t.stage.index)).solve(
                strategies.get(name), p.estimate.peak_bytes
            )
            for t in traced.traced
        }
        report = traced.report(fixed)
        for r in (0, 1):
            if report.rank_peak_bytes[r] <= budget:
                mine = sum(p.recompute_seconds for i, p in fixed.items() if i % 2 == r)
                assert cost[r] <= mine + 1e-12, (name, r)
    # brute force over every pair of the two stages' candidates
    for r in (0, 1):
        a, b = ([*(f := traced.planner(i).pareto()).points, *f.named] for i in (r, r + 2))
        fitting = [
            p.recompute_seconds + q.recompute_seconds
            for p in a
            for q in b
            if traced.rank_peak(r, {r: traced.step(r, p), r + 2: traced.step(r + 2, q)}) <= budget
        ]
        assert cost[r] == pytest.approx(min(fitting), abs=1e-12)
    with pytest.raises(InfeasibleBudget, match=r"rank 0 \(stage 0 \(\d in flight\), 2"):
        traced.plan(1000)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "args",
    [  # 1F1B with AdamW and only the first stage recomputing, GPipe, interleaved 1F1B
        ["--schedule", "1f1b", "--budget", "6.4MiB", "--optimizer", "adamw"],
        ["--schedule", "gpipe"],
        ["--schedule", "interleaved-1f1b"],
        # transformers' LlamaForCausalLM cut by its own pipeline plan (HFStage)
        pytest.param(["--schedule", "1f1b", "--model", "hf"], marks=pytest.mark.slow),
        # a model of one's own, cut by torch's pipeline frontend, remat's plan applied per stage
        pytest.param(
            ["--schedule", "1f1b", "--model", "own", "--budget", "4MiB"], marks=pytest.mark.slow
        ),
        pytest.param(
            ["--schedule", "gpipe", "--model", "hf", "--optimizer", "adamw"], marks=pytest.mark.slow
        ),  # fmt: skip
    ],
    ids=" ".join,
)
def test_each_ranks_peak_and_gradients_match_a_real_pipeline(args):
    torchrun(EXAMPLE, *args, timeout=180)


@pytest.mark.parametrize("schedule, stages", [("1f1b", 2), ("gpipe", 2), ("interleaved-1f1b", 4)])
def test_each_ranks_allocation_events_request_what_its_walk_counts(schedule, stages):
    """`rank_events` (the walk as the blocks a rank allocates and frees, for the caching
    allocator) requests at its peak exactly the walk's peak, with and without plans, optimizer
    and FSDP sharding: two accounts of one step that must agree to the byte."""
    from remat.device.allocator import simulate
    from remat.planning import strategies

    def build(batch, seq):
        return tiny("llama-2-7b", layers=2 * stages, batch=batch, seq=seq)

    traced = pp.TracedPipeline.of(
        build, 8, 64, stages=stages, microbatches=4, schedule=schedule, ranks=2
    )
    selective = {
        t.stage.index: (p := traced.planner(t.stage.index)).solve(
            strategies.get("selective:torchtitan"), p.estimate.peak_bytes
        )
        for t in traced.traced
    }
    for plans, optimizer, sharding in [
        ({}, None, pp.UNSHARDED),
        (selective, "adamw", pp.UNSHARDED),
        (selective, "adamw", pp.Sharding(2, 2)),
    ]:
        walk = traced.report(plans, optimizer, sharding).rank_peak_bytes
        for rank in (0, 1):
            events = pp.rank_events(traced, rank, plans, optimizer, sharding)
            assert simulate(events).requested_bytes == walk[rank], (rank, optimizer, sharding)


def test_largest_microbatch_fits_and_the_next_one_does_not():
    def build(batch, seq):
        return tiny("llama-2-7b", layers=2, batch=batch, seq=seq)

    shape = {"stages": 2, "microbatches": 4, "schedule": "1f1b"}
    budget = pp.predict(build, 4 * 5, 16, **shape).peak_bytes  # exactly 5 fits
    found = pp.largest_microbatch(build, 16, budget, **shape)
    assert found.microbatch_size == 5 and found.peak_bytes <= budget
    assert pp.predict(build, 4 * 6, 16, **shape).peak_bytes > budget
    assert pp.largest_microbatch(build, 16, 1000, **shape) is None


def test_middle_stages_traced_alike_predict_as_stages_traced_apart():
    """`reuse_alike` traces middle stages of as many blocks once: every rank's peak is as when
    each stage is traced on its own blocks."""
    from remat.layouts.pipeline import TracedPipeline

    def build(batch, seq):
        return models.build("llama-2-7b", batch=batch, seq=seq, tiny=True, n_layers=8)

    apart, alike = (
        TracedPipeline.of(build, 4, 32, stages=4, microbatches=4, reuse_alike=reuse)
        for reuse in (False, True)
    )
    assert alike.traced[2].graph is alike.traced[1].graph
    assert alike.report(optimizer="adamw").rank_peak_bytes == (
        apart.report(optimizer="adamw").rank_peak_bytes
    )


@pytest.mark.parametrize("name", ["hf:meta-llama/Llama-3.2-1B", "hf:google/gemma-2-9b"])
def test_hugging_face_stages_chain_to_the_whole_models_loss(name):
    """A transformers model cut by its own pipeline plan (`HFStage`): the stages, run one after
    another, give the whole model's loss, each holding only its own parameters. Gemma 2 alternates
    sliding-window and full attention by `config.layer_types[i]` of the stage's own loop index: a
    stage starting at an odd layer (stage 2 of 3: layer 3) must still slide where layer 3 does."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, (ids, labels) = models.build(
        name, batch=2, seq=32, device="cpu", tiny=True, num_hidden_layers=4,
        **({"sliding_window": 8} if "gemma" in name else {}),
    )  # fmt: skip
    whole = model(ids, labels)
    stages = pp.split(model, 3)
    assert [list(s.layer_indices) for s in stages] == [[0, 1], [2], [3]]
    x = ids
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(stages[-1].loss_fn(x, labels), whole)
    owned = [{id(p) for p in s.parameters()} for s in stages]
    assert not (owned[0] & owned[1]) and not (owned[1] & owned[2])
    assert sum(map(len, owned)) == len({id(p) for p in model.parameters()}) + (
        model.model.config.tie_word_embeddings  # the tied head: on the first and last stage
    )


class Own(torch.nn.Module):
    """A model of one's own: embedding, a stack of residual MLP blocks, head."""

    def __init__(self, n: int = 4, d: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, d)
        self.blocks = torch.nn.Sequential(
            *(torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(),
                                  torch.nn.Linear(2 * d, d)) for _ in range(n))
        )  # fmt: skip
        self.head = torch.nn.Linear(d, 100)

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))


def test_a_model_of_ones_own_is_cut_at_its_block_stack_by_torchs_frontend():
    """No zoo layout, no transformers plan: `split` finds the numbered blocks (as the planner
    finds blocks), cuts the exported forward before the blocks that begin stages, and the
    stages chain to the model's output with each block on one stage; a model without repeated
    blocks is refused by name. Before issue 39: 'cannot cut a Own into pipeline stages'."""
    from remat.layouts.pipeline_exported import block_stack

    torch.manual_seed(0)
    model, ids = Own(), torch.randint(0, 100, (2, 8))
    assert block_stack(model) == "blocks"
    stages = pp.split(model, 3, ids)
    assert [list(s.layer_indices) for s in stages] == [[0, 1], [2], [3]]
    x = ids
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, model(ids))
    owned = [{id(p) for p in s.parameters()} for s in stages]
    assert sum(map(len, owned)) == len({id(p) for p in model.parameters()})
    labels = torch.randint(0, 100, (2, 8))
    expected = torch.nn.functional.cross_entropy(x.flatten(0, 1).float(), labels.flatten())
    torch.testing.assert_close(stages[-1].loss_fn(x, labels), expected)
    with pytest.raises(RematError, match=r"cannot cut a Linear \(torch.*no repeated blocks"):
        pp.split(torch.nn.Linear(4, 4), 2, torch.randn(2, 4))


class OwnWithPositions(Own):
    """`Own` with learned positions made on the ids' device, as most models of one's own do."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.nn.Embedding(64, 32)

    def forward(self, ids):
        where = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.blocks(self.embed(ids) + self.positions(where)))


def _built_on(device: str):
    def build(batch: int, seq: int):
        torch.manual_seed(0)
        with torch.device(device):
            model = OwnWithPositions()
        ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
        return model, (ids, ids)

    return build


def test_a_model_of_ones_own_cut_on_meta_traces_where_it_asks_for_its_inputs_device():
    # export wrote `device=meta` into the graph (the arange), and the stages' fake CPU trace
    # met a meta tensor in the positions' backward: FakeTensorDeviceMismatchError
    from remat.layouts.pipeline_traced import TracedPipeline

    on_meta, on_cpu = (
        TracedPipeline.of(_built_on(device), 4, 16, stages=2, microbatches=2)
        for device in ("meta", "cpu")
    )
    meta, cpu = on_meta.report(), on_cpu.report()
    assert [s.held_bytes_per_microbatch for s in meta.stages] == [
        s.held_bytes_per_microbatch for s in cpu.stages
    ]
    assert meta.rank_peak_bytes == cpu.rank_peak_bytes


def test_a_model_that_hands_its_stages_more_than_one_tensor_is_refused_by_name():
    class WithMask(Own):  # a mask made once and given to every block, as GPT-2's is
        def forward(self, ids):
            h, mask = self.embed(ids), (ids > 0).unsqueeze(-1).float()
            for block in self.blocks:
                h = h + block(h) * mask
            return self.head(h)

    with pytest.raises(RematError, match="stage 1 takes 2 tensors"):
        pp.split(WithMask(), 2, torch.randint(0, 100, (2, 8)))


def test_an_hf_model_type_built_without_labels_is_cut_with_its_ids_as_labels():
    # `remat fit --model hf:llama --pp 2` stopped in a ValueError traceback: hf:<model_type>
    # builds with the token ids alone (its one-process step sums the logits)
    from remat.layouts.pipeline_traced import TracedPipeline

    def build(batch: int, seq: int):
        return models.build("hf:llama", device="meta", tiny=True, batch=batch, seq=seq)

    report = TracedPipeline.of(build, 4, 32, stages=2, microbatches=2).report()
    assert [s.layers for s in report.stages] == [range(0, 1), range(1, 2)]

    def pixels_alone(batch: int, seq: int):
        return Own(), (torch.randn(batch, seq),)

    with pytest.raises(RematError, match="no labels: a pipeline's last stage needs labels"):
        TracedPipeline.of(pixels_alone, 4, 8, stages=2, microbatches=2)
