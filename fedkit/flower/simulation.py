"""Flower's simulation runtime, driven from this process.

``SimulationLink`` starts ``flwr.simulation.run_simulation`` in a background thread with
``nodes`` virtual SuperNodes (``partition-id`` 0, 1, ...: the client each holds) and a
ServerApp whose only job is to hand its ``Grid`` to the ``flower`` executor and wait
until it is closed: fedkit's own engine stays in charge of the rounds. A link serves one
run after another (each run sets its nodes up anew), so tests start Flower once.
Flower runs the ClientApps on Ray actors (``engine.workers`` of them, ``engine.num_cpus``
each, torch at that many threads), on a Ray instance of the run's own unless
``engine.address`` names a cluster to join (``fedkit.core.ray_executor.init_options``:
Flower's backend gets the same ``init_args``), and keeps each node's ``Context.state`` between
messages, which is where the client's memory lives (``fedkit.flower.node``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

import ray
from flwr.serverapp import ServerApp
from flwr.simulation import run_simulation

from fedkit.config.schema import EngineConfig
from fedkit.core import ray_reaper
from fedkit.core.ray_executor import init_options
from fedkit.errors import FedkitError
from fedkit.flower.clientapp import make_app

START_TIMEOUT = 600.0
"""Seconds to wait for Flower's simulation to start and every node to register."""


class SimulationLink:
    """Flower's simulation in a thread, and its grid (see the module docstring)."""

    remote = False

    def __init__(self, nodes: int, engine: EngineConfig) -> None:

        os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
        logging.getLogger("flwr").setLevel(logging.ERROR)
        n = nodes
        workers = engine.workers or max(1, int((os.cpu_count() or 1) // engine.num_cpus))
        handed: queue.Queue[Any] = queue.Queue()
        self.done, self.failure = threading.Event(), None
        server = ServerApp()

        @server.main()
        def main(grid: Any, context: Any) -> None:
            handed.put(grid)
            self.done.wait()

        init = {**init_options(engine, workers), "log_to_driver": False}
        resources = {"num_cpus": engine.num_cpus, "num_gpus": engine.num_gpus}
        config = {"client_resources": resources, "init_args": init}

        self.reaper = None
        if not ray.is_initialized():  # here, in the calling thread, and quietly
            if engine.address is None:  # a Ray of our own: its processes end with us
                self.reaper = ray_reaper.watch()
            ray.init(**init, logging_level=logging.ERROR)

        def simulate() -> None:
            try:
                run_simulation(server, make_app(), n, backend_config=config)
            except BaseException as exc:  # noqa: BLE001 - reported to the waiting engine
                self.failure = exc
                handed.put(None)

        self.thread = threading.Thread(target=simulate, name="flower-simulation", daemon=True)
        self.thread.start()
        self.grid = handed.get(timeout=START_TIMEOUT)
        if self.grid is None:
            raise FedkitError(f"Flower's simulation did not start: {self.failure}")
        deadline = time.monotonic() + START_TIMEOUT
        while len(list(self.grid.get_node_ids())) < n:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise FedkitError(f"Flower's simulation registered fewer than {n} nodes")
            time.sleep(0.05)

    def close(self) -> None:
        """Let the ServerApp return; Flower then stops its nodes and Ray."""
        self.done.set()
        self.thread.join(timeout=120)
        ray_reaper.stop(self.reaper)
