"""A tiny Llama pipelined over 2 ranks with torch.distributed.pipelining, on CPU with gloo: each
rank's measured peak against remat's prediction for its stages, and the gradients against the
single-process run.

    torchrun --nproc_per_node=2 examples/pipeline.py --schedule 1f1b
    torchrun --nproc_per_node=2 examples/pipeline.py --schedule gpipe --budget 8MiB
    torchrun --nproc_per_node=2 examples/pipeline.py --schedule interleaved-1f1b
    torchrun --nproc_per_node=2 examples/pipeline.py --schedule 1f1b --optimizer adamw
    torchrun --nproc_per_node=2 examples/pipeline.py --schedule 1f1b --model hf
    torchrun --nproc_per_node=2 examples/pipeline.py --schedule 1f1b --model own

`--model own`: a model of one's own (`Net`: embedding, 4 pre-norm MLP blocks, head), cut at its
block stack by torch's pipeline frontend (`remat.layouts.pipeline_exported.ExportedStage`).
`--model hf`: a Hugging Face `LlamaForCausalLM` (Llama 3.2 1B's config, tiny, head untied so that
each stage's gradients compare alone) cut by its own pipeline plan
(`remat.layouts.pipeline_hf.HFStage`), its loss the model's own.

The model is cut by `remat.layouts.pipeline.split` (2 stages, or 4 interleaved: stages r and r + 2 on
rank r); each rank runs its stages in `PipelineStage`s under torch's schedule, 4 micro-batches.
The prediction comes from the same architecture built on the meta device
(`remat.layouts.pipeline.predict`, or `plan` under `--budget`, whose plan for this rank's stage is applied
before the run). One step warms up (it allocates `PipelineStage`'s receive buffers and the
optimizer's state), then the least of the next three is measured with the profiler's CPU memory events
(`remat.measuring.measure.cpu_peak_bytes`) above what is live before it: the stages' parameters and
buffers, the receive buffers, the optimizer's state and the rank's part of the batch. The
gradients, averaged over the micro-batches as the schedule scales them, must equal those of the
whole model on the whole batch, and the in-flight micro-batches those predicted.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

import remat
from remat import models
from remat.layouts import pipeline as pp
from remat.measuring.measure import cpu_peak_bytes

BATCH, SEQ, MICROBATCHES = 8, 128, 4
# lr 0: the optimizers keep and allocate what they do in training, and leave the weights as they are
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.0),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.0, momentum=0.9),
}


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    """A model of one's own: no stage code, no pipeline plan; its loss is cross-entropy on fp32
    logits, the one `ExportedStage.loss_fn` takes for a model without a `loss_fn`."""

    def __init__(self, vocab: int = 512, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(batch: int, seq: int, device: str = "meta"):
    torch.manual_seed(0)
    if MODEL == "own":
        with torch.device(device):
            model = Net()
        return model, (torch.zeros(batch, seq, dtype=torch.long, device=device),) * 2
    if MODEL == "hf":
        return models.build(
            "hf:meta-llama/Llama-3.2-1B", batch=batch, seq=seq, device=device, tiny=True,
            dtype=torch.float32, num_hidden_layers=4, tie_word_embeddings=False,
        )  # fmt: skip
    return models.build("llama-2-7b", batch=batch, seq=seq, device=device, tiny=True, n_layers=4)


MODEL = "llama"


def full_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, 512, (BATCH, SEQ), generator=g) for _ in range(2))


def reference_grads() -> list[torch.Tensor]:
    """The whole model on the whole batch, in one process: the mean loss's gradients, in the
    order of its parameters."""
    model, _ = build(BATCH, SEQ, device="cpu")
    model(*full_batch()).backward()
    return [p.grad for p in model.parameters()]


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=list(pp.SCHEDULES), required=True)
    parser.add_argument("--budget", help="plan each stage to fit this per-rank budget")
    parser.add_argument("--optimizer", choices=["adamw", "sgd-momentum"], help="step it too")
    parser.add_argument("--model", choices=["llama", "hf", "own"], default="llama")
    args = parser.parse_args()
    global MODEL
    MODEL = args.model
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    interleaved = args.schedule == "interleaved-1f1b"
    n_stages = 2 * world if interleaved else world  # interleaved: stages r and r + world on rank r

    shape = {
        "stages": n_stages,
        "microbatches": MICROBATCHES,
        "schedule": args.schedule,
        "optimizer": args.optimizer,
    }
    if args.budget:
        report = pp.plan(build, BATCH, SEQ, args.budget, **shape)
    else:
        report = pp.predict(build, BATCH, SEQ, ranks=world, **shape)
    mine = [s for s in report.stages if s.rank == rank]

    model, _ = build(BATCH, SEQ, device="cpu")
    position = {id(p): i for i, p in enumerate(model.parameters())}
    microbatch = full_batch()[0][: BATCH // MICROBATCHES]  # for torch's frontend (--model own)
    stages = [pp.split(model, n_stages, microbatch)[s.stage] for s in mine]
    del model  # the other stages' parameters
    for stage, predicted in zip(stages, mine, strict=True):
        if predicted.plan is not None:
            remat.apply(stage, predicted.plan)
    cpu = torch.device("cpu")
    pipes = [PipelineStage(stage, stage.index, n_stages, cpu) for stage in stages]
    schedule = pp.SCHEDULES[args.schedule](
        pipes if interleaved else pipes[0], MICROBATCHES, loss_fn=stages[0].loss_fn
    )

    ids, labels = full_batch()
    inputs = (ids,) if stages[0].is_first else ()
    target = {"target": labels} if stages[-1].is_last else {}
    in_flight = {stage.index: 0 for stage in stages}
    for pipe in pipes:

        def counted(*a, pipe=pipe, forward=pipe.forward_one_chunk, **kw):
            out = forward(*a, **kw)
            in_flight[pipe.stage_index] = max(in_flight[pipe.stage_index], len(pipe.fwd_cache))
            return out

        pipe.forward_one_chunk = counted

    params = [p for stage in stages for p in stage.parameters()]
    optimizer = OPTIMIZERS[args.optimizer](params) if args.optimizer else None

    def step() -> None:
        schedule.step(*inputs, **target, return_outputs=False)
        if optimizer is not None:
            optimizer.step()

    step()  # builds PipelineStage's buffers

    def measured_step() -> int:
        for pipe in pipes:
            pipe.clear_runtime_states()  # the receive buffers' gradients, as the step begins with
        for p in params:
            p.grad = None
        return cpu_peak_bytes(step)

    # the least of three steps: gloo's worker thread may free a received tensor late
    peak = min(measured_step() for _ in range(3))
    buffers = [
        info.buffer
        for pipe in pipes
        for infos in (*pipe.args_recv_info.values(), *pipe.grad_recv_info.values())
        for info in infos
        if getattr(info, "buffer", None) is not None
    ]
    buffers += [b for stage in stages for b in stage.buffers()]
    state = [t for s in (optimizer.state.values() if optimizer else ()) for t in s.values()]
    state = [t for t in state if isinstance(t, torch.Tensor)]
    measured = distinct_bytes([*params, *buffers, *inputs, *target.values(), *state]) + peak
    predicted = report.rank_peak_bytes[rank]
    fixed = sum(s.fixed_bytes for s in mine)

    expected = reference_grads()
    worst = max(
        (p.grad - expected[position[id(p)]]).abs().max().item()
        for stage in stages
        for p in stage.parameters()
    )
    error = (predicted - measured) / measured
    plans = ", ".join(s.plan.strategy if s.plan else "none" for s in mine)
    flights = ", ".join(f"{in_flight[s.stage]} (predicted {s.in_flight})" for s in mine)
    line = (
        f"rank {rank} (stages {', '.join(str(s.stage) for s in mine)}, in flight {flights}, plan "
        f"{plans}): predicted {predicted} B, measured {measured} B ({error:+.2%}), of which in "
        f"the step {predicted - fixed} B predicted, {peak} B measured; "
        f"max |grad - single-process grad| = {worst:.1e}"
    )
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print(f"{args.schedule}, {MICROBATCHES} micro-batches of {BATCH // MICROBATCHES}:")
        print("\n".join(lines))
    assert all(in_flight[s.stage] == s.in_flight for s in mine), in_flight
    assert worst < 1e-5, worst
    assert abs(error) < 0.02, error
    dist.barrier()
    if rank == 0:
        print("OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from distributed import exit_before_interpreter_teardown

    main()
    exit_before_interpreter_teardown()
