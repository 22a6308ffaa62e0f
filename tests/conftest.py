import logging
import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Test models are tiny: intra-op threads gain nothing, and on a small VM handing each op to the
    thread pool costs ~10 ms, which turns a millisecond step into a second. The commands tests run
    as subprocesses (the README's and docs' lines, torchrun) inherit OMP_NUM_THREADS=1: two pytest
    workers each running a two-thread `remat bench` on two cores spent most of a step waiting."""
    threads = torch.get_num_threads()
    omp = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = omp


@pytest.fixture(autouse=True)
def fits_in_one_process(monkeypatch):
    """`remat fit` searches its rows in one process per core (`remat.answers.fit_workers`); the
    suite already runs a pytest worker per core, so a fit's own workers would only compete with
    the other tests (and trace the size model's anchors twice). Fits here run in one process, as
    the commands they start do; tests/test_fit_workers.py asks for workers and checks that they
    answer as one process does."""
    monkeypatch.setenv("REMAT_WORKERS", "1")


@pytest.fixture(autouse=True)
def tuned_plans_kept_in_a_fresh_folder(tmp_path, monkeypatch):
    """`remat.applying.tune` keeps its results on disk: each test starts with none, and nothing is written
    to the user's ~/.cache."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "remat-cache"))


@pytest.fixture(autouse=True)
def checkpointing_overheads_pinned(monkeypatch):
    """`remat.auto` ranks plans with checkpointing's host cost measured on this machine, which
    a loaded CI runner measures differently each time: tests plan as if it were free (the shipped
    profiles' figure), so that their plans do not depend on the machine's load. Tests of the
    measurement set their own (`remat.applying.tune._OVERHEADS`); the same for the CPU's op rates
    (`_RATES`: None, the shipped profile's). Each test starts with no tuned
    plan kept in the process either (a test that trained past `remat.auto`'s first-steps tuning
    would hand its winner to the next test's `auto`)."""
    from remat.applying import tune

    monkeypatch.setattr(tune, "_OVERHEADS", {"cpu": (0.0, 0.0)})
    monkeypatch.setattr(tune, "_RATES", {tune.rates_key(): None})
    tune._CACHE.clear()


@pytest.fixture
def remat_log(caplog):
    """The `remat` logger's records (it does not propagate to the root logger)."""
    logger = logging.getLogger("remat")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def fresh_dynamo():
    """Each test compiles from scratch: past dynamo's recompile limit a model silently runs eager."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
