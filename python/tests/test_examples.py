"""The examples in python/examples train against the local cluster: the
loss falls."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support import Cluster

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_guides_session_runs_as_a_script(cluster):
    # docs/src/guides/python.md shows this file whole (the docs test checks
    # that it is the same).
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "session.py"), str(cluster.worker_config), Cluster.EMBEDDINGS],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("fetched (3, 16), pushed "), run.stdout
    # One line per server of the 2 x 2 cluster, each a health answer.
    assert len(lines) == 5 and all("'serving': True" in line for line in lines[1:]), run.stdout


def test_numpy_logistic_regression_learns(client):
    losses = load("logreg_numpy").train(client, Cluster.WIDE, steps=300, log_every=0)
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    # From zero weights the first step's loss is ln 2; the hidden model
    # allows far less.
    assert abs(losses[0] - np.log(2)) < 1e-4, losses[0]
    assert last < 0.8 * first, (first, last)


def test_torch_embedding_learns(client):
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("torch is not installed in this environment: the PyTorch example is not run "
                    "(pip install torch to run it)")
    losses = load("torch_embedding").train(client, Cluster.EMBEDDINGS, steps=200, log_every=0)
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    assert last < 0.85 * first, (first, last)
