"""A test body run on several gloo processes on loopback (CPU), with every rank's traceback
reported on failure."""
from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(body: Callable[[int], None], world: int, tmp_path) -> None:
    """``body(rank)`` on ``world`` spawned processes in one gloo group (file rendezvous in
    ``tmp_path``; ``body`` a module-level function, pickled by name)."""
    init_file, errors = str(tmp_path / "rendezvous"), str(tmp_path / "errors")
    try:
        mp.spawn(_worker, args=(body, world, init_file, errors), nprocs=world, join=True)
    except Exception as error:  # noqa: BLE001 - show the workers' own tracebacks
        reports = [open(f"{errors}.{r}").read() for r in range(world)
                   if os.path.exists(f"{errors}.{r}")]
        pytest.fail("\n".join(reports) or str(error))


def _worker(rank: int, body: Callable[[int], None], world: int, init_file: str,
            errors: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        body(rank)
        dist.barrier()  # every rank done before the teardown: gloo aborts on a peer gone early
    except BaseException:
        with open(f"{errors}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # no interpreter teardown: a gloo thread destroyed there still joinable aborted a worker
    # ("terminate called without an active exception", SIGABRT) in 1 of about 40 runs
    os._exit(0)
