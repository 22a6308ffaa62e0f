"""A fit's rows over worker processes: each strategy's searches for its largest batch and sequence
are independent of the other strategies' but for where they start (`fit_row`'s `earlier`: a row
whose peak at the asked size is within 1% of an earlier one's starts at that one's answers), so
the rows split into groups of such rows, and the groups run in forked processes, one per core.

A row's answer is what the serial fit gives: the same asked-size judgement, the same row to start
from (earlier, in the same process), the same probes. Only the caches are not shared
(a trace one process makes, the other makes again where it needs it). Forked (Linux): the
children start with everything traced so far, and no pickling of the model. Elsewhere, with one
core, or with `workers=1` (`REMAT_WORKERS=1`), the rows run one after another in this process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from remat.answers.fit_rows import (
    SEQ_STEP,
    FitRow,
    fits_on,
    judge_step,
    nearest_row,
    searched_row,
    seq_anchors,
    some_size_fits,
)
from remat.answers.fit_steps import FitSteps
from remat.errors import RematError


def default_workers() -> int:
    """Processes a fit may use: `REMAT_WORKERS` if set, else the cores this process may run
    on, where processes can be forked (Linux); 1 elsewhere, and where nothing can be forked."""
    if "fork" not in multiprocessing.get_all_start_methods():  # Windows
        return 1
    given = os.environ.get("REMAT_WORKERS")
    if given is not None:
        try:
            workers = int(given)
        except ValueError:
            raise RematError(f"REMAT_WORKERS={given!r}: give a whole number of processes") from None
        if workers < 1:
            raise RematError(f"REMAT_WORKERS={given!r}: give 1 or more processes")
        return workers
    if not sys.platform.startswith("linux"):
        return 1
    return len(os.sched_getaffinity(0))


def row_groups(peaks: Sequence[int | None], judged_by_allocator: bool) -> list[list[int]]:
    """The rows (by index) that must run in one process, in order: each row with the earlier row
    its searches start from (`nearest_row`, where the allocator judges). Pure."""
    group_of = list(range(len(peaks)))

    def root(i: int) -> int:
        while group_of[i] != i:
            i = group_of[i]
        return i

    for i, peak in enumerate(peaks):
        near = nearest_row(peaks[:i], peak) if judged_by_allocator and peak else None
        if near is not None:
            group_of[root(i)] = root(near)
    groups: dict[int, list[int]] = {}
    for i in range(len(peaks)):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def share_out(groups: list[list[int]], weights: Sequence[int], workers: int) -> list[list[int]]:
    """The groups dealt to at most `workers` processes, the heaviest group first (by its rows'
    `weights`) to the lightest process (the first of equals), each process's rows in the fit's
    order. Pure."""
    shares: list[list[int]] = [[] for _ in range(min(workers, len(groups)))]
    load = [0] * len(shares)
    for group in sorted(groups, key=lambda g: sum(weights[i] for i in g), reverse=True):
        k = min(range(len(shares)), key=lambda k: (load[k], k))
        shares[k].extend(group)
        load[k] += sum(weights[i] for i in group)
    return [sorted(share) for share in shares if share]


class _Worker:
    """A forked process running `task(receive)`: `receive()` waits for the next message this
    process sends it with `send` (its share of the rows, then the deferred row or None)."""

    def __init__(self, task: Callable[[Callable[[], Any]], Any]) -> None:
        context = multiprocessing.get_context("fork")
        self._answer, answer = context.Pipe(duplex=False)
        later, self._later = context.Pipe(duplex=False)
        self.process = context.Process(target=_work, args=(task, later, answer), daemon=True)
        self.process.start()
        answer.close()
        later.close()

    def send(self, message: Any) -> None:
        with contextlib.suppress(BrokenPipeError):  # the worker has ended: `result` says how
            self._later.send(message)

    def result(self) -> Any:
        """What the task returned; its error raised here (a `RematError` as it was, another with
        the child's traceback)."""
        try:
            ok, value = self._answer.recv()
        except EOFError:
            self.process.join()
            raise RematError(
                f"a fit worker process ended without an answer (exit code "
                f"{self.process.exitcode}): run again with REMAT_WORKERS=1 to fit in one process"
            ) from None
        self.process.join()
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._answer.close()
        self._later.close()
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _work(task: Callable[[Callable[[], Any]], Any], later: Any, answer: Any) -> None:
    try:
        result: tuple[bool, Any] = (True, task(later.recv))
    except RematError as err:
        result = (False, err)
    except BaseException:  # the parent raises it with the child's traceback
        result = (False, RematError("a fit worker process failed:\n" + traceback.format_exc()))
    answer.send(result)
    answer.close()


def fit_rows(
    steps: FitSteps,
    names: Sequence[str],
    batch: int,
    seq: int,
    usable: int,
    max_batch: int,
    max_seq: int,
    workers: int = 1,
) -> tuple[list[FitRow], set[tuple[int, int]]]:
    """Every strategy's `fit_row`, in order, with the sizes traced for them (here and in the
    workers: `steps.traced` holds only this process's).

    Whether any size fits is the same for every row (what a rank holds at every size, against
    the limit): known from the first row judged, after which, where sizes are searched, the
    workers start and trace the sequence size model's anchors while the other rows are judged
    here. Then each worker gets its share of the groups of rows (`row_groups`, `share_out`).
    Auto's judgement runs its solvers (1.3 s at 70B; a fixed strategy's is one simulation): as
    the last row, it is judged after the shares are sent, and joins the process of the row it
    starts from (else this one)."""
    deferred = len(names) - 1 if workers > 1 and len(names) > 1 and names[-1] == "auto" else None
    fixed = [i for i in range(len(names)) if i != deferred]
    anchors = [u * SEQ_STEP for u in seq_anchors(seq)]
    judged: dict[int, Any] = {}

    def judge(i: int) -> Any:
        """Row i at the asked size, on the judging allocator setting alone (the row's process
        walks the others, `searched_row`)."""
        judged[i] = judge_step(steps, names[i], batch, seq, usable, judged_only=True)
        return judged[i]

    def rows_of(
        share: list[int], deferred_row: Callable[[], Any]
    ) -> tuple[dict[int, FitRow], set[tuple[int, int]]]:
        """The share's rows, in order, then the deferred one if it comes to this process."""
        rows: dict[int, FitRow] = {}

        def search(i: int) -> None:
            earlier = [rows[j] for j in sorted(rows)]
            rows[i] = searched_row(
                steps, names[i], judged[i], batch, seq, usable, max_batch, max_seq, earlier
            )

        for i in share:
            search(i)
        came = deferred_row()
        if came is not None:
            i, judged[i] = came
            search(i)
        return rows, set(steps.traced)

    def work(receive: Callable[[], Any]) -> tuple[dict[int, FitRow], set[tuple[int, int]]]:
        """A worker: the sequence size model while the rows are judged, then its share."""
        with contextlib.suppress(RematError):  # each row says why the model cannot be built
            steps.model_through("seq", batch, anchors)
        share, theirs = receive()
        judged.update(theirs)
        return rows_of(share, receive)

    searching = False
    for i in fixed:
        if judge(i) is not None:
            searching = some_size_fits(steps, judged[i], batch, seq)
            break
    progress = steps.progress
    started: list[_Worker] = []
    try:
        steps.progress = None  # the workers' searches go unannounced
        started = [_Worker(work) for _ in range(min(workers, len(fixed)) - 1 if searching else 0)]
        steps.progress = progress
        for i in fixed:
            if i not in judged:
                judge(i)
        peaks = [None if judged[i] is None else judged[i][0] for i in fixed]
        simulated = any(judged[i] is not None and judged[i][2] for i in fixed)
        # what a row's searches cost, roughly: none where no size fits; a row that fits at the
        # asked size searches both sizes upwards, and auto's plan is most often a fitting fixed
        # one's (auto then joins its process); one that does not, the sequence downwards
        weights = [
            0 if j is None or not searching else 1 + fits_on(j[0], j[2], j[3])
            for j in (judged[i] for i in fixed)
        ]
        shares = share_out(row_groups(peaks, simulated), weights, 1 + len(started))
        for worker in started[len(shares) - 1 :]:  # no share (the rows start from each other):
            worker.close()  # stopped now, not left tracing beside this process's rows
        started = started[: len(shares) - 1]
        for k, worker in enumerate(started, 1):
            worker.send((shares[k], {i: judged[i] for i in shares[k]}))
        if len(shares) > 1:  # this process's rows read it first
            with contextlib.suppress(RematError):
                steps.model_through("seq", batch, anchors)
        mine: Any = None
        if deferred is not None:
            j = judge(deferred)
            near = nearest_row(peaks, j[0]) if simulated and j is not None and j[0] else None
            home = 0 if near is None else next(k for k, s in enumerate(shares) if near in s)
            if len(shares) == 1:  # one process: in order, as ever
                shares[0].append(deferred)
            for k, worker in enumerate(started, 1):
                worker.send((deferred, j) if k == home else None)
            mine = (deferred, j) if home == 0 and len(shares) > 1 else None
        else:
            for worker in started:
                worker.send(None)
        found, traced = rows_of(shares[0], lambda: mine)
        for worker in started:
            rows, sizes = worker.result()
            found.update(rows)
            traced |= sizes
    finally:
        steps.progress = progress
        for worker in started:
            worker.close()
    return [found[i] for i in range(len(names))], traced
